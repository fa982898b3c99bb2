"""Benchmark suite files: the schema, loading, and turning a case into a graph and a topology.

A suite is a yaml file (``experiments/suites/<name>.yaml``, see :mod:`agent.checkout`)::

    name: default
    seed: 0
    budget: {seconds: 8, evaluations: 300}   # for the search placers (megatron_3d, random_search, mcmc)
    placers: all                            # or a list of names from agent.placers.PLACERS
    cases:
      - name: gpt-1.3b@dgx1                  # unique
        graph: gpt-1.3b                      # see resolve_case
        topology: dgx1-v100                  # preset or yaml/JSON file; omitted for imported workloads
        objective: step_time                 # step_time | throughput | latency
        requires: profilers.spec             # optional: skip the case (with a message) if not importable
        expert: path/to/split.json           # optional: a human-expert split to compare with

The file is read with :func:`envs.files.read_document` and checked against :class:`SuiteDoc`
(:func:`envs.files.validated`): unknown keys, wrong types and ranges are one :class:`SuiteError` line
naming the file and the field (``cases[2].objective``).

Graphs: a built-in example (``gpt-small``), ``transformer:layers=..,hidden=..,seq=..,batch=..``
(``envs.examples.transformer_graph``), ``builtin:NAME`` (``envs.tasks`` graphs shipped in envs/data),
a graph JSON file, a model spec (``gpt:layers=4,...``) or ``file.py:fn`` (traced by ``profilers``), or
``dnn-partitioning:PATH`` (a public workload; it brings its own topology). ``${VAR}`` in paths expands
from the environment (``RLPLACE_WORKLOADS`` defaults to ``shared/workloads`` beside the checkout); relative paths are
taken from the suite file's folder first. A case whose file is missing is skipped with a message.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from agent.checkout import DEFAULT_WORKLOADS, SUITES_DIR, experiments_file
from agent.placers import PLACERS, Budget
from envs.errors import RlplaceError
from envs.files import read_document, validated
from envs.graph import OpGraph
from envs.plan import Plan
from envs.presets import resolve_topology
from envs.sim import OBJECTIVES
from envs.topology import Topology

DEFAULT_BUDGET = Budget(seconds=10.0, evaluations=300)


class SuiteError(RlplaceError):
    """A benchmark suite file is missing or malformed."""


class CaseSkipped(Exception):
    """A case cannot run here (optional dependency or workload file missing)."""


# ---------------------------------------------------------------------- the schema
class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


Text = Annotated[str, Field(min_length=1)]


class BudgetDoc(_Doc):
    """``budget``: wall-clock seconds and / or simulator evaluations per search placer and case."""

    seconds: Annotated[float, Field(gt=0)] | None = None
    evaluations: Annotated[int, Field(ge=1)] | None = None


class CaseDoc(_Doc):
    """One case: a graph on a topology for an objective."""

    name: Text | None = None
    graph: Text
    topology: Text | None = None
    objective: Literal[OBJECTIVES] = "step_time"  # type: ignore[valid-type]
    requires: Text | None = None
    expert: Text | None = None
    note: str | None = None

    @model_validator(mode="after")
    def _has_topology(self) -> CaseDoc:
        if self.topology is None and not self.graph.startswith("dnn-partitioning:"):
            raise ValueError(f"({self.graph}) needs a 'topology'")
        return self

    def case_name(self) -> str:
        """``name``, else ``graph@topology`` (``graph@workload`` for a workload without a topology key)."""
        topology = self.topology if "topology" in self.model_fields_set else "workload"
        return self.name or f"{self.graph}@{topology}"


def _budget_mapping(value: Any) -> Any:
    """A bare budget number is evaluations (an int) or seconds (a float), as in :meth:`Budget.of`."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return {"evaluations": value}
    if isinstance(value, float):
        return {"seconds": value}
    return value


def _all_placers(value: Any) -> Any:
    return list(PLACERS) if value == "all" else value


