"""The engine's step-by-step API (the server's loop): requests added at any time join the
running batch between steps, an abort frees the slot at once, and nothing of it changes what
the other requests generate."""

import pytest

from infer.engine import LLM
from infer.request import make_request
from infer.sampling import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 2}


def _request(llm, index, prompt, **params):
    return make_request(index, prompt, SamplingParams(**params), llm.target)


@pytest.mark.parametrize("spec", [None, NGRAM])
def test_late_arrivals_and_aborts_leave_the_others_alone(loopy_target, engine_prompts, spec):
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    offline = LLM(loopy_target, spec).generate(engine_prompts, SamplingParams(**greedy))
    llm = LLM(loopy_target, spec, max_num_seqs=2)
    reqs = [_request(llm, i, p, **greedy) for i, p in enumerate(engine_prompts)]
    doomed = _request(llm, 99, [7, 8, 9], temperature=0, max_tokens=50, ignore_eos=True)
    llm.add_request(reqs[0])
    llm.add_request(doomed)
    llm.step()
    assert llm.num_running == 2 and llm.num_waiting == 0
    for r in reqs[1:]:  # arrive while the batch is full: they wait
        llm.add_request(r)
    llm.step()
    assert llm.num_waiting == 3
    llm.abort_request(doomed)  # its slot is free before the next step
    assert doomed.finish_reason == "abort" and llm.num_running == 1
    llm.step()
    assert llm.num_running == 2 and llm.num_waiting == 2
    while llm.has_unfinished_requests():
        llm.step()
    assert [r.output_ids for r in reqs] == [o.token_ids for o in offline]
    assert all(r.finish_reason == "length" for r in reqs)


def test_abort_a_waiting_request_and_generate_while_busy(loopy_target):
    llm = LLM(loopy_target, max_num_seqs=1)
    first = _request(llm, 0, [1, 2], max_tokens=5)
    queued = _request(llm, 1, [3, 4], max_tokens=5)
    llm.add_request(first)
    llm.add_request(queued)
    llm.step()
    llm.abort_request(queued)
    assert queued.finish_reason == "abort" and llm.num_waiting == 0
    with pytest.raises(RuntimeError, match="add_request"):
        llm.generate([1, 2, 3])
    while llm.has_unfinished_requests():
        llm.step()
    assert first.finish_reason == "length" and queued.output_ids == []
    refused = _request(llm, 2, [], max_tokens=5)
    llm.add_request(refused)  # refused at construction: never queued
    assert not llm.has_unfinished_requests() and refused.finish_reason == "error"


def test_verify_spans_only_the_longest_draft(loopy_target):
    """A lookup proposer's step verifies 1 + its batch's longest draft: a step where nothing
    matched is one token through the target (an autoregressive step), not k + 1."""
    llm = LLM(loopy_target, {"method": "ngram", "num_speculative_tokens": 3,
                             "prompt_lookup_min": 2, "prompt_lookup_max": 2})
    widths = []
    forward = llm.target.model.forward

    def spy(input_ids, *args, **kwargs):
        widths.append(input_ids.shape[1])
        return forward(input_ids, *args, **kwargs)
    llm.target.model.forward = spy
    prompt = [5, 6, 7, 8, 9, 10, 11]  # no bigram repeats: the first steps draft nothing
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    steps = widths[1:]  # after the prefill
    assert steps[0] == 1 and max(steps) == 4  # nothing matched yet; later, full drafts
    # columns beyond a draft exist only where max_tokens clipped it near the end
    assert sum(w - 1 for w in steps) >= out[0].metrics["num_draft_tokens"] > 0
    assert out[0].token_ids == LLM(loopy_target).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].token_ids
