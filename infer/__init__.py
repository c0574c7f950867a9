"""draftsmith inference: everything a trained drafter checkpoint needs at run time."""

from infer.engine import LLM
from infer.rejection import rejection_sample
from infer.sampling import SamplingParams
from infer.spec_config import SpeculativeConfig

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "rejection_sample"]
