"""Request state inside the engine, how ``generate``'s inputs become requests, and the outputs it
returns (vLLM-shaped)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from infer.metrics import SpecMetrics
from infer.sampling import SamplingParams
from infer.target import Target

log = logging.getLogger(__name__)


@dataclass
class CompletionOutput:
    """One completion (draftsmith supports n=1)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", or "error"


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns per prompt, in prompt order."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: dict  # SpecMetrics.as_dict() of this request
    error: str | None = None  # set when the request was refused (e.g. prompt too long)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass
class Request:
    """A running request. ``tokens`` = prompt + output; the last one is *pending*: sampled but not
    yet written to the target's KV cache (the next step feeds it), so ``cache_len = len - 1``."""

    request_id: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    slot: int = -1
    finish_reason: str | None = None
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    generator: torch.Generator | None = None  # its own stream when SamplingParams.seed is set

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def draft_limit(self, k: int, max_model_len: int) -> int:
        """Drafts worth verifying: every emitted token must fit max_tokens and the cache."""
        room_out = self.params.max_tokens - self.num_output - 1  # the final token takes one
        room_cache = max_model_len - len(self.tokens)
        return max(0, min(k, room_out, room_cache))

    def append(self, new: list[int], eos_ids: frozenset[int], max_model_len: int) -> int:
        """Append emitted tokens until a stop condition; returns how many were kept."""
        p = self.params
        for i, tok in enumerate(new):
            self.tokens.append(tok)
            stop = self.num_output >= p.min_tokens and (
                tok in p.stop_token_ids or (not p.ignore_eos and tok in eos_ids))
            if stop:
                self.finish_reason = "stop"
            elif self.num_output >= p.max_tokens or len(self.tokens) >= max_model_len:
                self.finish_reason = "length"
            if self.finished:
                return i + 1
        return len(new)


def prefill_groups(lengths: list[int], call_cost: int = 64) -> list[list[int]]:
    """Split requests with prompt ``lengths`` into prefill forwards, as indices into ``lengths``.

    A ragged prefill pads every row to the longest prompt of its forward, so one forward over
    prompts of 64 and 257 tokens computes 2 x 257 rows. Sorted by length, a split into
    consecutive groups minimises ``sum(len(group) * longest(group)) + call_cost * groups``
    (``call_cost``: one forward's fixed cost, in padded tokens), found exactly by dynamic
    programming over the sorted lengths. On the tiny target's 8 held-out prompts (64 to 257
    tokens) that is 1508 padded tokens in 4 forwards instead of 2056 in one.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    best = [0] + [None] * len(order)  # best[j]: cost of prefilling the j shortest
    cut = [0] * (len(order) + 1)  # best[j]'s last group starts at sorted index cut[j]
    for j in range(1, len(order) + 1):
        longest = lengths[order[j - 1]]
        for i in range(j):
            cost = best[i] + (j - i) * longest + call_cost
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(order)
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


# ---- generate's inputs and outputs ------------------------------------------------------------

def make_requests(prompts: Any, params: Any, target: Target) -> list[Request]:
    """Prompts (strings, token-id lists, ``{"prompt_token_ids": [...]}`` / ``{"prompt": ...}``,
    one or a list) and sampling params (one for all, or one each) -> requests. A prompt that
    leaves no room for one generated token is refused alone (``finish_reason`` "error")."""
    prompts = _normalise_prompts(prompts)
    params_list = _normalise_params(params, len(prompts))
    requests = []
    for i, (prompt, p) in enumerate(zip(prompts, params_list)):
        text, ids = _encode(prompt, i, target)
        req = Request(i, text, ids, p)
        if p.seed is not None and not p.greedy:  # its own random stream
            req.generator = torch.Generator(device=target.device).manual_seed(p.seed)
        if len(ids) >= target.max_model_len:
            req.finish_reason = "error"
            log.error("request %d refused: prompt has %d tokens, max_model_len is %d", i,
                      len(ids), target.max_model_len)
        requests.append(req)
    return requests


def request_output(req: Request, target: Target) -> RequestOutput:
    """A finished (or refused) request as ``generate`` returns it."""
    error = None
    if req.finish_reason == "error":
        error = (f"prompt has {len(req.prompt_ids)} tokens; max_model_len is "
                 f"{target.max_model_len} (at least one token must be generated)")
    ids = req.output_ids
    tok = target.tokenizer
    text = tok.decode(ids, skip_special_tokens=True) if tok is not None else ""
    completion = CompletionOutput(0, text, ids, req.finish_reason)
    return RequestOutput(req.request_id, req.prompt, req.prompt_ids, [completion],
                         req.metrics.as_dict(), error)


def _encode(prompt: Any, index: int, target: Target) -> tuple[str | None, list[int]]:
    if isinstance(prompt, str):
        if target.tokenizer is None:
            raise ValueError(f"prompt {index} is text but the model directory has no "
                             "tokenizer; pass token ids or tokenizer=PATH")
        ids = target.tokenizer(prompt)["input_ids"]  # with BOS where the tokenizer adds one
        text = prompt
    else:
        ids, text = list(prompt), None
    if not ids:
        raise ValueError(f"prompt {index} is empty; every prompt needs at least one token")
    vocab = target.model.config.vocab_size
    bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)]
    if bad:
        raise ValueError(f"prompt {index} has token ids outside [0, {vocab}): {bad[:5]}")
    return text, ids


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
