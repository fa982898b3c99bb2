"""Coarsening: group an OpGraph's operators into at most ``max_nodes`` groups, keeping it a DAG.

``coarsen(graph, max_nodes, method)`` returns the coarse OpGraph and a ``Grouping`` (op -> group) that
expands a plan on groups into a plan on ops (and projects one back). Methods:

- ``module``: group by module path (``layers.3.mlp.fc1``) cut at the deepest prefix depth that gives
  at most ``max_nodes`` groups. A group is a maximal run of one prefix in a module-aware topological
  order, so a module whose ops cannot be contiguous (e.g. a module called twice, weight tying) is split
  into several runs instead of forming a cycle; groups never cross module boundaries at that depth.
- ``light``: start from single ops and repeatedly merge the lightest group (forward + backward FLOPs)
  into a neighbour: first those sharing the longest module prefix, then the lightest (which keeps the
  groups balanced instead of letting one snowball), producers before consumers on ties. Merges that
  would tie two co-location classes together come last; once classes are tied, groups of the tied
  classes joined by an edge are merged for free (they must share a device anyway), so a forward op
  and its backward twin (one class) coarsen in step instead of chaining every class into one.
- ``partition``: module groups at the deepest depth, then light merging down to ``max_nodes``.
- ``auto``: module runs also split where Megatron-LM's tensor-parallel layout changes
  (:func:`envs.plan.megatron_layouts`), at the deepest depth where they fit and leave at least
  ``max_nodes / 2`` groups, so that no group mixes column-split, row-split and replicated operators (a
  group takes one layout: a U-Net's whole ResNet blocks on 16 A100s could not take Megatron's
  per-operator plan, 2,433 ms and out of memory instead of 397 ms). Otherwise: module groups at the
  deepest depth that fits; if that leaves fewer than ``max_nodes / 2`` groups, start instead from the
  next deeper depth and light-merge down to ``max_nodes`` (pure light merging when the graph has no
  module paths).
- ``concurrent``: ``auto``, and also keeps apart concurrent children (sibling modules no path joins: an
  HRNet stage's resolution branches, a multi-task model's heads) of the modules at any depth below the
  chosen one, where those beyond the heaviest carry at least :data:`envs.branches.MIN_SIBLING_LOAD` of the
  step and each at least ``1 / max_nodes``: the runs are split between such children and between chains
  of one label that no edge joins (an HRNet stage's fused outputs), then light-merged back to
  ``max_nodes``, a group joining first a neighbour whose every op it precedes or follows (``auto``'s runs
  interleave the children, so no plan on its groups runs them side by side). Where ``auto`` light-merges
  from the next deeper depth, the same ordered merge (``auto``'s took an ensemble's input with the first
  layers of two members). Where neither changes ``auto``'s grouping it is that (recorded as ``auto``).
- ``concurrent-chains``: ``concurrent``'s split, light-merged back along chain edges first (a producer's
  only consumer, a consumer's only producer), which may put unordered ops together: an HRNet's resampling
  convolutions join the sum they feed, beside the branch that sums them, rather than the branch they read.
  A refine-mode environment takes whichever of the two groupings has the faster refine start.

Acyclicity: a contraction u -> v is done only if no other path u ~> v exists. The merger keeps a
topological order of the groups and repairs it after each contraction like Pearce & Kelly's dynamic
topological sort ("A dynamic topological sort algorithm for directed acyclic graphs", JEA 2007): the
search for another path only visits groups ordered between u and v. Searches over a budget count as
unsafe; if merging gets stuck above ``max_nodes`` (e.g. disconnected parts), groups adjacent in the
maintained order are merged, which can never create a cycle.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from envs.branches import concurrent_children, major_regions, reachable, step_load
from envs.errors import GraphError, PlanError
from envs.graph import CAN_COL, CAN_ROW, OpGraph
from envs.plan import LAYOUTS, Plan, megatron_layouts

METHODS = ("auto", "module", "light", "partition", "concurrent", "concurrent-chains")
SEARCH_BUDGET = 2000  # groups one acyclicity search may visit before the contraction counts as unsafe
FAR_BUDGET = 64  # the same for groups far apart in the order (their region is rarely small)


# ---------------------------------------------------------------------- grouping
@dataclass(eq=False)
class Grouping:
    """Which group every op of a graph belongs to (groups are numbered in a topological order)."""

    group_of: np.ndarray
    num_groups: int
    method: str = ""
    level: int | None = None  # module-path depth used, if any
    colocation: np.ndarray | None = None  # the coarse graph's co-location ids (for ``project``)
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.group_of = np.asarray(self.group_of, dtype=np.int64).reshape(-1)
        self.num_groups = int(self.num_groups)
        if self.group_of.size and (self.group_of.min() < 0 or self.group_of.max() >= self.num_groups):
            raise GraphError(f"group ids must lie in [0, {self.num_groups})")
        if np.unique(self.group_of).size != self.num_groups:
            raise GraphError("every group must hold at least one op")

    @property
    def num_ops(self) -> int:
        return int(self.group_of.shape[0])

    def sizes(self) -> np.ndarray:
        """Number of ops per group."""
        return np.bincount(self.group_of, minlength=self.num_groups)

    def members(self, g: int) -> np.ndarray:
        """The ops of group ``g``, ascending."""
        return np.flatnonzero(self.group_of == int(g))

    def expand(self, plan: Plan) -> Plan:
        """A plan on groups -> the plan on ops: every op gets its group's devices, layout, dp, recompute;
        microbatches, schedule, batch, dtype and provenance are copied."""
        if plan.num_nodes != self.num_groups:
            raise PlanError(f"plan has {plan.num_nodes} nodes but the grouping has {self.num_groups} groups")
        g = self.group_of
        prov = dict(plan.provenance)
        prov["expanded_from_groups"] = self.num_groups
        return Plan(groups=[plan.groups[i] for i in g.tolist()], layouts=[plan.layouts[i] for i in g.tolist()],
                    dp=plan.dp[g], recompute=plan.recompute[g], microbatches=plan.microbatches,
                    schedule=plan.schedule, global_batch=plan.global_batch, dtype=plan.dtype,
                    state_bytes_per_param=plan.state_bytes_per_param, provenance=prov)

    def project(self, plan: Plan) -> Plan:
        """A plan on ops -> a plan on groups: each group takes its members' majority (devices, layout, dp,
        recompute), ties going to the first op; groups sharing a co-location id then take the assignment
        of the first such group, so the result respects co-location."""
        if plan.num_nodes != self.num_ops:
            raise PlanError(f"plan has {plan.num_nodes} nodes but the grouping covers {self.num_ops} ops")
        best = group_majority(self.group_of, [(plan.groups[i], plan.layouts[i], int(plan.dp[i]),
                                               bool(plan.recompute[i])) for i in range(self.num_ops)],
                              self.num_groups)
        if self.colocation is not None:
            first: dict[int, int] = {}
            for g, c in enumerate(self.colocation.tolist()):
                if c >= 0:
                    best[g] = best[first.setdefault(c, g)]
        prov = dict(plan.provenance)
        prov["projected_from_ops"] = self.num_ops
        return Plan(groups=[b[0] for b in best], layouts=[b[1] for b in best], dp=[b[2] for b in best],
                    recompute=[b[3] for b in best], microbatches=plan.microbatches, schedule=plan.schedule,
                    global_batch=plan.global_batch, dtype=plan.dtype,
                    state_bytes_per_param=plan.state_bytes_per_param, provenance=prov)

    restrict = project

    def to_dict(self) -> dict:
        return {"group_of": self.group_of.tolist(), "num_groups": self.num_groups, "method": self.method,
                "level": self.level, "info": self.info,
                "colocation": None if self.colocation is None else self.colocation.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> Grouping:
        try:
            return cls(group_of=d["group_of"], num_groups=d["num_groups"], method=d.get("method", ""),
                       level=d.get("level"), info=d.get("info", {}),
                       colocation=None if d.get("colocation") is None else np.asarray(d["colocation"]))
        except (KeyError, TypeError) as exc:
            raise GraphError(f"malformed grouping: {exc!r}") from exc


# ---------------------------------------------------------------------- entry point
def tensor_parallel_blocks(graph: OpGraph, group_of: np.ndarray, num_groups: int,
                           layouts: list[str] | None = None) -> np.ndarray:
    """Per group: whether its operators mix Megatron-LM's layouts (:func:`envs.plan.megatron_layouts`), one
    of them a column or row split, as a group of a transformer layer's attention output, residual, norm
    and MLP input does. No one layout suits all its operators; such a group may be tensor parallel all
    the same, each operator taking Megatron-LM's layout (``PreparedTask.op_layouts``), so its coarse node
    may take column and row splits. ``layouts``: :func:`envs.plan.megatron_layouts` of ``graph``, if known."""
    layouts = megatron_layouts(graph) if layouts is None else layouts
    code = np.fromiter((LAYOUTS.index(x) for x in layouts), dtype=np.int64, count=graph.num_nodes)
    tensor = np.zeros(num_groups, dtype=bool)
    tensor[group_of[(code == LAYOUTS.index("col_split")) | (code == LAYOUTS.index("row_split"))]] = True
    lo = np.full(num_groups, len(LAYOUTS))
    hi = np.full(num_groups, -1)
    np.minimum.at(lo, group_of, code)
    np.maximum.at(hi, group_of, code)
    return tensor & (lo != hi)


def group_majority(group_of: np.ndarray, keys: list, num_groups: int) -> list:
    """Per group, its members' most common key; a tie goes to the key that occurs first (lowest op index)."""
    counts: list[dict] = [{} for _ in range(num_groups)]
    for key, g in zip(keys, group_of.tolist()):
        counts[g][key] = counts[g].get(key, 0) + 1
    return [max(c, key=c.get) for c in counts]  # dicts keep first-occurrence order: max keeps the first of a tie


