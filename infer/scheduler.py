"""Which requests hold KV-cache slots and which wait: the engine's scheduling, apart from any
model.

Requests join the running batch in arrival order as slots free up; a finished request leaves at
once (its slot is free for the next step) and an aborted one is finished first. The running
batch is kept sorted by slot, so that rows ``0 .. B - 1`` of a step read the cache's rows in
order (views, no gather; ``infer/kv_cache.py:cache_rows``).
"""

from __future__ import annotations

from infer.request import Request


class Scheduler:
    """The waiting queue and the running batch of one engine with ``max_num_seqs`` slots."""

    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.running: list[Request] = []  # in KV-cache slots, sorted by slot
        self.waiting: list[Request] = []  # queued, in arrival order

    def add(self, request: Request) -> None:
        """Queue a request (a refused one is finished already and never queued)."""
        if not request.finished:
            self.waiting.append(request)

    def abort(self, request: Request) -> None:
        """Drop ``request`` from the queue, or finish it if it runs ("abort"); its slot is freed
        by the next :meth:`retire`."""
        self.waiting = [r for r in self.waiting if r is not request]
        if not request.finished:
            request.finish_reason = "abort"

    def take(self) -> list[Request]:
        """Waiting requests given the free slots, in arrival order (they leave the queue; they
        join the batch when :meth:`join` is called after their prefill)."""
        free = sorted(set(range(self.max_num_seqs)) - {r.slot for r in self.running})
        taken, self.waiting = self.waiting[: len(free)], self.waiting[len(free):]
        for req, slot in zip(taken, free):
            req.slot = slot
        return taken

    def join(self, reqs: list[Request]) -> None:
        """Prefilled requests enter the running batch."""
        self.running = sorted(self.running + reqs, key=lambda r: r.slot)

    def retire(self) -> list[Request]:
        """The finished requests, removed from the running batch (their slots are free)."""
        done = [r for r in self.running if r.finished]
        self.running = [r for r in self.running if not r.finished]
        return done

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
