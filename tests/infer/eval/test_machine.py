"""The harness sees other processes competing for the cores during a timed run."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from infer.eval.machine import CpuMonitor, machine_settings


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs Linux /proc/stat")
def test_a_busy_neighbour_is_seen_and_an_idle_wait_is_not():
    busy = subprocess.Popen([sys.executable, "-c",
                             "import time\nend = time.time() + 3\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.5)  # the neighbour is up and spinning
        with CpuMonitor() as m:
            time.sleep(1.0)  # this process idles while the other one burns a core
    finally:
        busy.kill()
        busy.wait()
    assert m.window.wall_s >= 1.0 and m.window.own_cpu_s < 0.2
    assert m.window.other_cores > 0.6 and m.window.contended
    with CpuMonitor() as idle:  # whatever else the machine does now
        time.sleep(0.5)
    with CpuMonitor() as own:  # this process's own work is never counted as contention
        end = time.perf_counter() + 0.5
        while time.perf_counter() < end:
            pass
    assert own.window.own_cpu_s > 0.3
    assert own.window.other_cores < idle.window.other_cores + 0.5


def test_machine_settings():
    s = machine_settings()
    assert s["cpu_count"] >= 1 and 1 <= s["usable_cores"] <= s["cpu_count"]
    assert s["torch_threads"] >= 1 and s["torch_interop_threads"] >= 1
