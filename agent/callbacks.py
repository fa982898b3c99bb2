"""Training callbacks: best plan per task, TensorBoard scalars / Gantt images / hparams, progress bar.

- :class:`BestPlanCallback` watches finished episodes (``info["plan"]``, and in refine mode the best
  plan visited on the way, ``info["best_plan"]``), keeps each task's best plan
  (fits in memory first, then fastest) and writes it to ``plans/<task>.json`` whenever it improves
  (``plans/best.json`` indexes them, so a resumed run keeps its bests). At every rollout end it logs
  ``task/<task>/best_step_time_ms``, ``.../speedup_vs_ref`` (over the env's reference plan),
  ``.../speedup_vs_heuristic`` (over the best fast placer, run once per task at the start), and
  ``rollout/oom_rate``, ``rollout/mean_score``, ``rollout/mean_best_speedup``, ``train/entropy``.
- :class:`GanttEvalCallback` is sb3-contrib's ``MaskableEvalCallback`` (held-out tasks) that also
  logs the Gantt chart of the current best plans as TensorBoard images at every evaluation;
  :class:`GanttCallback` does the images alone when there are no held-out tasks.
  Its ``evaluations.npz`` and ``best/best_model.zip`` are written atomically, and :meth:`GanttEvalCallback.resume`
  continues a resumed run's evaluations instead of overwriting them.
- :class:`AtomicCheckpointCallback` is SB3's ``CheckpointCallback`` (``model_<steps>_steps.zip``) saving
  through :func:`atomic_save`: a kill during a save never leaves a broken file under a checkpoint's name.
- :class:`TensorBoardResumeCallback` marks where a resumed run's curve restarts.
- :class:`DeadlineCallback` ends training at a wall-clock deadline (``agent.train.train(deadline=...)``).
- :class:`HParamCallback` records the hyperparameters (SB3 ``HParam``) with the metrics they explain.
- :class:`ProgressCallback` is a rich progress bar showing the current mean best speedup.
"""

from __future__ import annotations

import json
import re
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from sb3_contrib.common.maskable.callbacks import MaskableEvalCallback
from stable_baselines3.common.callbacks import BaseCallback, CheckpointCallback
from stable_baselines3.common.logger import HParam, Image

from envs.files import atomic_output, one_line
from envs.plan import Plan

NO_TEXT = ("stdout", "log", "json", "csv")


def safe_name(name: str) -> str:
    """A task name usable as a file name and TensorBoard tag component."""
    return re.sub(r"[^A-Za-z0-9_.@-]+", "_", name)


def figure_to_array(fig) -> np.ndarray:
    """An RGB uint8 HWC array of a matplotlib figure (closes it)."""
    import matplotlib.pyplot as plt

    fig.canvas.draw()
    arr = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    plt.close(fig)
    return arr


def atomic_save(model, path: str | Path) -> Path:
    """``model.save(path)`` through a temporary zip beside ``path``, flushed and renamed over it: a kill
    during the save leaves the previous file (or none), never a half-written one."""
    with atomic_output(path, "model") as tmp:
        model.save(tmp)
    return Path(path)


class DeadlineCallback(BaseCallback):
    """Ends ``model.learn()`` at the first step after a wall-clock ``deadline`` (a ``time.perf_counter()``
    value), whatever the step count."""

    def __init__(self, deadline: float):
        super().__init__()
        self.deadline = float(deadline)

    def _on_step(self) -> bool:
        return time.perf_counter() < self.deadline


class AtomicCheckpointCallback(CheckpointCallback):
    """SB3's ``CheckpointCallback`` (``<name_prefix>_<steps>_steps.zip`` every ``save_freq`` calls) whose
    saves are atomic (:func:`atomic_save`)."""

    def _on_step(self) -> bool:
        if self.n_calls % self.save_freq == 0:
            atomic_save(self.model, self._checkpoint_path(extension="zip"))
        return True


def episode_plans(info: dict) -> list[tuple[Plan, float, bool]]:
    """``(plan, step_time, oom)`` of a finished episode's final plan and, in refine mode, of the best plan
    the episode visited on the way (``info["best_plan"]``)."""
    out = [(info["plan"], float(info["step_time"]), bool(info["oom"]))]
    if "best_plan" in info:
        out.append((info["best_plan"], float(info["best_step_time"]), bool(info["best_oom"])))
    return out


