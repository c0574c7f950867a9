"""The embedded default target: a tiny Llama code model trained on the Python standard library.

No model can be downloaded on a CI machine or an air-gapped laptop, yet every acceptance number
needs a target with real structure. The standard library's own ``.py`` files exist wherever Python
does, so draftsmith trains its default target (and a smaller draft LM with the same tokenizer) on
them, split by file into train and held-out sets, and saves normal Hugging Face model directories.

This module holds the pieces other modules rely on (the chat template, the tokenizer, the corpus
split, the cache location, the training / held-out token streams); the builder that trains and
caches the models is ``train/tiny/build.py`` (``ensure_tiny_target``, ``build_tiny_target``).
"""

from __future__ import annotations

import os
import random
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|end|>"  # ends an assistant turn; what generation stops on
DOC_TOKEN = "<|endoftext|>"  # separates raw documents; also the pad token
SPECIAL_TOKENS = [DOC_TOKEN, EOS_TOKEN, "<|system|>", "<|user|>", "<|assistant|>"]

# One role header per turn, every turn closed by <|end|>. The generation prompt opens an
# assistant turn. Used for prompt/completion pairs built from code: the user turn is a code
# prefix, the assistant turn its continuation.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


# Left out of the corpus: tests (repetitive), site-packages (differs per machine), and code that
# is data or boilerplate rather than the code users write: codec tables (``encodings``, 13 % of
# the stdlib's bytes), pydoc's help-text dump (7 %), Tk wrappers (``self.tk.call(...)`` over and
# over, which taught the earlier targets to loop), the turtle demos and the HTML entity table.
SKIP_PARTS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib",
                        "__pycache__", "encodings", "pydoc_data", "tkinter", "turtledemo"})
SKIP_FILES = frozenset({"html/entities.py"})


def stdlib_corpus(seed: int = 0, heldout_fraction: float = 0.1,
                  root: Path | None = None) -> tuple[list[str], list[str]]:
    """Split the standard library's ``.py`` files (relative paths, sorted) into train / held-out.

    ``SKIP_PARTS`` and ``SKIP_FILES`` are left out (see there). The split is by file, so held-out
    code was never seen in training.
    """
    root = root or stdlib_root()
    files = sorted(
        str(rel) for rel in (p.relative_to(root) for p in root.rglob("*.py"))
        if not any(part in SKIP_PARTS for part in rel.parts) and rel.as_posix() not in SKIP_FILES
    )
    if not files:
        raise FileNotFoundError(f"no .py files found under the standard library at {root}")
    rng = random.Random(seed)
    shuffled = files[:]
    rng.shuffle(shuffled)
    n_held = max(1, int(len(files) * heldout_fraction))
    return sorted(shuffled[n_held:]), sorted(shuffled[:n_held])


def train_tokenizer(texts: list[str], vocab_size: int = 4096) -> PreTrainedTokenizerFast:
    """Byte-level BPE over ``texts`` with draftsmith's special tokens and chat template.

    Every newline is a token of its own, never merged with the next line's indentation: a prompt
    that ends at a line end (a code prefix, or the template's ``<|assistant|>\n``) then tokenizes
    exactly as it does inside the full text, so generation does not start from a token boundary
    never seen in training (with ``"\n" + indent`` tokens the first token after such a prompt was
    an unindented ``class``/``def``).
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n", behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=DOC_TOKEN, unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[2:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def capped_corpus(root: Path, seed: int = 0, heldout_fraction: float = 0.1,
                  max_files: int | None = None) -> tuple[list[str], list[str]]:
    """``stdlib_corpus`` with at most ``max_files`` train files (held-out scaled alike), by seed."""
    train, held = stdlib_corpus(seed, heldout_fraction, root)
    if max_files is not None:
        rng = random.Random(seed)
        n_held = max(1, round(max_files * len(held) / max(1, len(train))))
        train = sorted(rng.sample(train, min(max_files, len(train))))
        held = sorted(rng.sample(held, min(n_held, len(held))))
    return train, held


def sample_prompt(texts: list[str], seed: int = 0) -> str:
    """A function signature with its docstring from ``texts`` (a model writes the body)."""
    candidates = []
    for text in texts:
        lines = text.splitlines(keepends=True)
        for i, line in enumerate(lines[:-1]):
            if line.lstrip().startswith("def ") and line.rstrip().endswith(":") \
                    and lines[i + 1].strip().startswith('"""'):
                end = next((j for j in range(i + 1, min(i + 12, len(lines)))
                            if lines[j].rstrip().endswith('"""')
                            and (j > i + 1 or lines[j].strip().count('"""') == 2)), None)
                if end is not None:
                    candidates.append("".join(lines[i:end + 1]))
    if not candidates:  # a corpus without documented functions: the start of a file
        return "".join(next(t for t in texts if t.strip()).splitlines(keepends=True)[:5])
    return random.Random(seed).choice(candidates)


# ----------------------------------------------------------------------------- cache location

CACHE_ENV = "DRAFTSMITH_CACHE"


def default_cache_dir() -> Path:
    """``$DRAFTSMITH_CACHE``, else ``$XDG_CACHE_HOME/draftsmith``, else ``~/.cache/draftsmith``.

    Read at call time (not import time), so tests and users can point it elsewhere.
    """
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "draftsmith"


def default_target_dir() -> Path:
    return default_cache_dir() / "tiny-target"


def default_draft_dir() -> Path:
    return default_cache_dir() / "tiny-draft"


