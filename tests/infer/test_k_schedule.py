"""k by batch size (``num_speculative_tokens_per_batch_size``, infer/k_schedule.py): vLLM's
rules for the schedule, the k each step takes from its batch, and greedy output unchanged
while the batch (and so k) changes from step to step."""

import pytest

from infer.engine import LLM
from infer.k_schedule import k_for_batch, parse_schedule
from infer.sampling import SamplingParams
from infer.spec_config import SpeculativeConfig

KEY = "num_speculative_tokens_per_batch_size"


@pytest.mark.parametrize("value, message", [
    ([], "a non-empty list"),
    ("1,2,3", "a list of"),
    ([[1, 2]], r"\[0\].*three integers"),
    ([[1, 2, 3.0]], r"\[0\].*three integers"),
    ([[1, 4, 3], [0, 2, 1]], r"\[1\].*batch bounds > 0"),
    ([[3, 2, 1]], r"start_bs <= end_bs"),
    ([[1, 4, -1]], r"k >= 0"),
    ([[1, 4, 3], [4, 8, 1]], r"do not overlap \(\[1, 4\] and \[4, 8\]"),
    ([[2, 4, 3]], "starting at batch size 1"),
])
def test_bad_schedules_are_refused_naming_the_rule(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, KEY: value})


def test_the_schedule_is_sorted_and_survives_a_round_trip():
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4,
                                    KEY: [[5, 8, 1], [1, 2, 4], [3, 4, 2]]})
    assert spec.num_speculative_tokens_per_batch_size == ((1, 2, 4), (3, 4, 2), (5, 8, 1))
    assert SpeculativeConfig.parse(spec.to_dict()) == spec
    assert SpeculativeConfig.parse(spec.to_json()) == spec


def test_each_batch_size_gets_its_k():
    schedule = parse_schedule([[1, 1, 5], [2, 3, 2], [6, 8, 0], [10, 12, 9]], "t")
    ks = [k_for_batch(schedule, b, 4) for b in range(1, 15)]
    # 1: 5 clamped to 4; 4-5: the gap carries 2; 9: carries 0; 10+: 9 clamped, the tail too
    assert ks == [4, 2, 2, 2, 2, 0, 0, 0, 0, 4, 4, 4, 4, 4]
    assert k_for_batch(None, 7, 3) == 3


def _run(target, prompts, spec, max_tokens, max_num_seqs):
    """Outputs, and (running requests, k asked of the proposer, widest draft) per drafting step."""
    llm = LLM(target, speculative_config=spec, dtype="float32", max_num_seqs=max_num_seqs)
    steps, propose = [], llm.proposer.propose

    def spy(batch):
        proposal = propose(batch)
        steps.append((len(batch.slots), batch.k, proposal.draft_ids.shape[1]))
        return proposal

    llm.proposer.propose = spy
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens]
    return [o.token_ids for o in llm.generate(prompts, params)], steps, llm


@pytest.mark.parametrize("setup", ["draft_model", "ngram"])
def test_k_follows_the_running_batch_and_output_is_unchanged(setup, tiny_target, twin_draft,
                                                            loopy_target, engine_prompts):
    """Requests with different max_tokens leave the batch one by one: steps at 4, 3, 2 and 1
    running requests take the schedule's k (none at 3-4), and greedy output is the plain one."""
    schedule = [[1, 1, 3], [2, 2, 1], [3, 4, 0]]
    if setup == "ngram":
        target, prompts = loopy_target, [[5, 6, 7, 5, 6, 7, 5], [20, 21, 20, 21], [4, 5, 4, 5],
                                         [9, 9, 9]]
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                "prompt_lookup_max": 3, KEY: schedule}
    else:
        target, prompts = tiny_target, engine_prompts[:4]
        spec = {"method": "draft_model", "model": twin_draft, "num_speculative_tokens": 3,
                KEY: schedule}
    max_tokens = [6, 10, 14, 22]
    outs, steps, llm = _run(target, prompts, spec, max_tokens, 4)
    plain = LLM(target, dtype="float32", max_num_seqs=4).generate(
        prompts, [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens])
    assert outs == [o.token_ids for o in plain]
    assert {b for b, _, _ in steps} == {1, 2}  # 3-4 running: k 0, the proposer is not asked
    assert all(k == {1: 3, 2: 1}[b] and width <= k for b, k, width in steps)
    assert llm.get_metrics()["num_drafts"] > 0
