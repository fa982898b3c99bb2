"""The simulator's cost model: what one training step costs, independent of how the task graph is built.

The leaf of :mod:`envs.sim` (imports envs.graph, envs.plan, envs.topology and numpy only). Both task
graph builders (:mod:`envs.sim.reference`, the specification, and :mod:`envs.sim.compiled`) and the
max-load model (:mod:`envs.sim.throughput`) take every duration and every rule from here:

- :class:`StepReport`, the result of a simulation, and the task kinds of its timeline;
- the tensor layout states and the rules of which state a node produces and requires;
- :func:`node_times` (per-op forward/backward time) and :func:`memory` (peak bytes per device);
- :class:`CommTimes` (collective and transfer times, cached) and the device-group helpers;
- :func:`layout_crossing`: the communication a tensor needs between its producer's and its
  consumer's layouts (written once; both builders emit exactly these tasks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from envs.graph import OpGraph
from envs.plan import DTYPE_BYTES, Plan, layer_ids
from envs.topology import Topology

# layout states of a tensor: full, a feature shard (tensor-parallel split), partial sums (to be reduced)
FULL, FSHARD, PARTIAL = 0, 1, 2
# task kinds of a report's timeline
KIND_COMPUTE, KIND_COMM, KIND_OPT = 0, 1, 2
KIND_NAMES = {KIND_COMPUTE: "compute", KIND_COMM: "comm", KIND_OPT: "optimizer"}
# layouts as integer codes (the compiled builder's arrays)
LAYOUT_CODE = {"single": 0, "batch_split": 1, "col_split": 2, "row_split": 3, "replicate": 4}
L_COL, L_ROW = LAYOUT_CODE["col_split"], LAYOUT_CODE["row_split"]
DDP_BUCKET_BYTES = 25 * 2**20  # torch.nn.parallel.DistributedDataParallel bucket_cap_mb=25 (PyTorch docs)


@dataclass
class StepReport:
    objective: str
    value: float  # the objective's value, seconds: step time, steady-state time per global batch, or latency
    makespan: float  # simulated wall time of the schedule (== value for step_time / latency)
    compute_time: np.ndarray  # per device: busy computing (s)
    comm_time: np.ndarray  # per device: busy sending or receiving (s)
    idle_time: np.ndarray  # per device: makespan - compute
    peak_memory: np.ndarray  # bytes per device
    memory_capacity: np.ndarray
    oom: list[int]
    memory_breakdown: dict[str, np.ndarray] = field(default_factory=dict)
    task_start: np.ndarray | None = None
    task_finish: np.ndarray | None = None
    task_device_ptr: np.ndarray | None = None
    task_devices: np.ndarray | None = None
    task_kind: np.ndarray | None = None
    task_label: list[str] | None = None
    device_names: list[str] = field(default_factory=list)
    num_tasks: int = 0
    num_tail_tasks: int = 0  # the gradient all-reduce and optimizer tasks, the last ones (compiled builder)
    plan_arrays: object = None  # the plan in array form (envs.sim.compiled.PlanArrays), for CompiledSimulator.delta
    fast_path: str = ""  # which builder produced the report: "arrays" (compiled), "stages", "reference"
    stage_times: dict[str, np.ndarray] | None = None  # per stage, from the stage-level model (envs.sim.stages)

    @property
    def is_oom(self) -> bool:
        return bool(self.oom)

    def timeline(self) -> list[dict]:
        """Rows ``{device, start, end, kind, label}`` (one per device a task occupies), for Gantt charts."""
        if self.task_start is None:
            return []
        rows = []
        for t in range(self.num_tasks):
            for k in range(self.task_device_ptr[t], self.task_device_ptr[t + 1]):
                rows.append({"device": int(self.task_devices[k]), "start": float(self.task_start[t]),
                             "end": float(self.task_finish[t]), "kind": KIND_NAMES[int(self.task_kind[t])],
                             "label": self.task_label[t] if self.task_label else ""})
        return rows

    def to_dict(self) -> dict:
        return {"objective": self.objective, "value_s": self.value, "makespan_s": self.makespan,
                "peak_memory_bytes": [float(x) for x in self.peak_memory],
                "memory_capacity_bytes": [float(x) for x in self.memory_capacity],
                "oom": bool(self.oom), "oom_devices": [self.device_names[d] for d in self.oom],
                "compute_s": [float(x) for x in self.compute_time], "comm_s": [float(x) for x in self.comm_time],
                "idle_s": [float(x) for x in self.idle_time], "devices": self.device_names,
                "num_tasks": self.num_tasks}


# ---------------------------------------------------------------------- layout rules
def is_tensor_split(layout: str) -> bool:
    """Whether the layout splits the node's weights over its tensor-parallel group (column or row split)."""
    return layout in ("col_split", "row_split")


