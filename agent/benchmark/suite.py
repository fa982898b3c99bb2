"""Benchmark suite files: the schema, loading, and turning a case into a graph and a topology.

A suite is a yaml file (``experiments/suites/<name>.yaml``, see :mod:`agent.checkout`)::

    name: default
    seed: 0
    budget: {seconds: 8, evaluations: 300}   # for the search placers (agent.placers.SEARCH_PLACERS)
    placers: all                            # or a list of names from agent.placers.PLACERS
    agent: {samples: 8, evaluations: 800}   # optional: the policy and policy+search columns (see AgentDoc)
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

``agent`` (optional; a suite without it has no agent columns unless ``rlplace bench --policy`` asks for
them): ``samples`` sampled rollouts besides the greedy one for the ``policy`` column (the trained policy
zero-shot: its best rollout), ``evaluations`` simulator evaluations of the policy-guided search for the
``policy+search`` column (``agent.infer.place`` with ``max_evaluations``: the search starts from the best
of the policy's rollouts and ``place``'s fast baselines; 0 leaves the column out), ``policy`` a
checkpoint (default: the shipped ``agent/pretrained/placement_policy.zip``; a relative path is taken
from the suite file's folder first). ``agent: true`` is the defaults, ``agent: false`` none.

Graphs: a built-in example (``gpt-small``), ``transformer:layers=..,hidden=..,seq=..,batch=..``
(``envs.examples.transformer_graph``), ``moe-transformer:layers=..,experts=..,top_k=..,hidden=..,seq=..,
batch=..,vocab=..`` (``envs.tasks.moe_graph``: a mixture-of-experts transformer),
``random-layered:seed=N`` / ``random-series-parallel:seed=N`` (the irregular random DAGs of
``agent.distribution.random_dags``, the training distribution's generators), ``builtin:NAME``
(``envs.tasks`` graphs shipped in envs/data), a graph JSON file, a model spec (``gpt:layers=4,...``,
``inception:blocks=6,...``, ``unet:...``) or ``file.py:fn`` (traced by ``profilers``), or
``dnn-partitioning:PATH`` (a public workload; it brings its own topology).

Topologies: a preset (``hetero``, ``a100-80g-cluster:nodes=4``), a yaml/JSON topology file, or
``cluster:seed=N[,memory_scale=F]``: the random cluster of ``agent.distribution.topologies.random_cluster``
for that seed (1-8 hosts of A100/H100/V100/T4 accelerators, some with their host CPU as a device, mixed
kinds across hosts), with every device's memory scaled by ``F`` in (0, 1] instead of the drawn scale
(a memory-tight cluster; the cluster is otherwise the same).

The knobs of the ``transformer:``, ``moe-transformer:``, ``random-*:`` and ``cluster:`` forms are
checked when the suite is read (an unknown or malformed knob is a :class:`SuiteError` naming the case).
``${VAR}`` in paths expands from the environment (``RLPLACE_WORKLOADS`` defaults to ``shared/workloads``
beside the checkout); relative paths are taken from the suite file's folder first. A case whose file is
missing is skipped with a message.
"""

from __future__ import annotations

import importlib
import inspect
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


class AgentDoc(_Doc):
    """``agent``: the trained policy's columns (see the module docstring)."""

    samples: Annotated[int, Field(ge=0, le=1024)] = 8
    evaluations: Annotated[int, Field(ge=0)] = 800
    policy: Text | None = None


def _agent_mapping(value: Any) -> Any:
    """``agent: true`` is the default settings, ``agent: false`` (or null) none."""
    if value is True:
        return {}
    if value is False:
        return None
    return value


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
    agent: Annotated[AgentDoc | None, BeforeValidator(_agent_mapping)] = None
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


@dataclass(frozen=True)
class AgentSettings:
    """The agent columns of a run: ``policy`` (a checkpoint path; None: the shipped policy) zero-shot with
    the greedy rollout and ``samples`` sampled ones, and ``evaluations`` of policy-guided search for
    ``policy+search`` (0: no such column)."""

    samples: int = 8
    evaluations: int = 800
    policy: str | None = None

    def describe(self) -> str:
        return f"policy `{self.policy}`" if self.policy else "the shipped policy `agent/pretrained/placement_policy.zip`"


@dataclass
class Suite:
    name: str
    cases: list[Case]
    placers: list[str]
    budget: Budget
    seed: int = 0
    base: Path = field(default_factory=Path.cwd)
    agent: AgentSettings | None = None


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
    for i, c in enumerate(cases):
        try:
            check_forms(c)
        except SuiteError as exc:
            raise SuiteError(f"{path}: cases[{i}] ({c.name}): {exc}") from None
    agent = None
    if doc.agent is not None:
        policy = _path(doc.agent.policy, path.parent) if doc.agent.policy else None
        agent = AgentSettings(samples=doc.agent.samples, evaluations=doc.agent.evaluations, policy=policy)
    return Suite(name=doc.name or path.stem, cases=cases, placers=list(doc.placers),
                 budget=Budget.of(budget, DEFAULT_BUDGET), seed=doc.seed, base=path.parent, agent=agent)


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


