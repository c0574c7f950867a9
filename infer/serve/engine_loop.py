"""The server's engine loop: one background thread owns the :class:`~infer.engine.LLM` and
steps it while requests are running; the HTTP side only queues work and reads updates.

Why a thread and queues: the engine (its KV cache, proposer state, running batch) is not
thread-safe, and a step must not block the event loop that answers ``/health`` and
``/metrics``. torch releases the GIL inside its kernels, so the event loop keeps answering
while the thread computes. New requests and aborts are handed over through a lock-protected
inbox and applied between steps, so a request joins the running batch at the next step with a
free slot (continuous batching; the rest wait in arrival order), and an aborted one frees its
KV slot before the next step.

After each step the thread hands every request with new tokens a :class:`TokenUpdate` through
the callback it was submitted with (the HTTP side passes one that crosses into its event loop
with ``call_soon_threadsafe``), and records the timing histograms and counters
(``infer/serve/prometheus.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from infer.engine import LLM
from infer.metrics import SpecMetrics
from infer.request import Request
from infer.serve.prometheus import EngineSnapshot, ServeMetrics

log = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.5  # the idle thread wakes at once on new work; this only bounds a missed wake


@dataclass(frozen=True)
class TokenUpdate:
    """A request's state after a step: all its output tokens so far (a copy)."""

    token_ids: list[int]
    finish_reason: str | None = None  # None while it runs
    stop_reason: int | str | None = None
    error: str | None = None  # the engine failed this request (finish_reason "error")


@dataclass
class _Tracked:
    request: Request
    on_update: Callable[[TokenUpdate], None]
    arrival: float = field(default_factory=time.perf_counter)
    sent: int = 0  # output tokens already handed over
    last: float = 0.0  # when the last update with tokens was handed over


class EngineLoop:
    """Owns ``llm`` in a daemon thread; ``submit`` / ``abort`` are safe from any thread."""

    def __init__(self, llm: LLM, metrics: ServeMetrics) -> None:
        self.llm, self.metrics = llm, metrics
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[_Tracked] = []
        self._aborts: list[Request] = []
        self._tracked: dict[int, _Tracked] = {}  # by id(request)
        self._stop = False
        self.failure: BaseException | None = None  # set when the loop died: /health says so
        self._thread = threading.Thread(target=self._run, name="draftsmith-engine", daemon=True)

    def start(self) -> "EngineLoop":
        self._publish_snapshot()
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    def submit(self, request: Request, on_update: Callable[[TokenUpdate], None]) -> None:
        """Queue a validated request; ``on_update`` is called from the engine thread (at once,
        with an error, if the loop has died)."""
        with self._lock:
            if self.failure is None:
                self._inbox.append(_Tracked(request, on_update))
                self._wake.set()
                return
        on_update(self._failed(request))

    def abort(self, request: Request) -> None:
        """Abort a request (a client went away): its slot is freed before the next step."""
        with self._lock:
            self._aborts.append(request)
        self._wake.set()

    # ---- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop:
                self._apply_inbox()
                if not self.llm.has_unfinished_requests():
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                self.llm.admit()
                self._hand_over()  # first tokens out before the next decode step
                self.llm.decode()
                self._hand_over()
        except BaseException as e:  # a bug: fail what is in flight, say so on /health
            log.exception("the engine loop failed; every request in flight gets an error")
            with self._lock:
                self.failure = e
                queued, self._inbox = self._inbox, []
            for t in list(self._tracked.values()) + queued:
                t.on_update(self._failed(t.request))

    def _failed(self, request: Request) -> TokenUpdate:
        return TokenUpdate(request.output_ids, "error",
                           error=f"engine failure: {self.failure!r}")

    def _apply_inbox(self) -> None:
        with self._lock:
            new, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for t in new:
            self._tracked[id(t.request)] = t
            self.llm.add_request(t.request)
        for request in aborts:
            if id(request) in self._tracked:
                self.llm.abort_request(request)
        if new or aborts:
            self._hand_over()

    def _hand_over(self) -> None:
        """Updates for requests with new tokens or a finish; metrics; forget finished ones."""
        now = time.perf_counter()
        for key, t in list(self._tracked.items()):
            req = t.request
            if req.num_output == t.sent and not req.finished:
                continue
            self._observe(t, now)
            t.on_update(TokenUpdate(req.output_ids, req.finish_reason, req.stop_reason))
            if req.finished:
                del self._tracked[key]
        self._publish_snapshot()

    def _observe(self, t: _Tracked, now: float) -> None:
        """vLLM's timing metrics: time to first token; the gap between successive updates
        (one per step, however many tokens a step accepted); end-to-end at the finish."""
        req, m = t.request, self.metrics
        new = req.num_output - t.sent
        if new > 0:
            if t.sent == 0:
                m.prompt_tokens.inc(len(req.prompt_ids))
                m.ttft.observe(now - t.arrival)
            else:
                m.itl.observe(now - t.last)
            m.generation_tokens.inc(new)
            t.sent, t.last = req.num_output, now
        if req.finished:
            m.e2e.observe(now - t.arrival)
            m.finished(req.finish_reason)

    def _publish_snapshot(self) -> None:
        with self._lock:
            queued = len(self._inbox)
        self.metrics.snapshot = EngineSnapshot(
            self.llm.num_running, self.llm.num_waiting + queued,
            SpecMetrics().merge(self.llm.metrics))  # a copy: the engine keeps counting
