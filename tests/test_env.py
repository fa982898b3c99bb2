"""Specification of the Gymnasium placement environment ``rlplace/Placement-v0``."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import envs.placement  # noqa: F401 - registers the environments
from envs.errors import EnvError, RlplaceError
from envs.evaluator import CachedSimulation, EvalResult, PlanEvaluator
from envs.examples import transformer_graph
from envs.graph import DTYPE_BYTES, OpGraph, chain_graph
from envs.placement.env import PlacementEnv
from envs.placement.observation import DYNAMIC_KEYS, OBSERVATION, STATIC_KEYS, DynamicState
from envs.placement.options import (
    MODIFIERS,
    N_MODIFIERS,
    OptionTable,
    action_of,
    decision_order,
    split_action,
)
from envs.placement.reward import plan_reward
from envs.plan import ADAM_MIXED_BYTES_PER_PARAM, single_device_plan, stage_cuts
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
        plan = info["plan"]
        assert steps == 2 + info["num_groups"] + (plan.virtual_stages > 1 or steps == 3 + info["num_groups"])
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
    for phase in ("schedule", "place"):
        obs, r, done, _, info = env.step(int(np.flatnonzero(env.action_masks())[-1]))
        assert r == 0.0 and not done and info["phase"] == phase
    assert obs["current_node"].sum() == 1
    assert obs["phase"][2] == 1
    rng = np.random.default_rng(0)
    done = False
    while not done:
        obs, r, done, _, info = env.step(int(rng.choice(np.flatnonzero(env.action_masks()))))
        if not done:
            assert r == 0.0
    plan = info["plan"]
    assert plan.microbatches == 8 and plan.schedule == "1f1b"


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
    bad = int(np.flatnonzero(~mask[:env.prepared.num_actions])[0])
    _, _, _, _, info = env.step(bad)
    assert info["invalid_action"]


def test_refine_mode_rewards_telescope(small_tasks):
    env = PlacementEnv(small_tasks, mode="refine", refine_passes=2, seed=0)
    rng = np.random.default_rng(0)
    for _ in range(3):
        obs, info = env.reset()
        start = env.current_plan_reward
        assert obs["node_state"][: info["num_groups"], 0].all()  # a complete plan from the start
        total, steps, info = rollout_from(env, obs, rng)
        assert steps - 2 * info["num_groups"] in (2, 3)  # microbatches, schedule, [virtual stages]
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
    ev = CachedSimulation()
    rng = np.random.default_rng(1)
    for _ in range(3):
        obs, _ = env.reset()
        start = env.prepared.start.result
        seen, done = [(bool(start.oom), float(start.value))], False  # the start counts as visited
        while not done:
            obs, _, done, _, info = env.step(int(rng.choice(np.flatnonzero(env.action_masks()))))
            seen.append((info["oom"], info["step_time"]))
        assert (info["best_oom"], info["best_step_time"]) == min(seen)
        res = ev.evaluate(env.task.graph, env.task.topology, info["best_plan"])
        assert np.isclose(res.value, info["best_step_time"])
        info["best_plan"].validate(env.task.graph, env.task.topology)


def test_refine_start_is_the_best_heuristic(small_tasks):
    env = PlacementEnv(small_tasks[:1], mode="refine")
    env.reset(seed=0)
    best = env.current_plan_reward
    assert best == env.prepared.start.reward
    for name in ("single_device", "data_parallel", "megatron"):
        e = PlacementEnv(small_tasks[:1], mode="refine", refine_init=name)
        e.reset(seed=0)
        assert e.current_plan_reward <= best + 1e-12
        assert e.prepared.start.name.startswith(name.replace("_", " ") if name == "megatron" else name)


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
    for a in (0, 0):  # 1 microbatch, gpipe
        env.step(a)
    env.step(action_of(0))  # op0 on gpu0 (30 GB)
    assert env.action_masks()[action_of(0)]  # 60 GB still fits
    env.step(action_of(0))
    mask = env.action_masks()
    assert not mask[action_of(0)] and mask[action_of(1)]  # 90 GB on gpu0 cannot fit; gpu1 can
    # a 4-way split of 30 GB fits next to the 60 GB on gpu0
    opts = env.prepared.options
    four = [o for o, g_ in enumerate(opts.groups) if g_ == (0, 1, 2, 3) and opts.state_div[o] == 4]
    assert four and all(mask[action_of(o)] for o in four)
    # so does ZeRO-3 over 4 data-parallel replicas (30 GB / 4 per device), not ZeRO-0 or 1
    dp4 = next(o for o, g_ in enumerate(opts.groups) if g_ == (0, 1, 2, 3) and opts.dp[o] == 4)
    by_zero = {m.zero: k for k, m in enumerate(MODIFIERS) if m.recompute == "none" and not m.expert_parallel}
    assert mask[action_of(dp4, by_zero[3])] and not mask[action_of(dp4, by_zero[0])]


def test_colocated_nodes_follow_their_class():
    g = chain_graph(6, flops=1e12, param_bytes=1e6, act_bytes=1e6, batch_size=8)
    g.colocation = np.array([0, -1, 0, -1, -1, 0])
    env = PlacementEnv([Task(g, preset("dgx-a100-80g"))])
    env.reset(seed=0)
    for a in (0, 0, action_of(5)):  # op0 on gpu5
        env.step(a)
    env.step(action_of(2))  # op1 on gpu2
    np.testing.assert_array_equal(np.flatnonzero(env.action_masks()), [action_of(5)])
    rng = np.random.default_rng(0)
    done = False
    while not done:
        _, _, done, _, info = env.step(int(rng.choice(np.flatnonzero(env.action_masks()))))
    assert info["plan"].groups[0] == info["plan"].groups[2] == info["plan"].groups[5] == (5,)
    info["plan"].validate(g, preset("dgx-a100-80g"))


# ---------------------------------------------------------------------- rewards and evaluator
def test_plan_reward_and_oom_penalty():
    cap = np.array([10.0, 10.0])
    ok = EvalResult(value=0.5, peak_memory=np.array([5.0, 5.0]), memory_capacity=cap, oom=False)
    assert np.isclose(plan_reward(ok, 1.0), np.log(2.0))
    small = EvalResult(value=0.5, peak_memory=np.array([11.0, 5.0]), memory_capacity=cap, oom=True)
    big = EvalResult(value=0.5, peak_memory=np.array([40.0, 5.0]), memory_capacity=cap, oom=True)
    assert np.isclose(plan_reward(small, 1.0), -1 - np.log(1.1))
    assert plan_reward(big, 1.0) < plan_reward(small, 1.0) < -1
    slow = EvalResult(value=4.0, peak_memory=np.array([11.0, 5.0]), memory_capacity=cap, oom=True)
    assert plan_reward(slow, 1.0) < plan_reward(EvalResult(4.0, np.array([5.0, 5.0]), cap, False), 1.0)


def test_oom_plan_is_flagged_and_penalised():
    # 4 x 30 GB of stashed activations: the mask (model states only) allows all on gpu0, which overflows
    g = chain_graph(4, flops=1e12, param_bytes=1e6, act_bytes=30e9, batch_size=8)
    env = PlacementEnv([Task(g, preset("dgx-a100-80g"))])
    env.reset(seed=0)
    done = False
    while not done:
        assert env.action_masks()[0]
        _, r, done, _, info = env.step(0)  # gpu0, no modifier (and 1 microbatch, GPipe)
    assert "invalid_action" not in info
    assert info["oom"] and r < -1 and np.isclose(r, info["score"])
    assert info["peak_memory"][0] > info["memory_capacity"][0]


def test_cached_simulation_caches_by_plan_key():
    ev = CachedSimulation()
    assert isinstance(ev, PlanEvaluator)
    g, topo = load_builtin_graph("gpt-tiny"), preset("dgx-a100-80g")
    r1 = ev.evaluate(g, topo, single_device_plan(g, topo))
    r2 = ev.evaluate(g, topo, single_device_plan(g, topo))
    assert r1 is r2 and ev.hits == 1 and ev.misses == 1
    assert r1.value > 0 and not r1.oom


def test_custom_evaluator_is_used(small_tasks):
    class Flat:
        calls = 0

        def evaluate(self, graph, topology, plan, objective="step_time"):
            Flat.calls += 1
            nd = topology.num_devices
            return EvalResult(value=1.0, peak_memory=np.zeros(nd), memory_capacity=np.ones(nd), oom=False)

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
    one_device = chain_graph(2, param_bytes=200e9 / 8, batch_size=8, kind="layernorm")
    one_device.layout_caps[:] = 0  # no split of any kind, so no ZeRO either
    with pytest.raises(EnvError, match="no device holds"):
        PlacementEnv([Task(one_device, topo)])
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


def test_graph_policy_trains_on_a_tiny_task():
    """A few hundred PPO steps of rlplace's own GraphPlacementPolicy on one tiny task: the run reaches its
    step count with finite losses, every parameter tensor moved (each module is reached by the loss and
    updated by the optimiser) and stays finite, and the greedy plan is valid, with the reward and time
    that a fresh simulation of it gives."""
    import torch as th
    from sb3_contrib import MaskablePPO

    from agent.infer import rollout
    from agent.policy import GraphPlacementPolicy

    task = default_tasks("pcie-4gpu", names=["gpt-tiny"])[0]
    env = PlacementEnv([task], max_nodes=8, max_devices=4, seed=0)
    model = MaskablePPO(GraphPlacementPolicy, env, n_steps=64, batch_size=32, n_epochs=2, seed=0, device="cpu",
                        policy_kwargs={"hidden": 16, "rounds": 1, "device_rounds": 1, "prior": (-1.0, -4.0, 3.0)})
    before = {k: v.detach().clone() for k, v in model.policy.named_parameters()}
    model.learn(256)
    assert model.num_timesteps == 256
    logged = model.logger.name_to_value  # the last update's losses (recorded after the last log dump)
    for key in ("train/loss", "train/value_loss", "train/policy_gradient_loss", "train/entropy_loss"):
        assert np.isfinite(logged[key]), key
    after = dict(model.policy.named_parameters())
    assert set(after) == set(before)
    assert [k for k, v in after.items() if th.equal(v, before[k])] == []
    assert all(th.isfinite(v).all() for v in after.values())
    info = rollout(model, env, task, deterministic=True)
    info["plan"].validate(task.graph, task.topology)
    res = CachedSimulation().evaluate(task.graph, task.topology, info["plan"])
    assert np.isclose(res.value, info["step_time"])
    assert np.isclose(plan_reward(res, env.reference()["time"]), info["score"])


# ---------------------------------------------------------------------- option table and multi-host
def test_option_table_layouts_and_mixed_parallelism():
    topo = preset("a100-80g-cluster:nodes=2")
    opts = OptionTable.build(topo)
    look = opts.lookup()
    assert all(((d,), "single", 1) in look for d in range(16))
    assert ((0, 1, 2, 3), "batch_split", 4) in look and ((0, 1, 2, 3), "col_split", 1) in look
    assert ((0, 1, 2, 3), "col_split", 2) in look and ((0, 1, 2, 3), "seq_split", 1) in look  # tp 2 x dp 2, tp 4
    whole = tuple(range(16))
    assert (whole, "batch_split", 16) in look
    # across hosts: tensor parallel inside each host (tp = 2, 4 or 8), data parallel across and beside it
    assert (whole, "row_split", 2) in look and (whole, "row_split", 8) in look and (whole, "col_split", 1) not in look
    assert sorted(int(t) for g_, t in zip(opts.groups, opts.tp) if g_ == whole) == [1] + [2] * 4 + [4] * 4 + [8] * 4
    caps = np.array([1 | 8, 1 | 2 | 4 | 8, 1 | 2 | 8, 0, 1])
    ok = opts.allowed(caps, seq_ok=np.array([False, True, False, False, False]))
    lay = np.array(["single", "batch_split", "col_split", "row_split", "replicate", "seq_split"])[opts.layout]
    assert not ok[0, lay == "col_split"].any() and ok[1].all() and not ok[2, lay == "seq_split"].any()
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
    assert split_action(action_of(7, 3)) == (7, 3) and N_MODIFIERS == len(MODIFIERS)
    o2, *_ = env.step(0)
    assert all(not np.shares_memory(o1[k], o2[k]) for k in o1)


def test_fine_evaluation_of_coarsened_tasks():
    g = load_builtin_graph("gpt-medium")
    env = PlacementEnv([Task(g, preset("dgx-a100-80g"))], max_nodes=24, eval_graph="fine")
    _, _, info = rollout(env, np.random.default_rng(0))
    assert info["num_groups"] <= 24
    from envs.sim import simulate

    rep = simulate(g, preset("dgx-a100-80g"), info["plan"], timeline=False)
    assert np.isclose(rep.value, info["step_time"])


# ---------------------------------------------------------------------- the observation declaration
def test_static_and_dynamic_keys_are_declared_once(small_tasks):
    """The observation space, the static features and the dynamic state all follow OBSERVATION: static
    and dynamic keys partition the space, static arrays never change during an episode, and every
    array has its declared padded shape."""
    assert not set(STATIC_KEYS) & set(DYNAMIC_KEYS)
    assert tuple(OBSERVATION) == STATIC_KEYS + DYNAMIC_KEYS
    env = PlacementEnv(small_tasks, mode="place", seed=0)
    assert set(env.observation_space.spaces) == set(OBSERVATION)
    for task in small_tasks:
        obs, _ = env.reset(options={"task": task})
        assert tuple(env.prepared.static) == STATIC_KEYS
        first = obs
        done = False
        while not done:
            obs, _, done, _, _ = env.step(int(np.flatnonzero(env.action_masks())[0]))
            for k in STATIC_KEYS:
                np.testing.assert_array_equal(obs[k], first[k], err_msg=k)
            assert all(obs[k].shape == env.observation_space[k].shape for k in OBSERVATION)
    dyn = DynamicState(8, 4, 48, len(env.microbatch_choices))
    assert tuple(dyn.arrays()) == DYNAMIC_KEYS


def test_shipped_policy_was_trained_on_this_observation_space():
    """The observation space pickled in the shipped policy equals the environment's at its padding."""
    from agent.infer import load_policy, model_shape

    model = load_policy()
    env = PlacementEnv(default_tasks(names=["gpt-tiny"]), **model_shape(model),
                       microbatch_choices=model.episode_kwargs["microbatch_choices"])
    assert model.observation_space == env.observation_space
    assert model.action_space == env.action_space


