"""Task preparation: everything about one task that an episode does not change, computed once per task.

:func:`prepare_task` turns a :class:`envs.tasks.Task` into a :class:`PreparedTask` in the steps its body
reads as: check the task fits the padding; coarsen the graph to at most ``max_nodes`` groups; build the
option table; merge the co-location classes; find the microbatch counts (and each option's dp) the
batch allows; estimate the model states and check that some plan can hold them; estimate every node's
roofline time on every option; fix the decision order and each node's producers; compute the static
observation. Bad input raises :class:`envs.errors.EnvError` naming the task.

Two parts need the simulator, so they are computed on first use (once per task) with the
environment's :class:`Scoring`: the reward's reference time (:func:`reference`: the better of
:func:`envs.plan.standard_plans`' single-device and data-parallel plans) and the refine mode's start
(:func:`refine_start`: the best of those plans and a Megatron plan, expressed in the option table).
:meth:`PreparedTask.plan` turns an assignment (one option per group) into a :class:`envs.plan.Plan`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from envs.errors import EnvError
from envs.evaluator import EvalResult, PlanEvaluator
from envs.graph import OpGraph
from envs.placement.observation import static_features
from envs.placement.options import OptionTable, decision_order
from envs.placement.reward import plan_reward
from envs.plan import ADAM_MIXED_BYTES_PER_PARAM, DTYPE_BYTES, LAYOUTS, Plan, megatron_layouts, standard_plans
from envs.tasks import Task

REFERENCE_PLANS = ("single_device", "data_parallel")  # the envs.plan templates T_ref is the better of


@dataclass(frozen=True)
class Settings:
    """The environment's settings that a prepared task depends on."""

    max_nodes: int
    max_edges: int
    max_devices: int
    max_options: int
    microbatch_choices: tuple[int, ...]
    objective: str
    coarsen: bool = True
    coarsen_method: str = "auto"
    order: str = "topological"


@dataclass
class RefineStart:
    """The refine mode's starting plan: the candidate ``name`` as options, with its reward."""

    name: str
    assign: np.ndarray  # [n] option per group
    reward: float
    mb_idx: int  # index into the microbatch choices (the first one the batch allows)
    result: EvalResult


@dataclass(eq=False)
class PreparedTask:
    """Everything about one task that does not change during an episode."""

    task: Task
    graph: OpGraph  # what the agent places (coarse if coarsened)
    grouping: object | None  # envs.coarsen.Grouping, or None when the graph was not coarsened
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
    static: dict[str, np.ndarray]  # the STATIC_KEYS observation arrays
    dtype: str
    dev_frac: np.ndarray  # [O, nd] 1/|group| on members
    dev_f: np.ndarray  # [O, nd] float multi-hot
    dev_inf: np.ndarray  # [O, nd] 0 on members, inf elsewhere (for min-headroom)
    ref: dict | None = None  # reference(), once computed
    start: RefineStart | None = None  # refine_start(), once computed

    def plan(self, assign: np.ndarray, microbatches: int, schedule: str, recompute: bool, placer: str) -> Plan:
        """The plan on the groups that gives group ``v`` option ``assign[v]``."""
        opts = self.options
        a = assign.tolist()
        return Plan(groups=[opts.groups[o] for o in a], layouts=[LAYOUTS[int(opts.layout[o])] for o in a],
                    dp=opts.dp[assign], recompute=np.full(len(a), bool(recompute)), microbatches=microbatches,
                    schedule=schedule, global_batch=self.task.global_batch, dtype=self.dtype,
                    provenance={"placer": placer, "task": self.task.name})

    def expand(self, plan: Plan) -> Plan:
        """A plan on the groups as a plan on the task's operators."""
        return self.grouping.expand(plan) if self.grouping is not None else plan


