"""``GET /metrics``: the server's Prometheus metrics, with vLLM's names, labels and buckets.

Dashboards and tools built for ``vllm serve`` (Grafana boards, speculators' evaluation, which
computes acceptance length as 1 + accepted / drafts from these counters) read a draftsmith
server unchanged: every metric has vLLM 0.32's name, its ``model_name`` and ``engine`` labels,
and its histogram buckets (vllm/v1/metrics/buckets.py).

The speculative counters are not kept twice: a collector reads them at scrape time from the
engine's own :class:`~infer.metrics.SpecMetrics` (a snapshot the engine thread publishes after
each step), so they equal ``LLM.get_metrics()`` by construction. As in vLLM they exist only
when speculation is on, with one ``position`` series per draft position (zeros included).
Each registry is its own (not prometheus_client's global one), so several servers can live in
one process (the tests).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from infer.metrics import SpecMetrics

LABELS = ("model_name", "engine")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
_SPEC = (("num_drafts", "Number of spec decoding drafts."),
         ("num_draft_tokens", "Number of draft tokens."),
         ("num_accepted_tokens", "Number of accepted tokens."))


@dataclass(frozen=True)
class EngineSnapshot:
    """What the engine thread publishes after each step for the scrape to read."""

    running: int = 0
    waiting: int = 0  # the engine's queue plus requests not yet handed to it
    spec: SpecMetrics = field(default_factory=SpecMetrics)


class ServeMetrics:
    """The registry behind ``/metrics``; ``k`` None: no speculation (no spec_decode series)."""

    def __init__(self, model_name: str, k: int | None) -> None:
        self.labels = (model_name, "0")
        self.k = k
        self.snapshot = EngineSnapshot()
        self.registry = CollectorRegistry()
        reg, labels = self.registry, LABELS
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     labels, registry=reg).labels(*self.labels)
        self.generation_tokens = Counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.", labels,
                                         registry=reg).labels(*self.labels)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          labels + ("finished_reason",), registry=reg)
        self._success = {r: success.labels(*self.labels, r) for r in FINISH_REASONS}
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", labels,
                              buckets=TTFT_BUCKETS, registry=reg).labels(*self.labels)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", labels,
                             buckets=ITL_BUCKETS, registry=reg).labels(*self.labels)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", labels,
                             buckets=E2E_BUCKETS, registry=reg).labels(*self.labels)
        reg.register(_EngineCollector(self))

    def finished(self, reason: str | None) -> None:
        self._success[reason or "error"].inc()


class _EngineCollector:
    """Gauges and speculative counters read from the latest :class:`EngineSnapshot`."""

    def __init__(self, metrics: ServeMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        m = self.metrics
        snap, labels = m.snapshot, list(m.labels)
        for name, value, doc in (("running", snap.running,
                                  "Number of requests in model execution batches."),
                                 ("waiting", snap.waiting,
                                  "Number of requests waiting to be processed.")):
            gauge = GaugeMetricFamily(f"vllm:num_requests_{name}", doc, labels=LABELS)
            gauge.add_metric(labels, value)
            yield gauge
        if m.k is None:
            return
        for key, doc in _SPEC:
            counter = CounterMetricFamily(f"vllm:spec_decode_{key}", doc, labels=LABELS)
            counter.add_metric(labels, getattr(snap.spec, key))
            yield counter
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.",
                                      labels=LABELS + ("position",))
        counts = snap.spec.num_accepted_tokens_per_pos
        for pos in range(max(m.k, len(counts))):
            per_pos.add_metric(labels + [str(pos)], counts[pos] if pos < len(counts) else 0)
        yield per_pos
