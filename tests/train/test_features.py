"""Target features: frozen heads, the offline safetensors cache (equal to online capture,
resumable, fingerprinted, split across ranks), the row datasets and the feature-source factory."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from infer.models.loader import load_model
from train import features as F
from train.config import TrainConfig
from train.data import collate
from train.frozen_target import FrozenTarget
from train.objectives.base import FeatureSpec

SPEC = FeatureSpec(aux_layer_ids=(1, 2, 4), hidden=True, greedy=True)
RPS, BS = 8, 4  # rows per shard, target batch: 2 forwards per full shard


@pytest.fixture(scope="module")
def target(train_data):
    return load_model(train_data.target_dir, dtype="float32")


@pytest.fixture
def count_forwards(monkeypatch):
    """Counts target forwards of the cache build (``F.capture`` calls); ``fail_after`` raises."""
    state = {"n": 0, "fail_after": None}
    real = F.capture

    def counted(*args, **kwargs):
        if state["fail_after"] is not None and state["n"] >= state["fail_after"]:
            raise KeyboardInterrupt("simulated interruption")
        state["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "capture", counted)
    return state


def build(train_data, cache, spec=SPEC, **kw):
    kw = {"dtype": "float32", "rows_per_shard": RPS, "batch_size": BS, "progress": False} | kw
    frozen = FrozenTarget(train_data.target_dir, "float32", "cpu")
    return F.build_feature_cache(frozen, train_data.dataset, spec, cache, **kw)


def num_shards(train_data) -> int:
    return -(-len(train_data.dataset) // RPS)


def stack(rows: list[dict]) -> dict[str, torch.Tensor]:
    """What the trainer's collate does with cached rows: token fields + stacked features."""
    return collate(rows, 0) | {k: torch.stack([r[k] for r in rows])
                               for k in ("aux", "hidden", "greedy") if k in rows[0]}


def online(target, train_data, spec=SPEC) -> dict[str, torch.Tensor]:
    """Online capture with the same batch grouping as the cache build (bit-identical matmuls)."""
    rows = F.PlainRows(train_data.dataset)
    outs = [F.capture(target, collate([rows[j] for j in range(s, min(s + BS, len(rows)))], 0),
                      spec) for s in range(0, len(rows), BS)]
    return {k: torch.cat([o[k] for o in outs]) for k in ("aux", "hidden", "greedy")}  # [N, T, .]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cache_equals_online_capture(train_data, target, tmp_path, capsys, dtype):
    ds, n, T = train_data.dataset, len(train_data.dataset), 128
    cache = build(train_data, tmp_path / "cache", dtype=dtype)
    out = capsys.readouterr().out
    shards, H = num_shards(train_data), 64
    gb = n * T * 4 * H * (4 if dtype == "float32" else 2) / 1e9
    assert f"{n} rows x {T} tokens x {4 * H} features" in out and f"{gb:.3g} GB" in out
    assert f"{shards} shards of {RPS} rows" in out
    index = json.loads((cache / "index.json").read_text())
    assert [s["file"] for s in index["shards"]] == [f"shard_{i:05d}.safetensors"
                                                   for i in range(shards)]
    assert index["shards"][-1]["stop"] == n and index["fingerprint"]["dtype"] == dtype

    ref = online(target, train_data)
    rows = F.CachedFeatureRows(cache, ds, SPEC)
    assert len(rows) == n
    item = rows[n - 1]
    assert set(item) == {"input_ids", "loss_mask", "position_ids", "doc_ids", "aux", "hidden",
                         "greedy"}
    assert item["aux"].shape == (T, 3 * H) and item["hidden"].shape == (T, H)
    assert item["greedy"].shape == (T,) and item["greedy"].dtype == torch.int32
    assert item["aux"].dtype == getattr(torch, dtype)
    assert item["input_ids"].tolist() == ds[n - 1]["input_ids"]
    batch = stack([rows[i] for i in range(n)])
    assert batch["aux"].shape == (n, T, 3 * H) and batch["input_ids"].shape == (n, T)
    for k in ("aux", "hidden"):  # float32 exact; bf16 = the same values rounded once
        assert torch.equal(batch[k], ref[k].to(getattr(torch, dtype)))
    # the target's greedy next token, over its whole vocabulary, at every position
    assert torch.equal(ref["greedy"], target.lm_head(ref["hidden"]).argmax(-1))
    cast = F.CastFeatures(target.lm_head, SPEC)(batch)
    assert cast["aux"].dtype == torch.float32 and torch.equal(cast["greedy"], ref["greedy"])
    worker_copy = pickle.loads(pickle.dumps(rows))  # DataLoader workers: handles reopened
    assert worker_copy._open == {} and torch.equal(worker_copy[n - 1]["aux"], item["aux"])


