"""What the machine was doing while the harness timed a run.

Timings on a shared machine mean little without knowing whether something else ran: on a 2-core
CPU, one other busy process can make torch's threads spin-wait on each other and a decode step
many times slower. The harness therefore records, per timed run, how many cores *other*
processes kept busy on average (``other_cores``: the machine's busy CPU time from ``/proc/stat``
minus this process's own CPU time, over the wall time), flags runs where that exceeds
``CONTENTION_CORES``, and records the machine's cores, the cores this process may use, the load
average and torch's thread count in results.json. Where ``/proc/stat`` does not exist (macOS,
Windows) ``other_cores`` is None and only the load average is recorded.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from infer.foundation.threads import (CONTENTION_CORES, GOVERNOR, machine_busy_seconds,
                                     own_cpu_seconds)


@dataclass
class CpuWindow:
    """CPU use over one timed region (see the module doc)."""

    wall_s: float
    own_cpu_s: float
    other_cores: float | None  # average cores kept busy by other processes

    @property
    def contended(self) -> bool:
        return self.other_cores is not None and self.other_cores > CONTENTION_CORES


class CpuMonitor:
    """``with CpuMonitor() as m: ...`` then ``m.window``: the CPU use of the block."""

    def __enter__(self) -> "CpuMonitor":
        self._start = (time.perf_counter(), own_cpu_seconds(), machine_busy_seconds())
        return self

    def __exit__(self, *exc: Any) -> None:
        wall0, own0, busy0 = self._start
        wall, own, busy = time.perf_counter() - wall0, own_cpu_seconds() - own0, None
        now = machine_busy_seconds()
        if busy0 is not None and now is not None and wall > 0:
            busy = max(0.0, (now - busy0 - own) / wall)
        self.window = CpuWindow(wall, own, busy)


def other_cores_now(seconds: float) -> float | None:
    """Cores other processes keep busy, watched for ``seconds`` (None without /proc/stat)."""
    with CpuMonitor() as monitor:
        time.sleep(seconds)
    return monitor.window.other_cores


def machine_settings() -> dict[str, Any]:
    """The machine a report was measured on: cores, cores this process may use, load average,
    torch's intra- / inter-op threads and the thread policy (infer/foundation/threads.py)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"cpu_count": os.cpu_count(), "usable_cores": usable,
            "load_average": [round(x, 2) for x in load] if load else None,
            "torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads(),
            "thread_policy": GOVERNOR.record()}
