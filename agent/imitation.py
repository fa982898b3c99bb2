"""Warm start by imitation: replay the best heuristic plan of every training task, clone it, then PPO.

PPO from a uniform policy must discover, one sparse end-of-episode reward at a time, what a heuristic
already knows (keep a transformer data-parallel on NVLink, pipeline it over PCIe, ...). So before PPO
starts, :func:`warm_start`

1. runs the fast heuristic baselines on every training task (:func:`agent.infer.run_baselines`) and keeps
   the best plan that fits in memory;
2. replays it in the environment as a demonstration (:func:`replay` with :func:`demo_action`: the
   allowed option closest to the plan at every decision, so the replay is the plan as far as the
   option table can express it; its simulated time is recorded next to the heuristic's);
3. behaviour-clones the demonstrations: cross-entropy of the masked policy on the demonstrated actions
   plus ``vf_coef`` x the squared error of the value head against the demonstration's discounted
   return from each step (the model's gamma; with gamma = 1 in place mode, the final score), with the
   policy's own optimiser for ``epochs`` passes.

PPO then explores around the heuristic instead of from scratch; the training curve and the best plans
are PPO's own. Config section (all optional): ``imitation: {epochs: 20, batch_size: 128}``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from envs.errors import RlplaceError
from envs.plan import SCHEDULES, Plan


@dataclass
class Demonstration:
    """One replayed heuristic plan: the episode's observations, masks and actions."""

    task: str
    source: str  # the placer whose plan was replayed
    heuristic_time: float  # the placer's plan, simulated on the operator graph
    replay_time: float  # the replayed episode's plan, as the environment scores it
    score: float  # the final plan's score
    plan: Plan | None = None  # the replayed episode's plan (on the task's operators), as the environment made it
    oom: bool = False
    on_policy: bool = False  # the learner's own episode, labelled with the plan's actions (learner_demo)
    obs: list[dict[str, np.ndarray]] = field(repr=False, default_factory=list)
    masks: list[np.ndarray] = field(repr=False, default_factory=list)
    actions: list[int] = field(repr=False, default_factory=list)
    rewards: list[float] = field(repr=False, default_factory=list)

    def returns(self, gamma: float) -> np.ndarray:
        """The discounted return from every step (the value head's regression target)."""
        out, g = np.zeros(len(self.rewards)), 0.0
        for i in range(len(self.rewards) - 1, -1, -1):
            g = self.rewards[i] + gamma * g
            out[i] = g
        return out


def best_heuristic_plans(tasks: Sequence, objective: str = "step_time", seed: int = 0) -> dict[str, tuple[str, Plan,
                                                                                                         float, bool]]:
    """task name -> (placer, plan, step time, oom) of the best fast heuristic (plans that fit first)."""
    from agent.infer import run_baselines

    out = {}
    for task in tasks:
        cands = run_baselines(task.graph, task.topology, objective, seed=seed)
        if cands:
            b = min(cands, key=lambda c: (c.oom, c.value))
            out[task.name] = (b.name, b.plan, float(b.evaluation.value), bool(b.oom))
    return out


# ---------------------------------------------------------------------- replaying a plan in the environment
def demo_target(prepared, plan: Plan) -> np.ndarray:
    """``plan`` (on the task's operators, or on the groups the environment places) as one action per
    group of ``prepared`` (the environment's :class:`envs.placement.task_setup.PreparedTask`):
    :func:`envs.placement.task_setup.express`; any other size raises :class:`envs.errors.EnvError`."""
    from envs.placement.task_setup import express

    return express(prepared, plan)


