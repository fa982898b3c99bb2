"""The simulator's cost model: what one training step costs, independent of how the task graph is built.

The leaf of :mod:`envs.sim` (imports envs.graph, envs.plan, envs.topology and numpy only). Both task
graph builders (:mod:`envs.sim.reference`, the specification, and :mod:`envs.sim.compiled`) and the
max-load model (:mod:`envs.sim.throughput`) take every duration and every rule from here:

- :class:`StepReport`, the result of a simulation, and the task kinds of its timeline;
- the tensor layout states and the rules of which state a node produces and requires;
- :func:`node_times` (per-op forward/backward time) and :func:`memory` (peak bytes per device);
- :func:`expert_hosts` and :func:`expert_exchanges`: where expert parallelism puts each expert and the
  all-to-alls that dispatch tokens to the experts and combine them back;
- :class:`CommTimes` (collective and transfer times, cached) and the device-group helpers;
- :func:`layout_crossing`: the communication a tensor needs between its producer's and its
  consumer's layouts (written once; both builders emit exactly these tasks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from numba import njit

from envs.graph import OpGraph
from envs.plan import DTYPE_BYTES, Plan, expert_layers, layer_ids
from envs.topology import Topology

# layout states of a tensor: full, a feature shard (tensor-parallel split), partial sums (to be reduced),
# a sequence shard (sequence parallelism: each tensor-parallel rank holds 1/tp of the tokens)
FULL, FSHARD, PARTIAL, SSHARD = 0, 1, 2, 3
# task kinds of a report's timeline
KIND_COMPUTE, KIND_COMM, KIND_OPT = 0, 1, 2
KIND_NAMES = {KIND_COMPUTE: "compute", KIND_COMM: "comm", KIND_OPT: "optimizer"}
# layouts as integer codes (the compiled builder's arrays)
LAYOUT_CODE = {"single": 0, "batch_split": 1, "col_split": 2, "row_split": 3, "replicate": 4, "seq_split": 5}
L_COL, L_ROW, L_SEQ = LAYOUT_CODE["col_split"], LAYOUT_CODE["row_split"], LAYOUT_CODE["seq_split"]
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


def work_split(layout_code, tp):
    """By how much the layout divides a node's work and activations over its tensor-parallel group:
    column, row and sequence splits by tp, any other layout not (numpy arrays or ints)."""
    return np.where((layout_code == L_COL) | (layout_code == L_ROW) | (layout_code == L_SEQ), tp, 1)


def produced_state(layout_code: int) -> int:
    """The state of a node's output: a column-split node leaves a feature shard on each member, a
    row-split node partial sums (Megatron-LM, Shoeybi et al. 2019), a sequence-split node a sequence
    shard (Korthikanti et al. 2022); any other layout the full tensor. Plain Python on integer codes,
    so that the compiled builder compiles this same function."""
    if layout_code == L_COL:
        return FSHARD
    if layout_code == L_ROW:
        return PARTIAL
    if layout_code == L_SEQ:
        return SSHARD
    return FULL


def required_state(layout_code: int, has_params: bool, is_embedding: bool) -> int:
    """The state a node needs of each input: a column-split linear the full input, a column-split
    parameter-free op its feature shard; a row-split linear its feature shard, a row-split embedding
    the full token ids; a sequence-split node its sequence shard; any other layout the full tensor."""
    if layout_code == L_COL:
        return FULL if has_params else FSHARD
    if layout_code == L_ROW:
        return FULL if is_embedding else FSHARD
    if layout_code == L_SEQ:
        return SSHARD
    return FULL


def column_weighted(layout_code: int, has_params: bool) -> bool:
    """A column-split linear: its input gradient is a partial sum (all-reduced backward, Megatron's "f")."""
    return layout_code == L_COL and has_params


# ---------------------------------------------------------------------- per-node quantities
class DeviceSpec(NamedTuple):
    """What op times depend on, of one kind of device (devices with equal specs share their times)."""

    kind: str
    rate: float  # achieved FLOP/s on large GEMMs (peak x compute_eff)
    bandwidth: float  # achieved bytes/s of device memory (mem_bw x mem_eff)
    launch: float  # device-side fixed time per kernel (s)
    sm_count: int  # 0: no wave quantisation
    tile: int  # GEMM output tile edge
    host: float  # host time to issue one kernel (s)
    checkpoint: float  # time a recomputed checkpoint region adds (s)

    @classmethod
    def of(cls, device, dtype: str) -> DeviceSpec:
        return cls(device.kind, device.flops(dtype), device.bandwidth(), device.launch_overhead, int(device.sm_count),
                   int(device.gemm_tile), device.host_overhead, device.recompute_overhead)


class OpTimes(NamedTuple):
    """Per node: forward and backward time on the device, the host time to issue each, and what its
    recomputation adds besides the forward (the checkpoint machinery, on a region's last node)."""

    fwd: np.ndarray
    bwd: np.ndarray
    host_fwd: np.ndarray
    host_bwd: np.ndarray
    checkpoint: np.ndarray


@njit(cache=True)
def wave_efficiency(m: float, n: float, batch: float, sm_count: int, tile: int) -> float:
    """Fraction of the GPU a GEMM keeps busy: its ``ceil(m/T) ceil(n/T) batch`` output tiles run in waves of
    one tile per SM, and the last wave is partly empty (NVIDIA, "Matrix Multiplication Background User's
    Guide": wave quantization; T = 128 for cuBLAS' large bf16 tiles)."""
    if sm_count <= 0:
        return 1.0
    tiles = math.ceil(m / tile) * math.ceil(n / tile) * math.ceil(batch)
    return tiles / (math.ceil(tiles / sm_count) * sm_count)


@njit(cache=True)
def gemm_time(m: float, n: float, k: float, batch: float, rate: float, bandwidth: float, sm_count: int, tile: int,
              elem_bytes: float) -> float:
    """Roofline of one (batched) GEMM: ``max(2mnk b / (rate x wave efficiency), (mk + kn + mn) b e / bandwidth)``
    (Williams, Waterman & Patterson, "Roofline", CACM 2009; the efficiency by shape: wave_efficiency)."""
    flops = 2.0 * m * n * k * batch
    nbytes = (m * k + k * n + m * n) * batch * elem_bytes
    return max(flops / (rate * wave_efficiency(m, n, batch, sm_count, tile)), nbytes / bandwidth)


@njit(cache=True)
def _op_times(fwd_flops, bwd_flops, mem_bytes, param_bytes, n_ops, gemm_ptr, gemm_shape, gemm_kind, nodes, samples,
              split, layout, rate, bandwidth, launch, sm_count, tile, host, elem_bytes):
    """The loop of :func:`op_times` (see there), one node at a time."""
    cnt = nodes.shape[0]
    fwd = np.empty(cnt)
    bwd = np.empty(cnt)
    host_f = np.empty(cnt)
    host_b = np.empty(cnt)
    for i in range(cnt):
        v = nodes[i]
        sv, sp = samples[i], split[i]
        flops = fwd_flops[v] * sv / sp
        bflops = bwd_flops[v] * sv / sp
        nbytes = (max(mem_bytes[v] - param_bytes[v], 0.0) * sv + param_bytes[v]) / sp
        kernels = float(n_ops[v])
        lo, hi = gemm_ptr[v], gemm_ptr[v + 1]
        if hi == lo:
            f = max(flops / rate, nbytes / bandwidth)
            b = max(bflops / rate, 2 * nbytes / bandwidth)
        else:
            t_f = t_b = f_g = b_g = 0.0
            for j in range(lo, hi):
                m, n, k, bt = gemm_shape[j, 0], gemm_shape[j, 1], gemm_shape[j, 2], gemm_shape[j, 3]
                if gemm_kind[j] == 0:  # dense: the samples scale m; a column split divides n, a row split k
                    m = m * sv
                    if layout[i] == L_COL:
                        n = n / sp
                    elif layout[i] == L_ROW:
                        k = k / sp
                else:  # per head: the samples scale the batch (x heads), a split divides the heads
                    bt = bt * sv / sp
                t_f += gemm_time(m, n, k, bt, rate, bandwidth, sm_count, tile, elem_bytes)
                t_b += (gemm_time(m, k, n, bt, rate, bandwidth, sm_count, tile, elem_bytes)
                        + gemm_time(k, n, m, bt, rate, bandwidth, sm_count, tile, elem_bytes))
                f_g += 2.0 * m * n * k * bt
                b_g += (m * k + k * n + m * n) * bt * elem_bytes
            rest = max(nbytes - b_g, 0.0)
            f = t_f + max(max(flops - f_g, 0.0) / rate, rest / bandwidth)
            b = t_b + max(max(bflops - 2 * f_g, 0.0) / rate, 2 * rest / bandwidth)
            kernels_b = kernels + (hi - lo)
            fwd[i] = f + kernels * launch
            bwd[i] = b + kernels_b * launch
            host_f[i] = kernels * host
            host_b[i] = kernels_b * host
            continue
        fwd[i] = f + kernels * launch
        bwd[i] = b + kernels * launch
        host_f[i] = kernels * host
        host_b[i] = kernels * host
    return fwd, bwd, host_f, host_b


def op_times(graph: OpGraph, spec: DeviceSpec, nodes: np.ndarray, samples: np.ndarray, split: np.ndarray,
             layout: np.ndarray, elem_bytes: float) -> OpTimes:
    """Times of ``nodes`` on a device of ``spec`` for one microbatch: ``samples`` is each node's share of
    the traced batch on one device (microbatch / traced batch / dp), ``split`` its tensor-parallel
    degree when column- or row-split (else 1), ``layout`` its layout code.

    Measured times of the device kind, when the graph has them, scale with the samples and the split.
    Otherwise each of a node's GEMMs is timed by shape (:func:`gemm_time`; a column split divides a dense
    GEMM's n, a row split its k, either split a per-head GEMM's heads; the backward pass runs the input-
    and the weight-gradient GEMMs of the same size); the rest of the node's work (its FLOPs and bytes
    beyond the GEMMs': normalisations, softmax, elementwise ops) by the roofline max(flops / rate,
    bytes / bandwidth), twice the bytes backward; every kernel adds the device's launch time (one per
    op forward, one more per GEMM backward). A node without GEMMs is the roofline of all its work.
    Host time: ``host_overhead`` per kernel issued (PyTorch issues kernels one by one from Python)."""
    nodes = np.ascontiguousarray(nodes, dtype=np.int64)
    samples = np.ascontiguousarray(samples, dtype=np.float64)
    split = np.ascontiguousarray(split, dtype=np.float64)
    meas = graph.measured.get(spec.kind)
    checkpoint = graph.checkpoint_ends()[nodes] * spec.checkpoint
    if meas is not None:
        kernels = graph.n_ops[nodes].astype(np.float64)
        return OpTimes(meas["fwd"][nodes] * samples / split, meas["bwd"][nodes] * samples / split,
                       kernels * spec.host, kernels * spec.host, checkpoint)
    return OpTimes(*_op_times(graph.fwd_flops, graph.bwd_flops, graph.mem_bytes, graph.param_bytes, graph.n_ops,
                              graph.gemm_ptr(), graph.gemm_shape, graph.gemm_kind, nodes, samples, split,
                              np.ascontiguousarray(layout, dtype=np.int64), spec.rate, spec.bandwidth, spec.launch,
                              spec.sm_count, spec.tile, spec.host, float(elem_bytes)), checkpoint)


def device_specs(topology: Topology, dtype: str) -> tuple[list[DeviceSpec], np.ndarray]:
    """The distinct device specs of a topology and the spec of each device."""
    keys: dict[DeviceSpec, int] = {}
    per_dev = [keys.setdefault(DeviceSpec.of(d, dtype), len(keys)) for d in topology.devices]
    return list(keys), np.asarray(per_dev, dtype=np.int64)


def group_op_times(graph: OpGraph, specs: list[DeviceSpec], present: np.ndarray | None, nodes: np.ndarray,
                   samples: np.ndarray, split: np.ndarray, layout: np.ndarray, elem_bytes: float) -> OpTimes:
    """:func:`op_times` of nodes running SPMD on device groups: a node's time is its slowest member's
    (``present[i, j]``: node i's group has a device of spec j; None when there is one spec)."""
    out = None
    for j, spec in enumerate(specs):
        t = op_times(graph, spec, nodes, samples, split, layout, elem_bytes)
        if out is None and present is None:
            return t
        if out is None:
            out = OpTimes(*(np.where(present[:, j], x, 0.0) for x in t))
        else:
            out = OpTimes(*(np.where(present[:, j], np.maximum(a, x), a) for a, x in zip(out, t)))
    return out


def finish_op_times(t: OpTimes, recompute: np.ndarray, dp: np.ndarray, latency: bool) -> OpTimes:
    """Full recomputation re-runs the forward (device and host work) right before the backward (Chen
    et al., 2016), plus the checkpoint machinery's fixed cost once per recomputed region (``recompute_overhead``;
    fitted on measured CPU runs: torch.utils.checkpoint costs ~0.6 ms per call on one core); the latency
    objective times one sample, which data parallelism does not split."""
    fwd, bwd, hf, hb, ck = t
    if recompute.any():
        bwd = bwd + np.where(recompute, fwd + ck, 0.0)
        hb = hb + np.where(recompute, hf, 0.0)
    if latency:
        fwd = fwd * dp.astype(np.float64)
    return OpTimes(fwd, bwd, hf, hb, ck)


def node_times(graph: OpGraph, topology: Topology, plan: Plan, scale: float, latency: bool = False) -> OpTimes:
    """Forward and backward time (and the host time to issue them) of each node for one microbatch
    (``scale`` = samples / traced batch) under ``plan`` (see :func:`op_times`)."""
    specs, dev_spec = device_specs(topology, plan.dtype)
    n = graph.num_nodes
    dp = np.asarray(plan.dp, dtype=np.int64)
    tp = np.array([len(g) for g in plan.groups], dtype=np.int64) // dp
    layout = np.array([LAYOUT_CODE[x] for x in plan.layouts], dtype=np.int64)
    split = work_split(layout, tp)
    present = None
    if len(specs) > 1:
        present = np.zeros((n, len(specs)), dtype=bool)
        for v, g in enumerate(plan.groups):
            present[v, dev_spec[list(g)]] = True
    # a replica's share of the microbatch: an expert under expert parallelism computes the tokens of its
    # ep data-parallel ranks (dp / ep replicas)
    replicas = dp // np.asarray(plan.ep, dtype=np.int64)
    t = group_op_times(graph, specs, present, np.arange(n), scale / replicas, split, layout,
                       DTYPE_BYTES.get(plan.dtype, 2))
    return finish_op_times(t, np.asarray(plan.recompute, dtype=bool), replicas, latency)


def expert_hosts(graph: OpGraph, plan: Plan) -> list[tuple[int, ...]]:
    """Per node the devices that compute it and hold its weights: its device group, or for an expert
    under expert parallelism its EP rank j in every EP group (EP groups of ep consecutive data-parallel
    ranks, rank j holding experts j*E/ep .. (j+1)*E/ep - 1: DeepSpeed-MoE's and Megatron-LM's placement)."""
    hosts = list(plan.groups)
    if plan.ep.max(initial=1) <= 1:
        return hosts
    _, index, count = expert_layers(graph)
    for v in np.flatnonzero(plan.ep > 1).tolist():
        g, dp, ep = plan.groups[v], int(plan.dp[v]), int(plan.ep[v])
        j = int(index[v]) // (int(count[v]) // ep)
        hosts[v] = tuple(g[q * ep + j] for q in range(dp // ep))
    return hosts


class ExpertExchange(NamedTuple):
    """One all-to-all of an expert-parallel layer per microbatch: the dispatch (tokens to their experts)
    or the combine (expert outputs back to their tokens' ranks), its gradient the reverse all-to-all."""

    label: str  # "dispatch" or "combine" and the layer
    producers: list[int]  # nodes whose outputs it carries
    consumers: list[int]  # nodes that read them
    group: tuple[int, ...]  # the experts' data-parallel group (the all-to-alls run in each EP group of it)
    ep_group: tuple[int, ...]  # the first EP group
    nbytes: float  # each rank's send buffer for the traced batch (scale it by the microbatch share)
    replay: bool  # the experts are recomputed: the dispatch runs again in the backward


def expert_exchanges(graph: OpGraph, plan: Plan) -> list[ExpertExchange]:
    """The dispatch and combine all-to-alls of every expert-parallel layer, in layer order: the edges
    entering its experts from outside them (dispatch) and leaving them (combine); each rank sends its
    share of those tensors (1/dp), 1/ep of it to each rank of its EP group (Lepikhin et al., GShard,
    2021; Rajbhandari et al., DeepSpeed-MoE, ICML'22)."""
    if plan.ep.max(initial=1) <= 1:
        return []
    layer, index, _ = expert_layers(graph)
    out: list[ExpertExchange] = []
    for L in sorted({int(x) for x in layer[plan.ep > 1]}):
        members = np.flatnonzero(layer == L)
        v0 = int(members[0])
        g, dp, ep = plan.groups[v0], int(plan.dp[v0]), int(plan.ep[v0])
        inside = (layer[graph.edge_src] == layer[graph.edge_dst]) & (index[graph.edge_src] == index[graph.edge_dst])
        for what, expert_end in (("dispatch", graph.edge_dst), ("combine", graph.edge_src)):
            sel = np.flatnonzero((layer[expert_end] == L) & ~inside)
            if not sel.size:
                continue
            prods = sorted({int(x) for x in (graph.edge_src[sel])})
            cons = sorted({int(x) for x in (graph.edge_dst[sel])})
            replay = what == "dispatch" and bool(plan.recompute[members].any())
            out.append(ExpertExchange(f"{what} {graph.module_paths[v0].rsplit('.experts', 1)[0]}", prods, cons, g,
                                      g[:ep], float(graph.edge_bytes[sel].sum()) / dp, replay))
    return out


def model_state_bytes(params, state_bytes_per_param: float, param_bytes: float, zero, dp):
    """Model-state bytes on one replica of ``params`` parameters: weights and gradients (``param_bytes``
    each) plus the optimizer states (the rest of ``state_bytes_per_param``), ZeRO stage ``zero`` sharding
    the optimizer states (1), also the gradients (2), also the weights (3) over the ``dp`` replicas:
    16P, 4P + 12P/N, 2P + 14P/N, 16P/N for mixed-precision Adam (Rajbhandari et al., SC'20, Fig. 1).
    ``params``, ``zero`` and ``dp`` may be per-node arrays (elementwise; an array comes back), or numbers
    (a float comes back)."""
    opt = max(state_bytes_per_param - 2 * param_bytes, 0.0)
    w, g = param_bytes, param_bytes
    sharded = (np.asarray(zero) > 0) & (np.asarray(dp) > 1)
    out = np.where(sharded & (zero == 1), params * (w + g + opt / dp), params * state_bytes_per_param)
    out = np.where(sharded & (zero == 2), params * (w + (g + opt) / dp), out)
    out = np.where(sharded & (zero >= 3), params * (w + g + opt) / dp, out)
    return out if out.ndim else float(out)


def interleaved_in_flight(p: int, v: int, rank: int, chunk: int, m: int) -> int:
    """Microbatches of local model chunk ``chunk`` (of ``v``) whose activations pipeline rank ``rank``
    (of ``p``) holds at its peak under interleaved 1F1B: the warm-up forwards, (p - rank - 1) x 2 +
    (v - 1) x p, and one more, visiting the chunks p microbatches at a time (Megatron-LM's interleaved
    schedule; Narayanan et al., SC'21, Sec. 2.2); with v = 1 it is min(m, p - rank)."""
    if v <= 1:
        return min(m, p - rank)
    total = min((p - rank - 1) * 2 + (v - 1) * p + 1, m * v)
    full, rest = divmod(total, p * v)
    return full * p + min(max(rest - chunk * p, 0), p)


def memory(graph: OpGraph, topology: Topology, plan: Plan, stage: np.ndarray, num_stages: int,
           objective: str = "step_time") -> dict[str, np.ndarray]:
    """Peak bytes per device: model states + stashed activations of in-flight microbatches + the
    transient activations of one recomputed microbatch + with several microbatches the largest weight
    gradient of one node (autograd's AccumulateGrad allocates a microbatch's gradient before adding
    it to the accumulated one; measured on CPU runs, experiments/memory_fidelity.py) + under ZeRO-3 the
    gathered weights of two nodes (the one computing and the one prefetched).

    Model states: :func:`model_state_bytes` (ZeRO, Rajbhandari et al. SC'20). Stashed: a node's output
    and what it saves for its backward (``OpGraph.saved_bytes``), divided over a column, row (saved
    part) or sequence split (Korthikanti et al. 2022, Table 2). In flight: GPipe all m microbatches,
    1F1B at most p - s on stage s (Narayanan et al., SC'21, Sec. 2.2), interleaved 1F1B
    :func:`interleaved_in_flight`."""
    nd, n = topology.num_devices, graph.num_nodes
    transient = np.zeros(nd)
    accumulate = np.zeros(nd)
    gathered = np.zeros((nd, 2))
    pbytes = DTYPE_BYTES.get(graph.dtype, 2)
    m = plan.microbatches
    scale = 1.0 / graph.batch_size if objective == "latency" else plan.microbatch_size(graph) / graph.batch_size
    hosts = expert_hosts(graph, plan)
    V = int(plan.virtual_stages)
    # per node, as arrays (each the same IEEE operations as the per-node formulas): group size, tensor
    # degree, replicas, which layouts divide what
    layouts = np.asarray(plan.layouts)
    size = np.fromiter(map(len, plan.groups), dtype=np.int64, count=n)
    dp_plan = plan.dp.astype(np.int64)
    tp = size // dp_plan
    dp = dp_plan // plan.ep.astype(np.int64)  # the replicas (an expert-parallel expert: one per EP group)
    col_or_seq = (layouts == "col_split") | (layouts == "seq_split")
    tensor_split = (layouts == "col_split") | (layouts == "row_split")
    split = np.where(tensor_split, tp, 1)
    zero = plan.zero.astype(np.int64)
    # a row split's partial sums reach a sequence-split consumer reduce-scattered: what is kept is the shard
    scattered = np.zeros(n, dtype=bool)
    if "seq_split" in plan.layouts:
        for e in range(graph.num_edges):
            u, w = int(graph.edge_src[e]), int(graph.edge_dst[e])
            if plan.layouts[u] == "row_split" and plan.layouts[w] == "seq_split" and plan.groups[u] == plan.groups[w]:
                scattered[u] = True
    # model states (ZeRO, Rajbhandari et al. SC'20: model_state_bytes)
    if objective == "latency" or graph.meta.get("memory_model") == "param_bytes":
        # inference keeps weights only; imported workloads state their memory as bytes per node
        node_states = graph.param_bytes / split
    else:
        node_states = model_state_bytes(graph.param_bytes / pbytes / split, plan.state_bytes_per_param, pbytes,
                                        zero, dp)
    if objective == "latency":
        inflight = np.ones(n, dtype=np.int64)  # inference keeps no activations for a backward: only the outputs
        stash = graph.out_bytes * scale / 1 / np.where(col_or_seq, tp, 1)
    else:
        # bytes a node keeps for the backward per microbatch (its output and what it saves), per replica
        stash = graph.out_bytes * scale / dp
        stash = stash / np.where(col_or_seq | scattered, tp, 1)
        saved = graph.saved_bytes * scale / dp
        stash = np.where(graph.saved_bytes > 0,
                         stash + saved / np.where(col_or_seq | (layouts == "row_split"), tp, 1), stash)
        if plan.schedule == "gpipe":
            inflight = np.full(n, m, dtype=np.int64)
        elif V > 1:
            chunk = plan.chunks(graph)[0] // num_stages
            inflight = np.array([interleaved_in_flight(num_stages, V, int(stage[v]), int(chunk[v]), m)
                                 for v in range(n)], dtype=np.int64)
        else:
            inflight = np.minimum(m, num_stages - stage.astype(np.int64))
    region_bytes: dict[tuple, float] = {}
    if objective != "latency" and plan.recompute.any():
        # checkpoint: keep the inputs that come from outside this recomputed region (one layer on one
        # device group), unless their producer stashes them already
        pred = graph.predecessor_lists()
        lid = layer_ids(graph)
        region = [(hosts[v], int(lid[v]) if lid[v] >= 0 else -1 - v) for v in range(n)]
        counted: set = set()
        kept = stash.copy()
        for v in np.flatnonzero(plan.recompute).tolist():
            inputs = 0.0
            for p in pred[v]:
                if region[p] != region[v] and (plan.recompute[p] or hosts[p] != hosts[v]) \
                        and (p, region[v]) not in counted:
                    counted.add((p, region[v]))
                    inputs += graph.out_bytes[p] * scale / int(dp[v]) / (int(tp[v]) if plan.layouts[p] in
                                                                        ("col_split", "seq_split") else 1)
            region_bytes[region[v]] = region_bytes.get(region[v], 0.0) + stash[v]
            kept[v] = inputs
        stash = kept
    node_acts = stash * inflight
    node_grad = graph.param_bytes / split if m > 1 and objective != "latency" else np.zeros(n)
    node_full = np.where((zero >= 3) & (dp > 1), graph.param_bytes / split, 0.0) if objective != "latency" \
        else np.zeros(n)
    # per device, node by node (bincount adds in input order: the same sums as a loop over the nodes)
    counts = np.fromiter((len(h) for h in hosts), dtype=np.int64, count=graph.num_nodes)
    node_of = np.repeat(np.arange(graph.num_nodes), counts)
    as_array = {h: np.asarray(h, dtype=np.int64) for h in set(hosts)}
    dev_of = np.concatenate([as_array[h] for h in hosts]) if graph.num_nodes else np.zeros(0, dtype=np.int64)
    states = np.bincount(dev_of, weights=node_states[node_of], minlength=nd).astype(np.float64)
    acts = np.bincount(dev_of, weights=node_acts[node_of], minlength=nd).astype(np.float64)
    np.maximum.at(accumulate, dev_of, node_grad[node_of])
    full = node_full[node_of]
    if (full > 0).any():  # the two largest gathered weights of each device
        order = np.lexsort((-full, dev_of))
        d_sorted, w_sorted = dev_of[order], full[order]
        head = np.ones(len(order), dtype=bool)
        head[1:] = d_sorted[1:] != d_sorted[:-1]
        gathered[d_sorted[head], 0] = w_sorted[head]
        second = np.flatnonzero(head) + 1
        second = second[second < len(order)]
        second = second[d_sorted[second] == d_sorted[second - 1]]
        gathered[d_sorted[second], 1] = w_sorted[second]
    # during the backward of a recomputed region, its activations for one microbatch are live again
    for key, b in region_bytes.items():
        for d in key[0]:
            transient[d] = max(transient[d], b)
    caps = np.array([d.memory_bytes for d in topology.devices])
    out = {"model_states": states, "activations": acts, "recompute_transient": transient,
           "accumulation_transient": accumulate, "total": states + acts + transient + accumulate, "capacity": caps}
    if (plan.zero >= 3).any() and objective != "latency":
        out["zero3_gathered"] = gathered.sum(axis=1)
        out["total"] = out["total"] + out["zero3_gathered"]
    return out


def optimizer_time(params: float, state_bytes_per_param: float, bandwidth: float, launch_overhead: float) -> float:
    """Adam is memory-bound: one read and one write of all model states (ZeRO, SC'20, Sec. 3)."""
    return 2 * params * state_bytes_per_param / bandwidth + launch_overhead


# ---------------------------------------------------------------------- communication
class CommTimes:
    """Collective and transfer times of a topology, collectives cached (sizes repeat across microbatches),
    and the host time a device spends issuing each (``comm_overhead`` per collective, ``p2p_overhead``
    per point-to-point transfer, plus ``sync_overhead`` per further rank of a collective: the ranks'
    hosts meet at every collective, and the more ranks the later the last arrives; with the host
    modelled, a transfer blocks its hosts until it is done: Megatron-LM and DeepSpeed synchronise after
    pipeline sends and receives)."""

    def __init__(self, topology: Topology):
        self.topo = topology
        self.cache: dict = {}
        devs = topology.devices
        self._coll_host = np.array([d.comm_overhead for d in devs])
        self._p2p_host = np.array([d.p2p_overhead for d in devs])
        self._sync_host = np.array([d.sync_overhead for d in devs])
        self._host_cache: dict = {}
        self._hosted = np.array([d.host_overhead > 0 or d.comm_overhead > 0 or d.p2p_overhead > 0
                                 or d.sync_overhead > 0 for d in devs])

    def host(self, devices: tuple[int, ...], transfer: bool) -> tuple[float, bool]:
        """(host seconds to issue a collective or transfer over ``devices``, whether it blocks the host)."""
        if not self._hosted.any():
            return 0.0, False
        key = (devices, transfer)
        hit = self._host_cache.get(key)
        if hit is None:
            idx = list(devices)
            if transfer:
                hit = float(self._p2p_host[idx].max()), bool(self._hosted[idx].any())
            else:
                hit = float(self._coll_host[idx].max() + self._sync_host[idx].max() * (len(idx) - 1)), False
            self._host_cache[key] = hit
        return hit

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
                b = (hi - lo) * nbytes / (tpv if req == FSHARD or req == SSHARD else 1)
                out.append((src, c, b, t))
    return out


class CommTask(NamedTuple):
    """One communication task of a layout crossing."""

    duration: float
    backward: bool  # part of the backward pass (takes the producer's backward priority)
    devices: tuple[int, ...]  # the devices it occupies, sorted and distinct
    ports: tuple[tuple[int, ...], tuple[int, ...]]  # (devices whose send port it holds, ... receive port)
    label: str  # a template: ``{u}`` the producer's name, ``{k}`` the microbatch
    host: float = 0.0  # host seconds to issue it (CommTimes.host)
    sync: bool = False  # its hosts wait for it to finish


class Crossing(NamedTuple):
    """The communication of one edge group: its tasks (in the order the task graph numbers them) and
    the two chains of steps they form; a step is a list of parallel tasks (indices into ``tasks``)."""

    tasks: list[CommTask]
    forward: list[list[int]]  # F(producer) -> step -> ... -> F(consumers)
    backward: list[list[int]]  # B(consumers) -> step -> ... -> B(producer)


def layout_crossing(comm: CommTimes, gu: tuple[int, ...], dpu: int, have: int, gv: tuple[int, ...], dpv: int,
                    req: int, col_weighted: bool, nbytes: float, edge_time: float | None, latency: bool,
                    scale: float, replay: bool = False, blocking_transfers: bool = True) -> Crossing:
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
    to each transfer's share of the samples; otherwise transfers cost :meth:`CommTimes.p2p`. ``replay``
    (the producer is recomputed): the collectives of a same-group crossing run again in the backward
    pass, before the gradient's, because recomputing the forward re-issues them (Megatron-LM's full
    recomputation re-runs a layer's forward, its tensor-parallel all-reduces included; Korthikanti et al.
    2022, Sec. 5). ``blocking_transfers=False``: point-to-point transfers do not hold their hosts
    (Megatron-LM's interleaved schedule overlaps its sends and receives with compute,
    ``--overlap-p2p-communication``)."""
    tasks: list[CommTask] = []

    def add(dur, backward, devices, label, ports) -> int:
        devs = tuple(sorted(set(devices)))
        host, sync = comm.host(devs, transfer=len(ports[0]) == 1 and len(ports[1]) == 1 and ports[0] != ports[1])
        sync = sync and blocking_transfers
        tasks.append(CommTask(float(dur), bool(backward), devs, ports, label, host, sync))
        return len(tasks) - 1

    def collective(kind, g, dp, nb, backward, label) -> list[int]:
        return [add(comm.collective(kind, tp_groups(g, dp)[0], nb), backward, g, label, (g, g))]

    fwd: list[list[int]] = []
    bwd: list[list[int]] = []
    tpu, tpv = len(gu) // dpu, len(gv) // dpv
    S = nbytes
    shard = req == FSHARD or req == SSHARD
    if gu == gv and dpu == dpv:
        if have == PARTIAL and req == FULL:
            fwd.append(collective("all_reduce", gu, dpu, S / dpu, False, "allreduce {u} mb{k}"))
        elif have == PARTIAL and shard:
            # to a feature shard, or (sequence parallelism) to a sequence shard: Korthikanti et al.
            # 2022, Sec. 4.2.2, the all-reduce becomes a reduce-scatter, its gradient an all-gather
            fwd.append(collective("reduce_scatter", gu, dpu, S / dpu, False, "reducescatter {u} mb{k}"))
            if not latency:
                bwd.append(collective("all_gather", gu, dpu, S / dpu, True, "allgather grad {u} mb{k}"))
        elif have == FSHARD and req == FULL:
            fwd.append(collective("all_gather", gu, dpu, S / dpu, False, "allgather {u} mb{k}"))
        elif (have == SSHARD and req != SSHARD) or (have == FSHARD and req == SSHARD):
            # a sequence shard gathered (into a column split: sequence parallelism's all-gather in place
            # of Megatron's "f"); between a feature and a sequence shard the gather bounds the all-to-all
            fwd.append(collective("all_gather", gu, dpu, S / dpu, False, "allgather {u} mb{k}"))
        elif have == FULL and shard and not latency and tpu > 1:
            bwd.append(collective("all_gather", gu, dpu, S / dpu, True, "allgather grad {u} mb{k}"))
    else:
        if have == PARTIAL:
            fwd.append(collective("all_reduce", gu, dpu, S / dpu, False, "allreduce {u} mb{k}"))
        elif (have == FSHARD or have == SSHARD) and tpu > 1:
            fwd.append(collective("all_gather", gu, dpu, S / dpu, False, "allgather {u} mb{k}"))
        scatter_gather = (req == FULL and edge_time is None and tpu == tpv and tpu > 1 and dpu == dpv
                          and not set(gu) & set(gv))
        moves = [] if scatter_gather else redistribution(gu, dpu, gv, dpv, req, S)
        if scatter_gather:
            # Megatron-LM's scatter/gather between pipeline stages (Narayanan et al., SC'21, Sec. 4.1):
            # tensor-parallel rank t sends 1/tp of the tensor to rank t of the next stage, which
            # all-gather it over their fast intra-group links; the gradient the same way back
            piece = S / dpv / tpv
            step, back = [], []
            for a, b in zip(gu, gv):
                t = comm.p2p(a, b, piece)
                step.append(add(t, False, (a, b), f"send {{u}} {a}->{b} mb{{k}}", ((a,), (b,))))
                if not latency:
                    back.append(add(t, True, (a, b), f"send grad {{u}} {b}->{a} mb{{k}}", ((b,), (a,))))
            fwd.append(step)
            fwd.append(collective("all_gather", gv, dpv, S / dpv, False, "allgather {u} mb{k}"))
            if not latency:
                bwd.append(back)
                bwd.append(collective("all_gather", gu, dpu, S / dpu, True, "allgather grad {u} mb{k}"))
        if moves:
            step, back = [], []
            for a, b, nb, trank in moves:
                if edge_time is not None:  # measured transfer time of the tensor, scaled with the samples
                    t = edge_time * (scale * (nb / S if S > 0 else 1.0))
                else:
                    t = comm.p2p(a, b, nb)
                step.append(add(t, False, (a, b), f"send {{u}} {a}->{b} mb{{k}}", ((a,), (b,))))
                if not latency and (shard or trank == 0):
                    back.append(add(t, True, (a, b), f"send grad {{u}} {b}->{a} mb{{k}}", ((b,), (a,))))
            fwd.append(step)
            if back:
                bwd.append(back)
    if col_weighted and not latency and tpv > 1:
        # Megatron's "f": the input gradient of a column-split linear is a partial sum, all-reduced;
        # reduce-scattered back to sequence shards under sequence parallelism (Korthikanti et al. 2022)
        if have == SSHARD and gu == gv and dpu == dpv:
            bwd.insert(0, collective("reduce_scatter", gv, dpv, S / dpv, True, "reducescatter grad {u} mb{k}"))
        else:
            bwd.insert(0, collective("all_reduce", gv, dpv, S / dpv, True, "allreduce grad {u} mb{k}"))
    if replay and not latency and gu == gv and dpu == dpv and fwd:
        again = [[add(tasks[j].duration, True, tasks[j].devices, "re-" + tasks[j].label, tasks[j].ports)
                  for j in step] for step in fwd]
        bwd[0:0] = again
    return Crossing(tasks, fwd, bwd)
