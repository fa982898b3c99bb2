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

The whole config is validated (:mod:`agent.config`: unknown keys, types, ranges) and its tasks and
environments are built before anything is written; a problem is one :class:`TrainError` line naming the
file and the field.

Every run lives in a run directory (default ``runs/NAME``): ``config.yaml``, ``model.zip`` (final),
``checkpoints/`` (``model_<steps>_steps.zip``), ``best/`` (best eval model), ``eval/evaluations.npz``,
``plans/`` (best plan per task, JSON) and ``tb/`` (the TensorBoard logs). Models are written atomically
(a kill leaves the old file or the new one). ``resume=True`` loads the newest model by step count that
loads (``model.zip`` or a checkpoint; a broken zip is skipped with a warning) and continues the same step
counter, the same TensorBoard curve and the same ``evaluations.npz``. Ctrl-C saves a checkpoint first.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import shlex
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from agent.config import TrainSpec, check_batch_size
from envs.errors import RlplaceError
from envs.files import one_line, read_document, validated

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


class InitWeightsMismatch(TrainError):
    """``--init POLICY``: the policy's network does not have the shapes of the config's network."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped :func:`train` after it saved a resumable checkpoint; the message says where and how
    to resume. A ``KeyboardInterrupt``, so the command line ends with exit code 130."""

    def __init__(self, message: str, checkpoint: Path, num_timesteps: int):
        super().__init__(message)
        self.checkpoint = checkpoint
        self.num_timesteps = num_timesteps


# ---------------------------------------------------------------------- configs
@dataclass
class TrainConfig:
    """A parsed, validated training config (see the module docstring and :mod:`agent.config`).

    ``raw`` is the mapping as written; ``source`` the file it was read from (None for a dict)."""

    name: str
    raw: dict
    source: str | None = None
    spec: TrainSpec | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.spec is None:
            self.spec = parse_spec(self.raw, self.source)

    @property
    def where(self) -> str:
        """The prefix of this config's one-line errors: its file, or "training config"."""
        return f"{self.source}: " if self.source else "training config: "

    @property
    def seed(self) -> int:
        return self.spec.seed

    @property
    def n_envs(self) -> int:
        return self.spec.n_envs

    @property
    def total_timesteps(self) -> int:
        return self.spec.total_timesteps

    @property
    def env(self) -> dict:
        return {**DEFAULT_ENV, **self.spec.env.model_dump(exclude_unset=True)}

    @property
    def ppo(self) -> dict:
        return {**DEFAULT_PPO, **self.spec.ppo.model_dump(exclude_unset=True)}

    @property
    def policy(self) -> dict:
        return self.spec.policy.model_dump(exclude_unset=True)

    @property
    def imitation(self) -> dict | None:
        """The imitation warm-start settings, or None without an ``imitation`` section."""
        sec = self.spec.imitation
        return None if sec is None else sec.model_dump()

    @property
    def self_imitation(self) -> dict | None:
        """The self-imitation settings (agent/self_imitation.py), or None without the section."""
        sec = self.spec.self_imitation
        return None if sec is None else sec.model_dump()

    @property
    def callbacks(self) -> dict:
        return self.spec.callbacks.model_dump()


def parse_spec(raw: Any, source: str | os.PathLike | None = None) -> TrainSpec:
    """``raw`` checked against the config schema (:class:`agent.config.TrainSpec`); a problem raises a
    one-line :class:`TrainError` naming ``source`` (or "training config") and the field."""
    where = f"{source}: " if source is not None else "training config: "
    if not isinstance(raw, dict):
        raise TrainError(f"{where}a training config must be a mapping of sections, got {type(raw).__name__}")
    spec = validated(TrainSpec, raw, "training config", TrainError, source)
    problem = check_batch_size(spec)
    if problem:
        raise TrainError(where + problem)
    return spec


