"""The CPU thread policy: one torch thread per core other processes leave free, re-checked as the
engine runs; a fixed num_threads is never changed. The machine is simulated (a fake clock and
fake /proc/stat counters), so these tests do not depend on what else runs on the CI machine."""

import pytest
import torch

import infer.foundation.threads as threads
from infer.engine import LLM
from infer.eval.machine import machine_settings
from infer.foundation.threads import ThreadGovernor, threads_for


@pytest.mark.parametrize("other, ceiling, expected", [(0.0, 4, 4), (0.2, 4, 4), (0.3, 4, 3),
                                                      (1.0, 4, 3), (2.7, 4, 1), (9.0, 4, 1),
                                                      (1.0, 2, 1), (0.0, 1, 1)])
def test_threads_for_leaves_busy_cores_alone(other, ceiling, expected):
    assert threads_for(other, ceiling) == expected


class FakeMachine:
    """A clock, this process's CPU seconds and the machine's busy seconds, advanced by hand."""

    def __init__(self, monkeypatch):
        self.wall = self.own = self.busy = 0.0
        monkeypatch.setattr(threads.time, "perf_counter", lambda: self.wall)
        monkeypatch.setattr(threads, "own_cpu_seconds", lambda: self.own)
        monkeypatch.setattr(threads, "machine_busy_seconds", lambda: self.busy)
        monkeypatch.setattr(threads, "usable_cores", lambda: 4)

    def run(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.wall += seconds
        self.own += seconds * own_cores
        self.busy += seconds * (own_cores + other_cores)


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_auto_shrinks_beside_a_busy_process_and_grows_back(monkeypatch, restore_threads):
    machine, gov = FakeMachine(monkeypatch), ThreadGovernor()
    torch.set_num_threads(4)
    gov.start(None)
    assert (gov.ceiling, torch.get_num_threads()) == (4, 4)
    machine.run(0.1, own_cores=4, other_cores=0)
    gov.tick()  # inside the interval: no look
    assert torch.get_num_threads() == 4
    machine.run(0.2, own_cores=3.2, other_cores=1.0)
    gov.tick()
    assert torch.get_num_threads() == 3
    machine.run(0.3, own_cores=1.0, other_cores=2.9)
    gov.tick()
    assert torch.get_num_threads() == 1
    machine.run(0.3, own_cores=1.0, other_cores=0.1)  # the neighbours left
    gov.tick()
    assert torch.get_num_threads() == 4
    record = gov.record()
    assert record["policy"] == "auto" and record["ceiling"] == 4
    assert record["steps_at_threads"] == {"1": 1, "3": 1, "4": 2}


def test_fixed_count_is_never_changed(monkeypatch, restore_threads):
    machine, gov = FakeMachine(monkeypatch), ThreadGovernor()
    gov.start(2)
    machine.run(1.0, own_cores=2, other_cores=2)
    gov.tick()
    assert torch.get_num_threads() == 2 and gov.record()["policy"] == "fixed"
    with pytest.raises(ValueError, match="num_threads"):
        gov.start(0)


def test_ceiling_follows_a_count_set_outside(monkeypatch, restore_threads):
    """torch.set_num_threads / OMP_NUM_THREADS between runs is the user's choice: the new
    ceiling; an auto governor already running otherwise keeps what it learnt."""
    machine, gov = FakeMachine(monkeypatch), ThreadGovernor()
    torch.set_num_threads(3)
    gov.start(None)
    machine.run(0.3, own_cores=2, other_cores=1.0)
    gov.tick()
    assert torch.get_num_threads() == 2
    gov.start(None)  # a second engine in the same process
    assert torch.get_num_threads() == 2 and gov.ceiling == 3
    torch.set_num_threads(1)
    gov.start(None)
    assert gov.ceiling == 1 and torch.get_num_threads() == 1


def test_without_proc_stat_the_count_stays(monkeypatch, restore_threads):
    machine, gov = FakeMachine(monkeypatch), ThreadGovernor()
    monkeypatch.setattr(threads, "machine_busy_seconds", lambda: None)
    torch.set_num_threads(2)
    gov.start(None)
    machine.run(1.0, own_cores=1, other_cores=3)
    gov.tick()
    assert torch.get_num_threads() == 2


def test_engine_applies_num_threads_and_reports_it(tiny_target, restore_threads):
    LLM(tiny_target, num_threads=1, device="cpu")
    assert torch.get_num_threads() == 1
    settings = machine_settings()
    assert settings["thread_policy"]["policy"] == "fixed"
    assert settings["thread_policy"]["num_threads"] == 1
    with pytest.raises(ValueError, match="num_threads"):
        LLM(tiny_target, num_threads=0, device="cpu")
    LLM(tiny_target, device="cpu")  # back to the policy
    assert machine_settings()["thread_policy"]["policy"] == "auto"


def test_reserve_keeps_cores_for_the_server(monkeypatch):
    """A server keeps one core for its event loop: the auto policy runs at most ceiling - 1
    threads, at least one, and a fixed num_threads is left alone."""
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        gov = threads.ThreadGovernor()
        gov.start(None)
        gov.reserve(1)
        assert gov.cap == 3 and torch.get_num_threads() == 3
        assert "1 kept for this process's server" in gov.describe()
        assert threads.threads_for(0.0, gov.cap) == 3
        gov.reserve(5)
        assert gov.cap == 1 and torch.get_num_threads() == 1
        fixed = threads.ThreadGovernor()
        fixed.start(2)
        fixed.reserve(1)
        assert torch.get_num_threads() == 2 and fixed.record()["reserved"] == 1
    finally:
        torch.set_num_threads(before)