def produced_state(layout_code: int) -> int:
    """The state of a node's output: a column-split node leaves a feature shard on each member, a
    row-split node partial sums (Megatron-LM, Shoeybi et al. 2019); any other layout the full tensor.
    Plain Python on integer codes, so that the compiled builder compiles this same function."""
    if layout_code == L_COL:
        return FSHARD
    if layout_code == L_ROW:
        return PARTIAL
    return FULL


def required_state(layout_code: int, has_params: bool, is_embedding: bool) -> int:
    """The state a node needs of each input: a column-split linear the full input, a column-split
    parameter-free op its feature shard; a row-split linear its feature shard, a row-split embedding
    the full token ids; any other layout the full tensor."""
    if layout_code == L_COL:
        return FULL if has_params else FSHARD
    if layout_code == L_ROW:
        return FULL if is_embedding else FSHARD
    return FULL


def column_weighted(layout_code: int, has_params: bool) -> bool:
    """A column-split linear: its input gradient is a partial sum (all-reduced backward, Megatron's "f")."""
    return layout_code == L_COL and has_params


# ---------------------------------------------------------------------- per-node quantities
def node_times(graph: OpGraph, topology: Topology, plan: Plan, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward time of each node for one microbatch (``scale`` = samples / traced batch).

    Measured time for the device kind when the graph has one (scaled linearly with the samples and
    split); otherwise the roofline max(flops / (peak * eff), bytes / (mem_bw * eff)) plus launch
    overhead per operator (Williams, Waterman & Patterson, "Roofline", CACM 2009)."""
    n = graph.num_nodes
    fwd = np.zeros(n)
    bwd = np.zeros(n)
    dtype = plan.dtype
    for v in range(n):
        g = plan.groups[v]
        lay = plan.layouts[v]
        dp = int(plan.dp[v])
        tp = len(g) // dp
        split = tp if is_tensor_split(lay) else 1
        s = scale / dp
        tf = tb = 0.0
        for d in set(g):
            dev = topology.devices[d]
            meas = graph.measured.get(dev.kind)
            if meas is not None:
                f = meas["fwd"][v] * s / split
                b = meas["bwd"][v] * s / split
            else:
                act = max(graph.mem_bytes[v] - graph.param_bytes[v], 0.0) * s
                byt = (act + graph.param_bytes[v]) / split
                flops_rate, bw = dev.flops(dtype), dev.bandwidth()
                ov = graph.n_ops[v] * dev.launch_overhead
                f = max(graph.fwd_flops[v] * s / split / flops_rate, byt / bw) + ov
                # backward reads activations and output grads, writes input (and weight) grads: ~2x bytes
                b = max(graph.bwd_flops[v] * s / split / flops_rate, 2 * byt / bw) + ov
            tf, tb = max(tf, f), max(tb, b)
        fwd[v], bwd[v] = tf, tb
    if plan.recompute.any():
        # full recomputation re-runs the forward right before the backward (Chen et al., 2016)
        bwd = bwd + np.where(plan.recompute, fwd, 0.0)
    return fwd, bwd


def memory(graph: OpGraph, topology: Topology, plan: Plan, stage: np.ndarray, num_stages: int,
           objective: str = "step_time") -> dict[str, np.ndarray]:
    """Peak bytes per device: model states + stashed activations of in-flight microbatches + the
    transient activations of one recomputed microbatch.

    Model states: params x ``state_bytes_per_param`` (ZeRO, Rajbhandari et al. SC'20). In flight:
    GPipe all m microbatches, 1F1B at most p - s on stage s (Narayanan et al., SC'21, Sec. 2.2)."""
    nd = topology.num_devices
    states = np.zeros(nd)
    acts = np.zeros(nd)
    transient = np.zeros(nd)
    pbytes = DTYPE_BYTES.get(graph.dtype, 2)
    m = plan.microbatches
    scale = 1.0 / graph.batch_size if objective == "latency" else plan.microbatch_size(graph) / graph.batch_size
    pred = graph.predecessor_lists()
    lid = layer_ids(graph)
    region = [(plan.groups[v], int(lid[v]) if lid[v] >= 0 else -1 - v) for v in range(graph.num_nodes)]
    region_bytes: dict[tuple, float] = {}
    counted: set = set()
    for v in range(graph.num_nodes):
        g = plan.groups[v]
        lay = plan.layouts[v]
        dp = int(plan.dp[v])
        tp = len(g) // dp
        split = tp if is_tensor_split(lay) else 1
        params = graph.param_bytes[v] / pbytes / split
        if objective == "latency" or graph.meta.get("memory_model") == "param_bytes":
            # inference keeps weights only; imported workloads state their memory as bytes per node
            st = graph.param_bytes[v] / split
        else:
            st = params * plan.state_bytes_per_param
        out = graph.out_bytes[v] * scale / (1 if objective == "latency" else dp)
        out /= tp if lay == "col_split" else 1
        if objective == "latency":
            inflight = 1
            stash = out
        else:
            inflight = m if plan.schedule == "gpipe" else min(m, num_stages - int(stage[v]))
            if plan.recompute[v]:
                # checkpoint: keep the inputs that come from outside this recomputed region (one layer on
                # one device group), unless their producer stashes them already
                stash = 0.0
                for p in pred[v]:
                    if region[p] != region[v] and (plan.recompute[p] or plan.groups[p] != g) \
                            and (p, region[v]) not in counted:
                        counted.add((p, region[v]))
                        stash += graph.out_bytes[p] * scale / dp / (tp if plan.layouts[p] == "col_split" else 1)
                region_bytes[region[v]] = region_bytes.get(region[v], 0.0) + out
            else:
                stash = out
        for d in g:
            states[d] += st
            acts[d] += stash * inflight
    # during the backward of a recomputed region, its activations for one microbatch are live again
    for key, b in region_bytes.items():
        for d in key[0]:
            transient[d] = max(transient[d], b)
    caps = np.array([d.memory_bytes for d in topology.devices])
    return {"model_states": states, "activations": acts, "recompute_transient": transient,
            "total": states + acts + transient, "capacity": caps}


def optimizer_time(params: float, state_bytes_per_param: float, bandwidth: float, launch_overhead: float) -> float:
    """Adam is memory-bound: one read and one write of all model states (ZeRO, SC'20, Sec. 3)."""
    return 2 * params * state_bytes_per_param / bandwidth + launch_overhead


# ---------------------------------------------------------------------- communication
class CommTimes:
    """Collective and transfer times of a topology, collectives cached (sizes repeat across microbatches)."""

    def __init__(self, topology: Topology):
        self.topo = topology
        self.cache: dict = {}

    def collective(self, kind: str, group: tuple[int, ...], nbytes: float) -> float:
        key = (kind, group, nbytes)
        t = self.cache.get(key)
        if t is None:
            t = self.topo.collective_time(kind, group, nbytes)
            self.cache[key] = t
        return t

    def p2p(self, a: int, b: int, nbytes: float) -> float:
        return self.topo.p2p_time(a, b, nbytes)


def tp_groups(g: tuple[int, ...], dp: int) -> list[tuple[int, ...]]:
    """The tensor-parallel subgroups of a group of ``dp`` replicas (consecutive members)."""
    tp = len(g) // dp
    return [g[r * tp:(r + 1) * tp] for r in range(dp)]


def dp_groups(g: tuple[int, ...], dp: int) -> list[tuple[int, ...]]:
    """The data-parallel subgroups of a group (the members of equal tensor-parallel rank)."""
    tp = len(g) // dp
    return [g[t::tp] for t in range(tp)]


def redistribution(gu, dpu, gv, dpv, req, nbytes):
    """Point-to-point transfers that move a (materialised, batch-sharded over dpu) tensor of ``nbytes``
    from group ``gu`` to the layout group ``gv`` requires: each consumer device receives the batch
    slice of its data-parallel shard (its feature shard when ``req`` is FSHARD) from the producer
    shard(s) holding it. Returns [(src, dst, bytes, consumer_tp_rank)]."""
    tpu, tpv = len(gu) // dpu, len(gv) // dpv
    out = []
    for rv in range(dpv):
        lo_v, hi_v = rv / dpv, (rv + 1) / dpv
        for t in range(tpv):
            c = gv[rv * tpv + t]
            for ru in range(dpu):
                lo, hi = max(lo_v, ru / dpu), min(hi_v, (ru + 1) / dpu)
                if hi <= lo:
                    continue
                src = gu[ru * tpu + (t % tpu)]
                if src == c:
                    continue
                b = (hi - lo) * nbytes / (tpv if req == FSHARD else 1)
                out.append((src, c, b, t))
    return out


class CommTask(NamedTuple):
    """One communication task of a layout crossing."""

    duration: float
    backward: bool  # part of the backward pass (takes the producer's backward priority)
    devices: tuple[int, ...]  # the devices it occupies, sorted and distinct
    ports: tuple[tuple[int, ...], tuple[int, ...]]  # (devices whose send port it holds, ... receive port)
    label: str  # a template: ``{u}`` the producer's name, ``{k}`` the microbatch


class Crossing(NamedTuple):
    """The communication of one edge group: its tasks (in the order the task graph numbers them) and
    the two chains of steps they form; a step is a list of parallel tasks (indices into ``tasks``)."""

    tasks: list[CommTask]
    forward: list[list[int]]  # F(producer) -> step -> ... -> F(consumers)
    backward: list[list[int]]  # B(consumers) -> step -> ... -> B(producer)


def layout_crossing(comm: CommTimes, gu: tuple[int, ...], dpu: int, have: int, gv: tuple[int, ...], dpv: int,
                    req: int, col_weighted: bool, nbytes: float, edge_time: float | None, latency: bool,
                    scale: float) -> Crossing:
    """The collectives and transfers that carry a tensor of ``nbytes`` (one microbatch) from a producer
    on group ``gu`` (``dpu`` replicas, output state ``have``) to consumers on ``gv`` (``dpv`` replicas,
    input state ``req``), and its gradient back (not for ``latency``).

    On the same group and replicas only the state changes: partial sums are all-reduced (to FULL) or
    reduce-scattered (to FSHARD, gathered backward), shards all-gathered; a FULL input consumed as a
    shard sends its gradient back as shards to all-gather. Across groups the producer first
    materialises the tensor (all-reduce of partial sums, all-gather of shards), then
    :func:`redistribution` sends each consumer its slice, gradients flowing back along the mirrored
    transfers (one per consumer tensor-parallel group unless the consumer holds shards). A
    column-weighted consumer all-reduces its input gradient first (Megatron's "f"). ``edge_time`` is
    the measured transfer time of the tensor (dnn-partitioning workloads) for the traced batch, scaled
    to each transfer's share of the samples; otherwise transfers cost :meth:`CommTimes.p2p`."""
    tasks: list[CommTask] = []

    def add(dur, backward, devices, label, ports) -> int:
        tasks.append(CommTask(float(dur), bool(backward), tuple(sorted(set(devices))), ports, label))
        return len(tasks) - 1

    def collective(kind, g, dp, nb, backward, label) -> list[int]:
        return [add(comm.collective(kind, tp_groups(g, dp)[0], nb), backward, g, label, (g, g))]

    fwd: list[list[int]] = []
    bwd: list[list[int]] = []
    tpu, tpv = len(gu) // dpu, len(gv) // dpv
    S = nbytes
    if gu == gv and dpu == dpv:
        if have == PARTIAL and req == FULL:
            fwd.append(collective("all_reduce", gu, dpu, S / dpu, False, "allreduce {u} mb{k}"))
        elif have == PARTIAL and req == FSHARD:
            fwd.append(collective("reduce_scatter", gu, dpu, S / dpu, False, "reducescatter {u} mb{k}"))
            if not latency:
                bwd.append(collective("all_gather", gu, dpu, S / dpu, True, "allgather grad {u} mb{k}"))
        elif have == FSHARD and req == FULL:
            fwd.append(collective("all_gather", gu, dpu, S / dpu, False, "allgather {u} mb{k}"))
        elif have == FULL and req == FSHARD and not latency and tpu > 1:
            bwd.append(collective("all_gather", gu, dpu, S / dpu, True, "allgather grad {u} mb{k}"))
    else:
        if have == PARTIAL:
            fwd.append(collective("all_reduce", gu, dpu, S / dpu, False, "allreduce {u} mb{k}"))
        elif have == FSHARD and tpu > 1:
            fwd.append(collective("all_gather", gu, dpu, S / dpu, False, "allgather {u} mb{k}"))
        moves = redistribution(gu, dpu, gv, dpv, req, S)
        if moves:
            step, back = [], []
            for a, b, nb, trank in moves:
                if edge_time is not None:  # measured transfer time of the tensor, scaled with the samples
                    t = edge_time * (scale * (nb / S if S > 0 else 1.0))
                else:
                    t = comm.p2p(a, b, nb)
                step.append(add(t, False, (a, b), f"send {{u}} {a}->{b} mb{{k}}", ((a,), (b,))))
                if not latency and (req == FSHARD or trank == 0):
                    back.append(add(t, True, (a, b), f"send grad {{u}} {b}->{a} mb{{k}}", ((b,), (a,))))
            fwd.append(step)
            if back:
                bwd.append(back)
    if col_weighted and not latency and tpv > 1:
        # Megatron's "f": the input gradient of a column-split linear is a partial sum
        bwd.insert(0, collective("all_reduce", gv, dpv, S / dpv, True, "allreduce grad {u} mb{k}"))
    return Crossing(tasks, fwd, bwd)
