"""Acceptance evaluation harness: a matrix of speculative configurations over a prompt set.

``run_harness(target, configs, prompts, max_tokens=..., output_dir=...)`` runs every
configuration (method x k x temperature x batch size) with draftsmith's engine, once more without
speculation per (batch size, temperature) as the baseline, and returns a ``HarnessReport``; with
``output_dir`` it writes ``results.json``, ``results.md`` and PNG plots there (see
``infer/harness_report.py`` and ``docs/harness.md``), and with a ``logger`` it logs the same to
W&B. Metrics come from ``infer.metrics.SpecMetrics`` (the one definition); costs are measured by
wrapping the engine's methods from outside (``instrument``).

Costs (``cost_draft``, ``cost_verify``, in units of one autoregressive step at the same batch
size and temperature), the predicted speedup and the k advisor are defined in
``infer/advisor.py``.

Greedy rows (temperature 0) must reproduce the autoregressive outputs token for token; a
mismatch sets ``lossless: false``, is logged as an error and flagged in results.md.

Prompts: a list of strings / token-id lists (the entry point passes the held-out code prompts), or
``load_prompts(source)`` (``infer/prompt_sets.py``, re-exported here) for local json / jsonl /
csv / parquet files and Hugging Face datasets in the common shapes (``prompt``, ``question``,
``turns``, ``messages`` / ``conversations``, ``instruction``, ``text``).

results.json keys (``schema_version`` 1; documented in docs/harness.md):

- top level: ``schema_version``, ``created``, ``target``, ``settings`` (max_tokens, num_prompts,
  ignore_eos, device (resolved), dtype, seed, warmup, torch, torch_threads), ``baselines``,
  ``results``, ``advisor``, ``recommended_k`` (method -> k), ``lossless`` (false iff any greedy
  row mismatched), ``files`` (markdown and plot file names).
- ``baselines[]``: ``batch_size``, ``temperature``, ``tok_s``, ``tokens``, ``seconds``,
  ``steps``, ``c_ar_s``.
- ``results[]``: ``method`` (the label), ``speculative_config`` (resolved, vLLM schema), ``k``,
  ``temperature``, ``batch_size``, ``acceptance_length``, ``acceptance_rate``, ``per_position``
  (k rates), ``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``,
  ``num_accepted_tokens_per_pos``, ``draft_coverage``, ``tokens``, ``seconds``, ``tok_s``,
  ``ar_tok_s``, ``speedup``, ``predicted_speedup``, ``tokens_per_step``, ``cost_draft``,
  ``cost_verify``, ``c_ar_s``, ``c_step_s``, ``c_draft_s``, ``c_verify_s``,
  ``c_verify_forward_s``, ``steps``, ``lossless`` (bool; null for sampled rows),
  ``mismatched_prompts`` (prompt indices), ``num_errors``.
- ``advisor[]``: ``method``, ``batch_size``, ``temperature``, ``measured_ks``,
  ``recommended_k``, ``predicted_speedup``, ``candidates[]`` (``k``, ``expected_accepted``,
  ``cost_draft``, ``cost_verify``, ``predicted_speedup``).
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from infer.advisor import advise, predicted_speedup
from infer.engine import LLM
from infer.metrics import SpecMetrics
from infer.prompt_sets import load_prompts, prompt_from_record, render_prompt  # noqa: F401
from infer.sampling import SamplingParams
from infer.spec_config import SpeculativeConfig
from infer.tracking import Logger, NoopLogger
from infer.validation import check_float, check_int, config_error

log = logging.getLogger(__name__)
_WHERE = "harness"
SCHEMA_VERSION = 1


# ---- the matrix -----------------------------------------------------------------------------

@dataclass(frozen=True)
class HarnessConfig:
    """One cell of the matrix. ``speculative_config`` is a vLLM mapping without k (``k`` sets
    ``num_speculative_tokens``); ``method`` is the label in reports (default: the method)."""

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
        return SpeculativeConfig.parse({**self.speculative_config,
                                        "num_speculative_tokens": self.k})


def expand_matrix(methods: Sequence[Mapping[str, Any]], ks: Sequence[int],
                  temperatures: Sequence[float] = (0.0,),
                  batch_sizes: Sequence[int] = (1,)) -> list[HarnessConfig]:
    """methods x ks x temperatures x batch sizes. A method is a speculative_config mapping with
    an optional ``name`` (its label; default the method, which must then be unique)."""
    if not methods or not ks or not temperatures or not batch_sizes:
        raise config_error("methods/ks/temperatures/batch_sizes",
                           [list(methods), list(ks), list(temperatures), list(batch_sizes)],
                           "non-empty lists", _WHERE)
    labelled = []
    for i, m in enumerate(methods):
        if not isinstance(m, Mapping):
            raise config_error(f"methods[{i}]", m, "a speculative_config mapping", _WHERE)
        m = dict(m)
        if "num_speculative_tokens" in m:
            raise config_error(f"methods[{i}].num_speculative_tokens", m["num_speculative_tokens"],
                               "no value: k comes from the 'ks' list", _WHERE)
        name = m.pop("name", None) or m.get("method")
        if not name:  # method inferred from the draft (validates the mapping early, too)
            name = SpeculativeConfig.parse({**m, "num_speculative_tokens": 1}).method
        labelled.append((str(name), m))
    names = [n for n, _ in labelled]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise config_error("methods", names, f"unique labels; give each of {dupes} a 'name'",
                           _WHERE)
    return [HarnessConfig(m, int(k), float(t), int(b), name)
            for name, m in labelled for k in ks for t in temperatures for b in batch_sizes]


# ---- timing ---------------------------------------------------------------------------------

class Timer:
    """Accumulates wall time, calls, per-call durations and (optionally) batch rows of a wrapped
    function. On CUDA it synchronises around each call so the time is the device's."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.seconds, self.calls, self.rows = 0.0, 0, 0
        self.durations: list[float] = []
        self.cuda = torch.device(device).type == "cuda" if device is not None else False

    def wrap(self, fn: Callable, rows: Callable[..., int] | None = None) -> Callable:
        def timed(*args, **kwargs):
            if self.cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if self.cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            self.seconds += elapsed
            self.durations.append(elapsed)
            self.calls += 1
            self.rows += rows(*args, **kwargs) if rows is not None else 0
            return out
        return timed

    @property
    def mean(self) -> float:
        return self.seconds / self.calls if self.calls else 0.0

    @property
    def median(self) -> float:
        return statistics.median(self.durations) if self.durations else 0.0


