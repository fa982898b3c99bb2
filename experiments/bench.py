"""Benchmark suite: every placer on every case, with lower bounds, a CSV, a markdown report and plots.

A suite is a yaml file (``experiments/suites/<name>.yaml``)::

    name: default
    seed: 0
    budget: {seconds: 8, evaluations: 300}   # for the search placers (megatron_3d, random_search, mcmc)
    placers: all                            # or a list of names from agent.placers.PLACERS
    cases:
      - name: gpt-1.3b@dgx1                  # unique
        graph: gpt-1.3b                      # see resolve_case_graph
        topology: dgx1-v100                  # preset or yaml/JSON file; omitted for imported workloads
        objective: step_time                 # step_time | throughput | latency
        requires: profilers.spec             # optional: skip the case (with a message) if not importable
        expert: path/to/split.json           # optional: a human-expert split to compare with

Graphs: a built-in example (``gpt-small``), ``transformer:layers=..,hidden=..,seq=..,batch=..``
(``envs.examples.transformer_graph``), ``builtin:NAME`` (``envs.tasks`` graphs shipped in envs/data),
a graph JSON file, a model spec (``gpt:layers=4,...``) or ``file.py:fn`` (traced by ``profilers``), or
``dnn-partitioning:PATH`` (a public workload; it brings its own topology). ``${VAR}`` in paths expands
from the environment (``RLPLACE_WORKLOADS`` defaults to ``shared/workloads`` beside the checkout); relative paths are
taken from the suite file's folder first. A case whose file is missing is skipped with a message.
"""

from __future__ import annotations

import csv
import importlib
import io
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from agent.lower_bound import lower_bound
from agent.placers import PLACERS, SEARCH_PLACERS, Budget, run_placer
from agent.placers.common import Scorer, finish
from envs.errors import RlplaceError
from envs.files import atomic_write_text
from envs.gantt import save_figure
from envs.graph import OpGraph
from envs.plan import Plan
from envs.simulator import OBJECTIVES, simulate
from envs.topology import Topology, resolve_topology

SUITES_DIR = Path(__file__).resolve().parent / "suites"
# shared/ sits beside the repository checkout (as in CI); override with RLPLACE_WORKLOADS
DEFAULT_WORKLOADS = str(Path(__file__).resolve().parents[2] / "shared" / "workloads")
CASE_KEYS = {"name", "graph", "topology", "objective", "requires", "expert", "note"}
SUITE_KEYS = {"name", "seed", "budget", "placers", "cases", "description"}


class SuiteError(RlplaceError):
    """A benchmark suite file is missing or malformed."""


class CaseSkipped(Exception):
    """A case cannot run here (optional dependency or workload file missing)."""


@dataclass
class Case:
    name: str
    graph: str
    topology: str | None
    objective: str = "step_time"
    requires: str | None = None
    expert: str | None = None


@dataclass
class Suite:
    name: str
    cases: list[Case]
    placers: list[str]
    budget: Budget
    seed: int = 0
    base: Path = field(default_factory=Path.cwd)


# ---------------------------------------------------------------------- loading
def suite_path(spec: str) -> Path:
    """A suite name (``default`` -> experiments/suites/default.yaml) or a yaml path."""
    p = Path(spec)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.exists():
            raise SuiteError(f"suite file not found: {spec}")
        return p
    q = SUITES_DIR / f"{spec}.yaml"
    if not q.exists():
        names = ", ".join(sorted(x.stem for x in SUITES_DIR.glob("*.yaml")))
        raise SuiteError(f"unknown suite {spec!r}; suites: {names} (or a path to a .yaml file)")
    return q


