"""Rejection sampler (PyTorch reference): losslessness, greedy exactness, synthetic rates, shapes.

Statistical tolerances come from the sampling error: for an empirical histogram ``h`` of M
draws from ``p``, ``E ||h - p||^2 = (1 - sum p^2) / M``; we allow 4 times its square root.
"""

from __future__ import annotations

import ast
import inspect
import math

import pytest
import torch

import infer.rejection as rejection
from infer.rejection import (draw_randomness, rejection_core_reference, rejection_sample,
                             synthetic_accept_prob)
from infer.sampling import logits_to_probs

VOCAB, K = 10, 2
SIGMAS = 4.0


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _hist(tokens: torch.Tensor, vocab: int = VOCAB) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / max(tokens.numel(), 1)


def _l2_tolerance(p: torch.Tensor, m: int) -> float:
    return SIGMAS * math.sqrt((1.0 - (p.double() ** 2).sum().item()) / m)


def _check_structure(out: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """Accepted prefix == drafts, one final token, then exactly -1; returns num_accepted."""
    emitted = (out >= 0).sum(1)
    num_accepted = emitted - 1
    assert (num_accepted >= 0).all()
    assert (num_accepted <= (drafts >= 0).sum(1)).all()
    slots = torch.arange(out.shape[1])
    assert torch.equal(out >= 0, slots < emitted[:, None])
    prefix = (slots < num_accepted[:, None])[:, :-1]  # [batch, k]
    assert torch.equal(out[:, :-1][prefix], drafts[prefix])
    return num_accepted


# --------------------------------------------------------------------------- convergence


@pytest.fixture(scope="module")
def dists() -> dict[str, torch.Tensor]:
    """Target logits per position, draft distributions, unrelated distributions (vocab 10, k 2)."""
    g = _gen(0)
    target_logits = 1.5 * torch.randn(K + 1, VOCAB, generator=g)  # [k + 1, vocab]
    return {
        "logits": target_logits,
        "p": logits_to_probs(target_logits, 1.0).double(),  # [k + 1, vocab]
        "q": torch.softmax(1.5 * torch.randn(K, VOCAB, generator=g), -1),  # [k, vocab]
        "unrelated": torch.softmax(1.5 * torch.randn(5, VOCAB, generator=g), -1).double(),
    }


def _simulate(dists: dict, method: str, n: int, seed: int,
              q: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """n independent requests, drafts sampled from q, verified in one batched call."""
    g = _gen(seed)
    q = dists["q"] if q is None else q  # [k, vocab]
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g)
                          for j in range(K)], dim=1)  # [n, k]
    logits = dists["logits"].expand(n, K + 1, VOCAB)
    draft_probs = q.expand(n, K, VOCAB) if method == "probabilistic" else None
    out = rejection_sample(logits, drafts, draft_probs, temperature=1.0, method=method,
                           generator=g)
    return out, drafts


@pytest.mark.parametrize("method", ["strict", "probabilistic"])
def test_first_token_converges_to_target(dists, method):
    """L2(hist, p0) stays within sampling error and falls like 1/sqrt(N); unrelated plateaus."""
    ns = [100, 1000, 10000, 100000]
    p0 = dists["p"][0]
    to_target, to_unrelated = [], []
    for i, n in enumerate(ns):
        out, drafts = _simulate(dists, method, n, seed=10 + i)
        _check_structure(out, drafts)
        h = _hist(out[:, 0])
        to_target.append((h - p0).norm().item())
        to_unrelated.append((h - dists["unrelated"]).norm(dim=1))  # [5]
        assert to_target[-1] <= _l2_tolerance(p0, n), (n, to_target)
    # least-squares slope of log L2 vs log N is -1/2 in theory; each log-distance scatters by
    # about 0.3, so over 3 decades the fitted slope has sd ~0.06: +-0.3 is about 5 sd
    x = torch.tensor(ns).double().log()
    y = torch.tensor(to_target).log()
    slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
    assert -0.8 < slope < -0.2, (slope, to_target)
    true_gaps = (p0 - dists["unrelated"]).norm(dim=1)  # [5]
    assert (true_gaps > 10 * _l2_tolerance(p0, ns[-1])).all()
    # the distance to unrelated distributions does not shrink: it settles at the true gap
    assert torch.allclose(to_unrelated[-1], true_gaps, atol=_l2_tolerance(p0, ns[-1]))
    assert (to_unrelated[-1] > 0.5 * to_unrelated[0]).all()