def load_config(path: str | os.PathLike | dict, name: str | None = None) -> TrainConfig:
    """Read a yaml config (or take a dict) and validate all of it (:func:`parse_spec`)."""
    if isinstance(path, dict):
        raw, source = copy.deepcopy(path), None
    else:
        source = str(path)
        raw = read_document(path, "training config", TrainError)
        raw = {} if raw is None else raw  # an empty file: "tasks: missing"
    spec = parse_spec(raw, source)
    cname = name or spec.name or (Path(source).stem if source else "run")
    return TrainConfig(name=re.sub(r"[^A-Za-z0-9_.-]+", "-", cname), raw=raw, source=source, spec=spec)


# ---------------------------------------------------------------------- tasks
def build_tasks(section: dict, seed: int = 0) -> list:
    """The Task list a ``tasks`` / ``eval_tasks`` section describes (graphs x topologies x batches)."""
    from envs.presets import resolve_topology
    from envs.tasks import Task, load_builtin_graph

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


def task_lists(cfg: TrainConfig) -> tuple[list, list]:
    """The training and held-out Task lists of a config; an unknown graph, spec or topology raises a
    one-line :class:`TrainError` naming the config and the section."""
    out = []
    for section, seed in (("tasks", cfg.seed), ("eval_tasks", cfg.seed + 1000)):
        if not cfg.raw.get(section):
            out.append([])
            continue
        try:
            out.append(build_tasks(cfg.raw[section], seed=seed))
        except (RlplaceError, OSError) as exc:
            raise TrainError(f"{cfg.where}{section}: {one_line(exc)}") from None
    return out[0], out[1]


def env_kwargs(cfg: TrainConfig) -> dict:
    return dict(cfg.env)


def make_env_fn(tasks: Sequence, kwargs: dict, seed: int, ignore_sigint: bool = False) -> Callable[[], Any]:
    """A picklable thunk building one monitored PlacementEnv (for SubprocVecEnv workers). With
    ``ignore_sigint`` (a worker process) Ctrl-C is left to the main process, which saves and closes."""

    def _init():
        import torch as th
        from stable_baselines3.common.monitor import Monitor

        from envs.placement.env import PlacementEnv

        if ignore_sigint:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        th.set_num_threads(1)
        env = PlacementEnv(list(tasks), seed=seed, **kwargs)
        return Monitor(env)

    return _init


def make_vec_env(tasks: Sequence, kwargs: dict, n_envs: int, seed: int):
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    sub = n_envs > 1
    fns = [make_env_fn(tasks, kwargs, seed + i, ignore_sigint=sub) for i in range(n_envs)]
    if sub:
        return SubprocVecEnv(fns, start_method="fork" if os.name == "posix" else "spawn")
    return DummyVecEnv(fns)


def _close_quietly(env) -> None:
    """Close a vec env; a worker that is already gone (after Ctrl-C or a crash) is not a second error.
    A SubprocVecEnv interrupted inside a step or reset may have a worker's answer half read (Ctrl-C in the
    middle of a large observation's ``recv``): reading that pipe again would take the rest of the answer
    for a length header and wait for bytes that never come, and SB3's own close reads every pending answer.
    So nothing is read: the workers are told to close, and any that does not end within seconds (one
    blocked sending its answer to nobody) is terminated."""
    if env is None:
        return
    remotes, processes = getattr(env, "remotes", None), getattr(env, "processes", None)
    if remotes is None or processes is None or getattr(env, "closed", False):
        try:
            env.close()
        except (EOFError, OSError):  # BrokenPipeError, ConnectionResetError: the worker is gone
            pass
        return
    for remote in remotes:
        try:
            remote.send(("close", None))
        except (EOFError, OSError):
            pass
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.terminate()
            process.join(timeout=5)
    env.waiting, env.closed = False, True


