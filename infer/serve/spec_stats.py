"""Per-request speculative-decoding stats in the OpenAI responses, as vLLM's
``--per-request-spec-decode-metrics none|summary|detailed``: the response's
``metrics.speculative_decoding`` (streamed: in the final usage chunk) says how one request's
drafts fared, with the counters that ``/metrics`` sums over all requests (docs/reference.md
§13). null where a response holds more than one choice, as in vLLM for n > 1."""

from __future__ import annotations

from typing import Any

from infer.foundation.validation import StrChoice
from infer.metrics import SpecMetrics


class SpecStatsLevel(StrChoice):
    none = "none"
    summary = "summary"  # counts, rates and the acceptance histogram
    detailed = "detailed"  # and the drafted / accepted counts of every step


def request_spec_stats(metrics: SpecMetrics, k: int, steps: list[tuple[int, int]] | None
                       ) -> dict[str, Any]:
    """One request's stats: ``mean_acceptance_length`` = 1 + accepted / steps (the engine's
    definition), ``acceptance_histogram[j]`` = steps that accepted exactly j of their drafts
    (length k + 1; acceptance is a prefix, so it follows from the per-position counts);
    ``steps`` ((drafted, accepted) per step) adds vLLM's detailed lists."""
    at_least = [metrics.num_drafts] + list(metrics.num_accepted_tokens_per_pos)  # [>= j]
    at_least += [0] * (k + 2 - len(at_least))
    out: dict[str, Any] = {
        "mean_acceptance_length": metrics.mean_acceptance_length,
        "draft_acceptance_rate": metrics.acceptance_rate,
        "acceptance_histogram": [at_least[j] - at_least[j + 1] for j in range(k + 1)],
        "num_spec_steps": metrics.num_drafts,
        "num_accepted_draft_tokens": metrics.num_accepted_tokens,
        "num_draft_tokens": metrics.num_draft_tokens,
        "num_spec_tokens": k,
    }
    if steps is not None:
        out["per_step_accepted"] = [accepted for _, accepted in steps]
        out["per_step_drafted"] = [drafted for drafted, _ in steps]
    return out
