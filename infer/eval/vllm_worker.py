"""One timed vLLM run for the acceptance harness (``eval.engine=vllm``).

Imports nothing from draftsmith: the harness either imports this module (vLLM installed beside
draftsmith, the GPU case: ``pip install draftsmith[vllm]``) or runs it as a script with another
interpreter (``eval.vllm_python``: vLLM in its own environment), passing one JSON job on stdin
and reading one line of stdout (``DRAFTSMITH_VLLM_RESULT {json}``). A job::

    {"target": DIR, "speculative_config": {...} | null, "prompt_token_ids": [[...], ...],
     "temperature": 0.0, "max_tokens": 64, "ignore_eos": false, "seed": 0,
     "max_num_seqs": 8, "tensor_parallel_size": 1, "max_model_len": 1024 | null,
     "dtype": "auto", "warmup": true, "llm_kwargs": {...}}

The answer: ``{"token_ids": [[...]], "seconds": s, "counters": {num_drafts, num_draft_tokens,
num_accepted_tokens, num_accepted_tokens_per_pos}}``, the counters being vLLM's
``vllm:spec_decode_*`` metrics grown over the timed ``generate`` only (the warm-up excluded).
"""

from __future__ import annotations

import json
import sys
import time

MARKER = "DRAFTSMITH_VLLM_RESULT "  # the answer's line on stdout
_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
             "num_accepted_tokens_per_pos")


def spec_counters(llm) -> dict:
    """vLLM's spec-decode counters from ``LLM.get_metrics()`` (per-position as a list)."""
    out: dict = {}
    for m in llm.get_metrics():
        key = m.name.removeprefix("vllm:spec_decode_")
        if m.name.startswith("vllm:spec_decode_") and key in _COUNTERS:
            out[key] = list(m.values) if hasattr(m, "values") else m.value
    return out


def _grown(after: dict, before: dict) -> dict:
    out = {}
    for key in _COUNTERS:
        a, b = after.get(key), before.get(key)
        if isinstance(a, list):
            out[key] = [x - y for x, y in zip(a, b or [0] * len(a))]
        else:
            out[key] = (a or 0) - (b or 0)
    return out


def build_llm(job: dict):
    """vLLM's LLM with the job's settings (token ids in and out: no tokenizer)."""
    from vllm import LLM

    return LLM(job["target"], speculative_config=job.get("speculative_config"),
              tensor_parallel_size=job.get("tensor_parallel_size", 1),
              max_num_seqs=job["max_num_seqs"], max_model_len=job.get("max_model_len"),
              dtype=job.get("dtype", "auto"), seed=job.get("seed", 0), disable_log_stats=False,
              skip_tokenizer_init=True,  # token ids in and out: no tokenizer needed or used
              **job.get("llm_kwargs", {}))


def run_job(job: dict) -> dict:
    """Build vLLM's LLM for ``job``, warm it up, time one ``generate`` (module doc)."""
    from vllm import SamplingParams

    llm = build_llm(job)
    prompts = [{"prompt_token_ids": ids} for ids in job["prompt_token_ids"]]
    params = SamplingParams(temperature=job["temperature"], max_tokens=job["max_tokens"],
                            ignore_eos=job.get("ignore_eos", False), seed=job.get("seed", 0),
                            detokenize=False)
    if job.get("warmup", True):
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False),
                     use_tqdm=False)
    before = spec_counters(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    counters = _grown(spec_counters(llm), before)
    return {"token_ids": [list(o.outputs[0].token_ids) for o in outs], "seconds": seconds,
            "counters": counters}


def generate(llm, request: dict) -> dict:
    """One batch of a session (regeneration): ``{"prompt_token_ids", "temperature", "top_p",
    "max_tokens", "stop_token_ids", "seed"}`` -> ``{"token_ids", "finish_reasons"}``; request
    ``i`` samples with seed ``seed + i``."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=request["temperature"], top_p=request["top_p"],
                             max_tokens=request["max_tokens"],
                             stop_token_ids=request["stop_token_ids"], seed=request["seed"] + i,
                             detokenize=False)
              for i in range(len(request["prompt_token_ids"]))]
    outs = llm.generate([{"prompt_token_ids": ids} for ids in request["prompt_token_ids"]],
                        params, use_tqdm=False)
    return {"token_ids": [list(o.outputs[0].token_ids) for o in outs],
            "finish_reasons": [o.outputs[0].finish_reason for o in outs]}


def serve_session() -> None:
    """``--session``: the first stdin line builds the LLM, every later line is a
    :func:`generate` request answered with one marked line; end of input ends it."""
    llm = build_llm(json.loads(sys.stdin.readline()))
    print(MARKER + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(MARKER + json.dumps(generate(llm, json.loads(line))), flush=True)


if __name__ == "__main__":
    if "--session" in sys.argv:
        serve_session()
    else:
        result = run_job(json.loads(sys.stdin.read()))
        print("\n" + MARKER + json.dumps(result), flush=True)  # vLLM may print after it
