"""Reading the files users point at, with one clear error naming the file.

A truncated download, a half-copied checkpoint or a hand-edited ``config.json`` otherwise ends in
``SafetensorError: invalid header length`` or ``JSONDecodeError: Expecting value: line 1``,
naming neither the file nor the fix. Every JSON and safetensors file draftsmith reads for a model,
a drafter or a cache goes through here: a file that cannot be used raises
:class:`~infer.foundation.errors.FileFormatError` (what is wrong with which file), a missing one
:class:`~infer.foundation.errors.MissingFileError`; both are user errors (one line, exit status 2).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from infer.foundation.errors import FileFormatError, MissingFileError


def read_json(path: str | Path, *, required: Iterable[str] = (), what: str = "") -> dict:
    """The JSON object in ``path``; ``required`` keys must be present. ``what`` says what the
    file is for (e.g. "the target's config") in the messages."""
    path = Path(path)
    label = f"{path} ({what})" if what else str(path)
    if not path.is_file():
        raise MissingFileError(f"{label} does not exist")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise FileFormatError(f"{label} is not a text (JSON) file") from None
    except json.JSONDecodeError as e:
        raise FileFormatError(f"{label} is not valid JSON ({e.msg} at line {e.lineno}, "
                              f"column {e.colno}); a truncated or hand-edited file?") from None
    if not isinstance(obj, dict):
        raise FileFormatError(f"{label} holds a JSON {type(obj).__name__}; expected a JSON "
                              "object ({...})")
    missing = [k for k in required if k not in obj]
    if missing:
        raise FileFormatError(f"{label} lacks required key(s) {', '.join(map(repr, missing))}")
    return obj


@contextmanager
def open_safetensors(path: str | Path) -> Iterator[Any]:
    """``safetensors.safe_open`` (torch tensors, on CPU) with a broken file named and explained.
    The header and the length of the data are checked when the file is opened, so a truncated
    file fails here, not halfway through a load."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path} does not exist")
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except SafetensorError as e:
        raise FileFormatError(
            f"{path} is not a readable safetensors file ({_reason(e)}): truncated or corrupt; "
            "copy, download or export it again") from None
    with handle as f:
        yield f


def _reason(error: Exception) -> str:
    text = str(error)
    return text.removeprefix("Error while deserializing header: ")


def read_safetensors(path: str | Path, names: Iterable[str] | None = None) -> dict[str, Any]:
    """``{name: tensor}`` of ``path`` (the ``names`` given, else all), on CPU."""
    with open_safetensors(path) as f:
        present = set(f.keys())
        keys = sorted(present) if names is None else list(names)
        missing = [k for k in keys if k not in present]
        if missing:
            raise FileFormatError(f"{path} lacks tensor(s) {missing[:8]}")
        return {k: f.get_tensor(k) for k in keys}


def check_tensors(where: str | Path, expected: Mapping[str, Any], found: Mapping[str, Any],
                  hint: str = "") -> None:
    """The checkpoint at ``where`` has exactly the ``expected`` tensor names, each with the
    expected shape (a config.json that disagrees with its weights, or weights of another model,
    is reported here rather than as a state_dict error from deep inside torch). Values are
    tensors or shapes."""
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        raise FileFormatError(f"checkpoint {where}: missing weights {missing[:8]}, unexpected "
                              f"weights {unexpected[:8]}{hint}")
    def shape(v) -> tuple[int, ...]:
        return tuple(getattr(v, "shape", v))

    wrong = [f"{k} is {shape(found[k])}, expected {shape(expected[k])}"
             for k in expected if shape(found[k]) != shape(expected[k])]
    if wrong:
        raise FileFormatError(f"checkpoint {where}: weights do not match its config.json: "
                              f"{'; '.join(wrong[:4])}{hint}")


#: The files a tokenizer (and its chat template) may be saved as: what a derived or exported
#: model folder copies from the one whose tokenizer it shares.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json")


def has_tokenizer(path: str | Path) -> bool:
    p = Path(path)
    return (p / "tokenizer.json").is_file() or (p / "tokenizer_config.json").is_file()


def load_tokenizer(path: str | Path, *, required: bool = True, key: str = "tokenizer") -> Any:
    """``AutoTokenizer.from_pretrained(path)`` (local files, no remote code), or None when the
    directory has no tokenizer and ``required`` is False (token-id prompts only). A directory
    without one, or a tokenizer file transformers cannot read, is a user error naming it."""
    p = Path(path)
    if not has_tokenizer(p):
        if not required:
            return None
        raise MissingFileError(f"{key}={str(path)!r}: no tokenizer there (expected "
                               "tokenizer.json or tokenizer_config.json)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(p))
    except Exception as e:  # transformers / tokenizers raise many types for a broken file
        raise FileFormatError(f"{key}={str(path)!r}: the tokenizer in {p} cannot be loaded "
                              f"({type(e).__name__}: {str(e)[:300]})") from e
