"""Expert iteration: search makes the targets, the policy distils them, PPO improves it, and the policy
seeds the next round's search (Anthony et al., "Thinking Fast and Slow with Deep Learning and Tree
Search", NeurIPS 2017; Silver et al., AlphaZero, 2018 — here the expert is rlplace's own local search).

A config with an ``expert_iteration`` section (and a ``tasks.distribution``: tasks drawn over model
families x sizes x random clusters, :mod:`agent.distribution`) trains like this, top to bottom::

    draw the training tasks and the held-out-family tasks          (seeded: the same config, the same tasks)
    dataset  <- heuristics + MCMC from the best, per training task  (round 0's targets; agent.dataset)
                heuristics only, per held-out task                   (the zero-shot yardstick)
    for round r = 0 .. rounds-1:
        if r > 0: per training task, the policy's plans (greedy + samples) and the policy-guided search
                  from the best of them and the task's best-known plan; a better plan becomes a new row
        distil:   replay every task's best-known plan in the environment and behaviour-clone the whole
                  decision sequence (agent.imitation; cross-entropy + value regression)
        improve:  PPO with self-imitation (agent.self_imitation) on the training tasks, the dataset's
                  plans counting as known bests
        evaluate: on the held-out families, the policy's best of greedy + samples vs the best fast
                  heuristic (the zero-shot ratio); TensorBoard ``expert_iteration/*`` per round

Every phase ends with an atomic checkpoint (``checkpoints/round_<r>_<phase>.zip``) and a line in
``expert_iteration.json``; ``--resume`` continues after the last finished phase, and the dataset's
own resume skips finished tasks (a killed search round keeps its finished rows: ``search_round_<r>.txt``
lists the tasks already searched). The policy of the last round is ``model.zip``.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from envs.errors import RlplaceError
from envs.files import atomic_write_json

PHASES = ("search", "distill", "ppo", "evaluate", "logged")


# ---------------------------------------------------------------------- the round's bookkeeping
@dataclass
class IterationState:
    """What has finished (``expert_iteration.json`` in the run directory)."""

    path: Path
    finished: list[list] = field(default_factory=list)  # [round, phase, checkpoint, stats]

    @classmethod
    def load(cls, run: Path) -> IterationState:
        p = run / "expert_iteration.json"
        if not p.exists():
            return cls(p)
        try:
            data = json.loads(p.read_text())
            return cls(p, [list(x) for x in data["finished"]])
        except (ValueError, KeyError, TypeError) as exc:
            raise RlplaceError(f"{p}: not an expert-iteration state file ({exc})") from None

    def done(self, r: int, phase: str) -> bool:
        return any(x[0] == r and x[1] == phase for x in self.finished)

    def last_checkpoint(self) -> str | None:
        for x in reversed(self.finished):
            if x[2]:
                return x[2]
        return None

    def mark(self, r: int, phase: str, checkpoint: str | None, stats: dict) -> None:
        self.finished.append([r, phase, checkpoint, stats])
        atomic_write_json(self.path, {"finished": self.finished}, indent=1)

    def stats(self, r: int, phase: str) -> dict:
        return next((x[3] for x in self.finished if x[0] == r and x[1] == phase), {})


# ---------------------------------------------------------------------- policy-seeded search (one task)
@dataclass
class PolicySearchJob:
    """One training task of a round r > 0: the policy's plans, then the guided search from the best of
    them and the task's best-known plan (picklable: the policy travels as a path)."""

    row: dict  # the task's best dataset row
    dataset: str
    policy: str
    samples: int
    evaluations: int
    seed: int
    round: int


_MODELS: dict[tuple[str, float], Any] = {}


def _policy(path: str):
    """The policy at ``path``, loaded once per process (and again when the file changes)."""
    from agent.infer import load_policy

    key = (path, os.path.getmtime(path))
    if key not in _MODELS:
        _MODELS.clear()
        _MODELS[key] = load_policy(path)
    return _MODELS[key]


