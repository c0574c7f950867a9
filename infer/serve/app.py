"""The FastAPI application: vLLM's OpenAI-compatible routes over a :class:`ServedModel`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true``),
``GET /v1/models``, ``GET /health`` (200, or 503 once the engine loop has died),
``GET /metrics`` (Prometheus text). Errors are OpenAI-shaped bodies
(``{"error": {"message", "type", "param", "code"}}``): 400 for a malformed body, an unknown
field, a wrong type or value, a prompt too long, 404 for another model's name, 500 if the
engine fails.

A client that goes away is noticed by a task that waits for the ASGI disconnect message; it
aborts the job's unfinished requests, which frees their KV slots at the next step (streaming
or not, and also while a request still waits for a slot).
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from infer.serve.generation import Job, ServedModel, chat_job, completion_job, respond
from infer.serve.protocol import (ApiError, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                  StreamOptions, TextPart)
from infer.serve.streaming import stream


def build_app(served: ServedModel) -> FastAPI:
    app = FastAPI(title="draftsmith", description="OpenAI-compatible server on draftsmith's "
                  "speculative-decoding engine")
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    created = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if served.loop.alive else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": served.name, "object": "model", "created": created,
                "owned_by": "draftsmith", "root": served.llm.target.path,
                "max_model_len": served.llm.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(served.loop.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest) -> Response:
        return await _run(completion_job(body, served), served, http, body.stream,
                          body.include_usage)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, http: HttpRequest) -> Response:
        return await _run(chat_job(body, served), served, http, body.stream, body.include_usage)

    return app


async def _run(job: Job, served: ServedModel, http: HttpRequest, streamed: bool,
               include_usage: bool) -> Response:
    if not served.loop.alive:  # before a stream's 200 goes out
        raise ApiError("the engine has stopped after a failure (see the server's log); "
                       "restart the server", None, 503, "ServiceUnavailableError")
    if not streamed:
        async with _abort_on_disconnect(http, job, served):
            return JSONResponse(await respond(job, served))

    async def events() -> AsyncIterator[str]:
        async with _abort_on_disconnect(http, job, served):
            async for e in stream(job, served, include_usage):
                yield e

    return StreamingResponse(events(), media_type="text/event-stream")


@asynccontextmanager
async def _abort_on_disconnect(http: HttpRequest, job: Job, served: ServedModel):
    """While the body runs, a client disconnect aborts the job's requests."""
    async def watch() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass
        for request in job.requests:
            served.loop.abort(request)

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()


async def _api_error(_: HttpRequest, error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def _validation_error(_: HttpRequest, error: RequestValidationError) -> JSONResponse:
    """pydantic's complaint about one field as a 400 naming it (``messages.0.role``); a union
    field (``prompt``) lists what each accepted type said."""
    errors = error.errors()
    first = errors[0]
    param = _field_path(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        message, param = f"malformed JSON body: {first.get('ctx', {}).get('error', '')}", None
    elif first.get("type") == "missing" and not param:
        message = "the request body is missing; expected a JSON object"
    elif first.get("type") == "extra_forbidden":  # the unknown name is the location's end
        param = ".".join(str(p) for p in first["loc"][1:])
        message = f"unknown field '{param}': not a field draftsmith's server accepts"
    else:
        said = [e.get("msg", "invalid") for e in errors if _field_path(e.get("loc", ())) == param]
        value = json.dumps(first.get("input"), default=str)[:200]
        message = f"invalid value for '{param}': {value}; {' or '.join(dict.fromkeys(said))}"
    return JSONResponse(ApiError(message, param).body(), status_code=400)


_FIELDS = {name for model in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart,
                              StreamOptions) for name in model.model_fields}


def _field_path(loc) -> str | None:
    """``("body", "prompt", "list[int]", 0)`` -> ``"prompt"``: the field names and list
    indices of pydantic's location, without "body" and union-member tags."""
    parts = []
    for part in list(loc)[1:]:
        if not (isinstance(part, int) or part in _FIELDS):
            break
        parts.append(str(part))
    return ".".join(parts) or None
