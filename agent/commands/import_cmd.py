"""`rlplace import --format dnn-partitioning FILE -o OUTDIR [--split EXPERT.json]`: public workloads
into rlplace files (OUTDIR/graph.json, OUTDIR/topology.json and optionally OUTDIR/plan.json)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import typer

from envs.errors import RlplaceError
from envs.graph import OpGraph
from envs.plan import Plan
from envs.topology import Topology


class ImportFormatError(RlplaceError):
    """The requested import format is unknown or cannot take the given options."""


def _dnn_partitioning() -> tuple[Callable[[str], tuple[OpGraph, Topology]],
                                 Callable[[str, OpGraph, Topology], Plan]]:
    from profilers.dnn_partitioning import import_split, import_workload

    return import_workload, import_split


FORMATS: dict[str, Callable[[], tuple]] = {"dnn-partitioning": _dnn_partitioning}


def import_files(fmt: str, file: str, outdir: str, split: str | None = None) -> dict[str, Path]:
    """Convert ``file`` (and an optional ``split``) of format ``fmt``; write rlplace JSON files into
    ``outdir`` (each written atomically) and return their paths. Nothing is written if reading fails."""
    if fmt not in FORMATS:
        raise ImportFormatError(f"unknown import format {fmt!r}; choose one of {', '.join(sorted(FORMATS))}")
    from envs.files import check_output_dir

    out = check_output_dir(outdir, "output folder")
    read_workload, read_split = FORMATS[fmt]()
    graph, topo = read_workload(file)
    plan = read_split(split, graph, topo).bind(graph) if split else None
    paths = {"graph": out / "graph.json", "topology": out / "topology.json"}
    graph.save(paths["graph"])
    topo.save(paths["topology"])
    if plan is not None:
        paths["plan"] = out / "plan.json"
        plan.save(paths["plan"])
    return paths


def import_cmd(
    file: str = typer.Argument(..., help="workload file to import"),
    fmt: str = typer.Option("dnn-partitioning", "--format", "-f", help="input format: dnn-partitioning"),
    outdir: str = typer.Option(..., "--output", "-o", help="folder for graph.json, topology.json (and plan.json)"),
    split: str = typer.Option(None, "--split", help="a split file (e.g. a human-expert placement) to import as plan.json"),
) -> None:
    """Import a public placement workload as graph.json + topology.json (+ plan.json from --split)."""
    paths = import_files(fmt, file, outdir, split)
    graph = OpGraph.load(paths["graph"])
    msg = f"{graph.summary()} -> {', '.join(str(p) for p in paths.values())}"
    if "plan" in paths and fmt == "dnn-partitioning":
        from profilers.dnn_partitioning import max_load

        ml = max_load(graph, Topology.load(paths["topology"]), Plan.load(paths["plan"]))
        msg += f" (split max-load {ml:.6g})"
    typer.echo(msg)


def register(app: typer.Typer) -> None:
    app.command("import")(import_cmd)