@pytest.mark.parametrize("method", ["strict", "probabilistic"])
def test_later_tokens_follow_target_given_acceptance(dists, method):
    """Slot 1 given x0 accepted ~ p1 and slot 2 (bonus) given x0, x1 accepted ~ p2.

    Provable: the test at position j uses fresh randomness, so conditioning on acceptances
    before j leaves position j an ordinary speculative-sampling step. A recovered token never
    equals its draft (its residual has no mass there), so "slot j == x_j" is "x_j accepted".
    """
    n = 100000
    # a drafter that half agrees with the target, so enough rows reach the bonus slot
    q = 0.5 * (dists["p"][:K].float() + dists["q"])
    out, drafts = _simulate(dists, method, n, seed=3, q=q)
    reached = torch.ones(n, dtype=torch.bool)
    for slot in range(K + 1):
        m = int(reached.sum())
        assert m > 2000  # enough conditioned samples for a meaningful check
        h = _hist(out[reached, slot])
        assert (h - dists["p"][slot]).norm() <= _l2_tolerance(dists["p"][slot], m), slot
        if slot < K:
            reached &= out[:, slot] == drafts[:, slot]


def test_acceptance_rates_match_theory(dists):
    """probabilistic accepts with prob sum_x min(p, q); strict with sum_x p(x) q(x)."""
    n = 50000
    p0, q0 = dists["p"][0], dists["q"][0].double()
    for method, expected in [("probabilistic", torch.minimum(p0, q0).sum().item()),
                             ("strict", (p0 * q0).sum().item())]:
        out, drafts = _simulate(dists, method, n, seed=4)
        rate = (out[:, 0] == drafts[:, 0]).double().mean().item()
        assert abs(rate - expected) <= SIGMAS * math.sqrt(expected * (1 - expected) / n), method


def test_probabilistic_without_draft_probs_is_one_hot_q_and_strict():
    g = _gen(5)
    logits = torch.randn(64, 4, 20, generator=g)
    drafts = torch.randint(0, 20, (64, 3), generator=g)
    one_hot = torch.nn.functional.one_hot(drafts, 20).float()  # [batch, k, vocab]
    outs = [rejection_sample(logits, drafts, q, temperature=0.8, method=m, generator=_gen(6))
            for m, q in [("probabilistic", None), ("probabilistic", one_hot), ("strict", None)]]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_residual_fallback_when_residual_is_all_zero():
    """q = 2p leaves max(p - q, 0) == 0 on rejection: the recovered token then comes from p."""
    n = 4000
    g = _gen(7)
    logits = torch.randn(1, 2, 6, generator=g).expand(n, 2, 6)
    p0 = logits_to_probs(logits[0, 0], 1.0)  # [vocab]
    drafts = torch.multinomial(p0, n, replacement=True, generator=g)[:, None]  # [n, 1]
    q = 2 * p0.expand(n, 1, 6)
    out = rejection_sample(logits, drafts, q, temperature=1.0, method="probabilistic",
                           generator=g)
    rejected = _check_structure(out, drafts) == 0
    m = int(rejected.sum())
    assert abs(m / n - 0.5) <= SIGMAS * math.sqrt(0.25 / n)  # u * 2p(x) < p(x)  <=>  u < 1/2
    h = _hist(out[rejected, 0], 6)
    assert (h - p0.double()).norm() <= _l2_tolerance(p0, m)


# --------------------------------------------------------------------------- greedy