# ---------------------------------------------------------------------- preparation
def prepare_task(task: Task, settings: Settings) -> PreparedTask:
    """Everything an episode of ``task`` needs that does not change during it (see the module docstring)."""
    if not isinstance(task, Task):
        raise EnvError(f"tasks must be envs.tasks.Task objects, got {type(task).__name__}")
    who = f"task {task.name!r}"
    topo = task.topology
    check_fits_padding(task, settings, who)
    graph, grouping = coarsened(task, settings, who)
    dtype = graph.dtype if graph.dtype in DTYPE_BYTES else "bf16"
    options = option_table(task, dtype, settings, who)
    class_of, members, caps = colocation_classes(graph)
    allowed = options.allowed(caps)
    mb_valid, mb_ok = microbatch_masks(task.global_batch, settings.microbatch_choices, options, who)
    states, need = model_states(graph, members, settings.objective)
    capacity = np.array([d.memory_bytes for d in topo.devices], dtype=np.float64)
    check_memory(graph, states, need, capacity, allowed, options, who)
    speed, time_single = roofline_speed(graph, topo, options, dtype)
    order = decision_order(graph, settings.order)
    preds, in_bytes = producers(graph)
    static = static_features(graph, topo, options, order, max_nodes=settings.max_nodes,
                             max_edges=settings.max_edges, max_devices=settings.max_devices,
                             max_options=settings.max_options, caps=caps)
    dev_f = options.devices.astype(np.float64)
    sizes = dev_f.sum(axis=1, keepdims=True)
    return PreparedTask(task=task, graph=graph, grouping=grouping, options=options, order=order, allowed=allowed,
                        mb_ok=mb_ok, mb_valid=mb_valid, need=need, states=states, class_of=class_of,
                        class_members=members, capacity=capacity, speed=speed, time_single=time_single,
                        preds=preds, in_bytes=in_bytes, static=static, dtype=dtype, dev_frac=dev_f / sizes,
                        dev_f=dev_f, dev_inf=np.where(options.devices, 0.0, np.inf))


def check_fits_padding(task: Task, settings: Settings, who: str) -> None:
    """The topology has at most ``max_devices`` devices and the graph has nodes."""
    topo, fine = task.topology, task.graph
    if topo.num_devices > settings.max_devices:
        raise EnvError(f"{who}: topology {topo.name!r} has {topo.num_devices} devices, more than "
                       f"max_devices={settings.max_devices}")
    if fine.num_nodes == 0:
        raise EnvError(f"{who}: graph {fine.name!r} has no nodes")


def coarsened(task: Task, settings: Settings, who: str) -> tuple[OpGraph, object | None]:
    """(the graph the agent places, its grouping): the task's graph, coarsened to at most ``max_nodes``
    groups when it is larger; at most ``max_edges`` edges either way."""
    fine = task.graph
    graph, grouping = fine, None
    if fine.num_nodes > settings.max_nodes:
        if not settings.coarsen:
            raise EnvError(f"{who}: graph {fine.name!r} has {fine.num_nodes} nodes, more than "
                           f"max_nodes={settings.max_nodes}, and coarsen=False")
        from envs.coarsen import coarsen

        graph, grouping = coarsen(fine, settings.max_nodes, method=settings.coarsen_method)
        if graph.num_nodes > settings.max_nodes:
            raise EnvError(f"{who}: coarsening left {graph.num_nodes} groups > max_nodes={settings.max_nodes}")
    if graph.num_edges > settings.max_edges:
        raise EnvError(f"{who}: graph has {graph.num_edges} edges (after coarsening), more than "
                       f"max_edges={settings.max_edges}")
    return graph, grouping


def option_table(task: Task, dtype: str, settings: Settings, who: str) -> OptionTable:
    """The task topology's option table, at most ``max_options`` long."""
    options = OptionTable.build(task.topology, dtype)
    if options.size > settings.max_options:
        raise EnvError(f"{who}: topology {task.topology.name!r} gives {options.size} options, more than "
                       f"max_options={settings.max_options}")
    return options


def colocation_classes(graph: OpGraph) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """(dense class per node or -1, each class's members, layout capabilities AND-ed over each class):
    a co-located class is placed as one, so it may only take the layouts all its members allow."""
    n = graph.num_nodes
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
    return class_of, members, caps


