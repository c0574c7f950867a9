"""k by batch size: vLLM's ``num_speculative_tokens_per_batch_size`` (2026), a list of
``[start_bs, end_bs, k]`` ranges (inclusive) that picks each step's k from the number of
requests the step runs.

Rules, as vLLM checks them: a non-empty list; three integers per entry; bounds > 0 and
start <= end; k >= 0 (0: that step drafts nothing, a plain decoding step); sorted by start, the
ranges do not overlap; the first starts at 1. A gap between ranges and everything past the last
carry the previous range's k; each k is clamped to ``num_speculative_tokens`` (the most any step
drafts, which sizes the caches). Why: a drafter that pays at batch 1, where a verify of k tokens
costs about a decode step, can lose at batch 8, where the verify is compute-bound (on a CPU, or a
GPU at large batch); the harness's k advisor measures where (infer/eval/advisor.py).
"""

from __future__ import annotations

from typing import Any

from infer.foundation.validation import config_error

KEY = "num_speculative_tokens_per_batch_size"
Schedule = tuple[tuple[int, int, int], ...]


def parse_schedule(value: Any, where: str) -> Schedule | None:
    """The checked schedule, sorted by start, as a tuple (hashable, for a frozen config)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise config_error(KEY, value, "a list of [start_bs, end_bs, k] ranges", where)
    entries = [list(e) if hasattr(e, "__iter__") and not isinstance(e, str) else e
               for e in value]
    if not entries:
        raise config_error(KEY, value, "a non-empty list of [start_bs, end_bs, k] ranges", where)
    for i, e in enumerate(entries):
        _check_entry(f"{KEY}[{i}]", e, where)
    ranges = sorted((int(s), int(e), int(k)) for s, e, k in entries)
    for (s0, e0, _), (s1, e1, _) in zip(ranges, ranges[1:]):
        if s1 <= e0:
            raise config_error(KEY, value, f"ranges that do not overlap ([{s0}, {e0}] and "
                               f"[{s1}, {e1}] share batch sizes)", where)
    if ranges[0][0] != 1:
        raise config_error(KEY, value, f"a first range starting at batch size 1 (it starts at "
                           f"{ranges[0][0]}: smaller batches would have no k)", where)
    return tuple(ranges)


def _check_entry(key: str, e: Any, where: str) -> None:
    ints = isinstance(e, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                       for x in e)
    if not ints or len(e) != 3:
        raise config_error(key, e, "[start_bs, end_bs, k]: three integers", where)
    start, end, k = e
    if start < 1 or end < 1 or start > end:
        raise config_error(key, e, "batch bounds > 0 with start_bs <= end_bs", where)
    if k < 0:
        raise config_error(key, e, "k >= 0 (0: no drafting at those batch sizes)", where)


def k_for_batch(schedule: Schedule | None, batch_size: int, k_max: int) -> int:
    """The k of a step running ``batch_size`` requests: the last range starting at or below it
    (a gap or the tail carries the previous k), clamped to ``k_max``; ``k_max`` without a
    schedule."""
    if not schedule:
        return k_max
    k = k_max
    for start, _, range_k in schedule:
        if start > batch_size:
            break
        k = range_k
    return min(k, k_max)
