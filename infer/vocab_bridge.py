"""A draft model with another tokenizer than the target's (``use_heterogeneous_vocab``).

vLLM's rule (2026; the token-level intersection of Timor et al., ICML 2025): the two vocabularies
are intersected as strings, after the word-start markers are made one (SentencePiece's ``▁`` is
byte-level BPE's ``Ġ``). The draft then only ever proposes tokens of the intersection (its
logits elsewhere are -inf) and each drafted id is mapped to the target's id of the same string;
the target's tokens reach the draft through the inverse map, a token outside the intersection as
the draft's unknown token (or id 0). Drafts are greedy (argmax over the intersection) and carry
no distribution, so the rejection sampler treats each as a point mass: lossless at every
temperature, as with any greedy draft. What it costs is acceptance: a string the target spells
as one token and the draft as several can never be drafted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_WORD_START = {"▁": "Ġ"}  # SentencePiece -> byte-level BPE


def normalise(token: str) -> str:
    """One spelling of a vocabulary entry for both tokenizers (word-start markers made one)."""
    for marker, canonical in _WORD_START.items():
        token = token.replace(marker, canonical)
    return token


@dataclass
class VocabBridge:
    """``to_target [V_draft]``: the target id of each draft id (-1 outside the intersection);
    ``to_draft [V_target]``: the draft id of each target id (``fallback`` outside it);
    ``allowed [V_draft]``: the intersection. All on the engine's device but ``to_draft``, a
    host list (the draft's inputs are built on the host)."""

    to_target: torch.Tensor
    to_draft: list[int]
    allowed: torch.Tensor

    @classmethod
    def build(cls, draft_tokenizer: Any, target_tokenizer: Any, draft_vocab: int,
              target_vocab: int, device: torch.device) -> "VocabBridge":
        """The intersection of two tokenizers' vocabularies (ids past a model's ``vocab``, a
        tokenizer's added tokens beyond its embedding, are left out)."""
        draft = _by_string(draft_tokenizer, draft_vocab)
        target = _by_string(target_tokenizer, target_vocab)
        fallback = draft_tokenizer.unk_token_id
        fallback = fallback if isinstance(fallback, int) and fallback < draft_vocab else 0
        to_target = torch.full((draft_vocab,), -1, dtype=torch.long)
        to_draft = [fallback] * target_vocab
        for text in draft.keys() & target.keys():
            to_target[draft[text]] = target[text]
            to_draft[target[text]] = draft[text]
        return cls(to_target.to(device), to_draft, (to_target >= 0).to(device))

    @property
    def size(self) -> int:
        """Tokens in the intersection."""
        return int(self.allowed.sum())

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft ``logits [..., V_draft]`` with every token outside the intersection at -inf."""
        return logits.masked_fill(~self.allowed, float("-inf"))

    def draft_ids(self, target_ids: list[int]) -> list[int]:
        """Target token ids as the draft reads them."""
        return [self.to_draft[t] for t in target_ids]


def _by_string(tokenizer: Any, vocab: int) -> dict[str, int]:
    """``{normalised string: id}``, the lowest id where two entries normalise alike."""
    out: dict[str, int] = {}
    for text, i in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        if i < vocab:
            out.setdefault(normalise(text), i)
    return out
