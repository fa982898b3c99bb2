"""`rlplace demo`: train a small policy, place a held-out model with it, compare with the baselines."""

from __future__ import annotations

import typer


def demo_cmd(
    steps: int = typer.Option(None, "--steps", min=1, help="training steps (default: the demo config's, ~15 min on 2 cores)"),
    out: str = typer.Option("runs", "--out", help="directory for the run, the plan and its Gantt chart"),
    model: str = typer.Option("gpt-medium", "--model", help="the held-out model to place"),
    topology: str = typer.Option("dgx-a100-80g", "--topology", "-t"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
) -> None:
    """End to end in about fifteen minutes on 2 cores: train, place a held-out model, print the comparison."""
    from agent.demo import run_demo

    run_demo(steps=steps, out=out, model=model, topology=topology, progress=progress, echo=typer.echo)


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_cmd)
