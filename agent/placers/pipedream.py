"""Pipeline dynamic program over contiguous splits (Narayanan et al., "PipeDream: Generalized Pipeline
Parallelism for DNN Training", SOSP 2019, Sec. 3.1).

The topological order of placement units is cut at candidate boundaries (between repeated layers when
the graph has them, else between units; at most ``MAX_SEGMENTS`` segments of equal work). With the
devices in a fixed order (fastest first), ``A[j][k]`` is the smallest achievable time of the slowest
stage when the first ``j`` segments use the first ``k`` devices:

    A[j][k] = min over i < j, 1 <= r <= k of max(A[i][k - r], comm(i), T(i..j, devices k-r..k))

where ``T`` is the stage's compute per step divided among its ``r`` data-parallel replicas (on their
slowest device) plus the all-reduce of its weights over the replicas, and ``comm(i)`` the activations
and gradients crossing boundary ``i`` (PipeDream's ``2 C_i / B``). Stages whose model states do not fit
a device are skipped. The best split for every number of devices used is then rebuilt as a Plan
(stage ``s`` data parallel over its ``r`` devices when its ops split by batch) and the simulator picks
the best of them over microbatch counts and schedules.
"""

from __future__ import annotations

import numpy as np

from agent.placers.common import (
    Budget,
    Scorer,
    best_of,
    device_speed_order,
    enforce_constraints,
    finish,
    microbatch_options,
    node_memory,
    op_time_matrix,
    plan_defaults,
    units,
)
from envs.graph import CAN_BATCH, OpGraph
from envs.plan import Plan, layer_ids
from envs.topology import Topology

DEFAULT_BUDGET = Budget(seconds=30.0, evaluations=96)
MAX_SEGMENTS = 48


def segments(graph: OpGraph, weights: np.ndarray) -> list[np.ndarray]:
    """Contiguous runs of placement units in topological order that the DP may not cut inside."""
    unit, members = units(graph)
    lid = layer_ids(graph)
    ulayer = np.array([lid[m[0]] for m in members])
    uw = np.array([weights[m].sum() for m in members])
    nu = len(members)
    cuts = [i for i in range(1, nu) if ulayer[i] != ulayer[i - 1]] if (ulayer >= 0).any() else list(range(1, nu))
    if len(cuts) + 1 > MAX_SEGMENTS:
        cum = np.cumsum(uw)
        targets = cum[-1] * np.arange(1, MAX_SEGMENTS) / MAX_SEGMENTS
        c = np.asarray(cuts)
        pick = sorted({int(c[np.argmin(np.abs(cum[c - 1] - t))]) for t in targets})
        cuts = pick
    bounds = [0, *cuts, nu]
    return [np.concatenate([members[u] for u in range(a, b)]) for a, b in zip(bounds[:-1], bounds[1:])]


