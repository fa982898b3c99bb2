"""The report of a benchmark run: ``results.csv``, ``results.md`` and ``ratios.png`` (each atomic).

``results.md`` has a summary (per case: lower bound, best placer, its ratio to the bound, and every
placer's and agent column's time over the best baseline's), a line per agent column (how often it beats
the best baseline, the geometric mean of its ratio), the classic-vs-today's plan space comparison when
the run has both ``megatron_3d_classic`` and ``megatron_3d``, the details of every run, and the lower
bounds' parts; ``ratios.png`` draws the same ratios as a heat map next to each case's gap to its lower
bound. The baselines are :data:`agent.placers.PLACERS`; ``policy``, ``policy+search`` and
``human_expert`` are compared with them but never count as the best baseline.
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
    from agent.benchmark.suite import AgentSettings, Suite

AGENT = ("policy", "policy+search")
TIE = 1e-9  # relative: closer than this to the best baseline is a tie


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
    note: str = ""  # the plan in a few words: a template's configuration, the agent's winning candidate


def plan_note(provenance: dict) -> str:
    """A few words on a plan: which candidate the agent returned, and a Megatron configuration
    (``tp2 pp4 dp1 mb1 zero1 rc=selective``...) when the plan is one."""
    winner = provenance.get("winner")
    config = _config_note(provenance.get("config"))
    if winner:
        return f"{winner}: {config}" if config else str(winner)
    return config


def _config_note(cfg) -> str:
    if isinstance(cfg, dict) and "tp" in cfg:
        parts = [f"tp{cfg['tp']} pp{cfg.get('pp', 1)} dp{cfg.get('dp', 1)} mb{cfg.get('microbatch_size', '?')}"]
        if cfg.get("virtual_stages", 1) != 1:
            parts.append(f"v{cfg['virtual_stages']}")
        if cfg.get("zero"):
            parts.append(f"zero{cfg['zero']}")
        if cfg.get("sequence_parallel"):
            parts.append("sp")
        if cfg.get("recompute", "none") != "none":
            parts.append(f"rc={cfg['recompute']}")
        if cfg.get("expert_parallel", 1) != 1:
            parts.append(f"ep{cfg['expert_parallel']}")
        return " ".join(parts)
    return ""


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


def write_report(rows: list[Row], bounds: dict[str, dict], suite: Suite, out: Path, budget: Budget,
                 agent: AgentSettings | None = None) -> None:
    """results.csv, results.md and ratios.png in ``out`` (each written atomically)."""
    buf = io.StringIO()
    fields = list(Row.__dataclass_fields__)
    w = csv.writer(buf)
    w.writerow(fields)
    for r in rows:
        w.writerow([getattr(r, f) for f in fields])
    atomic_write_text(out / "results.csv", buf.getvalue())
    atomic_write_text(out / "results.md", markdown(rows, bounds, suite, budget, agent))
    if rows:
        _plot(rows, out / "ratios.png")


def best_baseline(rows: list[Row]) -> Row | None:
    """The best baseline (:data:`PLACERS`) row of one case's rows: plans that fit first, then time."""
    ok = [r for r in rows if r.status == "ok" and r.placer in PLACERS]
    fit = [r for r in ok if not r.oom] or ok
    return min(fit, key=lambda r: r.predicted) if fit else None


def versus(row: Row, base: Row) -> int:
    """-1 if ``row`` beats ``base`` (fits where it does not, or is faster by more than :data:`TIE`),
    0 for a tie, 1 if it loses."""
    if row.oom != base.oom:
        return -1 if base.oom else 1
    if row.predicted < base.predicted * (1 - TIE):
        return -1
    return 0 if row.predicted <= base.predicted * (1 + TIE) else 1


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if np.isfinite(x) and x > 0]
    return float(np.exp(np.mean(np.log(xs)))) if xs else math.nan


