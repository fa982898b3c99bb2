"""Running a benchmark suite: every placer and the trained agent on every case, in-process or on Ray.

:func:`run_suite` turns each case into a :class:`CaseJob` and runs the jobs with an
:class:`agent.scale.Executor` (in this process by default; ``Executor(ray=True)`` or
``Executor(address=...)`` runs each case as a Ray task). A job (:func:`solve_case`) resolves its case
(:func:`agent.benchmark.suite.resolve_case`; a case that cannot run here is skipped with a message),
computes its lower bound (:func:`agent.lower_bound.lower_bound`), runs the suite's placers with the
suite's budget for the search placers, then the agent columns, then the human-expert split if any, and
ranks every result against the best placer that fits memory and against the lower bound.

The agent columns (when the suite has an ``agent`` section or the caller gives :class:`AgentSettings`)
come from :func:`agent.infer.place`, per case:

* ``policy``: the trained policy zero-shot, the best of its greedy rollout and ``samples`` sampled ones
  (``place`` without baselines or budget: the candidates of kind ``"policy"``, each refine episode's
  final and best visited plans, every step simulated; their planning time is ``place``'s env and policy
  stages);
* ``policy+search``: what a second ``place`` call returns with ``max_evaluations=evaluations``: the
  policy-guided search (:mod:`agent.guided_search`) from the best of the policy's rollouts (their final
  plans, as ``place`` runs them before a search) and ``place``'s fast baselines. An evaluation budget,
  not seconds, so the column is the same on any machine.

A Ray task resolves its case where it runs: on a multi-machine cluster every node needs the checkout,
the suite's workload files and the policy at the same paths as the driver (a shared filesystem or
identical images). Every case is seeded by the suite's seed; with evaluation budgets (no ``seconds``)
the rows are the same however the jobs ran. Results come back in case order; the report
(:mod:`agent.benchmark.results`), each case's best plan as JSON and, unless ``gantt=False``, its Gantt
chart are written only after every case has run (each file atomically), so a run that fails part-way
writes nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from agent.benchmark.results import Row, plan_note, slug, write_report
from agent.benchmark.suite import AgentSettings, Case, CaseSkipped, Suite, resolve_case
from agent.lower_bound import lower_bound
from agent.placers import PLACERS, SEARCH_PLACERS, Budget, run_placer
from agent.placers.common import Scorer, finish
from envs.errors import RlplaceError
from envs.graph import OpGraph
from envs.plan import Plan
from envs.sim import simulate
from envs.topology import Topology

if TYPE_CHECKING:
    from agent.scale import Executor

AGENT_COLUMNS = ("policy", "policy+search")


@dataclass(frozen=True)
class CaseJob:
    """What one case needs to run anywhere (picklable, for Ray)."""

    case: Case
    base: Path
    seed: int
    placers: tuple[str, ...]
    budget: Budget
    agent: AgentSettings | None = None

    def run_names(self) -> list[str]:
        """The rows a job makes (the human-expert split aside): its placers, then the agent columns."""
        return list(self.placers) + agent_columns(self.agent)


@dataclass
class CaseResult:
    """One case and what running it gave (``skipped``: the reason it did not run)."""

    name: str
    graph: OpGraph | None = None
    topology: Topology | None = None
    bound: dict = field(default_factory=dict)  # agent.lower_bound.lower_bound + "unit"
    rows: list[Row] = field(default_factory=list)
    best: tuple[tuple, Plan] | None = None  # (oom, predicted) and plan of the best non-expert run
    skipped: str | None = None


def agent_columns(agent: AgentSettings | None) -> list[str]:
    if agent is None:
        return []
    return ["policy", "policy+search"] if agent.evaluations > 0 else ["policy"]


def effective_agent(suite: Suite, agent: AgentSettings | bool | None = None, policy: str | None = None
                    ) -> AgentSettings | None:
    """The agent settings of a run: ``agent`` (settings, or False for none) over the suite's; a
    ``policy`` checkpoint turns the agent on (with the suite's settings or the defaults) and replaces
    the suite's policy."""
    if agent is False:
        return None
    settings = agent if isinstance(agent, AgentSettings) else suite.agent
    if policy is not None:
        settings = replace(settings or AgentSettings(), policy=str(policy))
    return settings


def check_agent(agent: AgentSettings | None) -> None:
    """Load the agent's policy once (a missing or corrupt checkpoint: one ``PlaceError`` before any work)."""
    if agent is not None:
        policy_model(agent.policy)


def run_suite(suite: Suite, out_dir: str | Path, *, budget: Budget | None = None, policy: str | None = None,
              agent: AgentSettings | bool | None = None, executor: Executor | None = None,
              log: Callable[[str], None] = print, progress: bool = True, gantt: bool = True) -> list[Row]:
    """Run every placer of ``suite`` (and the agent, see :func:`effective_agent`) on every case and write
    the report into ``out_dir``; ``executor`` runs the cases (default: in this process)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from agent.scale import Executor

    budget = budget or suite.budget
    settings = effective_agent(suite, agent, policy)
    check_agent(settings)
    jobs = [CaseJob(case, suite.base, suite.seed, tuple(suite.placers), budget, settings) for case in suite.cases]
    ex = executor or Executor()
    per_case = len(jobs[0].run_names()) if jobs else 0
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not progress, transient=False) as bar:
        task = bar.add_task("bench", total=len(jobs) * per_case)
        with ex:
            if ex.use_ray:
                bar.update(task, description=f"bench: {len(jobs)} cases on Ray ({ex.workers} CPUs)")

                def done(_i: int, res: CaseResult) -> None:
                    bar.advance(task, per_case)
                    bar.update(task, description=f"bench: {res.name} done")

                results = ex.map(solve_case, jobs, on_result=done)
            else:
                def solve_here(job: CaseJob) -> CaseResult:
                    return solve_case(job, started=lambda name: bar.update(task, description=f"{job.case.name}: "
                                                                                              f"{name}"),
                                      finished=lambda name: bar.advance(task))

                results = ex.map(solve_here, jobs)
    for res in results:
        if res.skipped is not None:
            log(f"skipping case {res.name}: {res.skipped}")
    ran = [res for res in results if res.skipped is None]
    rows = [r for res in ran for r in res.rows]
    out = Path(out_dir)
    write_report(rows, {res.name: res.bound for res in ran}, suite, out, budget, agent=settings)
    _write_best_plans(ran, out, gantt)
    return rows


def solve_case(job: CaseJob, started: Callable[[str], None] | None = None,
               finished: Callable[[str], None] | None = None) -> CaseResult:
    """Run one case (see the module docstring); ``started`` / ``finished`` are told each run's name."""
    try:
        graph, topo, expert = resolve_case(job.case, job.base)
    except CaseSkipped as exc:
        return CaseResult(job.case.name, skipped=str(exc))
    runs = _case_runs(job, graph, topo, expert)
    return _run_case(job.case, graph, topo, runs, started or (lambda _n: None), finished or (lambda _n: None))


# A run makes one or more rows: (row names, a thunk returning [(name, plan or an error line, seconds or None)])
Run = tuple[tuple[str, ...], Callable[[], list[tuple]]]


def _run_case(case: Case, graph: OpGraph, topo: Topology, runs: list[Run], started: Callable[[str], None],
              finished: Callable[[str], None]) -> CaseResult:
    """Every run of one case, its rows ranked against the best placer and the lower bound."""
    bound = lower_bound(graph, topo, case.objective)
    bound["unit"] = unit = "ms" if graph.meta.get("source") == "dnn-partitioning" else "s"
    res = CaseResult(case.name, graph, topo, bound)

    def row(name: str, plan: Plan | None, seconds: float, status: str = "ok") -> Row:
        if plan is None:
            return Row(case.name, name, graph.name, topo.name, case.objective, graph.num_nodes, topo.num_devices,
                       math.nan, math.nan, False, seconds, 0, bound["lower_bound"], status=status, unit=unit)
        pr = plan.provenance
        return Row(case.name, name, graph.name, topo.name, case.objective, graph.num_nodes, topo.num_devices,
                   float(pr["predicted_step_time"]), pr["peak_memory"] / 1e9, bool(pr["oom"]), seconds,
                   int(pr.get("evaluations", 0)), bound["lower_bound"], unit=unit, note=plan_note(pr))

    for names, fn in runs:
        started(names[0] if len(names) == 1 else " / ".join(names))
        t0 = time.perf_counter()
        try:
            made = fn()
        except RlplaceError as exc:
            made = [(name, f"error: {exc}", None) for name in names]
        spent = time.perf_counter() - t0
        for name, plan, seconds in made:
            secs = spent if seconds is None else seconds
            if isinstance(plan, str):
                res.rows.append(row(name, None, secs, status=plan))
                continue
            r = row(name, plan, secs)
            res.rows.append(r)
            key = (r.oom, r.predicted)
            if name != "human_expert" and (res.best is None or key < res.best[0]):
                res.best = (key, plan)
        for name in names:
            if name != "human_expert":
                finished(name)
    _rank(res.rows, bound)
    return res


def _rank(rows: list[Row], bound: dict) -> None:
    """Each row's time over the best placer's (plans that fit first) and over the lower bound."""
    fits = [r.predicted for r in rows if r.status == "ok" and not r.oom and r.placer in PLACERS]
    anyr = [r.predicted for r in rows if r.status == "ok" and r.placer in PLACERS]
    best = min(fits) if fits else (min(anyr) if anyr else math.nan)
    for r in rows:
        r.ratio_best = r.predicted / best if best and r.status == "ok" else math.nan
        lb = bound["lower_bound"] if not r.oom else bound["lower_bound_any"]
        r.ratio_lb = r.predicted / lb if lb > 0 and r.status == "ok" else math.nan


def _write_best_plans(results: list[CaseResult], out: Path, gantt: bool) -> None:
    """``gantt/<case>.png`` (one timeline simulation each) and ``plans/<case>.json`` of each case's best plan."""
    best = [res for res in results if res.best is not None]
    if gantt:
        from envs.gantt import save_gantt

        for res in best:
            plan = res.best[1]
            rep = simulate(res.graph, res.topology, plan, "step_time", timeline=True)
            save_gantt(rep, out / "gantt" / f"{slug(res.name)}.png",
                       title=f"{res.name}: best plan ({plan.provenance.get('placer')}), step_time timeline "
                             f"{rep.value * 1e3:.3g} ms")
    for res in best:
        res.best[1].save(out / "plans" / f"{slug(res.name)}.json")


# ---------------------------------------------------------------------- the agent
_MODELS: dict[str | None, object] = {}


def policy_model(path: str | None):
    """The policy at ``path`` (None: the shipped one), loaded once per process."""
    if path not in _MODELS:
        from agent.infer import load_policy

        _MODELS[path] = load_policy(path)
    return _MODELS[path]


def _stamp(cand, label: str, objective: str, seed: int, evaluations: int, agent: AgentSettings) -> Plan:
    """A copy of an ``agent.infer.Candidate``'s plan whose provenance names the column and what it cost."""
    plan = cand.plan.copy()
    plan.provenance = {**dict(cand.plan.provenance), "placer": label, "winner": cand.name, "winner_kind": cand.kind,
                       "objective": objective, "predicted_step_time": float(cand.value),
                       "peak_memory": float(cand.peak_memory), "oom": bool(cand.oom), "evaluations": int(evaluations),
                       "seed": int(seed), "policy": agent.policy or "shipped", "samples": agent.samples,
                       "search_evaluations": agent.evaluations if label == "policy+search" else 0}
    return plan


def agent_rows(agent: AgentSettings, graph: OpGraph, topo: Topology, objective: str, seed: int
               ) -> list[tuple[str, Plan | str, float]]:
    """The ``policy`` and (with ``agent.evaluations``) ``policy+search`` plans of one case, from
    :func:`agent.infer.place` calls (see the module docstring), with their planning seconds.

    Evaluations: the policy's candidates simulated on the operator graph; for ``policy+search`` also
    those of ``place``'s fast baselines and of the guided search."""
    from agent.infer import place

    model = policy_model(agent.policy)
    zero = place(graph, topo, model=model, objective=objective, samples=agent.samples, seed=seed, baselines=False)
    own = [c for c in zero.candidates if c.kind == "policy"]  # best first: place sorts its candidates
    policy_s = zero.seconds.get("env", 0.0) + zero.seconds.get("policy", 0.0)
    out: list[tuple[str, Plan | str, float]] = [
        ("policy", _stamp(own[0], "policy", objective, seed, len(own), agent) if own
         else "error: the policy produced no valid plan", policy_s)]
    if agent.evaluations > 0:
        t0 = time.perf_counter()
        res = place(graph, topo, model=model, objective=objective, samples=agent.samples, seed=seed,
                    max_evaluations=agent.evaluations)
        total = time.perf_counter() - t0
        rollouts = sum(c.kind == "policy" for c in res.candidates)
        base = sum(int(c.plan.provenance.get("evaluations", 1)) for c in res.candidates if c.kind == "baseline")
        found = int(getattr(res.search, "evaluations", 0) or 0)
        out.append(("policy+search", _stamp(res.best, "policy+search", objective, seed, rollouts + base + found,
                                            agent), total))
    return out


# ---------------------------------------------------------------------- the runs of a case
def _case_runs(job: CaseJob, graph: OpGraph, topo: Topology, expert: Plan | None) -> list[Run]:
    """(row names, thunk) per placer of the suite, then the agent and the human-expert split if any."""
    case = job.case

    def placer(name: str) -> Callable[[], list]:
        b = job.budget if name in SEARCH_PLACERS else None
        return lambda: [(name, run_placer(name, graph, topo, seed=job.seed, budget=b, objective=case.objective),
                         None)]

    runs: list[Run] = [((name,), placer(name)) for name in job.placers]
    if job.agent is not None:
        agent = job.agent
        runs.append((tuple(agent_columns(agent)), lambda: agent_rows(agent, graph, topo, case.objective, job.seed)))
    if expert is not None:
        runs.append((("human_expert",), lambda: [("human_expert", finish(
            expert, "human_expert", job.seed, Scorer(graph, topo, case.objective, Budget(evaluations=1))), None)]))
    return runs


__all__ = ["Row", "run_suite", "solve_case", "CaseJob", "CaseResult", "AgentSettings", "AGENT_COLUMNS",
           "agent_rows", "effective_agent", "check_agent", "policy_model"]
