"""Step-time and memory simulator: ``simulate(graph, topology, plan) -> StepReport``.

It builds the training step's task graph and list-schedules it on device resources:

- compute tasks: forward and backward of every node for every microbatch; a node on a device group
  runs SPMD on all devices of its group at once (one task holding every member's compute engine);
- transfers for every tensor that crosses devices, and re-layout collectives between a producer's and
  a consumer's layout (Megatron: row-split partial sums all-reduced forward, column-split input
  gradients all-reduced backward); each gradient flows back along the mirrored transfer;
- data-parallel gradient all-reduce in 25 MB buckets (PyTorch DDP's default ``bucket_cap_mb``),
  each starting when its last gradient is ready, so it overlaps the rest of the backward pass;
- the optimizer update per device after its gradients are synchronised.

Link contention: every device has one send port and one receive port, each exclusive (a transfer
holds the sender's send port and the receiver's receive port; a collective holds both ports of every
member). Compute and communication overlap freely. Routes and bandwidths come from the Topology
(widest path, alpha-beta). Pipeline schedules: GPipe runs all forwards then all backwards (flush);
1F1B keeps at most ``p - s`` microbatches in flight on stage ``s`` (Narayanan et al., PipeDream-Flush,
ICML'21) and prefers backward work.

Speed: ``simulate`` builds the task graph with the compiled evaluator :class:`envs.fast_sim.Simulator`
(cached per graph and topology; numpy + numba, the same tasks as the plain-Python reference builder
``_schedule_reference`` bit for bit; it also offers ``delta`` re-evaluation after moving one node), and
switches to the stage-level pipeline model of :mod:`envs.fast_stage` for stage-chain plans whose task
graph would exceed ``FAST_PATH_TASKS`` (``fast_path=`` forces either way).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from envs.errors import PlanError
from envs.graph import OpGraph
from envs.plan import DTYPE_BYTES, Plan, layer_ids
from envs.schedule_core import list_schedule, to_csr
from envs.topology import Topology

OBJECTIVES = ("step_time", "throughput", "latency")
DDP_BUCKET_BYTES = 25 * 2**20  # torch.nn.parallel.DistributedDataParallel bucket_cap_mb=25 (PyTorch docs)
FULL, FSHARD, PARTIAL = 0, 1, 2

KIND_COMPUTE, KIND_COMM, KIND_OPT = 0, 1, 2


@dataclass
class StepReport:
    objective: str
    step_time: float  # the objective's value in seconds (step time, time per microbatch, or latency)
    makespan: float  # simulated wall time of the schedule (== step_time for step_time / latency)
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
    plan_arrays: object = None  # the plan in array form (envs.fast_sim.PlanArrays), for Simulator.delta
    fast_path: str = ""  # which builder produced the report: "arrays", "stages" (envs.fast_sim), "reference"

    @property
    def is_oom(self) -> bool:
        return bool(self.oom)

    def timeline(self) -> list[dict]:
        """Rows ``{device, start, end, kind, label}`` (one per device a task occupies), for Gantt charts."""
        if self.task_start is None:
            return []
        kinds = {KIND_COMPUTE: "compute", KIND_COMM: "comm", KIND_OPT: "optimizer"}
        rows = []
        for t in range(self.num_tasks):
            for k in range(self.task_device_ptr[t], self.task_device_ptr[t + 1]):
                rows.append({"device": int(self.task_devices[k]), "start": float(self.task_start[t]),
                             "end": float(self.task_finish[t]), "kind": kinds[int(self.task_kind[t])],
                             "label": self.task_label[t] if self.task_label else ""})
        return rows

    def to_dict(self) -> dict:
        return {"objective": self.objective, "step_time_s": self.step_time, "makespan_s": self.makespan,
                "peak_memory_bytes": [float(x) for x in self.peak_memory],
                "memory_capacity_bytes": [float(x) for x in self.memory_capacity],
                "oom": bool(self.oom), "oom_devices": [self.device_names[d] for d in self.oom],
                "compute_s": [float(x) for x in self.compute_time], "comm_s": [float(x) for x in self.comm_time],
                "idle_s": [float(x) for x in self.idle_time], "devices": self.device_names,
                "num_tasks": self.num_tasks}


# ---------------------------------------------------------------------- per-node quantities
def _state_out(layout: str) -> int:
    return {"col_split": FSHARD, "row_split": PARTIAL}.get(layout, FULL)


def _required_in(graph: OpGraph, v: int, layout: str) -> int:
    if layout == "col_split":
        return FULL if graph.param_bytes[v] > 0 else FSHARD
    if layout == "row_split":
        return FULL if graph.kinds[v] == "embedding" else FSHARD
    return FULL


def _tp_divisor(layout: str) -> bool:
    return layout in ("col_split", "row_split")


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
        split = tp if (_tp_divisor(lay) or (lay == "col_split")) else 1
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
    pred = graph._pred_lists()
    lid = layer_ids(graph)
    region = [(plan.groups[v], int(lid[v]) if lid[v] >= 0 else -1 - v) for v in range(graph.num_nodes)]
    region_bytes: dict[tuple, float] = {}
    counted: set = set()
    for v in range(graph.num_nodes):
        g = plan.groups[v]
        lay = plan.layouts[v]
        dp = int(plan.dp[v])
        tp = len(g) // dp
        split = tp if _tp_divisor(lay) else 1
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


# ---------------------------------------------------------------------- task graph
class _Tasks:
    def __init__(self, nd: int):
        self.nd = nd
        self.dur: list[float] = []
        self.prio: list[float] = []
        self.res: list[tuple[int, ...]] = []
        self.devs: list[tuple[int, ...]] = []
        self.kind: list[int] = []
        self.label: list[str] = []
        self.src: list[int] = []
        self.dst: list[int] = []

    def add(self, dur, prio, devices, kind, label, comm_ports=None) -> int:
        nd = self.nd
        if kind == KIND_COMM:
            snd, rcv = comm_ports
            res = tuple(nd + d for d in snd) + tuple(2 * nd + d for d in rcv)
        else:
            res = tuple(devices)
        self.dur.append(float(dur))
        self.prio.append(float(prio))
        self.res.append(res)
        self.devs.append(tuple(sorted(set(devices))))
        self.kind.append(kind)
        self.label.append(label)
        return len(self.dur) - 1

    def dep(self, a: int, b: int) -> None:
        self.src.append(a)
        self.dst.append(b)


class _Comm:
    """Collective and transfer times with a cache (sizes repeat across microbatches)."""

    def __init__(self, topology: Topology, graph: OpGraph):
        self.topo = topology
        self.cache: dict = {}

    def coll(self, kind: str, group: tuple[int, ...], nbytes: float) -> float:
        key = (kind, group, nbytes)
        t = self.cache.get(key)
        if t is None:
            t = self.topo.collective_time(kind, group, nbytes)
            self.cache[key] = t
        return t

    def p2p(self, a: int, b: int, nbytes: float) -> float:
        return self.topo.p2p_time(a, b, nbytes)


def _tp_groups(g: tuple[int, ...], dp: int) -> list[tuple[int, ...]]:
    tp = len(g) // dp
    return [g[r * tp:(r + 1) * tp] for r in range(dp)]


def _dp_groups(g: tuple[int, ...], dp: int) -> list[tuple[int, ...]]:
    tp = len(g) // dp
    return [g[t::tp] for t in range(tp)]


def _redistribution(gu, dpu, gv, dpv, req, nbytes):
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


def simulate(graph: OpGraph, topology: Topology, plan: Plan, objective: str = "step_time", *,
             timeline: bool = True, validate: bool = True, fast_path: bool | None = None) -> StepReport:
    """Predict the step time and peak memory of ``plan`` for ``graph`` on ``topology``.

    objective: ``step_time`` (one training step), ``throughput`` (steady-state time per microbatch:
    the busiest device's per-microbatch load of compute plus communication; for the dnn-partitioning
    workloads this is Tarnawski et al.'s max-load), ``latency`` (one sample, forward only).

    The task graph is built by the compiled evaluator :class:`envs.fast_sim.Simulator` (cached per
    graph and topology), which reproduces the reference builder ``_schedule_reference`` exactly.
    ``fast_path``: the stage-level pipeline model (:func:`envs.fast_sim.stage_simulate`) for
    stage-contiguous plans with identical microbatches; None uses it automatically when the full task
    graph would exceed ``FAST_PATH_TASKS`` tasks and the plan qualifies, True forces it (raising
    PlanError when the plan does not qualify), False never uses it."""
    if objective not in OBJECTIVES:
        raise PlanError(f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
    if validate:
        plan.validate(graph, topology)
    if objective == "throughput":
        return _throughput(graph, topology, plan)
    from envs.fast_sim import simulate_fast

    return simulate_fast(graph, topology, plan, objective, timeline=timeline, fast_path=fast_path)


def _edge_transfer_time(graph: OpGraph, comm: _Comm, e: int, a: int, b: int, nbytes: float, scale: float) -> float:
    if graph.edge_time is not None:
        # measured transfer time of this tensor (dnn-partitioning workloads), scaled with the samples
        return float(graph.edge_time[e]) * scale
    return comm.p2p(a, b, nbytes)


def _schedule_reference(graph: OpGraph, topology: Topology, plan: Plan, objective: str,
                        want_timeline: bool) -> StepReport:
    """The reference task-graph builder (plain Python, one task at a time): the specification that
    envs.fast_sim.Simulator reproduces exactly; kept for tests and debugging."""
    nd = topology.num_devices
    n = graph.num_nodes
    latency = objective == "latency"
    m = 1 if latency else plan.microbatches
    scale = (1.0 / graph.batch_size) if latency else plan.microbatch_size(graph) / graph.batch_size
    stage, p = plan.stages(graph)
    topo_pos = np.empty(n, dtype=np.int64)
    topo_pos[graph.topological_order()] = np.arange(n)
    fwd_t, bwd_t = node_times(graph, topology, plan, scale)
    if latency:  # a single sample is not split by data parallelism
        fwd_t = fwd_t * np.array([plan.dp[v] for v in range(n)], dtype=np.float64)
    comm = _Comm(topology, graph)
    T = _Tasks(nd)
    N = float(n + 1)
    gpipe = plan.schedule == "gpipe"

    def prio(v: int, k: int, backward: bool) -> float:
        if gpipe:
            return (m * N + k * N + (N - 1 - topo_pos[v])) if backward else (k * N + topo_pos[v])
        return k * 2 * N + ((N - 1 - topo_pos[v]) if backward else (N + topo_pos[v]))

    F = np.empty((n, m), dtype=np.int64)
    B = np.empty((n, m), dtype=np.int64) if not latency else None
    for v in range(n):
        g = plan.groups[v]
        name = graph.names[v]
        for k in range(m):
            F[v, k] = T.add(fwd_t[v], prio(v, k, False), g, KIND_COMPUTE, f"F {name} mb{k}")
            if not latency:
                B[v, k] = T.add(bwd_t[v], prio(v, k, True), g, KIND_COMPUTE, f"B {name} mb{k}")
                T.dep(F[v, k], B[v, k])
    # pipeline schedule constraints
    if not latency and m > 1:
        for v in range(n):
            if gpipe:
                for k in range(m):
                    T.dep(F[v, m - 1], B[v, k])
            else:
                w = p - int(stage[v])
                for k in range(w, m):
                    T.dep(B[v, k - w], F[v, k])

    # edges grouped by (producer, consumer group, consumer dp, requirement)
    groups_by_key: dict[tuple, list[tuple[int, int]]] = {}
    for e in range(graph.num_edges):
        u, v = int(graph.edge_src[e]), int(graph.edge_dst[e])
        key = (u, plan.groups[v], int(plan.dp[v]), _required_in(graph, v, plan.layouts[v]),
               plan.layouts[v] == "col_split" and graph.param_bytes[v] > 0)
        groups_by_key.setdefault(key, []).append((e, v))
    for (u, gv, dpv, req, col_weighted), members in groups_by_key.items():
        gu, dpu, lay_u = plan.groups[u], int(plan.dp[u]), plan.layouts[u]
        have = _state_out(lay_u)
        e0 = members[0][0]
        S = float(graph.edge_bytes[[e for e, _ in members]].max()) * scale
        tpu, tpv = len(gu) // dpu, len(gv) // dpv
        consumers = [v for _, v in members]
        for k in range(m):
            pr_f = min(prio(v, k, False) for v in consumers)
            fwd_chain: list[list[int]] = []  # steps of parallel tasks
            bwd_chain: list[list[int]] = []
            pr_b = prio(u, k, True) if not latency else 0.0
            same = gu == gv and dpu == dpv
            if same:
                if have == PARTIAL and req == FULL:
                    t = comm.coll("all_reduce", _tp_groups(gu, dpu)[0], S / dpu)
                    fwd_chain.append([T.add(t, pr_f, gu, KIND_COMM, f"allreduce {graph.names[u]} mb{k}", (gu, gu))])
                elif have == PARTIAL and req == FSHARD:
                    t = comm.coll("reduce_scatter", _tp_groups(gu, dpu)[0], S / dpu)
                    fwd_chain.append([T.add(t, pr_f, gu, KIND_COMM, f"reducescatter {graph.names[u]} mb{k}", (gu, gu))])
                    if not latency:
                        t = comm.coll("all_gather", _tp_groups(gu, dpu)[0], S / dpu)
                        bwd_chain.append([T.add(t, pr_b, gu, KIND_COMM, f"allgather grad {graph.names[u]} mb{k}", (gu, gu))])
                elif have == FSHARD and req == FULL:
                    t = comm.coll("all_gather", _tp_groups(gu, dpu)[0], S / dpu)
                    fwd_chain.append([T.add(t, pr_f, gu, KIND_COMM, f"allgather {graph.names[u]} mb{k}", (gu, gu))])
                elif have == FULL and req == FSHARD and not latency and tpu > 1:
                    t = comm.coll("all_gather", _tp_groups(gu, dpu)[0], S / dpu)
                    bwd_chain.append([T.add(t, pr_b, gu, KIND_COMM, f"allgather grad {graph.names[u]} mb{k}", (gu, gu))])
            else:
                if have == PARTIAL:
                    t = comm.coll("all_reduce", _tp_groups(gu, dpu)[0], S / dpu)
                    fwd_chain.append([T.add(t, pr_f, gu, KIND_COMM, f"allreduce {graph.names[u]} mb{k}", (gu, gu))])
                elif have == FSHARD and tpu > 1:
                    t = comm.coll("all_gather", _tp_groups(gu, dpu)[0], S / dpu)
                    fwd_chain.append([T.add(t, pr_f, gu, KIND_COMM, f"allgather {graph.names[u]} mb{k}", (gu, gu))])
                moves = _redistribution(gu, dpu, gv, dpv, req, S)
                if moves:
                    step = []
                    back = []
                    for a, b, nb, trank in moves:
                        t = _edge_transfer_time(graph, comm, e0, a, b, nb, scale * (nb / S if S > 0 else 1.0))
                        step.append(T.add(t, pr_f, (a, b), KIND_COMM, f"send {graph.names[u]} {a}->{b} mb{k}",
                                          ((a,), (b,))))
                        if not latency and (req == FSHARD or trank == 0):
                            back.append(T.add(t, pr_b, (a, b), KIND_COMM, f"send grad {graph.names[u]} {b}->{a} mb{k}",
                                              ((b,), (a,))))
                    fwd_chain.append(step)
                    if back:
                        bwd_chain.append(back)
            if col_weighted and not latency and tpv > 1:
                # Megatron's "f": the input gradient of a column-split linear is a partial sum
                t = comm.coll("all_reduce", _tp_groups(gv, dpv)[0], S / dpv)
                bwd_chain.insert(0, [T.add(t, pr_b, gv, KIND_COMM, f"allreduce grad {graph.names[u]} mb{k}", (gv, gv))])
            # wire forward: F(u) -> steps -> F(v)
            prev = [int(F[u, k])]
            for step in fwd_chain:
                for a in prev:
                    for b in step:
                        T.dep(a, b)
                prev = step
            for v in consumers:
                for a in prev:
                    T.dep(a, int(F[v, k]))
            if latency:
                continue
            prev = [int(B[v, k]) for v in consumers]
            for step in bwd_chain:
                for a in prev:
                    for b in step:
                        T.dep(a, b)
                prev = step
            for a in prev:
                T.dep(a, int(B[u, k]))

    # data-parallel gradient all-reduce, bucketed in backward order, per (group, dp) replica set
    opt_deps: dict[int, list[int]] = {d: [] for d in range(nd)}
    pbytes = DTYPE_BYTES.get(graph.dtype, 2)
    if not latency:
        by_group: dict[tuple, list[int]] = {}
        for v in np.argsort(-topo_pos, kind="stable"):
            v = int(v)
            if graph.param_bytes[v] > 0 and plan.dp[v] > 1:
                by_group.setdefault((plan.groups[v], int(plan.dp[v]), _tp_divisor(plan.layouts[v])), []).append(v)
        for (g, dp, split), nodes in by_group.items():
            tp = len(g) // dp
            bucket: list[int] = []
            size = 0.0

            def flush(bucket=None, size=0.0, g=g, dp=dp):
                if not bucket:
                    return
                t = comm.coll("all_reduce", _dp_groups(g, dp)[0], size)
                last = bucket[-1]
                tid = T.add(t, prio(last, m - 1, True) + 0.5, g, KIND_COMM,
                            f"grad allreduce {graph.names[bucket[0]]}..({len(bucket)})", (g, g))
                for v in bucket:
                    T.dep(int(B[v, m - 1]), tid)
                for d in g:
                    opt_deps[d].append(tid)

            for v in nodes:
                gb = graph.param_bytes[v] / (tp if split else 1)
                bucket.append(v)
                size += gb
                if size >= DDP_BUCKET_BYTES:
                    flush(bucket, size)
                    bucket, size = [], 0.0
            flush(bucket, size)
        # optimizer update: memory-bound pass over the model states (read + write)
        params_dev = np.zeros(nd)
        for v in range(n):
            g, lay = plan.groups[v], plan.layouts[v]
            dp = int(plan.dp[v])
            split = (len(g) // dp) if _tp_divisor(lay) else 1
            for d in g:
                params_dev[d] += graph.param_bytes[v] / pbytes / split
        last_b: dict[int, list[int]] = {d: [] for d in range(nd)}
        for v in range(n):
            for d in plan.groups[v]:
                last_b[d].append(int(B[v, m - 1]))
        for d in range(nd):
            if params_dev[d] <= 0:
                continue
            dev = topology.devices[d]
            # Adam is memory-bound: one read and one write of all model states (ZeRO, SC'20, Sec. 3)
            t = 2 * params_dev[d] * plan.state_bytes_per_param / dev.bandwidth() + dev.launch_overhead
            tid = T.add(t, 1e300, (d,), KIND_OPT, f"optimizer {dev.name}")
            for a in opt_deps[d] + last_b[d]:
                T.dep(a, tid)

    # ---------------------------------------------------------------- schedule
    nt = len(T.dur)
    dur = np.asarray(T.dur)
    pri = np.asarray(T.prio)
    res_counts = np.fromiter((len(r) for r in T.res), dtype=np.int64, count=nt)
    res_ptr = np.zeros(nt + 1, dtype=np.int64)
    np.cumsum(res_counts, out=res_ptr[1:])
    res_idx = np.fromiter((x for r in T.res for x in r), dtype=np.int64, count=int(res_ptr[-1]))
    src = np.asarray(T.src, dtype=np.int64)
    dst = np.asarray(T.dst, dtype=np.int64)
    succ_ptr, succ_idx = to_csr(src, dst, nt)
    n_pred = np.bincount(dst, minlength=nt).astype(np.int64)
    start, finish, done = list_schedule(dur, pri, res_ptr, res_idx, succ_ptr, succ_idx, n_pred, 3 * nd)
    if done != nt:  # pragma: no cover - would be a bug in the task graph
        raise RuntimeError(f"simulator deadlock: scheduled {done} of {nt} tasks")
    makespan = float(finish.max()) if nt else 0.0

    dev_counts = np.fromiter((len(x) for x in T.devs), dtype=np.int64, count=nt)
    dev_ptr = np.zeros(nt + 1, dtype=np.int64)
    np.cumsum(dev_counts, out=dev_ptr[1:])
    dev_idx = np.fromiter((x for r in T.devs for x in r), dtype=np.int64, count=int(dev_ptr[-1]))
    kinds = np.asarray(T.kind, dtype=np.int64)
    owner = np.repeat(np.arange(nt), dev_counts)
    dur_rep = dur[owner]
    kind_rep = kinds[owner]
    compute = np.bincount(dev_idx, weights=dur_rep * (kind_rep != KIND_COMM), minlength=nd)
    commt = np.bincount(dev_idx, weights=dur_rep * (kind_rep == KIND_COMM), minlength=nd)
    mem = memory(graph, topology, plan, stage, p, objective)
    total = mem["total"]
    oom = [int(d) for d in np.flatnonzero(total > mem["capacity"])]
    return StepReport(
        objective=objective, step_time=makespan, makespan=makespan, compute_time=compute, comm_time=commt,
        idle_time=np.maximum(makespan - compute, 0.0), peak_memory=total, memory_capacity=mem["capacity"],
        oom=oom, memory_breakdown=mem, task_start=start if want_timeline else None,
        task_finish=finish if want_timeline else None, task_device_ptr=dev_ptr if want_timeline else None,
        task_devices=dev_idx if want_timeline else None, task_kind=kinds if want_timeline else None,
        task_label=T.label if want_timeline else None, device_names=[d.name for d in topology.devices],
        num_tasks=nt, fast_path="reference",
    )


def _throughput(graph: OpGraph, topology: Topology, plan: Plan) -> StepReport:
    """Steady-state time per microbatch: max over devices of per-microbatch compute + communication.

    A producer u whose tensor goes to other devices adds its transfer time once to its own device and
    once to each other device that consumes it (Tarnawski et al., NeurIPS 2020, "max-load"); devices
    with ``pays_comm=False`` (host CPUs in that model) pay no communication. Collectives add their
    time to every member; the gradient all-reduce and optimizer are amortised over the microbatches."""
    nd = topology.num_devices
    n = graph.num_nodes
    m = plan.microbatches
    scale = plan.microbatch_size(graph) / graph.batch_size
    stage, p = plan.stages(graph)
    fwd_t, bwd_t = node_times(graph, topology, plan, scale)
    comm = _Comm(topology, graph)
    load_c = np.zeros(nd)
    load_m = np.zeros(nd)
    for v in range(n):
        for d in set(plan.groups[v]):
            load_c[d] += fwd_t[v] + bwd_t[v]
    pays = np.array([d.pays_comm for d in topology.devices])
    # point-to-point: per producer, the set of other devices that consume it
    recv: dict[int, dict[int, float]] = {}
    for e in range(graph.num_edges):
        u, v = int(graph.edge_src[e]), int(graph.edge_dst[e])
        gu, gv = plan.groups[u], plan.groups[v]
        if set(gv) <= set(gu):
            continue
        S = graph.edge_bytes[e] * scale
        for c in gv:
            if c in gu:
                continue
            if graph.edge_time is not None:
                t = float(graph.edge_time[e]) * scale
            else:
                t = min(comm.p2p(a, c, S / len(gv)) for a in gu)
            r = recv.setdefault(u, {})
            r[c] = max(r.get(c, 0.0), t)
    for u, r in recv.items():
        send = max(r.values())
        for a in set(plan.groups[u]):
            if pays[a]:
                load_m[a] += send
        for c, t in r.items():
            if pays[c]:
                load_m[c] += t
    # re-layout and gradient collectives
    for v in range(n):
        g, lay, dp = plan.groups[v], plan.layouts[v], int(plan.dp[v])
        tp = len(g) // dp
        if lay == "row_split" and tp > 1:
            t = comm.coll("all_reduce", _tp_groups(g, dp)[0], graph.out_bytes[v] * scale / dp)
            for d in g:
                load_m[d] += t * pays[d]
        if lay == "col_split" and graph.param_bytes[v] > 0 and tp > 1:
            ins = graph.edge_bytes[graph.edge_dst == v].sum() * scale / dp
            t = comm.coll("all_reduce", _tp_groups(g, dp)[0], ins)
            for d in g:
                load_m[d] += t * pays[d]
        if graph.param_bytes[v] > 0 and dp > 1:
            t = comm.coll("all_reduce", _dp_groups(g, dp)[0], graph.param_bytes[v] / (tp if _tp_divisor(lay) else 1))
            for d in g:
                load_m[d] += t / m * pays[d]
    load = load_c + load_m
    value = float(load.max()) if nd else 0.0
    mem = memory(graph, topology, plan, stage, p, "step_time")
    total = mem["total"]
    oom = [int(d) for d in np.flatnonzero(total > mem["capacity"])]
    return StepReport(objective="throughput", step_time=value, makespan=value * (m + p - 1), compute_time=load_c,
                      comm_time=load_m, idle_time=np.maximum(value - load, 0.0), peak_memory=total,
                      memory_capacity=mem["capacity"], oom=oom, memory_breakdown=mem,
                      device_names=[d.name for d in topology.devices])


# the compiled evaluator (one graph, many plans; delta evaluation) and the stage-level fast path
from envs.fast_sim import FAST_PATH_TASKS, Simulator, simulator_for  # noqa: E402, F401
