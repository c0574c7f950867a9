"""Atomic writes: a reader (a vLLM server, a resumed run, a teammate) never sees half a file.

What draftsmith writes for later use goes through here: results and reports, drafter
checkpoints and exports, the feature cache's shards, regenerated data, the tiny target's build
(the trainer's own checkpoint folder, which every rank writes into, is renamed into place with
``replace_dir`` by train/checkpoint.py). The pattern
is always the same: write to a temporary name beside the destination (same file system, so the
final ``os.replace`` is a rename), then move it into place; on any error the temporary is
removed. What lands gets the permissions of the process's umask (not ``tempfile``'s 0600 / 0700,
which some writers inside use: ``umask_modes``), so it is readable by whoever may read the
destination's directory.

- :func:`atomic_file` / :func:`write_text`: one file.
- :func:`atomic_dir`: a directory filled in a fresh temporary one; a new destination appears in
  one rename, an existing one is either swapped out whole (renamed aside, then deleted) or, with
  ``merge``, updated file by file in the given order (others left alone).
- :func:`remove_leftovers`: the temporaries of writes that were killed midway (SIGKILL, power
  loss: no ``finally`` ran). The next run deletes those of its own destinations before writing
  them, each where no other writer of that run can be active: the feature cache (rank 0, before
  the ranks start, train/features.py), regeneration and the prepared data (main process first,
  the other ranks only read afterwards), exports and drafter checkpoints (their only writer),
  eval reports and ``infer.py output=`` (one process), the tiny target (under its lock); the
  trainer's checkpoint temporaries are cleared by train/checkpoint.py's ``remove_temporaries``
  when a stage starts. Two separate jobs writing the same folder at once are covered on one
  host by the pid check in :func:`remove_leftovers`, not across hosts.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence


_TEMP_NAME = re.compile(r"\.(?:tmp|old)-(\d+)-[0-9a-f]{8}$")
_WRITING: set[Path] = set()  # temporaries this process is writing now


def _in_use(path: Path) -> bool:
    """Whether ``path`` (a temporary) may still be written: by this process now, or by the live
    process whose pid it carries. This pid in a name outside ``_WRITING`` is a killed earlier
    process's (containers reuse the same pids run after run)."""
    if path in _WRITING:
        return True
    pid = int(_TEMP_NAME.search(path.name).group(1))
    if pid == os.getpid():
        return False
    if os.name == "nt":  # no harmless liveness probe there (os.kill would terminate it)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's live process; an absurd pid: leave it
    return True


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (setting it to read
    it back would briefly affect files other threads create)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def umask_modes(path: str | os.PathLike) -> None:
    """Give ``path`` (a file, or a directory and everything in it) the permissions a plain
    ``open`` / ``mkdir`` would under the umask: libraries that write through ``tempfile``
    (recent safetensors' ``save_file``, hence ``save_pretrained`` and accelerate's
    ``save_state``) leave 0600 files that a vLLM server or a teammate cannot read."""
    mask, path = current_umask(), Path(path)
    files, dirs = 0o666 & ~mask, 0o777 & ~mask
    if not path.is_dir() or path.is_symlink():
        if not path.is_symlink():
            os.chmod(path, files)
        return
    for root, subdirs, names in os.walk(path):
        os.chmod(root, dirs)
        for name in names:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), files)


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
    _WRITING.add(tmp)
    try:
        yield tmp
        umask_modes(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        _WRITING.discard(tmp)


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
    _WRITING.add(tmp)
    try:
        tmp.mkdir()
        yield tmp
        umask_modes(tmp)
        if merge is not None and dest.is_dir():
            for name in merge:
                os.replace(tmp / name, dest / name)
        else:
            replace_dir(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        _WRITING.discard(tmp)


def replace_dir(src: str | os.PathLike, dest: str | os.PathLike) -> None:
    """``src`` takes the place of ``dest``: readers see the old directory or the new one, never a
    mix (``rename`` cannot replace a non-empty directory, so the old one is moved aside first)."""
    src, dest = Path(src), Path(dest)
    if not (dest.exists() or dest.is_symlink()):
        os.replace(src, dest)
        return
    old = temp_path(dest, "old")
    _WRITING.add(old)
    try:
        os.replace(dest, old)
        os.replace(src, dest)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        _WRITING.discard(old)


def remove_leftovers(dest: str | os.PathLike) -> list[Path]:
    """Delete the temporaries that killed writes of ``dest`` left beside it; returns them.

    ``dest``'s name may be a glob pattern (``chunk_*.jsonl``, ``*``: every destination in that
    folder). Only names of this module's format count (``temp_path``; also a temporary's own
    temporaries: ``atomic_dir(merge=...)`` inside an outer ``atomic_dir``). Kept: those of writes
    in progress in this process, and those named after a process that is alive on this host (it
    may be writing them now; a reused pid merely delays the cleanup). A writer on another host
    cannot be seen: callers clean where no other writer of theirs can be active (see callers).
    """
    dest = Path(dest)
    patterns = (f".{dest.name}.tmp-*", f".{dest.name}.old-*", f"..{dest.name}.tmp-*")
    found = sorted({p for pattern in patterns for p in dest.parent.glob(pattern)
                    if _TEMP_NAME.search(p.name) and not _in_use(p)})
    for p in found:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return found