def _greedy_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hand-built rows: logits with chosen argmaxes, drafts, and the exact expected output."""
    argmax = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [0, 0, 0, 0], [5, 4, 3, 2], [5, 1, 1, 1]])
    drafts = torch.tensor([[1, 2, 3], [1, 5, 3], [2, 0, 0], [5, 4, -1], [-1, -1, -1]])
    expected = torch.tensor([[1, 2, 3, 4],     # all accepted, bonus = argmax at position 3
                             [1, 2, -1, -1],   # second draft rejected, recovered = argmax
                             [0, -1, -1, -1],  # first draft rejected
                             [5, 4, 3, -1],    # 2 drafts, both accepted, bonus at position 2
                             [5, -1, -1, -1]])  # no drafts: bonus only
    logits = 0.5 * torch.randn(5, 4, 6, generator=_gen(8))
    logits.scatter_(-1, argmax[..., None], 4.0)  # clear argmax, yet T = 1 still samples others
    assert torch.equal(logits.argmax(-1), argmax)
    return logits, drafts, expected


@pytest.mark.parametrize("method,with_q", [("strict", False), ("probabilistic", False),
                                           ("probabilistic", True)])
@pytest.mark.parametrize("temperature", [0.0, "tensor"])
def test_greedy_rows_are_exact(method, with_q, temperature):
    logits, drafts, expected = _greedy_case()
    if temperature == "tensor":
        temperature = torch.zeros(5)
    q = torch.softmax(torch.randn(5, 3, 6, generator=_gen(9)), -1) if with_q else None
    for seed in range(5):
        out = rejection_sample(logits, drafts, q, temperature=temperature, method=method,
                               top_k=2, top_p=0.5, generator=_gen(seed))
        assert torch.equal(out, expected), (seed, out)


@pytest.mark.parametrize("method", ["strict", "probabilistic"])
def test_mixed_greedy_and_sampled_rows(method):
    logits, drafts, expected = _greedy_case()
    temperature = torch.tensor([0.0, 1.0, 0.0, 0.7, 0.0])
    greedy = temperature == 0
    seen = set()
    for seed in range(10):
        out = rejection_sample(logits, drafts, temperature=temperature, method=method,
                               generator=_gen(seed))
        assert torch.equal(out[greedy], expected[greedy])
        _check_structure(out, drafts)
        seen.add(tuple(out[~greedy].flatten().tolist()))
    assert len(seen) > 1  # the sampled rows really are sampled


# --------------------------------------------------------------------------- synthetic


@pytest.mark.parametrize("n", [1, 2, 5, 8])
@pytest.mark.parametrize("rate", [0.0, 0.3, 0.75, 1.0])
def test_synthetic_accept_prob_solves_its_equation(n, rate):
    a = synthetic_accept_prob(n, rate)
    assert sum(a ** i for i in range(1, n + 1)) / n == pytest.approx(rate, abs=1e-9)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("rate", [0.0, 0.2, 0.6, 0.9, 1.0])
def test_synthetic_mean_acceptance_rate(k, rate):
    """accepted / drafted over ragged rows is within 4 standard errors of the asked rate."""
    n = 20000
    g = _gen(11)
    logits = torch.randn(n, k + 1, 8, generator=g)
    drafts = torch.randint(0, 8, (n, k), generator=g)
    lengths = torch.randint(0, k + 1, (n,), generator=g)  # ragged: 0..k drafts per row
    drafts[torch.arange(k) >= lengths[:, None]] = -1
    out = rejection_sample(logits, drafts, temperature=1.0, method="synthetic",
                           synthetic_acceptance_rate=rate, generator=g)
    accepted = _check_structure(out, drafts).double()
    measured = accepted.sum() / lengths.sum()
    # ratio estimator: standard error of sum(A) / sum(n) from the per-row residuals A - r n
    se = (accepted - measured * lengths).std() * math.sqrt(n) / lengths.sum()
    assert abs(measured - rate) <= SIGMAS * se + 1e-12, (measured, rate, se)


# --------------------------------------------------------------------------- shapes, seeds


@pytest.mark.parametrize("method", ["strict", "probabilistic", "synthetic"])
def test_ragged_rows_padding(method):
    g = _gen(12)
    drafts = torch.tensor([[-1, -1, -1, -1], [3, -1, -1, -1], [1, 2, -1, -1], [4, 4, 4, 4]])
    logits = torch.randn(4, 5, 6, generator=g)
    rate = 1.0 if method == "synthetic" else None
    q = torch.softmax(torch.randn(4, 4, 6, generator=g), -1) if method == "probabilistic" else None
    for seed in range(20):
        out = rejection_sample(logits, drafts, q, temperature=1.0, method=method,
                               synthetic_acceptance_rate=rate, generator=_gen(seed))
        accepted = _check_structure(out, drafts)
        assert accepted[0] == 0 and out[0, 0] >= 0  # no drafts: bonus token only
    if method == "synthetic":  # rate 1 accepts every draft: the bonus sits at slot n exactly
        assert torch.equal(out >= 0, torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0],
                                                   [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]).bool())


def test_k_zero_gives_bonus_only():
    out = rejection_sample(torch.randn(3, 1, 7), torch.empty(3, 0, dtype=torch.long),
                           temperature=0.0)
    assert out.shape == (3, 1) and (out >= 0).all()


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_k_zero_shortcut_is_the_cores_bonus_token(temperature):
    """With no drafts the sampler skips the core: the same tokens as the core, from the same
    draws, so plain decoding's random stream is unchanged."""
    logits = torch.randn(5, 1, 40, generator=_gen(3))
    empty = torch.empty(5, 0, dtype=torch.long)
    got = rejection_sample(logits, empty, temperature=temperature, generator=_gen(9))
    probs = logits_to_probs(logits, temperature)
    uniforms, noise = draw_randomness(5, 0, 40, logits.device, _gen(9))
    want = rejection_core_reference(probs, empty, torch.zeros(5, dtype=torch.long), uniforms,
                                    noise)
    assert torch.equal(got, want)


