"""Lower bounds on the simulated objective of *any* plan of a graph on a topology.

``lower_bound(graph, topology, objective)`` returns the components and their maximum. Every bound uses
only the *linear* part of each op's simulated time: on device ``d`` a node's time for ``s`` samples
split ``k`` ways is at least ``(s / k) * lin[v, d]`` with ``lin = measured time`` when the graph has one
for the device kind, else ``max(flops / achievable FLOP/s, activation bytes / achievable memory
bandwidth)`` (the simulator's roofline without the parameter-bytes term and launch overheads). Parts:

- **critical path** (``step_time``, ``latency``): one microbatch's forward and backward run the
  longest path one op after another; an op splits at most over all ``k`` devices (data and tensor
  parallel; only tensor parallel for ``latency``, where one sample is not split by batch) and a
  microbatch holds at least one sample per data-parallel replica, so each op takes at least
  ``lin / (batch * k)`` (+ the launch overhead where the time is a roofline one) on its fastest device.
- **aggregate work** (all objectives): device ``d``'s busy time is at least ``sum_v x[v, d] * w[v, d]``
  where ``x[v, d]`` is the fraction of ``v``'s work it does (fractions over a node's group sum to >= 1
  whatever its layout) and ``w`` the full-batch work (forward + backward, plus the optimizer's
  memory-bound pass over the model states for ``step_time``). The linear program ``min L`` s.t.
  ``sum_d x[u, d] = 1`` per placement unit, ``sum_u x[u, d] w[u, d] <= L`` per device bounds the
  busiest device (``w`` includes each op's launch overheads: a device doing any part of it pays them at
  least once, which is at least ``x`` times them). With ``total work / aggregate throughput`` it is the classical bound, made exact for
  heterogeneous devices and CPU-only / co-located nodes.
- **memory-forced** (plans that fit): the same LP with ``sum_u x[u, d] states[u] <= memory[d]``,
  because a device holding a fraction of a node's work holds at least that fraction of its model
  states (tensor splits divide both; data-parallel replicas hold full copies). It is the bound the
  report uses when some plan can fit, and it says how many devices the model states need at least.
- **largest unsplittable op**: a unit that allows no batch or tensor split runs whole on one device.
- **host work** (``step_time``, ``latency``): every kernel of every node is issued by some device's
  host at least once (``n_ops`` forward, as many backward), one kernel after another per host
  (``host_overhead`` each), so the busiest host works at least the total over the devices.

``lower_bound_any`` (no memory constraint) holds for every plan, including those that run out of memory;
``lower_bound`` holds for every plan that fits (and equals ``lower_bound_any`` if none can fit). For
``throughput`` the value bounds the simulator's throughput value (time per global batch).
The property test (tests/test_lower_bound.py) checks both against the simulator on random graphs and
plans.
"""

from __future__ import annotations

import numpy as np

from agent.placers.common import PlacerError, allowed_devices, plan_defaults, units
from envs.graph import CAN_BATCH, CAN_COL, CAN_ROW, OpGraph
from envs.plan import DTYPE_BYTES
from envs.sim import OBJECTIVES
from envs.topology import Topology

SAFETY = 1.0 - 1e-7  # LP solver tolerance


