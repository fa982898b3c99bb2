"""Measure op times on a real device and calibrate a device model from them.

``measure(model, inputs, ...)`` traces the model (``profilers.trace``), materialises random weights and
inputs on the device (CPU, or CUDA when asked), runs the exported graph once to get every
intermediate tensor, then times each OpGraph node on its own: forward (no grad) and backward
(``torch.autograd.grad`` of that op's outputs with respect to its floating inputs and weights), with
warm-up runs and the median of repeats. Times are attached as ``graph.measured[kind]`` (seconds at
the traced batch), where ``kind`` is the Topology device kind (``cpu``, ``a100-80g``...).

``fit_device(graph, kind)`` fits ``t = max(flops / F, bytes / B) + c`` robustly rather than by plain
least squares (a handful of tiny ops would otherwise dominate): ``c`` (launch overhead) is the median
time of the cheapest fifth of the ops; ``F`` is total FLOPs over total time above ``c`` of the
compute-bound ops (matmul, linear, conv, attention, recurrent kinds), ``B`` the same with bytes for
the others; then each op is reassigned to whichever term predicts the larger time and F, B re-fit
(three rounds). Forward and backward samples are both used (backward with its FLOPs, twice the bytes).

``calibrate_cpu_local(...)`` measures a small model on this host's CPU, fits F, B and c, times
tensor copies between two local processes (a gloo send/recv ping-pong over loopback; alpha-beta fit),
and writes the ``cpu-local`` topology to ``envs.presets.calibrated_cpu_local_path()`` (atomically).
The measured rates are *achieved* rates, so they are stored as ``peak_flops`` / ``mem_bw`` with
``compute_eff = mem_eff = 1.0``: the efficiency is folded into the measured number.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from envs.errors import RlplaceError
from envs.graph import OpGraph
from envs.presets import calibrated_cpu_local_path
from envs.topology import Device, Link, Topology
from profilers.trace import DTYPES, TraceError, export_meta, graph_and_members

COMPUTE_KINDS = {"linear", "matmul", "conv", "conv1d", "conv2d", "conv3d", "sdpa", "attention", "lstm",
                 "gru", "rnn", "expert", "embedding_bag"}
Progress = Callable[[int, int], None]


class MeasureError(RlplaceError):
    """Measurement could not run (bad device, model that fails on real tensors)."""


def device_kind(device: str | torch.device) -> str:
    """Topology device kind for a torch device: ``cpu`` or a preset GPU kind (``a100-80g``...)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev.type
    props = torch.cuda.get_device_properties(dev)
    name = props.name.lower()
    gb = props.total_memory / 1e9
    for key, kind in (("h100", "h100-80g"), ("a100", "a100-80g" if gb > 50 else "a100-40g"),
                      ("v100", "v100-32g" if gb > 20 else "v100-16g"), ("t4", "t4")):
        if key in name:
            return kind
    return name.replace("nvidia ", "").replace(" ", "-")


# ---------------------------------------------------------------------------- materialising
def _real(v: Any, device: torch.device, gen: torch.Generator) -> Any:
    if isinstance(v, torch.Tensor):
        if v.is_floating_point():
            t = torch.randn(tuple(v.shape), dtype=torch.float32, generator=gen).mul_(0.02).to(v.dtype)
        else:  # indices, masks, counters: zeros are valid for every lookup
            t = torch.zeros(tuple(v.shape), dtype=v.dtype)
        return t.to(device)
    if isinstance(v, (list, tuple)):
        return type(v)(_real(x, device, gen) for x in v)
    return v


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return float(statistics.median(times))


def _float_tensors(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v] if v.is_floating_point() else []
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _float_tensors(x)]
    return []


