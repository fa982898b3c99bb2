"""`rlplace bench --suite NAME|path.yaml [--policy CKPT] [--budget-seconds S] [--out DIR]`: every placer
on every case of a benchmark suite; writes results.csv, results.md, ratios.png and Gantt charts."""

from __future__ import annotations

import typer

from agent.placers.common import Budget


def bench_cmd(
    suite: str = typer.Option("default", "--suite", "-s", help="suite name (the checkout's experiments/suites/NAME.yaml) or yaml path"),
    policy: str = typer.Option(None, "--policy", help="checkpoint of a trained policy to include (needs agent.infer)"),
    budget_seconds: float = typer.Option(None, "--budget-seconds", min=0.001, max=86_400.0, help="wall-clock budget per search placer and case "
                                         "(replaces the suite's budget; results then depend on machine speed)"),
    budget_evaluations: int = typer.Option(None, "--budget-evaluations", min=1, help="simulator evaluations per search placer "
                                           "and case (replaces the suite's budget)"),
    out: str = typer.Option("experiments/results", "--out", "-o", help="output folder"),
    no_gantt: bool = typer.Option(False, "--no-gantt", help="skip the Gantt charts of the best plans"),
) -> None:
    """Benchmark the placers on a suite of cases against lower bounds."""
    from agent.benchmark.runner import run_suite
    from agent.benchmark.suite import load_suite
    from envs.files import check_output_dir

    check_output_dir(out, "output folder")
    s = load_suite(suite)
    budget = None
    if budget_seconds is not None or budget_evaluations is not None:
        budget = Budget(seconds=budget_seconds, evaluations=budget_evaluations)
    rows = run_suite(s, out, budget=budget, policy=policy, log=typer.echo, gantt=not no_gantt)
    typer.echo(f"{len(rows)} results for {len({r.case for r in rows})} cases written to {out}/results.md, "
               f"results.csv, ratios.png")


def register(app: typer.Typer) -> None:
    app.command("bench")(bench_cmd)
