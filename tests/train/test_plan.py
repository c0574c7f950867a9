"""``plan=true`` (train/plan.py): every number against a hand computation, the disk refusal
naming ``features.cache_dir``, the planned feature spec against the built objective's, and
``python train.py plan=true`` end to end (exit 0, nothing trained, no weights read)."""

import dataclasses
import json
import math
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from infer.foundation.errors import NoSpaceError, UserError
from infer.models.llama import Llama
from infer.models.loader import load_config
from infer.models.output import FeatureSpec
from train import plan as P
from train.config import TrainerConfig
from train.objectives.base import OBJECTIVES
from train.pipeline import run

from ..infer.foundation.test_entry import assert_user_error, entry
from .conftest import TINY_RECIPES
from .test_config import compose_train

LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
            "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "rope_theta": 500000.0,
            "max_position_embeddings": 131072, "tie_word_embeddings": False}
GIB = 1024 ** 3


@pytest.fixture
def llama8b(tmp_path) -> Path:
    """A Llama-3.1-8B-shaped target directory: config.json only, no weights at all."""
    path = tmp_path / "llama8b"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(LLAMA_8B))
    return path


def cfg_of(*overrides):
    return OmegaConf.to_object(compose_train(["logger.kind=none", *overrides]))


# ---- pure functions ----------------------------------------------------------------------------

def test_llama8b_parameters_by_hand(llama8b):
    V, H, L, I, kv = 128256, 4096, 32, 14336, 8 * 128
    layer = H * H + 2 * H * kv + H * H + 3 * H * I + 2 * H  # q, k, v, o; gate/up/down; 2 norms
    assert layer == 218_112_000
    hand = V * H + L * layer + H + V * H  # embedding, layers, final norm, untied LM head
    assert hand == 8_030_261_248
    assert P.count_parameters(load_config(llama8b)) == hand


@pytest.mark.parametrize("extra", [
    {"tie_word_embeddings": True},
    {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},  # q/k/v biases
    {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": True,
     "head_dim": 24},  # q/k norms, o bias, head_dim != hidden / heads
    {"mlp_bias": True, "attention_bias": True},
])
def test_parameter_count_matches_the_model(tmp_path, extra):
    small = {**LLAMA_8B, "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 3,
             "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 80,
             **extra}
    (tmp_path / "config.json").write_text(json.dumps(small))
    config = load_config(tmp_path)
    with torch.device("meta"):
        model = Llama(config)
    assert P.count_parameters(config) == sum(p.numel() for p in model.parameters())


def test_offline_bytes_eagle3_bf16_by_hand():
    spec = FeatureSpec(aux_layer_ids=(2, 16, 29), hidden=True, greedy=True)  # what eagle3 caches
    rows, T, H = 1000, 2048, 4096
    data = rows * T * (3 * H + H) * 2  # aux [n, T, 3H] + hidden [n, T, H], bfloat16
    assert data == 67_108_864_000
    greedy = rows * T * 4  # the target's greedy tokens [n, T], int32
    shards = 4  # ceil(1000 / 256)
    assert P.cache_bytes(rows, T, spec, H, "bfloat16", 256) == \
        data + greedy + shards * P.SHARD_HEADER_BYTES
    assert P.cache_bytes(rows, T, spec, H, "float32", 256) == \
        2 * data + greedy + 4 * P.SHARD_HEADER_BYTES
    assert P.cache_bytes(rows, T, FeatureSpec(hidden=True, greedy=True), H, "float16", 1000) == \
        rows * T * H * 2 + greedy + P.SHARD_HEADER_BYTES
    assert P.cache_bytes(rows, T, FeatureSpec(hidden=True), H, "float16", 1000) == \
        rows * T * H * 2 + P.SHARD_HEADER_BYTES  # what the MLP speculator caches: no tokens
    assert P.cache_bytes(rows, T, FeatureSpec(), H, "bfloat16", 256) == 0  # nothing captured


def test_target_memory_by_hand(llama8b):
    c, spec = load_config(llama8b), FeatureSpec(aux_layer_ids=(2, 16, 29), hidden=True)
    B, T, H, I, V = 2, 2048, 4096, 14336, 128256
    m = P.target_memory(c, spec, B, T, "bfloat16")
    assert m.weights == 8_030_261_248 * 2
    assert m.captured == B * T * H * (2 * 3 + 1) * 2  # aux list + its concatenation, hidden
    acts = 2 * H + (32 + 2 * 8) * 128 + 32 * 128 + 3 * I
    assert m.forward == B * T * acts * 2 + B * 32 * T * T * 2 + B * T * T * (1 + 4) + B * V * 2
    assert m.total == m.weights + m.captured + m.forward
    assert 14.9 * GIB < m.weights < 15 * GIB  # 16.06 GB: the familiar "16 GB" of an 8B model


