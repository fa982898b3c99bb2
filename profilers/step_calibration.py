"""Calibrate a topology's cost parameters to measured step times (what ``rlplace calibrate`` runs).

Measurements are :class:`Sample` s — a graph, a plan and its measured step time — read from a CSV of
Megatron-style runs in the columns of the given data set (``# GPUs, global batch, micro batch, hidden
size, attention heads, # layers, sequence length, tensor parallelism, data parallelism, pipeline
parallelism, iteration time (ms)``: each row becomes ``envs.examples.transformer_graph`` under
``envs.plan.megatron_plan``) or from the JSON lines ``rlplace run --record FILE`` appends (model spec,
plan, measured median step time).

:func:`fit` changes a topology's *parameters* (:data:`PARAMETERS`: device efficiencies and overheads,
link efficiency and latency), never the simulator's laws: bounded least squares on the log error
``log(simulated / measured)`` (``scipy.optimize.least_squares``, parameters in log space so one step
is a few percent of each whatever its unit), on a subset of the rows. :func:`split_by_model` holds whole
models out of the fit (a model size never seen), :func:`metrics` reports MAPE, the mean ratio,
Spearman's rank correlation overall and within each model, and the worst factor off;
:func:`error_table` the errors per group (model, tp, pp, dp, micro-batch).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from envs.errors import RlplaceError
from envs.graph import OpGraph
from envs.plan import Plan
from envs.topology import Device, Link, Topology

CSV_COLUMNS = ("# GPUs", "global batch", "micro batch", "hidden size", "attention heads", "# layers",
               "sequence length", "tensor parallelism", "data parallelism", "pipeline parallelism",
               "iteration time (ms)")


class CalibrationError(RlplaceError):
    """Measurements or a calibration request are unusable (missing columns, non-positive times, plans
    the topology cannot hold, unknown parameters)."""


# ---------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class Param:
    """A fittable parameter: where it lives in a topology and its physical range."""

    name: str
    lo: float
    hi: float
    doc: str

    @property
    def is_time(self) -> bool:
        """Seconds (an overhead or a latency) rather than a rate or a fraction."""
        return self.name.endswith(("overhead", "latency"))

    def read(self, topo: Topology) -> float:
        kind, _, attr = self.name.partition(".")
        if kind == "device":
            return float(getattr(topo.devices[0], attr)) if attr != "peak_flops" else \
                float(max(topo.devices[0].peak_flops.values()))
        links = [ln for ln in topo.links]
        return float(np.median([getattr(ln, attr) for ln in links])) if links else 1.0


PARAMETERS: dict[str, Param] = {p.name: p for p in (
    Param("device.compute_eff", 0.05, 1.0, "achieved fraction of the peak FLOP/s on large GEMMs"),
    Param("device.mem_eff", 0.05, 1.0, "achieved fraction of the memory bandwidth"),
    Param("device.launch_overhead", 1e-7, 1e-3, "device time per kernel (s)"),
    Param("device.host_overhead", 1e-7, 1e-2, "host time to issue one kernel (s)"),
    Param("device.comm_overhead", 1e-7, 1e-2, "host time to issue one collective (s)"),
    Param("device.p2p_overhead", 1e-7, 1e-1, "host time per point-to-point transfer (s)"),
    Param("device.sync_overhead", 1e-8, 1e-2, "host time a collective adds per further rank (s)"),
    Param("device.recompute_overhead", 1e-7, 1e-1, "time a recomputed checkpoint region adds (s)"),
    Param("device.peak_flops", 1e6, 1e17, "peak FLOP/s, every dtype (for devices without a datasheet)"),
    Param("device.mem_bw", 1e6, 1e14, "memory bandwidth (bytes/s)"),
    Param("link.efficiency", 0.01, 1.0, "achieved fraction of every link's bandwidth"),
    Param("link.latency", 1e-8, 1e-2, "latency of every link hop (s)"),
    Param("link.bandwidth", 1e5, 1e13, "bandwidth of every link (bytes/s; for links without a datasheet)"),
)}
DEFAULT_FIT = ("device.compute_eff", "device.host_overhead", "device.comm_overhead", "device.p2p_overhead",
               "device.sync_overhead", "link.efficiency")
# for devices without a datasheet (a CPU core, an unknown accelerator): the rates themselves
ABSOLUTE_FIT = ("device.peak_flops", "device.mem_bw", "device.launch_overhead", "device.recompute_overhead",
                "link.latency", "link.bandwidth")


def with_parameters(base: Topology, values: dict[str, float], *, name: str | None = None,
                    meta: dict | None = None) -> Topology:
    """``base`` with every device and link carrying ``values`` (names of :data:`PARAMETERS`)."""
    dev_set, link_set = {}, {}
    for key, v in values.items():
        if key not in PARAMETERS:
            raise CalibrationError(f"unknown parameter {key!r}; choose from {', '.join(PARAMETERS)}")
        kind, _, attr = key.partition(".")
        (dev_set if kind == "device" else link_set)[attr] = float(v)
    devices = []
    for d in base.devices:
        fields = dict(d.__dict__)
        for attr, v in dev_set.items():
            if attr == "peak_flops":
                fields["peak_flops"] = {k: v for k in d.peak_flops}
            else:
                fields[attr] = v
        devices.append(Device(**fields))
    links = [Link(**{**ln.__dict__, **link_set}) for ln in base.links]
    return Topology(devices, links, list(base.switches), name=name or base.name, meta={**base.meta, **(meta or {})})


# ---------------------------------------------------------------------- measurements
@dataclass
class Sample:
    """One plan with its measured step time (seconds); ``model`` groups the rows of one model (the
    held-out split keeps them together); ``config`` is what the error table groups by."""

    graph: OpGraph
    plan: Plan
    measured: float
    model: str = ""
    config: dict = field(default_factory=dict)


def _read_csv(path: str | os.PathLike) -> list[dict[str, str]]:
    from envs.files import read_text

    text = read_text(path, "measurements CSV", CalibrationError)
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows:
        raise CalibrationError(f"{path}: no rows")
    missing = [c for c in CSV_COLUMNS if c not in rows[0]]
    if missing:
        raise CalibrationError(f"{path}: missing column(s) {', '.join(repr(c) for c in missing)}; "
                               f"expected {', '.join(CSV_COLUMNS)}")
    return rows


def samples_from_csv(path: str | os.PathLike, topology: Topology, *, vocab: int = 50257, recompute: str = "full",
                     schedule: str = "1f1b", dtype: str = "bf16") -> list[Sample]:
    """The rows of a Megatron-runs CSV as samples (see the module docstring); every row is checked
    (positive integers and times, tp x pp x dp = GPUs within the topology, divisible batches)."""
    from envs.errors import PlanError
    from envs.examples import transformer_graph
    from envs.plan import megatron_plan

    graphs: dict[tuple, OpGraph] = {}
    out = []
    for i, row in enumerate(_read_csv(path), start=2):
        where = f"{path}: line {i}"
        try:
            vals = {c: float(row[c]) for c in CSV_COLUMNS}
        except (TypeError, ValueError):
            raise CalibrationError(f"{where}: every column must be a number") from None
        if not all(math.isfinite(v) and v > 0 for v in vals.values()):
            raise CalibrationError(f"{where}: values must be positive and finite (a time of {vals[CSV_COLUMNS[-1]]})")
        ints = {c: int(v) for c, v in vals.items() if c != CSV_COLUMNS[-1]}
        if any(ints[c] != vals[c] for c in ints):
            raise CalibrationError(f"{where}: counts and sizes must be integers")
        gpus, gb, mb, h, a, L, s, tp, dp, pp = (ints[c] for c in CSV_COLUMNS[:-1])
        if tp * dp * pp != gpus:
            raise CalibrationError(f"{where}: tp x dp x pp = {tp * dp * pp} but the row says {gpus} GPUs")
        if gpus > topology.num_devices:
            raise CalibrationError(f"{where}: {gpus} GPUs, the topology {topology.name!r} has {topology.num_devices}")
        key = (L, h, a, s, gb)
        if key not in graphs:
            graphs[key] = transformer_graph(layers=L, hidden=h, heads=a, seq=s, vocab=vocab, batch=gb, dtype=dtype,
                                            name=f"gpt-h{h}-l{L}-s{s}-b{gb}")
        g = graphs[key]
        try:
            plan = megatron_plan(g, topology, tp=tp, pp=pp, dp=dp, microbatch_size=mb, global_batch=gb,
                                 schedule=schedule, recompute=recompute, dtype=dtype)
        except PlanError as exc:
            raise CalibrationError(f"{where}: {exc}") from None
        out.append(Sample(g, plan, vals[CSV_COLUMNS[-1]] / 1e3, model=f"h{h}-L{L}",
                          config={"model": f"h{h}-L{L}", "tp": tp, "pp": pp, "dp": dp, "micro": mb}))
    return out


def samples_from_runs(path: str | os.PathLike) -> list[Sample]:
    """The JSON lines ``rlplace run --record`` appends: {"model", "plan", "median_step_time_s", ...}."""
    from envs.files import read_text
    from profilers.spec import graph_from_spec

    out, graphs = [], {}
    for i, line in enumerate(read_text(path, "run records", CalibrationError).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            spec, t = str(rec["model"]), float(rec["median_step_time_s"])
            plan = Plan.from_dict(rec["plan"], source=f"{path}:{i}")
        except (ValueError, KeyError, TypeError) as exc:
            raise CalibrationError(f"{path}: line {i} is not a run record ({exc})") from None
        if not (math.isfinite(t) and t > 0):
            raise CalibrationError(f"{path}: line {i}: step time {t} must be positive")
        if spec not in graphs:
            graphs[spec] = graph_from_spec(spec, dtype=rec.get("dtype", "fp32"))
        cfg = {"model": spec, **{k: rec.get(k) for k in ("tp", "pp", "dp") if k in rec}}
        out.append(Sample(graphs[spec], plan, t, model=spec, config=cfg))
    if not out:
        raise CalibrationError(f"{path}: no run records")
    return out


def check_samples(samples: Sequence[Sample], topology: Topology) -> None:
    """Every sample's plan must be valid on ``topology`` (devices it names, its degrees and groups)."""
    from envs.errors import PlanError

    for i, s in enumerate(samples):
        try:
            s.plan.validate(s.graph, topology)
        except PlanError as exc:
            raise CalibrationError(f"measurement {i + 1} ({s.model}): {exc}") from None


