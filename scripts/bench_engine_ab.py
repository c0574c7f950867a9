"""The engine of two checkouts side by side, for a change that must not move speed.

    python scripts/bench_engine_ab.py --before ../old-checkout --after . [--rounds 10]

Each round runs, in a fresh process per checkout (before, then after), plain decoding, n-gram
(k=3) and the tiny draft LM (k=3) on the embedded tiny target: 64 greedy tokens for 4 held-out
prompts at batch 1 and 16 at batch 8, two fixed threads. Prints every round and the medians
(tok/s) with after / before; a shared machine moves single rounds by +-25 %, so compare medians
of several alternated rounds and pause other work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

SPECS = {"plain": None, "ngram_k3": {"method": "ngram", "num_speculative_tokens": 3},
         "draft_lm_k3": "draft"}


def measure() -> dict[str, float]:
    """tok/s of each row with the engine importable from the current directory."""
    sys.path.insert(0, str(Path.cwd()))
    from infer.engine import LLM
    from infer.sampling import SamplingParams
    from train.tiny.build import ensure_tiny_target
    from train.tiny.corpus import default_draft_dir
    from train.tiny.examples import heldout_prompts

    base = LLM(str(ensure_tiny_target(progress=False)), num_threads=2)
    prompts, params = heldout_prompts(16), SamplingParams(temperature=0.0, max_tokens=64,
                                                          ignore_eos=True)
    rows = {}
    for batch in (1, 8):
        for name, spec in SPECS.items():
            if spec == "draft":
                spec = {"method": "draft_model", "model": str(default_draft_dir()),
                        "num_speculative_tokens": 3}
            llm = base.with_config(spec, max_num_seqs=batch)
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
            chosen = prompts[: 4 if batch == 1 else 16]
            start = time.perf_counter()
            outs = llm.generate(chosen, params)
            tokens = sum(len(o.token_ids) for o in outs)
            rows[f"batch{batch}_{name}"] = tokens / (time.perf_counter() - start)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path)
    ap.add_argument("--after", type=Path)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--one", action="store_true", help="measure this checkout once (internal)")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure()))
        return
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for i in range(args.rounds):
        for side in ("before", "after"):
            out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--one"],
                                 cwd=getattr(args, side), capture_output=True, text=True,
                                 check=True).stdout.strip().splitlines()[-1]
            runs[side].append(json.loads(out))
            print(f"round {i + 1} {side}: {out}", flush=True)
    print("\n| row | before | after | after / before |\n|---|---|---|---|")
    for key in runs["before"][0]:
        b, a = (statistics.median(r[key] for r in runs[s]) for s in ("before", "after"))
        print(f"| {key} | {b:.0f} | {a:.0f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
