"""Native MTP's settings (train/objectives/mtp.py): one layer started from the target's last,
exported stitched into the target (MiMo's layout); its loss is the unroll's cross-entropy."""

from __future__ import annotations

from dataclasses import dataclass

from train.methods.base import METHODS, DrafterConfig, UnrollConfig, method_field


@dataclass
class MTPObjectiveConfig(UnrollConfig):
    """The unroll (FastMTP: one shared layer, weights step_weight ** s)."""


@METHODS.register("mtp")
@dataclass
class MTPDrafterConfig(DrafterConfig):
    """The target's own MTP layer."""

    method: str = method_field("mtp")

    objective_config = MTPObjectiveConfig
