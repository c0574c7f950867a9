"""The harness report's outputs: results.json, results.md, PNG plots, and W&B logging.

Every file is written atomically (``infer/foundation/atomic.py``), so a reader (or a crashed run)
never sees
half a file. Plots use matplotlib's object API with the Agg canvas
(no pyplot state, no display needed):

- ``per_position_acceptance.png``: acceptance rate per draft position, one bar series per method
  (its largest measured k), one panel per (temperature, batch size);
- ``speedup_vs_k.png``: measured speedup (solid), predicted at the measured k (dashed) and the
  advisor's predicted curve over every k (dotted), per method and panel;
- ``acceptance_length_vs_k.png``: mean acceptance length per method and panel.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from infer.foundation.atomic import atomic_file, remove_leftovers, write_text
from infer.eval.advisor import advise_schedule
from infer.eval.machine import CONTENTION_CORES
from infer.eval.results import DRIFT_WARN, ConfigResult, HarnessReport
from infer.foundation.tracking import Logger

PLOTS = ("per_position_acceptance.png", "speedup_vs_k.png", "acceptance_length_vs_k.png")
TABLE_COLUMNS = ["method", "k", "temperature", "batch_size", "draft_sample_method",
                 "acceptance_length", "acceptance_rate", "per_position", "tok_s", "ar_tok_s",
                 "speedup", "predicted_speedup", "cost_draft", "cost_verify", "draft_coverage",
                 "lossless"]


def write_report(report: HarnessReport, output_dir: str | os.PathLike) -> dict:
    """results.json, results.md and the plots into ``output_dir``; returns ``report.files``."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out / "*")  # of a killed earlier write (one harness process writes here)
    report.output_dir = str(out)
    plots = [name for name, draw in zip(PLOTS, (_plot_per_position, _plot_speedup,
                                                _plot_acceptance_length))
             if report.results and _save_figure(draw(report), out / name)]
    report.files = {"json": "results.json", "markdown": "results.md", "plots": plots}
    write_text(out / "results.md", render_markdown(report))
    write_text(out / "results.json", json.dumps(report.to_dict(), indent=2) + "\n")
    return report.files


def log_report(report: HarnessReport, logger: Logger, *, step: int | None = None,
               prefix: str = "eval") -> None:
    """The results table, the plots written by ``write_report``, recommended k and losslessness."""
    rows = [[_table_value(asdict(r)[c]) for c in TABLE_COLUMNS] for r in report.results]
    logger.log_table(f"{prefix}/results", TABLE_COLUMNS, rows, step=step)
    scalars = {f"{prefix}/recommended_k/{m}": k for m, k in report.recommended_k.items()}
    scalars[f"{prefix}/lossless"] = float(report.lossless)
    logger.log(scalars, step=step)
    for name in report.files.get("plots", []):
        logger.log_image(f"{prefix}/{Path(name).stem}", Path(report.output_dir) / name, step=step)


def _table_value(value):
    """One type per column (W&B tables type-check columns): lists and the lossless flag
    (true / false / null) become strings."""
    if isinstance(value, list):
        return " ".join(f"{v:.3f}" for v in value)
    if value is None or isinstance(value, bool):
        return {None: "n/a", True: "yes", False: "NO"}[value]
    return value


# ---- markdown -------------------------------------------------------------------------------

def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _lossless_cell(value: bool | None) -> str:
    return "n/a (sampled)" if value is None else ("yes" if value else "**NO - MISMATCH**")


def render_markdown(report: HarnessReport) -> str:
    lines = _header(report) + _baselines_table(report) + _results_table(report)
    lines += _advisor_table(report)
    if report.files.get("plots"):
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in report.files["plots"]]
        lines.append("")
    return "\n".join(lines)


def _prompts(report: HarnessReport) -> str:
    """``16 prompts`` or ``16 prompts at batch 1, 64 at batch 8`` (requests_per_slot)."""
    counts = sorted({(r.batch_size, r.num_prompts) for r in report.results if r.num_prompts})
    if len({n for _, n in counts}) <= 1:
        return f"{counts[0][1] if counts else report.settings['num_prompts']} prompts"
    return ", ".join(f"{n} prompts at batch {b}" if i == 0 else f"{n} at batch {b}"
                     for i, (b, n) in enumerate(counts))


def _repeats(settings: dict) -> str:
    n = settings.get("repeats", 1)
    return (f" Speedups are medians of {n} rounds (each configuration once, between two "
            f"autoregressive runs)." if n > 1 else "")


