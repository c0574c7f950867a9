"""Chat prompt sets that exist offline, for a real instruct target (SmolLM2): one to train on,
one to evaluate on, of different origins so that evaluation measures what a drafter learnt
about the target's answers rather than about the prompts' wording.

- ``draftsmith:chat-train``: instructions built deterministically from templates over subject
  lists (explanations, lists and how-tos, comparisons, creative writing, short programs,
  advice, recipes, travel, troubleshooting, short emails, arithmetic). Each record is one user
  message and an empty assistant turn: the target writes the answers
  (``regenerate.enabled``), so the drafter learns the target's own distribution, as the
  EAGLE-3 recipes do.
- ``draftsmith:chat-heldout``: questions written by hand for evaluation, in the phrasing of a
  person asking an assistant; none of them is a training prompt, nor a template away from one
  (tests/infer/eval/test_chat_prompts.py).

Both are read through :func:`infer.data_sources.load_source` (``data.source=`` /
``eval.dataset=``), so they go through exactly the code path of a user's own dataset.
"""

from __future__ import annotations

import random
from typing import Callable

SCIENCE = ("photosynthesis", "gravity", "black holes", "DNA", "the water cycle", "volcanoes",
           "magnetism", "static electricity", "atoms", "evolution", "climate change",
           "vaccines", "the immune system", "plate tectonics", "rainbows", "ocean tides",
           "earthquakes", "the greenhouse effect", "friction", "sound waves", "the speed of light",
           "the periodic table", "cells", "bacteria", "viruses", "the solar system",
           "the phases of the moon", "the seasons", "chemical reactions", "nuclear energy",
           "the human heart", "the nervous system", "erosion", "clouds", "lightning",
           "fossils", "the Big Bang", "entropy", "osmosis", "genes")
TECHNOLOGY = ("the internet", "machine learning", "blockchain", "cloud computing", "smartphones",
              "encryption", "databases", "operating systems", "GPS", "lithium-ion batteries",
              "solar panels", "electric cars", "3D printing", "industrial robots", "compilers",
              "search engines", "Wi-Fi", "email", "password managers", "open-source software",
              "virtual reality", "microchips", "web browsers", "video compression",
              "social media algorithms", "QR codes", "barcodes", "touch screens")
HISTORY = ("the Roman Empire", "the printing press", "the Industrial Revolution",
           "ancient Egypt", "the French Revolution", "the Renaissance", "the Silk Road",
           "the Cold War", "the first moon landing", "the invention of the telephone",
           "the Great Wall of China", "the Vikings", "the ancient Olympic Games",
           "the Aztec Empire", "the invention of writing", "the Black Death",
           "the age of exploration", "the history of chess", "the first airplanes",
           "the fall of the Berlin Wall", "ancient Greek democracy", "the samurai")
ACTIVITIES = ("cooking rice", "saving money", "learning a new language", "public speaking",
              "managing time", "writing a resume", "studying for exams", "training for a 10k run",
              "starting a vegetable garden", "meditating", "making new friends",
              "preparing for a job interview", "traveling on a budget", "sleeping better",
              "reducing stress", "keeping a journal", "baking bread", "cleaning a kitchen",
              "organizing a closet", "learning to play the guitar", "taking better photos",
              "reading more books", "drinking more water", "working from home",
              "caring for a houseplant", "learning to swim", "writing a blog", "hosting a dinner")
NATURE = ("dolphins", "honeybees", "elephants", "penguins", "octopuses", "rainforests",
          "deserts", "coral reefs", "rivers", "mountains", "owls", "wolves", "butterflies",
          "whales", "ants", "sunflowers", "oak trees", "mushrooms", "the Arctic", "wetlands")
CULTURE = ("jazz music", "poetry", "oil painting", "photography", "chess", "soccer",
           "theater", "novels", "origami", "ballet", "classical music", "comic books",
           "architecture", "film festivals", "board games", "street art", "opera", "tea")
IMAGERY = ("friendship", "courage", "autumn leaves", "the ocean at night", "a rainy day",
           "a city at dawn", "childhood", "a lost key", "a curious robot", "a sleepy dragon",
           "a lighthouse", "a journey to Mars", "a small village", "a snowy mountain",
           "an old library", "a summer storm", "a forgotten garden", "the first day of school",
           "a train ride", "a cup of coffee", "the stars", "a grandmother's kitchen")
CODE_TASKS = ("reverses a string", "checks whether a number is prime",
              "computes the factorial of n", "counts the vowels in a string",
              "finds the largest number in a list", "removes duplicates from a list",
              "checks whether a word is a palindrome", "returns the n-th Fibonacci number",
              "converts Celsius to Fahrenheit", "sums the digits of an integer",
              "merges two sorted lists", "counts the words in a sentence",
              "finds the second smallest element of a list", "flattens a nested list",
              "capitalizes the first letter of every word", "computes the average of a list")
GOALS = ("be more productive in the morning", "stop procrastinating", "eat healthier",
         "get better at math", "improve my handwriting", "become a better listener",
         "stay motivated while exercising", "remember names better", "spend less time on my phone",
         "write clearer emails", "negotiate a higher salary", "prepare for a long flight",
         "make my apartment feel cozier", "keep my plants alive", "learn to cook quickly")

