"""Measure the three agent targets (PPO vs heuristics, zero-shot transfer, placement latency).

    python -m experiments.agent_targets --target a [--minutes 15] [--seed S] [--warm-start ZIP] [--tag _s1]
                                                   [--config target_a|target_a_place]
    python -m experiments.agent_targets --target b [--minutes 15] [--side zeroshot|specialist|both]
    python -m experiments.agent_targets --target c [--groups 500] [--samples 8]

(a) PPO on one ~200-group GPT graph (``experiments/configs/target_a.yaml``: gpt-1.3b coarsened to 200
    groups, on ``dgx-a100-80g``; refine mode with self-imitation; ``--config target_a_place`` is the
    place-mode variant) for ``--minutes`` of wall clock; the best plan found so far is tracked
    over time against the best heuristic (the fast placers incl. megatron_3d, then MCMC from the best
    of them for ``--mcmc-seconds``). Result: ``best_heuristic_time / best_ppo_time`` (> 1: PPO wins).
(b) Zero-shot transfer: a policy trained for ``--minutes`` on several families without moe-wide
    (``target_b_zeroshot.yaml``) places moe-wide@dgx-a100-80g (greedy + ``--samples`` rollouts, no
    training on it), against a specialist trained on moe-wide alone for the same budget
    (``target_b_specialist.yaml``; its best = best training episode or final rollouts). Result:
    ``zero_shot_time / specialist_time`` (target <= 1.05; also against the specialist's final policy
    alone, same protocol as the zero-shot side). Each side can run alone (``--side``); the ratio is
    written once both side files exist (``--side combine`` recomputes it).
(c) ``rlplace place`` latency with the shipped policy (``agent/pretrained/placement_policy.zip``) on a
    ``--groups``-group GPT graph (built in memory, so no tracing): policy-only time (env + rollouts)
    and the total with the fast baselines.

Every target writes ``target_<x>.json`` and ``target_<x>.png`` into ``--out`` (atomically). All plan
times are the simulator's step time on the *operator* graph. Training is :func:`agent.train.train` with a
wall-clock deadline (``--minutes`` from the call: environments and the imitation warm start count), one
torch thread per process and ``n_envs`` (2) environment processes; each run keeps its directory
(checkpoints, TensorBoard logs, best plans) under ``runs/agent_targets/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from envs.files import atomic_write_text  # noqa: E402
from envs.gantt import save_figure  # noqa: E402

CONFIGS = ROOT / "experiments" / "configs"
DEFAULT_OUT = ROOT / "experiments" / "results" / "agent_targets"
RUNS = ROOT / "runs" / "agent_targets"  # the training runs' directories (checkpoints, TensorBoard logs)


# ---------------------------------------------------------------------- small helpers
def seed_everything(seed: int) -> None:
    import torch as th

    random.seed(seed)
    np.random.seed(seed)
    th.manual_seed(seed)
    th.set_num_threads(1)


def write_json(path: Path, obj: dict) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def write_png(path: Path, fig) -> None:
    fig.tight_layout()
    save_figure(fig, path)


def new_figure(title: str, xlabel: str, ylabel: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(float(seconds) * 1e3, 4)


# ---------------------------------------------------------------------- wall-clock PPO training
def training_curve(t0: float):
    """An SB3 callback recording, per task, every finished episode as ``history[task]`` ``(seconds,
    step_time, oom)`` and every improvement of the best plan as ``curve[task]`` ``(seconds, timesteps,
    step_time, oom)`` (fits in memory first, then fastest); seconds count from ``t0``
    (``time.perf_counter()``)."""
    from stable_baselines3.common.callbacks import BaseCallback

    from agent.callbacks import episode_plans

    class TrainingCurve(BaseCallback):
        def __init__(self):
            super().__init__()
            self.best: dict[str, tuple[bool, float]] = {}
            self.curve: dict[str, list] = {}
            self.history: dict[str, list] = {}

        def elapsed(self) -> float:
            return time.perf_counter() - t0

        def _on_step(self) -> bool:
            for info in self.locals.get("infos", []):
                if "plan" not in info:
                    continue
                task = info["task_id"]
                self.history.setdefault(task, []).append((round(self.elapsed(), 2), float(info["step_time"]),
                                                          bool(info["oom"])))
                for _plan, st, oom in episode_plans(info):
                    if task not in self.best or (oom, st) < self.best[task]:
                        self.best[task] = (oom, st)
                        self.curve.setdefault(task, []).append((self.elapsed(), int(self.num_timesteps), st, oom))
            return True

    return TrainingCurve()


def train_minutes(config_name: str, minutes: float, seed: int, warm_start: Path | None = None):
    """PPO on a config's tasks (seed: the config's + ``seed``) for ``minutes`` of wall clock, counted from
    the call (building the environments and the imitation warm start included): :func:`agent.train.train`
    with a deadline, its run directory a fresh folder under ``runs/agent_targets/``. ``warm_start``: a
    model zip whose policy weights initialise the run. Returns (TrainResult, training curve)."""
    from agent.train import load_config, train

    cfg = load_config(CONFIGS / f"{config_name}.yaml")
    cfg = dataclasses.replace(cfg, raw={**cfg.raw, "seed": cfg.seed + seed}, spec=None)
    seed_everything(cfg.seed)
    RUNS.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"{config_name}-seed{cfg.seed}-", dir=RUNS))
    t0 = time.perf_counter()
    curve = training_curve(t0)
    # an effectively unbounded step target: the deadline ends training
    res = train(cfg, run_dir=run_dir, total_steps=10**9, progress=False, callbacks=[curve],
                deadline=t0 + minutes * 60.0, init_weights=warm_start)
    print(f"[{config_name}] trained {res.num_timesteps} steps, {res.episodes} episodes in {curve.elapsed():.0f}s "
          f"(run: {run_dir})")
    return res, curve


def policy_best(model, task, cfg, samples: int, seed: int):
    """The best of the policy's greedy + ``samples`` sampled rollouts, scored on the operator graph, in the
    config's episode mode (``rlplace place`` reads it from the run's config.yaml); also the seconds taken
    and the greedy rollout's time(s) in ms."""
    from agent.infer import EPISODE_KEYS, place

    model.episode_kwargs = {k: cfg.env[k] for k in EPISODE_KEYS if k in cfg.env}
    t = time.perf_counter()
    res = place(task.graph, task.topology, model=model, samples=samples, seed=seed, baselines=False,
                max_groups=cfg.env["max_nodes"])
    greedy = {c.name: ms(c.value) for c in res.candidates if c.name.startswith("policy greedy")}
    return res.best, time.perf_counter() - t, greedy


