"""Memory-constrained list-scheduling placers m-ETF and m-SCT (Jeon et al., "Baechi: Fast Device
Placement of Machine Learning Graphs", SoCC 2020).

Both schedule the forward graph's operators one by one on the devices, with each operator's time the
forward + backward time on that device (``envs.sim.node_times``, i.e. measured times or the
roofline) and each cross-device tensor costing ``Topology.p2p_time`` (or the graph's measured edge
time). A device is eligible for an operator only while it has memory left for the operator's model
states and stashed activation (Baechi's memory constraint); when no device has room, the one with the
most free memory takes it and :func:`~agent.placers.common.repair_memory` fixes the rest.

- **m-ETF** (earliest finish time; Hwang, Chow, Anger & Lee, SIAM J. Comput. 1989): among all ready
  (operator, device) pairs, schedule the one that finishes first.
- **m-SCT** (small communication time; Hanen & Munier 1995, as adapted by Baechi): every operator
  has at most one *favourite child*; a favourite child is placed on its parent's device when that device
  has room and is free by the time the child's data is ready, otherwise ETF decides. Baechi obtains
  favourite children from the rounded solution of an LP relaxation; here each operator's favourite
  child is the child it sends the most data to (the LP's rounding keeps the heaviest edge when
  communication is small), a greedy stand-in for the LP.

Co-location classes are respected: the first member placed pins the whole class (and charges its
memory) to that device. The microbatch count of the final plan is chosen by the simulator.
"""

from __future__ import annotations

import numpy as np

from agent.placers.common import (
    Budget,
    Scorer,
    allowed_devices,
    assignment_plan,
    best_of,
    finish,
    microbatch_options,
    node_memory,
    op_time_matrix,
    plan_defaults,
    repair_memory,
    units,
)
from envs.graph import OpGraph
from envs.placement.list_schedule import favourite_parents, list_schedule
from envs.topology import Topology

DEFAULT_BUDGET = Budget(seconds=30.0, evaluations=32)


def _edge_time(graph: OpGraph, topology: Topology, e: int, a: int, b: int) -> float:
    if a == b:
        return 0.0
    if graph.edge_time is not None:
        return float(graph.edge_time[e])
    return topology.p2p_time(a, b, float(graph.edge_bytes[e]))


def list_schedule_placement(graph: OpGraph, topology: Topology, *, sct: bool) -> np.ndarray:
    """Device of each node from memory-constrained ETF (``sct=False``) or SCT (``sct=True``)."""
    nd = topology.num_devices
    kw = plan_defaults(graph)
    tau = op_time_matrix(graph, topology, kw["dtype"])
    mem = node_memory(graph, kw)
    cap = np.array([d.memory_bytes for d in topology.devices], dtype=np.float64)
    allowed = allowed_devices(graph, topology)
    unit, members = units(graph)
    umem = np.array([mem[m].sum() for m in members])
    uallowed = np.array([allowed[m].all(axis=0) for m in members])
    fav = None
    if sct:
        weight = graph.edge_time if graph.edge_time is not None else graph.edge_bytes
        fav = favourite_parents(graph.num_nodes, graph.edge_src, graph.edge_dst, weight)

    def delay(e: int, a: int) -> np.ndarray:
        return np.array([_edge_time(graph, topology, e, a, d) for d in range(nd)])

    device, used = list_schedule(graph.topological_order().tolist(), tau, graph.edge_src, graph.edge_dst, delay,
                                 unit, umem, uallowed, cap, fav)
    if (used > cap).any():
        device = repair_memory(graph, topology, device, mem, tau)
    return device


def _place(graph: OpGraph, topology: Topology, name: str, sct: bool, seed: int, budget, objective: str):
    scorer = Scorer(graph, topology, objective, Budget.of(budget, DEFAULT_BUDGET))
    device = list_schedule_placement(graph, topology, sct=sct)
    cands = [assignment_plan(graph, topology, device, microbatches=m, schedule=s)
             for m in microbatch_options(graph.batch_size, limit=4) for s in ("1f1b", "gpipe")]
    plan, _ = best_of(scorer, cands)
    return finish(plan, name, seed, scorer, devices_used=len(set(device.tolist())))


def m_etf(graph: OpGraph, topology: Topology, *, seed: int = 0, budget=None, objective: str = "step_time"):
    """Baechi's m-ETF (see module docstring). Deterministic; ``seed`` is recorded only."""
    return _place(graph, topology, "m_etf", False, seed, budget, objective)


def m_sct(graph: OpGraph, topology: Topology, *, seed: int = 0, budget=None, objective: str = "step_time"):
    """Baechi's m-SCT (see module docstring). Deterministic; ``seed`` is recorded only."""
    return _place(graph, topology, "m_sct", True, seed, budget, objective)
