"""The OpenAI request bodies the server accepts, as vLLM implements them, and how they become
engine requests.

Bodies are pydantic models that forbid unknown fields: vLLM 0.32 logs and ignores a field it
does not know, so a misspelt ``temprature`` silently samples at 1.0; here it is a 400 naming
the field. Pydantic checks types only; values are checked once, by ``SamplingParams`` and the
engine's own request checks (``infer/request.py``), whose errors name the key
(``ConfigError.key``) that becomes the error's ``param``.

OpenAI fields that draftsmith does not implement (logprobs, penalties, logit_bias, echo,
suffix, n > 1, tools) are accepted at their "off" value and refused otherwise, by name.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from infer.foundation.errors import ConfigError
from infer.sampling_params import SamplingParams

_OFF = (None, False, 0, 0.0, {}, [])


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    """A last chunk with the usage counts (and no choices) before ``data: [DONE]``."""
    continuous_usage_stats: bool = False
    """vLLM: usage counts in every chunk."""


class SampledRequest(BaseModel):
    """Fields both endpoints share (OpenAI's, then vLLM's extra sampling fields)."""

    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_tokens: int = 0
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None

    unsupported: ClassVar[tuple[str, ...]] = ("frequency_penalty", "presence_penalty",
                                              "logit_bias")

    def check_supported(self) -> None:
        """Refuse, by name, an OpenAI field set to something draftsmith does not implement."""
        for name in self.unsupported:
            value = getattr(self, name)
            if value not in _OFF:
                raise ApiError(f"'{name}' is not supported by draftsmith's server (got "
                               f"{value!r}); leave it unset", name)
        if self.n != 1:
            raise ApiError(f"'n' must be 1 (one completion per prompt); got {self.n}", "n")

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The request's SamplingParams; an invalid value is a 400 naming its field."""
        given = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                 "min_tokens": self.min_tokens, "seed": self.seed, "stop": self.stop or [],
                 "stop_token_ids": self.stop_token_ids or [], "ignore_eos": self.ignore_eos}
        try:
            return SamplingParams(max_tokens=max_tokens,
                                  **{k: v for k, v in given.items() if v is not None})
        except ConfigError as e:
            raise ApiError(str(e), e.key) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SampledRequest):
    """``POST /v1/completions``."""

    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = 16
    echo: bool = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None

    unsupported: ClassVar[tuple[str, ...]] = SampledRequest.unsupported + ("echo", "logprobs",
                                                                     "suffix")

    def prompts(self) -> list[Union[str, list[int]]]:
        """One entry per choice: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ApiError("'prompt' is empty; expected a string, token ids or a list of them",
                           "prompt")
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template reads it (text parts joined, as vLLM does)."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        out = {"role": self.role, "content": content or ""}
        return out | ({"name": self.name} if self.name else {})


class ChatCompletionRequest(SampledRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    response_format: Optional[dict[str, Any]] = None

    unsupported: ClassVar[tuple[str, ...]] = SampledRequest.unsupported + (
        "logprobs", "top_logprobs", "tools", "tool_choice")

    def check_supported(self) -> None:
        super().check_supported()
        if self.response_format not in (None, {"type": "text"}):
            raise ApiError("'response_format' other than {\"type\": \"text\"} is not supported "
                           "by draftsmith's server", "response_format")

    @property
    def requested_max_tokens(self) -> int | None:
        """OpenAI's new name first; None: the rest of the context (vLLM's default)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens
