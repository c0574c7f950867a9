"""SIGINT / SIGTERM policies (infer/foundation/signals.py), with real signals sent to this
process."""

import os
import signal
import threading

import pytest

from infer.foundation.errors import Interrupted
from infer.foundation.signals import StopRequests, raise_on_signals


def handlers() -> dict:
    return {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}


def test_raise_on_signals_unwinds_with_the_signal_and_restores_handlers():
    before, unwound = handlers(), []
    with pytest.raises(Interrupted, match=r"^interrupted by SIGTERM; finished chunks are kept$"
                       ) as stopped:
        with raise_on_signals("finished chunks are kept"):
            try:
                os.kill(os.getpid(), signal.SIGTERM)
            finally:
                unwound.append(True)  # finally blocks run (temporaries removed), unlike SIGTERM's
    assert stopped.value.signum == signal.SIGTERM and stopped.value.exit_status == 143
    assert unwound == [True] and handlers() == before


def test_a_stop_request_is_recorded_announced_and_a_late_repeat_aborts(capfd):
    before = handlers()
    with StopRequests("{signal} received: stopping", abort="nothing saved") as stops:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)  # within the window: the same request
        assert stops.signum == signal.SIGINT
        stops.window_s = 0.0  # now a repeat is the user insisting
        with pytest.raises(Interrupted, match="^interrupted again by SIGINT: nothing saved$"):
            os.kill(os.getpid(), signal.SIGINT)
    assert capfd.readouterr().err == "SIGINT received: stopping\n"
    assert handlers() == before


def test_a_request_not_acted_on_goes_to_the_previous_handler():
    got = []
    old = signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    try:
        with pytest.raises(RuntimeError):  # the block failed: its error wins, no re-delivery
            with StopRequests():
                os.kill(os.getpid(), signal.SIGTERM)
                raise RuntimeError("bug")
        assert got == []
        with StopRequests():
            os.kill(os.getpid(), signal.SIGTERM)
            assert got == []
        assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old)


def test_off_the_main_thread_nothing_is_installed():
    before, seen = handlers(), []

    def body():
        with StopRequests() as stops, raise_on_signals():
            seen.append((handlers() == before, stops.signum))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [(True, 0)]


def test_a_forked_child_ignores_stop_requests():
    """DataLoader workers forked during training: the main process decides when to stop."""
    with StopRequests("announced") as stops:
        pid = os.fork()
        if pid == 0:  # the child: a signal must neither stop it nor touch the request
            os.kill(os.getpid(), signal.SIGINT)
            os._exit(0 if stops.signum == 0 else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0 and stops.signum == 0


def test_an_ignored_signal_stays_ignored():
    """A shell starts background jobs with SIGINT ignored; training must not start caring."""
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopRequests() as stops, raise_on_signals():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
        assert stops.signum == 0 and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)