def policy_search(job: PolicySearchJob) -> dict | None:
    """The new dataset row of ``job``'s task when the policy and the guided search beat its best-known
    plan, else None."""
    from agent.dataset import Dataset, _scrub
    from agent.guided_search import guided_search
    from agent.infer import Candidate, place
    from envs.evaluator import CachedSimulation

    t0 = time.perf_counter()
    ds = Dataset(path=Path(job.dataset))
    task = ds.task(job.row)
    model = _policy(job.policy)
    best_known = ds.plan(job.row)
    res = place(task.graph, task.topology, model=model, objective=job.row["objective"], samples=job.samples,
                seed=job.seed, baselines=False)
    pol = min(res.candidates, key=Candidate.key)
    known = (bool(job.row["oom"]), float(job.row["value"]))
    start = pol.plan if pol.key() < known else best_known
    found = guided_search(model, task.graph, task.topology, job.row["objective"], start, seed=job.seed,
                          evaluations=job.evaluations, evaluator=CachedSimulation(cache_size=4096))
    cands = [((pol.oom, pol.value), pol.plan, f"policy round {job.round}"),
             ((found.oom, found.value), found.plan, f"guided search round {job.round}")]
    (oom, value), plan, source = min(cands, key=lambda c: c[0])
    if (oom, value) >= known:
        return None
    row = {k: v for k, v in job.row.items() if k not in ("graph", "topology")}
    row.update(value=float(value), oom=bool(oom), source=source, plan=_scrub(plan.bind(task.graph).to_dict()),
               round=int(job.round), evaluations=int(job.evaluations), seconds=round(time.perf_counter() - t0, 3),
               seed=int(job.seed))
    return row


