"""The observation of ``rlplace/Placement-v0``: declared once, then computed (static) or updated (dynamic).

:data:`OBSERVATION` declares every key of the flat ``gymnasium.spaces.Dict`` the environment emits (as
circuit_training's ``observation_config.py`` does): its padded shape, with axes named by what they
index (``nodes``, ``edges``, ``devices``, ``options`` = placement rows, ``modifiers``, ``actions`` =
options x modifiers, ``globals``) or fixed widths, its bounds, and whether it is **static**
(:data:`STATIC_KEYS`: a function of the task and the padding, computed once per task by
:func:`static_features`) or **dynamic** (:data:`DYNAMIC_KEYS`: changes during an episode, kept by
:class:`DynamicState`). :func:`observation_space` builds the space from it; the policy
(:mod:`agent.policy`) and the rollouts (:mod:`agent.infer`) read the same declaration.

- **Static**: node features (log-scaled FLOPs, parameter, activation and saved bytes, shares of the
  totals, depth, critical-path position, layout capabilities, co-location, attention-core share,
  experts, sequence splittability, hashed op kind), edge index with log bytes, device features (log
  FLOP/s, memory, memory bandwidth, host), pairwise log bandwidth and latency, the placement table's
  features (group size, layout one-hot, dp / tp, hosts spanned, compute split, which devices as a
  multi-hot row), the modifier table's features (ZeRO stage, recomputation, expert parallelism), and the
  node / edge / device / option masks.
- **Dynamic**: updated incrementally, O(devices + actions) per step — the current assignment of each
  node (placement id, layout, modifier, share on each device), the node being decided (one-hot),
  per-device compute load, model-state and activation memory so far, per-placement features for the
  node being decided (model-state memory after placing it, estimated compute speed-up, input
  locality), per-action features (memory after placing it with the modifier, its compute factor), the
  phase, the global choices and the action mask.

Every array is float32, padded to ``max_nodes`` / ``max_edges`` / ``max_devices`` / ``max_options``
with 0/1 masks, and bounded, so the observation is a flat Dict of finite ``Box`` es.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import gymnasium as gym
import numpy as np

from envs.graph import CAN_BATCH, CAN_COL, CAN_ROW, OpGraph
from envs.placement.options import MODIFIER_FEATURES, N_MODIFIERS, OptionTable, flop_levels, modifier_features
from envs.plan import DTYPE_BYTES, LAYOUTS, SCHEDULES
from envs.topology import Topology

KIND_VOCAB = 16  # op kinds hashed into this many buckets (one-hot)
NODE_FEATURES = 23 + KIND_VOCAB
EDGE_FEATURES = 2
DEVICE_FEATURES = 6
OPTION_LAYOUTS = LAYOUTS  # every layout of the plan is a placement of the environment
OPTION_FEATURES = 6 + len(OPTION_LAYOUTS)
NODE_STATE_FEATURES = 4 + len(OPTION_LAYOUTS) + MODIFIER_FEATURES
DEVICE_STATE_FEATURES = 4
OPTION_STATE_FEATURES = 3
ACTION_STATE_FEATURES = 4
VIRTUAL_STAGE_CHOICES = (1, 2, 3, 4)  # interleaving degrees the last global decision chooses from
PHASES = ("microbatches", "schedule", "place", "virtual_stages")
PLACE_PHASE = PHASES.index("place")
GLOBAL_PHASES = tuple(i for i, p in enumerate(PHASES) if p != "place")
GLOBAL_CHOICES = 16  # actions 0..15 carry a global decision's choices (microbatches, schedule, stages)
# The default microbatch counts, steps of x1.5 / x1.33 (each stands for the divisor of the batch nearest to it):
# with powers of two alone a batch of 240 on two data-parallel replicas has no count between 8 (too large a
# microbatch for memory) and 30 (Megatron's fewest that fit is 10-15: 12 here stands for 12 microbatches of 20)
MICROBATCH_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
FEATURE_BOUND = 16.0  # every feature is clipped to [-FEATURE_BOUND, FEATURE_BOUND]
NODE_INDEX = "node index"  # an upper bound: the largest node slot (max_nodes - 1)


@dataclass(frozen=True)
class Key:
    """One observation array: padded shape (axis names or widths), bounds, and static or dynamic."""

    shape: tuple[str | int, ...]
    low: float = -FEATURE_BOUND
    high: float | str = FEATURE_BOUND
    static: bool = False


def _static(*shape, low: float = -FEATURE_BOUND, high: float | str = FEATURE_BOUND) -> Key:
    return Key(tuple(shape), low, high, static=True)


def _dynamic(*shape, low: float = -FEATURE_BOUND, high: float | str = FEATURE_BOUND) -> Key:
    return Key(tuple(shape), low, high, static=False)


OBSERVATION: dict[str, Key] = {
    # static: the task (graph, topology, placement and modifier tables) at this padding
    "node_features": _static("nodes", NODE_FEATURES),
    "node_mask": _static("nodes", low=0.0, high=1.0),
    "edge_index": _static(2, "edges", low=0.0, high=NODE_INDEX),
    "edge_features": _static("edges", EDGE_FEATURES),
    "edge_mask": _static("edges", low=0.0, high=1.0),
    "device_features": _static("devices", DEVICE_FEATURES),
    "device_mask": _static("devices", low=0.0, high=1.0),
    "device_bandwidth": _static("devices", "devices"),
    "device_latency": _static("devices", "devices"),
    "option_features": _static("options", OPTION_FEATURES),
    "option_devices": _static("options", "devices", low=0.0, high=1.0),
    "option_mask": _static("options", low=0.0, high=1.0),
    "modifier_features": _static("modifiers", MODIFIER_FEATURES, low=0.0, high=1.0),
    # dynamic: the episode so far
    "node_state": _dynamic("nodes", NODE_STATE_FEATURES, low=0.0, high=1.0),
    "node_devices": _dynamic("nodes", "devices", low=0.0, high=1.0),
    "device_state": _dynamic("devices", DEVICE_STATE_FEATURES),
    "option_state": _dynamic("options", OPTION_STATE_FEATURES),
    "action_state": _dynamic("options", "modifiers", ACTION_STATE_FEATURES),
    "current_node": _dynamic("nodes", low=0.0, high=1.0),
    "phase": _dynamic(len(PHASES), low=0.0, high=1.0),
    "globals": _dynamic("globals", low=0.0, high=1.0),
    "action_mask": _dynamic("actions", low=0.0, high=1.0),
}
STATIC_KEYS = tuple(k for k, key in OBSERVATION.items() if key.static)
DYNAMIC_KEYS = tuple(k for k, key in OBSERVATION.items() if not key.static)


def globals_width(n_microbatch_choices: int) -> int:
    """Length of ``globals``: microbatch one-hot, schedule one-hot, virtual-stage one-hot, and the
    episode's progress."""
    return n_microbatch_choices + len(SCHEDULES) + len(VIRTUAL_STAGE_CHOICES) + 1


