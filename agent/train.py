"""PPO training of the graph placement policy over a distribution of tasks (RL-Zoo-style yaml configs).

A config (``experiments/configs/NAME.yaml``) has these sections, all optional except ``tasks``::

    seed: 0
    n_envs: 2                      # SubprocVecEnv when > 1, DummyVecEnv otherwise
    total_timesteps: 20000
    env:   {max_nodes: 32, max_devices: 8, objective: step_time, order: topological}
    tasks:                         # the training distribution
      builtin: [gpt-tiny, mlp-chain]           # graphs shipped in envs/data (envs.tasks)
      families: [gpt, mlp]                     # model-family specs (profilers.spec.sample_specs)
      n_specs: 4
      size: small
      specs: ["gpt:layers=2,hidden=64"]        # explicit specs or graph JSON paths
      topologies: [dgx-a100-80g, pcie-4gpu]
      batches: [null]
    eval_tasks: {builtin: [gpt-small], topologies: [dgx-a100-80g]}  # held out (MaskableEvalCallback)
    policy: {hidden: 64, rounds: 3}
    ppo:   {learning_rate: 3.0e-4, n_steps: 256, batch_size: 128, n_epochs: 4, gamma: 1.0, ...}
    callbacks: {eval_freq: 2048, checkpoint_freq: 10000, baselines: true}
    imitation: {epochs: 20, batch_size: 128}           # clone the best heuristic plans first (agent.imitation)
    self_imitation: {every: 4, epochs: 5}              # clone the best plan found so far (agent.self_imitation)

Every run lives in a run directory (default ``runs/NAME``): ``config.yaml``, ``model.zip`` (final),
``checkpoints/``, ``best/`` (best eval model), ``plans/`` (best plan per task, JSON) and ``tb/`` (the
TensorBoard logs). ``resume=True`` loads ``model.zip`` (or the newest checkpoint) and continues the
same step counter and the same TensorBoard curve.
"""

from __future__ import annotations

import copy
import os
import re
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from envs.errors import RlplaceError

DEFAULT_PPO: dict[str, Any] = {
    "learning_rate": 3e-4,
    "n_steps": 256,
    "batch_size": 128,
    "n_epochs": 4,
    "gamma": 1.0,  # the only reward is at the end of the episode
    "gae_lambda": 0.95,
    "clip_range": 0.2,
    "ent_coef": 0.01,
    "vf_coef": 0.5,
    "max_grad_norm": 0.5,
}
DEFAULT_ENV: dict[str, Any] = {"max_nodes": 32, "max_devices": 8, "objective": "step_time", "order": "topological"}
TB_NAME = "PPO"


class TrainError(RlplaceError):
    """A training config or run directory is unusable."""


