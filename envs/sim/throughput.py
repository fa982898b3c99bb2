"""The throughput objective: steady-state time per global batch, from the busiest device's load per
microbatch times the number of microbatches (no schedule).

Imports only :mod:`envs.sim.cost` (and envs.graph/plan/topology).
"""

from __future__ import annotations

import numpy as np

from envs.graph import OpGraph
from envs.plan import Plan
from envs.sim.cost import (
    CommTimes,
    StepReport,
    dp_groups,
    expert_exchanges,
    expert_hosts,
    is_tensor_split,
    memory,
    node_times,
    tp_groups,
)
from envs.topology import Topology


def simulate_throughput(graph: OpGraph, topology: Topology, plan: Plan) -> StepReport:
    """Steady-state time per global batch: the number of microbatches times the busiest device's
    per-microbatch compute + communication (with one microbatch, as in the dnn-partitioning workloads,
    the max-load itself).

    A producer u whose tensor goes to other devices adds its transfer time once to its own device and
    once to each other device that consumes it (Tarnawski et al., NeurIPS 2020, "max-load"); devices
    with ``pays_comm=False`` (host CPUs in that model) pay no communication. Collectives add their
    time to every member; the gradient all-reduce and optimizer are amortised over the microbatches."""
    nd = topology.num_devices
    m = plan.microbatches
    scale = plan.microbatch_size(graph) / graph.batch_size
    stage, p = plan.stages(graph)
    fwd_t, bwd_t = node_times(graph, topology, plan, scale)[:2]
    comm = CommTimes(topology)
    load_c = np.zeros(nd)
    hosts = expert_hosts(graph, plan)
    for v in range(graph.num_nodes):
        for d in set(hosts[v]):
            load_c[d] += fwd_t[v] + bwd_t[v]
    pays = np.array([d.pays_comm for d in topology.devices])
    load_m = np.zeros(nd)
    _transfer_load(graph, plan, comm, scale, pays, load_m)
    _collective_load(graph, plan, comm, scale, pays, load_m)
    load = (load_c + load_m) * m  # per global batch
    per_mb = float(load.max()) / m if nd else 0.0
    value = per_mb * m
    mem = memory(graph, topology, plan, stage, p, "step_time")
    total = mem["total"]
    oom = [int(d) for d in np.flatnonzero(total > mem["capacity"])]
    return StepReport(objective="throughput", value=value, makespan=per_mb * (m + p - 1), compute_time=load_c * m,
                      comm_time=load_m * m, idle_time=np.maximum(value - load, 0.0), peak_memory=total,
                      memory_capacity=mem["capacity"], oom=oom, memory_breakdown=mem,
                      device_names=[d.name for d in topology.devices])


def _transfer_load(graph: OpGraph, plan: Plan, comm: CommTimes, scale: float, pays: np.ndarray,
                   load_m: np.ndarray) -> None:
    """Point-to-point: per producer, the set of other devices that consume it; the producer's devices
    pay its slowest transfer, each consumer device its own."""
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


def _collective_load(graph: OpGraph, plan: Plan, comm: CommTimes, scale: float, pays: np.ndarray,
                     load_m: np.ndarray) -> None:
    """Re-layout collectives per microbatch (row-split outputs all-reduced forward, column-split
    linears' input gradients backward) and the gradient all-reduce amortised over the microbatches."""
    m = plan.microbatches
    for ex in expert_exchanges(graph, plan):  # dispatch / combine all-to-all and its gradient's
        t = 2 * comm.collective("all_to_all", ex.ep_group, ex.nbytes * scale)
        for d in ex.group:
            load_m[d] += t * pays[d]
    hosts = expert_hosts(graph, plan)
    for v in range(graph.num_nodes):
        if plan.ep[v] > 1:
            if graph.param_bytes[v] > 0 and plan.replicas(v) > 1:
                t = comm.collective("all_reduce", hosts[v], graph.param_bytes[v])
                for d in hosts[v]:
                    load_m[d] += t / m * pays[d]
            continue
        g, lay, dp = plan.groups[v], plan.layouts[v], int(plan.dp[v])
        tp = len(g) // dp
        if lay == "row_split" and tp > 1:
            t = comm.collective("all_reduce", tp_groups(g, dp)[0], graph.out_bytes[v] * scale / dp)
            for d in g:
                load_m[d] += t * pays[d]
        if lay == "col_split" and graph.param_bytes[v] > 0 and tp > 1:
            ins = graph.edge_bytes[graph.edge_dst == v].sum() * scale / dp
            t = comm.collective("all_reduce", tp_groups(g, dp)[0], ins)
            for d in g:
                load_m[d] += t * pays[d]
        if graph.param_bytes[v] > 0 and dp > 1:
            t = comm.collective("all_reduce", dp_groups(g, dp)[0],
                                graph.param_bytes[v] / (tp if is_tensor_split(lay) else 1))
            for d in g:
                load_m[d] += t / m * pays[d]
