"""Reading a dataset from wherever a user keeps it: the one reader behind training data
(``train/data.py``) and evaluation prompts (``infer/eval/prompt_sets.py``).

``load_source(source, split, subset=)`` returns a ``datasets.Dataset`` from

- a ``save_to_disk`` folder (has ``state.json`` or ``dataset_dict.json``): ``load_from_disk``
  (``split`` picks from a DatasetDict);
- a folder of .json / .jsonl / .parquet / .arrow / .csv files: ``load_dataset(folder)``
  (datasets infers the splits from the file names; no split names -> all files are ``train``);
- one such file (a single file is one split; ``split`` is ignored). A .json file holds a list
  of records, JSON Lines, or an object whose ``split`` / ``data`` / ``rows`` / ``examples`` /
  ``train`` key holds the list of records;
- ``draftsmith:NAME``: a prompt set draftsmith builds itself (``infer/eval/chat_prompts.py``:
  ``chat-train``, ``chat-heldout``);
- anything else that does not exist locally and does not look like a path: a Hugging Face Hub id
  (``split``, ``subset``; needs the network or a populated cache).

Chat turns in the ShareGPT spelling (``from`` / ``value``, roles ``human`` / ``gpt`` ...) map to
OpenAI roles through ``ROLES``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from infer.foundation.errors import FileFormatError, MissingFileError

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow",
                 ".csv": "csv"}
RECORD_LIST_KEYS = ("data", "rows", "examples", "train")  # after the split's own name
BUILTIN_PREFIX = "draftsmith:"  # draftsmith:chat-train, draftsmith:chat-heldout
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "chatgpt": "assistant", "model": "assistant", "system": "system"}


def load_source(source: str | Path, split: str = "train", *, subset: str | None = None,
                cache_dir: str | None = None) -> Any:
    """The dataset at ``source`` (see the module doc) as a ``datasets.Dataset``."""
    import datasets

    text = str(source)
    if text.startswith(BUILTIN_PREFIX):
        return _load_builtin(text)
    path = Path(text).expanduser()
    if path.is_dir():
        return _load_folder(path, split, subset, cache_dir)
    if path.is_file():
        return _load_file(path, split, cache_dir)
    if text.startswith((".", "/", "~")) or path.suffix in FILE_BUILDERS:
        raise MissingFileError(f"dataset path {text!r} does not exist")
    try:
        return datasets.load_dataset(text, subset, split=split, cache_dir=cache_dir)
    except Exception as e:  # noqa: BLE001 - re-raised with the source named
        raise FileFormatError(f"{text!r} is not a local path and could not be loaded as a Hub "
                         f"dataset (split={split!r}): {type(e).__name__}: {e}") from e


def _load_builtin(text: str) -> Any:
    """A prompt set that draftsmith builds itself (infer/eval/chat_prompts.py)."""
    import datasets

    from infer.eval.chat_prompts import BUILTIN_SETS

    name = text[len(BUILTIN_PREFIX):]
    if name not in BUILTIN_SETS:
        raise MissingFileError(f"dataset {text!r}: no such built-in set; built-in sets are "
                               f"{', '.join(BUILTIN_PREFIX + k for k in BUILTIN_SETS)}")
    return datasets.Dataset.from_list(BUILTIN_SETS[name]())


def _load_folder(path: Path, split: str, subset: str | None, cache_dir: str | None) -> Any:
    import datasets

    if (path / "state.json").exists() or (path / "dataset_dict.json").exists():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise FileFormatError(f"dataset {str(path)!r} has splits {sorted(loaded)}; "
                                 f"split={split!r} is not one of them")
            loaded = loaded[split]
        return loaded
    if not any(p.suffix in FILE_BUILDERS for p in path.rglob("*")):
        raise FileFormatError(f"dataset folder {str(path)!r} holds no {_supported()} files and is not "
                         "a save_to_disk folder")
    return datasets.load_dataset(str(path), subset, split=split, cache_dir=cache_dir)


def _load_file(path: Path, split: str, cache_dir: str | None) -> Any:
    import datasets

    builder = FILE_BUILDERS.get(path.suffix)
    if builder is None:
        raise FileFormatError(f"dataset file {str(path)!r} has an unsupported extension "
                         f"{path.suffix!r}; expected {_supported()} or a folder")
    kwargs = {}
    if path.suffix == ".json":
        key = _record_list_key(path, split)
        if key is not None:
            kwargs["field"] = key
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train",
                                     cache_dir=cache_dir, **kwargs)
    except Exception as e:  # noqa: BLE001 - name the file and, for jsonl, the bad line
        if path.suffix == ".jsonl":
            _check_jsonl(path)
        raise FileFormatError(f"{path}: could not be read as {builder} ({type(e).__name__}: "
                         f"{e})") from e


def _record_list_key(path: Path, split: str) -> str | None:
    """The key of a .json object that holds the list of records (None: the file is a list of
    records or JSON Lines)."""
    with open(path, encoding="utf-8") as f:
        head = f.read(4096).lstrip()
    if not head.startswith("{"):
        return None
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None  # JSON Lines under a .json name: the datasets builder reads those
    for key in (split, *RECORD_LIST_KEYS):
        value = obj.get(key)
        if isinstance(value, list) and value and isinstance(value[0], dict):
            return key
    raise FileFormatError(f"{path}: expected a list of records or an object with a "
                     f"{', '.join(repr(k) for k in (split, *RECORD_LIST_KEYS))} list of records; "
                     f"got an object with keys {sorted(obj)[:8]}")


def _check_jsonl(path: Path) -> None:
    """Raise naming the first line of ``path`` that is not a JSON object."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except json.JSONDecodeError as e:
                raise FileFormatError(f"{path}:{n}: not valid JSON ({e})") from None


def _supported() -> str:
    return "/".join(sorted(FILE_BUILDERS))
