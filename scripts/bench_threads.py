"""Decode throughput under CPU contention, per thread policy (infer/foundation/threads.py).

    python scripts/bench_threads.py [--prompts 8] [--max-tokens 64] [--repeats 5] [--record]

Greedy autoregressive decoding of ``--prompts`` held-out prompts on the embedded tiny target at
batch 8, in three situations: alone; beside one busy process (a pure-Python loop); beside one
small torch process (128x128 matmuls in a loop with torch's default threads, like another decode
or training job). In each situation the policies run in turn, ``--repeats`` rounds alternating:
``fixed-N`` (torch's default thread count, what draftsmith ran before the policy), ``fixed-1``
and ``auto`` (one thread per core other processes leave free). Reported: the median tok/s
and, per policy, the slowdown against the same policy alone, and the thread counts auto used.
Check that nothing else runs (``uptime``) before trusting the "alone" rows.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from infer.engine import LLM  # noqa: E402
from infer.sampling import SamplingParams  # noqa: E402
from infer.foundation.threads import GOVERNOR, usable_cores  # noqa: E402
from train.tiny.build import ensure_tiny_target  # noqa: E402
from train.tiny.examples import heldout_prompts  # noqa: E402

NEIGHBOURS = {
    "alone": None,
    "busy process": "while True: pass",
    "torch process": ("import torch\nx = torch.randn(128, 128)\n"
                      "while True:\n    x = torch.tanh(x @ x)"),
}


def decode(llm: LLM, prompts: list, params: SamplingParams) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def settle(llm: LLM, prompts: list, seconds: float = 0.6) -> None:
    """Decode untimed for a while first: every policy is measured in its steady state (auto has
    looked at the machine a few times; a fixed count changes nothing)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        decode(llm, prompts, SamplingParams(max_tokens=8, ignore_eos=True))


def run_situation(llm: LLM, prompts, params, policies: dict, repeats: int) -> dict:
    """Median tok/s per policy, rounds alternating; auto's steps per thread count."""
    rates = {name: [] for name in policies}
    auto_steps = {}
    for _ in range(repeats):
        for name, n in policies.items():
            GOVERNOR.start(n)
            settle(llm, prompts)
            GOVERNOR.ticks_at.clear()
            rates[name].append(decode(llm, prompts, params))
            if n is None:
                for k, v in GOVERNOR.ticks_at.items():
                    auto_steps[k] = auto_steps.get(k, 0) + v
    return {name: statistics.median(r) for name, r in rates.items()} | {"_auto": auto_steps}


def with_neighbour(code: str | None):
    if code is None:
        return None
    proc = subprocess.Popen([sys.executable, "-c", code])
    time.sleep(1.5)  # let it start (imports) and settle on a core
    return proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--record", action="store_true", help="append to docs/benchmarks-history.md")
    args = ap.parse_args()
    default = torch.get_num_threads()
    policies = {f"fixed-{default} (before)": default, "fixed-1": 1, "auto": None}
    llm = LLM(str(ensure_tiny_target()), max_num_seqs=8, device="cpu")
    prompts = heldout_prompts(args.prompts, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    decode(llm, prompts[:1], SamplingParams(max_tokens=4))
    results = {}
    for situation, code in NEIGHBOURS.items():
        proc = with_neighbour(code)
        try:
            results[situation] = run_situation(llm, prompts, params, policies, args.repeats)
        finally:
            if proc is not None:
                proc.kill()
                proc.wait()
        print(situation, {k: (round(v) if isinstance(v, float) else v)
                          for k, v in results[situation].items()}, flush=True)
    table = render(results, policies, args)
    print(table)
    if args.record:
        with open(ROOT / "docs" / "benchmarks-history.md", "a", encoding="utf-8") as f:
            f.write("\n" + table + "\n")


def render(results: dict, policies: dict, args) -> str:
    alone = results["alone"]
    head = ("| neighbour | " + " | ".join(policies) + " | auto's steps per thread count |\n|"
            + "---|" * (len(policies) + 2))
    rows = []
    for situation, r in results.items():
        cells = [f"{r[p]:.0f} tok/s ({alone[p] / r[p]:.1f}x slower)" if situation != "alone"
                 else f"{r[p]:.0f} tok/s" for p in policies]
        rows.append(f"| {situation} | " + " | ".join(cells) + f" | {r['_auto']} |")
    when = time.strftime("%Y-%m-%d")
    return (f"Thread policy under contention ({when}, {platform.processor() or 'cpu'}, "
            f"{usable_cores()} usable cores, torch {torch.__version__}; greedy, batch 8, "
            f"{args.prompts} prompts x {args.max_tokens} tokens, median of {args.repeats}; "
            "`python scripts/bench_threads.py`):\n\n" + head + "\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
