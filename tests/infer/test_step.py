"""The typed step (infer/step.py): one StepPlan per step reaches the proposer and the rejection
sampler with the same values, k included."""

import torch

import infer.step as step
from infer.engine import LLM
from infer.sampling import BatchGenerator, SamplingParams


def test_the_proposer_and_the_sampler_get_the_same_plan(loopy_target, monkeypatch):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2, "num_speculative_tokens_per_batch_size": [[1, 1, 3],
                                                                               [2, 2, 2]]}
    llm = LLM(loopy_target, speculative_config=spec, dtype="float32", max_num_seqs=2)
    events, propose, real = [], llm.proposer.propose, step.rejection_sample

    def spy_propose(batch):
        events.append(("propose", batch))
        return propose(batch)

    def spy_sample(*args, **kwargs):  # also the prefills' first tokens: no propose before
        events.append(("sample", kwargs))
        return real(*args, **kwargs)

    llm.proposer.propose = spy_propose
    monkeypatch.setattr(step, "rejection_sample", spy_sample)
    params = [SamplingParams(temperature=0.7, top_k=4, max_tokens=12, seed=3),
              SamplingParams(temperature=1.0, max_tokens=6)]
    llm.generate([[5, 6, 7, 5, 6, 7], [20, 21, 20, 21]], params)
    pairs = [(a[1], b[1]) for a, b in zip(events, events[1:])
             if a[0] == "propose" and b[0] == "sample"]
    assert len(pairs) == sum(e[0] == "propose" for e in events) > 0  # each step verifies next
    for batch, kw in pairs:
        assert batch.k == {2: 2, 1: 3}[len(batch.slots)] and kw["draw_k"] == 3
        assert kw["method"] == "strict" and kw["generator"] is batch.generator
        assert isinstance(batch.generator, BatchGenerator)  # a seeded row has its own stream
        if len(batch.slots) == 2:  # rows differ: per-row tensors, the very same ones
            assert kw["temperature"] is batch.temperature and kw["top_k"] is batch.top_k
            assert torch.equal(batch.temperature, torch.tensor([0.7, 1.0]))
            assert torch.equal(batch.top_k, torch.tensor([4, 0]))


def test_a_plan_without_drafts_samples_the_target_itself(loopy_target):
    """A prefill's plan: no drafts, but the sampler's draws as for the configured k, so a seeded
    request's stream does not depend on whether a step drafted."""
    llm = LLM(loopy_target, speculative_config={"method": "ngram", "num_speculative_tokens": 4},
              dtype="float32")
    plan = step.plan_step([], llm.spec, llm.generator, llm.device, drafting=False)
    assert (plan.k, plan.draw_k, plan.rejection) == (0, 4, "strict")
