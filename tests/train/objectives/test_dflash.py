"""DFlash objective: anchors, block mask, slot targets and metrics by hand; the training forward
equals the served proposer's forward on the same context (the check that catches a shift or
position bug); the loss falls; the export serves in the engine with identical logits."""

from __future__ import annotations

import json
import math

import pytest
import torch

from infer.engine import LLM
from infer.models.loader import load_model
from infer.models.output import ModelOutput
from infer.proposers.base import DraftBatch, VerifiedStep
from train.config import TrainConfig
from train.frozen_target import target_heads
from train.objectives.base import OBJECTIVES, FeatureSpec
from train.objectives.dflash import (anchor_candidates, block_mask, sample_anchors, slot_metrics,
                                     slot_targets)
from ..conftest import adam_steps, feature_batches, method_cfg

T_, F_ = True, False
BLOCK = 4


def make_cfg(**overrides) -> TrainConfig:
    return method_cfg("dflash", **{"num_layers": 2, "block_size": BLOCK, **overrides})


@pytest.fixture(scope="module")
def env(train_data):
    target = load_model(train_data.target_dir)
    spec = FeatureSpec(aux_layer_ids=(1, 3), hidden=True, greedy=True)  # what build() asks for
    return target, target_heads(target), feature_batches(train_data, target, spec, rows=8, size=4)


def build(env, train_data, seed=0, **overrides):
    torch.manual_seed(seed)
    return OBJECTIVES.get("dflash")(make_cfg(aux_layer_ids=[1, 3], **overrides), env[1],
                                    train_data.vocab, train_data.target_dir)


# ---- layout by hand -----------------------------------------------------------------------------

def test_anchor_candidates_by_hand():
    loss = torch.tensor([[0, 1, 1, 1, 0, 1, 1]]).bool()
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, 1]])
    # a trains when x_a and x_{a+1} are loss tokens of one document
    assert anchor_candidates(loss, doc)[0].tolist() == [F_, T_, T_, F_, F_, T_, F_]
    anchors, valid = sample_anchors(anchor_candidates(loss, doc), 2, random=False)
    assert anchors.tolist() == [[1, 5]] and valid.all()
    anchors, valid = sample_anchors(anchor_candidates(loss, doc), 8, random=True)
    assert anchors[0, :3].tolist() == [1, 2, 5] and valid[0].tolist() == [T_, T_, T_]


def test_block_mask_by_hand():
    doc = torch.tensor([[0, 0, 0, 1, 1]])
    anchors = torch.tensor([[2, 4]])
    mask = block_mask(anchors, doc, 2)
    assert mask.shape == (1, 1, 4, 5 + 4)
    expected = [  # context 0..4 | block rows (a=2: 0, 1), (a=4: 0, 1)
        [T_, T_, F_, F_, F_, T_, T_, F_, F_],  # a=2 slot 0: context < 2, own block
        [T_, T_, F_, F_, F_, T_, T_, F_, F_],  # a=2 slot 1: the same (bidirectional)
        [F_, F_, F_, T_, F_, F_, F_, T_, T_],  # a=4: only index 3 (its document, < 4)
        [F_, F_, F_, T_, F_, F_, F_, T_, T_],
    ]
    assert mask[0, 0].tolist() == expected


def test_slot_targets_by_hand():
    doc = torch.tensor([[0, 0, 0, 0, 1, 1]])
    loss = torch.tensor([[1, 1, 0, 1, 1, 1]]).bool()
    anchors, valid = torch.tensor([[0, 3]]), torch.tensor([[T_, T_]])
    at, trains = slot_targets(anchors, valid, loss, doc, 4)
    # slot j reads the target state at a + j - 1 (no EAGLE shift): a=0 -> 0, 1, 2
    assert at[0].tolist() == [[0, 1, 2], [3, 4, 4]]
    # a=0: x1 loss, x2 not, x3 loss; a=3: x4 is another document, x5 too, x6 outside the row
    assert trains[0].tolist() == [[T_, F_, T_], [F_, F_, F_]]


def test_slot_metrics_by_hand():
    right = torch.tensor([[[T_, T_, F_], [T_, F_, T_]]])
    trains = torch.tensor([[[T_, T_, T_], [T_, T_, F_]]])
    m = slot_metrics(torch.zeros(1, 2, 3), right, trains)
    assert float(m["acc_0"]) == 1.0 and float(m["acc_1"]) == pytest.approx(0.5)
    assert float(m["acc_2"]) == 0.0
    assert float(m["full_acc_1"]) == pytest.approx(0.5)  # only the first anchor right at 1, 2
    assert float(m["acceptance_length_est"]) == pytest.approx(1 + 1 + 0.5 + 0)


# ---- training forward == served forward --------------------------------------------------------

