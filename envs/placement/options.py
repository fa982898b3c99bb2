"""What a node group can be assigned, and in which order an episode decides the groups.

The option table (:class:`OptionTable`) lists every (device group, layout) a node may take: each single
device with ``single``; each group of ``topology.hierarchy_groups()`` with ``batch_split`` (dp = group
size), ``col_split``, ``row_split`` and ``replicate`` (tensor parallel: tp = group size inside one host;
a group spanning hosts uses tp = devices per host and dp = number of hosts, i.e. tensor parallelism on
NVLink and data parallelism across the network, as Megatron-LM places them). The single-device options
come first, in device order, so option ``d < num_devices`` is device ``d`` alone.

:func:`decision_order` is the fixed order of the node decisions (:data:`ORDERS`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from envs.graph import CAN_BATCH, CAN_COL, CAN_REPLICATE, CAN_ROW, OpGraph
from envs.plan import LAYOUTS
from envs.topology import Topology

ORDERS = ("topological", "critical_path")


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
