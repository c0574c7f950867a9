"""End-of-training acceptance report: the trained drafter through the same harness as serving.

The exported checkpoint is loaded by the engine exactly as ``python infer.py`` or a user would
(its ``speculative_config``), next to the configured baselines (n-gram by default), on held-out
prompts: the held-out standard-library code for the embedded default, or ``eval.dataset``.
What is printed (acceptance length, per-position rates, speedup against autoregressive decoding
at the same batch size) is what ``results.json`` / W&B get, from ``infer.harness.run_harness``.
"""

from __future__ import annotations

from typing import Any

from infer.harness import HarnessConfig, HarnessReport, load_prompts, render_prompt, run_harness
from infer.tracking import Logger
from train.config import TrainConfig


def eval_prompts(cfg: TrainConfig, target_dir: str) -> list[Any]:
    """``eval.dataset`` rendered with the target's chat template, else held-out code prompts
    (each sent as one user message, as the drafter saw its training prompts)."""
    from transformers import AutoTokenizer

    from train.data import heldout_prompts

    ev = cfg.eval
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    if ev.dataset:
        return load_prompts(ev.dataset, num=ev.num_prompts, split=ev.dataset_split,
                            tokenizer=tokenizer)
    return [render_prompt([{"role": "user", "content": p}], True, tokenizer)
            for p in heldout_prompts(ev.num_prompts, seed=cfg.seed)]


def harness_configs(cfg: TrainConfig, drafter_spec: dict) -> list[HarnessConfig]:
    """The drafter (labelled by the recipe name) and each baseline method, at every ``eval.ks``."""
    methods = [(cfg.name, {k: v for k, v in drafter_spec.items()
                           if k != "num_speculative_tokens"})]
    methods += [(m, {"method": m}) for m in cfg.eval.baselines]
    return [HarnessConfig(spec, k, batch_size=cfg.eval.batch_size, method=label)
            for label, spec in methods for k in cfg.eval.ks]


def evaluate(cfg: TrainConfig, target_dir: str, drafter_spec: dict, logger: Logger,
             step: int | None = None, device: str = "auto") -> HarnessReport:
    """Run the harness, write ``<run_dir>/eval`` (results.json, results.md, plots), print a
    summary, log to ``logger``."""
    out = cfg.run_dir / "eval"
    report = run_harness(target_dir, harness_configs(cfg, drafter_spec),
                         eval_prompts(cfg, target_dir), max_tokens=cfg.eval.max_tokens,
                         output_dir=out, logger=logger, device=device, seed=cfg.seed,
                         step=step, prefix="eval")
    print(summary(report))
    print(f"acceptance report: {out / 'results.md'}")
    return report


def summary(report: HarnessReport) -> str:
    """One line per configuration: acceptance length, per-position rates, speedup."""
    lines = ["method            k  accept_len  per-position            tok/s   speedup"]
    for r in report.results:
        rates = " ".join(f"{x:.2f}" for x in r.per_position)
        lines.append(f"{r.method:<16} {r.k:>2}  {r.acceptance_length:>10.2f}  {rates:<22} "
                     f"{r.tok_s:>6.1f}  {r.speedup:>7.2f}x")
    for b in report.baselines:
        lines.append(f"autoregressive (batch {b.batch_size}): {b.tok_s:.1f} tok/s")
    if not report.lossless:
        lines.append("LOSSLESS CHECK FAILED: a greedy speculative output differed (results.md)")
    return "\n".join(lines)

