"""`rlplace topology show NAME|FILE`: devices, links and the pairwise bandwidth matrix."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from envs.topology import resolve_topology


def show(name: str = typer.Argument(..., help="preset name (e.g. dgx-a100-80g, a100-80g-cluster:nodes=2) or yaml/JSON file")) -> None:
    """Print a topology's devices, links and pairwise bandwidth matrix (GB/s, achievable)."""
    topo = resolve_topology(name)
    con = Console(width=200)
    con.print(f"[bold]{topo.describe()}[/bold]")
    t = Table(title="devices")
    for c in ("#", "name", "kind", "host", "peak TFLOP/s (bf16)", "eff", "memory GB", "mem BW GB/s"):
        t.add_column(c)
    for i, d in enumerate(topo.devices):
        peak = d.peak_flops.get("bf16", max(d.peak_flops.values()))
        t.add_row(str(i), d.name, d.kind, str(d.host), f"{peak / 1e12:.1f}", f"{d.compute_eff:.2f}",
                  f"{d.memory_bytes / 1e9:.1f}", f"{d.mem_bw / 1e9:.0f}")
    con.print(t)
    lt = Table(title=f"links ({len(topo.links)})")
    for c in ("a", "b", "kind", "GB/s per dir", "eff", "latency us"):
        lt.add_column(c)
    for ln in topo.links[:64]:
        lt.add_row(ln.a, ln.b, ln.kind, f"{ln.bandwidth / 1e9:.1f}", f"{ln.efficiency:.2f}", f"{ln.latency * 1e6:.1f}")
    con.print(lt)
    if len(topo.links) > 64:
        con.print(f"... {len(topo.links) - 64} more links")
    n = min(topo.num_devices, 16)
    bt = Table(title="pairwise achievable bandwidth, GB/s" + (f" (first {n} devices)" if n < topo.num_devices else ""))
    bt.add_column("")
    for j in range(n):
        bt.add_column(str(j))
    bw = topo.bandwidth_matrix
    for i in range(n):
        bt.add_row(str(i), *["-" if i == j else f"{bw[i, j] / 1e9:.0f}" for j in range(n)])
    con.print(bt)


def register(app: typer.Typer) -> None:
    sub = typer.Typer(help="Inspect topologies (presets or files).", no_args_is_help=True)
    sub.command("show")(show)
    app.add_typer(sub, name="topology")