def split_by_model(samples: Sequence[Sample], fraction: float = 0.3, seed: int = 0,
                   holdout: Sequence[str] | None = None) -> tuple[list[Sample], list[Sample]]:
    """(fit, held out): whole models held out (``holdout`` names them, else models drawn at random until
    at least ``fraction`` of the rows are held out)."""
    models = sorted({s.model for s in samples})
    if holdout is None:
        rng = np.random.default_rng(seed)
        chosen: list[str] = []
        for m in rng.permutation(models).tolist():
            if sum(s.model in chosen for s in samples) >= fraction * len(samples):
                break
            chosen.append(m)
        holdout = chosen
    unknown = set(holdout) - set(models)
    if unknown:
        raise CalibrationError(f"no measurements of model(s) {sorted(unknown)}; models: {', '.join(models)}")
    fit_set = [s for s in samples if s.model not in holdout]
    held = [s for s in samples if s.model in holdout]
    if not fit_set:
        raise CalibrationError("the held-out models leave no rows to fit on")
    return fit_set, held


# ---------------------------------------------------------------------- prediction and errors
def predict(samples: Sequence[Sample], topology: Topology) -> np.ndarray:
    """Simulated step time of every sample's plan on ``topology``."""
    from envs.sim import simulate

    return np.array([simulate(s.graph, topology, s.plan, "step_time", timeline=False, validate=False).value
                     for s in samples], dtype=np.float64)


