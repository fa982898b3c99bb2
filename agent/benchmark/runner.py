"""Running a benchmark suite: every placer (and optionally a trained policy) on every case.

:func:`run_suite` resolves each case (:func:`agent.benchmark.suite.resolve_case`; a case that cannot
run here is skipped with a message), computes its lower bound (:func:`agent.lower_bound.lower_bound`),
runs the suite's placers with the suite's budget for the search placers, then the policy and the
human-expert split if any, and ranks every result against the best placer that fits memory and
against the lower bound. It writes the report (:mod:`agent.benchmark.results`), the best plan of each
case as JSON and, unless ``gantt=False``, its Gantt chart.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.benchmark.results import Row, slug, write_report
from agent.benchmark.suite import Case, CaseSkipped, Suite, resolve_case
from agent.lower_bound import lower_bound
from agent.placers import PLACERS, SEARCH_PLACERS, Budget, run_placer
from agent.placers.common import Scorer, finish
from envs.errors import RlplaceError
from envs.graph import OpGraph
from envs.plan import Plan
from envs.sim import simulate
from envs.topology import Topology


@dataclass
class CaseResult:
    """One resolved case and what running it gave."""

    graph: OpGraph
    topology: Topology
    bound: dict  # agent.lower_bound.lower_bound + "unit"
    rows: list[Row]
    best: tuple[tuple, Plan] | None  # (oom, predicted) and plan of the best non-expert run


def run_suite(suite: Suite, out_dir: str | os.PathLike, *, budget: Budget | None = None, policy: str | None = None,
              log: Callable[[str], None] = print, progress: bool = True, gantt: bool = True) -> list[Row]:
    """Run every placer of ``suite`` on every case and write the report into ``out_dir``."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    budget = budget or suite.budget
    place_policy = _policy_runner(policy)
    runs_per_case = len(suite.placers) + (1 if place_policy else 0)
    results: dict[str, CaseResult] = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not progress, transient=False) as bar:
        task = bar.add_task("bench", total=len(suite.cases) * runs_per_case)
        for case in suite.cases:
            try:
                graph, topo, expert = resolve_case(case, suite.base)
            except CaseSkipped as exc:
                log(f"skipping case {case.name}: {exc}")
                bar.advance(task, runs_per_case)
                continue

            def started(name: str, case: Case = case) -> None:
                bar.update(task, description=f"{case.name}: {name}")

            def finished(name: str) -> None:
                if name != "human_expert":
                    bar.advance(task)

            runs = _case_runs(suite, case, graph, topo, expert, budget, place_policy)
            results[case.name] = _run_case(case, graph, topo, runs, started, finished)
    rows = [r for res in results.values() for r in res.rows]
    write_report(rows, {name: res.bound for name, res in results.items()}, suite, out, budget)
    _write_best_plans(results, out, gantt)
    return rows


def _run_case(case: Case, graph: OpGraph, topo: Topology, runs: list[tuple[str, Callable[[], Plan]]],
              started: Callable[[str], None], finished: Callable[[str], None]) -> CaseResult:
    """Every run of one case, its rows ranked against the best placer and the lower bound."""
    bound = lower_bound(graph, topo, case.objective)
    bound["unit"] = unit = "ms" if graph.meta.get("source") == "dnn-partitioning" else "s"
    rows: list[Row] = []
    best: tuple[tuple, Plan] | None = None
    for name, fn in runs:
        started(name)
        t0 = time.perf_counter()
        try:
            plan = fn()
            pr = plan.provenance
            row = Row(case.name, name, graph.name, topo.name, case.objective, graph.num_nodes,
                      topo.num_devices, float(pr["predicted_step_time"]), pr["peak_memory"] / 1e9,
                      bool(pr["oom"]), time.perf_counter() - t0, int(pr.get("evaluations", 0)),
                      bound["lower_bound"], unit=unit)
            key = (row.oom, row.predicted)
            if name != "human_expert" and (best is None or key < best[0]):
                best = (key, plan)
        except RlplaceError as exc:
            row = Row(case.name, name, graph.name, topo.name, case.objective, graph.num_nodes,
                      topo.num_devices, math.nan, math.nan, False, time.perf_counter() - t0, 0,
                      bound["lower_bound"], status=f"error: {exc}", unit=unit)
        rows.append(row)
        finished(name)
    _rank(rows, bound)
    return CaseResult(graph, topo, bound, rows, best)


def _rank(rows: list[Row], bound: dict) -> None:
    """Each row's time over the best placer's (plans that fit first) and over the lower bound."""
    fits = [r.predicted for r in rows if r.status == "ok" and not r.oom and r.placer in PLACERS]
    anyr = [r.predicted for r in rows if r.status == "ok" and r.placer in PLACERS]
    best = min(fits) if fits else (min(anyr) if anyr else math.nan)
    for r in rows:
        r.ratio_best = r.predicted / best if best and r.status == "ok" else math.nan
        lb = bound["lower_bound"] if not r.oom else bound["lower_bound_any"]
        r.ratio_lb = r.predicted / lb if lb > 0 and r.status == "ok" else math.nan


def _write_best_plans(results: dict[str, CaseResult], out: Path, gantt: bool) -> None:
    """``gantt/<case>.png`` (one timeline simulation each) and ``plans/<case>.json`` of each case's best plan."""
    best = {name: res for name, res in results.items() if res.best is not None}
    if gantt:
        from envs.gantt import save_gantt

        for name, res in best.items():
            plan = res.best[1]
            rep = simulate(res.graph, res.topology, plan, "step_time", timeline=True)
            save_gantt(rep, out / "gantt" / f"{slug(name)}.png",
                       title=f"{name}: best plan ({plan.provenance.get('placer')}), step_time timeline "
                             f"{rep.value * 1e3:.3g} ms")
    for name, res in best.items():
        res.best[1].save(out / "plans" / f"{slug(name)}.json")


def _policy_runner(policy: str | None) -> Callable | None:
    """A function (graph, topology, objective, seed) -> Plan that places with the trained policy
    (``agent.infer.place``, policy rollouts only: no baselines, no search); None without a policy."""
    if not policy:
        return None
    from agent.infer import place

    def run(graph: OpGraph, topo: Topology, objective: str, seed: int) -> Plan:
        res = place(graph, topo, policy=policy, objective=objective, seed=seed, baselines=False)
        plan = res.plan.copy()
        return finish(plan, "policy", seed, Scorer(graph, topo, objective, Budget(evaluations=1)),
                      winner=res.plan.provenance.get("winner"), checkpoint=str(policy))

    return run


def _case_runs(suite: Suite, case: Case, graph: OpGraph, topo: Topology, expert: Plan | None, budget: Budget,
               place_policy: Callable | None) -> list[tuple[str, Callable[[], Plan]]]:
    """(name, thunk) per placer of the suite, then the policy and the human-expert split if any."""

    def placer(name: str) -> Callable[[], Plan]:
        b = budget if name in SEARCH_PLACERS else None
        return lambda: run_placer(name, graph, topo, seed=suite.seed, budget=b, objective=case.objective)

    runs = [(name, placer(name)) for name in suite.placers]
    if place_policy is not None:
        runs.append(("policy", lambda: place_policy(graph, topo, case.objective, suite.seed)))
    if expert is not None:
        runs.append(("human_expert", lambda: finish(expert, "human_expert", suite.seed,
                                                    Scorer(graph, topo, case.objective, Budget(evaluations=1)))))
    return runs


__all__ = ["Row", "run_suite"]
