"""Block verification (``rejection_sample_method: block``, infer/rejection.py): lossless by a
chi-square test of every output position at k 1 / 3 / 5 and temperatures 0.6 / 1.0, with and
without draft probabilities; never accepting less than the token-by-token test; greedy rows
exact; and the engine's sampled output distribution unchanged.

The output law of one step is checked as the paper states it: the step's tokens, continued by
sampling the rest of a fixed-length window from the target, are distributed as the target's own
samples. Target and draft distributions here do not depend on the prefix (a special case of the
theorem), so the target's law of the window is the product of its positions' distributions.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infer.rejection import rejection_sample
from infer.sampling import logits_to_probs
from infer.spec_config import SpeculativeConfig

from .test_engine_sampling import chi2_pvalue
from .test_rejection import _check_structure, _gen, _greedy_case

VOCAB, N = 6, 40000
ALPHA = 1e-3  # per-test significance; the seeds are fixed, so a pass is reproducible


def _laws(k: int, temperature: float, seed: int):
    """Target logits [k + 1, V], their distributions at ``temperature``, draft laws q [k, V]
    (near the target, so blocks of several drafts are accepted)."""
    g = _gen(seed)
    logits = 1.5 * torch.randn(k + 1, VOCAB, generator=g)
    p = logits_to_probs(logits, temperature)  # [k + 1, V]
    q = torch.softmax(0.6 * logits[:k] / temperature + 0.8 * torch.randn(k, VOCAB, generator=g),
                      -1)
    return logits, p, q


def _window(out: torch.Tensor, p: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Each row's step output, continued from the target to k + 1 tokens: ``[N, k + 1]``."""
    filled = out.clone()
    for j in range(out.shape[1]):
        fresh = torch.multinomial(p[j], out.shape[0], replacement=True, generator=g)
        filled[:, j] = torch.where(filled[:, j] < 0, fresh, filled[:, j])
    return filled


def _step(method: str, k: int, temperature: float, with_q: bool, seed: int):
    logits, p, q = _laws(k, temperature, seed)
    g = _gen(seed + 1)
    drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g)
                          for j in range(k)], dim=1)  # [N, k]
    out = rejection_sample(logits.expand(N, k + 1, VOCAB), drafts,
                           q.expand(N, k, VOCAB) if with_q else None, temperature=temperature,
                           method=method, generator=g)
    _check_structure(out, drafts)
    return out, drafts, p, g


@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize("temperature", [0.6, 1.0])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_every_position_follows_the_target(k, temperature, with_q):
    out, _, p, g = _step("block", k, temperature, with_q, seed=100 + 10 * k)
    window = _window(out, p, g)
    for j in range(k + 1):
        counts = np.bincount(window[:, j].numpy(), minlength=VOCAB)
        assert chi2_pvalue(counts, p[j].numpy()) > ALPHA, (j, counts / N, p[j])
    if k > 1:  # and the positions together: the joint law of the first two is the product
        pair = np.bincount((window[:, 0] * VOCAB + window[:, 1]).numpy(), minlength=VOCAB ** 2)
        assert chi2_pvalue(pair, np.outer(p[0], p[1])) > ALPHA


@pytest.mark.parametrize("with_q", [True, False], ids=["draft_probs", "one_hot"])
@pytest.mark.parametrize("k", [3, 5])
def test_accepts_at_least_what_the_token_test_accepts(k, with_q):
    """Theorem 2: in expectation, at least as many drafts as the token-by-token test (the p/q
    test with draft probabilities, p(x) without), on the same laws; vLLM's margin 0.01."""
    token = "probabilistic" if with_q else "strict"
    means = {}
    for method in ("block", token):
        out, _, _, _ = _step(method, k, 1.0, with_q, seed=7)
        means[method] = float(((out >= 0).sum(1) - 1).double().mean())
    assert means["block"] >= means[token] - 0.01, means


@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_rows_are_exact(with_q):
    logits, drafts, expected = _greedy_case()
    q = torch.softmax(torch.randn(5, 3, 6, generator=_gen(9)), -1) if with_q else None
    for temperature in (0.0, torch.zeros(5)):
        for seed in range(5):
            out = rejection_sample(logits, drafts, q, temperature=temperature, method="block",
                                   generator=_gen(seed))
            assert torch.equal(out, expected), (seed, out)


def test_the_schema_takes_block_beside_greedy_or_sampled_drafts():
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                    "rejection_sample_method": "block"})
    assert (spec.rejection_sample_method, spec.draft_sample_method) == ("block", "greedy")
    sampled = {"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "block",
               "draft_sample_method": "probabilistic"}
    assert SpeculativeConfig.parse(sampled).draft_sample_method == "probabilistic"
    assert SpeculativeConfig.parse(SpeculativeConfig.parse(sampled).to_dict()) == \
        SpeculativeConfig.parse(sampled)
