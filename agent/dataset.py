"""The best-known-plans dataset: training tasks, the best plan search found for each, its predicted
value and the task's lower bound — what expert iteration distils the policy on, and a benchmark others
can reuse.

**Format** (``rlplace.dataset``, version 2), a directory::

    manifest.json            {"format": "rlplace.dataset", "version": 2, "params": {seed, evaluations, ...}, ...}
    tasks.jsonl              one JSON object per line (a row, see below), appended as work finishes
    graphs/<fingerprint>-<hash>.json   the operator graphs (rlplace graph JSON), shared by rows of one graph
    topologies/<name>-<hash>.json      the topologies (rlplace topology JSON)

``<hash>`` hashes the whole file, so two graphs of one structure (the fingerprint: node names, kinds and
edges) at other sizes — a model family at another width or batch — get two files. Version 1 named graph
files by the fingerprint alone, so such a task read the first one's graph; it is refused, and
``python -m experiments.upgrade_dataset OLD NEW`` rebuilds each row's graph from its spec and re-simulates
its plan on it.

A row: ``task_id`` (unique per graph x topology x batch x objective), ``family``, ``spec`` (model spec
or generator id), ``split`` (``train`` / ``validation`` / ``holdout``), ``graph`` and ``topology`` (paths
relative to the directory), ``nodes``, ``devices``, ``global_batch``, ``objective``, ``lower_bound`` (seconds; no plan
can beat it that fits in memory, ``agent.lower_bound``; ``lower_bound_any``: none at all),
``heuristic_value``, ``heuristic_oom`` and ``heuristic`` (the best fast placer),
``value`` (the best plan's objective value, seconds: ``EvalResult.value``), ``oom``, ``source`` (what found it: ``mcmc from megatron_3d``, ``policy round 2``...),
``plan`` (the rlplace plan JSON), ``round``, ``evaluations`` and ``seconds`` of the search, ``seed``.
Later rounds append better rows for the same ``task_id``; :meth:`Dataset.best` keeps the best one per
task. Read it with pandas: ``pandas.read_json("DIR/tasks.jsonl", lines=True)`` (or
``pyarrow.json.read_json``).

**Building** (:func:`build`) is resumable: finished tasks' rows are appended in task order and flushed
(``fsync``) one by one, tasks already in the file are skipped, and a line torn by a kill is dropped on
the next open. The same tasks, budgets (evaluations, not seconds) and seed give the same rows (all but
``seconds``), in-process or on Ray (:class:`agent.scale.Executor`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envs.errors import RlplaceError
from envs.files import atomic_write_json, finite_json, one_line, read_document
from envs.graph import OpGraph
from envs.plan import Plan
from envs.tasks import Task
from envs.topology import Topology

FORMAT = "rlplace.dataset"
VERSION = 2
ROW_KEYS = ("task_id", "value", "oom", "plan", "graph", "topology", "global_batch")


class DatasetError(RlplaceError):
    """A dataset directory is unusable (another format or version, a malformed row, a bad build request)."""


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("rlplace")
    except Exception:  # noqa: BLE001 - not installed as a package
        return ""


def topology_id(topology: Topology) -> str:
    text = finite_json(topology.to_dict())
    return f"{topology.name.replace(':', '_').replace('/', '_')}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"


def graph_file_id(graph: OpGraph, doc: dict | None = None) -> str:
    """The graph's file name in a dataset: its structure's fingerprint and a hash of the whole graph
    (``doc``: its ``to_dict()``, if at hand)."""
    text = finite_json(graph.to_dict() if doc is None else doc)
    return f"{graph.fingerprint()}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"


def task_id(task: Task, objective: str) -> str:
    return f"{task.graph.name}#{task.graph.fingerprint()}@{topology_id(task.topology)}/b{task.global_batch}/{objective}"


@dataclass
class TaskJob:
    """One dataset task to search: what :func:`solve` needs (picklable for Ray)."""

    task: Task
    family: str
    spec: str
    split: str = "train"
    objective: str = "step_time"
    evaluations: int = 800
    seed: int = 0
    start: Plan | None = None  # a plan to search from (e.g. the policy's); default: the best fast heuristic
    source: str = ""
    round: int = 0

    @property
    def task_id(self) -> str:
        return task_id(self.task, self.objective)


TIMING_FIELDS = ("seconds",)  # the only row fields that differ between two builds with the same seed


def _scrub(plan_dict: dict) -> dict:
    """A plan's JSON without wall-clock provenance (so the same seed gives byte-identical rows)."""
    prov = {k: v for k, v in (plan_dict.get("provenance") or {}).items() if "seconds" not in k}
    return {**plan_dict, "provenance": prov}


