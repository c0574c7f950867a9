"""The loaded target: model, tokenizer, stop ids, device and context length.

Loading a target is the expensive part of an engine, and everything else an engine holds (KV
cache, proposer, metrics, seed, running requests) belongs to one run. Keeping the two apart lets
the harness and training's in-loop evaluation run many configurations on one loaded target:
``LLM(target, speculative_config=...)`` accepts a :class:`Target` in place of a path, and
``LLM.with_config`` is exactly that. The target is only read after loading.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from infer.foundation.files import load_tokenizer
from infer.models.llama import Llama
from infer.models.loader import DTYPES, load_model
from infer.foundation.validation import config_error

_WHERE = "LLM"


@dataclass(frozen=True)
class Target:
    """A loaded target model and what comes with it; shared read-only by engines."""

    path: str  # the model directory it was loaded from
    model: Llama
    tokenizer: Any  # transformers tokenizer, or None (token-id prompts only)
    eos_ids: frozenset[int]  # the config's EOS ids and the tokenizer's
    device: torch.device
    max_model_len: int

    @classmethod
    def load(cls, path: str, *, dtype: str = "auto", device: str = "auto",
             max_model_len: int | None = None, tokenizer: str | None = None) -> "Target":
        """Load ``path`` (dtype "auto": the checkpoint's on CUDA, float32 on CPU, where bf16
        matmuls are slow); ``max_model_len`` None: the model's, at most 4096."""
        dtype = str(dtype)  # a config enum member -> its value
        if dtype != "auto" and dtype not in DTYPES:
            raise config_error("dtype", dtype, f"'auto' or one of {', '.join(DTYPES)}", _WHERE)
        dev = resolve_device(device)
        model = load_model(path, dtype=_resolve_dtype(dtype, dev), device=dev)
        return cls.wrap(path, model, max_model_len=max_model_len, tokenizer=tokenizer)

    @classmethod
    def wrap(cls, path: str, model: Llama, *, max_model_len: int | None = None,
             tokenizer: str | None = None) -> "Target":
        """A model already in memory (a training run's frozen target) as an engine's target,
        shared, not copied; ``path`` gives its tokenizer and names it."""
        cfg = model.config
        limit = context_limit(cfg.max_position_embeddings, max_model_len)
        tok = load_tokenizer(tokenizer or path, required=tokenizer is not None)
        device = next(model.parameters()).device
        return cls(str(path), model, tok, eos_ids(cfg, tok), device, limit)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size


@dataclass(frozen=True)
class TargetTokens:
    """What turning prompts into requests needs of a target (``make_requests``): its tokenizer,
    vocabulary, stop ids and context length, without its weights. The harness on vLLM
    (``eval.engine=vllm``) tokenizes with it exactly as the engine would, also for targets the
    engine does not run (any architecture transformers describes: ``target_config``)."""

    path: str
    tokenizer: Any
    eos_ids: frozenset[int]
    vocab_size: int
    max_model_len: int
    device: torch.device = torch.device("cpu")  # where a seeded request's generator lives

    @classmethod
    def load(cls, path: str, *, max_model_len: int | None = None,
             config=None) -> "TargetTokens":
        """``config``: the target's (``target_config``), when the caller has read it already."""
        from infer.models.foreign import target_config

        cfg = config or target_config(path)
        tok = load_tokenizer(path, required=False)
        return cls(str(path), tok, eos_ids(cfg, tok), cfg.vocab_size,
                   context_limit(cfg.max_position_embeddings, max_model_len))


def context_limit(max_positions: int, max_model_len: int | None) -> int:
    """``max_model_len``, at most the model's positions; None: the model's, at most 4096 (a
    KV cache for 128k positions would not fit where a user did not ask for it)."""
    limit = max_model_len or min(max_positions, 4096)
    if limit > max_positions:
        raise config_error("max_model_len", max_model_len,
                           f"<= the model's max_position_embeddings ({max_positions})", _WHERE)
    return limit


def resolve_device(device: str) -> torch.device:
    """"auto" -> CUDA when visible, else CPU; "cuda[:N]" refused without CUDA."""
    if not (device == "auto" or str(device).split(":")[0] in ("cpu", "cuda")):
        raise config_error("device", device, "'auto', 'cpu', 'cuda' or 'cuda:N'", _WHERE)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise config_error("device", device, "'cpu' or 'auto' (no CUDA device is visible)", _WHERE)
    return torch.device(device)


def _resolve_dtype(dtype: str, device: torch.device) -> str | torch.dtype:
    if dtype == "auto":
        return "auto" if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


def eos_ids(config, tokenizer) -> frozenset[int]:
    """The config's EOS ids and the tokenizer's EOS id (when it has a tokenizer and one): a
    target's stop tokens, collected the same way wherever a target is described."""
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    return frozenset(config.eos_token_ids) | (frozenset() if eos is None else frozenset([eos]))
