"""`rlplace simulate`: predicted step time and memory of a plan on a topology."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from agent.resolve import resolve_graph
from envs.errors import PlanError
from envs.plan import Plan, data_parallel, megatron, single_device
from envs.simulator import OBJECTIVES, StepReport, simulate
from envs.topology import resolve_topology


def _fmt_time(t: float) -> str:
    return f"{t * 1e3:.3f} ms" if t < 10 else f"{t:.2f} s"


def _standard_plans(graph, topo, global_batch):
    n = topo.num_devices
    gb = global_batch or graph.batch_size
    plans = {"single device": single_device(graph, topo, global_batch=gb)}
    if gb % n == 0:
        plans[f"data parallel x{n}"] = data_parallel(graph, topo, global_batch=gb)
    for tp, pp in ((n, 1), (1, n), (2, n // 2)):
        if tp * pp != n or (tp == 1 and pp == 1):
            continue
        mbs = max(1, gb // (4 * pp)) if pp > 1 else gb
        try:
            plans[f"megatron tp{tp} pp{pp}"] = megatron(graph, topo, tp=tp, pp=pp, dp=1, microbatch_size=mbs,
                                                         global_batch=gb)
        except PlanError:
            continue
    return plans


def simulate_cmd(
    graph: str = typer.Option("gpt-small", "--graph", "-g", help="graph JSON, built-in example (gpt-small, gpt-1.3b, mlp-block) or model spec"),
    topology: str = typer.Option("dgx-a100-80g", "--topology", "-t", help="preset name or yaml/JSON file"),
    plan: str = typer.Option(None, "--plan", "-p", help="plan JSON file"),
    tp: int = typer.Option(None, "--tp", help="tensor-parallel degree (Megatron template)"),
    pp: int = typer.Option(None, "--pp", help="pipeline stages (Megatron template)"),
    dp: int = typer.Option(None, "--dp", help="data-parallel replicas (Megatron template)"),
    microbatch_size: int = typer.Option(None, "--microbatch-size", help="samples per microbatch"),
    global_batch: int = typer.Option(None, "--global-batch", help="samples per step (default: the graph's batch)"),
    schedule: str = typer.Option("1f1b", "--schedule", help="gpipe or 1f1b"),
    recompute: str = typer.Option("none", "--recompute", help="none or full"),
    objective: str = typer.Option("step_time", "--objective", help="step_time, throughput or latency"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    gantt: str = typer.Option(None, "--gantt", help="write a Gantt chart PNG of the timeline"),
    save_plan: str = typer.Option(None, "--save-plan", "-o", help="write the (best) simulated plan as JSON"),
) -> None:
    """Simulate one training step. Without --plan or --tp/--pp/--dp, compares standard plans."""
    if objective not in OBJECTIVES:
        raise PlanError(f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
    if recompute not in ("none", "full"):
        raise PlanError(f"--recompute must be none or full, got {recompute!r}")
    g = resolve_graph(graph)
    topo = resolve_topology(topology)
    if plan and any(x is not None for x in (tp, pp, dp)):
        raise PlanError("give either --plan or --tp/--pp/--dp, not both")
    if plan:
        plans = {plan: Plan.load(plan)}
    elif any(x is not None for x in (tp, pp, dp, microbatch_size)):
        plans = {f"megatron tp{tp or 1} pp{pp or 1} dp{dp or 1}": megatron(
            g, topo, tp=tp or 1, pp=pp or 1, dp=dp or 1, microbatch_size=microbatch_size, global_batch=global_batch,
            schedule=schedule, recompute=recompute)}
    else:
        plans = _standard_plans(g, topo, global_batch)
    reports: dict[str, StepReport] = {name: simulate(g, topo, p, objective) for name, p in plans.items()}
    if as_json:
        out = {name: r.to_dict() for name, r in reports.items()}
        typer.echo(json.dumps(next(iter(out.values())) if len(out) == 1 else out, indent=2))
    else:
        con = Console(width=160)
        con.print(f"[bold]{g.summary()}[/bold]\n{topo.describe()}")
        t = Table(title=f"objective: {objective}")
        for c in ("plan", "time", "peak memory / device", "OOM", "busiest compute", "busiest comm"):
            t.add_column(c)
        for name, r in reports.items():
            t.add_row(name, _fmt_time(r.step_time), f"{r.peak_memory.max() / 1e9:.2f} GB",
                      "yes" if r.oom else "no", _fmt_time(float(r.compute_time.max())),
                      _fmt_time(float(r.comm_time.max())))
        con.print(t)
    best = min(reports.items(), key=lambda kv: (kv[1].is_oom, kv[1].step_time))
    if save_plan:
        chosen = plans[best[0]]
        chosen.provenance.update({"predicted_step_time": best[1].step_time, "objective": objective,
                                  "peak_memory": [float(x) for x in best[1].peak_memory], "name": best[0]})
        chosen.save(save_plan)
        if not as_json:
            typer.echo(f"plan '{best[0]}' written to {save_plan}")
    if gantt:
        from envs.gantt import save_gantt

        if best[1].objective == "throughput":
            best = (best[0], simulate(g, topo, plans[best[0]], "step_time"))
        save_gantt(best[1], gantt, title=f"{g.name} on {topo.name}: {best[0]} ({_fmt_time(best[1].step_time)})")
        if not as_json:
            typer.echo(f"Gantt chart of '{best[0]}' written to {gantt}")


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate_cmd)
