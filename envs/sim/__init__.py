"""The step-time and memory simulator: ``simulate(graph, topology, plan) -> StepReport``.

What lives here, bottom up (each module imports only the ones above it): :mod:`~envs.sim.cost` (the
leaf: the report type, constants, op times, memory, collective times and the layout-crossing rules),
:mod:`~envs.sim.schedule` (the list scheduler, numba), :mod:`~envs.sim.throughput` (the max-load
objective), :mod:`~envs.sim.reference` (the plain-Python task-graph builder: the specification),
:mod:`~envs.sim.kernels` and :mod:`~envs.sim.compiled` (the same task graph from arrays, bit for bit,
with one-node delta re-evaluation), :mod:`~envs.sim.stages` (the stage-level model for huge pipelines),
and this front door (:func:`simulate` and its fast-path dispatch). The package may import envs.graph,
envs.plan, envs.topology, envs.errors and numpy/numba; never envs.placement, agent or profilers.
"""

from __future__ import annotations

from envs.errors import PlanError
from envs.graph import OpGraph
from envs.plan import Plan
from envs.sim.compiled import CompiledSimulator, compiled_simulator
from envs.sim.cost import StepReport, memory, node_times
from envs.sim.stages import stage_simulate, stage_structure
from envs.sim.throughput import simulate_throughput
from envs.topology import Topology

__all__ = ["simulate", "OBJECTIVES", "FAST_PATH_TASKS", "StepReport", "node_times", "memory", "CompiledSimulator",
           "compiled_simulator"]

OBJECTIVES = ("step_time", "throughput", "latency")
FAST_PATH_TASKS = 200_000  # above this many tasks simulate() switches to the stage-level pipeline model


def simulate(graph: OpGraph, topology: Topology, plan: Plan, objective: str = "step_time", *,
             timeline: bool = True, validate: bool = True, fast_path: bool | None = None) -> StepReport:
    """Predict the step time and peak memory of ``plan`` for ``graph`` on ``topology``.

    objective: ``step_time`` (one training step), ``throughput`` (steady-state time per global batch:
    the microbatches times the busiest device's per-microbatch load of compute plus communication; for the dnn-partitioning
    workloads this is Tarnawski et al.'s max-load), ``latency`` (one sample, forward only).

    The task graph is built by the compiled builder (:func:`compiled_simulator`, cached per graph and
    topology), which reproduces the reference builder :func:`envs.sim.reference.simulate_reference`
    exactly. ``fast_path``: the stage-level pipeline model (:func:`envs.sim.stages.stage_simulate`) for
    stage-contiguous plans with identical microbatches; None uses it automatically when the full task
    graph would exceed ``FAST_PATH_TASKS`` tasks and the plan qualifies, True forces it (raising
    PlanError when the plan does not qualify), False never uses it."""
    if objective not in OBJECTIVES:
        raise PlanError(f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
    if validate:
        plan.validate(graph, topology)
    if objective == "throughput":
        return simulate_throughput(graph, topology, plan)
    if fast_path or (fast_path is None and objective == "step_time"
                     and _min_tasks(graph, plan, objective) > FAST_PATH_TASKS):
        why = stage_structure(graph, plan, objective)
        if not isinstance(why, str):
            return stage_simulate(graph, topology, plan, why, timeline=timeline)
        if fast_path:
            raise PlanError(f"fast_path=True but the plan does not qualify for the stage model: {why}")
    return compiled_simulator(graph, topology).evaluate(plan, objective, timeline=timeline)


def _min_tasks(graph: OpGraph, plan: Plan, objective: str = "step_time") -> int:
    """Lower bound on the full task graph's size: compute tasks of every node and microbatch."""
    m = 1 if objective == "latency" else plan.microbatches
    return graph.num_nodes * m * (1 if objective == "latency" else 2)
