"""`rlplace train --config experiments/configs/NAME.yaml`: PPO over a distribution of placement tasks."""

from __future__ import annotations

import typer

EXIT_INTERRUPTED = 130  # as agent.cli: Ctrl-C


def train_cmd(
    config: str = typer.Option(..., "--config", "-c", help="training config yaml (see experiments/configs/)"),
    resume: bool = typer.Option(False, "--resume", help="continue the run in --run-dir (same step counter and curves)"),
    total_steps: int = typer.Option(None, "--total-steps", min=1,
                                    help="step counter to reach (default: the config's)"),
    run_dir: str = typer.Option(None, "--run-dir", help="run directory (default: runs/NAME)"),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="show a progress bar"),
    init: str = typer.Option(None, "--init", help="start from this policy's weights (e.g. the shipped "
                                                  "agent/pretrained/placement_policy.zip); its network must "
                                                  "have the config's shapes"),
    max_minutes: float = typer.Option(None, "--max-minutes", min=0.01, max=10_000_000.0,
                                      help="stop training after this much wall clock (PPO stops at the next "
                                           "step; expert iteration starts no new round)"),
    ray: bool = typer.Option(False, "--ray", help="expert iteration: run the searches on a local Ray instance"),
    ray_address: str = typer.Option(None, "--ray-address", help="expert iteration: run the searches on the Ray "
                                                                 "cluster at HOST:PORT"),
) -> None:
    """Train a graph-neural MaskablePPO placement policy; logs to TensorBoard under the run directory.
    Ctrl-C saves a resumable checkpoint and says how to resume (exit code 130)."""
    import time

    from agent.scale import Executor
    from agent.train import TrainingInterrupted, load_config, train

    cfg = load_config(config)  # a bad config is one line before Ray starts
    deadline = None if max_minutes is None else time.perf_counter() + 60.0 * max_minutes
    try:
        with Executor.from_flags(ray, ray_address) as ex:
            res = train(cfg, run_dir=run_dir, total_steps=total_steps, resume=resume, progress=progress,
                        log=typer.echo, init_weights=init, deadline=deadline, executor=ex)
    except TrainingInterrupted as exc:  # one line: where the checkpoint is and how to resume
        typer.echo(str(exc), err=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    typer.echo(f"trained to step {res.num_timesteps} in {res.seconds:.0f}s; model: {res.model_path}")
    for name, b in sorted(res.best.items()):
        h = b.get("heuristic") or {}
        vs = f", x{h['step_time'] / b['step_time']:.2f} vs {h['placer']}" if h else ""
        typer.echo(f"  {name}: best {b['step_time'] * 1e3:.3f} ms (x{b['speedup']:.2f} vs ref{vs})"
                   f"{' OOM' if b['oom'] else ''}")
    typer.echo(f"TensorBoard: tensorboard --logdir {res.run_dir}")


def register(app: typer.Typer) -> None:
    app.command("train")(train_cmd)