def test_sharded_target_memory_by_hand(llama8b, tmp_path):
    """8B over 8 ranks: a rank's eighth of every tensor, plus the gathered root (embedding and
    LM head, 2 x V x H) and two decoder layers (q, o: H^2; k, v: H x 1024; MLP 3 x H x I; two
    norms)."""
    c, H, I, V = load_config(llama8b), 4096, 14336, 128256
    layer = 2 * H * H + 2 * H * 1024 + 3 * H * I + 2 * H
    assert layer == 218_112_000
    assert P.sharded_weights(c, 8) == math.ceil(8_030_261_248 / 8) + 2 * V * H + 2 * layer
    assert P.target_memory(c, None, 1, 16, "bfloat16", 8).weights == P.sharded_weights(c, 8) * 2
    online = cfg_of(f"target.path={llama8b}", f"output_dir={tmp_path}", "trainer.device=auto")
    env = {"WORLD_SIZE": "8", "ACCELERATE_USE_FSDP": "true"}  # target.sharding=auto: FSDP
    plan = P.make_plan(online, env=env)
    assert plan.memory.shards == 8 and plan.memory.weights == P.sharded_weights(c, 8) * 2
    assert "1/8 each + gathered layers" in P.format_plan(plan, online)
    assert P.make_plan(online, env={"WORLD_SIZE": "8"}).memory.weights == 8_030_261_248 * 2


def test_steps_epochs_max_steps_accum_and_world():
    t = TrainerConfig(micro_batch_size=4, grad_accum=2, epochs=1.0)
    assert P.optimizer_steps(1000, t, 1).total == 125  # 250 micro-batches / 2
    assert P.optimizer_steps(1001, t, 1).total == 126  # 251 -> the last window is short
    assert P.optimizer_steps(1000, t, 4).total == 32  # ceil(250 / 4) = 63 per rank -> 32
    t2 = TrainerConfig(micro_batch_size=4, grad_accum=2, epochs=2.5)
    assert P.optimizer_steps(1000, t2, 1).total == 313  # ceil(2.5 * 125)
    t3 = TrainerConfig(micro_batch_size=4, grad_accum=2, max_steps=7, warmup_ratio=0.5)
    s = P.optimizer_steps(1000, t3, 1)
    assert (s.total, s.per_epoch, s.warmup) == (7, 125, 4)


def test_world_size_from_env():
    assert P.world_size({}) == 1
    assert P.world_size({"WORLD_SIZE": "8"}) == 8
    assert P.world_size({"WORLD_SIZE": "junk"}) == 1


def test_example_bound_and_cache_dir(tmp_path):
    cfg = cfg_of("data.num_examples=500", "regenerate.num_examples=200", f"output_dir={tmp_path}",
                 "regenerate.enabled=false")
    assert P.example_bound(cfg) == 500  # regeneration off: its cap does not apply
    cfg.regenerate.enabled = True
    assert P.example_bound(cfg) == 200
    assert P.feature_cache_dir(cfg) == tmp_path / cfg.name / "features"
    cfg.features.cache_dir = str(tmp_path / "elsewhere")
    assert P.feature_cache_dir(cfg) == tmp_path / "elsewhere"


def test_free_bytes_reads_the_nearest_existing_parent(tmp_path, monkeypatch):
    seen = []
    usage = namedtuple("usage", "total used free")

    def fake(path):
        seen.append(Path(path))
        return usage(100, 90, 10)

    monkeypatch.setattr(shutil, "disk_usage", fake)
    assert P.free_bytes(tmp_path / "not" / "yet") == 10
    assert seen == [tmp_path]


# ---- the plan of a config ----------------------------------------------------------------------

def test_plan_of_an_8b_config(llama8b, tmp_path, capsys):
    cfg = cfg_of(f"target.path={llama8b}", f"output_dir={tmp_path}", "data.num_examples=1000",
                 "data.max_length=2048", "features.mode=offline", "features.batch_size=2",
                 "features.dtype=bfloat16",  # the tiny default recipe caches float32
                 "trainer.max_steps=null", "trainer.epochs=1", "trainer.micro_batch_size=2",
                 "trainer.grad_accum=4", "drafter.aux_layer_ids=null", "trainer.device=auto")
    plan = P.make_plan(cfg, env={"WORLD_SIZE": "2"})
    assert plan.parameters == 8_030_261_248 and plan.spec.aux_layer_ids == (2, 16, 29)
    assert (plan.rows, plan.tokens, plan.streams) == (1000, 1000 * 2048, 4)
    assert plan.cache_bytes == 1000 * 2048 * (4 * 4096 * 2 + 4) + 4 * P.SHARD_HEADER_BYTES
    assert plan.steps.total == 63 and plan.rows_per_step == 16  # ceil(ceil(500 / 2) / 4)
    assert plan.target_dtype == "bfloat16" and plan.memory.batch == 2
    text = P.format_plan(plan, cfg)
    for needle in ("8.03 B parameters", "2.05 M tokens", "<= 63 optimizer steps",
                   "aux [2, 16, 29] + hidden = 4 stream(s) x 4096", "GiB bfloat16", "features"):
        assert needle in text, text