def build_envs(cfg: TrainConfig, tasks: Sequence, eval_tasks: Sequence, kw: dict):
    """The training vec env and the eval vec env (None without held-out tasks). A task the env cannot
    take raises a one-line :class:`TrainError` here, in this process (a subprocess worker could not say
    why it died)."""
    from envs.placement.env import PlacementEnv

    venv = None
    try:
        if cfg.n_envs > 1:
            PlacementEnv(list(tasks), **kw).close()  # the workers build the same env
        venv = make_vec_env(tasks, kw, cfg.n_envs, cfg.seed)
        eval_env = make_vec_env(eval_tasks, kw, 1, cfg.seed + 10_000) if eval_tasks else None
    except RlplaceError as exc:
        _close_quietly(venv)
        raise TrainError(f"{cfg.where}env: {one_line(exc)}") from None
    except BaseException:
        _close_quietly(venv)
        raise
    return venv, eval_env


# ---------------------------------------------------------------------- resuming
CHECKPOINT_NAME = re.compile(r"model_(\d+)_steps\.zip")


def saved_steps(path: str | os.PathLike) -> int:
    """The step counter (``num_timesteps``) a saved SB3 model zip holds, read from its ``data`` entry."""
    import json
    import zipfile

    with zipfile.ZipFile(path) as z:
        return int(json.loads(z.read("data"))["num_timesteps"])


def _set_aside(path: Path, exc: BaseException, say: Callable[[str], None]) -> None:
    """Warn about an unloadable model zip and rename it to ``*.corrupt`` (kept, but never picked again)."""
    aside = path.with_name(path.name + ".corrupt")
    try:
        os.replace(path, aside)
        where = f"; moved to {aside.name}"
    except OSError:
        where = ""
    say(f"warning: skipping {path}: it does not load ({one_line(exc, 120)}){where}")


def _remove_unfinished_saves(run: Path) -> None:
    """Delete the temporary files of saves a kill interrupted (``.NAME.*.tmp.EXT``, see envs.files)."""
    for folder in (run, run / "checkpoints", run / "best", run / "eval", run / "plans"):
        if folder.is_dir():
            for p in folder.glob(".*.tmp.*"):
                p.unlink(missing_ok=True)


def pick_checkpoint(run: Path, say: Callable[[str], None] = print) -> Path:
    """The newest model of a run *by step count* that loads: ``model.zip`` (its ``num_timesteps``) or
    ``checkpoints/model_<steps>_steps.zip``; ``model.zip`` wins a tie. A zip that does not load (a 0-byte
    or truncated file) is skipped with a one-line warning and renamed ``*.corrupt``."""
    from sb3_contrib import MaskablePPO

    found: list[tuple[int, int, Path]] = []
    for p in (run / "checkpoints").glob("model_*_steps.zip"):
        m = CHECKPOINT_NAME.fullmatch(p.name)
        if m:
            found.append((int(m.group(1)), 0, p))
    final = run / "model.zip"
    skipped = 0
    if final.exists():
        try:
            found.append((saved_steps(final), 1, final))
        except Exception as exc:  # noqa: BLE001 - any way a zip can be broken
            _set_aside(final, exc, say)
            skipped += 1
    for _steps, _final, p in sorted(found, reverse=True):
        try:
            MaskablePPO.load(p, device="cpu")
        except Exception as exc:  # noqa: BLE001
            _set_aside(p, exc, say)
            skipped += 1
            continue
        return p
    why = f" ({skipped} did not load)" if skipped else ""
    raise TrainError(f"--resume: no loadable model.zip or checkpoints/model_*_steps.zip in {run}{why}")


# ---------------------------------------------------------------------- training
@dataclass
class TrainResult:
    """What :func:`train` leaves behind."""

    run_dir: Path
    model_path: Path
    num_timesteps: int
    best: dict  # task -> {"step_time", "ref_time", "speedup", "oom", "timestep", "heuristic", ...}
    seconds: float
    model: Any = field(default=None, repr=False)  # the trained MaskablePPO (its environments closed)
    config: TrainConfig | None = field(default=None, repr=False)  # the config the run used
    tasks: list = field(default_factory=list, repr=False)  # the training tasks
    episodes: int = 0  # training episodes finished in this call
    imitation: dict | None = None  # the behaviour-cloning report (agent.imitation.warm_start), if it ran
    self_imitation_rounds: int | None = None  # self-imitation rounds, with a self_imitation section


