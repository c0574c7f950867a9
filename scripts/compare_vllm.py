"""Speedup of draftsmith's engine and of a real vLLM from the same drafter, side by side.

    python scripts/compare_vllm.py --vllm-python /path/to/vllm-env/bin/python \
        --drafter eagle3=outputs/tiny_eagle3/final \
        --drafter pard=outputs/tiny_pard/final --drafter peagle=outputs/tiny_peagle/final \
        --drafter dflash=outputs/tiny_dflash/final \
        [--target DIR] [--k 3] [--batch-sizes 1 8] [--prompts 8] [--max-tokens 64] [--repeats 3]

``--target smollm2`` (the real target, train/real/targets.py) runs on the held-out chat questions
(``draftsmith:chat-heldout``) instead of the tiny target's held-out code.

Each engine's speedup is over its own autoregressive decoding (both greedy, ``ignore_eos``, the
same chat-rendered held-out prompts, all submitted at once with ``max_num_seqs`` = the batch
size). draftsmith runs through its harness (``run_harness``); vLLM through
``scripts/check_vllm.py --time`` in its own environment. The two alternate within each repeat
(order flipped every repeat) so a slow spell of a shared machine hits both; the table shows
medians. ``NAME=PATH`` drafters name their method (``eagle3``, ``eagle``, ``dflash``) or a parallel
variant (``pard``: draft_model, ``peagle``: eagle3, both with ``parallel_drafting``). Writes the raw runs to
``--out`` (JSON; the prompts beside it). Before each engine's turn it waits until the machine is idle (see
``wait_until_idle``); draftsmith's rows record the cores other processes used while timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infer.eval.chat_prompts import HELDOUT  # noqa: E402
from infer.eval.harness import expand_matrix, run_harness  # noqa: E402
from infer.eval.options import HarnessOptions  # noqa: E402
from infer.eval.machine import other_cores_now  # noqa: E402
from infer.spec_config import METHODS  # noqa: E402
from infer.target import Target  # noqa: E402
from train.real.targets import NAMED_TARGETS, local_target  # noqa: E402
from train.tiny.build import ensure_tiny_target  # noqa: E402
from train.tiny.examples import heldout_prompts  # noqa: E402

CHECK_VLLM = Path(__file__).resolve().parent / "check_vllm.py"


# drafter labels that name a parallel-drafting variant: (method, parallel_drafting)
VARIANTS = {"pard": ("draft_model", True), "peagle": ("eagle3", True)}


def speculative_config(arg: str) -> tuple[str, dict]:
    """``NAME=PATH[:parallel]`` -> (name, vLLM speculative_config without k). NAME is a method
    (``eagle3``, ``dflash``) or a variant of one (``pard``: draft_model, ``peagle``: eagle3, both
    with parallel drafting); ``:parallel`` turns parallel drafting on for a method name."""
    name, _, path = arg.partition("=")
    path, _, flag = path.partition(":")
    method, parallel = VARIANTS.get(name, (name, flag == "parallel"))
    if not path or flag not in ("", "parallel") or method not in METHODS:
        raise SystemExit(f"--drafter {arg!r}: expected NAME=PATH[:parallel] with NAME one of "
                         f"{', '.join([*METHODS, *VARIANTS])}")
    spec = {"method": method, "model": path}
    return name, {**spec, "parallel_drafting": True} if parallel else spec


def wait_until_idle(max_seconds: float = 60.0) -> float | None:
    """Wait (up to ``max_seconds``) until other processes keep under 0.1 core busy over a second:
    vLLM's engine processes take seconds to exit after its script returns, and a baseline timed
    meanwhile would be slow and flatter the next engine's speedup. Returns the last reading."""
    other = None
    deadline = time.monotonic() + max_seconds
    while time.monotonic() < deadline:
        other = other_cores_now(1.0)
        if other is None or other < 0.1:
            break
    return other


def draftsmith_speedups(target: Target, spec: dict, k: int, batches: list[int],
                        prompts: list[str], max_tokens: int) -> dict[int, dict]:
    report = run_harness(target, expand_matrix([spec], [k], batch_sizes=batches), prompts,
                         HarnessOptions(max_tokens=max_tokens, ignore_eos=True))
    return {r.batch_size: {"speedup": r.speedup, "acceptance_length": r.acceptance_length,
                           "tok_s": r.tok_s, "ar_tok_s": r.ar_tok_s,
                           "cost_draft_per_k": r.cost_draft / k, "lossless": r.lossless,
                           "other_cores": r.other_cores} for r in report.results}