FOODS = ("lasagna", "sushi", "a vegetable soup", "banana bread", "a fruit salad",
         "tacos", "chocolate chip cookies", "a green smoothie", "roast chicken", "fried rice",
         "hummus", "an omelette", "pizza dough", "lemonade", "apple pie", "guacamole",
         "a lentil curry", "mashed potatoes", "granola")
PLACES = ("Paris", "Tokyo", "New York", "the Grand Canyon", "Iceland", "Kenya", "Peru", "Sydney",
          "Venice", "the Sahara", "the Canadian Rockies", "Barcelona", "Istanbul",
          "the Amazon rainforest", "Kyoto", "Scotland", "Morocco", "New Zealand")
PROBLEMS = ("my phone battery drains quickly", "my bread does not rise",
            "my houseplant is wilting", "I cannot fall asleep", "my code throws an index error",
            "my bike chain keeps slipping", "my coffee tastes bitter", "my dog barks at night",
            "I feel tired after lunch", "my email inbox is overflowing",
            "my car makes a squeaking noise", "my sourdough is too sour",
            "my cat scratches the sofa", "my Wi-Fi keeps disconnecting",
            "my shoes give me blisters", "my rice comes out sticky")
RECIPIENTS = ("my manager", "a teacher", "my landlord", "a friend", "a customer", "my team",
              "a neighbor", "my grandmother")
ABOUTS = ("a schedule change", "a late delivery", "a birthday party", "a project update",
          "a broken heater", "a new idea", "a canceled meeting", "a thank-you for their help")

TOPICS = SCIENCE + TECHNOLOGY + HISTORY + NATURE + CULTURE
EXPLAIN = ("Explain {t} in simple terms.", "What is {t}?", "How does {t} work?",
           "Why is {t} important?", "Give me a short overview of {t}.",
           "Can you describe {t} to a ten-year-old?", "Tell me about {t}.",
           "Summarize what is known about {t} in three sentences.",
           "List five interesting facts about {t}.", "What are the main ideas behind {t}?",
           "Write a short paragraph about {t}.", "What are common misconceptions about {t}?")
HOWTO = ("Give me three tips for {a}.", "What are common mistakes when {a}?",
         "How do I get started with {a}?", "Write a step-by-step guide to {a}.",
         "What should a beginner know about {a}?", "Why is {a} worth the effort?")
COMPARE = ("What is the difference between {t} and {u}?", "Compare {t} and {u}.",
           "What do {t} and {u} have in common?")
CREATIVE = ("Write a short poem about {i}.", "Write a short story about {i}.",
            "Write a haiku about {i}.", "Describe {i} in a few vivid sentences.",
            "Write a letter to a friend about {i}.", "Write the opening of a fairy tale about {i}.")
CODE = ("Write a Python function that {c}.", "Show me how to write a function that {c}.",
        "Write a JavaScript function that {c}.")
RECIPE = ("What is a good way to cook {f} for beginners?", "How do I make {f}?",
          "What ingredients do I need for {f}?")
TRAVEL = ("Plan a two-day visit to {p}.", "What should I see in {p}?",
          "What is the best time of year to visit {p}?", "Tell me about the food in {p}.")
TROUBLE = ("{p}. What could be wrong?", "{p}. How can I fix it?", "{p}. Any advice?")
EMAIL = ("Write a short email to {r} about {a}.", "Write a polite message to {r} about {a}.")
ADVICE = ("How can I {g}?", "I want to {g}. Where should I start?",
          "What are some practical ways to {g}?")


def _explain(rng: random.Random) -> str:
    return rng.choice(EXPLAIN).format(t=rng.choice(TOPICS))


def _howto(rng: random.Random) -> str:
    return rng.choice(HOWTO).format(a=rng.choice(ACTIVITIES))


def _compare(rng: random.Random) -> str:
    group = rng.choice((SCIENCE, TECHNOLOGY, HISTORY, NATURE, CULTURE))
    t, u = rng.sample(group, 2)
    return rng.choice(COMPARE).format(t=t, u=u)


def _creative(rng: random.Random) -> str:
    return rng.choice(CREATIVE).format(i=rng.choice(IMAGERY))


def _code(rng: random.Random) -> str:
    return rng.choice(CODE).format(c=rng.choice(CODE_TASKS))


def _advice(rng: random.Random) -> str:
    return rng.choice(ADVICE).format(g=rng.choice(GOALS))


def _recipe(rng: random.Random) -> str:
    return rng.choice(RECIPE).format(f=rng.choice(FOODS))


def _travel(rng: random.Random) -> str:
    return rng.choice(TRAVEL).format(p=rng.choice(PLACES))


def _trouble(rng: random.Random) -> str:
    problem = rng.choice(PROBLEMS)
    return rng.choice(TROUBLE).format(p=problem[0].upper() + problem[1:])


def _email(rng: random.Random) -> str:
    return rng.choice(EMAIL).format(r=rng.choice(RECIPIENTS), a=rng.choice(ABOUTS))


