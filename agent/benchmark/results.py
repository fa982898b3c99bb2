"""The report of a benchmark run: ``results.csv``, ``results.md`` and ``ratios.png`` (each atomic).

``results.md`` has a summary (per case: lower bound, best placer, its ratio to the bound, and every
placer's time over the best baseline's), the details of every run, and the lower bounds' parts;
``ratios.png`` draws the same ratios as a heat map next to each case's gap to its lower bound.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from agent.placers import PLACERS, SEARCH_PLACERS, Budget
from envs.files import atomic_write_text
from envs.gantt import save_figure

if TYPE_CHECKING:
    from agent.benchmark.suite import Suite


@dataclass
class Row:
    """One run of one placer on one case: a line of results.csv."""

    case: str
    placer: str
    graph: str
    topology: str
    objective: str
    nodes: int
    devices: int
    predicted: float
    peak_memory_gb: float
    oom: bool
    planning_s: float
    evaluations: int
    lower_bound: float
    ratio_best: float = math.nan
    ratio_lb: float = math.nan
    status: str = "ok"
    unit: str = "s"  # "s", or the workload's own time unit (dnn-partitioning: the paper's ms)


def slug(name: str) -> str:
    """A file name for a case name."""
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)


def _fmt_t(t: float, unit: str = "s") -> str:
    if t is None or not np.isfinite(t):
        return "—"
    if unit != "s":  # a workload's own unit (dnn-partitioning files: milliseconds)
        return f"{t:.4g} {unit}"
    if t >= 1:
        return f"{t:.3g} s" if t < 1000 else f"{t:.4g}"
    return f"{t * 1e3:.3g} ms"


def _fmt_r(x: float) -> str:
    return "—" if not np.isfinite(x) else f"{x:.2f}"


def write_report(rows: list[Row], bounds: dict[str, dict], suite: Suite, out: Path, budget: Budget) -> None:
    """results.csv, results.md and ratios.png in ``out`` (each written atomically)."""
    buf = io.StringIO()
    fields = list(Row.__dataclass_fields__)
    w = csv.writer(buf)
    w.writerow(fields)
    for r in rows:
        w.writerow([getattr(r, f) for f in fields])
    atomic_write_text(out / "results.csv", buf.getvalue())
    atomic_write_text(out / "results.md", markdown(rows, bounds, suite, budget))
    if rows:
        _plot(rows, out / "ratios.png")


def markdown(rows: list[Row], bounds: dict[str, dict], suite: Suite, budget: Budget) -> str:
    cases = list(dict.fromkeys(r.case for r in rows))
    placers = list(dict.fromkeys(r.placer for r in rows))
    by = {(r.case, r.placer): r for r in rows}
    lines = [f"# Benchmark suite `{suite.name}`", "",
             f"Seed {suite.seed}; search placers ({', '.join(SEARCH_PLACERS)}) budget: "
             f"{budget.evaluations or '∞'} evaluations / {budget.seconds or '∞'} s. Times are simulated "
             "(`step_time`: one training step; `throughput`: steady-state time per global batch, for the "
             "dnn-partitioning workloads the paper's max-load in its time unit). Ratios: to the best baseline "
             "that fits memory, and to the lower bound (`agent/lower_bound.py`). OOM = out of memory.", "",
             "## Summary", "",
             "| case | objective | lower bound | best placer | best | best / LB | " + " | ".join(placers) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(placers)]
    for c in cases:
        crow = [by[(c, p)] for p in placers if (c, p) in by]
        ok = [r for r in crow if r.status == "ok" and r.placer in PLACERS]
        fit = [r for r in ok if not r.oom] or ok
        best = min(fit, key=lambda r: r.predicted) if fit else None
        cells = []
        for p in placers:
            r = by.get((c, p))
            if r is None:
                cells.append("")
            elif r.status != "ok":
                cells.append("error")
            else:
                cells.append(_fmt_r(r.ratio_best) + (" OOM" if r.oom else ""))
        lb, u = bounds[c]["lower_bound"], bounds[c]["unit"]
        lines.append(f"| {c} | {crow[0].objective} | {_fmt_t(lb, u)} | {best.placer if best else '—'} | "
                     f"{_fmt_t(best.predicted, u) if best else '—'} | {_fmt_r(best.predicted / lb) if best else '—'} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Per-placer cells: predicted time / best baseline's.", "", "## Details", "",
              "| case | placer | predicted | / best | / LB | planning s | peak mem GB | OOM | evals |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pred = _fmt_t(r.predicted, r.unit) if r.status == "ok" else r.status
        lines.append(f"| {r.case} | {r.placer} | {pred} | {_fmt_r(r.ratio_best)} | {_fmt_r(r.ratio_lb)} | "
                     f"{r.planning_s:.2f} | {r.peak_memory_gb:.3g} | {'yes' if r.oom else 'no'} | {r.evaluations} |")
    lines += ["", "## Lower bounds", "", "| case | lower bound | any plan (incl. OOM) | critical path | aggregate | "
              "aggregate with memory | largest op | min devices for states |", "|---|---|---|---|---|---|---|---|"]
    for c in cases:
        b, u = bounds[c], bounds[c]["unit"]
        lines.append(f"| {c} | {_fmt_t(b['lower_bound'], u)} | {_fmt_t(b['lower_bound_any'], u)} | "
                     f"{_fmt_t(b['critical_path'], u)} | {_fmt_t(b['aggregate'], u)} | "
                     f"{_fmt_t(b['aggregate_memory'], u) if b['aggregate_memory'] is not None else 'infeasible'} | "
                     f"{_fmt_t(b['largest_op'], u)} | {b['min_devices_for_states'] or 'more than available'} |")
    return "\n".join(lines) + "\n"


def _plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r.case for r in rows))
    placers = list(dict.fromkeys(r.placer for r in rows))
    by = {(r.case, r.placer): r for r in rows}
    M = np.full((len(cases), len(placers)), np.nan)
    for i, c in enumerate(cases):
        for j, p in enumerate(placers):
            r = by.get((c, p))
            if r is not None and np.isfinite(r.ratio_best):
                M[i, j] = r.ratio_best
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(6 + 0.8 * len(placers), 1.5 + 0.45 * len(cases)),
                                  gridspec_kw={"width_ratios": [len(placers), 3]})
    im = ax.imshow(np.log2(np.clip(M, 1, 64)), cmap="viridis_r", aspect="auto", vmin=0, vmax=3)
    for i in range(len(cases)):
        for j in range(len(placers)):
            r = by.get((cases[i], placers[j]))
            if r is not None and np.isfinite(M[i, j]):
                ax.text(j, i, f"{M[i, j]:.2f}" + ("\nOOM" if r.oom else ""), ha="center", va="center", fontsize=6,
                        color="white" if M[i, j] > 2.5 else "black")
    ax.set_xticks(range(len(placers)))
    ax.set_xticklabels(placers, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(cases)))
    ax.set_yticklabels(cases, fontsize=8)
    ax.set_title("predicted time / best baseline (log colour, capped at 8x)", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.03, label="log2 ratio")
    best_lb = []
    for c in cases:
        ok = [by[(c, p)] for p in placers if (c, p) in by and by[(c, p)].status == "ok" and by[(c, p)].placer in PLACERS]
        fit = [r for r in ok if not r.oom] or ok
        best_lb.append(min(r.ratio_lb for r in fit) if fit else np.nan)
    ax2.barh(range(len(cases)), best_lb, color="#4C72B0")
    ax2.axvline(1.0, color="k", lw=0.8)
    ax2.set_yticks(range(len(cases)))
    ax2.set_yticklabels([])
    ax2.invert_yaxis()
    ax2.set_xlabel("best / lower bound")
    ax2.set_title("gap to the lower bound", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


__all__ = ["write_report", "markdown", "slug"]
