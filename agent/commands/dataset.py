"""`rlplace dataset build DIR --tasks N --seed S --evaluations E [--ray | --ray-address ADDR]` and
`rlplace dataset show DIR`: the best-known-plans dataset (``agent.dataset``)."""

from __future__ import annotations

import typer


def _fail(message: str):
    from agent.dataset import DatasetError

    raise DatasetError(message)


def build_cmd(
    directory: str = typer.Argument(..., help="dataset directory (created; an existing one is resumed)"),
    tasks: int = typer.Option(16, "--tasks", "-n", help="number of tasks drawn from the distribution"),
    seed: int = typer.Option(0, "--seed", help="seed of the task distribution and of every search"),
    evaluations: int = typer.Option(800, "--evaluations", "-e", help="simulator evaluations of MCMC per task"),
    objective: str = typer.Option("step_time", "--objective", help="step_time, throughput or latency"),
    families: str = typer.Option(None, "--families", help="comma list of task families (default: all)"),
    ray: bool = typer.Option(False, "--ray", help="run the tasks on a local Ray instance (pip install 'rlplace[scale]')"),
    ray_address: str = typer.Option(None, "--ray-address", help="join the Ray cluster at HOST:PORT (or 'auto')"),
    num_cpus: int = typer.Option(None, "--num-cpus", help="workers of a local Ray instance (default: all cores)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
) -> None:
    """Draw --tasks tasks, run the fast heuristics and MCMC from the best one on each, and append each
    task's best plan to DIR as it finishes. Re-running resumes: finished tasks are skipped. Bad input
    (another dataset version, other settings than DIR was built with, an unreachable Ray cluster)
    exits 2 with one line and writes nothing."""
    from pathlib import Path

    from agent.dataset import Dataset, build, jobs_from_draws
    from agent.distribution import FAMILIES, draw_tasks
    from agent.distribution.progress import drawing
    from agent.scale import Executor
    from envs.sim import OBJECTIVES

    if tasks < 0:
        _fail(f"--tasks must be >= 0, got {tasks}")
    if evaluations < 1:
        _fail(f"--evaluations must be >= 1, got {evaluations}")
    if objective not in OBJECTIVES:
        _fail(f"unknown --objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
    if num_cpus is not None and num_cpus < 1:
        _fail(f"--num-cpus must be >= 1, got {num_cpus}")
    fams = [f.strip() for f in families.split(",") if f.strip()] if families else list(FAMILIES)
    params = {"seed": seed, "evaluations": evaluations, "objective": objective, "families": fams}
    exists = (Path(directory) / "manifest.json").exists()
    if exists:  # check the version and settings before any work
        Dataset.open(directory, params=params)
    with Executor(ray=ray, address=ray_address, num_cpus=num_cpus) as ex:  # Ray is reached before any tracing
        with drawing(tasks, not quiet) as on_draw:
            draws = draw_tasks(tasks, seed, fams, on_draw=on_draw)
        jobs = jobs_from_draws(draws, evaluations=evaluations, objective=objective)
        ds = Dataset.open(directory, create=True, params=params,
                          description=f"best-known plans: {tasks} task(s), seed {seed}, {evaluations} evaluations")
        if ds.rows:
            typer.echo(f"resuming {directory}: {len(ds.done())} task(s) already done", err=True)
        build(ds, jobs, executor=ex, log=lambda m: typer.echo(m, err=True), progress=not quiet)


def show_cmd(
    directory: str = typer.Argument(..., help="dataset directory"),
    limit: int = typer.Option(50, "--limit", help="rows of the table (0: all)"),
) -> None:
    """A table of the dataset's best plan per task: heuristic / best and best / lower bound."""
    from rich.console import Console
    from rich.table import Table

    from agent.dataset import Dataset

    ds = Dataset.open(directory)
    best = list(ds.best().values())
    t = Table(title=f"{directory}: {len(ds.rows)} row(s), {len(best)} task(s)")
    left = ("spec", "family", "split", "heuristic", "source")
    for col in ("spec", "family", "split", "nodes", "devices", "heuristic", "heuristic s", "best s", "heur/best",
                "best/LB", "source"):
        t.add_column(col, justify="left" if col in left else "right")
    for r in best[: limit or None]:
        ratio = r["heuristic_value"] / r["value"] if r["value"] > 0 else float("nan")
        lb = r["value"] / r["lower_bound"] if r["lower_bound"] > 0 else float("nan")
        t.add_row(r["spec"], r["family"], r["split"], str(r["nodes"]), str(r["devices"]),
                  r["heuristic"], f"{r['heuristic_value']:.4g}", f"{r['value']:.4g}" + (" OOM" if r["oom"] else ""),
                  f"{ratio:.3f}", f"{lb:.2f}", r["source"])
    Console(width=max(160, Console().width)).print(t)
    if best:
        import statistics

        ratios = [r["heuristic_value"] / r["value"] for r in best if r["value"] > 0]
        gaps = [r["value"] / r["lower_bound"] for r in best if r["lower_bound"] > 0]
        typer.echo(f"median heuristic/best {statistics.median(ratios):.3f}; median best/lower-bound "
                   f"{statistics.median(gaps):.2f}" if ratios and gaps else "")


def register(app: typer.Typer) -> None:
    sub = typer.Typer(help="Build and inspect the best-known-plans dataset.", no_args_is_help=True)
    sub.command("build")(build_cmd)
    sub.command("show")(show_cmd)
    app.add_typer(sub, name="dataset")
