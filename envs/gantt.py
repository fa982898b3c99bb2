"""Gantt chart of a simulated step (one row per device: compute, communication, optimizer)."""

from __future__ import annotations

import os
from pathlib import Path

from envs.sim import StepReport

COLORS = {"compute": "#4C72B0", "comm": "#DD8452", "optimizer": "#55A868"}


def gantt_figure(report: StepReport, title: str = "", max_rows: int = 64):
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = report.timeline()
    used = sorted({r["device"] for r in rows})[:max_rows]
    pos = {d: i for i, d in enumerate(used)}
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(used) + 1.6))
    scale, unit = (1e3, "ms") if report.makespan < 10 else (1.0, "s")
    by_kind: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for r in rows:
        if r["device"] not in pos:
            continue
        by_kind.setdefault((r["device"], r["kind"]), []).append((r["start"] * scale, (r["end"] - r["start"]) * scale))
    for (d, kind), spans in by_kind.items():
        lane = pos[d] + (0.2 if kind == "comm" else 0.0)
        height = 0.35 if kind == "comm" else 0.6
        ax.broken_barh(spans, (lane - 0.3, height), facecolors=COLORS[kind], edgecolor="none")
    ax.set_yticks(range(len(used)))
    ax.set_yticklabels([report.device_names[d] for d in used])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title or f"step {report.value * scale:.3g} {unit} ({report.objective})")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items()], loc="upper right", fontsize=8)
    fig.tight_layout()
    return fig


def save_figure(fig, path: str | os.PathLike, dpi: int = 110) -> Path:
    """Write a matplotlib figure as PNG atomically (temp file + rename) and close it."""
    import matplotlib.pyplot as plt

    from envs.files import atomic_output

    try:
        with atomic_output(path, "image") as tmp:
            fig.savefig(tmp, dpi=dpi, format="png")
    finally:
        plt.close(fig)
    return Path(path)


def save_gantt(report: StepReport, path: str | os.PathLike, title: str = "") -> Path:
    """Render the Gantt chart of ``report`` and write it as a PNG atomically."""
    return save_figure(gantt_figure(report, title), path)