def _resume_config(run: Path, cfg: TrainConfig) -> TrainConfig:
    """The config of the run to resume: its own ``config.yaml`` (it defines the tasks and shapes)."""
    if not run.is_dir():
        raise TrainError(f"--resume: no run directory {run}")
    saved = run / "config.yaml"
    return load_config(saved, name=cfg.name) if saved.exists() else cfg


@contextlib.contextmanager
def _ignoring_sigint() -> Iterator[None]:
    """A block that Ctrl-C does not interrupt (a save that must finish); a no-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _save_interrupted(model, run: Path, cfg: TrainConfig) -> TrainingInterrupted:
    """Save the interrupted model as a checkpoint (atomically, Ctrl-C held off); the exception to raise."""
    from agent.callbacks import atomic_save

    steps = int(model.num_timesteps)
    path = run / "checkpoints" / f"model_{steps}_steps.zip"
    with _ignoring_sigint():
        atomic_save(model, path)
    config = shlex.quote(cfg.source or str(run / "config.yaml"))
    return TrainingInterrupted(f"training interrupted at step {steps}; checkpoint saved to {path}; resume with: "
                               f"rlplace train --config {config} --run-dir {shlex.quote(str(run))} --resume",
                               path, steps)


def train(config: str | os.PathLike | dict | TrainConfig, *, run_dir: str | os.PathLike | None = None,
          total_steps: int | None = None, resume: bool = False, progress: bool = True, verbose: int = 0,
          log: Callable[[str], None] | None = print, callbacks: Sequence = (), deadline: float | None = None,
          init_weights: str | os.PathLike | None = None, executor=None) -> TrainResult:
    """Train (or resume) a MaskablePPO placement policy as the config says; returns the run summary.

    ``total_steps`` overrides the config's ``total_timesteps``: the step counter the run should reach
    (on ``resume`` it trains only the remaining steps). The config, the tasks and the environments are
    all checked before the run directory is created. Ctrl-C saves ``checkpoints/model_<steps>_steps.zip``
    and raises :class:`TrainingInterrupted`.

    Extension points: ``callbacks`` (SB3 callbacks) run after the run's own; ``deadline`` (a
    ``time.perf_counter()`` value) ends PPO once that moment has passed, whatever the step count;
    ``init_weights`` (a model zip, new runs only) initialises the policy's weights before the imitation
    warm start (the GNN is padding-agnostic: a policy trained with other padding fits as long as its
    widths and option count agree).

    A config with an ``expert_iteration`` section trains by expert iteration instead
    (:mod:`agent.expert_iteration`: rounds of search, distillation, PPO and held-out evaluation over the
    drawn ``tasks.distribution``; ``executor``, an :class:`agent.scale.Executor`, runs its searches)."""
    import torch as th

    from agent.callbacks import DeadlineCallback, atomic_save
    from agent.self_imitation import SelfImitationCallback
    from envs.files import check_output_dir

    # the run: config, tasks and environments, every one checked before anything is written
    given = config if isinstance(config, TrainConfig) else load_config(config)
    run = Path(run_dir) if run_dir is not None else Path("runs") / given.name
    target = int(total_steps if total_steps is not None else given.total_timesteps)
    if target < 1:
        raise TrainError(f"total steps must be >= 1, got {target}")
    if resume and init_weights is not None:
        raise TrainError("--resume continues the run's own weights; initial weights are for a new run")
    say = log or (lambda _m: None)
    th.set_num_threads(1)  # small per-step batches: one thread each avoids oversubscribing shared cores
    t0 = time.time()
    cfg = _resume_config(run, given) if resume else given
    if not resume:
        check_output_dir(run, "run directory")
    if cfg.spec.expert_iteration is not None:
        return _train_by_expert_iteration(cfg, given, run, resume=resume, progress=progress, verbose=verbose, say=say,
                                          init_weights=init_weights, deadline=deadline, t0=t0, executor=executor)
    tasks, eval_tasks = task_lists(cfg)
    kw = env_kwargs(cfg)
    source = _resume_source(run, say) if resume else None
    weights = _policy_weights(init_weights) if init_weights is not None else None
    venv, eval_env = build_envs(cfg, tasks, eval_tasks, kw)
    try:
        # the model: the checkpoint to resume, or a new one (initial weights, then behaviour cloning)
        model = _resumed_model(source, venv, run, say) if resume else _new_model(cfg, venv, run, verbose, weights)
        if weights is not None:
            say(f"initial weights from {init_weights}")
        best_cb = _best_plan_callback(cfg, tasks, kw, run, say)
        imitation, known = _imitation_warm_start(model, cfg, tasks, kw, best_cb, run, say) \
            if not resume and cfg.imitation is not None else (None, {})
        # PPO with the run's callbacks, then the caller's
        own = _run_callbacks(cfg, model, run, tasks, eval_tasks, eval_env, kw, best_cb, known, target, resume,
                             progress, say)
        extra = list(callbacks) + ([DeadlineCallback(deadline)] if deadline is not None else [])
        _learn(model, own + extra, target, resume, run, given, say)
        atomic_save(model, run / "model.zip")
    finally:
        _close_quietly(venv)
        _close_quietly(eval_env)
    self_imitation = next((cb for cb in own if isinstance(cb, SelfImitationCallback)), None)
    return TrainResult(run_dir=run, model_path=run / "model.zip", num_timesteps=int(model.num_timesteps),
                       best=best_cb.summary(), seconds=time.time() - t0, model=model, config=cfg, tasks=list(tasks),
                       episodes=best_cb.episodes, imitation=imitation,
                       self_imitation_rounds=None if self_imitation is None else self_imitation.rounds)


def _train_by_expert_iteration(cfg: TrainConfig, given: TrainConfig, run: Path, *, resume: bool, progress: bool,
                               verbose: int, say: Callable[[str], None], init_weights, deadline: float | None,
                               t0: float, executor) -> TrainResult:
    """:func:`train` for a config with an ``expert_iteration`` section."""
    from agent.expert_iteration import expert_iteration

    kw = env_kwargs(cfg)
    weights = _policy_weights(init_weights) if init_weights is not None else None
    if weights is not None:
        check_init_weights(cfg, kw, weights)  # before the dataset's searches, not after them
    venvs: list = []

    def model_factory(tasks: Sequence):
        from envs.placement.env import PlacementEnv

        try:
            if cfg.n_envs > 1:
                PlacementEnv(list(tasks), **kw).close()  # the workers build the same env
            venv = make_vec_env(tasks, kw, cfg.n_envs, cfg.seed)
        except RlplaceError as exc:
            raise TrainError(f"{cfg.where}env: {one_line(exc)}") from None
        venvs.append(venv)
        model = _new_model(cfg, venv, run, verbose, weights)
        if weights is not None:
            say(f"initial weights from {init_weights}")
        return model, venv

    try:
        res = expert_iteration(cfg, run, model_factory=model_factory, resume=resume, progress=progress, log=say,
                               executor=executor, deadline=deadline, initial_given=weights is not None)
    except KeyboardInterrupt:
        raise TrainingInterrupted(f"expert iteration interrupted; finished phases are kept; resume with: rlplace "
                                  f"train --config {shlex.quote(cfg.source or str(run / 'config.yaml'))} --run-dir "
                                  f"{shlex.quote(str(run))} --resume", run / "expert_iteration.json", 0) from None
    finally:
        for v in venvs:
            _close_quietly(v)
    return TrainResult(run_dir=run, model_path=res.model_path, num_timesteps=int(res.model.num_timesteps), best={},
                       seconds=time.time() - t0, model=res.model, config=cfg, tasks=[],
                       imitation={"rounds": res.rounds, "selected_round": res.selected_round})


def _resume_source(run: Path, say: Callable[[str], None]) -> Path:
    """The checkpoint a resumed run continues from (unfinished saves of a killed run removed first)."""
    _remove_unfinished_saves(run)
    return pick_checkpoint(run, say)


def _resumed_model(source: Path, venv, run: Path, say: Callable[[str], None]):
    from sb3_contrib import MaskablePPO

    try:
        model = MaskablePPO.load(source, env=venv, device="cpu")
    except ValueError as exc:  # spaces differ: the config's shapes changed since the checkpoint
        raise TrainError(f"--resume: {source} does not fit the run's environment: {one_line(exc)}") from None
    model.tensorboard_log = str(run / "tb")
    say(f"resuming {source} at step {model.num_timesteps}")
    return model


def _new_model(cfg: TrainConfig, venv, run: Path, verbose: int, weights: dict | None = None):
    """A fresh MaskablePPO (its policy set to ``weights`` if given); the run directory and its
    ``config.yaml`` are the first things written."""
    from sb3_contrib import MaskablePPO

    from agent.policy import GraphPlacementPolicy
    from envs.files import atomic_write_text

    model = MaskablePPO(GraphPlacementPolicy, venv, seed=cfg.seed, device="cpu", verbose=verbose,
                        tensorboard_log=str(run / "tb"), policy_kwargs=cfg.policy, **cfg.ppo)
    if weights is not None:
        refuse_unfit_weights(model.policy.state_dict(), weights)
        model.policy.load_state_dict(weights)
    model.episode_kwargs = episode_settings(cfg)
    run.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run / "config.yaml", yaml.safe_dump({**cfg.raw, "name": cfg.name}, sort_keys=False))
    return model


def episode_settings(cfg: TrainConfig) -> dict:
    """The env settings a policy must place with (saved with the model: agent.infer.EPISODE_KEYS)."""
    from agent.infer import EPISODE_KEYS

    env = {**cfg.spec.env.model_dump(), **cfg.env}
    return {k: (list(env[k]) if isinstance(env[k], (list, tuple)) else env[k]) for k in EPISODE_KEYS if k in env}


def check_init_weights(cfg: TrainConfig, kw: dict, weights: dict) -> None:
    """Raise :class:`InitWeightsMismatch` when ``weights`` do not load into the network ``cfg`` builds for
    its environment settings ``kw`` (the network's shapes depend on the padding alone; a probe environment
    on a built-in graph on two devices gives the spaces). Nothing is written."""
    from agent.policy import GraphPlacementPolicy
    from envs.placement.env import PlacementEnv
    from envs.presets import cpu_local
    from envs.tasks import Task, load_builtin_graph

    try:
        env = PlacementEnv([Task(load_builtin_graph("gpt-tiny"), cpu_local(2))], **kw)
    except RlplaceError:  # settings no probe fits (e.g. one device): the model's own check comes later
        return
    try:
        policy = GraphPlacementPolicy(env.observation_space, env.action_space, lambda _: 0.0, **cfg.policy)
    finally:
        env.close()
    refuse_unfit_weights(policy.state_dict(), weights)


def refuse_unfit_weights(wanted: dict, given: dict) -> None:
    """One-line :class:`InitWeightsMismatch` naming the first :func:`weight_differences`, if any."""
    differences = weight_differences(wanted, given)
    if differences:
        more = f" (and {len(differences) - 3} more)" if len(differences) > 3 else ""
        raise InitWeightsMismatch("initial weights do not fit the config's policy: " + "; ".join(differences[:3])
                                  + more + " — give the config the env padding and policy section the weights were "
                                  "trained with (the shipped policy's: experiments/configs/pretrained.yaml)")


def weight_differences(wanted: dict, given: dict) -> list[str]:
    """What keeps the state dict ``given`` from loading into a network whose state dict is ``wanted``:
    tensors missing or extra, and tensors of other shapes (e.g. another ``hidden`` width, another
    ``max_options`` padding for the global heads); ``[]`` when it loads."""
    out = [f"{k}: shape {tuple(given[k].shape)} in the policy, {tuple(v.shape)} in the config's network"
           for k, v in wanted.items() if k in given and tuple(given[k].shape) != tuple(v.shape)]
    missing = [k for k in wanted if k not in given]
    extra = [k for k in given if k not in wanted]
    if missing:
        out.append(f"{len(missing)} tensor(s) the policy lacks (first {missing[0]})")
    if extra:
        out.append(f"{len(extra)} tensor(s) the config's network lacks (first {extra[0]})")
    return out


def _policy_weights(path: str | os.PathLike) -> dict:
    """The policy weights (state dict) of the model zip at ``path``."""
    from sb3_contrib import MaskablePPO

    if not Path(path).is_file():
        raise TrainError(f"initial weights not found: {path}")
    try:
        return MaskablePPO.load(path, device="cpu").policy.state_dict()
    except Exception as exc:  # noqa: BLE001 - a broken zip, a pickle of unknown classes, ...
        raise TrainError(f"cannot load initial weights {path}: {type(exc).__name__}: {one_line(exc)}") from None


def _best_plan_callback(cfg: TrainConfig, tasks: Sequence, kw: dict, run: Path, say: Callable[[str], None]):
    from agent.callbacks import BestPlanCallback

    return BestPlanCallback(tasks, run / "plans", objective=kw.get("objective", "step_time"),
                            baselines=bool(cfg.callbacks["baselines"]), log=say)


def _run_callbacks(cfg: TrainConfig, model, run: Path, tasks: Sequence, eval_tasks: Sequence, eval_env, kw: dict,
                   best_cb, known: dict, target: int, resume: bool, progress: bool,
                   say: Callable[[str], None]) -> list:
    """The run's own callbacks, in order: (resume marker), best plans, hyperparameters, checkpoints,
    held-out evaluation (or Gantt charts alone), self-imitation, progress bar."""
    from agent.callbacks import (
        AtomicCheckpointCallback,
        GanttCallback,
        GanttEvalCallback,
        HParamCallback,
        ProgressCallback,
        TensorBoardResumeCallback,
    )

    cb_cfg = cfg.callbacks
    every = max(1, int(cb_cfg["eval_freq"]) // cfg.n_envs)
    out = [best_cb, HParamCallback(cfg), AtomicCheckpointCallback(
        save_freq=max(1, int(cb_cfg["checkpoint_freq"]) // cfg.n_envs), save_path=str(run / "checkpoints"),
        name_prefix="model")]
    if resume:
        out.insert(0, TensorBoardResumeCallback(model.num_timesteps))
    if eval_env is not None:
        n_eval = cb_cfg["n_eval_episodes"] or max(len(eval_tasks), 1)
        eval_cb = GanttEvalCallback(eval_env, best_cb, n_eval_episodes=int(n_eval), eval_freq=every,
                                    best_model_save_path=str(run / "best"), log_path=str(run / "eval"),
                                    deterministic=True, verbose=0)
        if resume:
            eval_cb.resume(int(model.num_timesteps), say)
        out.append(eval_cb)
    else:
        out.append(GanttCallback(best_cb, eval_freq=every))
    if cfg.self_imitation is not None:
        from agent.self_imitation import SelfImitationCallback

        out.append(SelfImitationCallback(tasks, kw, lambda: best_cb.best, seed=cfg.seed, known=known,
                                         **cfg.self_imitation))
    if progress:
        out.append(ProgressCallback(best_cb, target))
    return out


def _learn(model, callbacks: list, target: int, resume: bool, run: Path, given: TrainConfig,
           say: Callable[[str], None]) -> None:
    """PPO up to step ``target`` (Ctrl-C: save a checkpoint and raise :class:`TrainingInterrupted`)."""
    from stable_baselines3.common.callbacks import CallbackList

    from agent.callbacks import ProgressCallback

    remaining = target - model.num_timesteps
    if remaining <= 0:
        say(f"already at step {model.num_timesteps} >= {target}; nothing to train")
        return
    try:
        with warnings.catch_warnings():  # Subproc training vs Dummy eval env is intended
            warnings.filterwarnings("ignore", message="Training and eval env are not of the same type")
            # reset_num_timesteps=False on resume: the same step counter and TensorBoard curve
            model.learn(total_timesteps=remaining, callback=CallbackList(callbacks), tb_log_name=TB_NAME,
                        reset_num_timesteps=not resume, progress_bar=False)
    except KeyboardInterrupt:
        for cb in callbacks:
            if isinstance(cb, ProgressCallback):
                cb.close()
        raise _save_interrupted(model, run, given) from None


def _imitation_warm_start(model, cfg: TrainConfig, tasks: Sequence, kw: dict, best_cb, run: Path,
                          say) -> tuple[dict, dict]:
    """Clone the best heuristic plans before PPO; the heuristic table also feeds the best-plan callback.
    Returns the imitation report and the cloned plans as self-imitation's known bests."""
    import json

    from agent.callbacks import atomic_save
    from agent.imitation import best_heuristic_plans, warm_start
    from agent.self_imitation import known_from_imitation
    from envs.files import atomic_write_json

    t = time.perf_counter()
    plans = best_heuristic_plans(tasks, kw.get("objective", "step_time"), seed=cfg.seed)
    say(f"baselines for {len(tasks)} task(s) in {time.perf_counter() - t:.1f}s")
    best_cb.heuristic.update({name: {"placer": placer, "step_time": st, "oom": oom}
                              for name, (placer, _plan, st, oom) in plans.items()})
    report = warm_start(model, tasks, kw, plans=plans, seed=cfg.seed, log=say, **cfg.imitation)
    atomic_write_json(run / "imitation.json", json.loads(json.dumps(report, default=float)))
    atomic_save(model, run / "checkpoints" / "model_0_steps.zip")  # the cloned policy, before any PPO step
    return report, known_from_imitation(report, plans)


