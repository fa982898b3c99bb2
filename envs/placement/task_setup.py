"""Task preparation: everything about one task that an episode does not change, computed once per task.

:func:`prepare_task` turns a :class:`envs.tasks.Task` into a :class:`PreparedTask` in the steps its body
reads as: check the task fits the padding; coarsen the graph to at most ``max_nodes`` groups; build the
placement table; merge the co-location classes; summarise what each group stands for (attention core,
experts, sequence splittability, activations: :func:`group_stats`); find the microbatch counts (and
each placement's dp) the batch allows; estimate the model states and check that some plan can hold
them; estimate every node's roofline time on every placement; which modifiers each node and placement
allow and what they do to memory and time; fix the decision order and each node's producers; compute
the static observation. Bad input raises :class:`envs.errors.EnvError` naming the task.

Two parts need the simulator, so they are computed on first use (once per task) with the
environment's :class:`Scoring`: the reward's reference time (:func:`reference`: the better of
:func:`envs.plan.standard_plans`' single-device and data-parallel plans) and the refine mode's start
(:func:`refine_start`: the best of those plans and Megatron-style tensor x data plans, expressed in the
placement table). :meth:`PreparedTask.plan` turns an assignment (one action = placement x modifier per
group) and the global choices into a :class:`envs.plan.Plan` on the task's operators;
:func:`express` turns any plan back into an assignment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from envs.branches import balanced_bins, major_regions, step_load
from envs.coarsen import group_majority, tensor_parallel_blocks
from envs.errors import EnvError, PlanError
from envs.evaluator import EvalResult, PlanEvaluator
from envs.graph import OpGraph
from envs.graph_partition import metis_parts
from envs.placement.cut_search import StagedStart, moved_cuts
from envs.placement.list_schedule import favourite_parents, list_schedule
from envs.placement.observation import VIRTUAL_STAGE_CHOICES, GroupStats, static_features
from envs.placement.options import MODIFIERS, N_MODIFIERS, OptionTable, decision_order, expert_parallel_degree
from envs.placement.reward import plan_reward
from envs.placement.stage_partition import bottleneck_stages
from envs.plan import (
    DTYPE_BYTES,
    LAYOUTS,
    RECOMPUTE,
    SCHEDULES,
    Plan,
    attention_core,
    contiguous_stages,
    expert_layers,
    interleaved_where_valid,
    megatron_layouts,
    plan_defaults,
    sequence_parallel_layouts,
    sequence_splittable,
    stage_cuts,
    standard_plans,
)
from envs.sim.cost import node_times
from envs.tasks import Task

REFERENCE_PLANS = ("single_device", "data_parallel")  # the envs.plan templates T_ref is the better of
ZERO = np.array([m.zero for m in MODIFIERS], dtype=np.int64)
_COL, _ROW = LAYOUTS.index("col_split"), LAYOUTS.index("row_split")
RECOMPUTE_MODE = np.array([RECOMPUTE.index(m.recompute) for m in MODIFIERS], dtype=np.int64)
EXPERT_PARALLEL = np.array([m.expert_parallel for m in MODIFIERS], dtype=bool)
_MODIFIER_ID = {(m.zero, m.recompute, m.expert_parallel): k for k, m in enumerate(MODIFIERS)}
CUT_SEARCH_EVALUATIONS = 12  # simulations with_moved_cuts may spend on a pipeline start's boundaries
NEAR_BEST_MARGIN = 0.10  # a pipeline start this much slower than the best start is searched further
SPLIT_LAYOUTS = [LAYOUTS.index(x) for x in ("col_split", "row_split", "seq_split")]


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
    """The refine mode's starting plan: the candidate ``name`` as actions, with its reward."""

    name: str
    assign: np.ndarray  # [n] action per group (placement x modifier)
    reward: float
    mb_idx: int  # index into the microbatch choices (the first one the batch allows)
    result: EvalResult
    schedule: int = 1  # index into SCHEDULES (1F1B)
    vs: int = 0  # index into VIRTUAL_STAGE_CHOICES (0: no interleaving)


@dataclass(eq=False)
class PreparedTask:
    """Everything about one task that does not change during an episode."""

    task: Task
    graph: OpGraph  # what the agent places (coarse if coarsened)
    grouping: object | None  # envs.coarsen.Grouping, or None when the graph was not coarsened
    options: OptionTable
    order: np.ndarray
    allowed: np.ndarray  # [n, P] layout allowed
    mb_ok: np.ndarray  # [choices, P] dp divides the microbatch
    mb_valid: np.ndarray  # [choices] stands for a count no earlier choice stands for
    mb_counts: np.ndarray  # [choices] the microbatch count (a divisor of the batch) each choice stands for
    need: np.ndarray  # [n] model-state bytes of the node's class (or the node)
    states: np.ndarray  # [n] model-state bytes of the node itself
    class_of: np.ndarray  # [n] dense co-location class, -1 none
    class_members: list[np.ndarray]
    capacity: np.ndarray  # [nd]
    speed: np.ndarray  # [n, P] float32: log2(time on placement / time on fastest single device)
    time_single: np.ndarray  # [n] roofline time on the fastest device (compute-load feature)
    preds: list[tuple[np.ndarray, np.ndarray]]  # per node: (producer ids, bytes)
    in_bytes: np.ndarray
    static: dict[str, np.ndarray]  # the STATIC_KEYS observation arrays
    dtype: str
    state_bytes_per_param: float  # envs.plan.plan_defaults: what the placers' plans count too
    dev_frac: np.ndarray  # [P, nd] 1/|group| on members
    dev_f: np.ndarray  # [P, nd] float multi-hot
    dev_inf: np.ndarray  # [P, nd] 0 on members, inf elsewhere (for min-headroom)
    stats: GroupStats
    modifier_ok: np.ndarray  # [n, K] the modifier applies to the node at all
    zero_factor: np.ndarray  # [P, K] model states kept per member under the modifier's ZeRO stage (1/dp
    # on the expert-parallel rows; :meth:`state_factor` gives a node's, with its experts' degree)
    act_div: np.ndarray  # [P] activations divided over a member (dp x tensor/sequence split)
    act_kept: np.ndarray  # [n, K] activation bytes per traced batch kept under the modifier's recomputation
    time_factor: np.ndarray  # [n, K] log2 of the compute time factor of the modifier (recomputation)
    ops: dict  # the operator graph's per-op arrays the plan needs (attention core, experts)
    ref: dict | None = None  # reference(), once computed
    start: RefineStart | None = None  # refine_start(), once computed
    runner_up: RefineStart | None = None  # refine_start()'s best start placed otherwise than ``start``
    expert_state_factors: dict = field(default_factory=dict)  # experts per layer -> state_factor()
    single_times: np.ndarray | None = None  # single_device_times(), once computed
    staged: dict = field(default_factory=dict)  # start name -> StagedStart, the pipeline starts of start_assignments

    def state_factor(self, v: int) -> np.ndarray:
        """[P, K] model states node ``v`` keeps per member under each placement and modifier: the ZeRO
        stage's fraction, and 1/ep on the expert-parallel rows (ep: :func:`expert_parallel_degree` of the
        placement's dp and the node's experts; each expert on ep ranks' share)."""
        experts = int(self.stats.expert_count[v])
        if experts == 0:
            return self.zero_factor
        if experts not in self.expert_state_factors:
            out = self.zero_factor.copy()
            out[:, EXPERT_PARALLEL] = 1.0 / expert_parallel_degree(self.options.dp, experts)[:, None]
            self.expert_state_factors[experts] = out
        return self.expert_state_factors[experts]

    @property
    def num_actions(self) -> int:
        return self.options.size * N_MODIFIERS

    def nearest_microbatch_choice(self, microbatches: int, ok: np.ndarray | None = None) -> int:
        """The index of the microbatch choice whose count is nearest (in log) to ``microbatches``, among
        those ``ok`` allows (default: those the batch allows; ties go to the smaller count)."""
        ok = self.mb_valid if ok is None else ok
        dist = np.abs(np.log(np.maximum(self.mb_counts, 1)) - np.log(max(int(microbatches), 1)))
        return int(np.argmin(np.where(ok, dist, np.inf)))

    def plan(self, assign: np.ndarray, microbatches: int, schedule: str, virtual_stages: int, placer: str) -> Plan:
        """The plan on the task's operators that gives group ``v`` action ``assign[v]`` (its placement's
        devices, layout and dp; its modifier's ZeRO stage on its weighted ops, recomputation of all its
        ops or of its attention-core ops, expert parallelism of its experts), with the global choices.
        Expert parallelism is kept for a layer only where the plan can run it (the layer's experts and
        their dispatch and combine ops data-parallel on one group, :func:`envs.plan.Plan.validate`);
        elsewhere that layer's experts run without it."""
        opts = self.options
        a = np.asarray(assign, dtype=np.int64)
        place, mod = a // N_MODIFIERS, a % N_MODIFIERS
        g = self.grouping.group_of if self.grouping is not None else np.arange(a.size)
        op_place, op_mod = place[g], mod[g]
        fine = self.task.graph
        dp = opts.dp[op_place]
        rc = RECOMPUTE_MODE[op_mod]
        recompute = (rc == RECOMPUTE.index("full")) | ((rc == RECOMPUTE.index("selective")) & self.ops["core"])
        zero = np.where((fine.param_bytes > 0) & (dp > 1), ZERO[op_mod], 0)
        ep = np.where(EXPERT_PARALLEL[op_mod], expert_parallel_degree(dp, self.ops["expert_count"]), 1)
        groups = [opts.groups[o] for o in place.tolist()]
        plan = Plan(groups=[groups[i] for i in g.tolist()], layouts=[LAYOUTS[i] for i in self.op_layouts(opts.layout[op_place]).tolist()],
                    dp=dp, recompute=recompute, zero=zero, ep=ep, microbatches=microbatches, schedule=schedule,
                    virtual_stages=virtual_stages, global_batch=self.task.global_batch, dtype=self.dtype,
                    state_bytes_per_param=self.state_bytes_per_param,
                    provenance={"placer": placer, "task": self.task.name})
        if ep.max(initial=1) > 1:
            _drop_invalid_expert_parallelism(plan, fine, self.ops["expert_layer"])
        return plan

    def op_layouts(self, lay: np.ndarray, ops: np.ndarray | slice = slice(None)) -> np.ndarray:
        """The layouts (indices into LAYOUTS) of operators ``ops`` whose groups' placements have layouts
        ``lay``: the placement's, except in a group that mixes Megatron-LM's layouts, one of them a tensor
        split (:func:`envs.coarsen.tensor_parallel_blocks`), where a column split means Megatron-LM's
        tensor-parallel layout of each operator and a row split the same with sequence parallelism
        (Shoeybi et al. 2019; Korthikanti et al. 2022): one split for all would put a gather between every
        pair of linears, and the norms could not take it."""
        block = self.ops["tensor_block"][ops]
        if not block.any():
            return lay
        return np.where(block & (lay == _COL), self.ops["megatron"][ops],
                        np.where(block & (lay == _ROW), self.ops["megatron_sp"][ops], lay))

    def apply_action(self, plan: Plan, groups, action: int) -> Plan:
        """A copy of ``plan`` (on the task's operators) whose ops of ``groups`` take ``action`` as
        :meth:`plan` would give it them; every other op keeps what it has (and the interleaving, while the
        chunks still allow it: :func:`envs.plan.interleaved_where_valid`). Returns the copy (validated by
        ``Plan`` construction only)."""
        opts = self.options
        o, k = divmod(int(action), N_MODIFIERS)
        g = self.grouping.group_of if self.grouping is not None else np.arange(self.task.graph.num_nodes)
        ops = np.flatnonzero(np.isin(g, np.asarray(list(groups), dtype=np.int64)))
        fine = self.task.graph
        new = plan.copy(provenance={}, virtual_stages=1)
        devices, dp = opts.groups[o], int(opts.dp[o])
        layouts = self.op_layouts(np.full(ops.size, opts.layout[o], dtype=np.int64), ops)
        for u, lay in zip(ops.tolist(), layouts.tolist()):
            new.groups[u], new.layouts[u] = devices, LAYOUTS[lay]
        new.dp[ops] = dp
        rc = int(RECOMPUTE_MODE[k])
        new.recompute[ops] = (rc == RECOMPUTE.index("full")) | ((rc == RECOMPUTE.index("selective"))
                                                                & self.ops["core"][ops])
        new.zero[ops] = np.where((fine.param_bytes[ops] > 0) & (dp > 1), ZERO[k], 0)
        new.ep[ops] = np.where(EXPERT_PARALLEL[k], expert_parallel_degree(dp, self.ops["expert_count"][ops]), 1)
        if new.ep.max(initial=1) > 1:
            _drop_invalid_expert_parallelism(new, fine, self.ops["expert_layer"])
        return interleaved_where_valid(new, fine, plan.virtual_stages)

    def coarse_plan(self, plan: Plan) -> Plan:
        """A plan on the operators as a plan on the groups (each group takes its members' majority)."""
        return self.grouping.project(plan) if self.grouping is not None else plan


