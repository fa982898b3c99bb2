"""Calibrate a topology's cost parameters from measured step times of whole plans.

The simulator's prediction of a plan depends on five numbers of a (homogeneous) topology:

* ``flops``: achieved FLOP/s of a device (stored as ``peak_flops`` for every dtype, ``compute_eff=1``),
* ``mem_bw``: achieved bytes/s (``mem_bw``, ``mem_eff=1``),
* ``launch_overhead``: seconds per operator launch (also what per-microbatch framework overhead
  of each op costs),
* ``link_latency``: seconds per link hop (alpha; on ``cpu-local`` a message crosses two links, device
  -> ``shm`` -> device, so a point-to-point message and each ring step of a collective pay
  ``2 * link_latency``: this is where gloo's per-message / per-collective cost goes),
* ``link_bandwidth``: bytes/s per direction (beta, ``efficiency=1``).

:func:`fit` finds them by bounded nonlinear least squares (``scipy.optimize.least_squares``, robust
``soft_l1`` loss) on the log-error ``log(simulated / measured)`` over a set of :class:`Sample`
(graph, plan, measured step time), from several starting points (the base topology's values and
scaled copies; the best wins). The parameters live in log10 space relative to the start, so one
finite-difference step is a few percent of every parameter whatever its magnitude. The result is a
fitted :class:`~envs.topology.Topology` (same devices, switches and links as the base, rates
replaced) plus the fitted numbers; :func:`metrics` gives Spearman rank correlation and MAPE.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from envs.errors import RlplaceError
from envs.graph import OpGraph
from envs.plan import Plan
from envs.topology import Device, Link, Topology

PARAMS = ("flops", "mem_bw", "launch_overhead", "link_latency", "link_bandwidth")
BOUNDS = {"flops": (1e6, 1e15), "mem_bw": (1e6, 1e13), "launch_overhead": (1e-9, 1e-1),
          "link_latency": (1e-9, 1e-1), "link_bandwidth": (1e5, 1e13)}


class FitError(RlplaceError):
    """Calibration cannot run (no samples, a bad parameter name, non-positive measurements)."""


@dataclass
class CalibParams:
    """The five cost parameters of a homogeneous topology (see the module docstring)."""

    flops: float
    mem_bw: float
    launch_overhead: float
    link_latency: float
    link_bandwidth: float

    def vector(self) -> np.ndarray:
        return np.array([getattr(self, k) for k in PARAMS], dtype=np.float64)

    @classmethod
    def from_vector(cls, v: np.ndarray) -> CalibParams:
        return cls(**{k: float(x) for k, x in zip(PARAMS, v)})

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass
class Sample:
    """One plan with its measured step time (seconds)."""

    graph: OpGraph
    plan: Plan
    measured: float
    label: str = ""
    meta: dict = field(default_factory=dict)


@dataclass
class FitResult:
    params: CalibParams
    start: CalibParams
    topology: Topology
    cost: float  # final robust cost
    rms_log_error: float  # over the fitted samples
    evaluations: int
    fitted: tuple[str, ...]


def params_of(topology: Topology, dtype: str = "fp32") -> CalibParams:
    """The parameters a topology implies (device 0 and link 0; achieved rates, i.e. with efficiencies)."""
    dev = topology.devices[0]
    link = topology.links[0] if topology.links else Link(dev.name, dev.name + "'", bandwidth=1e12, latency=0.0)
    return CalibParams(flops=dev.flops(dtype), mem_bw=dev.bandwidth(), launch_overhead=max(dev.launch_overhead, 1e-9),
                       link_latency=max(link.latency, 1e-9), link_bandwidth=link.bandwidth * link.efficiency)


def apply_params(base: Topology, params: CalibParams, *, name: str | None = None,
                 meta: dict[str, Any] | None = None) -> Topology:
    """``base`` with every device and link carrying ``params`` (efficiencies folded in, i.e. 1.0)."""
    devs = [Device(**{**d.__dict__, "peak_flops": {k: params.flops for k in d.peak_flops}, "compute_eff": 1.0,
                      "mem_bw": params.mem_bw, "mem_eff": 1.0, "launch_overhead": params.launch_overhead})
            for d in base.devices]
    links = [Link(ln.a, ln.b, bandwidth=params.link_bandwidth, latency=params.link_latency, efficiency=1.0,
                  kind=ln.kind) for ln in base.links]
    return Topology(devs, links, list(base.switches), name=name or base.name, meta={**base.meta, **(meta or {})})


def predict(samples: list[Sample], topology: Topology) -> np.ndarray:
    """Simulated step time of every sample's plan on ``topology``."""
    from envs.sim import simulate

    return np.array([simulate(s.graph, topology, s.plan, "step_time", timeline=False, validate=False).value
                     for s in samples], dtype=np.float64)


