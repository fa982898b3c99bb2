"""`rlplace profile`: trace a model into an OpGraph JSON (and optionally measure and calibrate)."""

from __future__ import annotations

from pathlib import Path

import typer

from envs.errors import RlplaceError


class ProfileArgsError(RlplaceError):
    """Bad arguments to `rlplace profile`."""


def _shape(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        shape = tuple(int(x) for x in text.replace("x", ",").split(",") if x.strip())
    except ValueError as exc:
        raise ProfileArgsError(f"--input-shape must be integers separated by commas, got {text!r}") from exc
    if not shape or any(s < 1 for s in shape):
        raise ProfileArgsError(f"--input-shape must be positive integers, got {text!r}")
    return shape


def profile(
    model: str = typer.Option(..., "--model", "-m", help=(
        "zoo spec (e.g. gpt:layers=24,hidden=2048,heads=16,seq=2048,batch=8; families: mlp, resnet, "
        "inception, gnmt, gpt, bert, moe, unet, vit, llama, t5, dlrm, twotower, convnext, diffusion), "
        "hf:NAME[:key=value,...], or path/to/file.py:build_fn[:knob=value,...]. A file spec EXECUTES that "
        "file: build_fn(**knobs) runs under torch.device('meta') and returns (module, example_inputs) or a "
        "module (then give --input-shape).")),
    input_shape: str | None = typer.Option(None, "--input-shape", help="example input shape for a file "
                                           "spec, e.g. 8,3,224,224 (a float tensor)"),
    batch: int | None = typer.Option(None, "--batch", min=1, help="batch size (zoo: overrides the batch "
                                     "knob; file: the batch the inputs hold, default their first dim)"),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16, fp16, fp32 or tf32"),
    measure: bool = typer.Option(False, "--measure", help="also time every op on this host's CPU (CUDA "
                                 "with --device cuda), attach the times, and calibrate the cpu-local "
                                 "topology (~/.rlplace/topologies/cpu-local.json, or $RLPLACE_HOME)"),
    device: str = typer.Option("cpu", "--device", help="device for --measure"),
    repeats: int = typer.Option(5, "--repeats", min=1, max=10_000, help="timed runs per op for --measure (median)"),
    no_link: bool = typer.Option(False, "--no-link", help="with --measure: skip the process-to-process "
                                 "copy benchmark (keep default link numbers)"),
    output: Path | None = typer.Option(None, "--output", "-o", help="write the graph JSON here"),
) -> None:
    """Trace a model on the meta device into an OpGraph; print a summary and write the JSON.

    A file spec (path/to/file.py:build_fn) executes that Python file: only profile files you trust."""
    from profilers.spec import build_model, graph_from_spec
    from profilers.trace import DTYPES

    if dtype not in DTYPES:
        raise ProfileArgsError(f"unknown --dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    shape = _shape(input_shape)
    if output is not None:
        from envs.files import check_output_path

        check_output_path(output, "graph")
    if shape is not None and ".py:" not in model:
        raise ProfileArgsError("--input-shape applies to file specs (path/to/file.py:build_fn) only")
    graph = graph_from_spec(model, dtype=dtype, input_shape=shape, batch=batch)
    if measure:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from profilers.calibration import calibrate_cpu_local, fit_device
        from profilers.calibration import measure as measure_ops

        module, inputs, b = build_model(model, input_shape=shape, batch=batch)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), transient=True) as bar:
            task = bar.add_task(f"timing ops on {device}", total=graph.num_nodes)
            graph = measure_ops(module, inputs, batch_size=b, dtype=dtype, device=device, repeats=repeats,
                                name=model, progress=lambda i, n: bar.update(task, completed=i, total=n))
            kind = next(iter(graph.measured))
            fit = fit_device(graph, kind)
            typer.echo(f"measured on {kind}: fwd {graph.measured[kind]['fwd'].sum() * 1e3:.3f} ms, "
                       f"bwd {graph.measured[kind]['bwd'].sum() * 1e3:.3f} ms; fit "
                       f"{fit.flops / 1e9:.1f} GFLOP/s, {fit.bandwidth / 1e9:.1f} GB/s, "
                       f"{fit.overhead * 1e6:.1f} us/op (median error {fit.rel_error:.0%})")
            if device == "cpu":
                task2 = bar.add_task("calibrating cpu-local", total=None)
                topo, _, path = calibrate_cpu_local(dtype="fp32", link=not no_link, repeats=repeats,
                                                    progress=lambda i, n: bar.update(task2, completed=i,
                                                                                     total=n))
                d = topo.devices[0]
                typer.echo(f"calibrated cpu-local ({topo.num_devices} devices): "
                           f"{d.peak_flops['fp32'] / 1e9:.1f} GFLOP/s fp32, {d.mem_bw / 1e9:.1f} GB/s, "
                           f"{d.launch_overhead * 1e6:.1f} us/op, link "
                           f"{topo.links[0].bandwidth / 1e9:.2f} GB/s {topo.links[0].latency * 1e6:.0f} us "
                           f"-> {path}")
    typer.echo(graph.summary())
    typer.echo(f"params: {graph.param_bytes.sum() / _dtype_bytes(dtype):,.0f} "
               f"({graph.param_bytes.sum() / 2**20:.2f} MiB at {dtype}, buffers included); "
               f"fwd {graph.fwd_flops.sum() / 1e9:.3f} GFLOP, bwd {graph.bwd_flops.sum() / 1e9:.3f} GFLOP")
    if output is not None:
        graph.save(output)
        typer.echo(f"wrote {output}")


def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype in ("fp32", "tf32") else 2


def register(app: typer.Typer) -> None:
    app.command("profile")(profile)
