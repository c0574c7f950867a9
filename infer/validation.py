"""Shared validation helpers: every config error names the key, the value and what is allowed.

Imported by ``train/`` as well as ``infer/``, so it stays free of torch and of the engine.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Iterable, TypeVar


def config_error(key: str, value: Any, allowed: str, where: str = "") -> ValueError:
    """Build the one error format used by every config class in draftsmith."""
    prefix = f"{where}: " if where else ""
    if isinstance(value, Enum):  # a config enum member: show the value the user wrote
        value = value.value
    return ValueError(f"{prefix}invalid value for {key!r}: {value!r}; expected {allowed}")


def reject_unknown_keys(keys: Iterable[str], known: Iterable[str], where: str,
                        hints: dict[str, str] | None = None) -> None:
    """Raise for the first key not in ``known``; ``hints`` maps a key to a targeted message."""
    known = sorted(known)
    for key in keys:
        if key in known:
            continue
        if hints and key in hints:
            raise ValueError(f"{where}: key {key!r} is not allowed here; {hints[key]}")
        raise ValueError(f"{where}: unknown key {key!r}; allowed keys: {', '.join(known)}")


def check_int(key: str, value: Any, where: str, *, minimum: int | None = None,
              optional: bool = False) -> None:
    """Integers only (bool is not an int here); optional allows None."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise config_error(key, value, "an integer" + (" or None" if optional else ""), where)
    if minimum is not None and value < minimum:
        raise config_error(key, value, f"an integer >= {minimum}", where)


def check_float(key: str, value: Any, where: str, *, low: float | None = None,
                high: float | None = None, low_open: bool = False, optional: bool = False) -> None:
    """Real numbers (ints accepted) within [low, high] (or (low, high] when low_open)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise config_error(key, value, "a number" + (" or None" if optional else ""), where)
    lo_ok = low is None or (value > low if low_open else value >= low)
    hi_ok = high is None or value <= high
    if not (lo_ok and hi_ok):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise config_error(key, value, f"a number in {'(' if low_open else '['}{lo}, {hi}]", where)


class StrChoice(str, Enum):
    """A config field with a fixed set of string values: Hydra / OmegaConf reject any other
    value at compose time, listing the allowed ones. Members compare equal to their strings
    and format as them (``f"{Schedule.cosine}" == "cosine"``)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


C = TypeVar("C", bound=StrChoice)


def check_choice(key: str, value: Any, choices: type[C], where: str) -> C:
    """``value`` as a member of ``choices`` (configs built in Python skip OmegaConf's check)."""
    try:
        return choices(value)
    except ValueError:
        allowed = " | ".join(str(c.value) for c in choices)
        raise config_error(key, value, f"one of {allowed}", where) from None