def coarsen(graph: OpGraph, max_nodes: int, method: str = "auto") -> tuple[OpGraph, Grouping]:
    """Group ``graph`` into at most ``max_nodes`` nodes; returns (coarse graph, grouping)."""
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, (int, np.integer)) or max_nodes < 1:
        raise GraphError(f"max_nodes must be an integer >= 1, got {max_nodes!r}")
    if method not in METHODS:
        raise GraphError(f"unknown coarsening method {method!r}; choose one of {', '.join(METHODS)}")
    max_nodes = int(max_nodes)
    n = graph.num_nodes
    level: int | None = None
    info: dict = {}
    if n <= max_nodes:
        group_of = np.empty(n, dtype=np.int64)
        group_of[graph.topological_order()] = np.arange(n)
        info["identity"] = True
    elif method == "light":
        group_of = _light(graph, _topo_identity(graph), max_nodes)
    else:
        levels = _module_levels(graph)
        if method == "module":
            group_of, level = _module(graph, levels, max_nodes)
        elif method == "partition":
            level = len(levels) - 1 or None  # None: no module paths, start from single ops
            group_of = _label_runs(graph, levels[level]) if level else _topo_identity(graph)
            if group_of.max() + 1 > max_nodes:
                group_of = _light(graph, group_of, max_nodes)
        else:  # auto, concurrent, concurrent-chains
            split = info if method.startswith("concurrent") else None  # where the split records itself
            if split is not None:
                split["merge"] = "chains" if method == "concurrent-chains" else "ordered"
            if len(levels) == 1:  # no module paths at all
                group_of = _light(graph, _topo_identity(graph), max_nodes)
            else:
                branch = _major_branches(graph)
                pure = _layout_pure(graph, levels, max_nodes, branch, split)
                if pure is not None:
                    group_of, level = pure
                    info["layout_pure"] = True
                else:
                    group_of, level, finer = _module(graph, levels, max_nodes, keep_finer=True, branch=branch,
                                                     siblings=split)
                    if finer is not None and group_of.max() + 1 < max_nodes / 2:
                        group_of, level = _light(graph, finer, max_nodes), level + 1
                        info.pop("concurrent_children", None)  # light-merged as auto does: no split
                        if split is not None and split["merge"] == "ordered":  # unordered ops apart first
                            ordered = _light(graph, finer, max_nodes, anc=reachable(graph, downstream=False))
                            if not np.array_equal(ordered, group_of):
                                group_of, info["ordered_merge"] = ordered, True
    if method.startswith("concurrent") and not {"concurrent_children", "ordered_merge"} & info.keys():
        method = "auto"  # no concurrent children kept apart: auto's grouping, named so
        info.pop("merge", None)
    k = int(group_of.max()) + 1 if n else 0
    coarse = coarse_graph(graph, group_of, k, method=method)
    grouping = Grouping(group_of=group_of, num_groups=k, method=method, level=level,
                        colocation=coarse.colocation.copy(), info=info)
    return coarse, grouping