# ---------------------------------------------------------------------- evaluation helpers
def greedy_scores(model, tasks: Sequence, kwargs: dict) -> np.ndarray:
    """The score of the policy's deterministic plan on each task (one episode per task; the final plan's
    ``info["score"]``, which in refine mode is not the last step's reward)."""
    return policy_scores(model, tasks, kwargs)


def policy_scores(model, tasks: Sequence, kwargs: dict, *, deterministic: bool = True,
                  episodes: int = 1) -> np.ndarray:
    """Per task, the mean final ``info["score"]`` of ``episodes`` episodes of the policy (greedy, or
    sampled with ``deterministic=False``: seed torch first for repeatable samples)."""
    from envs.placement.env import PlacementEnv

    env = PlacementEnv(list(tasks), **kwargs)
    out = []
    for task in tasks:
        scores = []
        for _ in range(episodes):
            obs, _ = env.reset(options={"task": task})
            done, info = False, {}
            while not done:
                a, _ = model.predict(obs, action_masks=env.action_masks(), deterministic=deterministic)
                obs, _, done, _, info = env.step(int(a))
            scores.append(float(info["score"]))
        out.append(float(np.mean(scores)))
    return np.array(out)


__all__ = ["TrainConfig", "TrainResult", "TrainError", "TrainingInterrupted", "load_config", "parse_spec",
           "build_tasks", "task_lists", "build_envs", "pick_checkpoint", "saved_steps", "train", "greedy_scores",
           "policy_scores",
           "make_vec_env"]
