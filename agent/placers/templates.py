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

import math

import numpy as np

from agent.placers.common import (
    Budget,
    PlacerError,
    Scorer,
    check_restrictions,
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
from envs.plan import Plan, contiguous_stages, expert_layers, megatron_plan
from envs.sim import memory
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
    """Valid Megatron (tp, pp, dp, microbatch size, schedule) configurations, most promising first: tp
    within a host and a power of two, tp * pp * dp at most the device count (the template uses the first
    tp * pp * dp devices), microbatch size dividing batch / dp. Coarse to fine, so a short budget still
    sees every parallel shape: first one configuration per shape (tp, pp, dp), all devices first (see
    :func:`_first_of_shape`), then the shapes' other microbatch sizes (largest first) and schedules."""
    nd = topology.num_devices
    per_host = min(len(v) for v in topology.hosts_of(range(nd)).values())
    caps = graph.layout_caps
    can_tp = bool((caps & (CAN_COL | CAN_ROW)).any())
    can_dp = bool((caps & CAN_BATCH).any())
    batch = graph.batch_size
    first: list[dict] = []
    rest: list[dict] = []
    for total in range(nd, 0, -1):
        for tp in [t for t in divisors(total) if t & (t - 1) == 0 and t <= per_host]:
            if tp > 1 and not can_tp:
                continue
            for pp in divisors(total // tp):
                dp = total // tp // pp
                if (dp > 1 and not can_dp) or pp > graph.num_nodes or batch % dp:
                    continue
                shape = []
                for mbs in sorted(divisors(batch // dp), reverse=True):
                    scheds = ("1f1b", "gpipe") if pp > 1 and batch // dp // mbs > 1 else ("1f1b",)
                    for s in scheds:
                        shape.append(dict(tp=tp, pp=pp, dp=dp, microbatch_size=mbs, schedule=s, total=total))
                lead = _first_of_shape(shape, pp, batch // dp)
                first.append(shape[lead])
                rest += shape[:lead] + shape[lead + 1:]
    return first + rest


PIPELINE_FILL = 4  # microbatches per pipeline stage the first configuration of a shape aims at


def _first_of_shape(shape: list[dict], pp: int, batch: int) -> int:
    """Index of the configuration a shape is tried with first: without a pipeline the largest microbatch
    size (no gradient accumulation); with one the largest 1F1B microbatch size that gives at least
    :data:`PIPELINE_FILL` microbatches per stage (the bubble (pp - 1) / m stays small; Narayanan et al.,
    SC'21, section 3.2), or the smallest if none does."""
    if pp == 1:
        return 0
    one_f = [i for i, c in enumerate(shape) if c["schedule"] == "1f1b"]
    filled = [i for i in one_f if batch // shape[i]["microbatch_size"] >= PIPELINE_FILL * pp]
    return filled[0] if filled else one_f[-1]


CHOICES = ("all", "classic")  # megatron_3d's space: today's choices, or the 2021 one (recompute none/full)


class _OutOfMemory:
    """What megatron_3d's sweep knows of a plan it did not simulate because it runs out of memory."""

    oom = True

    @staticmethod
    def key() -> tuple:
        return (1, math.inf, math.inf)


OUT_OF_MEMORY = _OutOfMemory()


def runs_out_of_memory(graph: OpGraph, topology: Topology, plan: Plan, objective: str = "step_time") -> bool:
    """Whether the simulator would report ``plan`` out of memory: its peak memory per device
    (:func:`envs.sim.memory`, the report's own) over a device's capacity, without the schedule."""
    stage, p = plan.stages(graph)
    mem = memory(graph, topology, plan, stage, p, "latency" if objective == "latency" else "step_time")
    return bool((mem["total"] > mem["capacity"]).any())


def expert_choices(dp: int, tp: int, experts: int) -> list[int]:
    """Expert-parallel degrees a user sweeps for ``experts`` experts per layer: 1 and the powers of two
    > 1 dividing both dp and the experts (tp = 1: the EP groups are data-parallel ranks), the largest
    three of them."""
    if experts < 2 or tp > 1 or dp < 2:
        return [1]
    eps = [e for e in divisors(math.gcd(dp, experts)) if e > 1 and e & (e - 1) == 0]
    return [1] + eps[-3:]


def memory_options(tp: int, pp: int, dp: int, choices: str = "all", experts: int = 0) -> tuple[list[dict], list[dict]]:
    """The per-configuration settings a user sweeps, as (always tried, tried in turn while everything
    so far runs out of memory): without and with sequence parallelism (tp > 1), without and with ZeRO-1
    (dp > 1), each expert-parallel degree of :func:`expert_choices` (mixture-of-experts models with
    ``experts`` experts per layer); then, with the largest expert-parallel degree, selective
    recomputation, ZeRO-2 and ZeRO-3 (dp > 1 and no pipeline: DeepSpeed's and Megatron-LM's FSDP refuse
    ZeRO-2/3 with pipeline parallelism) and full recomputation. ``classic``: no ZeRO, no sequence or
    expert parallelism, recomputation none or full (the plan space before them)."""
    if choices == "classic":
        return [dict(zero=0, sequence_parallel=False, recompute="none")], \
            [dict(zero=0, sequence_parallel=False, recompute="full")]
    sps = (False, True) if tp > 1 else (False,)
    zeros = (0, 1) if dp > 1 else (0,)
    eps = expert_choices(dp, tp, experts)
    always = [dict(zero=z, sequence_parallel=sp, recompute="none", expert_parallel=e)
              for e in eps for z in zeros for sp in sps]
    sp, z1, ep = tp > 1, 1 if dp > 1 else 0, eps[-1]
    savers = [dict(zero=z1, sequence_parallel=sp, recompute="selective", expert_parallel=ep)]
    if dp > 1 and pp == 1:
        savers += [dict(zero=2, sequence_parallel=sp, recompute="selective", expert_parallel=ep),
                   dict(zero=3, sequence_parallel=sp, recompute="selective", expert_parallel=ep)]
    savers.append(dict(zero=3 if dp > 1 and pp == 1 else z1, sequence_parallel=sp, recompute="full",
                       expert_parallel=ep))
    return always, savers


def megatron_3d(graph: OpGraph, topology: Topology, *, seed: int = 0, budget=None,
                objective: str = "step_time", choices: str = "all") -> Plan:
    """Best Megatron-LM 3-D configuration by exhaustive enumeration under the budget (see module
    docstring): per (tp, pp, dp, microbatch size, schedule) the settings of :func:`memory_options`,
    then for pipelines interleaving (2-4 virtual stages where they divide the layers) of the best of
    them. The enumeration order puts configurations over all devices first, so a short budget still
    covers them. ``choices="classic"`` searches the space without ZeRO, sequence parallelism, selective
    recomputation and interleaving (for comparisons)."""
    if choices not in CHOICES:
        raise PlacerError(f"unknown choices {choices!r}; choose one of {', '.join(CHOICES)}")
    scorer = Scorer(graph, topology, objective, Budget.of(budget, DEFAULT_BUDGET))
    kw = plan_defaults(graph)
    best: tuple | None = None
    # co-location classes and CPU-only nodes to enforce; without them enforce_constraints has nothing to
    # do but would turn the sequence-parallel nodes (seq_split, which its layout check does not know)
    # into single-device ones
    constrained = bool((graph.colocation >= 0).any() or graph.meta.get("cpu_only"))

    def score(cfg: dict, opts: dict, v: int = 1):
        nonlocal best
        try:
            plan = megatron_plan(graph, topology, tp=cfg["tp"], pp=cfg["pp"], dp=cfg["dp"],
                                 microbatch_size=cfg["microbatch_size"], global_batch=graph.batch_size,
                                 schedule=cfg["schedule"], dtype=kw["dtype"], virtual_stages=v, **opts)
        except PlanError:
            return None
        plan = plan.copy(state_bytes_per_param=kw["state_bytes_per_param"])
        if constrained:
            plan = enforce_constraints(graph, topology, plan)
        if best is not None and not best[0].oom:
            # a plan that runs out of memory loses to the best one, which fits: its memory (cheap)
            # decides, the schedule is not simulated
            try:
                plan.validate(graph, topology)
                check_restrictions(graph, topology, plan)
            except PlanError:
                return None
            if runs_out_of_memory(graph, topology, plan, objective):
                return OUT_OF_MEMORY
        out = scorer(plan)
        if out is not None and (best is None or out.key() < best[0].key()):
            best = (out, plan, cfg, {**opts, "virtual_stages": v})
        return out

    elayer, _, ecount = expert_layers(graph)
    experts = math.gcd(*(int(c) for c in ecount[elayer >= 0]))  # 0 without experts
    for cfg in megatron_configs(graph, topology):
        if best is not None and scorer.exhausted():
            break
        always, savers = memory_options(cfg["tp"], cfg["pp"], cfg["dp"], choices, experts)
        results = [(score(cfg, o), o) for o in always]
        if results[0][0] is None:
            continue  # the configuration itself is invalid for this graph
        fits = [(r, o) for r, o in results if r is not None and not r.oom]
        for o in savers if not fits else []:
            r = score(cfg, o)
            if r is not None and not r.oom:
                fits.append((r, o))
                break
        if choices == "all" and cfg["pp"] > 1 and cfg["schedule"] == "1f1b" and fits and not scorer.exhausted():
            top = min(fits, key=lambda ro: ro[0].key())[1]
            for v in (2, 3, 4):
                score(cfg, top, v)
    if best is None:
        raise PlacerError("megatron_3d found no valid configuration")
    cfg = {k: v for k, v in best[2].items() if k != "total"}
    return finish(best[1], "megatron_3d", seed, scorer, config={**cfg, **best[3]})