# ---------------------------------------------------------------------- module grouping
def _module_levels(graph: OpGraph) -> list[np.ndarray]:
    """Integer label per op for each module-path depth 0..D (depth d: the first d path components; an op
    of a shallower module keeps its whole path)."""
    comps = [p.split(".") if p else [] for p in graph.module_paths]
    depth = max((len(c) for c in comps), default=0)
    levels = []
    for d in range(depth + 1):
        ids: dict[str, int] = {}
        levels.append(np.fromiter((ids.setdefault(".".join(c[:d]), len(ids)) for c in comps),
                                  dtype=np.int64, count=len(comps)))
    return levels


def _combine(*labels: np.ndarray) -> np.ndarray:
    """One label per op that is equal exactly where all of ``labels`` are."""
    return np.unique(np.stack(labels, axis=1), axis=0, return_inverse=True)[1].reshape(-1)


def _module(graph: OpGraph, levels: list[np.ndarray], max_nodes: int, keep_finer: bool = False,
            branch: np.ndarray | None = None, siblings: dict | None = None):
    """Runs at the deepest depth with at most ``max_nodes`` groups (depth 0 always fits: one run); with
    ``branch`` (:func:`_major_branches`), also split between major concurrent branches, unless even depth 0
    split so does not fit; with ``siblings`` (a dict the split is noted in), also between concurrent
    children (:func:`_split_concurrent_children`)."""
    finer = None
    for d in range(len(levels) - 1, -1, -1):
        labels = (levels[d],) if branch is None else (levels[d], branch)
        group_of = _label_runs(graph, _combine(*labels))
        if group_of.max() + 1 <= max_nodes:
            if siblings is not None:
                group_of = _split_concurrent_children(graph, levels, d, labels, group_of, max_nodes, siblings)
            return (group_of, d, finer) if keep_finer else (group_of, d)
        finer = group_of
    if branch is not None:  # even one run per branch is too many: runs across branches
        return _module(graph, levels, max_nodes, keep_finer, siblings=siblings)
    raise AssertionError("depth 0 is a single run")  # pragma: no cover


def _split_concurrent_children(graph: OpGraph, levels: list[np.ndarray], d: int, labels: tuple[np.ndarray, ...],
                               group_of: np.ndarray, max_nodes: int, info: dict) -> np.ndarray:
    """The runs of ``labels`` (at module depth ``d``) also split between concurrent children of the modules
    at every depth below ``d`` (:func:`envs.branches.concurrent_children`: an HRNet stage's resolution
    branches, which a run of the stage's module interleaves, so that no plan could run them side by side)
    and between chains of one label that no edge joins (``connected`` runs), light-merged back to
    ``max_nodes``, ordered neighbours first (:meth:`_Merger.merge_light`); ``group_of`` unchanged when no
    child is kept apart."""
    depth = np.fromiter((len(p.split(".")) if p else 0 for p in graph.module_paths), dtype=np.int64,
                        count=graph.num_nodes)
    load, reach = step_load(graph), (reachable(graph), reachable(graph, downstream=False))
    apart = []
    for e in range(d + 1, len(levels)):
        child = np.where(depth >= e, levels[e], -1)  # an op of a shallower module is in no child
        kept = concurrent_children(graph, levels[e - 1], child, load, min_child_load=1.0 / max_nodes, reach=reach)
        if (kept >= 0).any():
            apart.append(kept)
    if not apart:
        return group_of
    info["concurrent_children"] = int(sum(np.unique(a[a >= 0]).size for a in apart))
    split = _label_runs(graph, _combine(*labels, *apart), connected=True)
    if split.max() + 1 <= max_nodes:
        return split
    return _light(graph, split, max_nodes, anc=reach[1], chains=info["merge"] == "chains")


