"""One timed run of the harness: a configuration's engine over a set of prompts.

``measure_run`` forks the loaded engine for one configuration, warms it up and times one
``generate`` over the prompts (the whole-run scheme); ``timed_run`` times one ``generate`` on an
engine the caller keeps (the interleaved scheme runs each prompt apart and ``merge_runs`` puts
the pieces back together as one run). ``measure_vllm`` is the same run on vLLM. The harness
(``infer/eval/harness.py``) decides which runs happen in what order.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import torch

from infer.engine import LLM
from infer.eval.machine import CpuMonitor, CpuWindow
from infer.eval.vllm_engine import VllmEngine, for_vllm
from infer.metrics import SpecMetrics
from infer.request import RequestOutput
from infer.sampling import SamplingParams
from infer.spec_config import SpeculativeConfig
from infer.timing import EngineTimers

log = logging.getLogger(__name__)


@dataclass
class Run:
    """What one timed run produced and cost."""

    outputs: list[list[int]]  # token ids per prompt, in prompt order
    metrics: SpecMetrics
    tokens: int
    seconds: float
    errors: int
    timers: EngineTimers | None  # None: vLLM (no per-step timings)
    device: str
    cpu: CpuWindow  # what else the machine did meanwhile
    at: float = 0.0  # time.monotonic() at the middle of the timed run

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def warm_up(llm: LLM, prompts: list, params: SamplingParams) -> None:
    """Keep first-call costs out of a timed run: a 2-token request (allocations barely touch the
    caches), or on CUDA the whole run once, so every CUDA graph it needs is captured first. The
    warm-up's outputs are then forgotten (``Proposer.reset``), so they feed no timed draft."""
    if llm.static_forward is not None:
        llm.generate(prompts, params)
    else:
        llm.generate(prompts[:1], SamplingParams(temperature=params.temperature, max_tokens=2,
                                                 ignore_eos=True))
    if llm.proposer is not None:
        llm.proposer.reset()


def timed_generate(llm: LLM, prompts: list, params: SamplingParams
                   ) -> tuple[list[RequestOutput], float, EngineTimers]:
    """One ``generate`` with the engine's step timers on: (outputs, wall seconds, timers)."""
    llm.timers = timers = EngineTimers.on(llm.device)
    try:
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        return outs, time.perf_counter() - start, timers
    finally:
        llm.timers = None


def timed_run(llm: LLM, prompts: list, params: SamplingParams) -> Run:
    """One timed ``generate`` of ``prompts`` on ``llm``, watched by a :class:`CpuMonitor`."""
    with CpuMonitor() as cpu:
        outs, seconds, timers = timed_generate(llm, prompts, params)
    metrics = SpecMetrics()
    for o in outs:  # this call's requests only (not a warm-up's)
        metrics.merge(SpecMetrics.from_dict(o.metrics))
    return Run([list(o.token_ids) for o in outs], metrics, sum(len(o.token_ids) for o in outs),
               seconds, sum(o.error is not None for o in outs), timers, str(llm.device),
               cpu.window, time.monotonic() - seconds / 2)


def merge_runs(parts: list[Run]) -> Run:
    """Runs of one engine over consecutive slices of a prompt set, as the one run over all of
    them: outputs in order, counters and step timings pooled, seconds summed (the time between
    the pieces, spent on other configurations, is not this run's)."""
    metrics = SpecMetrics()
    for p in parts:
        metrics.merge(p.metrics)
    timers = (EngineTimers.merged([p.timers for p in parts])
              if all(p.timers is not None for p in parts) else None)
    return Run([o for p in parts for o in p.outputs], metrics, sum(p.tokens for p in parts),
               sum(p.seconds for p in parts), sum(p.errors for p in parts), timers,
               parts[0].device, CpuWindow.merged([p.cpu for p in parts]),
               sum(p.at for p in parts) / len(parts))


def warn_if_contended(run: Run) -> None:
    if run.cpu.contended:
        log.warning("other processes kept %.2f cores busy during this timed run: its timings "
                    "are not to be trusted", run.cpu.other_cores)


def measure_run(engine: LLM, spec: SpeculativeConfig | None, prompts: list,
                params: SamplingParams, batch_size: int, warmup: bool) -> Run:
    """Fork ``engine`` for ``spec`` at ``batch_size`` (the target stays loaded; same seed),
    warm it up when asked, and time one run of ``prompts``."""
    llm = engine.with_config(spec, max_num_seqs=batch_size)
    try:
        if warmup:
            warm_up(llm, prompts, params)
        run = timed_run(llm, prompts, params)
    finally:
        on_cuda = llm.device.type == "cuda"
        del llm
        if on_cuda:  # give the next configuration the memory back (gc.collect costs ~0.2 s)
            gc.collect()
            torch.cuda.empty_cache()
    warn_if_contended(run)
    return run


def measure_vllm(vllm: VllmEngine, spec: SpeculativeConfig | None, prompt_ids: list,
                 params: SamplingParams, batch_size: int, warmup: bool) -> Run:
    """The same run on vLLM (infer/eval/vllm_engine.py): outputs, counters, wall time."""
    res = vllm.run(for_vllm(spec) if spec else None, prompt_ids,
                   temperature=params.temperature, max_tokens=params.max_tokens,
                   ignore_eos=params.ignore_eos, batch_size=batch_size, warmup=warmup)
    tokens = sum(len(t) for t in res.token_ids)
    return Run(res.token_ids, res.metrics, tokens, res.seconds, 0, None, "vllm",
               CpuWindow(res.seconds, 0.0, None), time.monotonic() - res.seconds / 2)
