"""CPU thread policy: one torch thread per core that no other process keeps busy.

torch runs each op on an OpenMP team that spin-waits at every barrier. When another process
takes one of the cores, the thread sharing that core is preempted for a whole scheduler slice
while its teammates spin, and every op waits: on 2 cores, greedy decoding of the tiny target fell
from ~2800 tok/s to 47-84 tok/s (34-60x) beside one other small torch process, where one
thread gave 1330-1670. vLLM avoids this by pinning its threads; draftsmith cannot pin (the other
process may be anywhere), so it watches instead.

``ThreadGovernor.tick()`` is called once per engine step, training step and feature-cache batch.
At most every ``interval_s`` it compares the machine's busy CPU time (``/proc/stat``) with this
process's own over the window since the last look; what other processes used, in cores, is
``other``. It then runs ``ceiling - ceil(other - CONTENTION_CORES)`` threads (at least one),
where ``ceiling`` is the thread count torch had when the policy started (torch's default, or what
``OMP_NUM_THREADS`` / ``torch.set_num_threads`` / ``num_threads`` said), capped by the cores this
process may run on. Alone, nothing changes; with a busy neighbour the team shrinks within one
interval and grows back when the neighbour leaves. Each look costs one read of ``/proc/stat``
(microseconds); between looks, ``tick`` is a clock read. Without ``/proc/stat`` (macOS,
Windows) the count stays at the ceiling.

A server (``infer.py mode=serve``) keeps one core for its HTTP event loop (``reserve(1)``): that
thread is in this process, so the look above cannot see it, and a team spread over its core
collapses the same way (measured: 2 torch threads beside the server's own event loop and a load
client ran the tiny target's decode step in 4.5 ms, one thread in 1.8 ms). vLLM's CPU backend
likewise keeps a core for its front end.

``num_threads`` (``python infer.py num_threads=N``, ``python train.py trainer.num_threads=N``,
``LLM(num_threads=N)``): None = this policy, N = exactly N threads, never changed. The policy and
the thread counts it ran with are logged at start-up and recorded in results.json.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from infer.foundation.validation import check_int

log = logging.getLogger(__name__)

CONTENTION_CORES = 0.25  # other processes' busy cores tolerated before giving a core up
# How often the machine is looked at: /proc/stat counts in 10 ms ticks, so a 0.2 s window on 2
# cores measures other processes' use to ~0.05 cores, well inside CONTENTION_CORES.
INTERVAL_S = 0.2
_PROC_STAT = Path("/proc/stat")


def machine_busy_seconds() -> float | None:
    """CPU seconds all cores spent busy since boot (None without /proc/stat)."""
    try:
        fields = _PROC_STAT.read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    busy = sum(ticks[:8]) - idle  # guest time is already counted in user / nice
    return busy / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, as a container's cpuset sets it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def threads_for(other_cores: float, ceiling: int) -> int:
    """The team size beside ``other_cores`` busy cores of other processes."""
    return max(1, ceiling - math.ceil(max(0.0, other_cores - CONTENTION_CORES)))


@dataclass
class ThreadGovernor:
    """The process's torch thread count (see the module doc); one per process: ``GOVERNOR``."""

    fixed: int | None = None  # num_threads given: never changed
    ceiling: int = 0  # 0: not started
    interval_s: float = INTERVAL_S
    ticks_at: Counter = field(default_factory=Counter)  # thread count -> ticks run with it
    _last: tuple[float, float, float | None] | None = None
    _applied: int = 0  # the count the governor last set
    reserved: int = 0  # cores kept free for this process's other busy threads (a server's)

    def start(self, num_threads: int | None = None) -> None:
        """Apply ``num_threads`` (None: the policy). The ceiling is torch's thread count at the
        first call, or whenever something else (the user, ``torch.set_num_threads``) changed it
        since the governor last set it."""
        check_int("num_threads", num_threads, "thread policy", minimum=1, optional=True)
        current = torch.get_num_threads()
        outside = current != self._applied  # torch's count was set by someone else meanwhile
        if not self.ceiling or outside:
            self.ceiling = max(1, min(current, usable_cores()))
        changed = self._last is None or num_threads != self.fixed
        self.fixed = num_threads
        if changed or outside:  # an auto governor already running keeps what it learnt
            self._apply(num_threads or self.cap)
        self._last = self._sample()
        if changed:
            log.info("torch threads: %s", self.describe())

    @property
    def cap(self) -> int:
        """The most threads the policy runs: the ceiling less the reserved cores."""
        return max(1, self.ceiling - self.reserved)

    def reserve(self, cores: int) -> None:
        """Keep ``cores`` cores free of torch threads from now on (policy ``auto`` only)."""
        check_int("cores", cores, "thread policy", minimum=0)
        self.reserved = cores
        if self.fixed is None and self.ceiling:
            self._apply(min(torch.get_num_threads(), self.cap))
            log.info("torch threads: %s", self.describe())

    def _apply(self, n: int) -> None:
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
        self._applied = n

    def describe(self) -> str:
        if self.fixed is not None:
            return f"{self.fixed} (num_threads, fixed)"
        kept = f", {self.reserved} kept for this process's server" if self.reserved else ""
        return (f"{torch.get_num_threads()} now; auto: one per core not busy with other "
                f"processes, at most {self.cap} of {usable_cores()} usable cores{kept}")

    def tick(self) -> None:
        """Called once per step: every ``interval_s``, resize the team to the free cores."""
        if self._last is None:
            return
        self.ticks_at[self._applied] += 1
        if self.fixed is not None or time.perf_counter() - self._last[0] < self.interval_s:
            return
        now = self._sample()
        other = _other_cores(self._last, now)
        self._last = now
        if other is None:
            return
        want = threads_for(other, self.cap)
        if want != torch.get_num_threads():
            log.info("torch threads %d -> %d (other processes busy on %.2f cores)",
                     torch.get_num_threads(), want, other)
            self._apply(want)

    def record(self) -> dict[str, Any]:
        """What results.json keeps: the policy and the steps run at each thread count."""
        return {"policy": "fixed" if self.fixed is not None else "auto",
                "num_threads": self.fixed, "ceiling": self.ceiling,
                "usable_cores": usable_cores(), "reserved": self.reserved,
                "threads_now": torch.get_num_threads(),
                "steps_at_threads": {str(k): v for k, v in sorted(self.ticks_at.items())}}

    @staticmethod
    def _sample() -> tuple[float, float, float | None]:
        return time.perf_counter(), own_cpu_seconds(), machine_busy_seconds()


def _other_cores(before: tuple, after: tuple) -> float | None:
    """Average cores other processes kept busy between two samples."""
    wall, own = after[0] - before[0], after[1] - before[1]
    if before[2] is None or after[2] is None or wall <= 0:
        return None
    return max(0.0, (after[2] - before[2] - own) / wall)


GOVERNOR = ThreadGovernor()
