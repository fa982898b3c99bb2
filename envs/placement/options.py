"""What a node group can be assigned, and in which order an episode decides the groups.

A node group's choice is an *action* = a **placement** row x a **modifier** row:

- the placement table (:class:`OptionTable`) lists every (device group, layout, dp, tp) a node may take:
  each single device with ``single``; each group of ``topology.hierarchy_groups()`` with ``batch_split``
  (dp = group size) and, for every tensor-parallel degree tp >= 2 that divides the group's devices on
  each of its hosts (tensor parallelism stays inside a host, as Megatron-LM places it), ``col_split``,
  ``row_split``, ``replicate`` and ``seq_split`` (sequence parallelism) with dp = group size / tp. The
  single-device rows come first, in device order, so placement ``d < num_devices`` is device ``d`` alone;
- the modifier table (:data:`MODIFIERS`) lists the per-group memory/communication choices: the ZeRO
  stage over the group's data-parallel replicas (0-3, Rajbhandari et al. SC'20), activation
  recomputation (``none``, ``selective`` = the group's attention-core ops, Korthikanti et al. 2022, or
  ``full``) and expert parallelism (the group's experts spread over its data-parallel ranks). Modifier 0
  is (ZeRO 0, no recomputation, no expert parallelism).

Action ``a`` = ``placement * len(MODIFIERS) + modifier`` (:func:`action_of`, :func:`split_action`).
New choices are new rows of either table with their features (:func:`modifier_features`), so the same
policy network scores a larger space.

:func:`decision_order` is the fixed order of the node decisions (:data:`ORDERS`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from envs.graph import CAN_BATCH, CAN_COL, CAN_REPLICATE, CAN_ROW, OpGraph
from envs.plan import LAYOUTS, RECOMPUTE
from envs.topology import Topology

ORDERS = ("topological", "critical_path")
TENSOR_LAYOUTS = ("col_split", "row_split", "replicate", "seq_split")


@dataclass(frozen=True)
class Modifier:
    """One modifier row: ZeRO stage, recomputation mode, expert parallelism (ep =
    :func:`expert_parallel_degree` of the group's dp and its layer's experts)."""

    zero: int
    recompute: str
    expert_parallel: bool


# ZeRO 0-3 x recomputation; expert parallelism only with ZeRO 0 (with ep = dp every expert has one replica,
# which ZeRO cannot shard over; with ep < dp a few replicas, whose sharding the rows leave to the placers)
MODIFIERS: tuple[Modifier, ...] = tuple(
    [Modifier(z, rc, False) for z in (0, 1, 2, 3) for rc in RECOMPUTE]
    + [Modifier(0, rc, True) for rc in RECOMPUTE])
N_MODIFIERS = len(MODIFIERS)
MODIFIER_FEATURES = 4 + len(RECOMPUTE) + 1


def expert_parallel_degree(dp, experts):
    """The expert-parallel degree of an expert-parallel modifier: the largest degree that divides both the
    data-parallel degree and the layer's experts (Megatron-LM's and DeepSpeed-MoE's constraints: ep divides
    dp and the experts), e.g. 8 experts over dp 16 -> ep 8, two replicas of each expert; 1 outside experts."""
    dp, experts = np.asarray(dp, dtype=np.int64), np.asarray(experts, dtype=np.int64)
    return np.where(experts > 0, np.gcd(np.maximum(dp, 1), experts), 1)


def modifier_features() -> np.ndarray:
    """[modifiers, MODIFIER_FEATURES] float32: ZeRO stage one-hot, recomputation one-hot, expert parallel."""
    out = np.zeros((N_MODIFIERS, MODIFIER_FEATURES), dtype=np.float32)
    for k, m in enumerate(MODIFIERS):
        out[k, m.zero] = 1.0
        out[k, 4 + RECOMPUTE.index(m.recompute)] = 1.0
        out[k, -1] = float(m.expert_parallel)
    return out


def action_of(placement: int, modifier: int = 0) -> int:
    return int(placement) * N_MODIFIERS + int(modifier)


def split_action(action: int) -> tuple[int, int]:
    """(placement, modifier) of an action."""
    return divmod(int(action), N_MODIFIERS)


def option_bound(max_devices: int) -> int:
    """A generous bound on the placement rows of a topology with ``max_devices`` devices (the default
    ``max_options`` padding): a single-host group of 8 gives 1 + 4 x 3 rows, its halves and quarters
    fewer, and every host level above adds one group per level."""
    return 10 * int(max_devices) + 16


# ---------------------------------------------------------------------- placement table
@dataclass(eq=False)
class OptionTable:
    """The (device group, layout, dp, tp) placements a node can take on one topology.

    Arrays are indexed by placement: ``groups[o]`` the device tuple (dp-major), ``layout[o]`` an index into
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

    @property
    def num_actions(self) -> int:
        return self.size * N_MODIFIERS

    @classmethod
    def build(cls, topology: Topology, dtype: str = "bf16", batch: int | None = None) -> OptionTable:
        """The table of ``topology``; with ``batch``, also the groups it needs to split evenly
        (:func:`device_groups`)."""
        nd = topology.num_devices
        rows: list[tuple[tuple[int, ...], int, int]] = [((d,), LAYOUTS.index("single"), 1) for d in range(nd)]
        for g in device_groups(topology, batch):
            g = tuple(int(d) for d in g)
            n = len(g)
            per_host = min(len(v) for v in topology.hosts_of(g).values())
            rows.append((g, LAYOUTS.index("batch_split"), n))
            for tp in tensor_degrees(n, per_host):
                for lay in TENSOR_LAYOUTS:
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
        speedup = (dp * np.where(tensor | (layout == LAYOUTS.index("seq_split")), tp, 1)).astype(np.float64)
        flops = np.array([d.flops(dtype) for d in topology.devices])
        min_flops = np.array([flops[list(g)].min() for g in groups])
        return cls(groups=groups, layout=layout, dp=dp, tp=tp, devices=devices, state_div=state_div,
                   speedup=speedup, min_flops=min_flops)

    def allowed(self, caps: np.ndarray, seq_ok: np.ndarray | None = None) -> np.ndarray:
        """[nodes, placements] bool: the layout is one the node's capability bits allow (dp > 1 needs
        CAN_BATCH; ``seq_split`` needs ``seq_ok``, the node may be sequence-split)."""
        caps = np.asarray(caps, dtype=np.int64)[:, None]
        lay = self.layout[None, :]
        ok = np.ones((caps.shape[0], self.size), dtype=bool)
        ok &= ~((lay == LAYOUTS.index("col_split")) & ((caps & CAN_COL) == 0))
        ok &= ~((lay == LAYOUTS.index("row_split")) & ((caps & CAN_ROW) == 0))
        ok &= ~((lay == LAYOUTS.index("replicate")) & ((caps & CAN_REPLICATE) == 0))
        ok &= ~(((self.dp[None, :] > 1) | (lay == LAYOUTS.index("batch_split"))) & ((caps & CAN_BATCH) == 0))
        seq = np.zeros(caps.shape[0], dtype=bool) if seq_ok is None else np.asarray(seq_ok, dtype=bool)
        ok &= ~((lay == LAYOUTS.index("seq_split")) & ~seq[:, None])
        return ok

    def lookup(self) -> dict[tuple[tuple[int, ...], str, int], int]:
        """(group, layout name, dp) -> placement id."""
        return {(g, LAYOUTS[int(lay)], int(dp)): o for o, (g, lay, dp) in enumerate(zip(self.groups, self.layout,
                                                                                          self.dp))}


