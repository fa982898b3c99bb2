"""Placing one model with a trained policy: rollouts, optional fine-tune and local search, baselines.

:func:`place` runs, for one (graph, topology):

1. the policy's greedy rollout plus ``samples`` sampled rollouts (``PlacementEnv`` coarsens the graph
   to at most ``max_groups`` groups; the GNN works for any padding, so the graph and topology may be
   larger than those the policy was trained on);
2. optionally ``finetune_steps`` of PPO on this task alone (only when the task fits the policy's
   padding), then the rollouts again;
3. the fast heuristic baselines (:data:`agent.placers.PLACERS` except the search placers; without
   ``agent.placers``, the single-device, data-parallel and Megatron templates of ``envs.plan``);
4. optionally ``search_seconds`` of local search (``agent.placers``' MCMC) from the best plan so far.

Every candidate is scored by the simulator on the *operator* graph; the best plan (plans that fit in
memory first) is returned, so the result is never worse than the best baseline. Its provenance says
which candidate won.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from envs.errors import PlanError, RlplaceError
from envs.evaluator import SimulatorEvaluator
from envs.files import one_line
from envs.graph import OpGraph
from envs.plan import Plan, standard_plans
from envs.topology import Topology

PRETRAINED_DIR = Path(__file__).with_name("pretrained")
PRETRAINED = PRETRAINED_DIR / "placement_policy.zip"
_FALLBACK_BASELINES = ("single_device", "data_parallel", "megatron")


class PlaceError(RlplaceError):
    """A placement request cannot be served (no policy file, bad objective, ...)."""


@dataclass
class Candidate:
    """One plan considered by :func:`place`, scored on the operator graph."""

    name: str
    kind: str  # "policy", "baseline" or "search"
    plan: Plan
    value: float  # the objective value (agent.placers.common.score: per global batch for throughput)
    step_time: float  # the simulator's objective value
    oom: bool
    peak_memory: float
    seconds: float = 0.0

    def key(self) -> tuple:
        return (1 if self.oom else 0, self.value)


@dataclass
class PlaceResult:
    """The chosen plan and every candidate (best first)."""

    plan: Plan
    best: Candidate
    candidates: list[Candidate]
    seconds: dict[str, float] = field(default_factory=dict)

    def best_baseline(self) -> Candidate | None:
        base = [c for c in self.candidates if c.kind == "baseline"]
        return min(base, key=Candidate.key) if base else None


def resolve_model(spec: str | OpGraph) -> OpGraph:
    """A graph from a built-in name, a graph JSON or a model spec (``agent.resolve.resolve_graph``)."""
    from agent.resolve import resolve_graph

    return resolve_graph(spec)


# ---------------------------------------------------------------------- scoring
def objective_value(step_time: float, plan: Plan, objective: str) -> float:
    """What placers minimise: step time, or for throughput the time per global batch."""
    try:
        from agent.placers.common import score
    except ImportError:  # pragma: no cover - agent.placers ships with rlplace
        return float(step_time) * (plan.microbatches if objective == "throughput" else 1)
    return score(step_time, plan, objective)


def evaluate_candidate(name: str, kind: str, plan: Plan, graph: OpGraph, topology: Topology, objective: str,
                       evaluator: SimulatorEvaluator, seconds: float = 0.0) -> Candidate | None:
    """Validate and simulate ``plan``; None if it is not a valid plan for the graph."""
    try:
        plan.validate(graph, topology)
    except PlanError:
        return None
    res = evaluator.evaluate(graph, topology, plan, objective)
    return Candidate(name=name, kind=kind, plan=plan, value=objective_value(res.step_time, plan, objective),
                     step_time=float(res.step_time), oom=bool(res.oom),
                     peak_memory=float(res.peak_memory.max()) if res.peak_memory.size else 0.0, seconds=seconds)


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


def fast_placer_names() -> list[str]:
    """The cheap heuristic placers of ``agent.placers`` (empty if the package is missing)."""
    try:
        from agent.placers import PLACERS, SEARCH_PLACERS
    except ImportError:  # pragma: no cover
        return []
    return [n for n in PLACERS if n not in SEARCH_PLACERS or n == "megatron_3d"]


def run_baselines(graph: OpGraph, topology: Topology, objective: str = "step_time", *, seed: int = 0,
                  evaluator: SimulatorEvaluator | None = None, names: list[str] | None = None) -> list[Candidate]:
    """Run the fast heuristic baselines and score them on ``graph`` (a failing placer is skipped)."""
    ev = evaluator or SimulatorEvaluator()
    out: list[Candidate] = []
    chosen = names if names is not None else fast_placer_names()
    if chosen:
        from agent.placers import run_placer

        for name in chosen:
            t = time.perf_counter()
            try:
                with _quiet_stdout():
                    plan = run_placer(name, graph, topology, seed=seed, objective=objective,
                                      budget=16 if name == "megatron_3d" else None)
            except RlplaceError:
                continue
            c = evaluate_candidate(name, "baseline", plan, graph, topology, objective, ev, time.perf_counter() - t)
            if c is not None:
                out.append(c)
    if not out:
        for name, plan in standard_plans(graph, topology).items():
            c = evaluate_candidate(name, "baseline", plan, graph, topology, objective, ev)
            if c is not None:
                out.append(c)
    return out


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
    model.episode_kwargs = run_episode_kwargs(p)
    return model


EPISODE_KEYS = ("mode", "refine_init", "refine_passes", "order")


def run_episode_kwargs(policy_path: Path) -> dict:
    """How the policy's training run built its episodes (``mode``, ``refine_*``, ``order`` of the run's
    ``config.yaml``, next to ``model.zip`` or one level above a checkpoint), so a policy trained in
    refine mode also places in refine mode; ``{}`` when there is no run config (the shipped policy)."""
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


def trim_padding(obs: dict[str, np.ndarray], dynamic_only: bool = False) -> dict[str, np.ndarray]:
    """Drop the padded node, edge and device slots of one observation (the GNN needs none of them;
    the option axis keeps its padding so action indices are unchanged). ``dynamic_only``: only the
    keys that change during an episode."""
    from agent.policy import STATIC_KEYS

    n = max(int(obs["node_mask"].sum()), 1)
    m = max(int(obs["edge_mask"].sum()), 1)
    d = max(int(obs["device_mask"].sum()), 1)
    out = {k: v for k, v in obs.items() if not (dynamic_only and k in STATIC_KEYS)}
    for k in ("node_features", "node_mask", "node_state", "current_node"):
        if k in out:
            out[k] = obs[k][:n]
    out["node_devices"] = obs["node_devices"][:n, :d]
    if not dynamic_only:
        out["edge_index"] = obs["edge_index"][:, :m]
        out["edge_features"] = obs["edge_features"][:m]
        out["edge_mask"] = obs["edge_mask"][:m]
        for k in ("device_bandwidth", "device_latency"):
            out[k] = obs[k][:d, :d]
    for k in ("device_features", "device_mask", "device_state"):
        if k in out:
            out[k] = obs[k][:d]
    out["option_devices"] = obs["option_devices"][:, :d]
    return out


def rollouts(model, envs: list, task, deterministic: list[bool], rng: np.random.Generator | None = None) -> list[dict]:
    """Episodes of ``task`` in several environments in lockstep (one batched forward per step).

    The GNN's static part (graph and device encoders) runs once for the task; each step only runs the
    dynamic part on the stacked dynamic arrays. ``deterministic[i]`` says whether env ``i`` takes the
    argmax or samples from the masked softmax; returns each episode's final info."""
    import torch as th

    from agent.policy import STATIC_KEYS

    fe = model.policy.features_extractor
    rng = rng or np.random.default_rng()
    obs = [e.reset(options={"task": task})[0] for e in envs]
    done = [False] * len(envs)
    infos: list[dict] = [{} for _ in envs]
    first = trim_padding(obs[0])  # same task in every env: the same static arrays and sizes
    static = {k: th.as_tensor(first[k])[None] for k in STATIC_KEYS}
    with th.no_grad():
        dev_s, node_s = fe.static_embeddings(static)
        while not all(done):
            active = [i for i in range(len(envs)) if not done[i]]
            masks = {i: envs[i].action_masks() for i in active}
            choose = [i for i in active if masks[i].sum() > 1]
            logits = {}
            if choose:
                trimmed = [trim_padding(obs[i], dynamic_only=True) for i in choose]
                batch = {k: th.as_tensor(np.stack([o[k] for o in trimmed])) for k in trimmed[0]}
                b = len(choose)
                batch.update({k: v.expand(b, *v.shape[1:]) for k, v in static.items()})
                out = fe.logits_from_embeddings(batch, dev_s.expand(b, -1, -1), node_s.expand(b, -1, -1))[0]
                out = out.numpy().astype(np.float64)
                logits = {i: out[j] for j, i in enumerate(choose)}
            for i in active:
                m = masks[i]
                if i not in logits:
                    a = int(np.flatnonzero(m)[0])
                else:
                    lg = np.where(m, logits[i], -np.inf)
                    if deterministic[i]:
                        a = int(np.argmax(lg))
                    else:
                        p = np.exp(lg - lg.max())
                        a = int(rng.choice(len(p), p=p / p.sum()))
                obs[i], _, done[i], _, info = envs[i].step(a)
                if done[i]:
                    infos[i] = info
    return infos