class BestPlanCallback(BaseCallback):
    """Tracks the best plan of every training task (see the module docstring)."""

    def __init__(self, tasks: Sequence, plans_dir: str | Path, objective: str = "step_time", baselines: bool = True,
                 window: int = 200, max_gantt: int = 3, log: Callable[[str], None] | None = None, verbose: int = 0):
        super().__init__(verbose)
        self.tasks = {t.name: t for t in tasks}
        self.plans_dir = Path(plans_dir)
        self.objective = objective
        self.run_baselines = baselines
        self.max_gantt = max_gantt
        self.say = log or (lambda _m: None)
        self.best: dict[str, dict] = {}
        self.heuristic: dict[str, dict] = {}
        self.scores: deque = deque(maxlen=window)
        self.ooms: deque = deque(maxlen=window)
        self.episodes = 0

    # ------------------------------------------------------------------ state
    def _index_path(self) -> Path:
        return self.plans_dir / "best.json"

    def _load_index(self) -> None:
        p = self._index_path()
        if not p.exists():
            return
        data = json.loads(p.read_text())
        self.heuristic.update({k: v for k, v in (data.get("heuristic") or {}).items() if k in self.tasks})
        for name, row in data.get("tasks", {}).items():
            if name in self.tasks and Path(row.get("path", "")).exists():
                self.best[name] = {**row, "plan": Plan.load(row["path"])}

    def _save_index(self) -> None:
        from envs.files import atomic_write_json

        rows = {k: {kk: vv for kk, vv in v.items() if kk != "plan"} for k, v in self.best.items()}
        atomic_write_json(self._index_path(), {"tasks": rows, "heuristic": self.heuristic})

    def _on_training_start(self) -> None:
        self.plans_dir.mkdir(parents=True, exist_ok=True)
        self._load_index()
        if self.run_baselines and not self.heuristic:
            from agent.infer import run_baselines

            t = time.perf_counter()
            for name, task in self.tasks.items():
                cands = run_baselines(task.graph, task.topology, self.objective)
                fit = [c for c in cands if not c.oom] or cands
                if fit:
                    b = min(fit, key=lambda c: c.evaluation.value)
                    self.heuristic[name] = {"placer": b.name, "step_time": b.evaluation.value, "oom": b.oom}
            self.say(f"baselines for {len(self.tasks)} task(s) in {time.perf_counter() - t:.1f}s")

    # ------------------------------------------------------------------ episodes
    def _on_step(self) -> bool:
        for info in self.locals.get("infos", []):
            if "plan" not in info:
                continue
            self.episodes += 1
            self.scores.append(float(info.get("score", 0.0)))
            self.ooms.append(bool(info.get("oom", False)))
            for plan, step_time, oom in episode_plans(info):
                self.offer(info["task_id"], plan, step_time, float(info["ref_time"]), oom)
        return True

    def offer(self, task: str, plan: Plan, step_time: float, ref_time: float, oom: bool) -> bool:
        """Keep ``plan`` if it beats the task's best; returns whether it did."""
        cur = self.best.get(task)
        if cur is not None and (cur["oom"], cur["step_time"]) <= (oom, step_time):
            return False
        path = self.plans_dir / f"{safe_name(task)}.json"
        plan.save(path)
        self.best[task] = {"step_time": step_time, "ref_time": ref_time, "oom": oom, "speedup": ref_time / step_time,
                           "path": str(path), "timestep": int(self.num_timesteps), "plan": plan}
        self._save_index()
        return True

    def mean_best_speedup(self) -> float:
        ok = [b["speedup"] for b in self.best.values() if not b["oom"]]
        return float(np.exp(np.mean(np.log(ok)))) if ok else 0.0

    def _on_rollout_end(self) -> None:
        lg = self.logger
        for name, b in self.best.items():
            tag = f"task/{safe_name(name)}"
            lg.record(f"{tag}/best_step_time_ms", b["step_time"] * 1e3)
            lg.record(f"{tag}/speedup_vs_ref", b["speedup"])
            h = self.heuristic.get(name)
            if h is not None:
                lg.record(f"{tag}/speedup_vs_heuristic", h["step_time"] / b["step_time"])
        if self.scores:
            lg.record("rollout/mean_score", float(np.mean(self.scores)))
            lg.record("rollout/oom_rate", float(np.mean(self.ooms)))
        if self.best:
            lg.record("rollout/mean_best_speedup", self.mean_best_speedup())
            vs = [self.heuristic[k]["step_time"] / b["step_time"] for k, b in self.best.items() if k in self.heuristic]
            if vs:
                lg.record("rollout/mean_speedup_vs_heuristic", float(np.exp(np.mean(np.log(vs)))))
        ent = lg.name_to_value.get("train/entropy_loss")
        if ent is not None:  # SB3 logs -entropy as train/entropy_loss after the previous update
            lg.record("train/entropy", -float(ent))

    # ------------------------------------------------------------------ images
    def gantt_images(self) -> dict[str, np.ndarray]:
        """Gantt chart (RGB array) of the best plan of up to ``max_gantt`` tasks, on the operator graph."""
        from envs.gantt import gantt_figure
        from envs.sim import simulate

        out = {}
        for name in list(self.best)[:self.max_gantt]:
            b, task = self.best[name], self.tasks.get(name)
            if task is None:
                continue
            try:
                rep = simulate(task.graph, task.topology, b["plan"], "step_time", timeline=True, validate=False)
            except Exception:  # noqa: BLE001 - a chart must never stop training
                continue
            title = f"{name}: {rep.value * 1e3:.3g} ms (x{b['speedup']:.2f} vs ref) @ step {b['timestep']}"
            out[name] = figure_to_array(gantt_figure(rep, title=title))
        return out

    def log_gantt(self, logger) -> int:
        imgs = self.gantt_images()
        for name, arr in imgs.items():
            logger.record(f"plans/{safe_name(name)}", Image(arr, "HWC"), exclude=NO_TEXT)
        return len(imgs)

    def summary(self) -> dict:
        return {k: {kk: vv for kk, vv in v.items() if kk != "plan"} | {"heuristic": self.heuristic.get(k)}
                for k, v in self.best.items()}