@dataclass
class EngineTimers:
    """``step``: ``speculative_step``; ``verify``: target forwards of steps (not prefills), whose
    ``rows`` count request-steps; ``draft``: ``proposer.propose``; ``prefill``: prompt
    prefills (speculation does not change them)."""

    step: Timer
    verify: Timer
    draft: Timer
    prefill: Timer


@contextmanager
def instrument(llm: LLM) -> Iterator[EngineTimers]:
    """Time an engine's steps, verify forwards, prefills and proposer calls; restores them on
    exit."""
    timers = EngineTimers(*(Timer(llm.device) for _ in range(4)))
    patched = [(llm, "speculative_step", timers.step.wrap(llm.speculative_step)),
               (llm, "_verify", timers.verify.wrap(  # graph replays included, prefills not
                   llm._verify, rows=lambda ids, *a, **k: ids.shape[0])),
               (llm, "_prefill", timers.prefill.wrap(llm._prefill))]
    if llm.proposer is not None:
        patched.append((llm.proposer, "propose", timers.draft.wrap(llm.proposer.propose)))
    for obj, name, fn in patched:
        setattr(obj, name, fn)  # instance attribute shadows the method
    try:
        yield timers
    finally:
        for obj, name, _ in patched:
            obj.__dict__.pop(name, None)


# ---- one run --------------------------------------------------------------------------------

@dataclass
class _Run:
    outputs: list[list[int]]
    metrics: SpecMetrics
    tokens: int
    seconds: float
    errors: int
    timers: EngineTimers
    device: str

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


