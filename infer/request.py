"""Request state inside the engine, how ``generate``'s inputs become requests, and the outputs it
returns (vLLM-shaped)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from infer.detokenize import StopStrings, output_text
from infer.foundation.errors import ConfigError, UserError
from infer.metrics import SpecMetrics
from infer.sampling_params import SamplingParams
from infer.target import Target, TargetTokens

PromptTarget = Target | TargetTokens  # what requests read of a target (TargetTokens' fields)

log = logging.getLogger(__name__)


@dataclass
class CompletionOutput:
    """One completion (draftsmith supports n=1)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or "error"
    stop_reason: int | str | None = None  # as vLLM: the stop string or stop_token_ids id that
    # ended it; None for EOS, length, or a request still running


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns per prompt, in prompt order."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: dict  # SpecMetrics.as_dict() of this request
    error: str | None = None  # why the request was refused (finish_reason "error"): which
    # prompt and what is wrong with it, e.g. "prompt 2: is empty; expected at least one token"

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
    error: str | None = None  # why it was refused; it then never runs (finish_reason "error")
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    stop_strings: StopStrings | None = None  # set when params.stop is not empty
    step_log: list[tuple[int, int]] | None = None  # (drafted, accepted) per step, when a
    # server reports detailed per-request stats (infer/serve/spec_stats.py)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)

    def refuse(self, error: str) -> None:
        self.finish_reason, self.error = "error", error

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
            if self.num_output >= p.min_tokens:
                self._check_stop(tok, eos_ids)
            if not self.finished and (self.num_output >= p.max_tokens
                                      or len(self.tokens) >= max_model_len):
                self.finish_reason = "length"
            if self.finished:
                return i + 1
        return len(new)

    def _check_stop(self, tok: int, eos_ids: frozenset[int]) -> None:
        """vLLM's order: a stop token id, then EOS, then a stop string (only once more than
        min_tokens were generated: vLLM's detokenizer skips the check until then)."""
        p = self.params
        if tok in p.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", tok
        elif not p.ignore_eos and tok in eos_ids:
            self.finish_reason = "stop"
        elif self.stop_strings is not None and self.num_output > p.min_tokens:
            hit = self.stop_strings.hit(self.output_ids)
            if hit is not None:
                self.finish_reason, self.stop_reason = "stop", hit


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

class GenerateError(UserError, ValueError):
    """``generate`` was called wrongly as a whole (no prompts, prompts that are not a prompt or
    a list of them, a params list of another length): nothing ran."""


class _Refused(Exception):
    """Why one request cannot run; caught per request, so the rest of the batch runs."""


def make_requests(prompts: Any, params: Any, target: PromptTarget) -> list[Request]:
    """Prompts (strings, token-id lists, ``{"prompt_token_ids": [...]}`` / ``{"prompt": ...}``,
    one or a list) and sampling params (one for all, or one each) -> requests, in prompt order.

    A call wrong as a whole raises :class:`GenerateError` (a ``ValueError``). A request that
    cannot run (an empty prompt, token ids outside the vocabulary, a prompt leaving no room for
    one generated token, text without a tokenizer, invalid SamplingParams: validated again
    here, as they may have been changed since they were built; stop_token_ids outside the
    vocabulary) is refused alone, with ``finish_reason`` "error" and ``error`` naming the
    prompt and what is wrong. It takes no slot, no forward and no random draw, so the others
    run exactly as they would without it.
    """
    prompts = _normalise_prompts(prompts)
    params_list = _normalise_params(params, len(prompts))
    return [make_request(i, prompt, p, target)
            for i, (prompt, p) in enumerate(zip(prompts, params_list))]


def make_request(index: int, prompt: Any, params: Any, target: PromptTarget) -> Request:
    """One request (id ``index``), or a refused one saying why (see ``make_requests``)."""
    text, ids = None, []
    try:
        text, ids = _prompt_parts(prompt)
        ids = _tokenize(text, ids, target)
        _check_ids(ids, target)
        if not isinstance(params, SamplingParams):
            raise _Refused(f"its sampling params are a {type(params).__name__}; expected a "
                           "SamplingParams")
        params.validate()
        _check_stop_ids(params.stop_token_ids, target)
        if params.stop and target.tokenizer is None:
            raise _Refused("has stop strings but the model directory has no tokenizer; "
                           "expected stop_token_ids instead (or pass tokenizer=PATH)")
    except (_Refused, ConfigError) as e:
        ok_ids = all(isinstance(t, int) for t in ids)  # echoed back only when they are ids
        req = Request(index, text, list(ids) if ok_ids else [], params)
        req.refuse(f"prompt {index}: {e}")
        log.error("request refused: %s", req.error)
        return req
    req = Request(index, text, ids, params)
    if params.stop:
        req.stop_strings = StopStrings(target.tokenizer, params.stop)
    if params.seed is not None and not params.greedy:  # its own random stream
        req.generator = torch.Generator(device=target.device).manual_seed(params.seed)
    return req


