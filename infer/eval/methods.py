"""The evaluation's method list (``eval.methods``): one check, run when the config is validated
and again when the harness builds its matrix from it, and one place that completes
``draft_model`` entries without a ``model`` with the draft LM paired with the target.

An entry is a vLLM ``speculative_config`` mapping without k (k comes from the ks list), with an
optional ``name`` (its label in reports; default the method, which must then be unique) and
optional ``ks`` / ``temperatures`` / ``batch_sizes`` of its own in place of the matrix's (a
baseline row that needs one k only; a draft tree, which applies to greedy batch-1 steps only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from infer.foundation.errors import ConfigError
from infer.foundation.validation import check_float, check_int, check_list, config_error

_K = partial(check_int, minimum=1)  # a num_speculative_tokens value
#: a method's own lists in place of the matrix's, and how their items are checked
OWN_LISTS = {"ks": _K, "temperatures": partial(check_float, low=0.0), "batch_sizes": _K}


@dataclass(frozen=True)
class MethodEntry:
    """One checked entry: its label, its speculative_config without k, and its own lists
    (None: the matrix's)."""

    label: str
    spec: dict[str, Any]
    ks: list[int] | None = None
    temperatures: list[float] | None = None
    batch_sizes: list[int] | None = None


def check_methods(key: str, methods: Any, where: str, ks_key: str = "eval.ks"
                  ) -> list[MethodEntry]:
    """Every entry checked (a mapping, no k, its own lists, SpeculativeConfig-valid, labels
    unique), named ``key[i]``; a ``draft_model`` without a ``model`` is checked for shape only
    (:func:`with_paired_draft` completes it)."""
    if isinstance(methods, (str, Mapping)) or not isinstance(methods, Sequence):
        raise config_error(key, methods, "a list of speculative_config mappings", where)
    entries = [_entry(f"{key}[{i}]", m, where, ks_key) for i, m in enumerate(methods)]
    labels = [e.label for e in entries]
    dupes = sorted({n for n in labels if labels.count(n) > 1})
    if dupes:
        raise config_error(key, labels, f"unique labels; give each of {dupes} a 'name'", where)
    return entries


def _entry(key: str, m: Any, where: str, ks_key: str) -> MethodEntry:
    from infer.spec_config import SpeculativeConfig

    if not isinstance(m, Mapping):
        raise config_error(key, m, "a speculative_config mapping", where)
    if "num_speculative_tokens" in m:
        raise config_error(f"{key}.num_speculative_tokens", m["num_speculative_tokens"],
                           f"no value: k comes from {ks_key}", where)
    for name, item in OWN_LISTS.items():
        check_list(f"{key}.{name}", m.get(name), where, item=item, optional=True)
    own = [list(m[name]) if m.get(name) is not None else None for name in OWN_LISTS]
    spec = {k: v for k, v in m.items() if k not in ("name", *OWN_LISTS)}
    label = m.get("name") or spec.get("method")
    if not (spec.get("method") == "draft_model" and not spec.get("model")):
        try:  # the method inferred from the draft when omitted
            parsed = SpeculativeConfig.parse({**spec, "num_speculative_tokens": 1})
        except ConfigError as err:
            raise ConfigError(f"{where}: {key}: {err}") from None
        label = label or parsed.method
    return MethodEntry(str(label), spec, *own)


def with_paired_draft(methods: Sequence[Mapping[str, Any]], draft: str | Path | None
                      ) -> list[dict[str, Any]]:
    """``draft_model`` entries without a ``model`` get ``draft``, the draft LM paired with the
    target (the embedded tiny draft; a named real target's derived one); without one they are
    left out with a note instead of failing the evaluation."""
    out, dropped = [], False
    for m in methods:
        m = dict(m)
        if m.get("method") == "draft_model" and not m.get("model"):
            if draft is None:
                dropped = True
                continue
            m["model"] = str(draft)
        out.append(m)
    if dropped:
        print("eval: no draft LM is paired with this target; the draft_model row is skipped "
              "(give eval.methods a draft_model entry with a model)")
    return out