def heuristic_best(task, mcmc_seconds: float, seed: int) -> dict:
    """The fast placers (megatron_3d included) and MCMC from the best of them; the overall winner."""
    from agent.infer import Candidate, run_baselines, search_from_best
    from envs.evaluator import CachedSimulation

    ev = CachedSimulation(cache_size=4096)
    t = time.perf_counter()
    cands = run_baselines(task.graph, task.topology, "step_time", seed=seed, evaluator=ev)
    fast_s = time.perf_counter() - t
    if mcmc_seconds > 0:
        cands += search_from_best(cands, task.graph, task.topology, "step_time", mcmc_seconds, seed, ev)
    best = min(cands, key=Candidate.key)
    return {"winner": best.name, "step_time": best.value, "oom": best.oom, "fast_seconds": round(fast_s, 2),
            "mcmc_seconds": mcmc_seconds,
            "all_ms": {c.name: ms(c.value) for c in sorted(cands, key=Candidate.key)}}


def _per_minute_median(history: list, h_time: float) -> list[dict]:
    """Median of ``h_time / step_time`` over the episodes that ended in each minute of training."""
    by_min: dict[int, list[float]] = {}
    for sec, st, _oom in history:
        by_min.setdefault(int(sec // 60) + 1, []).append(h_time / st)
    return [{"minute": m, "episodes": len(v), "median_ratio": round(float(np.median(v)), 4)}
            for m, v in sorted(by_min.items())]


# ---------------------------------------------------------------------- (a) PPO vs heuristics on ~200 groups
def target_a(args) -> dict:
    from agent.train import build_tasks, load_config

    cfg = load_config(CONFIGS / f"{args.config}.yaml")
    task = build_tasks(cfg.raw["tasks"], seed=cfg.seed)[0]
    print(f"(a) {task.name}: {len(task.graph.names)} ops -> <= {cfg.env['max_nodes']} groups; "
          f"{args.minutes} min of PPO")

    heur = heuristic_best(task, args.mcmc_seconds, args.seed)
    h_time = heur["step_time"]
    print(f"(a) best heuristic: {heur['winner']} {h_time * 1e3:.3f} ms (all: {heur['all_ms']})")

    res, tracker = train_minutes(args.config, args.minutes, args.seed, args.warm_start)
    cfg, best, imitation = res.config, res.best.get(task.name), res.imitation
    curve = [{"seconds": round(s, 2), "timesteps": n, "best_ms": ms(st), "oom": oom, "ratio": round(h_time / st, 4)}
             for s, n, st, oom in tracker.curve.get(task.name, [])]
    final, roll_s, greedy = policy_best(res.model, task, cfg, args.samples, args.seed)
    ppo_time = min([final.value] + ([best["step_time"]] if best and not best["oom"] else []))
    ratio = h_time / ppo_time
    out = {"target": "a", "config": args.config, "mode": cfg.env.get("mode", "place"), "task": task.name,
           "ops": len(task.graph.names), "max_groups": cfg.env["max_nodes"],
           "minutes": args.minutes, "seed": args.seed,
           "warm_start": None if args.warm_start is None else str(args.warm_start),
           "imitation": None if imitation is None else
           {k: v for k, v in imitation.items() if k != "demonstrations"} |
           {"demonstration": imitation["demonstrations"]}, "timesteps": res.num_timesteps,
           "episodes": res.episodes, "heuristic": {**heur, "step_time_ms": ms(h_time)},
           "ppo_best_training_ms": ms(best["step_time"]) if best else None,
           "ppo_best_training_oom": best["oom"] if best else None,
           "ppo_final_policy_ms": ms(final.value), "ppo_final_policy_oom": final.oom,
           "ppo_final_rollouts": {"samples": args.samples, "seconds": round(roll_s, 2)},
           "ppo_final_greedy_ms": greedy,
           "self_imitation_rounds": res.self_imitation_rounds,
           "ppo_best_ms": ms(ppo_time),
           "ratio_heuristic_over_ppo": round(ratio, 4), "ppo_beats_heuristic": ratio > 1.0, "curve": curve,
           "episode_ratio_median_per_minute": _per_minute_median(tracker.history.get(task.name, []), h_time)}
    print(f"(a) best PPO {ppo_time * 1e3:.3f} ms vs {heur['winner']} {h_time * 1e3:.3f} ms: "
          f"ratio heuristic/PPO = {ratio:.4f}")

    fig, ax = new_figure(f"(a) {task.name}: best PPO plan vs best heuristic ({heur['winner']})",
                         "wall-clock training time (s)", "best heuristic time / best PPO time")
    if curve:
        xs = [c["seconds"] for c in curve] + [tracker.elapsed()]
        ys = [c["ratio"] for c in curve] + [curve[-1]["ratio"]]
        ax.step(xs, ys, where="post", label="best training episode")
    hist = tracker.history.get(task.name, [])
    if hist:
        ax.plot([h[0] for h in hist], [h_time / h[1] for h in hist], ".", ms=2, alpha=0.3, color="C0",
                label="every training episode")
        med = out["episode_ratio_median_per_minute"]
        ax.plot([m["minute"] * 60 for m in med], [m["median_ratio"] for m in med], "-", color="C1",
                label="median episode, per minute")
    ax.axhline(1.0, color="k", ls="--", lw=1, label="heuristic")
    ax.axhline(ratio, color="C2", ls=":", label=f"final (incl. greedy+{args.samples}): {ratio:.3f}")
    ax.legend()
    write_json(args.out / f"target_a{args.tag}.json", out)
    write_png(args.out / f"target_a{args.tag}.png", fig)
    return out


# ---------------------------------------------------------------------- (b) zero-shot vs specialist
def target_b(args) -> dict:
    from agent.train import build_tasks, load_config

    zcfg = load_config(CONFIGS / "target_b_zeroshot.yaml")
    held = build_tasks(zcfg.raw["eval_tasks"], seed=zcfg.seed)[0]
    sides = {"both": ["zeroshot", "specialist"], "combine": []}.get(args.side, [args.side])
    for side in sides:
        res, tracker = train_minutes(f"target_b_{side}", args.minutes, args.seed)
        if side == "zeroshot":
            assert all(t.graph.name != held.graph.name for t in res.tasks), "held-out graph leaked into training"
        final, roll_s, _ = policy_best(res.model, held, res.config, args.samples, args.seed)
        row = {"side": side, "config": f"target_b_{side}.yaml", "task": held.name, "minutes": args.minutes,
               "seed": args.seed, "timesteps": res.num_timesteps, "episodes": res.episodes,
               "train_tasks": [t.name for t in res.tasks],
               "final_policy_ms": ms(final.value), "final_policy_oom": final.oom,
               "final_rollouts": {"samples": args.samples, "seconds": round(roll_s, 2)}}
        times = [final.value]
        if side == "specialist":  # the specialist also searched this very task while training
            b = res.best.get(held.name)
            row["best_training_ms"] = ms(b["step_time"]) if b else None
            row["curve"] = [{"seconds": round(s, 2), "timesteps": n, "best_ms": ms(st), "oom": oom}
                            for s, n, st, oom in tracker.curve.get(held.name, [])]
            if b and not b["oom"]:
                times.append(b["step_time"])
        row["best_ms"] = ms(min(times))
        print(f"(b) {side}: {held.name} best {row['best_ms']} ms after {row['timesteps']} steps")
        write_json(args.out / f"target_b_{side}.json", row)

    paths = {s: args.out / f"target_b_{s}.json" for s in ("zeroshot", "specialist")}
    if not all(p.exists() for p in paths.values()):
        print(f"(b) waiting for the other side ({', '.join(str(p) for p in paths.values() if not p.exists())})")
        return {}
    z, s = (json.loads(p.read_text()) for p in paths.values())
    ratio = z["best_ms"] / s["best_ms"]
    heur = heuristic_best(held, 0.0, args.seed)  # context only: the fast placers, no MCMC
    policy_ratio = z["final_policy_ms"] / s["final_policy_ms"]  # both: greedy + samples of the final policy
    out = {"target": "b", "task": held.name, "zeroshot": z, "specialist": s,
           "ratio_zeroshot_over_specialist": round(ratio, 4), "meets_target_1.05": ratio <= 1.05,
           "ratio_zeroshot_over_specialist_final_policy": round(policy_ratio, 4),
           "fast_heuristic": {"winner": heur["winner"], "step_time_ms": ms(heur["step_time"])}}
    print(f"(b) zero-shot {z['best_ms']} ms / specialist {s['best_ms']} ms = {ratio:.4f} (target <= 1.05; "
          f"vs the specialist's final policy {s['final_policy_ms']} ms: {policy_ratio:.4f}); "
          f"best fast heuristic {heur['winner']} {heur['step_time'] * 1e3:.3f} ms")

    fig, ax = new_figure(f"(b) {held.name}: zero-shot vs specialist", "specialist wall-clock training time (s)",
                         "best step time (ms)")
    if s.get("curve"):
        xs = [c["seconds"] for c in s["curve"]] + [s["minutes"] * 60]
        ys = [c["best_ms"] for c in s["curve"]] + [s["curve"][-1]["best_ms"]]
        ax.step(xs, ys, where="post", label="specialist: best training episode")
    ax.axhline(s["best_ms"], color="C1", ls=":", label=f"specialist best {s['best_ms']:.3f} ms")
    ax.axhline(z["best_ms"], color="C2", ls="--", label=f"zero-shot {z['best_ms']:.3f} ms (x{ratio:.3f})")
    ax.axhline(heur["step_time"] * 1e3, color="k", ls="-.", lw=1,
               label=f"best fast heuristic ({heur['winner']}) {heur['step_time'] * 1e3:.3f} ms")
    ax.legend()
    write_json(args.out / "target_b.json", out)
    write_png(args.out / "target_b.png", fig)
    return out


# ---------------------------------------------------------------------- (c) place latency, pretrained policy
def target_c(args) -> dict:
    from agent.infer import PRETRAINED, load_policy, place, policy_env
    from envs.examples import transformer_graph
    from envs.presets import resolve_topology
    from envs.tasks import Task

    seed_everything(args.seed)
    # 10 ops per layer (+4); at 2x --groups ops the coarsening, not the graph, sets the group count (the
    # environment merges ops it cannot place apart, so a graph of exactly --groups ops has fewer groups)
    layers = max(1, -(-2 * args.groups // 10))
    graph = transformer_graph(layers=layers, hidden=2048, heads=16, seq=2048, batch=8, name=f"gpt-l{layers}")
    topo = resolve_topology("dgx-a100-80g")
    t = time.perf_counter()
    model = load_policy(PRETRAINED)
    load_s = time.perf_counter() - t
    task = Task(graph, topo)
    env, _, _ = policy_env(model, task, "step_time", args.groups)
    groups = int(env.reset(options={"task": task})[1]["num_groups"])
    print(f"(c) {graph.name}: {len(graph.names)} ops, {groups} groups, {PRETRAINED.name} loaded in {load_s:.2f}s")

    t = time.perf_counter()
    pol = place(graph, topo, model=model, samples=args.samples, seed=args.seed, max_groups=args.groups,
                baselines=False)
    policy_s = time.perf_counter() - t
    t = time.perf_counter()
    place(graph, topo, model=model, samples=0, seed=args.seed, max_groups=args.groups, baselines=False)
    greedy_s = time.perf_counter() - t
    t = time.perf_counter()
    full = place(graph, topo, model=model, samples=args.samples, seed=args.seed, max_groups=args.groups)
    total_s = time.perf_counter() - t
    base = full.best_baseline()
    out = {"target": "c", "graph": graph.name, "ops": len(graph.names), "max_groups": args.groups, "groups": groups,
           "topology": topo.name, "samples": args.samples, "seed": args.seed, "policy_load_seconds": round(load_s, 3),
           "policy_only_seconds": round(policy_s, 3), "greedy_only_seconds_warm": round(greedy_s, 3),
           "policy_only_breakdown": {k: round(v, 3) for k, v in pol.seconds.items()},
           "total_with_baselines_seconds": round(total_s, 3),
           "total_breakdown": {k: round(v, 3) for k, v in full.seconds.items()},
           "policy_best_ms": ms(pol.best.value), "best_baseline": base.name if base else None,
           "best_baseline_ms": ms(base.value) if base else None, "winner": full.best.name,
           "note": "graph built in memory: no tracing; a fresh process adds imports and the policy load"}
    print(f"(c) policy only {policy_s:.2f}s ({out['policy_only_breakdown']}; greedy alone, warm: {greedy_s:.2f}s); "
          f"with baselines {total_s:.2f}s "
          f"({out['total_breakdown']}); winner {full.best.name}")

    fig, ax = new_figure(f"(c) place latency, {graph.name} ({args.groups} groups)", "", "seconds")
    parts = [("policy only", pol.seconds), ("with baselines", full.seconds)]
    keys = sorted({k for _, s in parts for k in s})
    bottom = np.zeros(len(parts))
    for k in keys:
        vals = np.array([s.get(k, 0.0) for _, s in parts])
        ax.bar([p for p, _ in parts], vals, bottom=bottom, label=k)
        bottom += vals
    ax.legend()
    write_json(args.out / "target_c.json", out)
    write_png(args.out / "target_c.png", fig)
    return out


# ---------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", choices=["a", "b", "c"], required=True)
    ap.add_argument("--minutes", type=float, default=15.0, help="PPO wall-clock budget per trained policy (a, b)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--samples", type=int, default=8, help="sampled rollouts besides the greedy one")
    ap.add_argument("--mcmc-seconds", type=float, default=20.0, help="(a) MCMC budget for the heuristic side")
    ap.add_argument("--side", choices=["zeroshot", "specialist", "both", "combine"], default="both",
                    help="(b) which side(s) to train; combine: only the ratio of the side files in --out")
    ap.add_argument("--warm-start", type=Path, default=None,
                    help="(a) initialise the policy from this model zip (e.g. agent/pretrained/placement_policy.zip)")
    ap.add_argument("--tag", default="", help="suffix of the output files (target_a<tag>.json), to keep several runs")
    ap.add_argument("--config", default="target_a", help="(a) the experiments/configs/ training config")
    ap.add_argument("--groups", type=int, default=500, help="(c) graph size in groups")
    args = ap.parse_args(argv)
    args.out = Path(args.out)
    t0 = time.time()
    {"a": target_a, "b": target_b, "c": target_c}[args.target](args)
    print(f"done in {time.time() - t0:.0f}s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
