"""User errors versus bugs: what the entry points print without a traceback.

A ``UserError`` says that something the user gave is wrong (a config value, a file, a request)
and its message alone tells them what to fix: ``python train.py`` and ``python infer.py`` print
it on one line and exit with status 2 (``infer/foundation/entry.py``). Any other exception is a
bug and
keeps its traceback. The subclasses also derive from the built-in exception a caller would
expect (``ValueError``, ``FileNotFoundError``), so library users can catch those as before.

``Interrupted`` is how a run stopped by SIGINT / SIGTERM leaves: it derives from
``KeyboardInterrupt`` (no ``except Exception`` swallows it) and carries the signal, so the entry
point can print where the work was saved and exit with 128 + the signal number, as a shell
reports a process stopped by that signal.

Torch-free: imported by config classes and by the entry points before anything heavy.
"""

from __future__ import annotations

import errno
import os
import signal
import tempfile
from pathlib import Path


class UserError(Exception):
    """Something the user gave is wrong; the message names it and what was expected."""


class ConfigError(UserError, ValueError):
    """A configuration key has a value that is not allowed. ``key``: that key, when one is to
    blame (the server reports it as the OpenAI error's ``param``)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class FileFormatError(UserError, ValueError):
    """A file exists but cannot be used: truncated, corrupt, not the expected format, or made
    for another model (wrong vocabulary or hidden size, another drafter method)."""


class MissingFileError(UserError, FileNotFoundError):
    """A file or directory the user pointed at (or that a checkpoint needs) does not exist."""


class NotWritableError(UserError, PermissionError):
    """An output location cannot be written; found before any work starts."""


class NoSpaceError(UserError, OSError):
    """What a run would write does not fit on the disk it targets; found before writing it."""


class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal after saving what it had (the message says where)."""

    def __init__(self, message: str, signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.signum = int(signum)

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


def check_writable(path: str | os.PathLike, key: str) -> None:
    """Raise ``NotWritableError`` unless ``path`` (a file or directory to be written, maybe not
    existing yet) can be created and written: checked before any work starts, so a long run
    never ends by losing its results to a permission error. Probed by writing, not by
    ``os.access``, which says yes to root on a read-only filesystem."""
    p = Path(path).expanduser().absolute()
    if p.is_file():
        try:  # append mode: nothing written, nothing truncated
            with open(p, "a"):
                pass
        except OSError as err:
            raise NotWritableError(f"{key}={str(path)!r}: {p} is not writable "
                                   f"({err.strerror})") from None
        return
    parent = p if p.is_dir() else p.parent
    while not parent.exists():
        parent = parent.parent
    try:
        if not parent.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        with tempfile.TemporaryFile(dir=parent, prefix=".draftsmith-probe-"):
            pass
    except OSError as err:
        raise NotWritableError(f"{key}={str(path)!r}: cannot create files under {parent} "
                               f"(not a writable directory: {err.strerror})") from None