def load_suite(spec: str) -> Suite:
    """Read and check a suite file (see the module docstring)."""
    from envs.files import read_document

    path = suite_path(spec)
    data = read_document(path, "suite", SuiteError)
    if not isinstance(data, dict):
        raise SuiteError(f"suite {path} must be a mapping with 'cases'")
    unknown = set(data) - SUITE_KEYS
    if unknown:
        raise SuiteError(f"suite {path}: unknown key(s) {sorted(unknown)}; allowed: {sorted(SUITE_KEYS)}")
    cases_raw = data.get("cases")
    if not isinstance(cases_raw, list) or not cases_raw:
        raise SuiteError(f"suite {path}: 'cases' must be a non-empty list")
    placers = data.get("placers", "all")
    if placers == "all":
        placers = list(PLACERS)
    if not isinstance(placers, list) or not placers:
        raise SuiteError(f"suite {path}: 'placers' must be 'all' or a list of names")
    bad = [p for p in placers if p not in PLACERS]
    if bad:
        raise SuiteError(f"suite {path}: unknown placer(s) {bad}; placers: {', '.join(PLACERS)}")
    try:
        budget = Budget.of(data.get("budget"), Budget(seconds=10.0, evaluations=300))
        seed = int(data.get("seed", 0))
    except (RlplaceError, TypeError, ValueError) as exc:
        raise SuiteError(f"suite {path}: bad budget or seed: {exc}") from exc
    cases, names = [], set()
    for i, c in enumerate(cases_raw):
        if not isinstance(c, dict) or "graph" not in c:
            raise SuiteError(f"suite {path}: case {i} must be a mapping with at least 'graph'")
        unknown = set(c) - CASE_KEYS
        if unknown:
            raise SuiteError(f"suite {path}: case {i}: unknown key(s) {sorted(unknown)}; allowed: {sorted(CASE_KEYS)}")
        obj = c.get("objective", "step_time")
        if obj not in OBJECTIVES:
            raise SuiteError(f"suite {path}: case {i}: unknown objective {obj!r}; choose one of {', '.join(OBJECTIVES)}")
        graph = str(c["graph"])
        if c.get("topology") is None and not graph.startswith("dnn-partitioning:"):
            raise SuiteError(f"suite {path}: case {i} ({graph}) needs a 'topology'")
        name = str(c.get("name") or f"{graph}@{c.get('topology', 'workload')}")
        if name in names:
            raise SuiteError(f"suite {path}: duplicate case name {name!r}")
        names.add(name)
        cases.append(Case(name=name, graph=graph, topology=c.get("topology"), objective=obj,
                          requires=c.get("requires"), expert=c.get("expert")))
    return Suite(name=str(data.get("name", path.stem)), cases=cases, placers=list(placers), budget=budget,
                 seed=seed, base=path.parent)


def _path(text: str, base: Path) -> str:
    env = dict(os.environ)
    env.setdefault("RLPLACE_WORKLOADS", DEFAULT_WORKLOADS)
    expanded = text
    for k, v in env.items():
        expanded = expanded.replace("${" + k + "}", v)
    p = Path(expanded)
    if not p.is_absolute() and (base / p).exists():
        return str(base / p)
    return expanded


def _kv(args: str) -> dict:
    out = {}
    for part in filter(None, (x.strip() for x in args.split(","))):
        k, eq, v = part.partition("=")
        if not eq:
            raise SuiteError(f"bad knob {part!r} (expected key=value)")
        try:
            out[k.strip()] = int(v)
        except ValueError:
            out[k.strip()] = v.strip()
    return out


def resolve_case(case: Case, base: Path) -> tuple[OpGraph, Topology, Plan | None]:
    """The case's graph, topology and (optional) human-expert plan. Raises CaseSkipped when an optional
    dependency or a workload file is missing."""
    if case.requires:
        try:
            importlib.import_module(case.requires)
        except ImportError as exc:
            raise CaseSkipped(f"needs {case.requires} ({exc})") from exc
    spec = case.graph
    expert = None
    if spec.startswith("dnn-partitioning:"):
        try:
            from profilers.dnn_partitioning import import_split, import_workload
        except ImportError as exc:
            raise CaseSkipped(f"the dnn-partitioning importer is not available ({exc})") from exc
        path = _path(spec.split(":", 1)[1], base)
        if not os.path.exists(path):
            raise CaseSkipped(f"workload file not found: {path}")
        graph, topo = import_workload(path)
        if case.topology:
            topo = resolve_topology(_path(case.topology, base))
        if case.expert:
            epath = _path(case.expert, base)
            if os.path.exists(epath):
                expert = import_split(epath, graph, topo)
        return graph, topo, expert
    if spec.startswith("transformer:"):
        from envs.examples import transformer_graph

        try:
            graph = transformer_graph(**_kv(spec.split(":", 1)[1]))
        except TypeError as exc:
            raise SuiteError(f"case {case.name}: bad transformer knobs in {spec!r}: {exc}") from exc
    elif spec.startswith("builtin:"):
        from envs.tasks import load_builtin_graph

        graph = load_builtin_graph(spec.split(":", 1)[1])
    else:
        from agent.resolve import resolve_graph

        p = _path(spec, base)
        if p.endswith(".json") and not os.path.exists(p):
            raise CaseSkipped(f"graph file not found: {p}")
        graph = resolve_graph(p)
    topo = resolve_topology(_path(str(case.topology), base))
    return graph, topo, expert