class SuiteDoc(_Doc):
    """A whole suite file."""

    name: Text | None = None
    description: str | None = None
    seed: Annotated[int, Field(ge=0)] = 0
    budget: Annotated[BudgetDoc | None, BeforeValidator(_budget_mapping)] = None
    placers: Annotated[list[Text], Field(min_length=1), BeforeValidator(_all_placers)] = Field(
        default_factory=lambda: list(PLACERS))
    cases: Annotated[list[CaseDoc], Field(min_length=1)]

    @field_validator("placers")
    @classmethod
    def _known_placers(cls, v: list[str]) -> list[str]:
        bad = [p for p in v if p not in PLACERS]
        if bad:
            raise ValueError(f"unknown placer(s) {bad}; placers: {', '.join(PLACERS)}")
        return v

    @field_validator("cases")
    @classmethod
    def _unique_names(cls, v: list[CaseDoc]) -> list[CaseDoc]:
        seen: set[str] = set()
        for c in v:
            if c.case_name() in seen:
                raise ValueError(f"duplicate case name {c.case_name()!r}")
            seen.add(c.case_name())
        return v


# ---------------------------------------------------------------------- loaded suites
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


def suite_path(spec: str) -> Path:
    """A suite name (``default`` -> experiments/suites/default.yaml) or a yaml path."""
    p = Path(spec)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.exists():
            raise SuiteError(f"suite file not found: {spec}")
        return p
    return experiments_file(SUITES_DIR, spec, "suite", SuiteError)


def load_suite(spec: str) -> Suite:
    """Read and check a suite file (see the module docstring)."""
    path = suite_path(spec)
    doc = validated(SuiteDoc, read_document(path, "suite", SuiteError), "suite", SuiteError, path)
    budget = doc.budget.model_dump() if doc.budget is not None else None
    cases = [Case(name=c.case_name(), graph=c.graph, topology=c.topology, objective=c.objective,
                  requires=c.requires, expert=c.expert) for c in doc.cases]
    return Suite(name=doc.name or path.stem, cases=cases, placers=list(doc.placers),
                 budget=Budget.of(budget, DEFAULT_BUDGET), seed=doc.seed, base=path.parent)


# ---------------------------------------------------------------------- cases
def _path(text: str, base: Path) -> str:
    env = dict(os.environ)
    env.setdefault("RLPLACE_WORKLOADS", str(DEFAULT_WORKLOADS))
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
    if case.graph.startswith("dnn-partitioning:"):
        return _workload_case(case, base)
    graph = _case_graph(case, base)
    return graph, resolve_topology(_path(str(case.topology), base)), None


def _workload_case(case: Case, base: Path) -> tuple[OpGraph, Topology, Plan | None]:
    """A public dnn-partitioning workload: its graph, its own topology (or the case's), its expert split."""
    try:
        from profilers.dnn_partitioning import import_split, import_workload
    except ImportError as exc:
        raise CaseSkipped(f"the dnn-partitioning importer is not available ({exc})") from exc
    path = _path(case.graph.split(":", 1)[1], base)
    if not os.path.exists(path):
        raise CaseSkipped(f"workload file not found: {path}")
    graph, topo = import_workload(path)
    if case.topology:
        topo = resolve_topology(_path(case.topology, base))
    expert = None
    if case.expert:
        epath = _path(case.expert, base)
        if os.path.exists(epath):
            expert = import_split(epath, graph, topo)
    return graph, topo, expert


def _case_graph(case: Case, base: Path) -> OpGraph:
    spec = case.graph
    if spec.startswith("transformer:"):
        from envs.examples import transformer_graph

        try:
            return transformer_graph(**_kv(spec.split(":", 1)[1]))
        except TypeError as exc:
            raise SuiteError(f"case {case.name}: bad transformer knobs in {spec!r}: {exc}") from exc
    if spec.startswith("builtin:"):
        from envs.tasks import load_builtin_graph

        return load_builtin_graph(spec.split(":", 1)[1])
    from agent.resolve import resolve_graph

    p = _path(spec, base)
    if p.endswith(".json") and not os.path.exists(p):
        raise CaseSkipped(f"graph file not found: {p}")
    return resolve_graph(p)


__all__ = ["SuiteError", "CaseSkipped", "SuiteDoc", "CaseDoc", "BudgetDoc", "Case", "Suite", "suite_path",
           "load_suite", "resolve_case"]
