"""Expert iteration: search makes the targets, the policy distils them, PPO improves it, and the policy
seeds the next round's search (Anthony et al., "Thinking Fast and Slow with Deep Learning and Tree
Search", NeurIPS 2017; Silver et al., AlphaZero, 2018 — here the expert is rlplace's own local search).

A config with an ``expert_iteration`` section (and a ``tasks.distribution``: tasks drawn over model
families x sizes x random clusters, :mod:`agent.distribution`) trains like this, top to bottom::

    draw the training tasks and the held-out-family tasks          (seeded: the same config, the same tasks)
    dataset  <- heuristics + MCMC from the best, per training task  (the best known plans; agent.dataset)
                heuristics only, per held-out task                   (the zero-shot yardstick)
    for round r = 0 .. rounds-1:
        targets:  per training task, the best plan the policy's environment can express: the dataset's
                  best plan replayed in it, the current target, the policy's plans (greedy + samples),
                  then a search from the best of them with group moves in the action space (the policy's
                  moves); in round 0 of a fresh network, without its plans and with uniform moves; a plan
                  beating the dataset's best is a new row
        distil:   replay every task's target in the environment and behaviour-clone the whole decision
                  sequence (agent.imitation; cross-entropy + value regression); with
                  ``distill_on_policy_states``, also the target's actions on the states of the policy's
                  own greedy rollout (DAgger: where a clone that strays from its teacher ends up)
        improve:  PPO with self-imitation (agent.self_imitation) on the training tasks, the targets counting
                  as known bests
        evaluate: on the held-out families, the policy's best of greedy + samples vs the best fast
                  heuristic (the zero-shot ratio), and the same ratio on ``train_eval_tasks`` training tasks
                  (the gap between the two is what training did not generalise); TensorBoard
                  ``expert_iteration/*`` per round
        validate: the same ratio on ``validation_tasks`` members of the trained families that training
                  never sees (also for the initial policy, before round 0)
    model.zip <- the validated policy with the best ratio (ties: the earlier; without validation tasks,
                 the last round's): training never hands back a policy that validates worse than its start.
                 The initial policy is a candidate only when it was given (``--init``): a fresh network is
                 validated as the reference line but never handed back as the trained policy

Targets are distilled rather than the dataset's plans themselves because a plan found by MCMC over
operators (a stage on three of five devices, 122 microbatches ...) may not be a sequence of the
environment's actions; replaying it exactly is what makes the clone reproduce it.

Every phase ends with an atomic checkpoint (``checkpoints/round_<r>_<phase>.zip``) and a line in
``expert_iteration.json``; ``--resume`` continues after the last finished phase, and the dataset's
own resume skips finished tasks (a killed search round keeps its finished tasks: ``targets.jsonl`` and
``search_round_<r>.txt``). The policy selected on validation is ``model.zip``; every round's stays in
``checkpoints/``.
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

PHASES = ("search", "distill", "ppo", "evaluate", "validate", "logged")
# a target is a plan as the policy's environment expresses it (replayed), not as place found it: place's
# plans may split a group the environment places as one (a twotower task's best replayed at 0.909 of its
# time), and a target valued at a plan the clone cannot follow taught it the slower replay. The policy's
# best few plans are replayed, as the best one need not replay best
EXPRESSED_CANDIDATES = 3
INITIAL = -1  # the round index of the initial policy's validation


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


# ---------------------------------------------------------------------- targets (one task)
@dataclass
class TargetJob:
    """One training task's search for its distillation target: the best plan the policy's environment
    can express (picklable: the policy travels as a path)."""

    row: dict  # the task's best dataset row
    target: dict | None  # its current target, if any
    dataset: str
    policy: str
    samples: int  # the policy's sampled rollouts beside the greedy one (when not ``uniform``)
    evaluations: int  # the search's simulator evaluations
    # round 0 from a fresh network: its plans are not candidates and its moves are drawn uniformly
    uniform: bool
    seed: int
    round: int
    t0: float | None = None  # the search's annealing schedule; None: the guided search's own
    half_life: float | None = None


def find_target(job: TargetJob) -> dict:
    """The task's new target and dataset row (each None when not better than the current one).

    Candidates, each replayed in the policy's environment (the nearest plan the environment expresses,
    valued as replayed): the dataset's best plan, the current target, and unless ``uniform`` the policy's
    best :data:`EXPRESSED_CANDIDATES` plans (greedy + samples);
    from the best of them, the guided search with only group moves in the environment's action space
    (``policy_fraction=1``: every plan it visits stays expressible). A target beats another by (out of
    memory, value); a plan that beats the dataset's best also becomes a dataset row."""
    from agent.dataset import Dataset, _scrub
    from agent.guided_search import guided_search
    from agent.infer import cached_policy, policy_env
    from envs.evaluator import CachedSimulation

    t0 = time.perf_counter()
    ds = Dataset(path=Path(job.dataset))
    task = ds.task(job.row)
    objective = job.row["objective"]
    model = cached_policy(job.policy)
    ev = CachedSimulation(cache_size=4096)
    env, _, _ = policy_env(model, task, objective, None, ev)
    key, start, source = min(target_candidates(env, task, job, ds.plan(job.row), model), key=lambda c: c[0])
    curve: list = []
    if job.evaluations > 0:
        found = guided_search(model, task.graph, task.topology, objective, start, seed=job.seed,
                              evaluations=job.evaluations, policy_fraction=1.0, uniform_moves=job.uniform,
                              evaluator=ev, **schedule(job.t0, job.half_life))
        curve = [[int(n), float(v) / key[1]] for n, v in found.curve]  # best / start value over evaluations
        if (found.oom, found.value) < key:
            key, start, source = (found.oom, found.value), found.plan, f"action-space search round {job.round}"
    start, key = simplest(env.prepared, start, key, ev, objective)
    out: dict = {"target": None, "row": None, "curve": curve}
    current = (bool(job.target["oom"]), float(job.target["value"])) if job.target is not None else None
    plan_doc = _scrub(start.bind(task.graph).to_dict())
    if current is None or key < current:
        out["target"] = {"task_id": job.row["task_id"], "value": float(key[1]), "oom": bool(key[0]), "source": source,
                         "round": int(job.round), "plan": plan_doc}
    if key < (bool(job.row["oom"]), float(job.row["value"])):
        row = {k: v for k, v in job.row.items() if k not in ("graph", "topology")}
        row.update(value=float(key[1]), oom=bool(key[0]), source=source, plan=plan_doc, round=int(job.round),
                   evaluations=int(job.evaluations), seconds=round(time.perf_counter() - t0, 3), seed=int(job.seed))
        out["row"] = row
    return out


