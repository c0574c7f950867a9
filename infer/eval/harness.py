"""Acceptance evaluation harness: a matrix of speculative configurations over a prompt set.

``run_harness(target, configs, prompts, HarnessOptions(...), output_dir=...)`` runs every
configuration (method x k x temperature x batch size) with draftsmith's engine, once more without
speculation per (batch size, temperature) as the baseline, and returns a ``HarnessReport``; with
``output_dir`` it writes ``results.json``, ``results.md`` and PNG plots there (see
``infer/eval/report.py`` and ``docs/harness.md``), and with a ``logger`` it logs the same to
W&B. Metrics come from ``infer.metrics.SpecMetrics`` (the one definition); costs come from the
step timers the engine fills (``infer/timing.py``).

Costs (``cost_draft``, ``cost_verify``, in units of one autoregressive step at the same batch
size and temperature), the predicted speedup and the k advisor are defined in
``infer/eval/advisor.py``.

Greedy rows (temperature 0) must reproduce the autoregressive outputs token for token; a
mismatch sets ``lossless: false``, is logged as an error and flagged in results.md.

Prompts: a list of strings / token-id lists (the entry point passes the held-out code prompts), or
``load_prompts(source)`` (``infer/eval/prompt_sets.py``, re-exported here) for local json / jsonl /
csv / parquet files and Hugging Face datasets in the common shapes (``prompt``, ``question``,
``turns``, ``messages`` / ``conversations``, ``instruction``, ``text``).

results.json keys: ``infer/eval/results.py``.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from infer.engine import LLM
from infer.eval.advisor import advise, predicted_speedup
from infer.eval.vllm_engine import (VllmEngine, cpu_defaults, engine_dtype, for_vllm,
                                     vllm_has_cuda)
from infer.eval.methods import check_methods
from infer.eval.machine import CpuMonitor, CpuWindow, machine_settings
from infer.eval.options import HarnessOptions
from infer.eval.prompt_sets import load_prompts, prompt_from_record, render_prompt  # noqa: F401
from infer.eval.results import Baseline, ConfigResult, HarnessReport
from infer.metrics import SpecMetrics
from infer.proposers.base import PROPOSERS, proposer_class
from infer.request import RequestOutput, make_requests
from infer.sampling import SamplingParams
from infer.spec_config import SpeculativeConfig
from infer.target import Target, TargetTokens
from infer.timing import EngineTimers
from infer.foundation.tracking import Logger, NoopLogger
from infer.foundation.validation import check_float, check_int, config_error

log = logging.getLogger(__name__)
_WHERE = "harness"


# ---- the matrix -----------------------------------------------------------------------------

@dataclass(frozen=True)
class HarnessConfig:
    """One cell of the matrix. ``speculative_config`` is a vLLM mapping without k (``k`` sets
    ``num_speculative_tokens``); ``method`` is the label in reports (default: the method).

    Sampled rows (temperature > 0) of a drafter with a distribution to sample from draft with
    ``draft_sample_method: probabilistic`` (the p/q test) unless the mapping says how (or the
    drafter has another vocabulary, ``use_heterogeneous_vocab``: greedy drafts only): at
    temperature 1 it accepts far more than greedy drafts judged by p(x) alone (vLLM's default),
    and both are lossless. The report's "drafts" column says which rule ran."""

    speculative_config: Mapping[str, Any]
    k: int
    temperature: float = 0.0
    batch_size: int = 1
    method: str = ""

    def __post_init__(self) -> None:
        check_int("k", self.k, _WHERE, minimum=1)
        check_float("temperature", self.temperature, _WHERE, low=0.0)
        check_int("batch_size", self.batch_size, _WHERE, minimum=1)
        if not self.method:
            object.__setattr__(self, "method", str(self.speculative_config.get("method")))

    def spec(self) -> SpeculativeConfig:
        given = {**self.speculative_config, "num_speculative_tokens": self.k}
        spec = SpeculativeConfig.parse(given)
        if self.temperature > 0 and not {"rejection_sample_method",
                                         "draft_sample_method"} & given.keys() \
                and spec.method in PROPOSERS.names() and not spec.use_heterogeneous_vocab \
                and proposer_class(spec).provides_draft_probs:
            spec = SpeculativeConfig.parse({**given, "draft_sample_method": "probabilistic"})
        return spec


def expand_matrix(methods: Sequence[Mapping[str, Any]], ks: Sequence[int],
                  temperatures: Sequence[float] = (0.0,),
                  batch_sizes: Sequence[int] = (1,)) -> list[HarnessConfig]:
    """methods x ks x temperatures x batch sizes; each method as ``infer/eval/methods.py``
    describes it (its label, its own lists in place of the matrix's), checked there."""
    if not methods or not ks or not temperatures or not batch_sizes:
        raise config_error("methods/ks/temperatures/batch_sizes",
                           [list(methods), list(ks), list(temperatures), list(batch_sizes)],
                           "non-empty lists", _WHERE)
    entries = check_methods("methods", methods, _WHERE, ks_key="the 'ks' list")
    return [HarnessConfig(e.spec, int(k), float(t), int(b), e.label) for e in entries
            for k in e.ks or ks for t in e.temperatures or temperatures
            for b in e.batch_sizes or batch_sizes]


# ---- one run --------------------------------------------------------------------------------

@dataclass
class _Run:
    outputs: list[list[int]]
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
    if llm.runner.static_forward is not None:
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


def _measure(engine: LLM, spec: SpeculativeConfig | None, prompts: list, params: SamplingParams,
             batch_size: int, warmup: bool) -> _Run:
    llm = engine.with_config(spec, max_num_seqs=batch_size)  # the target stays loaded; same seed
    device = str(llm.device)
    try:
        if warmup:
            warm_up(llm, prompts, params)
        with CpuMonitor() as cpu:
            outs, seconds, timers = timed_generate(llm, prompts, params)
        at = time.monotonic() - seconds / 2
    finally:
        on_cuda = llm.device.type == "cuda"
        del llm
        if on_cuda:  # give the next configuration the memory back (gc.collect costs ~0.2 s)
            gc.collect()
            torch.cuda.empty_cache()
    metrics = SpecMetrics()
    for o in outs:  # this call's requests only (not the warm-up)
        metrics.merge(SpecMetrics.from_dict(o.metrics))
    if cpu.window.contended:
        log.warning("other processes kept %.2f cores busy during this timed run: its timings "
                    "are not to be trusted", cpu.window.other_cores)
    return _Run([list(o.token_ids) for o in outs], metrics, sum(len(o.token_ids) for o in outs),
                seconds, sum(o.error is not None for o in outs), timers, device, cpu.window, at)


def _measure_vllm(vllm: VllmEngine, spec: SpeculativeConfig | None, prompt_ids: list,
                  params: SamplingParams, batch_size: int, warmup: bool) -> _Run:
    """The same run on vLLM (infer/eval/vllm_engine.py): outputs, counters, wall time."""
    res = vllm.run(for_vllm(spec) if spec else None, prompt_ids,
                   temperature=params.temperature, max_tokens=params.max_tokens,
                   ignore_eos=params.ignore_eos, batch_size=batch_size, warmup=warmup)
    tokens = sum(len(t) for t in res.token_ids)
    return _Run(res.token_ids, res.metrics, tokens, res.seconds, 0, None, "vllm",
                CpuWindow(res.seconds, 0.0, None), time.monotonic() - res.seconds / 2)


# ---- the harness ----------------------------------------------------------------------------

@dataclass
class _Matrix:
    """Runs configurations on one loaded engine, a (batch size, temperature) cell at a time:
    the cell's configurations back to back, between two autoregressive runs (:meth:`cell`)."""

    engine: LLM | None  # None on vLLM (eval.engine=vllm): ``tokens`` tokenizes the prompts
    tokens: Target | TargetTokens
    prompts: list
    max_tokens: int
    ignore_eos: bool
    warmup: bool
    vllm: VllmEngine | None = None  # eval.engine=vllm: every run goes there instead
    num_prompts: int = 0  # prompts of a batch-1 run
    requests_per_slot: int = 0  # a batch-B run takes at least this many per slot
    repeats: int = 1  # rounds per cell: timed runs of each configuration (:meth:`cell`)
    baselines: list[Baseline] = field(default_factory=list)  # one per cell, in run order

    def prompts_at(self, batch: int) -> list:
        """The first max(num_prompts, requests_per_slot x batch) prompts: each slot is refilled
        several times, so the drain at the end of a closed set of requests stays small."""
        return self.prompts[: max(self.num_prompts, self.requests_per_slot * batch)]

    def measure(self, spec: SpeculativeConfig | None, temperature: float, batch: int) -> _Run:
        params, prompts = self.params(temperature), self.prompts_at(batch)
        if self.vllm is None:
            return _measure(self.engine, spec, prompts, params, batch, self.warmup)
        ids = [r.prompt_ids for r in make_requests(prompts, params, self.tokens)]
        return _measure_vllm(self.vllm, spec, ids, params, batch, self.warmup)

    def params(self, temperature: float) -> SamplingParams:
        return SamplingParams(temperature=temperature, max_tokens=self.max_tokens,
                              ignore_eos=self.ignore_eos)

    def cell(self, cfgs: Sequence[HarnessConfig]) -> list[ConfigResult]:
        """The rows of one cell (every config has its batch size and temperature). A shared
        machine's throughput drifts by tens of percent over minutes and moves every method alike
        (docs/benchmarks-history.md), so the cell runs in rounds: each round every configuration
        once, back to back (in an order that shifts from round to round), then an autoregressive
        run; one more autoregressive run opens the first round. A run's speedup is against the two
        autoregressive runs around its round, interpolated to its middle; with ``repeats`` > 1
        a row's speedup is the median over its rounds. Every configuration meets the same
        minutes of the machine, and two rows compare runs seconds apart."""
        batch, temp = cfgs[0].batch_size, cfgs[0].temperature
        specs = [cfg.spec() for cfg in cfgs]
        ars = [self.measure(None, temp, batch)]
        runs: list[list[_Run]] = [[] for _ in cfgs]
        for r in range(self.repeats):
            shift = r * len(cfgs) // self.repeats
            for j in range(len(cfgs)):
                i = (shift + j) % len(cfgs)
                runs[i].append(self.measure(specs[i], temp, batch))
            ars.append(self.measure(None, temp, batch))
        base = _baseline(ars[0], ars[1], batch, temp)
        log.info("autoregressive batch=%d temperature=%g: %.1f tok/s before the cell, %.1f after "
                 "its first round", batch, temp, base.tok_s, base.tok_s_after)
        if base.drifted:
            log.warning("the machine's speed moved by %+.0f %% within this cell (autoregressive "
                        "%.1f -> %.1f tok/s): single-run speedups here are as uncertain%s",
                        100 * base.drift, base.tok_s, base.tok_s_after,
                        "" if self.repeats > 1 else "; eval.repeats=3 takes medians")
        self.baselines.append(base)
        return [self._row(cfg, spec, rounds, ars, base)
                for cfg, spec, rounds in zip(cfgs, specs, runs)]

    def _row(self, cfg: HarnessConfig, spec: SpeculativeConfig, rounds: list[_Run],
             ars: list[_Run], base: Baseline) -> ConfigResult:
        """The row of one configuration from its first round (its run ``r`` lies between
        ``ars[r]`` and ``ars[r + 1]``); the speedup over all rounds."""
        first = _baseline_at(base, ars[0], ars[1], rounds[0].at)
        row = _result(cfg, spec, rounds[0], first, ars[0])
        if self.repeats > 1:
            row.speedup_runs = [_speedup(run, ars[r], ars[r + 1]) for r, run in enumerate(rounds)]
            row.speedup = statistics.median(row.speedup_runs)
        log.info("%s k=%d T=%g batch=%d: acceptance length %.2f, speedup %.2f (predicted %.2f)",
                 row.method, row.k, row.temperature, row.batch_size, row.acceptance_length,
                 row.speedup, row.predicted_speedup)
        return row

    @property
    def device(self) -> str:
        return "vllm" if self.vllm is not None else str(self.engine.device)

    def settings(self, **run: Any) -> dict:
        """results.json's ``settings``: the matrix's own, the run's (``run``), the software's
        and the machine's."""
        return {"max_tokens": self.max_tokens, "num_prompts": self.num_prompts,
                "requests_per_slot": self.requests_per_slot, "repeats": self.repeats,
                "ignore_eos": self.ignore_eos, "device": self.device, "warmup": self.warmup,
                **run, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                "machine": machine_settings()}


def run_harness(target: str | Target, configs: Sequence[HarnessConfig], prompts: Sequence[Any],
                options: HarnessOptions = HarnessOptions(), *,
                output_dir: str | Path | None = None, logger: Logger | None = None,
                step: int | None = None, prefix: str = "eval") -> HarnessReport:
    """Run ``configs`` (``expand_matrix``) on ``prompts`` as ``options`` say.

    ``target``: a model directory (loaded once with the options' device / dtype / max_model_len)
    or a loaded :class:`~infer.target.Target` (which fixed those). Writes results.json /
    results.md / plots into ``output_dir`` when given; logs per-config acceptance scalars, the
    results table and the plots to ``logger`` at ``step`` under ``prefix``. ``engine="vllm"``
    runs every configuration on vLLM instead (infer/eval/vllm_engine.py); only the target's
    tokenizer is loaded here then (``TargetTokens``), so any target vLLM serves can be
    measured, also one draftsmith's engine does not run. A batch-B run takes the first
    max(num_prompts, requests_per_slot x B) of ``prompts`` (EvalConfig.requests_per_slot says
    why); repeats > 1: each row's speedup is the median over that many rounds of its cell
    (``_Matrix.cell``).
    """
    o, configs, prompts = options, list(configs), list(prompts)
    if not prompts:
        raise ValueError("run_harness: no prompts")
    for cfg in configs:  # every config error before the first (possibly long) run
        cfg.spec()
    check_int("max_tokens", o.max_tokens, _WHERE, minimum=1)
    logger = logger or NoopLogger()
    engine_llm, tokens, vllm = _engines(target, o)
    matrix = _Matrix(engine_llm, tokens, prompts, o.max_tokens, o.ignore_eos, o.warmup, vllm,
                     o.num_prompts or len(prompts), o.requests_per_slot, o.repeats)
    _warn_short(matrix, configs)
    results: list[ConfigResult] = [None] * len(configs)  # type: ignore[list-item]
    for cell in _by_cell(configs):
        for i, row in zip(cell, matrix.cell([configs[i] for i in cell])):
            results[i] = row
            logger.log_acceptance(f"{prefix}/{config_id(row)}", asdict(row), step=step)
    # vLLM exposes no step costs: no cost model, no k advice for its rows
    advisor, recommended = advise(results) if vllm is None else ([], {})
    report = HarnessReport(
        target=tokens.path,
        baselines=matrix.baselines, results=results, advisor=advisor,
        recommended_k=recommended, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        settings=matrix.settings(dtype=o.dtype, seed=o.seed, engine=o.engine,
                                 tensor_parallel_size=o.tensor_parallel_size))
    from infer.eval.report import log_report, write_report  # matplotlib: only when needed

    if output_dir is not None:
        write_report(report, output_dir)
    log_report(report, logger, step=step, prefix=prefix)
    return report


def _baseline(before: _Run, after: _Run, batch: int, temp: float) -> Baseline:
    """The cell's record: the run before its rows, with the throughput of the run after."""
    steps, c_ar = ((before.timers.step.calls, before.timers.step.median) if before.timers
                   else (0, 0.0))
    return Baseline(batch, temp, before.tok_s, before.tokens, before.seconds, steps, c_ar,
                    before.cpu.other_cores, len(before.outputs), tok_s_after=after.tok_s,
                    c_ar_s_after=after.timers.step.median if after.timers else 0.0)


def _weight(before: _Run, after: _Run, at: float) -> float:
    """Where time ``at`` lies between the two runs' middles, 0 .. 1 (held at the ends)."""
    span = after.at - before.at
    return min(max((at - before.at) / span, 0.0), 1.0) if span > 0 else 0.5


def _speedup(run: _Run, before: _Run, after: _Run) -> float:
    """``run``'s throughput over the autoregressive one interpolated to its middle."""
    ar = _lerp(before.tok_s, after.tok_s, _weight(before, after, run.at))
    return run.tok_s / ar if ar else 0.0


def _baseline_at(base: Baseline, before: _Run, after: _Run, at: float) -> Baseline:
    """``base`` (the record of ``before`` and ``after``) with its throughput and step time
    interpolated to time ``at``: what a run measured at ``at`` is compared with."""
    w = _weight(before, after, at)
    return dataclasses.replace(base, tok_s=_lerp(base.tok_s, base.tok_s_after, w),
                               c_ar_s=_lerp(base.c_ar_s, base.c_ar_s_after or base.c_ar_s, w))


def _lerp(a: float, b: float, w: float) -> float:
    return (1 - w) * a + w * b


def _by_cell(configs: Sequence[HarnessConfig]) -> list[list[int]]:
    """Indices of ``configs`` grouped by (batch size, temperature), cells in order of first
    appearance, each cell's configs in their order."""
    cells: dict[tuple[int, float], list[int]] = {}
    for i, cfg in enumerate(configs):
        cells.setdefault((cfg.batch_size, cfg.temperature), []).append(i)
    return list(cells.values())


def _warn_short(matrix: _Matrix, configs: Sequence[HarnessConfig]) -> None:
    """A prompt set too small for requests_per_slot at some batch size: say so, run with it."""
    for batch in sorted({c.batch_size for c in configs}):
        want = matrix.requests_per_slot * batch
        if want > len(matrix.prompts):
            log.warning("batch %d: %d requests per slot want %d prompts, the prompt set has %d; "
                        "its runs end in a longer drain", batch, matrix.requests_per_slot, want,
                        len(matrix.prompts))


def _engines(target: str | Target, o: HarnessOptions
             ) -> tuple[LLM | None, Target | TargetTokens, VllmEngine | None]:
    """draftsmith's engine (forked per run) and its target; or, for ``engine="vllm"``, the vLLM
    runner in the dtype this engine would use, with only the target's tokenizer loaded here."""
    if o.engine == "draftsmith":
        llm = LLM(target, seed=o.seed, max_num_seqs=1, device=o.device, dtype=o.dtype,
                  max_model_len=o.max_model_len, num_threads=o.num_threads)
        return llm, llm.target, None
    if o.engine != "vllm":
        raise config_error("engine", o.engine, "'draftsmith' or 'vllm'", _WHERE)
    tokens = (TargetTokens.load(target, max_model_len=o.max_model_len)
              if isinstance(target, str) else target)
    cuda = vllm_has_cuda(o.vllm_python)
    vllm = VllmEngine(tokens.path, o.vllm_python, o.tensor_parallel_size, o.max_model_len,
                      engine_dtype(o.dtype, tokens.path, cuda), o.seed, cpu_defaults(cuda))
    return None, tokens, vllm


def config_id(row: ConfigResult | HarnessConfig) -> str:
    """``method/k3/T0/b1``: a W&B-safe key for one configuration (no dots)."""
    temp = f"{row.temperature:g}".replace(".", "_")
    return f"{row.method}/k{row.k}/T{temp}/b{row.batch_size}"


def _step_costs(t: EngineTimers | None) -> tuple[float, float]:
    """Median seconds per step of drafting and of the rest of the step (verify forward,
    rejection sampling, bookkeeping). Medians, paired per step: robust to the scheduling
    hiccups of a shared machine, which would otherwise dominate a mean. (0, 0) without
    timers (vLLM runs)."""
    if t is None:
        return 0.0, 0.0
    steps, drafts = t.step.durations, t.draft.durations
    if len(drafts) != len(steps):  # not one propose per step: fall back to means
        c_draft = t.draft.seconds / max(t.step.calls, 1)
        return c_draft, t.step.mean - c_draft
    if not steps:
        return 0.0, 0.0
    return statistics.median(drafts), statistics.median(s - d for s, d in zip(steps, drafts))


def _result(cfg: HarnessConfig, spec: SpeculativeConfig, run: _Run, base: Baseline,
            ar: _Run) -> ConfigResult:
    m, t = run.metrics, run.timers
    per_position = (m.per_position_rates + [0.0] * cfg.k)[: cfg.k]
    per_pos_counts = (m.num_accepted_tokens_per_pos + [0] * cfg.k)[: cfg.k]
    # vLLM: no step count; each request-step emits its accepted drafts plus one token, after
    # the first token of the prefill
    request_steps = max(t.verify.rows if t else
                        run.tokens - len(run.outputs) - m.num_accepted_tokens, 1)
    # (vLLM's estimate runs short by the steps whose emitted tokens max_tokens cut: capped)
    coverage = min(m.num_drafts / request_steps, 1.0)
    c_ar = base.c_ar_s
    c_draft, c_verify = _step_costs(t)
    cost_draft, cost_verify = (c_draft / c_ar, c_verify / c_ar) if c_ar > 0 else (0.0, 0.0)
    lossless, mismatched = None, []
    if cfg.temperature == 0.0:
        mismatched = [i for i, (a, b) in enumerate(zip(run.outputs, ar.outputs)) if a != b]
        lossless = not mismatched and len(run.outputs) == len(ar.outputs)
        if not lossless:
            log.error("LOSSLESS CHECK FAILED: %s k=%d batch=%d temperature 0: %d of %d outputs "
                      "differ from autoregressive decoding (prompts %s)", cfg.method, cfg.k,
                      cfg.batch_size, len(mismatched), len(run.outputs), mismatched[:10])
    return ConfigResult(
        method=cfg.method, speculative_config=spec.to_dict(), k=cfg.k,
        temperature=cfg.temperature, batch_size=cfg.batch_size,
        acceptance_length=m.mean_acceptance_length, acceptance_rate=m.acceptance_rate,
        per_position=per_position, num_drafts=m.num_drafts, num_draft_tokens=m.num_draft_tokens,
        num_accepted_tokens=m.num_accepted_tokens, num_accepted_tokens_per_pos=per_pos_counts,
        draft_coverage=coverage, tokens=run.tokens, seconds=run.seconds, tok_s=run.tok_s,
        ar_tok_s=base.tok_s, speedup=run.tok_s / base.tok_s if base.tok_s else 0.0,
        predicted_speedup=predicted_speedup(coverage * sum(per_position), cost_draft,
                                            cost_verify),
        tokens_per_step=(run.tokens - len(run.outputs) + run.errors) / request_steps
        if t is None or t.verify.rows else 0.0,
        cost_draft=cost_draft, cost_verify=cost_verify, c_ar_s=base.c_ar_s,
        c_step_s=t.step.median if t else 0.0, c_draft_s=c_draft, c_verify_s=c_verify,
        c_verify_forward_s=t.verify.median if t else 0.0, steps=t.step.calls if t else 0,
        draft_sample_method=spec.draft_sample_method, other_cores=run.cpu.other_cores,
        lossless=lossless, mismatched_prompts=mismatched, num_errors=run.errors,
        num_prompts=len(run.outputs))
