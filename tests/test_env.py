"""Specification of the Gymnasium placement environment ``rlplace/Placement-v0``."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest

import envs  # noqa: F401 - registers the environments
from envs.errors import EnvError, RlplaceError
from envs.evaluator import EvalResult, Evaluator, SimulatorEvaluator
from envs.examples import transformer_graph
from envs.features import decision_order
from envs.graph import OpGraph, chain_graph
from envs.placement_env import PlacementEnv, score
from envs.plan import single_device_plan
from envs.presets import preset
from envs.tasks import (
    Task,
    builtin_graph_factories,
    builtin_graph_names,
    default_tasks,
    graph_sampler,
    load_builtin_graph,
)


@pytest.fixture(scope="module")
def small_tasks():
    return default_tasks(names=["gpt-tiny", "mlp-chain", "moe-wide"])


def rollout(env, rng, check_mask=True):
    obs, info = env.reset()
    total, done, steps = 0.0, False, 0
    while not done:
        mask = env.action_masks()
        assert mask.any()
        assert np.array_equal(mask, obs["action_mask"] > 0)
        a = int(rng.choice(np.flatnonzero(mask)))
        obs, r, done, trunc, info = env.step(a)
        assert not trunc
        if check_mask:
            assert "invalid_action" not in info
        assert env.observation_space.contains(obs)
        total += r
        steps += 1
    return total, steps, info


# ---------------------------------------------------------------------- registration and conformance
def test_make_default_distribution():
    env = gym.make("rlplace/Placement-v0")
    obs, info = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    assert isinstance(env.action_space, gym.spaces.Discrete)
    assert info["task_id"] in {t.name for t in default_tasks()}
    assert set(builtin_graph_names()) >= {"gpt-tiny", "gpt-small", "mlp-chain", "branching-cnn", "moe-wide"}
    assert all(t.topology.name == default_tasks()[0].topology.name for t in default_tasks())
    env.close()


def test_gymnasium_env_checker(small_tasks):
    from gymnasium.utils.env_checker import check_env

    env = PlacementEnv(small_tasks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_env(env, skip_render_check=True)


def test_sb3_env_checker(small_tasks):
    from stable_baselines3.common.env_checker import check_env

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_env(PlacementEnv(small_tasks), warn=True)


def test_seeded_resets_are_reproducible():
    a, b = PlacementEnv(), PlacementEnv()
    for seed in (0, 1, 7):
        oa, ia = a.reset(seed=seed)
        ob, ib = b.reset(seed=seed)
        assert ia["task_id"] == ib["task_id"]
        for k in oa:
            np.testing.assert_array_equal(oa[k], ob[k], err_msg=k)
        oc, _ = a.reset(seed=seed)
        for k in oa:
            np.testing.assert_array_equal(oa[k], oc[k], err_msg=k)
    # the constructor seed seeds the first reset
    ids = [PlacementEnv(seed=3).reset()[1]["task_id"] for _ in range(2)]
    assert ids[0] == ids[1]


# ---------------------------------------------------------------------- episodes
@pytest.mark.parametrize("order", ["topological", "critical_path"])
def test_random_masked_rollouts_give_valid_plans(order):
    env = PlacementEnv(order=order, seed=0)
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(12):
        total, steps, info = rollout(env, rng)
        task = env.task
        assert steps == 3 + info["num_groups"]
        plan = info["plan"]
        assert plan.num_nodes == task.graph.num_nodes  # expanded to operators
        plan.validate(task.graph, task.topology)
        assert info["plan_json"]["format"] == "rlplace.plan"
        assert np.isclose(total, info["score"])
        expected = np.log(info["ref_time"] / info["step_time"])
        if not info["oom"]:
            assert np.isclose(info["score"], expected)
        assert info["peak_memory"].shape == (task.topology.num_devices,)
        seen.add(info["task_id"])
    assert len(seen) >= 3


def test_phases_and_intermediate_rewards(small_tasks):
    env = PlacementEnv(small_tasks[:1], microbatch_choices=(1, 2, 4, 8, 16))
    obs, info = env.reset(seed=0)
    assert info["phase"] == "microbatches"
    np.testing.assert_array_equal(np.flatnonzero(env.action_masks()), [0, 1, 2, 3])  # 16 does not divide 8
    for phase in ("schedule", "recompute", "place"):
        obs, r, done, _, info = env.step(int(np.flatnonzero(env.action_masks())[-1]))
        assert r == 0.0 and not done and info["phase"] == phase
    assert obs["current_node"].sum() == 1
    assert obs["phase"][3] == 1
    rng = np.random.default_rng(0)
    done = False
    while not done:
        obs, r, done, _, info = env.step(int(rng.choice(np.flatnonzero(env.action_masks()))))
        if not done:
            assert r == 0.0
    plan = info["plan"]
    assert plan.microbatches == 8 and plan.schedule == "1f1b" and plan.recompute.all()


def test_coarsened_task_expands_to_operators():
    g = load_builtin_graph("gpt-1.3b")
    env = PlacementEnv([Task(g, preset("dgx-a100-80g"))], max_nodes=32)
    total, steps, info = rollout(env, np.random.default_rng(1))
    assert info["num_groups"] <= 32 < g.num_nodes
    assert info["plan"].num_nodes == g.num_nodes and info["group_plan"].num_nodes == info["num_groups"]
    info["plan"].validate(g, preset("dgx-a100-80g"))


def test_invalid_action_is_replaced_by_an_allowed_one(small_tasks):
    env = PlacementEnv(small_tasks[:1])
    env.reset(seed=0)
    for _ in range(3):
        env.step(0)
    mask = env.action_masks()
    bad = int(np.flatnonzero(~mask)[0])
    _, _, _, _, info = env.step(bad)
    assert info["invalid_action"]


def test_refine_mode_rewards_telescope(small_tasks):
    env = PlacementEnv(small_tasks, mode="refine", refine_passes=2, seed=0)
    rng = np.random.default_rng(0)
    for _ in range(3):
        obs, info = env.reset()
        start = env._score
        assert obs["node_state"][: info["num_groups"], 0].all()  # a complete plan from the start
        total, steps, info = rollout_from(env, obs, rng)
        assert steps == 2 * info["num_groups"]
        assert np.isclose(total, info["score"] - start)
        info["plan"].validate(env.task.graph, env.task.topology)


def rollout_from(env, obs, rng):
    total, done, steps = 0.0, False, 0
    while not done:
        a = int(rng.choice(np.flatnonzero(env.action_masks())))
        obs, r, done, _, info = env.step(a)
        assert "invalid_action" not in info
        total += r
        steps += 1
    return total, steps, info


def test_refine_mode_reports_the_best_plan_it_visited(small_tasks):
    env = PlacementEnv(small_tasks, mode="refine", seed=1)
    ev = SimulatorEvaluator()
    rng = np.random.default_rng(1)
    for _ in range(3):
        obs, _ = env.reset()
        seen, done = [], False
        while not done:
            obs, _, done, _, info = env.step(int(rng.choice(np.flatnonzero(env.action_masks()))))
            seen.append((info["oom"], info["step_time"]))
        assert (info["best_oom"], info["best_step_time"]) == min(seen)
        res = ev.evaluate(env.task.graph, env.task.topology, info["best_plan"])
        assert np.isclose(res.step_time, info["best_step_time"])
        info["best_plan"].validate(env.task.graph, env.task.topology)


def test_refine_start_is_the_best_heuristic(small_tasks):
    env = PlacementEnv(small_tasks[:1], mode="refine")
    env.reset(seed=0)
    best = env._score
    for name in ("single_device", "data_parallel", "megatron"):
        e = PlacementEnv(small_tasks[:1], mode="refine", refine_init=name)
        e.reset(seed=0)
        assert e._score <= best + 1e-12


def test_critical_path_order_is_topological():
    g = load_builtin_graph("moe-wide")
    order = decision_order(g, "critical_path")
    pos = np.empty(g.num_nodes, dtype=int)
    pos[order] = np.arange(g.num_nodes)
    assert (pos[g.edge_src] < pos[g.edge_dst]).all()
    assert sorted(order.tolist()) == list(range(g.num_nodes))


# ---------------------------------------------------------------------- masks
def heavy_chain(n=4, state_gb=30.0):
    # bf16 params: states = params / 2 * 16 = 8 x param bytes
    return chain_graph(n, flops=1e12, param_bytes=state_gb * 1e9 / 8, act_bytes=1e6, kind="linear", batch_size=8)


def test_memory_mask_hides_devices_that_certainly_overflow():
    g = heavy_chain()
    env = PlacementEnv([Task(g, preset("dgx-a100-80g"))])
    env.reset(seed=0)
    for a in (0, 0, 0):  # 1 microbatch, gpipe, no recompute
        env.step(a)
    env.step(0)  # op0 on gpu0 (30 GB)
    assert env.action_masks()[0]  # 60 GB still fits
    env.step(0)
    mask = env.action_masks()
    assert not mask[0] and mask[1]  # 90 GB on gpu0 cannot fit; gpu1 can
    # a 4-way split of 30 GB fits next to the 60 GB on gpu0
    opts = env._p.options
    four = [o for o, g_ in enumerate(opts.groups) if g_ == (0, 1, 2, 3) and opts.state_div[o] == 4]
    assert four and all(mask[o] for o in four)


def test_colocated_nodes_follow_their_class():
    g = chain_graph(6, flops=1e12, param_bytes=1e6, act_bytes=1e6, batch_size=8)
    g.colocation = np.array([0, -1, 0, -1, -1, 0])
    env = PlacementEnv([Task(g, preset("dgx-a100-80g"))])
    env.reset(seed=0)
    for a in (0, 0, 0, 5):  # op0 on gpu5
        env.step(a)
    env.step(2)  # op1 on gpu2
    np.testing.assert_array_equal(np.flatnonzero(env.action_masks()), [5])
    rng = np.random.default_rng(0)
    done = False
    while not done:
        _, _, done, _, info = env.step(int(rng.choice(np.flatnonzero(env.action_masks()))))
    assert info["plan"].groups[0] == info["plan"].groups[2] == info["plan"].groups[5] == (5,)
    info["plan"].validate(g, preset("dgx-a100-80g"))


# ---------------------------------------------------------------------- rewards and evaluator
def test_score_and_oom_penalty():
    cap = np.array([10.0, 10.0])
    ok = EvalResult(step_time=0.5, peak_memory=np.array([5.0, 5.0]), memory_capacity=cap, oom=False)
    assert np.isclose(score(ok, 1.0), np.log(2.0))
    small = EvalResult(step_time=0.5, peak_memory=np.array([11.0, 5.0]), memory_capacity=cap, oom=True)
    big = EvalResult(step_time=0.5, peak_memory=np.array([40.0, 5.0]), memory_capacity=cap, oom=True)
    assert np.isclose(score(small, 1.0), -1 - np.log(1.1))
    assert score(big, 1.0) < score(small, 1.0) < -1
    slow = EvalResult(step_time=4.0, peak_memory=np.array([11.0, 5.0]), memory_capacity=cap, oom=True)
    assert score(slow, 1.0) < score(EvalResult(4.0, np.array([5.0, 5.0]), cap, False), 1.0)


def test_oom_plan_is_flagged_and_penalised():
    # 4 x 30 GB of stashed activations: the mask (model states only) allows all on gpu0, which overflows
    g = chain_graph(4, flops=1e12, param_bytes=1e6, act_bytes=30e9, batch_size=8)
    env = PlacementEnv([Task(g, preset("dgx-a100-80g"))])
    env.reset(seed=0)
    done = False
    while not done:
        assert env.action_masks()[0]
        _, r, done, _, info = env.step(0)
    assert "invalid_action" not in info
    assert info["oom"] and r < -1 and np.isclose(r, info["score"])
    assert info["peak_memory"][0] > info["memory_capacity"][0]


def test_simulator_evaluator_caches_by_plan_key():
    ev = SimulatorEvaluator()
    assert isinstance(ev, Evaluator)
    g, topo = load_builtin_graph("gpt-tiny"), preset("dgx-a100-80g")
    r1 = ev.evaluate(g, topo, single_device_plan(g, topo))
    r2 = ev.evaluate(g, topo, single_device_plan(g, topo))
    assert r1 is r2 and ev.hits == 1 and ev.misses == 1
    assert r1.step_time > 0 and not r1.oom


def test_custom_evaluator_is_used(small_tasks):
    class Flat:
        calls = 0

        def evaluate(self, graph, topology, plan, objective="step_time"):
            Flat.calls += 1
            nd = topology.num_devices
            return EvalResult(step_time=1.0, peak_memory=np.zeros(nd), memory_capacity=np.ones(nd), oom=False)

    env = PlacementEnv(small_tasks[:1], evaluator=Flat())
    total, _, info = rollout(env, np.random.default_rng(0))
    assert info["step_time"] == 1.0 and np.isclose(total, 0.0) and Flat.calls >= 2


# ---------------------------------------------------------------------- bad input
def test_bad_input_fails_at_construction():
    topo = preset("dgx-a100-80g")
    big = transformer_graph(layers=8, hidden=256, heads=4, seq=128, vocab=1000, batch=8)
    with pytest.raises(EnvError, match="max_nodes"):
        PlacementEnv([Task(big, topo)], max_nodes=16, coarsen=False)
    with pytest.raises(EnvError, match="max_devices"):
        PlacementEnv([Task(big, preset("a100-80g-cluster:nodes=2"))], max_devices=8)
    huge = heavy_chain(n=8, state_gb=100.0)  # 800 GB of model states > 8 x 80 GB
    with pytest.raises(EnvError, match="no plan fits"):
        PlacementEnv([Task(huge, topo)])
    with pytest.raises(EnvError, match="no device holds"):
        PlacementEnv([Task(chain_graph(2, param_bytes=200e9 / 8, batch_size=8, kind="layernorm"), topo)])
    with pytest.raises(EnvError, match="microbatch"):
        PlacementEnv([Task(big, topo, batch=3)], microbatch_choices=(2, 4))
    with pytest.raises(EnvError, match="max_devices"):  # a sampler's first draw is probed
        PlacementEnv(graph_sampler([big], ["a100-80g-cluster:nodes=2"]))
    with pytest.raises(EnvError):
        PlacementEnv(mode="bogus")
    assert issubclass(EnvError, RlplaceError)


def test_callable_sampler_draws_per_reset():
    graphs = [load_builtin_graph(n) for n in ("gpt-tiny", "branching-cnn")]
    env = PlacementEnv(graph_sampler(graphs, ["dgx-a100-80g", "pcie-4gpu"]), seed=0)
    names = set()
    for s in range(10):
        _, info = env.reset(seed=s)
        names.add(info["task_id"])
    assert len(names) >= 3


def test_builtin_graphs_match_their_generators():
    for name, make in builtin_graph_factories().items():
        shipped, fresh = load_builtin_graph(name), make()
        assert isinstance(shipped, OpGraph)
        assert shipped.names == fresh.names
        np.testing.assert_allclose(shipped.fwd_flops, fresh.fwd_flops)
        np.testing.assert_allclose(shipped.param_bytes, fresh.param_bytes)


# ---------------------------------------------------------------------- vectorised and learning
def _make_small():
    return PlacementEnv(default_tasks(names=["gpt-tiny", "mlp-chain"]))


def test_subproc_vec_env():
    from stable_baselines3.common.vec_env import SubprocVecEnv

    venv = SubprocVecEnv([_make_small, _make_small], start_method="fork")
    try:
        venv.seed(0)
        obs = venv.reset()
        assert obs["node_features"].shape[0] == 2
        for _ in range(5):
            masks = np.stack(venv.env_method("action_masks"))
            acts = [int(np.flatnonzero(m)[0]) for m in masks]
            obs, rew, dones, infos = venv.step(np.array(acts))
            assert all("task_id" in i for i in infos)
    finally:
        venv.close()


def test_maskable_ppo_smoke():
    from sb3_contrib import MaskablePPO

    model = MaskablePPO("MultiInputPolicy", _make_small(), n_steps=64, batch_size=32, n_epochs=1, seed=0,
                        device="cpu", policy_kwargs={"net_arch": [32]})
    model.learn(128)


# ---------------------------------------------------------------------- option table and multi-host
def test_option_table_layouts_and_mixed_parallelism():
    from envs.features import OptionTable

    topo = preset("a100-80g-cluster:nodes=2")
    opts = OptionTable.build(topo)
    look = opts.lookup()
    assert all(((d,), "single", 1) in look for d in range(16))
    assert ((0, 1, 2, 3), "batch_split", 4) in look and ((0, 1, 2, 3), "col_split", 1) in look
    whole = tuple(range(16))
    assert (whole, "batch_split", 16) in look
    # across hosts: tensor parallel inside each host (tp = 8), data parallel across the 2 hosts
    assert (whole, "row_split", 2) in look and (whole, "col_split", 16) not in look
    caps = np.array([1 | 8, 1 | 2 | 4 | 8, 1 | 2 | 8, 0, 1])
    ok = opts.allowed(caps)
    lay = np.array(["single", "batch_split", "col_split", "row_split", "replicate"])[opts.layout]
    assert not ok[0, lay == "col_split"].any() and ok[1].all()
    assert not ok[2, lay == "row_split"].any() and ok[2, lay == "col_split"].all()
    assert ok[3, lay == "single"].all() and not ok[3, opts.dp > 1].any()
    assert not ok[3, lay != "single"].any()  # caps 0: one device only, no replicate either
    assert not ok[4, lay == "replicate"].any() and ok[4, lay == "batch_split"].all()


def test_multi_host_rollouts_are_valid():
    env = PlacementEnv(default_tasks("a100-80g-cluster:nodes=2", names=["gpt-small", "moe-wide"]), max_devices=16)
    rng = np.random.default_rng(3)
    for _ in range(4):
        _, _, info = rollout(env, rng)
        info["plan"].validate(env.task.graph, env.task.topology)
        assert env.observation_space["node_devices"].shape == (64, 16)


def test_observations_are_fresh_arrays(small_tasks):
    env = PlacementEnv(small_tasks[:1])
    o1, _ = env.reset(seed=0)
    o2, *_ = env.step(0)
    assert all(not np.shares_memory(o1[k], o2[k]) for k in o1)


def test_fine_evaluation_of_coarsened_tasks():
    g = load_builtin_graph("gpt-medium")
    env = PlacementEnv([Task(g, preset("dgx-a100-80g"))], max_nodes=24, eval_graph="fine")
    _, _, info = rollout(env, np.random.default_rng(0))
    assert info["num_groups"] <= 24
    from envs.simulator import simulate

    rep = simulate(g, preset("dgx-a100-80g"), info["plan"], timeline=False)
    assert np.isclose(rep.step_time, info["step_time"])


# ---------------------------------------------------------------------- demonstrations
def test_demo_action_replays_expressible_plans_exactly():
    """Replaying a plan the option table can express gives that plan back (data parallel also on a
    coarsened graph; Megatron's per-op layouts only without coarsening, a group takes its majority)."""
    from envs.plan import data_parallel_plan, megatron_plan

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
            a = env.demo_action(plan)
            assert env.action_masks()[a]
            _, _, done, _, info = env.step(a)
        got = info["plan"]
        assert got.microbatches == plan.microbatches
        assert [tuple(x) for x in got.groups] == [tuple(x) for x in plan.groups]
        assert got.layouts == plan.layouts and (got.dp == plan.dp).all()


def test_demo_action_falls_back_to_the_closest_allowed_option():
    """A plan outside the option table (a 3-device group) is mapped to allowed options; bad sizes raise."""
    from envs.plan import Plan

    tasks = default_tasks("dgx-a100-80g", names=["mlp-chain"])
    env = PlacementEnv(tasks)
    g = tasks[0].graph
    odd = Plan(groups=[(0, 1, 2)] * g.num_nodes, layouts=["batch_split"] * g.num_nodes, dp=[3] * g.num_nodes,
               microbatches=1, global_batch=tasks[0].global_batch)
    env.reset(options={"task": tasks[0]})
    done = False
    while not done:
        a = env.demo_action(odd)
        assert env.action_masks()[a]
        _, _, done, _, info = env.step(a)
    info["plan"].validate(g, tasks[0].topology)
    env.reset(options={"task": tasks[0]})
    with pytest.raises(EnvError):
        env.demo_action(Plan(groups=[(0,)] * 3, layouts=["single"] * 3, microbatches=1, global_batch=1))