def test_interrupted_build_resumes_missing_shards_only(train_data, tmp_path, count_forwards):
    shards, cache = num_shards(train_data), tmp_path / "cache"
    count_forwards["fail_after"] = 3  # shard 0 done (2 forwards), dies inside shard 1
    with pytest.raises(KeyboardInterrupt):
        build(train_data, cache)
    assert sorted(p.name for p in cache.iterdir()) == ["shard_00000.safetensors"]  # no tmp
    with pytest.raises(FileNotFoundError, match="incomplete: no index.json"):
        F.CachedFeatureRows(cache, train_data.dataset)
    count_forwards.update(n=0, fail_after=None)
    build(train_data, cache)
    last = len(train_data.dataset) - (shards - 1) * RPS
    assert count_forwards["n"] == 2 * (shards - 2) + -(-last // BS)  # every shard but shard 0
    F.CachedFeatureRows(cache, train_data.dataset)

    (cache / "shard_00001.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="shard_00001.safetensors"):
        F.CachedFeatureRows(cache, train_data.dataset)
    count_forwards["n"] = 0
    build(train_data, cache)
    assert count_forwards["n"] == 2  # only the deleted shard
    count_forwards["n"] = 0
    build(train_data, cache)
    assert count_forwards["n"] == 0  # complete: the target is not even run


def test_fingerprint_mismatch_names_the_field(train_data, tmp_path):
    cache = build(train_data, tmp_path / "cache", spec=FeatureSpec(hidden=True))
    with pytest.raises(ValueError, match=r"cache.*different 'aux_layer_ids'.*Delete"):
        build(train_data, cache, spec=FeatureSpec(aux_layer_ids=(1,), hidden=True))
    with pytest.raises(ValueError, match=r"different 'dtype': cache has 'float32'"):
        build(train_data, cache, spec=FeatureSpec(hidden=True), dtype="bfloat16")
    with pytest.raises(ValueError, match=str(cache)):
        build(train_data, cache, spec=FeatureSpec(hidden=True), rows_per_shard=RPS + 1)
    (cache / "index.json").unlink()  # interrupted-looking cache: the shards still say so
    with pytest.raises(ValueError, match=r"shard_00000.*different 'aux_layer_ids': cache has \[\]"):
        build(train_data, cache, spec=FeatureSpec(aux_layer_ids=(2,)))
    build(train_data, cache, spec=FeatureSpec(hidden=True))
    other = train_data.dataset.select(range(len(train_data.dataset) - 1))
    with pytest.raises(ValueError, match="different 'num_rows'"):
        F.CachedFeatureRows(cache, other)
    with pytest.raises(ValueError, match="different 'aux_layer_ids'"):
        F.CachedFeatureRows(cache, train_data.dataset, SPEC)
    reordered = train_data.dataset.select(list(range(len(train_data.dataset)))[::-1])
    with pytest.raises(ValueError, match="different 'rows_sha'"):
        F.CachedFeatureRows(cache, reordered)


def test_two_ranks_split_the_shards(train_data, tmp_path, count_forwards):
    shards, cache = num_shards(train_data), tmp_path / "cache"
    with pytest.raises(RuntimeError, match=r"shard_00001.safetensors \(rank 1\)"):
        build(train_data, cache, rank=0, world_size=2)  # rank 1 has not run yet
    assert sorted(p.name for p in cache.iterdir()) == [
        f"shard_{i:05d}.safetensors" for i in range(0, shards, 2)]
    build(train_data, cache, rank=1, world_size=2)
    assert not (cache / "index.json").exists()  # rank 0 writes the index
    n0 = count_forwards["n"]
    build(train_data, cache, rank=0, world_size=2)
    assert count_forwards["n"] == n0  # rank 0's shards were already there
    assert len(F.CachedFeatureRows(cache, train_data.dataset, SPEC)) == len(train_data.dataset)


def test_make_feature_source_modes(train_data, target, tmp_path, count_forwards):
    cfg = TrainConfig(output_dir=str(tmp_path), name="run")
    cache_dir = tmp_path / "run" / "features"
    rows = [F.PlainRows(train_data.dataset)[i] for i in range(2)]
    assert set(rows[0]) == {"input_ids", "loss_mask", "position_ids", "doc_ids"}
    batch = collate(rows, 0)
    ref = F.capture(target, batch, SPEC)

    frozen = FrozenTarget(train_data.target_dir, "auto", "cpu")
    src = F.make_feature_source(cfg.features, frozen, train_data.dataset, SPEC, cache_dir)
    assert frozen.loaded and frozen.model.lm_head is frozen.heads.lm_head  # one copy
    assert torch.equal(src.add_features(batch)["aux"], ref["aux"])

    cfg.features.mode, cfg.features.dtype, cfg.features.rows_per_shard = "offline", "float32", 32
    frozen = FrozenTarget(train_data.target_dir, "auto", "cpu")
    src = F.make_feature_source(cfg.features, frozen, train_data.dataset, SPEC, cache_dir)
    assert (cache_dir / "index.json").is_file()
    cached = src.add_features(stack([src.rows[0], src.rows[1]]))
    assert torch.equal(cached["hidden"], ref["hidden"])
    frozen = FrozenTarget(train_data.target_dir, "auto", "cpu")  # the cache is complete:
    F.make_feature_source(cfg.features, frozen, train_data.dataset, SPEC, cache_dir)
    assert not frozen.loaded  # only the heads would ever load

    count_forwards["n"] = 0
    src = F.make_feature_source(cfg.features, frozen, train_data.dataset, FeatureSpec(),
                                cache_dir)
    assert not frozen.loaded and isinstance(src.rows, F.PlainRows)
    assert count_forwards["n"] == 0 and src.add_features(batch) is batch
    cfg.features.mode = "both"
    with pytest.raises(ValueError, match="'features.mode': 'both'"):
        F.make_feature_source(cfg.features, frozen, train_data.dataset, SPEC, cache_dir)


def test_cache_written_before_greedy_still_trains(train_data, target, tmp_path, count_forwards):
    """Shards from before the greedy tokens were cached are complete: the build does not
    recompute them, and the trainer's cast computes the tokens from the cached final states."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    cache = build(train_data, tmp_path / "cache")
    index = json.loads((cache / "index.json").read_text())
    for entry in index["shards"]:
        path = cache / entry["file"]
        with safe_open(str(path), framework="pt") as f:
            meta, kept = f.metadata(), {k: f.get_tensor(k) for k in f.keys() if k != "greedy"}
        save_file(kept, str(path), metadata=meta)
        entry["bytes"] = path.stat().st_size
    (cache / "index.json").write_text(json.dumps(index))
    count_forwards["n"] = 0
    build(train_data, cache)
    assert count_forwards["n"] == 0
    rows = F.CachedFeatureRows(cache, train_data.dataset, SPEC)
    batch = stack([rows[i] for i in range(BS)])
    assert "greedy" not in batch
    ref = online(target, train_data)
    assert torch.equal(F.CastFeatures(target.lm_head, SPEC)(batch)["greedy"], ref["greedy"][:BS])
    # a drafter that does not read the tokens (MLP speculator, EAGLE-1) never pays for them
    hidden_only = FeatureSpec(hidden=True)
    assert "greedy" not in F.capture(target, stack([rows[0]]), hidden_only)
    assert "greedy" not in F.CastFeatures(target.lm_head, hidden_only)(batch)
