"""What every placer shares: budgets, a caching scorer, the graph's placement constraints, and the
helpers that turn a device assignment into a valid Plan.

A placer minimises the simulator's objective value (``StepReport.value``): the step time, the latency,
or for ``throughput`` the steady-state time per global batch, so that plans with different microbatch
counts compare fairly (for the dnn-partitioning workloads, one sample in one microbatch, the paper's
max-load).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from envs.errors import PlanError, RlplaceError
from envs.evaluator import CachedSimulation, EvalResult
from envs.graph import CAN_BATCH, CAN_COL, CAN_REPLICATE, CAN_ROW, OpGraph
from envs.graph_partition import units
from envs.plan import DTYPE_BYTES, Plan, plan_defaults
from envs.sim import OBJECTIVES, node_times
from envs.topology import Topology


class PlacerError(RlplaceError):
    """A placer was asked for something it cannot do (unknown name, bad budget, unknown objective)."""


# ---------------------------------------------------------------------- budgets
@dataclass(frozen=True)
class Budget:
    """How much search a placer may do: wall-clock ``seconds`` and/or simulator ``evaluations``.

    The placer stops at whichever limit comes first. Evaluation budgets make results deterministic for a
    seed; with only a wall-clock budget, a placer is deterministic given the number of evaluations it
    reached (a faster machine gets further along the same trajectory)."""

    seconds: float | None = None
    evaluations: int | None = None

    @classmethod
    def of(cls, budget: Budget | int | float | dict | None, default: Budget) -> Budget:
        """``None`` -> ``default``; an ``int`` -> evaluations; a ``float`` -> seconds; a dict with keys
        ``seconds`` / ``evaluations``; or a Budget."""
        if budget is None:
            return default
        if isinstance(budget, Budget):
            return budget
        if isinstance(budget, bool):
            raise PlacerError(f"bad budget {budget!r}")
        if isinstance(budget, int):
            return cls(evaluations=budget)
        if isinstance(budget, float):
            return cls(seconds=budget)
        if isinstance(budget, dict):
            unknown = set(budget) - {"seconds", "evaluations"}
            if unknown:
                raise PlacerError(f"unknown budget key(s) {sorted(unknown)}; use 'seconds' and/or 'evaluations'")
            s, e = budget.get("seconds"), budget.get("evaluations")
            return cls(seconds=None if s is None else float(s), evaluations=None if e is None else int(e))
        raise PlacerError(f"bad budget {budget!r}: give seconds (float), evaluations (int) or a dict")

    def __post_init__(self) -> None:
        if self.seconds is not None and not self.seconds > 0:
            raise PlacerError(f"budget seconds must be > 0, got {self.seconds}")
        if self.evaluations is not None and self.evaluations < 1:
            raise PlacerError(f"budget evaluations must be >= 1, got {self.evaluations}")


# ---------------------------------------------------------------------- scoring
@dataclass
class Outcome:
    """What the Scorer says about one plan: its objective value and the evaluation it came from."""

    value: float  # the evaluation's objective value
    oom: bool
    overflow: float  # worst device's peak / capacity
    peak_memory: float  # bytes, worst device
    evaluation: EvalResult

    def key(self) -> tuple:
        """Sort key: plans that fit first, then by value (OOM plans by how far they overflow)."""
        return (0, self.value) if not self.oom else (1, self.overflow, self.value)


# A search whose last 5,000 proposals were all plans it had scored (or invalid ones) stops: on a 5-operator
# LSTM model `rlplace place` spent its 20 s budget on 150,000 proposals for 691 distinct plans.
REPEATS_TO_STOP = 5000


class Scorer:
    """Evaluates plans with the simulator (through a caching evaluator), counts evaluations and keeps
    time, so placers can honour a :class:`Budget`."""

    def __init__(self, graph: OpGraph, topology: Topology, objective: str, budget: Budget,
                 on_improve: Callable[[int, float], None] | None = None):
        if objective not in OBJECTIVES:
            raise PlacerError(f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
        self.graph, self.topology, self.objective, self.budget = graph, topology, objective, budget
        self.evaluator = CachedSimulation(cache_size=8192, validate=False)
        self.evaluations = 0
        self.repeats = 0  # calls in a row that scored no new plan (one seen before, or an invalid one)
        self.t0 = time.perf_counter()
        self.best: tuple[Outcome, Plan] | None = None
        self.on_improve = on_improve  # called (evaluations so far, value) whenever the best plan improves

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def exhausted(self) -> bool:
        b = self.budget
        if b.evaluations is not None and self.evaluations >= b.evaluations:
            return True
        return b.seconds is not None and self.elapsed() >= b.seconds

    def searching(self, proposals: int) -> bool:
        """A search loop goes on after ``proposals`` proposals: budget left, new plans still being found, and
        at most 50 proposals per evaluation of an evaluation budget (a space of invalid plans ends too)."""
        return (not self.exhausted() and not self.saturated()
                and proposals < 50 * (self.budget.evaluations or 10**6))

    def saturated(self) -> bool:
        """:data:`REPEATS_TO_STOP` calls in a row scored no new plan: a search has seen every plan its moves
        reach (a model of a few operators), and would spend the rest of a time budget on cache hits (the
        annealing loops stop; an enumeration of templates does not ask)."""
        return self.repeats >= REPEATS_TO_STOP

    def __call__(self, plan: Plan) -> Outcome | None:
        """Outcome of a plan, or None if it is invalid. Every call on a new plan counts as an evaluation."""
        try:
            plan.validate(self.graph, self.topology)
            check_restrictions(self.graph, self.topology, plan)
        except PlanError:
            self.repeats += 1
            return None
        hits = self.evaluator.hits
        res = self.evaluator.evaluate(self.graph, self.topology, plan, self.objective)
        if self.evaluator.hits == hits:
            self.evaluations += 1
            self.repeats = 0
        else:
            self.repeats += 1
        out = Outcome(float(res.value), bool(res.oom), res.overflow,
                      float(res.peak_memory.max()) if res.peak_memory.size else 0.0, res)
        if self.best is None or out.key() < self.best[0].key():
            self.best = (out, plan)
            if self.on_improve is not None:
                self.on_improve(self.evaluations, out.value)
        return out


def finish(plan: Plan, name: str, seed: int, scorer: Scorer, **extra) -> Plan:
    """Validate ``plan``, score it, stamp its provenance and remember its evaluation
    (:func:`finished_evaluation`)."""
    plan.validate(scorer.graph, scorer.topology)
    check_restrictions(scorer.graph, scorer.topology, plan)
    out = scorer(plan)
    assert out is not None
    plan.provenance = {"placer": name, "seed": int(seed), "objective": scorer.objective,
                       "predicted_step_time": out.value, "peak_memory": out.peak_memory, "oom": out.oom,
                       "evaluations": scorer.evaluations, "planning_seconds": round(scorer.elapsed(), 4), **extra}
    plan.bind(scorer.graph)
    _FINISHED[plan] = (plan.key(), weakref.ref(scorer.graph), weakref.ref(scorer.topology), scorer.objective,
                       out.evaluation)
    return plan


# plan -> (its key, graph, topology, objective, evaluation) when finish() stamped it; weak, so an entry
# lives exactly as long as its plan
_FINISHED: weakref.WeakKeyDictionary[Plan, tuple] = weakref.WeakKeyDictionary()


def finished_evaluation(plan: Plan, graph: OpGraph, topology: Topology, objective: str) -> EvalResult | None:
    """The evaluation the placer's Scorer gave ``plan`` when :func:`finish` stamped it, if the plan is
    unchanged since and was scored on these very graph and topology objects for ``objective``; None
    otherwise. Lets a caller use a placer's evaluation instead of simulating the plan a second time."""
    hit = _FINISHED.get(plan)
    if hit is None:
        return None
    key, scored_graph, scored_topology, scored_objective, evaluation = hit
    same = scored_graph() is graph and scored_topology() is topology and scored_objective == objective
    return evaluation if same and key == plan.key() else None


