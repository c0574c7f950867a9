"""Training data: dataset -> chat template + assistant-only loss masks -> packed token rows.

``prepare_dataset`` is the one entry point:

    source (Hub id / file / folder / Dataset)
      -> shuffle(seed) -> first max_examples
      -> tokenize (cached ``datasets.map``, ``num_proc`` workers): input_ids, loss_mask
      -> drop and count rows that cannot train (empty, no assistant turn, ...)
      -> pack into rows of exactly ``max_length`` tokens (document boundaries kept)

Row layout (one packed row, T = max_length)::

    input_ids     int32 [T]  documents back to back, then pad tokens
    loss_mask     int8  [T]  1 = this token is a training target (assistant answer + terminator;
                             every token of a ``text`` document); 0 for prompts, headers, padding
    position_ids  int32 [T]  restart at 0 at every document (and in the padding block)
    doc_ids       int32 [T]  0, 1, ... per document; padding gets the next id, its own document

``loss_mask[t]`` refers to the token *at* t: an objective predicting token t + 1 from position t
uses ``loss_mask[t + 1]``, and only where ``doc_ids[t + 1] == doc_ids[t]``. The first token of
every document has loss_mask 0 (nothing in its document precedes it), so a shifted loss never
crosses a boundary even if an objective forgets the doc-id check. Attention must not cross
documents either: ``document_attention_mask`` builds the block-diagonal causal mask.

Formats, loss-mask rules (terminator in, trailing template newline out) and loading live in
``train/data_formats.py``. The embedded default dataset (prefix -> continuation pairs cut from
the tiny target's training files) is ``train.tiny.examples.build_default_dataset``.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import datasets
import pyarrow.compute as pc
import torch
from datasets import Features, List, Value

from train.data_formats import (FORMATS, SkipRow, added_special_tokens, detect_format,
                                load_source, row_to_messages, tokenize_messages,
                                truncated_turns)

__all__ = [
    "FORMATS", "DataStats", "Tokenize", "tokenize_dataset", "pack_lengths", "pack_dataset",
    "document_attention_mask", "collate", "prepare_dataset", "load_source", "detect_format",
]

SKIP_REASONS = {  # reason -> how the summary line says it
    "empty": "empty",
    "no_assistant": "without assistant turn",
    "unknown_role": "with an unknown role",
    "template_error": "rejected by the chat template",
    "no_loss_tokens": "without loss tokens after truncation",
}

log = logging.getLogger(__name__)

DROP_WARN = 0.05  # dropped conversations above this fraction get a warning

TOKENIZED_FEATURES = Features({
    "input_ids": List(Value("int32")), "loss_mask": List(Value("int8")),
    "num_tokens": Value("int32"), "num_loss_tokens": Value("int32"),
    "truncated": Value("bool"), "skip": Value("string"),  # skip: "" or a SKIP_REASONS key
})


def packed_features(max_length: int) -> Features:
    """Fixed-length columns, so ``with_format("torch")`` stacks a batch into ``[B, T]``."""
    return Features({
        "input_ids": List(Value("int32"), length=max_length),
        "loss_mask": List(Value("int8"), length=max_length),
        "position_ids": List(Value("int32"), length=max_length),
        "doc_ids": List(Value("int32"), length=max_length),
    })


# ----------------------------------------------------------------------------- tokenize

class Tokenize:
    """The batched ``datasets.map`` function: raw rows -> ``input_ids`` / ``loss_mask``.

    A class holding the tokenizer (not a closure) so it pickles into ``num_proc`` workers and
    hashes deterministically into datasets' cache fingerprint.
    """

    def __init__(self, tokenizer, format: str, max_length: int,
                 template_kwargs: dict[str, Any] | None = None):
        if format not in FORMATS:
            raise ValueError(f"unknown format {format!r}; expected one of {sorted(FORMATS)}")
        self.tokenizer, self.format, self.max_length = tokenizer, format, max_length
        self.template_kwargs = dict(template_kwargs or {})  # enable_thinking, ...
        self.added = [] if format == "text" else added_special_tokens(tokenizer)

    def _encode(self, row: dict[str, Any], strict: bool) -> list[tuple[list[int], list[int]]]:
        """One row -> its examples' full-length ``(input_ids, loss_mask)``."""
        if self.format == "text":
            text = row.get("text") or ""
            if not text.strip():
                raise SkipRow("empty")
            ids = list(self.tokenizer(text, add_special_tokens=True)["input_ids"])
            return [(ids, [1] * len(ids))]  # a plain document: every token is a target
        messages = row_to_messages(row, self.format)
        try:
            return tokenize_messages(self.tokenizer, messages, self.added, truncated_turns(row),
                                     **self.template_kwargs)
        except SkipRow:
            raise
        except Exception:  # noqa: BLE001 - jinja raise_exception, role checks, ...
            if strict:
                raise
            raise SkipRow("template_error") from None

    def examples(self, row: dict[str, Any], strict: bool = False
                 ) -> list[tuple[list[int], list[int], bool]]:
        """One row -> its examples ``(input_ids [T], loss_mask [T], truncated)`` (several for
        per-turn templates, see ``train/data_formats.py``); raises ``SkipRow``.

        ``strict`` lets chat-template exceptions propagate instead of counting the row.
        """
        out, encoded = [], self._encode(row, strict)
        for ids, mask in encoded:
            if not ids:
                continue
            truncated = len(ids) > self.max_length
            ids, mask = ids[: self.max_length], mask[: self.max_length]
            mask[0] = 0  # no in-document position precedes the first token
            if any(mask):
                out.append((ids, mask, truncated))
        if not out:
            raise SkipRow("no_loss_tokens" if any(ids for ids, _ in encoded) else "empty")
        return out

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {k: [] for k in TOKENIZED_FEATURES}
        n = len(next(iter(batch.values())))
        for i in range(n):
            try:
                rows = [(*e, "") for e in self.examples({k: v[i] for k, v in batch.items()})]
            except SkipRow as s:
                rows = [([], [], False, s.reason)]  # one row per skipped conversation
            for ids, mask, truncated, skip in rows:
                out["input_ids"].append(ids)
                out["loss_mask"].append(mask)
                out["num_tokens"].append(len(ids))
                out["num_loss_tokens"].append(sum(mask))
                out["truncated"].append(truncated)
                out["skip"].append(skip)
        return out


