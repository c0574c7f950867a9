"""MLP speculator objective: head/token alignment, the stage formula, loss and metrics by hand,
export -> load round trip, training lowers the loss, and the engine serves the export losslessly."""

import math

import pytest
import torch
import torch.nn.functional as F

from infer import LLM
from infer.drafters.mlp_speculator import MLPSpeculator
from infer.models.loader import load_model
from train.features import capture
from train.frozen_target import target_heads
from train.objectives.base import OBJECTIVES, FeatureSpec
from train.objectives.mlp_speculator import MLPSpeculatorObjective, shifted_targets
from ..conftest import adam_steps, feature_batches, own_continuations, method_cfg


@pytest.fixture(scope="module")
def target(train_target):
    return load_model(train_target, dtype=torch.float32)


@pytest.fixture(scope="module")
def batches(train_data, target):
    """Four micro-batches of 4 packed rows with the target's last hidden state."""
    return feature_batches(train_data, target, FeatureSpec(hidden=True), rows=16, size=4)


def make(train_target, target, vocab, **drafter):
    cfg = method_cfg("mlp_speculator", **{"n_predict": 3, "inner_dim": 32, **drafter})
    torch.manual_seed(0)
    return OBJECTIVES.get("mlp_speculator")(cfg, target_heads(target), vocab, train_target)


def test_registered_and_needs_hidden(train_target, target, train_data):
    obj = make(train_target, target, train_data.vocab)
    assert isinstance(obj, MLPSpeculatorObjective)
    assert obj.feature_spec() == FeatureSpec(hidden=True)
    assert obj.speculative_config("/x", 3) == {"method": "mlp_speculator", "model": "/x",
                                               "num_speculative_tokens": 3}


def test_shifted_targets_alignment():
    """Head i at t consumes tokens t+1..t+1+i and predicts t+2+i, inside the document only."""
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16]])
    doc = torch.tensor([[0, 0, 0, 0, 0, 1, 1]])
    mask = torch.tensor([[0, 1, 1, 0, 1, 0, 1]]).bool()
    tokens, targets, valid = shifted_targets(ids, mask, doc, 2)
    assert tokens[0, :, 0].tolist() == [11, 12, 13, 14, 15, 16, 0]
    assert tokens[0, :, 1].tolist() == [12, 13, 14, 15, 16, 0, 0]
    assert targets[0, :, 0].tolist() == [12, 13, 14, 15, 16, 0, 0]
    assert targets[0, :, 1].tolist() == [13, 14, 15, 16, 0, 0, 0]
    # head 0 at t predicts t+2: valid iff loss_mask[t+2] and doc[t+2] == doc[t]
    assert valid[0, :, 0].tolist() == [True, False, True, False, False, False, False]
    # head 1 at t predicts t+3: t=1 -> 4 (mask 1, doc 0) ok; t=3 -> 6 is in doc 1
    assert valid[0, :, 1].tolist() == [False, True, False, False, False, False, False]


def test_stage_formula_loss_and_metrics_by_hand(train_target, target, train_data, batches):
    n, inner = 3, 32
    obj = make(train_target, target, train_data.vocab, n_predict=n, inner_dim=inner)
    m = obj.drafter
    state_w = 0.5 ** (0.5 / n)
    assert m.state_weight == pytest.approx(state_w)
    assert m.emb_weight == pytest.approx(math.sqrt((1 - state_w ** 2) * inner / 2))
    batch = batches[0]
    ids, hidden = batch["input_ids"], batch["hidden"]
    b, t = ids.shape
    out = obj(batch)
    s, full = hidden, torch.ones(b, t - 2 - n + 1, dtype=torch.bool)
    accept = 1.0
    for i in range(n):  # s_{i+1} = GELU(LN_i(W_i s_i + emb_w/state_w * E_i(token_{t+1+i})))
        span = t - 2 - i  # positions with a label inside the row
        tok = ids[:, 1 + i: 1 + i + span]
        z = s[:, :span] @ m.proj[i].weight.T + (m.emb_weight / state_w) * m.emb[i].weight[tok]
        z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6)
        s = F.gelu(m.ln[i].weight * z + m.ln[i].bias)
        logits = s @ m.head[i].weight.T  # [B, span, V]
        label = ids[:, 2 + i: 2 + i + span]
        valid = (batch["loss_mask"][:, 2 + i:] & (batch["doc_ids"][:, 2 + i:]
                                                  == batch["doc_ids"][:, :span]))
        ce = F.cross_entropy(logits.flatten(0, 1), label.flatten(), reduction="none")
        ce = ce.view(b, span)
        assert out.metrics[f"loss/head_{i}"].item() == pytest.approx(
            (ce * valid).sum().item() / valid.sum().item(), rel=1e-5)
        right = logits.argmax(-1) == label
        assert out.metrics[f"acc_{i}"].item() == pytest.approx(
            (right & valid).sum().item() / valid.sum().item())
        full = full & right[:, :full.shape[1]]
        full_acc = (full & valid[:, :full.shape[1]]).sum().item() / valid.sum().item()
        assert out.metrics[f"full_acc_{i}"].item() == pytest.approx(full_acc)
        accept += full_acc
    assert out.loss.item() == pytest.approx(sum(out.metrics[f"loss/head_{i}"].item()
                                                for i in range(n)), rel=1e-6)
    assert out.metrics["acceptance_length_est"].item() == pytest.approx(accept)
    assert all(not v.requires_grad for v in out.metrics.values())


