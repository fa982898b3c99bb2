"""Demonstration replay (agent.imitation): driving the placement environment along a given plan."""

from __future__ import annotations

import pytest

from agent.imitation import demo_action, replay
from envs.errors import EnvError, RlplaceError
from envs.placement.env import PlacementEnv
from envs.plan import Plan, data_parallel_plan, megatron_plan
from envs.tasks import default_tasks


def test_demo_action_replays_expressible_plans_exactly():
    """Replaying a plan the option table can express gives that plan back (data parallel also on a
    coarsened graph; Megatron's per-op layouts only without coarsening, a group takes its majority)."""
    tasks = default_tasks("dgx-a100-80g", names=["gpt-small"])
    task = tasks[0]
    g = task.graph
    fine, coarse = PlacementEnv(tasks, max_nodes=g.num_nodes), PlacementEnv(tasks, max_nodes=16)
    for env, plan in ((coarse, data_parallel_plan(g, task.topology, global_batch=task.global_batch)),
                      (fine, data_parallel_plan(g, task.topology, global_batch=task.global_batch)),
                      (fine, megatron_plan(g, task.topology, tp=8, pp=1, dp=1, global_batch=task.global_batch))):
        env.reset(options={"task": task})
        done = False
        while not done:
            a = demo_action(env, plan)
            assert env.action_masks()[a]
            _, _, done, _, info = env.step(a)
        got = info["plan"]
        assert got.microbatches == plan.microbatches
        assert [tuple(x) for x in got.groups] == [tuple(x) for x in plan.groups]
        assert got.layouts == plan.layouts and (got.dp == plan.dp).all()
        demo = replay(env, task, plan, "test")  # the same episode, recorded
        assert demo.replay_time == info["step_time"] and len(demo.actions) == len(demo.obs) == len(demo.masks)


def test_demo_action_falls_back_to_the_closest_allowed_option():
    """A plan outside the option table (a 3-device group) is mapped to allowed options; bad sizes raise."""
    tasks = default_tasks("dgx-a100-80g", names=["mlp-chain"])
    env = PlacementEnv(tasks)
    g = tasks[0].graph
    odd = Plan(groups=[(0, 1, 2)] * g.num_nodes, layouts=["batch_split"] * g.num_nodes, dp=[3] * g.num_nodes,
               microbatches=1, global_batch=tasks[0].global_batch)
    with pytest.raises(RlplaceError, match="reset"):
        demo_action(env, odd)
    env.reset(options={"task": tasks[0]})
    done = False
    while not done:
        a = demo_action(env, odd)
        assert env.action_masks()[a]
        _, _, done, _, info = env.step(a)
    info["plan"].validate(g, tasks[0].topology)
    with pytest.raises(RlplaceError, match="reset"):  # the episode is over
        demo_action(env, odd)
    env.reset(options={"task": tasks[0]})
    with pytest.raises(EnvError):
        demo_action(env, Plan(groups=[(0,)] * 3, layouts=["single"] * 3, microbatches=1, global_batch=1))
