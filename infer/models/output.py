"""What a target forward returns, and what a drafter asks of it.

Hidden-state index semantics (``aux_layer_ids``, the EAGLE-3 / vLLM convention): id ``k`` is the
residual stream after ``k`` decoder layers, ``0`` = the token embeddings and ``N = num_layers`` =
the output of the last layer *before* the final norm. Hugging Face's ``output_hidden_states``
agrees for ``k < N``, but its last entry (``hidden_states[N]``) is *after* the final norm: that is
``ModelOutput.hidden`` here, the last hidden state EAGLE-1 and the MLP speculator use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class ModelOutput:
    """What a forward returns (see the module doc for the hidden-state index semantics)."""

    logits: Tensor  # [B, T, V], or [B, K, V] when logits_at [B, K] was given
    hidden: Tensor  # [B, T, H] last hidden state after the final norm (= HF hidden_states[-1])
    aux: tuple[Tensor, ...] = ()  # one [B, T, H] per aux_layer_ids entry, in the order asked


def pad_outputs(outs: list[ModelOutput]) -> ModelOutput:
    """One :class:`ModelOutput` for several of one row each (a grouped forward's prompts,
    ``[1, T_i, .]``), right-padded to the longest: ``[n, max T_i, .]`` (logits ``[n, K, V]``,
    equal K). What a padded prefill forward of the same rows would return, padding aside."""
    if len(outs) == 1:
        return outs[0]

    def pad(parts: list[Tensor]) -> Tensor:
        out = parts[0].new_zeros(len(parts), max(p.shape[1] for p in parts), parts[0].shape[-1])
        for i, p in enumerate(parts):
            out[i, : p.shape[1]] = p[0]
        return out  # [n, T, H]

    aux = tuple(pad([o.aux[i] for o in outs]) for i in range(len(outs[0].aux)))
    return ModelOutput(torch.cat([o.logits for o in outs]), pad([o.hidden for o in outs]), aux)


@dataclass(frozen=True)
class FeatureSpec:
    """What a drafter needs from the frozen target besides its logits, declared once and read
    by whoever runs the target: the engine (``Proposer.feature_spec``, before the first forward)
    and training (``Objective.feature_spec``: online capture or the offline cache)."""

    aux_layer_ids: tuple[int, ...] = ()  # residual streams, sorted id order (-> ModelOutput.aux)
    hidden: bool = False  # the last hidden state after the final norm (-> ModelOutput.hidden;
    # the engine's outputs always carry it, training computes it only when asked)
    greedy: bool = False  # training: the target's greedy next token at every position (the
    # argmax of its logits, which the engine has anyway), for drafters scored against it

    @property
    def needs_target(self) -> bool:
        return bool(self.aux_layer_ids) or self.hidden or self.greedy