def target_candidates(env, task, job: TargetJob, best_plan, model) -> list[tuple[tuple[bool, float], object, str]]:
    """(key, plan, source) of :func:`find_target`'s candidates: each plan replayed in the policy's
    environment ``env`` and valued as replayed (the dataset's best ``best_plan``, the current target, and
    unless ``job.uniform`` the policy's best :data:`EXPRESSED_CANDIDATES` plans)."""
    from agent.imitation import replay
    from agent.infer import Candidate, place
    from envs.plan import Plan

    def expressed(plan: Plan, source: str) -> tuple:
        shown = replay(env, task, plan)
        return (shown.oom, shown.replay_time), shown.plan, source

    cands = [expressed(best_plan, f"expressed {job.row['source']}")]
    if job.target is not None:
        cands.append(expressed(Plan.from_dict(job.target["plan"]), job.target["source"]))
    if not job.uniform:
        res = place(task.graph, task.topology, model=model, objective=job.row["objective"], samples=job.samples,
                    seed=job.seed, baselines=False)
        cands += [expressed(c.plan, f"policy round {job.round}")
                  for c in sorted(res.candidates, key=Candidate.key)[:EXPRESSED_CANDIDATES]]
    return cands


def schedule(t0: float | None, half_life: float | None) -> dict:
    """The guided search's annealing keywords a config sets (unset ones keep the search's defaults)."""
    return {k: float(v) for k, v in (("t0", t0), ("half_life", half_life)) if v is not None}