def test_trimming_follows_the_declared_axes(small_tasks):
    """The rollouts drop padded node / edge / device / placement slots (padded placements are the last
    ones, so the action indices of the others are unchanged) by each key's declared axes."""
    from agent.infer import padding_sizes, trim_to

    def trim_padding(obs, dynamic_only=False):
        return trim_to(obs, padding_sizes(obs), DYNAMIC_KEYS if dynamic_only else obs)

    env = PlacementEnv(small_tasks[:1], max_nodes=64, max_devices=16)
    obs, info = env.reset(seed=0)
    n, m, d = info["num_groups"], env.graph.num_edges, env.task.topology.num_devices
    full = trim_padding(obs)
    assert set(full) == set(OBSERVATION)
    assert full["node_features"].shape[0] == n and full["node_devices"].shape == (n, d)
    assert full["edge_index"].shape == (2, m) and full["device_bandwidth"].shape == (d, d)
    p = env.prepared.options.size  # padded placements are the last: trimming keeps every action index
    assert full["option_devices"].shape == (p, d) and full["action_mask"].shape == (p * N_MODIFIERS,)
    np.testing.assert_array_equal(full["action_mask"], obs["action_mask"][:p * N_MODIFIERS])
    assert not obs["action_mask"][p * N_MODIFIERS:].any()
    assert tuple(trim_padding(obs, dynamic_only=True)) == DYNAMIC_KEYS


