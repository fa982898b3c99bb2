"""Graph-partitioning placer: METIS k-way partitioning of the operator graph (Karypis & Kumar, "A Fast
and High Quality Multilevel Scheme for Partitioning Irregular Graphs", SIAM J. Sci. Comput. 1998)
through ``pymetis``.

Vertices are placement units (co-location classes contracted) weighted by compute time, edges are
weighted by the bytes they carry (summed both ways), k = number of devices (and, because a balanced
cut of a training DAG on fewer devices is sometimes faster, every smaller k down to 2). Parts are
mapped to devices heaviest part to fastest device, target part weights proportional to device speed,
memory violations are repaired by moving units off over-full devices, and the microbatch count is
chosen by the simulator.
"""

from __future__ import annotations

import numpy as np

from agent.placers.common import (
    Budget,
    Scorer,
    assignment_plan,
    best_of,
    device_speed_order,
    finish,
    microbatch_options,
    node_memory,
    op_time_matrix,
    plan_defaults,
    repair_memory,
    units,
)
from envs.graph import OpGraph
from envs.graph_partition import metis_parts
from envs.topology import Topology

DEFAULT_BUDGET = Budget(seconds=30.0, evaluations=64)


def metis(graph: OpGraph, topology: Topology, *, seed: int = 0, budget=None, objective: str = "step_time"):
    """METIS placer (see module docstring); ``seed`` seeds METIS's randomised coarsening."""
    scorer = Scorer(graph, topology, objective, Budget.of(budget, DEFAULT_BUDGET))
    kw = plan_defaults(graph)
    order = device_speed_order(topology, kw["dtype"])
    tau = op_time_matrix(graph, topology, kw["dtype"])
    mem = node_memory(graph, kw)
    cands = []
    n_units = len(units(graph)[1])
    for k in range(min(topology.num_devices, n_units), 1, -1):
        devs = order[:k]
        speed = np.array([topology.devices[d].flops(kw["dtype"]) for d in devs])
        tp = (speed / speed.sum()).tolist()
        parts = metis_parts(graph, k, tau[:, order[0]], tp, seed)
        # parts are already sized to the target weights; part i goes to devs[i]
        device = np.asarray(devs, dtype=np.int64)[parts]
        device = repair_memory(graph, topology, device, mem, tau)
        for m in microbatch_options(graph.batch_size, limit=3):
            cands.append((k, assignment_plan(graph, topology, device, microbatches=m)))
    if not cands:
        cands = [(1, assignment_plan(graph, topology, [order[0]] * graph.num_nodes))]
    plan, _ = best_of(scorer, [p for _, p in cands])
    return finish(plan, "metis", seed, scorer, devices_used=len(plan.devices_used()))