def axis_sizes(max_nodes: int, max_edges: int, max_devices: int, max_options: int, n_globals: int) -> dict[str, int]:
    """The size of every named axis for a padding."""
    return {"nodes": max_nodes, "edges": max_edges, "devices": max_devices, "options": max_options,
            "modifiers": N_MODIFIERS, "actions": max_options * N_MODIFIERS, "globals": n_globals}


def padded_shape(key: str, sizes: dict[str, int]) -> tuple[int, ...]:
    """The shape of ``key`` for the axis sizes ``sizes`` (:func:`axis_sizes`)."""
    return tuple(sizes[a] if isinstance(a, str) else a for a in OBSERVATION[key].shape)


def observation_space(max_nodes: int, max_edges: int, max_devices: int, max_options: int,
                      n_globals: int) -> gym.spaces.Dict:
    """The flat Dict of bounded float32 Boxes the environment emits (:data:`OBSERVATION`)."""
    sizes = axis_sizes(max_nodes, max_edges, max_devices, max_options, n_globals)

    def box(name: str, key: Key) -> gym.spaces.Box:
        high = float(max(max_nodes - 1, 1)) if key.high == NODE_INDEX else key.high
        return gym.spaces.Box(low=key.low, high=high, shape=padded_shape(name, sizes), dtype=np.float32)

    return gym.spaces.Dict({name: box(name, key) for name, key in OBSERVATION.items()})


# ---------------------------------------------------------------------- static features
@dataclass(frozen=True)
class GroupStats:
    """What the features and the masks need to know about each node (group) beyond the OpGraph: from the
    operators it stands for (``envs.placement.task_setup.group_stats``)."""

    core_fwd_flops: np.ndarray  # forward FLOPs of its attention-core ops (what selective recomputes)
    core_saved_bytes: np.ndarray  # activation bytes those ops save (what selective frees)
    has_core: np.ndarray  # bool: selective recomputation applies
    expert_count: np.ndarray  # experts in its mixture-of-experts layer (0: no experts in it)
    seq_ok: np.ndarray  # bool: every op of it may be sequence-split
    act_bytes: np.ndarray  # activations stashed per traced batch (outputs + saved)
    in_bytes: np.ndarray  # bytes it reads from other groups per traced batch (what full recomputation keeps)