def search_round(dataset, rows: Sequence[dict], policy_path: Path, r: int, *, samples: int, evaluations: int,
                 seed: int, executor=None, progress: bool = True, log: Callable[[str], None] = print) -> dict:
    """Round ``r``'s policy-seeded search over ``rows`` (each task's best row); better plans are appended
    as rows. Resumable: ``search_round_<r>.txt`` lists the tasks finished. Returns counts."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from agent.scale import Executor

    done_file = Path(dataset.path) / f"search_round_{r}.txt"
    done = set(done_file.read_text().split()) if done_file.exists() else set()
    todo = [row for row in rows if row["task_id"] not in done]
    jobs = [PolicySearchJob(row=row, dataset=str(dataset.path), policy=str(policy_path), samples=samples,
                            evaluations=evaluations, seed=seed + i, round=r) for i, row in enumerate(todo)]
    improved = 0
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not progress) as bar:
        t = bar.add_task(f"round {r} search", total=len(jobs))
        finished: dict[int, dict | None] = {}
        next_i = 0

        def keep(i: int, new: dict | None) -> None:
            nonlocal improved, next_i
            finished[i] = new
            while next_i in finished:  # in job order, so the file is the same however the jobs ran
                got, job = finished.pop(next_i), jobs[next_i]
                if got is not None:
                    dataset.append(got, dataset.task(job.row))
                    improved += 1
                with open(done_file, "a") as fh:
                    fh.write(job.row["task_id"] + "\n")
                next_i += 1
            bar.advance(t)

        with executor or Executor() as ex:
            ex.map(policy_search, jobs, on_result=keep)
    log(f"round {r}: the policy and the guided search improved {improved} of {len(rows)} task(s)")
    return {"searched": len(rows), "improved": improved}


# ---------------------------------------------------------------------- zero-shot evaluation
def zero_shot(model, dataset, rows: Sequence[dict], *, samples: int, seed: int = 0) -> dict:
    """On each held-out row: the policy's best of greedy + ``samples`` (no heuristics, no search) vs the
    row's best fast heuristic; ratio = heuristic / policy (> 1: the policy is faster; an out-of-memory
    plan where the heuristic fits counts as 0)."""
    from agent.infer import Candidate, place

    out = []
    for row in rows:
        task = dataset.task(row)
        res = place(task.graph, task.topology, model=model, objective=row["objective"], samples=samples, seed=seed,
                    baselines=False)
        pol = min(res.candidates, key=Candidate.key)
        ratio = 0.0 if (pol.oom and not row["heuristic_oom"]) else row["heuristic_value"] / pol.value
        out.append({"task_id": row["task_id"], "family": row["family"], "ratio": ratio, "policy": pol.value,
                    "heuristic": row["heuristic_value"], "heuristic_name": row["heuristic"]})
    ratios = np.array([max(x["ratio"], 1e-3) for x in out])
    return {"rows": out, "geomean": float(np.exp(np.log(ratios).mean())) if out else float("nan"),
            "min": float(ratios.min()) if out else float("nan"),
            "wins": int((ratios > 1.0 + 1e-9).sum()), "n": len(out)}


# ---------------------------------------------------------------------- the loop
@dataclass
class IterationResult:
    model: Any
    model_path: Path
    rounds: list[dict]
    seconds: float


def expert_iteration(cfg, run: Path, *, model_factory: Callable[[Sequence], Any], resume: bool,
                     progress: bool, log: Callable[[str], None], executor=None,
                     deadline: float | None = None) -> IterationResult:
    """The loop of the module docstring for the config ``cfg`` (``agent.train.TrainConfig``) in the run
    directory ``run``. ``model_factory(tasks)`` builds the new model (with its training vec env) or, on
    resume, the vec env for the checkpoint. Returns the last round's policy."""
    from agent.callbacks import atomic_save
    from agent.dataset import Dataset, build, jobs_from_draws
    from agent.distribution import draw_distribution

    t0 = time.perf_counter()
    ei = cfg.spec.expert_iteration
    dist = cfg.spec.tasks.distribution
    state = IterationState.load(run) if resume else IterationState(run / "expert_iteration.json")
    objective = cfg.env.get("objective", "step_time")

    # the tasks and round 0's targets
    train_draws, holdout_draws = draw_distribution(dist)
    ds_path = Path(ei.dataset) if ei.dataset else run / "dataset"
    params = {"seed": dist.seed, "evaluations": ei.search_evaluations, "objective": objective,
              "distribution": dist.model_dump(mode="json")}
    dataset = Dataset.open(ds_path, create=True, params=params, description=f"expert iteration of {cfg.name}")
    jobs = (jobs_from_draws(train_draws, evaluations=ei.search_evaluations, objective=objective)
            + jobs_from_draws(holdout_draws, evaluations=0, objective=objective))
    build(dataset, jobs, executor=executor, log=log, progress=progress)
    ids = {"train": [j.task_id for j in jobs if j.split == "train"],
           "holdout": [j.task_id for j in jobs if j.split == "holdout"]}
    best = dataset.best()
    tasks = [dataset.task(best[i]) for i in ids["train"]]
    model, venv = model_factory(tasks)
    if resume and state.last_checkpoint():
        from sb3_contrib import MaskablePPO

        model = MaskablePPO.load(state.last_checkpoint(), env=venv, device="cpu", tensorboard_log=str(run / "tb"))
        log(f"resuming expert iteration from {state.last_checkpoint()}")
    writer = _writer(run)
    rounds = []
    try:
        for r in range(int(ei.rounds)):
            if deadline is not None and time.perf_counter() > deadline:
                log(f"deadline reached before round {r}")
                break
            if r > 0 and not state.done(r, "search"):
                path = _checkpoint(model, run, r, "search-start")
                stats = search_round(dataset, [dataset.best()[i] for i in ids["train"]], path, r,
                                     samples=ei.policy_samples, evaluations=ei.policy_evaluations,
                                     seed=cfg.seed + 1000 * r, executor=executor, progress=progress, log=log)
                state.mark(r, "search", None, stats)
            best = dataset.best()
            targets = {tasks[i].name: best[tid] for i, tid in enumerate(ids["train"])}
            if not state.done(r, "distill"):
                stats = distil(model, tasks, targets, dataset, cfg.env, epochs=ei.distill_epochs,
                               batch_size=ei.distill_batch_size, learning_rate=ei.distill_learning_rate,
                               seed=cfg.seed + r, log=log)
                state.mark(r, "distill", str(_checkpoint(model, run, r, "distill")), stats)
            if not state.done(r, "ppo") and ei.ppo_steps > 0:
                stats = improve(model, cfg, run, tasks, targets, dataset, steps=ei.ppo_steps, progress=progress,
                                log=log, deadline=deadline)
                state.mark(r, "ppo", str(_checkpoint(model, run, r, "ppo")), stats)
            if not state.done(r, "evaluate"):
                held = [dataset.best()[i] for i in ids["holdout"]]
                stats = zero_shot(model, dataset, held, samples=ei.eval_samples, seed=cfg.seed)
                train_ratio = _train_ratio(model, dataset, [targets[t.name] for t in tasks[:ei.train_eval_tasks]],
                                           ei.eval_samples, cfg.seed)
                stats = {**{k: v for k, v in stats.items() if k != "rows"}, "train": train_ratio,
                         "holdout": stats["rows"]}
                state.mark(r, "evaluate", None, stats)
            report = _round_report(state, r, dataset, ids)
            rounds.append(report)
            if not state.done(r, "logged"):  # once per round, also across resumes
                _log_round(writer, report, model)
                state.mark(r, "logged", None, {})
            log(f"round {r}: dataset {report['dataset_rows']} rows, distillation cross-entropy "
                f"{report.get('distill_loss', float('nan')):.3f} (agreement {report.get('agreement', 0):.1%}), "
                f"held-out zero-shot geo-mean {report.get('zero_shot_geomean', float('nan')):.3f} "
                f"(min {report.get('zero_shot_min', float('nan')):.3f}), training tasks "
                f"{report.get('train_geomean', float('nan')):.3f} of the best known")
    finally:
        writer.close()
    path = atomic_save(model, run / "model.zip")
    return IterationResult(model=model, model_path=path, rounds=rounds, seconds=time.perf_counter() - t0)