# ---------------------------------------------------------------------- configs
@dataclass
class TrainConfig:
    """A parsed training config (see the module docstring)."""

    name: str
    raw: dict

    @property
    def seed(self) -> int:
        return int(self.raw.get("seed", 0))

    @property
    def n_envs(self) -> int:
        return max(1, int(self.raw.get("n_envs", 1)))

    @property
    def total_timesteps(self) -> int:
        return int(self.raw.get("total_timesteps", 10_000))

    @property
    def env(self) -> dict:
        return {**DEFAULT_ENV, **(self.raw.get("env") or {})}

    @property
    def ppo(self) -> dict:
        return {**DEFAULT_PPO, **(self.raw.get("ppo") or {})}

    @property
    def policy(self) -> dict:
        return dict(self.raw.get("policy") or {})

    @property
    def imitation(self) -> dict | None:
        """The imitation warm-start settings, or None without an ``imitation`` section."""
        sec = self.raw.get("imitation")
        if not sec:
            return None
        if not isinstance(sec, dict):
            return {"epochs": 20, "batch_size": 128}
        unknown = set(sec) - {"epochs", "batch_size"}
        if unknown:
            raise TrainError(f"unknown imitation setting(s) {sorted(unknown)}; known: batch_size, epochs")
        return {"epochs": int(sec.get("epochs", 20)), "batch_size": int(sec.get("batch_size", 128))}

    @property
    def self_imitation(self) -> dict | None:
        """The self-imitation settings (agent/self_imitation.py), or None without the section."""
        from agent.self_imitation import SETTINGS

        sec = self.raw.get("self_imitation")
        if not sec:
            return None
        if sec is True:
            sec = {}
        if not isinstance(sec, dict):
            raise TrainError(f"self_imitation must be a mapping of {', '.join(SETTINGS)} (or true), got {sec!r}")
        unknown = set(sec) - set(SETTINGS)
        if unknown:
            raise TrainError(f"unknown self_imitation setting(s) {sorted(unknown)}; known: {', '.join(SETTINGS)}")
        out = {k: sec.get(k, v) for k, v in SETTINGS.items()}
        bad = {k: v for k, v in out.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
        if bad:
            raise TrainError(f"self_imitation settings must be integers >= 1, got {bad}")
        return out

    @property
    def callbacks(self) -> dict:
        return {"eval_freq": 2048, "checkpoint_freq": 10_000, "baselines": True, "n_eval_episodes": None,
                **(self.raw.get("callbacks") or {})}


def load_config(path: str | os.PathLike | dict, name: str | None = None) -> TrainConfig:
    """Read a yaml config (or take a dict) and check its sections."""
    if isinstance(path, dict):
        raw = copy.deepcopy(path)
        cname = name or str(raw.get("name", "run"))
    else:
        p = Path(path)
        if not p.exists():
            raise TrainError(f"config not found: {p}")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise TrainError(f"{p}: not valid yaml ({exc})") from exc
        cname = name or str(raw.get("name", p.stem))
    if not isinstance(raw, dict):
        raise TrainError("a training config must be a mapping")
    known = {"name", "seed", "n_envs", "total_timesteps", "env", "tasks", "eval_tasks", "policy", "ppo", "callbacks",
             "imitation", "self_imitation"}
    unknown = set(raw) - known
    if unknown:
        raise TrainError(f"unknown config section(s) {sorted(unknown)}; known: {', '.join(sorted(known))}")
    if not raw.get("tasks"):
        raise TrainError("the config needs a 'tasks' section")
    cfg = TrainConfig(name=re.sub(r"[^A-Za-z0-9_.-]+", "-", cname), raw=raw)
    cfg.imitation  # noqa: B018 - validates the section now, not after the baselines ran
    cfg.self_imitation  # noqa: B018
    return cfg


# ---------------------------------------------------------------------- tasks
def build_tasks(section: dict, seed: int = 0) -> list:
    """The Task list a ``tasks`` / ``eval_tasks`` section describes (graphs x topologies x batches)."""
    from envs.tasks import Task, load_builtin_graph
    from envs.topology import resolve_topology

    if not isinstance(section, dict):
        raise TrainError("a tasks section must be a mapping")
    graphs = [load_builtin_graph(n) for n in section.get("builtin") or []]
    specs = list(section.get("specs") or [])
    if section.get("families"):
        from profilers.spec import sample_specs

        specs += sample_specs(section["families"], int(section.get("n_specs", 4)), seed=seed,
                              size=str(section.get("size", "small")))
    if specs:
        from agent.resolve import resolve_graph

        graphs += [resolve_graph(s) for s in specs]
    if not graphs:
        raise TrainError("a tasks section needs 'builtin', 'specs' or 'families'")
    topos = [resolve_topology(t) for t in section.get("topologies") or ["dgx-a100-80g"]]
    batches = list(section.get("batches") or [None])
    return [Task(g, t, b) for g in graphs for t in topos for b in batches]


def env_kwargs(cfg: TrainConfig) -> dict:
    return dict(cfg.env)


def make_env_fn(tasks: Sequence, kwargs: dict, seed: int) -> Callable[[], Any]:
    """A picklable thunk building one monitored PlacementEnv (for SubprocVecEnv workers)."""

    def _init():
        import torch as th
        from stable_baselines3.common.monitor import Monitor

        from envs.placement_env import PlacementEnv

        th.set_num_threads(1)
        env = PlacementEnv(list(tasks), seed=seed, **kwargs)
        return Monitor(env)

    return _init


def make_vec_env(tasks: Sequence, kwargs: dict, n_envs: int, seed: int):
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    fns = [make_env_fn(tasks, kwargs, seed + i) for i in range(n_envs)]
    if n_envs > 1:
        return SubprocVecEnv(fns, start_method="fork" if os.name == "posix" else "spawn")
    return DummyVecEnv(fns)


# ---------------------------------------------------------------------- training
@dataclass
class TrainResult:
    """What :func:`train` leaves behind."""

    run_dir: Path
    model_path: Path
    num_timesteps: int
    best: dict  # task -> {"step_time", "ref_time", "speedup", "heuristic_time", "plan"}
    seconds: float


def _latest_checkpoint(run_dir: Path) -> Path | None:
    ck = sorted((run_dir / "checkpoints").glob("*.zip"), key=lambda p: p.stat().st_mtime)
    return ck[-1] if ck else None


def train(config: str | os.PathLike | dict | TrainConfig, *, run_dir: str | os.PathLike | None = None,
          total_steps: int | None = None, resume: bool = False, progress: bool = True, verbose: int = 0,
          log: Callable[[str], None] | None = print) -> TrainResult:
    """Train (or resume) a MaskablePPO placement policy as the config says; returns the run summary.

    ``total_steps`` overrides the config's ``total_timesteps``: the step counter the run should reach
    (on ``resume`` it trains only the remaining steps)."""
    import torch as th
    from sb3_contrib import MaskablePPO
    from stable_baselines3.common.callbacks import CallbackList, CheckpointCallback

    from agent.callbacks import (
        BestPlanCallback,
        GanttCallback,
        GanttEvalCallback,
        HParamCallback,
        ProgressCallback,
    )
    from agent.policy import GraphPlacementPolicy

    cfg = config if isinstance(config, TrainConfig) else load_config(config)
    run = Path(run_dir) if run_dir is not None else Path("runs") / cfg.name
    target = int(total_steps if total_steps is not None else cfg.total_timesteps)
    if target < 1:
        raise TrainError(f"total steps must be >= 1, got {target}")
    say = log or (lambda _m: None)
    th.set_num_threads(1)  # small per-step batches: one thread each avoids oversubscribing shared cores
    t0 = time.time()
    tasks = build_tasks(cfg.raw["tasks"], seed=cfg.seed)
    eval_tasks = build_tasks(cfg.raw["eval_tasks"], seed=cfg.seed + 1000) if cfg.raw.get("eval_tasks") else []
    kw = env_kwargs(cfg)
    run.mkdir(parents=True, exist_ok=True)
    model_path = run / "model.zip"
    if resume:
        src = model_path if model_path.exists() else _latest_checkpoint(run)
        if src is None:
            raise TrainError(f"--resume: no model.zip or checkpoint in {run}")
        saved = run / "config.yaml"
        if saved.exists():  # the run's own config defines its tasks and shapes
            cfg = load_config(yaml.safe_load(saved.read_text()), name=cfg.name)
            tasks = build_tasks(cfg.raw["tasks"], seed=cfg.seed)
            eval_tasks = build_tasks(cfg.raw["eval_tasks"], seed=cfg.seed + 1000) if cfg.raw.get("eval_tasks") else []
            kw = env_kwargs(cfg)
    else:
        (run / "config.yaml").write_text(yaml.safe_dump({**cfg.raw, "name": cfg.name}, sort_keys=False))
    venv = make_vec_env(tasks, kw, cfg.n_envs, cfg.seed)
    eval_env = make_vec_env(eval_tasks, kw, 1, cfg.seed + 10_000) if eval_tasks else None
    try:
        if resume:
            model = MaskablePPO.load(src, env=venv, device="cpu")
            model.tensorboard_log = str(run / "tb")
            say(f"resuming {src} at step {model.num_timesteps}")
        else:
            model = MaskablePPO(GraphPlacementPolicy, venv, seed=cfg.seed, device="cpu", verbose=verbose,
                                tensorboard_log=str(run / "tb"), policy_kwargs=cfg.policy, **cfg.ppo)
        remaining = target - model.num_timesteps
        cb_cfg = cfg.callbacks
        best_cb = BestPlanCallback(tasks, run / "plans", objective=kw.get("objective", "step_time"),
                                   baselines=bool(cb_cfg["baselines"]), log=say)
        known = {}
        if not resume and cfg.imitation is not None:
            known = _imitation_warm_start(model, cfg, tasks, kw, best_cb, run, say)
        callbacks = [best_cb, HParamCallback(cfg), CheckpointCallback(
            save_freq=max(1, int(cb_cfg["checkpoint_freq"]) // cfg.n_envs), save_path=str(run / "checkpoints"),
            name_prefix="model")]
        if eval_env is not None:
            n_eval = cb_cfg["n_eval_episodes"] or max(len(eval_tasks), 1)
            callbacks.append(GanttEvalCallback(eval_env, best_cb, n_eval_episodes=int(n_eval),
                                               eval_freq=max(1, int(cb_cfg["eval_freq"]) // cfg.n_envs),
                                               best_model_save_path=str(run / "best"), log_path=str(run / "eval"),
                                               deterministic=True, verbose=0))
        else:
            callbacks.append(GanttCallback(best_cb, eval_freq=max(1, int(cb_cfg["eval_freq"]) // cfg.n_envs)))
        if cfg.self_imitation is not None:
            from agent.self_imitation import SelfImitationCallback

            callbacks.append(SelfImitationCallback(tasks, kw, lambda: best_cb.best, seed=cfg.seed, known=known,
                                                   **cfg.self_imitation))
        if progress:
            callbacks.append(ProgressCallback(best_cb, target))
        if remaining > 0:
            with warnings.catch_warnings():  # Subproc training vs Dummy eval env is intended
                warnings.filterwarnings("ignore", message="Training and eval env are not of the same type")
                model.learn(total_timesteps=remaining, callback=CallbackList(callbacks), tb_log_name=TB_NAME,
                            reset_num_timesteps=not resume, progress_bar=False)
        else:
            say(f"already at step {model.num_timesteps} >= {target}; nothing to train")
        model.save(model_path)
        best = best_cb.summary()
    finally:
        venv.close()
        if eval_env is not None:
            eval_env.close()
    return TrainResult(run_dir=run, model_path=model_path, num_timesteps=int(model.num_timesteps), best=best,
                       seconds=time.time() - t0)


def _imitation_warm_start(model, cfg: TrainConfig, tasks: Sequence, kw: dict, best_cb, run: Path, say) -> dict:
    """Clone the best heuristic plans before PPO; the heuristic table also feeds the best-plan callback.
    Returns the cloned plans as self-imitation's known bests."""
    import json

    from agent.imitation import best_heuristic_plans, warm_start
    from agent.self_imitation import known_from_imitation
    from envs.graph import atomic_write_json

    t = time.perf_counter()
    plans = best_heuristic_plans(tasks, kw.get("objective", "step_time"), seed=cfg.seed)
    say(f"baselines for {len(tasks)} task(s) in {time.perf_counter() - t:.1f}s")
    best_cb.heuristic.update({name: {"placer": placer, "step_time": st, "oom": oom}
                              for name, (placer, _plan, st, oom) in plans.items()})
    report = warm_start(model, tasks, kw, plans=plans, seed=cfg.seed, log=say, **cfg.imitation)
    atomic_write_json(run / "imitation.json", json.loads(json.dumps(report, default=float)))
    (run / "checkpoints").mkdir(parents=True, exist_ok=True)
    model.save(run / "checkpoints" / "model_0_steps.zip")  # the cloned policy, before any PPO step
    return known_from_imitation(report, plans)


# ---------------------------------------------------------------------- evaluation helpers
def greedy_scores(model, tasks: Sequence, kwargs: dict) -> np.ndarray:
    """The score of the policy's deterministic plan on each task (one episode per task; the final plan's
    ``info["score"]``, which in refine mode is not the last step's reward)."""
    from envs.placement_env import PlacementEnv

    env = PlacementEnv(list(tasks), **kwargs)
    out = []
    for task in tasks:
        obs, _ = env.reset(options={"task": task})
        done, info = False, {}
        while not done:
            a, _ = model.predict(obs, action_masks=env.action_masks(), deterministic=True)
            obs, _, done, _, info = env.step(int(a))
        out.append(float(info["score"]))
    return np.array(out)


__all__ = ["TrainConfig", "TrainResult", "TrainError", "load_config", "build_tasks", "train", "greedy_scores",
           "make_vec_env"]