def solve(job: TaskJob) -> dict[str, Any]:
    """Search one task: the fast baselines (``agent.infer.run_baselines``), then MCMC
    (``agent.placers.mcmc``) from the best of them (or from ``job.start``) for ``job.evaluations``
    simulator evaluations; the dataset row (without the graph / topology file paths)."""
    from agent.infer import Candidate, placer_candidate, run_baselines
    from agent.lower_bound import lower_bound
    from agent.placers import Budget, run_placer
    from envs.evaluator import CachedSimulation

    t0 = time.perf_counter()
    g, topo = job.task.graph, job.task.topology
    ev = CachedSimulation()
    cands = run_baselines(g, topo, job.objective, seed=job.seed, evaluator=ev)
    if not cands:
        raise DatasetError(f"task {job.task_id}: no baseline placer produced a valid plan")
    heur = min(cands, key=Candidate.key)
    best = heur
    source = heur.name
    if job.start is not None:
        st = placer_candidate(job.source or "given", "start", job.start, g, topo, job.objective, ev)
        if st is not None and st.key() < best.key():
            best, source = st, job.source or "given"
    start_name = source
    found = None
    if job.evaluations > 0:  # 0: the heuristics alone (e.g. a held-out task's yardstick)
        try:
            found = run_placer("mcmc", g, topo, seed=job.seed, objective=job.objective,
                               budget=Budget(evaluations=int(job.evaluations)), start=best.plan.copy())
        except RlplaceError:
            found = None
    if found is not None:
        c = placer_candidate(f"mcmc from {start_name}", "search", found, g, topo, job.objective, ev)
        if c is not None and c.key() < best.key():
            best, source = c, f"mcmc from {start_name}"
    lb = lower_bound(g, topo, job.objective)
    return {"task_id": job.task_id, "family": job.family, "spec": job.spec, "split": job.split,
            "nodes": int(g.num_nodes), "devices": int(topo.num_devices), "global_batch": job.task.global_batch,
            "objective": job.objective, "lower_bound": float(lb["lower_bound"]),
            "lower_bound_any": float(lb["lower_bound_any"]),
            "heuristic_value": float(heur.value), "heuristic": heur.name, "heuristic_oom": bool(heur.oom),
            "value": float(best.value), "oom": bool(best.oom), "source": source,
            "plan": _scrub(best.plan.bind(g).to_dict()), "round": int(job.round),
            "evaluations": int(job.evaluations), "seconds": round(time.perf_counter() - t0, 3),
            "seed": int(job.seed)}


def jobs_from_draws(draws, *, evaluations: int, objective: str = "step_time") -> list[TaskJob]:
    """The dataset jobs of tasks drawn by :func:`agent.distribution.draw_tasks`."""
    return [TaskJob(task=Task(d.graph, d.topology), family=d.family, spec=d.spec, split=d.split,
                    objective=objective, evaluations=int(evaluations), seed=d.seed) for d in draws]