# ---------------------------------------------------------------------- running
@dataclass
class Row:
    case: str
    placer: str
    graph: str
    topology: str
    objective: str
    nodes: int
    devices: int
    predicted: float
    peak_memory_gb: float
    oom: bool
    planning_s: float
    evaluations: int
    lower_bound: float
    ratio_best: float = math.nan
    ratio_lb: float = math.nan
    status: str = "ok"
    unit: str = "s"  # "s", or the workload's own time unit (dnn-partitioning: the paper's ms)


def _policy_runner(policy: str | None) -> tuple[Callable | None, str | None]:
    """A function (graph, topology, objective, seed) -> Plan that places with the trained policy
    (``agent.infer.place``, policy rollouts only: no baselines, no search), or a message saying why
    there is none."""
    if not policy:
        return None, None
    try:
        infer = importlib.import_module("agent.infer")
    except ImportError:
        return None, "the learned agent is not available yet (agent.infer is missing): no policy results"
    place = getattr(infer, "place", None)
    if place is None:
        return None, "agent.infer has no place() function: no policy results"

    def run(graph: OpGraph, topo: Topology, objective: str, seed: int) -> Plan:
        res = place(graph, topo, policy=policy, objective=objective, seed=seed, baselines=False)
        plan = res.plan.copy()
        return finish(plan, "policy", seed, Scorer(graph, topo, objective, Budget(evaluations=1)),
                      winner=res.plan.provenance.get("winner"), checkpoint=str(policy))

    return run, None


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