def simplest(prep, plan, key: tuple[bool, float], evaluator, objective: str):
    """``plan`` with every group's modifier reset to none (ZeRO 0, no recomputation, no expert
    parallelism) wherever that is no worse, group by group: among equally good plans the simplest, so the
    clone learns the choices that matter rather than a search's arbitrary ones. Returns (plan, key)."""
    from envs.placement.options import N_MODIFIERS
    from envs.placement.task_setup import express

    assign = express(prep, plan)
    graph, topo = prep.task.graph, prep.task.topology
    for v in range(assign.size):
        if assign[v] % N_MODIFIERS == 0 or (prep.class_of[v] >= 0 and prep.class_members[prep.class_of[v]][0] != v):
            continue
        c = int(prep.class_of[v])
        groups = prep.class_members[c] if c >= 0 else [v]
        cand = prep.apply_action(plan, groups, int(assign[v]) - int(assign[v]) % N_MODIFIERS)
        cand.virtual_stages = plan.virtual_stages
        try:
            res = evaluator.evaluate(graph, topo, cand, objective)
        except RlplaceError:
            continue
        if (res.oom, res.value) <= key:
            plan, key = cand, (bool(res.oom), float(res.value))
    return plan, key


class Targets:
    """The distillation targets of a run (``targets.jsonl``: appended rows, the best per task wins)."""

    def __init__(self, path: Path):
        self.path = path
        self.rows: list[dict] = []
        if path.exists():
            raw = path.read_bytes()
            complete, sep, torn = raw.rpartition(b"\n")
            if torn:  # a line a kill cut: dropped
                with open(path, "rb+") as fh:
                    fh.truncate(len(complete) + len(sep))
            self.rows = [json.loads(x) for x in complete.split(b"\n") if x.strip()] if sep else []

    def best(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for r in self.rows:
            cur = out.get(r["task_id"])
            if cur is None or (r["oom"], r["value"]) <= (cur["oom"], cur["value"]):
                out[r["task_id"]] = r
        return out

    def append(self, row: dict) -> None:
        from envs.files import finite_json

        with open(self.path, "a") as fh:
            fh.write(finite_json(row) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        self.rows.append(row)


def search_round(dataset, targets: Targets, task_ids: Sequence[str], policy_path: Path, r: int, *, samples: int,
                 evaluations: int, seed: int, executor=None, progress: bool = True,
                 log: Callable[[str], None] = print, t0: float | None = None,
                 half_life: float | None = None, uniform: bool = False) -> dict:
    """Round ``r``'s target search over ``task_ids``; better targets are appended to ``targets``, plans
    that beat the dataset's best to the dataset. ``uniform``: search with uniform moves and without the
    policy's plans (round 0 of a fresh network; ``samples`` is then unused); ``t0`` / ``half_life``:
    the searches' annealing schedule (None: the guided search's). Resumable: a task whose round-r search
    finished has a line in ``search_round_<r>.txt``. Returns counts."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from agent.scale import Executor

    done_file = targets.path.parent / f"search_round_{r}.txt"
    done = set(done_file.read_text().split()) if done_file.exists() else set()
    best, tbest = dataset.best(), targets.best()
    todo = [t for t in task_ids if t not in done]
    jobs = [TargetJob(row=best[t], target=tbest.get(t), dataset=str(dataset.path), policy=str(policy_path),
                      samples=samples, evaluations=evaluations, uniform=uniform, seed=seed + i, round=r,
                      t0=t0, half_life=half_life)
            for i, t in enumerate(todo)]
    counts: dict = {"searched": len(task_ids), "new_targets": 0, "improved_dataset": 0}
    curves: list = []
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not progress) as bar:
        t = bar.add_task(f"round {r} targets", total=len(jobs))
        finished: dict[int, dict] = {}
        next_i = 0

        def keep(i: int, got: dict) -> None:
            nonlocal next_i
            finished[i] = got
            while next_i in finished:  # in job order, so the files are the same however the jobs ran
                out, job = finished.pop(next_i), jobs[next_i]
                if out["row"] is not None:
                    dataset.append(out["row"], dataset.task(job.row))
                    counts["improved_dataset"] += 1
                if out["target"] is not None:
                    targets.append(out["target"])
                    counts["new_targets"] += 1
                if out.get("curve"):
                    curves.append(out["curve"])
                with open(done_file, "a") as fh:
                    fh.write(job.row["task_id"] + "\n")
                next_i += 1
            bar.advance(t)

        with executor or Executor() as ex:
            ex.map(find_target, jobs, on_result=keep)
    log(f"round {r}: {counts['new_targets']} new target(s), {counts['improved_dataset']} dataset improvement(s) "
        f"over {len(task_ids)} task(s)")
    counts["seconds"] = round(time.perf_counter() - t0, 1)  # this invocation's (a resumed round: its rest)
    counts["curves"] = curves[:64]  # the searches' best / start over evaluations (the TensorBoard image)
    return counts


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
    selected_round: int | None = None  # model.zip's round (INITIAL: the initial policy); None: no validation


def expert_iteration(cfg, run: Path, *, model_factory: Callable[[Sequence], Any], resume: bool,
                     progress: bool, log: Callable[[str], None], executor=None,
                     deadline: float | None = None, initial_given: bool = True) -> IterationResult:
    """The loop of the module docstring for the config ``cfg`` (``agent.train.TrainConfig``) in the run
    directory ``run``. ``model_factory(tasks)`` builds the new model (with its training vec env) or, on
    resume, the vec env for the checkpoint; ``initial_given``: its weights are a trained policy's (False: a
    fresh network, which selection never hands back). Returns the policy selected on validation (else the
    last round's)."""
    from agent.callbacks import atomic_save
    from agent.dataset import Dataset, build, jobs_from_draws
    from agent.distribution import draw_distribution, draw_validation
    from agent.distribution.progress import drawing

    t0 = time.perf_counter()
    ei = cfg.spec.expert_iteration
    dist = cfg.spec.tasks.distribution
    state = IterationState.load(run) if resume else IterationState(run / "expert_iteration.json")
    objective = cfg.env.get("objective", "step_time")

    # the tasks and round 0's targets (drawn and searched once: a resumed run reads them back); a new run
    # draws (traces) every member before anything is written, so a family whose knobs build no model
    # leaves no run directory behind
    ds_path = Path(ei.dataset) if ei.dataset else run / "dataset"
    params = {"seed": dist.seed, "evaluations": ei.search_evaluations, "objective": objective,
              "distribution": dist.model_dump(mode="json")}
    tasks_file = run / "tasks.json"
    ids = json.loads(tasks_file.read_text()) if tasks_file.exists() else None
    draws = None
    if ids is None:
        with drawing(dist.tasks + dist.holdout_tasks + ei.validation_tasks, progress) as on_draw:
            draws = (draw_distribution(dist, on_draw), draw_validation(dist, ei.validation_tasks, on_draw))
    run.mkdir(parents=True, exist_ok=True)
    dataset = Dataset.open(ds_path, create=True, params=params, description=f"expert iteration of {cfg.name}")
    if ids is None or not set(ids["train"] + ids["holdout"]) <= dataset.done():
        train_draws, holdout_draws = draws[0] if draws is not None else draw_distribution(dist)
        jobs = (jobs_from_draws(train_draws, evaluations=ei.search_evaluations, objective=objective)
                + jobs_from_draws(holdout_draws, evaluations=0, objective=objective))
        build(dataset, jobs, executor=executor, log=log, progress=progress)
        ids = {"train": [j.task_id for j in jobs if j.split == "train"],
               "holdout": [j.task_id for j in jobs if j.split == "holdout"]}
        atomic_write_json(tasks_file, ids, indent=1)
    if "validation" not in ids or not set(ids["validation"]) <= dataset.done():
        valid_draws = draws[1] if draws is not None else draw_validation(dist, ei.validation_tasks)
        jobs = [j for j in jobs_from_draws(valid_draws, evaluations=0, objective=objective)
                if j.task_id not in set(ids["train"])]
        build(dataset, jobs, executor=executor, log=log, progress=progress)
        ids["validation"] = [j.task_id for j in jobs]
        atomic_write_json(tasks_file, ids, indent=1)
    best = dataset.best()
    validation = [best[i] for i in ids["validation"]]
    if "initial_given" not in ids:  # how the run started, kept for its resumes (which pass no weights)
        ids["initial_given"] = bool(state.stats(INITIAL, "validate").get("given", initial_given))
        atomic_write_json(tasks_file, ids, indent=1)
    ids["train"], tasks = placeable(dataset, [best[i] for i in ids["train"]], cfg.env, log)
    model, venv = model_factory(tasks)
    if resume and state.last_checkpoint():
        from sb3_contrib import MaskablePPO

        model = MaskablePPO.load(state.last_checkpoint(), env=venv, device="cpu", tensorboard_log=str(run / "tb"))
        log(f"resuming expert iteration from {state.last_checkpoint()}")
    targets = Targets(run / "targets.jsonl")
    writer = _writer(run)
    rounds = []
    try:
        if validation and not state.done(INITIAL, "validate"):
            path = atomic_save(model, run / "checkpoints" / "initial.zip")
            state.mark(INITIAL, "validate", str(path),
                       {**_validate(model, dataset, validation, ei, cfg.seed), "given": bool(initial_given)})
            log(f"initial policy: validation zero-shot geo-mean {state.stats(INITIAL, 'validate')['geomean']:.3f} "
                f"on {len(validation)} task(s)")
        # a trained initial policy (--init) seeds round 0's searches as each round's policy seeds the next:
        # its own plans are candidate targets and its moves guide the search. Unseeded, round 0 taught a
        # trained policy plans worse than its own (twotower, experiments/configs/target_c.yaml: 8 of 16
        # round-0 targets slower than the shipped policy's plans, geo-mean 0.990 of them)
        seeded = bool(ids["initial_given"])
        longest = 0.0  # the longest round of this process so far: a round that would overrun is not started
        for r in range(int(ei.rounds)):
            if deadline is not None and time.perf_counter() + longest > deadline and not state.done(r, "logged"):
                log(f"deadline reached before round {r}" + (f" (a round takes up to {longest:.0f} s)" if longest else ""))
                break
            started = time.perf_counter()
            if not state.done(r, "search"):
                path = _checkpoint(model, run, r, "search-start")
                stats = search_round(dataset, targets, ids["train"], path, r, samples=ei.policy_samples,
                                     evaluations=ei.policy_evaluations if r > 0 else ei.target_evaluations,
                                     seed=cfg.seed + 1000 * r, executor=executor, progress=progress, log=log,
                                     t0=ei.target_t0, half_life=ei.target_half_life,
                                     uniform=r == 0 and not seeded)
                state.mark(r, "search", None, stats)
            tbest = targets.best()
            goal = {tasks[i].name: tbest[tid] for i, tid in enumerate(ids["train"]) if tid in tbest}
            if not state.done(r, "distill"):
                stats = distil(model, tasks, goal, cfg.env, epochs=ei.distill_epochs,
                               batch_size=ei.distill_batch_size, learning_rate=ei.distill_learning_rate,
                               seed=cfg.seed + r, log=log, on_policy_states=ei.distill_on_policy_states)
                state.mark(r, "distill", str(_checkpoint(model, run, r, "distill")), stats)
            if not state.done(r, "ppo") and ei.ppo_steps > 0:
                stats, found = improve(model, cfg, run, tasks, goal, steps=ei.ppo_steps, progress=progress, log=log,
                                       deadline=deadline)
                for i, tid in enumerate(ids["train"]):  # PPO's plans are the environment's: targets as they are
                    b, g = found.get(tasks[i].name), goal.get(tasks[i].name)
                    if b is not None and g is not None and (b["oom"], b["step_time"]) < (g["oom"], g["value"]):
                        targets.append({"task_id": tid, "value": float(b["step_time"]), "oom": bool(b["oom"]),
                                        "source": f"ppo round {r}", "round": r,
                                        "plan": b["plan"].bind(tasks[i].graph).to_dict()})
                state.mark(r, "ppo", str(_checkpoint(model, run, r, "ppo")), stats)
            if not state.done(r, "evaluate"):
                best = dataset.best()
                held = [best[i] for i in ids["holdout"]]
                stats = zero_shot(model, dataset, held, samples=ei.eval_samples, seed=cfg.seed)
                # the same ratio on training tasks: its denominator is fixed, so a rising curve is the policy's
                # (a ratio to the best known falls whenever the searches improve the dataset)
                seen = zero_shot(model, dataset, [best[i] for i in ids["train"][:ei.train_eval_tasks]],
                                 samples=ei.eval_samples, seed=cfg.seed)
                stats = {**{k: v for k, v in stats.items() if k != "rows"}, "train_vs_heuristic": seen["geomean"],
                         "holdout": stats["rows"]}
                state.mark(r, "evaluate", None, stats)
            if validation and not state.done(r, "validate"):
                state.mark(r, "validate", state.last_checkpoint(), _validate(model, dataset, validation, ei, cfg.seed))
            report = _round_report(state, r, dataset, targets, ids)
            rounds.append(report)
            if not state.done(r, "logged"):  # once per round, also across resumes
                _log_round(writer, report, model)
                state.mark(r, "logged", None, {})
                longest = max(longest, time.perf_counter() - started)
            log(f"round {r}: dataset {report['dataset_rows']} rows, targets at {report['targets_vs_best']:.3f} of "
                f"the best known, distillation cross-entropy {report.get('distill_loss') or float('nan'):.3f} "
                f"(agreement {report.get('agreement') or 0:.1%}), held-out zero-shot geo-mean "
                f"{report.get('zero_shot_geomean') or float('nan'):.3f} (min "
                f"{report.get('zero_shot_min') or float('nan'):.3f}), on training tasks "
                f"{report.get('train_geomean') or float('nan'):.3f}"
                + (f", validation {report['validation_geomean']:.3f}" if report.get("validation_geomean") else ""))
    finally:
        writer.close()
    chosen = selected(state)
    if chosen is not None and chosen[1] != state.last_checkpoint():
        from sb3_contrib import MaskablePPO

        model = MaskablePPO.load(chosen[1], env=model.get_env(), device="cpu", tensorboard_log=str(run / "tb"))
    if chosen is not None:
        log(f"model.zip: the {'initial policy' if chosen[0] == INITIAL else f'policy of round {chosen[0]}'} "
            f"(validation zero-shot geo-mean {chosen[2]:.3f}, the best of {_validated_count(state)})")
        fresh = state.stats(INITIAL, "validate") if state.done(INITIAL, "validate") else {}
        if not _candidate(INITIAL, fresh) and fresh.get("geomean", 0.0) > chosen[2] + 1e-9:
            log(f"note: the untrained network validated better ({fresh['geomean']:.3f}); the validation "
                f"tasks are few, or training did not help on them")
    path = atomic_save(model, run / "model.zip")
    return IterationResult(model=model, model_path=path, rounds=rounds, seconds=time.perf_counter() - t0,
                           selected_round=None if chosen is None else chosen[0])


def _validate(model, dataset, rows: Sequence[dict], ei, seed: int) -> dict:
    """The policy's zero-shot ratio on the validation tasks (:func:`zero_shot`), without the per-task rows."""
    stats = zero_shot(model, dataset, rows, samples=ei.eval_samples, seed=seed)
    return {k: v for k, v in stats.items() if k != "rows"}


def selected(state: IterationState) -> tuple[int, str, float] | None:
    """(round, checkpoint, validation geo-mean) of the validated policy with the best zero-shot geo-mean
    (the earliest among equals; the initial policy is round ``INITIAL``, a candidate unless it was a fresh
    network), or None without validation."""
    best = None
    for r, phase, ckpt, stats in state.finished:
        g = stats.get("geomean") if phase == "validate" and _candidate(r, stats) else None
        if g is not None and ckpt and math.isfinite(g) and (best is None or g > best[2] + 1e-9):
            best = (int(r), str(ckpt), float(g))
    return best


def _candidate(r: int, validation: dict) -> bool:
    """Whether the policy validated in round ``r`` may be selected: every round's, and the initial policy
    unless it was a fresh network (an untrained network is a reference line, not a result)."""
    return r != INITIAL or validation.get("given", True)


def _validated_count(state: IterationState) -> int:
    """The selection's candidates: the validated policies, less a fresh initial network."""
    return sum(1 for r, phase, _, stats in state.finished if phase == "validate" and _candidate(r, stats))


def placeable(dataset, rows: Sequence[dict], env_kwargs: dict, log: Callable[[str], None]) -> tuple[list, list]:
    """(task ids, Tasks) of the rows whose task the training environment takes (a task it refuses, e.g. an
    operator no device can hold at this padding, is left out with a message)."""
    from envs.errors import EnvError
    from envs.placement.env import PlacementEnv

    ids, tasks = [], []
    for row in rows:
        task = dataset.task(row)
        try:
            PlacementEnv([task], **env_kwargs)
        except EnvError as exc:
            log(f"task {row['task_id']} left out of training: {exc}")
            continue
        ids.append(row["task_id"])
        tasks.append(task)
    return ids, tasks


def distil(model, tasks: Sequence, goal: dict[str, dict], env_kwargs: dict, *, epochs: int, batch_size: int,
           learning_rate: float, seed: int, log: Callable[[str], None], on_policy_states: bool = False) -> dict:
    """Behaviour-clone every task's target (the whole decision sequence of its replay); with
    ``on_policy_states``, also the target's labels on the current policy's greedy rollout (DAgger)."""
    from agent.imitation import behaviour_clone, collect
    from envs.plan import Plan

    t = time.perf_counter()
    plans = {name: (row["source"], Plan.from_dict(row["plan"]), float(row["value"]), bool(row["oom"]))
             for name, row in goal.items()}
    demos = collect([x for x in tasks if x.name in plans], env_kwargs, plans,
                    learner=model if on_policy_states else None)
    t_demo = time.perf_counter() - t
    stats = behaviour_clone(model, demos, epochs=epochs, batch_size=batch_size, seed=seed,
                            learning_rate=learning_rate, log=log)
    replay_gap = [d.heuristic_time / d.replay_time for d in demos if not d.on_policy and d.replay_time > 0]
    # the policy's own greedy plans (before this distillation) against their targets, where rolled out
    own_gap = [plans[d.task][2] / d.replay_time for d in demos if d.on_policy and d.replay_time > 0]
    return {"steps": stats["steps"], "first_loss": stats.get("first_loss"), "last_loss": stats.get("last_loss"),
            "agreement": stats.get("greedy_agreement"), "demo_seconds": round(t_demo, 1),
            "seconds": round(time.perf_counter() - t, 1),
            "replay_fidelity": _geomean(replay_gap), "policy_vs_target": _geomean(own_gap)}


def _geomean(ratios: list[float]) -> float | None:
    return float(np.exp(np.mean(np.log(ratios)))) if ratios else None


def improve(model, cfg, run: Path, tasks: Sequence, goal: dict[str, dict], *, steps: int, progress: bool,
            log: Callable[[str], None], deadline: float | None) -> tuple[dict, dict]:
    """PPO for ``steps`` with self-imitation; the targets are the known bests. Returns the stats and the
    best plan PPO visited per task (``BestPlanCallback.best``)."""
    from stable_baselines3.common.callbacks import CallbackList

    from agent.callbacks import AtomicCheckpointCallback, BestPlanCallback, DeadlineCallback, ProgressCallback
    from agent.self_imitation import SelfImitationCallback
    from agent.train import TB_NAME
    from envs.plan import Plan

    t = time.perf_counter()
    kw = dict(cfg.env)
    best_cb = BestPlanCallback(tasks, run / "plans", objective=kw.get("objective", "step_time"), baselines=False,
                               log=log)
    known = {name: {"plan": Plan.from_dict(row["plan"]), "step_time": float(row["value"]), "oom": bool(row["oom"])}
             for name, row in goal.items()}
    cbs = [best_cb, AtomicCheckpointCallback(save_freq=max(1, cfg.callbacks["checkpoint_freq"] // cfg.n_envs),
                                             save_path=str(run / "checkpoints"), name_prefix="model")]
    if cfg.self_imitation is not None:
        cbs.append(SelfImitationCallback(tasks, kw, lambda: best_cb.best, seed=cfg.seed, known=known,
                                         **cfg.self_imitation))
    if progress:
        cbs.append(ProgressCallback(best_cb, model.num_timesteps + steps))
    if deadline is not None:
        cbs.append(DeadlineCallback(deadline))
    model.learn(total_timesteps=int(steps), callback=CallbackList(cbs), tb_log_name=TB_NAME,
                reset_num_timesteps=False, progress_bar=False)
    beat = sum(1 for name, b in best_cb.best.items()
               if name in goal and (b["oom"], b["step_time"]) < (goal[name]["oom"], goal[name]["value"]))
    return ({"steps": int(steps), "num_timesteps": int(model.num_timesteps), "episodes": best_cb.episodes,
             "beat_target": beat, "seconds": round(time.perf_counter() - t, 1)}, dict(best_cb.best))


def _checkpoint(model, run: Path, r: int, phase: str) -> Path:
    from agent.callbacks import atomic_save

    return atomic_save(model, run / "checkpoints" / f"round_{r}_{phase}.zip")


def _round_report(state: IterationState, r: int, dataset, targets: Targets, ids: dict) -> dict:
    search, distill, ppo, ev, val = (state.stats(r, p) for p in ("search", "distill", "ppo", "evaluate", "validate"))
    best, tbest = dataset.best(), targets.best()

    def geo(xs):
        g = _geomean(xs)
        return float("nan") if g is None else g

    gaps = [best[i]["heuristic_value"] / best[i]["value"] for i in ids["train"] if not best[i]["oom"]]
    reach = [best[i]["value"] / tbest[i]["value"] for i in ids["train"] if i in tbest and not tbest[i]["oom"]]
    return {"round": r, "dataset_rows": len(dataset.rows), "dataset_tasks": len(best),
            "best_vs_heuristic": geo(gaps), "targets_vs_best": geo(reach),
            "new_targets": search.get("new_targets"), "search_improved": search.get("improved_dataset"),
            "distill_loss": distill.get("last_loss"), "agreement": distill.get("agreement"),
            "replay_fidelity": distill.get("replay_fidelity"), "policy_vs_target": distill.get("policy_vs_target"),
            "ppo_beat_target": ppo.get("beat_target"), "zero_shot_geomean": ev.get("geomean"),
            "zero_shot_min": ev.get("min"), "zero_shot_wins": ev.get("wins"),
            "zero_shot_n": ev.get("n"), "train_geomean": ev.get("train_vs_heuristic"), "validation_geomean": val.get("geomean"),
            "validation_min": val.get("min"), "curves": search.get("curves")}


def _writer(run: Path):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(run / "tb" / "expert_iteration"))


def _log_round(writer, report: dict, model) -> None:
    """TensorBoard ``expert_iteration/*`` scalars at the round's index (and the step count as a scalar)."""
    r = int(report["round"])
    for key in ("dataset_rows", "best_vs_heuristic", "targets_vs_best", "new_targets", "search_improved",
                "distill_loss", "agreement", "replay_fidelity", "policy_vs_target", "ppo_beat_target",
                "zero_shot_geomean", "zero_shot_min", "zero_shot_wins", "train_geomean", "validation_geomean",
                "validation_min"):
        v = report.get(key)
        if v is not None and isinstance(v, (int, float)) and math.isfinite(float(v)):
            writer.add_scalar(f"expert_iteration/{key}", float(v), r)
    writer.add_scalar("expert_iteration/num_timesteps", float(model.num_timesteps), r)
    if report.get("curves"):
        writer.add_figure("expert_iteration/search_curves", _curve_figure(report["curves"], r), r)
    writer.flush()


def _curve_figure(curves: list, r: int):
    """The round's searches: best value / start value vs simulator evaluations, one line per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for c in curves:
        ax.step([max(n, 1) for n, _ in c], [v for _, v in c], where="post", lw=0.8, alpha=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("simulator evaluations")
    ax.set_ylabel("best / start")
    ax.set_title(f"round {r}: target searches ({len(curves)} tasks)")
    fig.tight_layout()
    return fig


__all__ = ["expert_iteration", "IterationResult", "IterationState", "TargetJob", "Targets", "find_target",
           "search_round", "target_candidates", "zero_shot", "distil", "improve", "placeable", "selected"]
