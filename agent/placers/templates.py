"""Expert templates: the GPipe layer split and the Megatron-LM 3-D (tensor x pipeline x data) configuration.

- :func:`expert_split` — contiguous pipeline stages balanced by op time on the fastest devices, GPipe
  schedule (Huang et al., "GPipe", NeurIPS 2019): stage counts, microbatch counts and re-materialisation
  tried, best by the simulator.
- :func:`megatron_3d` — every valid (tp, pp, dp, microbatch size, schedule, recompute) of the Megatron
  template (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC'21) enumerated and simulated; configurations that run out of memory lose to any that
  fits; recomputation is tried only where the plain configuration runs out of memory.
"""

from __future__ import annotations

import numpy as np

from agent.placers.common import (
    Budget,
    PlacerError,
    Scorer,
    device_speed_order,
    divisors,
    enforce_constraints,
    finish,
    microbatch_options,
    op_time_matrix,
    plan_defaults,
    units,
)
from envs.errors import PlanError
from envs.graph import CAN_BATCH, CAN_COL, CAN_ROW, OpGraph
from envs.plan import Plan, contiguous_stages, megatron_plan
from envs.topology import Topology

DEFAULT_BUDGET = Budget(seconds=60.0, evaluations=400)


def _stage_plan(graph: OpGraph, topology: Topology, stage: np.ndarray, devices: list[int], m: int,
                schedule: str, recompute: bool) -> Plan:
    n = graph.num_nodes
    p = Plan(groups=[(devices[int(s)],) for s in stage], layouts=["single"] * n, microbatches=m,
             schedule=schedule, recompute=np.full(n, recompute), **plan_defaults(graph))
    return enforce_constraints(graph, topology, p)


def balanced_stages(graph: OpGraph, k: int, weights: np.ndarray) -> np.ndarray:
    """Stage of each node: ``k`` contiguous stages balanced by ``weights``. Graphs with co-location
    classes are cut over their placement units (in order of first use) so a class never straddles a
    cut; others use ``envs.plan.contiguous_stages`` (cuts between repeated layers)."""
    if (graph.colocation < 0).all():
        return contiguous_stages(graph, k, weights=weights)
    unit, members = units(graph)
    w = np.array([weights[m].sum() for m in members]) + 1e-12
    cum = np.cumsum(w)
    ustage = np.minimum((k * (cum - w / 2) / cum[-1]).astype(np.int64), k - 1)
    return ustage[unit]


def expert_split(graph: OpGraph, topology: Topology, *, seed: int = 0, budget=None,
                 objective: str = "step_time") -> Plan:
    """GPipe-style layer split: for each stage count k (1..devices) the topological order is cut into k
    contiguous stages balanced by op time on the fastest device (cuts between repeated layers where the
    graph has them), stage i on the i-th fastest device; every microbatch count (powers of two first) is
    tried with the GPipe schedule, and with re-materialisation when memory is short."""
    scorer = Scorer(graph, topology, objective, Budget.of(budget, DEFAULT_BUDGET))
    dtype = plan_defaults(graph)["dtype"]
    order = device_speed_order(topology, dtype)
    times = op_time_matrix(graph, topology, dtype)[:, order[0]]
    best: tuple | None = None
    for k in range(1, min(topology.num_devices, graph.num_nodes) + 1):
        stage = balanced_stages(graph, k, times)
        devs = order[:k]
        for rc in (False, True):
            if rc and best is not None and not best[0].oom:
                break
            for m in microbatch_options(graph.batch_size, limit=6):
                if best is not None and scorer.exhausted():
                    break
                plan = _stage_plan(graph, topology, stage, devs, m, "gpipe", rc)
                out = scorer(plan)
                if out is not None and (best is None or out.key() < best[0].key()):
                    best = (out, plan, k)
    if best is None:
        raise PlacerError("expert_split found no valid plan")
    return finish(best[1], "expert_split", seed, scorer, stages=best[2])


def megatron_configs(graph: OpGraph, topology: Topology) -> list[dict]:
    """Valid Megatron (tp, pp, dp, microbatch size, schedule) configurations, most promising first:
    tp within a host and a power of two, tp * pp * dp at most the device count (all devices first;
    the template uses the first tp * pp * dp devices), microbatch size dividing batch / dp (largest
    first)."""
    nd = topology.num_devices
    per_host = min(len(v) for v in topology.hosts_of(range(nd)).values())
    caps = graph.layout_caps
    can_tp = bool((caps & (CAN_COL | CAN_ROW)).any())
    can_dp = bool((caps & CAN_BATCH).any())
    batch = graph.batch_size
    out: list[dict] = []
    for total in range(nd, 0, -1):
        for tp in [t for t in divisors(total) if t & (t - 1) == 0 and t <= per_host]:
            if tp > 1 and not can_tp:
                continue
            for pp in divisors(total // tp):
                dp = total // tp // pp
                if (dp > 1 and not can_dp) or pp > graph.num_nodes or batch % dp:
                    continue
                for mbs in sorted(divisors(batch // dp), reverse=True):
                    scheds = ("1f1b", "gpipe") if pp > 1 and batch // dp // mbs > 1 else ("1f1b",)
                    for s in scheds:
                        out.append(dict(tp=tp, pp=pp, dp=dp, microbatch_size=mbs, schedule=s, total=total))
    return out


def megatron_3d(graph: OpGraph, topology: Topology, *, seed: int = 0, budget=None,
                objective: str = "step_time") -> Plan:
    """Best Megatron-LM 3-D configuration by exhaustive enumeration under the budget (see module
    docstring). The enumeration order puts configurations over all devices first, so a short budget
    still covers them."""
    scorer = Scorer(graph, topology, objective, Budget.of(budget, DEFAULT_BUDGET))
    kw = plan_defaults(graph)
    best: tuple | None = None
    for cfg in megatron_configs(graph, topology):
        if best is not None and scorer.exhausted():
            break
        for rc in ("none", "full"):
            try:
                plan = megatron_plan(graph, topology, tp=cfg["tp"], pp=cfg["pp"], dp=cfg["dp"],
                                microbatch_size=cfg["microbatch_size"], global_batch=graph.batch_size,
                                schedule=cfg["schedule"], recompute=rc, dtype=kw["dtype"])
            except PlanError:
                break
            plan = enforce_constraints(graph, topology, plan.copy(state_bytes_per_param=kw["state_bytes_per_param"]))
            out = scorer(plan)
            if out is not None and (best is None or out.key() < best[0].key()):
                best = (out, plan, cfg, rc)
            if out is None or not out.oom:
                break  # recomputation only helps when the plain configuration runs out of memory
    if best is None:
        raise PlacerError("megatron_3d found no valid configuration")
    cfg = {k: v for k, v in best[2].items() if k != "total"}
    return finish(best[1], "megatron_3d", seed, scorer, config={**cfg, "recompute": best[3]})
