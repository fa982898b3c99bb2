"""Topology speed: construction, ``rlplace topology show``, one row of routes and a full all-reduce.

For ``a100-80g-cluster`` with 1, 16, 128 (1,024 GPUs) and 1250 (10,000 GPUs) nodes, and ``dgx1-v100``,
times (wall seconds, each step on a freshly built topology so no route is cached from an earlier step):

- ``construct``: ``preset(spec)`` (validation and the link graph);
- ``show``: the ``rlplace topology show`` command function (construct + tables + first-16 bandwidth matrix),
  printed into a buffer;
- ``bw row``: ``bandwidth(0, j)`` for every device j;
- ``all_reduce``: ``collective_time("all_reduce", all devices, 1e9)`` (what a data-parallel simulation over
  every device needs).

Numba's compiled routing kernels are loaded once before the table (a tiny topology), as any later call in a
process would find them. Run: ``python -m experiments.bench_topology`` (``--nodes 1,16`` to choose sizes,
``--no-dgx1`` to leave out the DGX-1 row).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import time

from agent.commands.topology import show
from envs.presets import preset


def _timed(fn) -> float:
    """Wall seconds of one call of ``fn``."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _show(spec: str) -> None:
    """``rlplace topology show spec`` with its output thrown away."""
    with contextlib.redirect_stdout(io.StringIO()):
        show(spec)


def _bw_row(spec: str) -> float:
    """Seconds of ``bandwidth(0, j)`` for every j on a fresh topology (construction not counted)."""
    topo = preset(spec)
    return _timed(lambda: [topo.bandwidth(0, j) for j in range(topo.num_devices)])


def _all_reduce(spec: str) -> float:
    """Seconds of a 1 GB all-reduce over every device on a fresh topology (construction not counted)."""
    topo = preset(spec)
    return _timed(lambda: topo.collective_time("all_reduce", range(topo.num_devices), 1e9))


def bench_one(spec: str) -> dict:
    """One table row: seconds of each step for the preset ``spec``."""
    t0 = time.perf_counter()
    topo = preset(spec)
    construct = time.perf_counter() - t0
    return {"topology": spec, "devices": topo.num_devices, "construct": construct,
            "show": _timed(lambda: _show(spec)), "bw row": _bw_row(spec), "all_reduce": _all_reduce(spec)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="1,16,128,1250", help="comma-separated a100-80g-cluster node counts")
    ap.add_argument("--no-dgx1", action="store_true", help="leave out the dgx1-v100 row")
    args = ap.parse_args(argv)
    preset("dgx1-v100").collective_time("all_reduce", range(8), 1e9)  # load compiled kernels
    specs = [f"a100-80g-cluster:nodes={int(n)}" for n in args.nodes.split(",") if n.strip()]
    if not args.no_dgx1:
        specs.append("dgx1-v100")
    cols = ("construct", "show", "bw row", "all_reduce")
    print(f"{'topology':34s} {'devices':>8s} " + " ".join(f"{c:>11s}" for c in cols) + "   (seconds)")
    for spec in specs:
        row = bench_one(spec)
        print(f"{spec:34s} {row['devices']:8d} " + " ".join(f"{row[c]:11.3f}" for c in cols), flush=True)


if __name__ == "__main__":
    main()