class _Runner:
    """Executes fx nodes of an exported graph on real tensors kept in ``env``."""

    def __init__(self, ep: torch.export.ExportedProgram, device: torch.device, seed: int) -> None:
        self.ep = ep
        self.device = device
        self.env: dict[torch.fx.Node, Any] = {}
        gen = torch.Generator().manual_seed(seed)
        for n in ep.graph.nodes:
            if n.op == "placeholder":
                self.env[n] = _real(n.meta.get("val"), device, gen)

    def _args(self, n: torch.fx.Node, env: dict) -> tuple[tuple, dict]:
        def look(a: torch.fx.Node) -> Any:
            if a.op == "get_attr":
                return getattr(self.ep.graph_module, str(a.target))
            return env[a] if a in env else self.env[a]

        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), look)
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta":
            kwargs = {**kwargs, "device": self.device}  # factory ops were traced on meta
        args = tuple(self.device if isinstance(a, torch.device) and a.type == "meta" else a for a in args)
        return args, kwargs

    def run_all(self) -> None:
        with torch.no_grad():
            for n in self.ep.graph.nodes:
                if n.op == "call_function":
                    args, kwargs = self._args(n, self.env)
                    self.env[n] = n.target(*args, **kwargs)

    def group_fn(self, members: Sequence[torch.fx.Node], local: dict) -> Callable[[], Any]:
        """Runs ``members`` in order; values of nodes outside the group come from ``local`` (grad
        leaves) or the full-run environment."""

        def run() -> Any:
            env = dict(local)
            for n in members:
                args, kwargs = self._args(n, env)
                env[n] = n.target(*args, **kwargs)
            return env

        return run


def measure(model: nn.Module, example_inputs: Any, *, batch_size: int, dtype: str = "fp32",
            device: str = "cpu", warmup: int = 2, repeats: int = 5, backward: bool = True,
            name: str | None = None, seed: int = 0, progress: Progress | None = None,
            threads: int | None = None) -> OpGraph:
    """Trace ``model`` and time every node on ``device``; returns the graph with ``measured[kind]``."""
    if dtype not in DTYPES:
        raise MeasureError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise MeasureError(f"bad device {device!r}: {exc}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MeasureError("device cuda requested but CUDA is not available")
    gname = name or type(model).__name__
    ep = export_meta(model, example_inputs, dtype=dtype, name=gname)
    graph, members = graph_and_members(ep, batch_size=batch_size, dtype=dtype, name=gname)
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    try:
        runner = _Runner(ep, dev, seed)
        try:
            runner.run_all()
        except Exception as exc:
            raise MeasureError(f"running {gname} on {dev} with random inputs failed: "
                               f"{type(exc).__name__}: {exc}") from exc
        fwd = np.zeros(graph.num_nodes)
        bwd = np.zeros(graph.num_nodes)
        member_set = [set(m) for m in members]
        for i, mem in enumerate(members):
            if mem:
                fwd[i], bwd[i] = _time_group(runner, mem, member_set[i], dev, warmup, repeats, backward)
            if progress:
                progress(i + 1, graph.num_nodes)
    finally:
        torch.set_num_threads(old_threads)
    kind = device_kind(dev)
    out = graph.with_measured(kind, fwd, bwd)
    out.meta.update(graph.meta)
    out.meta.setdefault("measured_on", {})[kind] = {
        "device": str(dev), "dtype": dtype, "warmup": warmup, "repeats": repeats,
        "threads": torch.get_num_threads() if not threads else int(threads), "statistic": "median"}
    return out


def _time_group(runner: _Runner, mem: Sequence[torch.fx.Node], inside: set, dev: torch.device,
                warmup: int, repeats: int, backward: bool) -> tuple[float, float]:
    ext = []
    for n in mem:
        for a in n.all_input_nodes:
            if a not in inside and a.op != "get_attr" and a not in ext:
                ext.append(a)
    with torch.no_grad():
        fwd = _median_time(runner.group_fn(mem, {}), dev, warmup, repeats)
    if not backward:
        return fwd, 0.0
    local: dict[torch.fx.Node, Any] = {}
    leaves: list[torch.Tensor] = []
    for a in ext:
        v = runner.env[a]
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            leaf = v.detach().requires_grad_(True)
            local[a] = leaf
            leaves.append(leaf)
    if not leaves:
        return fwd, 0.0
    try:
        with torch.enable_grad():
            env = runner.group_fn(mem, local)()
        outs = [t for t in _float_tensors(env[mem[-1]]) if t.requires_grad]
        if not outs:
            return fwd, 0.0
        grads = [torch.ones_like(t) for t in outs]

        def back() -> Any:
            return torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True)

        return fwd, _median_time(back, dev, warmup, repeats)
    except RuntimeError:  # an op without a derivative (e.g. integer outputs): no backward work
        return fwd, 0.0


