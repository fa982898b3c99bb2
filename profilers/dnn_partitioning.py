"""Importer for the public device-placement workloads of Tarnawski et al., "Efficient Algorithms for
Device Placement of DNN Graph Operators" (NeurIPS 2020), and the paper's max-load objective.

File format (JSON): a header ``maxFPGAs`` (accelerators), ``maxCPUs``, ``maxSizePerFPGA`` (bytes), then
``nodes`` with ``id``, ``name``, ``cpuLatency``, ``fpgaLatency``, ``size`` (bytes the node keeps on its
device), ``colorClass`` (nodes of one class must share a device; optional), ``supportedOnFpga`` and
``isBackwardNode``, and ``edges`` with ``sourceId``, ``destId``, ``cost`` (transfer time; equal for
all out-edges of a node) and ``size`` (bytes).

How the workload maps onto rlplace objects:

- Every file node (forward *and* backward: the format lists backward nodes explicitly) is an OpGraph
  node, in file order; ``meta["node_ids"][i]`` is the file ``id`` of node ``i``.
- ``measured = {"accel": {"fwd": fpgaLatency, "bwd": 0}, "cpu": {"fwd": cpuLatency, "bwd": 0}}`` and
  ``bwd_flops = 0``: the simulator must not derive extra backward work. Times stay in the file's unit
  (the paper's milliseconds) so numbers match the paper.
- ``fwd_flops = fpgaLatency * NOMINAL_ACCEL_FLOPS`` so that FLOP-balancing heuristics balance accelerator
  latency; the topology's accelerators run at exactly ``NOMINAL_ACCEL_FLOPS`` (efficiency 1).
- ``param_bytes = size``, ``out_bytes = 0``: accelerator memory is the plain sum of ``size`` over the
  nodes it holds (plans use dtype fp32 with ``state_bytes_per_param = 4``, i.e. one byte per byte).
- ``edge_time = cost``, ``edge_bytes = size`` of the edge; ``colocation = colorClass`` (-1 if absent).
- ``layout_caps = 0``: the paper places whole operators (no data/tensor parallelism), so only the
  ``single`` layout is valid.
- Restrictions the simulator and placers must respect: ``meta["cpu_only"]`` lists the nodes that are
  not ``supportedOnFpga`` (they may only go to a device of kind ``"cpu"``); ``meta["objective"] ==
  "throughput"`` means the step cost is the max-load objective below, not a step time.

Topology: ``maxFPGAs`` devices ``accel{i}`` of kind ``"accel"`` with ``maxSizePerFPGA`` bytes, then
``maxCPUs`` devices ``cpu{j}`` of kind ``"cpu"`` with ``pays_comm=False`` and effectively unbounded
memory, all on one switch (bandwidth irrelevant: ``edge_time`` overrides bytes/bandwidth).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from envs.errors import GraphError, PlanError
from envs.graph import OpGraph
from envs.plan import Plan
from envs.topology import Device, Link, Topology

SOURCE = "dnn-partitioning"
ACCEL = "accel"
CPU = "cpu"
NOMINAL_ACCEL_FLOPS = 1e12  # FLOP per file time unit on an accelerator (only for FLOP-based heuristics)
CPU_MEMORY_BYTES = 2.0**50  # "large": the paper puts no memory limit on CPUs
SWITCH = "fabric"
LINK_BANDWIDTH = 1e12  # any positive value: edge_time overrides bytes / bandwidth


class WorkloadError(GraphError):
    """A workload or split file is missing, malformed, or does not fit its graph."""


def _load_json(path: str | os.PathLike, what: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise WorkloadError(f"{what} file not found: {path}")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"{what} file {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise WorkloadError(f"{what} file {path} must hold a JSON object")
    return data


def _num(x, what: str) -> float:
    if isinstance(x, bool):
        return float(x)
    if not isinstance(x, (int, float)):
        raise WorkloadError(f"{what} must be a number, got {x!r}")
    v = float(x)
    if not np.isfinite(v) or v < 0:
        raise WorkloadError(f"{what} must be finite and >= 0, got {x!r}")
    return v


def import_workload(path: str | os.PathLike) -> tuple[OpGraph, Topology]:
    """Read a dnn-partitioning workload file into an OpGraph and its Topology (see module docstring)."""
    d = _load_json(path, "workload")
    try:
        n_acc = int(d["maxFPGAs"])
        n_cpu = int(d.get("maxCPUs", 0))
        acc_mem = float(d["maxSizePerFPGA"])
        nodes = d["nodes"]
        edges = d.get("edges", [])
    except (KeyError, TypeError, ValueError) as exc:
        raise WorkloadError(f"workload file {path}: missing or bad header field {exc}") from exc
    if n_acc < 0 or n_cpu < 0 or n_acc + n_cpu < 1:
        raise WorkloadError(f"workload file {path}: needs at least one device (maxFPGAs={n_acc}, maxCPUs={n_cpu})")
    if n_acc > 0 and not (np.isfinite(acc_mem) and acc_mem > 0):
        raise WorkloadError(f"workload file {path}: maxSizePerFPGA must be > 0, got {acc_mem}")
    if not isinstance(nodes, list) or not nodes or not isinstance(edges, list):
        raise WorkloadError(f"workload file {path}: 'nodes' must be a non-empty list and 'edges' a list")

    index: dict[int, int] = {}
    names, kinds, ids = [], [], []
    fpga, cpu, size, color, cpu_only, backward = [], [], [], [], [], []
    seen_names: set[str] = set()
    try:
        for i, nd in enumerate(nodes):
            nid = int(nd["id"])
            if nid in index:
                raise WorkloadError(f"workload file {path}: duplicate node id {nid}")
            index[nid] = i
            ids.append(nid)
            nm = str(nd.get("name", f"node{nid}"))
            if nm in seen_names:
                nm = f"{nm}#{nid}"
            seen_names.add(nm)
            names.append(nm)
            bwd = bool(nd.get("isBackwardNode", False))
            backward.append(bwd)
            kinds.append("backward" if bwd else "forward")
            fpga.append(_num(nd["fpgaLatency"], f"node {nid}: fpgaLatency"))
            cpu.append(_num(nd["cpuLatency"], f"node {nid}: cpuLatency"))
            size.append(_num(nd.get("size", 0.0), f"node {nid}: size"))
            c = nd.get("colorClass")
            color.append(int(c) if c is not None and int(c) >= 0 else -1)
            if not bool(nd.get("supportedOnFpga", True)):
                cpu_only.append(i)
        src, dst, ebytes, etime = [], [], [], []
        for e in edges:
            s, t = int(e["sourceId"]), int(e["destId"])
            if s not in index or t not in index:
                raise WorkloadError(f"workload file {path}: edge {s} -> {t} refers to an unknown node id")
            src.append(index[s])
            dst.append(index[t])
            ebytes.append(_num(e.get("size", 0.0), f"edge {s} -> {t}: size"))
            etime.append(_num(e["cost"], f"edge {s} -> {t}: cost"))
    except WorkloadError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise WorkloadError(f"workload file {path}: malformed node or edge ({exc!r})") from exc
    if cpu_only and n_cpu == 0:
        raise WorkloadError(f"workload file {path}: {len(cpu_only)} nodes are not supported on accelerators "
                            "but the file allows no CPU")

    n = len(names)
    fpga_a = np.asarray(fpga)
    meta = {"source": SOURCE, "objective": "throughput", "file": Path(path).name, "node_ids": ids,
            "cpu_only": cpu_only, "is_backward": backward, "time_unit": "file units (ms in the paper)",
            "memory": "sum of param_bytes per accelerator", "max_accelerators": n_acc, "max_cpus": n_cpu,
            "max_size_per_accelerator": acc_mem}
    try:
        graph = OpGraph(
            names=names, kinds=kinds, fwd_flops=fpga_a * NOMINAL_ACCEL_FLOPS, bwd_flops=np.zeros(n),
            param_bytes=np.asarray(size), out_bytes=np.zeros(n), mem_bytes=np.zeros(n),
            edge_src=np.asarray(src, dtype=np.int64), edge_dst=np.asarray(dst, dtype=np.int64),
            edge_bytes=np.asarray(ebytes), edge_time=np.asarray(etime),
            colocation=np.asarray(color, dtype=np.int64), layout_caps=np.zeros(n, dtype=np.int64),
            measured={ACCEL: {"fwd": fpga_a, "bwd": np.zeros(n)},
                      CPU: {"fwd": np.asarray(cpu), "bwd": np.zeros(n)}},
            batch_size=1, dtype="fp32", name=Path(path).stem, meta=meta,
        )
    except GraphError as exc:
        raise WorkloadError(f"workload file {path}: {exc}") from exc
    return graph, _topology(n_acc, n_cpu, acc_mem, name=f"{SOURCE}:{Path(path).stem}")


def _topology(n_acc: int, n_cpu: int, acc_mem: float, name: str) -> Topology:
    cpu_flops = NOMINAL_ACCEL_FLOPS / 10.0  # the samples' CPUs are ~10x slower; measured times override
    devices = [Device(f"{ACCEL}{i}", ACCEL, {"fp32": NOMINAL_ACCEL_FLOPS, "bf16": NOMINAL_ACCEL_FLOPS}, acc_mem,
                      1e12, compute_eff=1.0, mem_eff=1.0, launch_overhead=0.0) for i in range(n_acc)]
    devices += [Device(f"{CPU}{j}", CPU, {"fp32": cpu_flops, "bf16": cpu_flops}, CPU_MEMORY_BYTES, 1e11,
                       compute_eff=1.0, mem_eff=1.0, launch_overhead=0.0, pays_comm=False) for j in range(n_cpu)]
    links = [Link(dv.name, SWITCH, bandwidth=LINK_BANDWIDTH, latency=0.0, kind="dnn-partitioning")
             for dv in devices]
    return Topology(devices, links, [SWITCH], name=name,
                    meta={"source": SOURCE, "objective": "throughput"})


def devices_of_kind(topology: Topology, kind: str) -> list[int]:
    """Indices of the topology's devices of one kind, in order."""
    return [i for i, dv in enumerate(topology.devices) if dv.kind == kind]


