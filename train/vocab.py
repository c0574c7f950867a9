"""Draft vocabulary (EAGLE-3 ``d2t`` / ``t2d``) from loss-masked token frequencies.

A drafter's LM head can cover only the ``N`` target tokens that matter: the most frequent
tokens among the tokens it is trained to predict, i.e. those with ``loss_mask == 1`` (assistant
answers; prompts and templates are never predicted, so they are not counted).

Selection: the top ``N`` by count, ties broken by the smaller token id, then sorted ascending.
When fewer than ``N`` distinct tokens were seen, the rest is filled with the lowest-id unseen
tokens (the same tie rule applied to count 0), so the vocabulary always has exactly ``N``
entries and the fill is deterministic.

Encoding (the speculators / vLLM convention, docs/reference.md §4)::

    d2t  int64 [N]             d2t[i] = target_id(i) - i   (non-decreasing: ids are sorted)
    t2d  bool  [target_vocab]  True where the target token is in the draft vocabulary

Stored as ``draft_vocab.safetensors`` (``d2t``, ``t2d``, ``counts``) next to the processed data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from infer.foundation.atomic import atomic_file

VOCAB_FILE = "draft_vocab.safetensors"


@dataclass
class DraftVocab:
    d2t: torch.Tensor     # int64 [N]: draft id i -> target id i + d2t[i]
    t2d: torch.Tensor     # bool [target_vocab]
    counts: torch.Tensor  # int64 [target_vocab]: loss-masked occurrences of each target token
    # target id -> draft id (-1 outside) per device, built on first use: the EAGLE-3 objective
    # looks its targets up every training step
    _to_draft: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.numel())

    @property
    def target_vocab_size(self) -> int:
        return int(self.t2d.numel())

    def target_ids(self) -> torch.Tensor:
        """int64 [N]: the target id of every draft id, ascending."""
        return self.d2t + torch.arange(self.draft_vocab_size, dtype=torch.long)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids (any shape) -> target ids (same shape)."""
        return draft_ids + self.d2t.to(draft_ids.device)[draft_ids]

    def target_to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids (any shape) -> draft ids, -1 where the token is not in the draft vocab."""
        lookup = self._to_draft.get(target_ids.device)
        if lookup is None:
            lookup = torch.full((self.target_vocab_size,), -1, dtype=torch.long)
            lookup[self.target_ids()] = torch.arange(self.draft_vocab_size)
            lookup = self._to_draft[target_ids.device] = lookup.to(target_ids.device)
        return lookup[target_ids]

    def save(self, path: str | Path) -> Path:
        """Write ``path`` (a folder gets ``draft_vocab.safetensors`` inside); returns the file."""
        file = _file(path)
        with atomic_file(file) as tmp:
            save_file({"d2t": self.d2t.contiguous(), "t2d": self.t2d.contiguous(),
                       "counts": self.counts.contiguous()}, str(tmp),
                      metadata={"format": "draftsmith-draft-vocab"})
        return file

    @classmethod
    def load(cls, path: str | Path) -> "DraftVocab":
        file = _file(path)
        if not file.exists():
            raise FileNotFoundError(f"draft vocabulary {str(file)!r} does not exist")
        t = load_file(str(file))
        missing = {"d2t", "t2d", "counts"} - set(t)
        if missing:
            raise ValueError(f"draft vocabulary {str(file)!r} lacks tensors {sorted(missing)}")
        vocab = cls(d2t=t["d2t"].long(), t2d=t["t2d"].bool(), counts=t["counts"].long())
        vocab.check()
        return vocab

    def check(self) -> None:
        """The invariants every consumer relies on; raises ValueError naming the broken one."""
        ids = self.target_ids()
        if ids.numel() and (ids.min() < 0 or ids.max() >= self.target_vocab_size):
            raise ValueError(f"draft vocabulary maps outside the target vocabulary "
                             f"[0, {self.target_vocab_size})")
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("draft vocabulary target ids are not strictly ascending")
        if int(self.t2d.sum()) != self.draft_vocab_size or not bool(self.t2d[ids].all()):
            raise ValueError("t2d does not mark exactly the draft vocabulary's target ids")


def _file(path: str | Path) -> Path:
    path = Path(path)
    return path if path.suffix == ".safetensors" else path / VOCAB_FILE


def save_draft_vocab(vocab: DraftVocab, path: str | Path) -> Path:
    return vocab.save(path)


def load_draft_vocab(path: str | Path) -> DraftVocab:
    return DraftVocab.load(path)


def _flat(x: Any) -> np.ndarray:
    """A row or a batch (list, ragged list of lists, ndarray, tensor) -> 1-D int64 array."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().reshape(-1).long().numpy()
    if isinstance(x, np.ndarray) and x.dtype != object:
        return x.reshape(-1).astype(np.int64)
    if len(x) and not np.isscalar(x[0]):  # ragged rows (lists, object arrays)
        return np.concatenate([_flat(r) for r in x])
    return np.asarray(x, dtype=np.int64).reshape(-1)


def count_loss_tokens(rows: Iterable[dict[str, Any]], target_vocab_size: int) -> torch.Tensor:
    """int64 ``[target_vocab]`` counts of tokens with ``loss_mask == 1``.

    ``rows`` yields dicts with ``input_ids`` and ``loss_mask`` (rows or batches of rows).
    """
    counts = np.zeros(target_vocab_size, dtype=np.int64)
    for row in rows:
        ids, mask = _flat(row["input_ids"]), _flat(row["loss_mask"])
        if ids.shape != mask.shape:
            raise ValueError(f"input_ids and loss_mask differ in size: {ids.shape} vs {mask.shape}")
        picked = ids[mask != 0]
        if picked.size and (picked.min() < 0 or picked.max() >= target_vocab_size):
            raise ValueError(f"token id {int(picked.max())} (or {int(picked.min())}) is outside "
                             f"the target vocabulary of {target_vocab_size}")
        counts += np.bincount(picked, minlength=target_vocab_size)
    return torch.from_numpy(counts)


def select_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> DraftVocab:
    """Top ``N`` of ``counts`` (ties: smaller id first; unseen tokens fill), sorted ascending."""
    V = counts.numel()
    if not 0 < draft_vocab_size <= V:
        raise ValueError(f"invalid value for 'draft_vocab_size': {draft_vocab_size!r}; expected "
                         f"an integer in [1, {V}] (the target vocabulary size)")
    order = np.argsort(-counts.numpy(), kind="stable")  # stable: equal counts keep id order
    ids = torch.from_numpy(np.sort(order[:draft_vocab_size])).long()  # [N] ascending target ids
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    vocab = DraftVocab(d2t=ids - torch.arange(draft_vocab_size), t2d=t2d, counts=counts.long())
    vocab.check()
    return vocab


def build_draft_vocab(data: Any, target_vocab_size: int, draft_vocab_size: int,
                      batch_size: int = 1024) -> DraftVocab:
    """Draft vocabulary from a prepared ``datasets.Dataset`` (packed or not) or any iterable of
    ``{"input_ids", "loss_mask"}`` rows / batches."""
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise ValueError(f"invalid value for 'draft_vocab_size': {draft_vocab_size!r}; expected "
                         f"an integer in [1, {target_vocab_size}] (the target vocabulary size)")
    if hasattr(data, "iter") and hasattr(data, "column_names"):  # datasets.Dataset
        data = data.select_columns(["input_ids", "loss_mask"]).with_format("numpy")
        data = data.iter(batch_size=batch_size)
    return select_draft_vocab(count_loss_tokens(data, target_vocab_size), draft_vocab_size)
