"""The reference task-graph builder: the specification of a simulated training step, one task at a time.

:func:`simulate_reference` builds the step's task graph in plain Python and list-schedules it:

1. compute tasks: forward and backward of every node for every microbatch; a node on a device group
   runs SPMD on all devices of its group at once (one task holding every member's compute engine);
2. pipeline constraints: GPipe runs all forwards then all backwards (flush); 1F1B keeps at most
   ``p - s`` microbatches in flight on stage ``s`` (Narayanan et al., PipeDream-Flush, ICML'21) and
   prefers backward work;
3. edge-group communication: the transfers and re-layout collectives between a producer's and its
   consumers' layouts (:func:`envs.sim.cost.layout_crossing`), each gradient flowing back along the
   mirrored transfer;
4. ZeRO-3 parameter all-gathers: before each forward and each backward of a node whose weights are
   sharded, prefetched one node ahead (FSDP's and DeepSpeed's prefetch: the gather of a node may start
   when the node two before it has finished);
5. gradient buckets: data-parallel gradient all-reduce in 25 MB buckets (PyTorch DDP's default
   ``bucket_cap_mb``), each starting when its last gradient is ready, so it overlaps the backward;
   a reduce-scatter instead under ZeRO (stage 1 once per step, like Megatron-LM's distributed
   optimizer; stages 2-3 after every microbatch, the gradients being sharded); sequence-parallel
   weights (LayerNorm) all-reduced over the whole tensor x data group;
6. expert parallelism: per expert-parallel layer and microbatch the all-to-all that dispatches the
   tokens to the experts' devices and the one that combines the outputs back (and their gradients'
   reverse all-to-alls; the dispatch again in the backward when the experts are recomputed); each
   expert runs on its EP rank of every EP group (:func:`envs.sim.cost.expert_hosts`);
7. the optimizer update per device after its gradients are synchronised (over its shard under ZeRO);
   under ZeRO-1/2 the updated weights all-gathered after it, per bucket (ZeRO's 2x all-reduce volume
   in total: reduce-scatter + all-gather; Rajbhandari et al., SC'20, Sec. 7);
8. the list schedule on device resources, and the report.

Interleaved 1F1B (``virtual_stages`` v > 1): each device runs its v model chunks p microbatches at a
time, in Megatron-LM's program order (megatron/core/pipeline_parallel/schedules.py,
forward_backward_pipelining_with_interleaving; Narayanan et al., SC'21, Sec. 2.2): on pipeline rank r,
W = (p - r - 1) x 2 + (v - 1) x p warm-up forwards, then the forward of chunk-microbatch W + i before
the backward of chunk-microbatch i, then the cool-down backwards. Priorities are that order, and the
forward of the j-th chunk-microbatch waits for the backward of the (j - W - 1)-th (at most W + 1
chunk-microbatches in flight, as in Megatron-LM). Pipeline transfers do not block the hosts
(``--overlap-p2p-communication``: sends and receives are posted asynchronously).

Link contention: every device has one send port and one receive port, each exclusive (a transfer
holds the sender's send port and the receiver's receive port; a collective holds both ports of every
member). Compute and communication overlap freely.

The compiled builder (:mod:`envs.sim.compiled`) reproduces this task graph exactly (same tasks in the
same order, same durations, priorities and dependencies); tests compare the two bit for bit. This
module imports only :mod:`envs.sim.cost` and :mod:`envs.sim.schedule` (and envs.graph/plan/topology).
"""

from __future__ import annotations

import numpy as np

from envs.graph import OpGraph
from envs.plan import DTYPE_BYTES, Plan
from envs.sim.cost import (
    DDP_BUCKET_BYTES,
    KIND_COMM,
    KIND_COMPUTE,
    KIND_OPT,
    LAYOUT_CODE,
    CommTimes,
    StepReport,
    column_weighted,
    dp_groups,
    expert_exchanges,
    expert_hosts,
    is_tensor_split,
    layout_crossing,
    memory,
    node_times,
    optimizer_time,
    produced_state,
    required_state,
)
from envs.sim.schedule import busy_times, schedule, to_csr
from envs.topology import Topology


