"""Train the policy shipped in ``agent/pretrained/`` and report how it scores.

    python experiments/train_pretrained.py [--steps N] [--run-dir runs/pretrained]

Trains ``experiments/configs/pretrained.yaml``, copies the final model zip (policy and optimizer
state, about 2.7 MB) to ``agent/pretrained/placement_policy.zip``, and prints, for every training and
held-out task, the policy's greedy score (log of the reference time over the plan's) and its best
plan (greedy + 4 samples) against the best fast heuristic; the table is also written to
``RUN_DIR/pretrained_report.json``.
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


def main(argv: list[str] | None = None) -> int:
    from agent.infer import PRETRAINED, place
    from agent.train import build_tasks, greedy_scores, load_config, train

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="total timesteps (default: the config's)")
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "pretrained"))
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    cfg = load_config(ROOT / "experiments" / "configs" / "pretrained.yaml")
    t0 = time.time()
    res = train(cfg, run_dir=args.run_dir, total_steps=args.steps, progress=not args.no_progress)
    print(f"trained {res.num_timesteps} steps in {res.seconds:.0f}s -> {res.model_path}")
    PRETRAINED.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(res.model_path, PRETRAINED)
    print(f"shipped {PRETRAINED} ({PRETRAINED.stat().st_size / 1e6:.2f} MB)")

    from sb3_contrib import MaskablePPO

    model = MaskablePPO.load(PRETRAINED, device="cpu")
    report = {"steps": res.num_timesteps, "train_seconds": round(res.seconds, 1), "tasks": {}}
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
    out.write_text(json.dumps(report, indent=2))
    print(f"report: {out} (total {time.time() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
