"""A frozen target sharded across the ranks (train/frozen_target.py): FSDP2 and DeepSpeed
ZeRO-3, each run for real with two CPU processes (gloo) under ``accelerate launch``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from infer.foundation.errors import ConfigError
from infer.models.loader import load_model
from train.config import TargetSharding
from train.frozen_target import (FrozenTarget, load_sharded, load_target_heads,
                                 resolve_sharding, zero3_config)

from .conftest import chat_rows
from .test_config import compose_train
from .test_trainer import REPO, _free_port

SHARDED = [TargetSharding.fsdp, TargetSharding.zero3]


def launch(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file conf/accelerate/cpu_2proc.yaml ARGS`` (two ranks)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "ACCELERATE_LOG_LEVEL": "error"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "conf/accelerate/cpu_2proc.yaml"), "--main_process_port",
           str(_free_port()), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def test_auto_follows_the_accelerate_launch():
    fsdp = {"ACCELERATE_USE_FSDP": "true"}
    zero3 = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}
    zero2 = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}
    assert resolve_sharding("auto", 8, fsdp) == TargetSharding.fsdp
    assert resolve_sharding("auto", 8, zero3) == TargetSharding.zero3
    assert resolve_sharding("auto", 8, zero2) == TargetSharding.none  # optimizer-only sharding
    assert resolve_sharding("auto", 8, {}) == TargetSharding.none  # DDP
    assert resolve_sharding("none", 8, fsdp) == TargetSharding.none
    assert resolve_sharding("zero3", 8, {}) == TargetSharding.zero3  # explicit wins
    assert resolve_sharding("fsdp", 1, fsdp) == TargetSharding.none  # one process: whole


def test_heads_equal_target_untied_and_tied(train_target, tmp_path):
    target = load_model(train_target, dtype="float32")
    heads = load_target_heads(train_target, "float32", "cpu")
    assert torch.equal(heads.embed_tokens.weight, target.embed_tokens.weight)
    assert torch.equal(heads.lm_head.weight, target.lm_head.weight)
    assert not torch.equal(heads.lm_head.weight, heads.embed_tokens.weight)
    assert not any(p.requires_grad for p in (heads.embed_tokens.weight, heads.lm_head.weight))
    assert heads.config == target.config
    bf16 = load_target_heads(train_target, "bfloat16", "cpu")
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(bf16.lm_head.weight, target.lm_head.weight.bfloat16())

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tied")
    with safe_open(str(tmp_path / "tied" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # tied: only the embedding is stored
    tied, ref = load_target_heads(tmp_path / "tied"), load_model(tmp_path / "tied")
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert torch.equal(tied.lm_head.weight, ref.lm_head.weight)
    assert tied.lm_head(torch.ones(2, 32)).shape == (2, 96)


def launch_env(config: Path, *extra: str):
    """What ``accelerate launch --config_file CONFIG [EXTRA] train.py`` hands torchrun: its
    parsed arguments and the workers' environment (built by accelerate's own launcher code)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config), *extra, "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    if not args.use_deepspeed:
        return args, prepare_multi_gpu_env(args)
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
    return args, prepare_deepspeed_cmd_env(args)[1]


@pytest.mark.parametrize("name, expected", [
    ("cpu_2proc", "none"), ("ddp_8gpu", "none"), ("deepspeed_zero2_8gpu", "none"),
    ("deepspeed_zero3_8gpu", "zero3"), ("fsdp_8gpu", "fsdp"), ("fsdp_2nodes_16gpu", "fsdp")])
def test_each_accelerate_config_shards_the_target_as_its_comment_says(name, expected):
    args, env = launch_env(REPO / "conf" / "accelerate" / f"{name}.yaml")
    assert resolve_sharding("auto", args.num_processes, env) == TargetSharding(expected)
    assert "target.sharding" in (REPO / "conf" / "accelerate" / f"{name}.yaml").read_text() \
        or expected == "none"


def test_the_two_node_config_gives_torchrun_a_static_rendezvous():
    args, _ = launch_env(REPO / "conf/accelerate/fsdp_2nodes_16gpu.yaml", "--machine_rank", "1")
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("2", "8", 1)
    assert (args.rdzv_endpoint, args.rdzv_backend) == ("10.0.0.1:29500", "static")


def test_zero3_config_follows_the_target_dtype():
    cfg = zero3_config(4096, torch.bfloat16)
    assert cfg["bf16"]["enabled"] and not cfg["fp16"]["enabled"]
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 40960
    assert not zero3_config(64, torch.float32)["bf16"]["enabled"]


def test_a_sharded_load_without_a_process_group_says_how_to_launch(train_target):
    with pytest.raises(RuntimeError, match="accelerate launch"):
        load_sharded(train_target, "float32", torch.device("cpu"), TargetSharding.fsdp)


