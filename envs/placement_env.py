"""``rlplace/Placement-v0``: place an operator graph on a device topology, one decision per step.

**Episode (mode ``"place"``).** A task (graph, topology, batch) is drawn at every ``reset``. Graphs
larger than ``max_nodes`` are coarsened to at most ``max_nodes`` groups (``envs.coarsen``); the agent
places groups and ``info["plan"]`` is expanded back to operators. The episode first decides the global
parallelism choices, then one option per node group:

1. number of microbatches (action i -> ``microbatch_choices[i]``; only divisors of the batch allowed),
2. pipeline schedule (0 = GPipe, 1 = 1F1B),
3. activation recomputation (0 = none, 1 = full, for every node),
4. for each node in a fixed order, an option (device group, layout) from the task's option table
   (:class:`envs.features.OptionTable`: every single device, and every group of
   ``topology.hierarchy_groups()`` with batch_split / col_split / row_split / replicate).

All phases share one ``Discrete(max_options)`` action space; ``action_masks()`` (and the ``action_mask``
observation key) says which actions are meaningful now. An action outside the mask is replaced by
the ``action % k``-th allowed action (so random actions from ``action_space.sample()`` are safe) and
``info["invalid_action"]`` is set.

**Order.** ``order="topological"`` (default) decides nodes in topological order: every producer is
placed before its consumers, so the dynamic features (``node_devices``, ``option_state`` locality)
show where the node's inputs live when it is decided — the sequential decision then mirrors how the
simulator forms pipeline stages (first use in topological order), and co-located groups are pinned
as soon as their first member is placed. ``order="critical_path"`` sorts by descending upward rank
(HEFT), which is also a topological order but decides the heaviest chains first so that they get
the free devices (meant for graphs with wide parallel branches: MoE, Inception; not yet shown to
train better).

**Masks.** An option is hidden when its layout is not allowed for the node (layout capabilities,
AND-ed over the node's co-location class; dp > 1 needs batch splitting), when its data-parallel
degree does not divide the microbatch, when the node's co-location class is already placed elsewhere
(it must follow), or when the model states already placed on a member device plus this node's (its
class's) would certainly exceed that device's memory. If memory rules out every option, the memory
rule is dropped for that node (the plan will be OOM and penalised), so an episode never dead-ends.

**Reward.** Intermediate rewards are 0; at the end ``score(plan)``:
``log(T_ref / T_plan)`` where ``T_ref`` is the better (non-OOM first) of the single-device and the full
data-parallel plan (computed once per task and cached); an OOM plan scores
``-1 - log(peak / capacity) on the worst device + min(0, log(T_ref / T_plan))`` — below -1, growing with
the overflow, and never above the same plan's time score, so fitting in memory always pays.
No shaping is used (none was tried). The evaluator (default :class:`SimulatorEvaluator`,
cached by ``plan.key()``) evaluates plans on the (coarse) graph the agent sees; ``eval_graph="fine"``
evaluates the expanded plan on the operator graph instead.

**Mode ``"refine"``** (Placeto-style): the episode starts from a complete plan — the best-scoring of
the single-device, data-parallel and Megatron tensor-parallel plans expressible in the option table
(``refine_init``), whose global choices stay fixed — and revisits every node ``refine_passes`` times in
the same order; each step re-assigns one node (its co-location class moves with it) and is rewarded
with the improvement ``score(new) - score(prev)`` (``= log(T_prev / T_new)`` while both fit), so the
return telescopes to ``score(final) - score(initial)``.

**Observation**: the flat Dict of :func:`envs.features.observation_space` — static per-task arrays
(node / edge / device / option features, pairwise bandwidth and latency, masks) computed once, and
dynamic arrays (assignment, node being decided, device load and memory, per-option state, phase,
global choices, ``action_mask``) updated incrementally; every step returns fresh copies.

``reset(options={"task": task})`` places a given task instead of drawing one (e.g. for evaluation).

**info**: ``task_id``, ``phase``, ``num_groups`` on every step; at the end also ``step_time``,
``ref_time``, ``ref_plan``, ``score``, ``peak_memory`` (per device), ``memory_capacity``, ``oom``, ``plan`` (a
:class:`envs.plan.Plan` on operators), ``plan_json`` (its dict) and ``group_plan`` (the plan on groups);
in refine mode every step also carries ``score``, ``step_time`` and ``oom`` of the current plan, and
the last step ``best_plan``, ``best_step_time``, ``best_oom`` and ``best_score``: the best plan any step
of the episode visited (every one was evaluated), which a search keeps even when later steps undo it.

**Bad input** (graph above ``max_nodes`` with ``coarsen=False``, a topology with more than
``max_devices`` devices, more options than ``max_options``, more edges than ``max_edges``, no
microbatch choice dividing the batch, model states that exceed the memory of all devices together
or a node that fits on no device) raises :class:`envs.errors.EnvError` at construction for listed tasks,
and at the reset that draws it for a sampler's task (the first draw is probed at construction).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np

from envs.errors import EnvError, RlplaceError
from envs.evaluator import EvalResult, Evaluator, SimulatorEvaluator
from envs.features import (
    PHASES,
    DynamicState,
    OptionTable,
    decision_order,
    observation_space,
    static_features,
)
from envs.graph import OpGraph
from envs.plan import (
    ADAM_MIXED_BYTES_PER_PARAM,
    DTYPE_BYTES,
    LAYOUTS,
    SCHEDULES,
    Plan,
    data_parallel_plan,
    megatron_layouts,
    single_device_plan,
)
from envs.simulator import OBJECTIVES
from envs.tasks import Task, default_tasks

MODES = ("place", "refine")
ORDERS = ("topological", "critical_path")
REFINE_INITS = ("best", "single_device", "data_parallel", "megatron")
N_GLOBAL_PHASES = 3
_LAY_SINGLE = LAYOUTS.index("single")


def score(result: EvalResult, ref_time: float) -> float:
    """The scale-free score of a plan (see the module docstring): log(T_ref / T), or the OOM penalty."""
    t = max(float(result.step_time), 1e-30)
    s = float(np.log(ref_time / t))
    if result.oom:
        return -1.0 - float(np.log(max(result.overflow, 1.0))) + min(0.0, s)
    return s


@dataclass(eq=False)
class _Prepared:
    """Everything about one task that does not change during an episode."""

    task: Task
    graph: OpGraph  # what the agent places (coarse if coarsened)
    grouping: object | None
    options: OptionTable
    order: np.ndarray
    allowed: np.ndarray  # [n, O] layout allowed
    mb_ok: np.ndarray  # [choices, O] dp divides the microbatch
    mb_valid: np.ndarray  # [choices] divides the batch
    need: np.ndarray  # [n] model-state bytes of the node's class (or the node)
    states: np.ndarray  # [n] model-state bytes of the node itself
    class_of: np.ndarray  # [n] dense co-location class, -1 none
    class_members: list[np.ndarray]
    capacity: np.ndarray  # [nd]
    speed: np.ndarray  # [n, O] float32: log2(time on option / time on fastest single device)
    time_single: np.ndarray  # [n] roofline time on the fastest device (compute-load feature)
    preds: list[tuple[np.ndarray, np.ndarray]]  # per node: (producer ids, bytes)
    in_bytes: np.ndarray
    static: dict[str, np.ndarray]
    dtype: str
    dev_frac: np.ndarray  # [O, nd] 1/|group| on members
    dev_f: np.ndarray  # [O, nd] float multi-hot
    dev_inf: np.ndarray  # [O, nd] 0 on members, inf elsewhere (for min-headroom)
    ref: dict | None = None
    init: dict | None = None
    extra: dict = field(default_factory=dict)


class PlacementEnv(gym.Env):
    """Sequential placement of a graph's node groups on a topology (see the module docstring)."""

    metadata = {"render_modes": []}

    def __init__(self, tasks: Sequence[Task] | Callable[[np.random.Generator], Task] | None = None, *,
                 max_nodes: int = 64, max_devices: int = 8, max_edges: int | None = None,
                 max_options: int | None = None, mode: str = "place", objective: str = "step_time",
                 evaluator: Evaluator | None = None, coarsen: bool = True, coarsen_method: str = "auto",
                 order: str = "topological", microbatch_choices: Sequence[int] = (1, 2, 4, 8),
                 refine_passes: int = 1, refine_init: str = "best", eval_graph: str = "coarse",
                 seed: int | None = None, task_cache_size: int = 64):
        super().__init__()
        if mode not in MODES:
            raise EnvError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if order not in ORDERS:
            raise EnvError(f"unknown order {order!r}; choose one of {', '.join(ORDERS)}")
        if objective not in OBJECTIVES:
            raise EnvError(f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
        if refine_init not in REFINE_INITS:
            raise EnvError(f"unknown refine_init {refine_init!r}; choose one of {', '.join(REFINE_INITS)}")
        if eval_graph not in ("coarse", "fine"):
            raise EnvError("eval_graph must be 'coarse' or 'fine'")
        if int(max_nodes) < 1 or int(max_devices) < 1:
            raise EnvError("max_nodes and max_devices must be >= 1")
        self.max_nodes = int(max_nodes)
        self.max_devices = int(max_devices)
        self.max_edges = int(max_edges) if max_edges is not None else 4 * self.max_nodes
        # option table bound: singles + at most ~2D hierarchy groups x 4 layouts
        self.max_options = int(max_options) if max_options is not None else 9 * self.max_devices
        self.microbatch_choices = tuple(int(m) for m in microbatch_choices)
        if not self.microbatch_choices or min(self.microbatch_choices) < 1:
            raise EnvError("microbatch_choices must be positive integers")
        if self.max_options < max(len(self.microbatch_choices), len(SCHEDULES), 2):
            raise EnvError(f"max_options={self.max_options} is smaller than the global phases' choices")
        self.mode = mode
        self.objective = objective
        self.evaluator: Evaluator = evaluator if evaluator is not None else SimulatorEvaluator()
        self.coarsen = bool(coarsen)
        self.coarsen_method = coarsen_method
        self.order = order
        self.refine_passes = max(1, int(refine_passes))
        self.refine_init = refine_init
        self.eval_graph = eval_graph
        self._init_seed = seed
        self._seeded = False
        self._cache: OrderedDict[int, _Prepared] = OrderedDict()
        self._cache_size = max(1, int(task_cache_size))

        if tasks is None:
            tasks = default_tasks()
        if callable(tasks) and not isinstance(tasks, (list, tuple)):
            self._sampler: Callable[[np.random.Generator], Task] | None = tasks
            self._tasks: list[Task] = []
            probe = tasks(np.random.default_rng(seed))
            self._prepare(probe)  # fail at construction on a bad first task
        else:
            self._sampler = None
            self._tasks = list(tasks)
            if not self._tasks:
                raise EnvError("PlacementEnv needs at least one task")
            for t in self._tasks:
                self._prepare(t)

        self.n_globals = len(self.microbatch_choices) + len(SCHEDULES) + 2 + 1
        self.observation_space = observation_space(self.max_nodes, self.max_edges, self.max_devices,
                                                   self.max_options, self.n_globals)
        self.action_space = gym.spaces.Discrete(self.max_options)
        self._dyn = DynamicState(self.max_nodes, self.max_devices, self.max_options, self.n_globals)
        self._p: _Prepared | None = None
        self._mask = np.zeros(self.max_options, dtype=bool)

    # ------------------------------------------------------------------ task preparation
    def _prepare(self, task: Task) -> _Prepared:
        key = id(task)
        hit = self._cache.get(key)
        if hit is not None and hit.task is task:
            self._cache.move_to_end(key)
            return hit
        if not isinstance(task, Task):
            raise EnvError(f"tasks must be envs.tasks.Task objects, got {type(task).__name__}")
        p = self._build(task)
        self._cache[key] = p
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return p

    def _build(self, task: Task) -> _Prepared:
        topo, fine = task.topology, task.graph
        who = f"task {task.name!r}"
        nd = topo.num_devices
        if nd > self.max_devices:
            raise EnvError(f"{who}: topology {topo.name!r} has {nd} devices, more than max_devices={self.max_devices}")
        if fine.num_nodes == 0:
            raise EnvError(f"{who}: graph {fine.name!r} has no nodes")
        grouping = None
        graph = fine
        if fine.num_nodes > self.max_nodes:
            if not self.coarsen:
                raise EnvError(f"{who}: graph {fine.name!r} has {fine.num_nodes} nodes, more than "
                               f"max_nodes={self.max_nodes}, and coarsen=False")
            try:
                from envs.coarsen import coarsen as coarsen_fn
            except ImportError as exc:  # pragma: no cover - envs.coarsen ships with rlplace
                raise EnvError(f"{who}: graph has {fine.num_nodes} nodes > max_nodes={self.max_nodes} and "
                               f"envs.coarsen is not available ({exc})") from exc
            graph, grouping = coarsen_fn(fine, self.max_nodes, method=self.coarsen_method)
            if graph.num_nodes > self.max_nodes:
                raise EnvError(f"{who}: coarsening left {graph.num_nodes} groups > max_nodes={self.max_nodes}")
        n = graph.num_nodes
        if graph.num_edges > self.max_edges:
            raise EnvError(f"{who}: graph has {graph.num_edges} edges (after coarsening), more than "
                           f"max_edges={self.max_edges}")
        dtype = graph.dtype if graph.dtype in DTYPE_BYTES else "bf16"
        options = OptionTable.build(topo, dtype)
        if options.size > self.max_options:
            raise EnvError(f"{who}: topology {topo.name!r} gives {options.size} options, more than "
                           f"max_options={self.max_options}")
        # co-location classes: AND the layout capabilities over each class
        coloc = graph.colocation
        class_of = np.full(n, -1, dtype=np.int64)
        members: list[np.ndarray] = []
        caps = graph.layout_caps.copy()
        if (coloc >= 0).any():
            uniq, inv = np.unique(coloc[coloc >= 0], return_inverse=True)
            class_of[coloc >= 0] = inv
            for c in range(uniq.size):
                mem = np.flatnonzero(class_of == c)
                members.append(mem)
                caps[mem] = np.bitwise_and.reduce(caps[mem])
        allowed = options.allowed(caps)
        batch = task.global_batch
        mb_valid = np.array([batch % m == 0 for m in self.microbatch_choices])
        if not mb_valid.any():
            raise EnvError(f"{who}: no microbatch choice in {self.microbatch_choices} divides the batch {batch}")
        mb_ok = np.array([((batch // m) % options.dp == 0) if ok else np.zeros(options.size, dtype=bool)
                          for m, ok in zip(self.microbatch_choices, mb_valid)])
        pbytes = DTYPE_BYTES.get(graph.dtype, 2)
        if self.objective == "latency" or graph.meta.get("memory_model") == "param_bytes":
            states = graph.param_bytes.copy()
        else:
            states = graph.param_bytes / pbytes * ADAM_MIXED_BYTES_PER_PARAM
        need = states.copy()
        for mem in members:
            need[mem] = states[mem].sum()
        capacity = np.array([d.memory_bytes for d in topo.devices], dtype=np.float64)
        if states.sum() > capacity.sum():
            raise EnvError(f"{who}: model states need {states.sum() / 1e9:.3g} GB but all {nd} devices together "
                           f"hold {capacity.sum() / 1e9:.3g} GB: no plan fits in memory")
        best_split = np.where(allowed, options.state_div[None, :], 0).max(axis=1)
        worst = np.flatnonzero(need / best_split > capacity.max())
        if worst.size:
            v = int(worst[0])
            raise EnvError(f"{who}: node {graph.names[v]!r} needs {need[v] / best_split[v] / 1e9:.3g} GB of model "
                           f"states per device even split {int(best_split[v])} ways; no device holds that")
        # per-node roofline times on each option, relative to the fastest single device
        fl = graph.fwd_flops + graph.bwd_flops
        byt = 3.0 * graph.mem_bytes
        dev_bw = np.array([d.bandwidth() for d in topo.devices])
        ov = np.array([d.launch_overhead for d in topo.devices])
        fastest = int(np.argmax([d.flops(dtype) for d in topo.devices]))
        min_bw = np.array([dev_bw[list(g)].min() for g in options.groups])
        max_ov = np.array([ov[list(g)].max() for g in options.groups])
        t_opt = (np.maximum(fl[:, None] / (options.min_flops[None, :] * options.speedup[None, :]),
                            byt[:, None] / (min_bw[None, :] * options.speedup[None, :]))
                 + 2 * graph.n_ops[:, None] * max_ov[None, :])
        t_single = t_opt[:, fastest]
        speed = np.clip(np.log2(t_opt / np.maximum(t_single[:, None], 1e-30)), -12, 12).astype(np.float32)
        order = decision_order(graph, self.order)
        preds: list[tuple[np.ndarray, np.ndarray]] = []
        src_sorted = np.argsort(graph.edge_dst, kind="stable")
        starts = np.searchsorted(graph.edge_dst[src_sorted], np.arange(n + 1))
        for v in range(n):
            es = src_sorted[starts[v]:starts[v + 1]]
            preds.append((graph.edge_src[es].copy(), graph.edge_bytes[es].copy()))
        in_bytes = np.array([b.sum() for _, b in preds])
        static = static_features(graph, topo, options, order, max_nodes=self.max_nodes, max_edges=self.max_edges,
                                 max_devices=self.max_devices, max_options=self.max_options, caps=caps).arrays
        dev_f = options.devices.astype(np.float64)
        sizes = dev_f.sum(axis=1, keepdims=True)
        return _Prepared(task=task, graph=graph, grouping=grouping, options=options, order=order, allowed=allowed,
                         mb_ok=mb_ok, mb_valid=mb_valid, need=need, states=states, class_of=class_of,
                         class_members=members, capacity=capacity, speed=speed, time_single=t_single, preds=preds,
                         in_bytes=in_bytes, static=static, dtype=dtype, dev_frac=dev_f / sizes, dev_f=dev_f,
                         dev_inf=np.where(options.devices, 0.0, np.inf))

    # ------------------------------------------------------------------ evaluation
    def _eval_graph_and_plan(self, p: _Prepared, plan: Plan) -> tuple[OpGraph, Plan]:
        if self.eval_graph == "fine" and p.grouping is not None:
            return p.task.graph, p.grouping.expand(plan)
        return p.graph, plan

    def _evaluate(self, p: _Prepared, plan: Plan) -> EvalResult:
        g, pl = self._eval_graph_and_plan(p, plan)
        return self.evaluator.evaluate(g, p.task.topology, pl, self.objective)

    def _reference(self, p: _Prepared) -> dict:
        """T_ref: the better of single-device and full data-parallel (non-OOM first), once per task."""
        if p.ref is not None:
            return p.ref
        g = p.task.graph if (self.eval_graph == "fine" and p.grouping is not None) else p.graph
        topo = p.task.topology
        batch = p.task.global_batch
        kw = dict(global_batch=batch, dtype=p.dtype)
        plans = {"single_device": single_device_plan(g, topo, **kw)}
        groups = sorted([tuple(range(topo.num_devices))] + list(topo.hierarchy_groups()), key=len, reverse=True)
        dp_group = next((gr for gr in groups if len(gr) > 1 and batch % len(gr) == 0), None)
        if dp_group is not None:
            plans["data_parallel"] = data_parallel_plan(g, topo, group=dp_group, **kw)
        results = {k: self.evaluator.evaluate(g, topo, pl, self.objective) for k, pl in plans.items()}
        fitting = {k: r for k, r in results.items() if not r.oom}
        pool = fitting or results
        name = min(pool, key=lambda k: pool[k].step_time)
        p.ref = {"time": float(pool[name].step_time), "plan": name, "oom": not fitting,
                 "times": {k: float(r.step_time) for k, r in results.items()}}
        return p.ref

    # ------------------------------------------------------------------ plans
    def _plan(self, assign: np.ndarray, mb: int, schedule: str, recompute: bool) -> Plan:
        p = self._p
        opts = p.options
        a = assign.tolist()
        return Plan(groups=[opts.groups[o] for o in a], layouts=[LAYOUTS[int(opts.layout[o])] for o in a],
                    dp=opts.dp[assign], recompute=np.full(len(a), bool(recompute)), microbatches=mb,
                    schedule=schedule, global_batch=p.task.global_batch, dtype=p.dtype,
                    provenance={"placer": f"rlplace-env/{self.mode}", "task": p.task.name})

    def _initial(self, p: _Prepared) -> dict:
        """The refine mode's starting assignment: heuristic plans expressed as options, best score first."""
        if p.init is not None:
            return p.init
        g, topo, opts = p.graph, p.task.topology, p.options
        n = g.num_nodes
        batch = p.task.global_batch
        look = opts.lookup()
        fastest = topo.fastest_device(p.dtype)
        cands: dict[str, np.ndarray] = {"single_device": np.full(n, fastest, dtype=np.int64)}
        groups = sorted([tuple(range(topo.num_devices))] + list(topo.hierarchy_groups()), key=len, reverse=True)
        dp_group = next((gr for gr in groups if len(gr) > 1 and batch % len(gr) == 0
                         and (gr, "batch_split", len(gr)) in look), None)
        if dp_group is not None:
            o = look[(dp_group, "batch_split", len(dp_group))]
            cands["data_parallel"] = np.where(p.allowed[:, o], o, dp_group[0]).astype(np.int64)
        host0 = [gr for gr in topo.hierarchy_groups() if 0 in gr and len(topo.hosts_of(gr)) == 1]
        tp_group = max(host0, key=len) if host0 else None
        if tp_group is not None:
            hosts = len(topo.hosts_of(range(topo.num_devices)))
            whole = tuple(range(topo.num_devices))
            grp, dpd = (whole, hosts) if hosts > 1 and batch % hosts == 0 and (whole, "replicate", hosts) in look \
                else (tp_group, 1)
            lays = megatron_layouts(g)
            assign = np.empty(n, dtype=np.int64)
            for v in range(n):
                o = look.get((grp, lays[v], dpd))
                if o is None or not p.allowed[v, o]:
                    o = look[(grp, "replicate", dpd)]
                assign[v] = o
            cands["megatron"] = assign
        if self.refine_init != "best":
            if self.refine_init not in cands:
                raise EnvError(f"task {p.task.name!r}: refine_init {self.refine_init!r} is not expressible here")
            cands = {self.refine_init: cands[self.refine_init]}
        ref = self._reference(p)
        best = None
        mb_idx = int(np.flatnonzero(p.mb_valid)[0])
        m = self.microbatch_choices[mb_idx]
        for name, assign in cands.items():
            for mem in p.class_members:
                assign[mem] = assign[mem[0]]
            if not p.mb_ok[mb_idx, assign].all():
                continue
            res = self._evaluate(p, self._plan_for(p, assign, m, "1f1b", False))
            s = score(res, ref["time"])
            if best is None or s > best["score"]:
                best = {"name": name, "assign": assign.copy(), "score": s, "mb_idx": mb_idx, "result": res}
        if best is None:  # pragma: no cover - single_device_plan always works with microbatch 1
            raise EnvError(f"task {p.task.name!r}: no heuristic start plan is expressible")
        p.init = best
        return best

    def _plan_for(self, p: _Prepared, assign: np.ndarray, mb: int, schedule: str, recompute: bool) -> Plan:
        prev, self._p = self._p, p
        try:
            return self._plan(assign, mb, schedule, recompute)
        finally:
            self._p = prev

    # ------------------------------------------------------------------ gym API
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is None and not self._seeded and self._init_seed is not None:
            seed = self._init_seed
        super().reset(seed=seed)
        self._seeded = True
        options = options or {}
        if "task" in options:
            task = options["task"]
        elif self._sampler is not None:
            task = self._sampler(self.np_random)
        else:
            task = self._tasks[int(self.np_random.integers(len(self._tasks)))]
        p = self._prepare(task)
        self._p = p
        n, nd = p.graph.num_nodes, p.task.topology.num_devices
        self._n, self._nd = n, nd
        self._assign = np.full(n, -1, dtype=np.int64)
        self._dev_states = np.zeros(nd)
        self._dev_load = np.zeros(nd)
        self._dev_count = np.zeros(nd)
        self._class_opt = np.full(len(p.class_members), -1, dtype=np.int64)
        self._total_time = max(float(p.time_single.sum()), 1e-30)
        self._dyn.reset()
        self._t = 0
        self._ref = self._reference(p)
        if self.mode == "place":
            self._mb_idx, self._sched, self._recompute = -1, -1, -1
            self._horizon = N_GLOBAL_PHASES + n
        else:
            init = self._initial(p)
            self._mb_idx, self._sched, self._recompute = init["mb_idx"], SCHEDULES.index("1f1b"), 0
            for v in range(n):
                self._put(v, int(init["assign"][v]))
            self._score = init["score"]
            self._horizon = n * self.refine_passes
            self._best_visit = None
        self._write_globals()
        self._prepare_decision()
        return self._obs(), self._info()

    def step(self, action):
        if self._p is None:
            raise RlplaceError("call reset() before step()")
        if self._t >= self._horizon:
            raise RlplaceError("episode is over; call reset()")
        a = int(action)
        info_extra = {}
        if not (0 <= a < self.max_options and self._mask[a]):
            allowed = np.flatnonzero(self._mask)
            a = int(allowed[a % allowed.size]) if 0 <= a else int(allowed[0])
            info_extra["invalid_action"] = True
        p = self._p
        reward = 0.0
        phase = self._phase()
        if phase == 0:
            self._mb_idx = a
        elif phase == 1:
            self._sched = a
        elif phase == 2:
            self._recompute = a
        else:
            v = self._node()
            c = int(p.class_of[v])
            targets = p.class_members[c] if (self.mode == "refine" and c >= 0) else (v,)
            for u in targets:
                u = int(u)
                if self._assign[u] >= 0:
                    self._take(u)
                self._put(u, a)
            if self.mode == "place" and c >= 0 and self._class_opt[c] < 0:
                self._class_opt[c] = a
        self._t += 1
        done = self._t >= self._horizon
        if self.mode == "refine" or done:
            self._write_globals()
        final = None
        if self.mode == "refine":
            res = self._evaluate(p, self._current_plan())
            s = score(res, self._ref["time"])
            reward = s - self._score
            self._score = s
            final = (res, s)
            info_extra.update({"score": s, "step_time": float(res.step_time), "oom": bool(res.oom)})
            key = (bool(res.oom), float(res.step_time))
            if self._best_visit is None or key < self._best_visit[0]:
                self._best_visit = (key, self._assign.copy(), res)
        elif done:
            res = self._evaluate(p, self._current_plan())
            s = score(res, self._ref["time"])
            reward = s
            final = (res, s)
        elif phase < N_GLOBAL_PHASES:
            self._write_globals()
        if not done:
            self._prepare_decision()
        else:
            self._dyn.set_current(-1)
            self._dyn.phase.fill(0)
            self._dyn.action_mask.fill(0)
            self._dyn.action_mask[0] = 1
            self._mask.fill(False)
            self._mask[0] = True
        info = self._info()
        info.update(info_extra)
        if done:
            res, s = final
            plan, full = self._plans_of(p, self._assign, res)
            info.update({"step_time": float(res.step_time), "ref_time": self._ref["time"],
                         "ref_plan": self._ref["plan"], "score": s, "peak_memory": res.peak_memory.copy(),
                         "memory_capacity": res.memory_capacity.copy(), "oom": bool(res.oom), "plan": full,
                         "plan_json": full.to_dict(), "group_plan": plan})
            if self.mode == "refine":
                info.update(self._best_visited(p))
        return self._obs(), float(reward), bool(done), False, info

    def action_masks(self) -> np.ndarray:
        """Bool mask over the Discrete(max_options) actions (sb3-contrib's MaskablePPO protocol)."""
        return self._mask.copy()

    # ------------------------------------------------------------------ internals
    def _phase(self) -> int:
        if self.mode == "refine":
            return N_GLOBAL_PHASES
        return min(self._t, N_GLOBAL_PHASES)

    def _node(self) -> int:
        k = self._t - N_GLOBAL_PHASES if self.mode == "place" else self._t % self._n
        return int(self._p.order[k])

    def _put(self, v: int, o: int) -> None:
        p = self._p
        self._assign[v] = o
        row = p.dev_f[o]
        self._dev_states += row * (p.states[v] / p.options.state_div[o])
        self._dev_load += row * (p.time_single[v] * np.exp2(float(p.speed[v, o])))
        self._dev_count += row
        self._dyn.set_assignment(v, o, int(p.options.layout[o]), len(p.options.groups[o]) / self._nd, p.dev_frac[o])

    def _take(self, v: int) -> None:
        p = self._p
        o = int(self._assign[v])
        row = p.dev_f[o]
        self._dev_states -= row * (p.states[v] / p.options.state_div[o])
        self._dev_load -= row * (p.time_single[v] * np.exp2(float(p.speed[v, o])))
        self._dev_count -= row
        self._assign[v] = -1

    def _prepare_decision(self) -> None:
        """Mask and per-option features for the decision at step ``self._t``."""
        p, dyn = self._p, self._dyn
        phase = self._phase()
        dyn.phase.fill(0)
        dyn.phase[phase] = 1
        mask = self._mask
        mask.fill(False)
        if phase == 0:
            mask[:len(self.microbatch_choices)] = p.mb_valid
            dyn.set_current(-1)
            dyn.option_state.fill(0)
        elif phase in (1, 2):
            mask[:2] = True
            dyn.set_current(-1)
            dyn.option_state.fill(0)
        else:
            v = self._node()
            dyn.set_current(v)
            k = p.options.size
            c = int(p.class_of[v])
            cur = int(self._assign[v])
            used = self._dev_states
            if self.mode == "refine":  # the node's (class's) own states do not count against it
                used = used.copy()
                for u in (p.class_members[c] if c >= 0 else (v,)):
                    o = int(self._assign[u])
                    used -= p.dev_f[o] * (p.states[u] / p.options.state_div[o])
            ok = p.allowed[v] & p.mb_ok[self._mb_idx]
            need = p.need[v] / p.options.state_div
            headroom = p.capacity - used
            min_head = (p.dev_inf + headroom[None, :]).min(axis=1)
            fit = need <= min_head
            forced = self.mode == "place" and c >= 0 and self._class_opt[c] >= 0
            if forced:
                mask[int(self._class_opt[c])] = True
            else:
                sel = ok & fit
                mask[:k] = sel if sel.any() else ok
                if self.mode == "refine" and cur >= 0:
                    mask[cur] = True
            # per-option features for this node
            st = dyn.option_state
            after = (used[None, :] + need[:, None] * p.dev_f) / p.capacity[None, :]
            st[:k, 0] = np.minimum((after * p.dev_f).max(axis=1), 16.0)
            st[:k, 1] = p.speed[v] / 4.0
            srcs, b = p.preds[v]
            if srcs.size and p.in_bytes[v] > 0:
                placed = self._assign[srcs] >= 0
                if placed.any():
                    loc_dev = (b[placed, None] * p.dev_frac[self._assign[srcs[placed]]]).sum(axis=0)
                    st[:k, 2] = p.dev_f @ loc_dev / p.in_bytes[v]
                else:
                    st[:k, 2] = 0
            else:
                st[:k, 2] = 0
        dyn.action_mask[:] = mask
        ds = dyn.device_state
        nd = self._nd
        ds[:nd, 0] = np.minimum(self._dev_load / self._total_time, 16.0)
        ds[:nd, 1] = np.minimum(self._dev_states / p.capacity, 16.0)
        ds[:nd, 2] = self._dev_count / self._n

    def _write_globals(self) -> None:
        gl = self._dyn.globals
        gl.fill(0)
        nm = len(self.microbatch_choices)
        if self._mb_idx >= 0:
            gl[self._mb_idx] = 1
        if self._sched >= 0:
            gl[nm + self._sched] = 1
        if self._recompute >= 0:
            gl[nm + 2 + self._recompute] = 1
        gl[-1] = self._t / max(self._horizon, 1)

    def _best_visited(self, p: _Prepared) -> dict:
        """Refine mode: the best plan any step of this episode produced (``best_*`` info keys)."""
        (oom, step_time), assign, res = self._best_visit
        return {"best_plan": self._plans_of(p, assign, res)[1], "best_step_time": step_time, "best_oom": oom,
                "best_score": score(res, self._ref["time"])}

    def _plans_of(self, p: _Prepared, assign: np.ndarray, res: EvalResult) -> tuple[Plan, Plan]:
        """(plan on groups, plan on operators with the evaluation in its provenance) of an assignment."""
        plan = self._assignment_plan(assign)
        full = p.grouping.expand(plan) if p.grouping is not None else plan
        full.provenance.update({"predicted_step_time": float(res.step_time), "objective": self.objective,
                                "predicted_peak_memory": [float(x) for x in res.peak_memory]})
        return plan, full

    def _assignment_plan(self, assign: np.ndarray) -> Plan:
        return self._plan(assign, self.microbatch_choices[self._mb_idx], SCHEDULES[self._sched],
                          bool(self._recompute))

    def _current_plan(self) -> Plan:
        return self._assignment_plan(self._assign)

    def _obs(self) -> dict[str, np.ndarray]:
        obs = {k: a.copy() for k, a in self._p.static.items()}  # fresh arrays: callers may keep them
        obs.update(self._dyn.arrays())
        return obs

    def _info(self) -> dict:
        return {"task_id": self._p.task.name, "phase": PHASES[self._phase()] if self._t < self._horizon else "done",
                "num_groups": self._n}

    def demo_action(self, target: Plan) -> int:
        """The allowed action now that best expresses ``target`` (a plan on the task's operator graph or
        on the groups the agent places): used to replay heuristic plans as demonstrations.

        Global phases take the plan's microbatch count (the nearest allowed choice), schedule and
        recompute (majority). A node takes the option with the plan's (devices, layout, dp) for it (a
        coarsened graph's group takes its members' majority, ``Grouping.project``); if that option is
        not in the table or not allowed now, the allowed option closest to it: same devices, then same
        layout, then most shared devices, then same dp."""
        if self._p is None or self._t >= self._horizon:
            raise RlplaceError("demo_action needs an episode in progress (call reset())")
        p = self._p
        plan = self._demo_target(target)
        allowed = np.flatnonzero(self._mask)
        phase = self._phase()
        if phase == 0:
            want = np.log2(max(int(plan.microbatches), 1))
            dist = [abs(np.log2(self.microbatch_choices[a]) - want) for a in allowed]
            return int(allowed[int(np.argmin(dist))])
        if phase in (1, 2):
            a = SCHEDULES.index(plan.schedule) if phase == 1 else int(2 * plan.recompute.sum() > plan.num_nodes)
            return a if self._mask[a] else int(allowed[0])
        v = self._node()
        key = (tuple(int(d) for d in plan.groups[v]), plan.layouts[v], int(plan.dp[v]))
        look = p.extra.get("lookup")
        if look is None:  # built once per task, not at every decision
            look = p.extra["lookup"] = p.options.lookup()
        o = look.get(key)
        if o is not None and self._mask[o]:
            return int(o)
        want = set(key[0])
        lay = LAYOUTS.index(key[1])

        def closeness(a: int) -> tuple:
            devs = set(p.options.groups[a])
            return (devs == want, int(p.options.layout[a]) == lay, len(devs & want) / len(devs | want),
                    int(p.options.dp[a]) == key[2])

        return int(max(allowed.tolist(), key=closeness))

    def _demo_target(self, target: Plan) -> Plan:
        p = self._p
        hit = p.extra.get("demo")
        if hit is not None and hit[0] is target:
            return hit[1]
        if p.grouping is not None and target.num_nodes == p.task.graph.num_nodes:
            plan = p.grouping.project(target)
        elif target.num_nodes == p.graph.num_nodes:
            plan = target
        else:
            raise EnvError(f"the demonstration plan has {target.num_nodes} nodes; task {p.task.name!r} has "
                           f"{p.task.graph.num_nodes} ops and {p.graph.num_nodes} groups")
        p.extra["demo"] = (target, plan)
        return plan

    # ------------------------------------------------------------------ conveniences
    @property
    def task(self) -> Task | None:
        return None if self._p is None else self._p.task

    @property
    def graph(self) -> OpGraph | None:
        """The graph the agent places in the current episode (coarse if coarsened)."""
        return None if self._p is None else self._p.graph

    def reference(self) -> dict:
        """The current task's reference plans and times (``time`` is T_ref)."""
        return dict(self._reference(self._p))


__all__ = ["PlacementEnv", "score", "MODES", "ORDERS"]