def linear_times(graph: OpGraph, topology: Topology, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(forward, backward) linear time per node and device at the traced batch, and the per-op launch
    overhead that the simulator adds on top (0 where the time is measured): each nodes x devices."""
    n, nd = graph.num_nodes, topology.num_devices
    f, b, ov = np.zeros((n, nd)), np.zeros((n, nd)), np.zeros((n, nd))
    act = np.maximum(graph.mem_bytes - graph.param_bytes, 0.0)
    for d, dev in enumerate(topology.devices):
        meas = graph.measured.get(dev.kind)
        if meas is not None:
            f[:, d], b[:, d] = meas["fwd"], meas["bwd"]
        else:
            rate, bw = dev.flops(dtype), dev.bandwidth()
            f[:, d] = np.maximum(graph.fwd_flops / rate, act / bw)
            b[:, d] = np.maximum(graph.bwd_flops / rate, 2 * act / bw)
            ov[:, d] = graph.n_ops * dev.launch_overhead
    return f, b, ov


def _lp(w: np.ndarray, allowed: np.ndarray, states: np.ndarray | None, caps: np.ndarray) -> float | None:
    """min L: sum_d x[u,d] = 1, sum_u x[u,d] w[u,d] <= L, optionally sum_u x[u,d] states[u] <= caps[d].
    Returns None when infeasible."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    U, nd = w.shape
    scale = float(w.max()) or 1.0
    ws = w / scale
    nv = U * nd + 1
    c = np.zeros(nv)
    c[-1] = 1.0
    idx = np.arange(U * nd).reshape(U, nd)
    # equality: per unit
    a_eq = coo_matrix((np.ones(U * nd), (np.repeat(np.arange(U), nd), idx.ravel())), shape=(U, nv))
    rows, cols, vals = [], [], []
    for d in range(nd):
        rows += [d] * U
        cols += idx[:, d].tolist()
        vals += ws[:, d].tolist()
        rows.append(d)
        cols.append(nv - 1)
        vals.append(-1.0)
    nrow = nd
    b_ub = [0.0] * nd
    if states is not None:
        smax = float(states.max()) or 1.0
        for d in range(nd):
            rows += [nrow] * U
            cols += idx[:, d].tolist()
            vals += (states / smax).tolist()
            b_ub.append(caps[d] / smax)
            nrow += 1
    a_ub = coo_matrix((vals, (rows, cols)), shape=(nrow, nv))
    bounds = [(0.0, None if ok else 0.0) for ok in allowed.ravel()] + [(0.0, None)]
    res = linprog(c, A_ub=a_ub.tocsr(), b_ub=np.asarray(b_ub), A_eq=a_eq.tocsr(), b_eq=np.ones(U),
                  bounds=bounds, method="highs")
    if res.status != 0:
        return None
    return float(res.x[-1]) * scale


def lower_bound(graph: OpGraph, topology: Topology, objective: str = "step_time", *, dtype: str | None = None,
                state_bytes_per_param: float | None = None, global_batch: int | None = None) -> dict:
    """Lower bounds on the objective of any plan with this dtype / optimizer-state size / global batch
    (defaults: what the placers use, ``agent.placers.common.plan_defaults``). See the module docstring."""
    if objective not in OBJECTIVES:
        raise PlacerError(f"unknown objective {objective!r}; choose one of {', '.join(OBJECTIVES)}")
    kw = plan_defaults(graph)
    dtype = dtype or kw["dtype"]
    sbp = kw["state_bytes_per_param"] if state_bytes_per_param is None else float(state_bytes_per_param)
    gb = int(global_batch or graph.batch_size)
    nd = topology.num_devices
    f, b, ov = linear_times(graph, topology, dtype)
    latency = objective == "latency"
    pbytes = DTYPE_BYTES.get(graph.dtype, 2)
    caps_l = graph.layout_caps
    # ---- critical path of one microbatch (one sample per replica at best)
    cp = 0.0
    if objective != "throughput":
        if latency:
            par = np.where(caps_l & (CAN_COL | CAN_ROW), nd, 1)
            node_w = (f / (graph.batch_size * par[:, None]) + ov).min(axis=1)
        else:
            par = np.where(caps_l & (CAN_BATCH | CAN_COL | CAN_ROW), nd, 1)
            node_w = ((f + b) / (graph.batch_size * par[:, None]) + 2 * ov).min(axis=1)
        cp = graph.critical_path(node_w)[0]
    # ---- aggregate work per unit and device (full batch; latency: one sample, forward only)
    # a device that does any part of a node pays its launch overheads at least once (>= x * overhead)
    if latency:
        work = f / graph.batch_size + ov
    else:
        work = (f + b) * (gb / graph.batch_size) + 2 * ov
    if objective == "step_time":
        bw = np.array([d.bandwidth() for d in topology.devices])
        work = work + 2 * (graph.param_bytes / pbytes * sbp)[:, None] / bw[None, :]
    if latency or graph.meta.get("memory_model") == "param_bytes":
        states = graph.param_bytes.copy()
    else:
        states = graph.param_bytes / pbytes * sbp
    unit, members = units(graph)
    uw = np.array([work[m].sum(axis=0) for m in members])
    us = np.array([states[m].sum() for m in members])
    allowed = allowed_devices(graph, topology)
    ua = np.array([allowed[m].all(axis=0) for m in members])
    caps = np.array([d.memory_bytes for d in topology.devices])
    simple = float(np.where(ua, uw, np.inf).min(axis=1).sum() / nd)
    agg = _lp(uw, ua, None, caps)
    agg = simple if agg is None else max(agg * SAFETY, 0.0)
    agg_mem = _lp(uw, ua, us, caps)
    feasible = agg_mem is not None
    agg_mem = agg_mem * SAFETY if feasible else None
    splittable = np.array([bool((caps_l[m] & (CAN_COL | CAN_ROW | (0 if latency else CAN_BATCH))).any()) for m in members])
    whole = np.where(ua, uw, np.inf).min(axis=1)
    op = float(whole[~splittable].max()) if (~splittable).any() else 0.0
    # ---- how many devices the model states need at least
    total_states = float(us.sum())
    mem_sorted = np.sort(caps)[::-1]
    need = int(np.searchsorted(np.cumsum(mem_sorted), total_states) + 1) if total_states > 0 else 1
    host_b = 0.0
    host = np.array([d.host_overhead for d in topology.devices])
    if objective != "throughput" and host.any():
        kernels = graph.n_ops.astype(np.float64)
        if not latency:
            kernels = 2 * kernels
        host_b = float((kernels[:, None] * host[None, :]).min(axis=1).sum() / nd) * SAFETY
    any_bound = max(cp, agg, op, host_b)
    fit_bound = max(cp, agg_mem, op, host_b) if feasible else any_bound
    return {"objective": objective, "lower_bound": fit_bound, "lower_bound_any": any_bound,
            "critical_path": cp, "aggregate": agg, "aggregate_memory": agg_mem, "largest_op": op, "host_work": host_b,
            "work_over_throughput": simple, "min_devices_for_states": min(need, nd + 1) if need <= nd else None,
            "memory_feasible": feasible}
