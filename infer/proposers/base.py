"""The proposer interface and registry.

A proposer drafts up to k tokens per running request; the engine verifies them with one target
forward. Methods register by name (``@PROPOSERS.register("ngram")``) and the engine looks them
up from ``speculative_config.method``, so nothing outside this package branches on a method
string.

Contract with the engine, in order:

- ``feature_spec()`` once, before the first target forward: which target states the proposer
  reads (aux residual streams; the last hidden state always comes with the output). The engine
  requests exactly those in its prefill and verify forwards.
- per request: ``start(slot, prompt_ids)`` when it takes a cache slot; ``prefilled(...)`` with
  the prompt forward's :class:`~infer.models.output.ModelOutput`; ``propose(batch)`` every step;
  ``observe(step)`` after verification (accepted tokens and the verify forward's output as
  ``VerifiedStep.target_output``); ``finish(slot)`` when the request ends.

Token histories are passed as Python lists: the CPU proposers (n-gram, suffix) work on them
directly; model-based proposers keep their own tensors and KV caches.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from infer.models.llama import Llama, ModelConfig
from infer.models.output import FeatureSpec, ModelOutput
from infer.foundation.registry import Registry
from infer.sampling import BatchGenerator, Generator
from infer.spec_config import SpeculativeConfig
from infer.foundation.validation import config_error


@dataclass
class ProposerContext:
    """What the engine hands a proposer at construction."""

    target: Llama  # for heads that share its embedding / lm_head
    target_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_num_seqs: int
    max_model_len: int
    vocab_size: int
    static_steps: bool = False  # model steps in fixed shapes, CUDA graphs on CUDA (infer/graphs)
    tokenizer: Any = None  # the target's (None: token ids only), for drafts with another one


@dataclass
class DraftBatch:
    """One step's running requests, in the order of the engine's batch rows."""

    slots: list[int]  # cache row of each request
    token_ids: list[list[int]]  # prompt + generated so far (the last one not yet in the KV cache)
    k: int  # drafts wanted per request
    # the requests' sampling settings, for proposers that sample or return draft_probs: a
    # scalar when every row shares it (infer/step.py plan_step), else [batch]
    temperature: torch.Tensor | float | None = None
    top_k: torch.Tensor | None = None  # [batch]
    top_p: torch.Tensor | None = None  # [batch]
    generator: Generator = None  # per-row streams for seeded requests (BatchGenerator)

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
    # [batch, k, S] each draft's next-best tokens (``draft_tree_siblings`` = S), or None
    sibling_ids: torch.Tensor | None = None
    # [batch, k] the drafter's top probability at each draft (adaptive verification), or None
    confidence: torch.Tensor | None = None


@dataclass
class VerifiedStep:
    """What verification decided, handed back to the proposer (``observe``)."""

    slots: list[int]
    num_accepted: list[int]  # accepted drafts per request
    new_tokens: list[list[int]]  # tokens appended to each request this step (accepted + final)
    target_output: ModelOutput  # the verify forward's; position j of row i is the target's
    # state after [pending, d_1..d_j] (aux streams as the proposer's feature_spec asked)


class Proposer(ABC):
    """Base class: override ``propose``; the hooks default to no-ops."""

    name: ClassVar[str] = ""  # the method it is registered as
    #: whether the proposer drafts probabilities usable by ``probabilistic`` rejection
    provides_draft_probs: bool = False
    #: what it does with ``parallel_drafting``: False = chains only (the flag is refused), True
    #: = one forward per step whatever the flag, None = both (it reads the flag itself)
    parallel_drafting: ClassVar[bool | None] = False

    def __init__(self, spec: SpeculativeConfig, ctx: ProposerContext) -> None:
        self.spec = spec
        self.ctx = ctx

    def confidence(self, logits: torch.Tensor) -> torch.Tensor | None:
        """``top_probability`` of the drafter's ``logits [B, n, V]`` when the engine verifies
        adaptively (``enable_adaptive_verification``), else None (nothing computed)."""
        return top_probability(logits) if self.spec.enable_adaptive_verification else None

    def feature_spec(self) -> FeatureSpec:
        """What the proposer reads from the target's outputs (the engine asks once, before its
        first forward); nothing by default."""
        return FeatureSpec()

    def start(self, slot: int, prompt_ids: list[int]) -> None:
        """A request took ``slot`` (its prompt is already prefilled in the target's cache)."""

    def prefilled(self, slots: list[int], num_tokens: list[int],
                  target_output: ModelOutput) -> None:
        """Target outputs of the prompts just prefilled: row i is ``slots[i]`` with
        ``num_tokens[i]`` valid positions of ``target_output.hidden`` ``[B, T, H]`` and of each
        ``target_output.aux`` entry (in ``feature_spec().aux_layer_ids`` order)."""

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


PROPOSERS: Registry[type[Proposer]] = Registry(
    "infer.proposers", "method", "speculative_config",
    allowed="a method this engine serves: {names}")


def proposer_class(spec: SpeculativeConfig) -> type[Proposer]:
    """The proposer serving ``spec``: ``METHOD/parallel`` when parallel drafting is on and such a
    proposer is registered (P-EAGLE is ``eagle3/parallel``), else ``METHOD``; a method whose
    proposer cannot draft in parallel refuses the flag instead of silently drafting chains."""
    parallel = f"{spec.method}/parallel"
    if spec.parallel_drafting and parallel in PROPOSERS.names():
        return PROPOSERS.get(parallel)
    cls = PROPOSERS.get(spec.method)
    if spec.parallel_drafting and cls.parallel_drafting is False:
        served = [n.removesuffix("/parallel") for n in PROPOSERS.names()
                  if n.endswith("/parallel") or PROPOSERS.get(n).parallel_drafting is not False]
        raise config_error("parallel_drafting", True, "false for method "
                           f"{spec.method!r}: this engine drafts in parallel with "
                           f"{', '.join(sorted(set(served)))} (P-EAGLE: eagle3 with a peagle "
                           "checkpoint; PARD: draft_model)", "speculative_config")
    return cls


def check_head_fits(where: str, ids_key: str, aux_ids, vocab_size: int, target_hidden: int,
                    ctx: ProposerContext) -> None:
    """A feature-fed head (EAGLE-3, P-EAGLE, DFlash) against the target it is served with:
    aux layer ids inside ``[0, num_layers]``, the target's vocabulary and hidden size; each
    mismatch is one error naming the checkpoint key (``where``: the drafter and its path)."""
    n, target = ctx.target_config.num_layers, ctx.target_config
    if any(not 0 <= k <= n for k in aux_ids):
        raise config_error(ids_key, list(aux_ids), f"ids in [0, {n}] for this {n}-layer target",
                           where)
    if vocab_size != ctx.vocab_size:
        raise config_error("transformer_layer_config.vocab_size", vocab_size,
                           f"the target's vocab_size ({ctx.vocab_size})", where)
    if target_hidden != target.hidden_size:
        raise config_error("target_hidden_size", target_hidden,
                           f"the target's hidden_size ({target.hidden_size})", where)


def aux_features(target_output: ModelOutput, want: tuple[int, ...], method: str) -> torch.Tensor:
    """The aux residual streams a feature-fed head asked for, concatenated in sorted id order:
    ``[B, T, n_aux * H_t]``; a clear error when the engine did not capture them."""
    aux = tuple(target_output.aux)
    if len(aux) != len(want):
        raise RuntimeError(f"{method} needs the target's aux hidden states {list(want)} but the "
                           f"target output carries {len(aux)}; the engine must request "
                           "proposer.feature_spec().aux_layer_ids in the prefill and verify "
                           "forwards")
    return torch.cat(aux, dim=-1)


def pad_drafts(drafts: list[list[int]], k: int, device: torch.device) -> torch.Tensor:
    """Lists of up to k token ids -> ``[batch, w]`` long with -1 padding, ``w`` the longest
    draft (0 when none drafted). The verify forward runs over ``w + 1`` tokens, so a step where
    a lookup proposer found nothing costs one autoregressive step, not a ``k + 1``-token
    forward (as in vLLM, whose ragged batches carry no padding)."""
    width = max((min(len(ids), k) for ids in drafts), default=0)
    out = torch.full((len(drafts), width), -1, dtype=torch.long)
    for row, ids in enumerate(drafts):
        ids = ids[:k]
        if ids:
            out[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out.to(device)


def joined(confidences: list[torch.Tensor | None]) -> torch.Tensor | None:
    """Per-step confidences ``[B, 1]`` of a chain as ``[B, k]``; None when none were asked."""
    return torch.cat(confidences, dim=1) if confidences[0] is not None else None


def top_probability(logits: torch.Tensor) -> torch.Tensor:
    """The drafter's probability of its most likely token, ``logits [..., V] -> [...]``: how
    adaptive verification (infer/adaptive.py) ranks a draft's chance to survive."""
    return logits.float().softmax(dim=-1).amax(dim=-1)