def agent_summary(rows: list[Row], column: str) -> dict | None:
    """How ``column`` (``policy``, ``policy+search``) did against the best baseline over the cases where
    both ran: ``wins``, ``ties``, ``losses``, ``cases``, ``oom`` (its plans out of memory), ``errors``,
    ``geomean`` (of its time over the best baseline's, over the ``fitting`` cases: its plan fits memory,
    or neither fits; a plan that does not fit is no speed-up). None without such rows."""
    cases = list(dict.fromkeys(r.case for r in rows))
    out = {"wins": 0, "ties": 0, "losses": 0, "cases": 0, "oom": 0, "errors": 0}
    ratios = []
    seen = False
    for c in cases:
        crow = [r for r in rows if r.case == c]
        mine = next((r for r in crow if r.placer == column), None)
        base = best_baseline(crow)
        if mine is None or base is None:
            continue
        seen = True
        out["cases"] += 1
        if mine.status != "ok":
            out["errors"] += 1
            out["losses"] += 1
            continue
        out["oom"] += int(mine.oom)
        out[("wins", "ties", "losses")[versus(mine, base) + 1]] += 1
        if not mine.oom or base.oom:
            ratios.append(mine.predicted / base.predicted)
    out["geomean"] = geomean(ratios)
    out["fitting"] = len(ratios)
    return out if seen else None


def _agent_lines(rows: list[Row], agent: AgentSettings | None) -> list[str]:
    lines = []
    for col in AGENT:
        s = agent_summary(rows, col)
        if s is None:
            continue
        extra = [f"{s['ties']} tie{'s' if s['ties'] != 1 else ''}"]
        if s["oom"]:
            extra.append(f"{s['oom']} out of memory")
        if s["errors"]:
            extra.append(f"{s['errors']} error{'s' if s['errors'] != 1 else ''}")
        if s["fitting"] == 0:
            mean = "none of its plans fits memory where a baseline's does"
        else:
            over = "" if s["fitting"] == s["cases"] else f" over the {s['fitting']} cases where its plan fits"
            mean = f"geometric mean {col} / best baseline **{_fmt_r(s['geomean'])}**{over}"
        lines.append(f"- `{col}` beats the best baseline in **{s['wins']} of {s['cases']}** cases "
                     f"({', '.join(extra)}); {mean}.")
    if not lines:
        return []
    head = "**Agent**"
    if agent is not None:
        head += (f" ({agent.describe()}): `policy` is the policy zero-shot, the best of its greedy rollout and "
                 f"{agent.samples} sampled ones; `policy+search` is `agent.infer.place` with "
                 f"{agent.evaluations} evaluations of policy-guided search from the best of the policy and "
                 "`place`'s fast baselines")
    return [head + ".", "", *lines, ""]


def _space_lines(rows: list[Row]) -> list[str]:
    """Per case, the best plan of the classic space (megatron_3d_classic) vs today's (megatron_3d)."""
    by = {(r.case, r.placer): r for r in rows}
    cases = [c for c in dict.fromkeys(r.case for r in rows)
             if (c, "megatron_3d") in by and (c, "megatron_3d_classic") in by]
    if not cases:
        return []
    lines = ["## Plan spaces: classic vs today's", "",
             "`megatron_3d_classic` sweeps the classic space (tensor, pipeline and data parallelism, recomputation "
             "none or full); `megatron_3d` today's (also ZeRO, sequence parallelism, selective recomputation, "
             "interleaving, expert parallelism), same budget.", "",
             "| case | classic best | time | today's best | time | speed-up |", "|---|---|---|---|---|---|"]
    ups = []
    for c in cases:
        a, b = by[(c, "megatron_3d_classic")], by[(c, "megatron_3d")]
        if a.status != "ok" or b.status != "ok":
            lines.append(f"| {c} | {a.note if a.status == 'ok' else a.status} | — | "
                         f"{b.note if b.status == 'ok' else b.status} | — | — |")
            continue
        up = a.predicted / b.predicted
        ups.append(up)
        lines.append(f"| {c} | {a.note} | {_fmt_t(a.predicted, a.unit)}{' OOM' if a.oom else ''} | {b.note} | "
                     f"{_fmt_t(b.predicted, b.unit)}{' OOM' if b.oom else ''} | {up:.3f} |")
    lines += ["", f"Geometric mean speed-up of today's space over the classic one: {_fmt_r(geomean(ups))} "
                  f"({len(ups)} cases).", ""]
    return lines


