"""``objective.loss`` (train/objectives/losses.py): each distance against a hand computation on
two small distributions, the property it is chosen for, and EAL."""

import math

import pytest
import torch

from train.objectives.losses import distill_loss, dpace_weights, expected_acceptance

P = torch.tensor([0.5, 0.3, 0.2])
Q = torch.tensor([0.2, 0.3, 0.5])


def _loss(kind, p=P, q=Q):
    return float(distill_loss(kind, q.log(), p.log()))  # logits = log q: softmax gives q back


def test_each_loss_by_hand():
    kl = sum(a * math.log(a / b) for a, b in zip(P.tolist(), Q.tolist()))
    rkl = sum(b * math.log(b / a) for a, b in zip(P.tolist(), Q.tolist()))
    m = [(a + b) / 2 for a, b in zip(P.tolist(), Q.tolist())]
    jsd = 0.5 * sum(a * math.log(a / c) for a, c in zip(P.tolist(), m)) \
        + 0.5 * sum(b * math.log(b / c) for b, c in zip(Q.tolist(), m))
    alpha = 0.2 + 0.3 + 0.2  # sum of min(p, q)
    lam = math.exp(-3 * alpha)
    want = {"kl": kl, "rkl": rkl, "jsd": jsd, "ce": -math.log(0.2), "tv": 1 - alpha,
            "nla": -math.log(alpha), "lk_hybrid": lam * kl + (1 - lam) * (1 - alpha)}
    for kind, value in want.items():
        assert _loss(kind) == pytest.approx(value, rel=1e-5), kind


@pytest.mark.parametrize("kind", ["kl", "rkl", "jsd", "tv", "nla", "lk_hybrid"])
def test_zero_at_a_match_and_a_gradient_toward_it(kind):
    assert _loss(kind, P, P) == pytest.approx(0.0, abs=1e-6)
    logits = Q.log().clone().requires_grad_(True)
    distill_loss(kind, logits, P.log()).backward()
    stepped = logits - 0.1 * logits.grad
    assert float(distill_loss(kind, stepped, P.log())) < _loss(kind)


def test_lk_hybrid_has_no_gradient_through_lambda():
    logits = Q.log().clone().requires_grad_(True)
    distill_loss("lk_hybrid", logits, P.log()).backward()
    alpha = torch.minimum(P, torch.softmax(logits, -1)).sum().detach()
    lam = torch.exp(-3 * alpha)
    ref = Q.log().clone().requires_grad_(True)
    q = torch.softmax(ref, -1)
    (lam * (P * (P.log() - q.log())).sum() + (1 - lam) * (1 - torch.minimum(P, q).sum())).backward()
    torch.testing.assert_close(logits.grad, ref.grad)


def test_eal_is_the_sum_of_running_products():
    accs = [torch.tensor(0.8), torch.tensor(0.5), torch.tensor(0.25)]
    assert float(expected_acceptance(accs)) == pytest.approx(0.8 + 0.4 + 0.1)
    assert float(expected_acceptance(torch.tensor([1.0, 0.0, 1.0]))) == 1.0


def test_dpace_weights_by_hand():
    """Two anchors, three steps; anchor 1's last step is invalid (past its document)."""
    losses = torch.tensor([[0.0, 1.0], [math.log(2), 2.0], [math.log(4), 5.0]])  # [K=3, 2]
    valid = torch.tensor([[1, 1], [1, 1], [1, 0]]).bool()
    s0 = [0.5 * 1 + 0.5, 0.5 * 0.5 + 0.5, 0.5 * 0.25 + 0.5]  # anchor 0: q = 1, 1/2, 1/4
    p0 = [s0[0], s0[0] * s0[1], s0[0] * s0[1] * s0[2]]
    s1 = [0.5 * math.exp(-1) + 0.5, 0.5 * math.exp(-2) + 0.5]
    p1 = [s1[0], s1[0] * s1[1]]
    want = torch.tensor([[sum(p0), sum(p1)], [p0[1] + p0[2], p1[1]], [p0[2], 0.0]])
    got = dpace_weights(losses.requires_grad_(True), valid)
    torch.testing.assert_close(got, want.float())
    assert not got.requires_grad  # weights carry no gradient