def test_kd_term_matches_target_distribution(train_target, target, train_data, batches):
    """KD of head i at t compares with the target's distribution at t+1+i (same token)."""
    obj = make(train_target, target, train_data.vocab, n_predict=2, kd_weight=0.5)
    batch = batches[1]
    out = obj(batch)
    tokens, targets, valid = shifted_targets(batch["input_ids"], batch["loss_mask"],
                                             batch["doc_ids"], 2)
    logits = obj.drafter.forward_train(batch["hidden"], tokens)  # [n, B, T, V]
    p_log = F.log_softmax(target.lm_head(batch["hidden"]), -1)  # [B, T, V]
    for i in range(2):
        t = batch["input_ids"].shape[1] - 1 - i
        logq = F.log_softmax(logits[i, :, :t], -1)
        kl = (p_log[:, 1 + i:].exp() * (p_log[:, 1 + i:] - logq)).sum(-1)
        v = valid[:, :t, i]
        assert out.metrics[f"loss/kd_{i}"].item() == pytest.approx(
            (kl * v).sum().item() / v.sum().item(), rel=1e-4)
    total = sum(out.metrics[f"loss/head_{i}"] + 0.5 * out.metrics[f"loss/kd_{i}"]
                for i in range(2))
    assert out.loss.item() == pytest.approx(total.item(), rel=1e-6)


@pytest.mark.parametrize("tied", [False, True])
def test_export_load_identical_logits(tmp_path, train_target, target, train_data, batches, tied):
    obj = make(train_target, target, train_data.vocab, tie_weights=tied, scale_input=tied)
    batch = batches[0]
    tokens, _, _ = shifted_targets(batch["input_ids"], batch["loss_mask"], batch["doc_ids"], 3)
    want = obj.drafter.forward_train(batch["hidden"], tokens).detach()
    for name, sd in (("own", None), ("gathered", obj.state_dict())):
        path = obj.export(tmp_path / name, sd)
        loaded = MLPSpeculator.from_pretrained(path, dtype=torch.float32)
        assert loaded.config.to_dict() == obj.drafter.config.to_dict()
        torch.testing.assert_close(loaded.forward_train(batch["hidden"], tokens), want,
                                   rtol=0, atol=0)
    # init_from: a new objective starts from the export
    again = make(train_target, target, train_data.vocab, tie_weights=tied, scale_input=tied,
                 init_from=str(tmp_path / "own"))
    torch.testing.assert_close(again.drafter.forward_train(batch["hidden"], tokens), want)


def test_init_from_shape_mismatch_names_key(tmp_path, train_target, target, train_data):
    path = make(train_target, target, train_data.vocab).export(tmp_path / "s")
    with pytest.raises(ValueError, match="drafter.init_from.*n_predict=4.*n_predict=3"):
        make(train_target, target, train_data.vocab, n_predict=4, init_from=str(path))


def test_training_lowers_loss(train_target, target, train_data, batches):
    obj = make(train_target, target, train_data.vocab)
    with torch.no_grad():
        before = sum(obj(b).loss.item() for b in batches)
    adam_steps(obj, batches)
    with torch.no_grad():
        after = sum(obj(b).loss.item() for b in batches)
    assert after < 0.8 * before, (before, after)


def test_engine_greedy_equality(tmp_path, train_target, target, train_data, batches):
    """Trained on the target's own greedy continuations (stage-2 data), the export is served by
    draftsmith's engine: output identical to no speculation, and the acceptance the training
    metrics predict is what serving measures (a misaligned head would accept nothing)."""
    prompts, params, base, batch = own_continuations(train_target, batches, train_data.tokenizer)
    batch = capture(target, batch, FeatureSpec(hidden=True))
    obj = make(train_target, target, train_data.vocab, scale_input=True)
    adam_steps(obj, [batch], steps=60, lr=1e-2)
    estimate = obj(batch).metrics["acceptance_length_est"].item()
    path = obj.export(tmp_path / "mlp")
    llm = LLM(train_target, speculative_config=obj.speculative_config(path, 3), max_num_seqs=3)
    assert [o.token_ids for o in llm.generate(prompts, params)] == base
    served = llm.get_metrics()["mean_acceptance_length"]
    assert estimate > 2.5 and served > 2.5, (estimate, served)


def test_stages_are_data(train_target, target, train_data):
    from train.objectives.base import Stage, StageData

    obj = make(train_target, target, train_data.vocab)
    assert obj.stages() == [Stage()]
    obj.cfg.objective.stage2_steps = 7
    obj.cfg.trainer.lr = 2e-3
    two = obj.stages()
    ibm = {"max_steps": 7, "lr": 2e-4, "warmup_steps": 0, "warmup_ratio": 0.0,
           "schedule": "cosine", "min_lr_ratio": 0.1}  # 7 // 20: no warmup step
    assert two == [Stage(), Stage("stage2", StageData.target_answers, ibm, carry_optimizer=True)]
    obj.cfg.objective.stage2_steps = 50_000
    assert obj.stages()[1].trainer["warmup_steps"] == 2000  # min(2000, 5 %)
    obj.cfg.objective.stage2_steps = 400
    assert obj.stages()[1].trainer["warmup_steps"] == 20
    obj.cfg.objective.stage2_lr_factor = 0.0
    with pytest.raises(ValueError, match="stage2_lr_factor"):
        obj.stages()


def test_batch_without_labels_is_a_zero_loss(train_target, target, train_data, batches):
    """The stages run only where a head has a label; a micro-batch with none (all prompt) still
    gives a zero loss that backpropagates, as a masked mean over nothing does."""
    obj = make(train_target, target, train_data.vocab, n_predict=2, kd_weight=0.5)
    batch = {**batches[0], "loss_mask": torch.zeros_like(batches[0]["loss_mask"])}
    out = obj(batch)
    out.loss.backward()
    assert out.loss.item() == 0.0 and int(out.num_tokens) == 0
    assert out.metrics["acceptance_length_est"].item() == 1.0
