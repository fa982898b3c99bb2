"""Measured rewards (profilers.measured_evaluator)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from envs.evaluator import PlanEvaluator
from envs.plan import megatron_plan, single_device_plan
from envs.presets import cpu_local
from profilers.execution_layout import WorkerError
from profilers.measured_evaluator import MeasuredEvaluator
from profilers.rank_program import FAIL_ENV
from profilers.spec import graph_from_spec

MLP = "mlp:layers=2,hidden=16,in_dim=8,out=4,batch=8"


@pytest.fixture(scope="module")
def topo():
    return cpu_local(2)


@pytest.fixture(scope="module")
def graph():
    return graph_from_spec(MLP, dtype="fp32")


def test_measured_evaluation_is_cached_and_refusals_are_flagged(graph, topo):
    with MeasuredEvaluator(MLP, steps=2, warmup=1, workers=2, timeout=60) as ev:
        assert isinstance(ev, PlanEvaluator)
        plan = megatron_plan(graph, topo, dp=2, dtype="fp32")
        first = ev.evaluate(graph, topo, plan)
        assert ev.measurements == 1 and first.extra["measured"] and not first.oom
        assert first.value > 0 and len(first.extra["step_times"]) == 2 and first.extra["dp"] == 2
        again = ev.evaluate(graph, topo, plan.copy())  # same decisions, another object: not re-measured
        assert again is first and ev.measurements == 1 and ev.hits == 1
        single = ev.evaluate(graph, topo, single_device_plan(graph, topo, dtype="fp32"))
        assert ev.measurements == 2 and single.extra["world_size"] == 1  # a sub-group of the 2-rank pool
        bad = single_device_plan(graph, topo, dtype="fp32")
        bad.groups[graph.names.index("layers.0.act")] = (1,)  # a pipeline cut inside a block
        res = ev.evaluate(graph, topo, bad)
        assert ev.measurements == 2  # refused without running anything
        assert res.extra["refused"] and "cuts inside block" in res.extra["reason"]
        assert res.oom and res.overflow >= 2.0 and np.isfinite(res.value)
        assert ev.pool_starts == 1


def test_worker_crash_and_hang_are_clear_errors_then_the_pool_restarts(graph, topo, monkeypatch):
    plan = megatron_plan(graph, topo, dp=2, dtype="fp32")
    ev = MeasuredEvaluator(MLP, steps=1, warmup=0, workers=2, timeout=6, collective_timeout=30)
    try:
        monkeypatch.setenv(FAIL_ENV, "1")
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match="rank 1 failed: .*injected failure"):
            ev.evaluate(graph, topo, plan)
        monkeypatch.setenv(FAIL_ENV, "1:hang")
        with pytest.raises(WorkerError, match="did not finish within 6 s"):
            ev.evaluate(graph, topo, plan)
        assert time.monotonic() - t0 < 40
        monkeypatch.delenv(FAIL_ENV)
        assert ev.evaluate(graph, topo, plan).extra["measured"]  # a fresh pool
        assert ev.pool_starts == 3
    finally:
        ev.close()


def test_tiny_training_run_with_measured_rewards(graph, topo):
    from sb3_contrib import MaskablePPO

    from envs.placement.env import PlacementEnv
    from envs.tasks import Task

    t0 = time.monotonic()
    with MeasuredEvaluator(MLP, steps=2, warmup=1, workers=2, timeout=60) as ev:
        env = PlacementEnv([Task(graph, topo)], max_nodes=8, max_devices=2, evaluator=ev, seed=0)
        model = MaskablePPO("MultiInputPolicy", env, n_steps=16, batch_size=16, seed=0, verbose=0)
        model.learn(32)
        assert ev.misses >= 2 and ev.measurements + ev.refusals == ev.misses
    assert time.monotonic() - t0 < 60
