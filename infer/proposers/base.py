"""The proposer interface and registry.

A proposer drafts up to k tokens per running request; the engine verifies them with one target
forward. Methods register by name (``@register("ngram")``) and the engine looks them up from
``speculative_config.method``, so nothing outside this package branches on a method string.

Lifecycle per request: ``start(slot, prompt_ids)`` when it takes a cache slot, ``propose(batch)``
every step, ``observe(step)`` after verification (accepted tokens, target outputs), ``finish(slot)``
when the request ends. Token histories are passed as Python lists: the CPU proposers (n-gram,
suffix) work on them directly; model-based proposers keep their own tensors and KV caches.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from infer.sampling import BatchGenerator, Generator
from infer.spec_config import SpeculativeConfig


@dataclass
class ProposerContext:
    """What the engine hands a proposer at construction."""

    target: Any  # infer.models.llama.Llama (for heads that share its embedding / lm_head)
    target_config: Any  # infer.models.llama.ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_num_seqs: int
    max_model_len: int
    vocab_size: int
    static_steps: bool = False  # model steps in fixed shapes, CUDA graphs on CUDA (infer/graphs)


@dataclass
class DraftBatch:
    """One step's running requests, in the order of the engine's batch rows."""

    slots: list[int]  # cache row of each request
    token_ids: list[list[int]]  # prompt + generated so far (the last one not yet in the KV cache)
    k: int  # drafts wanted per request
    temperature: torch.Tensor | None = None  # [batch] the requests' sampling settings, for
    top_k: torch.Tensor | None = None  # [batch]   proposers that sample or return draft_probs
    top_p: torch.Tensor | None = None  # [batch]
    generator: Generator = None  # per-row streams for seeded requests (BatchGenerator)
    extras: dict[str, Any] = field(default_factory=dict)  # e.g. target hidden states for EAGLE

    def select(self, rows: list[int]) -> "DraftBatch":
        """The sub-batch of ``rows`` (e.g. the requests that can still draft): every per-row
        field follows, the seeded rows' generators included."""
        def pick(t):
            if isinstance(t, torch.Tensor) and t.ndim:
                return t[torch.tensor(rows, dtype=torch.long, device=t.device)]
            return t

        generator = self.generator
        if isinstance(generator, BatchGenerator):
            generator = generator.select(rows)
        return replace(self, slots=[self.slots[i] for i in rows],
                       token_ids=[self.token_ids[i] for i in rows],
                       temperature=pick(self.temperature), top_k=pick(self.top_k),
                       top_p=pick(self.top_p), generator=generator)


@dataclass
class Proposal:
    """Drafts for a batch: ``draft_ids`` ``[batch, k]`` long with a -1 suffix where a request
    drafted fewer; ``draft_probs`` ``[batch, k, vocab]`` (for ``probabilistic``) or None."""

    draft_ids: torch.Tensor
    draft_probs: torch.Tensor | None = None


@dataclass
class VerifiedStep:
    """What verification decided, handed back to the proposer (``observe``)."""

    slots: list[int]
    num_accepted: list[int]  # accepted drafts per request
    new_tokens: list[list[int]]  # tokens appended to each request this step (accepted + final)
    extras: dict[str, Any] = field(default_factory=dict)  # "target_output": the verify forward's
    # ModelOutput; its position j of row i is the target's state after [pending, d_1..d_j]


class Proposer(ABC):
    """Base class: override ``propose``; the hooks default to no-ops."""

    #: whether the proposer drafts probabilities usable by ``probabilistic`` rejection
    provides_draft_probs: bool = False
    #: target residual streams the proposer needs (REFERENCE section 4 numbering: 0 = embeddings,
    #: N = last layer before the final norm); the engine requests them in prefill and verify
    #: forwards and hands the ``ModelOutput`` to ``prefilled`` / ``observe``
    aux_layer_ids: tuple[int, ...] = ()

    def __init__(self, spec: SpeculativeConfig, ctx: ProposerContext) -> None:
        self.spec = spec
        self.ctx = ctx

    def start(self, slot: int, prompt_ids: list[int]) -> None:
        """A request took ``slot`` (its prompt is already prefilled in the target's cache)."""

    def prefilled(self, slots: list[int], num_tokens: list[int], target_output: Any) -> None:
        """Target outputs of the prompts just prefilled: row i is ``slots[i]`` with
        ``num_tokens[i]`` valid positions of ``target_output.hidden`` ``[B, T, H]`` and of each
        ``target_output.aux`` entry (in ``aux_layer_ids`` order)."""

    @abstractmethod
    def propose(self, batch: DraftBatch) -> Proposal:
        """Draft up to ``batch.k`` tokens per request."""

    def observe(self, step: VerifiedStep) -> None:
        """Verification result for the requests of the last ``propose``."""

    def finish(self, slot: int) -> None:
        """The request in ``slot`` ended; free its state."""

    def reset(self) -> None:
        """Forget what finished requests taught (state shared across requests, e.g. suffix
        decoding's global tree), so that timed runs of the same prompts start alike."""


_REGISTRY: dict[str, type[Proposer]] = {}


def register(name: str) -> Callable[[type[Proposer]], type[Proposer]]:
    """Class decorator: make a proposer available as ``speculative_config.method == name``."""

    def wrap(cls: type[Proposer]) -> type[Proposer]:
        if name in _REGISTRY:
            raise ValueError(f"proposer {name!r} is registered twice")
        _REGISTRY[name] = cls
        return cls

    return wrap


def get_proposer_class(method: str) -> type[Proposer]:
    """The class registered for ``method``; a clear error lists the ones this engine serves."""
    _import_builtin_proposers()
    if method not in _REGISTRY:
        raise ValueError(f"speculative_config: invalid value for 'method': {method!r}; this engine "
                         f"serves: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[method]


def pad_drafts(drafts: list[list[int]], k: int, device: torch.device) -> torch.Tensor:
    """Lists of up to k token ids -> ``[batch, k]`` long with -1 padding."""
    out = torch.full((len(drafts), k), -1, dtype=torch.long)
    for row, ids in enumerate(drafts):
        ids = ids[:k]
        if ids:
            out[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out.to(device)


def _import_builtin_proposers() -> None:
    """Import the proposer modules so their ``@register`` decorators run."""
    import importlib
    import pkgutil

    import infer.proposers as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name != "base":
            importlib.import_module(f"infer.proposers.{info.name}")
