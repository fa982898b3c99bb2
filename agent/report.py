"""What a placement looks like to a person: the candidates table and the winner's timeline.

Shared by ``rlplace place`` (:mod:`agent.commands.place`) and the demo (:mod:`agent.demo`); library code,
so it imports nothing of the command line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from envs.graph import OpGraph
    from envs.sim import StepReport
    from envs.topology import Topology


def format_time(t: float) -> str:
    """Milliseconds below ten seconds, seconds above."""
    return f"{t * 1e3:.3f} ms" if t < 10 else f"{t:.2f} s"


def print_comparison(result, objective: str, title: str = "", console: Console | None = None) -> None:
    """The candidates of a :class:`agent.infer.PlaceResult` as a table (best first)."""
    con = console or Console(width=140)
    base = result.best_baseline()
    t = Table(title=title or f"objective: {objective}")
    for c in ("candidate", "kind", "time", "vs best baseline", "peak memory / device", "OOM"):
        t.add_column(c)
    seen: set[str] = set()
    for c in result.candidates:
        if c.kind == "policy" and c.name.split(" sample")[0] in seen and c is not result.best:
            continue  # one row per rollout kind (the best sample) keeps the table short
        seen.add(c.name.split(" sample")[0])
        vs = f"x{base.value / c.value:.3f}" if base is not None and c.value > 0 else "-"
        style = "bold green" if c is result.best else None
        t.add_row(c.name, c.kind, format_time(c.value), vs, f"{c.peak_memory / 1e9:.2f} GB",
                  "yes" if c.oom else "no", style=style)
    con.print(t)


def winner_timeline(result, graph: OpGraph, topology: Topology, objective: str) -> StepReport:
    """The one timeline simulation of the returned plan, for its Gantt chart (a whole training step:
    the throughput objective's steady state has no single step to draw)."""
    from envs.sim import simulate

    return simulate(graph, topology, result.plan, "step_time" if objective == "throughput" else objective)


__all__ = ["print_comparison", "winner_timeline", "format_time"]
