"""Engine throughput on the embedded tiny target, side by side with Hugging Face transformers.

    python scripts/bench_engine.py [--prompts 8] [--max-tokens 64] [--k 3 5] [--record]

For batch 1 and 8: tokens/s of draftsmith's autoregressive decoding and of each speculative
method, next to transformers' ``generate`` (plain; with ``assistant_model``; with
``prompt_lookup_num_tokens``; the last two only at batch 1, which is all transformers supports).
For each method it also reports the speedup predicted from the measured acceptance and the
measured costs, ``(1 + E[accepted]) * c_ar / (c_draft + c_verify)`` (E per request-step, steps that drafted
nothing included; per step, with
``c_ar`` one autoregressive step, ``c_verify`` one target forward over k + 1 tokens, ``c_draft``
one proposer call; timed by ``infer.harness.instrument``), and the ratio measured / predicted.
Greedy decoding, fp32, CPU threads as torch sets them. ``--record`` appends the table to
docs/benchmarks.md. ``python infer.py mode=eval`` is the fuller version (a method x k x
temperature x batch matrix, the k advisor, plots, W&B).
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch

from infer.engine import LLM
from infer.harness import instrument
from infer.sampling import SamplingParams
from train.data import heldout_prompts
from train.tiny_target import default_draft_dir
from train.tiny_target_build import ensure_tiny_target


def run_engine(target: str, spec, prompts, max_tokens: int, batch: int) -> dict:
    llm = LLM(target, speculative_config=spec, max_num_seqs=batch, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    llm.metrics.__init__()
    with instrument(llm) as timers:  # step / verify forward / propose wall times
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    m = llm.get_metrics()
    # each request-step emits one recovered/bonus token besides its accepted drafts, and the
    # prefill emits one token per prompt: E[accepted per request-step] counts steps that drafted
    # nothing (n-gram misses), unlike the acceptance length
    request_steps = max(tokens - len(prompts) - m["num_accepted_tokens"], 1)
    return {"tok_s": tokens / elapsed, "tokens": tokens, "accept_len": m["mean_acceptance_length"],
            "e_acc": m["num_accepted_tokens"] / request_steps,
            "c_step": timers.step.mean, "c_verify": timers.verify.mean,
            "c_draft": timers.draft.mean, "outputs": [o.token_ids for o in outs]}


def run_hf(target: str, draft: str, prompts, max_tokens: int, batch: int, mode: str,
           k: int) -> float | None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if mode != "plain" and batch > 1:
        return None  # transformers' assisted / prompt-lookup generation is batch-1 only
    tok = AutoTokenizer.from_pretrained(target)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    kwargs = {"max_new_tokens": max_tokens, "min_new_tokens": max_tokens, "do_sample": False,
              "pad_token_id": tok.pad_token_id}
    if mode == "assistant":
        kwargs["assistant_model"] = AutoModelForCausalLM.from_pretrained(draft).eval()
        kwargs["num_assistant_tokens"] = k
        kwargs["num_assistant_tokens_schedule"] = "constant"
    elif mode == "prompt_lookup":
        kwargs["prompt_lookup_num_tokens"] = k
    tokens, start = 0, time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            enc = tok(prompts[i:i + batch], return_tensors="pt", padding=True,
                      add_special_tokens=False)
            out = model.generate(**enc, **kwargs)
            tokens += (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description="draftsmith engine benchmark (tiny target, CPU)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, nargs="+", default=[3, 5])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--record", action="store_true", help="append to docs/benchmarks.md")
    args = ap.parse_args()

    target, draft = str(ensure_tiny_target()), str(default_draft_dir())
    prompts = heldout_prompts(args.prompts, seed=0)
    methods = {"ngram": {"method": "ngram"}, "suffix": {"method": "suffix"},
               "draft_model": {"method": "draft_model", "model": draft}}
    hf_modes = {"ngram": "prompt_lookup", "draft_model": "assistant"}
    lines = ["| batch | method | k | tok/s | HF tok/s | accept len | speedup | predicted | "
             "measured/predicted |", "|---|---|---|---|---|---|---|---|---|"]
    for batch in args.batches:
        ar = run_engine(target, None, prompts, args.max_tokens, batch)
        hf_plain = run_hf(target, draft, prompts, args.max_tokens, batch, "plain", 0)
        lines.append(f"| {batch} | autoregressive | - | {ar['tok_s']:.1f} | {hf_plain:.1f} | 1.00 "
                     f"| 1.00 | - | - |")
        print(lines[-1], flush=True)
        for name, base in methods.items():
            for k in args.k:
                r = run_engine(target, {**base, "num_speculative_tokens": k}, prompts,
                               args.max_tokens, batch)
                lossless = r["outputs"] == ar["outputs"]
                hf = run_hf(target, draft, prompts, args.max_tokens, batch,
                            hf_modes[name], k) if name in hf_modes else None
                pred = (1 + r["e_acc"]) * ar["c_step"] / (r["c_draft"] + r["c_verify"])
                speed = r["tok_s"] / ar["tok_s"]
                lines.append(f"| {batch} | {name}{'' if lossless else ' (MISMATCH)'} | {k} | "
                             f"{r['tok_s']:.1f} | {'n/a' if hf is None else f'{hf:.1f}'} | "
                             f"{r['accept_len']:.2f} | {speed:.2f} | {pred:.2f} | "
                             f"{speed / pred:.2f} |")
                print(lines[-1], flush=True)
    header = (f"\n## Engine throughput, tiny target (CPU)\n\n`python scripts/bench_engine.py "
              f"--prompts {args.prompts} --max-tokens {args.max_tokens}` on "
              f"{platform.machine()}, {torch.get_num_threads()} threads, torch "
              f"{torch.__version__}, {time.strftime('%Y-%m-%d')}. HF = transformers generate "
              "(plain; assistant_model for draft_model; prompt_lookup_num_tokens for ngram).\n\n")
    table = header + "\n".join(lines) + "\n"
    print(table)
    if args.record:
        path = Path("docs/benchmarks.md")
        if not path.exists():
            path.write_text("# Benchmarks\n\nEvery number here comes from a script in scripts/; "
                            "the command and machine are given with each table.\n")
        with path.open("a") as f:
            f.write(table)


if __name__ == "__main__":
    main()
