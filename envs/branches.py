"""Concurrent branches of a DAG: the parts of a multi-branch model (two towers, a multimodal model's
modalities, a recommendation model's dense and sparse arms) that no path orders, so that disjoint device
groups can run them at the same time.

A node comparable with every other node (each other node is its ancestor or its descendant) is a
*junction*: a residual block's operators, a chain's, the ops where branches meet. The other nodes fall
into connected components (over the edges between two non-junction nodes); the components between the
same two junctions form a *region*, and a region's components are its concurrent branches."""

from __future__ import annotations

import numpy as np

from envs.graph import OpGraph

# a region's branches are major when those beyond the heaviest carry at least this share of the step's load
# (:func:`step_load`): a two-tower model's towers are, a few parallel projections in a layer are not
MIN_BRANCH_LOAD = 0.10


# a module's concurrent children (an HRNet stage's resolution branches, a multi-task model's heads) are kept apart
# in the grouping when those beyond the heaviest carry at least this share of the step's load; a layer's gate and
# up projections (about 1% in an 8-layer Llama) are not
MIN_SIBLING_LOAD = 0.02


def reachable(graph: OpGraph, downstream: bool = True) -> list[int]:
    """Per node, the bitset (an int) of its descendants (``downstream``) or ancestors, in one pass."""
    n = graph.num_nodes
    order = graph.topological_order().tolist()
    nxt: list[list[int]] = [[] for _ in range(n)]
    src, dst = graph.edge_src.tolist(), graph.edge_dst.tolist()
    for a, b in zip(src, dst) if downstream else zip(dst, src):
        nxt[a].append(b)
    bits = [0] * n
    for v in reversed(order) if downstream else order:
        for w in nxt[v]:
            bits[v] |= bits[w] | (1 << w)
    return bits


def junctions(graph: OpGraph) -> np.ndarray:
    """Bool per node: comparable with every other node (reachability as bitsets, one pass each way)."""
    n = graph.num_nodes
    desc, anc = reachable(graph), reachable(graph, downstream=False)
    return np.array([(desc[v] | anc[v]).bit_count() == n - 1 for v in range(n)], dtype=bool)


def concurrent_children(graph: OpGraph, parent: np.ndarray, child: np.ndarray, load: np.ndarray,
                        min_load: float = MIN_SIBLING_LOAD, min_child_load: float = 0.0,
                        reach: tuple[list[int], list[int]] | None = None) -> np.ndarray:
    """Per node, its ``child`` label where that child runs concurrently with a sibling, else -1.

    ``parent`` and ``child`` label each node's module at two successive depths (``child`` -1: a node of the
    parent itself). Two children of one parent are concurrent when no path joins their nodes either way.
    A child lighter than ``min_child_load`` of the graph's total ``load`` (per node) is not kept apart (it
    would not fill a group of its own), and a parent's concurrent children count only when those beyond
    the heaviest carry at least ``min_load`` of it: where running them side by side can matter. ``reach``:
    :func:`reachable`'s (descendants, ancestors) bitsets, when the caller has them."""
    out = np.full(graph.num_nodes, -1, dtype=np.int64)
    total = max(float(load.sum()), 1e-300)
    members: dict[int, dict[int, list[int]]] = {}
    for v, (p, c) in enumerate(zip(parent.tolist(), child.tolist())):
        if c >= 0:
            members.setdefault(p, {}).setdefault(c, []).append(v)
    share = {(p, c): float(load[vs].sum()) / total for p, kids in members.items() for c, vs in kids.items()}

    def carry(weights: list[float]) -> bool:  # those beyond the heaviest carry min_load
        return len(weights) >= 2 and sum(weights) - max(weights) >= min_load

    families = []
    for p, kids in members.items():  # the children heavy enough, where they could carry min_load
        heavy = [c for c in kids if share[p, c] >= min_child_load]
        if carry([share[p, c] for c in heavy]):
            families.append((p, heavy))
    if not families:
        return out
    desc, anc = reach if reach is not None else (reachable(graph), reachable(graph, downstream=False))
    for p, labels in families:
        nodes = [members[p][c] for c in labels]
        own = [sum(1 << v for v in vs) for vs in nodes]
        around = [0] * len(labels)  # the nodes a path joins to the child's, either way
        for i, vs in enumerate(nodes):
            for v in vs:
                around[i] |= desc[v] | anc[v]
        everyone = sum(own)  # the children's nodes are disjoint
        apart = [i for i in range(len(labels))
                 if (everyone ^ own[i]) & ~around[i]  # some sibling node unordered with child i
                 and any(j != i and not around[i] & own[j] for j in range(len(labels)))]
        if carry([share[p, labels[i]] for i in apart]):
            for i in apart:
                out[nodes[i]] = labels[i]
    return out


