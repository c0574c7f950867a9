"""Target model implementations (Llama family) and Hugging Face checkpoint loading."""

from infer.models.attention import packed_causal_mask, position_mask
from infer.models.llama import Llama, ModelConfig
from infer.models.loader import (
    SUPPORTED_ARCHITECTURES,
    config_from_hf,
    load_config,
    load_model,
)
from infer.models.output import FeatureSpec, ModelOutput
from infer.models.rope import RopeConfig

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "FeatureSpec",
    "Llama",
    "ModelConfig",
    "ModelOutput",
    "RopeConfig",
    "config_from_hf",
    "load_config",
    "load_model",
    "packed_causal_mask",
    "position_mask",
]