def test_training_block_equals_served_block(env, train_data, tmp_path):
    """Block logits of the objective at anchor a == the engine's proposer after it took the
    context x_first .. x_{a-1} (half through prefilled, half through observe) and drafts with
    x_a pending: same positions, same mask, same keys."""
    obj = build(env, train_data, seed=3).eval()
    obj.export(tmp_path / "head")
    llm = LLM(train_data.target_dir, max_num_seqs=2, dtype="float32",
              speculative_config={"model": str(tmp_path / "head"),
                                  "num_speculative_tokens": BLOCK - 1})
    proposer = llm.proposer
    batch = next(b for b in env[2] if int(b["doc_ids"][0].max()) >= 1)
    batch = {k: v[:1] for k, v in batch.items()}
    doc, ids = batch["doc_ids"][0], batch["input_ids"][0]
    start2 = int((doc == 1).nonzero()[0])
    anchors = torch.tensor([[5, start2 + 6, start2 + 1]])
    with torch.no_grad():
        train_logits = obj.drafter.logits(obj.block_hidden(batch, anchors))[0]  # [A, Bk-1, Vd]
    width = env[0].config.hidden_size
    for i, a in enumerate(anchors[0].tolist()):
        first = int((doc == doc[a]).nonzero()[0])
        aux = batch["aux"][:, first:a].split(width, dim=-1)  # per layer [1, n, H]
        half = (a - first) // 2
        proposer.prefilled([1], [half], ModelOutput(None, None, tuple(x[:, :half] for x in aux)))
        rest = ModelOutput(None, None, tuple(x[:, half:] for x in aux))
        proposer.observe(VerifiedStep([1], [0], [[0] * (a - first - half)], rest))
        served = proposer.drafter.logits(proposer.block_hidden(
            DraftBatch([1], [ids[first:a + 1].tolist()], BLOCK - 1)))
        torch.testing.assert_close(served[0], train_logits[i], atol=2e-5, rtol=1e-4)


# ---- training and export -----------------------------------------------------------------------

def test_loss_falls_and_export_serves(env, train_data, tmp_path):
    obj = build(env, train_data)
    obj.eval()
    with torch.no_grad():
        before = sum(float(obj(b).loss) for b in env[2])
    adam_steps(obj, env[2], steps=30)
    with torch.no_grad():
        out = [obj(b) for b in env[2]]
    assert sum(float(o.loss) for o in out) < 0.85 * before
    m = out[0].metrics
    assert {"acc_0", "full_acc_2", "loss/slot_1", "acceptance_length_est"} <= set(m)
    assert float(m["acceptance_length_est"]) == pytest.approx(
        1 + sum(math.prod(float(m[f"acc_{j}"]) for j in range(i + 1)) for i in range(3)),
        rel=1e-5)
    path = obj.export(tmp_path / "head")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["block_size"] == BLOCK
    assert cfg["aux_hidden_state_layer_ids"] == [1, 3]
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == BLOCK - 1
    assert obj.speculative_config(path, 10) == {"method": "dflash", "model": str(path),
                                                "num_speculative_tokens": BLOCK - 1}
    # served: greedy output equals plain decoding
    prompts = ["def add(a, b):\n", "for i in range(10):\n    pri", "class Point:\n"]
    from infer.sampling import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = LLM(train_data.target_dir, max_num_seqs=2).generate(prompts, params)
    llm = LLM(train_data.target_dir, max_num_seqs=2, speculative_config={"model": str(path)})
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    metrics = llm.get_metrics()  # a trained head: drafts are accepted, so rollback is exercised
    assert metrics["num_draft_tokens"] > 0 and metrics["num_accepted_tokens"] > 0, metrics


def test_default_mask_token_and_aux_ids(env, train_data):
    obj = build(env, train_data)
    cfg = obj.drafter.config
    assert train_data.vocab.counts[cfg.mask_token_id] == 0  # never a training target
    torch.manual_seed(0)
    default = OBJECTIVES.get("dflash")(make_cfg(), env[1], train_data.vocab, train_data.target_dir)
    assert list(default.drafter.aux_layer_ids) == [2]  # 4 layers, 2 draft layers: z-lab [1, 1]
    assert "mask_hidden" not in obj.drafter.state_dict()


def test_bad_aux_ids_name_the_key(env, train_data):
    for ids in ([1, 9], [3, -2], [-6]):  # -2 = 3 on this 4-layer target; -6 is below 0
        with pytest.raises(ValueError, match=r"drafter\.aux_layer_ids"):
            OBJECTIVES.get("dflash")(make_cfg(aux_layer_ids=ids), env[1], train_data.vocab,
                                     train_data.target_dir)
    obj = OBJECTIVES.get("dflash")(make_cfg(aux_layer_ids=[-1]), env[1], train_data.vocab,
                                   train_data.target_dir)
    assert list(obj.drafter.aux_layer_ids) == [4]  # negative ids count from the end
