"""`rlplace run plan.json --model SPEC`: execute a plan's training step for real and measure it."""

from __future__ import annotations

import os

import typer
from rich.console import Console
from rich.table import Table

from agent.report import format_time
from envs.files import finite_json


def run_cmd(
    plan: str = typer.Argument(..., help="plan JSON file (made for the graph of --model)"),
    model: str = typer.Option(..., "--model", "-m", help="model spec, e.g. gpt:layers=2,hidden=64 or file.py:build_fn"),
    steps: int = typer.Option(5, "--steps", min=1, max=100_000, help="timed training steps"),
    warmup: int = typer.Option(1, "--warmup", min=0, max=100_000, help="untimed warm-up steps before them"),
    backend: str = typer.Option(None, "--backend", help="gloo (CPU) or nccl (CUDA); default nccl if CUDA is present"),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32, bf16 or fp16 (the reference check is tightest in fp32)"),
    seed: int = typer.Option(0, "--seed", help="seed of the weights and the synthetic data"),
    timeout: float = typer.Option(300.0, "--timeout", min=1.0, max=7 * 86_400.0,
                                  help="seconds the local workers may run in all"),
    no_check: bool = typer.Option(False, "--no-check", help="skip the single-process reference loss check"),
    check_steps: int = typer.Option(2, "--check-steps", min=0,
                                    help="steps whose loss must match the reference (0: all)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
    record: str = typer.Option(None, "--record", help="append the measurement (model, plan, step times, memory) "
                               "as one JSON line to this file, for `rlplace calibrate --measurements FILE`"),
) -> None:
    """Run WARMUP + STEPS training steps of the plan with torch.distributed (local workers, or this rank
    under torchrun); report the median step time, peak memory per rank and the loss against a
    single-process reference. Exit 1 when the loss does not match or a worker fails, 2 on bad input."""
    from profilers.execute import execute_plan
    from profilers.execution_layout import WorkerError

    if record:
        from envs.files import check_output_path

        check_output_path(record, "record file")
    try:
        report = execute_plan(plan, model, steps, warmup=warmup, backend=backend, seed=seed, dtype=dtype,
                              check=not no_check, check_steps=check_steps, timeout_s=timeout)
    except WorkerError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise SystemExit(1) from None
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun only rank 0 reports
        return
    if record:
        append_record(record, model, plan, dtype, report)
    if as_json:
        typer.echo(finite_json(report.to_dict(), indent=2))
    else:
        con = Console(width=160)
        con.print(f"[bold]{model}[/bold]: pp={report.pp} dp={report.dp} tp={report.tp}, "
                  f"{report.microbatches} microbatch(es)" + (f", {report.schedule}" if report.pp > 1 else "")
                  + f", {report.backend}, {len(report.step_times)} timed step(s) after {report.warmup} warm-up")
        t = Table()
        for c in ("median step", "min step", "max step", "peak memory / rank", "loss", "reference", "match"):
            t.add_column(c)
        mem = ", ".join(f"{m / 2**20:.0f} MiB" for m in report.peak_memory_per_rank)
        ref = "-" if report.reference_loss is None else f"{report.reference_loss:.6g}"
        match = {None: "-", True: "yes", False: "NO"}[report.loss_matches]
        t.add_row(format_time(report.median_step_time_s), format_time(min(report.step_times)),
                  format_time(max(report.step_times)), mem, f"{report.loss:.6g}", ref, match)
        con.print(t)
    if report.loss_matches is False:
        typer.echo("error: the loss does not match the single-process reference", err=True)
        raise SystemExit(1)


def append_record(path: str, model: str, plan_path: str, dtype: str, report) -> None:
    """Append one measurement as a JSON line (flushed to disk; a line is written whole or not at all)."""
    from envs.plan import Plan

    line = finite_json({"model": model, "dtype": dtype, "plan": Plan.load(plan_path).to_dict(),
                        "median_step_time_s": report.median_step_time_s, "step_times_s": report.step_times,
                        "peak_memory_per_rank": report.peak_memory_per_rank, "memory_kind": report.memory_kind,
                        "tp": report.tp, "pp": report.pp, "dp": report.dp, "backend": report.backend}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def register(app: typer.Typer) -> None:
    app.command("run")(run_cmd)