# ---------------------------------------------------------------------- imports and registration
REPO = Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=240)


def test_world_model_imports_without_gymnasium():
    """Errors and plain data types (and the presets and tasks) import without gymnasium."""
    r = _python("import sys\n"
                "import envs.errors, envs.graph, envs.plan, envs.topology, envs.files, envs.schema, envs.presets, "
                "envs.tasks\n"
                "assert 'gymnasium' not in sys.modules, sorted(m for m in sys.modules if m.startswith('gym'))\n")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("imports, env_id", [
    ("import envs.placement; import gymnasium as gym", "rlplace/Placement-v0"),
    ("import gymnasium as gym; import envs.placement", "rlplace/Placement-v0"),
    ("import gymnasium as gym", "envs.placement:rlplace/Placement-v0"),  # a fresh (e.g. spawned) process
])
def test_gym_make_in_a_fresh_process(imports, env_id):
    r = _python(f"{imports}\n"
                "from envs.tasks import default_tasks\n"
                f"env = gym.make({env_id!r}, tasks=default_tasks(names=['gpt-tiny']))\n"
                "obs, info = env.reset(seed=0)\n"
                "assert env.observation_space.contains(obs) and info['task_id'] == 'gpt-tiny@dgx-a100-80g'\n")
    assert r.returncode == 0, r.stderr


def test_microbatch_choices_stand_for_the_nearest_divisor_of_the_batch():
    from envs.placement.task_setup import microbatch_counts

    np.testing.assert_array_equal(microbatch_counts(488, (1, 2, 4, 8, 16, 32, 64, 128, 256)),
                                  [1, 2, 4, 8, 0, 61, 0, 122, 244])  # 488 = 8 x 61: 16 is 8 again, 32 and 64 61
    np.testing.assert_array_equal(microbatch_counts(3, (2, 4)), [3, 0])
    np.testing.assert_array_equal(microbatch_counts(64, (1, 2, 4, 128)), [1, 2, 4, 64])
    env = PlacementEnv([Task(load_builtin_graph("gpt-tiny"), preset("pcie-4gpu"), batch=488)],
                       microbatch_choices=(1, 2, 4, 8, 16, 32, 64, 128))
    env.reset(seed=0)
    assert env.prepared.mb_counts.tolist() == [1, 2, 4, 8, 0, 61, 0, 122]
    np.testing.assert_array_equal(np.flatnonzero(env.action_masks()), [0, 1, 2, 3, 5, 7])


