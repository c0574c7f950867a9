"""Adaptive verification (infer/adaptive.py): the width by hand, the acceptance estimate, the
costs, and the engine lossless with it (greedy output identical; the sampled law in
test_engine_sampling.py)."""

import pytest
import torch

from infer.adaptive import AcceptanceEstimate, AdaptiveVerifier, verify_width
from infer.engine import LLM
from infer.runner import ModelRunner
from infer.foundation.errors import ConfigError
from infer.sampling import SamplingParams
from infer.spec_config import SpeculativeConfig


def test_the_width_maximises_expected_tokens_per_second():
    survival = [[0.9, 0.72, 0.07], [0.5, 0.25, 0.12]]
    assert verify_width(survival, [3, 3], 0.1, [1.0, 1.0, 1.0, 1.0]) == 3  # flat: all pay
    # a fixed part plus 0.5 per token per row: by hand, width 1 is best
    costs = [1.0 + 0.5 * w for w in range(4)]
    rates = [(2 + sum(s[i] for s in survival for i in range(w))) / costs[w] for w in range(4)]
    assert max(range(4), key=lambda w: rates[w]) == 1
    assert verify_width(survival, [3, 3], 0.0, costs) == 1
    # a row that drafted less keeps what it has; nothing drafted, nothing verified
    assert verify_width(survival, [1, 3], 0.0, [1.0] * 4) == 3
    assert verify_width([[0.9]], [0], 0.0, [1.0, 1.0]) == 0


def test_the_acceptance_estimate_starts_at_the_confidence_and_learns_outcomes():
    est = AcceptanceEstimate()
    assert est.survival([[0.95, 0.55]])[0] == pytest.approx([0.95, 0.95 * 0.55])
    for _ in range(200):  # a drafter whose 0.5-confident drafts are always accepted
        est.observe([[0.55, 0.55, 0.55]], verified=[3], accepted=[3])
    assert est.survival([[0.55]])[0][0] > 0.95
    for _ in range(200):  # rejected at the first draft: the second is never judged
        est.observe([[0.15, 0.95]], verified=[2], accepted=[0])
    assert est.survival([[0.15]])[0][0] < 0.05
    assert est.survival([[0.95]])[0][0] == pytest.approx(0.95)


def test_costs_are_profiled_once_per_batch_size_then_refreshed_by_each_verify():
    calls = []
    verifier = AdaptiveVerifier()

    def profile():
        calls.append(1)
        return [1.0, 1.0, 1.0, 1.0]

    for _ in range(3):
        verifier.keep(torch.tensor([[0.5, 0.5, 0.5]]), [3], 0.1, profile)
        verifier.observe([3], [1], 3.0)  # three drafts verified at width 4, in 3 s
    assert len(calls) == 1 and verifier.costs[1][:3] == [1.0, 1.0, 1.0]
    assert verifier.costs[1][3] == pytest.approx(3.0 - 2.0 * 0.8 ** 3)  # the running mean


@pytest.mark.parametrize("name", ["draft_model", "pard"])
def test_adaptive_verification_is_greedy_identical(tiny_target, twin_draft, pard_draft, name,
                                                   monkeypatch):
    profiled = []  # a verified token costs 0.3 of a one-token forward: unlikely drafts are cut

    def profile(self, reqs, slots, width):
        profiled.append(len(reqs))
        return [1.0 + 0.3 * i for i in range(width)]
    monkeypatch.setattr(ModelRunner, "profile_verify", profile)
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
    assert profiled[0] == 4 and len(profiled) == len(set(profiled)) == len(llm.adaptive.costs)


def test_only_drafters_with_confidences_take_it():
    with pytest.raises(ConfigError, match="'enable_adaptive_verification'"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                 "enable_adaptive_verification": True})
