"""Heuristic and search placers, all with the agent's interface:

    placer(graph, topology, *, seed=0, budget=None, objective="step_time") -> Plan

``budget`` is ``None`` (the placer's default), an ``int`` (simulator evaluations), a ``float``
(wall-clock seconds), a dict ``{"seconds": s, "evaluations": n}`` or a
:class:`~agent.placers.common.Budget`; the placer stops at whichever limit comes first (fast heuristics
need far less than any sensible budget). Every returned plan is validated against its graph and
topology, respects co-location classes and layout capabilities, and carries provenance
``{"placer", "seed", "objective", "predicted_step_time", "peak_memory", "oom", "evaluations",
"planning_seconds", ...}``. ``predicted_step_time`` is the simulator's objective value (for the
throughput objective: steady-state time per global batch).
"""

from __future__ import annotations

from collections.abc import Callable

from agent.placers.baechi import m_etf, m_sct
from agent.placers.common import Budget, PlacerError
from agent.placers.partition import metis
from agent.placers.pipedream import pipedream
from agent.placers.search import mcmc, random_search
from agent.placers.simple import data_parallel, round_robin, single_device
from agent.placers.templates import expert_split, megatron_3d
from envs.graph import OpGraph
from envs.plan import Plan
from envs.topology import Topology

Placer = Callable[..., Plan]


def megatron_3d_classic(graph: OpGraph, topology: Topology, **kw) -> Plan:
    """:func:`~agent.placers.templates.megatron_3d` over the classic plan space (``choices="classic"``:
    tensor, pipeline and data parallelism with recomputation none or full; no ZeRO, sequence
    parallelism, selective recomputation, interleaving or expert parallelism), so a benchmark can show
    the best plan of that space beside today's."""
    plan = megatron_3d(graph, topology, choices="classic", **kw)
    plan.provenance = {**plan.provenance, "placer": "megatron_3d_classic", "choices": "classic"}
    return plan


PLACERS: dict[str, Placer] = {
    "single_device": single_device,
    "data_parallel": data_parallel,
    "round_robin": round_robin,
    "expert_split": expert_split,
    "megatron_3d": megatron_3d,
    "megatron_3d_classic": megatron_3d_classic,
    "m_etf": m_etf,
    "m_sct": m_sct,
    "metis": metis,
    "pipedream": pipedream,
    "random_search": random_search,
    "mcmc": mcmc,
}

# Placers whose search grows with the budget (the others finish in a few evaluations).
SEARCH_PLACERS = ("megatron_3d", "megatron_3d_classic", "random_search", "mcmc")


def run_placer(name: str, graph: OpGraph, topology: Topology, **kw) -> Plan:
    """Run the placer registered as ``name`` (see :data:`PLACERS`)."""
    if name not in PLACERS:
        raise PlacerError(f"unknown placer {name!r}; placers: {', '.join(PLACERS)}")
    return PLACERS[name](graph, topology, **kw)


__all__ = ["PLACERS", "SEARCH_PLACERS", "Budget", "PlacerError", "Placer", "run_placer"]