def test_default_microbatch_choices_leave_no_gap_that_data_parallelism_cannot_split():
    """Between any two neighbouring counts of the defaults that split a batch over two data-parallel
    replicas there is at most a factor 2.5 (powers of two alone: batch 240 on 2 replicas has 8, then 30,
    since 16 microbatches of 15 do not split; Megatron's fewest that fit memory can be 10-15)."""
    from envs.placement.observation import MICROBATCH_CHOICES
    from envs.placement.task_setup import microbatch_counts

    for batch in (240, 96, 384, 1000, 992, 72, 360):
        counts = sorted(int(m) for m in microbatch_counts(batch, MICROBATCH_CHOICES) if m and (batch // m) % 2 == 0)
        gaps = [b / a for a, b in zip(counts, counts[1:])]
        assert max(gaps) <= 2.5, (batch, counts)
    assert 12 in microbatch_counts(240, MICROBATCH_CHOICES).tolist()


def test_kind_groups_are_placements_beside_the_hierarchy():
    """A host's GPUs without its CPU, and all GPUs across hosts, are placements (hetero: 4 V100 + 2 T4 +
    a CPU)."""
    opts = OptionTable.build(preset("hetero"))
    look = opts.lookup()
    kinds = [d.kind for d in preset("hetero").devices]
    gpus = tuple(i for i, k in enumerate(kinds) if k != "cpu")
    assert any(g == gpus or set(g) == set(gpus) for g in opts.groups) or len(set(kinds)) > 2
    by_kind = {}
    for i, k in enumerate(kinds):
        by_kind.setdefault(k, []).append(i)
    for members in by_kind.values():
        if len(members) > 1:
            assert (tuple(members), "batch_split", len(members)) in look


def test_refine_without_step_evaluation_simulates_the_final_plan_only(small_tasks):
    """evaluate_steps=False (fast inference): the same actions give the same final plan and score, with
    one simulation for the episode's steps instead of one per step."""
    runs = {}
    for flag in (True, False):
        ev = CachedSimulation()
        env = PlacementEnv(small_tasks[:1], mode="refine", evaluator=ev, evaluate_steps=flag)
        env.reset(seed=0)
        before = ev.misses
        rng = np.random.default_rng(5)
        total, done = 0.0, False
        while not done:
            _, r, done, _, info = env.step(int(rng.choice(np.flatnonzero(env.action_masks()))))
            total += r
        runs[flag] = (info, total, ev.misses - before)
    (slow, t_slow, n_slow), (fast, t_fast, n_fast) = runs[True], runs[False]
    assert fast["plan"].key() == slow["plan"].key() and np.isclose(fast["score"], slow["score"])
    assert np.isclose(t_fast, t_slow)  # the rewards telescope either way
    assert n_fast <= 1 < n_slow
    assert (fast["best_oom"], fast["best_step_time"]) >= (slow["best_oom"], slow["best_step_time"])  # fewer seen


def test_refine_episode_from_a_given_plan(small_tasks):
    """reset(options={"start": plan}) starts a refine episode from that plan as the action table
    expresses it: a data-parallel plan the table expresses is the start exactly."""
    from envs.plan import data_parallel_plan

    task = small_tasks[0]
    env = PlacementEnv([task], mode="refine")
    plan = data_parallel_plan(task.graph, task.topology, global_batch=task.global_batch)
    env.reset(options={"task": task, "start": plan})
    res = CachedSimulation().evaluate(task.graph, task.topology, plan)
    assert np.isclose(env.current_plan_reward, plan_reward(res, env.reference()["time"]))
    start_plan = env._current_plan()
    assert start_plan.groups == plan.groups and start_plan.layouts == plan.layouts
    done = False
    while not done:
        _, _, done, _, info = env.step(int(env.assignment[env.node]) if env.node is not None
                                       else int(np.flatnonzero(env.action_masks())[0]))
    assert info["best_step_time"] <= CachedSimulation().evaluate(task.graph, task.topology, plan).value + 1e-12


def test_refine_episode_from_the_runner_up_start():
    """reset(options={"start": "runner-up"}) starts from the best template start that places the groups
    otherwise than the usual start (not only another ZeRO stage or recomputation), scored as refine_start
    scored it; any other string is one clear error."""
    from envs.placement.env import RUNNER_UP

    env = PlacementEnv(default_tasks("dgx-a100-80g", names=["gpt-tiny"]), mode="refine", max_nodes=40)
    env.reset(seed=0)
    p = env.prepared
    best, runner = p.start, p.runner_up
    assert runner is not None and runner.reward <= best.reward
    assert (runner.assign // N_MODIFIERS != best.assign // N_MODIFIERS).any()
    env.reset(options={"start": RUNNER_UP})
    assert np.array_equal(env.assignment, runner.assign)
    assert np.isclose(env.current_plan_reward, runner.reward)
    env.reset(options={"start": None})
    assert np.array_equal(env.assignment, best.assign)
    with pytest.raises(EnvError, match="runner-up"):
        env.reset(options={"start": "second"})


def test_pipeline_starts_cut_the_order_into_balanced_stages_on_the_fastest_devices():
    from envs.placement.task_setup import pipeline_assignments, single_device_times, start_assignments

    env = PlacementEnv(default_tasks("dgx-a100-80g", names=["gpt-tiny"]), mode="refine", max_nodes=40)
    env.reset(seed=0)
    prep = env.prepared
    starts = pipeline_assignments(prep)
    even = ["pipeline 2 stages", "pipeline 4 stages", "pipeline 8 stages"]  # 8 equal GPUs
    assert set(even) <= set(starts) <= set(even) | {f"{k} min-max" for k in even}
    single, _, tau = single_device_times(prep)
    order = prep.graph.topological_order()
    for name, assign in starts.items():
        k = int(name.split()[1])
        assert (assign % N_MODIFIERS == 0).all()
        device = np.searchsorted(single, assign[order] // N_MODIFIERS)
        assert (np.diff(device) >= 0).all() and np.unique(device).size == k  # contiguous, in device order
        load = np.bincount(device, weights=tau[order, 0], minlength=k)
        assert load.max() < 1.5 * load.sum() / k + tau[:, 0].max()  # balanced up to one group
        if name.endswith("min-max"):  # cuts only between layers, and the smallest bottleneck among them
            assert set((np.flatnonzero(np.diff(device)) + 1).tolist()) <= set(stage_cuts(prep.graph, k).tolist())
            even_device = np.searchsorted(single, starts[name[:-len(" min-max")]][order] // N_MODIFIERS)
            if set((np.flatnonzero(np.diff(even_device)) + 1).tolist()) <= set(stage_cuts(prep.graph, k).tolist()):
                assert load.max() <= np.bincount(even_device, weights=tau[order, 0]).max() * (1 + 1e-6)
    assert set(starts) <= set(start_assignments(prep))


def test_pipeline_start_cuts_where_memory_fits():
    """Weights all in the first half of a chain: the work-balanced cut puts them on one GPU and overflows
    it; the min-max cut moves stage boundaries until every stage holds its part, and the refine start
    is a pipeline that fits."""
    from envs.placement.task_setup import pipeline_assignments, single_device_times

    n = 16
    g = chain_graph(n, flops=1e13)
    topo = preset("pcie-4gpu")
    cap = min(d.memory_bytes for d in topo.devices)
    # the first 8 ops hold 1.5 devices' worth of Adam states (16 B per parameter), the rest none
    g.param_bytes[:8] = 1.5 * cap / 8 / ADAM_MIXED_BYTES_PER_PARAM * DTYPE_BYTES[g.dtype]
    task = Task(g, topo)
    env = PlacementEnv([task], mode="refine", max_nodes=n, coarsen=False)
    env.reset(seed=0)
    prep = env.prepared
    starts = pipeline_assignments(prep)
    single, _, _ = single_device_times(prep)
    ev = CachedSimulation()
    two = starts["pipeline 2 stages"]
    assert ev.evaluate(g, topo, prep.plan(two, 1, "1f1b", 1, "test")).oom  # equal work: 1.5 devices' states
    for name, assign in starts.items():
        if name.endswith("min-max"):
            device = np.searchsorted(single, assign // N_MODIFIERS)
            states = np.bincount(device, weights=prep.states, minlength=topo.num_devices)
            assert states.max() <= cap
    fits = [a for name, a in starts.items() if name.endswith("min-max")
            and not ev.evaluate(g, topo, prep.plan(a, 1, "1f1b", 1, "test")).oom]
    assert fits
    assert not env.prepared.start.result.oom


def test_contiguous_stages_take_their_shares_of_the_work():
    from envs.plan import contiguous_stages

    g = chain_graph(12)  # equal ops
    assert np.bincount(contiguous_stages(g, 3)).tolist() == [4, 4, 4]
    # a device twice as fast as the other two takes half the work
    assert np.bincount(contiguous_stages(g, 3, shares=np.array([2.0, 1.0, 1.0]))).tolist() == [6, 3, 3]
    stage = contiguous_stages(g, 3, shares=np.array([1.0, 1.0, 2.0]))
    assert (np.diff(stage[g.topological_order()]) >= 0).all() and np.bincount(stage).tolist() == [3, 3, 6]


def test_option_table_adds_the_largest_group_an_uneven_batch_splits_over():
    topo = preset("a100-80g-cluster:nodes=2")
    plain = OptionTable.build(topo)
    assert OptionTable.build(topo, batch=64).groups == plain.groups  # 16 divides 64: nothing to add
    uneven = OptionTable.build(topo, batch=120)
    first15 = tuple(range(15))
    assert uneven.groups[:plain.size] == plain.groups  # the topology's rows keep their indices
    look = uneven.lookup()
    assert (first15, "batch_split", 15) in look and set(uneven.groups[plain.size:]) == {first15}
    assert (first15, "col_split", 1) not in look  # tensor parallel stays inside a host: 15 = 8 + 7 has none
    # the environment's data-parallel start takes it
    from envs.graph import chain_graph
    from envs.placement.task_setup import data_parallel_assignments

    env = PlacementEnv([Task(chain_graph(6, batch_size=120, param_bytes=1e8), topo)], mode="refine", max_nodes=8,
                       max_devices=16)
    env.reset(seed=0)
    starts = data_parallel_assignments(env.prepared)
    assert "data parallel a100-80g x15" in starts
    # and with sharded optimizer states (ZeRO-1, Megatron-LM's distributed optimizer) and FSDP (ZeRO-3)
    from envs.placement.options import MODIFIERS, N_MODIFIERS

    for stage in (1, 3):
        zero = starts[f"data parallel a100-80g x15 zero-{stage}"]
        plain = starts["data parallel a100-80g x15"]
        weighted = env.prepared.graph.param_bytes > 0
        assert {MODIFIERS[m].zero for m in (zero % N_MODIFIERS)[weighted]} == {stage}
        assert (zero // N_MODIFIERS == plain // N_MODIFIERS).all()


def test_show_assignment_builds_the_loads_once_per_plan(small_tasks):
    """Showing one plan with each group in turn (a guided-search round) rebuilds the per-device loads
    once; every observation equals the one a fresh environment shows for that plan and group."""
    task = small_tasks[0]
    env = PlacementEnv([task], mode="refine", seed=0)
    env.reset(options={"task": task})
    rng = np.random.default_rng(0)
    actions = np.flatnonzero(env.action_masks())
    n = len(env.assignment)
    plans = [np.asarray(env.assignment).copy(), rng.choice(actions, size=n)]
    reload, reloads = env._reload, []
    env._reload = lambda: (reloads.append(1), reload())
    for assign in plans:
        for v in rng.permutation(n)[:6].tolist():
            shown = env.show_assignment(assign, v, (0, 1, 0))
            fresh = PlacementEnv([task], mode="refine", seed=0)
            fresh.reset(options={"task": task})
            expected = fresh.show_assignment(assign, v, (0, 1, 0))
            assert shown.keys() == expected.keys()
            for k in shown:
                np.testing.assert_array_equal(shown[k], expected[k], err_msg=k)
            np.testing.assert_array_equal(env.action_masks(), fresh.action_masks())
            dynamic = env.show_assignment(assign, v, (0, 1, 0), dynamic_only=True)  # the guided search's view
            assert set(dynamic) == set(DYNAMIC_KEYS)
            for k in dynamic:
                np.testing.assert_array_equal(dynamic[k], expected[k], err_msg=k)
    assert len(reloads) == len(plans)


def test_refine_starts_include_megatron_pipelines_of_device_groups():
    """Megatron's 3-D layout as a refine start: contiguous stages, each on one of k disjoint equal groups
    that hold every device (here the two hosts, or four quads), tensor parallel (col/row splits) or data
    parallel inside the stage."""
    from envs.placement.options import N_MODIFIERS
    from envs.placement.task_setup import staged_megatron_assignments
    from envs.plan import LAYOUTS

    topo = preset("a100-80g-cluster:nodes=2")
    g = transformer_graph(layers=8, hidden=512, heads=8, seq=128, vocab=1000, batch=16)
    env = PlacementEnv([Task(g, topo)], mode="refine", max_nodes=40, max_devices=16)
    env.reset(seed=0)
    prep = env.prepared
    starts = staged_megatron_assignments(prep)
    assert {"pipeline 2 stages x megatron tp8", "pipeline 2 stages x megatron dp8",
            "pipeline 4 stages x megatron tp4"} <= set(starts)
    opts = prep.options
    for name, assign in starts.items():
        k = int(name.split()[1])
        rows = assign // N_MODIFIERS
        groups = [opts.groups[r] for r in rows]
        order = prep.graph.topological_order()
        firsts = list(dict.fromkeys(groups[v] for v in order))
        assert len(firsts) == k and len({d for gr in firsts for d in gr}) == 16  # k groups cover every device
        stage_of = {gr: s for s, gr in enumerate(firsts)}
        seq = [stage_of[groups[v]] for v in order]
        assert seq == sorted(seq)  # contiguous stages in topological order
    tp8 = starts["pipeline 2 stages x megatron tp8"] // N_MODIFIERS
    assert {LAYOUTS[opts.layout[r]] for r in tp8} >= {"col_split", "row_split"}
    dp8 = starts["pipeline 2 stages x megatron dp8"] // N_MODIFIERS
    assert {LAYOUTS[opts.layout[r]] for r in dp8} == {"batch_split"}


def test_megatron_starts_on_each_device_kinds_group_of_a_heterogeneous_cluster():
    from envs.placement.options import N_MODIFIERS
    from envs.placement.task_setup import megatron_assignments

    topo = preset("hetero")  # 2 A100, 2 V100, 2 T4 and a CPU
    g = transformer_graph(layers=2, hidden=256, heads=4, seq=64, vocab=500, batch=8)
    env = PlacementEnv([Task(g, topo)], mode="refine", max_nodes=40, max_devices=8)
    env.reset(seed=0)
    starts = megatron_assignments(env.prepared)
    a100 = starts["megatron a100-80g x2 tp2 dp1"] // N_MODIFIERS
    groups = {env.prepared.options.groups[r] for r in a100}
    assert groups <= {(0, 1), (0,)} and (0, 1) in groups
    assert any(name.startswith("megatron tp7") for name in starts)  # all devices, as before


def test_single_device_starts_on_each_device_kind_of_a_heterogeneous_cluster():
    """Every group on each kind's first device, only where there are several kinds: a host-bound chain of
    many small operators runs faster on another kind's device than on the A100 the reference plan takes."""
    from envs.placement.options import N_MODIFIERS
    from envs.placement.task_setup import single_device_assignments

    g = chain_graph(300, flops=1e7, act_bytes=1e4, batch_size=1)
    env = PlacementEnv([Task(g, preset("hetero"))], mode="refine", max_nodes=300, max_devices=8, coarsen=False)
    env.reset(seed=0)
    prep = env.prepared
    starts = single_device_assignments(prep)
    assert set(starts) == {f"single device {kind}" for kind in ("a100-80g", "v100-32g", "t4", "cpu")}
    for kind, members in prep.task.topology.devices_by_kind().items():
        rows = set((starts[f"single device {kind}"] // N_MODIFIERS).tolist())
        assert {prep.options.groups[r] for r in rows} == {(members[0],)}
    assert prep.start.name.startswith("single device ") and prep.start.name != "single device a100-80g"
    assert prep.start.result.value < env._ref["times"]["single_device"]
    homogeneous = PlacementEnv([Task(g, preset("pcie-4gpu"))], mode="refine", max_nodes=300, coarsen=False)
    homogeneous.reset(seed=0)
    assert single_device_assignments(homogeneous.prepared) == {}


def test_kind_pipeline_starts_put_data_parallel_stages_on_each_device_kind():
    """On a cluster of several kinds, a start's stages are each kind's group (the kind of more
    throughput first), contiguous in topological order, data parallel over the group, at the smallest
    bottleneck of stage time over replicas (every 2-stage cut checked: one V100 vs a pair of T4s, so
    ignoring the replicas cuts elsewhere); a cluster of one kind gets none."""
    from envs.placement.options import N_MODIFIERS
    from envs.placement.task_setup import kind_pipeline_assignments, single_device_times
    from envs.plan import LAYOUTS
    from envs.presets import PCIE3, _t4, _v100
    from envs.topology import Link, Topology

    devs = [_v100("v100"), _t4("t4.0"), _t4("t4.1")]
    topo = Topology(devs, [Link(d.name, "rc", kind="pcie", **PCIE3) for d in devs], ["rc"], name="v100+2t4")
    g = transformer_graph(layers=8, hidden=256, heads=4, seq=64, vocab=500, batch=8)
    env = PlacementEnv([Task(g, topo)], mode="refine", max_nodes=60, max_devices=4)
    env.reset(seed=0)
    prep = env.prepared
    starts = kind_pipeline_assignments(prep)
    assert list(starts) == ["pipeline over device kinds t4 x2 | v100-32g x1"]  # 2 x 65 TFLOP/s > 125
    two = starts["pipeline over device kinds t4 x2 | v100-32g x1"]
    opts, order = prep.options, prep.graph.topological_order()
    groups = [opts.groups[r] for r in two[order] // N_MODIFIERS]
    stage = np.array([0 if set(gr) <= {1, 2} else 1 for gr in groups])
    assert set(groups) <= {(1, 2), (1,), (0,)} and (np.diff(stage) >= 0).all() and stage.max() == 1
    assert {LAYOUTS[opts.layout[r]] for r in two // N_MODIFIERS if len(opts.groups[r]) > 1} == {"batch_split"}
    _, _, tau = single_device_times(prep)
    cum = np.cumsum(tau[order][:, [1, 0]] / [2.0, 1.0], axis=0)  # the T4 stage's work over its 2 replicas

    def bottleneck(cut):
        return max(cum[cut - 1, 0], cum[-1, 1] - cum[cut - 1, 1])

    cuts = stage_cuts(prep.graph, 2).tolist()
    best = min(cuts, key=bottleneck)
    assert bottleneck(int(np.argmax(stage))) <= bottleneck(best) * (1 + 1e-5)
    unreplicated = min(cuts, key=lambda c: max(2 * cum[c - 1, 0], cum[-1, 1] - cum[c - 1, 1]))
    assert bottleneck(unreplicated) > bottleneck(best) * 1.01  # the replicas change the answer here
    env = PlacementEnv(default_tasks("dgx-a100-80g", names=["gpt-tiny"]), mode="refine", max_nodes=40)
    env.reset(seed=0)
    assert kind_pipeline_assignments(env.prepared) == {}


def test_hybrid_start_keeps_weight_heavy_groups_whole_and_the_rest_data_parallel():
    """Krizhevsky's rule per group: whole on one device where its gradient all-reduce over the data-parallel
    group costs more than data parallelism saves of its compute, the longest such groups first on the
    least loaded devices; the compute-heavy rest batch_split over the group."""
    from envs.placement.options import N_MODIFIERS
    from envs.placement.task_setup import hybrid_parallel_assignments, single_device_times
    from envs.plan import LAYOUTS

    g = chain_graph(8, flops=2e12, batch_size=64, act_bytes=1e7)
    g.param_bytes[[1, 2, 5]] = [6e9, 4e9, 2e9]  # embedding-like: many weights, little compute
    g.fwd_flops[[1, 2, 5]] = [1e9, 3e9, 2e9]
    g.bwd_flops[[1, 2, 5]] = [2e9, 6e9, 4e9]
    topo = preset("dgx-a100-80g")
    env = PlacementEnv([Task(g, topo)], mode="refine", max_nodes=8, coarsen=False)
    env.reset(seed=0)
    prep = env.prepared
    starts = hybrid_parallel_assignments(prep)
    assign = starts["hybrid data x model parallel a100-80g x8"] // N_MODIFIERS
    opts = prep.options
    _, _, tau = single_device_times(prep)
    whole = [v for v in range(8) if len(opts.groups[assign[v]]) == 1]
    assert whole == [1, 2, 5]
    for v in range(8):
        sync = topo.collective_time("all_reduce", tuple(range(8)), float(g.param_bytes[v])) if g.param_bytes[v] else 0
        assert (v in whole) == (sync > tau[v, 0] * (1 - 1 / 8))
        if v not in whole:
            assert opts.groups[assign[v]] == tuple(range(8)) and LAYOUTS[opts.layout[assign[v]]] == "batch_split"
    devices = [opts.groups[assign[v]][0] for v in (2, 5, 1)]  # longest first: each on an empty device
    assert len(set(devices)) == 3
    env = PlacementEnv([Task(chain_graph(8, flops=2e12, batch_size=64), topo)], mode="refine", max_nodes=8,
                       coarsen=False)
    env.reset(seed=0)
    assert hybrid_parallel_assignments(env.prepared) == {}  # no weights: all data parallel, nothing new


def test_nearest_microbatch_choice_is_nearest_in_log_among_the_allowed():
    env = PlacementEnv(default_tasks("pcie-4gpu", names=["gpt-tiny"]), mode="refine", max_nodes=40)
    env.reset(seed=0)
    prep = env.prepared
    counts = prep.mb_counts
    valid = np.flatnonzero(prep.mb_valid)
    for i in valid.tolist():
        assert prep.nearest_microbatch_choice(int(counts[i])) == i
    only_one = np.zeros_like(prep.mb_valid)
    only_one[valid[0]] = True
    assert prep.nearest_microbatch_choice(10**6, only_one) == valid[0]
    assert set(counts[valid].tolist()) >= {1, 2, 4}  # batch 8
    one_or_four = prep.mb_valid & np.isin(counts, (1, 4))  # 2 lies exactly between them in log: the smaller
    assert counts[prep.nearest_microbatch_choice(2, one_or_four)] == 1
    assert counts[prep.nearest_microbatch_choice(3, one_or_four)] == 4
    assert prep.nearest_microbatch_choice(10**6) == valid[np.argmax(counts[valid])]


def test_a_pipeline_start_tries_every_microbatch_count(monkeypatch):
    """A pipeline's time is not monotone in its microbatch count (the bubble shrinks while the
    microbatches' efficiency and the activations in flight change), so the refine start evaluates every
    count that fits, not only until the time first stops falling."""
    from envs.placement import task_setup

    g = transformer_graph(layers=4, hidden=256, heads=4, seq=64, vocab=500, batch=64)
    task = Task(g, preset("pcie-4gpu"))
    real = task_setup.start_assignments

    def one_pipeline(prep):
        return {k: v for k, v in real(prep).items() if k == "pipeline 2 stages"}

    class NonMonotone:  # 2 microbatches better than 1, 4 worse, 8 best of all
        times = {1: 10.0, 2: 9.0, 4: 9.5, 8: 5.0}

        def evaluate(self, graph, topology, plan, objective="step_time"):
            n = topology.num_devices
            return EvalResult(self.times.get(plan.microbatches, 20.0), np.zeros(n), np.ones(n), False)

    monkeypatch.setattr(task_setup, "start_assignments", one_pipeline)
    env = PlacementEnv([task], mode="refine", max_nodes=16, max_devices=4, evaluator=NonMonotone(),
                       microbatch_choices=(1, 2, 4, 8))
    env.reset(seed=0)
    start = env.prepared.start
    assert start.name == "pipeline 2 stages" and int(env.prepared.mb_counts[start.mb_idx]) == 8


def test_mixture_of_experts_refine_start_takes_expert_parallel_data_parallelism():
    """On a mixture-of-experts model the data-parallel starts include one with expert parallelism on
    every group of experts (ep = dp: each expert on one rank), the rest as plain data parallelism; where
    it is the fastest start (the experts' weights leave the gradient all-reduce) the episode starts from
    it, and its plan runs the experts expert-parallel."""
    from envs.placement.options import MODIFIERS, N_MODIFIERS
    from envs.placement.task_setup import data_parallel_assignments

    task = default_tasks(names=["moe-wide"])[0]
    task = Task(task.graph, preset("pcie-4gpu"), batch=task.batch)
    env = PlacementEnv([task], mode="refine", max_nodes=40, max_devices=4)
    env.reset(seed=0)
    prep = env.prepared
    starts = data_parallel_assignments(prep)
    ep = starts["data parallel a100-80g x4 expert-parallel"]
    plain = starts["data parallel a100-80g x4"]
    experts = prep.stats.expert_count > 0
    assert experts.any() and (ep // N_MODIFIERS == plain // N_MODIFIERS).all()
    assert all(MODIFIERS[m].expert_parallel for m in (ep % N_MODIFIERS)[experts])
    assert not any(MODIFIERS[m].expert_parallel for m in (ep % N_MODIFIERS)[~experts])
    # a routed-experts GPT (GShard-style dispatch) whose gradient all-reduce dominates over PCIe
    from profilers.spec import graph_from_spec

    g = graph_from_spec("moe:layers=2,hidden=256,heads=4,experts=4,seq=128,batch=8")
    env = PlacementEnv([Task(g, preset("pcie-4gpu"))], mode="refine", max_nodes=40, max_devices=4)
    env.reset(seed=0)
    prep = env.prepared
    assert prep.start.name == "data parallel a100-80g x4 expert-parallel"
    plan = prep.plan(prep.start.assign, 1, "1f1b", 1, "test")
    assert (plan.ep[prep.ops["expert_layer"] >= 0] == 4).all()
    # a model without experts gets no such start
    dense = PlacementEnv([Task(chain_graph(6, batch_size=8, param_bytes=1e8), preset("pcie-4gpu"))], mode="refine",
                         max_nodes=8, max_devices=4)
    dense.reset(seed=0)
    assert not any(k.endswith("expert-parallel") for k in data_parallel_assignments(dense.prepared))


def test_megatron_starts_with_sequence_parallelism_and_tensor_x_data_parallel_stages():
    """Every tensor-parallel Megatron start also comes with sequence parallelism (the groups it replicates
    between the tensor-parallel regions sequence-split where they may be, nothing else changed), and the
    pipelines of device groups also run tensor x data parallel inside each stage."""
    from envs.placement.options import N_MODIFIERS
    from envs.placement.task_setup import megatron_assignments, staged_megatron_assignments
    from envs.plan import LAYOUTS

    topo = preset("a100-80g-cluster:nodes=2")
    g = transformer_graph(layers=4, hidden=512, heads=8, seq=128, vocab=1000, batch=16)
    env = PlacementEnv([Task(g, topo)], mode="refine", max_nodes=40, max_devices=16)
    env.reset(seed=0)
    prep = env.prepared
    opts = prep.options

    def layouts(assign):
        return [LAYOUTS[opts.layout[r]] for r in assign // N_MODIFIERS]

    starts = {**megatron_assignments(prep), **staged_megatron_assignments(prep)}
    pairs = [(k[:-3], k) for k in starts if k.endswith(" sp")]
    assert "megatron tp8 dp2 sp" in starts and "pipeline 2 stages x megatron tp4 dp2 sp" in starts
    assert not any(k.endswith("dp8 sp") and "tp" not in k.split(" x ")[-1] for k in starts)  # no tp: no sp
    for plain, sp in pairs:
        a, b = layouts(starts[plain]), layouts(starts[sp])
        changed = [v for v in range(len(a)) if a[v] != b[v]]
        assert changed, sp
        assert all(a[v] == "replicate" and b[v] == "seq_split" and prep.stats.seq_ok[v] for v in changed)
    # and with Megatron-LM's distributed optimizer (ZeRO-1) where there are data-parallel replicas
    from envs.placement.options import MODIFIERS

    for name in ("megatron tp8 dp2", "megatron tp8 dp2 sp"):
        plain, zero = starts[name], starts[name + " zero-1"]
        assert (plain // N_MODIFIERS == zero // N_MODIFIERS).all()
        weighted = prep.modifier_ok[:, 3] & (opts.dp[plain // N_MODIFIERS] >= 2)
        assert weighted.any() and {MODIFIERS[m].zero for m in zero[weighted] % N_MODIFIERS} == {1}
        assert (zero[~weighted] == plain[~weighted]).all()
    assert not any(k.startswith("megatron tp16 dp1") and k.endswith("zero-1") for k in starts)
    mixed = starts["pipeline 2 stages x megatron tp4 dp2"] // N_MODIFIERS
    assert {int(opts.dp[r]) for r in mixed} == {2} and {len(opts.groups[r]) for r in mixed} == {8}
    assert {LAYOUTS[opts.layout[r]] for r in mixed} >= {"col_split", "row_split"}
    # the data-parallel pipeline stages also with ZeRO-1 (Megatron-LM's distributed optimizer with pp)
    for name in ("pipeline 2 stages x megatron tp4 dp2", "pipeline 2 stages x megatron dp8"):
        plain, zero = starts[name], starts[f"{name} zero-1"]
        assert (plain // N_MODIFIERS == zero // N_MODIFIERS).all()
        weighted = prep.modifier_ok[:, 3] & (opts.dp[plain // N_MODIFIERS] >= 2)
        assert weighted.any() and {MODIFIERS[m].zero for m in zero[weighted] % N_MODIFIERS} == {1}
    assert "pipeline 2 stages x megatron tp8 zero-1" not in starts  # no data-parallel replicas


def test_staged_megatron_starts_over_one_device_kind_of_a_mixed_cluster():
    """On a cluster of several kinds the Megatron pipelines also run over each kind's devices alone (the
    GPUs without the host CPU, whose count need not divide into equal groups with it)."""
    from envs.placement.options import N_MODIFIERS
    from envs.placement.task_setup import staged_megatron_assignments
    from envs.presets import PCIE3, _v100
    from envs.topology import Device, Link, Topology

    gpus = [_v100(f"v100.{i}") for i in range(4)]
    cpu = Device("cpu", "cpu", {"fp32": 5.9e12, "bf16": 5.9e12}, 512e9, 410e9, compute_eff=0.5, mem_eff=0.6)
    links = [Link(d.name, f"plx{i // 2}", kind="pcie", **PCIE3) for i, d in enumerate(gpus)]
    links += [Link(f"plx{s}", "rc", kind="pcie", **PCIE3) for s in range(2)]
    links.append(Link("cpu", "rc", kind="membus", bandwidth=64e9, latency=5e-7, efficiency=0.8))
    topo = Topology(gpus + [cpu], links, ["plx0", "plx1", "rc"], name="4v100+cpu")
    g = transformer_graph(layers=4, hidden=256, heads=4, seq=64, vocab=500, batch=8)
    env = PlacementEnv([Task(g, topo)], mode="refine", max_nodes=40, max_devices=5)
    env.reset(seed=0)
    starts = staged_megatron_assignments(env.prepared)
    assert not any(" x megatron" in k for k in starts)  # 5 devices: no equal groups over all of them
    staged = starts["pipeline 2 stages x v100-32g x4 megatron tp2"] // N_MODIFIERS
    groups = [env.prepared.options.groups[r] for r in staged]
    assert set(groups) == {(0, 1), (2, 3)}


def test_refine_start_skips_candidates_that_cannot_win_and_starts_where_it_did():
    """A candidate whose smallest microbatch count, divided by its device groups (the most any
    microbatching can overlap), is no faster than the best start so far is not tried at more counts, and
    one on single devices whose busiest device computes for longer than the best start takes is not
    simulated at all: the same starts (name, count, schedule, value) as trying every count, with fewer
    evaluations."""
    from envs.placement import task_setup

    tasks = default_tasks(names=["gpt-tiny", "mlp-chain", "moe-wide", "branching-cnn"])
    topos = [preset("pcie-4gpu"), preset("dgx-a100-80g"), preset("hetero")]

    def starts(monkeypatch, prune: bool):
        if not prune:
            monkeypatch.setattr(task_setup, "_cannot_win", lambda *a: False)
            monkeypatch.setattr(task_setup, "_compute_exceeds", lambda *a: False)
        out, evaluations = [], 0
        for t in tasks:
            for topo in topos:
                ev = CachedSimulation()
                env = PlacementEnv([Task(t.graph, topo, batch=t.batch)], mode="refine", max_nodes=40,
                                   max_devices=8, evaluator=ev)
                env.reset(seed=0)
                s = env.prepared.start
                out.append((s.name, s.mb_idx, s.schedule, s.result.value))
                evaluations += ev.misses
        monkeypatch.undo()
        return out, evaluations

    with pytest.MonkeyPatch.context() as mp:
        pruned, fewer = starts(mp, True)
    with pytest.MonkeyPatch.context() as mp:
        every, more = starts(mp, False)
    assert pruned == every
    assert fewer < more


def test_expert_parallelism_over_more_replicas_than_experts():
    """Expert parallelism's degree is the largest that divides both the data-parallel degree and the
    layer's experts (Megatron-LM's ep | dp, experts % ep == 0): 2 experts data parallel over 4 devices run
    with ep 2 (two replicas of each expert), which the action mask allows, the plan validates and the
    per-device model states count (half the experts' states on each member, not a quarter)."""
    from envs.placement.options import EXPERT_ROWS, N_MODIFIERS, expert_parallel_degree
    from envs.placement.task_setup import data_parallel_assignments
    from profilers.spec import graph_from_spec

    assert expert_parallel_degree([1, 2, 4, 8, 16, 6], 8).tolist() == [1, 2, 4, 8, 8, 2]
    assert expert_parallel_degree(16, 0) == 1
    g = graph_from_spec("moe:layers=2,hidden=256,heads=4,experts=2,seq=128,batch=8")
    topo = preset("pcie-4gpu")
    env = PlacementEnv([Task(g, topo)], mode="refine", max_nodes=40, max_devices=4)
    env.reset(seed=0)
    prep = env.prepared
    assign = data_parallel_assignments(prep)["data parallel a100-80g x4 expert-parallel"]
    plan = prep.plan(assign, 1, "1f1b", 1, "test")
    experts = prep.ops["expert_layer"] >= 0
    assert (plan.ep[experts] == 2).all() and (plan.dp[experts] == 4).all() and (plan.ep[~experts] == 1).all()
    plan.validate(g, topo)
    v = int(np.flatnonzero(prep.stats.expert_count > 0)[0])
    o = int(assign[v] // N_MODIFIERS)
    k = int(np.flatnonzero(EXPERT_ROWS)[0])
    assert prep.state_factor(v)[o, k] == pytest.approx(0.5) and prep.zero_factor[o, k] == pytest.approx(0.25)
    # the mask offers the expert-parallel rows on that placement when the group is decided
    while env._phase() != 2 or env._node() != v:
        env.step(int(np.flatnonzero(env.action_masks())[0]) if env._phase() != 2 else int(env.assignment[env._node()]))
    assert env.action_masks()[o * N_MODIFIERS + k]


def test_template_stage_times_are_the_simulators_op_times():
    """The refine starts balance pipeline stages and list-schedule groups by each group's forward +
    backward time on a device as the simulator's op-time model gives it (once per device kind), not by
    the policy features' roofline estimate."""
    from envs.placement.options import N_MODIFIERS
    from envs.placement.task_setup import single_device_times
    from envs.sim.cost import node_times

    topo = preset("hetero")
    g = transformer_graph(layers=2, hidden=256, heads=4, seq=64, vocab=500, batch=8)
    env = PlacementEnv([Task(g, topo)], mode="refine", max_nodes=12, max_devices=8)
    env.reset(seed=0)
    prep = env.prepared
    single, ok, tau = single_device_times(prep)
    for d in (0, 2, 4):  # an A100, a V100, a T4
        plan = prep.plan(np.full(prep.graph.num_nodes, single[d] * N_MODIFIERS), 1, "1f1b", 1, "test")
        t = node_times(g, topo, plan, 1.0)
        want = np.bincount(prep.grouping.group_of, weights=t.fwd + t.bwd, minlength=prep.graph.num_nodes)
        np.testing.assert_allclose(tau[ok[:, d], d], want[ok[:, d]], rtol=1e-12)
    assert (tau[:, 0] == tau[:, 1]).all()  # the same kind, the same times
