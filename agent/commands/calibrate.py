"""`rlplace calibrate --measurements FILE --topology NAME|FILE -o calibrated.json`: fit a topology's cost
parameters to measured step times; report held-out errors, a predicted-vs-measured plot and the errors
per group."""

from __future__ import annotations

from pathlib import Path

import typer


def calibrate_cmd(
    measurements: str = typer.Option(..., "--measurements", "-m", help="CSV of runs in the data set's columns "
                                     "(# GPUs, global batch, micro batch, hidden size, ...), or the JSON lines of "
                                     "`rlplace run --record`"),
    topology: str = typer.Option("dgx-a100-80g", "--topology", "-t", help="the topology to calibrate (preset or file)"),
    output: str = typer.Option(..., "--output", "-o", help="where to write the calibrated topology (JSON)"),
    report: str = typer.Option(None, "--report", help="folder for calibration.md, calibration.csv and "
                               "calibration.png (default: next to the output)"),
    params: str = typer.Option(None, "--params", help="comma-separated parameters to fit (default: "
                               "compute_eff, host, collective, transfer and sync overheads)"),
    holdout_fraction: float = typer.Option(0.3, "--holdout-fraction", min=0.0, max=0.9,
                                           help="share of rows whose models are held out of the fit"),
    holdout_models: str = typer.Option(None, "--holdout-models", help="comma-separated models to hold out "
                                       "(e.g. h2048-L24) instead of a random share"),
    max_rows: int = typer.Option(400, "--max-rows", min=1, help="rows the fit simulates (a random subset)"),
    max_evaluations: int = typer.Option(60, "--max-evaluations", min=2, help="simulations of the fit rows"),
    vocab: int = typer.Option(50257, "--vocab", min=1, help="CSV rows: vocabulary of the GPT models"),
    recompute: str = typer.Option("full", "--recompute", help="CSV rows: recomputation the runs used (none or full)"),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Calibrate a topology on measured step times (see rlplace calibrate --help)."""
    from envs.files import atomic_output, atomic_write_text, check_output_dir, check_output_path
    from envs.presets import resolve_topology
    from profilers import step_calibration as sc

    if recompute not in ("none", "full"):
        raise sc.CalibrationError(f"--recompute must be none or full, got {recompute!r}")
    out = check_output_path(output, "calibrated topology")
    folder = check_output_dir(report if report else out.parent, "report folder")
    fit_params = [p if p.startswith(("device.", "link.")) else f"device.{p}"
                  for p in (params.split(",") if params else sc.DEFAULT_FIT)]
    bad = [p for p in fit_params if p not in sc.PARAMETERS]
    if bad:
        raise sc.CalibrationError(f"unknown parameter {bad[0]!r}; choose from {', '.join(sc.PARAMETERS)}")
    base = resolve_topology(topology)
    if Path(measurements).suffix.lower() in (".jsonl", ".json"):
        samples = sc.samples_from_runs(measurements)
    else:
        samples = sc.samples_from_csv(measurements, base, vocab=vocab, recompute=recompute)
    sc.check_samples(samples, base)
    holdout = holdout_models.split(",") if holdout_models else None
    if holdout is None and holdout_fraction == 0:
        fit_set, held = list(samples), []
    else:
        fit_set, held = sc.split_by_model(samples, holdout_fraction, seed, holdout)
    typer.echo(f"{len(samples)} measurements of {len({s.model for s in samples})} models; fitting "
               f"{', '.join(fit_params)} on {len(fit_set)} rows ({min(len(fit_set), max_rows)} simulated), "
               f"{len(held)} held out")
    res = sc.fit(fit_set, base, fit_params, max_rows=max_rows, seed=seed, max_nfev=max_evaluations, log=typer.echo)
    fit_pred = sc.predict(fit_set, res.topology)
    held_pred = sc.predict(held, res.topology) if held else fit_pred[:0]
    fit_m = sc.metrics(fit_pred, [s.measured for s in fit_set], [s.model for s in fit_set])
    held_m = sc.metrics(held_pred, [s.measured for s in held], [s.model for s in held]) if held else {"n": 0}
    table = sc.error_table(held if held else fit_set, held_pred if held else fit_pred)
    sources = (f"Fitted by `rlplace calibrate` on `{measurements}` ({len(fit_set)} rows; held out: "
               f"{', '.join(sorted({s.model for s in held})) or 'none'}); base topology `{base.name}`.")
    res.topology.meta.update({"calibration_source": str(measurements), "held_out": held_m, "fit": fit_m})
    csv_rows = ["model,tp,pp,dp,micro,split,measured_s,predicted_s"]
    for split, ss, pp in (("fit", fit_set, fit_pred), ("held_out", held, held_pred)):
        for s, p in zip(ss, pp):
            c = s.config
            csv_rows.append(f"{s.model},{c.get('tp', '')},{c.get('pp', '')},{c.get('dp', '')},{c.get('micro', '')},"
                            f"{split},{s.measured:.6g},{float(p):.6g}")
    with atomic_output(folder / "calibration.png", "plot") as png:
        sc.plot(png, fit_set, fit_pred, held, held_pred, f"{base.name} calibrated: held-out MAPE "
                f"{held_m.get('mape', fit_m['mape']):.1%}")
        atomic_write_text(folder / "calibration.csv", "\n".join(csv_rows) + "\n")
        atomic_write_text(folder / "calibration.md", sc.markdown_report(base.name, res.values, fit_m, held_m, table,
                                                                        sources))
        res.topology.save(out)
    for k, v in res.values.items():
        typer.echo(f"  {k} = {v:.4g}")
    for name, m in (("fit", fit_m), ("held out", held_m)):
        if m.get("n"):
            typer.echo(f"{name}: {m['n']} rows, MAPE {m['mape']:.1%}, mean ratio {m['mean_ratio']:.3f}, Spearman "
                       f"{m['spearman']:.3f} (within models >= {m.get('spearman_within_min', float('nan')):.3f}), "
                       f"worst x{m['max_factor']:.2f}")
    typer.echo(f"calibrated topology: {out}; report: {folder}/calibration.md, calibration.csv, calibration.png")


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate_cmd)
