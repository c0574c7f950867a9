"""Prefill grouping (infer/request.py): optimal splits, and the engine's use of them."""

import itertools
import random

from infer.engine import LLM
from infer.request import prefill_groups
from infer.sampling import SamplingParams


def cost(lengths, groups, call_cost):
    return sum(len(g) * max(lengths[i] for i in g) + call_cost for g in groups)


def best_by_enumeration(lengths, call_cost):
    """Every split of the sorted lengths into consecutive groups."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    best = None
    for cuts in itertools.product([False, True], repeat=len(order) - 1):
        groups, start = [], 0
        for i, cut in enumerate(cuts, 1):
            if cut:
                groups.append(order[start:i])
                start = i
        groups.append(order[start:])
        c = cost(lengths, groups, call_cost)
        best = c if best is None else min(best, c)
    return best


def test_groups_are_a_minimal_cost_partition():
    rng = random.Random(0)
    for _ in range(60):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 8))]
        call_cost = rng.choice([0, 16, 64, 1000])
        groups = prefill_groups(lengths, call_cost)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert cost(lengths, groups, call_cost) == best_by_enumeration(lengths, call_cost)
    assert prefill_groups([]) == []
    assert prefill_groups([7, 7, 7], call_cost=64) == [[0, 1, 2]]  # nothing to gain by splitting
    assert prefill_groups([5, 300], call_cost=64) == [[0], [1]]


def test_engine_prefills_in_groups_and_keeps_outputs(tiny_target, monkeypatch):
    prompts = [[3] * 60, [4, 5], [6] * 57, [7, 8, 9]]  # two long, two short
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = [LLM(tiny_target, max_num_seqs=1).generate([p], params)[0].token_ids
             for p in prompts]
    # prompts apart from the step, as engines with fixed-shape (CUDA graph) steps prefill them
    monkeypatch.setattr(LLM, "_groups_prompts", property(lambda self: False))
    llm = LLM(tiny_target, max_num_seqs=4)
    widths, forward = [], llm.target.model.forward

    def counting(ids, *args, **kwargs):
        if kwargs.get("logits_at") is not None:  # the prefill forwards
            widths.append(tuple(ids.shape))
        return forward(ids, *args, **kwargs)

    monkeypatch.setattr(llm.target.model, "forward", counting)
    steps = []
    verify = llm.runner.verify
    monkeypatch.setattr(llm.runner, "verify", lambda inputs, reqs, *a, **k: (
        steps.append([r.slot for r in reqs]), verify(inputs, reqs, *a, **k))[1])
    outs = llm.generate(prompts, params)
    assert sorted(widths) == [(2, 3), (2, 60)]  # short with short, long with long
    assert all(s == sorted(s) for s in steps)  # the running batch stays in slot order
    assert [o.token_ids for o in outs] == alone
    # prompt i in slot i, its cache all but the last emitted token
    assert llm.cache.lens.tolist() == [len(p) + 6 - 1 for p in prompts]