def _drop_invalid_expert_parallelism(plan: Plan, graph: OpGraph, layer: np.ndarray) -> None:
    """Set ep = 1 on every expert layer whose expert parallelism the plan cannot run (in place)."""
    for L in np.unique(layer[(layer >= 0) & (plan.ep > 1)]).tolist():
        members = layer == L
        trial = plan.ep.copy()
        trial[~members & (layer >= 0)] = 1
        probe = plan.copy(ep=trial, zero=np.where(members, 0, plan.zero), provenance={})
        try:
            probe._validate_expert_parallel(graph)
        except PlanError:
            plan.ep[members] = 1


# ---------------------------------------------------------------------- preparation
def prepare_task(task: Task, settings: Settings) -> PreparedTask:
    """Everything an episode of ``task`` needs that does not change during it (see the module docstring)."""
    if not isinstance(task, Task):
        raise EnvError(f"tasks must be envs.tasks.Task objects, got {type(task).__name__}")
    who = f"task {task.name!r}"
    topo = task.topology
    check_fits_padding(task, settings, who)
    graph, grouping = coarsened(task, settings, who)
    defaults = plan_defaults(task.graph)
    dtype = defaults["dtype"]
    options = option_table(task, dtype, settings, who)
    class_of, members, caps = colocation_classes(graph)
    ops = operator_facts(task.graph, grouping)
    stats = group_stats(task.graph, graph, grouping, ops)
    allowed = options.allowed(caps, stats.seq_ok)
    mb_counts, mb_valid, mb_ok = microbatch_masks(task.global_batch, settings.microbatch_choices, options, who)
    states, need = model_states(graph, members, settings.objective, defaults["state_bytes_per_param"])
    capacity = np.array([d.memory_bytes for d in topo.devices], dtype=np.float64)
    check_memory(graph, states, need, capacity, allowed, options, who)
    speed, time_single = roofline_speed(graph, topo, options, dtype)
    modifier_ok, zero_factor, act_div, act_kept, time_factor = modifier_effects(graph, options, stats)
    order = decision_order(graph, settings.order)
    preds, in_bytes = producers(graph)
    static = static_features(graph, topo, options, order, stats, max_nodes=settings.max_nodes,
                             max_edges=settings.max_edges, max_devices=settings.max_devices,
                             max_options=settings.max_options, caps=caps)
    dev_f = options.devices.astype(np.float64)
    sizes = dev_f.sum(axis=1, keepdims=True)
    return PreparedTask(task=task, graph=graph, grouping=grouping, options=options, order=order, allowed=allowed,
                        mb_ok=mb_ok, mb_valid=mb_valid, mb_counts=mb_counts, need=need, states=states, class_of=class_of,
                        class_members=members, capacity=capacity, speed=speed, time_single=time_single,
                        preds=preds, in_bytes=in_bytes, static=static, dtype=dtype,
                        state_bytes_per_param=defaults["state_bytes_per_param"], dev_frac=dev_f / sizes,
                        dev_f=dev_f, dev_inf=np.where(options.devices, 0.0, np.inf), stats=stats,
                        modifier_ok=modifier_ok, zero_factor=zero_factor, act_div=act_div, act_kept=act_kept,
                        time_factor=time_factor, ops=ops)


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
    """The task topology's placement table (with the groups its batch splits evenly over), at most
    ``max_options`` long."""
    options = OptionTable.build(task.topology, dtype, batch=task.global_batch)
    if options.size > settings.max_options:
        raise EnvError(f"{who}: topology {task.topology.name!r} gives {options.size} placements, more than "
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


def operator_facts(graph: OpGraph, grouping=None) -> dict:
    """Per operator: attention core (``core``), expert layer and experts in it (``expert_layer``,
    ``expert_count``), sequence-splittable (``seq_ok``), Megatron-LM's layout without and with sequence
    parallelism (``megatron``, ``megatron_sp``: indices into LAYOUTS) and whether its group mixes those
    layouts, one of them a tensor split (``tensor_block``; per group ``tensor_block_group``)."""
    layer, _, count = expert_layers(graph)
    seq_ok = sequence_splittable(graph)
    meg = megatron_layouts(graph)
    n = graph.num_nodes
    if grouping is not None:
        per_group = tensor_parallel_blocks(graph, grouping.group_of, grouping.num_groups, meg)
        block = per_group[grouping.group_of]
    else:
        per_group = block = np.zeros(n, dtype=bool)
    return {"core": attention_core(graph), "expert_layer": layer, "expert_count": count, "seq_ok": seq_ok,
            "megatron": np.fromiter(map(LAYOUTS.index, meg), dtype=np.int64, count=n),
            "megatron_sp": np.fromiter(map(LAYOUTS.index, sequence_parallel_layouts(meg, seq_ok)), dtype=np.int64,
                                       count=n),
            "tensor_block": block, "tensor_block_group": per_group}


def group_stats(fine: OpGraph, graph: OpGraph, grouping, ops: dict) -> GroupStats:
    """:class:`GroupStats` of the placed nodes: sums and ANDs over the operators of each group."""
    n = graph.num_nodes
    g = grouping.group_of if grouping is not None else np.arange(fine.num_nodes)

    def gsum(x) -> np.ndarray:
        return np.bincount(g, weights=np.asarray(x, dtype=np.float64), minlength=n)

    core = ops["core"]
    count = np.zeros(n, dtype=np.int64)
    np.maximum.at(count, g, ops["expert_count"])
    seq_ok = gsum(~ops["seq_ok"]) == 0
    act = fine.out_bytes + fine.saved_bytes
    cross = g[fine.edge_src] != g[fine.edge_dst]
    in_bytes = np.bincount(g[fine.edge_dst[cross]], weights=fine.edge_bytes[cross], minlength=n)
    return GroupStats(core_fwd_flops=gsum(np.where(core, fine.fwd_flops, 0.0)),
                      core_saved_bytes=gsum(np.where(core, act, 0.0)), has_core=gsum(core) > 0,
                      expert_count=count, seq_ok=seq_ok, act_bytes=gsum(act), in_bytes=in_bytes)


def microbatch_counts(batch: int, choices: tuple[int, ...]) -> np.ndarray:
    """The microbatch count each choice stands for: the divisor of ``batch`` nearest to it on a log scale
    (the smaller on a tie), 0 where an earlier choice already stands for that count — so a choice of 128
    on a batch of 488 is 122 microbatches of 4, and the choices adapt to any batch."""
    divisors = np.array([d for d in range(1, batch + 1) if batch % d == 0], dtype=np.float64)
    out, seen = [], set()
    for m in choices:
        d = int(divisors[int(np.argmin(np.abs(np.log(divisors) - np.log(m))))])
        out.append(0 if d in seen else d)
        seen.add(d)
    return np.array(out, dtype=np.int64)


def microbatch_masks(batch: int, choices: tuple[int, ...], options: OptionTable,
                     who: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the count each microbatch choice stands for, which choices are distinct counts, [choice,
    placement]: its dp divides the microbatch)."""
    counts = microbatch_counts(batch, choices)
    mb_valid = counts > 0
    if not mb_valid.any():  # pragma: no cover - the first choice always stands for a divisor
        raise EnvError(f"{who}: no microbatch choice in {choices} fits the batch {batch}")
    mb_ok = np.array([((batch // m) % options.dp == 0) if m else np.zeros(options.size, dtype=bool)
                      for m in counts.tolist()])
    return counts, mb_valid, mb_ok


def model_states(graph: OpGraph, members: list[np.ndarray], objective: str,
                 state_bytes_per_param: float) -> tuple[np.ndarray, np.ndarray]:
    """(model-state bytes per node, the same summed over each co-location class): the plans'
    ``state_bytes_per_param`` (mixed-precision Adam's 16, :func:`envs.plan.plan_defaults`), or the
    parameter bytes alone for ``latency`` (inference) and graphs whose memory model says so."""
    if objective == "latency" or graph.meta.get("memory_model") == "param_bytes":
        states = graph.param_bytes.copy()
    else:
        states = graph.param_bytes / DTYPE_BYTES.get(graph.dtype, 2) * state_bytes_per_param
    need = states.copy()
    for mem in members:
        need[mem] = states[mem].sum()
    return states, need


def check_memory(graph: OpGraph, states: np.ndarray, need: np.ndarray, capacity: np.ndarray, allowed: np.ndarray,
                 options: OptionTable, who: str) -> None:
    """Some plan can hold the model states: all devices together, and every node (class) split as far as
    its layouts and ZeRO-3 allow on the largest device."""
    if states.sum() > capacity.sum():
        raise EnvError(f"{who}: model states need {states.sum() / 1e9:.3g} GB but all {capacity.size} devices "
                       f"together hold {capacity.sum() / 1e9:.3g} GB: no plan fits in memory")
    split = options.state_div * np.where(options.dp > 1, options.dp, 1)  # ZeRO-3 divides by dp too
    best_split = np.where(allowed, split[None, :], 0).max(axis=1)
    worst = np.flatnonzero(need / best_split > capacity.max())
    if worst.size:
        v = int(worst[0])
        raise EnvError(f"{who}: node {graph.names[v]!r} needs {need[v] / best_split[v] / 1e9:.3g} GB of model "
                       f"states per device even split {int(best_split[v])} ways; no device holds that")


def roofline_speed(graph: OpGraph, topology, options: OptionTable, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """([n, P] log2 of each node's roofline time on each placement relative to the fastest single device,
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
    # a node with no work (no FLOPs, bytes or ops, e.g. a zero-latency workload node) is as fast anywhere
    ratio = np.divide(t_opt, t_single[:, None], out=np.ones_like(t_opt), where=t_single[:, None] > 0)
    speed = np.clip(np.log2(np.maximum(ratio, 2.0 ** -12)), -12, 12).astype(np.float32)
    return speed, t_single


def zero_state_fraction(zero: int, replicas: np.ndarray) -> np.ndarray:
    """Model states kept per replica over the unsharded 16 bytes per parameter of mixed-precision Adam,
    for ZeRO stage ``zero`` over ``replicas`` (Rajbhandari et al. SC'20, Fig. 1: 2+2+12 bytes; stage 1
    shards the 12, stage 2 also the gradients' 2, stage 3 everything)."""
    n = np.maximum(np.asarray(replicas, dtype=np.float64), 1.0)
    return {0: np.ones_like(n), 1: (4.0 + 12.0 / n) / 16.0, 2: (2.0 + 14.0 / n) / 16.0, 3: 1.0 / n}[int(zero)]


def modifier_effects(graph: OpGraph, options: OptionTable, stats: GroupStats
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What each modifier allows and does (estimates for the features and the memory mask; the reward is
    the simulator's): ([n, K] it applies to the node, [P, K] model-state fraction per member, [P]
    activation divisor, [n, K] activation bytes kept, [n, K] log2 compute factor)."""
    n, k = graph.num_nodes, N_MODIFIERS
    has_params = graph.param_bytes > 0
    rc = RECOMPUTE_MODE
    ok = np.ones((n, k), dtype=bool)
    ok &= ~((ZERO[None, :] > 0) & ~has_params[:, None])
    ok &= ~((rc[None, :] == RECOMPUTE.index("selective")) & ~stats.has_core[:, None])
    ok &= ~(EXPERT_PARALLEL[None, :] & (stats.expert_count[:, None] == 0))
    zero_factor = np.stack([zero_state_fraction(int(z), options.dp) for z in ZERO], axis=1)
    expert_rows = EXPERT_PARALLEL[None, :] & np.ones((options.size, 1), dtype=bool)
    zero_factor = np.where(expert_rows, 1.0 / np.maximum(options.dp, 1)[:, None], zero_factor)
    split = np.isin(options.layout, SPLIT_LAYOUTS)
    act_div = options.dp * np.where(split, options.tp, 1).astype(np.float64)
    act = stats.act_bytes
    kept = {0: act, 1: np.maximum(act - stats.core_saved_bytes, 0.0), 2: np.minimum(stats.in_bytes, act)}
    act_kept = np.stack([kept[int(r)] for r in rc], axis=1)
    total = np.maximum(graph.fwd_flops + graph.bwd_flops, 1e-30)
    extra = {0: np.zeros(n), 1: stats.core_fwd_flops / total, 2: graph.fwd_flops / total}
    time_factor = np.log2(1.0 + np.stack([extra[int(r)] for r in rc], axis=1))
    return ok, zero_factor, act_div, act_kept, time_factor


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
    """How an environment evaluates plans: its evaluator and objective, on the task's operator graph
    (``fine``, the default: exact, and the only graph on which selective recomputation of a group's
    attention core is expressible) or on the graph the agent places (a plan projected onto the groups,
    each group taking its members' majority: faster, approximate)."""

    evaluator: PlanEvaluator
    objective: str
    fine: bool = True

    def graph(self, prep: PreparedTask) -> OpGraph:
        return prep.task.graph if (self.fine or prep.grouping is None) else prep.graph

    def evaluate(self, prep: PreparedTask, plan: Plan) -> EvalResult:
        """Evaluate a plan on the task's operators."""
        if self.fine or prep.grouping is None:
            return self.evaluator.evaluate(prep.task.graph, prep.task.topology, plan, self.objective)
        return self.evaluator.evaluate(prep.graph, prep.task.topology, prep.coarse_plan(plan), self.objective)


def reference_plans(graph: OpGraph, task: Task) -> dict[str, Plan]:
    """:func:`envs.plan.standard_plans`' single-device and data-parallel plans (the latter when some
    hierarchy group divides the batch) on ``graph``, by template name (:data:`REFERENCE_PLANS`), with the
    task's :func:`envs.plan.plan_defaults`."""
    defaults = plan_defaults(task.graph)
    plans = standard_plans(graph, task.topology, global_batch=task.global_batch, dtype=defaults["dtype"]).values()
    return {pl.provenance["placer"]: pl.copy(state_bytes_per_param=defaults["state_bytes_per_param"])
            for pl in plans if pl.provenance.get("placer") in REFERENCE_PLANS}


def reference(prep: PreparedTask, scoring: Scoring) -> dict:
    """T_ref: the better (non-OOM first) of the reference plans on the evaluation graph, once per task.

    ``{"time": T_ref, "plan": its template, "oom": whether both overflow, "times": template -> time}``."""
    if prep.ref is not None:
        return prep.ref
    g, topo = scoring.graph(prep), prep.task.topology
    plans = reference_plans(g, prep.task)
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
    ``refine_init`` unless it is ``"best"``), each at the microbatch counts the batch and its placements
    allow, with the 1F1B schedule and no interleaving (a candidate on several device groups, a pipeline,
    also with GPipe at its best count), the one with the best reward (the count matters: one microbatch
    of a large batch can overflow memory where four fit). Counts go up from the smallest: a one-stage
    candidate stops at the first that fits, a pipeline tries them all, and a candidate that cannot win
    (:func:`_compute_exceeds`, :func:`_cannot_win`) stops early. The pipeline starts within
    :data:`NEAR_BEST_MARGIN` of the best are then tried with GPipe at every count
    (:func:`gpipe_at_every_count`), the staged ones that interleaving could bring that near interleaved
    (:func:`interleaved_at_every_count`; the episode keeps the start's virtual stages while its
    placements allow them), and the best pipeline start has its stage boundaries moved while the
    simulator says it helps (:func:`with_moved_cuts`) when it won or came within that margin (and wins if
    it then overtakes the best). The best start that places the groups otherwise (not only another
    modifier) is kept as ``prep.runner_up``: episodes from it hedge against a start the policy cannot
    improve (:data:`envs.placement.env.RUNNER_UP`)."""
    if prep.start is not None:
        return prep.start
    cands = start_assignments(prep)
    if refine_init != "best":  # "megatron": the best of the tensor x data variants
        cands = {k: v for k, v in cands.items() if k == refine_init or k.startswith(refine_init + " ")}
        if not cands:
            raise EnvError(f"task {prep.task.name!r}: refine_init {refine_init!r} is not expressible here")
    ref = reference(prep, scoring)
    best, pipelines, scored = None, [], []
    for name, assign in cands.items():
        assign = _with_classes(prep, assign)
        fits = prep.mb_valid & prep.mb_ok[:, assign // N_MODIFIERS].all(axis=1)
        device_groups = np.unique(prep.options.devices[assign // N_MODIFIERS], axis=0).shape[0]
        pipeline = device_groups > 1
        if _compute_exceeds(prep, assign, best):
            continue
        mine = None
        for mb_idx in np.flatnonzero(fits).tolist():  # counts ascending
            tried = _scored(prep, scoring, name, assign, mb_idx, "1f1b", ref["time"], placer)
            res = tried.result
            if mine is None and _cannot_win(res, device_groups, best):
                break  # (nor can its GPipe variant: the same work, more activations in flight)
            if mine is None or tried.reward > mine.reward:
                mine = tried
            # one stage: more microbatches only save memory, so the first count that fits is its best; a
            # pipeline tries every count: its bubble shrinks with the count while the microbatches' efficiency
            # and the activations in flight change, not monotonically (a 28-layer ViT on 3 stages, batch 992:
            # 41.0 s at 31 microbatches, 41.2 at 32, 41.2 at 62, 33.4 at 124)
            if not res.oom and not pipeline:
                break
        if mine is not None and pipeline:
            # a pipeline: GPipe at the best count too (no interleaved backward; more activations in flight)
            tried = _scored(prep, scoring, name, assign, mine.mb_idx, "gpipe", ref["time"], placer)
            mine = tried if tried.reward > mine.reward else mine
        if mine is not None and pipeline:
            pipelines.append(mine)
        if mine is not None:
            scored.append(mine)
        if mine is not None and (best is None or mine.reward > best.reward):
            best = mine
    if best is None:  # pragma: no cover - the single-device plan always works with microbatch 1
        raise EnvError(f"task {prep.task.name!r}: no heuristic start plan is expressible")
    # the pipelines near the best start: GPipe at every count, interleaved, then the best staged one's cuts moved
    near = [gpipe_at_every_count(prep, scoring, m, ref["time"], placer) for m in pipelines
            if not m.result.oom and not best.result.oom and m.result.value <= best.result.value * (1 + NEAR_BEST_MARGIN)]
    near += [x for m in pipelines if _interleaving_may_win(prep, m, best)
             for x in [interleaved_at_every_count(prep, scoring, m, ref["time"], placer, best)] if x is not None]
    best = max([best, *near], key=lambda m: m.reward)
    staged = max((m for m in near if m.name in prep.staged), key=lambda m: m.reward, default=None)
    if best.name in prep.staged:
        best = with_moved_cuts(prep, scoring, best, ref["time"], placer)
    elif staged is not None:
        moved = with_moved_cuts(prep, scoring, staged, ref["time"], placer)
        scored.append(moved)
        best = moved if moved.reward > best.reward else best
    placed = best.assign // N_MODIFIERS
    prep.runner_up = max((m for m in [*scored, *near] if (m.assign // N_MODIFIERS != placed).any()),
                         key=lambda m: m.reward, default=None)
    prep.start = best
    return best


def gpipe_at_every_count(prep: PreparedTask, scoring: Scoring, start: RefineStart, ref_time: float,
                         placer: str) -> RefineStart:
    """A pipeline start at the best of GPipe at every microbatch count its placements allow (the start
    tried GPipe only at its best 1F1B count; a GPT on three single-H100 hosts: 3 stages, 9.33 ms with
    GPipe at 4 microbatches, 11.2 ms at the best 1F1B count and GPipe there)."""
    best = start
    fits = prep.mb_valid & prep.mb_ok[:, start.assign // N_MODIFIERS].all(axis=1)
    for mb_idx in np.flatnonzero(fits).tolist():
        if mb_idx == start.mb_idx:
            continue  # tried with both schedules
        tried = _scored(prep, scoring, start.name, start.assign, mb_idx, "gpipe", ref_time, placer)
        best = tried if tried.reward > best.reward else best
    return best


def _interleaving_may_win(prep: PreparedTask, start: RefineStart, best: RefineStart) -> bool:
    """Whether a staged pipeline start of ``p`` stages at ``m`` microbatches could beat ``best`` interleaved:
    1F1B's bubble is ``(p - 1) / m`` of the ideal time, ``v`` virtual stages divide it by ``v`` (Narayanan et
    al., SC'21, Sec. 2.2), so its time scales by ``(m + (p - 1) / v) / (m + p - 1)`` at the largest ``v``
    at best (the chunks' extra transfers only add; an interleaved start that does not beat the best is of
    no use: only the plain staged starts have their cuts moved). Llama-7B (batch 8) on two 8-A100 nodes: a
    2-stage tensor x data-parallel pipeline at 387 ms (2 microbatches) against 332 ms data parallel;
    Megatron-LM interleaves it 4 ways, 286 ms."""
    if start.name not in prep.staged or start.result.oom or best.result.oom:
        return False
    p, m, v = int(prep.staged[start.name].stage.max()) + 1, int(prep.mb_counts[start.mb_idx]), VIRTUAL_STAGE_CHOICES[-1]
    return float(start.result.value) * (m + (p - 1) / v) / (m + p - 1) < float(best.result.value)


def _interleaving_bound(prep: PreparedTask, start: RefineStart, tried: RefineStart, k: int) -> float:
    """The least time the largest interleaving degree could take, from the plain start and an interleaved
    try of the same ``k`` stages: the start's time is ``C (1 + (k - 1) / m)`` (the pipeline bubble; Narayanan
    et al., SC'21, Sec. 2.2), the try's ``C (1 + (k - 1) / (v m')) + o`` with ``o`` what interleaving adds
    (transfers), which a larger degree only grows."""
    m0, m = int(prep.mb_counts[start.mb_idx]), int(prep.mb_counts[tried.mb_idx])
    v, top = VIRTUAL_STAGE_CHOICES[tried.vs], VIRTUAL_STAGE_CHOICES[-1]
    ideal = float(start.result.value) / (1 + (k - 1) / m0)
    added = max(float(tried.result.value) - ideal * (1 + (k - 1) / (v * m)), 0.0)
    return ideal * (1 + (k - 1) / (top * m)) + added


def interleaved_at_every_count(prep: PreparedTask, scoring: Scoring, start: RefineStart, ref_time: float,
                               placer: str, rival: RefineStart | None = None) -> RefineStart | None:
    """A staged pipeline start of ``k`` stages interleaved (Narayanan et al., SC'21: the groups'
    topological order cut into ``k x v`` chunks balanced by roofline time, chunk ``c`` on the start's
    stage ``c mod k``, 1F1B with ``v`` virtual stages) at every interleaving degree of
    :data:`VIRTUAL_STAGE_CHOICES` and every microbatch count its placements allow that ``k`` divides
    (Megatron-LM's condition); the best, or None where none is expressible. The bubble shrinks by ``v``:
    Llama-7B (batch 8) on 4 PCIe A100s, 4 stages and 8 microbatches, 1.085 s with GPipe, 0.885 s
    interleaved 4 ways (Megatron-LM's plan: 0.891 s). The degrees go up while one beats the start and
    the largest could still beat ``rival`` (the best start so far):
    each degree adds ``k`` stage boundaries a microbatch crosses, and :func:`_interleaving_bound` says what
    the largest can reach at best (a 100-layer GPT's 4-stage pipeline of data-parallel pairs on 8 A100s:
    0.915 s, interleaved 2 ways 0.722 s, bound at 4 ways 0.653 s against data parallelism's 0.569 s: stop;
    it would take 0.647 s)."""
    staged = prep.staged[start.name]
    k = int(staged.stage.max()) + 1
    best = None
    for vs, v in enumerate(VIRTUAL_STAGE_CHOICES):
        if v < 2:
            continue
        if k * v > prep.graph.num_nodes or (best is not None and best.reward <= start.reward) or (
                best is None and vs > 1):
            break
        if best is not None and rival is not None and not rival.result.oom and _interleaving_bound(
                prep, start, best, k) >= float(rival.result.value):
            break
        chunk = contiguous_stages(prep.graph, k * v, weights=prep.time_single)
        assign = _with_classes(prep, staged.build(chunk % k))
        fits = prep.mb_valid & prep.mb_ok[:, assign // N_MODIFIERS].all(axis=1) & (prep.mb_counts % k == 0)
        for mb_idx in np.flatnonzero(fits).tolist():
            try:
                tried = _scored(prep, scoring, f"{start.name} interleaved x{v}", assign, mb_idx, "1f1b", ref_time,
                                placer, vs)
            except PlanError:  # the chunks do not visit the stages in turn (a co-location class joined two)
                break
            best = tried if best is None or tried.reward > best.reward else best
    return best


def with_moved_cuts(prep: PreparedTask, scoring: Scoring, start: RefineStart, ref_time: float,
                    placer: str) -> RefineStart:
    """A pipeline start with its stage boundaries hill-climbed by the simulator: a boundary moves one
    place (:func:`envs.placement.cut_search.moved_cuts`) while that improves the start at its microbatch
    count and schedule, at most :data:`CUT_SEARCH_EVALUATIONS` evaluations (the cut balanced by compute
    is not always the fastest one, :mod:`envs.placement.cut_search`)."""
    staged = prep.staged[start.name]
    stage, best, evaluations, improved = staged.stage, start, 0, True
    while improved and evaluations < CUT_SEARCH_EVALUATIONS:
        improved = False
        for moved in moved_cuts(prep.graph, stage):
            if evaluations >= CUT_SEARCH_EVALUATIONS:
                break
            assign = _with_classes(prep, staged.build(moved))
            if not prep.mb_ok[best.mb_idx, assign // N_MODIFIERS].all():
                continue
            evaluations += 1
            tried = _scored(prep, scoring, f"{start.name} (cuts moved)", assign, best.mb_idx,
                            SCHEDULES[best.schedule], ref_time, placer)
            if tried.reward > best.reward:
                best, stage, improved = tried, moved, True
                break
    return best


def _with_classes(prep: PreparedTask, assign: np.ndarray) -> np.ndarray:
    """``assign`` (in place) with every co-located class following its first member."""
    for mem in prep.class_members:
        assign[mem] = assign[mem[0]]
    return assign


def _scored(prep: PreparedTask, scoring: Scoring, name: str, assign: np.ndarray, mb_idx: int, schedule: str,
            ref_time: float, placer: str, vs: int = 0) -> RefineStart:
    """``assign`` at microbatch choice ``mb_idx`` with ``schedule`` and virtual-stage choice ``vs`` (0: no
    interleaving), simulated and rewarded as the start candidate ``name`` (keeping a copy of ``assign``)."""
    plan = prep.plan(assign, int(prep.mb_counts[mb_idx]), schedule, VIRTUAL_STAGE_CHOICES[vs], placer)
    if vs:
        plan._validate_virtual_stages(prep.task.graph)  # PlanError where the chunks do not allow it
    res = scoring.evaluate(prep, plan)
    return RefineStart(name=name, assign=assign.copy(), reward=plan_reward(res, ref_time), mb_idx=mb_idx,
                       result=res, schedule=SCHEDULES.index(schedule), vs=vs)


def _cannot_win(first: EvalResult, device_groups: int, best: RefineStart | None) -> bool:
    """Whether a candidate whose smallest microbatch count gave ``first`` cannot beat ``best`` at any
    count: microbatching at best overlaps its ``device_groups`` device groups' work perfectly (each group
    still does all of its work, and smaller microbatches are no cheaper per sample), so no count runs it
    faster than ``first`` / ``device_groups``. Only when both fit in memory (more microbatches can turn an
    out-of-memory plan into one that fits)."""
    if best is None or first.oom or best.result.oom:
        return False
    return float(first.value) / device_groups >= float(best.result.value)


def _compute_exceeds(prep: PreparedTask, assign: np.ndarray, best: RefineStart | None) -> bool:
    """Whether a candidate that puts every group on one device alone cannot beat ``best`` (which fits in
    memory) at any microbatch count, by compute alone: some device's groups take at least ``best``'s
    time there (:func:`single_device_times`; microbatching splits that work, it does not shrink it), so
    no simulation is needed (a GPT's 2-stage pipeline on 8 GPUs against data parallelism)."""
    if best is None or best.result.oom:
        return False
    rows = assign // N_MODIFIERS
    devices = prep.options.devices[rows]
    if (devices.sum(axis=1) != 1).any():
        return False
    _, _, tau = single_device_times(prep)
    on = np.argmax(devices, axis=1)
    load = np.bincount(on, weights=tau[np.arange(on.size), on], minlength=tau.shape[1])
    return float(load.max()) >= float(best.result.value)


def start_assignments(prep: PreparedTask) -> dict[str, np.ndarray]:
    """The refine start's candidates, one action per group: the reference plans expressed in the
    placement table; on a cluster of several device kinds, everything on each kind's first device
    (:func:`single_device_assignments`); data parallelism over every device kind's largest group (a cluster's GPUs without
    its CPUs) and, where some group has weights, the same with ZeRO-1 and with ZeRO-3, and with the groups
    whose weights cost more to synchronise than they save kept whole on single devices
    (:func:`hybrid_parallel_assignments`), and with concurrent branches data parallel on disjoint parts of
    the group (:func:`branch_parallel_assignments`); Megatron-style
    tensor x data parallelism over all devices and each device kind's group (:func:`megatron_assignments`,
    one per tensor-parallel degree the table offers) and pipelines of such groups
    (:func:`staged_megatron_assignments`); and the groups on single devices: list-scheduled
    (:func:`list_schedule_assignments`), cut into balanced pipeline stages (:func:`pipeline_assignments`)
    and partitioned by METIS (:func:`graph_partition_assignments`), the operator placements multi-branch
    graphs and pipelines want; on a
    cluster of several device kinds, pipelines whose stages are data parallel over each kind's devices
    (:func:`kind_pipeline_assignments`)."""
    plans = reference_plans(prep.task.graph, prep.task)
    prep.staged.clear()  # the pipeline builders below fill it
    out = {name: express(prep, plan) for name, plan in plans.items()}
    out.update(single_device_assignments(prep))
    out.update(data_parallel_assignments(prep))
    out.update(hybrid_parallel_assignments(prep))
    out.update(branch_parallel_assignments(prep))
    out.update(megatron_assignments(prep))
    out.update(staged_megatron_assignments(prep))
    out.update(list_schedule_assignments(prep))
    out.update(pipeline_assignments(prep))
    out.update(graph_partition_assignments(prep))
    out.update(kind_pipeline_assignments(prep))
    return out


def largest_group_of_each_kind(prep: PreparedTask) -> dict[str, tuple[int, ...]]:
    """Each device kind's largest group of the placement table whose devices are all of that kind and
    that the batch splits evenly over, the first in the table on ties (every group of two or more has a
    ``batch_split`` row); the kind's first device alone when no group of two or more qualifies."""
    out = {}
    for kind, members in prep.task.topology.devices_by_kind().items():
        mine = set(members)
        out[kind] = max((g for g in prep.options.groups if set(g) <= mine and prep.task.global_batch % len(g) == 0),
                        key=len)
    return out


def single_device_assignments(prep: PreparedTask) -> dict[str, np.ndarray]:
    """On a cluster of several device kinds, every group on each kind's first device (the reference plan
    takes the fastest device by its datasheet peak, which a host-bound model need not run fastest on: a
    192-layer MLP of 577 small operators on the ``hetero`` preset takes 92.5 ms on an A100, whose host
    issues every kernel launch, and 62.2 ms on the cluster's CPU); none on one kind, where the reference
    plan is it. A kind whose device the table does not let hold every group is skipped."""
    kinds = prep.task.topology.devices_by_kind()
    if len(kinds) < 2:
        return {}
    look = prep.options.lookup()
    out = {}
    for kind, members in kinds.items():
        o = look.get(((members[0],), "single", 1))
        if o is not None and prep.allowed[:, o].all():
            out[f"single device {kind}"] = np.full(prep.graph.num_nodes, o * N_MODIFIERS, dtype=np.int64)
    return out


def data_parallel_assignments(prep: PreparedTask) -> dict[str, np.ndarray]:
    """Data parallelism (``batch_split``) over each device kind's largest group of the table that the
    batch splits evenly over, groups that cannot split by samples on its first device; and that with
    ZeRO-1 (Megatron-LM's distributed optimizer) and with ZeRO-3 (FSDP) on every weighted group: where
    memory is tight, sharded optimizer states let larger microbatches fit; and, on a mixture-of-experts
    model, with expert parallelism on every group of experts (ep: :func:`expert_parallel_degree`, e.g. each
    expert on one rank when the experts divide over dp, DeepSpeed-MoE's and Megatron-LM's layout: its
    weights leave the gradient all-reduce)."""
    look = prep.options.lookup()
    expert_parallel = _MODIFIER_ID[(0, "none", True)]
    experts = prep.stats.expert_count
    out = {}
    for kind, g in largest_group_of_each_kind(prep).items():
        o = look.get((g, "batch_split", len(g)))
        if len(g) < 2 or o is None:
            continue
        single = look[((g[0],), "single", 1)]
        plain = np.where(prep.allowed[:, o], o, single) * N_MODIFIERS
        out[f"data parallel {kind} x{len(g)}"] = plain
        for stage in (1, 3):
            zero = with_zero(prep, plain, stage)
            if (zero != plain).any():
                out[f"data parallel {kind} x{len(g)} zero-{stage}"] = zero
        ep = prep.allowed[:, o] & prep.modifier_ok[:, expert_parallel] & (expert_parallel_degree(len(g), experts) >= 2)
        if ep.any():
            out[f"data parallel {kind} x{len(g)} expert-parallel"] = plain + np.where(ep, expert_parallel, 0)
    return out


def branch_parallel_assignments(prep: PreparedTask) -> dict[str, np.ndarray]:
    """Concurrent branches data parallel on disjoint parts of each device kind's largest group: at each
    size of the table's groups inside it (:func:`_part_levels`), its disjoint sub-groups of that size are
    the parts; each region of major branches (:func:`envs.branches.major_regions`, by
    :func:`envs.branches.step_load` with the groups' times on the group's first device) has its branches
    packed onto them, balanced by load (:func:`envs.branches.balanced_bins`); the rest (the ops that
    feed and join the branches) data parallel over the whole group, or, as another start, over the part
    whose branches carry the least load. A device's host issues every operator it runs, so a data-parallel
    group as wide as the cluster can be bound by its hosts while the compute would split: a CLIP-style
    image and text encoder (batch 128) on 8 A100s takes 58.3 ms data parallel and 32.7 ms with its towers
    side by side on the two quads; an ensemble of eight small CNNs on two 8-A100 nodes 21.2 ms with four
    members on each node (18.4 ms with the rest on the lightest node) and 6.5 ms with each member on a
    pair of GPUs and the rest on the lightest pair. A group the table does not let
    split the batch takes its part's (or the group's) first device alone."""
    look = prep.options.lookup()
    _, _, tau = single_device_times(prep)
    out = {}
    for kind, g in largest_group_of_each_kind(prep).items():
        if look.get((g, "batch_split", len(g))) is None:
            continue
        load = step_load(prep.graph, tau[:, g[0]])
        regions = major_regions(prep.graph, load)
        if not regions:
            continue
        for parts in _part_levels(prep, g, look, max(len(branches) for branches in regions)):
            packed, part_load = [], np.zeros(len(parts))  # (part, its branches' nodes); each part's load
            for branches in regions:
                bins = balanced_bins([float(load[b].sum()) for b in branches], len(parts))
                for i, items in enumerate(bins):
                    members = np.concatenate([branches[j] for j in items])
                    packed.append((parts[i], members))
                    part_load[i] += float(load[members].sum())
            name = f"branches on {len(parts)} x {kind} x{len(parts[0])}"
            lightest = parts[int(np.argmin(part_load))]
            for rest, label in ((g, name), (lightest, f"{name}, the rest on the lightest")):
                assign = _data_parallel_on(prep, look, rest, np.arange(prep.graph.num_nodes))
                for part, members in packed:
                    assign[members] = _data_parallel_on(prep, look, part, members)
                out[label] = assign
    return out


def _part_levels(prep: PreparedTask, g: tuple[int, ...], look: dict, branches: int) -> list[list[tuple[int, ...]]]:
    """The ways to cut ``g`` into disjoint parts for concurrent branches: for each size of the table's
    groups strictly inside ``g`` that the batch splits over (and single devices), largest first, those
    groups in table order (first fit) -- the largest size always (two or more parts), a smaller one
    only while there are no more parts than ``branches`` (a part with no branch would idle)."""
    inner = [h for h in prep.options.groups if len(h) >= 2 and set(h) < set(g)
             and (h, "batch_split", len(h)) in look and prep.task.global_batch % len(h) == 0]
    inner += [(d,) for d in g if ((d,), "single", 1) in look]
    levels = []
    for size in sorted({len(h) for h in inner}, reverse=True):
        parts, used = [], set()
        for h in inner:
            if len(h) == size and not used & set(h):
                parts.append(h)
                used |= set(h)
        if len(parts) >= 2 and (not levels or len(parts) <= branches):
            levels.append(parts)
    return levels


def _data_parallel_on(prep: PreparedTask, look: dict, g: tuple[int, ...], nodes: np.ndarray) -> np.ndarray:
    """The actions putting ``nodes`` data parallel over ``g`` (a node the table does not let split the
    batch there, or a ``g`` of one device: on ``g``'s first device)."""
    single = look[((g[0],), "single", 1)]
    o = look[(g, "batch_split", len(g))] if len(g) > 1 else single
    return np.where(prep.allowed[nodes, o], o, single) * N_MODIFIERS


def with_zero(prep: PreparedTask, assign: np.ndarray, stage: int) -> np.ndarray:
    """``assign`` with ZeRO ``stage`` (no recomputation) on every group that is data parallel (dp >= 2),
    holds weights and has no modifier yet; the rest as it is."""
    z = _MODIFIER_ID[(stage, "none", False)]
    rows = assign // N_MODIFIERS
    ok = (prep.options.dp[rows] >= 2) & prep.modifier_ok[:, z] & (assign % N_MODIFIERS == 0)
    return np.where(ok, rows * N_MODIFIERS + z, assign)


def hybrid_parallel_assignments(prep: PreparedTask) -> dict[str, np.ndarray]:
    """Hybrid data and model parallelism over each device kind's largest group of the table that the batch
    splits over (Krizhevsky, "One weird trick for parallelizing convolutional neural networks", 2014;
    DLRM's embedding tables, Naumov et al., 2019): a group whose gradient all-reduce over the group takes
    longer than data parallelism saves of its compute (its roofline time x (1 - 1/dp)) — an embedding
    table, a large fully-connected layer — stays whole on one device of the group, the longest first on
    the device with the least work so far among those its model states fit; every other group is data
    parallel over the group. None where every group or no group would be data parallel (the plain
    data-parallel and single-device starts)."""
    look = prep.options.lookup()
    topo, graph = prep.task.topology, prep.graph
    single, ok, tau = single_device_times(prep)
    out = {}
    for kind, g in largest_group_of_each_kind(prep).items():
        if len(g) < 2:
            continue
        o = look[(g, "batch_split", len(g))]
        t = tau[:, g[0]]
        sync = np.array([topo.collective_time("all_reduce", g, float(b)) if b > 0 else 0.0
                         for b in graph.param_bytes.tolist()])
        whole = (sync > t * (1.0 - 1.0 / len(g))) | ~prep.allowed[:, o]
        if whole.all() or not whole.any():
            continue
        work, free = np.zeros(len(g)), prep.capacity[list(g)].astype(np.float64)
        assign = np.full(graph.num_nodes, o * N_MODIFIERS, dtype=np.int64)
        for v in sorted(np.flatnonzero(whole).tolist(), key=lambda v: (-t[v], v)):
            fits = [i for i in range(len(g)) if ok[v, g[i]] and prep.states[v] <= free[i]]
            i = min(fits or range(len(g)), key=lambda i: (work[i], i))
            work[i] += t[v]
            free[i] -= prep.states[v]
            assign[v] = single[g[i]] * N_MODIFIERS
        out[f"hybrid data x model parallel {kind} x{len(g)}"] = assign
    return out


def express(prep: PreparedTask, plan: Plan) -> np.ndarray:
    """A plan (on the task's operators, or on the groups) as one action per group: each group takes its
    operators' majority placement (devices, layout, dp) when the table has it and the group may take it,
    else its first device alone; and the modifier closest to its operators' ZeRO stage (the majority over
    its weighted ops), recomputation (none; selective when exactly its attention-core ops are recomputed;
    full otherwise) and expert parallelism."""
    n = prep.graph.num_nodes
    fine_n = prep.task.graph.num_nodes
    if plan.num_nodes == n and prep.grouping is not None and n != fine_n:  # a plan on the groups
        g = np.arange(n)
        core = np.zeros(n, dtype=bool)  # a group's recomputation flag: full
        params = prep.graph.param_bytes > 0
        experts = prep.stats.expert_count > 0
    elif plan.num_nodes == fine_n:
        g = prep.grouping.group_of if prep.grouping is not None else np.arange(n)
        core, params, experts = prep.ops["core"], prep.task.graph.param_bytes > 0, prep.ops["expert_layer"] >= 0
    else:
        raise EnvError(f"the plan has {plan.num_nodes} nodes; task {prep.task.name!r} has {fine_n} ops and "
                       f"{n} groups")
    look = prep.options.lookup()
    layouts = plan.layouts
    if g.size == fine_n and prep.ops["tensor_block"].any():
        # a group mixing Megatron-LM's layouts is tensor parallel where its operators are split: a column
        # split (with sequence-split operators, a row split) stands for their layouts (PreparedTask.op_layouts)
        split = np.zeros(n, dtype=bool)
        seq = np.zeros(n, dtype=bool)
        lay = np.asarray(layouts)
        split[g[(lay == "col_split") | (lay == "row_split")]] = True
        seq[g[lay == "seq_split"]] = True
        tensor = prep.ops["tensor_block_group"] & split
        layouts = [("row_split" if seq[c] else "col_split") if tensor[c] else x for x, c in zip(layouts, g.tolist())]
    majority = group_majority(g, [(plan.groups[i], layouts[i], int(plan.dp[i])) for i in range(g.size)], n)
    out = np.empty(n, dtype=np.int64)
    for v in range(n):
        key = majority[v]
        o = look.get(key)
        if o is None or not prep.allowed[v, o]:
            o = look[((key[0][0],), "single", 1)]
        mine = g == v
        zs = plan.zero[mine & params]
        zero = int(np.bincount(zs).argmax()) if zs.size else 0
        rec = plan.recompute[mine]
        if not rec.any():
            mode = "none"
        elif (rec == core[mine]).all():
            mode = "selective"
        else:
            mode = "full"
        ep = bool((plan.ep[mine & experts] > 1).any())
        k = _MODIFIER_ID.get((zero if not ep else 0, mode, ep), 0)
        if not prep.modifier_ok[v, k] or (ZERO[k] > 0 and prep.options.dp[o] < 2):
            k = _MODIFIER_ID[(0, mode if prep.modifier_ok[v, _MODIFIER_ID[(0, mode, False)]] else "none", False)]
        out[v] = o * N_MODIFIERS + k
    return out


def list_schedule_assignments(prep: PreparedTask) -> dict[str, np.ndarray]:
    """The groups placed one per device by memory-constrained ETF and SCT list scheduling
    (:func:`envs.placement.list_schedule.list_schedule`, Baechi's m-ETF / m-SCT on the groups): each
    group's time on a device is its roofline time there (``time_single`` x ``2**speed``), each edge
    costs ``Topology.p2p_time`` of its bytes, and a unit (co-location class or group) holds its model
    states plus the activations of 1F1B at the largest microbatch count the batch allows. When every
    group lands on one device the start is the single-device plan already offered, and is left out.
    A chain of groups (its critical path on the fastest device is all its work, as a transformer's
    coarsened layers are) gets none: with no branches to overlap, a list schedule can only leave it on
    one device or cut it into the pipelines :func:`pipeline_assignments` already offers."""
    topo, g = prep.task.topology, prep.graph
    n, nd = g.num_nodes, topo.num_devices
    single, ok, tau = single_device_times(prep)
    fastest = tau[:, int(np.argmin(tau.sum(axis=0)))]
    if fastest.sum() <= g.critical_path(fastest)[0] * (1 + 1e-9):
        return {}
    m = int(prep.mb_counts[prep.mb_valid].max())
    in_flight = prep.task.global_batch / max(int(g.batch_size), 1) / m * min(m, nd)
    mem = prep.states + prep.act_kept[:, 0] * in_flight
    n_cls = len(prep.class_members)
    unit = np.where(prep.class_of >= 0, prep.class_of, n_cls + np.arange(n))
    unit_memory = np.bincount(unit, weights=mem, minlength=n_cls + n)
    unit_allowed = np.ones((n_cls + n, nd), dtype=bool)
    np.logical_and.at(unit_allowed, unit, ok)
    nbytes = np.asarray(g.edge_bytes, dtype=np.float64)
    delays: dict[tuple[int, int], np.ndarray] = {}

    def delay(e: int, a: int) -> np.ndarray:
        key = (e, a)
        if key not in delays:
            delays[key] = np.array([0.0 if d == a else topo.p2p_time(a, d, float(nbytes[e])) for d in range(nd)])
        return delays[key]

    order = g.topological_order().tolist()
    out: dict[str, np.ndarray] = {}
    for name, fav in (("list schedule etf", None),
                      ("list schedule sct", favourite_parents(n, g.edge_src, g.edge_dst, nbytes))):
        device, _ = list_schedule(order, tau, g.edge_src, g.edge_dst, delay, unit, unit_memory, unit_allowed,
                                  prep.capacity, fav)
        assign = single[device] * N_MODIFIERS
        if np.unique(device).size > 1 and not any(np.array_equal(assign, a) for a in out.values()):
            out[name] = assign
    return out


def single_device_times(prep: PreparedTask) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the placement id of each device alone [nd], whether each group may go there [n, nd], each group's
    compute time there [n, nd]: its operators' forward + backward times on that device by the simulator's
    op-time model (``envs.sim.cost.node_times``, once per device kind), inf where not allowed). The
    roofline estimate the policy's features use (``time_single`` x ``2**speed``) was 2-3x off and
    distributed differently (a ConvNeXt's first 23 of 120 groups: 21% of the roofline time on a V100, 53%
    of the simulated), so pipelines cut by it were unbalanced (its V100 + 2 x T4 pipeline: 742 ms vs
    PipeDream's 573 ms)."""
    look, topo = prep.options.lookup(), prep.task.topology
    nd = topo.num_devices
    single = np.array([look[((d,), "single", 1)] for d in range(nd)], dtype=np.int64)  # every device alone
    ok = prep.allowed[:, single]
    if prep.single_times is None:
        fine = prep.task.graph
        group_of = prep.grouping.group_of if prep.grouping is not None else np.arange(fine.num_nodes)
        times = np.empty((prep.graph.num_nodes, nd))
        by_kind: dict[str, np.ndarray] = {}
        for d in range(nd):
            kind = topo.devices[d].kind
            if kind not in by_kind:
                plan = prep.plan(np.full(prep.graph.num_nodes, single[d] * N_MODIFIERS), 1, "1f1b", 1, "times")
                t = node_times(fine, topo, plan, plan.batch(fine) / max(int(fine.batch_size), 1))
                by_kind[kind] = np.bincount(group_of, weights=t.fwd + t.bwd, minlength=prep.graph.num_nodes)
            times[:, d] = by_kind[kind]
        prep.single_times = times
    return single, ok, np.where(ok, prep.single_times, np.inf)


def pipeline_assignments(prep: PreparedTask) -> dict[str, np.ndarray]:
    """GPipe-style pipelines (Huang et al., 2019): the groups' topological order cut into k contiguous
    stages, stage i on the i-th fastest device that may hold every group (ties in device order, so
    neighbouring stages share a host), k = 2, 4, 8, ... and all of them; cuts between layers where the
    graph has them (:func:`envs.plan.stage_cuts`). A group's time on a stage is its roofline time on the
    stage's device, so a faster device takes more work (PipeDream's balance, Narayanan et al., SOSP 2019).
    Two cuts per k: each stage's share of the work near its device's share of the speed
    (:func:`envs.plan.contiguous_stages`; it spreads the work evenly but ignores memory), and, where it
    differs, the smallest bottleneck stage time that fits in memory
    (:func:`envs.placement.stage_partition.bottleneck_stages`; a stage holds its groups' model states plus
    the activations 1F1B keeps in flight there, the first of k stages the most, at the largest
    microbatch count the batch allows; none when no cut fits)."""
    single, tau, devs, counts = _devices_by_speed(prep)
    total = tau.sum(axis=0)
    units = _PipelineUnits.of(prep, tau)
    out: dict[str, np.ndarray] = {}
    for k in counts:
        def build(stage: np.ndarray, on: np.ndarray = devs[:k]) -> np.ndarray:
            return single[on[stage]] * N_MODIFIERS

        even = contiguous_stages(prep.graph, k, weights=tau[:, devs[0]], shares=total[devs[0]] / total[devs[:k]])
        _add_staged(prep, out, f"pipeline {k} stages", even, build)
        stage = units.min_max(prep, devs[:k], np.ones(k))
        if stage is not None and not np.array_equal(stage, even):
            _add_staged(prep, out, f"pipeline {k} stages min-max", stage, build)
    return out


def _devices_by_speed(prep: PreparedTask) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """(the placement id of each device alone, each group's time on each device (:func:`single_device_times`),
    the devices that may hold every group, fastest first (ties in device order), the device counts k the
    operator-placing starts try: 2, 4, 8, ... and all of them, at most one per group)."""
    single, ok, tau = single_device_times(prep)
    usable = np.flatnonzero(ok.all(axis=0))
    total = tau.sum(axis=0)  # each device's time for all groups (inf: it may not hold some)
    devs = usable[np.argsort(total[usable], kind="stable")]
    n = prep.graph.num_nodes
    counts = sorted({k for k in (2 ** np.arange(1, 7)).tolist() if k < devs.size} | {int(devs.size)})
    return single, tau, devs, [k for k in counts if 2 <= k <= n]


def graph_partition_assignments(prep: PreparedTask) -> dict[str, np.ndarray]:
    """METIS k-way partitions of the groups (:func:`envs.graph_partition.metis_parts`: the least bytes cut
    with parts balanced by compute), part i on the i-th fastest device that may hold every group, each
    part's share of the work its device's share of the speed, k = 2, 4, 8, ... and all of them: the
    placements of multi-branch graphs that contiguous pipeline cuts miss (a GNMT's encoder and decoder
    LSTMs on three H100s, two microbatches: 2.01 ms in 3 parts vs 2.32 ms for the best pipeline). Its
    cut weighs the bytes crossing it, which the compute-balanced pipeline cuts do not (that GNMT's best
    partition is contiguous: a pipeline they missed)."""
    single, tau, devs, counts = _devices_by_speed(prep)
    total = tau.sum(axis=0)
    out: dict[str, np.ndarray] = {}
    for k in counts:
        speed = 1.0 / total[devs[:k]]
        parts = metis_parts(prep.graph, k, tau[:, devs[0]], (speed / speed.sum()).tolist(), seed=0)
        actions = single[devs[parts]] * N_MODIFIERS
        if not any((actions == a).all() for a in out.values()):
            out[f"graph partition {k} parts"] = actions
    return out


def _add_staged(prep: PreparedTask, out: dict[str, np.ndarray], name: str, stage: np.ndarray,
                build) -> np.ndarray:
    """``out[name]`` = the pipeline start ``build(stage)``, remembered with its stages in ``prep.staged``
    (:func:`with_moved_cuts` moves its boundaries)."""
    out[name] = build(stage)
    prep.staged[name] = StagedStart(stage=stage, build=build)
    return out[name]


def kind_pipeline_assignments(prep: PreparedTask) -> dict[str, np.ndarray]:
    """On a cluster of several device kinds, PipeDream's pipelines whose stages are data parallel over
    replicas of unequal count (Narayanan et al., SOSP 2019): stage ``s`` on the ``s``-th kind's largest
    group of the table that the batch splits over (or its one device), the kinds in order of their
    group's throughput, fastest first, for the fastest 2, 3, ... kinds that may hold every group. The
    groups' topological order is cut at the smallest bottleneck that fits
    (:func:`envs.placement.stage_partition.bottleneck_stages`): a group's time on a stage is its time
    on the kind's device (the simulator's op times, :func:`single_device_times`; and, where it cuts
    elsewhere, the roofline estimate) over the replicas, a replica holds the stage's model states and its share
    of the activations 1F1B keeps in flight. A group the table does not let split the batch there takes
    ``replicate`` over the stage's devices, else its first device alone (:func:`_group_action`)."""
    topo = prep.task.topology
    kind_groups = largest_group_of_each_kind(prep)
    n = prep.graph.num_nodes
    if len(kind_groups) < 2 or n < 2:
        return {}
    single, ok, tau = single_device_times(prep)
    # also cut by the roofline estimate: the op times leave out the stages' transfers and the replicas'
    # gradient all-reduce, and on a recommendation model on a V100 + 2 x T4 the roofline cut ran faster
    # (50.0 vs 55.2 ms); the start takes whichever simulates better
    roofline = np.where(ok, prep.time_single[:, None] * np.exp2(prep.speed[:, single].astype(np.float64)), np.inf)
    look = prep.options.lookup()
    out: dict[str, np.ndarray] = {}
    for times, suffix in ((tau, ""), (roofline, " (roofline cut)")):
        stages = [(len(g) / times[:, g[0]].sum(), g) for g in kind_groups.values()  # (throughput, group)
                  if ok[:, g[0]].all()]  # kinds that may hold every group
        stages.sort(key=lambda st: -st[0])
        units = _PipelineUnits.of(prep, times)
        for k in range(2, min(len(stages), n) + 1):
            groups = [g for _, g in stages[:k]]
            stage = units.min_max(prep, np.array([g[0] for g in groups]), np.array([len(g) for g in groups], float))
            if stage is None:
                continue
            def build(stage: np.ndarray, groups: list = groups) -> np.ndarray:
                on = [groups[int(s)] for s in stage.tolist()]
                return np.array([_group_action(prep, look, v, g, "batch_split", len(g)) if len(g) > 1
                                 else single[g[0]] * N_MODIFIERS for v, g in enumerate(on)], dtype=np.int64)

            actions = build(stage)
            if any((actions == a).all() for a in out.values()):
                continue
            name = " | ".join(f"{topo.devices[g[0]].kind} x{len(g)}" for g in groups)
            _add_staged(prep, out, f"pipeline over device kinds {name}{suffix}", stage, build)
    return out


@dataclass(frozen=True)
class _PipelineUnits:
    """The placement units a pipeline cut moves (a co-located class goes where its first member in the
    topological order goes, e.g. a layer's backward with its forward), each weighing its members' sums:
    roofline time on every device, model states, and activations of one microbatch at the largest count
    the batch allows."""

    n: int
    unit: np.ndarray  # [n] the unit (its leader group) of each group
    leaders: np.ndarray  # the units' leaders in topological order
    leader_pos: np.ndarray  # where in the topological order each leader sits
    tau: np.ndarray  # [units, nd]
    states: np.ndarray  # [units]
    activations: np.ndarray  # [units]
    microbatches: int

    @classmethod
    def of(cls, prep: PreparedTask, tau: np.ndarray) -> _PipelineUnits:
        n = prep.graph.num_nodes
        order = prep.graph.topological_order()
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(n)
        unit = np.arange(n)
        for mem in prep.class_members:
            unit[mem] = mem[np.argmin(rank[mem])]
        leader_pos = np.flatnonzero(unit[order] == order)
        leaders = order[leader_pos]
        m = int(prep.mb_counts[prep.mb_valid].max())
        activations = prep.act_kept[:, 0] * (prep.task.global_batch / max(int(prep.graph.batch_size), 1) / m)
        unit_tau = np.zeros((n, tau.shape[1]))
        np.add.at(unit_tau, unit, tau)
        return cls(n=n, unit=unit, leaders=leaders, leader_pos=leader_pos, tau=unit_tau[leaders],
                   states=np.bincount(unit, weights=prep.states, minlength=n)[leaders],
                   activations=np.bincount(unit, weights=activations, minlength=n)[leaders], microbatches=m)

    def min_max(self, prep: PreparedTask, devices: np.ndarray, replicas: np.ndarray) -> np.ndarray | None:
        """The stage of each group for stages on ``devices`` (one per stage, data parallel over
        ``replicas`` of its kind), cut between layers where the graph has them, at the smallest
        bottleneck stage time that fits in memory (stage ``s`` of ``k`` keeps ``min(m, k - s)``
        microbatches in flight under 1F1B); None when no cut fits."""
        k = len(devices)
        in_flight = np.minimum(self.microbatches, k - np.arange(k)) / replicas
        memory = self.states[:, None] + self.activations[:, None] * in_flight[None, :]
        cuts = np.unique(np.searchsorted(self.leader_pos, stage_cuts(prep.graph, k)))  # positions among leaders
        leader_stage = bottleneck_stages(self.tau[:, devices] / replicas[None, :], memory,
                                         prep.capacity[devices], cuts)
        if leader_stage is None:
            return None
        stage_of = np.empty(self.n, dtype=np.int64)
        stage_of[self.leaders] = leader_stage
        return stage_of[self.unit]


def staged_megatron_assignments(prep: PreparedTask) -> dict[str, np.ndarray]:
    """Megatron-LM's 3-D layout (Narayanan et al., SC'21) where the table has it: the groups'
    topological order cut into k >= 2 contiguous stages balanced by roofline time
    (:func:`envs.plan.contiguous_stages`), stage s on the s-th of k disjoint equal device groups of the
    table that together hold every device (pairs, a host's halves, hosts), each stage tensor parallel over
    its group with Megatron's layouts (tp = the group's size), data parallel over it, or tensor parallel x
    data parallel inside it at every data-parallel degree the table offers there (Megatron-LM's
    tp x pp x dp), the tensor-parallel ones also with sequence parallelism
    (:func:`envs.plan.sequence_parallel_layouts`, where every operator of a group may be sequence-split),
    those with data-parallel replicas also with ZeRO-1 (Megatron-LM's distributed optimizer);
    a layout the table does not offer or a group may not take becomes ``replicate``, then
    the group's first device alone. On a cluster of several device kinds, also the same over each kind's
    devices alone (a heterogeneous cluster's GPUs without its CPUs; megatron_3d likewise uses a subset)."""
    look, topo, n = prep.options.lookup(), prep.task.topology, prep.graph.num_nodes
    groups = list(dict.fromkeys(prep.options.groups))
    layouts = group_megatron_layouts(prep)
    sequence_parallel = group_sequence_parallel_layouts(prep, layouts)
    pools = {tuple(range(topo.num_devices)): ""}
    by_kind = topo.devices_by_kind()
    for kind, members in by_kind.items() if len(by_kind) > 1 else ():
        if len(members) > 1:
            pools.setdefault(tuple(members), f"{kind} x{len(members)} ")
    out = {}
    for pool, label in pools.items():
        inside, m = set(pool), len(pool)
        for size in sorted({len(g) for g in groups if 1 < len(g) < m and m % len(g) == 0 and set(g) <= inside}):
            k = m // size
            cover: list[tuple[int, ...]] = []
            used: set[int] = set()
            for g in groups:
                if len(g) == size and set(g) <= inside and used.isdisjoint(g):
                    cover.append(g)
                    used.update(g)
            if len(cover) != k or k > n:
                continue
            stage = contiguous_stages(prep.graph, k, weights=prep.time_single)
            mixed = sorted({key[2] for key in look if key[0] == cover[0] and key[1] == "replicate"} - {1, size})
            variants = [(1, f"tp{size}"), (size, f"dp{size}")] + [(dp, f"tp{size // dp} dp{dp}") for dp in mixed]
            for dp, name in variants:
                chosen = [("", layouts)] + ([(" sp", sequence_parallel)] if dp < size and sequence_parallel != layouts
                                            else [])
                for suffix, lay in chosen:
                    def build(st: np.ndarray, cover: list = cover, dp: int = dp, lay: list = lay,
                              size: int = size) -> np.ndarray:
                        return np.array([_group_action(prep, look, v, cover[int(st[v])],
                                                       "batch_split" if dp == size else lay[v], dp)
                                         for v in range(n)], dtype=np.int64)

                    start = f"pipeline {k} stages x {label}megatron {name}{suffix}"
                    plain = _add_staged(prep, out, start, stage, build)
                    if dp >= 2 and (with_zero(prep, plain, 1) != plain).any():
                        def build_zero(st: np.ndarray, build=build) -> np.ndarray:
                            return with_zero(prep, build(st), 1)

                        _add_staged(prep, out, f"{start} zero-1", stage, build_zero)
    return out


def megatron_assignments(prep: PreparedTask) -> dict[str, np.ndarray]:
    """Megatron-LM's layouts (:func:`envs.plan.megatron_layouts`) over all devices with every tensor-
    parallel degree tp >= 2 the placement table offers there (tensor parallel inside hosts, data parallel
    over the rest), a layout the table does not offer or the group may not take becoming ``replicate``;
    when the all-device group is not in the table, on the largest one-host group holding device 0. On a
    cluster of several device kinds, also on each kind's largest group (tensor parallelism over a
    heterogeneous cluster's two fastest GPUs rather than all of its devices). Every variant with tp >= 2
    also with sequence parallelism (:func:`envs.plan.sequence_parallel_layouts`, where every operator of a
    group may be sequence-split), and those with tp, dp >= 2 also
    with ZeRO-1 (Megatron-LM's --use-distributed-optimizer)."""
    topo, look = prep.task.topology, prep.options.lookup()
    whole = tuple(range(topo.num_devices))
    groups = {whole: ""} if whole in prep.options.groups else {}
    host0 = [gr for gr in topo.hierarchy_groups() if 0 in gr and len(topo.hosts_of(gr)) == 1]
    if not groups and host0:
        groups = {max(host0, key=len): ""}
    kinds = [dev.kind for dev in topo.devices]
    for kind in dict.fromkeys(kinds) if len(set(kinds)) > 1 else ():
        same = [g for g in prep.options.groups if len(g) > 1 and all(kinds[d] == kind for d in g)]
        if same:
            largest = max(same, key=len)
            groups.setdefault(largest, f"{kind} x{len(largest)} ")
    layouts = group_megatron_layouts(prep)
    sequence_parallel = group_sequence_parallel_layouts(prep, layouts)
    out = {}
    for group, label in groups.items():
        for dp in sorted({k[2] for k in look if k[0] == group and k[1] == "replicate"}):
            name = f"megatron {label}tp{len(group) // dp} dp{dp}"
            out[name] = np.array([_group_action(prep, look, v, group, layouts[v], dp)
                                  for v in range(prep.graph.num_nodes)], dtype=np.int64)
            if len(group) // dp >= 2 and sequence_parallel != layouts:
                out[name + " sp"] = np.array([_group_action(prep, look, v, group, sequence_parallel[v], dp)
                                              for v in range(prep.graph.num_nodes)], dtype=np.int64)
            if 2 <= dp < len(group):  # Megatron-LM's distributed optimizer over the data-parallel replicas
                for variant in [name] + ([name + " sp"] if name + " sp" in out else []):
                    zero = with_zero(prep, out[variant], 1)
                    if (zero != out[variant]).any():
                        out[variant + " zero-1"] = zero
    return out


def group_megatron_layouts(prep: PreparedTask) -> list[str]:
    """Megatron-LM's layouts (:func:`envs.plan.megatron_layouts`) of the task's operators, each group taking
    its operators' most common one (ties: the first operator's), and a group that mixes them, one of them
    a tensor split, a column split (each of its operators then takes its own: :meth:`PreparedTask.op_layouts`). The
    coarse graph's own layouts would follow its groups' summed capabilities, which pair column and row
    splits differently."""
    fine = [LAYOUTS[i] for i in prep.ops["megatron"].tolist()]
    if prep.grouping is None:
        return fine
    majority = group_majority(prep.grouping.group_of, fine, prep.graph.num_nodes)
    return ["col_split" if mixed else x for x, mixed in zip(majority, prep.ops["tensor_block_group"].tolist())]


def group_sequence_parallel_layouts(prep: PreparedTask, layouts: list[str]) -> list[str]:
    """:func:`group_megatron_layouts` ``layouts`` with Megatron-LM's sequence parallelism
    (:func:`envs.plan.sequence_parallel_layouts` where every operator of a group may be sequence-split;
    a group that mixes Megatron-LM's layouts takes a row split: its operators' layouts with sequence
    parallelism)."""
    out = sequence_parallel_layouts(layouts, prep.stats.seq_ok)
    if prep.grouping is None:
        return out
    return ["row_split" if mixed else x for x, mixed in zip(out, prep.ops["tensor_block_group"].tolist())]


def _group_action(prep: PreparedTask, look: dict, v: int, group: tuple[int, ...], layout: str, dp: int) -> int:
    """Group ``v``'s action (no modifier) for ``layout`` over ``group`` at data-parallel degree ``dp``: that
    placement where the table has it and the group may take it, else ``replicate`` over the group, else
    the group's first device alone."""
    for key in ((group, layout, dp), (group, "replicate", dp)):
        o = look.get(key)
        if o is not None and prep.allowed[v, o]:
            return o * N_MODIFIERS
    return look[((group[0],), "single", 1)] * N_MODIFIERS


__all__ = ["Settings", "PreparedTask", "RefineStart", "Scoring", "prepare_task", "reference", "refine_start",
           "express", "REFERENCE_PLANS"]