def best_of(scorer: Scorer, plans: Sequence[Plan]) -> tuple[Plan, Outcome]:
    """Evaluate candidates in order (stopping when the budget runs out, after at least one valid one)
    and return the best. Raises PlacerError when none is valid."""
    best: tuple[Plan, Outcome] | None = None
    for p in plans:
        if best is not None and scorer.exhausted():
            break
        out = scorer(p)
        if out is not None and (best is None or out.key() < best[1].key()):
            best = (p, out)
    if best is None:
        raise PlacerError("no valid candidate plan")
    return best


# ---------------------------------------------------------------------- constraints
def allowed_devices(graph: OpGraph, topology: Topology) -> np.ndarray:
    """Boolean (nodes x devices): where each node may run (``meta["cpu_only"]`` nodes only on CPUs)."""
    ok = np.ones((graph.num_nodes, topology.num_devices), dtype=bool)
    cpu_only = graph.meta.get("cpu_only") or []
    if cpu_only:
        is_cpu = np.array([d.kind == "cpu" for d in topology.devices])
        ok[np.asarray(cpu_only, dtype=np.int64)] = is_cpu[None, :]
    return ok


def check_restrictions(graph: OpGraph, topology: Topology, plan: Plan) -> None:
    """Restrictions beyond Plan.validate: CPU-only nodes stay on CPUs."""
    cpu_only = graph.meta.get("cpu_only") or []
    for v in cpu_only:
        if any(topology.devices[d].kind != "cpu" for d in plan.groups[v]):
            raise PlanError(f"node {graph.names[v]!r} may only run on a CPU")


