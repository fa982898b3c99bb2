"""`rlplace export plan.json --model SPEC --to megatron|deepspeed|torchtitan [--out FILE]`: a plan as the
launch arguments / config file of a training runtime (``agent.export``)."""

from __future__ import annotations

from enum import Enum

import typer

from agent.export import RUNTIMES

Runtime = Enum("Runtime", {name: name for name in RUNTIMES}, type=str)  # typer shows and checks the choices

WHAT = {"megatron": "Megatron-LM launch script", "deepspeed": "DeepSpeed config", "torchtitan": "torchtitan config"}


def export_cmd(
    plan: str = typer.Argument(..., help="plan JSON file (made for the graph of --model)"),
    model: str = typer.Option(..., "--model", "-m", help="graph JSON, built-in graph (gpt-small, gpt-tiny, ...) or model spec (gpt:layers=4)"),
    to: Runtime = typer.Option(..., "--to", help="megatron (pretrain_gpt.py arguments), deepspeed (config JSON) "
                               "or torchtitan (job TOML)"),
    out: str = typer.Option(None, "--out", "-o", help="file to write (default: print to stdout)"),
) -> None:
    """Write a plan as Megatron-LM arguments, a DeepSpeed config or a torchtitan TOML. Plans a runtime
    cannot express (non-uniform placements, mixed layouts or settings) exit 2 and write nothing."""
    from agent.export import export
    from agent.resolve import resolve_graph
    from envs.files import atomic_write_text, check_output_path
    from envs.plan import Plan

    runtime = to.value
    if out:
        check_output_path(out, WHAT[runtime])
    graph = resolve_graph(model)
    exported = export(Plan.load(plan), graph, runtime)
    if out:
        atomic_write_text(out, exported.text, WHAT[runtime])
    else:
        typer.echo(exported.text, nl=False)
    for note in exported.notes:
        typer.echo(f"note: {note}", err=True)
    if out:
        typer.echo(f"{WHAT[runtime]} written to {out}", err=True)


def register(app: typer.Typer) -> None:
    app.command("export")(export_cmd)