def import_split(path: str | os.PathLike, graph: OpGraph, topology: Topology) -> Plan:
    """Read a split file (``fpgas[i].nodes`` / ``cpus[j].nodes``: file node ids) into a Plan on ``graph``.

    Accelerator ``i`` of the file is the i-th device of kind ``"accel"``, CPU ``j`` the j-th of kind
    ``"cpu"``. Every node must be listed exactly once; the plan is validated (co-location classes)."""
    d = _load_json(path, "split")
    ids = graph.meta.get("node_ids")
    if ids is None or len(ids) != graph.num_nodes:
        raise WorkloadError("graph was not imported from a dnn-partitioning file (no meta['node_ids'])")
    index = {int(nid): i for i, nid in enumerate(ids)}
    assign = [-1] * graph.num_nodes
    for key, kind in (("fpgas", ACCEL), ("cpus", CPU)):
        devs = devices_of_kind(topology, kind)
        parts = d.get(key, [])
        if not isinstance(parts, list):
            raise WorkloadError(f"split file {path}: '{key}' must be a list")
        for k, part in enumerate(parts):
            try:
                listed = [int(x) for x in part.get("nodes", [])]
            except (AttributeError, TypeError, ValueError) as exc:
                raise WorkloadError(f"split file {path}: {key}[{k}] is malformed ({exc!r})") from exc
            if listed and k >= len(devs):
                raise WorkloadError(f"split file {path}: {key}[{k}] is used but the topology has only "
                                    f"{len(devs)} {kind} devices")
            for nid in listed:
                if nid not in index:
                    raise WorkloadError(f"split file {path}: node id {nid} is not in graph {graph.name!r}")
                i = index[nid]
                if assign[i] >= 0:
                    raise WorkloadError(f"split file {path}: node id {nid} is listed twice")
                assign[i] = devs[k]
    missing = [ids[i] for i, a in enumerate(assign) if a < 0]
    if missing:
        raise WorkloadError(f"split file {path}: {len(missing)} node(s) unassigned, e.g. id {missing[0]}")
    plan = Plan(groups=[(a,) for a in assign], layouts=["single"] * graph.num_nodes, dtype="fp32",
                state_bytes_per_param=4.0, provenance={"placer": "human-expert", "source": Path(path).name})
    plan.validate(graph, topology)
    return plan