def metrics(predicted: np.ndarray, measured: np.ndarray) -> dict[str, float]:
    """Spearman rank correlation, mean absolute percentage error, median ratio and RMS log error."""
    from scipy.stats import spearmanr

    p, m = np.asarray(predicted, dtype=np.float64), np.asarray(measured, dtype=np.float64)
    rho = float(spearmanr(p, m).statistic) if p.size > 1 else float("nan")
    return {"spearman": rho, "mape": float(np.mean(np.abs(p - m) / m)),
            "median_ratio": float(np.median(p / m)), "rms_log_error": float(np.sqrt(np.mean(np.log(p / m) ** 2))),
            "n": int(p.size)}


def fit(samples: list[Sample], base: Topology, *, start: CalibParams | None = None,
        fit_params: tuple[str, ...] = PARAMS, starts: int = 3, loss: str = "soft_l1", f_scale: float = 0.1,
        max_nfev: int = 400) -> FitResult:
    """Fit ``fit_params`` (others stay at ``start``) minimising the robust log-error (module docstring)."""
    from scipy.optimize import least_squares

    if not samples:
        raise FitError("fit needs at least one sample")
    bad = [p for p in fit_params if p not in PARAMS]
    if bad:
        raise FitError(f"unknown parameter {bad[0]!r}; choose from {', '.join(PARAMS)}")
    meas = np.array([s.measured for s in samples], dtype=np.float64)
    if np.any(~np.isfinite(meas)) or np.any(meas <= 0):
        raise FitError("measured step times must be positive and finite")
    start = start or params_of(base)
    idx = [PARAMS.index(p) for p in fit_params]
    lo = np.log10([BOUNDS[PARAMS[i]][0] for i in idx])
    hi = np.log10([BOUNDS[PARAMS[i]][1] for i in idx])
    evals = 0

    def vec(x: np.ndarray, origin: np.ndarray) -> np.ndarray:
        v = origin.copy()
        v[idx] = 10.0 ** (np.log10(origin[idx]) + x)
        return v

    def residuals(x: np.ndarray, origin: np.ndarray) -> np.ndarray:
        nonlocal evals
        evals += 1
        topo = apply_params(base, CalibParams.from_vector(vec(x, origin)))
        return np.log(predict(samples, topo) / meas)

    best = None
    base_vec = np.clip(start.vector(), [b[0] for b in BOUNDS.values()], [b[1] for b in BOUNDS.values()])
    scales = [1.0, 10.0, 0.1, 100.0, 0.01][: max(1, starts)]
    for k, scale in enumerate(scales):
        origin = base_vec.copy()
        if k:  # rescale the time-like parameters of the start (rates divide, latencies multiply)
            for i in idx:
                origin[i] = origin[i] * scale if PARAMS[i] in ("launch_overhead", "link_latency") else origin[i] / scale
            origin = np.clip(origin, [b[0] for b in BOUNDS.values()], [b[1] for b in BOUNDS.values()])
        o_log = np.log10(origin[idx])
        res = least_squares(residuals, np.zeros(len(idx)), args=(origin,), bounds=(lo - o_log, hi - o_log),
                            loss=loss, f_scale=f_scale, diff_step=1e-2, max_nfev=max_nfev, x_scale=1.0)
        if best is None or res.cost < best[0].cost:
            best = (res, origin)
    res, origin = best
    params = CalibParams.from_vector(vec(res.x, origin))
    topo = apply_params(base, params, meta={"calibrated": True, "fidelity_fit": params.to_dict()})
    rms = float(np.sqrt(np.mean(res.fun ** 2)))
    return FitResult(params=params, start=start, topology=topo, cost=float(res.cost), rms_log_error=rms,
                     evaluations=evals, fitted=tuple(fit_params))


__all__ = ["BOUNDS", "PARAMS", "CalibParams", "FitError", "FitResult", "Sample", "apply_params", "fit", "metrics",
           "params_of", "predict"]
