"""The draftsmith inference engine: ``LLM`` with vLLM's constructor and ``generate`` API.

Every step runs :meth:`LLM.speculative_step` over all running requests: the proposer drafts up
to k tokens per request, one target forward verifies ``[pending token, drafts...]`` for the whole
ragged batch, the shared rejection sampler picks accepted + recovered/bonus tokens, and the KV
cache rolls rejected positions back by resetting lengths. Without a speculative config the same
function runs with zero drafts, which is plain autoregressive decoding, so "speculative equals
non-speculative" compares two uses of one code path.

Continuous batching: requests occupy KV-cache slots; finished ones free their slot at once and
waiting ones are prefilled into free slots before the next step.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from infer.graphs import StaticForward
from infer.kv_cache import KVCache
from infer.metrics import SpecMetrics
from infer.models.loader import load_model
from infer.proposers.base import (DraftBatch, Proposal, Proposer, ProposerContext, VerifiedStep,
                                  get_proposer_class)
from infer.rejection import greedy_verify, rejection_sample
from infer.request import CompletionOutput, Request, RequestOutput, prefill_groups
from infer.sampling import BatchGenerator, Generator, SamplingParams
from infer.spec_config import SpeculativeConfig
from infer.validation import check_float, check_int, config_error

log = logging.getLogger(__name__)
_WHERE = "LLM"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# what LLM.with_config forks share: the loaded target and what comes with it
_SHARED = ("device", "target", "max_model_len", "enforce_eager", "gpu_memory_utilization",
           "tokenizer", "eos_ids")


class LLM:
    """Offline generation engine (single device, tensor parallel size 1).

    dtype "auto": the checkpoint's dtype on CUDA, float32 on CPU (bf16 matmuls are slow there).
    """

    def __init__(self, model: str, speculative_config: Any = None, *, dtype: str = "auto",
                 device: str = "auto", max_model_len: int | None = None, max_num_seqs: int = 8,
                 seed: int = 0, enforce_eager: bool = False, gpu_memory_utilization: float = 0.9,
                 tensor_parallel_size: int = 1, tokenizer: str | None = None) -> None:
        _check_engine_args(dtype, device, max_model_len, max_num_seqs, seed,
                           gpu_memory_utilization, tensor_parallel_size)
        self.device = _resolve_device(device)
        self.spec = SpeculativeConfig.parse(speculative_config)
        self.target = load_model(model, dtype=_resolve_dtype(dtype, self.device),
                                 device=self.device)
        cfg = self.target.config
        self.max_model_len = max_model_len or min(cfg.max_position_embeddings, 4096)
        if self.max_model_len > cfg.max_position_embeddings:
            raise config_error("max_model_len", max_model_len,
                               f"<= the model's max_position_embeddings "
                               f"({cfg.max_position_embeddings})", _WHERE)
        self.enforce_eager = enforce_eager
        self.gpu_memory_utilization = gpu_memory_utilization
        self.tokenizer = _load_tokenizer(tokenizer or model)
        self.eos_ids = frozenset(cfg.eos_token_ids) | _tokenizer_eos(self.tokenizer)
        self._configure(max_num_seqs, seed)

    def _configure(self, max_num_seqs: int, seed: int) -> None:
        """Everything that depends on the speculative config, batch size and seed (``self.spec``
        is set): KV cache, generator, proposer, metrics; the target is left as it is."""
        self.max_num_seqs, self.seed = max_num_seqs, seed
        dtype = next(self.target.parameters()).dtype
        self._check_memory(kv_cache_bytes(self.target.config, max_num_seqs, self.max_model_len,
                                          dtype))
        self.cache = KVCache.for_model(self.target.config, max_num_seqs, self.max_model_len,
                                       dtype=dtype, device=self.device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.proposer = self._make_proposer(dtype)
        self._check_memory()  # the proposer's weights and caches are allocated now
        # target residual streams the proposer reads (EAGLE heads); none for the others
        self._aux_ids = self.proposer.aux_layer_ids if self.proposer else ()
        # steps in fixed shapes, captured as CUDA graphs; None: the plain forward (CPU, eager)
        self.static_forward = None
        if self._static_steps:
            self.static_forward = StaticForward(self.target, self.cache,
                                                aux_layer_ids=self._aux_ids)
        self.metrics = SpecMetrics()
        self._running: list[Request] = []

    def _check_memory(self, cache_bytes: int = 0) -> None:
        """On CUDA: what is allocated plus ``cache_bytes`` must fit gpu_memory_utilization."""
        if self.device.type == "cuda":
            _, total = torch.cuda.mem_get_info(self.device)
            check_memory_budget(torch.cuda.memory_allocated(self.device), cache_bytes, total,
                                self.gpu_memory_utilization, self.max_num_seqs,
                                self.max_model_len)

    def with_config(self, speculative_config: Any = None, *, max_num_seqs: int | None = None,
                    seed: int | None = None) -> "LLM":
        """A new engine on this one's loaded target and tokenizer (nothing is reloaded), with
        another speculative config, batch size or seed (None: this engine's): how the harness
        runs a matrix of configurations. The two share the target (read-only) and nothing
        else."""
        check_int("max_num_seqs", max_num_seqs, _WHERE, minimum=1, optional=True)
        check_int("seed", seed, _WHERE, optional=True)
        other = object.__new__(LLM)
        for name in _SHARED:
            setattr(other, name, getattr(self, name))
        other.spec = SpeculativeConfig.parse(speculative_config)
        other._configure(max_num_seqs or self.max_num_seqs, self.seed if seed is None else seed)
        return other

    # ---- public API ------------------------------------------------------------------------------

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for prompts (strings, token-id lists, or ``{"prompt_token_ids": [...]}``)."""
        requests = self._make_requests(prompts, sampling_params)
        waiting = [r for r in requests if not r.finished]
        bar = tqdm(total=len(requests), desc="generate", disable=not use_tqdm, unit="req")
        bar.update(len(requests) - len(waiting))
        while waiting or self._running:
            waiting = self._admit(waiting)
            done = self._retire()  # finished at their first token: never stepped
            bar.update(done)
            if done and waiting:
                continue  # their slots are free again: admit more before stepping
            if self._running:
                self.speculative_step()
            bar.update(self._retire())
        bar.close()
        return [self._output(r) for r in requests]

    def get_metrics(self) -> dict:
        """Cumulative speculative metrics over every ``generate`` call (REFERENCE section 3)."""
        return self.metrics.as_dict()

    @property
    def _static_steps(self) -> bool:
        """Steps in fixed shapes (infer/graphs.py), captured as CUDA graphs: on CUDA unless
        enforce_eager (CPU tests turn it on to run the same path eagerly)."""
        return self.device.type == "cuda" and not self.enforce_eager

    @property
    def k(self) -> int:
        return self.spec.num_speculative_tokens if self.spec else 0

    # ---- the step --------------------------------------------------------------------------------

    @torch.inference_mode()  # no autograd bookkeeping at all: ~10% off a small CPU step
    def speculative_step(self) -> None:
        """Draft k -> one target forward -> rejection sampling -> advance or roll back caches."""
        reqs = self._running
        slots = torch.tensor([r.slot for r in reqs], device=self.device)  # [B]
        pending = torch.tensor([r.tokens[-1] for r in reqs], device=self.device)  # [B]
        # host -> device copies above, before the proposer queues GPU work they would wait for
        temperature, top_k, top_p = self._sampling_tensors(reqs)
        generator = self._generator(reqs)
        proposal = self._propose(reqs, temperature, top_k, top_p, generator)
        draft_ids = proposal.draft_ids  # [B, k], -1 padded
        num_drafted = (draft_ids >= 0).sum(dim=1)  # [B]
        inputs = torch.cat([pending[:, None], draft_ids.clamp_min(0)], dim=1)  # [B, k + 1]
        out = self._verify(inputs, reqs, slots, 1 + num_drafted)
        logits = self._suppress_early_eos(out.logits, reqs)  # [B, k + 1, vocab]
        method = self.spec.rejection_sample_method if self.spec else "strict"
        if _all_greedy(temperature) and method != "synthetic":
            tokens = greedy_verify(logits, draft_ids)  # what rejection_sample returns here
        else:
            tokens = rejection_sample(
                logits, draft_ids, proposal.draft_probs, temperature=temperature,
                method=method, top_k=top_k, top_p=top_p, generator=generator,
                synthetic_acceptance_rate=(self.spec.synthetic_acceptance_rate if self.spec
                                           else None),
            )  # [B, k + 1]
        rows, drafted = tokens.tolist(), num_drafted.tolist()  # the step's one host sync
        accepted = [sum(t >= 0 for t in row) - 1 for row in rows]
        new_lens = [len(r.tokens) + a for r, a in zip(reqs, accepted)]  # pending + accepted
        self.cache.truncate(slots, torch.tensor(new_lens, device=self.device))
        new_tokens = [self._accept(r, row[: a + 1], n, a)
                      for r, row, n, a in zip(reqs, rows, drafted, accepted)]
        if self.proposer is not None:
            self.proposer.observe(VerifiedStep([r.slot for r in reqs], accepted, new_tokens,
                                               {"target_output": out}))

    def _verify(self, inputs: torch.Tensor, reqs: list[Request], slots: torch.Tensor,
                num_tokens: torch.Tensor):
        """The step's one target forward over ``inputs [B, k + 1]`` (``num_tokens [B]`` real)."""
        if self.static_forward is not None:
            longest = max(len(r.tokens) for r in reqs) + inputs.shape[1] - 1  # cache + step
            return self.static_forward(inputs, slots=[r.slot for r in reqs], index=slots,
                                       num_tokens=num_tokens, max_len=longest)
        # rows 0 .. B-1 in order: the cache reads views instead of gathering every layer's keys
        target_slots = None if _in_order([r.slot for r in reqs]) else slots
        return self.target(inputs, self.cache, target_slots, num_tokens=num_tokens,
                           aux_layer_ids=self._aux_ids)

    def _accept(self, req: Request, emitted: list[int], drafted: int, accepted: int) -> list[int]:
        """Append a request's emitted tokens (stop-aware) and record its metrics."""
        kept = req.append(emitted, self.eos_ids, self.max_model_len)
        step = SpecMetrics()
        step.record(drafted, min(accepted, kept))  # tokens after a stop are not counted
        req.metrics.merge(step)
        self.metrics.merge(step)
        return emitted[:kept]

    def _propose(self, reqs: list[Request], temperature, top_k, top_p,
                 generator: Generator) -> Proposal:
        """Drafts ``[B, k]`` clipped per request to what max_tokens and the cache can take."""
        if self.proposer is None or self.k == 0:
            return Proposal(torch.empty(len(reqs), 0, dtype=torch.long, device=self.device))
        batch = DraftBatch([r.slot for r in reqs], [r.tokens for r in reqs], self.k,
                           temperature=_as_tensor(temperature, len(reqs), self.device),
                           top_k=top_k, top_p=top_p, generator=generator)
        limits = torch.tensor([r.draft_limit(self.k, self.max_model_len) for r in reqs],
                              device=self.device)  # [B], copied before the drafts are queued
        proposal = self.proposer.propose(batch)
        over = torch.arange(self.k, device=self.device)[None, :] >= limits[:, None]  # [B, k]
        proposal.draft_ids = proposal.draft_ids.masked_fill(over, -1)
        return proposal

    def _suppress_early_eos(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """min_tokens: a request's stop tokens (EOS unless ignore_eos, and its stop_token_ids, as
        in vLLM) get -inf at output positions before its min_tokens."""
        need = [r.params.min_tokens - r.num_output for r in reqs]
        if max(need) <= 0:
            return logits
        vocab = logits.shape[-1]
        stops = torch.zeros(len(reqs), vocab, dtype=torch.bool)  # [B, vocab]
        for row, r in enumerate(reqs):
            ids = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else self.eos_ids)
            stops[row, [t for t in ids if t < vocab]] = True
        positions = torch.arange(logits.shape[1], device=logits.device)  # [k + 1]
        early = positions[None, :] < torch.tensor(need, device=logits.device)[:, None]  # [B, k+1]
        block = early[:, :, None] & stops.to(logits.device)[:, None, :]  # [B, k + 1, vocab]
        return logits.masked_fill(block, float("-inf"))

    # ---- scheduling ------------------------------------------------------------------------------

    def _admit(self, waiting: list[Request]) -> list[Request]:
        """Prefill waiting requests into free slots; returns those still waiting."""
        free = sorted(set(range(self.max_num_seqs)) - {r.slot for r in self._running})
        admitted, waiting = waiting[: len(free)], waiting[len(free):]
        for req, slot in zip(admitted, free):
            req.slot = slot
        # a forward's fixed cost in padded tokens: a weight read against one token's FLOPs
        # (~300 on an H100 in bf16; ~50 on 2 CPU cores in fp32, Python included)
        call_cost = 256 if self.device.type == "cuda" else 64
        for group in prefill_groups([len(r.prompt_ids) for r in admitted], call_cost):
            self._prefill([admitted[i] for i in group])  # similar lengths: little padding
        self._running.sort(key=lambda r: r.slot)  # rows 0 .. B-1 in order read cache views
        return waiting

    @torch.inference_mode()
    def _prefill(self, reqs: list[Request]) -> None:
        """Run prompts through the target (ragged batch) and sample each first token."""
        slots = torch.tensor([r.slot for r in reqs], device=self.device)
        self.cache.reset(slots)
        target_slots = None if _in_order([r.slot for r in reqs]) else slots
        lens = [len(r.prompt_ids) for r in reqs]
        ids = torch.zeros(len(reqs), max(lens), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, : lens[i]] = torch.tensor(r.prompt_ids)
        lens_t = torch.tensor(lens, device=self.device)
        out = self.target(ids.to(self.device), self.cache, target_slots, num_tokens=lens_t,
                          logits_at=(lens_t - 1)[:, None],
                          aux_layer_ids=self._aux_ids)  # logits [B, 1, vocab]
        temperature, top_k, top_p = self._sampling_tensors(reqs)
        logits = self._suppress_early_eos(out.logits, reqs)
        empty = torch.empty(len(reqs), 0, dtype=torch.long, device=self.device)
        if _all_greedy(temperature):
            first = greedy_verify(logits, empty)[:, 0].tolist()
        else:
            first = rejection_sample(logits, empty, temperature=temperature, top_k=top_k,
                                     top_p=top_p,
                                     generator=self._generator(reqs))[:, 0].tolist()
        for req, tok in zip(reqs, first):
            req.append([tok], self.eos_ids, self.max_model_len)
            if self.proposer is not None:
                self.proposer.start(req.slot, req.prompt_ids)
            self._running.append(req)
        if self.proposer is not None:
            self.proposer.prefilled([r.slot for r in reqs], lens, out)

    def _retire(self) -> int:
        """Free the slots of finished requests; returns how many finished."""
        done = [r for r in self._running if r.finished]
        for req in done:
            if self.proposer is not None:
                self.proposer.finish(req.slot)
        self._running = [r for r in self._running if not r.finished]
        return len(done)

    def _generator(self, reqs: list[Request]) -> Generator:
        """The engine's generator, or a :class:`BatchGenerator` when some request is seeded."""
        if all(r.generator is None for r in reqs):
            return self.generator
        return BatchGenerator(self.generator, [r.generator for r in reqs])

    def _sampling_tensors(self, reqs: list[Request]):
        """Per-row temperature / top-k / top-p; scalars (and None filters) when uniform."""
        temps = [float(r.params.temperature) for r in reqs]
        temperature = temps[0] if len(set(temps)) == 1 else torch.tensor(temps, device=self.device)
        top_k = top_p = None
        if any(r.params.top_k > 0 for r in reqs):
            top_k = torch.tensor([r.params.top_k for r in reqs], device=self.device)
        if any(r.params.top_p < 1.0 for r in reqs):
            top_p = torch.tensor([float(r.params.top_p) for r in reqs], device=self.device)
        return temperature, top_k, top_p

    # ---- setup and I/O ---------------------------------------------------------------------------

    def _make_proposer(self, dtype: torch.dtype) -> Proposer | None:
        if self.spec is None:
            return None
        self.spec.check_against_target(self.max_model_len)
        ctx = ProposerContext(self.target, self.target.config, self.device, dtype,
                              self.max_num_seqs, self.max_model_len, self.target.config.vocab_size,
                              self._static_steps)
        return get_proposer_class(self.spec.method)(self.spec, ctx)

    def _make_requests(self, prompts: Any, params: Any) -> list[Request]:
        prompts = _normalise_prompts(prompts)
        params_list = _normalise_params(params, len(prompts))
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            text, ids = self._encode(prompt, i)
            req = Request(i, text, ids, p)
            if p.seed is not None and not p.greedy:  # its own random stream
                req.generator = torch.Generator(device=self.device).manual_seed(p.seed)
            if len(ids) >= self.max_model_len:
                req.finish_reason = "error"
                log.error("request %d refused: prompt has %d tokens, max_model_len is %d", i,
                          len(ids), self.max_model_len)
            requests.append(req)
        return requests

    def _encode(self, prompt: Any, index: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {index} is text but the model directory has no "
                                 "tokenizer; pass token ids or tokenizer=PATH")
            ids = self.tokenizer(prompt)["input_ids"]  # with BOS where the tokenizer adds one
            text = prompt
        else:
            ids, text = list(prompt), None
        if not ids:
            raise ValueError(f"prompt {index} is empty; every prompt needs at least one token")
        vocab = self.target.config.vocab_size
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt {index} has token ids outside [0, {vocab}): {bad[:5]}")
        return text, ids

    def _output(self, req: Request) -> RequestOutput:
        error = None
        if req.finish_reason == "error":
            error = (f"prompt has {len(req.prompt_ids)} tokens; max_model_len is "
                     f"{self.max_model_len} (at least one token must be generated)")
        ids = req.output_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""
        completion = CompletionOutput(0, text, ids, req.finish_reason)
        return RequestOutput(req.request_id, req.prompt, req.prompt_ids, [completion],
                             req.metrics.as_dict(), error)


def kv_cache_bytes(cfg, rows: int, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of a :class:`KVCache` for ``rows`` sequences of ``max_len`` tokens (keys + values,
    the scratch column included)."""
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    return rows * (max_len + 1) * per_token


def check_memory_budget(used: int, cache: int, total: int, utilization: float,
                        max_num_seqs: int, max_model_len: int) -> None:
    """vLLM's ``gpu_memory_utilization``: what is allocated (``used`` bytes: weights, caches)
    plus the KV cache about to be (``cache``) must fit in that fraction of the device's
    ``total``; caches are sized by max_num_seqs x max_model_len, so a clear error beats an OOM
    later."""
    budget = utilization * total
    if used + cache > budget:
        gib = 2 ** 30
        raise config_error(
            "gpu_memory_utilization", utilization,
            f"room for what is allocated ({used / gib:.2f} GiB: weights, caches) and the KV "
            f"cache ({cache / gib:.2f} GiB for max_num_seqs={max_num_seqs} x "
            f"max_model_len={max_model_len}) within "
            f"{budget / gib:.2f} GiB of the device's {total / gib:.2f} GiB; lower max_model_len "
            "or max_num_seqs, or raise gpu_memory_utilization", _WHERE)


def _in_order(slots: list[int]) -> bool:
    """Whether a batch occupies cache rows ``0 .. B-1`` in order (then no slot gather is needed)."""
    return all(s == i for i, s in enumerate(slots))


def _all_greedy(temperature) -> bool:
    """Every row greedy: ``_sampling_tensors`` gives a scalar when temperatures are uniform."""
    return not isinstance(temperature, torch.Tensor) and temperature <= 0.0


def _check_engine_args(dtype, device, max_model_len, max_num_seqs, seed, util, tp) -> None:
    if dtype != "auto" and dtype not in _DTYPES:
        raise config_error("dtype", dtype, f"'auto' or one of {', '.join(_DTYPES)}", _WHERE)
    if not (device == "auto" or str(device).split(":")[0] in ("cpu", "cuda")):
        raise config_error("device", device, "'auto', 'cpu', 'cuda' or 'cuda:N'", _WHERE)
    check_int("max_model_len", max_model_len, _WHERE, minimum=2, optional=True)
    check_int("max_num_seqs", max_num_seqs, _WHERE, minimum=1)
    check_int("seed", seed, _WHERE)
    check_float("gpu_memory_utilization", util, _WHERE, low=0.0, high=1.0, low_open=True)
    if tp != 1:
        raise config_error("tensor_parallel_size", tp,
                           "1 (draftsmith's engine runs on one device; serve with vLLM for "
                           "tensor parallelism)", _WHERE)


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise config_error("device", device, "'cpu' or 'auto' (no CUDA device is visible)", _WHERE)
    return torch.device(device)


def _resolve_dtype(dtype: str, device: torch.device) -> str | torch.dtype:
    if dtype == "auto":
        return "auto" if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def _load_tokenizer(path: str):
    """The model directory's tokenizer, or None when it has none (token-id prompts only)."""
    p = Path(path)
    if not (p / "tokenizer.json").exists() and not (p / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p))


def _tokenizer_eos(tokenizer) -> frozenset[int]:
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    return frozenset() if eos is None else frozenset([eos])


def _normalise_prompts(prompts: Any) -> list[Any]:
    """A single prompt or a list of them -> list of str / list[int]."""
    if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                p = p["prompt_token_ids"]
            elif "prompt" in p:
                p = p["prompt"]
            else:
                raise ValueError(f"prompt {i}: a dict prompt needs 'prompt' or "
                                 f"'prompt_token_ids', got keys {sorted(p)}")
        if not isinstance(p, (str, list, tuple)):
            raise ValueError(f"prompt {i}: expected a string or a list of token ids, got "
                             f"{type(p).__name__}")
        out.append(p)
    if not out:
        raise ValueError("generate: no prompts given")
    return out


def _normalise_params(params: Any, n: int) -> list[SamplingParams]:
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        params = [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"generate: got {len(params)} sampling params for {n} prompts")
    return params


def _as_tensor(value: Any, batch: int, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.full((batch,), float(value), device=device)
