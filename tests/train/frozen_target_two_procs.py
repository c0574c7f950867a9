"""Run by test_frozen_target.py under ``accelerate launch`` (conf/accelerate/cpu_2proc.yaml).

argv: TARGET_DIR OUT_DIR SHARDING. The frozen target is loaded sharded across the two ranks
(``FrozenTarget``), then, on each rank:

1. what the rank holds: its share of every large weight (FSDP: DTensor local shards; ZeRO-3:
   partitions), the heads whole;
2. online capture on a batch of this rank's own rows, against the replicated model;
3. an offline cache built with the sharded target, 3 shards over 2 ranks (rank 0 computes two,
   rank 1 one: idle forwards keep them in step); every cached row against the replicated model;
4. resume: a deleted shard of rank 1's is recomputed and no other shard file is rewritten
   (modification times); rank 0 runs idle forwards meanwhile (forward counts).

Results go to ``OUT/<sharding>_rank<r>.json`` for the test to check.
"""

import importlib.util
import json
import sys
from pathlib import Path

import datasets
import torch
from accelerate import PartialState
from transformers import AutoTokenizer

from infer.models.loader import load_model
from train.config import TargetSharding
from train.data import collate, pad_token_id, prepare_dataset
from train.features import CachedFeatureRows, build_feature_cache, capture
from train.frozen_target import FrozenTarget
from train.objectives.base import FeatureSpec

_spec = importlib.util.spec_from_file_location("train_conftest",
                                               Path(__file__).with_name("conftest.py"))
conftest = sys.modules["train_conftest"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)  # (registered first: its dataclasses look their module up)

SPEC = FeatureSpec(aux_layer_ids=(1, 2, 4), hidden=True, greedy=True)


def held_fraction(target: FrozenTarget) -> dict[str, float]:
    """Share of each decoder weight this rank holds (1.0 = whole)."""
    out = {}
    for name, p in target.model.named_parameters():
        if len(getattr(p, "ds_shape", p.shape)) < 2:
            continue
        if hasattr(p, "ds_tensor"):  # ZeRO-3: the partition (the parameter itself is empty)
            out[name] = p.ds_tensor.numel() / p.ds_numel
        elif hasattr(p, "to_local"):  # FSDP: a DTensor shard
            out[name] = p.to_local().numel() / p.numel()
        else:  # FSDP keeps its root unit (embedding, LM head) gathered after a forward
            out[name] = 1.0
    return out


def max_diff(a: dict, b: dict, row: int | None = None) -> float:
    """Largest difference of the features of ``a`` and ``b`` (``b[k][row]`` when given)."""
    return max(float((a[k].float() - (b[k] if row is None else b[k][row]).float()).abs().max())
               for k in ("aux", "hidden", "greedy"))


class Counting:
    """Counts target forwards (each one runs decoder layer 0 once)."""

    def __init__(self, model):
        self.layer, self.calls = model.layers[0], 0

    def __enter__(self):
        self.hook = self.layer.register_forward_pre_hook(self._count)
        return self

    def _count(self, *_):
        self.calls += 1

    def __exit__(self, *exc):
        self.hook.remove()


def main(target_dir: str, out: Path, sharding: str) -> None:
    torch.set_num_threads(1)
    state = PartialState(cpu=True)
    rank = state.process_index
    tok = AutoTokenizer.from_pretrained(target_dir)
    rows = prepare_dataset(datasets.Dataset.from_list(conftest.chat_rows(24)), tok,
                           max_length=64, verbose=False)
    pad = pad_token_id(tok)
    target = FrozenTarget(target_dir, "float32", state.device, TargetSharding(sharding))
    replica = load_model(target_dir, dtype="float32", fuse=False)
    mine = collate([rows[i] for i in range(rank, 6, 2)], pad)  # this rank's own rows
    online = max_diff(capture(target.model, mine, SPEC, target.heads.lm_head),
                      capture(replica, mine, SPEC))

    cache = out / f"{sharding}_cache"
    n = min(len(rows), 12)
    part = rows.select(range(n))  # 3 shards of 4 rows: rank 0 gets shards 0 and 2, rank 1 one
    with Counting(target.model) as first:
        build_feature_cache(target, part, SPEC, cache, dtype="float32", rows_per_shard=4,
                            batch_size=2, rank=rank, world_size=2,
                            barrier=state.wait_for_everyone, progress=False)
    cached = CachedFeatureRows(cache, part, SPEC)
    offline = max(max_diff(cached[i], capture(replica, collate([part[i]], pad), SPEC), row=0)
                  for i in range(n))
    stamps = {p.name: p.stat().st_mtime_ns for p in sorted(cache.glob("shard_*"))}
    state.wait_for_everyone()
    if rank == 0:
        (cache / "shard_00001.safetensors").unlink()  # rank 1's
        (cache / "index.json").unlink()
    state.wait_for_everyone()
    with Counting(target.model) as resumed:
        build_feature_cache(target, part, SPEC, cache, dtype="float32", rows_per_shard=4,
                            batch_size=2, rank=rank, world_size=2,
                            barrier=state.wait_for_everyone, progress=False)
    again = CachedFeatureRows(cache, part, SPEC)
    resumed_diff = max(max_diff(again[i], cached[i]) for i in range(n))
    (out / f"{sharding}_rank{rank}.json").write_text(json.dumps({
        "world": state.num_processes, "held": held_fraction(target),
        "heads": [list(target.heads.embed_tokens.weight.shape),
                  list(target.heads.lm_head.weight.shape)],
        "rewritten": sorted(k for k, v in stamps.items()
                            if (cache / k).stat().st_mtime_ns != v),
        "online_diff": online, "offline_diff": offline, "resumed_diff": resumed_diff,
        "build_forwards": first.calls, "resume_forwards": resumed.calls}))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