def vllm_speedups(python: str, target: str, spec: dict, k: int, batches: list[int],
                  prompts_file: str, max_tokens: int) -> dict[int, dict]:
    cmd = [python, str(CHECK_VLLM), "--time", "--target", target, "--prompts-file", prompts_file,
           "--speculative-config", json.dumps({**spec, "num_speculative_tokens": k}),
           "--max-tokens", str(max_tokens), "--batch-sizes", *map(str, batches)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if not last.startswith("{"):
        raise SystemExit(f"vLLM run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    out = {}
    for row in json.loads(last)["rows"]:
        c = row["counters"]
        drafts = c.get("num_drafts") or 0
        al = 1 + (c.get("num_accepted_tokens") or 0) / drafts if drafts else 0.0
        out[row["batch_size"]] = {"speedup": row["speedup"], "acceptance_length": al,
                                  "tok_s": row["tokens"] / row["spec_seconds"],
                                  "ar_tok_s": row["tokens"] / row["ar_seconds"],
                                  "lossless": row["greedy_identical"]}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--drafter", action="append", required=True)
    ap.add_argument("--target")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="outputs/compare_vllm.json")
    args = ap.parse_args()

    target_dir = local_target(args.target) or str(ensure_tiny_target())
    target = Target.load(target_dir, device="cpu")
    questions = (HELDOUT[: args.prompts] if args.target in NAMED_TARGETS
                 else heldout_prompts(args.prompts, seed=0))
    prompts = [target.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                    tokenize=False, add_generation_prompt=True)
               for p in questions]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prompts_file = out.with_suffix(".prompts.json")  # kept: the prompts both engines ran
    prompts_file.write_text(json.dumps(prompts))
    runs: list[dict] = []
    for rep in range(args.repeats):
        for arg in args.drafter:
            name, spec = speculative_config(arg)
            engines = ["draftsmith", "vllm"] if rep % 2 == 0 else ["vllm", "draftsmith"]
            for engine in engines:
                idle = wait_until_idle()
                rows = (draftsmith_speedups(target, spec, args.k, args.batch_sizes, prompts,
                                            args.max_tokens) if engine == "draftsmith" else
                        vllm_speedups(args.vllm_python, target_dir, spec, args.k,
                                      args.batch_sizes, str(prompts_file), args.max_tokens))
                for batch, row in rows.items():
                    runs.append({"drafter": name, "engine": engine, "batch_size": batch,
                                 "repeat": rep, "other_cores_before": idle, **row})
                    print(json.dumps(runs[-1]), flush=True)
    out.write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    print_table(runs)
    return 0


def print_table(runs: list[dict]) -> None:
    print("\n| drafter | batch | draftsmith speedup | vLLM speedup | draftsmith AL | vLLM AL |"
          " draftsmith cost_draft/k | draftsmith AR / spec tok/s | vLLM AR / spec tok/s |"
          "\n|---|---|---|---|---|---|---|---|---|")
    keys = sorted({(r["drafter"], r["batch_size"]) for r in runs})
    for name, batch in keys:
        def med(engine, field):
            vals = [r[field] for r in runs if (r["drafter"], r["batch_size"], r["engine"])
                    == (name, batch, engine) and r.get(field) is not None]
            return statistics.median(vals) if vals else float("nan")
        print(f"| {name} | {batch} | {med('draftsmith', 'speedup'):.2f} | "
              f"{med('vllm', 'speedup'):.2f} | {med('draftsmith', 'acceptance_length'):.2f} | "
              f"{med('vllm', 'acceptance_length'):.2f} | "
              f"{med('draftsmith', 'cost_draft_per_k'):.2f} | "
              f"{med('draftsmith', 'ar_tok_s'):.0f} / {med('draftsmith', 'tok_s'):.0f} | "
              f"{med('vllm', 'ar_tok_s'):.0f} / {med('vllm', 'tok_s'):.0f} |")


if __name__ == "__main__":
    sys.exit(main())