class GanttCallback(BaseCallback):
    """Logs the best plans' Gantt charts every ``eval_freq`` calls (when there is no eval env)."""

    def __init__(self, best: BestPlanCallback, eval_freq: int):
        super().__init__()
        self.best_cb, self.eval_freq = best, int(eval_freq)

    def _on_step(self) -> bool:
        if self.eval_freq > 0 and self.n_calls % self.eval_freq == 0 and self.best_cb.log_gantt(self.logger):
            self.logger.dump(self.num_timesteps)
        return True

    def _on_training_end(self) -> None:
        if self.best_cb.log_gantt(self.logger):
            self.logger.dump(self.num_timesteps)


class GanttEvalCallback(MaskableEvalCallback):
    """``MaskableEvalCallback`` on held-out tasks that also logs the best plans' Gantt charts, writes
    ``evaluations.npz`` and ``best_model.zip`` atomically and can continue a resumed run's evaluations."""

    def __init__(self, eval_env, best: BestPlanCallback, best_model_save_path: str | None = None, **kwargs):
        super().__init__(eval_env, best_model_save_path=None, **kwargs)  # the best model is saved here
        self.best_cb = best
        self.best_model_path = Path(best_model_save_path) / "best_model.zip" if best_model_save_path else None
        self.npz_path = Path(f"{self.log_path}.npz") if self.log_path is not None else None

    def resume(self, upto: int, log: Callable[[str], None] | None = None) -> int:
        """Preload the evaluations of ``evaluations.npz`` up to step ``upto`` (the resumed model's counter;
        later ones belong to steps that are trained again), so the file continues; the best mean reward
        so far is theirs. Returns how many were kept."""
        say = log or (lambda _m: None)
        if self.npz_path is None or not self.npz_path.exists():
            return 0
        try:
            with np.load(self.npz_path) as d:
                steps, results, lengths = d["timesteps"], d["results"], d["ep_lengths"]
                successes = d["successes"] if "successes" in d.files else None
        except Exception as exc:  # noqa: BLE001 - a broken file: start afresh, say so
            say(f"warning: {self.npz_path} does not load ({one_line(exc, 120)}); evaluations start afresh")
            return 0
        if results.ndim != 2 or results.shape[1] != self.n_eval_episodes or len(steps) != len(results):
            say(f"warning: {self.npz_path} holds {results.shape} results, not {self.n_eval_episodes} episodes "
                f"per evaluation; evaluations start afresh")
            return 0
        keep = np.asarray(steps) <= int(upto)
        self.evaluations_timesteps = [int(t) for t in steps[keep]]
        self.evaluations_results = [[float(r) for r in row] for row in results[keep]]
        self.evaluations_length = [[int(n) for n in row] for row in lengths[keep]]
        if successes is not None and len(successes) == len(steps):
            self.evaluations_successes = [[bool(x) for x in row] for row in successes[keep]]
        if self.evaluations_results:
            self.best_mean_reward = max(float(np.mean(row)) for row in self.evaluations_results)
        return len(self.evaluations_timesteps)

    def _on_step(self) -> bool:
        if not (self.eval_freq > 0 and self.n_calls % self.eval_freq == 0):
            return super()._on_step()
        self.best_cb.log_gantt(self.logger)  # dumped with the evaluation's scalars
        best = self.best_mean_reward
        if self.npz_path is None:
            go = super()._on_step()
        else:
            with atomic_output(self.npz_path, "evaluations") as tmp:
                self.log_path = str(tmp)  # np.savez writes the temporary file, renamed when complete
                go = super()._on_step()
        if self.best_model_path is not None and self.best_mean_reward > best:
            atomic_save(self.model, self.best_model_path)
        return go

    def _on_training_end(self) -> None:
        if self.best_cb.log_gantt(self.logger):
            self.logger.dump(self.num_timesteps)