@pytest.mark.parametrize("method", ["strict", "probabilistic", "synthetic"])
def test_seeded_determinism(method):
    g = _gen(13)
    logits = torch.randn(64, 5, 50, generator=g)
    drafts = logits[:, :4].argmax(-1)  # likely drafts, so acceptances happen too
    drafts[::3, 2:] = -1
    q = torch.softmax(torch.randn(64, 4, 50, generator=g), -1)
    q = q if method == "probabilistic" else None
    rate = 0.5 if method == "synthetic" else None

    def run(seed: int) -> torch.Tensor:
        return rejection_sample(logits, drafts, q, temperature=1.0, method=method,
                                synthetic_acceptance_rate=rate, generator=_gen(seed))

    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))


# --------------------------------------------------------------------------- top-k / top-p


def _nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Bool mask ``[batch, pos, vocab]``: smallest top set whose mass reaches top_p."""
    sorted_p, idx = probs.sort(-1, descending=True)
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p.view(-1, 1, 1)
    return torch.zeros_like(keep).scatter(-1, idx, keep)


@pytest.mark.parametrize("method", ["strict", "probabilistic"])
def test_top_k_top_p_respected(method):
    """Every emitted token (accepted, recovered, bonus) lies in its position's top-k / nucleus."""
    g = _gen(14)
    batch, k, vocab, temp = 3000, 3, 40, 0.9
    logits = 2.0 * torch.randn(batch, k + 1, vocab, generator=g)
    top_k = torch.randint(1, 8, (batch,), generator=g)
    top_p = 0.3 + 0.7 * torch.rand(batch, generator=g)
    plain = torch.softmax(logits / temp, -1)
    # drafts: half from the unfiltered target (often outside the filter), half uniform
    drafts = torch.multinomial(plain[:, :k].reshape(-1, vocab), 1, generator=g).view(batch, k)
    drafts[::2] = torch.randint(0, vocab, (batch // 2, k), generator=g)
    q = torch.softmax(torch.randn(batch, k, vocab, generator=g), -1)
    q = q if method == "probabilistic" else None
    rank_ok = (torch.arange(7) < top_k.view(-1, 1, 1)).expand(-1, k + 1, 7)  # top_k <= 7
    in_top_k = torch.zeros_like(plain, dtype=torch.bool).scatter(
        -1, logits.topk(7, -1).indices, rank_ok)
    for kwargs, allowed in [({"top_k": top_k}, in_top_k),
                            ({"top_p": top_p}, _nucleus(plain, top_p))]:
        out = rejection_sample(logits, drafts, q, temperature=temp, method=method,
                               generator=_gen(15), **kwargs)
        accepted = _check_structure(out, drafts)
        assert accepted.sum() > 100  # acceptances really are exercised
        emitted = out >= 0
        assert allowed.gather(-1, out.clamp_min(0)[..., None]).squeeze(-1)[emitted].all()


# --------------------------------------------------------------------------- arguments


def _good_args() -> dict:
    return {"target_logits": torch.randn(2, 4, 5),
            "draft_token_ids": torch.zeros(2, 3, dtype=torch.long),
            "draft_probs": None, "temperature": 1.0}


@pytest.mark.parametrize("change,name", [
    ({"method": "greedy"}, "method"),
    ({"impl": "cuda"}, "impl"),
    ({"target_logits": torch.randn(2, 4)}, "target_logits"),
    ({"target_logits": torch.zeros(2, 4, 5, dtype=torch.long)}, "target_logits"),
    ({"draft_token_ids": torch.zeros(2, 3)}, "draft_token_ids"),
    ({"draft_token_ids": torch.zeros(2, 4, dtype=torch.long)}, "draft_token_ids"),
    ({"draft_token_ids": torch.zeros(3, 3, dtype=torch.long)}, "draft_token_ids"),
    ({"draft_probs": torch.rand(2, 4, 5)}, "draft_probs"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": torch.ones(3)}, "temperature"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_k": torch.ones(2, 1, dtype=torch.long)}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"method": "synthetic"}, "synthetic_acceptance_rate"),
    ({"method": "synthetic", "synthetic_acceptance_rate": 1.5}, "synthetic_acceptance_rate"),
    ({"synthetic_acceptance_rate": 0.5}, "synthetic_acceptance_rate"),
])
def test_bad_arguments_raise_value_error_naming_them(change, name):
    args = {**_good_args(), **change}
    with pytest.raises(ValueError, match=f"'{name}'.*expected"):
        rejection_sample(args.pop("target_logits"), args.pop("draft_token_ids"),
                         args.pop("draft_probs"), **args)


def test_auto_dispatch_uses_reference_on_cpu():
    assert rejection._pick_core("auto", torch.zeros(1)) is rejection.rejection_core_reference


def test_hot_path_has_no_host_syncs():
    """No .item()/.tolist()/nonzero/multinomial/.cpu() anywhere in the module's code."""
    forbidden = {"item", "tolist", "nonzero", "multinomial", "cpu", "numpy", "argwhere"}
    tree = ast.parse(inspect.getsource(rejection))
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not used & forbidden
