"""EAGLE-1 objective: the unroll equals the inference chain, the loss is the weighted sum of
SmoothL1 and KL per step, it falls, and the export round-trips and serves greedy-identically."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from infer.drafters.eagle import EagleDrafter
from infer.engine import LLM
from infer.kv_cache import KVCache
from infer.sampling import SamplingParams
from train.objectives.ttt import step_valid, target_rows, ttt_attention_mask
from .test_eagle3 import build, make_env, train_briefly


@pytest.fixture(scope="module")
def env(train_data):
    return make_env(train_data)


@pytest.fixture(scope="module")
def trained(env, train_data):
    return train_briefly("eagle", env, train_data)


def test_feature_spec_and_shared_heads(env, train_data):
    obj = build("eagle", env, train_data)
    assert obj.feature_spec().hidden and obj.feature_spec().aux_layer_ids == ()
    assert obj.drafter.lm_head is env[1].lm_head and obj.drafter.embed_tokens is env[1].embed_tokens
    names = {n for n, _ in obj.named_parameters()}
    assert names and all(n.startswith("drafter.") for n in names)  # target pieces not owned
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)


def test_unroll_equals_cached_inference_chain(env, train_data):
    obj = build("eagle", env, train_data, seed=4).eval()
    batch = next(b for b in env[2] if int(b["doc_ids"][0].max()) >= 1)
    batch = {k: v[:1] for k, v in batch.items()}
    docs, ids, feats = batch["doc_ids"][0], batch["input_ids"][0], batch["hidden"]
    drafter, steps = obj.drafter, obj.ttt_steps
    with torch.no_grad():
        chain = [logits[0] for logits, _ in obj.unroll(batch)]  # steps x [T, V]
        start2 = int((docs == 1).nonzero()[0])
        for anchor in (2, start2 + 3):
            first = int((docs == docs[anchor]).nonzero()[0])
            cache = KVCache.for_model(drafter.layer_config, 1, 256)
            logits, h = drafter(ids[first + 1:anchor + 2][None], feats[:, first:anchor + 1], cache,
                                logits_at=torch.tensor([[anchor - first]]))
            for s in range(steps):
                if s:
                    logits, h = drafter(ids[anchor + 1 + s].view(1, 1), h, cache)
                torch.testing.assert_close(logits[0, 0], chain[s][anchor], atol=2e-5, rtol=1e-4)


def test_loss_is_weighted_regression_plus_kl(env, train_data):
    """Recompute step 1's loss by hand from the unroll: SmoothL1 to f_{t+2} + 0.1 KL against the
    target at t + 2, averaged over the valid anchors; total = sum_s 0.8 ** s * loss_s."""
    obj = build("eagle", env, train_data, step_weight=0.8, ce_weight=0.1).eval()
    batch = env[2][0]
    with torch.no_grad():
        out = obj(batch)
        logits, hidden = list(obj.unroll(batch))[1]  # step 1: [B, T, V], [B, T, H]
        n = batch["input_ids"].shape[1] - 2
        f = batch["hidden"][:, 2:]  # f_{t+2}
        reg = F.smooth_l1_loss(hidden[:, :n], f, reduction="none").mean(-1)  # [B, n]
        p = torch.softmax(env[1].lm_head(f), -1)
        kl = (p * (p.log() - torch.log_softmax(logits[:, :n], -1))).sum(-1)
        valid = step_valid(batch["loss_mask"], batch["doc_ids"], 1)[:, :n]
        expected = ((reg + 0.1 * kl) * valid).sum() / valid.sum()
    torch.testing.assert_close(out.metrics["loss/step_1"], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.metrics["regression/step_1"], (reg * valid).sum() / valid.sum())
    steps = [out.metrics[f"loss/step_{s}"] for s in range(3)]
    torch.testing.assert_close(out.loss, steps[0] + 0.8 * steps[1] + 0.64 * steps[2])


def test_noise_on_inputs_not_on_targets(env, train_data):
    obj = build("eagle", env, train_data, feature_noise=0.3).train()
    batch = env[2][0]
    noisy = obj.features(batch)
    assert 0 < (noisy - batch["hidden"]).abs().max() <= 0.3 + 1e-6
    rows = target_rows(batch["loss_mask"])
    assert torch.equal(obj.targets(batch, rows)["hidden"], batch["hidden"][rows])
    assert torch.equal(obj.eval().features(batch), batch["hidden"])


def test_loss_falls(trained):
    obj, before, after = trained
    assert after < 0.85 * before, (before, after)


def test_export_round_trip_and_init_from(trained, env, train_data, tmp_path):
    obj = trained[0]
    path = obj.export(tmp_path / "head")
    raw = json.loads((path / "config.json").read_text())
    assert raw["model_type"] == "eagle" and raw["architectures"] == ["EagleLlamaForCausalLM"]
    loaded = EagleDrafter.from_pretrained(path)
    loaded.attach_target(env[1])
    batch = env[2][1]
    mask = ttt_attention_mask(batch["doc_ids"], 0)
    with torch.no_grad():
        mine = obj.drafter.forward_train(batch["input_ids"], batch["hidden"],
                                         batch["position_ids"], mask)
        theirs = loaded.forward_train(batch["input_ids"], batch["hidden"],
                                      batch["position_ids"], mask)
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])
    resumed = build("eagle", env, train_data, seed=7, init_from=str(path)).eval()
    with torch.no_grad():
        torch.testing.assert_close(resumed(batch).loss, obj(batch).loss)


def test_served_greedy_output_identical(trained, train_data, tmp_path):
    path = trained[0].export(tmp_path / "served")
    prompts = ["def mean(xs):\n", "with open(path) as f:\n"]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    base = LLM(train_data.target_dir, max_num_seqs=2).generate(prompts, params)
    spec = {"method": "eagle", "model": str(path), "num_speculative_tokens": 2}
    outs = LLM(train_data.target_dir, speculative_config=spec, max_num_seqs=2).generate(
        prompts, params)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
