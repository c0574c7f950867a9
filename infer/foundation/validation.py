"""Shared validation helpers: every config error names the key, the value and what is allowed.

Imported by ``train/`` as well as ``infer/``, so it stays free of torch and of the engine.
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Any, Callable, Iterable, Mapping, TypeVar

from infer.foundation.errors import ConfigError


def config_error(key: str, value: Any, allowed: str, where: str = "") -> ConfigError:
    """Build the one error format used by every config class in draftsmith (a ``ValueError``
    that the entry points report without a traceback, exit status 2)."""
    prefix = f"{where}: " if where else ""
    if isinstance(value, Enum):  # a config enum member: show the value the user wrote
        value = value.value
    return ConfigError(f"{prefix}invalid value for {key!r}: {value!r}; expected {allowed}", key)


def reject_unknown_keys(keys: Iterable[str], known: Iterable[str], where: str,
                        hints: dict[str, str] | None = None) -> None:
    """Raise for the first key not in ``known``; ``hints`` maps a key to a targeted message."""
    known = sorted(known)
    for key in keys:
        if key in known:
            continue
        if hints and key in hints:
            raise ConfigError(f"{where}: key {key!r} is not allowed here; {hints[key]}", key)
        raise ConfigError(f"{where}: unknown key {key!r}; allowed keys: {', '.join(known)}",
                          key)


def check_int(key: str, value: Any, where: str, *, minimum: int | None = None,
              optional: bool = False, maximum: int | None = None) -> None:
    """Integers only (bool is not an int here); optional allows None."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise config_error(key, value, "an integer" + (" or None" if optional else ""), where)
    too_low = minimum is not None and value < minimum
    if too_low or (maximum is not None and value > maximum):
        allowed = (f"an integer >= {minimum}" if maximum is None else
                   f"an integer <= {maximum}" if minimum is None else
                   f"an integer in [{minimum}, {maximum}]")
        raise config_error(key, value, allowed, where)


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


def check_choice(key: str, value: Any, choices: type[C], where: str, *,
                 optional: bool = False) -> C | None:
    """``value`` as a member of ``choices`` (configs built in Python skip OmegaConf's check)."""
    if value is None and optional:
        return None
    try:
        return choices(value)
    except ValueError:
        allowed = " | ".join(str(c.value) for c in choices) + (" or None" if optional else "")
        raise config_error(key, value, f"one of {allowed}", where) from None


def check_bool(key: str, value: Any, where: str, *, optional: bool = False) -> None:
    """true or false (0 and 1 are not); optional allows None."""
    if not (isinstance(value, bool) or (value is None and optional)):
        raise config_error(key, value, "true or false" + (" or None" if optional else ""), where)


def check_str(key: str, value: Any, where: str, *, optional: bool = False) -> None:
    """A non-empty string (a path, a name, a hub id); optional allows None."""
    if not ((isinstance(value, str) and value) or (value is None and optional)):
        raise config_error(key, value, "a non-empty string" + (" or None" if optional else ""),
                           where)


def check_list(key: str, values: Any, where: str, *, item: Callable[..., Any],
               optional: bool = False) -> None:
    """A non-empty list whose items each pass ``item`` (``check_int`` with its bounds bound by
    ``functools.partial`` ...), named ``key[i]``: ``eval.ks=[0]`` is refused as ``eval.ks[0]``."""
    if values is None and optional:
        return
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise config_error(key, values, "a list" + (" or None" if optional else ""), where)
    values = list(values)
    if not values:
        raise config_error(key, values, "a non-empty list", where)
    for i, value in enumerate(values):
        item(f"{key}[{i}]", value, where=where)


def setting(default: Any = dataclasses.MISSING, check: Callable[..., Any] | None = None, *,
            factory: Callable[[], Any] | None = None, resume: bool = False) -> Any:
    """A config dataclass field declared with its rule: ``check(key, value, where=...)`` is how
    ``check_fields`` validates it, and ``resume`` says a resumed training run must have the same
    value (train/checkpoint.py). One declaration per setting, so no table beside the class has
    to be kept in step with it. ``factory``: a mutable default (``dataclasses.field``'s)."""
    if check is None:
        raise TypeError("setting(): every field needs its check")
    meta = {"check": check, "resume": resume}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def check_fields(obj: Any, prefix: str, where: str) -> None:
    """Every field of the config dataclass ``obj`` through its ``setting`` rule, called as
    ``rule(f"{prefix}.{name}", value, where=where)``. A field without a rule is a bug in the
    config class (its values would go unchecked until they fail deep in a run), so it raises."""
    for f in dataclasses.fields(obj):
        rule = f.metadata.get("check")
        if rule is None:
            raise RuntimeError(f"{type(obj).__name__}.{f.name}: no validation rule (setting())")
        rule(f"{prefix}.{f.name}" if prefix else f.name, getattr(obj, f.name), where=where)


def check_section(key: str, value: Any, where: str) -> None:
    """The rule of a nested config section: its own fields, named ``key.field``."""
    check_fields(value, key, where)
