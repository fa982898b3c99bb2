"""Evaluators: the reward source of the placement environments.

A :class:`PlanEvaluator` turns (graph, topology, plan, objective) into an :class:`EvalResult` (step
time, peak memory per device, OOM). :class:`CachedSimulation` (the default) calls
:func:`envs.sim.simulate` and caches results by the plan's decisions (``Plan.key()``), per graph
and topology, in a bounded LRU, so re-visited plans (common late in training, and for the reference
plans of every task) cost a dictionary lookup. A measured executor (``profilers/``) can implement the
same protocol.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from envs.graph import OpGraph
from envs.plan import Plan
from envs.topology import Topology


@dataclass
class EvalResult:
    """What an evaluator says about one plan. ``peak_memory`` and ``memory_capacity`` are bytes per device."""

    value: float  # the objective's value (envs.sim.StepReport.value), seconds
    peak_memory: np.ndarray
    memory_capacity: np.ndarray
    oom: bool
    extra: dict = field(default_factory=dict)

    @property
    def overflow(self) -> float:
        """Worst device's peak / capacity (> 1 means out of memory)."""
        if self.peak_memory.size == 0:
            return 0.0
        return float(np.max(self.peak_memory / self.memory_capacity))


@runtime_checkable
class PlanEvaluator(Protocol):
    """Anything that predicts or measures a plan's step time and memory."""

    def evaluate(self, graph: OpGraph, topology: Topology, plan: Plan, objective: str = "step_time") -> EvalResult:
        ...


class CachedSimulation:
    """The simulator as an evaluator, with an LRU cache keyed by (graph, topology, objective, plan key).

    ``simulate`` already runs the compiled builder (:class:`envs.sim.CompiledSimulator`, cached per
    graph and topology); its one-node ``delta`` was measured no faster than a full
    evaluation on the environments' coarse graphs (~0.7 ms vs ~0.9 ms for 52 groups on 8 GPUs), so
    every miss is a plain ``simulate(..., timeline=False, validate=False)``.

    Graphs and topologies are keyed by identity (``id``) and a reference to them is kept with the entry,
    so an id is never re-used while cached. ``validate`` checks each plan before simulating (the
    environments build valid plans by construction, so they pass ``validate=False``)."""

    def __init__(self, cache_size: int = 4096, validate: bool = False):
        self.cache_size = int(cache_size)
        self.validate = bool(validate)
        self._cache: OrderedDict[tuple, tuple[EvalResult, OpGraph, Topology]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def evaluate(self, graph: OpGraph, topology: Topology, plan: Plan, objective: str = "step_time") -> EvalResult:
        key = (id(graph), id(topology), objective, plan.key())
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return hit[0]
        self.misses += 1
        res = self._simulate(graph, topology, plan, objective)
        self._cache[key] = (res, graph, topology)
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return res

    def _simulate(self, graph: OpGraph, topology: Topology, plan: Plan, objective: str) -> EvalResult:
        from envs.sim import simulate

        rep = simulate(graph, topology, plan, objective, timeline=False, validate=self.validate)
        return EvalResult(value=float(rep.value), peak_memory=np.asarray(rep.peak_memory, dtype=np.float64),
                          memory_capacity=np.asarray(rep.memory_capacity, dtype=np.float64), oom=bool(rep.is_oom),
                          extra={"makespan": float(rep.makespan)})

    def clear(self) -> None:
        self._cache.clear()
        self.hits = self.misses = 0