def metrics(predicted: np.ndarray, measured: np.ndarray, models: Sequence[str] | None = None) -> dict[str, float]:
    """MAPE, mean predicted/measured, Spearman overall and within each model (min and mean over models
    with at least 3 rows), the worst factor off (max of p/m and m/p), RMS log error."""
    from scipy.stats import spearmanr

    p, m = np.asarray(predicted, dtype=np.float64), np.asarray(measured, dtype=np.float64)
    if p.size == 0:
        return {"n": 0}
    out = {"n": int(p.size), "mape": float(np.mean(np.abs(p - m) / m)), "mean_ratio": float(np.mean(p / m)),
           "spearman": float(spearmanr(p, m).statistic) if p.size > 2 else float("nan"),
           "max_factor": float(np.max(np.maximum(p / m, m / p))), "rms_log_error": float(np.sqrt(np.mean(np.log(p / m) ** 2)))}
    if models is not None:
        rhos = []
        for mod in sorted(set(models)):
            idx = [i for i, x in enumerate(models) if x == mod]
            if len(idx) >= 3 and np.ptp(m[idx]) > 0:
                rhos.append(float(spearmanr(p[idx], m[idx]).statistic))
        if rhos:
            out["spearman_within_min"] = float(np.min(rhos))
            out["spearman_within_mean"] = float(np.mean(rhos))
    return out


