"""``stream: true``: server-sent events as vLLM sends them.

Each event is ``data: {json}`` and a blank line; the stream ends with ``data: [DONE]``. A
completion chunk carries ``choices[i].text``, a chat chunk ``choices[i].delta`` (the first one
``{"role": "assistant", "content": ""}``, then ``{"content": ...}``); the last chunk of a
choice has its ``finish_reason`` and ``stop_reason``. With ``stream_options.include_usage`` a
chunk with no choices and the usage counts (and the per-request speculative-decoding stats,
when the server reports them) comes before ``[DONE]``. Text deltas come from
:class:`~infer.detokenize.IncrementalText`, so they concatenate to the non-streaming text.
An engine failure mid-stream is sent as an ``{"error": ...}`` event, as vLLM does.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from infer.detokenize import IncrementalText
from infer.serve.engine_loop import TokenUpdate
from infer.serve.generation import Job, ServedModel, spec_metrics, updates, usage
from infer.serve.protocol import ApiError


def event(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def stream(job: Job, served: ServedModel, include_usage: bool) -> AsyncIterator[str]:
    """The SSE events of one job (see the module docstring)."""
    tokenizer = served.llm.tokenizer
    texts = [IncrementalText(tokenizer, r.params.stop) for r in job.requests]
    finals: dict[int, TokenUpdate] = {}
    if job.kind == "chat":
        for index in range(len(job.requests)):
            yield event(_chunk(job, index, {"delta": {"role": "assistant", "content": ""}}))
    async for index, update in updates(served.loop, job.requests):
        if update.finish_reason == "error":
            yield event(ApiError(update.error or "engine failure", None, 500,
                                 "InternalServerError").body())
            return
        done = update.finish_reason is not None
        delta = texts[index].delta(update.token_ids, update.stop_reason, final=done)
        if done:
            finals[index] = update
        elif not delta:
            continue  # nothing printable yet (a held-back character)
        body = ({"delta": {"content": delta} if delta or not done else {}}
                if job.kind == "chat" else {"text": delta})
        finish = {"finish_reason": update.finish_reason,
                  "stop_reason": update.stop_reason} if done else {"finish_reason": None}
        yield event(_chunk(job, index, {**body, "logprobs": None, **finish}))
    if include_usage:  # per-request stats ride on the final usage chunk, as in vLLM
        yield event(_envelope(job, [], usage=usage(job, finals), **spec_metrics(job, served)))
    yield "data: [DONE]\n\n"


def _chunk(job: Job, index: int, choice: dict[str, Any]) -> dict[str, Any]:
    return _envelope(job, [{"index": index, **choice}])


def _envelope(job: Job, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
    return {"id": job.id, "object": obj, "created": job.created, "model": job.model,
            "choices": choices, **extra}
