"""The demo: a small policy trained on a default distribution, then used on a held-out model.

:func:`run_demo` trains ``experiments/configs/demo.yaml`` (built-in GPT, MLP and CNN graphs on two
topologies; TensorBoard logs under ``OUT/demo/tb``), places ``model`` (default ``gpt-medium``,
which is not in the training set) with the trained policy, prints the comparison with the heuristic
baselines, and writes ``OUT/demo_plan.json`` and its Gantt chart ``OUT/demo_plan.png``. The config is
read from the checkout's ``experiments/configs/`` (:mod:`agent.checkout`; ``pip install -e .`` keeps it
there): without it the demo stops at once with a one-line :class:`agent.train.TrainError` saying where
it looked.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

DEMO_CONFIG = "demo"  # experiments/configs/demo.yaml of the checkout (agent.checkout)


def run_demo(steps: int | None = None, out: str | Path = "runs", model: str = "gpt-medium",
             topology: str = "dgx-a100-80g", progress: bool = True, samples: int = 8,
             echo: Callable[[str], None] = print) -> dict:
    """Run the demo; returns paths and the winner (see the module docstring)."""
    from rich.console import Console

    from agent.checkout import CONFIGS_DIR, experiments_file
    from agent.infer import place, resolve_model
    from agent.report import print_comparison, winner_timeline
    from agent.train import TrainError, load_config, train
    from envs.files import check_output_dir
    from envs.gantt import save_gantt
    from envs.presets import resolve_topology

    out = check_output_dir(out, "output folder")
    cfg = load_config(experiments_file(CONFIGS_DIR, DEMO_CONFIG, "training config", TrainError, path_allowed=False))
    g = resolve_model(model)  # bad names fail now, not after training
    topo = resolve_topology(topology)
    echo(f"[1/3] training a small placement policy on {', '.join(cfg.raw['tasks']['builtin'])} "
         f"x {', '.join(cfg.raw['tasks']['topologies'])}")
    res = train(cfg, run_dir=out / "demo", total_steps=steps, progress=progress, log=echo)
    echo(f"      {res.num_timesteps} steps in {res.seconds:.0f}s")
    echo(f"[2/3] placing held-out model {g.name} on {topo.name}")
    from sb3_contrib import MaskablePPO

    policy = MaskablePPO.load(res.model_path, device="cpu")
    pr = place(g, topo, model=policy, samples=samples, seed=0)
    print_comparison(pr, "step_time", title=f"{g.name} on {topo.name}", console=Console(width=140))
    plan_path = out / "demo_plan.json"
    pr.plan.save(plan_path)
    png = save_gantt(winner_timeline(pr, g, topo, "step_time"), out / "demo_plan.png",
                     title=f"{g.name} on {topo.name}: {pr.best.name}")
    base = pr.best_baseline()
    pol = min((c for c in pr.candidates if c.kind == "policy"), key=lambda c: c.key(), default=None)
    if pol is not None and base is not None:
        echo(f"      policy's best plan: {pol.value * 1e3:.3f} ms; best baseline ({base.name}): "
             f"{base.value * 1e3:.3f} ms; returned: {pr.best.name}")
    echo(f"[3/3] plan: {plan_path}  Gantt chart: {png}")
    echo(f"      see the training curves with: tensorboard --logdir {out}")
    return {"run_dir": res.run_dir, "plan": plan_path, "gantt": png, "winner": pr.best.name,
            "steps": res.num_timesteps}


__all__ = ["run_demo", "DEMO_CONFIG"]