def _placement_env(model, task, objective: str, max_groups: int | None, evaluator=None):
    from envs.placement_env import PlacementEnv

    shape = model_shape(model)
    n_groups = int(max_groups) if max_groups is not None else shape["max_nodes"]
    nd = max(shape["max_devices"], task.topology.num_devices)
    fits = n_groups == shape["max_nodes"] and nd == shape["max_devices"]
    kw = dict(max_nodes=n_groups, max_devices=nd, objective=objective, **getattr(model, "episode_kwargs", {}))
    if fits:
        kw.update(max_edges=shape["max_edges"], max_options=shape["max_options"])
    try:
        env = PlacementEnv([task], evaluator=evaluator, **kw)
    except RlplaceError:
        if not fits:
            raise
        # a denser coarse graph than the training padding: more edge slots (the GNN does not mind)
        kw.update(max_edges=8 * n_groups, max_options=None)
        env, fits = PlacementEnv([task], evaluator=evaluator, **kw), False

    def factory():
        return PlacementEnv([task], evaluator=evaluator, **kw)

    return env, fits, factory


def policy_candidates(model, env, task, graph: OpGraph, objective: str, samples: int, seed: int,
                      evaluator: SimulatorEvaluator, label: str = "policy", env_factory=None) -> list[Candidate]:
    """The greedy rollout and ``samples`` sampled ones (run in lockstep), scored on ``graph``."""
    rng = np.random.default_rng(seed)
    envs = [env] + [env_factory() for _ in range(samples)] if env_factory is not None and samples else [env]
    flags = [i == 0 for i in range(samples + 1)]
    t = time.perf_counter()
    if len(envs) == len(flags):
        infos = rollouts(model, envs, task, flags, rng)
    else:
        infos = [rollouts(model, [env], task, [f], rng)[0] for f in flags]
    per = (time.perf_counter() - t) / len(flags)
    out = []
    for i, info in enumerate(infos):
        name = f"{label} greedy" if i == 0 else f"{label} sample {i}"
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


