"""Packed linears: every one packed against the default size rule, in whole forwards.

    python scripts/bench_layout.py [--head outputs/tiny_eagle3/final] [--batches 1 8]
        [--calls 400] [--threads 1] [--context 300]

``infer/models/layout.py`` packs a CPU linear for oneDNN only from ``PACK_MIN_ELEMENTS``
weight elements: below that, oneDNN's fixed per-call cost outweighs its faster kernel. This
script checks that rule where it matters, in the real forwards of a speculative step on the
embedded target. It loads the target and an EAGLE-3 head twice: once with every linear packed
(``min_elements=0``), once with the default rule. Then it times four forwards: an
autoregressive step, a verify of 4 tokens per row with the head's aux states, one head pair,
and a head catch-up of 4 pairs. The two layouts alternate call by call, so each forward finds
its weights evicted by the other layout's, as in a real step where the target and the head take
turns. Prints medians (microseconds) and each forward's cost in autoregressive steps. Check
``uptime`` first: the machine must be otherwise idle.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from infer.drafters.eagle3 import Eagle3Drafter
from infer.kv_cache import KVCache
from infer.models.layout import pack_for_cpu_
from infer.models.llama import inference_layout
from infer.models.loader import load_model
from train.tiny.build import ensure_tiny_target

LAYOUTS = {"all packed": 0, "default rule": None}  # min_elements (None: the default)
FORWARDS = ("autoregressive", "verify 4", "head 1 pair", "head 4 pairs")


def load(head_path: str, min_elements: int | None):
    """The tiny target and the EAGLE-3 head, in the inference layout (repacked with
    ``min_elements`` when given)."""
    target = load_model(ensure_tiny_target())
    head = inference_layout(Eagle3Drafter.from_pretrained(head_path))
    head.share_embedding(target.embed_tokens)
    if min_elements is not None:
        pack_for_cpu_(target, min_elements=min_elements)
        pack_for_cpu_(head, min_elements=min_elements)
    return target, head


def forwards(target, head, batch: int, context: int) -> tuple[dict, callable]:
    """``{name: fn}`` over caches holding ``context`` positions, and the rollback after each."""
    cache = KVCache.for_model(target.config, batch, context + 8)
    head_cache = KVCache.for_model(head.layer_config, batch, context + 8)
    ids = torch.randint(0, target.config.vocab_size, (batch, context))  # [B, S]
    hidden = head.layer_config.hidden_size
    with torch.no_grad():
        target(ids, cache)
        head(ids, torch.randn(batch, context, hidden), head_cache)
    rows = torch.arange(batch)
    one, four = torch.randn(batch, 1, hidden), torch.randn(batch, 4, hidden)  # [B, T, H]
    count, last = torch.full((batch,), 4), torch.full((batch, 1), 3)
    aux = head.aux_layer_ids

    def rollback() -> None:
        cache.truncate(rows, context)
        head_cache.truncate(rows, context)

    return {
        "autoregressive": lambda: target(ids[:, :1], cache),
        "verify 4": lambda: target(ids[:, :4], cache, aux_layer_ids=aux),
        "head 1 pair": lambda: head(ids[:, :1], one, head_cache),
        "head 4 pairs": lambda: head(ids[:, :4], four, head_cache, num_tokens=count,
                                     logits_at=last),
    }, rollback


def measure(models: dict, batch: int, calls: int, context: int) -> dict:
    """Median microseconds per (layout, forward), the layouts alternating call by call."""
    runs = {name: forwards(*pair, batch, context) for name, pair in models.items()}
    times = {(name, f): [] for name in runs for f in FORWARDS}
    order = list(runs)
    with torch.no_grad():
        for i in range(calls):
            for f in FORWARDS:
                for name in (order if i % 2 else order[::-1]):
                    fns, rollback = runs[name]
                    start = time.perf_counter()
                    fns[f]()
                    times[(name, f)].append(time.perf_counter() - start)
                    rollback()
    return {key: statistics.median(v) * 1e6 for key, v in times.items()}


def report(med: dict, batch: int) -> None:
    before, after = LAYOUTS  # the two layout names
    ar_a, ar_b = med[(before, "autoregressive")], med[(after, "autoregressive")]
    print(f"\nbatch {batch}: {'forward':<16} {before:>12} {after:>14}  ratio   in AR steps")
    for f in FORWARDS:
        a, b = med[(before, f)], med[(after, f)]
        print(f"         {f:<16} {a:10.0f} us {b:12.0f} us  {b / a:5.2f}"
              f"   {a / ar_a:.3f} -> {b / ar_b:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head", default="outputs/tiny_eagle3/final")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    models = {name: load(args.head, n) for name, n in LAYOUTS.items()}
    for batch in args.batches:
        report(measure(models, batch, args.calls, args.context), batch)


if __name__ == "__main__":
    main()
