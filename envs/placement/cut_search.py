"""Moving a pipeline's stage boundaries one place at a time, for a search the simulator judges.

A start cut by balanced compute can still lose to a cut one layer away: under 1F1B a bottleneck in a
middle stage stalls both neighbours, so a 39-layer Llama on three 4-V100 hosts (pp 3 x dp 4, 14
microbatches) simulates at 33.2 s with 14 | 13 | 12 layers and 27.1 s with Megatron-LM's 13 | 13 | 13,
although both cuts have the same largest stage compute (24.0 vs 23.8 s). :class:`StagedStart` keeps how a
pipeline start was built from its stages so that another cut can be built the same way, and
:func:`moved_cuts` lists the cuts one boundary away (a boundary moves to the next place a stage may
start: between repeated layers where the graph has them, :func:`envs.plan.stage_cuts`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from envs.graph import OpGraph
from envs.plan import stage_cuts


@dataclass(frozen=True)
class StagedStart:
    """A pipeline start as its stage of each group and the function that builds its actions (one per
    group) from any such stage vector."""

    stage: np.ndarray  # [n] stage of each group
    build: Callable[[np.ndarray], np.ndarray]


def cut_positions(graph: OpGraph, stage: np.ndarray) -> np.ndarray:
    """Where in the topological order each stage after the first starts (the first group at that stage
    or later), ``k - 1`` positions."""
    in_order = np.asarray(stage)[graph.topological_order()]
    k = int(in_order.max()) + 1
    return np.array([int(np.argmax(in_order >= s)) for s in range(1, k)], dtype=np.int64)


def stages_from_cuts(graph: OpGraph, cuts: np.ndarray) -> np.ndarray:
    """The stage of each group for contiguous stages starting at ``cuts`` in the topological order."""
    order = graph.topological_order()
    in_order = np.searchsorted(np.asarray(cuts), np.arange(order.size), side="right")
    stage = np.empty(order.size, dtype=np.int64)
    stage[order] = in_order
    return stage


def moved_cuts(graph: OpGraph, stage: np.ndarray) -> list[np.ndarray]:
    """Every stage vector with one boundary of ``stage`` moved to the neighbouring place a stage may start,
    earlier or later, every stage keeping at least one group (boundaries in order, earlier first)."""
    cuts = cut_positions(graph, stage)
    if cuts.size == 0:
        return []
    places = stage_cuts(graph, cuts.size + 1)
    out = []
    for i, c in enumerate(cuts.tolist()):
        lo = cuts[i - 1] if i > 0 else 0
        hi = cuts[i + 1] if i + 1 < cuts.size else graph.num_nodes
        earlier, later = places[places < c], places[places > c]
        for new in ((int(earlier[-1]),) if earlier.size else ()) + ((int(later[0]),) if later.size else ()):
            if lo < new < hi:
                moved = cuts.copy()
                moved[i] = new
                out.append(stages_from_cuts(graph, moved))
    return out