def _header(report: HarnessReport) -> list[str]:
    s = report.settings
    machine = s.get("machine") or {}
    lines = ["# Acceptance evaluation", "",
             f"Target `{report.target}`, {_prompts(report)}, max_tokens "
             f"{s['max_tokens']}, device {s['device']}, {s.get('torch_threads')} torch threads, "
             f"{machine.get('usable_cores', '?')} usable cores, load average "
             f"{machine.get('load_average')} at the start, created {report.created}.{_repeats(s)}",
             ""]
    bad = [r for r in report.results if r.lossless is False]
    if bad:
        lines += ["**LOSSLESS CHECK FAILED**: greedy speculative outputs differ from "
                  "autoregressive decoding for:", ""]
        lines += [f"- {r.method} k={r.k} batch={r.batch_size}: prompts {r.mismatched_prompts}"
                  for r in bad]
        lines.append("")
    busy = [r for r in report.results if r.contended]
    busy += [b for b in report.baselines if b.other_cores is not None
             and b.other_cores > CONTENTION_CORES]
    if busy:
        lines += [f"**Other processes competed for the cores** during {len(busy)} timed runs "
                  "(marked `busy` below: their tok/s, speedups and costs are not to be trusted; "
                  "rerun on an idle machine).", ""]
    return lines + _drift_warning(report)


def _drift_warning(report: HarnessReport) -> list[str]:
    """Cells within which the machine itself changed speed (:attr:`Baseline.drifted`)."""
    drifted = [b for b in report.baselines if b.drifted]
    if not drifted:
        return []
    cells = ", ".join(f"batch {b.batch_size} T={b.temperature:g}: {b.tok_s:.1f} -> "
                      f"{b.tok_s_after:.1f} tok/s" for b in drifted)
    advice = ("their medians over the rounds damp it" if report.settings.get("repeats", 1) > 1
              else "rerun with eval.repeats=3 for medians")
    return [f"**The machine's speed drifted** within {len(drifted)} cell(s): the "
            f"autoregressive throughput moved by more than {DRIFT_WARN:.0%} across them "
            f"({cells}). A speedup measured there can be off by about as much; {advice}.", ""]


def _baselines_table(report: HarnessReport) -> list[str]:
    """Each cell's autoregressive run before its rows and the one after (a row's speedup is
    against their interpolation to the middle of its run)."""
    lines = ["## Autoregressive baselines", "",
             "Each cell's configurations ran back to back between these two runs; a row's speedup "
             "is against their throughput interpolated to the middle of its run.", "",
             _row(["batch", "temperature", "tok/s before", "tok/s after", "tokens", "s/step"]),
             _row(["---"] * 6)]
    return lines + [_row([b.batch_size, f"{b.temperature:g}", _tok_s(b.tok_s, b.other_cores),
                          f"{b.tok_s_after:.1f}" if b.tok_s_after else "-", b.tokens,
                          f"{b.c_ar_s * 1e3:.2f} ms"]) for b in report.baselines]


def _results_table(report: HarnessReport) -> list[str]:
    lines = ["", "## Results", "",
             "drafts: how the drafter's tokens were chosen (greedy: argmax, accepted with "
             "probability p(x); sampled: drawn from the drafter, accepted by the p/q test). ",
             "",
             _row(["method", "k", "T", "batch", "drafts", "accept len", "accept rate",
                   "per-position", "tok/s", "speedup", "predicted", "cost draft", "cost verify",
                   "coverage", "lossless"]), _row(["---"] * 15)]
    for r in report.results:
        drafts = "sampled" if r.draft_sample_method == "probabilistic" else "greedy"
        lines.append(_row([
            r.method, r.k, f"{r.temperature:g}", r.batch_size, drafts,
            f"{r.acceptance_length:.2f}", f"{r.acceptance_rate:.3f}",
            " ".join(f"{p:.2f}" for p in r.per_position), _tok_s(r.tok_s, r.other_cores),
            f"{r.speedup:.2f}", f"{r.predicted_speedup:.2f}", f"{r.cost_draft:.2f}",
            f"{r.cost_verify:.2f}", f"{r.draft_coverage:.2f}", _lossless_cell(r.lossless)]))
    return lines


def _tok_s(value: float, other_cores: float | None) -> str:
    busy = other_cores is not None and other_cores > CONTENTION_CORES
    return f"{value:.1f} busy ({other_cores:.2f} cores)" if busy else f"{value:.1f}"


