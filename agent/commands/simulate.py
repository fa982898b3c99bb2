"""`rlplace simulate`: predicted step time and memory of a plan on a topology."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from agent.report import format_time
from agent.resolve import resolve_graph
from envs.errors import PlanError
from envs.files import check_output_path, finite_json
from envs.plan import RECOMPUTE, SCHEDULES, Plan, megatron_plan, standard_plans
from envs.presets import resolve_topology
from envs.sim import OBJECTIVES, StepReport, simulate


def simulate_cmd(
    graph: str = typer.Option("gpt-small", "--graph", "-g", help="graph JSON, built-in example (gpt-small, gpt-1.3b, mlp-block) or model spec"),
    topology: str = typer.Option("dgx-a100-80g", "--topology", "-t", help="preset name or yaml/JSON file"),
    plan: str = typer.Option(None, "--plan", "-p", help="plan JSON file"),
    tp: int = typer.Option(None, "--tp", min=1, help="tensor-parallel degree (Megatron template)"),
    pp: int = typer.Option(None, "--pp", min=1, help="pipeline stages (Megatron template)"),
    dp: int = typer.Option(None, "--dp", min=1, help="data-parallel replicas (Megatron template)"),
    microbatch_size: int = typer.Option(None, "--microbatch-size", min=1, help="samples per microbatch"),
    global_batch: int = typer.Option(None, "--global-batch", min=1,
                                     help="samples per step (default: the graph's batch)"),
    schedule: str = typer.Option("1f1b", "--schedule", help="gpipe or 1f1b"),
    recompute: str = typer.Option("none", "--recompute", help="none, selective (the attention core) or full"),
    zero: int = typer.Option(0, "--zero", min=0, max=3, help="ZeRO stage over the data-parallel replicas (0-3)"),
    sequence_parallel: bool = typer.Option(False, "--sequence-parallel",
                                           help="sequence parallelism for the tensor-parallel layers' token-wise ops"),
    virtual_stages: int = typer.Option(1, "--virtual-stages", min=1,
                                       help="model chunks per pipeline rank (interleaved 1F1B when > 1)"),
    expert_parallel: int = typer.Option(1, "--expert-parallel", min=1,
                                        help="expert-parallel degree: each mixture-of-experts layer's experts "
                                             "spread over this many data-parallel ranks (tp=1)"),
    objective: str = typer.Option("step_time", "--objective", help="step_time, throughput or latency"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    gantt: str = typer.Option(None, "--gantt", help="write a Gantt chart PNG of the timeline"),
    save_plan: str = typer.Option(None, "--save-plan", "-o", help="write the (best) simulated plan as JSON"),
) -> None:
    """Simulate one training step. Without --plan or --tp/--pp/--dp, compares standard plans."""
    if objective not in OBJECTIVES:
        raise PlanError(f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
    if recompute not in RECOMPUTE:
        raise PlanError(f"--recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    extras = zero or sequence_parallel or virtual_stages > 1 or recompute != "none" or expert_parallel > 1
    if plan and extras:
        raise PlanError("--zero/--recompute/--sequence-parallel/--virtual-stages/--expert-parallel build a Megatron "
                        "template: give them with --tp/--pp/--dp, not with --plan (a plan file carries its own)")
    if schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if plan and any(x is not None for x in (tp, pp, dp, microbatch_size, global_batch)):
        raise PlanError("give either --plan or the template's --tp/--pp/--dp/--microbatch-size/--global-batch, "
                        "not both")
    for path, what in ((save_plan, "plan"), (gantt, "Gantt chart")):
        if path:
            check_output_path(path, what)
    topo = resolve_topology(topology)  # a name is checked before the model is traced
    g = resolve_graph(graph)
    if plan:
        plans = {plan: Plan.load(plan)}
    elif any(x is not None for x in (tp, pp, dp, microbatch_size)) or extras:
        name = f"megatron tp{tp or 1} pp{pp or 1} dp{dp or 1}" + "".join(
            f" {x}" for x, on in ((f"zero{zero}", zero), ("sp", sequence_parallel), (f"v{virtual_stages}",
                                                                                     virtual_stages > 1),
                                  (f"{recompute} recompute", recompute != "none"),
                                  (f"ep{expert_parallel}", expert_parallel > 1)) if on)
        plans = {name: megatron_plan(
            g, topo, tp=tp or 1, pp=pp or 1, dp=dp or 1, microbatch_size=microbatch_size, global_batch=global_batch,
            schedule=schedule, recompute=recompute, zero=zero, sequence_parallel=sequence_parallel,
            virtual_stages=virtual_stages, expert_parallel=expert_parallel)}
    else:
        plans = standard_plans(g, topo, global_batch)
    reports: dict[str, StepReport] = {name: simulate(g, topo, p, objective) for name, p in plans.items()}
    if as_json:
        out = {name: r.to_dict() for name, r in reports.items()}
        typer.echo(finite_json(next(iter(out.values())) if len(out) == 1 else out, indent=2))
    else:
        con = Console(width=160)
        con.print(f"[bold]{g.summary()}[/bold]\n{topo.describe()}")
        t = Table(title=f"objective: {objective}")
        for c in ("plan", "time", "peak memory / device", "OOM", "busiest compute", "busiest comm"):
            t.add_column(c)
        for name, r in reports.items():
            t.add_row(name, format_time(r.value), f"{r.peak_memory.max() / 1e9:.2f} GB",
                      "yes" if r.oom else "no", format_time(float(r.compute_time.max())),
                      format_time(float(r.comm_time.max())))
        con.print(t)
    name, report = min(reports.items(), key=lambda kv: (kv[1].is_oom, kv[1].value))
    chosen = plans[name]
    chosen.provenance.update({"predicted_step_time": report.value, "objective": objective,
                              "peak_memory": [float(x) for x in report.peak_memory], "name": name})
    timeline = report if report.objective != "throughput" else simulate(g, topo, chosen, "step_time")
    title = f"{g.name} on {topo.name}: {name} ({format_time(timeline.value)})"
    write_plan_and_chart(chosen, save_plan, timeline if gantt else None, gantt, title)
    if not as_json:
        if save_plan:
            typer.echo(f"plan '{name}' written to {save_plan}")
        if gantt:
            typer.echo(f"Gantt chart of '{name}' written to {gantt}")


def write_plan_and_chart(plan: Plan, plan_path: str | None, report: StepReport | None, png_path: str | None,
                         title: str) -> None:
    """Write the plan JSON and / or its Gantt PNG, both or neither: the chart is rendered to a temp file
    first, the plan written, then the chart renamed into place."""
    if png_path and report is not None:
        from envs.files import atomic_output
        from envs.gantt import gantt_figure, save_figure

        with atomic_output(png_path, "Gantt chart") as tmp:
            save_figure(gantt_figure(report, title), tmp)
            if plan_path:
                plan.save(plan_path)
    elif plan_path:
        plan.save(plan_path)


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate_cmd)