def _devices(graph: OpGraph, topology: Topology, plan: Plan) -> np.ndarray:
    """One device per node; raises PlanError where the plan leaves the paper's model."""
    if plan.num_nodes != graph.num_nodes:
        raise PlanError(f"plan has {plan.num_nodes} nodes, graph {graph.name!r} has {graph.num_nodes}")
    dev = np.empty(graph.num_nodes, dtype=np.int64)
    for i, g in enumerate(plan.groups):
        if len(g) != 1:
            raise PlanError(f"node {graph.names[i]!r}: max-load needs one device per node, got {g}")
        if not 0 <= g[0] < topology.num_devices:
            raise PlanError(f"node {graph.names[i]!r}: device {g[0]} is not in the topology")
        dev[i] = g[0]
    first: dict[int, int] = {}
    for i, c in enumerate(graph.colocation.tolist()):
        if c < 0:
            continue
        j = first.setdefault(c, i)
        if dev[i] != dev[j]:
            raise PlanError(f"co-location class {c} is split: {graph.names[j]!r} on device {dev[j]} "
                            f"but {graph.names[i]!r} on device {dev[i]}")
    for i in graph.meta.get("cpu_only", []):
        if topology.devices[dev[i]].kind != CPU:
            raise PlanError(f"node {graph.names[i]!r} is not supported on accelerators but is on "
                            f"{topology.devices[dev[i]].name!r}")
    return dev