def local_search(graph: OpGraph, topology: Topology, start: Plan, objective: str, seconds: float,
                 seed: int = 0) -> Plan | None:
    """MCMC from ``start`` for ``seconds`` (agent.placers' mcmc); None if unavailable."""
    try:
        from agent.placers import run_placer
    except ImportError:  # pragma: no cover
        return None
    try:
        return run_placer("mcmc", graph, topology, seed=seed, objective=objective, budget=float(seconds),
                          start=start.copy())
    except RlplaceError:
        return None


# ---------------------------------------------------------------------- the pipeline
def place(graph: OpGraph, topology: Topology, *, model=None, policy: str | os.PathLike | None = None,
          objective: str = "step_time", samples: int = 8, finetune_steps: int = 0, search_seconds: float = 0.0,
          seed: int = 0, max_groups: int | None = None, baselines: bool = True,
          log: Callable[[str], None] | None = None) -> PlaceResult:
    """Best plan for ``graph`` on ``topology`` from the policy, the baselines and local search."""
    import torch as th

    from envs.simulator import OBJECTIVES
    from envs.tasks import Task

    if objective not in OBJECTIVES:
        raise PlaceError(f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
    if samples < 0 or finetune_steps < 0 or search_seconds < 0:
        raise PlaceError("--samples, --finetune-steps and --search-seconds must be >= 0")
    say = log or (lambda _m: None)
    th.set_num_threads(1)
    secs: dict[str, float] = {}
    ev = SimulatorEvaluator(cache_size=4096)
    model = model if model is not None else load_policy(policy)
    task = Task(graph, topology)
    t = time.perf_counter()
    env_ev = SimulatorEvaluator(cache_size=4096)
    env, fits, factory = _placement_env(model, task, objective, max_groups, env_ev)
    secs["env"] = time.perf_counter() - t
    t = time.perf_counter()
    cands = policy_candidates(model, env, task, graph, objective, samples, seed, ev, env_factory=factory)
    secs["policy"] = time.perf_counter() - t
    if finetune_steps > 0:
        if fits:
            t = time.perf_counter()
            tuned = finetune(model, factory, finetune_steps, seed)
            cands += policy_candidates(tuned, env, task, graph, objective, samples, seed + 1, ev, label="finetuned",
                                       env_factory=factory)
            secs["finetune"] = time.perf_counter() - t
        else:
            say("fine-tuning skipped: the task does not fit the policy's padding")
    if baselines:
        t = time.perf_counter()
        cands += run_baselines(graph, topology, objective, seed=seed, evaluator=ev)
        secs["baselines"] = time.perf_counter() - t
    if not cands:
        raise PlaceError("no valid plan was produced")
    if search_seconds > 0:
        t = time.perf_counter()
        start = min(cands, key=Candidate.key)
        found = local_search(graph, topology, start.plan, objective, search_seconds, seed)
        if found is not None:
            c = evaluate_candidate(f"mcmc from {start.name}", "search", found, graph, topology, objective, ev,
                                   time.perf_counter() - t)
            if c is not None:
                cands.append(c)
        secs["search"] = time.perf_counter() - t
    cands.sort(key=Candidate.key)
    best = cands[0]
    base = [c for c in cands if c.kind == "baseline"]
    plan = best.plan.copy()
    plan.provenance = {**dict(best.plan.provenance), "placer": "rlplace-agent", "winner": best.name,
                       "winner_kind": best.kind, "objective": objective, "predicted_step_time": best.value,
                       "oom": best.oom, "best_baseline": min(base, key=Candidate.key).name if base else None,
                       "best_baseline_time": min(base, key=Candidate.key).value if base else None,
                       "candidates": len(cands), "seed": int(seed)}
    return PlaceResult(plan=plan, best=best, candidates=cands, seconds=secs)


__all__ = ["place", "PlaceResult", "Candidate", "PlaceError", "run_baselines", "load_policy", "rollout", "rollouts",
           "objective_value", "PRETRAINED", "model_shape", "fast_placer_names", "resolve_model"]