def distil(model, tasks: Sequence, targets: dict[str, dict], dataset, env_kwargs: dict, *, epochs: int,
           batch_size: int, learning_rate: float, seed: int, log: Callable[[str], None]) -> dict:
    """Behaviour-clone every task's best-known plan (the whole decision sequence of its replay)."""
    from agent.imitation import behaviour_clone, collect

    t = time.perf_counter()
    plans = {name: (row["source"], dataset.plan(row), float(row["value"]), bool(row["oom"]))
             for name, row in targets.items()}
    demos = collect(tasks, env_kwargs, plans)
    t_demo = time.perf_counter() - t
    stats = behaviour_clone(model, demos, epochs=epochs, batch_size=batch_size, seed=seed,
                            learning_rate=learning_rate, log=log)
    replay_gap = [d.heuristic_time / d.replay_time for d in demos if d.replay_time > 0]
    return {"steps": stats["steps"], "first_loss": stats.get("first_loss"), "last_loss": stats.get("last_loss"),
            "agreement": stats.get("greedy_agreement"), "demo_seconds": round(t_demo, 1),
            "seconds": round(time.perf_counter() - t, 1),
            "replay_fidelity": float(np.exp(np.mean(np.log(replay_gap)))) if replay_gap else None}


def improve(model, cfg, run: Path, tasks: Sequence, targets: dict[str, dict], dataset, *, steps: int,
            progress: bool, log: Callable[[str], None], deadline: float | None) -> dict:
    """PPO for ``steps`` with self-imitation; the dataset's plans are the known bests."""
    from stable_baselines3.common.callbacks import CallbackList

    from agent.callbacks import AtomicCheckpointCallback, BestPlanCallback, DeadlineCallback, ProgressCallback
    from agent.self_imitation import SelfImitationCallback
    from agent.train import TB_NAME

    t = time.perf_counter()
    kw = dict(cfg.env)
    best_cb = BestPlanCallback(tasks, run / "plans", objective=kw.get("objective", "step_time"), baselines=False,
                               log=log)
    known = {name: {"plan": dataset.plan(row), "step_time": float(row["value"]), "oom": bool(row["oom"])}
             for name, row in targets.items()}
    sil = cfg.self_imitation or {}
    cbs = [best_cb, AtomicCheckpointCallback(save_freq=max(1, cfg.callbacks["checkpoint_freq"] // cfg.n_envs),
                                             save_path=str(run / "checkpoints"), name_prefix="model")]
    if cfg.self_imitation is not None:
        cbs.append(SelfImitationCallback(tasks, kw, lambda: best_cb.best, seed=cfg.seed, known=known, **sil))
    if progress:
        cbs.append(ProgressCallback(best_cb, model.num_timesteps + steps))
    if deadline is not None:
        cbs.append(DeadlineCallback(deadline))
    model.learn(total_timesteps=int(steps), callback=CallbackList(cbs), tb_log_name=TB_NAME,
                reset_num_timesteps=False, progress_bar=False)
    beat = sum(1 for name, b in best_cb.best.items()
               if (b["oom"], b["step_time"]) < (targets[name]["oom"], targets[name]["value"]))
    return {"steps": int(steps), "num_timesteps": int(model.num_timesteps), "episodes": best_cb.episodes,
            "beat_known": beat, "seconds": round(time.perf_counter() - t, 1)}


def _train_ratio(model, dataset, rows: Sequence[dict], samples: int, seed: int) -> float:
    """Geometric mean over ``rows`` of best-known value / the policy's best of greedy + samples."""
    from agent.infer import Candidate, place

    ratios = []
    for row in rows:
        task = dataset.task(row)
        res = place(task.graph, task.topology, model=model, objective=row["objective"], samples=samples, seed=seed,
                    baselines=False)
        pol = min(res.candidates, key=Candidate.key)
        ratios.append(1e-3 if (pol.oom and not row["oom"]) else max(row["value"] / pol.value, 1e-3))
    return float(np.exp(np.mean(np.log(ratios)))) if ratios else float("nan")


def _checkpoint(model, run: Path, r: int, phase: str) -> Path:
    from agent.callbacks import atomic_save

    return atomic_save(model, run / "checkpoints" / f"round_{r}_{phase}.zip")


def _round_report(state: IterationState, r: int, dataset, ids: dict) -> dict:
    distill, ppo, ev = state.stats(r, "distill"), state.stats(r, "ppo"), state.stats(r, "evaluate")
    best = dataset.best()
    gaps = [best[i]["heuristic_value"] / best[i]["value"] for i in ids["train"]
            if not best[i]["oom"] and best[i]["value"] > 0]
    return {"round": r, "dataset_rows": len(dataset.rows), "dataset_tasks": len(best),
            "targets_vs_heuristic": float(np.exp(np.mean(np.log(gaps)))) if gaps else float("nan"),
            "search_improved": state.stats(r, "search").get("improved"),
            "distill_loss": distill.get("last_loss"), "agreement": distill.get("agreement"),
            "replay_fidelity": distill.get("replay_fidelity"), "ppo_beat_known": ppo.get("beat_known"),
            "zero_shot_geomean": ev.get("geomean"), "zero_shot_min": ev.get("min"), "zero_shot_wins": ev.get("wins"),
            "zero_shot_n": ev.get("n"), "train_geomean": ev.get("train")}


def _writer(run: Path):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(run / "tb" / "expert_iteration"))


def _log_round(writer, report: dict, model) -> None:
    """TensorBoard ``expert_iteration/*`` scalars at the round's index (and the step count as a scalar)."""
    r = int(report["round"])
    for key in ("dataset_rows", "targets_vs_heuristic", "search_improved", "distill_loss", "agreement",
                "replay_fidelity", "ppo_beat_known", "zero_shot_geomean", "zero_shot_min", "zero_shot_wins",
                "train_geomean"):
        v = report.get(key)
        if v is not None and isinstance(v, (int, float)) and math.isfinite(float(v)):
            writer.add_scalar(f"expert_iteration/{key}", float(v), r)
    writer.add_scalar("expert_iteration/num_timesteps", float(model.num_timesteps), r)
    writer.flush()


__all__ = ["expert_iteration", "IterationResult", "IterationState", "PolicySearchJob", "policy_search",
           "search_round", "zero_shot", "distil", "improve"]