# ---------------------------------------------------------------------------- device model fit
@dataclass
class DeviceFit:
    flops: float  # achieved FLOP/s
    bandwidth: float  # achieved bytes/s
    overhead: float  # s per op launch
    samples: int
    rel_error: float  # median |predicted - measured| / measured

    def predict(self, flops: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        return np.maximum(flops / self.flops, nbytes / self.bandwidth) + self.overhead


def fit_device(graph: OpGraph, kind: str) -> DeviceFit:
    """Fit F, B, c of ``t = max(flops/F, bytes/B) + c`` to a graph's measured times (module doc)."""
    if kind not in graph.measured:
        raise MeasureError(f"graph {graph.name!r} has no measurements for {kind!r}")
    m = graph.measured[kind]
    work = graph.kinds
    keep = np.array([k != "input" for k in work])
    f = np.concatenate([graph.fwd_flops[keep], graph.bwd_flops[keep]])
    b = np.concatenate([graph.mem_bytes[keep], 2.0 * graph.mem_bytes[keep]])
    t = np.concatenate([m["fwd"][keep], m["bwd"][keep]])
    compute = np.concatenate([[k in COMPUTE_KINDS for k, k_ in zip(work, keep) if k_]] * 2)
    ok = t > 0
    f, b, t, compute = f[ok], b[ok], t[ok], compute[ok]
    if t.size < 2:
        raise MeasureError("too few measured ops to fit a device model")
    size = np.maximum(f, b)
    small = size <= np.quantile(size, 0.2)
    c = float(np.median(t[small])) * 0.9 if small.any() else 0.0
    c = min(c, float(np.min(t)))
    busy = np.maximum(t - c, 1e-9)
    flops_rate = bw = 0.0
    for _ in range(3):
        if compute.any():
            flops_rate = float(f[compute].sum() / busy[compute].sum())
        if (~compute).any():
            bw = float(b[~compute].sum() / busy[~compute].sum())
        flops_rate = flops_rate or float(f.sum() / busy.sum()) or 1e9
        bw = bw or float(b.sum() / busy.sum()) or 1e9
        compute = f / flops_rate >= b / bw
    fit = DeviceFit(flops_rate, bw, c, int(t.size), 0.0)
    fit.rel_error = float(np.median(np.abs(fit.predict(f, b) - t) / t))
    return fit


# ---------------------------------------------------------------------------- link benchmark
def _pingpong_worker(rank: int, init_file: str, out_file: str, sizes: list[int], repeats: int) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        results = []
        for size in sizes:
            buf = torch.empty(size, dtype=torch.uint8)
            times = []
            for r in range(repeats + 1):
                dist.barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                if r:
                    times.append((time.perf_counter() - t0) / 2.0)
            results.append([size, float(statistics.median(times))])
        if rank == 0:
            Path(out_file).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def measure_link(sizes: Sequence[int] = (1 << 10, 1 << 16, 1 << 20, 1 << 23), repeats: int = 7,
                 timeout: float = 60.0) -> dict[str, float]:
    """One-way copy time between two local processes (gloo send/recv ping-pong on loopback) over
    message sizes; alpha-beta fit. Returns ``{"bandwidth", "latency", "method"}``."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="rlplace-link-") as tmp:
        init_file, out_file = os.path.join(tmp, "init"), os.path.join(tmp, "out.json")
        procs = [ctx.Process(target=_pingpong_worker, args=(r, init_file, out_file, list(sizes), repeats))
                 for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
        if not os.path.exists(out_file):
            raise MeasureError("link benchmark (gloo send/recv between two local processes) did not finish")
        data = np.array(json.loads(Path(out_file).read_text()))
    order = np.argsort(data[:, 0])
    x, y = data[order, 0], data[order, 1]
    # alpha-beta from the two ends (robust to a noisy middle on a shared host): the smallest message
    # is latency-bound, the slope between smallest and largest gives the bandwidth
    lat = float(y[0])
    slope = (y[-1] - y[0]) / (x[-1] - x[0]) if x[-1] > x[0] else 0.0
    bw = 1.0 / slope if slope > 0 else float(x[-1] / y[-1])
    return {"bandwidth": float(bw), "latency": lat,
            "method": "gloo send/recv ping-pong on loopback; latency = smallest message, "
                      "bandwidth = slope between smallest and largest",
            "samples": data.tolist()}


# ---------------------------------------------------------------------------- calibration
def _matmul_rate(dtype: torch.dtype, n: int = 256, repeats: int = 5) -> float:
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    t = _median_time(lambda: a @ b, torch.device("cpu"), 2, repeats)
    return 2.0 * n**3 / t


def calibrated_topology(fit: DeviceFit, *, dtype: str, devices: int, link: dict[str, float] | None,
                        extra_meta: dict | None = None, threads: int | None = None) -> Topology:
    """A ``cpu-local`` Topology whose devices carry the fitted rates (efficiency 1.0, see module doc)."""
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = 16 * 2**30
    peak = {dtype: fit.flops}
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    try:
        base = _matmul_rate(DTYPES[dtype])
        for other in ("fp32", "bf16", "fp16"):
            if other not in peak:  # scale by the matmul speed ratio between the dtypes on this CPU
                peak[other] = fit.flops * _matmul_rate(DTYPES[other]) / base
    finally:
        torch.set_num_threads(old_threads)
    devs = [Device(f"cpu{i}", "cpu", dict(peak), mem / devices, fit.bandwidth, compute_eff=1.0, mem_eff=1.0,
                   launch_overhead=fit.overhead) for i in range(devices)]
    bw = link["bandwidth"] if link else 5e9
    lat = link["latency"] if link else 2e-5
    links = [Link(d.name, "shm", kind="shm", bandwidth=bw, latency=lat, efficiency=1.0) for d in devs]
    meta = {"calibrated": True, "fit": {"flops": fit.flops, "bandwidth": fit.bandwidth,
                                        "overhead": fit.overhead, "samples": fit.samples,
                                        "median_rel_error": fit.rel_error, "dtype": dtype},
            "link": {k: v for k, v in (link or {"method": "not measured (defaults)"}).items() if k != "samples"},
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    meta.update(extra_meta or {})
    return Topology(devs, links, ["shm"], name="cpu-local", meta=meta)


def calibrate_cpu_local(spec: str = "mlp:layers=4,hidden=512,batch=64", *, dtype: str = "fp32",
                        devices: int = 2, link: bool = True, path: str | os.PathLike | None = None,
                        warmup: int = 2, repeats: int = 5,
                        progress: Progress | None = None) -> tuple[Topology, OpGraph, Path]:
    """Measure ``spec`` on this CPU (one device's share of the cores), fit the device model, time
    local process-to-process copies, and write the ``cpu-local`` topology (default path:
    ``envs.presets.calibrated_cpu_local_path()``). Returns (topology, measured graph, path)."""
    from profilers.spec import build_model

    module, inputs, batch = build_model(spec)
    threads = max(1, (os.cpu_count() or 1) // max(1, devices))
    graph = measure(module, inputs, batch_size=batch, dtype=dtype, warmup=warmup, repeats=repeats,
                    name=spec, progress=progress, threads=threads)
    fit = fit_device(graph, "cpu")
    link_info = None
    if link:
        try:
            link_info = measure_link()
        except (MeasureError, RuntimeError, OSError) as exc:
            link_info = {"bandwidth": 5e9, "latency": 2e-5, "method": f"defaults (benchmark failed: {exc})"}
    topo = calibrated_topology(fit, dtype=dtype, devices=devices, link=link_info,
                               extra_meta={"model": spec, "threads_per_device": threads}, threads=threads)
    out = Path(path) if path is not None else calibrated_cpu_local_path()
    topo.save(out)
    return topo, graph, out


__all__ = ["DeviceFit", "MeasureError", "TraceError", "calibrate_cpu_local", "calibrated_topology",
           "device_kind", "fit_device", "measure", "measure_link"]