@dataclass
class Dataset:
    """A dataset directory (see the module docstring)."""

    path: Path
    rows: list[dict] = field(default_factory=list)
    manifest: dict = field(default_factory=dict)

    @classmethod
    def open(cls, path: str | os.PathLike, *, create: bool = False, params: dict | None = None,
             description: str = "") -> Dataset:
        """Open (or with ``create`` make) a dataset; a torn last line of tasks.jsonl is dropped.
        ``params`` (seed, evaluations, objective, ...) are stored in a new manifest and must match an
        existing one's, so a resumed build continues the same distribution."""
        p = Path(path)
        man = p / "manifest.json"
        if not man.exists():
            if not create:
                raise DatasetError(f"{p} is not an rlplace dataset (no manifest.json)")
            from envs.files import check_output_dir

            check_output_dir(p, "dataset directory")
            if p.is_dir() and any(p.iterdir()):
                raise DatasetError(f"{p} is a non-empty directory without a dataset manifest.json: "
                                   "give a new or empty directory")
            p.mkdir(parents=True, exist_ok=True)
            manifest = {"format": FORMAT, "version": VERSION, "description": description,
                        "params": dict(params or {}), "rlplace": _version(),
                        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            atomic_write_json(man, manifest, indent=2)
        else:
            manifest = read_document(man, "dataset manifest", DatasetError)
            if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
                raise DatasetError(f"{man}: not an rlplace dataset (expected \"format\": {FORMAT!r})")
            v = manifest.get("version")
            if v == 1:
                raise DatasetError(f"{man}: dataset format version 1, whose tasks of one graph structure at other "
                                   f"sizes could read each other's graph; this rlplace reads version {VERSION}: "
                                   "python -m experiments.upgrade_dataset OLD NEW, or rebuild it")
            if v != VERSION:
                raise DatasetError(f"{man}: dataset format version {v!r}; this rlplace reads version {VERSION} "
                                   "only: rebuild it into a new directory")
            old = manifest.get("params") or {}
            diff = [k for k in (params or {}) if k in old and old[k] != params[k]]
            if diff:
                k = diff[0]
                raise DatasetError(f"{p} was built with {k}={old[k]!r}, not {params[k]!r}: use the same "
                                   "settings to resume it, or a new directory")
        ds = cls(path=p, manifest=manifest)
        ds.rows = ds._read_rows()
        return ds

    def _read_rows(self) -> list[dict]:
        f = self.path / "tasks.jsonl"
        if not f.exists():
            return []
        raw = f.read_bytes()
        complete, sep, torn = raw.rpartition(b"\n")
        if torn:  # a last line without its newline was cut by a kill: drop it
            with open(f, "rb+") as fh:
                fh.truncate(len(complete) + len(sep))
        rows = []
        for i, line in enumerate(complete.split(b"\n") if sep else []):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict) or any(k not in row for k in ROW_KEYS):
                    raise ValueError("not a dataset row")
            except ValueError as exc:
                raise DatasetError(f"{f}: line {i + 1} is not a dataset row ({one_line(exc)})") from None
            rows.append(row)
        return rows

    def done(self) -> set[str]:
        return {r["task_id"] for r in self.rows}

    def best(self) -> dict[str, dict]:
        """task_id -> its best row (fits in memory first, then the lowest value; later rounds win ties)."""
        out: dict[str, dict] = {}
        for r in self.rows:
            cur = out.get(r["task_id"])
            if cur is None or (r["oom"], r["value"]) <= (cur["oom"], cur["value"]):
                out[r["task_id"]] = r
        return out

    def _store(self, sub: str, name: str, doc: dict) -> str:
        rel = f"{sub}/{name}.json"
        target = self.path / rel
        if not target.exists():
            atomic_write_json(target, doc)
        return rel

    def append(self, row: dict, task: Task) -> dict:
        """Write the row's graph and topology files (once) and append the row, flushed to disk."""
        row = dict(row)
        doc = task.graph.to_dict()
        row["graph"] = self._store("graphs", graph_file_id(task.graph, doc), doc)
        row["topology"] = self._store("topologies", topology_id(task.topology), task.topology.to_dict())
        line = (finite_json(row) + "\n").encode()
        fd = os.open(self.path / "tasks.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.rows.append(row)
        return row

    def task(self, row: dict) -> Task:
        """The Task a row describes (graph and topology read from the dataset)."""
        g = OpGraph.load(self.path / row["graph"])
        t = Topology.load(self.path / row["topology"])
        return Task(g, t, row["global_batch"], name=row["task_id"])

    def plan(self, row: dict) -> Plan:
        return Plan.from_dict(row["plan"], source=f"{self.path}/tasks.jsonl:{row['task_id']}")


def build(dataset: Dataset, jobs: Sequence[TaskJob], *, executor=None,
          log: Callable[[str], None] | None = None, progress: bool = True, replace_if_better: bool = False) -> int:
    """Solve the jobs not yet in ``dataset`` (all of them with ``replace_if_better``, appending a row only
    when it beats the task's best) and append their rows as they finish; returns rows written."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from agent.scale import Executor

    say = log or (lambda _m: None)
    done = dataset.done()
    best = dataset.best()
    todo = [j for j in jobs if replace_if_better or j.task_id not in done]
    if not todo:
        say(f"dataset {dataset.path}: all {len(jobs)} task(s) done")
        return 0
    ex = executor or Executor()
    written = 0
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not progress) as bar:
        t = bar.add_task(f"dataset ({len(done)} done)", total=len(todo))

        finished: dict[int, dict] = {}
        next_i = 0

        def keep(i: int, row: dict) -> None:
            # rows are appended in job order (a job finished early on Ray waits for the ones before it),
            # so the file is the same however the jobs ran
            nonlocal written, next_i
            finished[i] = row
            while next_i in finished:
                r = finished.pop(next_i)
                cur = best.get(r["task_id"])
                if cur is None or (r["oom"], r["value"]) < (cur["oom"], cur["value"]):
                    dataset.append(r, todo[next_i].task)
                    best[r["task_id"]] = r
                    written += 1
                next_i += 1
            bar.advance(t)

        with ex:
            ex.map(solve, todo, on_result=keep)
    say(f"dataset {dataset.path}: {written} row(s) written, {len(dataset.rows)} in all")
    return written


__all__ = ["Dataset", "DatasetError", "TaskJob", "build", "solve", "task_id", "graph_file_id", "FORMAT", "VERSION"]
