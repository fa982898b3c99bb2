"""Placing one model with a trained policy: rollouts, optional fine-tune and local search, baselines.

:func:`place` runs, for one (graph, topology):

1. the policy's greedy rollout plus ``samples`` sampled rollouts (``PlacementEnv`` coarsens the graph
   to at most ``max_groups`` groups, by default :func:`policy_groups`; the GNN works for any padding, so
   the graph and topology may be larger than those the policy was trained on); a refine-mode episode's
   candidate is the best plan it visited (every step simulated), or its final plan alone when the
   guided search follows (step 5) or ``samples`` is 0;
2. optionally ``finetune_steps`` of PPO on this task alone (only when the task fits the policy's
   padding), then the rollouts again;
3. the fast heuristic baselines (:func:`run_baselines`: :data:`agent.placers.PLACERS` except the search
   placers; when every one of them fails, the standard plans of ``envs.plan``);
4. optionally ``search_seconds`` of local search (:func:`search_from_best`: ``agent.placers``' MCMC)
   from the best plan so far;
5. with a ``budget_seconds`` and/or ``max_evaluations``, the policy-guided search: a refine-mode policy
   first revisits the best plan so far itself (greedy + ``samples // 2`` sampled episodes that start from
   that plan, every step simulated), then :func:`agent.guided_search.guided_search` (annealing whose moves
   the policy proposes, on the groups of :func:`search_policy_groups`) runs from the best plan for what is
   left of ``budget_seconds`` (the budget covers the whole call, approximately: the steps before it are
   not cut short) and ``max_evaluations``.
   ``PlaceResult.evaluations`` counts the simulations of each part.

Every candidate carries its evaluation on the *operator* graph (a :class:`Candidate`): a placer's plan
keeps the evaluation its own Scorer made (``agent.placers.common.finished_evaluation``), a policy plan
is simulated once. The best plan (plans that fit in memory first) is returned, so the result is never
worse than the best baseline. Its provenance says which candidate won.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from agent.placers import PLACERS, SEARCH_PLACERS, run_placer
from agent.placers.common import finished_evaluation
from envs.errors import PlanError, RlplaceError
from envs.evaluator import CachedSimulation, EvalResult
from envs.files import one_line
from envs.graph import OpGraph
from envs.plan import Plan, standard_plans
from envs.topology import Topology

PRETRAINED_DIR = Path(__file__).with_name("pretrained")
PRETRAINED = PRETRAINED_DIR / "placement_policy.zip"
# the whole call's default budget: a 500-group graph (greedy + 8 samples ~2 s, baselines ~1 s) then gets
# ~17 s of guided search and finishes in about 20 s on 2 cores
DEFAULT_BUDGET_SECONDS = 20.0
# the groups the policy places when the caller names none: finer than the padding the shipped policy was
# trained at (its GNN does not depend on the size), so operator placements (a tower per device, a branch
# per device) survive the coarsening, and small enough that greedy + 8 samples stay within seconds
DEFAULT_POLICY_GROUPS = 128


class PlaceError(RlplaceError):
    """A placement request cannot be served (no policy file, bad objective, ...)."""


@dataclass
class Candidate:
    """One plan considered by :func:`place` and its evaluation on the operator graph."""

    name: str
    kind: str  # "policy", "baseline" or "search"
    plan: Plan
    value: float  # what candidates are compared by: the evaluation's objective value
    evaluation: EvalResult
    seconds: float = 0.0

    @property
    def oom(self) -> bool:
        return bool(self.evaluation.oom)

    @property
    def peak_memory(self) -> float:
        """Bytes on the fullest device."""
        peak = self.evaluation.peak_memory
        return float(peak.max()) if peak.size else 0.0

    def key(self) -> tuple:
        return (1 if self.oom else 0, self.value)

    @classmethod
    def of(cls, name: str, kind: str, plan: Plan, evaluation: EvalResult, objective: str,
           seconds: float = 0.0) -> Candidate:
        """The candidate of an evaluated plan, valued by its objective value."""
        return cls(name=name, kind=kind, plan=plan, value=float(evaluation.value),
                   evaluation=evaluation, seconds=seconds)


@dataclass
class PlaceResult:
    """The chosen plan and every candidate (best first)."""

    plan: Plan
    best: Candidate
    candidates: list[Candidate]
    seconds: dict[str, float] = field(default_factory=dict)
    search: object | None = None  # the guided search's agent.guided_search.GuidedResult, when it ran
    evaluations: dict[str, int] = field(default_factory=dict)  # simulations per step (policy, guided_search)

    def best_baseline(self) -> Candidate | None:
        base = [c for c in self.candidates if c.kind == "baseline"]
        return min(base, key=Candidate.key) if base else None


# the share of the sampled episodes that start from the runner-up start: 1 in 4 (2 of 8). Measured on target
# (a) (experiments/bench_agent.py, 25 cases): half of them took the 10-GPU series-parallel DAG from 0.962 to
# 0.986 of the best heuristic but lost the best-start samples that had found twotower#0's 12.76 ms (1.637 ->
# 1.538) and t5's small gains (geometric mean 1.0845 -> 1.0827)
RUNNER_UP_SHARE = 4


def resolve_model(spec: str | OpGraph) -> OpGraph:
    """A graph from a built-in name, a graph JSON or a model spec (``agent.resolve.resolve_graph``)."""
    from agent.resolve import resolve_graph

    return resolve_graph(spec)


# ---------------------------------------------------------------------- evaluating candidates
def evaluate_candidate(name: str, kind: str, plan: Plan, graph: OpGraph, topology: Topology, objective: str,
                       evaluator: CachedSimulation, seconds: float = 0.0) -> Candidate | None:
    """Validate and simulate ``plan``; None if it is not a valid plan for the graph."""
    try:
        plan.validate(graph, topology)
    except PlanError:
        return None
    return Candidate.of(name, kind, plan, evaluator.evaluate(graph, topology, plan, objective), objective, seconds)


def placer_candidate(name: str, kind: str, plan: Plan, graph: OpGraph, topology: Topology, objective: str,
                     evaluator: CachedSimulation, seconds: float = 0.0) -> Candidate | None:
    """A placer's plan with the evaluation its placer already made (validated and simulated then);
    simulated here only if that evaluation is not at hand."""
    evaluation = finished_evaluation(plan, graph, topology, objective)
    if evaluation is None:
        return evaluate_candidate(name, kind, plan, graph, topology, objective, evaluator, seconds)
    return Candidate.of(name, kind, plan, evaluation, objective, seconds)


# ---------------------------------------------------------------------- baselines
@contextlib.contextmanager
def _quiet_stdout():
    """Silence C-level stdout (METIS prints partitioning warnings straight to file descriptor 1)."""
    try:
        sys.stdout.flush()
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # captured stdout (pytest, notebooks): nothing to do
        yield
        return
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


# megatron_3d's evaluations among the fast baselines. Its enumeration is coarse to fine (every parallel
# shape once first), so 32 evaluations reach each shape: measured on the agent benchmarks' 26 (b) and (a)
# cases, 16 -> 32 found better Megatron plans on 6 (t5 on 3 devices 101.6 -> 90.6 s, the 16-device
# Inception 49.9 -> 40.0 ms, GPT on dgx-a100 13.04 -> 12.92 ms) at <= 1 s each (Llama-8B, 420 operators on
# 32 devices: 1.5 s); 64 added nothing on them and took up to 10 s (ViT, 286 operators, 3 devices)
FAST_MEGATRON_EVALUATIONS = 32


def fast_placer_names() -> list[str]:
    """The cheap heuristic placers of ``agent.placers`` (the search placers but megatron_3d left out)."""
    return [n for n in PLACERS if n not in SEARCH_PLACERS or n == "megatron_3d"]


def run_baselines(graph: OpGraph, topology: Topology, objective: str = "step_time", *, seed: int = 0,
                  evaluator: CachedSimulation | None = None, names: list[str] | None = None) -> list[Candidate]:
    """Run the fast heuristic baselines and keep their plans with their evaluations (a failing placer is
    skipped; when all fail, the standard plans of ``envs.plan`` are simulated instead)."""
    ev = evaluator or CachedSimulation()
    out: list[Candidate] = []
    for name in names if names is not None else fast_placer_names():
        t = time.perf_counter()
        try:
            with _quiet_stdout():
                plan = run_placer(name, graph, topology, seed=seed, objective=objective,
                                  budget=FAST_MEGATRON_EVALUATIONS if name == "megatron_3d" else None)
        except RlplaceError:
            continue
        c = placer_candidate(name, "baseline", plan, graph, topology, objective, ev, time.perf_counter() - t)
        if c is not None:
            out.append(c)
    if not out:
        for name, plan in standard_plans(graph, topology).items():
            c = evaluate_candidate(name, "baseline", plan, graph, topology, objective, ev)
            if c is not None:
                out.append(c)
    return out


def local_search(graph: OpGraph, topology: Topology, start: Plan, objective: str, seconds: float,
                 seed: int = 0) -> Plan | None:
    """MCMC from ``start`` for ``seconds`` (agent.placers' mcmc); None if it fails."""
    try:
        return run_placer("mcmc", graph, topology, seed=seed, objective=objective, budget=float(seconds),
                          start=start.copy())
    except RlplaceError:
        return None


def search_from_best(cands: list[Candidate], graph: OpGraph, topology: Topology, objective: str, seconds: float,
                     seed: int = 0, evaluator: CachedSimulation | None = None) -> list[Candidate]:
    """``seconds`` of local search from the best of ``cands``: the plan found as a "search" candidate
    (``[]`` when the search fails)."""
    t = time.perf_counter()
    start = min(cands, key=Candidate.key)
    found = local_search(graph, topology, start.plan, objective, seconds, seed)
    if found is None:
        return []
    c = placer_candidate(f"mcmc from {start.name}", "search", found, graph, topology, objective,
                         evaluator or CachedSimulation(), time.perf_counter() - t)
    return [c] if c is not None else []


# ---------------------------------------------------------------------- policy rollouts
def load_policy(path: str | os.PathLike | None = None):
    """A MaskablePPO model from ``path`` (default: the shipped pretrained policy)."""
    from sb3_contrib import MaskablePPO

    p = Path(path) if path is not None else PRETRAINED
    if not p.exists():
        hint = "" if path is not None else " (train one with `python experiments/train_pretrained.py`)"
        raise PlaceError(f"policy file not found: {p}{hint}")
    try:
        model = MaskablePPO.load(p, device="cpu")
    except Exception as exc:  # a corrupt zip, a pickle of unknown classes, ...
        raise PlaceError(f"cannot load policy {p}: {type(exc).__name__}: {one_line(exc)}") from None
    saved = getattr(model, "episode_kwargs", None)  # stored with the model by agent.train
    model.episode_kwargs = {**(saved if isinstance(saved, dict) else {}), **run_episode_kwargs(p)}
    return model


_CACHED: dict[tuple[str, float], object] = {}


def cached_policy(path: str | os.PathLike):
    """:func:`load_policy`, once per process and file version (for workers that place many tasks)."""
    key = (str(path), os.path.getmtime(path))
    if key not in _CACHED:
        _CACHED.clear()
        _CACHED[key] = load_policy(path)
    return _CACHED[key]


EPISODE_KEYS = ("mode", "refine_init", "refine_passes", "order", "microbatch_choices")


def run_episode_kwargs(policy_path: Path) -> dict:
    """How the policy's training run built its episodes (``mode``, ``refine_*``, ``order``,
    ``microbatch_choices`` of the run's ``config.yaml``, next to ``model.zip`` or one level above a
    checkpoint), so a policy trained in refine mode also places in refine mode; ``{}`` when there is no
    run config (a copied policy: then the settings saved with the model apply)."""
    import yaml

    for d in (policy_path.parent, policy_path.parent.parent):
        cfg = d / "config.yaml"
        if cfg.is_file():
            try:
                env = (yaml.safe_load(cfg.read_text()) or {}).get("env") or {}
            except yaml.YAMLError as exc:
                raise PlaceError(f"{cfg}: not valid yaml ({exc})") from exc
            return {k: env[k] for k in EPISODE_KEYS if k in env}
    return {}


def model_shape(model) -> dict:
    """The padding a model was trained with (max_nodes, max_devices, max_edges, max_options)."""
    sp = model.observation_space.spaces
    return {"max_nodes": int(sp["node_features"].shape[0]), "max_devices": int(sp["device_features"].shape[0]),
            "max_edges": int(sp["edge_index"].shape[1]), "max_options": int(sp["option_features"].shape[0])}


def rollout(model, env, task, *, deterministic: bool, rng: np.random.Generator | None = None) -> dict:
    """One episode of ``env`` on ``task`` with the model's GNN (works for any padding); the final info."""
    return rollouts(model, [env], task, [deterministic], rng)[0]


def padding_sizes(obs: dict[str, np.ndarray]) -> dict[str, int]:
    """The used (unpadded) size of each axis of one observation (its node, edge, device and option masks:
    static keys, the same for the whole task)."""
    from envs.placement.observation import GLOBAL_CHOICES
    from envs.placement.options import N_MODIFIERS

    options = max(int(obs["option_mask"].sum()), -(-GLOBAL_CHOICES // N_MODIFIERS))  # room for the global choices
    return {"nodes": max(int(obs["node_mask"].sum()), 1), "edges": max(int(obs["edge_mask"].sum()), 1),
            "devices": max(int(obs["device_mask"].sum()), 1), "options": options, "actions": options * N_MODIFIERS}


def trim_to(obs: dict[str, np.ndarray], sizes: dict[str, int], keys) -> dict[str, np.ndarray]:
    """``obs[k]`` for ``k`` in ``keys`` cut to :func:`padding_sizes` ``sizes`` along its declared axes
    (:data:`envs.placement.observation.OBSERVATION`): the padded node, edge, device and placement slots
    go (the GNN needs none of them; padded placements are the last ones, so the action indices of the
    others are unchanged and the logits simply end earlier)."""
    from envs.placement.observation import OBSERVATION

    return {k: obs[k][tuple(slice(sizes.get(axis)) for axis in OBSERVATION[k].shape)] for k in keys}


def rollouts(model, envs: list, task, deterministic: list[bool], rng: np.random.Generator | None = None,
             start: Plan | str | list | None = None) -> list[dict]:
    """Episodes of ``task`` in several environments in lockstep (one batched forward per step).

    The GNN's static part (graph and device encoders) runs once for the task; each step only runs the
    dynamic part on the stacked dynamic arrays. ``deterministic[i]`` says whether env ``i`` takes the
    argmax or samples from the masked softmax; returns each episode's final info. ``start``: refine-mode
    episodes start from this plan (``PlacementEnv.reset``'s ``start`` option: a Plan or
    ``envs.placement.env.RUNNER_UP``) instead of the template; a list gives each env its own."""
    import torch as th

    fe = model.policy.features_extractor
    rng = rng or np.random.default_rng()
    threads = th.get_num_threads()
    th.set_num_threads(1)  # the same float sums in every process, so greedy plans do not depend on threads
    try:
        return _rollouts(fe, envs, task, deterministic, rng, start)
    finally:
        th.set_num_threads(threads)


def _rollouts(fe, envs: list, task, deterministic: list[bool], rng: np.random.Generator,
              start: Plan | str | list | None = None) -> list[dict]:
    import torch as th

    from envs.placement.observation import DYNAMIC_KEYS, STATIC_KEYS

    starts = start if isinstance(start, list) else [start] * len(envs)
    obs = [e.reset(options={"task": task} if s is None else {"task": task, "start": s})[0]
           for e, s in zip(envs, starts)]
    done = [False] * len(envs)
    infos: list[dict] = [{} for _ in envs]
    sizes = padding_sizes(obs[0])  # same task in every env: the same static arrays and sizes
    static = {k: th.as_tensor(v)[None] for k, v in trim_to(obs[0], sizes, STATIC_KEYS).items()}
    expanded: dict[int, tuple[dict, th.Tensor, th.Tensor]] = {}  # batch size -> the static part, expanded
    with th.no_grad():
        dev_s, node_s = fe.static_embeddings(static)
        while not all(done):
            active = [i for i in range(len(envs)) if not done[i]]
            masks = {i: envs[i].action_masks() for i in active}
            choose = [i for i in active if masks[i].sum() > 1]
            logits = {}
            if choose:
                trimmed = [trim_to(obs[i], sizes, DYNAMIC_KEYS) for i in choose]
                b = len(choose)
                batch = {k: th.from_numpy(np.stack([o[k] for o in trimmed])) for k in trimmed[0]}
                if b not in expanded:
                    expanded[b] = ({k: v.expand(b, *v.shape[1:]) for k, v in static.items()},
                                   dev_s.expand(b, -1, -1), node_s.expand(b, -1, -1))
                static_b, dev_b, node_b = expanded[b]
                batch.update(static_b)
                out = fe.logits_from_embeddings(batch, dev_b, node_b)[0]
                out = out.numpy().astype(np.float64)
                logits = {i: out[j] for j, i in enumerate(choose)}
            for i in active:
                m = masks[i]
                if i not in logits:
                    a = int(np.flatnonzero(m)[0])
                else:
                    lg = np.where(m[:logits[i].size], logits[i], -np.inf)
                    if deterministic[i]:
                        a = int(np.argmax(lg))
                    else:
                        p = np.exp(lg - lg.max())
                        a = int(rng.choice(len(p), p=p / p.sum()))
                obs[i], _, done[i], _, info = envs[i].step(a)
                if done[i]:
                    infos[i] = info
    return infos


def policy_env(model, task, objective: str, max_groups: int | None, evaluator=None, episode: dict | None = None):
    """The environment ``model`` places ``task`` in: the model's padding when the task fits it (``fits``),
    else ``max_groups`` groups (default: the padding's node count) on every device of the topology;
    ``episode`` overrides the run's episode settings (e.g. ``{"mode": "refine"}``).
    Returns ``(env, fits, factory)``; ``factory()`` builds another env like it (for sampled rollouts)."""
    from envs.placement.env import PlacementEnv

    shape = model_shape(model)
    n_groups = int(max_groups) if max_groups is not None else shape["max_nodes"]
    nd = max(shape["max_devices"], task.topology.num_devices)
    fits = n_groups == shape["max_nodes"] and nd == shape["max_devices"]
    kw = dict(max_nodes=n_groups, max_devices=nd, objective=objective,
              **{**getattr(model, "episode_kwargs", {}), **(episode or {})})
    if fits:
        kw.update(max_edges=shape["max_edges"], max_options=shape["max_options"])
    try:
        env = PlacementEnv([task], evaluator=evaluator, **kw)
    except RlplaceError:
        # a denser coarse graph than the padding (DenseNet's concatenations): as many edge slots as it can
        # have -- each coarse edge stands for at least one of the graph's edges; the GNN does not mind
        kw.update(max_edges=max(8 * n_groups, task.graph.num_edges), max_options=None)
        env, fits = PlacementEnv([task], evaluator=evaluator, **kw), False

    def factory():
        return PlacementEnv([task], evaluator=evaluator, **kw)

    return env, fits, factory


def policy_candidates(model, env, task, graph: OpGraph, objective: str, samples: int, seed: int,
                      evaluator: CachedSimulation, label: str = "policy", env_factory=None,
                      start: Plan | None = None) -> list[Candidate]:
    """The greedy rollout and ``samples`` sampled ones (run in lockstep), scored on ``graph``; refine-mode
    episodes from ``start`` if given, else the greedy one and most samples from the environment's start
    and the last ``samples // RUNNER_UP_SHARE`` from its runner-up start (``envs.placement.env.RUNNER_UP``,
    the best start placed otherwise): a better start does not always give a better episode."""
    from envs.placement.env import RUNNER_UP

    rng = np.random.default_rng(seed)
    envs = [env] + [env_factory() for _ in range(samples)] if env_factory is not None and samples else [env]
    flags = [i == 0 for i in range(samples + 1)]
    hedge = samples // RUNNER_UP_SHARE if start is None and env.mode == "refine" else 0
    starts = [start] * (len(flags) - hedge) + [RUNNER_UP] * hedge
    t = time.perf_counter()
    if len(envs) == len(flags):
        infos = rollouts(model, envs, task, flags, rng, start=starts)
    else:
        infos = [rollouts(model, [env], task, [f], rng, start=s)[0] for f, s in zip(flags, starts)]
    per = (time.perf_counter() - t) / len(flags)
    out = []
    for i, info in enumerate(infos):
        name = f"{label} greedy" if i == 0 else f"{label} sample {i}"
        name += " (runner-up start)" if starts[i] == RUNNER_UP else ""
        plans = [(name, info["plan"])] + ([(f"{name} (best visited)", info["best_plan"])] if "best_plan" in info
                                          else [])
        for label_i, plan in plans:
            c = evaluate_candidate(label_i, "policy", plan, graph, task.topology, objective, evaluator, per)
            if c is not None:
                out.append(c)
    return out


def finetune(model, env_factory, steps: int, seed: int = 0):
    """A copy of ``model`` after ``steps`` of PPO on this task alone (``env_factory`` builds envs with
    the model's padding); the caller's model is left untouched."""
    import io

    from sb3_contrib import MaskablePPO
    from stable_baselines3.common.monitor import Monitor
    from stable_baselines3.common.vec_env import DummyVecEnv

    buf = io.BytesIO()
    model.save(buf)
    buf.seek(0)
    venv = DummyVecEnv([lambda: Monitor(env_factory())])
    tuned = MaskablePPO.load(buf, env=venv, device="cpu", n_steps=max(8, min(int(model.n_steps), int(steps))),
                             batch_size=max(8, min(int(model.batch_size), int(steps))))
    tuned.set_random_seed(seed)
    tuned.learn(total_timesteps=int(steps), reset_num_timesteps=True, progress_bar=False)
    return tuned


# ---------------------------------------------------------------------- the pipeline
def place(graph: OpGraph, topology: Topology, *, model=None, policy: str | os.PathLike | None = None,
          objective: str = "step_time", samples: int = 8, finetune_steps: int = 0, search_seconds: float = 0.0,
          seed: int = 0, max_groups: int | None = None, baselines: bool = True,
          budget_seconds: float | None = None, max_evaluations: int | None = None,
          log: Callable[[str], None] | None = None) -> PlaceResult:
    """Best plan for ``graph`` on ``topology`` from the policy, the baselines and local search.

    ``budget_seconds`` (the whole call's wall clock) and ``max_evaluations`` (simulator evaluations of
    the guided search) bound the policy-guided search; it runs when either is given and neither is 0."""
    import torch as th

    from envs.tasks import Task

    t_start = time.perf_counter()
    _check_request(objective, samples, finetune_steps, search_seconds)
    _check_budget(budget_seconds, max_evaluations)
    say = log or (lambda _m: None)
    th.set_num_threads(1)
    secs: dict[str, float] = {}
    ev = CachedSimulation(cache_size=4096)
    model = model if model is not None else load_policy(policy)
    search_groups = search_policy_groups(model, max_groups)
    max_groups = policy_groups(model, max_groups, finetune_steps)
    task = Task(graph, topology)
    policy_ev = CachedSimulation(cache_size=4096)  # the rollouts' simulations, counted apart
    # greedy only, or a guided search to follow: a refine episode simulates its final plan alone (the fast
    # path for large graphs). Before the guided search, simulating every step (the best visited plan, one
    # evaluation per group and episode) bought nothing the search does not find: experiments/bench_search.py,
    # 15 cases x 2 seeds, the same values at 4,000 guided evaluations (0.9995 in geometric mean) with 1-26%
    # fewer evaluations in all (the 134-operator DAG: 1,450 rollout evaluations -> 45)
    fast = {"evaluate_steps": False} if samples == 0 or (finetune_steps == 0 and _guided_requested(
        budget_seconds, max_evaluations)) else None
    with _timed(secs, "env"):
        env, fits, factory = policy_env(model, task, objective, max_groups, policy_ev, episode=fast)
    with _timed(secs, "policy"):
        cands = policy_candidates(model, env, task, graph, objective, samples, seed, ev, env_factory=factory)
    if finetune_steps > 0 and not fits:
        say("fine-tuning skipped: the task does not fit the policy's padding")
    elif finetune_steps > 0:
        with _timed(secs, "finetune"):
            tuned = finetune(model, factory, finetune_steps, seed)
            cands += policy_candidates(tuned, env, task, graph, objective, samples, seed + 1, ev, label="finetuned",
                                       env_factory=factory)
    if baselines:
        with _timed(secs, "baselines"):
            cands += run_baselines(graph, topology, objective, seed=seed, evaluator=ev)
    if not cands:
        raise PlaceError("no valid plan was produced")
    if search_seconds > 0:
        with _timed(secs, "search"):
            cands += search_from_best(cands, graph, topology, objective, search_seconds, seed, ev)
    found = None
    if _guided_requested(budget_seconds, max_evaluations):
        if env.mode == "refine" and samples > 0:  # the policy's own moves from the best plan so far first
            best = min(cands, key=Candidate.key)
            with _timed(secs, "policy_refinement"):
                cands += policy_candidates(model, env, task, graph, objective, max(1, samples // 2), seed + 7, ev,
                                           label=f"policy from {best.name}", env_factory=factory, start=best.plan)
        left = None if budget_seconds is None else budget_seconds - (time.perf_counter() - t_start)
        if left is not None and left < MIN_SEARCH_SECONDS:
            say(f"guided search skipped: {budget_seconds:g} s of budget were spent before it")
        else:
            with _timed(secs, "guided_search"):
                found = guided_from_best(cands, model, graph, topology, objective, seed=seed, seconds=left,
                                         evaluations=max_evaluations, max_groups=search_groups, evaluator=ev)
            cands += found[0]
    cands.sort(key=Candidate.key)
    evaluations = {"policy": int(policy_ev.misses), "guided_search": int(found[1].evaluations) if found else 0}
    return PlaceResult(plan=winning_plan(cands, objective, seed), best=cands[0], candidates=cands, seconds=secs,
                       search=found[1] if found else None, evaluations=evaluations)


def policy_groups(model, max_groups: int | None, finetune_steps: int = 0) -> int:
    """The groups the policy places the graph in: ``max_groups`` when given; else the policy's padding when
    fine-tuning (PPO needs the observation shape it was trained on), else the larger of the padding and
    :data:`DEFAULT_POLICY_GROUPS`."""
    if max_groups is not None:
        return int(max_groups)
    pad = model_shape(model)["max_nodes"]
    return pad if finetune_steps > 0 else max(pad, DEFAULT_POLICY_GROUPS)


def search_policy_groups(model, max_groups: int | None) -> int:
    """The groups the guided search's policy moves act on: ``max_groups`` when given, else the padding the
    policy was trained at, the granularity its move distribution was learned for. Measured
    (``experiments/bench_search.py``, 15 cases x 2 seeds at 4,000 evaluations) against the rollouts'
    :data:`DEFAULT_POLICY_GROUPS` (128): geometric mean 1.009 of the 128-group search's times, MCMC matched
    on 27 of 30 rows instead of 25 (the series-parallel DAG, 134 operators: 13.90 -> 12.36 ms; at 128
    groups nearly every group is one operator, and the chain drifted over neutral one-operator moves without
    improving); at 64 groups 1.001, at 20 groups 1.003, mixing 20 and 40 per proposal 1.000."""
    return int(max_groups) if max_groups is not None else int(model_shape(model)["max_nodes"])


MIN_SEARCH_SECONDS = 0.05  # less budget than this left: the guided search is skipped


def guided_from_best(cands: list[Candidate], model, graph: OpGraph, topology: Topology, objective: str, *,
                     seed: int, seconds: float | None, evaluations: int | None, max_groups: int | None,
                     evaluator: CachedSimulation) -> tuple[list[Candidate], object]:
    """The policy-guided search from the best of ``cands``: its plan as a "search" candidate, and the
    search's :class:`agent.guided_search.GuidedResult`."""
    from agent.guided_search import guided_search

    start = min(cands, key=Candidate.key)
    res = guided_search(model, graph, topology, objective, start.plan, seed=seed, seconds=seconds,
                        evaluations=evaluations, max_groups=max_groups, evaluator=evaluator)
    c = placer_candidate(f"guided search from {start.name}", "search", res.plan, graph, topology, objective,
                         evaluator, res.seconds)
    return ([c] if c is not None else []), res


def _guided_requested(budget_seconds: float | None, max_evaluations: int | None) -> bool:
    """The guided search runs when a budget is given and no budget is 0."""
    given = budget_seconds is not None or max_evaluations is not None
    return given and budget_seconds != 0 and max_evaluations != 0


def _check_budget(budget_seconds: float | None, max_evaluations: int | None) -> None:
    if budget_seconds is not None and (isinstance(budget_seconds, bool) or not math.isfinite(budget_seconds)
                                       or budget_seconds < 0):
        raise PlaceError(f"--budget-seconds must be a finite number of seconds >= 0, got {budget_seconds}")
    if max_evaluations is not None and (isinstance(max_evaluations, bool) or int(max_evaluations) != max_evaluations
                                        or max_evaluations < 0):
        raise PlaceError(f"--max-evaluations must be an integer >= 0, got {max_evaluations}")


def _check_request(objective: str, samples: int, finetune_steps: int, search_seconds: float) -> None:
    from envs.sim import OBJECTIVES

    if objective not in OBJECTIVES:
        raise PlaceError(f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
    if samples < 0 or finetune_steps < 0 or search_seconds < 0:
        raise PlaceError("--samples, --finetune-steps and --search-seconds must be >= 0")


@contextlib.contextmanager
def _timed(seconds: dict[str, float], stage: str):
    """Record the wall-clock seconds of the block as ``seconds[stage]``."""
    t = time.perf_counter()
    yield
    seconds[stage] = time.perf_counter() - t


def winning_plan(cands: list[Candidate], objective: str, seed: int) -> Plan:
    """A copy of the best candidate's plan (``cands`` sorted best first), its provenance saying which
    candidate won, what it predicts and how the best baseline compares."""
    best = cands[0]
    base = [c for c in cands if c.kind == "baseline"]
    best_base = min(base, key=Candidate.key) if base else None
    plan = best.plan.copy()
    plan.provenance = {**dict(best.plan.provenance), "placer": "rlplace-agent", "winner": best.name,
                       "winner_kind": best.kind, "objective": objective, "predicted_step_time": best.value,
                       "oom": best.oom, "best_baseline": best_base.name if best_base else None,
                       "best_baseline_time": best_base.value if best_base else None,
                       "candidates": len(cands), "seed": int(seed)}
    return plan


__all__ = ["place", "PlaceResult", "Candidate", "PlaceError", "run_baselines", "search_from_best", "load_policy",
           "rollout", "rollouts", "PRETRAINED", "model_shape", "fast_placer_names", "resolve_model"]