def microbatch_masks(batch: int, choices: tuple[int, ...], options: OptionTable,
                     who: str) -> tuple[np.ndarray, np.ndarray]:
    """(which microbatch choices divide the batch, [choice, option]: the option's dp divides the microbatch)."""
    mb_valid = np.array([batch % m == 0 for m in choices])
    if not mb_valid.any():
        raise EnvError(f"{who}: no microbatch choice in {choices} divides the batch {batch}")
    mb_ok = np.array([((batch // m) % options.dp == 0) if ok else np.zeros(options.size, dtype=bool)
                      for m, ok in zip(choices, mb_valid)])
    return mb_valid, mb_ok


def model_states(graph: OpGraph, members: list[np.ndarray], objective: str) -> tuple[np.ndarray, np.ndarray]:
    """(model-state bytes per node, the same summed over each co-location class): mixed-precision Adam's
    16 bytes per parameter, or the parameter bytes alone for ``latency`` (inference) and graphs whose
    memory model says so."""
    if objective == "latency" or graph.meta.get("memory_model") == "param_bytes":
        states = graph.param_bytes.copy()
    else:
        states = graph.param_bytes / DTYPE_BYTES.get(graph.dtype, 2) * ADAM_MIXED_BYTES_PER_PARAM
    need = states.copy()
    for mem in members:
        need[mem] = states[mem].sum()
    return states, need


def check_memory(graph: OpGraph, states: np.ndarray, need: np.ndarray, capacity: np.ndarray, allowed: np.ndarray,
                 options: OptionTable, who: str) -> None:
    """Some plan can hold the model states: all devices together, and every node (class) split as far as
    its layouts allow on the largest device."""
    if states.sum() > capacity.sum():
        raise EnvError(f"{who}: model states need {states.sum() / 1e9:.3g} GB but all {capacity.size} devices "
                       f"together hold {capacity.sum() / 1e9:.3g} GB: no plan fits in memory")
    best_split = np.where(allowed, options.state_div[None, :], 0).max(axis=1)
    worst = np.flatnonzero(need / best_split > capacity.max())
    if worst.size:
        v = int(worst[0])
        raise EnvError(f"{who}: node {graph.names[v]!r} needs {need[v] / best_split[v] / 1e9:.3g} GB of model "
                       f"states per device even split {int(best_split[v])} ways; no device holds that")


def roofline_speed(graph: OpGraph, topology, options: OptionTable, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """([n, O] log2 of each node's roofline time on each option relative to the fastest single device,
    clipped to +-12; [n] the time on that device). Roofline: max(FLOPs / (slowest member's FLOP/s x
    split), 3 x memory bytes / (slowest member's bandwidth x split)) + two launches per op."""
    fl = graph.fwd_flops + graph.bwd_flops
    byt = 3.0 * graph.mem_bytes
    dev_bw = np.array([d.bandwidth() for d in topology.devices])
    ov = np.array([d.launch_overhead for d in topology.devices])
    fastest = int(np.argmax([d.flops(dtype) for d in topology.devices]))
    min_bw = np.array([dev_bw[list(g)].min() for g in options.groups])
    max_ov = np.array([ov[list(g)].max() for g in options.groups])
    t_opt = (np.maximum(fl[:, None] / (options.min_flops[None, :] * options.speedup[None, :]),
                        byt[:, None] / (min_bw[None, :] * options.speedup[None, :]))
             + 2 * graph.n_ops[:, None] * max_ov[None, :])
    t_single = t_opt[:, fastest]
    speed = np.clip(np.log2(t_opt / np.maximum(t_single[:, None], 1e-30)), -12, 12).astype(np.float32)
    return speed, t_single


def producers(graph: OpGraph) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """(per node: its producers and the bytes each sends it, per node: total input bytes)."""
    n = graph.num_nodes
    preds: list[tuple[np.ndarray, np.ndarray]] = []
    src_sorted = np.argsort(graph.edge_dst, kind="stable")
    starts = np.searchsorted(graph.edge_dst[src_sorted], np.arange(n + 1))
    for v in range(n):
        es = src_sorted[starts[v]:starts[v + 1]]
        preds.append((graph.edge_src[es].copy(), graph.edge_bytes[es].copy()))
    in_bytes = np.array([b.sum() for _, b in preds])
    return preds, in_bytes


# ---------------------------------------------------------------------- scoring and the reference
@dataclass(frozen=True)
class Scoring:
    """How an environment evaluates plans: its evaluator and objective, on the graph the agent places or
    (``fine``) on the task's operator graph, a coarsened plan expanded first."""

    evaluator: PlanEvaluator
    objective: str
    fine: bool = False

    def graph(self, prep: PreparedTask) -> OpGraph:
        return prep.task.graph if (self.fine and prep.grouping is not None) else prep.graph

    def evaluate(self, prep: PreparedTask, plan: Plan) -> EvalResult:
        """Evaluate a plan on the groups."""
        if self.fine and prep.grouping is not None:
            return self.evaluator.evaluate(prep.task.graph, prep.task.topology, prep.grouping.expand(plan),
                                           self.objective)
        return self.evaluator.evaluate(prep.graph, prep.task.topology, plan, self.objective)


def reference_plans(graph: OpGraph, task: Task, dtype: str) -> dict[str, Plan]:
    """:func:`envs.plan.standard_plans`' single-device and data-parallel plans (the latter when some
    hierarchy group divides the batch) on ``graph``, by template name (:data:`REFERENCE_PLANS`)."""
    plans = standard_plans(graph, task.topology, global_batch=task.global_batch, dtype=dtype).values()
    return {pl.provenance["placer"]: pl for pl in plans if pl.provenance.get("placer") in REFERENCE_PLANS}


def reference(prep: PreparedTask, scoring: Scoring) -> dict:
    """T_ref: the better (non-OOM first) of the reference plans on the evaluation graph, once per task.

    ``{"time": T_ref, "plan": its template, "oom": whether both overflow, "times": template -> time}``."""
    if prep.ref is not None:
        return prep.ref
    g, topo = scoring.graph(prep), prep.task.topology
    plans = reference_plans(g, prep.task, prep.dtype)
    results = {k: scoring.evaluator.evaluate(g, topo, pl, scoring.objective) for k, pl in plans.items()}
    fitting = {k: r for k, r in results.items() if not r.oom}
    pool = fitting or results
    name = min(pool, key=lambda k: pool[k].value)
    prep.ref = {"time": float(pool[name].value), "plan": name, "oom": not fitting,
                "times": {k: float(r.value) for k, r in results.items()}}
    return prep.ref


# ---------------------------------------------------------------------- the refine start
def refine_start(prep: PreparedTask, scoring: Scoring, refine_init: str, microbatch_choices: tuple[int, ...],
                 placer: str) -> RefineStart:
    """The refine mode's starting assignment, once per task: of :func:`start_assignments` (or only
    ``refine_init`` unless it is ``"best"``), the one with the best reward at the first microbatch
    choice the batch allows, the 1F1B schedule and no recomputation."""
    if prep.start is not None:
        return prep.start
    cands = start_assignments(prep)
    if refine_init != "best":
        if refine_init not in cands:
            raise EnvError(f"task {prep.task.name!r}: refine_init {refine_init!r} is not expressible here")
        cands = {refine_init: cands[refine_init]}
    ref = reference(prep, scoring)
    mb_idx = int(np.flatnonzero(prep.mb_valid)[0])
    best = None
    for name, assign in cands.items():
        for mem in prep.class_members:  # a co-located class follows its first member
            assign[mem] = assign[mem[0]]
        if not prep.mb_ok[mb_idx, assign].all():
            continue
        res = scoring.evaluate(prep, prep.plan(assign, microbatch_choices[mb_idx], "1f1b", False, placer))
        r = plan_reward(res, ref["time"])
        if best is None or r > best.reward:
            best = RefineStart(name=name, assign=assign.copy(), reward=r, mb_idx=mb_idx, result=res)
    if best is None:  # pragma: no cover - the single-device plan always works with microbatch 1
        raise EnvError(f"task {prep.task.name!r}: no heuristic start plan is expressible")
    prep.start = best
    return best


def start_assignments(prep: PreparedTask) -> dict[str, np.ndarray]:
    """The refine start's candidates, one option per group: the reference plans expressed in the option
    table, and Megatron tensor parallelism built in it (:func:`megatron_assignment`)."""
    plans = reference_plans(prep.graph, prep.task, prep.dtype)
    out = {name: express(prep, plan) for name, plan in plans.items()}
    megatron = megatron_assignment(prep)
    if megatron is not None:
        out["megatron"] = megatron
    return out


def express(prep: PreparedTask, plan: Plan) -> np.ndarray:
    """A plan on the groups as one option per group: the option with the plan's (devices, layout, dp)
    when the table has it and the group may take it, else the group's first device alone."""
    look = prep.options.lookup()
    out = np.empty(prep.graph.num_nodes, dtype=np.int64)
    for v in range(out.size):
        devices = tuple(int(d) for d in plan.groups[v])
        o = look.get((devices, plan.layouts[v], int(plan.dp[v])))
        out[v] = o if o is not None and prep.allowed[v, o] else look[((devices[0],), "single", 1)]
    return out


def megatron_assignment(prep: PreparedTask) -> np.ndarray | None:
    """Megatron-LM's layouts (:func:`envs.plan.megatron_layouts`) on the largest one-host group holding
    device 0 — or, on several hosts when the batch splits over them, tensor parallel inside every host
    and data parallel across them (the option table's all-device group); a layout that option does not
    offer or the group may not take becomes ``replicate``. None when no one-host group holds device 0."""
    topo, look = prep.task.topology, prep.options.lookup()
    host0 = [gr for gr in topo.hierarchy_groups() if 0 in gr and len(topo.hosts_of(gr)) == 1]
    if not host0:
        return None
    hosts = len(topo.hosts_of(range(topo.num_devices)))
    whole = tuple(range(topo.num_devices))
    if hosts > 1 and prep.task.global_batch % hosts == 0 and (whole, "replicate", hosts) in look:
        group, dp = whole, hosts
    else:
        group, dp = max(host0, key=len), 1
    layouts = megatron_layouts(prep.graph)
    assign = np.empty(prep.graph.num_nodes, dtype=np.int64)
    for v in range(assign.size):
        o = look.get((group, layouts[v], dp))
        if o is None or not prep.allowed[v, o]:
            o = look[(group, "replicate", dp)]
        assign[v] = o
    return assign


__all__ = ["Settings", "PreparedTask", "RefineStart", "Scoring", "prepare_task", "reference", "refine_start",
           "REFERENCE_PLANS"]