def pipeline_dp(graph: OpGraph, topology: Topology, order: list[int], dtype: str, mem: np.ndarray,
                tau: np.ndarray) -> dict[int, list[tuple[int, int]]]:
    """For each device count k, the best stages as a list of (segments end, replicas), by the DP."""
    segs = segments(graph, tau[:, order[0]])
    S, nd = len(segs), len(order)
    seg_time = np.array([[tau[s, d].sum() for d in order] for s in segs])  # S x nd (device position)
    cum_t = np.vstack([np.zeros(nd), np.cumsum(seg_time, axis=0)])
    seg_params = np.array([graph.param_bytes[s].sum() for s in segs])
    cum_p = np.concatenate([[0.0], np.cumsum(seg_params)])
    seg_mem = np.array([mem[s].sum() for s in segs])
    cum_m = np.concatenate([[0.0], np.cumsum(seg_mem)])
    can_dp = np.array([bool((graph.layout_caps[s] & CAN_BATCH).all()) for s in segs])
    cum_nodp = np.concatenate([[0], np.cumsum(~can_dp)])
    caps = np.array([topology.devices[d].memory_bytes for d in order])
    pos_of = {v: i for i, s in enumerate(segs) for v in s.tolist()}
    boundary = np.zeros(S + 1)  # bytes crossing the boundary before segment j
    for e in range(graph.num_edges):
        a, b = pos_of[int(graph.edge_src[e])], pos_of[int(graph.edge_dst[e])]
        lo, hi = min(a, b), max(a, b)
        if lo != hi:
            if graph.edge_time is not None:
                boundary[lo + 1:hi + 1] += float(graph.edge_time[e])
            else:
                boundary[lo + 1:hi + 1] += graph.edge_bytes[e]
    if graph.edge_time is None and nd > 1:
        bw = np.median([topology.bandwidth(order[i], order[i + 1]) for i in range(nd - 1)])
        comm = 2 * boundary / bw
    else:
        comm = 2 * boundary
    INF = np.inf
    A = np.full((S + 1, nd + 1), INF)
    A[0, 0] = 0.0
    arg: dict[tuple[int, int], tuple[int, int]] = {}
    for j in range(1, S + 1):
        for k in range(1, nd + 1):
            best, who = INF, None
            for i in range(j):
                params = cum_p[j] - cum_p[i]
                states = cum_m[j] - cum_m[i]
                c = comm[i] if i > 0 else 0.0
                for r in range(1, k + 1):
                    prev = A[i, k - r]
                    if prev == INF or (r > 1 and cum_nodp[j] - cum_nodp[i] > 0):
                        continue
                    devs = range(k - r, k)
                    if states > caps[list(devs)].min():
                        continue
                    compute = max((cum_t[j, d] - cum_t[i, d]) for d in devs) / r
                    ar = topology.collective_time("all_reduce", [order[d] for d in devs], params) if r > 1 else 0.0
                    val = max(prev, c, compute + ar)
                    if val < best:
                        best, who = val, (i, r)
            A[j, k] = best
            if who is not None:
                arg[(j, k)] = who
    out: dict[int, list[tuple[int, int]]] = {}
    for k in range(1, nd + 1):
        if A[S, k] == INF:
            continue
        stages, j, kk = [], S, k
        while j > 0:
            i, r = arg[(j, kk)]
            stages.append((j, r))
            j, kk = i, kk - r
        out[k] = stages[::-1]
    out["segments"] = segs  # type: ignore[index]
    return out


def pipedream(graph: OpGraph, topology: Topology, *, seed: int = 0, budget=None, objective: str = "step_time"):
    """PipeDream's pipeline DP (see module docstring). Deterministic; ``seed`` is recorded only."""
    scorer = Scorer(graph, topology, objective, Budget.of(budget, DEFAULT_BUDGET))
    kw = plan_defaults(graph)
    order = device_speed_order(topology, kw["dtype"])
    tau = op_time_matrix(graph, topology, kw["dtype"])
    mem = node_memory(graph, kw)
    res = pipeline_dp(graph, topology, order, kw["dtype"], mem, tau)
    segs = res.pop("segments")
    cands: list[Plan] = []
    for k in sorted(res, reverse=True):
        stages = res[k]
        groups: list[tuple[int, ...]] = [()] * graph.num_nodes
        layouts = ["single"] * graph.num_nodes
        lcm = 1
        start_seg, dev_pos = 0, 0
        for end, r in stages:
            g = tuple(sorted(order[dev_pos:dev_pos + r]))
            for s in range(start_seg, end):
                for v in segs[s].tolist():
                    groups[v] = g if r > 1 else (g[0],)
                    layouts[v] = "batch_split" if r > 1 else "single"
            lcm = int(np.lcm(lcm, r))
            start_seg, dev_pos = end, dev_pos + r
        for m in microbatch_options(graph.batch_size, limit=5, multiple_of=lcm):
            for sched in ("1f1b", "gpipe") if len(stages) > 1 else ("1f1b",):
                p = Plan(groups=groups, layouts=layouts, microbatches=m, schedule=sched, **kw)
                cands.append(enforce_constraints(graph, topology, p))
    if not cands:
        cands = [enforce_constraints(graph, topology, Plan(groups=[(order[0],)] * graph.num_nodes,
                                                            layouts=["single"] * graph.num_nodes, **kw))]
    plan, _ = best_of(scorer, cands)
    return finish(plan, "pipedream", seed, scorer, stages=plan.stages(graph)[1])