def paired_draft_dir(target_dir: Path) -> Path:
    """Where the draft LM of ``target_dir`` lives by default: ``<cache>/tiny-draft`` beside the
    default target, ``<target_dir>-draft`` beside any other (never another target's draft)."""
    target_dir = Path(target_dir)
    if target_dir.expanduser().resolve() == default_target_dir().expanduser().resolve():
        return default_draft_dir()
    return target_dir.with_name(target_dir.name + "-draft")


def existing_paired_draft(target_dir: str | Path | None) -> Path | None:
    """``paired_draft_dir(target_dir)`` when a model is there (None when not, or no target)."""
    if target_dir is None:
        return None
    draft = paired_draft_dir(Path(target_dir))
    return draft if (draft / "config.json").is_file() else None


# ----------------------------------------------------------------------------- token streams

def read_texts(root: Path, files: list[str]) -> list[str]:
    """File contents in ``files`` order (undecodable bytes replaced, so every file reads)."""
    return [(root / f).read_text(encoding="utf-8", errors="replace") for f in files]


def code_chat_pairs(text: str, rng: random.Random, n: int,
                    prompt_chars: tuple[int, int] = (200, 800),
                    completion_chars: tuple[int, int] = (100, 500)) -> list[tuple[str, str]]:
    """Up to ``n`` (code prefix, continuation) pairs cut from ``text`` at line boundaries.

    The same shape as the embedded default training dataset: the prompt is a run of source lines,
    the completion the lines that follow it. Trailing newlines are dropped, as chat messages do,
    so ``<|end|>`` never competes with the next line of code after a newline (which made raw
    greedy continuations stop at the first line end).
    """
    lines = text.splitlines(keepends=True)
    pairs: list[tuple[str, str]] = []
    for _ in range(n):
        if len(lines) < 4:
            break
        i = rng.randrange(len(lines) - 2)
        want_p, want_c = rng.randint(*prompt_chars), rng.randint(*completion_chars)
        j, got = i, 0
        while j < len(lines) - 1 and got < want_p:
            got += len(lines[j])
            j += 1
        k, got = j, 0
        while k < len(lines) and got < want_c:
            got += len(lines[k])
            k += 1
        prompt, completion = "".join(lines[i:j]).rstrip("\n"), "".join(lines[j:k]).rstrip("\n")
        if prompt.strip() and completion.strip():
            pairs.append((prompt, completion))
    return pairs


def training_documents(tokenizer: PreTrainedTokenizerFast, texts: list[str], seed: int,
                       chat_fraction: float = 0.35) -> list[str]:
    """Raw files plus chat-formatted prefix -> continuation examples, in a seeded order.

    About ``chat_fraction`` of the characters are chat examples rendered with the chat template
    (user turn: code prefix, assistant turn: its continuation), so the model learns the template.
    """
    rng = random.Random(seed)
    docs = list(texts)
    per_char = chat_fraction / max(1e-9, 1.0 - chat_fraction) / 800.0  # ~800 chars per example
    for text in texts:
        expected = len(text) * per_char
        n = int(expected) + (rng.random() < expected - int(expected))
        for prompt, completion in code_chat_pairs(text, rng, n):
            messages = [{"role": "user", "content": prompt},
                        {"role": "assistant", "content": completion}]
            docs.append(tokenizer.apply_chat_template(messages, tokenize=False))
    rng.shuffle(docs)
    return docs


def pack_documents(tokenizer: PreTrainedTokenizerFast, docs: list[str],
                   seq_len: int) -> torch.Tensor:
    """Encode ``docs``, join them with ``<|endoftext|>`` and cut into full rows.  # [rows, seq_len]

    Special-token strings inside a document (the chat renders) become their single tokens.
    """
    sep = tokenizer.convert_tokens_to_ids(DOC_TOKEN)
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(sep)
    n_rows = len(ids) // seq_len
    if n_rows == 0:
        raise ValueError(f"corpus too small: {len(ids)} tokens, need at least seq_len={seq_len}")
    return torch.tensor(ids[: n_rows * seq_len], dtype=torch.long).view(n_rows, seq_len)


def heldout_rows(tokenizer: PreTrainedTokenizerFast, texts: list[str], seq_len: int,
                 num_rows: int) -> torch.Tensor:
    """The fixed held-out sample: ``num_rows`` rows spread evenly over the packed held-out files."""
    rows = pack_documents(tokenizer, texts, seq_len)  # [all_rows, seq_len]
    if len(rows) <= num_rows:
        return rows
    return rows[torch.linspace(0, len(rows) - 1, num_rows).round().long()]


@dataclass
class TinyData:
    """Everything a tiny-LM build trains and evaluates on."""

    root: Path
    train_files: list[str]
    heldout_files: list[str]
    train_rows: torch.Tensor  # [rows, seq_len]
    eval_rows: torch.Tensor  # [eval_rows, seq_len]
    sample_prompt: str
    seconds: float  # time it took to prepare


def prepare_data(tokenizer: PreTrainedTokenizerFast, root: Path, train_files: list[str],
                 heldout_files: list[str], *, seed: int, chat_fraction: float, seq_len: int,
                 eval_rows: int, train_texts: list[str] | None = None) -> TinyData:
    """Packed training rows (raw code + chat examples), the fixed held-out sample, a prompt."""
    t0 = time.monotonic()
    train_texts = train_texts if train_texts is not None else read_texts(root, train_files)
    held_texts = read_texts(root, heldout_files)
    docs = training_documents(tokenizer, train_texts, seed, chat_fraction)
    return TinyData(
        root=root, train_files=train_files, heldout_files=heldout_files,
        train_rows=pack_documents(tokenizer, docs, seq_len),
        eval_rows=heldout_rows(tokenizer, held_texts, seq_len, eval_rows),
        sample_prompt=sample_prompt(held_texts, seed), seconds=time.monotonic() - t0)
