"""Engine throughput on the embedded tiny target, side by side with Hugging Face transformers.

    python scripts/bench_engine.py [--prompts 8] [--max-tokens 64] [--k 3 5] [--repeats 3]
        [--record] [--device cuda --dtype bfloat16]

For batch 1 and 8: tokens/s of draftsmith's autoregressive decoding and of each speculative
method, next to transformers' ``generate`` (plain; with ``assistant_model``; with
``prompt_lookup_num_tokens``; the last two only at batch 1, which is all transformers supports).
For each method it also reports the speedup modelled from the measured batch steps, step costs
and prefill time (``modelled_speedup``, a timing model, unlike the harness's acceptance-based
``infer.eval.advisor.predicted_speedup``; costs from the engine's step timers), and the ratio
measured / modelled. Every row is the median of ``--repeats`` runs that alternate with
transformers' (a shared machine's load moves both alike). Greedy decoding; fp32 on CPU (threads
as torch sets them). On CUDA the engine's steps are CUDA graphs, so an extra row
runs the same decoding with ``enforce_eager=True``, and the roofline line compares the decode
step with the time to stream the weights once at the GPU's memory bandwidth. ``--record``
appends the table to docs/benchmarks-history.md. ``python infer.py mode=eval`` is the fuller version
(a method x k x temperature x batch matrix, the k advisor, plots, W&B).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from infer.engine import LLM
from infer.eval.harness import timed_generate, warm_up
from infer.sampling import SamplingParams
from train.tiny.examples import heldout_prompts
from train.tiny.corpus import default_draft_dir
from train.tiny.build import ensure_tiny_target


def engine_runner(target: str, spec, prompts, max_tokens: int, batch: int, device: str = "cpu",
                  dtype: str = "auto", eager: bool = False) -> Callable[[], dict]:
    """A warmed-up engine; each call of the returned function times one ``generate``."""
    llm = LLM(target, speculative_config=spec, max_num_seqs=batch, device=device, dtype=dtype,
              enforce_eager=eager)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    warm_up(llm, prompts, params)

    def run() -> dict:
        llm.metrics.__init__()
        if llm.proposer is not None:  # every run starts alike: no drafts from an earlier run's
            llm.proposer.reset()  # outputs of the same prompts (suffix decoding's global tree)
        outs, elapsed, timers = timed_generate(llm, prompts, params)  # step / verify / propose
        tokens = sum(len(o.token_ids) for o in outs)
        return {"tok_s": tokens / elapsed, "tokens": tokens,
                "accept_len": llm.metrics.mean_acceptance_length, "c_step": timers.step.mean,
                "c_verify": timers.verify.mean, "c_draft": timers.draft.mean,
                "steps": timers.step.calls, "prefill_s": timers.prefill.seconds,
                "outputs": [o.token_ids for o in outs]}
    return run


def hf_runner(target: str, draft: str, prompts, max_tokens: int, batch: int, mode: str,
              k: int, device: str = "cpu",
              dtype: torch.dtype = torch.float32) -> Callable[[], float] | None:
    """transformers' ``generate`` on the same prompts, warmed up; each call returns tok/s.
    None where transformers has no batched version of the mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if mode != "plain" and batch > 1:
        return None  # transformers' assisted / prompt-lookup generation is batch-1 only
    tok = AutoTokenizer.from_pretrained(target)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).eval().to(device)
    kwargs = {"max_new_tokens": max_tokens, "min_new_tokens": max_tokens, "do_sample": False,
              "pad_token_id": tok.pad_token_id}
    if mode == "assistant":
        kwargs["assistant_model"] = AutoModelForCausalLM.from_pretrained(
            draft, dtype=dtype).eval().to(device)
        kwargs["num_assistant_tokens"] = k
        kwargs["num_assistant_tokens_schedule"] = "constant"
    elif mode == "prompt_lookup":
        kwargs["prompt_lookup_num_tokens"] = k

    def run(n: int = len(prompts)) -> float:
        tokens, start = 0, time.perf_counter()
        with torch.inference_mode():
            for i in range(0, n, batch):
                enc = tok(prompts[i:i + batch], return_tensors="pt", padding=True,
                          add_special_tokens=False).to(device)
                out = model.generate(**enc, **kwargs)
                tokens += (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return tokens / (time.perf_counter() - start)
    run(batch)  # warm-up: first-call initialisation is not timed
    return run


def interleaved(engine: Callable[[], dict], hf: Callable[[], float] | None,
                repeats: int) -> tuple[dict, float | None]:
    """Alternate the engine's and transformers' runs ``repeats`` times (so both see the same
    machine load) and return each one's median run."""
    ours, theirs = [], []
    for _ in range(repeats):
        ours.append(engine())
        if hf is not None:
            theirs.append(hf())
    ours.sort(key=lambda r: r["tok_s"])
    return ours[len(ours) // 2], statistics.median(theirs) if theirs else None


def modelled_speedup(ar: dict, spec: dict) -> float:
    """Whole-run speedup predicted from the measured steps and costs:
    ``(P + N_ar c_ar) / (P + N_spec (c_draft + c_verify))``, with ``P`` the prefill time (the
    same in both runs, which speculation cannot shorten) and ``N`` the batch steps. At batch 1,
    ``N_spec = N_ar / (1 + E[accepted])``; with a batch, a step serves every running request,
    so ``N_spec`` follows the request with the fewest accepted tokens (measured, not averaged).
    Rejection sampling and bookkeeping are not in ``c_draft + c_verify``: measured/predicted
    shows what they cost.
    """
    p = ar["prefill_s"]
    return (p + ar["steps"] * ar["c_step"]) / (p + spec["steps"] * (spec["c_draft"]
                                                                    + spec["c_verify"]))


# memory bandwidth (GB/s) by device name, for the roofline line (vendor figures)
MEMORY_BANDWIDTH_GBS = {"H200": 4800, "H100 SXM": 3350, "H100 80GB HBM3": 3350, "H100 PCIe": 2000,
                        "H100": 3350, "A100-SXM4-80GB": 2039, "A100": 1555, "L40S": 864}


def roofline(target: str, device: str, dtype: str, c_step: float, batch: int) -> str:
    """One sentence: the AR step against streaming the weights once at the GPU's bandwidth."""
    if not device.startswith("cuda"):
        return ""
    from infer.models.loader import load_model

    model = load_model(target, dtype="auto" if dtype == "auto" else getattr(torch, dtype),
                       device="cpu")
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    name = torch.cuda.get_device_name()
    bw = next((v for k, v in MEMORY_BANDWIDTH_GBS.items() if k in name), None)
    floor = f", the weight-streaming floor at {bw} GB/s is {nbytes / bw / 1e3:.1f} us" if bw \
        else ""
    return (f"Roofline, batch {batch}: {nbytes / 1e6:.1f} MB of weights; one decode step takes "
            f"{c_step * 1e6:.1f} us ({nbytes / c_step / 1e9:.1f} GB/s achieved){floor} on {name}.")


def main() -> None:
    ap = argparse.ArgumentParser(description="draftsmith engine benchmark (tiny target)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, nargs="+", default=[3, 5])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs per row, alternating with transformers'; the median is reported")
    ap.add_argument("--record", action="store_true", help="append to docs/benchmarks-history.md")
    args = ap.parse_args()

    target, draft = str(ensure_tiny_target()), str(default_draft_dir())
    prompts = heldout_prompts(args.prompts, seed=0)
    methods = {"ngram": {"method": "ngram"}, "suffix": {"method": "suffix"},
               "draft_model": {"method": "draft_model", "model": draft}}
    hf_modes = {"ngram": "prompt_lookup", "draft_model": "assistant"}
    cuda = args.device.startswith("cuda")
    hf_dtype = getattr(torch, args.dtype) if args.dtype != "auto" else torch.float32
    engine = dict(device=args.device, dtype=args.dtype)
    lines = ["| batch | method | k | tok/s | HF tok/s | vs HF | accept len | steps | speedup | "
             "predicted | measured/predicted |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for batch in args.batches:
        ar, hf_plain = interleaved(
            engine_runner(target, None, prompts, args.max_tokens, batch, **engine),
            hf_runner(target, draft, prompts, args.max_tokens, batch, "plain", 0, args.device,
                      hf_dtype), args.repeats)
        lines.append(f"| {batch} | autoregressive | - | {ar['tok_s']:.1f} | {hf_plain:.1f} | "
                     f"{ar['tok_s'] / hf_plain:.2f} | 1.00 | {ar['steps']} | 1.00 | - | - |")
        print(lines[-1], flush=True)
        if cuda:  # the same steps without CUDA graphs
            eager, _ = interleaved(engine_runner(target, None, prompts, args.max_tokens, batch,
                                                 **engine, eager=True), None, args.repeats)
            lines.append(f"| {batch} | autoregressive (enforce_eager) | - | {eager['tok_s']:.1f} "
                         f"| - | - | 1.00 | {eager['steps']} | {eager['tok_s'] / ar['tok_s']:.2f} "
                         "| - | - |")
            notes.append(roofline(target, args.device, args.dtype, ar["c_step"], batch))
            print(lines[-1], notes[-1], sep="\n", flush=True)
        for name, base in methods.items():
            for k in args.k:
                r, hf = interleaved(
                    engine_runner(target, {**base, "num_speculative_tokens": k}, prompts,
                                  args.max_tokens, batch, **engine),
                    hf_runner(target, draft, prompts, args.max_tokens, batch, hf_modes[name], k,
                              args.device, hf_dtype) if name in hf_modes else None,
                    args.repeats)
                lossless = r["outputs"] == ar["outputs"]
                pred = modelled_speedup(ar, r)
                speed = r["tok_s"] / ar["tok_s"]
                hf_cols = "n/a | -" if hf is None else f"{hf:.1f} | {r['tok_s'] / hf:.2f}"
                lines.append(f"| {batch} | {name}{'' if lossless else ' (MISMATCH)'} | {k} | "
                             f"{r['tok_s']:.1f} | {hf_cols} | {r['accept_len']:.2f} | "
                             f"{r['steps']} | {speed:.2f} | {pred:.2f} | {speed / pred:.2f} |")
                print(lines[-1], flush=True)
    where = (torch.cuda.get_device_name() if cuda
             else f"{platform.machine()}, {torch.get_num_threads()} threads")
    header = (f"\n## Engine throughput, tiny target ({'GPU' if cuda else 'CPU'})\n\n"
              f"`python scripts/bench_engine.py --prompts {args.prompts} --max-tokens "
              f"{args.max_tokens} --repeats {args.repeats} --device {args.device} --dtype "
              f"{args.dtype}` on {where}, torch {torch.__version__}, "
              f"{time.strftime('%Y-%m-%d')}. HF = transformers generate (plain; assistant_model "
              "for draft_model; prompt_lookup_num_tokens for ngram); each row is the median of "
              "the repeats, alternating with transformers' runs.\n\n")
    table = header + "\n".join(lines) + "\n" + "".join(f"\n{n}\n" for n in notes if n)
    print(table)
    if args.record:
        path = Path("docs/benchmarks-history.md")
        if not path.exists():
            path.write_text("# Benchmarks\n\nEvery number here comes from a script in scripts/; "
                            "the command and machine are given with each table.\n")
        with path.open("a") as f:
            f.write(table)


if __name__ == "__main__":
    main()