def _measure(engine: LLM, spec: SpeculativeConfig | None, prompts: list, params: SamplingParams,
             batch_size: int, warmup: bool) -> _Run:
    llm = engine.with_config(spec, max_num_seqs=batch_size)  # the target stays loaded; same seed
    device = str(llm.device)
    try:
        if warmup:
            warm_up(llm, prompts, params)
        with instrument(llm) as timers:
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            seconds = time.perf_counter() - start
    finally:
        on_cuda = llm.device.type == "cuda"
        del llm
        if on_cuda:  # give the next configuration the memory back (gc.collect costs ~0.2 s)
            gc.collect()
            torch.cuda.empty_cache()
    metrics = SpecMetrics()
    for o in outs:  # this call's requests only (not the warm-up)
        metrics.merge(SpecMetrics(o.metrics["num_drafts"], o.metrics["num_draft_tokens"],
                                  o.metrics["num_accepted_tokens"],
                                  list(o.metrics["num_accepted_tokens_per_pos"])))
    return _Run([list(o.token_ids) for o in outs], metrics, sum(len(o.token_ids) for o in outs),
                seconds, sum(o.error is not None for o in outs), timers, device)


# ---- results --------------------------------------------------------------------------------

@dataclass
class Baseline:
    batch_size: int
    temperature: float
    tok_s: float
    tokens: int
    seconds: float
    steps: int
    c_ar_s: float


@dataclass
class ConfigResult:
    """One row of results.json (keys documented in the module docstring)."""

    method: str
    speculative_config: dict
    k: int
    temperature: float
    batch_size: int
    acceptance_length: float
    acceptance_rate: float
    per_position: list[float]
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: list[int]
    draft_coverage: float
    tokens: int
    seconds: float
    tok_s: float
    ar_tok_s: float
    speedup: float
    predicted_speedup: float
    tokens_per_step: float
    cost_draft: float
    cost_verify: float
    c_ar_s: float
    c_step_s: float
    c_draft_s: float
    c_verify_s: float
    c_verify_forward_s: float
    steps: int
    lossless: bool | None
    mismatched_prompts: list[int] = field(default_factory=list)
    num_errors: int = 0


@dataclass
class HarnessReport:
    target: str
    settings: dict
    baselines: list[Baseline]
    results: list[ConfigResult]
    advisor: list[dict]
    recommended_k: dict[str, int]
    created: str
    output_dir: str | None = None
    files: dict = field(default_factory=dict)

    @property
    def lossless(self) -> bool:
        return all(r.lossless is not False for r in self.results)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "HarnessReport":
        """Rebuild a report from results.json (to redraw plots, compare runs ...)."""
        return cls(target=data["target"], settings=dict(data["settings"]),
                   baselines=[Baseline(**b) for b in data["baselines"]],
                   results=[ConfigResult(**r) for r in data["results"]],
                   advisor=list(data["advisor"]), recommended_k=dict(data["recommended_k"]),
                   created=data["created"], files=dict(data.get("files", {})))

    def to_dict(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "created": self.created, "target": self.target,
                "settings": self.settings, "baselines": [asdict(b) for b in self.baselines],
                "results": [asdict(r) for r in self.results], "advisor": self.advisor,
                "recommended_k": self.recommended_k, "lossless": self.lossless,
                "files": self.files}


# ---- the harness ----------------------------------------------------------------------------

