"""SIGINT / SIGTERM during long runs: an orderly stop that keeps the work done so far.

Two policies, each a context manager that installs handlers for both signals in the main thread
for the duration of a phase and puts back the ones it replaced (outside the main thread Python
cannot install handlers: they are left alone and the phase runs unprotected):

- :func:`raise_on_signals`: phases that are chunked and resumable on their own (data
  preparation, regeneration, the feature cache, export, evaluation). Either signal raises
  :class:`~infer.foundation.errors.Interrupted` at once, so Python unwinds, ``finally`` blocks
  remove the
  temporaries of writes in progress (infer/foundation/atomic.py), and finished chunks stay.
  Without it
  SIGTERM's default action ends the process on the spot and leaves those temporaries behind.
- :class:`StopRequests`: the training loop. A signal only records a request; the trainer
  finishes the current optimizer step, saves a checkpoint and raises ``Interrupted`` itself
  (train/trainer.py, which also makes all ranks agree on the step). A repeated signal aborts at
  once without saving (the last checkpoint stays loadable: checkpoints are written atomically),
  except within ``window_s`` of the first: ``torchrun`` / ``accelerate launch`` forward the
  terminal's Ctrl-C to ranks that received it already, and that is still one request. A request
  still pending when the phase ends is handed to the handler that was there before.

Forked children (DataLoader workers, dataset map workers) inherit these handlers: under
``raise_on_signals`` they behave as if none were installed; under ``StopRequests`` they ignore
the signal, as the main process decides when to stop and shuts them down.

Torch-free: imported by the trainer and by entry points before anything heavy.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from infer.foundation.errors import Interrupted

SIGNALS = (signal.SIGINT, signal.SIGTERM)
REPEAT_WINDOW_S = 2.0  # repeats closer than this to the first signal are the same request


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def _install(handler: Callable[[int, Any], None]) -> dict[int, Any]:
    """``handler`` for SIGINT and SIGTERM; returns the replaced handlers ({} off the main
    thread, where nothing is installed). A signal the process ignores stays ignored (a shell
    starts background jobs with SIGINT ignored, so that Ctrl-C spares them)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, handler) for s in SIGNALS
            if signal.getsignal(s) is not signal.SIG_IGN}


def _restore(old: dict[int, Any]) -> None:
    for s, handler in old.items():  # None: installed from C; the default is the closest
        signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def _as_if_unhandled(signum: int) -> None:
    """What a process without our handler does: SIGINT raises KeyboardInterrupt, SIGTERM ends
    the process (default action re-delivered)."""
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _say(text: str) -> None:
    """One line on stderr from a signal handler: ``os.write``, since ``print`` may be
    interrupted mid-write of the same stream (tqdm's) and fail as a reentrant call."""
    try:
        os.write(2, (text + "\n").encode())
    except OSError:
        pass


@contextmanager
def raise_on_signals(note: str = "") -> Iterator[None]:
    """Within the block SIGINT and SIGTERM raise ``Interrupted("interrupted by SIG...; " +
    note)``: the exception unwinds the block like Ctrl-C does (``finally`` blocks run), and the
    entry point prints the message and exits with 128 + the signal number."""
    pid = os.getpid()

    def handler(signum: int, frame: Any) -> None:
        if os.getpid() != pid:
            _as_if_unhandled(signum)
            return
        raise Interrupted(f"interrupted by {signal_name(signum)}" + (f"; {note}" if note else ""),
                          signum)

    old = _install(handler)
    try:
        yield
    finally:
        _restore(old)


class StopRequests:
    """Records SIGINT / SIGTERM while installed (``with StopRequests(...) as stops``):
    ``stops.signum`` is the first signal received, 0 while none was. ``announce`` is printed
    (stderr) when it arrives; a repeat after ``window_s`` raises ``Interrupted(abort)``."""

    def __init__(self, announce: str | None = None, abort: str = "stopped without saving",
                 window_s: float = REPEAT_WINDOW_S) -> None:
        self.announce, self.abort, self.window_s = announce, abort, window_s
        self.signum, self._first_at, self._old, self._pid = 0, 0.0, {}, os.getpid()
        self._aborted = False

    def __enter__(self) -> "StopRequests":
        self._pid = os.getpid()
        self._old = _install(self._handle)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        old, self._old = self._old, {}
        _restore(old)
        if self.signum and exc_type is None and old and not self._aborted:
            signal.raise_signal(self.signum)  # not acted on: the previous handler's turn

    def _handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:  # a forked worker: the main process stops it
            return
        now = time.monotonic()
        if not self.signum:
            self.signum, self._first_at = signum, now
            if self.announce:
                _say(self.announce.format(signal=signal_name(signum)))
        elif now - self._first_at >= self.window_s:
            self._aborted = True
            raise Interrupted(f"interrupted again by {signal_name(signum)}: {self.abort}",
                              signum)
