"""DSpark objective: the Markov-corrected slot logits and the confidence target by hand; the
loss falls and the confidence head learns the acceptance it predicts; the export serves in the
engine greedy-identically."""

from __future__ import annotations

import json

import pytest
import torch

from infer.engine import LLM
from infer.models.loader import load_model
from infer.sampling import SamplingParams
from train.config import TrainConfig
from train.frozen_target import target_heads
from train.objectives.base import OBJECTIVES, FeatureSpec
from train.objectives.dflash import anchor_candidates, sample_anchors, slot_targets
from train.objectives.dspark import acceptance, previous_tokens
from ..conftest import adam_steps, feature_batches, method_cfg

BLOCK = 4


def make_cfg(**overrides) -> TrainConfig:
    return method_cfg("dspark", **{"num_layers": 2, "block_size": BLOCK, "markov_rank": 16,
                                   "aux_layer_ids": [1, 3], **overrides})


@pytest.fixture(scope="module")
def env(train_data):
    target = load_model(train_data.target_dir)
    spec = FeatureSpec(aux_layer_ids=(1, 3), hidden=True, greedy=True)
    return target, target_heads(target), feature_batches(train_data, target, spec, rows=8, size=4)


def build(env, train_data, seed=0, **overrides):
    torch.manual_seed(seed)
    return OBJECTIVES.get("dspark")(make_cfg(**overrides), env[1], train_data.vocab,
                                    train_data.target_dir)


def test_markov_head_starts_at_zero_and_shifts_each_slot_by_its_previous_token(env, train_data):
    obj = build(env, train_data)
    assert not obj.drafter.markov_head.markov_w2.weight.any()  # starts as DFlash
    batch = env[2][0]
    anchors, valid = sample_anchors(anchor_candidates(batch["loss_mask"].bool(),
                                                      batch["doc_ids"]), 4, random=False)
    at, _ = slot_targets(anchors, valid, batch["loss_mask"].bool(), batch["doc_ids"], BLOCK)
    with torch.no_grad():
        obj.drafter.markov_head.markov_w2.weight.normal_()
        h = obj.block_hidden(batch, anchors)  # [B, A, Bk-1, H]
        got = obj.slot_logits(h, batch["input_ids"], at)
    ids = batch["input_ids"]
    b, a, s = at.shape
    w1 = obj.drafter.markov_head.markov_w1.weight
    w2 = obj.drafter.markov_head.markov_w2.weight
    for row, anchor, slot in [(0, 0, 0), (1, 2, 2), (0, 3, 1)]:
        prev = int(ids[row, at[row, anchor, slot]])
        if slot == 0:
            assert prev == int(ids[row, anchors[row, anchor]])  # slot 1 reads the anchor
        want = obj.drafter.logits(h[row, anchor, slot]) + w2 @ w1[prev]
        torch.testing.assert_close(got[row, anchor, slot], want, atol=1e-5, rtol=1e-5)
    assert previous_tokens(ids, at).shape == (b, a, s)


def test_acceptance_is_the_overlap_of_the_two_laws():
    p = torch.tensor([[0.5, 0.3, 0.2]])
    q_logits = torch.log(torch.tensor([[0.2, 0.3, 0.5]]))
    assert float(acceptance(p.log(), q_logits)[0]) == pytest.approx(0.2 + 0.3 + 0.2)
    assert float(acceptance(p.log(), p.log())[0]) == pytest.approx(1.0)


def test_loss_falls_the_confidence_learns_and_the_export_serves(env, train_data, tmp_path):
    obj = build(env, train_data)
    with torch.no_grad():
        first = [obj.eval()(b) for b in env[2]]
    adam_steps(obj, env[2], steps=40)
    with torch.no_grad():
        out = [obj.eval()(b) for b in env[2]]
    assert sum(float(o.loss) for o in out) < 0.85 * sum(float(o.loss) for o in first)
    err = [sum(float(o.metrics["confidence_error"]) for o in r) for r in (first, out)]
    assert err[1] < 0.7 * err[0]  # |sigmoid(conf) - sum min(p, q)| over the slots that train
    assert {"loss/confidence", "acc_0", "eal"} <= set(out[0].metrics)
    path = obj.export(tmp_path / "head")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dspark" and cfg["markov_rank"] == 16
    assert obj.speculative_config(path, 10) == {"method": "dspark", "model": str(path),
                                                "num_speculative_tokens": BLOCK - 1}
    prompts = ["def add(a, b):\n", "for i in range(10):\n    pri", "class Point:\n"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = LLM(train_data.target_dir, max_num_seqs=2).generate(prompts, params)
    llm = LLM(train_data.target_dir, max_num_seqs=2, speculative_config={"model": str(path)})
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    assert llm.get_metrics()["num_accepted_tokens"] > 0


def test_without_a_confidence_head_nothing_is_added(env, train_data):
    obj = build(env, train_data, confidence_head=False)
    assert obj.drafter.confidence_head is None
    out = obj(env[2][0])
    assert "loss/confidence" not in out.metrics and torch.isfinite(out.loss)