def layout_ok(graph: OpGraph, v: int, layout: str, group_size: int, dp: int) -> bool:
    return caps_allow(int(graph.layout_caps[v]), layout, group_size, dp)


def caps_allow(caps: int, layout: str, group_size: int, dp: int) -> bool:
    """Whether layout capability bits ``caps`` allow ``layout`` on ``group_size`` devices with data-parallel
    degree ``dp``. Every test is on single bits, so for a set of nodes it holds for all of them exactly
    when it holds for the bitwise AND of their caps."""
    if layout == "single":
        return group_size == 1
    if layout == "batch_split":
        return bool(caps & CAN_BATCH) and dp == group_size
    if dp > 1 and not caps & CAN_BATCH:
        return False
    if layout == "col_split":
        return bool(caps & CAN_COL)
    if layout == "row_split":
        return bool(caps & CAN_ROW)
    if layout == "seq_split":  # sequence parallelism: token-wise ops of a tensor-parallel group (tp >= 2)
        return bool(caps & CAN_REPLICATE and caps & CAN_BATCH) and group_size // dp >= 2
    return layout == "replicate" and bool(caps & CAN_REPLICATE)


_UNIT_TABLES: dict[int, tuple] = {}


def _unit_table(graph: OpGraph) -> tuple[list[np.ndarray], list[int]]:
    """(nodes of every unit, the bitwise AND of its nodes' layout caps), once per graph object (the
    placers call :func:`enforce_constraints` for every candidate plan of the same graph)."""
    hit = _UNIT_TABLES.get(id(graph))
    if (hit is not None and hit[0]() is graph and np.array_equal(hit[1], graph.colocation)
            and np.array_equal(hit[2], graph.layout_caps)):  # the arrays may be replaced in place
        return hit[3]
    _, members = units(graph)
    caps = np.asarray(graph.layout_caps, dtype=np.int64)
    table = (members, [int(np.bitwise_and.reduce(caps[m])) for m in members])
    if len(_UNIT_TABLES) >= 64:
        _UNIT_TABLES.clear()
    _UNIT_TABLES[id(graph)] = (weakref.ref(graph), graph.colocation.copy(), caps.copy(), table)
    return table


def enforce_constraints(graph: OpGraph, topology: Topology, plan: Plan) -> Plan:
    """Make ``plan`` respect co-location classes and CPU-only nodes: each class takes the group and
    layout of its first member (in topological order) if every member can use them, else the class runs
    ``single`` on that group's first device; CPU-only nodes (and their classes) move to the first CPU."""
    groups, layouts, dps = list(plan.groups), list(plan.layouts), plan.dp.copy()
    restricted = bool(graph.meta.get("cpu_only"))
    allowed = allowed_devices(graph, topology) if restricted else None
    members, unit_caps = _unit_table(graph)
    cpus = [i for i, d in enumerate(topology.devices) if d.kind == "cpu"]
    for nodes, caps in zip(members, unit_caps):
        first = int(nodes[0])
        g, lay, dp = groups[first], layouts[first], int(dps[first])
        if restricted and not allowed[np.ix_(nodes, list(g))].all():
            g, lay, dp = ((cpus[0],) if cpus else (g[0],)), "single", 1
        elif not caps_allow(caps, lay, len(g), dp):
            g, lay, dp = (g[0],), "single", 1
        for v in nodes:
            groups[v], layouts[v], dps[v] = g, lay, dp
    return plan.copy(groups=groups, layouts=layouts, dp=dps)


# ---------------------------------------------------------------------- plan builders
def assignment_plan(graph: OpGraph, topology: Topology, device: Sequence[int], *, microbatches: int = 1,
                    schedule: str = "1f1b", global_batch: int | None = None, recompute: bool = False) -> Plan:
    """One device per node, layout ``single``, then :func:`enforce_constraints`."""
    n = graph.num_nodes
    plan = Plan(groups=[(int(d),) for d in device], layouts=["single"] * n, microbatches=microbatches,
                schedule=schedule, global_batch=global_batch, recompute=np.full(n, recompute),
                **plan_defaults(graph))
    return enforce_constraints(graph, topology, plan)