@dataclass
class DataStats:
    """What the pipeline kept and dropped; ``summary()`` is the one line printed."""

    rows: int
    examples: int
    tokens: int
    loss_tokens: int
    truncated: int = 0
    max_length: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    packed_rows: int | None = None

    @property
    def dropped_fraction(self) -> float:
        """Conversations (rows) skipped as a whole, as a fraction of all rows."""
        return sum(self.skipped.values()) / max(1, self.rows)

    def warning(self) -> str | None:
        """The loud line for more than ``DROP_WARN`` of the rows dropped, else None."""
        if self.dropped_fraction <= DROP_WARN:
            return None
        top = max(self.skipped, key=self.skipped.get)
        return (f"data: {self.dropped_fraction:.1%} of the {self.rows} conversations were "
                f"dropped (more than {DROP_WARN:.0%}), most {SKIP_REASONS.get(top, top)} "
                f"({self.skipped[top]}); the drafter trains on a biased fraction of the data. "
                "Check the format, the chat template and data.max_length.")

    def summary(self) -> str:
        skips = ", ".join(f"{n} {SKIP_REASONS.get(r, r)}" for r, n in sorted(self.skipped.items()))
        line = (f"data: {self.rows} rows -> {self.examples} examples ({skips or 'none skipped'}), "
                f"{self.tokens} tokens, {self.loss_tokens} loss tokens")
        if self.truncated:
            line += f", {self.truncated} truncated to {self.max_length}"
        if self.packed_rows is not None:
            fill = self.tokens / max(1, self.packed_rows * self.max_length)
            line += f" -> {self.packed_rows} packed rows of {self.max_length} ({fill:.1%} filled)"
        return line


def _keep(skip: list[str]) -> list[bool]:
    return [s == "" for s in skip]