def device_groups(topology: Topology, batch: int | None = None) -> list[tuple[int, ...]]:
    """The multi-device groups of the placement table: ``topology.hierarchy_groups()`` (each host's
    devices in powers of two, hosts, all) and the same hierarchy over each device kind alone (a host's
    GPUs without its CPU, all the GPUs of the cluster), without repeats; then, with ``batch``, for all
    devices and each kind's devices when the batch does not split evenly over them, their first k with
    k the largest divisor of the batch (data parallelism over 15 of 16 GPUs for a batch of 120, as
    PyTorch DDP users run it; whole hosts first, so the last host gives up devices)."""
    groups = list(topology.hierarchy_groups())
    seen = set(groups)
    kinds = topology.devices_by_kind()
    if len(kinds) > 1:
        for members in kinds.values():
            hosts = topology.hosts_of(members)
            host_list = list(hosts.values())
            cands = [tuple(h) for h in host_list if len(h) > 1]
            size = 2
            while size <= len(host_list):
                cands += [tuple(d for h in host_list[s:s + size] for d in h)
                          for s in range(0, len(host_list) - size + 1, size)]
                size *= 2
            cands.append(tuple(members))
            for g in cands:
                if len(g) > 1 and g not in seen:
                    groups.append(g)
                    seen.add(g)
    if batch is not None and batch > 0:  # last, so the other rows keep their indices
        tops = [tuple(range(topology.num_devices))] + ([tuple(m) for m in kinds.values()] if len(kinds) > 1 else [])
        for top in tops:
            k = max((k for k in range(2, len(top)) if batch % k == 0), default=0) if batch % len(top) else 0
            if k and top[:k] not in seen:
                groups.append(top[:k])
                seen.add(top[:k])
    return groups


def tensor_degrees(n: int, per_host: int) -> list[int]:
    """The tensor-parallel degrees of a group of ``n`` devices with ``per_host`` on its smallest host:
    every tp >= 2 dividing ``per_host`` (tp stays inside a host) and ``n``."""
    return [tp for tp in range(2, per_host + 1) if per_host % tp == 0 and n % tp == 0]


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
    _, bottom = flop_levels(graph)
    pos = np.empty(graph.num_nodes, dtype=np.int64)
    pos[topo] = np.arange(graph.num_nodes)
    return np.lexsort((pos, -bottom)).astype(np.int64)


def flop_levels(graph: OpGraph) -> tuple[np.ndarray, np.ndarray]:
    """(top level, bottom level) by forward+backward FLOPs (plus a tiny epsilon so every node weighs):
    the heaviest path above a node (excluding it) and from it to a sink (including it)."""
    n = graph.num_nodes
    w = graph.fwd_flops + graph.bwd_flops
    w = w + 1e-9 * max(float(w.max()) if n else 1.0, 1.0)
    topo = graph.topological_order()
    pred = graph.predecessor_lists()
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


ZERO_ROWS = np.array([m.zero > 0 for m in MODIFIERS], dtype=bool)  # modifiers that need data parallelism
EXPERT_ROWS = np.array([m.expert_parallel for m in MODIFIERS], dtype=bool)
# log2 of a modifier's gradient-synchronisation volume over data parallelism's all-reduce: ZeRO-3 also
# all-gathers the weights for the forward and the backward, 1.5x the volume (Rajbhandari et al. SC'20,
# Sec. 7.2.2); stages 1 and 2 reduce-scatter and all-gather what the all-reduce moves (1x)
COMM_FACTOR = np.array([np.log2(1.5) if m.zero == 3 else 0.0 for m in MODIFIERS])
