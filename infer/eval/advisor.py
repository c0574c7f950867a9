"""The cost model and the k advisor: pure functions over measured acceptance and costs.

All costs are per engine step, in units of one autoregressive step ``c_ar`` at the same batch
size and temperature (``c_ar`` = median wall time of a non-speculative ``speculative_step``;
every cost is a median over steps, which shrugs off the scheduling hiccups of a shared machine):

- ``cost_draft`` = median ``proposer.propose`` time per step / ``c_ar``;
- ``cost_verify`` = median of (step time - propose time) / ``c_ar``: the target forward over
  ``k + 1`` tokens plus rejection sampling, cache rollback and proposer bookkeeping, i.e.
  everything in a step but drafting, measured the way ``c_ar`` is;
- ``coverage`` = drafts / request-steps (n-gram and suffix find no match on some steps; ~1 for
  model drafters);
- E[accepted | k'] = coverage x sum_{i<k'} per_position[i];
- predicted speedup(k') = (1 + E[accepted | k']) / (cost_draft(k') + cost_verify(k')). With
  coverage 1 this is (1 + E[acc]) * c_ar / (k * c_draft_per_token + c_verify).

``advise_k`` evaluates every k' up to the largest measured k. ``cost_draft(k')`` interpolates
linearly between (0, 0) and the measured (k, cost) points (one measured k: k' x the per-token
cost; beyond the last point: the last segment's slope); ``cost_verify(k')`` interpolates
linearly between measured points and is constant outside them (one measured k: constant).
``advise`` groups harness rows by (method, batch size, temperature), uses each group's largest-k
per-position rates, and picks one k per method by the geometric mean of the predicted speedup
over the method's groups. See docs/harness.md.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence


def predicted_speedup(expected_accepted: float, cost_draft: float, cost_verify: float) -> float:
    """(1 + E[accepted]) / (cost_draft + cost_verify), costs in units of one AR step."""
    cost = cost_draft + cost_verify
    return (1.0 + expected_accepted) / cost if cost > 0 else 0.0


def _interp(x: float, points: list[tuple[float, float]], *, extrapolate: bool) -> float:
    """Piecewise-linear through sorted ``points``; outside them the end segment's line
    (``extrapolate``) or the end value."""
    if len(points) == 1:
        return points[0][1]
    if x <= points[0][0]:
        if not extrapolate:
            return points[0][1]
        (x0, y0), (x1, y1) = points[0], points[1]
    elif x >= points[-1][0]:
        if not extrapolate:
            return points[-1][1]
        (x0, y0), (x1, y1) = points[-2], points[-1]
    else:
        (x0, y0), (x1, y1) = next((a, b) for a, b in zip(points, points[1:]) if x <= b[0])
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def draft_cost_at(k: int, costs: Mapping[int, tuple[float, float]]) -> float:
    """cost_draft(k): linear through (0, 0) and the measured points (see the module doc)."""
    return _interp(k, [(0, 0.0)] + sorted((m, c[0]) for m, c in costs.items()), extrapolate=True)


def verify_cost_at(k: int, costs: Mapping[int, tuple[float, float]]) -> float:
    """cost_verify(k): linear between measured points, constant outside them."""
    return _interp(k, sorted((m, c[1]) for m, c in costs.items()), extrapolate=False)


def advise_k(per_position: Sequence[float], costs: Mapping[int, tuple[float, float]], *,
             coverage: float = 1.0, max_k: int | None = None) -> dict:
    """The k maximising the predicted speedup, with every candidate k' = 1..max_k.

    ``per_position``: acceptance rate of each draft position (from the largest measured k);
    ``costs``: measured k -> (cost_draft, cost_verify) in AR steps. Ties go to the smaller k.
    """
    if not costs:
        raise ValueError("advise_k: no measured costs")
    max_k = min(max_k or len(per_position), len(per_position))
    candidates = []
    for k in range(1, max_k + 1):
        expected = coverage * float(sum(per_position[:k]))
        cd, cv = draft_cost_at(k, costs), verify_cost_at(k, costs)
        candidates.append({"k": k, "expected_accepted": expected, "cost_draft": cd,
                           "cost_verify": cv, "predicted_speedup": predicted_speedup(expected,
                                                                                     cd, cv)})
    best = max(candidates, key=lambda c: (c["predicted_speedup"], -c["k"])) if candidates else None
    return {"recommended_k": best["k"] if best else None,
            "predicted_speedup": best["predicted_speedup"] if best else None,
            "candidates": candidates}


def advise(results: Sequence[Any]) -> tuple[list[dict], dict[str, int]]:
    """Advisor records per (method, batch size, temperature) and one k per method, from rows
    with ``method, batch_size, temperature, k, per_position, cost_draft, cost_verify,
    draft_coverage`` (``infer.eval.harness.ConfigResult``)."""
    groups: dict[tuple, list[Any]] = {}
    for r in results:
        groups.setdefault((r.method, r.batch_size, r.temperature), []).append(r)
    records = []
    for (method, batch, temp), rows in groups.items():
        widest = max(rows, key=lambda r: r.k)
        costs = {r.k: (r.cost_draft, r.cost_verify) for r in rows}
        rec = advise_k(widest.per_position, costs, coverage=widest.draft_coverage, max_k=widest.k)
        records.append({"method": method, "batch_size": batch, "temperature": temp,
                        "measured_ks": sorted(costs), **rec})
    recommended: dict[str, int] = {}
    for method in dict.fromkeys(r["method"] for r in records):
        mine = [r for r in records if r["method"] == method]
        if min(len(r["candidates"]) for r in mine):
            recommended[method] = _best_k(mine, smallest=1)
    return records, recommended


def advise_schedule(records: Sequence[Mapping[str, Any]]) -> dict[str, list[list[int]]]:
    """A ``num_speculative_tokens_per_batch_size`` per method from the advisor ``records``: at
    each measured batch size the k with the best predicted speedup (the geometric mean over
    the measured temperatures), 0 where none beats plain decoding (predicted 1 by definition);
    each range runs up to the next measured batch size, the first starts at 1, the last
    carries on (infer/k_schedule.py). Methods measured at one batch size get none."""
    out: dict[str, list[list[int]]] = {}
    for method in dict.fromkeys(r["method"] for r in records):
        mine = [r for r in records if r["method"] == method and r["candidates"]]
        batches = sorted({r["batch_size"] for r in mine})
        if len(batches) < 2:
            continue
        ks = [_best_k([r for r in mine if r["batch_size"] == b]) for b in batches]
        starts = [1] + batches[1:]
        ends = [s - 1 for s in starts[1:]] + [batches[-1]]
        out[method] = [[s, e, k] for s, e, k in zip(starts, ends, ks)]
    return out


def _best_k(records: Sequence[Mapping[str, Any]], smallest: int = 0) -> int:
    """The k >= ``smallest`` (0 = no drafting, predicted 1) with the best geometric-mean
    predicted speedup over ``records``; ties go to the smaller k."""
    top = min(len(r["candidates"]) for r in records)

    def geo_mean(k: int) -> float:
        if k == 0:
            return 1.0
        vals = [max(r["candidates"][k - 1]["predicted_speedup"], 1e-12) for r in records]
        return math.exp(sum(math.log(v) for v in vals) / len(vals))

    return max(range(smallest, top + 1), key=lambda k: (geo_mean(k), -k))