def run_harness(target: str, configs: Sequence[HarnessConfig] | Mapping[str, Any],
                prompts: Sequence[Any], *, max_tokens: int = 64,
                output_dir: str | Path | None = None, logger: Logger | None = None,
                device: str = "auto", dtype: str = "auto", seed: int = 0,
                max_model_len: int | None = None, ignore_eos: bool = False, warmup: bool = True,
                step: int | None = None, prefix: str = "eval") -> HarnessReport:
    """Run the matrix (configs, or a mapping of ``expand_matrix`` arguments) on ``prompts``.

    Writes results.json / results.md / plots into ``output_dir`` when given; logs per-config
    acceptance scalars, the results table and the plots to ``logger`` at ``step`` under
    ``prefix``. Returns the report.
    """
    if isinstance(configs, Mapping):
        configs = expand_matrix(**configs)
    configs = list(configs)
    prompts = list(prompts)
    if not prompts:
        raise ValueError("run_harness: no prompts")
    for cfg in configs:  # every config error before the first (possibly long) run
        cfg.spec()
    check_int("max_tokens", max_tokens, _WHERE, minimum=1)
    logger = logger or NoopLogger()
    engine = LLM(target, device=device, dtype=dtype, seed=seed, max_model_len=max_model_len,
                 max_num_seqs=1)  # loads the target once; each run forks it (LLM.with_config)
    baselines: dict[tuple[int, float], tuple[Baseline, _Run]] = {}

    def baseline(batch: int, temp: float) -> tuple[Baseline, _Run]:
        if (batch, temp) not in baselines:
            run = _measure(engine, None, prompts, _params(temp, max_tokens, ignore_eos), batch,
                           warmup)
            base = Baseline(batch, temp, run.tok_s, run.tokens, run.seconds, run.timers.step.calls,
                            run.timers.step.median)
            log.info("autoregressive batch=%d temperature=%g: %.1f tok/s", batch, temp, base.tok_s)
            baselines[(batch, temp)] = (base, run)
        return baselines[(batch, temp)]

    results = []
    for cfg in configs:
        base, ar = baseline(cfg.batch_size, cfg.temperature)
        spec = cfg.spec()
        run = _measure(engine, spec, prompts, _params(cfg.temperature, max_tokens, ignore_eos),
                       cfg.batch_size, warmup)
        row = _result(cfg, spec, run, base, ar)
        results.append(row)
        log.info("%s k=%d T=%g batch=%d: acceptance length %.2f, speedup %.2f (predicted %.2f)",
                 row.method, row.k, row.temperature, row.batch_size, row.acceptance_length,
                 row.speedup, row.predicted_speedup)
        logger.log_acceptance(f"{prefix}/{config_id(row)}", asdict(row), step=step)

    advisor, recommended = advise(results)
    report = HarnessReport(
        target=str(target), baselines=[b for b, _ in baselines.values()], results=results,
        advisor=advisor, recommended_k=recommended,
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        settings={"max_tokens": max_tokens, "num_prompts": len(prompts), "ignore_eos": ignore_eos,
                  "device": next(iter(baselines.values()))[1].device if baselines else device,
                  "dtype": dtype, "seed": seed, "warmup": warmup,
                  "torch": torch.__version__, "torch_threads": torch.get_num_threads()})
    from infer.harness_report import log_report, write_report  # matplotlib: only when needed

    if output_dir is not None:
        write_report(report, output_dir)
    log_report(report, logger, step=step, prefix=prefix)
    return report


def _params(temperature: float, max_tokens: int, ignore_eos: bool) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=ignore_eos)


def config_id(row: ConfigResult | HarnessConfig) -> str:
    """``method/k3/T0/b1``: a W&B-safe key for one configuration (no dots)."""
    temp = f"{row.temperature:g}".replace(".", "_")
    return f"{row.method}/k{row.k}/T{temp}/b{row.batch_size}"


def _step_costs(t: EngineTimers) -> tuple[float, float]:
    """Median seconds per step of drafting and of the rest of the step (verify forward,
    rejection sampling, bookkeeping). Medians, paired per step: robust to the scheduling
    hiccups of a shared machine, which would otherwise dominate a mean."""
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
    request_steps = max(t.verify.rows, 1)
    coverage = m.num_drafts / request_steps
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
        if t.verify.rows else 0.0,
        cost_draft=cost_draft, cost_verify=cost_verify, c_ar_s=base.c_ar_s,
        c_step_s=t.step.median, c_draft_s=c_draft, c_verify_s=c_verify,
        c_verify_forward_s=t.verify.median, steps=t.step.calls,
        lossless=lossless, mismatched_prompts=mismatched, num_errors=run.errors)