def branch_of(graph: OpGraph) -> np.ndarray:
    """Per node, the branch it belongs to: -1 for a junction, else its connected component over the
    edges between non-junction nodes (numbered by their lowest node)."""
    n = graph.num_nodes
    junction = junctions(graph)
    parent = list(range(n))

    def root(v: int) -> int:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    for a, b in zip(graph.edge_src.tolist(), graph.edge_dst.tolist()):
        if not junction[a] and not junction[b]:
            ra, rb = root(a), root(b)
            parent[max(ra, rb)] = min(ra, rb)
    return np.array([-1 if junction[v] else root(v) for v in range(n)], dtype=np.int64)


def branch_regions(graph: OpGraph) -> list[list[np.ndarray]]:
    """The graph's regions with two or more concurrent branches, each a list of its branches (node arrays,
    ascending), in topological order of the regions. A region is keyed by how many junctions precede its
    branches' earliest node in topological order."""
    branch = branch_of(graph)
    order = graph.topological_order()
    rank = np.empty(graph.num_nodes, dtype=np.int64)
    rank[order] = np.arange(graph.num_nodes)
    before = np.cumsum(branch[order] < 0)  # junctions up to and including each position
    regions: dict[int, list[np.ndarray]] = {}
    for b in np.unique(branch[branch >= 0]).tolist():
        members = np.flatnonzero(branch == b)
        regions.setdefault(int(before[rank[members].min()]), []).append(members)
    return [sorted(branches, key=lambda b: int(rank[b].min())) for _, branches in sorted(regions.items())
            if len(branches) >= 2]


def major_regions(graph: OpGraph, load: np.ndarray, min_load: float = MIN_BRANCH_LOAD) -> list[list[np.ndarray]]:
    """The :func:`branch_regions` whose branches beyond the heaviest carry at least ``min_load`` of the
    graph's total ``load`` (per node): where running branches side by side can matter, unlike a layer's
    few parallel projections."""
    total = max(float(load.sum()), 1e-300)
    out = []
    for branches in branch_regions(graph):
        weights = [float(load[b].sum()) / total for b in branches]
        if sum(weights) - max(weights) >= min_load:
            out.append(branches)
    return out


def step_load(graph: OpGraph, time: np.ndarray | None = None) -> np.ndarray:
    """A node's load, for telling major branches: the mean of its share of the compute (``time``, default its
    FLOPs) and its share of the operators (a device's host issues every operator it runs, so a branch of
    many small operators weighs too)."""
    work = graph.fwd_flops + graph.bwd_flops if time is None else np.where(np.isfinite(time), time, 0.0)
    ops = graph.n_ops.astype(np.float64)
    return 0.5 * (work / max(float(work.sum()), 1e-300) + ops / max(float(ops.sum()), 1.0))


def balanced_bins(loads: list[float], bins: int) -> list[list[int]]:
    """Longest-processing-time bin packing: item indices per bin, the heaviest item first into the
    lightest bin (ties to the lower index); empty bins dropped."""
    total = [0.0] * bins
    out: list[list[int]] = [[] for _ in range(bins)]
    for i in sorted(range(len(loads)), key=lambda i: (-loads[i], i)):
        b = min(range(bins), key=lambda b: (total[b], b))
        out[b].append(i)
        total[b] += loads[i]
    return [b for b in out if b]
