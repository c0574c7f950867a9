"""Typed training configuration, registered in Hydra's ConfigStore.

YAML in ``conf/`` and ``recipes/`` only states values; the schema lives here, so a misspelt key
fails at compose time with the key named (Hydra's structured-config check) instead of being
silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore


@dataclass
class TargetConfig:
    """The frozen target. ``path`` None means the embedded tiny target (built if missing)."""

    path: str | None = None
    dtype: str = "auto"


@dataclass
class DataConfig:
    """Training data. ``source`` None means the embedded default dataset (stdlib code)."""

    source: str | None = None
    format: str | None = None  # auto-detected from the columns when None
    split: str = "train"
    max_length: int = 512
    num_examples: int = 2000  # embedded default dataset size / cap on other sources
    num_proc: int = 1
    seed: int = 0
    pack: bool = True


@dataclass
class TrainConfig:
    """Top-level config of ``python train.py``."""

    recipe: str = "tiny_eagle3"
    output_dir: str = "outputs"
    seed: int = 0
    draft_vocab_size: int = 1024
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)


def register_configs() -> None:
    """Make the schema available to Hydra as ``train_schema`` (used by conf/train.yaml)."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