def tokenize_dataset(dataset: datasets.Dataset, tokenizer, *, max_length: int,
                     format: str | None = None, num_proc: int = 1,
                     template_kwargs: dict[str, Any] | None = None,
                     ) -> tuple[datasets.Dataset, DataStats]:
    """Tokenize every row (cached map); drop and count rows that cannot train.

    Returns examples with ``input_ids``, ``loss_mask`` (variable length <= max_length),
    ``num_tokens``, ``num_loss_tokens``, in the input order (a row may give several, see
    ``train/data_formats.py``). ``template_kwargs`` reach the chat template.
    """
    if max_length < 2:
        raise ValueError(f"data: invalid value for 'max_length': {max_length!r}; expected >= 2")
    fmt = detect_format(dataset.column_names, format)
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("data: loss masks need a fast tokenizer (character offsets); got "
                         f"{type(tokenizer).__name__}")
    if fmt != "text" and not tokenizer.chat_template:
        raise ValueError(f"data: format {fmt!r} needs a tokenizer with a chat_template; set "
                         "tokenizer.chat_template or use format='text'")
    fn = Tokenize(tokenizer, fmt, max_length, template_kwargs)
    if len(dataset):  # a broken template fails loudly here instead of skipping every row
        try:
            fn.examples(dataset[0], strict=True)
        except SkipRow:
            pass
    mapped = dataset.map(fn, batched=True, batch_size=256, remove_columns=dataset.column_names,
                         features=TOKENIZED_FEATURES, num_proc=num_proc if num_proc > 1 else None,
                         desc="tokenize")
    table = mapped.data.table
    kept = pc.equal(table.column("skip"), "")
    stats = DataStats(
        rows=len(dataset), examples=int(pc.sum(kept).as_py() or 0),
        tokens=int(pc.sum(table.column("num_tokens")).as_py() or 0),
        loss_tokens=int(pc.sum(table.column("num_loss_tokens")).as_py() or 0),
        truncated=int(pc.sum(table.column("truncated")).as_py() or 0), max_length=max_length,
        skipped={d["values"]: d["counts"] for d in pc.value_counts(table.column("skip")).to_pylist()
                 if d["values"]},
    )
    if stats.skipped:
        mapped = mapped.filter(_keep, input_columns="skip", batched=True,
                               num_proc=num_proc if num_proc > 1 else None, desc="drop skipped")
    return mapped.remove_columns(["skip", "truncated"]), stats


# ----------------------------------------------------------------------------- packing

def pack_lengths(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit bin packing: indices of ``lengths`` grouped into bins of at most ``capacity``.

    Each document goes into the open bin with the least room that still fits it (a new bin when
    none does); bins come out in creation order and keep their documents' input order, so the
    result is deterministic and follows the (seeded) shuffle. O(n log n).
    """
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # sorted (free tokens, bin index) of bins with room left
    for i, n in enumerate(lengths):
        if not 0 < n <= capacity:
            raise ValueError(f"document {i} has {n} tokens; expected 1..{capacity}")
        k = bisect.bisect_left(room, (n, -1))
        if k < len(room):
            free, b = room.pop(k)
        else:
            free, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if free - n > 0:
            bisect.insort(room, (free - n, b))
    return bins


class Pack:
    """Batched map function: a batch of documents -> packed rows of exactly ``max_length``."""

    def __init__(self, max_length: int, pad_id: int):
        self.max_length, self.pad_id = max_length, pad_id

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        T = self.max_length
        out: dict[str, list] = {"input_ids": [], "loss_mask": [], "position_ids": [],
                                "doc_ids": []}
        for members in pack_lengths([len(x) for x in batch["input_ids"]], T):
            ids, mask, pos, doc = [], [], [], []
            for d, i in enumerate(members):
                n = len(batch["input_ids"][i])
                ids += batch["input_ids"][i]
                mask += batch["loss_mask"][i]
                pos += range(n)
                doc += [d] * n
            pad = T - len(ids)  # padding: its own document, never a target
            out["input_ids"].append(ids + [self.pad_id] * pad)
            out["loss_mask"].append(mask + [0] * pad)
            out["position_ids"].append(pos + list(range(pad)))
            out["doc_ids"].append(doc + [len(members)] * pad)
        return out


def pack_dataset(dataset: datasets.Dataset, max_length: int, pad_id: int,
                 batch_size: int = 2000) -> datasets.Dataset:
    """Pack tokenized documents into ``[T]`` rows (see the module doc for the columns).

    Packing runs over batches of ``batch_size`` documents in one process (the bins must not
    depend on how ``num_proc`` would shard the data); it is list concatenation, cheap next to
    tokenizing.
    """
    return dataset.map(Pack(max_length, pad_id), batched=True, batch_size=batch_size,
                       remove_columns=dataset.column_names,
                       features=packed_features(max_length), desc="pack")


def document_attention_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Causal AND same-document boolean mask: ``[..., T]`` doc ids -> ``[..., T, T]``.

    ``mask[..., q, k]`` is True when query position q may attend to key position k. Every row has
    its own diagonal set (padding is its own document), so softmax never sees an empty row.
    """
    T = doc_ids.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return (doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2)) & causal


