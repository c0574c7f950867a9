"""Shared checks of the proposer tests."""

from __future__ import annotations

import infer.graphs
from infer.engine import LLM
from infer.sampling import SamplingParams


def drafted(llm: LLM, prompts: list, params) -> tuple[list, list]:
    """``generate`` through ``llm`` recording every step's drafts: (outputs, drafts per step)."""
    seen, propose = [], llm.proposer.propose

    def record(batch):
        proposal = propose(batch)
        seen.append(proposal.draft_ids.tolist())
        return proposal
    llm.proposer.propose = record
    return llm.generate(prompts, params), seen


def check_static_drafts(target: str, spec: dict, prompts: list, monkeypatch,
                        synthetic: float | None = None) -> None:
    """A one-forward proposer's static path (fixed shapes, captured as CUDA graphs on CUDA; run
    eagerly here over the same buffers: what ``LLM(device="cuda")`` sets up) against its plain
    forward, with continuous batching (2 slots for 4 requests of different lengths: slots
    refilled, rows out of order): every step drafts exactly the same, and greedy output is the
    target's. A random head's drafts are all rejected; with ``synthetic`` (vLLM's synthetic
    acceptance rate, seeded) some are accepted, so partly accepted steps are rolled back too."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (12, 5, 9, 7)]
    if synthetic:
        spec = spec | {"rejection_sample_method": "synthetic",
                       "synthetic_acceptance_rate": synthetic}
    # the plain forward admits as the static path does (prompts apart, before the step), so
    # that the two run the same steps
    with monkeypatch.context() as m:
        m.setattr(LLM, "_groups_prompts", property(lambda self: False))
        want, plain = drafted(LLM(target, speculative_config=spec, max_num_seqs=2), prompts,
                              params)
    monkeypatch.setattr(LLM, "_static_steps", property(lambda self: True))
    monkeypatch.setattr(infer.graphs, "MIN_KV_BUCKET", 1)  # key buckets below the cache size
    llm = LLM(target, speculative_config=spec, max_num_seqs=2)
    got, static = drafted(llm, prompts, params)
    assert llm.proposer.static.graphs  # the static path drafted
    assert static == plain
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    accepted = llm.get_metrics()["num_accepted_tokens"]
    assert accepted > 0 if synthetic else accepted == 0  # random head: nothing matches
    if not synthetic:
        monkeypatch.undo()
        base = LLM(target, max_num_seqs=2).generate(prompts, params)
        assert [o.token_ids for o in got] == [o.token_ids for o in base]


def check_cuda_graph_drafts(target: str, spec: dict, prompts: list) -> None:
    """On CUDA: the proposer's steps replayed as CUDA graphs draft what eager steps draft
    (float32, greedy) and every graph was really captured."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (12, 5, 9, 7)]
    runs = [LLM(target, speculative_config=spec, max_num_seqs=2, device="cuda",
                dtype="float32", enforce_eager=eager) for eager in (True, False)]
    (want, eager), (got, graphs) = (drafted(llm, prompts, params) for llm in runs)
    assert graphs == eager and [o.token_ids for o in got] == [o.token_ids for o in want]
    captured = runs[1].proposer.static.graphs
    assert captured and all(g.graph is not None for g in captured.values())
