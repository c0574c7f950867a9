"""The settings reference ``python train.py --help`` / ``python infer.py --help`` print.

Every field of the typed configs (``train/config.py``, ``infer/config.py``) carries an attribute
docstring (the string literal right after it). Python keeps no such docstrings at run time, so
they are read from the class's source with ``ast``; ``schema_help`` renders one line per key
(``section.key: default -- doc``, with the allowed values of enum fields), and
``register_help_resolver`` makes it available to Hydra's help template as
``${draftsmith_schema:NAME}`` (conf/train.yaml, conf/infer.yaml).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from enum import Enum
from typing import Any, Callable

RESOLVER = "draftsmith_schema"
_SCHEMAS: dict[str, Callable[[], str]] = {}  # resolver argument -> its text


def field_docs(cls: type) -> dict[str, str]:
    """``{field name: its attribute docstring}`` of a dataclass, inherited fields included (a
    subclass that re-declares a field without a docstring keeps its base's); fields without
    one are absent."""
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        docs.update(_own_docs(klass))
    return docs


def _own_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def schema_help(schema: Any, prefix: str = "") -> str:
    """One line per setting of a config dataclass or instance (its values as the defaults);
    nested sections are flattened as ``a.b``."""
    cls = schema if isinstance(schema, type) else type(schema)
    docs, hints, lines = field_docs(cls), typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        default = _default(f) if isinstance(schema, type) else getattr(schema, f.name)
        if dataclasses.is_dataclass(default):
            lines.append(f"{key}: {docs.get(f.name, '')}")
            lines.append(schema_help(default, f"{key}."))
            continue
        enum = next((t for t in (hints[f.name], *typing.get_args(hints[f.name]))
                     if isinstance(t, type) and issubclass(t, Enum)), None)
        choices = f" ({' | '.join(str(c.value) for c in enum)})" if enum else ""
        value = default.value if isinstance(default, Enum) else default
        lines.append(f"{key}: {value!r}{choices} -- {docs.get(f.name, '')}")
    return "\n".join(lines)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def register_help_resolver(name: str, schema: type,
                           extra: Callable[[], str] | None = None) -> None:
    """``${draftsmith_schema:NAME}`` renders ``schema_help(schema)``, then ``extra()`` if given
    (idempotent)."""
    from omegaconf import OmegaConf

    _SCHEMAS[name] = lambda: schema_help(schema) + (extra() if extra else "")
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, lambda key: _SCHEMAS[key]())
