"""The engine times its own steps when given timers (what the harness and benchmarks read)."""

from infer.engine import LLM
from infer.eval.harness import timed_generate
from infer.sampling import SamplingParams
from infer.timing import EngineTimers

PROMPTS = [[5, 6, 7, 5, 6, 7], [9, 10, 11], [20, 21, 20, 21, 20]]


def test_engine_fills_its_timers(tiny_target, tiny_draft):
    spec = {"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 3}
    llm = LLM(tiny_target, speculative_config=spec, max_num_seqs=2, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    untimed = llm.generate(PROMPTS, params)
    assert llm.timers is None
    steps = []
    real = llm.speculative_step

    def counted():
        steps.append(len(llm.scheduler.running))
        real()

    llm.speculative_step = counted
    outs, seconds, timers = timed_generate(llm, PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in untimed]  # timing changes nothing
    assert llm.timers is None and seconds > 0
    assert timers.step.calls == len(steps) == len(timers.step.durations)
    assert timers.draft.calls == timers.step.calls  # one propose per step
    assert timers.verify.calls == timers.step.calls and timers.verify.rows == sum(steps)
    assert timers.prefill.calls >= 2 and timers.prefill.rows == 0  # 3 prompts, 2 slots
    assert 0 < timers.draft.median < timers.step.median
    assert timers.verify.mean < timers.step.mean


def test_autoregressive_steps_draft_nothing(tiny_target):
    llm = LLM(tiny_target, max_num_seqs=3, device="cpu")
    llm.timers = EngineTimers.on(llm.device)
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert llm.timers.step.calls == 4 and llm.timers.draft.calls == 0  # first token: prefill