def test_served_evaluation_is_refused_with_a_sharded_target(tmp_path, train_target):
    """The engine would run the target on the main process alone: every other rank would be
    missing from its all-gathers (a hang), so the key is refused by name."""
    from train.served_eval import ServedEval

    cfg = OmegaConf.to_object(compose_train([f"output_dir={tmp_path}", "eval.every_steps=5"]))
    target = FrozenTarget(train_target, "float32", "cpu", TargetSharding.fsdp)
    with pytest.raises(ConfigError, match="eval.every_steps") as err:
        ServedEval.from_config(cfg, None, target)
    assert "target.sharding=fsdp" in str(err.value)
    assert not target.loaded


@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDED, ids=lambda s: s.value)
def test_two_ranks_hold_half_the_target_and_capture_its_exact_features(tmp_path, train_target,
                                                                       sharding):
    """tests/train/frozen_target_two_procs.py on two ranks: each holds half of every decoder
    weight (FSDP also keeps its root, embedding and LM head, gathered after a forward), the
    heads stay whole; online features and an offline cache built with the sharded target equal
    the replicated model's bit for bit; the uneven shard split (2 vs 1) runs in lockstep (both
    ranks: 4 forwards), and a deleted shard is recomputed alone on resume."""
    launch(str(Path(__file__).with_name("frozen_target_two_procs.py")), train_target,
           str(tmp_path), sharding.value)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"{sharding.value}_rank{rank}.json").read_text())
        assert got["world"] == 2
        layers = {k: v for k, v in got["held"].items() if k.startswith("layers.")}
        assert len(layers) == 4 * 7 and set(layers.values()) == {0.5}, layers
        root = {got["held"]["embed_tokens.weight"], got["held"]["lm_head.weight"]}
        assert root == ({1.0} if sharding == TargetSharding.fsdp else {0.5})
        assert got["heads"] == [[352, 64], [352, 64]]  # the objective's heads: whole
        assert got["online_diff"] == 0.0 and got["offline_diff"] == 0.0
        assert got["build_forwards"] == 4 and got["resume_forwards"] == 2
        assert got["rewritten"] == ["shard_00001.safetensors"] and got["resumed_diff"] == 0.0


@pytest.fixture
def chat_file(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in chat_rows(48, seed=3)))
    return path


@pytest.mark.slow
def test_train_py_on_two_ranks_with_a_sharded_target_trains_the_same_head(tmp_path,
                                                                         train_target,
                                                                         chat_file):
    """``accelerate launch ... train.py``: the replicated target (online), FSDP (online) and
    ZeRO-3 (offline cache) export the same EAGLE-3 head, bit for bit."""
    base = ["train.py", "recipe=tiny_eagle3", f"target.path={train_target}",
            f"data.source={chat_file}", "data.max_length=128", "drafter.draft_vocab_size=128",
            "trainer.max_steps=4", "trainer.micro_batch_size=2", "trainer.device=cpu",
            "logger.kind=none", "eval.enabled=false", "objective.ttt_steps=2"]
    runs = {"none": [], "fsdp": [], "zero3": ["features.mode=offline", "features.dtype=float32",
                                              "features.rows_per_shard=4"]}
    heads = {}
    for name, extra in runs.items():
        out = launch(*base, f"output_dir={tmp_path / name}", f"target.sharding={name}", *extra)
        said = f"target sharded across 2 ranks ({name})" in out.stdout
        assert said == (name != "none"), out.stdout[-2000:]
        heads[name] = load_file(tmp_path / name / "tiny_eagle3" / "final" / "model.safetensors")
    for name in ("fsdp", "zero3"):
        assert heads[name].keys() == heads["none"].keys()
        for k, v in heads["none"].items():
            assert torch.equal(heads[name][k], v), (name, k)


@pytest.mark.slow
def test_a_target_through_transformers_shards_the_same_way(tmp_path, chat_file):
    """An architecture the engine lacks (Gemma 3, through transformers) on two ranks: FSDP
    (online) and ZeRO-3 (offline cache) export the replicated run's head, bit for bit."""
    from .conftest import save_train_target

    target = save_train_target(tmp_path / "gemma3", arch="gemma3")
    base = ["train.py", "recipe=tiny_eagle3", f"target.path={target}",
            f"data.source={chat_file}", "data.max_length=128", "drafter.draft_vocab_size=128",
            "trainer.max_steps=3", "trainer.micro_batch_size=2", "trainer.device=cpu",
            "logger.kind=none", "eval.enabled=false", "objective.ttt_steps=2",
            "regenerate.enabled=false"]
    runs = {"none": [], "fsdp": [], "zero3": ["features.mode=offline", "features.dtype=float32",
                                              "features.rows_per_shard=4"]}
    heads = {}
    for name, extra in runs.items():
        out = launch(*base, f"output_dir={tmp_path / name}", f"target.sharding={name}", *extra)
        assert "target features through transformers" in out.stdout, out.stdout[-2000:]
        said = f"target sharded across 2 ranks ({name})" in out.stdout
        assert said == (name != "none"), out.stdout[-2000:]
        heads[name] = load_file(tmp_path / name / "tiny_eagle3" / "final" / "model.safetensors")
    for name in ("fsdp", "zero3"):
        for k, v in heads["none"].items():
            assert torch.equal(heads[name][k], v), (name, k)
