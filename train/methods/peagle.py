"""P-EAGLE's settings (train/objectives/peagle.py): EAGLE-3's head drafting k tokens in one
forward. Its embedding is always its own (the mask token's row is learned), so it has no
``embed_requires_grad``; and no unroll, so no ``ttt_steps``."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

from train.methods.base import (METHODS, CodConfig, DistillConfig, NoiseConfig, method_field,
                                opt_nonneg, pinned, positive_int, weight)
from train.methods.eagle3 import Eagle3DrafterConfig, Eagle3HeadConfig, Eagle3ObjectiveConfig


@dataclass
class PEagleObjectiveConfig(CodConfig, NoiseConfig, DistillConfig):
    """The depth layout (COD over the chains) and its loss."""

    parallel_depths: int = pinned(8, positive_int)
    """Drafts per forward trained (depths; the most a server may ask for)."""
    max_anchors: int = pinned(512, positive_int)
    """At most this many anchors (chains) per packed row."""
    argmax_weight: float = pinned(0.0, weight)
    """Cross-entropy on the target's greedy token (where the draft vocabulary has it), on top
    of the distillation loss: what a greedy draft must match."""

    def as_eagle3(self) -> Eagle3ObjectiveConfig:
        """EAGLE-3's objective settings that build the head P-EAGLE starts as."""
        return Eagle3ObjectiveConfig(**_shared(self, Eagle3ObjectiveConfig))


@METHODS.register("peagle")
@dataclass
class PEagleDrafterConfig(Eagle3HeadConfig):
    """A P-EAGLE head (speculators' peagle format)."""

    method: str = method_field("peagle")
    mask_token_id: Optional[int] = pinned(None, opt_nonneg)
    """The mask token; None: picked automatically (an id never seen as a target)."""

    objective_config = PEagleObjectiveConfig

    def as_eagle3(self, **changes: Any) -> Eagle3DrafterConfig:
        """The EAGLE-3 head these settings describe, with ``changes``."""
        return Eagle3DrafterConfig(**{**_shared(self, Eagle3DrafterConfig), **changes})


def _shared(settings: Any, cls: type) -> dict[str, Any]:
    names = {f.name for f in fields(cls)} - {"method"}
    return {f.name: getattr(settings, f.name) for f in fields(settings) if f.name in names}
