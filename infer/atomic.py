"""Atomic writes: a reader (a vLLM server, a resumed run, a teammate) never sees half a file.

What draftsmith writes for later use goes through here: results and reports, drafter
checkpoints and exports, the feature cache's shards, regenerated data, the tiny target's build
(the trainer's own checkpoint folder, which every rank writes into, is renamed into place with
``replace_dir`` by train/checkpoint.py). The pattern
is always the same: write to a temporary name beside the destination (same file system, so the
final ``os.replace`` is a rename), then move it into place; on any error the temporary is
removed. Temporaries are made with the process's umask (not ``tempfile``'s 0600 / 0700), so what
lands is readable by whoever may read the destination's directory.

- :func:`atomic_file` / :func:`write_text`: one file.
- :func:`atomic_dir`: a directory filled in a fresh temporary one; a new destination appears in
  one rename, an existing one is either swapped out whole (renamed aside, then deleted) or, with
  ``merge``, updated file by file in the given order (others left alone).
- :func:`remove_leftovers`: the temporaries of writes that were killed midway.
"""

from __future__ import annotations

import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence


def temp_path(dest: str | os.PathLike, kind: str = "tmp") -> Path:
    """A unique hidden sibling of ``dest``: ``.<name>.<kind>-<pid>-<random>``."""
    dest = Path(dest)
    return dest.with_name(f".{dest.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a temporary path to write; on success it replaces ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """``path`` holds ``text`` (UTF-8), written atomically."""
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


@contextmanager
def atomic_dir(dest: str | os.PathLike, merge: Sequence[str] | None = None) -> Iterator[Path]:
    """Yields a fresh empty directory to fill; on success it becomes ``dest``.

    Without ``merge`` an existing ``dest`` is replaced whole. With ``merge`` (file names, in the
    order to move them) an existing ``dest`` keeps its other files and receives these one by
    one, each atomically (put the file that marks completeness, e.g. ``config.json``, last).
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(dest)
    tmp.mkdir()
    try:
        yield tmp
        if merge is not None and dest.is_dir():
            for name in merge:
                os.replace(tmp / name, dest / name)
        else:
            replace_dir(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(src: str | os.PathLike, dest: str | os.PathLike) -> None:
    """``src`` takes the place of ``dest``: readers see the old directory or the new one, never a
    mix (``rename`` cannot replace a non-empty directory, so the old one is moved aside first)."""
    src, dest = Path(src), Path(dest)
    if not (dest.exists() or dest.is_symlink()):
        os.replace(src, dest)
        return
    old = temp_path(dest, "old")
    os.replace(dest, old)
    os.replace(src, dest)
    shutil.rmtree(old, ignore_errors=True)


def remove_leftovers(dest: str | os.PathLike) -> list[Path]:
    """Delete the temporaries that killed writes of ``dest`` left beside it; returns them."""
    dest = Path(dest)
    found = [*dest.parent.glob(f".{dest.name}.tmp-*"), *dest.parent.glob(f".{dest.name}.old-*")]
    for p in found:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return found