def device_loads(graph: OpGraph, topology: Topology, plan: Plan) -> np.ndarray:
    """Per-device load of the paper's throughput objective (Tarnawski et al. 2020, Sec. 4).

    load(d) = sum of the latencies of d's nodes (measured time for d's kind, fwd + bwd)
            + sum over nodes u on d with an out-edge to another device of cost(u)       (sending)
            + sum over nodes u on other devices with an out-edge into d of cost(u)      (receiving, once
              per (u, d) however many of d's nodes consume u)
    where cost(u) is the edge time of u's out-edges (equal in the format; the largest is taken if not).
    Devices with ``pays_comm=False`` (the CPUs) pay no communication. A plan that separates a co-location
    class, puts a CPU-only node on an accelerator, or uses more than one device per node raises PlanError.
    This is a plain reference implementation, independent of the simulator."""
    if graph.edge_time is None and graph.num_edges:
        raise GraphError(f"graph {graph.name!r} has no edge_time: max-load needs per-edge transfer costs")
    dev = _devices(graph, topology, plan)
    loads = np.zeros(topology.num_devices)
    for i in range(graph.num_nodes):
        kind = topology.devices[dev[i]].kind
        if kind not in graph.measured:
            raise PlanError(f"graph {graph.name!r} has no measured times for device kind {kind!r}")
        loads[dev[i]] += graph.measured[kind]["fwd"][i] + graph.measured[kind]["bwd"][i]
    send: dict[int, float] = {}
    recv: dict[tuple[int, int], float] = {}
    for e in range(graph.num_edges):
        u, v = int(graph.edge_src[e]), int(graph.edge_dst[e])
        if dev[u] == dev[v]:
            continue
        c = float(graph.edge_time[e])
        send[u] = max(send.get(u, 0.0), c)
        key = (u, int(dev[v]))
        recv[key] = max(recv.get(key, 0.0), c)
    for u, c in send.items():
        if topology.devices[dev[u]].pays_comm:
            loads[dev[u]] += c
    for (_, d), c in recv.items():
        if topology.devices[d].pays_comm:
            loads[d] += c
    return loads


def max_load(graph: OpGraph, topology: Topology, plan: Plan) -> float:
    """The paper's throughput objective: the largest per-device load (see ``device_loads``); the time
    per sample of the resulting pipeline, in the file's time unit."""
    return float(device_loads(graph, topology, plan).max())


def accelerator_memory(graph: OpGraph, topology: Topology, plan: Plan) -> np.ndarray:
    """Bytes per device under the paper's memory model (sum of node ``size``, i.e. ``param_bytes``); the
    plan is feasible when each accelerator's entry is at most its ``memory_bytes``."""
    dev = _devices(graph, topology, plan)
    return np.bincount(dev, weights=graph.param_bytes, minlength=topology.num_devices)
