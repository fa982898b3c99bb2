"""`rlplace topology show NAME|FILE`: devices, links and the pairwise bandwidth matrix."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from envs.presets import resolve_topology
from envs.topology import Topology

SHOWN = 64  # rows of the device and link tables; the rest is one "... N more" line
MATRIX = 16  # devices of the pairwise bandwidth matrix (routes of these rows only are computed)


def show(name: str = typer.Argument(..., help="preset name (e.g. dgx-a100-80g, a100-80g-cluster:nodes=2) or yaml/JSON file")) -> None:
    """Print a topology's devices, links and pairwise bandwidth matrix (GB/s, achievable)."""
    render(resolve_topology(name))


def render(topo: Topology, con: Console | None = None) -> None:
    """The tables of ``topology show``: at most ``SHOWN`` devices and links, the first ``MATRIX`` x ``MATRIX``
    bandwidths (bounded output and work on any size of topology)."""
    con = con or Console(width=200)
    con.print(f"[bold]{topo.describe()}[/bold]")
    t = Table(title=f"devices ({topo.num_devices})")
    for c in ("#", "name", "kind", "host", "peak TFLOP/s (bf16)", "eff", "memory GB", "mem BW GB/s"):
        t.add_column(c)
    for i, d in enumerate(topo.devices[:SHOWN]):
        peak = d.peak_flops.get("bf16", max(d.peak_flops.values()))
        t.add_row(str(i), d.name, d.kind, str(d.host), f"{peak / 1e12:.1f}", f"{d.compute_eff:.2f}",
                  f"{d.memory_bytes / 1e9:.1f}", f"{d.mem_bw / 1e9:.0f}")
    con.print(t)
    if topo.num_devices > SHOWN:
        con.print(f"... {topo.num_devices - SHOWN} more devices")
    lt = Table(title=f"links ({len(topo.links)})")
    for c in ("a", "b", "kind", "GB/s per dir", "eff", "latency us"):
        lt.add_column(c)
    for ln in topo.links[:SHOWN]:
        lt.add_row(ln.a, ln.b, ln.kind, f"{ln.bandwidth / 1e9:.1f}", f"{ln.efficiency:.2f}", f"{ln.latency * 1e6:.1f}")
    con.print(lt)
    if len(topo.links) > SHOWN:
        con.print(f"... {len(topo.links) - SHOWN} more links")
    n = min(topo.num_devices, MATRIX)
    bt = Table(title="pairwise achievable bandwidth, GB/s" + (f" (first {n} devices)" if n < topo.num_devices else ""))
    bt.add_column("")
    for j in range(n):
        bt.add_column(str(j))
    for i in range(n):
        bt.add_row(str(i), *["-" if i == j else f"{topo.bandwidth(i, j) / 1e9:.0f}" for j in range(n)])
    con.print(bt)


def register(app: typer.Typer) -> None:
    sub = typer.Typer(help="Inspect topologies (presets or files).", no_args_is_help=True)
    sub.command("show")(show)
    app.add_typer(sub, name="topology")