def _advisor_table(report: HarnessReport) -> list[str]:
    lines = ["", "## k advisor", "",
             "Predicted speedup for every k up to the largest measured one, from the measured "
             "per-position acceptance and costs (cost model: docs/harness.md).", "",
             _row(["method", "batch", "T", "measured k", "recommended k", "predicted",
                   "predicted by k"]), _row(["---"] * 7)]
    for a in report.advisor:
        curve = " ".join(f"{c['k']}:{c['predicted_speedup']:.2f}" for c in a["candidates"])
        lines.append(_row([a["method"], a["batch_size"], f"{a['temperature']:g}",
                           ",".join(map(str, a["measured_ks"])), a["recommended_k"],
                           f"{a['predicted_speedup']:.2f}", curve]))
    rec = ", ".join(f"{m}: k={k}" for m, k in report.recommended_k.items()) or "none"
    lines += ["", f"Recommended k per method (all measured conditions): {rec}.", ""]
    for method, schedule in advise_schedule(report.advisor).items():
        lines.append(f"- {method}, k by batch size (0: no drafting), to paste into its "
                     f"speculative_config: `\"num_speculative_tokens_per_batch_size\": "
                     f"{json.dumps(schedule)}`")
    return lines + [""]


# ---- plots ----------------------------------------------------------------------------------

def _grid(report: HarnessReport, title: str) -> tuple[Figure, list]:
    """One panel per (temperature, batch size): temperatures down, batch sizes across."""
    temps = sorted({r.temperature for r in report.results})
    batches = sorted({r.batch_size for r in report.results})
    have = {(r.temperature, r.batch_size) for r in report.results}
    fig = Figure(figsize=(5.2 * len(batches), 3.8 * len(temps) + 0.6), layout="constrained")
    axes = fig.subplots(len(temps), len(batches), squeeze=False)
    panels = []
    for i, temp in enumerate(temps):
        for j, batch in enumerate(batches):
            ax = axes[i][j]
            if (temp, batch) not in have:
                ax.set_visible(False)
                continue
            ax.set_title(f"temperature {temp:g}, batch {batch}", fontsize=10)
            ax.grid(alpha=0.3)
            panels.append((ax, (temp, batch)))
    fig.suptitle(title)
    return fig, panels


def _by_method(report: HarnessReport, temp: float, batch: int) -> dict[str, list]:
    out: dict[str, list[ConfigResult]] = {}
    for r in report.results:
        if r.temperature == temp and r.batch_size == batch:
            out.setdefault(r.method, []).append(r)
    return {m: sorted(rows, key=lambda r: r.k) for m, rows in out.items()}


def _plot_per_position(report: HarnessReport) -> Figure:
    fig, panels = _grid(report, "Acceptance rate per draft position (largest k per method)")
    for ax, (temp, batch) in panels:
        methods = _by_method(report, temp, batch)
        width = 0.8 / max(1, len(methods))
        for i, (method, rows) in enumerate(methods.items()):
            rates = rows[-1].per_position
            xs = [p + 1 + (i - (len(methods) - 1) / 2) * width for p in range(len(rates))]
            ax.bar(xs, rates, width=width, label=f"{method} (k={rows[-1].k})")
        ax.set_xlabel("draft position")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
    return fig


def _plot_speedup(report: HarnessReport) -> Figure:
    fig, panels = _grid(report, "Speedup over autoregressive decoding vs k\n"
                                "solid: measured, dashed: predicted, dotted: advisor's curve")
    colors = _colors(report)
    for ax, (temp, batch) in panels:
        for method, rows in _by_method(report, temp, batch).items():
            c = colors[method]
            ks = [r.k for r in rows]
            ax.plot(ks, [r.speedup for r in rows], "o-", color=c, label=method)
            ax.plot(ks, [r.predicted_speedup for r in rows], "x--", color=c)
            adv = next((a for a in report.advisor if a["method"] == method
                        and a["batch_size"] == batch and a["temperature"] == temp), None)
            if adv and adv["candidates"]:
                ax.plot([x["k"] for x in adv["candidates"]],
                        [x["predicted_speedup"] for x in adv["candidates"]], ":", color=c,
                        alpha=0.6)
        ax.axhline(1.0, color="grey", lw=0.8)
        _k_axis(ax)
        ax.set_ylabel("speedup")
        ax.legend(fontsize=8)
    return fig


def _plot_acceptance_length(report: HarnessReport) -> Figure:
    fig, panels = _grid(report, "Mean acceptance length vs k")
    colors = _colors(report)
    for ax, (temp, batch) in panels:
        for method, rows in _by_method(report, temp, batch).items():
            ax.plot([r.k for r in rows], [r.acceptance_length for r in rows], "o-",
                    color=colors[method], label=method)
        _k_axis(ax)
        ax.set_ylabel("acceptance length")
        ax.legend(fontsize=8)
    return fig


def _k_axis(ax) -> None:
    ax.set_xlabel("k (num_speculative_tokens)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _colors(report: HarnessReport) -> dict[str, str]:
    methods = list(dict.fromkeys(r.method for r in report.results))
    return {m: f"C{i % 10}" for i, m in enumerate(methods)}


def _save_figure(fig: Figure, path: Path) -> bool:
    """Atomic PNG write; False when there is nothing to plot."""
    if not fig.axes:
        return False
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    return True
