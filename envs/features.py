"""Observation features of the placement environments, split as in circuit_training's placement env.

- **Static** (:func:`static_features`): computed once per task and environment shape — node features
  (log-scaled FLOPs, parameter and activation bytes, shares of the totals, depth, critical-path
  position, layout capabilities, co-location, hashed op kind), edge index with log bytes, device
  features (log FLOP/s, memory, memory bandwidth, host), pairwise log bandwidth and latency, and the
  option table's features (group size, layout one-hot, dp / tp, which devices as a multi-hot row).
- **Dynamic** (:class:`DynamicState`): updated incrementally, O(devices + options x devices) per step —
  the current assignment of each node (option id, layout, share on each device), the node being
  decided (one-hot), per-device compute load and model-state memory so far, per-option features for
  the node being decided (memory after placing it, estimated compute speed-up, input locality), the
  phase and the global choices.

Every array is float32, padded to ``max_nodes`` / ``max_edges`` / ``max_devices`` / ``max_options``
with 0/1 masks, and bounded (see :func:`observation_space`) so the observation is a flat
``gymnasium.spaces.Dict`` of finite ``Box`` es.

The option table (:class:`OptionTable`) lists every (device group, layout) a node may take: each single
device with ``single``; each group of ``topology.hierarchy_groups()`` with ``batch_split`` (dp = group
size), ``col_split``, ``row_split`` and ``replicate`` (tensor parallel: tp = group size inside one host;
a group spanning hosts uses tp = devices per host and dp = number of hosts, i.e. tensor parallelism on
NVLink and data parallelism across the network, as Megatron-LM places them).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import gymnasium as gym
import numpy as np

from envs.graph import CAN_BATCH, CAN_COL, CAN_REPLICATE, CAN_ROW, OpGraph
from envs.plan import DTYPE_BYTES, LAYOUTS
from envs.topology import Topology

KIND_VOCAB = 16  # op kinds hashed into this many buckets (one-hot)
NODE_FEATURES = 18 + KIND_VOCAB
EDGE_FEATURES = 2
DEVICE_FEATURES = 6
OPTION_FEATURES = 6 + len(LAYOUTS)
NODE_STATE_FEATURES = 4 + len(LAYOUTS)
DEVICE_STATE_FEATURES = 3
OPTION_STATE_FEATURES = 3
PHASES = ("microbatches", "schedule", "recompute", "place")
FEATURE_BOUND = 16.0  # every feature is clipped to [-FEATURE_BOUND, FEATURE_BOUND]


def _log(x, scale: float) -> np.ndarray:
    """log10(1 + x) / scale: FLOPs use scale 16 (1e16 -> 1), bytes 12 (1 TB -> 1)."""
    return np.log10(1.0 + np.maximum(np.asarray(x, dtype=np.float64), 0.0)) / scale


def op_kind_id(kind: str, vocab: int = KIND_VOCAB) -> int:
    """A stable hash of an op kind into ``vocab`` buckets (crc32: the same across processes and runs)."""
    return zlib.crc32(kind.lower().encode()) % vocab


# ---------------------------------------------------------------------- option table
@dataclass(eq=False)
class OptionTable:
    """The (device group, layout, dp) choices a node can take on one topology.

    Arrays are indexed by option: ``groups[o]`` the device tuple (dp-major), ``layout[o]`` an index into
    ``LAYOUTS``, ``dp[o]`` / ``tp[o]`` the data- / tensor-parallel degrees, ``devices[o]`` a multi-hot row
    over devices, ``state_div[o]`` the factor that divides a node's model states on each member (tp for
    col/row splits, else 1), ``speedup[o]`` the compute split (dp x tp for col/row splits, dp otherwise)."""

    groups: list[tuple[int, ...]]
    layout: np.ndarray
    dp: np.ndarray
    tp: np.ndarray
    devices: np.ndarray
    state_div: np.ndarray
    speedup: np.ndarray
    min_flops: np.ndarray  # slowest member's FLOP/s (the SPMD group waits for it)

    @property
    def size(self) -> int:
        return len(self.groups)

    @classmethod
    def build(cls, topology: Topology, dtype: str = "bf16") -> OptionTable:
        nd = topology.num_devices
        rows: list[tuple[tuple[int, ...], int, int]] = [((d,), LAYOUTS.index("single"), 1) for d in range(nd)]
        for g in topology.hierarchy_groups():
            g = tuple(int(d) for d in g)
            n = len(g)
            hosts = topology.hosts_of(g)
            per_host = min(len(v) for v in hosts.values())
            tp = per_host if len(hosts) > 1 and n % per_host == 0 else n
            rows.append((g, LAYOUTS.index("batch_split"), n))
            for lay in ("col_split", "row_split", "replicate"):
                rows.append((g, LAYOUTS.index(lay), n // tp))
        k = len(rows)
        groups = [r[0] for r in rows]
        layout = np.array([r[1] for r in rows], dtype=np.int64)
        dp = np.array([r[2] for r in rows], dtype=np.int64)
        size = np.array([len(g) for g in groups], dtype=np.int64)
        tp = size // dp
        devices = np.zeros((k, nd), dtype=bool)
        for o, g in enumerate(groups):
            devices[o, list(g)] = True
        tensor = np.isin(layout, [LAYOUTS.index("col_split"), LAYOUTS.index("row_split")])
        state_div = np.where(tensor, tp, 1).astype(np.float64)
        speedup = (dp * np.where(tensor, tp, 1)).astype(np.float64)
        flops = np.array([d.flops(dtype) for d in topology.devices])
        min_flops = np.array([flops[list(g)].min() for g in groups])
        return cls(groups=groups, layout=layout, dp=dp, tp=tp, devices=devices, state_div=state_div,
                   speedup=speedup, min_flops=min_flops)

    def allowed(self, caps: np.ndarray) -> np.ndarray:
        """[nodes, options] bool: the layout is one the node's capability bits allow (and dp > 1 needs
        CAN_BATCH)."""
        caps = np.asarray(caps, dtype=np.int64)[:, None]
        lay = self.layout[None, :]
        ok = np.ones((caps.shape[0], self.size), dtype=bool)
        ok &= ~((lay == LAYOUTS.index("col_split")) & ((caps & CAN_COL) == 0))
        ok &= ~((lay == LAYOUTS.index("row_split")) & ((caps & CAN_ROW) == 0))
        ok &= ~((lay == LAYOUTS.index("replicate")) & ((caps & CAN_REPLICATE) == 0))
        ok &= ~(((self.dp[None, :] > 1) | (lay == LAYOUTS.index("batch_split"))) & ((caps & CAN_BATCH) == 0))
        return ok

    def lookup(self) -> dict[tuple[tuple[int, ...], str, int], int]:
        """(group, layout name, dp) -> option id."""
        return {(g, LAYOUTS[int(lay)], int(dp)): o for o, (g, lay, dp) in enumerate(zip(self.groups, self.layout,
                                                                                          self.dp))}


# ---------------------------------------------------------------------- orders
def decision_order(graph: OpGraph, order: str = "topological") -> np.ndarray:
    """The fixed order in which an episode decides the nodes.

    ``topological``: the graph's topological order. ``critical_path``: descending upward rank (HEFT,
    Topcuoglu et al. 2002: a node's FLOPs plus the heaviest path below it), ties by topological
    position. Both are topological orders (every producer before its consumers), so when a node is
    decided the placement of all its inputs is known."""
    topo = graph.topological_order()
    if order == "topological":
        return topo.copy()
    if order != "critical_path":
        raise ValueError(f"unknown order {order!r}; choose 'topological' or 'critical_path'")
    _, bottom = _levels(graph)
    pos = np.empty(graph.num_nodes, dtype=np.int64)
    pos[topo] = np.arange(graph.num_nodes)
    return np.lexsort((pos, -bottom)).astype(np.int64)


def _levels(graph: OpGraph) -> tuple[np.ndarray, np.ndarray]:
    """(top level, bottom level) by forward+backward FLOPs (plus a tiny epsilon so every node weighs)."""
    n = graph.num_nodes
    w = graph.fwd_flops + graph.bwd_flops
    w = w + 1e-9 * max(float(w.max()) if n else 1.0, 1.0)
    topo = graph.topological_order()
    pred = graph._pred_lists()
    succ: list[list[int]] = [[] for _ in range(n)]
    for s, t in zip(graph.edge_src.tolist(), graph.edge_dst.tolist()):
        succ[s].append(t)
    top = np.zeros(n)
    for v in topo.tolist():
        top[v] = max((top[p] + w[p] for p in pred[v]), default=0.0)
    bottom = np.zeros(n)
    for v in topo[::-1].tolist():
        bottom[v] = w[v] + max((bottom[s] for s in succ[v]), default=0.0)
    return top, bottom


# ---------------------------------------------------------------------- static features
@dataclass(eq=False)
class StaticFeatures:
    """Padded static arrays of one task (see the module docstring); ``arrays`` maps observation keys."""

    arrays: dict[str, np.ndarray]


def static_features(graph: OpGraph, topology: Topology, options: OptionTable, order: np.ndarray, *,
                    max_nodes: int, max_edges: int, max_devices: int, max_options: int,
                    caps: np.ndarray | None = None) -> StaticFeatures:
    n, m, nd, k = graph.num_nodes, graph.num_edges, topology.num_devices, options.size
    caps = graph.layout_caps if caps is None else caps
    f32 = np.float32
    flops = graph.fwd_flops + graph.bwd_flops
    depth = graph.depth().astype(np.float64)
    top, bottom = _levels(graph)
    w = flops + 1e-9 * max(float(flops.max()) if n else 1.0, 1.0)
    cp = float((top + w).max()) if n else 1.0
    indeg = np.bincount(graph.edge_dst, minlength=n)
    outdeg = np.bincount(graph.edge_src, minlength=n)
    pos = np.empty(n, dtype=np.int64)
    pos[order] = np.arange(n)
    node = np.zeros((max_nodes, NODE_FEATURES), dtype=f32)
    node[:n, 0] = _log(flops, 16)
    node[:n, 1] = _log(graph.param_bytes, 12)
    node[:n, 2] = _log(graph.out_bytes, 12)
    node[:n, 3] = flops / max(flops.sum(), 1e-30)
    node[:n, 4] = graph.param_bytes / max(graph.param_bytes.sum(), 1e-30)
    node[:n, 5] = graph.out_bytes / max(graph.out_bytes.sum(), 1e-30)
    node[:n, 6] = depth / max(depth.max() if n else 1.0, 1.0)
    node[:n, 7] = top / cp
    node[:n, 8] = bottom / cp
    node[:n, 9] = np.isclose(top + bottom, cp, rtol=1e-6)  # on the critical path (no slack)
    node[:n, 10] = (caps & CAN_BATCH) > 0
    node[:n, 11] = (caps & CAN_COL) > 0
    node[:n, 12] = (caps & CAN_ROW) > 0
    node[:n, 13] = graph.colocation >= 0
    node[:n, 14] = _log(graph.n_ops, 4)
    node[:n, 15] = np.log1p(indeg) / 3
    node[:n, 16] = np.log1p(outdeg) / 3
    node[:n, 17] = pos / max(n, 1)
    kinds = np.array([op_kind_id(kd) for kd in graph.kinds], dtype=np.int64)
    node[np.arange(n), 18 + kinds] = 1.0
    node_mask = np.zeros(max_nodes, dtype=f32)
    node_mask[:n] = 1
    edge_index = np.zeros((2, max_edges), dtype=f32)
    edge_index[0, :m] = graph.edge_src
    edge_index[1, :m] = graph.edge_dst
    edge = np.zeros((max_edges, EDGE_FEATURES), dtype=f32)
    edge[:m, 0] = _log(graph.edge_bytes, 12)
    edge[:m, 1] = graph.edge_bytes / max(graph.edge_bytes.sum(), 1e-30)
    edge_mask = np.zeros(max_edges, dtype=f32)
    edge_mask[:m] = 1
    dt = graph.dtype if graph.dtype in DTYPE_BYTES else "bf16"
    dflops = np.array([d.flops(dt) for d in topology.devices])
    dmem = np.array([d.memory_bytes for d in topology.devices])
    dbw = np.array([d.bandwidth() for d in topology.devices])
    hosts = np.array([d.host for d in topology.devices], dtype=np.float64)
    _, host_idx = np.unique(hosts, return_inverse=True)
    dev = np.zeros((max_devices, DEVICE_FEATURES), dtype=f32)
    dev[:nd, 0] = _log(dflops, 16)
    dev[:nd, 1] = _log(dmem, 12)
    dev[:nd, 2] = _log(dbw, 13)
    dev[:nd, 3] = host_idx / max(host_idx.max(), 1)
    dev[:nd, 4] = dflops / dflops.max()
    dev[:nd, 5] = dmem / dmem.max()
    device_mask = np.zeros(max_devices, dtype=f32)
    device_mask[:nd] = 1
    bw = np.array(topology.bandwidth_matrix, dtype=np.float64)
    bw[~np.isfinite(bw)] = 1e13  # a device to itself: faster than any link
    lat = np.array(topology.latency_matrix, dtype=np.float64)
    dev_bw = np.zeros((max_devices, max_devices), dtype=f32)
    dev_bw[:nd, :nd] = _log(bw, 12)
    dev_lat = np.zeros((max_devices, max_devices), dtype=f32)
    dev_lat[:nd, :nd] = np.log10(1.0 + lat * 1e6) / 2
    opt = np.zeros((max_options, OPTION_FEATURES), dtype=f32)
    size = np.array([len(g) for g in options.groups], dtype=np.float64)
    span = np.array([len(topology.hosts_of(g)) for g in options.groups], dtype=np.float64)
    opt[:k, 0] = np.log2(size) / np.log2(max(max_devices, 2))
    opt[:k, 1] = size / nd
    opt[:k, 2] = options.dp / size
    opt[:k, 3] = options.tp / size
    opt[:k, 4] = span / max(host_idx.max() + 1, 1)
    opt[:k, 5] = np.log2(options.speedup) / np.log2(max(max_devices, 2))
    opt[np.arange(k), 6 + options.layout] = 1.0
    opt_dev = np.zeros((max_options, max_devices), dtype=f32)
    opt_dev[:k, :nd] = options.devices
    option_mask = np.zeros(max_options, dtype=f32)
    option_mask[:k] = 1
    arrays = {"node_features": node, "node_mask": node_mask, "edge_index": edge_index, "edge_features": edge,
              "edge_mask": edge_mask, "device_features": dev, "device_mask": device_mask, "device_bandwidth": dev_bw,
              "device_latency": dev_lat, "option_features": opt, "option_devices": opt_dev,
              "option_mask": option_mask}
    for key, a in arrays.items():
        np.clip(a, -FEATURE_BOUND, FEATURE_BOUND, out=a)
        if not np.isfinite(a).all():  # pragma: no cover - guards against a bad graph or topology
            raise ValueError(f"non-finite static feature {key!r}")
    return StaticFeatures(arrays=arrays)


# ---------------------------------------------------------------------- dynamic state
class DynamicState:
    """The per-episode features, updated in place as nodes are assigned (O(D) per assignment).

    ``node_state`` columns: placed, being decided, option id / max_options, group size / devices, then
    the assigned layout one-hot. ``node_devices`` is the node's share on each device (1/|group|).
    ``device_state`` columns: estimated compute load (share of the total single-device time), model
    states placed / capacity, nodes placed / nodes. ``option_state`` (for the node being decided) columns:
    the worst member's model-state memory after taking the option / capacity, log2 of the option's
    estimated time for the node relative to the fastest single device (negative: faster), and the
    share of the node's input bytes already on the option's devices."""

    def __init__(self, max_nodes: int, max_devices: int, max_options: int, n_globals: int):
        f32 = np.float32
        self.max_nodes, self.max_devices, self.max_options = max_nodes, max_devices, max_options
        self.node_state = np.zeros((max_nodes, NODE_STATE_FEATURES), dtype=f32)
        self.node_devices = np.zeros((max_nodes, max_devices), dtype=f32)
        self.device_state = np.zeros((max_devices, DEVICE_STATE_FEATURES), dtype=f32)
        self.option_state = np.zeros((max_options, OPTION_STATE_FEATURES), dtype=f32)
        self.current_node = np.zeros(max_nodes, dtype=f32)
        self.phase = np.zeros(len(PHASES), dtype=f32)
        self.globals = np.zeros(n_globals, dtype=f32)
        self.action_mask = np.zeros(max_options, dtype=f32)
        self._current = -1

    def reset(self) -> None:
        for a in (self.node_state, self.node_devices, self.device_state, self.option_state, self.current_node,
                  self.phase, self.globals, self.action_mask):
            a.fill(0)
        self._current = -1

    def set_current(self, v: int) -> None:
        if self._current >= 0:
            self.current_node[self._current] = 0
            self.node_state[self._current, 1] = 0
        self._current = v
        if v >= 0:
            self.current_node[v] = 1
            self.node_state[v, 1] = 1

    def set_assignment(self, v: int, option: int, layout: int, size_frac: float, dev_frac_row: np.ndarray) -> None:
        row = self.node_state[v]
        row[0] = 1
        row[2] = option / self.max_options
        row[3] = size_frac
        row[4:] = 0
        row[4 + layout] = 1
        self.node_devices[v, :dev_frac_row.shape[0]] = dev_frac_row

    def arrays(self) -> dict[str, np.ndarray]:
        """Copies of the dynamic arrays (safe to keep after the next step)."""
        return {"node_state": self.node_state.copy(), "node_devices": self.node_devices.copy(),
                "device_state": self.device_state.copy(), "option_state": self.option_state.copy(),
                "current_node": self.current_node.copy(), "phase": self.phase.copy(),
                "globals": self.globals.copy(), "action_mask": self.action_mask.copy()}


def observation_space(max_nodes: int, max_edges: int, max_devices: int, max_options: int,
                      n_globals: int) -> gym.spaces.Dict:
    """The flat Dict of bounded float32 Boxes the environments emit."""
    b = FEATURE_BOUND

    def box(shape, low=-b, high=b):
        return gym.spaces.Box(low=low, high=high, shape=shape, dtype=np.float32)

    return gym.spaces.Dict({
        "node_features": box((max_nodes, NODE_FEATURES)),
        "node_mask": box((max_nodes,), 0.0, 1.0),
        "edge_index": box((2, max_edges), 0.0, float(max(max_nodes - 1, 1))),
        "edge_features": box((max_edges, EDGE_FEATURES)),
        "edge_mask": box((max_edges,), 0.0, 1.0),
        "device_features": box((max_devices, DEVICE_FEATURES)),
        "device_mask": box((max_devices,), 0.0, 1.0),
        "device_bandwidth": box((max_devices, max_devices)),
        "device_latency": box((max_devices, max_devices)),
        "option_features": box((max_options, OPTION_FEATURES)),
        "option_devices": box((max_options, max_devices), 0.0, 1.0),
        "option_mask": box((max_options,), 0.0, 1.0),
        "node_state": box((max_nodes, NODE_STATE_FEATURES), 0.0, 1.0),
        "node_devices": box((max_nodes, max_devices), 0.0, 1.0),
        "device_state": box((max_devices, DEVICE_STATE_FEATURES)),
        "option_state": box((max_options, OPTION_STATE_FEATURES)),
        "current_node": box((max_nodes,), 0.0, 1.0),
        "phase": box((len(PHASES),), 0.0, 1.0),
        "globals": box((n_globals,), 0.0, 1.0),
        "action_mask": box((max_options,), 0.0, 1.0),
    })