def simulate_reference(graph: OpGraph, topology: Topology, plan: Plan, objective: str = "step_time", *,
                       timeline: bool = True) -> StepReport:
    """StepReport of ``plan`` (objective ``step_time`` or ``latency``) from the reference builder; the
    plan is not validated. Kept as the specification (for tests and debugging): ``simulate`` runs the
    compiled builder, which gives the same report."""
    step = _Step(graph, topology, plan, objective)
    tasks = _TaskGraph(topology.num_devices)
    F, B = _compute_tasks(step, tasks)
    if not step.latency:
        _pipeline_constraints(step, tasks, F, B)
    _edge_group_communication(step, tasks, F, B)
    _expert_all_to_alls(step, tasks, F, B)
    if not step.latency:
        _zero3_gathers(step, tasks, F, B)
        grad_syncs, gathers = _gradient_buckets(step, tasks, B)
        optimizers = _optimizer_updates(step, tasks, B, grad_syncs)
        _parameter_gathers(step, tasks, gathers, optimizers)
    return _schedule_and_report(step, tasks, timeline)


class _Step:
    """What every part of the builder reads: the plan's per-microbatch quantities and priorities."""

    def __init__(self, graph: OpGraph, topology: Topology, plan: Plan, objective: str):
        self.graph, self.topology, self.plan, self.objective = graph, topology, plan, objective
        self.nd = topology.num_devices
        self.n = n = graph.num_nodes
        self.latency = latency = objective == "latency"
        self.m = 1 if latency else plan.microbatches
        self.scale = (1.0 / graph.batch_size) if latency else plan.microbatch_size(graph) / graph.batch_size
        self.stage, self.p = plan.stages(graph)
        self.topo_pos = np.empty(n, dtype=np.int64)
        self.topo_pos[graph.topological_order()] = np.arange(n)
        self.fwd, self.bwd, self.host_fwd, self.host_bwd, _ = node_times(graph, topology, plan, self.scale, latency)
        self.comm = CommTimes(topology)
        self.hosts = expert_hosts(graph, plan)  # who computes each node (its group unless an expert under EP)
        self.gpipe = plan.schedule == "gpipe"
        self._N = float(n + 1)
        self.V = 1 if latency else int(plan.virtual_stages)
        self.local_chunk = plan.chunks(graph)[0] // self.p if self.V > 1 else None

    def seq(self, v: int, k: int, backward: bool) -> int:
        """Position of node v's chunk-microbatch k in its device's forward (backward) sequence under
        interleaving: p microbatches of chunk 0, of chunk 1, ... (backward: the last chunk first)."""
        p, V, c = self.p, self.V, int(self.local_chunk[v])
        return (k // p) * p * V + ((V - 1 - c) if backward else c) * p + k % p

    def prio(self, v: int, k: int, backward: bool) -> float:
        """Priority of node v's forward / backward of microbatch k: GPipe all forwards (microbatch-major,
        topological order) then all backwards; 1F1B microbatch-major, backward before forward; interleaved
        1F1B by the device's program order (:meth:`order`), topological within a chunk."""
        N, m, pos = self._N, self.m, self.topo_pos[v]
        if self.gpipe:
            return (m * N + k * N + (N - 1 - pos)) if backward else (k * N + pos)
        if self.V > 1:
            return self.order(v, k, backward) * N + ((N - 1 - pos) if backward else pos)
        return k * 2 * N + ((N - 1 - pos) if backward else (N + pos))

    def order(self, v: int, k: int, backward: bool) -> int:
        """Place of node v's chunk-microbatch k in its pipeline rank r's program under interleaved 1F1B
        (Megatron-LM, megatron/core/pipeline_parallel/schedules.py, forward_backward_pipelining_with_
        interleaving): W = min((p - r - 1) x 2 + (v - 1) x p, m v) warm-up forwards, then forward W + i
        before backward i, then the cool-down backwards."""
        r = int(self.stage[v])
        total = self.m * self.V
        W = min((self.p - r - 1) * 2 + (self.V - 1) * self.p, total)
        j = self.seq(v, k, backward)
        if backward:
            return W + 2 * j + 1 if j < total - W else total + j
        return j if j < W else 2 * j - W


class _TaskGraph:
    """Tasks (duration, priority, resources, devices, kind, label) and dependencies, one at a time.
    Resources: device d's compute engine is d, its send port nd + d, its receive port 2 nd + d."""

    def __init__(self, nd: int):
        self.nd = nd
        self.dur: list[float] = []
        self.prio: list[float] = []
        self.res: list[tuple[int, ...]] = []
        self.devs: list[tuple[int, ...]] = []
        self.kind: list[int] = []
        self.label: list[str] = []
        self.host: list[float] = []
        self.sync: list[bool] = []
        self.src: list[int] = []
        self.dst: list[int] = []

    def add(self, dur, prio, devices, kind, label, comm_ports=None, host=0.0, sync=False) -> int:
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
        self.host.append(float(host))
        self.sync.append(bool(sync))
        return len(self.dur) - 1

    def dep(self, a: int, b: int) -> None:
        self.src.append(a)
        self.dst.append(b)

    def chain(self, first: list[int], steps: list[list[int]], last: list[int]) -> None:
        """Every task of each step after every task of the step before: first -> steps -> last."""
        prev = first
        for step in steps + [last]:
            for a in prev:
                for b in step:
                    self.dep(a, b)
            prev = step


def _compute_tasks(s: _Step, T: _TaskGraph) -> tuple[np.ndarray, np.ndarray | None]:
    """F(v, k) and B(v, k) for every node and microbatch (node-major), B after F."""
    n, m = s.n, s.m
    F = np.empty((n, m), dtype=np.int64)
    B = np.empty((n, m), dtype=np.int64) if not s.latency else None
    for v in range(n):
        g = s.hosts[v]
        name = s.graph.names[v]
        for k in range(m):
            F[v, k] = T.add(s.fwd[v], s.prio(v, k, False), g, KIND_COMPUTE, f"F {name} mb{k}", host=s.host_fwd[v])
            if not s.latency:
                B[v, k] = T.add(s.bwd[v], s.prio(v, k, True), g, KIND_COMPUTE, f"B {name} mb{k}", host=s.host_bwd[v])
                T.dep(F[v, k], B[v, k])
    return F, B


def _pipeline_constraints(s: _Step, T: _TaskGraph, F: np.ndarray, B: np.ndarray) -> None:
    """GPipe: no backward before the last forward. 1F1B: on stage s the forward of microbatch k waits
    for the backward of microbatch k - (p - s)."""
    m = s.m
    if m <= 1:
        return
    if s.V > 1:
        _interleaved_constraints(s, T, F, B)
        return
    for v in range(s.n):
        if s.gpipe:
            for k in range(m):
                T.dep(F[v, m - 1], B[v, k])
        else:
            w = s.p - int(s.stage[v])
            for k in range(w, m):
                T.dep(B[v, k - w], F[v, k])


def _interleaved_constraints(s: _Step, T: _TaskGraph, F: np.ndarray, B: np.ndarray) -> None:
    """Interleaved 1F1B: on pipeline rank r the forward of its j-th chunk-microbatch waits for the
    backward of its (j - w)-th, w = (p - r - 1) x 2 + (v - 1) x p + 1 (Megatron-LM runs the forward of
    W + i = w - 1 + i after the backward of i - 1: :meth:`_Step.order`); a backward of the same chunk
    is the node's own, of another chunk that chunk's first node's (its backward's end)."""
    p, V, m = s.p, s.V, s.m
    chunk = s.plan.chunks(s.graph)[0]
    first_of: dict[int, int] = {}
    for v in s.graph.topological_order().tolist():
        first_of.setdefault(int(chunk[v]), v)
    for v in range(s.n):
        r = int(s.stage[v])
        w = (p - r - 1) * 2 + (V - 1) * p + 1
        for k in range(m):
            j = s.seq(v, k, False) - w
            if j < 0:
                continue
            blk, rest = divmod(j, p * V)
            c_local, kk = V - 1 - rest // p, blk * p + rest % p
            c = c_local * p + r
            u = v if c == int(chunk[v]) else first_of[c]
            T.dep(B[u, kk], F[v, k])


def _edge_groups(graph: OpGraph, plan: Plan) -> dict[tuple, list[tuple[int, int]]]:
    """Edges grouped by (producer, consumer group, consumer dp, required state, column-weighted), in
    order of first edge: the consumers of one group share the producer's communication."""
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for e in range(graph.num_edges):
        u, v = int(graph.edge_src[e]), int(graph.edge_dst[e])
        code, has_params = LAYOUT_CODE[plan.layouts[v]], graph.param_bytes[v] > 0
        key = (u, plan.groups[v], int(plan.dp[v]), required_state(code, has_params, graph.kinds[v] == "embedding"),
               column_weighted(code, has_params))
        groups.setdefault(key, []).append((e, v))
    return groups


def _edge_group_communication(s: _Step, T: _TaskGraph, F: np.ndarray, B: np.ndarray | None) -> None:
    """Per edge group and microbatch: the crossing's tasks, wired F(u) -> forward steps -> F(consumers)
    and B(consumers) -> backward steps -> B(u)."""
    graph, plan = s.graph, s.plan
    for (u, gv, dpv, req, col_weighted), members in _edge_groups(graph, plan).items():
        e0 = members[0][0]
        S = float(graph.edge_bytes[[e for e, _ in members]].max()) * s.scale
        edge_time = float(graph.edge_time[e0]) if graph.edge_time is not None else None
        crossing = layout_crossing(s.comm, plan.groups[u], int(plan.dp[u]), produced_state(LAYOUT_CODE[plan.layouts[u]]),
                                   gv, int(dpv), req, col_weighted, S, edge_time, s.latency, s.scale,
                                   bool(plan.recompute[u]), blocking_transfers=s.V == 1)
        consumers = [v for _, v in members]
        name = graph.names[u]
        for k in range(s.m):
            pr_f = min(s.prio(v, k, False) for v in consumers)
            pr_b = s.prio(u, k, True) if not s.latency else 0.0
            ids = [T.add(t.duration, pr_b if t.backward else pr_f, t.devices, KIND_COMM, t.label.format(u=name, k=k),
                         t.ports, t.host, t.sync) for t in crossing.tasks]
            T.chain([int(F[u, k])], [[ids[j] for j in step] for step in crossing.forward],
                    [int(F[v, k]) for v in consumers])
            if not s.latency:
                T.chain([int(B[v, k]) for v in consumers], [[ids[j] for j in step] for step in crossing.backward],
                        [int(B[u, k])])


def _expert_all_to_alls(s: _Step, T: _TaskGraph, F: np.ndarray, B: np.ndarray | None) -> None:
    """Per expert-parallel layer, exchange and microbatch: the all-to-all in every EP group of the
    experts' group at once (one task on all its ports), after its producers' forwards and before its
    consumers'; its gradient's all-to-all after the consumers' backwards and before the producers'.
    A recomputed layer dispatches again in the backward, before the experts' backwards (Megatron-LM and
    DeepSpeed re-run the layer's forward, its all-to-alls included)."""
    for ex in expert_exchanges(s.graph, s.plan):
        t = s.comm.collective("all_to_all", ex.ep_group, ex.nbytes * s.scale)
        host, _ = s.comm.host(tuple(sorted(ex.group)), transfer=False)
        g = ex.group
        for k in range(s.m):
            pr_f = min(s.prio(v, k, False) for v in ex.consumers)
            a = T.add(t, pr_f, g, KIND_COMM, f"alltoall {ex.label} mb{k}", (g, g), host)
            for u in ex.producers:
                T.dep(int(F[u, k]), a)
            for v in ex.consumers:
                T.dep(a, int(F[v, k]))
            if s.latency:
                continue
            pr_b = min(s.prio(u, k, True) for u in ex.producers)
            b = T.add(t, pr_b, g, KIND_COMM, f"alltoall grad {ex.label} mb{k}", (g, g), host)
            for v in ex.consumers:
                T.dep(int(B[v, k]), b)
            for u in ex.producers:
                T.dep(b, int(B[u, k]))
            if ex.replay:
                pr_r = min(s.prio(v, k, True) for v in ex.consumers)
                r = T.add(t, pr_r, g, KIND_COMM, f"re-alltoall {ex.label} mb{k}", (g, g), host)
                for u in ex.producers:
                    T.dep(int(F[u, k]), r)
                for v in ex.consumers:
                    T.dep(r, int(B[v, k]))


def _ddp_buckets(nodes: list[int], nbytes: list[float]):
    """(bucket, bytes): nodes in order, a bucket closed once it holds DDP_BUCKET_BYTES or more."""
    bucket: list[int] = []
    size = 0.0
    for v, b in zip(nodes, nbytes):
        bucket.append(v)
        size += b
        if size >= DDP_BUCKET_BYTES:
            yield bucket, size
            bucket, size = [], 0.0
    if bucket:
        yield bucket, size


def _zero3_gathers(s: _Step, T: _TaskGraph, F: np.ndarray, B: np.ndarray) -> None:
    """ZeRO-3: the weights of a sharded node are all-gathered over its data-parallel group before its
    forward and again before its backward of every microbatch (3x the parameters' volume per step with
    the gradients' reduce-scatter, 1.5x data parallelism's; Rajbhandari et al., SC'20, Sec. 7), prefetched
    one node ahead: the gather waits for the compute of the sharded node two before it on the group."""
    graph, plan = s.graph, s.plan
    order = [int(v) for v in graph.topological_order()
             if plan.zero[v] >= 3 and plan.replicas(v) > 1 and graph.param_bytes[v] > 0]
    if not order:
        return
    by_group: dict[tuple, list[int]] = {}
    for v in order:
        by_group.setdefault(s.hosts[v], []).append(v)
    for v in order:
        g, dp = s.hosts[v], int(plan.dp[v])
        split = (len(g) // dp) if is_tensor_split(plan.layouts[v]) else 1
        members = dp_groups(g, dp)[0] if plan.ep[v] <= 1 else g
        t = s.comm.collective("all_gather", members, graph.param_bytes[v] / split)
        host, _ = s.comm.host(tuple(sorted(set(g))), transfer=False)
        nodes = by_group[g]
        i = nodes.index(v)
        name = graph.names[v]
        for k in range(s.m):
            af = T.add(t, s.prio(v, k, False) - 0.5, g, KIND_COMM, f"allgather params {name} mb{k}", (g, g), host)
            T.dep(af, int(F[v, k]))
            if i >= 2:
                T.dep(int(F[nodes[i - 2], k]), af)
            ab = T.add(t, s.prio(v, k, True) - 0.5, g, KIND_COMM, f"allgather params grad {name} mb{k}", (g, g), host)
            T.dep(int(F[v, k]), ab)
            T.dep(ab, int(B[v, k]))
            if len(nodes) - 1 - i >= 2:
                T.dep(int(B[nodes[i + 2], k]), ab)


def _gradient_buckets(s: _Step, T: _TaskGraph, B: np.ndarray) -> tuple[dict[int, list[int]], list]:
    """Data-parallel gradient synchronisation, bucketed in backward order per replica set (group, dp,
    tensor split, ZeRO stage, sequence split): an all-reduce (ZeRO 0) or a reduce-scatter (ZeRO >= 1)
    over the data-parallel group (the whole group for sequence-split weights), after the last-microbatch
    backward of its nodes (ZeRO 2-3: one per microbatch, after that microbatch's backward). Returns each
    device's synchronisation tasks and the ZeRO-1/2 buckets whose weights are all-gathered after the
    optimizer: (group, dp group, bytes, first node, size)."""
    graph, plan, m = s.graph, s.plan, s.m
    replica_sets: dict[tuple, list[int]] = {}
    for v in np.argsort(-s.topo_pos, kind="stable"):
        v = int(v)
        seq = plan.layouts[v] == "seq_split"
        if graph.param_bytes[v] > 0 and (plan.replicas(v) > 1 or seq):
            key = (s.hosts[v], int(plan.dp[v]) // int(plan.ep[v]), is_tensor_split(plan.layouts[v]),
                   int(plan.zero[v]), seq)
            replica_sets.setdefault(key, []).append(v)
    syncs: dict[int, list[int]] = {d: [] for d in range(s.nd)}
    gathers: list = []
    for (g, dp, split, zero, seq), nodes in replica_sets.items():
        tp = len(g) // dp
        grads = [graph.param_bytes[v] / (tp if split else 1) for v in nodes]
        members = g if seq else dp_groups(g, dp)[0]
        kind = "reduce_scatter" if zero >= 1 and dp > 1 and not seq else "all_reduce"
        what = "grad reducescatter" if kind == "reduce_scatter" else "grad allreduce"
        for bucket, size in _ddp_buckets(nodes, grads):
            t = s.comm.collective(kind, members, size)
            host, _ = s.comm.host(tuple(sorted(set(g))), transfer=False)
            label = f"{what} {graph.names[bucket[0]]}..({len(bucket)})"
            for k in (range(m) if zero >= 2 and not seq else (m - 1,)):
                tid = T.add(t, s.prio(bucket[-1], k, True) + 0.5, g, KIND_COMM, label, (g, g), host)
                for v in bucket:
                    T.dep(int(B[v, k]), tid)
                for d in g:
                    syncs[d].append(tid)
            if zero in (1, 2) and dp > 1 and not seq:
                gathers.append((g, members, size, bucket[0], len(bucket)))
    return syncs, gathers


def _optimizer_updates(s: _Step, T: _TaskGraph, B: np.ndarray, grad_syncs: dict[int, list[int]]) -> dict[int, int]:
    """One optimizer task per device holding parameters (a memory-bound pass over its model states, its
    1/dp shard of them under ZeRO), after its gradient synchronisation and the last backward of each of
    its nodes. Returns each device's optimizer task."""
    graph, plan, topology, nd, m = s.graph, s.plan, s.topology, s.nd, s.m
    pbytes = DTYPE_BYTES.get(graph.dtype, 2)
    params_dev = np.zeros(nd)
    for v in range(s.n):
        g, lay = plan.groups[v], plan.layouts[v]
        dp = int(plan.dp[v])
        split = (len(g) // dp) if is_tensor_split(lay) else 1
        shard = plan.replicas(v) if plan.zero[v] >= 1 else 1
        for d in s.hosts[v]:
            params_dev[d] += graph.param_bytes[v] / pbytes / split / shard
    last_b: dict[int, list[int]] = {d: [] for d in range(nd)}
    for v in range(s.n):
        for d in s.hosts[v]:
            last_b[d].append(int(B[v, m - 1]))
    out: dict[int, int] = {}
    for d in range(nd):
        if params_dev[d] <= 0:
            continue
        dev = topology.devices[d]
        t = optimizer_time(params_dev[d], plan.state_bytes_per_param, dev.bandwidth(), dev.launch_overhead)
        tid = T.add(t, 1e300, (d,), KIND_OPT, f"optimizer {dev.name}")
        out[d] = tid
        for a in grad_syncs[d] + last_b[d]:
            T.dep(a, tid)
    return out


def _parameter_gathers(s: _Step, T: _TaskGraph, gathers: list, optimizers: dict[int, int]) -> None:
    """ZeRO-1/2: each bucket's updated weight shards all-gathered over its data-parallel group after
    the optimizers of the group's devices (Megatron-LM's distributed optimizer)."""
    for g, members, size, first, count in gathers:
        t = s.comm.collective("all_gather", members, size)
        host, _ = s.comm.host(tuple(sorted(set(g))), transfer=False)
        tid = T.add(t, 1e300, g, KIND_COMM, f"param allgather {s.graph.names[first]}..({count})", (g, g), host)
        for d in g:
            if d in optimizers:
                T.dep(optimizers[d], tid)


def _csr(lists: list[tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    counts = np.fromiter((len(r) for r in lists), dtype=np.int64, count=len(lists))
    ptr = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum(counts, out=ptr[1:])
    idx = np.fromiter((x for r in lists for x in r), dtype=np.int64, count=int(ptr[-1]))
    return counts, ptr, idx


def _schedule_and_report(s: _Step, T: _TaskGraph, want_timeline: bool) -> StepReport:
    """List-schedule the tasks on 3 resources per device; busy times, memory and the report."""
    nd, topology = s.nd, s.topology
    nt = len(T.dur)
    dur = np.asarray(T.dur)
    pri = np.asarray(T.prio)
    _, res_ptr, res_idx = _csr(T.res)
    src = np.asarray(T.src, dtype=np.int64)
    dst = np.asarray(T.dst, dtype=np.int64)
    succ_ptr, succ_idx = to_csr(src, dst, nt)
    n_pred = np.bincount(dst, minlength=nt).astype(np.int64)
    _, dev_ptr, dev_idx = _csr(T.devs)
    start, finish, done = schedule(dur, pri, res_ptr, res_idx, succ_ptr, succ_idx, n_pred, 3 * nd,
                                   np.asarray(T.host), np.asarray(T.sync, dtype=bool), dev_ptr, dev_idx, nd)
    if done != nt:  # pragma: no cover - would be a bug in the task graph
        raise RuntimeError(f"simulator deadlock: scheduled {done} of {nt} tasks")
    makespan = float(finish.max()) if nt else 0.0

    kinds = np.asarray(T.kind, dtype=np.int64)
    compute, commt = busy_times(dur, kinds, dev_ptr, dev_idx, nd, KIND_COMM)
    mem = memory(s.graph, topology, s.plan, s.stage, s.p, s.objective)
    total = mem["total"]
    oom = [int(d) for d in np.flatnonzero(total > mem["capacity"])]
    tl = want_timeline
    return StepReport(
        objective=s.objective, value=makespan, makespan=makespan, compute_time=compute, comm_time=commt,
        idle_time=np.maximum(makespan - compute, 0.0), peak_memory=total, memory_capacity=mem["capacity"],
        oom=oom, memory_breakdown=mem, task_start=start if tl else None, task_finish=finish if tl else None,
        task_device_ptr=dev_ptr if tl else None, task_devices=dev_idx if tl else None,
        task_kind=kinds if tl else None, task_label=T.label if tl else None,
        device_names=[d.name for d in topology.devices], num_tasks=nt, fast_path="reference",
    )
