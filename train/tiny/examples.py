"""The embedded default's data: prompt / completion pairs cut from the tiny target's training
files, and code-prefix prompts from its held-out files (both entry points use them)."""

from __future__ import annotations

import random
from pathlib import Path

import datasets

from train.tiny.corpus import code_chat_pairs, read_texts, stdlib_corpus, stdlib_root


def _sample_pairs(texts: list[str], n: int, seed: int, prompt_chars: tuple[int, int],
                  completion_chars: tuple[int, int]) -> list[tuple[str, str]]:
    """``n`` (code prefix, continuation) pairs from files picked in proportion to their size."""
    rng = random.Random(seed)
    cum, total = [], 0
    for t in texts:
        total += len(t)
        cum.append(total)
    pairs: list[tuple[str, str]] = []
    for _ in range(20 * n + 100):
        if len(pairs) == n or total == 0:
            break
        text = rng.choices(texts, cum_weights=cum)[0]
        pairs += code_chat_pairs(text, rng, 1, prompt_chars, completion_chars)
    if len(pairs) < n:
        raise ValueError(f"corpus too small: only {len(pairs)} of {n} prompt/completion pairs "
                         f"could be cut from {len(texts)} files")
    return pairs


def _corpus_texts(root: str | Path | None, corpus_seed: int, heldout_fraction: float,
                  heldout: bool) -> list[str]:
    root = Path(root) if root else stdlib_root()
    train, held = stdlib_corpus(corpus_seed, heldout_fraction, root)
    return read_texts(root, held if heldout else train)


def build_default_dataset(num_examples: int = 2000, *, seed: int = 0,
                          prompt_chars: tuple[int, int] = (200, 800),
                          completion_chars: tuple[int, int] = (100, 500),
                          root: str | Path | None = None, corpus_seed: int = 0,
                          heldout_fraction: float = 0.1) -> datasets.Dataset:
    """The embedded default: ``prompt`` (code prefix) / ``completion`` (the lines that follow).

    Cut from the tiny target's TRAIN files (``stdlib_corpus``; ``corpus_seed`` and
    ``heldout_fraction`` must match the target's build so held-out files stay unseen), at line
    boundaries, deterministically for a given ``seed``. The completions are the real source
    continuations; the pipeline may regenerate them with the target (self-distillation).
    """
    texts = _corpus_texts(root, corpus_seed, heldout_fraction, heldout=False)
    pairs = _sample_pairs(texts, num_examples, seed, prompt_chars, completion_chars)
    return datasets.Dataset.from_dict({"prompt": [p for p, _ in pairs],
                                       "completion": [c for _, c in pairs]})


def heldout_prompts(n: int, seed: int = 0, *, prompt_chars: tuple[int, int] = (200, 800),
                    root: str | Path | None = None, corpus_seed: int = 0,
                    heldout_fraction: float = 0.1) -> list[str]:
    """``n`` code-prefix prompts from the HELD-OUT files, for acceptance evaluation.

    Plain strings: callers send each as one user message through the chat template.
    """
    texts = _corpus_texts(root, corpus_seed, heldout_fraction, heldout=True)
    return [p for p, _ in _sample_pairs(texts, n, seed, prompt_chars, (1, 200))]
