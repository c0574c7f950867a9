"""From a validated OpenAI body to engine requests, and from engine updates to OpenAI JSON.

Everything a request needs is checked here, on the event loop, before anything is queued:
a 400 means no prompt of that HTTP request reached the engine. Prompt checks are the engine's
own (:func:`~infer.request.make_request`: empty prompt, ids outside the vocabulary, a prompt
of ``max_model_len`` tokens or more, invalid SamplingParams). As in vLLM 0.32, ``max_tokens``
is clamped to the context left after the prompt; without one (chat's default, or
``max_tokens: null``) a request may use all of it.

Chat prompts are the tokenizer's chat template rendered to text with a generation prompt,
then tokenized without special tokens (the template writes its own), as vLLM does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Union

from infer.detokenize import output_text
from infer.engine import LLM
from infer.foundation.errors import ConfigError
from infer.request import Request, make_request
from infer.serve.engine_loop import EngineLoop, TokenUpdate
from infer.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest, SampledRequest
from infer.serve.spec_stats import SpecStatsLevel, request_spec_stats


@dataclass
class ServedModel:
    """What the routes serve: the engine (owned by ``loop``'s thread) and its public name."""

    llm: LLM
    loop: EngineLoop
    name: str
    spec_stats: SpecStatsLevel = SpecStatsLevel.none  # per-request stats in responses

    def check_name(self, requested: str | None) -> None:
        """vLLM: a request for another model is a 404."""
        if requested not in (None, self.name):
            raise ApiError(f"The model `{requested}` does not exist.", "model", 404,
                           "NotFoundError")


@dataclass
class Job:
    """One HTTP request's engine requests (one per prompt = one choice each)."""

    kind: str  # "completion" or "chat"
    requests: list[Request]
    model: str
    id: str
    created: int

    @classmethod
    def new(cls, kind: str, requests: list[Request], served: ServedModel) -> "Job":
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        if served.spec_stats == SpecStatsLevel.detailed:
            for r in requests:
                r.step_log = []
        return cls(kind, requests, served.name, f"{prefix}-{uuid.uuid4().hex}",
                   int(time.time()))


def completion_job(body: CompletionRequest, served: ServedModel) -> Job:
    served.check_name(body.model)
    body.check_supported()
    requests = [engine_request(i, p, body, body.max_tokens, served.llm, "prompt")
                for i, p in enumerate(body.prompts())]
    return Job.new("completion", requests, served)


def chat_job(body: ChatCompletionRequest, served: ServedModel) -> Job:
    served.check_name(body.model)
    body.check_supported()
    ids = chat_prompt_ids(body, served.llm.tokenizer)
    request = engine_request(0, ids, body, body.requested_max_tokens, served.llm, "messages")
    return Job.new("chat", [request], served)


def chat_prompt_ids(body: ChatCompletionRequest, tokenizer: Any) -> list[int]:
    """The messages through the tokenizer's chat template, as token ids."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ApiError("the model has no chat template; use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(
            [m.for_template() for m in body.messages], tokenize=False,
            add_generation_prompt=body.add_generation_prompt,
            **dict(body.chat_template_kwargs or {}))
    except Exception as e:  # jinja's TemplateError and what templates raise on bad roles
        raise ApiError(f"the chat template refused the messages: {e}", "messages") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def engine_request(index: int, prompt: Union[str, list[int]], body: SampledRequest,
                   max_tokens: int | None, llm: LLM, param: str) -> Request:
    """A checked engine request for one prompt, ``max_tokens`` clamped to the context left."""
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(f"'max_tokens' must be at least 1; got {max_tokens}", "max_tokens")
    params = body.sampling_params(max_tokens or 1)
    request = make_request(index, prompt, params, llm.target)
    if request.error is not None:
        raise ApiError(request.error, param)
    room = llm.max_model_len - len(request.prompt_ids)
    try:
        request.params = dataclasses.replace(params, max_tokens=min(max_tokens or room, room))
    except ConfigError as e:  # min_tokens above what the context leaves
        raise ApiError(f"{e} (the prompt leaves room for {room} tokens)", e.key) from None
    return request


async def updates(loop: EngineLoop, requests: list[Request]
                  ) -> AsyncIterator[tuple[int, TokenUpdate]]:
    """Submit ``requests`` and yield ``(index, update)`` until all finish. Leaving early (the
    client disconnected, the task was cancelled) aborts the unfinished ones."""
    queue: asyncio.Queue[tuple[int, TokenUpdate]] = asyncio.Queue()
    events = asyncio.get_running_loop()

    def deliver(index: int, update: TokenUpdate) -> None:  # runs in the engine thread
        try:
            events.call_soon_threadsafe(queue.put_nowait, (index, update))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    for i, request in enumerate(requests):
        loop.submit(request, lambda u, i=i: deliver(i, u))
    pending = set(range(len(requests)))
    try:
        while pending:
            index, update = await queue.get()
            if update.finish_reason is not None:
                pending.discard(index)
            yield index, update
    finally:
        for index in pending:
            loop.abort(requests[index])


# ---- responses ---------------------------------------------------------------------------------

def usage(job: Job, finals: dict[int, TokenUpdate]) -> dict[str, int]:
    prompt = sum(len(r.prompt_ids) for r in job.requests)
    completion = sum(len(u.token_ids) for u in finals.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def spec_metrics(job: Job, served: ServedModel) -> dict[str, Any]:
    """``{"metrics": {"speculative_decoding": ...}}`` when the server reports per-request stats
    (read once the requests finished: the engine thread no longer touches them); the stats are
    null without speculation or with more than one choice."""
    if served.spec_stats == SpecStatsLevel.none:
        return {}
    stats = None
    if served.llm.spec is not None and len(job.requests) == 1:
        r = job.requests[0]
        stats = request_spec_stats(r.metrics, served.llm.k, r.step_log)
    return {"metrics": {"speculative_decoding": stats}}


async def respond(job: Job, served: ServedModel) -> dict[str, Any]:
    """The non-streaming answer: every choice's full text, finish reason and usage."""
    finals: dict[int, TokenUpdate] = {}
    async for index, update in updates(served.loop, job.requests):
        if update.finish_reason is not None:
            finals[index] = update
    failed = [u.error for u in finals.values() if u.finish_reason == "error"]
    if failed:
        raise ApiError(failed[0], None, 500, "InternalServerError")
    tokenizer = served.llm.tokenizer
    choices = []
    for index in sorted(finals):
        u = finals[index]
        text = output_text(tokenizer, u.token_ids, u.stop_reason)
        content = ({"message": {"role": "assistant", "content": text}} if job.kind == "chat"
                   else {"text": text})
        choices.append({"index": index, **content, "logprobs": None,
                        "finish_reason": u.finish_reason, "stop_reason": u.stop_reason})
    obj = "chat.completion" if job.kind == "chat" else "text_completion"
    return {"id": job.id, "object": obj, "created": job.created, "model": job.model,
            "choices": choices, "usage": usage(job, finals), **spec_metrics(job, served)}
