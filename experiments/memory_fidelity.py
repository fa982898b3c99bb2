"""Memory fidelity: the simulator's predicted peak memory per device vs what a real run of the plan uses.

``python -m experiments.memory_fidelity [--out experiments/results/memory_fidelity]``

For zoo models of tens to hundreds of MB (an MLP and a GPT) on ``cpu-local`` (2 devices) it runs every
plan of ``experiments.fidelity.candidate_plans`` the executor accepts with ``profilers.execute.
execute_plan`` (what ``rlplace run`` runs: gloo ranks, fp32, SGD; the measured memory is each rank's
peak bytes of live tensors over one step, ``profilers.tensor_memory``, CPU's counterpart of
``torch.cuda.max_memory_allocated``) and compares it with ``envs.sim.simulate(...).peak_memory`` of
the same plan (model states of 8 bytes per parameter: fp32 weights and gradients, SGD without
momentum). Reports per (plan, device): measured, predicted, the ratio; overall MAPE, the mean ratio,
the worst factor and how often the prediction is below the measurement ("it said it fits and it
OOMed"), and a plot (``memory_fidelity.png``). Outputs are written atomically.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from envs.files import atomic_write_json, atomic_write_text
from envs.gantt import save_figure

MODELS = ["mlp:layers=4,hidden=1024,in_dim=512,out=64,batch=64",
          "gpt:layers=2,hidden=256,heads=4,seq=64,vocab=2048,batch=8"]


def run(out: str | os.PathLike = "experiments/results/memory_fidelity", models: list[str] | None = None,
        log=print) -> dict[str, Any]:
    from envs.sim import simulate
    from experiments.fidelity import candidate_plans, default_topology
    from profilers.execute import ExecutionError, execute_plan, prepare
    from profilers.spec import graph_from_spec

    t0 = time.time()
    topo = default_topology(2)
    rows: list[dict[str, Any]] = []
    refused: list[dict[str, str]] = []
    for spec in models or MODELS:
        g = graph_from_spec(spec, dtype="fp32")
        for label, plan in candidate_plans(g, topo):
            try:
                _, lay, _ = prepare(plan, spec, g)
            except ExecutionError as exc:
                refused.append({"model": spec, "plan": label, "reason": str(exc)[:200]})
                continue
            rep = execute_plan(plan, spec, steps=1, warmup=0, check=False, graph=g)
            sim = simulate(g, topo, plan, "step_time", timeline=False)
            measured = np.zeros(topo.num_devices)
            for rank, mem in enumerate(rep.peak_memory_per_rank):
                d = lay.plan_device(rank)
                measured[d] = max(measured[d], mem)
            for d in np.flatnonzero(measured > 0).tolist():
                rows.append({"model": spec, "plan": label, "device": d, "measured_bytes": float(measured[d]),
                             "predicted_bytes": float(sim.peak_memory[d])})
            log(f"{spec[:28]:28s} {label:26s} " + "  ".join(
                f"dev{r['device']}: {r['measured_bytes'] / 2**20:7.1f} MiB measured, "
                f"{r['predicted_bytes'] / 2**20:7.1f} predicted" for r in rows if r["plan"] == label
                and r["model"] == spec) + f"  ({time.time() - t0:.0f} s)")
    report = {"command": "python -m experiments.memory_fidelity", "models": models or MODELS, "rows": rows,
              "refused": refused, "metrics": metrics(rows), "seconds": time.time() - t0}
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(outdir / "results.json", report)
    atomic_write_text(outdir / "results.md", markdown(report))
    plot(outdir / "memory_fidelity.png", rows)
    log(markdown(report))
    return report


def metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    p = np.array([r["predicted_bytes"] for r in rows])
    m = np.array([r["measured_bytes"] for r in rows])
    if m.size == 0:
        return {"n": 0}
    r = p / m
    return {"n": int(m.size), "plans": len({(x["model"], x["plan"]) for x in rows}),
            "mape": float(np.mean(np.abs(r - 1))), "mean_ratio": float(np.mean(r)),
            "max_factor": float(np.max(np.maximum(r, 1 / r))), "under_predicted": float(np.mean(r < 1)),
            "under_by_more_than_10pct": float(np.mean(r < 0.9))}


def markdown(rep: dict[str, Any]) -> str:
    m = rep["metrics"]
    lines = ["# Memory fidelity on cpu-local (predicted vs measured peak bytes per device)", "",
             f"`{rep['command']}` ({rep['seconds']:.0f} s). Measured: peak bytes of live tensors of each rank "
             "over one training step (`profilers.tensor_memory`).", ""]
    if m.get("n"):
        lines += [f"{m['plans']} plans, {m['n']} (plan, device) pairs: MAPE {m['mape']:.1%}, mean predicted/measured "
                  f"{m['mean_ratio']:.3f}, worst factor {m['max_factor']:.2f}; under-predicted on "
                  f"{m['under_predicted']:.0%} of devices, by more than 10% on {m['under_by_more_than_10pct']:.0%}.", ""]
    lines += ["| model | plan | device | measured MiB | predicted MiB | ratio |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['plan']} | {r['device']} | {r['measured_bytes'] / 2**20:.1f} | "
              f"{r['predicted_bytes'] / 2**20:.1f} | {r['predicted_bytes'] / r['measured_bytes']:.2f} |"
              for r in rep["rows"]]
    return "\n".join(lines) + "\n"


def plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for model in dict.fromkeys(r["model"] for r in rows):
        sel = [r for r in rows if r["model"] == model]
        ax.scatter([r["measured_bytes"] / 2**20 for r in sel], [r["predicted_bytes"] / 2**20 for r in sel], s=16,
                   label=model.split(":")[0])
    vals = [r[k] / 2**20 for r in rows for k in ("measured_bytes", "predicted_bytes")] or [1.0]
    lo, hi = min(vals) * 0.8, max(vals) * 1.25
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured peak (MiB)")
    ax.set_ylabel("predicted peak (MiB)")
    ax.set_title("peak memory per device")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="experiments/results/memory_fidelity")
    run(ap.parse_args(argv).out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