def test_plan_true_refuses_a_cache_that_does_not_fit(llama8b, tmp_path, monkeypatch, capsys):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(GIB, GIB - 1000, 1000))
    cache = tmp_path / "cache"
    cfg = cfg_of(f"target.path={llama8b}", f"output_dir={tmp_path}", "features.mode=offline",
                 f"features.cache_dir={cache}", "plan=true")
    with pytest.raises(NoSpaceError) as err:
        run(cfg)
    msg = str(err.value)
    assert isinstance(err.value, UserError)
    assert f"features.cache_dir='{cache}'" in msg and "1000 bytes" in msg and "GiB" in msg
    assert not cache.exists() and not (tmp_path / cfg.name).exists()  # nothing written


def test_plan_online_does_not_check_the_disk(llama8b, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(GIB, GIB, 0))
    plan = run(cfg_of(f"target.path={llama8b}", f"output_dir={tmp_path}", "plan=true",
                      "features.mode=online"))
    assert isinstance(plan, P.RunPlan) and plan.cache_bytes == 0


def test_real_run_check_counts_cached_shards(tmp_path, monkeypatch):
    spec = FeatureSpec(aux_layer_ids=(1, 2, 3), hidden=True)
    need = P.cache_bytes(10, 8, spec, 16, "bfloat16", 4)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(need, 0, need - 100))
    with pytest.raises(NoSpaceError, match="features.cache_dir"):
        P.check_offline_cache(tmp_path, 10, 8, spec, 16, "bfloat16", 4)
    (tmp_path / "shard_00000.safetensors").write_bytes(b"x" * 100)  # resumed: already there
    P.check_offline_cache(tmp_path, 10, 8, spec, 16, "bfloat16", 4)


@pytest.mark.parametrize("method,extra", [
    ("eagle3", []), ("eagle3", ["drafter.aux_layer_ids=[1,3]"]), ("peagle", []),
    ("dflash", []), ("eagle", []), ("mlp_speculator", []), ("mtp", []),
    ("pard", ["objective.kd_weight=0.5"]), ("pard", []),
])
def test_planned_spec_is_the_objectives(train_data, method, extra):
    from train.frozen_target import FrozenTarget

    target = train_data.target_dir
    cfg = cfg_of(f"recipe={TINY_RECIPES[method]}", f"target.path={target}", "trainer.device=cpu",
                 *([f"drafter.model={target}"] if method == "pard" else []), *extra)
    heads = FrozenTarget(target, "float32", "cpu").heads
    obj = OBJECTIVES.get(method)(cfg, heads, train_data.vocab, target)
    planned = OBJECTIVES.get(method).planned_feature_spec(cfg, heads.config)
    spec = obj.feature_spec()
    assert planned == dataclasses.replace(spec, aux_layer_ids=tuple(spec.aux_layer_ids))


# ---- the entry point ---------------------------------------------------------------------------

def test_train_py_plan_true_end_to_end(llama8b, tmp_path):
    out = entry("train.py", "plan=true", f"target.path={llama8b}", f"output_dir={tmp_path}",
                "logger.kind=none", "data.max_length=2048", "features.mode=offline",
                f"features.cache_dir={tmp_path / 'cache'}", "data.num_examples=100")
    assert out.returncode == 0, out.stderr
    assert "run plan of" in out.stdout and "8.03 B parameters" in out.stdout, out.stdout
    assert not (tmp_path / "cache").exists()  # no features cached
    run_dir = tmp_path / "tiny_eagle3"
    assert sorted(p.name for p in run_dir.iterdir()) == ["hydra"]  # Hydra's log, nothing else
    assert "run plan of" in next(run_dir.glob("hydra/*/train.log")).read_text()


def test_train_py_plan_refusal_is_one_line_exit_2(llama8b, tmp_path):
    out = entry("train.py", "plan=true", f"target.path={llama8b}", f"output_dir={tmp_path}",
                "logger.kind=none", "data.max_length=8192", "features.mode=offline",
                "features.dtype=float32", "data.num_examples=1000000000")  # ~ 1e18 bytes
    assert_user_error(out, "train.py", "features.cache_dir=", "GiB", "are free there")