def demo_action(env, plan: Plan, target: np.ndarray | None = None) -> int:
    """The allowed action of ``env`` (a :class:`envs.placement.env.PlacementEnv` mid-episode) now that
    best expresses ``plan``; ``target``: :func:`demo_target` of it, if the caller keeps it.

    Global phases take the plan's microbatch count (the nearest allowed choice), schedule and virtual
    stages (the nearest allowed). A node takes the plan's action for it (placement x modifier); if that
    action is not allowed now, the allowed action closest to it: same placement with the closest
    modifier (same recomputation, then same ZeRO stage), else the closest placement — same devices,
    then same layout, then most shared devices, then same dp — with the closest modifier."""
    from envs.placement.observation import PHASES, VIRTUAL_STAGE_CHOICES
    from envs.placement.options import MODIFIERS, N_MODIFIERS

    phase = env.phase
    if phase is None:
        raise RlplaceError("demo_action needs an episode in progress (call reset())")
    prepared = env.prepared
    if target is None:
        target = demo_target(prepared, plan)
    mask = env.action_masks()
    allowed = np.flatnonzero(mask)
    name = PHASES[phase]
    if name == "microbatches":
        want = np.log2(max(int(plan.microbatches), 1))
        dist = [abs(np.log2(prepared.mb_counts[a]) - want) for a in allowed]
        return int(allowed[int(np.argmin(dist))])
    if name == "schedule":
        a = SCHEDULES.index(plan.schedule)
        return a if mask[a] else int(allowed[0])
    if name == "virtual_stages":
        dist = [abs(VIRTUAL_STAGE_CHOICES[a] - int(plan.virtual_stages)) for a in allowed]
        return int(allowed[int(np.argmin(dist))])
    want = int(target[env.node])
    if mask[want]:
        return want
    options = prepared.options
    o_want, k_want = divmod(want, N_MODIFIERS)
    m_want = MODIFIERS[k_want]
    devs_want = set(options.groups[o_want])

    def closeness(a: int) -> tuple:
        o, k = divmod(a, N_MODIFIERS)
        m = MODIFIERS[k]
        devs = set(options.groups[o])
        return (o == o_want, devs == devs_want, int(options.layout[o]) == int(options.layout[o_want]),
                len(devs & devs_want) / len(devs | devs_want), int(options.dp[o]) == int(options.dp[o_want]),
                m.recompute == m_want.recompute, m.zero == m_want.zero, m.expert_parallel == m_want.expert_parallel)

    return int(max(allowed.tolist(), key=closeness))


def replay(env, task, plan: Plan, source: str = "", heuristic_time: float = float("nan")) -> Demonstration:
    """One episode of ``env`` on ``task`` that follows ``plan`` as closely as the action table allows."""
    obs, _ = env.reset(options={"task": task})
    target = demo_target(env.prepared, plan)  # once per episode
    demo = Demonstration(task=task.name, source=source, heuristic_time=heuristic_time, replay_time=float("nan"),
                         score=float("nan"))
    done, info, reward = False, {}, 0.0
    while not done:
        mask = env.action_masks()
        a = demo_action(env, plan, target)
        demo.obs.append(obs)
        demo.masks.append(mask)
        demo.actions.append(a)
        obs, reward, done, _, info = env.step(a)
        demo.rewards.append(float(reward))
    demo.replay_time = float(info["step_time"])
    demo.score = float(info["score"])
    demo.plan, demo.oom = info["plan"], bool(info["oom"])
    return demo


def learner_demo(env, task, plan: Plan, model, source: str = "") -> Demonstration:
    """DAgger (Ross, Gordon & Bagnell, AISTATS 2011): one episode of ``env`` on ``task`` driven by
    ``model``'s own greedy actions, every state labelled with the action that best expresses ``plan``
    there (:func:`demo_action`). A cloned policy that disagrees with its teacher on a step reaches
    states the teacher's replay never shows; these labels say how to get back to the plan from them."""
    obs, _ = env.reset(options={"task": task})
    target = demo_target(env.prepared, plan)
    demo = Demonstration(task=task.name, source=f"learner toward {source}", heuristic_time=float("nan"),
                         replay_time=float("nan"), score=float("nan"), on_policy=True)
    done, info = False, {}
    while not done:
        mask = env.action_masks()
        demo.obs.append(obs)
        demo.masks.append(mask)
        demo.actions.append(demo_action(env, plan, target))
        act, _ = model.predict(obs, action_masks=mask, deterministic=True)
        obs, reward, done, _, info = env.step(int(act))
        demo.rewards.append(float(reward))
    demo.replay_time, demo.score = float(info["step_time"]), float(info["score"])
    demo.plan, demo.oom = info["plan"], bool(info["oom"])
    return demo


def collect(tasks: Sequence, env_kwargs: dict, plans: dict[str, tuple[str, Plan, float, bool]],
            learner=None) -> list[Demonstration]:
    """Replay ``plans`` (from :func:`best_heuristic_plans`) in an environment built like the training ones;
    with a ``learner`` model, also one :func:`learner_demo` per plan (DAgger's states)."""
    from envs.placement.env import PlacementEnv

    env = PlacementEnv(list(tasks), **env_kwargs)
    mine = [t for t in tasks if t.name in plans]
    demos = [replay(env, t, plans[t.name][1], plans[t.name][0], plans[t.name][2]) for t in mine]
    if learner is not None:
        demos += [learner_demo(env, t, plans[t.name][1], learner, plans[t.name][0]) for t in mine]
    return demos


BC_LEARNING_RATE = 3e-3  # cloning a fixed set of decisions: faster than PPO's steps (measured on a 8-step
# plan: 150 epochs at 1e-3 cloned 50% of the decisions, at 3e-3 87%)


