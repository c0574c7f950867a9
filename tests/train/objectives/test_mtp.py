"""MTP objective (FastMTP): the unroll equals the engine's MTP chain on the same inputs, the
loss is step-weighted cross-entropy to x_{t+2+s} and falls, the stitched export loads back to
identical drafts, serves greedy-identically, and starts a later run (init_from)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from infer.drafters.mtp import MTPDrafter
from infer.engine import LLM
from infer.kv_cache import KVCache
from infer.models.loader import load_model
from infer.sampling import SamplingParams
from train.frozen_target import target_heads
from train.objectives.base import OBJECTIVES, FeatureSpec
from train.objectives.ttt import step_valid
from train.stitch import mimo_config
from ..conftest import adam_steps, feature_batches
from .test_eagle3 import make_cfg


@pytest.fixture(scope="module")
def env(train_data):
    """The Llama train target, its heads, and batches with its pre-final-norm stream."""
    target = load_model(train_data.target_dir)
    spec = FeatureSpec(aux_layer_ids=(target.config.num_layers,))
    batches = feature_batches(train_data, target, spec, rows=len(train_data.dataset), size=4)
    return target, target_heads(target), batches


def build(env, train_data, seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = make_cfg("mtp", step_weight=0.6, **overrides)
    return OBJECTIVES.get("mtp")(cfg, env[1], train_data.vocab, train_data.target_dir)


@pytest.fixture(scope="module")
def trained(env, train_data):
    obj = build(env, train_data)
    before = _loss(obj, env[2])
    adam_steps(obj, env[2], steps=40)
    return obj, before, _loss(obj, env[2])


def _loss(obj, batches) -> float:
    obj.eval()
    with torch.no_grad():
        return sum(float(obj(b).loss) for b in batches) / len(batches)


def test_starts_from_the_last_layer_and_trains_only_the_mtp_layer(env, train_data):
    obj = build(env, train_data)
    assert obj.feature_spec() == FeatureSpec(aux_layer_ids=(env[0].config.num_layers,))
    layer, last = obj.drafter.mtp_layers[0], env[0].layers[-1]
    assert torch.equal(layer.mlp.down_proj.weight, last.mlp.down_proj.weight)
    assert torch.count_nonzero(layer.self_attn.q_proj.bias) == 0
    assert torch.equal(layer.final_layernorm.weight, env[0].norm.weight)
    names = {n for n, p in obj.named_parameters() if p.requires_grad}
    assert names and all(n.startswith("drafter.mtp_layers.0.") for n in names)


def test_unroll_equals_the_engine_chain(env, train_data):
    """Step s of the unroll at anchor t == the cached drafter after a catch-up over the pairs
    up to t and s single-pair steps fed its own output: what MTPProposer does."""
    obj = build(env, train_data, seed=3).eval()
    batch = next(b for b in env[2] if int(b["doc_ids"][0].max()) >= 1)
    batch = {k: v[:1] for k, v in batch.items()}
    docs, ids, feats = batch["doc_ids"][0], batch["input_ids"][0], batch["aux"]
    drafter = obj.drafter
    with torch.no_grad():
        chain = [logits[0] for logits, _ in obj.unroll(batch)]  # steps x [T, V]
        second = int((docs == 1).nonzero()[0])
        for anchor in (0, 3, second + 2):  # 0: the zeroed embedding at position 0
            first = int((docs == docs[anchor]).nonzero()[0])
            cache = KVCache.for_model(drafter.layer_config, 1, 256)
            logits, o = drafter(ids[first + 1:anchor + 2][None], feats[:, first:anchor + 1],
                                cache, logits_at=torch.tensor([[anchor - first]]))
            for s in range(obj.ttt_steps):
                if s:
                    logits, o = drafter(ids[anchor + 1 + s].view(1, 1), o, cache)
                torch.testing.assert_close(logits[0, 0], chain[s][anchor], atol=2e-5, rtol=1e-4)


def test_loss_is_step_weighted_cross_entropy(env, train_data):
    obj = build(env, train_data, seed=1).eval()
    batch = env[2][0]
    ids, mask, docs = batch["input_ids"], batch["loss_mask"].bool(), batch["doc_ids"]
    with torch.no_grad():
        out = obj(batch)
        expected = 0.0
        for s, (logits, _) in enumerate(obj.unroll(batch)):
            n = ids.shape[1] - 2 - s
            ce = F.cross_entropy(logits[:, :n].transpose(1, 2), ids[:, 2 + s:], reduction="none")
            valid = step_valid(mask, docs, s)[:, :n]
            expected += 0.6 ** s * (ce * valid).sum() / valid.sum()
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-5)
    assert set(out.metrics) >= {"ce/step_0", "full_acc_2", "acceptance_length_est"}


def test_loss_falls(trained):
    _, before, after = trained
    assert after < 0.8 * before


def test_stitched_export(trained, env, train_data, tmp_path):
    """A MiMo copy of the Llama target: same body (zero q/k/v biases), the layer under its
    native names and alone in mtp_layers/; it loads back to identical drafts, serves greedy-
    identically as {"method": "mtp"}, and a new run starts from it."""
    obj = trained[0].eval()
    path = obj.export(tmp_path / "final")
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["MiMoForCausalLM"] and raw["model_type"] == "qwen2"
    assert raw["num_nextn_predict_layers"] == 1
    tensors = load_file(path / "model.safetensors")
    assert torch.count_nonzero(tensors["model.layers.0.self_attn.q_proj.bias"]) == 0
    alone = load_file(path / "mtp_layers" / "mtp_layers.safetensors")
    assert set(alone) == {k for k in tensors if k.startswith("model.mtp_layers.0.")}
    assert (path / "tokenizer.json").is_file()
    body = load_model(path)
    with torch.no_grad():
        ids = env[2][0]["input_ids"][:1, :16]
        torch.testing.assert_close(body.forward_train(ids).logits,
                                   env[0].forward_train(ids).logits)
    loaded = MTPDrafter.from_target(path)
    loaded.attach_target(env[1])
    batch = env[2][1]
    with torch.no_grad():
        mine = [x[0] for x in obj.unroll(batch)]
        obj.drafter, kept = loaded, obj.drafter
        theirs = [x[0] for x in obj.unroll(batch)]
        obj.drafter = kept
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert OBJECTIVES.get("mtp").served_config(path) == {"method": "mtp", "model": str(path)}
    prompts = ["def mean(xs):\n", "with open(path) as f:\n"]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    base = LLM(train_data.target_dir, max_num_seqs=2).generate(prompts, params)
    for model in (train_data.target_dir, str(path)):  # the original target, or the stitched one
        spec = {"method": "mtp", "model": str(path), "num_speculative_tokens": 2}
        llm = LLM(model, speculative_config=spec, max_num_seqs=2)
        assert [o.token_ids for o in llm.generate(prompts, params)] == [b.token_ids for b in base]
    resumed = build(env, train_data, seed=7, init_from=str(path)).eval()
    with torch.no_grad():
        torch.testing.assert_close(resumed(batch).loss, obj(batch).loss)


def test_mimo_config_refuses_what_qwen2_cannot_express():
    base = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8,
            "num_attention_heads": 2}
    assert mimo_config(base, 1)["model_type"] == "qwen2"
    for bad in ({"attention_bias": True}, {"model_type": "qwen3"}, {"head_dim": 16}):
        with pytest.raises(Exception, match="stitch|Qwen2|model_type"):
            mimo_config({**base, **bad}, 1)