def error_table(samples: Sequence[Sample], predicted: np.ndarray, keys: Sequence[str] = ("model", "tp", "pp", "dp", "micro")
                ) -> list[dict]:
    """MAPE and mean ratio per value of each grouping key."""
    rows = []
    meas = np.array([s.measured for s in samples])
    for key in keys:
        values = sorted({s.config.get(key) for s in samples if key in s.config}, key=str)
        for v in values:
            idx = [i for i, s in enumerate(samples) if s.config.get(key) == v]
            r = predicted[idx] / meas[idx]
            rows.append({"group": key, "value": v, "rows": len(idx), "mape": float(np.mean(np.abs(r - 1))),
                         "mean_ratio": float(np.mean(r)), "max_factor": float(np.max(np.maximum(r, 1 / r)))})
    return rows


# ---------------------------------------------------------------------- fitting
@dataclass
class FitResult:
    topology: Topology
    values: dict[str, float]
    start: dict[str, float]
    evaluations: int
    rows: int  # rows the fit used
    metrics: dict  # on those rows


def fit(samples: Sequence[Sample], base: Topology, params: Sequence[str] = DEFAULT_FIT, *, max_rows: int = 400,
        seed: int = 0, max_nfev: int = 60, start: dict[str, float] | None = None, starts: int = 1,
        loss: str = "linear", f_scale: float = 0.1, log: Callable[[str], None] | None = None) -> FitResult:
    """Least squares on ``log(simulated / measured)`` over (at most ``max_rows`` of) ``samples``,
    changing ``params`` of ``base`` within their ranges (see the module docstring). ``starts`` > 1 also
    starts from the base values scaled by 10, 0.1, 100, 0.01 (rates divided, times multiplied; for
    devices without a datasheet, whose guesses may be far off) and keeps the best; ``loss`` is
    ``least_squares``' (``soft_l1`` with ``f_scale`` ~ the noise in log units is robust to outliers)."""
    from scipy.optimize import least_squares

    say = log or (lambda _m: None)
    if not samples:
        raise CalibrationError("calibration needs at least one measurement")
    bad = [p for p in params if p not in PARAMETERS]
    if bad:
        raise CalibrationError(f"unknown parameter {bad[0]!r}; choose from {', '.join(PARAMETERS)}")
    if not params:
        raise CalibrationError("calibration needs at least one parameter to fit")
    rng = np.random.default_rng(seed)
    rows = list(samples) if len(samples) <= max_rows else [samples[i] for i in sorted(
        rng.choice(len(samples), size=max_rows, replace=False).tolist())]
    meas = np.array([s.measured for s in rows])
    if not np.all(np.isfinite(meas) & (meas > 0)):
        raise CalibrationError("measured step times must be positive and finite")
    specs = [PARAMETERS[p] for p in params]
    x0 = {p.name: min(max((start or {}).get(p.name, p.read(base)), p.lo), p.hi) for p in specs}
    lo = np.log([p.lo for p in specs])
    hi = np.maximum(np.log([p.hi for p in specs]), lo + 1e-12)
    evals = 0

    def values_of(x: np.ndarray) -> dict[str, float]:
        return {p.name: float(math.exp(v)) for p, v in zip(specs, x)}

    def residuals(x: np.ndarray) -> np.ndarray:
        nonlocal evals
        evals += 1
        r = np.log(predict(rows, with_parameters(base, values_of(x))) / meas)
        if evals % 10 == 1:
            say(f"fit: evaluation {evals}, RMS log error {float(np.sqrt(np.mean(r ** 2))):.4f}")
        return r

    best = None
    for scale in (1.0, 10.0, 0.1, 100.0, 0.01)[: max(1, starts)]:
        # a time-like parameter (an overhead or latency, seconds) scales up where a rate scales down
        origin = np.clip([math.log(x0[p.name]) + (1 if p.is_time else -1) * math.log(scale) for p in specs],
                         lo, hi)
        res = least_squares(residuals, origin, bounds=(lo, hi), diff_step=0.02, x_scale=1.0, max_nfev=max_nfev,
                            method="trf", loss=loss, f_scale=f_scale)
        if best is None or res.cost < best.cost:
            best = res
    values = values_of(best.x)
    topo = with_parameters(base, values, meta={"calibrated": True, "calibration": values})
    return FitResult(topology=topo, values=values, start=x0, evaluations=evals, rows=len(rows),
                     metrics=metrics(predict(rows, topo), meas, [s.model for s in rows]))


