"""Adaptive verification (infer/adaptive.py): the budget by hand, prefixes only, and the engine
lossless with it (greedy output identical; the sampled law in test_engine_sampling.py)."""

import pytest

from infer.adaptive import AdaptiveVerifier, _interpolate, verify_budget
from infer.engine import LLM
from infer.runner import ModelRunner
from infer.foundation.errors import ConfigError
from infer.sampling import SamplingParams
from infer.spec_config import SpeculativeConfig


def test_free_verification_keeps_every_draft_and_costly_keeps_the_likely_ones():
    conf = [[0.9, 0.8, 0.1], [0.5, 0.5, 0.5]]
    assert verify_budget(conf, [3, 3], 0.1, lambda tokens: 1.0) == [3, 3]  # flat cost
    # a fixed part (a weight read) plus a cost per token: by hand, survivals 0.9 and 0.72
    # (row 0) pay, 0.5 (row 1) no longer does
    rows, step = 2, lambda tokens: 1.0 + 0.5 * tokens
    survival = sorted([0.9, 0.72, 0.072, 0.5, 0.25, 0.125], reverse=True)
    rates = [(rows + sum(survival[:b])) / step(rows + b) for b in range(7)]
    assert max(range(7), key=lambda b: rates[b]) == 2
    assert verify_budget(conf, [3, 3], 0.0, step) == [2, 0]
    # no fixed part: a verified token costs what a decoded one does and nothing pays
    assert verify_budget(conf, [3, 3], 0.0, lambda tokens: 0.5 * tokens) == [0, 0]


def test_a_row_keeps_a_prefix_and_never_more_than_it_drafted():
    conf = [[1.0, 1.0, 1.0, 1.0], [0.2, 0.9, 0.9, 0.9]]
    keep = verify_budget(conf, [2, 4], 0.0, lambda tokens: 1.0 + 0.01 * tokens)
    assert keep[0] == 2 and keep[1] <= 4
    assert verify_budget([[0.9]], [0], 0.0, lambda tokens: 1.0) == [0]  # nothing drafted


def test_costs_are_profiled_once_per_batch_size_and_interpolated():
    calls = []
    verifier = AdaptiveVerifier()

    def profile():
        calls.append(1)
        return [1.0, 1.0, 1.0, 1.0]

    import torch

    for _ in range(3):
        verifier.keep(torch.tensor([[0.5, 0.5, 0.5]]), [3], 0.1, profile)
    assert len(calls) == 1 and verifier.costs[1] == [1.0] * 4
    assert _interpolate([1.0, 2.0, 4.0], 2.5) == 3.0 and _interpolate([1.0, 2.0], 9) == 2.0


@pytest.mark.parametrize("name", ["draft_model", "pard"])
def test_adaptive_verification_is_greedy_identical(tiny_target, twin_draft, pard_draft, name,
                                                   monkeypatch):
    # a verified token costs 0.3 of a one-token forward: unlikely drafts are cut
    monkeypatch.setattr(ModelRunner, "profile_verify",
                        lambda self, reqs, slots, w: [1.0 + 0.3 * i for i in range(w)])
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11, 12], [13]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    draft = {"draft_model": twin_draft, "pard": pard_draft}[name]
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 4,
            "parallel_drafting": name == "pard", "enable_adaptive_verification": True}
    llm = LLM(tiny_target, speculative_config=spec, max_num_seqs=4)
    got = llm.generate(prompts, params)
    want = LLM(tiny_target, max_num_seqs=4).generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # profiled once per batch size the run stepped at (4, then fewer as requests finish)
    assert llm.adaptive.costs[4] == [1.0, 1.3, 1.6, 1.9, 2.2] and set(llm.adaptive.costs) <= {
        1, 2, 3, 4}


def test_only_drafters_with_confidences_take_it():
    with pytest.raises(ConfigError, match="'enable_adaptive_verification'"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                 "enable_adaptive_verification": True})
