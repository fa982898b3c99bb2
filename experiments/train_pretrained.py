"""Train the policy shipped in ``agent/pretrained/`` and report how it scores.

    python experiments/train_pretrained.py [--steps N] [--run-dir runs/pretrained]

Trains ``experiments/configs/pretrained.yaml`` (imitation warm start, then PPO), picks among the
imitation checkpoint, the PPO checkpoints and the final model the one with the best mean greedy score
on the *training* tasks, copies it (policy and optimizer state, about 2.8 MB) to
``agent/pretrained/placement_policy.zip``, and prints, for every training and
held-out task, the policy's greedy score (log of the reference time over the plan's) and its best
plan (greedy + 4 samples) against the best fast heuristic; the table is also written to
``RUN_DIR/pretrained_report.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    from agent.infer import PRETRAINED, place
    from agent.train import build_tasks, greedy_scores, load_config, train
    from envs.files import atomic_write_bytes, atomic_write_text

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="total timesteps (default: the config's)")
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "pretrained"))
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    cfg = load_config(ROOT / "experiments" / "configs" / "pretrained.yaml")
    t0 = time.time()
    res = train(cfg, run_dir=args.run_dir, total_steps=args.steps, progress=not args.no_progress)
    print(f"trained {res.num_timesteps} steps in {res.seconds:.0f}s -> {res.model_path}")

    from sb3_contrib import MaskablePPO

    # model selection on the *training* tasks only: the imitation checkpoint, every PPO checkpoint and
    # the final model, by mean greedy score (later wins ties); the held-out tasks stay held out
    train_tasks = build_tasks(cfg.raw["tasks"], seed=cfg.seed)
    ckpts = sorted(Path(res.run_dir, "checkpoints").glob("model_*_steps.zip"), key=lambda p: int(p.stem.split("_")[1]))
    selection = []
    for path in ckpts + [res.model_path]:
        mean = float(greedy_scores(MaskablePPO.load(path, device="cpu"), train_tasks, cfg.env).mean())
        selection.append({"model": str(path.name), "mean_greedy_score": round(mean, 4)})
        print(f"  {path.name:28s} mean greedy score on the training tasks {mean:+.4f}")
    pick = max(range(len(selection)), key=lambda i: (selection[i]["mean_greedy_score"], i))
    chosen = (ckpts + [res.model_path])[pick]
    atomic_write_bytes(PRETRAINED, chosen.read_bytes(), "shipped policy")  # never a half-written one
    print(f"shipped {chosen.name} as {PRETRAINED} ({PRETRAINED.stat().st_size / 1e6:.2f} MB)")

    model = MaskablePPO.load(PRETRAINED, device="cpu")
    report = {"steps": res.num_timesteps, "train_seconds": round(res.seconds, 1), "shipped": chosen.name,
              "selection": selection, "tasks": {}}
    for split in ("tasks", "eval_tasks"):
        tasks = build_tasks(cfg.raw[split], seed=cfg.seed)
        scores = greedy_scores(model, tasks, cfg.env)
        for task, s in zip(tasks, scores):
            r = place(task.graph, task.topology, model=model, samples=4, seed=0)
            base = r.best_baseline()
            pol = min((c for c in r.candidates if c.kind == "policy"), key=lambda c: c.key())
            report["tasks"][task.name] = {"split": split, "greedy_score": round(float(s), 4),
                                          "policy_best_ms": round(pol.value * 1e3, 4),
                                          "best_baseline": base.name if base else None,
                                          "baseline_ms": round(base.value * 1e3, 4) if base else None,
                                          "policy_vs_baseline": round(base.value / pol.value, 4) if base else None,
                                          "winner": r.best.name}
    for name, row in report["tasks"].items():
        print(f"{row['split']:10s} {name:32s} greedy score {row['greedy_score']:+.3f}  policy {row['policy_best_ms']:.3f} ms"
              f"  baseline {row['best_baseline']} {row['baseline_ms']} ms  x{row['policy_vs_baseline']}")
    out = Path(args.run_dir) / "pretrained_report.json"
    atomic_write_text(out, json.dumps(report, indent=2), "report")
    print(f"report: {out} (total {time.time() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