def _value(text: str) -> int | float | bool | str:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def _kv(args: str) -> dict:
    out = {}
    for part in filter(None, (x.strip() for x in args.split(","))):
        k, eq, v = part.partition("=")
        if not eq or not k.strip() or not v.strip():
            raise SuiteError(f"bad knob {part!r} (expected key=value)")
        out[k.strip()] = _value(v.strip())
    return out


def _builder(form: str):
    """The graph builder of a ``form:knobs`` graph spec."""
    if form == "transformer":
        from envs.examples import transformer_graph

        return transformer_graph
    if form == "moe-transformer":
        from envs.tasks import moe_graph

        return moe_graph
    from agent.distribution.random_dags import GENERATORS

    return GENERATORS[form]


GRAPH_FORMS = ("transformer", "moe-transformer", "random-layered", "random-series-parallel")
CLUSTER_KNOBS = ("seed", "memory_scale")


def _seed(knobs: dict, what: str) -> int:
    seed = knobs.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise SuiteError(f"{what} needs seed=N with an integer N >= 0, got {knobs.get('seed')!r}")
    return seed


def _graph_form(spec: str) -> tuple[str, dict] | None:
    """``(form, knobs)`` of a ``transformer:`` / ``moe-transformer:`` / ``random-*:`` graph spec, checked
    (unknown knobs, a missing or bad seed); None for any other spec."""
    form, sep, args = spec.partition(":")
    if not sep or form not in GRAPH_FORMS:
        return None
    knobs = _kv(args)
    if form.startswith("random-"):
        bad = sorted(set(knobs) - {"seed"})
        if bad:
            raise SuiteError(f"graph {spec!r}: unknown knob(s) {', '.join(bad)}; {form} takes seed=N")
        _seed(knobs, f"graph {spec!r}")
        return form, knobs
    params = inspect.signature(_builder(form)).parameters
    bad = sorted(k for k in knobs if k not in params or k == "name")
    if bad:
        raise SuiteError(f"graph {spec!r}: unknown knob(s) {', '.join(bad)}; knobs: "
                         + ", ".join(k for k in params if k != "name"))
    for k, v in knobs.items():
        default = params[k].default
        if isinstance(default, int) and not isinstance(default, bool) and (isinstance(v, bool)
                                                                            or not isinstance(v, int) or v < 1):
            raise SuiteError(f"graph {spec!r}: knob {k}={v} must be an integer >= 1")
    return form, knobs


def _cluster_form(spec: str) -> dict | None:
    """The knobs of a ``cluster:seed=N[,memory_scale=F]`` topology, checked; None for any other spec."""
    form, sep, args = spec.partition(":")
    if form != "cluster" or not sep:
        return None
    knobs = _kv(args)
    bad = sorted(set(knobs) - set(CLUSTER_KNOBS))
    if bad:
        raise SuiteError(f"topology {spec!r}: unknown knob(s) {', '.join(bad)}; cluster takes "
                         "seed=N[,memory_scale=F]")
    _seed(knobs, f"topology {spec!r}")
    scale = knobs.get("memory_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0 < scale <= 1:
        raise SuiteError(f"topology {spec!r}: memory_scale must be a number in (0, 1], got {scale!r}")
    return knobs


def check_forms(case: Case) -> None:
    """Check the knobs of the case's ``form:knobs`` graph and topology specs (SuiteError if bad)."""
    _graph_form(case.graph)
    if case.topology is not None:
        _cluster_form(case.topology)


def random_cluster_topology(spec: str) -> Topology:
    """The topology of a ``cluster:seed=N[,memory_scale=F]`` spec (see the module docstring)."""
    from agent.distribution.topologies import ClusterRanges, random_cluster

    knobs = _cluster_form(spec)
    if knobs is None:
        raise SuiteError(f"not a cluster spec: {spec!r} (expected cluster:seed=N[,memory_scale=F])")
    ranges = ClusterRanges()
    if "memory_scale" in knobs:
        scale = float(knobs["memory_scale"])
        ranges = ClusterRanges(memory_scale=(scale, scale))  # the same draws: only the scale differs
    return random_cluster(int(knobs["seed"]), ranges, name=spec)


def _case_topology(case: Case, base: Path) -> Topology:
    spec = str(case.topology)
    if _cluster_form(spec) is not None:
        return random_cluster_topology(spec)
    return resolve_topology(_path(spec, base))


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
    return graph, _case_topology(case, base), None


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
    form = _graph_form(spec)
    if form is not None:
        name, knobs = form
        try:
            if name.startswith("random-"):
                return _builder(name)(int(knobs["seed"]), name=spec)
            return _builder(name)(**knobs)
        except (TypeError, ValueError) as exc:
            raise SuiteError(f"case {case.name}: bad knobs in {spec!r}: {exc}") from exc
    if spec.startswith("builtin:"):
        from envs.tasks import load_builtin_graph

        return load_builtin_graph(spec.split(":", 1)[1])
    from agent.resolve import resolve_graph

    p = _path(spec, base)
    if p.endswith(".json") and not os.path.exists(p):
        raise CaseSkipped(f"graph file not found: {p}")
    return resolve_graph(p)


__all__ = ["SuiteError", "CaseSkipped", "SuiteDoc", "CaseDoc", "BudgetDoc", "AgentDoc", "AgentSettings", "Case",
           "Suite", "suite_path", "load_suite", "resolve_case", "check_forms", "random_cluster_topology"]
