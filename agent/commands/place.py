"""`rlplace place --model SPEC|graph.json --topology NAME|FILE -o plan.json`: place a model with a policy."""

from __future__ import annotations

import contextlib
import math

import typer
from rich.console import Console

from agent.infer import DEFAULT_BUDGET_SECONDS
from agent.report import format_time, print_comparison, winner_timeline

MAX_SEARCH_SECONDS = 86_400.0  # a day of local search is the most `--search-seconds` takes


def place_cmd(
    model: str = typer.Option(..., "--model", "-m", help="graph JSON, built-in graph (gpt-tiny, gpt-medium, moe-wide, ...) or model spec (gpt:layers=4)"),
    topology: str = typer.Option("dgx-a100-80g", "--topology", "-t", help="preset name or yaml/JSON file"),
    policy: str = typer.Option(None, "--policy", help="policy .zip (default: the shipped pretrained policy)"),
    objective: str = typer.Option("step_time", "--objective", help="step_time, throughput or latency"),
    samples: int = typer.Option(8, "--samples", min=0, help="sampled rollouts besides the greedy one"),
    finetune_steps: int = typer.Option(0, "--finetune-steps", min=0, help="PPO steps on this task before the rollouts"),
    search_seconds: float = typer.Option(0.0, "--search-seconds", min=0.0, max=MAX_SEARCH_SECONDS,
                                         help="local search (MCMC) from the best plan, seconds"),
    budget_seconds: float = typer.Option(None, "--budget-seconds",
                                         help="wall clock for the whole call; what rollouts and baselines leave "
                                              f"goes to the policy-guided search (default {DEFAULT_BUDGET_SECONDS:g} "
                                              "s, none with --max-evaluations; 0: no guided search)"),
    max_evaluations: int = typer.Option(None, "--max-evaluations",
                                        help="simulator evaluations the guided search uses: the same seed gives "
                                             "the same plan on any machine (0: no guided search)"),
    max_groups: int = typer.Option(None, "--max-groups", min=1, help="coarsen to at most this many groups (default: 128 for the rollouts, or the policy's padding with --finetune-steps; the guided search: the policy's padding)"),
    seed: int = typer.Option(0, "--seed"),
    output: str = typer.Option("plan.json", "--output", "-o", help="plan JSON to write (and a .png Gantt chart)"),
    gantt: str = typer.Option(None, "--gantt", help="Gantt PNG path (default: next to the plan)"),
) -> None:
    """Place a model: policy rollouts + fast baselines (+ fine-tune / search); never worse than the baselines."""
    from agent.commands.simulate import write_plan_and_chart
    from agent.infer import PlaceError, place, resolve_model
    from envs.files import check_output_path
    from envs.presets import resolve_topology

    if not math.isfinite(search_seconds):
        raise PlaceError(f"--search-seconds must be a finite number of seconds, got {search_seconds}")
    if budget_seconds is None:  # an evaluation budget alone ends the search where the same seed always does
        budget_seconds = DEFAULT_BUDGET_SECONDS if max_evaluations is None else None
    elif not (math.isfinite(budget_seconds) and 0 <= budget_seconds <= MAX_SEARCH_SECONDS):
        raise PlaceError(f"--budget-seconds must be between 0 and {MAX_SEARCH_SECONDS:g} seconds, got {budget_seconds}")
    out = check_output_path(output, "plan")
    png = check_output_path(gantt if gantt else out.with_suffix(".png"), "Gantt chart")
    topo = resolve_topology(topology)  # a name is checked before the model is traced (seconds to minutes)
    with _working() as stage:  # a spinner with the elapsed time on a terminal, nothing left behind
        stage(f"tracing {model}")
        g = resolve_model(model)
        budget = (f"{budget_seconds:g} s" if budget_seconds else "no search") if max_evaluations is None else \
            f"{max_evaluations} evaluations"
        stage(f"placing ({budget}) on {topo.name}: {g.name}")
        res = place(g, topo, policy=policy, objective=objective, samples=samples, finetune_steps=finetune_steps,
                    search_seconds=search_seconds, seed=seed, max_groups=max_groups, budget_seconds=budget_seconds,
                    max_evaluations=max_evaluations, log=typer.echo)
    con = Console(width=140)
    con.print(f"[bold]{g.summary()}[/bold]\n{topo.describe()}")
    print_comparison(res, objective, console=con)
    rep = winner_timeline(res, g, topo, objective)
    write_plan_and_chart(res.plan, str(out), rep, str(png),
                         title=f"{g.name} on {topo.name}: {res.best.name} ({format_time(rep.value)})")
    if res.search is not None:
        s = res.search
        typer.echo(f"guided search: {s.evaluations} simulator evaluations in {s.seconds:.1f} s "
                   f"({s.policy_proposals} policy / {s.mcmc_proposals} MCMC proposals), best "
                   f"{format_time(s.value)}{'; ' + s.note if s.note else ''}"
                   + ("; stopped early: its last proposals found no plan it had not scored" if s.saturated else ""))
    typer.echo(f"winner: {res.best.name}; plan written to {out}, Gantt chart to {png}")


@contextlib.contextmanager
def _working():
    """A transient spinner on stderr (shown on a terminal only) whose text names the current stage."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    err = Console(stderr=True)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err,
                  transient=True, disable=not err.is_terminal) as bar:
        t = bar.add_task("", total=None)
        yield lambda text: bar.update(t, description=text[:60])


def register(app: typer.Typer) -> None:
    app.command("place")(place_cmd)
