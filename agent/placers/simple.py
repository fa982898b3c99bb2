"""The simplest baselines: one device, full data parallelism, round-robin by layer.

Each tries a handful of microbatch counts (and full activation recomputation when memory is short)
and keeps the best plan by the simulator (plans that fit memory first).
"""

from __future__ import annotations

import numpy as np

from agent.placers.common import (
    Budget,
    Scorer,
    assignment_plan,
    best_of,
    device_speed_order,
    enforce_constraints,
    finish,
    microbatch_options,
    plan_defaults,
)
from envs.graph import CAN_BATCH, OpGraph
from envs.plan import Plan, layer_ids
from envs.topology import Topology

DEFAULT_BUDGET = Budget(seconds=30.0, evaluations=64)


def _variants(graph: OpGraph, make, batch: int, multiple_of: int = 1, schedules=("1f1b",)) -> list[Plan]:
    """Plans from ``make(m, schedule, recompute)`` over microbatch counts, schedules and recompute."""
    out = []
    for rc in (False, True):
        for m in microbatch_options(batch, limit=5, multiple_of=multiple_of):
            for s in schedules:
                out.append(make(m, s, rc))
    return out


def _search(scorer: Scorer, candidates: list[Plan]) -> Plan:
    """Best of the no-recompute candidates; the recompute ones only if none of those fits."""
    plain = [p for p in candidates if not p.recompute.any()]
    rc = [p for p in candidates if p.recompute.any()]
    plan, out = best_of(scorer, plain)
    if out.oom and rc and not scorer.exhausted():
        plan2, out2 = best_of(scorer, rc)
        if out2.key() < out.key():
            plan = plan2
    return plan


def single_device(graph: OpGraph, topology: Topology, *, seed: int = 0, budget=None,
                  objective: str = "step_time") -> Plan:
    """Everything on one device: the fastest device whose memory holds the model (each distinct kind
    of device tried, fastest first; microbatches and recomputation chosen by the simulator)."""
    scorer = Scorer(graph, topology, objective, Budget.of(budget, DEFAULT_BUDGET))
    batch = graph.batch_size
    seen, cands = set(), []
    for d in device_speed_order(topology, plan_defaults(graph)["dtype"]):
        dev = topology.devices[d]
        key = (dev.kind, dev.memory_bytes)
        if key in seen:
            continue
        seen.add(key)
        cands += _variants(graph, lambda m, s, rc, d=d: assignment_plan(
            graph, topology, [d] * graph.num_nodes, microbatches=m, schedule=s, recompute=rc), batch)
    return finish(_search(scorer, cands), "single_device", seed, scorer)


def data_parallel(graph: OpGraph, topology: Topology, *, seed: int = 0, budget=None,
                  objective: str = "step_time") -> Plan:
    """Full data parallelism: every batch-splittable node replicated over the largest set of the
    fastest devices whose size divides the batch (ops that cannot split by batch run on the first)."""
    scorer = Scorer(graph, topology, objective, Budget.of(budget, DEFAULT_BUDGET))
    order = device_speed_order(topology, plan_defaults(graph)["dtype"])
    batch = graph.batch_size
    sizes = [k for k in range(topology.num_devices, 0, -1) if batch % k == 0]
    if not (graph.layout_caps & CAN_BATCH).any():
        sizes = [1]
    cands: list[Plan] = []
    for k in sizes[:2]:
        g = tuple(sorted(order[:k]))

        def make(m, s, rc, g=g):
            layouts = ["batch_split" if (c & CAN_BATCH and len(g) > 1) else "single"
                       for c in graph.layout_caps.tolist()]
            groups = [g if lay == "batch_split" else (g[0],) for lay in layouts]
            p = Plan(groups=groups, layouts=layouts, microbatches=m, schedule=s,
                     recompute=np.full(graph.num_nodes, rc), **plan_defaults(graph))
            return enforce_constraints(graph, topology, p)

        cands += _variants(graph, make, batch, multiple_of=k)
    return finish(_search(scorer, cands), "data_parallel", seed, scorer)


def round_robin(graph: OpGraph, topology: Topology, *, seed: int = 0, budget=None,
                objective: str = "step_time") -> Plan:
    """Layer ``l`` on device ``l mod k`` (nodes outside a repeated layer follow the previous node in
    topological order); a graph without layer indices is cut into ``4k`` equal chunks of its topological
    order, dealt round-robin. The classic naive model-parallel baseline (e.g. Mirhoseini et al., ICML'17)."""
    scorer = Scorer(graph, topology, objective, Budget.of(budget, DEFAULT_BUDGET))
    nd = topology.num_devices
    order = graph.topological_order()
    lid = layer_ids(graph)[order]
    if (lid >= 0).sum() == 0:
        chunks = max(1, min(graph.num_nodes, 4 * nd))
        lid = (np.arange(graph.num_nodes) * chunks) // max(graph.num_nodes, 1)
    device = np.zeros(graph.num_nodes, dtype=np.int64)
    devs = device_speed_order(topology, plan_defaults(graph)["dtype"])
    layers = sorted({int(x) for x in lid if x >= 0})
    rank = {L: i for i, L in enumerate(layers)}
    cur = devs[0]
    for pos, v in enumerate(order.tolist()):
        if lid[pos] >= 0:
            cur = devs[rank[int(lid[pos])] % nd]
        device[v] = cur
    cands = _variants(graph, lambda m, s, rc: assignment_plan(graph, topology, device, microbatches=m, schedule=s,
                                                              recompute=rc), graph.batch_size)
    return finish(_search(scorer, cands), "round_robin", seed, scorer)
