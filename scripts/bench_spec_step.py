"""Where a speculative step's time goes, next to autoregressive decoding, on the tiny target.

    python scripts/bench_spec_step.py [--model outputs/tiny_eagle3/final] [--method eagle3]
        [--k 3] [--batches 1 8] [--prompts 16] [--max-tokens 64] [--repeats 3] [--temperature 0]

For each batch size, alternating autoregressive and speculative ``generate`` runs over the same
held-out prompts (``--repeats`` each; medians), it prints the wall time and the engine's own
timers (speculative steps, their verify forwards and drafting, prefills), then splits drafting
into the proposer's parts: the drafter's forwards by kind (``catch-up``: the ragged forward over
the verified pairs; ``step``: a one-pair forward), ``begin_step`` / ``observe`` bookkeeping
(rollback, pending target features) and ``prepare`` (``fc`` over the target's aux states).
Costs are in autoregressive steps at the same batch (what the harness's ``cost_*`` columns
use), so the table says which part to shave for a speedup above 1. Speed is noisy on a shared
machine: check ``uptime`` first and compare medians. Chain proposers (eagle, eagle3, mtp) only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from infer.engine import LLM
from infer.eval.harness import timed_generate, warm_up
from infer.sampling import SamplingParams
from train.tiny.build import ensure_tiny_target
from train.tiny.examples import heldout_prompts


class PartTimer:
    """Wraps proposer / drafter methods (instance attributes) and sums their wall time."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = defaultdict(list)

    def wrap(self, owner, method: str, label) -> None:
        inner = getattr(owner, method)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = inner(*args, **kwargs)
            self.seconds[label(args, kwargs)].append(time.perf_counter() - start)
            return out
        setattr(owner, method, timed)


def forward_kind(args, kwargs) -> str:
    """One-pair steps; catch-ups by padded length (a prompt's pairs pad every row of its batch)."""
    if kwargs.get("num_tokens") is None:
        return "drafter step"
    return "drafter catch-up T<=8" if args[0].shape[1] <= 8 else "drafter catch-up T>8"


def instrument(llm: LLM) -> PartTimer:
    parts, prop = PartTimer(), llm.proposer
    parts.wrap(prop.drafter, "forward", forward_kind)
    parts.wrap(prop.drafter, "prepare", lambda a, k: "prepare (fc)")
    for name in ("begin_step", "observe"):
        parts.wrap(prop, name, lambda a, k, _n=name: _n)
    return parts


def one_batch(target: str, spec: dict, prompts, params, batch: int, repeats: int) -> None:
    base = LLM(target, max_num_seqs=batch)
    runs = {"ar": base, "spec": base.with_config(spec, max_num_seqs=batch)}
    parts = instrument(runs["spec"])
    rows = defaultdict(list)
    for llm in runs.values():
        warm_up(llm, prompts, params)
    parts.seconds.clear()
    for _ in range(repeats):
        for name, llm in runs.items():  # alternate: a shared machine's load moves both alike
            _, seconds, t = timed_generate(llm, prompts, params)
            rows[name].append((seconds, t))
    ar_step = statistics.median(t.step.seconds / t.step.calls for _, t in rows["ar"])
    steps = statistics.median(t.step.calls for _, t in rows["spec"])
    print(f"\nbatch {batch}: autoregressive step {ar_step * 1e3:.2f} ms; "
          f"{spec['method']} k={spec['num_speculative_tokens']}: {steps:.0f} steps")
    print(f"  {'part':<22} {'ms/run':>8} {'per step (AR steps)':>20}")
    for name in ("ar", "spec"):
        wall = statistics.median(s for s, _ in rows[name])
        print(f"  {name + ' wall':<22} {wall * 1e3:8.1f}")
    ar_prefill = statistics.median(t.prefill.seconds for _, t in rows["ar"])
    print(f"  {'ar prefill':<22} {ar_prefill * 1e3:8.1f} {ar_prefill / steps / ar_step:20.3f}")
    for field in ("step", "verify", "draft", "prefill"):
        ms = statistics.median(getattr(t, field).seconds for _, t in rows["spec"])
        print(f"  {'spec ' + field:<22} {ms * 1e3:8.1f} {ms / steps / ar_step:20.3f}")
    for label, values in sorted(parts.seconds.items(), key=lambda kv: -sum(kv[1])):
        ms = sum(values) / repeats
        print(f"  {label:<22} {ms * 1e3:8.1f} {ms / steps / ar_step:20.3f}"
              f"   ({len(values) // repeats} calls, median {statistics.median(values) * 1e6:.0f} us)")
    speedup = (statistics.median(s for s, _ in rows["ar"])
               / statistics.median(s for s, _ in rows["spec"]))
    print(f"  speedup {speedup:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="outputs/tiny_eagle3/final")
    ap.add_argument("--method", default="eagle3")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: sampled rows, drafts sampled for the p/q test (as the harness)")
    args = ap.parse_args()
    target = str(ensure_tiny_target())
    spec = {"method": args.method, "model": args.model, "num_speculative_tokens": args.k}
    if args.temperature > 0:
        spec["draft_sample_method"] = "probabilistic"
    prompts = heldout_prompts(args.prompts, seed=0)  # code prefixes, as bench_engine.py
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    for batch in args.batches:
        one_batch(target, spec, prompts, params, batch, args.repeats)


if __name__ == "__main__":
    main()