def _major_branches(graph: OpGraph) -> np.ndarray:
    """Per op, 0 or (1 + a label) of its major concurrent branch (:func:`envs.branches.major_regions`), so
    that a run never spans two: at a shallow depth a run of one layout would interleave a two-tower
    model's towers, and the two calls of a shared encoder (a Siamese model) have the same module paths."""
    branch = np.zeros(graph.num_nodes, dtype=np.int64)
    for region in major_regions(graph, step_load(graph)):
        for b in region:
            branch[b] = b[0] + 1
    return np.unique(branch, return_inverse=True)[1].reshape(-1)


def _layout_pure(graph: OpGraph, levels: list[np.ndarray], max_nodes: int, branch: np.ndarray,
                 siblings: dict | None = None) -> tuple[np.ndarray, int] | None:
    """Module runs at the deepest depth that fits ``max_nodes`` once each run is also split where
    Megatron-LM's tensor-parallel layout changes (:func:`envs.plan.megatron_layouts` on the operators),
    so that a group never mixes column-split, row-split and replicated operators, nor two major concurrent
    branches (``branch``: :func:`_major_branches`); None when that leaves
    fewer than ``max_nodes / 2`` groups (as ``auto`` asks of module groups: too coarse for the policy) or
    even depth 0 split by layout does not fit."""
    layout = np.fromiter((LAYOUTS.index(x) for x in megatron_layouts(graph)), dtype=np.int64,
                         count=graph.num_nodes)
    for d in range(len(levels) - 1, -1, -1):
        labels = (levels[d], layout, branch)
        group_of = _label_runs(graph, _combine(*labels))
        if group_of.max() + 1 <= max_nodes:
            if group_of.max() + 1 < max_nodes / 2:
                return None
            if siblings is not None:
                group_of = _split_concurrent_children(graph, levels, d, labels, group_of, max_nodes, siblings)
            return group_of, d
    return None


def _csr(n: int, src: np.ndarray, dst: np.ndarray) -> tuple[list[int], list[int]]:
    order = np.argsort(src, kind="stable")
    starts = np.searchsorted(src[order], np.arange(n + 1))
    return starts.tolist(), dst[order].tolist()


def _label_runs(graph: OpGraph, labels: np.ndarray, connected: bool = False) -> np.ndarray:
    """Maximal same-label runs of a topological order that stays within the current label while it can
    (otherwise takes the ready op of lowest index). Groups are numbered in that order. ``connected``: an op
    continues the run only if one of its inputs is in the run (else a new run starts), so that a run never
    joins concurrent chains of one label, such as the outputs an HRNet stage fuses side by side."""
    n = graph.num_nodes
    starts, succ = _csr(n, graph.edge_src, graph.edge_dst)
    pstarts, pred = _csr(n, graph.edge_dst, graph.edge_src) if connected else (None, None)
    indeg = np.bincount(graph.edge_dst, minlength=n).tolist()
    lab = labels.tolist()
    ready = [i for i in range(n) if indeg[i] == 0]  # ascending: a valid heap
    by_label: dict[int, list[int]] = {}
    for i in ready:
        by_label.setdefault(lab[i], []).append(i)
    taken = bytearray(n)
    group = [0] * n
    cur, run = -1, -1
    heappop, heappush = heapq.heappop, heapq.heappush

    def joins(x: int) -> bool:  # an input of x is in the current run
        return any(taken[u] and group[u] == run for u in pred[pstarts[x]:pstarts[x + 1]])

    for _ in range(n):
        h = by_label.get(cur)
        v = -1
        if connected and h:
            ok = [x for x in h if not taken[x] and joins(x)]
            if ok:
                v = min(ok)
                h.remove(v)
                heapq.heapify(h)
            h = None
        while h:
            x = heappop(h)
            if not taken[x]:
                v = x
                break
        if v < 0:
            while True:
                x = heappop(ready)
                if not taken[x]:
                    v = x
                    break
            cur = lab[v]
            run += 1
        taken[v] = 1
        group[v] = run
        for j in range(starts[v], starts[v + 1]):
            w = succ[j]
            indeg[w] -= 1
            if indeg[w] == 0:
                heappush(ready, w)
                hw = by_label.get(lab[w])
                if hw is None:
                    by_label[lab[w]] = [w]
                else:
                    heappush(hw, w)
    return np.asarray(group, dtype=np.int64)


def _topo_identity(graph: OpGraph) -> np.ndarray:
    """Each op its own group, groups numbered in topological order."""
    g = np.empty(graph.num_nodes, dtype=np.int64)
    g[graph.topological_order()] = np.arange(graph.num_nodes)
    return g


# ---------------------------------------------------------------------- light merging
def _weights(graph: OpGraph) -> np.ndarray:
    """Merge weight per op: FLOPs; measured time if there are no FLOPs; op count as a last resort."""
    w = graph.fwd_flops + graph.bwd_flops
    if w.sum() > 0:
        return w
    for ph in graph.measured.values():
        t = ph["fwd"] + ph["bwd"]
        if t.sum() > 0:
            return t
    return graph.n_ops.astype(np.float64)


