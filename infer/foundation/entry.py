"""What ``train.py`` and ``infer.py`` share around Hydra: user errors reported in one line with
exit status 2, bugs with their traceback, and vLLM's JSON accepted as users paste it.

Hydra reports every failure with exit status 1, a bad override in a compact message and an
error raised by the run under a (trimmed) traceback. Users cannot tell a typo from a crash by
the exit status, and a one-line "invalid value for 'eval.ks'" should not sit under a stack
trace. So:

- :func:`prepare_argv` rewrites a JSON object or list on the command line (vLLM's documented
  ``--speculative-config '{"method": "ngram", ...}'``, pasted as
  ``speculative_config='{"method": "ngram", ...}'``) into Hydra's grammar, which rejects quoted
  keys; then it composes the config once (``check_overrides``) so that a misspelt key, a bad
  enum value or a type error is reported in one line with status 2 before Hydra starts.
- :func:`user_errors` wraps the run: a :class:`~infer.foundation.errors.UserError` prints
  ``prog: error: message`` and exits 2; :class:`~infer.foundation.errors.Interrupted` (SIGINT /
  SIGTERM
  after saving) prints its message and exits 128 + signal; any other exception keeps Hydra's
  traceback. ``HYDRA_FULL_ERROR=1`` re-raises everything, tracebacks included, for debugging.
"""

from __future__ import annotations

import json
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from infer.foundation.errors import Interrupted, UserError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
USER_ERROR_STATUS = 2
_HYDRA_PREFIXES = ("hydra.", "hydra/", "+hydra", "++hydra", "~hydra")


def _debugging() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def fail(prog: str, message: str) -> None:
    """Print ``prog: error: message`` on stderr and exit with status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(USER_ERROR_STATUS)


@contextmanager
def user_errors(prog: str) -> Iterator[None]:
    """Run the body; user errors and interruptions end in one line and a status, bugs raise."""
    try:
        yield
    except UserError as e:
        if _debugging():
            raise
        fail(prog, str(e))
    except Interrupted as e:
        print(f"{prog}: {e}", file=sys.stderr)
        raise SystemExit(e.exit_status) from None
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


def hydra_value(value: Any) -> str:
    """A JSON value in Hydra's override grammar (strings quoted, so any character survives)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {hydra_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, str):  # Hydra: \ is literal unless it runs into a quote or the end
        doubled = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, value)
        return "'" + doubled.replace("'", "\\'") + "'"
    if value is None:
        return "null"
    return json.dumps(value)  # numbers, true / false


def json_override(arg: str) -> str:
    """``key={"a": 1}`` -> ``key={a: 1}``; anything that is not a JSON object or list with
    quoted strings in it (plain Hydra syntax) is returned unchanged."""
    key, sep, value = arg.partition("=")
    if not sep or not value.lstrip().startswith(("{", "[")) or '"' not in value:
        return arg
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return arg
    bad = [k for k in _keys(parsed) if not k.replace("_", "a").isalnum() or k[:1].isdigit()]
    if bad:
        return arg  # not a key Hydra can spell unquoted: let Hydra report it
    return f"{key}={hydra_value(parsed)}"


def _keys(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [str(k) for k in value] + [k for v in value.values() for k in _keys(v)]
    if isinstance(value, list):
        return [k for v in value for k in _keys(v)]
    return []


def check_overrides(config_name: str, overrides: Sequence[str], prog: str,
                    explain: Callable[[str], str] | None = None) -> None:
    """Compose ``config_name`` with ``overrides`` once; a composition error exits 2 with
    Hydra's message (through ``explain``, which may add what the program knows about it).
    Hydra's own flags (``--help``, ``-m`` ...) are left to Hydra."""
    if _debugging() or any(a.startswith("-") for a in overrides):
        return
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    mine = [a for a in overrides if not a.startswith(_HYDRA_PREFIXES)]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose(config_name=config_name, overrides=mine)
    except (HydraException, OmegaConfBaseException) as e:
        cause = e.__cause__ if isinstance(e.__cause__, OmegaConfBaseException) else None
        message = _one_message(e, cause)
        fail(prog, explain(message) if explain else message)
    extra = unknown_keys(cfg)
    if extra:
        fail(prog, f"unknown key(s) {', '.join(extra)}: not settings of {prog} (see "
                   f"python {prog} --help); '+' cannot add a setting")


def unknown_keys(node: Any, path: str = "") -> list[str]:
    """Keys of typed (dataclass) nodes that their dataclass lacks: Hydra's ``+key=value``
    attaches them, and the run would silently ignore them (a ``+trainer.lrr=1`` typo)."""
    from dataclasses import fields, is_dataclass

    from omegaconf import DictConfig, OmegaConf

    out = []
    kind = OmegaConf.get_type(node)
    if is_dataclass(kind):
        known = {f.name for f in fields(kind)}
        out += [f"{path}{k}" for k in node.keys() if k not in known]
    for k in node.keys():
        child = node._get_node(k)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            out += unknown_keys(child, f"{path}{k}.")
    return out


def _one_message(error: Exception, cause: Exception | None) -> str:
    """Hydra's message and its OmegaConf cause, without the repeated object-type lines."""
    lines = [str(error).strip()] + ([str(cause).strip()] if cause else [])
    text = "\n".join(lines)
    keep = [ln for ln in text.splitlines()
            if ln.strip() and not ln.strip().startswith(
                ("object_type=", "reference_type=", "To append to your config use"))]
    return "\n  ".join(dict.fromkeys(keep))


def prepare_argv(config_name: str, prog: str,
                 explain: Callable[[str], str] | None = None) -> None:
    """Before ``hydra.main``: JSON values rewritten in ``sys.argv``, then the overrides checked
    (``explain``: as ``check_overrides``)."""
    sys.argv[1:] = [json_override(a) for a in sys.argv[1:]]
    check_overrides(config_name, sys.argv[1:], prog, explain)