def run_suite(suite: Suite, out_dir: str | os.PathLike, *, budget: Budget | None = None, policy: str | None = None,
              log: Callable[[str], None] = print, progress: bool = True, gantt: bool = True) -> list[Row]:
    """Run every placer of ``suite`` on every case and write the report into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    budget = budget or suite.budget
    place_policy, msg = _policy_runner(policy)
    if msg:
        log(msg)
    rows: list[Row] = []
    bounds: dict[str, dict] = {}
    best_plans: dict[str, tuple[OpGraph, Topology, Plan, str]] = {}
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    n_tasks = len(suite.cases) * (len(suite.placers) + (1 if place_policy else 0))
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not progress, transient=False) as bar:
        task = bar.add_task("bench", total=n_tasks)
        for case in suite.cases:
            try:
                graph, topo, expert = resolve_case(case, suite.base)
            except CaseSkipped as exc:
                log(f"skipping case {case.name}: {exc}")
                bar.advance(task, len(suite.placers) + (1 if place_policy else 0))
                continue
            lb = lower_bound(graph, topo, case.objective)
            unit = "ms" if graph.meta.get("source") == "dnn-partitioning" else "s"
            lb["unit"] = unit
            bounds[case.name] = lb
            case_rows: list[Row] = []
            runs = _case_runs(suite, case, graph, topo, expert, budget, place_policy)
            for name, fn in runs:
                bar.update(task, description=f"{case.name}: {name}")
                t0 = time.perf_counter()
                try:
                    plan = fn()
                    pr = plan.provenance
                    row = Row(case.name, name, graph.name, topo.name, case.objective, graph.num_nodes,
                              topo.num_devices, float(pr["predicted_step_time"]), pr["peak_memory"] / 1e9,
                              bool(pr["oom"]), time.perf_counter() - t0, int(pr.get("evaluations", 0)),
                              lb["lower_bound"], unit=unit)
                    key = (row.oom, row.predicted)
                    if name != "human_expert" and (case.name not in best_plans or key < best_plans[case.name][3]):
                        best_plans[case.name] = (graph, topo, plan, key)  # type: ignore[assignment]
                except RlplaceError as exc:
                    row = Row(case.name, name, graph.name, topo.name, case.objective, graph.num_nodes,
                              topo.num_devices, math.nan, math.nan, False, time.perf_counter() - t0, 0,
                              lb["lower_bound"], status=f"error: {exc}", unit=unit)
                case_rows.append(row)
                if name not in ("human_expert",):
                    bar.advance(task)
            fits = [r.predicted for r in case_rows if r.status == "ok" and not r.oom and r.placer in PLACERS]
            anyr = [r.predicted for r in case_rows if r.status == "ok" and r.placer in PLACERS]
            best = min(fits) if fits else (min(anyr) if anyr else math.nan)
            for r in case_rows:
                r.ratio_best = r.predicted / best if best and r.status == "ok" else math.nan
                bound = lb["lower_bound"] if not r.oom else lb["lower_bound_any"]
                r.ratio_lb = r.predicted / bound if bound > 0 and r.status == "ok" else math.nan
            rows += case_rows
    write_report(rows, bounds, suite, out, budget)
    if gantt:
        for cname, (graph, topo, plan, _) in best_plans.items():
            rep = simulate(graph, topo, plan, "step_time", timeline=True)
            from envs.gantt import save_gantt

            save_gantt(rep, out / "gantt" / f"{_slug(cname)}.png",
                       title=f"{cname}: best plan ({plan.provenance.get('placer')}), step_time timeline "
                             f"{rep.step_time * 1e3:.3g} ms")
        for cname, (_, _, plan, _) in best_plans.items():
            plan.save(out / "plans" / f"{_slug(cname)}.json")
    return rows


# ---------------------------------------------------------------------- report
def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)


def _fmt_t(t: float, unit: str = "s") -> str:
    if t is None or not np.isfinite(t):
        return "—"
    if unit != "s":  # a workload's own unit (dnn-partitioning files: milliseconds)
        return f"{t:.4g} {unit}"
    if t >= 1:
        return f"{t:.3g} s" if t < 1000 else f"{t:.4g}"
    return f"{t * 1e3:.3g} ms"


def _fmt_r(x: float) -> str:
    return "—" if not np.isfinite(x) else f"{x:.2f}"


def write_report(rows: list[Row], bounds: dict[str, dict], suite: Suite, out: Path, budget: Budget) -> None:
    """results.csv, results.md and ratios.png in ``out`` (each written atomically)."""
    buf = io.StringIO()
    fields = list(Row.__dataclass_fields__)
    w = csv.writer(buf)
    w.writerow(fields)
    for r in rows:
        w.writerow([getattr(r, f) for f in fields])
    atomic_write_text(out / "results.csv", buf.getvalue())
    atomic_write_text(out / "results.md", markdown(rows, bounds, suite, budget))
    if rows:
        _plot(rows, out / "ratios.png")


def markdown(rows: list[Row], bounds: dict[str, dict], suite: Suite, budget: Budget) -> str:
    cases = list(dict.fromkeys(r.case for r in rows))
    placers = list(dict.fromkeys(r.placer for r in rows))
    by = {(r.case, r.placer): r for r in rows}
    lines = [f"# Benchmark suite `{suite.name}`", "",
             f"Seed {suite.seed}; search placers ({', '.join(SEARCH_PLACERS)}) budget: "
             f"{budget.evaluations or '∞'} evaluations / {budget.seconds or '∞'} s. Times are simulated "
             "(`step_time`: one training step; `throughput`: steady-state time per global batch, for the "
             "dnn-partitioning workloads the paper's max-load in its time unit). Ratios: to the best baseline "
             "that fits memory, and to the lower bound (`agent/lower_bound.py`). OOM = out of memory.", "",
             "## Summary", "",
             "| case | objective | lower bound | best placer | best | best / LB | " + " | ".join(placers) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(placers)]
    for c in cases:
        crow = [by[(c, p)] for p in placers if (c, p) in by]
        ok = [r for r in crow if r.status == "ok" and r.placer in PLACERS]
        fit = [r for r in ok if not r.oom] or ok
        best = min(fit, key=lambda r: r.predicted) if fit else None
        cells = []
        for p in placers:
            r = by.get((c, p))
            if r is None:
                cells.append("")
            elif r.status != "ok":
                cells.append("error")
            else:
                cells.append(_fmt_r(r.ratio_best) + (" OOM" if r.oom else ""))
        lb, u = bounds[c]["lower_bound"], bounds[c]["unit"]
        lines.append(f"| {c} | {crow[0].objective} | {_fmt_t(lb, u)} | {best.placer if best else '—'} | "
                     f"{_fmt_t(best.predicted, u) if best else '—'} | {_fmt_r(best.predicted / lb) if best else '—'} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Per-placer cells: predicted time / best baseline's.", "", "## Details", "",
              "| case | placer | predicted | / best | / LB | planning s | peak mem GB | OOM | evals |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pred = _fmt_t(r.predicted, r.unit) if r.status == "ok" else r.status
        lines.append(f"| {r.case} | {r.placer} | {pred} | {_fmt_r(r.ratio_best)} | {_fmt_r(r.ratio_lb)} | "
                     f"{r.planning_s:.2f} | {r.peak_memory_gb:.3g} | {'yes' if r.oom else 'no'} | {r.evaluations} |")
    lines += ["", "## Lower bounds", "", "| case | lower bound | any plan (incl. OOM) | critical path | aggregate | "
              "aggregate with memory | largest op | min devices for states |", "|---|---|---|---|---|---|---|---|"]
    for c in cases:
        b, u = bounds[c], bounds[c]["unit"]
        lines.append(f"| {c} | {_fmt_t(b['lower_bound'], u)} | {_fmt_t(b['lower_bound_any'], u)} | "
                     f"{_fmt_t(b['critical_path'], u)} | {_fmt_t(b['aggregate'], u)} | "
                     f"{_fmt_t(b['aggregate_memory'], u) if b['aggregate_memory'] is not None else 'infeasible'} | "
                     f"{_fmt_t(b['largest_op'], u)} | {b['min_devices_for_states'] or 'more than available'} |")
    return "\n".join(lines) + "\n"


def _plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r.case for r in rows))
    placers = list(dict.fromkeys(r.placer for r in rows))
    by = {(r.case, r.placer): r for r in rows}
    M = np.full((len(cases), len(placers)), np.nan)
    for i, c in enumerate(cases):
        for j, p in enumerate(placers):
            r = by.get((c, p))
            if r is not None and np.isfinite(r.ratio_best):
                M[i, j] = r.ratio_best
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(6 + 0.8 * len(placers), 1.5 + 0.45 * len(cases)),
                                  gridspec_kw={"width_ratios": [len(placers), 3]})
    im = ax.imshow(np.log2(np.clip(M, 1, 64)), cmap="viridis_r", aspect="auto", vmin=0, vmax=3)
    for i in range(len(cases)):
        for j in range(len(placers)):
            r = by.get((cases[i], placers[j]))
            if r is not None and np.isfinite(M[i, j]):
                ax.text(j, i, f"{M[i, j]:.2f}" + ("\nOOM" if r.oom else ""), ha="center", va="center", fontsize=6,
                        color="white" if M[i, j] > 2.5 else "black")
    ax.set_xticks(range(len(placers)))
    ax.set_xticklabels(placers, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(cases)))
    ax.set_yticklabels(cases, fontsize=8)
    ax.set_title("predicted time / best baseline (log colour, capped at 8x)", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.03, label="log2 ratio")
    best_lb = []
    for c in cases:
        ok = [by[(c, p)] for p in placers if (c, p) in by and by[(c, p)].status == "ok" and by[(c, p)].placer in PLACERS]
        fit = [r for r in ok if not r.oom] or ok
        best_lb.append(min(r.ratio_lb for r in fit) if fit else np.nan)
    ax2.barh(range(len(cases)), best_lb, color="#4C72B0")
    ax2.axvline(1.0, color="k", lw=0.8)
    ax2.set_yticks(range(len(cases)))
    ax2.set_yticklabels([])
    ax2.invert_yaxis()
    ax2.set_xlabel("best / lower bound")
    ax2.set_title("gap to the lower bound", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)