def _arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    return rng.choice((f"What is {a} plus {b}?", f"What is {a} times {b}?",
                       f"If I have {a + b} apples and give away {b}, how many are left?",
                       f"Convert {a} kilometers to miles.",
                       f"A train travels {a} km in {max(b // 10, 1)} hours. What is its speed?"))


# kind -> (builder, weight): explanations dominate, as in general chat data
KINDS: dict[str, tuple[Callable[[random.Random], str], int]] = {
    "explain": (_explain, 8), "howto": (_howto, 4), "compare": (_compare, 2),
    "creative": (_creative, 3), "code": (_code, 2), "advice": (_advice, 2),
    "recipe": (_recipe, 2), "travel": (_travel, 2), "trouble": (_trouble, 2),
    "email": (_email, 2), "arithmetic": (_arithmetic, 1)}


def training_prompts(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` distinct ``(kind, prompt)`` pairs, deterministic for ``seed``."""
    rng = random.Random(seed)
    names = list(KINDS)
    weights = [KINDS[k][1] for k in names]
    seen: set[str] = set()
    out: list[tuple[str, str]] = []
    for _ in range(50 * n):  # the space holds ~10k distinct prompts; stop early when exhausted
        if len(out) >= n:
            break
        kind = rng.choices(names, weights)[0]
        prompt = KINDS[kind][0](rng)
        if prompt not in seen and prompt not in HELDOUT_SET:
            seen.add(prompt)
            out.append((kind, prompt))
    return out


HELDOUT = (
    "My tomato plants have yellow leaves. What could be wrong?",
    "Can you help me plan a three-day trip to Rome?",
    "What should I pack for a weekend of camping?",
    "Why do cats purr?",
    "How do airplanes stay in the air?",
    "Write a limerick about a forgetful wizard.",
    "What's a good way to explain recursion to someone new to programming?",
    "Suggest a name for a bakery that only sells pies.",
    "I keep waking up at 3 am. Any advice?",
    "Is it better to rent or buy a house?",
    "How long should I boil an egg for a soft yolk?",
    "Write a thank-you note to my neighbor who watered my plants.",
    "What causes hiccups?",
    "Can you recommend some books for someone who liked The Hobbit?",
    "Explain the rules of basketball briefly.",
    "What are the health benefits of walking every day?",
    "Why is the sky blue?",
    "How do I make a good first impression at a new job?",
    "Write a short speech for my sister's wedding.",
    "What is the best way to memorize a poem?",
    "How does a refrigerator keep food cold?",
    "My laptop is running slowly. What can I do?",
    "What's the difference between weather and climate?",
    "Give me a simple recipe for pancakes.",
    "Why do leaves change color in the fall?",
    "How can I teach my dog to sit?",
    "Write a story about a cat who wants to fly.",
    "What should I consider when buying a used car?",
    "How do vaccines train the body to fight disease?",
    "Can you explain what inflation is and why prices go up?",
    "What are some fun things to do on a rainy weekend?",
    "How do I write a good cover letter?",
    "Why do we dream?",
    "Describe a sunset over the desert.",
    "What is the tallest mountain in the world, and how tall is it?",
    "How can I be more patient with my kids?",
    "Write a Python program that prints the multiplication table of 7.",
    "What makes a good password?",
    "Why do onions make people cry?",
    "Tell me a fun fact about space.",
    "How do bees make honey?",
    "What is a healthy breakfast I can make in five minutes?",
    "Should I learn Spanish or French first?",
    "Explain how a bill becomes a law in simple words.",
    "Write a poem about the smell of fresh bread.",
    "How do I politely decline an invitation?",
    "What happens to our body when we exercise?",
    "Why is it important to recycle plastic?",
    "How do I start learning to draw?",
    "What was life like for children in medieval times?",
    "What is the Pythagorean theorem used for?",
    "Give me ideas for a birthday party for a seven-year-old.",
    "How do submarines dive and come back up?",
    "Write a motivational message for a friend starting college.",
    "What are the signs that I need new running shoes?",
    "How do noise-cancelling headphones work?",
    "Why do we have leap years?",
    "What is the best way to store fresh herbs?",
    "Can you write a short mystery story set on a train?",
    "How can I save energy at home during winter?",
    "What are black holes made of?",
    "Explain the difference between a virus and bacteria to a child.",
    "What should I do if I feel nervous before an exam?",
    "How do I keep a conversation going with someone I just met?",
)
HELDOUT_SET = frozenset(HELDOUT)


def train_records(n: int = 4000, seed: int = 0) -> list[dict]:
    """The training set: one user turn and an empty answer for the target to write."""
    return [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": ""}],
             "kind": kind} for kind, p in training_prompts(n, seed)]


def heldout_records() -> list[dict]:
    """The evaluation set: one user turn each (the generation prompt is added at render)."""
    return [{"messages": [{"role": "user", "content": q}], "kind": "handwritten"}
            for q in HELDOUT]


BUILTIN_SETS: dict[str, Callable[[], list[dict]]] = {
    "chat-train": train_records, "chat-heldout": heldout_records}