def plot(path: str | os.PathLike, fit_set: Sequence[Sample], fit_pred: np.ndarray, held: Sequence[Sample],
         held_pred: np.ndarray, title: str) -> None:
    """Predicted vs measured step time (log-log), fit rows and held-out rows, with the y = x line."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from envs.gantt import save_figure

    fig, ax = plt.subplots(figsize=(6, 6))
    allv = [s.measured for s in fit_set] + [s.measured for s in held] + list(fit_pred) + list(held_pred)
    lo, hi = min(allv) * 0.8, max(allv) * 1.25
    ax.plot([lo, hi], [lo, hi], color="0.6", lw=1)
    ax.fill_between([lo, hi], [lo / 1.1, hi / 1.1], [lo * 1.1, hi * 1.1], color="0.9", label="±10%")
    ax.scatter([s.measured for s in fit_set], fit_pred, s=8, alpha=0.5, label=f"fit rows ({len(fit_set)})")
    if held:
        ax.scatter([s.measured for s in held], held_pred, s=8, alpha=0.7, label=f"held-out models ({len(held)})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("simulated step time (s)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def markdown_report(name: str, values: dict[str, float], fit_metrics: dict, held_metrics: dict,
                    table: list[dict], sources: str) -> str:
    """The calibration's errors as markdown (parameters, fit and held-out metrics, errors per group)."""
    def fmt(d: dict) -> str:
        keys = ("n", "mape", "mean_ratio", "spearman", "spearman_within_min", "spearman_within_mean", "max_factor")
        return " | ".join(f"{d[k]:.3f}" if isinstance(d.get(k), float) else str(d.get(k, "—")) for k in keys)

    lines = [f"# Calibration of `{name}`", "", sources, "", "| parameter | value |", "|---|---|"]
    lines += [f"| {k} | {v:.4g} |" for k, v in values.items()]
    lines += ["", "| rows | n | MAPE | mean ratio | Spearman | within-model min | within-model mean | max factor |",
              "|---|---|---|---|---|---|---|---|", f"| fit | {fmt(fit_metrics)} |", f"| held out | {fmt(held_metrics)} |",
              "", "Held-out rows by group:", "", "| group | value | rows | MAPE | mean ratio | max factor |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r['group']} | {r['value']} | {r['rows']} | {r['mape']:.3f} | {r['mean_ratio']:.3f} | "
              f"{r['max_factor']:.2f} |" for r in table]
    return "\n".join(lines) + "\n"


__all__ = ["ABSOLUTE_FIT", "CSV_COLUMNS", "PARAMETERS", "DEFAULT_FIT", "CalibrationError", "FitResult", "Param", "Sample",
           "check_samples", "error_table", "fit", "markdown_report", "metrics", "plot", "predict", "samples_from_csv",
           "samples_from_runs", "split_by_model", "with_parameters"]