def _common(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return a[:k]


def _light(graph: OpGraph, group_of: np.ndarray, max_nodes: int, anc: list[int] | None = None,
           chains: bool = False) -> np.ndarray:
    """Light-merge an acyclic grouping (numbered in a topological order of its quotient) to max_nodes;
    with ``anc`` (each op's ancestors as a bitset, :func:`envs.branches.reachable`), a group joins a
    neighbour whose every op it precedes or follows first, or with ``chains`` a neighbour along a chain
    edge first (:meth:`_Merger.merge_light`)."""
    k = int(group_of.max()) + 1
    gs, gd = group_of[graph.edge_src], group_of[graph.edge_dst]
    cross = gs != gd
    pairs = np.unique(gs[cross] * k + gd[cross])
    weight = np.bincount(group_of, weights=_weights(graph), minlength=k)
    prefix: list[tuple[str, ...] | None] = [None] * k
    for i, g in enumerate(group_of.tolist()):
        p = tuple(graph.module_paths[i].split(".")) if graph.module_paths[i] else ()
        prefix[g] = p if prefix[g] is None else _common(prefix[g], p)
    klass = np.full(k, -1, dtype=np.int64)
    has = np.flatnonzero(graph.colocation >= 0)
    extra: list[tuple[int, int]] = []
    if has.size:
        _, dense = np.unique(graph.colocation[has], return_inverse=True)
        for g, c in zip(group_of[has].tolist(), dense.tolist()):
            if klass[g] < 0:
                klass[g] = c
            elif klass[g] != c:
                extra.append((int(klass[g]), c))  # one group holding two classes ties them together
    m = _Merger(k, pairs // k, pairs % k, weight, prefix, klass, extra)
    if anc is not None and not chains:
        m.track_order(group_of, anc)
    m.merge_light(max_nodes, chains)
    if m.alive > max_nodes:
        m.merge_adjacent(max_nodes)
    return m.relabel()[group_of]


def _find(parent: list[int], x: int) -> int:
    """The root of ``x`` in the union-find forest ``parent`` (``parent[r] == r`` at a root), compressing
    the path on the way. :class:`_Merger` keeps two forests: merged groups and tied co-location classes."""
    root = x
    while parent[root] != root:
        root = parent[root]
    while parent[x] != root:
        parent[x], x = root, parent[x]
    return root


class _Merger:
    """Edge contraction on a DAG of groups with a maintained topological order ``pos``."""

    def __init__(self, k: int, src: np.ndarray, dst: np.ndarray, weight: np.ndarray,
                 prefix: list[tuple[str, ...]], klass: np.ndarray | None = None,
                 tied: list[tuple[int, int]] = ()):
        self.succ: list[set[int] | None] = [set() for _ in range(k)]
        self.pred: list[set[int] | None] = [set() for _ in range(k)]
        for s, d in zip(src.tolist(), dst.tolist()):
            self.succ[s].add(d)
            self.pred[d].add(s)
        self.pos = list(range(k))  # group ids are numbered in a topological order
        self.w = weight.tolist()
        self.prefix = prefix
        self.parent = list(range(k))
        self.alive = k
        self.version = [0] * k
        # co-location: a union-find over classes; ``klass[g]`` is one class of group g (-1: none) and
        # ``comp[root]`` the alive groups whose classes belong to that root's component
        self.klass = [-1] * k if klass is None else klass.tolist()
        n_cls = max([*self.klass, *(c for pair in tied for c in pair)], default=-1) + 1
        self.cparent = list(range(n_cls))
        for a, b in tied:
            self._cunion(a, b)
        self.comp: dict[int, set[int]] = {}
        self._pending: list[int] = []
        self.failed: dict[tuple[int, int], int] = {}  # (u, v) -> retry only below this many groups
        self._found = False
        self.ops: list[int] | None = None  # track_order's bitsets
        self.before: list[int] = []
        for g, c in enumerate(self.klass):
            if c >= 0:
                self.comp.setdefault(self._cfind(c), set()).add(g)

    # -- acyclicity-preserving contraction
    def _contract(self, u: int, v: int) -> int:
        """Contract edge u -> v if no other path u ~> v exists; returns the survivor or -1."""
        pos, succ, pred = self.pos, self.succ, self.pred
        lb, ub = pos[u], pos[v]
        if len(succ[u]) == 1:
            new = ub
        elif len(pred[v]) == 1:
            new = lb
        else:
            failed = self.failed.get((u, v))
            if failed is not None and self.alive > failed:
                return -1
            budget = SEARCH_BUDGET if ub - lb <= SEARCH_BUDGET else FAR_BUDGET
            fwd = self._search(u, v, succ, lambda p: p < ub, budget)
            if fwd is None:
                # another path stays (merging only adds reachability): never retry; a search over budget
                # may succeed once the region between u and v has shrunk: retry at a quarter of the groups
                self.failed[(u, v)] = -1 if self._found else self.alive // 4
                return -1
            if not fwd:
                new = ub
            else:
                bwd = self._search(v, u, pred, lambda p: p > lb, budget)
                if bwd is None:  # over budget (u itself cannot be found: the forward search completed)
                    self.failed[(u, v)] = self.alive // 4
                    return -1
                if not bwd:
                    new = lb
                else:  # Pearce-Kelly reorder: bwd, merged, fwd into the pooled slots
                    pool = sorted([pos[x] for x in fwd] + [pos[x] for x in bwd] + [lb, ub])
                    bwd.sort(key=pos.__getitem__)
                    fwd.sort(key=pos.__getitem__)
                    for x, p in zip(bwd, pool):
                        pos[x] = p
                    new = pool[len(bwd)]
                    for x, p in zip(fwd, pool[len(pool) - len(fwd):]):
                        pos[x] = p
        keep, gone = (u, v) if len(succ[u]) + len(pred[u]) >= len(succ[v]) + len(pred[v]) else (v, u)
        for x in succ[gone]:
            pred[x].discard(gone)
            if x != keep:
                pred[x].add(keep)
                succ[keep].add(x)
        for x in pred[gone]:
            succ[x].discard(gone)
            if x != keep:
                succ[x].add(keep)
                pred[keep].add(x)
        succ[keep].discard(gone)
        pred[keep].discard(gone)
        succ[gone] = pred[gone] = None
        self.parent[gone] = keep
        pos[keep] = new
        self.w[keep] += self.w[gone]
        self.prefix[keep] = _common(self.prefix[keep], self.prefix[gone])
        if self.ops is not None:
            self.ops[keep] |= self.ops[gone]
            self.before[keep] &= self.before[gone]
        self.alive -= 1
        self._merge_classes(keep, gone)
        return keep

    # -- co-location bookkeeping
    def _cfind(self, c: int) -> int:
        return _find(self.cparent, c)

    def _cunion(self, a: int, b: int) -> int:
        ra, rb = self._cfind(a), self._cfind(b)
        if ra != rb:
            self.cparent[rb] = ra
        return ra

    def _croot(self, g: int) -> int:
        c = self.klass[g]
        return self._cfind(c) if c >= 0 else -1

    def _merge_classes(self, keep: int, gone: int) -> None:
        ck, cg = self._croot(keep), self._croot(gone)
        if cg < 0:
            return
        self.comp[cg].discard(gone)
        if ck < 0:
            self.klass[keep] = self.klass[gone]
            self.comp[cg].add(keep)
        elif ck != cg:
            root = self._cunion(ck, cg)
            other = cg if root == ck else ck
            self.comp[root] |= self.comp.pop(other)
            self._pending.append(root)

    def _new_tie(self, g: int, x: int) -> bool:
        """Whether merging g and x would tie two co-location components together."""
        a, b = self._croot(g), self._croot(x)
        return a >= 0 and b >= 0 and a != b

    def _free_merges(self, max_nodes: int, touched: list[int]) -> None:
        """After components were tied, merge groups of one component joined by an edge: they must share
        a device anyway, so this costs no freedom (e.g. the backward twins of merged forward ops)."""
        while self._pending and self.alive > max_nodes:
            root = self._cfind(self._pending.pop())
            progress = True
            while progress and self.alive > max_nodes:
                progress = False
                for a in sorted(self.comp.get(root, ()), key=self.pos.__getitem__):
                    if self.parent[a] != a:
                        continue
                    for x in sorted(self.succ[a], key=self.pos.__getitem__):
                        if self.parent[x] == x and self._croot(x) == root:
                            keep = self._contract(a, x)
                            if keep >= 0:
                                touched.append(keep)
                                progress = True
                                break
                    if progress:
                        root = self._cfind(root)
                        break

    def _search(self, start: int, target: int, adj: list, inside, budget: int) -> list[int] | None:
        """Groups reachable from ``start`` (not via its direct edge to ``target``) whose order position
        satisfies ``inside``; None if ``target`` is reachable that way or more than ``budget`` are seen."""
        pos = self.pos
        stack = [x for x in adj[start] if x != target and inside(pos[x])]
        seen = set(stack)
        out = []
        self._found = False
        while stack:
            x = stack.pop()
            out.append(x)
            for y in adj[x]:
                if y == target:
                    self._found = True
                    return None
                if y not in seen and inside(pos[y]):
                    seen.add(y)
                    stack.append(y)
            if len(seen) > budget:
                return None
        return out

    # -- strategies
    def track_order(self, group_of: np.ndarray, anc: list[int]) -> None:
        """Keep, per group, its ops and the ops that precede every one of them (from each op's ancestors
        ``anc``), as bitsets, so that :meth:`merge_light` prefers merges that keep every op ordered."""
        k = len(self.parent)
        everything = (1 << len(anc)) - 1
        self.ops, self.before = [0] * k, [everything] * k
        for v, g in enumerate(group_of.tolist()):
            self.ops[g] |= 1 << v
            self.before[g] &= anc[v]

    def _ordered(self, g: int, x: int) -> bool:
        """Whether every op of group ``g`` precedes every op of its successor ``x``."""
        return self.ops[g] & ~self.before[x] == 0

    def merge_light(self, max_nodes: int, chains: bool = False) -> None:
        """Repeatedly merge the lightest group into a neighbour (see module docstring). With
        :meth:`track_order`, a neighbour whose every op the group's every op precedes or follows comes
        first, since joining it takes no concurrency away (linear clustering: Sarkar, "Partitioning and
        Scheduling Parallel Programs for Multiprocessors", 1989). ``chains``: a neighbour along a chain
        edge (the producer's only consumer, or the consumer's only producer) comes first instead, which
        does not say so: an input's eight consumers each have it as their only producer, and merging two
        of them into the input's group serialises them; but an HRNet's resampling convolutions then join
        the sum they feed, and their outputs need not cross devices."""
        w, pos, ver = self.w, self.pos, self.version
        succ, pred = self.succ, self.pred
        track = self.ops is not None

        def apart(g: int, x: int) -> bool:  # merging g and its neighbour x would co-locate unordered ops
            if chains:  # not a chain edge between g and x
                return not (len(succ[g]) == 1 or len(pred[x]) == 1 if x in succ[g] else
                            len(pred[g]) == 1 or len(succ[x]) == 1)
            return track and not (self._ordered(g, x) if x in succ[g] else self._ordered(x, g))
        heap = [(w[g], pos[g], g, 0) for g in range(len(w))]
        heapq.heapify(heap)
        stuck: set[int] = set()
        while self.alive > max_nodes and heap:
            _, _, g, vg = heapq.heappop(heap)
            if self.parent[g] != g or vg != ver[g]:
                continue
            pre, pg = self.pred[g], self.prefix[g]
            cands = sorted(self.pred[g] | self.succ[g],
                           key=lambda x: (self._new_tie(g, x), apart(g, x),
                                          -len(_common(pg, self.prefix[x])), w[x], x not in pre, pos[x]))
            keep = -1
            for x in cands:
                keep = self._contract(x, g) if x in pre else self._contract(g, x)
                if keep >= 0:
                    break
            if keep < 0:
                stuck.add(g)
                continue
            stuck.discard(g)
            touched = [keep]
            if self._pending:
                self._free_merges(max_nodes, touched)
            for keep in touched:
                if self.parent[keep] != keep:
                    continue
                ver[keep] += 1
                heapq.heappush(heap, (w[keep], pos[keep], keep, ver[keep]))
                if stuck:
                    nb = self.succ[keep] | self.pred[keep]
                    for y in (stuck & nb) if len(nb) < len(stuck) else [y for y in stuck if y in nb]:
                        stuck.discard(y)
                        ver[y] += 1
                        heapq.heappush(heap, (w[y], pos[y], y, ver[y]))

    def merge_adjacent(self, max_nodes: int) -> None:
        """Merge groups adjacent in the maintained topological order (always acyclic): the lightest
        group joins its lighter order-neighbour until at most ``max_nodes`` remain."""
        order = sorted((g for g in range(len(self.parent)) if self.parent[g] == g), key=self.pos.__getitem__)
        prev = {g: (order[i - 1] if i else -1) for i, g in enumerate(order)}
        nxt = {g: (order[i + 1] if i + 1 < len(order) else -1) for i, g in enumerate(order)}
        w, ver = self.w, self.version
        heap = [(w[g], self.pos[g], g, ver[g]) for g in order]
        heapq.heapify(heap)
        while self.alive > max_nodes and heap:
            _, _, g, vg = heapq.heappop(heap)
            if self.parent[g] != g or vg != ver[g]:
                continue
            a, b = prev[g], nxt[g]
            if a < 0 and b < 0:
                break
            other = b if a < 0 or (b >= 0 and w[b] < w[a]) else a
            first, second = (other, g) if other == a else (g, other)
            # merge ``second`` into ``first``: the union sits at ``first``'s slot of the order
            self.parent[second] = first
            w[first] += w[second]
            self.alive -= 1
            nb = nxt[second]
            nxt[first] = nb
            if nb >= 0:
                prev[nb] = first
            ver[first] += 1
            heapq.heappush(heap, (w[first], self.pos[first], first, ver[first]))

    def relabel(self) -> np.ndarray:
        """New id per initial group: surviving groups numbered by their order position."""
        k = len(self.parent)
        roots = [_find(self.parent, g) for g in range(k)]
        alive = sorted(set(roots), key=self.pos.__getitem__)
        new = {g: i for i, g in enumerate(alive)}
        return np.asarray([new[r] for r in roots], dtype=np.int64)


# ---------------------------------------------------------------------- the coarse graph
def coarse_graph(graph: OpGraph, group_of: np.ndarray, num_groups: int | None = None, *,
                 method: str = "custom") -> OpGraph:
    """The quotient OpGraph of a grouping (raises GraphError if the grouping is cyclic).

    Node costs are sums over members (FLOPs, bytes, op counts, measured times per device kind). A coarse
    edge g -> h carries, for every distinct producer op in g feeding h, that tensor once (the largest
    of its edges into h), summed; ``edge_time`` likewise. Groups holding ops of one co-location class
    share one co-location id (union-find); layout capabilities are the AND of the members'; the kind is
    that of the member with the most FLOPs; a single op keeps its name, a larger group is named by the
    members' common module prefix when that is unique among groups, else by its first op's name (made
    unique with a ``#k`` suffix if needed)."""
    group_of = np.asarray(group_of, dtype=np.int64).reshape(-1)
    n = graph.num_nodes
    if group_of.shape[0] != n:
        raise GraphError(f"grouping covers {group_of.shape[0]} ops, graph {graph.name!r} has {n}")
    k = int(group_of.max()) + 1 if n and num_groups is None else int(num_groups or 0)
    if n and (group_of.min() < 0 or group_of.max() >= k or np.unique(group_of).size != k):
        raise GraphError(f"group ids must cover 0..{k - 1} with no empty group")

    def gsum(x: np.ndarray) -> np.ndarray:
        return np.bincount(group_of, weights=np.asarray(x, dtype=np.float64), minlength=k)

    # edges: one tensor per (producer op, consumer group)
    gs, gd = group_of[graph.edge_src], group_of[graph.edge_dst]
    cross = np.flatnonzero(gs != gd)
    src_op, dst_g = graph.edge_src[cross], gd[cross]
    key = src_op * k + dst_g
    order = np.argsort(key, kind="stable")
    key_s = key[order]
    first = np.flatnonzero(np.r_[True, key_s[1:] != key_s[:-1]]) if key_s.size else np.zeros(0, np.int64)
    tensor_bytes = np.maximum.reduceat(graph.edge_bytes[cross][order], first) if first.size else np.zeros(0)
    prod = key_s[first] // k if first.size else np.zeros(0, np.int64)
    cons = key_s[first] % k if first.size else np.zeros(0, np.int64)
    ckey = group_of[prod] * k + cons
    uniq, inv = np.unique(ckey, return_inverse=True)
    edge_bytes = np.bincount(inv, weights=tensor_bytes, minlength=uniq.size)
    edge_time = None
    if graph.edge_time is not None:
        t = np.maximum.reduceat(graph.edge_time[cross][order], first) if first.size else np.zeros(0)
        edge_time = np.bincount(inv, weights=t, minlength=uniq.size)

    # per-group attributes
    flops = graph.fwd_flops + graph.bwd_flops
    by_group = np.lexsort((np.arange(n), group_of))  # members of each group, ascending
    gstart = np.searchsorted(group_of[by_group], np.arange(k))
    first_op = by_group[gstart]
    dom = np.lexsort((-flops, group_of))[gstart]  # stable: ties go to the lower index
    kinds = [graph.kinds[i] for i in dom.tolist()]
    caps = np.bitwise_and.reduceat(graph.layout_caps[by_group], gstart) if k else np.zeros(0, np.int64)
    caps = np.where(tensor_parallel_blocks(graph, group_of, k), caps | CAN_COL | CAN_ROW, caps)
    prefixes: list[tuple[str, ...] | None] = [None] * k
    for i, g in enumerate(group_of.tolist()):
        p = tuple(graph.module_paths[i].split(".")) if graph.module_paths[i] else ()
        prefixes[g] = p if prefixes[g] is None else _common(prefixes[g], p)
    mods = [".".join(p) for p in prefixes]
    counts: dict[str, int] = {}
    for m in mods:
        counts[m] = counts.get(m, 0) + 1
    size = np.bincount(group_of, minlength=k).tolist()
    names = [m if m and counts[m] == 1 and sz > 1 else graph.names[i]
             for m, i, sz in zip(mods, first_op.tolist(), size)]
    used: set[str] = set()
    for g, nm in enumerate(names):
        base, j = nm, 1
        while nm in used:
            nm, j = f"{base}#{j}", j + 1
        names[g] = nm
        used.add(nm)

    # co-location: groups linked through a shared class get one id
    coloc = np.full(k, -1, dtype=np.int64)
    has = np.flatnonzero(graph.colocation >= 0)
    if has.size:
        cls, cls_idx = np.unique(graph.colocation[has], return_inverse=True)
        a = group_of[has]
        b = k + cls_idx
        adj = coo_matrix((np.ones(has.size), (a, b)), shape=(k + cls.size, k + cls.size))
        _, comp = connected_components(adj, directed=False)
        grouped = np.unique(a)
        _, dense = np.unique(comp[grouped], return_inverse=True)
        coloc[grouped] = dense

    meta = _coarse_meta(graph, group_of, k, method)
    return OpGraph(
        names=names, kinds=kinds, module_paths=mods, fwd_flops=gsum(graph.fwd_flops),
        bwd_flops=gsum(graph.bwd_flops), param_bytes=gsum(graph.param_bytes), out_bytes=gsum(graph.out_bytes),
        mem_bytes=gsum(graph.mem_bytes), saved_bytes=gsum(graph.saved_bytes), n_ops=np.bincount(group_of, weights=graph.n_ops, minlength=k)
        .round().astype(np.int64), colocation=coloc, layout_caps=caps,
        measured={kd: {ph: gsum(arr) for ph, arr in v.items()} for kd, v in graph.measured.items()},
        edge_src=uniq // k if k else uniq, edge_dst=uniq % k if k else uniq, edge_bytes=edge_bytes,
        edge_time=edge_time, batch_size=graph.batch_size, dtype=graph.dtype,
        name=f"{graph.name}/coarse{k}", meta=meta,
        gemm_node=group_of[graph.gemm_node], gemm_shape=graph.gemm_shape, gemm_kind=graph.gemm_kind,
    )


def _coarse_meta(graph: OpGraph, group_of: np.ndarray, k: int, method: str) -> dict:
    """The fine graph's meta minus per-op lists, with ``cpu_only`` mapped to groups."""
    n = graph.num_nodes
    meta = {}
    for key, val in graph.meta.items():
        if key == "cpu_only":
            meta[key] = sorted({int(group_of[i]) for i in val})
        elif isinstance(val, list) and len(val) == n:
            continue  # per-op data does not carry over to groups
        else:
            meta[key] = val
    meta["coarsened"] = {"from": graph.name, "num_ops": n, "num_groups": k, "method": method}
    return meta
