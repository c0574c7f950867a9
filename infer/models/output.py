"""What a target forward returns, and what a drafter asks of it.

Hidden-state index semantics (``aux_layer_ids``, the EAGLE-3 / vLLM convention): id ``k`` is the
residual stream after ``k`` decoder layers, ``0`` = the token embeddings and ``N = num_layers`` =
the output of the last layer *before* the final norm. Hugging Face's ``output_hidden_states``
agrees for ``k < N``, but its last entry (``hidden_states[N]``) is *after* the final norm: that is
``ModelOutput.hidden`` here, the last hidden state EAGLE-1 and the MLP speculator use.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class ModelOutput:
    """What a forward returns (see the module doc for the hidden-state index semantics)."""

    logits: Tensor  # [B, T, V], or [B, K, V] when logits_at [B, K] was given
    hidden: Tensor  # [B, T, H] last hidden state after the final norm (= HF hidden_states[-1])
    aux: tuple[Tensor, ...] = ()  # one [B, T, H] per aux_layer_ids entry, in the order asked


@dataclass(frozen=True)
class FeatureSpec:
    """What a drafter needs from the frozen target besides its logits, declared once and read
    by whoever runs the target: the engine (``Proposer.feature_spec``, before the first forward)
    and training (``Objective.feature_spec``: online capture or the offline cache)."""

    aux_layer_ids: tuple[int, ...] = ()  # residual streams, sorted id order (-> ModelOutput.aux)
    hidden: bool = False  # the last hidden state after the final norm (-> ModelOutput.hidden;
    # the engine's outputs always carry it, training computes it only when asked)

    @property
    def needs_target(self) -> bool:
        return bool(self.aux_layer_ids) or self.hidden
