"""Train the policy shipped in ``agent/pretrained/`` by expert iteration and report how it scores.

    python -m experiments.train_pretrained [--resume] [--run-dir runs/pretrained] [--ray | --ray-address A]
                                           [--no-progress] [--hours H]

Trains ``experiments/configs/pretrained.yaml`` (:mod:`agent.expert_iteration`: a drawn task distribution,
round 0's heuristic + MCMC targets, then rounds of distillation, PPO with self-imitation, held-out
zero-shot evaluation and policy-seeded search), resumable after any finished phase (``--resume``; a
killed search or dataset build keeps its finished tasks). Then copies the policy that validated best
(``model.zip``: the initial one or a round's, on training-family members never trained on; about 3 MB) to ``agent/pretrained/placement_policy.zip``, the best-known-plans dataset to
``experiments/results/pretrained/dataset/`` and writes ``experiments/results/pretrained/report.json``
and ``report.md`` (per round: dataset size, distillation loss and agreement, the held-out zero-shot ratio
vs the best fast heuristic; per held-out task the ratio, for the shipped round), atomically. ``--hours``
starts no round that would not finish within that much wall clock, judged by the longest round so far
(the default 3 is the budget the project gives this job).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "experiments" / "results" / "pretrained"


def main(argv: list[str] | None = None) -> int:
    from agent.infer import PRETRAINED
    from agent.scale import Executor
    from agent.train import load_config, train
    from envs.files import atomic_write_bytes, atomic_write_json, atomic_write_text

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "pretrained"))
    ap.add_argument("--config", default=str(ROOT / "experiments" / "configs" / "pretrained.yaml"))
    ap.add_argument("--resume", action="store_true", help="continue the run after its last finished phase")
    ap.add_argument("--ray", action="store_true", help="run the searches on a local Ray instance")
    ap.add_argument("--ray-address", default=None, help="run the searches on this Ray cluster")
    ap.add_argument("--hours", type=float, default=3.0,
                    help="start no round that would not finish within this much wall clock")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    cfg = load_config(args.config)
    t0 = time.time()
    deadline = time.perf_counter() + args.hours * 3600
    with Executor.from_flags(args.ray, args.ray_address) as ex:
        res = train(cfg, run_dir=args.run_dir, resume=args.resume, progress=not args.no_progress, executor=ex,
                    deadline=deadline, log=lambda m: print(m, flush=True))  # phase lines, also when not on a terminal
    rounds = res.imitation["rounds"]
    print(f"expert iteration: {len(rounds)} round(s), {res.num_timesteps} PPO steps in {time.time() - t0:.0f}s")
    atomic_write_bytes(PRETRAINED, Path(res.model_path).read_bytes(), "shipped policy")
    print(f"shipped {res.model_path} as {PRETRAINED} ({PRETRAINED.stat().st_size / 1e6:.2f} MB)")
    run = Path(args.run_dir)
    state = json.loads((run / "expert_iteration.json").read_text())["finished"]
    shipped = res.imitation.get("selected_round")  # None: no validation tasks, the last round's policy
    evaluation = next((x[3] for x in reversed(state) if x[1] == "evaluate" and shipped in (None, x[0])), {})
    report = {"config": str(Path(args.config).relative_to(ROOT)) if Path(args.config).is_relative_to(ROOT)
              else args.config, "seconds": round(time.time() - t0, 1), "num_timesteps": res.num_timesteps,
              "shipped_round": shipped, "rounds": [{k: v for k, v in r.items() if k != "curves"} for r in rounds],
              "phases": [{"round": r, "phase": p, **{k: v for k, v in s.items() if k != "curves"}}
                                           for r, p, _c, s in state if p not in ("logged", "evaluate")], "holdout": evaluation.get("holdout", [])}
    OUT.mkdir(parents=True, exist_ok=True)
    atomic_write_json(OUT / "report.json", json.loads(json.dumps(report, default=float)), indent=1)
    atomic_write_text(OUT / "report.md", markdown(report))
    ds = run / "dataset"
    if ds.is_dir():
        dest = OUT / "dataset"
        tmp = OUT / ".dataset.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(ds, tmp)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    lines = ["# The shipped policy: expert iteration", "",
             f"`python -m experiments.train_pretrained` ({report['config']}), {report['num_timesteps']} PPO steps; "
             "phase times on this machine (2 cores): "
             + (", ".join(f"round {p['round']} {p['phase']} {p['seconds'] / 60:.1f} min" for p in report["phases"]
                          if p.get("seconds")) or "not recorded") + ".", "",
             "| round | dataset rows | best known vs heuristic | targets vs best known | new targets | "
             "distill CE | agreement | held-out zero-shot geo-mean | min | wins | training tasks zero-shot geo-mean | "
             "validation geo-mean |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(x, spec=".3f"):
        return "" if x is None else (format(x, spec) if isinstance(x, float) else str(x))

    for r in report["rounds"]:
        lines.append(f"| {r['round']} | {r['dataset_rows']} | {f(r['best_vs_heuristic'])} | {f(r['targets_vs_best'])} | "
                     f"{f(r['new_targets'])} | {f(r['distill_loss'])} | {f(r['agreement'], '.1%')} | "
                     f"{f(r['zero_shot_geomean'])} | {f(r['zero_shot_min'])} | {f(r['zero_shot_wins'])}/"
                     f"{f(r['zero_shot_n'])} | {f(r['train_geomean'])} | {f(r.get('validation_geomean'))} |")
    from agent.expert_iteration import INITIAL

    initial = next((p for p in report["phases"] if p["round"] == INITIAL and p["phase"] == "validate"), None)
    if initial is not None and initial.get("geomean") is not None:
        lines += ["", f"Validation geo-mean of the initial policy: {initial['geomean']:.3f}"
                  + (" (a fresh network: the reference line, never shipped)." if not initial.get("given", True) else ".")]
    if report["holdout"]:
        which = "last round" if report.get("shipped_round") is None else f"round {report['shipped_round']}, shipped"
        lines += ["", f"Held-out tasks ({which}): the policy's best of greedy + samples vs the best fast heuristic.",
                  "", "| task | family | heuristic | heuristic ms | policy ms | ratio |", "|---|---|---|---|---|---|"]
        for h in report["holdout"]:
            lines.append(f"| {h['task_id'].split('#')[0]} | {h['family']} | {h['heuristic_name']} | "
                         f"{h['heuristic'] * 1e3:.3f} | {h['policy'] * 1e3:.3f} | {h['ratio']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