def static_features(graph: OpGraph, topology: Topology, options: OptionTable, order: np.ndarray, stats: GroupStats,
                    *, max_nodes: int, max_edges: int, max_devices: int, max_options: int,
                    caps: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The :data:`STATIC_KEYS` arrays of one task, padded, bounded and finite (see the module docstring)."""
    n, m, nd, k = graph.num_nodes, graph.num_edges, topology.num_devices, options.size
    caps = graph.layout_caps if caps is None else caps
    f32 = np.float32
    flops = graph.fwd_flops + graph.bwd_flops
    depth = graph.depth().astype(np.float64)
    top, bottom = flop_levels(graph)
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
    node[:n, 18] = stats.core_fwd_flops / np.maximum(graph.fwd_flops, 1e-30)
    node[:n, 19] = stats.expert_count > 0
    node[:n, 20] = stats.seq_ok
    node[:n, 21] = _log(stats.act_bytes, 12)
    node[:n, 22] = stats.act_bytes / max(stats.act_bytes.sum(), 1e-30)
    kinds = np.array([op_kind_id(kd) for kd in graph.kinds], dtype=np.int64)
    node[np.arange(n), 23 + kinds] = 1.0
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
              "option_mask": option_mask, "modifier_features": modifier_features()}
    for key, a in arrays.items():
        np.clip(a, -FEATURE_BOUND, FEATURE_BOUND, out=a)
        if not np.isfinite(a).all():  # pragma: no cover - guards against a bad graph or topology
            raise ValueError(f"non-finite static feature {key!r}")
    return arrays


def _log(x, scale: float) -> np.ndarray:
    """log10(1 + x) / scale: FLOPs use scale 16 (1e16 -> 1), bytes 12 (1 TB -> 1)."""
    return np.log10(1.0 + np.maximum(np.asarray(x, dtype=np.float64), 0.0)) / scale


def op_kind_id(kind: str, vocab: int = KIND_VOCAB) -> int:
    """A stable hash of an op kind into ``vocab`` buckets (crc32: the same across processes and runs)."""
    return zlib.crc32(kind.lower().encode()) % vocab


# ---------------------------------------------------------------------- dynamic state
class DynamicState:
    """The :data:`DYNAMIC_KEYS` arrays of an episode, updated in place (O(D) per assignment).

    ``node_state`` columns: placed, being decided, placement id / max_options, group size / devices, the
    assigned layout one-hot, then the assigned modifier's features. ``node_devices`` is the node's share
    on each device (1/|group|). ``device_state`` columns: estimated compute load (share of the total
    single-device time), model states placed / capacity, activations placed / capacity, nodes placed /
    nodes. ``option_state`` (for the node being decided, per placement): the worst member's model-state
    memory after taking it (no modifier) / capacity, log2 of its estimated time for the node relative to
    the fastest single device (negative: faster), and the share of the node's input bytes already on its
    devices. ``action_state`` (per placement and modifier): the worst member's memory (model states and
    activations) after taking it / capacity, how far that exceeds the capacity (0 when it fits), log2 of
    the node's compute time factor under the modifier (recomputation adds a forward) and log2 of its
    gradient-synchronisation volume factor (ZeRO-3 gathers the weights too: 1.5x data parallelism's,
    Rajbhandari et al. SC'20). ``globals``: see :func:`globals_width`."""

    node_state: np.ndarray
    node_devices: np.ndarray
    device_state: np.ndarray
    option_state: np.ndarray
    action_state: np.ndarray
    current_node: np.ndarray
    phase: np.ndarray
    globals: np.ndarray
    action_mask: np.ndarray

    def __init__(self, max_nodes: int, max_devices: int, max_options: int, n_microbatch_choices: int):
        self.max_nodes, self.max_devices, self.max_options = max_nodes, max_devices, max_options
        self.n_microbatch_choices = int(n_microbatch_choices)
        sizes = axis_sizes(max_nodes, 4 * max_nodes, max_devices, max_options,
                           globals_width(self.n_microbatch_choices))
        for k in DYNAMIC_KEYS:
            setattr(self, k, np.zeros(padded_shape(k, sizes), dtype=np.float32))
        self._arrays = tuple((k, getattr(self, k)) for k in DYNAMIC_KEYS)
        self._current = -1
        self._modifier_rows = modifier_features()

    def reset(self) -> None:
        for _, a in self._arrays:
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

    def set_phase(self, phase: int) -> None:
        self.phase.fill(0)
        self.phase[phase] = 1

    def set_assignment(self, v: int, option: int, layout: int, modifier: int, size_frac: float,
                       dev_frac_row: np.ndarray) -> None:
        row = self.node_state[v]
        row[0] = 1
        row[2] = option / self.max_options
        row[3] = size_frac
        row[4:] = 0
        row[4 + layout] = 1
        row[4 + len(OPTION_LAYOUTS):] = self._modifier_rows[modifier]
        self.node_devices[v, :dev_frac_row.shape[0]] = dev_frac_row

    def set_globals(self, mb_idx: int, schedule: int, virtual_stages: int, progress: float) -> None:
        """The global choices so far (-1: not yet decided) and the share of the episode done."""
        gl = self.globals
        gl.fill(0)
        nm = self.n_microbatch_choices
        if mb_idx >= 0:
            gl[mb_idx] = 1
        if schedule >= 0:
            gl[nm + schedule] = 1
        if virtual_stages >= 0:
            gl[nm + len(SCHEDULES) + virtual_stages] = 1
        gl[-1] = progress

    def set_done(self) -> None:
        """The episode is over: no node, no phase, only action 0 "allowed"."""
        self.set_current(-1)
        self.phase.fill(0)
        self.action_mask.fill(0)
        self.action_mask[0] = 1

    def arrays(self) -> dict[str, np.ndarray]:
        """Copies of the dynamic arrays (safe to keep after the next step)."""
        return {k: a.copy() for k, a in self._arrays}
