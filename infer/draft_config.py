"""What a drafter checkpoint's ``config.json`` says: where it is, its drafter type and method.

Read as plain JSON (no remote code): all the ``speculative_config`` schema needs to infer the
method and k of a drafter, and what the exporters and loaders check a checkpoint against.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infer.foundation.errors import MissingFileError
from infer.foundation.files import read_json

# checkpoint types that are a variant of a method: (method, parallel_drafting). P-EAGLE is an
# EAGLE-3 head drafting in parallel.
VARIANTS = {"peagle": ("eagle3", True)}
_WHERE = "speculative_config"


def draft_config_path(model: str) -> Path | None:
    """The config.json of a local draft (a directory or the file itself); None for a hub id."""
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
        return path if path.is_file() else None
    return path if path.is_file() and path.suffix == ".json" else None


def cached_config_path(model: str) -> Path | None:
    """The config.json of a hub id already in the local Hugging Face cache (no network), the
    way the target loader finds it; None when it is not there."""
    from infer.models.loader import resolve_model_dir  # lazy: parsing needs no torch

    try:
        path = resolve_model_dir(model) / "config.json"
    except MissingFileError:
        return None
    return path if path.is_file() else None


def read_draft_config(path: Path | str) -> dict[str, Any]:
    """Plain JSON, no remote code: all the schema needs to infer the method and k."""
    return read_json(path, what=f"{_WHERE}.model's config")


def checkpoint_type(draft: dict[str, Any]) -> str | None:
    """The drafter type a config.json declares (speculators type, MLP speculator), if any:
    ``peagle`` stays ``peagle`` here (:func:`checkpoint_method` maps it to its method)."""
    kind = draft.get("speculators_model_type")
    if kind is None and draft.get("model_type") in ("mlp_speculator", "medusa"):
        kind = draft["model_type"]
    return kind


def checkpoint_method(draft: dict[str, Any]) -> str | None:
    """The method a drafter's config.json declares, if any (``peagle`` -> ``eagle3``, whose
    parallel-drafting variant it is, as vLLM maps it)."""
    kind = checkpoint_type(draft)
    return VARIANTS[kind][0] if kind in VARIANTS else kind