def collate(rows: Sequence[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Rows (packed or not) -> ``[B, T]`` tensors; shorter rows padded as their own document.

    Returns ``input_ids``, ``position_ids``, ``doc_ids`` (int64) and ``loss_mask`` (bool).
    Unpacked rows (``pack=False``) have no position / doc ids: one document each.
    """
    T = max(len(r["input_ids"]) for r in rows)
    out = {k: torch.zeros(len(rows), T, dtype=torch.long)
           for k in ("input_ids", "loss_mask", "position_ids", "doc_ids")}
    for b, r in enumerate(rows):
        n = len(r["input_ids"])
        pos = torch.as_tensor(r["position_ids"]) if "position_ids" in r else torch.arange(n)
        doc = torch.as_tensor(r["doc_ids"]) if "doc_ids" in r else torch.zeros(n)
        out["input_ids"][b, :n] = torch.as_tensor(r["input_ids"])
        out["input_ids"][b, n:] = pad_id
        out["loss_mask"][b, :n] = torch.as_tensor(r["loss_mask"])
        out["position_ids"][b, :n] = pos
        out["position_ids"][b, n:] = torch.arange(T - n)
        out["doc_ids"][b, :n] = doc
        out["doc_ids"][b, n:] = (int(doc.max()) + 1) if n else 0
    out["loss_mask"] = out["loss_mask"].bool()
    return out


def pad_token_id(tokenizer) -> int:
    """The pad id, else EOS (padding is masked out of loss and attention either way)."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0


# ----------------------------------------------------------------------------- entry point

def prepare_dataset(source: str | Path | datasets.Dataset | datasets.DatasetDict, tokenizer, *,
                    max_length: int, format: str | None = None, split: str = "train",
                    pack: bool = True, num_proc: int = 1, seed: int = 0, shuffle: bool = True,
                    max_examples: int | None = None, cache_dir: str | None = None,
                    pack_batch_size: int = 2000, verbose: bool = True,
                    return_stats: bool = False, template_kwargs: dict[str, Any] | None = None):
    """Load, shuffle, tokenize with loss masks, drop unusable rows, pack. Prints one summary line.

    ``source``: a Hub id, a local file / folder (see ``load_source``) or a ``Dataset``.
    ``format``: None auto-detects from the columns (``FORMATS``). ``pack=False`` keeps one
    example per row (variable length; ``collate`` pads). ``template_kwargs`` reach the chat
    template (``enable_thinking``). More than ``DROP_WARN`` of the rows dropped is logged as a
    warning even when not ``verbose``. Returns the dataset, or ``(dataset, DataStats)`` with
    ``return_stats``.
    """
    if isinstance(source, datasets.DatasetDict):
        source = source[split]
    ds = source if isinstance(source, datasets.Dataset) else load_source(source, split,
                                                                         cache_dir=cache_dir)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    if max_examples is not None:
        ds = ds.select(range(min(max_examples, len(ds))))
    ds, stats = tokenize_dataset(ds, tokenizer, max_length=max_length, format=format,
                                 num_proc=num_proc, template_kwargs=template_kwargs)
    if stats.warning():
        log.warning(stats.warning())
    if stats.examples == 0:
        raise ValueError(f"data: no usable examples in {source!r}: {stats.summary()}")
    if pack:
        ds = pack_dataset(ds, max_length, pad_token_id(tokenizer), pack_batch_size)
        stats.packed_rows = len(ds)
    if verbose:
        print(stats.summary(), flush=True)
    return (ds, stats) if return_stats else ds