def divisors(x: int) -> list[int]:
    return [d for d in range(1, int(x) + 1) if x % d == 0]


def microbatch_options(batch: int, limit: int = 6, multiple_of: int = 1) -> list[int]:
    """Up to ``limit`` microbatch counts m (powers of two first, then other divisors of ``batch``) whose
    microbatch size batch/m is a multiple of ``multiple_of``."""
    ok = [m for m in divisors(batch) if (batch // m) % multiple_of == 0]
    pow2 = [m for m in ok if m & (m - 1) == 0]
    rest = [m for m in ok if m not in pow2]
    return (pow2 + rest)[:limit] or [1]


def op_time_matrix(graph: OpGraph, topology: Topology, dtype: str | None = None) -> np.ndarray:
    """Forward + backward time (s) of each node alone on each device for the traced batch
    (``envs.sim.node_times`` with layout ``single``): nodes x devices."""
    dtype = dtype or plan_defaults(graph)["dtype"]
    n, nd = graph.num_nodes, topology.num_devices
    out = np.zeros((n, nd))
    by_kind: dict[tuple, np.ndarray] = {}
    for d, dev in enumerate(topology.devices):
        key = (dev.kind, dev.flops(dtype), dev.bandwidth(), dev.launch_overhead)
        if key not in by_kind:
            plan = Plan(groups=[(d,)] * n, layouts=["single"] * n, dtype=dtype)
            f, b = node_times(graph, topology, plan, 1.0)[:2]
            by_kind[key] = f + b
        out[:, d] = by_kind[key]
    return out


def device_speed_order(topology: Topology, dtype: str = "bf16") -> list[int]:
    """Devices fastest first (by achievable FLOP/s, then memory), ties in topology order."""
    return sorted(range(topology.num_devices),
                  key=lambda d: (-topology.devices[d].flops(dtype), -topology.devices[d].memory_bytes, d))


def node_memory(graph: OpGraph, plan_kw: dict, microbatch_scale: float = 1.0, inflight: int = 1) -> np.ndarray:
    """Additive per-node memory estimate (bytes) when the node runs ``single``: model states plus the
    stashed output for ``inflight`` microbatches (the simulator's ``memory`` without recomputation)."""
    pbytes = DTYPE_BYTES.get(graph.dtype, 2)
    if graph.meta.get("memory_model") == "param_bytes":
        states = graph.param_bytes.copy()
    else:
        states = graph.param_bytes / pbytes * plan_kw["state_bytes_per_param"]
    return states + graph.out_bytes * microbatch_scale * inflight


def repair_memory(graph: OpGraph, topology: Topology, device: np.ndarray, mem: np.ndarray,
                  times: np.ndarray | None = None) -> np.ndarray:
    """Move placement units off over-full devices (additive memory ``mem`` per node) until every device
    fits or nothing can move: repeatedly take the over-full device's unit with the most memory per unit
    of time and put it on the allowed device with the most free memory that can take it. Returns the new
    assignment (a copy)."""
    device = np.asarray(device, dtype=np.int64).copy()
    cap = np.array([d.memory_bytes for d in topology.devices])
    allowed = allowed_devices(graph, topology)
    unit, members = units(graph)
    umem = np.array([mem[m].sum() for m in members])
    utime = np.array([(times[m].min(axis=1).sum() if times is not None else 1.0) for m in members]) + 1e-30
    uallowed = np.array([allowed[m].all(axis=0) for m in members])
    udev = np.array([device[m[0]] for m in members])
    used = np.bincount(udev, weights=umem, minlength=topology.num_devices)
    for _ in range(4 * len(members)):
        over = np.flatnonzero(used > cap)
        if over.size == 0:
            break
        d = int(over[np.argmax(used[over] - cap[over])])
        cand = np.flatnonzero(udev == d)
        moved = False
        for u in cand[np.argsort(-umem[cand] / utime[cand], kind="stable")]:
            free = cap - used
            free[d] = -np.inf
            ok = np.flatnonzero(uallowed[u] & (free >= umem[u]))
            if ok.size:
                t = int(ok[np.argmax(free[ok])])
                used[d] -= umem[u]
                used[t] += umem[u]
                udev[u] = t
                moved = True
                break
        if not moved:
            break
    for u, m in enumerate(members):
        device[m] = udev[u]
    return device