class TensorBoardResumeCallback(BaseCallback):
    """On a resumed run, tells TensorBoard that the curve restarts after step ``step`` (the session-start
    event ``SummaryWriter(purge_step=step + 1)`` writes): points an earlier run logged beyond it (steps
    that are trained again, when the newest checkpoints were lost) are hidden instead of drawn twice."""

    def __init__(self, step: int):
        super().__init__()
        self.step = int(step)

    def _on_training_start(self) -> None:
        from stable_baselines3.common.logger import TensorBoardOutputFormat
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        for fmt in self.logger.output_formats:
            if isinstance(fmt, TensorBoardOutputFormat):
                fmt.writer._get_file_writer().add_event(  # as torch's SummaryWriter does for purge_step
                    Event(step=self.step + 1, session_log=SessionLog(status=SessionLog.START)))

    def _on_step(self) -> bool:
        return True


class HParamCallback(BaseCallback):
    """Records the run's hyperparameters (TensorBoard HPARAMS tab) at the start of training."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg

    def _on_training_start(self) -> None:
        hp: dict = {"n_envs": self.cfg.n_envs, "seed": self.cfg.seed, "total_timesteps": self.cfg.total_timesteps}
        for section in ("ppo", "policy", "env"):
            for k, v in getattr(self.cfg, section).items():
                hp[f"{section}/{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)
        metrics = {"rollout/ep_rew_mean": 0.0, "rollout/mean_best_speedup": 0.0, "eval/mean_reward": 0.0}
        self.logger.record("hparams", HParam(hp, metrics), exclude=NO_TEXT)

    def _on_step(self) -> bool:
        return True


class ProgressCallback(BaseCallback):
    """A rich progress bar over the run's steps, showing the mean best speedup over the reference."""

    def __init__(self, best: BestPlanCallback, total: int):
        super().__init__()
        self.best_cb, self.total = best, int(total)
        self._progress = None
        self._bar = None

    def _on_training_start(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeRemainingColumn(), TextColumn("{task.fields[best]}"))
        self._progress.start()
        self._bar = self._progress.add_task("training", total=self.total, completed=self.num_timesteps,
                                            best="best speedup: -")

    def _on_step(self) -> bool:
        if self._progress is not None and self.n_calls % 16 == 0:
            s = self.best_cb.mean_best_speedup()
            self._progress.update(self._bar, completed=self.num_timesteps,
                                  best=f"best speedup x{s:.2f}" if s else "best speedup: -")
        return True

    def _on_training_end(self) -> None:
        if self._progress is not None:
            self._progress.update(self._bar, completed=self.num_timesteps)
        self.close()

    def close(self) -> None:
        """Stop the bar (training ended or was interrupted)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


__all__ = ["BestPlanCallback", "GanttEvalCallback", "GanttCallback", "HParamCallback", "ProgressCallback",
           "AtomicCheckpointCallback", "TensorBoardResumeCallback", "atomic_save", "safe_name"]
