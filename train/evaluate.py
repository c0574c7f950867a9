"""End-of-training acceptance report: the trained drafter through the same harness as serving.

The exported checkpoint is loaded by the engine exactly as ``python infer.py`` or a user would
(its ``speculative_config``), next to the configured ``eval.methods`` (n-gram by default), on
held-out prompts: the held-out standard-library code for the embedded default, or
``eval.dataset``. What is printed (acceptance length, per-position rates, speedup against
autoregressive decoding at the same batch size) is what ``results.json`` / W&B get, from
``infer.eval.harness.run_harness``.
"""

from __future__ import annotations

from typing import Any

from infer.foundation.errors import ConfigError
from infer.eval.harness import HarnessConfig, expand_matrix, run_harness
from infer.eval.methods import with_paired_draft
from infer.eval.prompt_sets import eval_prompts as render_eval_prompts
from infer.eval.results import HarnessReport
from infer.foundation.tracking import Logger
from train.config import TrainConfig
from train.tiny.corpus import existing_paired_draft


def eval_prompts(cfg: TrainConfig, target_dir: str) -> list[Any]:
    """``eval.dataset`` rendered with the target's chat template, else held-out code prompts
    (each sent as one user message, as the drafter saw its training prompts); one
    implementation with infer.py's (infer/eval/prompt_sets.py:eval_prompts)."""
    from infer.foundation.files import load_tokenizer

    from train.tiny.examples import heldout_prompts

    ev = cfg.eval
    tokenizer = load_tokenizer(target_dir, key="target.path")
    default = None if ev.dataset else heldout_prompts(ev.prompts_needed(), seed=cfg.seed)
    return render_eval_prompts(ev, tokenizer, default, template_kwargs(cfg))


def template_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    """``eval.chat_template_kwargs`` plus the data's (``data.enable_thinking``): evaluation
    prompts render as the training data did; a contradiction between the two is an error."""
    ev, data = dict(cfg.eval.chat_template_kwargs or {}), cfg.data.template_kwargs
    for key, value in data.items():
        if key in ev and ev[key] != value:
            raise ConfigError(f"eval.chat_template_kwargs.{key}={ev[key]!r} contradicts "
                              f"data.{key}={value!r}: the drafter would be evaluated on prompts "
                              f"rendered unlike its training data; set only data.{key}")
    return {**ev, **data}


def harness_configs(cfg: TrainConfig, drafter_spec: dict,
                    target_dir: str | None = None) -> list[HarnessConfig]:
    """The drafter (``drafter_spec``: its served config without k, ``Objective.served_config``;
    labelled by the recipe name) and each of ``eval.methods``, at every ``eval.ks`` x
    ``eval.temperatures`` x ``eval.batch_sizes``. A ``draft_model`` entry without a ``model`` is
    the draft LM paired with the target (``with_paired_draft``)."""
    drafter = {"name": cfg.name, **drafter_spec}
    ev = cfg.eval
    methods = [drafter] + with_paired_draft(ev.methods, existing_paired_draft(target_dir))
    return expand_matrix(methods, ev.ks, ev.temperatures, ev.batch_sizes)


def evaluate(cfg: TrainConfig, target_dir: str, drafter_spec: dict, logger: Logger,
             step: int | None = None, device: str = "auto") -> HarnessReport:
    """Run the harness, write ``eval.output_dir`` (default ``<run_dir>/eval``: results.json,
    results.md, plots), print a summary, log to ``logger``."""
    ev = cfg.eval
    out = ev.output_dir or cfg.run_dir / "eval"
    options = ev.harness_options(device=device, seed=cfg.seed,
                                 num_threads=cfg.trainer.num_threads)
    report = run_harness(target_dir, harness_configs(cfg, drafter_spec, target_dir),
                         eval_prompts(cfg, target_dir), options, output_dir=out, logger=logger,
                         step=step, prefix="eval")
    print(summary(report))
    print(f"acceptance report: {out}/results.md")
    return report


def summary(report: HarnessReport) -> str:
    """One line per configuration: temperature, batch, drafting rule, acceptance length,
    per-position rates, speedup (``busy``: another process competed for the cores); each cell's
    autoregressive throughput before and after, and whether the machine's speed drifted."""
    lines = ["method            k    T  batch  drafts   accept_len  per-position         tok/s"
             "   speedup"]
    for r in report.results:
        rates = " ".join(f"{x:.2f}" for x in r.per_position)
        drafts = "sampled" if r.draft_sample_method == "probabilistic" else "greedy"
        lines.append(f"{r.method:<16} {r.k:>2} {r.temperature:>4g} {r.batch_size:>6}  "
                     f"{drafts:<7} {r.acceptance_length:>11.2f}  {rates:<20} {r.tok_s:>6.1f}  "
                     f"{r.speedup:>7.2f}x" + (" busy" if r.contended else ""))
    for b in report.baselines:
        drift = (f" (the machine's speed moved {b.drift:+.0%} within the cell: its single-run "
                 "speedups are as uncertain)" if b.drifted else "")
        lines.append(f"autoregressive (batch {b.batch_size}, T={b.temperature:g}): "
                     f"{b.tok_s:.1f} tok/s before the cell, {b.tok_s_after:.1f} after{drift}")
    if not report.lossless:
        lines.append("LOSSLESS CHECK FAILED: a greedy speculative output differed (results.md)")
    return "\n".join(lines)
