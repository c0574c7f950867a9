"""Any target through transformers (train/hf_target.py, infer/models/foreign.py): the features
equal the engine's where both run the target, and architectures the engine lacks train."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from infer.models.foreign import engine_gap, foreign_config, target_config
from infer.models.loader import load_model
from train.config import TrainConfig
from train.features import capture
from train.hf_target import TransformersTarget, doc_segments
from train.objectives.base import FeatureSpec
from train.pipeline import run

from .conftest import FOREIGN, chat_rows, save_train_target
from .test_config import compose_train


def packed_batch(vocab: int) -> dict[str, torch.Tensor]:
    """Two packed rows: three documents and a pad document; two documents."""
    docs = torch.tensor([[0] * 5 + [1] * 9 + [2] * 3 + [3] * 3, [0] * 12 + [1] * 8])  # [2, 20]
    positions = torch.zeros_like(docs)
    for row, start, stop in doc_segments(docs):
        positions[row, start:stop] = torch.arange(stop - start)
    ids = torch.randint(0, vocab, docs.shape, generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "position_ids": positions, "doc_ids": docs}


def test_doc_segments_are_the_runs_of_equal_ids():
    assert doc_segments(torch.tensor([[0, 0, 1, 1, 1, 2], [4, 4, 4, 4, 4, 4]])) == [
        (0, 0, 2), (0, 2, 5), (0, 5, 6), (1, 0, 6)]


def test_transformers_features_equal_the_engines(train_target):
    """The same Llama through the engine's model and through transformers: every residual
    stream (embeddings, a middle one, the last layer's output before the norm) and the final
    hidden state agree on packed rows (documents kept apart)."""
    spec = FeatureSpec(aux_layer_ids=(0, 2, 4), hidden=True)
    batch = packed_batch(300)
    native = capture(load_model(train_target, dtype="float32"), batch, spec)
    hf = TransformersTarget(AutoModelForCausalLM.from_pretrained(train_target,
                                                                 dtype=torch.float32))
    through = capture(hf, batch, spec)
    assert through["aux"].shape == native["aux"].shape == (2, 20, 3 * 64)
    torch.testing.assert_close(through["aux"], native["aux"], atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(through["hidden"], native["hidden"], atol=1e-4, rtol=1e-3)


@pytest.fixture(scope="module", params=FOREIGN)
def foreign_target(request, tmp_path_factory):
    return request.param, save_train_target(tmp_path_factory.mktemp(request.param),
                                            arch=request.param)


def test_the_engine_says_why_it_cannot_run_a_foreign_target(train_target, foreign_target):
    _, path = foreign_target
    assert engine_gap(train_target) is None
    assert "architectures" in engine_gap(path)
    cfg = target_config(path)  # the sizes a drafter is shaped from
    hf = json.loads(open(f"{path}/config.json").read())
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) \
        == (hf["vocab_size"], 64, 4, 4, 2)
    assert cfg.architecture == hf["architectures"][0] and cfg.eos_token_ids


def test_gemma3_drafters_copy_the_full_attention_rope():
    hf = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 8, "hidden_size": 4,
          "num_hidden_layers": 2, "num_attention_heads": 1, "rope_parameters": {
              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
              "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}
    assert foreign_config(hf).rope.theta == 1e6
    phi = {**hf, "rope_parameters": {"rope_type": "longrope", "rope_theta": 5e5}}
    assert foreign_config(phi).rope.theta == 5e5  # a rope the engine lacks: plain at its theta


def test_foreign_features_are_each_documents_own(foreign_target):
    """Each document of a packed row gets what transformers computes for it alone (its own
    positions; sliding layers too: the document is longer than the window)."""
    _, path = foreign_target
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = packed_batch(300)
    got = capture(TransformersTarget(model), batch, FeatureSpec(aux_layer_ids=(1, 3),
                                                               hidden=True))
    with torch.no_grad():  # row 0's second document (9 tokens), alone
        alone = model(batch["input_ids"][:1, 5:14], output_hidden_states=True).hidden_states
    want = torch.cat([alone[1], alone[3]], dim=-1)  # [1, 9, 2 * H]
    torch.testing.assert_close(got["aux"][:1, 5:14], want, atol=1e-4, rtol=1e-3)
    torch.testing.assert_close(got["hidden"][:1, 5:14], alone[-1], atol=1e-4, rtol=1e-3)


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in chat_rows(24, seed=5)))
    return str(path)


@pytest.mark.slow
def test_a_foreign_target_trains_end_to_end(tmp_path, foreign_target, chat_file, capsys):
    """train.py on an architecture the engine lacks: answers regenerated through transformers'
    generate, features through transformers (online, or an offline cache for one of them), an
    EAGLE-3 head trained and exported; the run says which path it took and why, and skips the
    engine's evaluation with where to serve the head instead."""
    arch, path = foreign_target
    mode = ["features.mode=offline", "features.dtype=float32"] if arch == "olmo2" else [
        "features.mode=online"]
    cfg: TrainConfig = OmegaConf.to_object(compose_train([
        "recipe=tiny_eagle3", f"output_dir={tmp_path}", f"target.path={path}",
        f"data.source={chat_file}", "data.max_length=96", "trainer.max_steps=3",
        "trainer.micro_batch_size=2", "trainer.device=cpu", "logger.kind=none",
        "regenerate.num_examples=4", "regenerate.max_tokens=6", "regenerate.batch_size=3",
        "drafter.draft_vocab_size=128", "drafter.token_map_size=64", "objective.ttt_steps=2",
        *mode]))
    final = run(cfg).final_dir
    out = capsys.readouterr().out
    assert "regeneration through transformers' generate" in out
    assert "target features through transformers (draftsmith's engine does not run it" in out
    assert "evaluation skipped" in out
    config = json.loads((final / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["transformer_layer_config"]["hidden_size"] == 64
    rows = [json.loads(line) for line in
            open(tmp_path / "tiny_eagle3" / "regenerated" / "chunk_00000.jsonl")]
    assert len(rows) == 4


def test_a_foreign_targets_head_is_evaluated_on_vllm(tmp_path, chat_file, monkeypatch, capsys):
    """With eval.engine=vllm the end-of-run harness runs for a target the engine lacks: the
    exported head's served config goes to vLLM (faked here: the real one is
    tests/infer/eval/test_vllm_engine.py's), the report is written instead of skipped."""
    from infer.eval import harness
    from infer.eval.vllm_engine import VllmEngine, VllmResult
    from infer.metrics import SpecMetrics

    path = save_train_target(tmp_path / "gemma3", arch="gemma3")
    specs = []

    def fake_run(self, spec, prompt_ids, **kw):
        specs.append(spec)
        return VllmResult([[1] * kw["max_tokens"] for _ in prompt_ids], 0.1,
                          SpecMetrics(2, 6, 3, [2, 1, 0]) if spec else SpecMetrics(0, 0, 0, []))

    monkeypatch.setattr(VllmEngine, "run", fake_run)
    monkeypatch.setattr(harness, "vllm_has_cuda", lambda python: False)
    cfg: TrainConfig = OmegaConf.to_object(compose_train([
        "recipe=tiny_eagle3", f"output_dir={tmp_path}", f"target.path={path}",
        f"data.source={chat_file}", "data.max_length=96", "trainer.max_steps=2",
        "trainer.micro_batch_size=2", "trainer.device=cpu", "logger.kind=none",
        "regenerate.enabled=false", "drafter.draft_vocab_size=128",
        "drafter.token_map_size=64", "objective.ttt_steps=2", "eval.engine=vllm",
        f"eval.vllm_python={sys.executable}", "eval.methods=[]", "eval.ks=[3]",
        "eval.batch_sizes=[1]", "eval.temperatures=[0.0]", "eval.num_prompts=2",
        "eval.max_tokens=4"]))
    result = run(cfg)
    assert "evaluation skipped" not in capsys.readouterr().out
    head = [s for s in specs if s]
    assert head and head[0]["method"] == "eagle3" and head[0]["model"] == str(result.final_dir)
    assert result.report.results[0].acceptance_length == pytest.approx(2.5)
