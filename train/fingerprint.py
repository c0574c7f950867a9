"""Stale-state checks: a cached or resumable result is used only by a run with the same inputs.

Three things in training are kept on disk and picked up by a rerun: the offline feature cache
(``train/features.py``), regenerated answers (``train/regenerate.py``) and checkpoints
(``train/checkpoint.py``). Each records a fingerprint, a flat JSON mapping of everything its
content depends on, and each rerun compares it with its own through ``check``, which names the
thing, every differing key with both values, and the way out.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable, Mapping

from infer.foundation.errors import ConfigError


def digest(fingerprint: Mapping[str, Any], length: int = 16) -> str:
    """A short stable hash of a fingerprint (key order does not matter)."""
    text = json.dumps(fingerprint, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def differences(saved: Mapping[str, Any], current: Mapping[str, Any],
                keys: Iterable[str] | None = None, ignore: Iterable[str] = ()) -> list[str]:
    """Keys (of ``keys``, default both mappings') whose values differ, sorted."""
    skip = set(ignore)
    keys = sorted(set(saved) | set(current)) if keys is None else list(keys)
    return [k for k in keys if k not in skip and saved.get(k) != current.get(k)]


def check(saved: Mapping[str, Any], current: Mapping[str, Any], *, subject: str, held: str,
          remedy: str, keys: Iterable[str] | None = None, ignore: Iterable[str] = (),
          error: type[Exception] = ConfigError) -> None:
    """Raise ``error`` when ``saved`` (what ``subject`` was built with) and ``current`` (this
    run) differ, e.g. "feature cache X was built for a different 'dtype': cache has 'float32',
    this run has 'bfloat16'. Delete X ..." (``held`` says who has the saved value: "cache
    has"). A user error by default: the user chose settings that differ from the saved ones."""
    diff = differences(saved, current, keys, ignore)
    if not diff:
        return
    parts = [f"{k!r}: {held} {saved.get(k)!r}, this run has {current.get(k)!r}"
             for k in diff[:8]]
    more = f" (and {len(diff) - 8} more)" if len(diff) > 8 else ""
    raise error(f"{subject} was built for a different {'; and a different '.join(parts)}{more}. "
                f"{remedy}")
