"""Target features for drafter training: online capture or an offline safetensors cache.

The run's frozen target (``FrozenTarget``: its heads, and the whole model replicated or sharded
across the ranks) is in train/frozen_target.py. ``capture(model, batch, spec)`` runs the native
target over a packed batch with the block-diagonal document mask and adds what the objective's
``FeatureSpec`` asks for (``aux`` and / or ``hidden``; see ``train/objectives/base.py``).

Online mode runs it inside every step (``OnlineFeatures``). Offline mode runs it once over the
whole dataset (``build_feature_cache``: sharded, resumable, split across ranks) and trains from
``CachedFeatureRows`` with only the target's heads in memory. ``make_feature_source`` picks
between them from the features config and returns the ``FeatureSource`` the trainer reads.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import datasets
import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor
from tqdm.auto import tqdm

from infer.foundation.atomic import atomic_file, remove_leftovers, write_text
from infer.foundation.errors import MissingFileError
from infer.foundation.files import read_json
from infer.models.llama import Llama
from infer.models.loader import resolve_dtype, resolve_model_dir, weight_files
from infer.foundation.validation import check_choice, config_error
from train import fingerprint
from infer.foundation.threads import GOVERNOR
from train.config import FeatureMode, FeaturesConfig, StorageDtype
from train.data import collate, document_attention_mask
from train.frozen_target import FrozenTarget, most_over_ranks
from infer.models.foreign import target_config
from train.hf_target import TransformersTarget
from train.objectives.base import FeatureSpec


@torch.no_grad()
def full_vocab_argmax(hidden: Tensor, head: torch.nn.Linear, chunk: int = 256) -> Tensor:
    """The target's greedy token at every position: ``[..., H]`` -> ``[...]`` target ids.

    Chunked over positions so that no ``[positions, vocab]`` tensor exists at once (8B targets:
    a 128k vocabulary times 2k positions would be 1 GB in fp32; 256 at a time: 128 MB).
    """
    flat = hidden.reshape(-1, hidden.shape[-1]).to(head.weight.dtype)  # [P, H]
    out = torch.empty(flat.shape[0], dtype=torch.long, device=hidden.device)  # [P]
    for start in range(0, flat.shape[0], chunk):
        part = F.linear(flat[start:start + chunk], head.weight, head.bias)  # [c, V]
        out[start:start + chunk] = part.argmax(-1)
    return out.reshape(hidden.shape[:-1])


def _own_head(target: Llama | TransformersTarget) -> torch.nn.Linear:
    return (target.module.get_output_embeddings() if isinstance(target, TransformersTarget)
            else target.lm_head)


@torch.no_grad()
def capture(target: Llama | TransformersTarget, batch: dict[str, Tensor],
            spec: FeatureSpec, lm_head: torch.nn.Linear | None = None) -> dict[str, Tensor]:
    """``batch`` plus ``aux [B, T, n * H]`` / ``hidden [B, T, H]`` from one target forward
    (the engine's model, or transformers' for an architecture the engine lacks).

    ``spec.greedy`` adds ``greedy [B, T]``, the target's greedy next token at every position
    (its full-vocabulary argmax, by ``lm_head``: the run's whole head, as a sharded target's
    own is sharded; default the model's). The drafters scored against that token would
    otherwise recompute the product over a 49k-128k vocabulary at every position in every step
    (a third of an offline step on a small target); the cache stores it once (4 bytes a token)."""
    if not spec.needs_target:
        return batch
    if isinstance(target, TransformersTarget):
        out = target.streams(batch["input_ids"], batch["position_ids"], batch["doc_ids"],
                             spec.aux_layer_ids)
    else:
        out = target.forward_train(batch["input_ids"], batch["position_ids"],
                                   document_attention_mask(batch["doc_ids"]),
                                   aux_layer_ids=spec.aux_layer_ids, logits_at=batch[
                                       "input_ids"].new_zeros(len(batch["input_ids"]), 1))
    batch = dict(batch)
    if spec.aux_layer_ids:
        batch["aux"] = torch.cat(out.aux, dim=-1)  # [B, T, n * H], sorted id order
    if spec.hidden:
        batch["hidden"] = out.hidden  # [B, T, H] after the final norm
    if spec.greedy:
        batch["greedy"] = full_vocab_argmax(
            out.hidden, _own_head(target) if lm_head is None else lm_head)  # [B, T]
    return batch


class OnlineFeatures:
    """Callable the trainer applies to every batch on the device: adds the target features."""

    def __init__(self, target: Llama | TransformersTarget, spec: FeatureSpec,
                 lm_head: torch.nn.Linear):
        self.target, self.spec, self.lm_head = target, spec, lm_head

    def __call__(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        return capture(self.target, batch, self.spec, self.lm_head)


# ============================================================================= offline cache
#
# <cache_dir>/shard_00000.safetensors ...  features of rows [i * rows_per_shard, ...):
#     "aux" [n, T, len(aux_layer_ids) * H], "hidden" [n, T, H] (storage dtype), "greedy"
#     [n, T] (int32; shards written before it existed lack it, and the trainer then computes it
#     from "hidden"); __metadata__:
#     format, fingerprint (JSON), start, stop, rows_sha (digest of the rows' token/position/doc
#     ids, what the features depend on)
# <cache_dir>/index.json  written last (rank 0): format, fingerprint, dims, shards [{file, start,
#     stop, bytes, rows_sha}]. No index = incomplete cache.

FORMAT_VERSION = 1
ROW_COLUMNS = ("input_ids", "loss_mask", "position_ids", "doc_ids")
FEATURE_KEYS = ("aux", "hidden")
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ST_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int32: "I32"}


def _seq_len(dataset: datasets.Dataset) -> int:
    """T of packed fixed-length rows; the cache stores ``[n, T, D]`` blocks, so it needs them."""
    missing = [c for c in ("input_ids", "position_ids", "doc_ids") if c not in dataset.column_names]
    T = getattr(dataset.features.get("input_ids"), "length", -1)
    if missing or T is None or T < 1:
        raise ValueError(f"features.mode=offline needs packed fixed-length rows (data.pack=true); "
                         f"dataset columns {dataset.column_names}, input_ids length {T}")
    return int(T)


def _rows_digest(dataset: datasets.Dataset, rows) -> str:
    """sha256 of the ids the features depend on (tokens, positions, documents) of ``rows``."""
    view = dataset.with_format("numpy", columns=["input_ids", "position_ids", "doc_ids"])[rows]
    h = hashlib.sha256()
    for col in ("input_ids", "position_ids", "doc_ids"):
        h.update(np.ascontiguousarray(view[col], dtype=np.int64).tobytes())
    return h.hexdigest()


def _dataset_id(dataset: datasets.Dataset) -> dict:
    """Row count, T and the digest of up to 256 evenly spaced rows (cheap for any size)."""
    n = len(dataset)
    sample = sorted({int(i) for i in np.linspace(0, max(n - 1, 0), min(n, 256))})
    return {"num_rows": n, "seq_len": _seq_len(dataset),
            "rows_sha": _rows_digest(dataset, sample) if n else ""}


def cache_fingerprint(target_dir: str | Path, dataset: datasets.Dataset, spec: FeatureSpec,
                      dtype: str, target_dtype: str | torch.dtype, rows_per_shard: int) -> dict:
    """What the cached features depend on; any difference makes an existing cache invalid.

    The dataset is identified by its content (row count, T, digest of up to 256 evenly spaced
    rows; each shard also carries its own rows' digest), not by ``Dataset._fingerprint``, which is
    random whenever a map function cannot be hashed and would break resuming. The target is
    identified by its config.json hash and weight file sizes; its path is recorded (``target``)
    but not compared, so a moved or re-downloaded copy of the same target reuses the cache.
    """
    model_dir = resolve_model_dir(target_dir)
    hf_bytes = (model_dir / "config.json").read_bytes()
    return {
        "format": FORMAT_VERSION, "target": str(model_dir.resolve()),
        "target_config_sha": hashlib.sha256(hf_bytes).hexdigest(),
        "target_weights": {p.name: p.stat().st_size for p in weight_files(model_dir)},
        "target_dtype": str(resolve_dtype(target_dtype, json.loads(hf_bytes))).removeprefix(
            "torch."),
        "aux_layer_ids": list(spec.aux_layer_ids), "hidden": bool(spec.hidden),
        **_dataset_id(dataset), "dtype": dtype, "rows_per_shard": int(rows_per_shard)}


def _check_fingerprint(cached: dict, current: dict, cache_dir: Path, where: str,
                       keys=None) -> None:
    """The cache's recorded inputs must be this run's (its ``target`` path is not compared)."""
    fingerprint.check(cached, current, subject=f"feature cache {cache_dir} ({where})",
                      held="cache has", keys=keys, ignore=("target",),
                      remedy=f"Delete {cache_dir} to rebuild it, or set features.cache_dir to "
                             "another directory")


def _feature_dims(spec: FeatureSpec, hidden_size: int) -> dict[str, int]:
    """Feature name -> D per token (``aux``: the aux layers' residuals concatenated)."""
    dims = {"aux": len(spec.aux_layer_ids) * hidden_size} if spec.aux_layer_ids else {}
    return dims | ({"hidden": hidden_size} if spec.hidden else {})


def _layout(spec: FeatureSpec, dims: dict[str, int], rows: int, seq_len: int, dtype: str
            ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each shard tensor's shape and dtype: the features ``[rows, T, D]`` in the storage dtype
    and, when the spec asks, the target's greedy tokens ``greedy [rows, T]`` as int32."""
    out = {k: ((rows, seq_len, d), STORAGE_DTYPES[dtype]) for k, d in dims.items()}
    return out | ({"greedy": ((rows, seq_len), torch.int32)} if spec.greedy else {})


def _shard_name(i: int) -> str:
    return f"shard_{i:05d}.safetensors"


class _ShardWriter:
    """Streams one shard to disk batch by batch.

    A safetensors file is an 8-byte header length, a JSON header and each tensor's raw bytes, so
    with the shapes known up front every batch goes straight to its offset: a shard never has to
    fit in memory (an 8B EAGLE-3 target produces ~32 KB per token, 17 GB per 256 x 2048 rows).
    """

    def __init__(self, path: Path, layout: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 metadata: dict[str, str]):
        header: dict = {"__metadata__": metadata}
        self.base, self.row_bytes, offset = {}, {}, 0
        for name, (shape, dtype) in sorted(layout.items()):
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": ST_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self.base[name] = offset
            self.row_bytes[name] = math.prod(shape[1:]) * dtype.itemsize
            offset += nbytes
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)  # data aligned to 8 bytes, as safetensors writes it
        self.start = 8 + len(raw)
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)
        self.file.truncate(self.start + offset)

    def write(self, name: str, row: int, t: Tensor) -> None:
        """``t [b, T, ...]`` (its layout dtype, CPU) -> rows ``row .. row + b`` of ``name``."""
        self.file.seek(self.start + self.base[name] + row * self.row_bytes[name])
        self.file.write(t.contiguous().view(torch.uint8).numpy())  # little-endian raw bytes

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


def _shard_ok(path: Path, start: int, stop: int, fp: dict, shapes: dict, rows_sha: str,
              cache_dir: Path) -> bool:
    """True = complete, matching shard (skip it); False = absent or unreadable (recompute it).
    A shard built for a different fingerprint or different rows raises instead."""
    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        cached = json.loads(meta["fingerprint"])
    except Exception as err:  # truncated / foreign file: recompute it
        warnings.warn(f"feature cache: recomputing unreadable shard {path} ({err})")
        return False
    _check_fingerprint(cached | {"shard_rows_sha": meta.get("rows_sha")},
                       fp | {"shard_rows_sha": rows_sha}, cache_dir, path.name)
    older = {k: v for k, v in shapes.items() if k != "greedy"}  # written before greedy existed
    return found in (shapes, older) and (meta.get("start"), meta.get("stop")) == (str(start),
                                                                                  str(stop))


def build_feature_cache(target: FrozenTarget, dataset: datasets.Dataset, spec: FeatureSpec,
                        cache_dir: str | Path, *, dtype: str = "bfloat16",
                        rows_per_shard: int = 256, batch_size: int = 4, rank: int = 0,
                        world_size: int = 1, progress: bool = True,
                        barrier: Callable[[], None] | None = None) -> Path:
    """Precompute the target features of every packed row into ``cache_dir`` (layout above).

    Resumable: shards are written atomically, complete matching ones are skipped (unreadable
    ones recomputed) and rank 0 deletes killed writes' temporaries before a first ``barrier()``,
    so a rerun computes only the missing shards (no target load if none). Shard i is rank ``i %
    world_size``'s; after a second ``barrier()`` rank 0 writes ``index.json``, all wait at a third.
    A sharded target (``target.sharded``) is loaded on every rank or none, and ranks with fewer
    rows left run idle forwards up to the busiest rank's count (each forward is a collective).
    """
    if not spec.needs_target:
        raise ValueError(f"build_feature_cache: {spec} asks for no target features")
    dtype = str(check_choice("features.dtype", dtype, StorageDtype, "train config"))
    for key, value in (("features.rows_per_shard", rows_per_shard),
                       ("features.batch_size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise config_error(key, value, "an integer >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    cache, barrier = Path(cache_dir), barrier or (lambda: None)
    cache.mkdir(parents=True, exist_ok=True)
    if rank == 0:  # a killed shard write leaves GBs; no rank of this run writes here yet
        remove_leftovers(cache / "*")
    barrier()
    fp = cache_fingerprint(target.dir, dataset, spec, dtype, target.dtype, rows_per_shard)
    dims = _feature_dims(spec, target_config(target.dir).hidden_size)
    n, T = fp["num_rows"], fp["seq_len"]
    if (cache / "index.json").is_file():
        index = json.loads((cache / "index.json").read_text())
        _check_fingerprint(index["fingerprint"], fp, cache, "index.json")
    shards = [(i, a, min(a + rows_per_shard, n)) for i, a in enumerate(range(0, n, rows_per_shard))]
    todo = [(i, a, b) for i, a, b in shards[rank::world_size] if not _shard_ok(
        cache / _shard_name(i), a, b, fp, {k: shape for k, (shape, _) in _layout(
            spec, dims, b - a, T, dtype).items()}, _rows_digest(dataset, range(a, b)), cache)]
    if rank == 0:
        D, item = sum(dims.values()), STORAGE_DTYPES[dtype].itemsize
        print(f"feature cache {cache}: {n} rows x {T} tokens x {D} features x "
              f"{item} B = {n * T * D * item / 1e9:.3g} GB in "
              f"{len(shards)} shards of {rows_per_shard} rows; rank 0 computes {len(todo)}",
              flush=True)
    mine = sum(math.ceil((b - a) / batch_size) for _, a, b in todo)  # target forwards
    # a sharded target's forward is a collective: ranks with fewer run idle ones
    forwards = most_over_ranks(mine, target.device) if target.sharded else mine
    if forwards:
        _compute_shards(target, dataset, spec, cache, todo, dims, fp, dtype=dtype,
                        batch_size=batch_size, progress=progress, desc=f"features (rank {rank})")
        _idle_forwards(target, dataset, spec, forwards - mine)
    barrier()
    if rank == 0:
        _write_index(cache, shards, fp, dims, world_size)
    barrier()
    return cache


def _compute_shards(target: FrozenTarget, dataset, spec, cache: Path, todo, dims, fp, *, dtype,
                    batch_size, progress, desc) -> None:
    """Target forwards (``capture``) over the rows of ``todo`` shards, streamed to disk."""
    rows, T = PlainRows(dataset), fp["seq_len"]
    bar = tqdm(total=sum(b - a for _, a, b in todo), unit="row", desc=desc, disable=not progress)
    try:
        for i, a, b in todo:
            meta = {"format": str(FORMAT_VERSION), "fingerprint": json.dumps(fp, sort_keys=True),
                    "start": str(a), "stop": str(b),
                    "rows_sha": _rows_digest(dataset, range(a, b))}
            layout = _layout(spec, dims, b - a, T, dtype)
            with atomic_file(cache / _shard_name(i)) as tmp:
                writer = _ShardWriter(tmp, layout, meta)
                try:
                    for s in range(a, b, batch_size):
                        GOVERNOR.tick()  # one torch thread per free core, re-checked
                        e = min(s + batch_size, b)
                        batch = collate([rows[j] for j in range(s, e)], pad_id=0)  # [B, T] each
                        batch = {k: v.to(target.device) for k, v in batch.items()}
                        out = capture(target.model, batch, spec, target.heads.lm_head)
                        for k, (_, dt) in layout.items():
                            writer.write(k, s - a, out[k].to(dt).cpu())  # [B, T, ...]
                        bar.update(e - s)
                    writer.close()
                finally:
                    writer.file.close()
    finally:
        bar.close()


def _idle_forwards(target: FrozenTarget, dataset, spec: FeatureSpec, n: int) -> None:
    """``n`` discarded forwards of one row: a sharded target's ranks must all take part in as
    many forwards as the busiest rank runs (each all-gathers the layers' weights)."""
    if n <= 0:
        return
    batch = collate([PlainRows(dataset)[0]], pad_id=0)  # [1, T] each
    batch = {k: v.to(target.device) for k, v in batch.items()}
    for _ in range(n):
        capture(target.model, batch, spec, target.heads.lm_head)


def _write_index(cache: Path, shards, fp: dict, dims: dict, world_size: int) -> None:
    """Rank 0, once every rank is done: all shards must exist; ``index.json`` marks completion."""
    missing = [f"{_shard_name(i)} (rank {i % world_size})" for i, _, _ in shards
               if not (cache / _shard_name(i)).is_file()]
    if missing:
        raise RuntimeError(f"feature cache {cache}: shards missing after every rank finished: "
                           f"{', '.join(missing)}; rerun to compute them")
    entries = []
    for i, a, b in shards:
        with safe_open(str(cache / _shard_name(i)), framework="pt") as f:
            rows_sha = (f.metadata() or {}).get("rows_sha")
        entries.append({"file": _shard_name(i), "start": a, "stop": b, "rows_sha": rows_sha,
                        "bytes": (cache / _shard_name(i)).stat().st_size})
    index = {"format": FORMAT_VERSION, "fingerprint": fp, "dims": dims, "shards": entries}
    write_text(cache / "index.json", json.dumps(index, indent=1))


# ============================================================================= row datasets

class PlainRows(torch.utils.data.Dataset):
    """The packed rows' fields as tensors (online mode: the target adds features per batch)."""

    def __init__(self, dataset: datasets.Dataset):
        self.dataset = dataset.with_format(
            "torch", columns=[c for c in ROW_COLUMNS if c in dataset.column_names])

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return dict(self.dataset[int(i)])  # input_ids / loss_mask / position_ids / doc_ids [T]


class CachedFeatureRows(torch.utils.data.Dataset):
    """Packed rows plus their cached features: item i = ``PlainRows`` fields + ``aux [T, n * H]``
    / ``hidden [T, H]`` in the cache's storage dtype.

    Features stay in the storage dtype (half the host memory and host->device copies of
    float32); ``make_feature_source``'s ``add_features`` casts them on the device to the target
    dtype. Shards are opened lazily with ``safe_open`` (memory-mapped, one row read per item),
    per process: DataLoader workers reopen them.
    """

    def __init__(self, cache_dir: str | Path, dataset: datasets.Dataset,
                 spec: FeatureSpec | None = None):
        self.cache_dir = cache = Path(cache_dir)
        index_path = cache / "index.json"
        if not index_path.is_file():
            found = sorted(p.name for p in cache.glob("shard_*.safetensors"))
            raise MissingFileError(
                f"feature cache {cache} is incomplete: no index.json ({len(found)} shard files "
                "present); run build_feature_cache / train.py with features.mode=offline to finish")
        index = read_json(index_path, required=("fingerprint", "shards"))
        fp, current = index["fingerprint"], _dataset_id(dataset)
        if spec is not None:
            current |= {"aux_layer_ids": list(spec.aux_layer_ids), "hidden": bool(spec.hidden)}
        _check_fingerprint(fp, current, cache, "index.json", keys=list(current))
        missing = [s["file"] for s in index["shards"] if not (cache / s["file"]).is_file()
                   or (cache / s["file"]).stat().st_size != s["bytes"]]
        if missing:
            raise MissingFileError(f"feature cache {cache} is incomplete: missing or changed "
                                    f"shards {', '.join(missing)}; rerun the build to recompute")
        self.rows, self.index = PlainRows(dataset), index
        self.rows_per_shard = int(fp["rows_per_shard"])
        self._open: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": {}}  # safe_open handles are per process

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        item = self.rows[i]
        s = int(i) // self.rows_per_shard
        if s not in self._open:
            self._open[s] = safe_open(str(self.cache_dir / self.index["shards"][s]["file"]),
                                      framework="pt")
        f = self._open[s]
        for name in f.keys():
            item[name] = f.get_slice(name)[int(i) - s * self.rows_per_shard]  # [T, D]
        return item


# ============================================================================= factory

class CastFeatures:
    """Offline ``add_features``: cached features -> the target dtype and the greedy tokens ->
    int64, on the device (so objectives see exactly what online capture gives); a cache from
    before ``greedy`` existed gets it here, from ``hidden`` and the target's LM head."""

    def __init__(self, lm_head: torch.nn.Linear, spec: FeatureSpec):
        self.lm_head, self.dtype, self.greedy = lm_head, lm_head.weight.dtype, spec.greedy

    def __call__(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        out = {k: v.to(self.dtype) if k in FEATURE_KEYS else v for k, v in batch.items()}
        if self.greedy:
            out["greedy"] = (out["greedy"].long() if "greedy" in out
                             else full_vocab_argmax(out["hidden"], self.lm_head))  # [B, T]
        return out


def _identity(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    return batch


@dataclass
class FeatureSource:
    """What the trainer reads: ``rows`` (packed rows, cached features included offline) and
    ``add_features``, applied to every batch on the device (online: the target forward)."""

    rows: torch.utils.data.Dataset
    add_features: Callable[[dict[str, Tensor]], dict[str, Tensor]]


def make_feature_source(features: FeaturesConfig, target: FrozenTarget,
                        dataset: datasets.Dataset, spec: FeatureSpec, cache_dir: str | Path, *,
                        rank: int = 0, world_size: int = 1,
                        barrier: Callable[[], None] | None = None) -> FeatureSource:
    """Online (``target.model`` runs per batch) or offline (the cache in ``cache_dir`` built or
    resumed here) features of ``dataset`` for ``spec``; no target forward at all when the spec
    asks for no features."""
    mode = check_choice("features.mode", features.mode, FeatureMode, "train config")
    if not spec.needs_target:
        return FeatureSource(PlainRows(dataset), _identity)
    if mode == FeatureMode.online:
        return FeatureSource(PlainRows(dataset), OnlineFeatures(target.model, spec,
                                                                target.heads.lm_head))
    cache = build_feature_cache(
        target, dataset, spec, cache_dir, dtype=features.dtype,
        rows_per_shard=features.rows_per_shard, batch_size=features.batch_size, rank=rank,
        world_size=world_size, barrier=barrier)
    return FeatureSource(CachedFeatureRows(cache, dataset, spec),
                         CastFeatures(target.heads.lm_head, spec))
