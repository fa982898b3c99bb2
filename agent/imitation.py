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

from envs.errors import EnvError, RlplaceError
from envs.plan import LAYOUTS, SCHEDULES, Plan


@dataclass
class Demonstration:
    """One replayed heuristic plan: the episode's observations, masks and actions."""

    task: str
    source: str  # the placer whose plan was replayed
    heuristic_time: float  # the placer's plan, simulated on the operator graph
    replay_time: float  # the replayed episode's plan, as the environment scores it
    score: float  # the final plan's score
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
def demo_target(prepared, plan: Plan) -> Plan:
    """``plan`` on the node groups the environment places (``prepared``: its
    :class:`envs.placement.task_setup.PreparedTask`): a plan on the task's operators is projected onto a
    coarsened graph's groups (each group takes its members' majority, ``Grouping.project``), a plan on
    the groups is taken as it is; any other size raises :class:`envs.errors.EnvError`."""
    if prepared.grouping is not None and plan.num_nodes == prepared.task.graph.num_nodes:
        return prepared.grouping.project(plan)
    if plan.num_nodes == prepared.graph.num_nodes:
        return plan
    raise EnvError(f"the demonstration plan has {plan.num_nodes} nodes; task {prepared.task.name!r} has "
                   f"{prepared.task.graph.num_nodes} ops and {prepared.graph.num_nodes} groups")


def demo_action(env, plan: Plan, lookup: dict | None = None) -> int:
    """The allowed action of ``env`` (a :class:`envs.placement.env.PlacementEnv` mid-episode) now that
    best expresses ``plan`` (on the task's operators or on the groups, :func:`demo_target`); ``lookup``:
    the option table's :meth:`~envs.placement.options.OptionTable.lookup`, if the caller keeps it.

    Global phases take the plan's microbatch count (the nearest allowed choice), schedule and
    recompute (majority). A node takes the option with the plan's (devices, layout, dp) for it; if that
    option is not in the table or not allowed now, the allowed option closest to it: same devices,
    then same layout, then most shared devices, then same dp."""
    phase = env.phase
    if phase is None:
        raise RlplaceError("demo_action needs an episode in progress (call reset())")
    prepared = env.prepared
    plan = demo_target(prepared, plan)
    mask = env.action_masks()
    allowed = np.flatnonzero(mask)
    if phase == 0:
        want = np.log2(max(int(plan.microbatches), 1))
        dist = [abs(np.log2(env.microbatch_choices[a]) - want) for a in allowed]
        return int(allowed[int(np.argmin(dist))])
    if phase in (1, 2):
        a = SCHEDULES.index(plan.schedule) if phase == 1 else int(2 * plan.recompute.sum() > plan.num_nodes)
        return a if mask[a] else int(allowed[0])
    v = env.node
    key = (tuple(int(d) for d in plan.groups[v]), plan.layouts[v], int(plan.dp[v]))
    options = prepared.options
    o = (lookup if lookup is not None else options.lookup()).get(key)
    if o is not None and mask[o]:
        return int(o)
    want = set(key[0])
    lay = LAYOUTS.index(key[1])

    def closeness(a: int) -> tuple:
        devs = set(options.groups[a])
        return (devs == want, int(options.layout[a]) == lay, len(devs & want) / len(devs | want),
                int(options.dp[a]) == key[2])

    return int(max(allowed.tolist(), key=closeness))


def replay(env, task, plan: Plan, source: str = "", heuristic_time: float = float("nan")) -> Demonstration:
    """One episode of ``env`` on ``task`` that follows ``plan`` as closely as the option table allows."""
    obs, _ = env.reset(options={"task": task})
    target = demo_target(env.prepared, plan)  # once per episode, like the option lookup
    lookup = env.prepared.options.lookup()
    demo = Demonstration(task=task.name, source=source, heuristic_time=heuristic_time, replay_time=float("nan"),
                         score=float("nan"))
    done, info, reward = False, {}, 0.0
    while not done:
        mask = env.action_masks()
        a = demo_action(env, target, lookup)
        demo.obs.append(obs)
        demo.masks.append(mask)
        demo.actions.append(a)
        obs, reward, done, _, info = env.step(a)
        demo.rewards.append(float(reward))
    demo.replay_time = float(info["step_time"])
    demo.score = float(info["score"])
    return demo


def collect(tasks: Sequence, env_kwargs: dict, plans: dict[str, tuple[str, Plan, float, bool]]) -> list[Demonstration]:
    """Replay ``plans`` (from :func:`best_heuristic_plans`) in an environment built like the training ones."""
    from envs.placement.env import PlacementEnv

    env = PlacementEnv(list(tasks), **env_kwargs)
    return [replay(env, t, plans[t.name][1], plans[t.name][0], plans[t.name][2]) for t in tasks if t.name in plans]


def behaviour_clone(model, demos: Sequence[Demonstration], *, epochs: int = 20, batch_size: int = 128,
                    seed: int = 0, log: Callable[[str], None] | None = None) -> dict:
    """Fit ``model.policy`` to the demonstrations (masked cross-entropy + value regression); returns stats."""
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
               plans: dict | None = None, log: Callable[[str], None] | None = None) -> dict:
    """Heuristics -> demonstrations -> behaviour cloning (see the module docstring); returns a report."""
    say = log or (lambda _m: None)
    t = time.perf_counter()
    plans = plans if plans is not None else best_heuristic_plans(tasks, env_kwargs.get("objective", "step_time"), seed)
    demos = collect(tasks, env_kwargs, plans)
    t_demo = time.perf_counter() - t
    stats = behaviour_clone(model, demos, epochs=epochs, batch_size=batch_size, seed=seed, log=say)
    stats.update({"demo_seconds": round(t_demo, 2), "seconds": round(time.perf_counter() - t, 2),
                  "demonstrations": [{"task": d.task, "source": d.source, "heuristic_ms": d.heuristic_time * 1e3,
                                      "replay_ms": d.replay_time * 1e3, "score": d.score} for d in demos]})
    return stats


__all__ = ["Demonstration", "best_heuristic_plans", "demo_target", "demo_action", "replay", "collect",
           "behaviour_clone", "warm_start"]