def markdown(rows: list[Row], bounds: dict[str, dict], suite: Suite, budget: Budget,
             agent: AgentSettings | None = None) -> str:
    cases = list(dict.fromkeys(r.case for r in rows))
    placers = list(dict.fromkeys(r.placer for r in rows))
    by = {(r.case, r.placer): r for r in rows}
    lines = [f"# Benchmark suite `{suite.name}`", "",
             f"Seed {suite.seed}; search placers ({', '.join(SEARCH_PLACERS)}) budget: "
             f"{budget.evaluations or '∞'} evaluations / {budget.seconds or '∞'} s. Times are simulated "
             "(`step_time`: one training step; `throughput`: steady-state time per global batch, for the "
             "dnn-partitioning workloads the paper's max-load in its time unit). Ratios: to the best baseline "
             "that fits memory, and to the lower bound (`agent/lower_bound.py`). OOM = out of memory.", "",
             "## Summary", "", *_agent_lines(rows, agent),
             "| case | objective | lower bound | best placer | best | best / LB | " + " | ".join(placers) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(placers)]
    for c in cases:
        crow = [by[(c, p)] for p in placers if (c, p) in by]
        best = best_baseline(crow)
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
    lines += ["", "Per-placer cells: predicted time / best baseline's (below 1: better than every baseline).", "",
              *_space_lines(rows), "## Details", "",
              "| case | placer | predicted | / best | / LB | planning s | peak mem GB | OOM | evals | plan |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pred = _fmt_t(r.predicted, r.unit) if r.status == "ok" else r.status
        lines.append(f"| {r.case} | {r.placer} | {pred} | {_fmt_r(r.ratio_best)} | {_fmt_r(r.ratio_lb)} | "
                     f"{r.planning_s:.2f} | {r.peak_memory_gb:.3g} | {'yes' if r.oom else 'no'} | {r.evaluations} | "
                     f"{r.note} |")
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
    from matplotlib.patches import Rectangle

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
    best = {c: best_baseline([by[(c, p)] for p in placers if (c, p) in by]) for c in cases}
    for i in range(len(cases)):
        for j in range(len(placers)):
            r = by.get((cases[i], placers[j]))
            if r is not None and np.isfinite(M[i, j]):
                ax.text(j, i, f"{M[i, j]:.2f}" + ("\nOOM" if r.oom else ""), ha="center", va="center", fontsize=6,
                        color="white" if M[i, j] > 2.5 else "black")
                b = best[cases[i]]
                if r.placer not in PLACERS and b is not None and versus(r, b) < 0:  # beats every baseline
                    ax.add_patch(Rectangle((j - 0.46, i - 0.44), 0.92, 0.88, fill=False, edgecolor="#E4572E", lw=2))
    first_agent = next((j for j, p in enumerate(placers) if p not in PLACERS), None)
    if first_agent:  # the agent (and human-expert) columns, apart from the baselines
        ax.axvline(first_agent - 0.5, color="w", lw=2.5)
    ax.set_xlim(-0.5, len(placers) - 0.5)
    ax.set_ylim(len(cases) - 0.5, -0.5)
    ax.set_xticks(range(len(placers)))
    ax.set_xticklabels(placers, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(cases)))
    ax.set_yticklabels(cases, fontsize=8)
    ax.set_title("predicted time / best baseline (log colour, capped at 8x; framed: beats every baseline)",
                 fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.03, label="log2 ratio")
    best_lb = [best[c].ratio_lb if best[c] is not None else np.nan for c in cases]
    ax2.barh(range(len(cases)), best_lb, color="#4C72B0")
    ax2.axvline(1.0, color="k", lw=0.8)
    ax2.set_yticks(range(len(cases)))
    ax2.set_yticklabels([])
    ax2.set_ylim(len(cases) - 0.5, -0.5)  # row for row with the heat map
    ax2.set_xlabel("best / lower bound")
    ax2.set_title("gap to the lower bound", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


__all__ = ["write_report", "markdown", "slug", "plan_note", "best_baseline", "agent_summary", "geomean", "versus"]
