"""draftsmith inference: everything a trained drafter checkpoint needs at run time.

``from infer import LLM, SamplingParams, SpeculativeConfig, rejection_sample`` is the public API.
The names are resolved on first use (PEP 562), so importing a light helper such as
``infer.foundation.validation`` or ``infer.foundation.atomic`` (as ``train/`` does) does not load
torch and the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {"LLM": "infer.engine", "SamplingParams": "infer.sampling_params",
            "SpeculativeConfig": "infer.spec_config", "rejection_sample": "infer.rejection"}
__all__ = ["LLM", "SamplingParams", "SpeculativeConfig", "rejection_sample"]

if TYPE_CHECKING:  # for type checkers and IDEs only
    from infer.engine import LLM
    from infer.rejection import rejection_sample
    from infer.sampling_params import SamplingParams
    from infer.spec_config import SpeculativeConfig


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'infer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
