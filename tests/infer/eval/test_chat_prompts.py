"""The offline chat prompt sets (infer/eval/chat_prompts.py) through the shared dataset reader."""

import re
from collections import Counter

import pytest

from infer.data_sources import load_source
from infer.foundation.errors import MissingFileError
from infer.eval import chat_prompts as cp
from infer.eval.prompt_sets import load_prompts


def test_training_prompts_are_deterministic_distinct_and_mixed():
    a, b = cp.training_prompts(1500, seed=0), cp.training_prompts(1500, seed=0)
    assert a == b and a != cp.training_prompts(1500, seed=1)
    prompts = [p for _, p in a]
    assert len(set(prompts)) == len(prompts) == 1500
    kinds = Counter(k for k, _ in a)
    assert set(kinds) == set(cp.KINDS)
    assert kinds["explain"] > kinds["arithmetic"]  # the weights show through


def test_heldout_questions_are_disjoint_from_any_training_prompt():
    held = set(cp.HELDOUT)
    assert len(held) == len(cp.HELDOUT) >= 64  # batch 8 x 8 requests per slot
    for seed in range(3):
        assert not held & {p for _, p in cp.training_prompts(3000, seed=seed)}


def test_no_heldout_question_is_a_template_away_from_a_training_prompt():
    """Of another origin: no training prompt shares 70 % of a held-out question's words."""
    def words(text):
        return set(re.findall(r"[a-z0-9]+", text.lower()))

    train = [words(p) for _, p in cp.training_prompts(4000, seed=0)]
    for question in cp.HELDOUT:
        q = words(question)
        assert max(len(q & t) / len(q | t) for t in train) < 0.7, question


def test_builtin_sets_load_through_the_shared_reader():
    train = load_source("draftsmith:chat-train")
    assert len(train) == 4000
    first = train[0]["messages"]
    assert [m["role"] for m in first] == ["user", "assistant"] and first[1]["content"] == ""
    held = load_source("draftsmith:chat-heldout")
    assert [r["messages"][0]["content"] for r in held] == list(cp.HELDOUT)


def test_heldout_prompts_render_through_a_chat_template(tiny_gguf):
    from transformers import AutoTokenizer

    path = tiny_gguf[0]
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    prompts = load_prompts("draftsmith:chat-heldout", num=3, tokenizer=tokenizer)
    assert len(prompts) == 3
    for question, prompt in zip(cp.HELDOUT, prompts):
        assert prompt.endswith(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


def test_unknown_builtin_set_names_the_ones_there_are():
    with pytest.raises(MissingFileError, match="draftsmith:chat-train, draftsmith:chat-heldout"):
        load_source("draftsmith:chat-nope")