def behaviour_clone(model, demos: Sequence[Demonstration], *, epochs: int = 20, batch_size: int = 128,
                    seed: int = 0, learning_rate: float = BC_LEARNING_RATE,
                    log: Callable[[str], None] | None = None) -> dict:
    """Fit ``model.policy`` to the demonstrations (masked cross-entropy + value regression) with the
    policy's optimiser at ``learning_rate`` (PPO's own rate is restored after); returns stats."""
    lrs = [g["lr"] for g in model.policy.optimizer.param_groups]
    for g in model.policy.optimizer.param_groups:
        g["lr"] = float(learning_rate)
    try:
        return _clone(model, demos, epochs=epochs, batch_size=batch_size, seed=seed, log=log)
    finally:
        for g, lr in zip(model.policy.optimizer.param_groups, lrs):
            g["lr"] = lr


def _clone(model, demos: Sequence[Demonstration], *, epochs: int, batch_size: int, seed: int,
           log: Callable[[str], None] | None) -> dict:
    import torch as th

    say = log or (lambda _m: None)
    policy = model.policy
    gamma = float(getattr(model, "gamma", 1.0))
    steps = [(o, m, a, g) for d in demos for o, m, a, g in zip(d.obs, d.masks, d.actions, d.returns(gamma))]
    if not steps or epochs < 1:
        return {"steps": len(steps), "epochs": 0}
    obs = {k: th.as_tensor(np.stack([s[0][k] for s in steps])) for k in steps[0][0]}
    masks = np.stack([s[1] for s in steps])
    actions = th.as_tensor([s[2] for s in steps], dtype=th.long)
    returns = th.as_tensor([s[3] for s in steps], dtype=th.float32)
    vf_coef = float(getattr(model, "vf_coef", 0.5))
    max_norm = float(getattr(model, "max_grad_norm", 0.5))
    rng = np.random.default_rng(seed)
    policy.set_training_mode(True)
    n = len(steps)
    history = []
    for _ in range(int(epochs)):
        perm = rng.permutation(n)
        tot_pi = tot_v = 0.0
        for s in range(0, n, int(batch_size)):
            idx = perm[s:s + int(batch_size)]
            it = th.as_tensor(idx)
            values, log_prob, _ = policy.evaluate_actions({k: v[it] for k, v in obs.items()}, actions[it],
                                                          action_masks=masks[idx])
            pi_loss = -log_prob.mean()
            v_loss = th.nn.functional.mse_loss(values.flatten(), returns[it])
            loss = pi_loss + vf_coef * v_loss
            policy.optimizer.zero_grad()
            loss.backward()
            th.nn.utils.clip_grad_norm_(policy.parameters(), max_norm)
            policy.optimizer.step()
            tot_pi += float(pi_loss.detach()) * len(idx)
            tot_v += float(v_loss.detach()) * len(idx)
        history.append((tot_pi / n, tot_v / n))
    policy.set_training_mode(False)
    with th.no_grad():
        dist = policy.get_distribution(obs, action_masks=masks)
        agree = float((dist.distribution.probs.argmax(-1) == actions).float().mean())
    say(f"imitation: {len(demos)} demonstration(s), {n} steps, {epochs} epochs: cross-entropy "
        f"{history[0][0]:.3f} -> {history[-1][0]:.3f}, greedy agrees on {agree:.1%} of the steps")
    return {"steps": n, "epochs": int(epochs), "first_loss": history[0][0], "last_loss": history[-1][0],
            "last_value_loss": history[-1][1], "greedy_agreement": agree}


def warm_start(model, tasks: Sequence, env_kwargs: dict, *, epochs: int = 20, batch_size: int = 128, seed: int = 0,
               learning_rate: float = BC_LEARNING_RATE,
               plans: dict | None = None, log: Callable[[str], None] | None = None) -> dict:
    """Heuristics -> demonstrations -> behaviour cloning (see the module docstring); returns a report."""
    say = log or (lambda _m: None)
    t = time.perf_counter()
    plans = plans if plans is not None else best_heuristic_plans(tasks, env_kwargs.get("objective", "step_time"), seed)
    demos = collect(tasks, env_kwargs, plans)
    t_demo = time.perf_counter() - t
    stats = behaviour_clone(model, demos, epochs=epochs, batch_size=batch_size, seed=seed,
                            learning_rate=learning_rate, log=say)
    stats.update({"demo_seconds": round(t_demo, 2), "seconds": round(time.perf_counter() - t, 2),
                  "demonstrations": [{"task": d.task, "source": d.source, "heuristic_ms": d.heuristic_time * 1e3,
                                      "replay_ms": d.replay_time * 1e3, "score": d.score} for d in demos]})
    return stats


__all__ = ["Demonstration", "best_heuristic_plans", "demo_target", "demo_action", "replay", "collect",
           "behaviour_clone", "warm_start"]