def request_output(req: Request, target: Target) -> RequestOutput:
    """A finished (or refused) request as ``generate`` returns it."""
    ids = req.output_ids
    text = output_text(target.tokenizer, ids, req.stop_reason)
    completion = CompletionOutput(0, text, ids, req.finish_reason, req.stop_reason)
    return RequestOutput(req.request_id, req.prompt, req.prompt_ids, [completion],
                         req.metrics.as_dict(), req.error)


def _prompt_parts(prompt: Any) -> tuple[str | None, list[Any]]:
    """One prompt -> (its text or None, its token ids as given; [] for text)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise _Refused(f"is a dict with keys {sorted(map(str, prompt))}; expected "
                           "'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        return prompt, []
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    raise _Refused(f"is a {type(prompt).__name__}; expected a string, a list of token ids or a "
                   "dict with 'prompt' or 'prompt_token_ids'")


def _tokenize(text: str | None, ids: list[Any], target: PromptTarget) -> list[Any]:
    if text is None:
        return ids
    if target.tokenizer is None:
        raise _Refused("is text but the model directory has no tokenizer; expected token ids "
                       "(or pass tokenizer=PATH)")
    return list(target.tokenizer(text)["input_ids"])  # with BOS where the tokenizer adds one


def _check_ids(ids: list[Any], target: PromptTarget) -> None:
    """At least one token, every id in the vocabulary, and room for one generated token."""
    if not ids:
        raise _Refused("is empty; expected at least one token")
    vocab = target.vocab_size
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise _Refused(f"has token ids outside [0, {vocab}): {bad[:5]}"
                       f"{' ...' if len(bad) > 5 else ''}; expected integers in [0, {vocab}) "
                       "(the model's vocab_size)")
    limit = target.max_model_len
    if len(ids) >= limit:
        raise _Refused(f"has {len(ids)} tokens; max_model_len is {limit}, so expected at most "
                       f"{limit - 1} (at least one token must be generated)")


def _check_stop_ids(stop_ids: list[int], target: PromptTarget) -> None:
    """vLLM refuses stop_token_ids the model cannot emit: a typo there would never stop."""
    vocab = target.vocab_size
    bad = [t for t in stop_ids if t >= vocab]
    if bad:
        raise _Refused(f"SamplingParams: invalid value for 'stop_token_ids': {stop_ids!r}; "
                       f"expected ids in [0, {vocab}) (the model's vocab_size), not {bad[:5]}")


def _normalise_prompts(prompts: Any) -> list[Any]:
    """``generate``'s prompts -> one entry per request. Only a call wrong as a whole raises;
    what is wrong with one prompt becomes that request's error."""
    if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
        return [prompts]  # one prompt
    if not isinstance(prompts, (list, tuple)):
        raise GenerateError(f"generate: prompts is a {type(prompts).__name__}; expected a "
                            "prompt (a string, a list of token ids, a dict with 'prompt' or "
                            "'prompt_token_ids') or a list of prompts")
    if not prompts:
        raise GenerateError("generate: no prompts given; expected at least one prompt")
    return list(prompts)


def _normalise_params(params: Any, n: int) -> list[Any]:
    """One SamplingParams for all ``n`` prompts (None: the defaults) or a list of ``n``."""
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, (list, tuple)):
        raise GenerateError(f"generate: sampling_params is a {type(params).__name__}; expected "
                            "a SamplingParams or a list of them, one per prompt")
    if len(params) != n:
        raise GenerateError(f"generate: got {len(params)} sampling params for {n} prompts; "
                            "expected one for all prompts or one per prompt")
    return list(params)


def mask_early_stops(logits: torch.Tensor, reqs: list[Request], eos_ids: frozenset[int],
                     depths: torch.Tensor | None = None) -> torch.Tensor:
    """min_tokens: a request's stop tokens (EOS unless ignore_eos, and its stop_token_ids, as in
    vLLM) get -inf in ``logits [B, T, vocab]`` at output positions (``depths [T]``, else
    0 .. T-1) before min_tokens; ``logits`` itself when no request needs it."""
    need = [r.params.min_tokens - r.num_output for r in reqs]
    if max(need) <= 0:
        return logits
    vocab = logits.shape[-1]
    stops = torch.zeros(len(reqs), vocab, dtype=torch.bool)  # [B, vocab]
    for row, r in enumerate(reqs):
        ids = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else eos_ids)
        stops[row, [t for t in ids if t < vocab]] = True
    positions = torch.arange(logits.shape[1]) if depths is None else depths  # [T] on CPU
    early = positions[None, :] < torch.tensor(need)[:, None]  # [B, T]
    block = (early[:, :, None] & stops[:, None, :]).to(logits.device)  # [B, T, vocab]
    return logits.masked_fill(block, float("-inf"))
