"""Trained drafters against the training-free methods on the embedded tiny target (one table).

    python scripts/bench_drafters.py [--recipes tiny_eagle3 tiny_eagle tiny_mlp tiny_pard]
        [--ks 3 5 8] [--prompts 8] [--max-tokens 64] [--steps N] [--record]

Trains each recipe exactly as ``python train.py recipe=NAME`` does (into
``outputs/bench/<recipe>``; a finished recipe is reused unless ``--retrain``), recording its
training tokens/s, then runs one acceptance harness over held-out code prompts with every trained
drafter, n-gram and the untrained tiny draft LM at each k: acceptance length, per-position rates,
tokens/s and speedup against autoregressive decoding, greedy, batch 1, on the same engine.
``--record`` appends both tables to docs/benchmarks-history.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from infer.eval.harness import HarnessConfig, run_harness
from infer.eval.options import HarnessOptions
from train.config import register_configs
from train.evaluate import eval_prompts
from train.pipeline import run
from train.tiny.corpus import default_draft_dir
from train.tiny.build import ensure_tiny_target

ROOT = Path(__file__).resolve().parents[1]
OUT = Path("outputs/bench")


def compose_recipe(name: str, steps: int | None):
    overrides = [f"recipe={name}", f"output_dir={OUT}", "eval.enabled=false", "logger.kind=none"]
    if steps:
        overrides.append(f"trainer.max_steps={steps}")
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return OmegaConf.to_object(compose(config_name="train", overrides=overrides))


def train_recipe(name: str, steps: int | None, retrain: bool) -> tuple[dict, dict]:
    """(speculative_config of the trained drafter, training stats); reuses a finished run."""
    from train.objectives.base import OBJECTIVES

    cfg = compose_recipe(name, steps)
    stats_file = cfg.run_dir / "bench_train.json"
    if retrain or not stats_file.exists() or not (cfg.final_dir / "config.json").exists():
        start = time.perf_counter()
        result = run(cfg)
        stats = {"seconds": time.perf_counter() - start, "steps": result.train.step,
                 "train_tok_s": result.train.tokens_per_s, "tokens": result.train.tokens,
                 **{k: v for k, v in result.train.metrics.items()
                    if k.startswith(("acceptance_length_est", "full_acc"))}}
        stats_file.write_text(json.dumps(stats))
    stats = json.loads(stats_file.read_text())
    spec = OBJECTIVES.get(cfg.drafter.method).served_config(cfg.final_dir)
    return spec, stats


def max_k(spec: dict) -> int:
    """An MLP speculator drafts at most ``n_predict`` tokens (one head each); others: any k."""
    if spec.get("method") != "mlp_speculator":
        return 1 << 30
    return json.loads((Path(spec["model"]) / "config.json").read_text())["n_predict"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipes", nargs="+",
                    default=["tiny_eagle3", "tiny_eagle", "tiny_mlp", "tiny_pard"])
    ap.add_argument("--ks", nargs="+", type=int, default=[3, 5, 8])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=None, help="override trainer.max_steps")
    ap.add_argument("--retrain", action="store_true")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()

    target = str(ensure_tiny_target(with_draft=True))
    methods, train_rows = [], []
    for name in args.recipes:
        spec, stats = train_recipe(name, args.steps, args.retrain)
        methods.append((name, spec))
        train_rows.append((name, stats))
    methods += [("ngram", {"method": "ngram"}),
                ("draft LM (untrained)", {"method": "draft_model",
                                          "model": str(default_draft_dir())})]
    configs = [HarnessConfig(spec, k, method=label) for label, spec in methods for k in args.ks
               if k <= max_k(spec)]
    cfg = compose_recipe(args.recipes[0], None)
    cfg.eval.num_prompts, cfg.eval.requests_per_slot = args.prompts, 0  # batch 1 only
    report = run_harness(target, configs, eval_prompts(cfg, target),
                         HarnessOptions(max_tokens=args.max_tokens, device="cpu",
                                        ignore_eos=True), output_dir=OUT / "harness")
    text = render(args, train_rows, report)
    print(text)
    if args.record:
        with open(ROOT / "docs" / "benchmarks-history.md", "a") as f:
            f.write("\n" + text + "\n")


def render(args, train_rows, report) -> str:
    cmd = "python scripts/bench_drafters.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items() if k not in ("record", "retrain") and v not in (None,))
    lines = ["## Trained drafters on the tiny target (CPU)", "",
             f"`{cmd}` on {platform.machine()}, {torch.get_num_threads()} threads, torch "
             f"{torch.__version__}, {time.strftime('%Y-%m-%d')}. Greedy, batch 1, held-out "
             "code prompts, ignore_eos.", "",
             "| recipe | steps | train tokens | train tok/s | wall s | est. acceptance length |",
             "|---|---|---|---|---|---|"]
    for name, s in train_rows:
        est = s.get("acceptance_length_est")
        lines.append(f"| {name} | {s['steps']} | {s['tokens']} | {s['train_tok_s']:.0f} | "
                     f"{s['seconds']:.0f} | {'-' if est is None else f'{est:.2f}'} |")
    base = report.baselines[0]
    lines += ["", f"Autoregressive: {base.tok_s:.1f} tok/s.", "",
              "| method | k | accept len | per-position | tok/s | speedup |",
              "|---|---|---|---|---|---|"]
    for r in report.results:
        rates = " ".join(f"{x:.2f}" for x in r.per_position)
        lines.append(f"| {r.method} | {r.k} | {r.acceptance_length:.2f} | {rates} | "
                     f"{r.tok_s:.1f} | {r.speedup:.2f} |")
    lines.append("")
    lines.append(f"All greedy rows lossless: {report.lossless}.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
