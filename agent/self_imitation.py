"""Self-imitation: between PPO updates, behaviour-clone the best plan found so far for every task.

A PPO rollout that stumbles on a better plan moves the policy only by one advantage-weighted step, and
the entropy that found it decays; in a long episode (one decision per group) the lucky decision is
one in hundreds. Self-imitation learning (Oh et al., "Self-Imitation Learning", ICML 2018) keeps
such returns: here the best plan per task (fits in memory first, then fastest, as the best-plan
tracker keeps it) is replayed as a demonstration (:func:`agent.imitation.collect`) and cloned for a
few epochs (:func:`agent.imitation.behaviour_clone`), so the greedy policy reproduces the best plan
and PPO explores around it. It runs at the start of a rollout (after the previous PPO update, so the
buffer's log-probabilities stay the policy's own) whenever a best plan improved, and every
``every`` rollouts otherwise. With an ``imitation`` warm start the imitated heuristic plans count as
known bests (:func:`known_from_imitation`), so PPO cannot drift below the heuristic it cloned without
being pulled back, and a better plan it finds takes over. Config section:
``self_imitation: {every: 4, epochs: 5, batch_size: 128}``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from stable_baselines3.common.callbacks import BaseCallback

SETTINGS = {"every": 4, "epochs": 5, "batch_size": 128}


def known_from_imitation(report: dict, plans: dict) -> dict:
    """The imitated heuristic plans as ``known`` bests: task -> ``{"plan", "step_time", "oom"}`` with the
    time the environment gave the replayed plan (the scale PPO's own episodes are measured on)."""
    out = {}
    for d in report.get("demonstrations", []):
        _name, plan, _time, oom = plans[d["task"]]
        out[d["task"]] = {"plan": plan, "step_time": float(d["replay_ms"]) / 1e3, "oom": bool(oom)}
    return out


class SelfImitationCallback(BaseCallback):
    """Clones ``best()`` (task name -> ``{"plan", "step_time", "oom"}``) between PPO updates."""

    def __init__(self, tasks: Sequence, env_kwargs: dict, best: Callable[[], dict], *, every: int = 4,
                 epochs: int = 5, batch_size: int = 128, seed: int = 0, known: dict | None = None,
                 learning_rate: float | None = None, log: Callable[[str], None] | None = None):
        super().__init__()
        self.known = dict(known or {})  # plans known before training (the imitated heuristics), same keys
        self.tasks = list(tasks)
        self.env_kwargs = dict(env_kwargs)
        self.best = best
        self.every = max(1, int(every))
        self.epochs = int(epochs)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.learning_rate = learning_rate
        self.say = log or (lambda _m: None)
        self.rollouts = 0
        self.rounds = 0
        self._cloned: dict[str, tuple] = {}  # task -> (oom, step_time) of the plan last cloned
        self.last: dict = {}
        self._env = None  # built on first use, like the training envs (its per-task setup is cached)

    def _on_step(self) -> bool:
        return True

    def _on_rollout_start(self) -> None:
        self.rollouts += 1
        if self.rollouts == 1:  # nothing found yet
            return
        best = {k: v for k, v in self.best().items() if not v["oom"]}
        for k, v in self.known.items():  # PPO's best replaces a known plan only when it is better
            if not v["oom"] and (k not in best or v["step_time"] < best[k]["step_time"]):
                best[k] = v
        keys = {k: (v["oom"], v["step_time"]) for k, v in best.items()}
        improved = any(self._cloned.get(k) != key for k, key in keys.items())
        if not best or not (improved or self.rollouts % self.every == 0):
            return
        from agent.imitation import behaviour_clone, replay

        if self._env is None:
            from envs.placement.env import PlacementEnv

            self._env = PlacementEnv(self.tasks, **self.env_kwargs)
        demos = [replay(self._env, t, best[t.name]["plan"], "best so far", float(best[t.name]["step_time"]))
                 for t in self.tasks if t.name in best]
        self.rounds += 1
        lr = {} if self.learning_rate is None else {"learning_rate": float(self.learning_rate)}
        self.last = behaviour_clone(self.model, demos, epochs=self.epochs, batch_size=self.batch_size,
                                    seed=self.seed + self.rounds, **lr)
        self._cloned = keys
        if self.last.get("epochs"):
            self.logger.record("self_imitation/cross_entropy", self.last["last_loss"])
            self.logger.record("self_imitation/greedy_agreement", self.last["greedy_agreement"])
            self.logger.record("self_imitation/rounds", self.rounds)


__all__ = ["SelfImitationCallback", "SETTINGS", "known_from_imitation"]
