"""OpGraph: a DAG of forward operators with their costs, stored as numpy arrays.

Backward and optimizer work is derived from the forward nodes, not stored as nodes (the simulator
does that). All batch-proportional quantities (FLOPs, output bytes, edge bytes, memory traffic,
measured times) are at ``batch_size``, the batch the graph was traced at; a plan's microbatch size
rescales them linearly. Parameter bytes do not scale.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import networkx as nx
import numpy as np

from envs.errors import GraphError

FORMAT = "rlplace.opgraph"
VERSION = 3  # 2: layout_caps has the CAN_REPLICATE bit (version-1 files load with it set where caps != 0);
# 3: nodes may list the matrix multiplies they run ("gemms", the cost model's shapes); older files load without
GEMM_DENSE, GEMM_PER_HEAD = 0, 1  # how a GEMM's shape follows the samples and the tensor-parallel split
DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

# Layout capability bits per node (see envs/plan.py for what each layout means). ``single`` is always
# allowed; every other layout needs its bit (imported placement workloads allow ``single`` only: 0).
CAN_BATCH = 1  # the op can run on a slice of the batch (almost every op)
CAN_COL = 2  # tensor parallel: weights split by output features, or sharded elementwise / per-head op
CAN_ROW = 4  # tensor parallel: weights split by input features, producing partial sums
CAN_REPLICATE = 8  # the op may run redundantly on every tensor-parallel rank (Megatron's LayerNorm, adds)
ALL_CAPS = CAN_BATCH | CAN_COL | CAN_ROW | CAN_REPLICATE

# Ops that hold weights and split like Megatron's linears (Shoeybi et al., 2019).
WEIGHTED_SPLITTABLE = {"linear", "matmul", "addmm", "mm", "bmm", "embedding", "conv", "conv1d", "conv2d",
                       "conv3d", "lstm", "gru", "expert"}
# Weightless ops that work per feature / per head and so run on a feature-sharded tensor.
SHARDABLE_ELEMENTWISE = {"gelu", "relu", "silu", "tanh", "sigmoid", "dropout", "add", "mul", "sub", "div",
                         "attention", "sdpa", "softmax_heads", "rotary", "elementwise", "act", "glu",
                         "batchnorm", "pool", "maxpool", "avgpool",
                         "cross_entropy"}  # vocab-parallel cross-entropy on vocab-sharded logits (Megatron-LM)


def default_layout_caps(kind: str, has_params: bool) -> int:
    """Which layouts an op of this kind allows, when the tracer did not say."""
    k = kind.lower()
    caps = CAN_BATCH | CAN_REPLICATE
    if k in WEIGHTED_SPLITTABLE and has_params:
        caps |= CAN_COL | CAN_ROW
    elif k in SHARDABLE_ELEMENTWISE:
        caps |= CAN_COL
    return caps


# Upper bounds of per-node and per-edge quantities (envs.schema.LIMITS: far beyond any real model).
MAX_FLOPS = 1e24
MAX_BYTES = 1e18
MAX_SECONDS = 1e6
MAX_N_OPS = 10**9


def _as_f64(values, n: int, what: str) -> np.ndarray:
    try:
        arr = np.asarray(values if values is not None else np.zeros(n), dtype=np.float64).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise GraphError(f"{what} must be numbers ({exc})") from None
    if arr.shape[0] != n:
        raise GraphError(f"{what} has {arr.shape[0]} entries, expected {n}")
    return arr


def int_array(values, what: str, error: type[Exception] = GraphError, n: int | None = None) -> np.ndarray:
    """Integers as int64, refusing non-integral numbers (1.7 is not a node index), booleans and strings;
    ``n``: the number of entries expected."""
    try:
        raw = np.asarray(values).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise error(f"{what} must be integers ({exc})") from None
    if raw.size and (raw.dtype == bool or not (np.issubdtype(raw.dtype, np.integer)
                                               or np.issubdtype(raw.dtype, np.floating))):
        raise error(f"{what} must be integers, got {raw.dtype} values")
    if np.issubdtype(raw.dtype, np.floating):
        bad = np.flatnonzero(~np.isfinite(raw) | (raw != np.round(raw)) | (np.abs(raw) > 2.0**62))
        if bad.size:
            raise error(f"{what}[{int(bad[0])}] is {raw[bad[0]]}, not an integer")
    arr = raw.astype(np.int64)
    if n is not None and arr.shape[0] != n:
        raise error(f"{what} has {arr.shape[0]} entries, expected {n}")
    return arr


def _as_i64(values, n: int | None, what: str) -> np.ndarray:
    return int_array(values, what, GraphError, n)


def _check_range(arr: np.ndarray, names: Sequence[str], what: str, lo: float, hi: float) -> None:
    """Every entry finite and in [lo, hi]; the first bad one is named."""
    bad = np.flatnonzero(~np.isfinite(arr) | (arr < lo) | (arr > hi))
    if bad.size:
        i = int(bad[0])
        raise GraphError(f"node {names[i]!r}: {what} is {arr[i]:g} (must be finite, in [{lo:g}, {hi:g}])")


@dataclass(eq=False)
class OpGraph:
    """Forward-operator DAG. Node ``i`` is described by the i-th entry of every per-node array."""

    names: list[str]
    kinds: list[str]
    fwd_flops: np.ndarray
    param_bytes: np.ndarray
    out_bytes: np.ndarray
    edge_src: np.ndarray
    edge_dst: np.ndarray
    edge_bytes: np.ndarray
    bwd_flops: np.ndarray | None = None
    mem_bytes: np.ndarray | None = None  # bytes an op reads+writes (roofline); derived if None
    module_paths: list[str] | None = None
    colocation: np.ndarray | None = None  # int class per node, -1 = none
    layout_caps: np.ndarray | None = None  # CAN_* bits per node
    n_ops: np.ndarray | None = None  # operators a (coarse) node stands for: launch overheads
    measured: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # kind -> {"fwd","bwd"} s
    edge_time: np.ndarray | None = None  # measured transfer time per edge (s), overrides bytes/bandwidth
    # the matrix multiplies of the nodes (the cost model times them by shape), sorted by node: the node of
    # each GEMM, its shape (m, n, k, batch) at the traced batch, and its kind: GEMM_DENSE (m grows with the
    # samples; a column split divides n, a row split k: linears, convolutions as implicit GEMMs) or
    # GEMM_PER_HEAD (batch = samples x heads grows with the samples and a split divides the heads: the
    # batched matmuls inside attention). Empty: every node is timed by the roofline of its FLOPs and bytes.
    gemm_node: np.ndarray | None = None
    gemm_shape: np.ndarray | None = None
    gemm_kind: np.ndarray | None = None
    # activation bytes a node saves for its backward beyond its output (at the traced batch): e.g. the
    # attention scores, softmax and dropout mask of an unfused attention core (Korthikanti et al. 2022,
    # Sec. 4.1: 5as^2b bytes per layer); freed when the node is recomputed. Default: none.
    saved_bytes: np.ndarray | None = None
    batch_size: int = 1
    dtype: str = "bf16"
    name: str = "graph"
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.names)
        self.names = [str(x) for x in self.names]
        self.kinds = [str(x) for x in self.kinds]
        if len(self.kinds) != n:
            raise GraphError(f"kinds has {len(self.kinds)} entries, expected {n}")
        self.module_paths = [str(x) for x in (self.module_paths or [""] * n)]
        if len(self.module_paths) != n:
            raise GraphError(f"module_paths has {len(self.module_paths)} entries, expected {n}")
        self.fwd_flops = _as_f64(self.fwd_flops, n, "fwd_flops")
        self.param_bytes = _as_f64(self.param_bytes, n, "param_bytes")
        self.out_bytes = _as_f64(self.out_bytes, n, "out_bytes")
        if self.bwd_flops is None:
            # Backward of an op with weights computes grads for inputs and weights: ~2x forward;
            # otherwise only input grads: ~1x (Narayanan et al., SC'21, Sec. 5.1 "6x per param" rule).
            self.bwd_flops = np.where(self.param_bytes > 0, 2.0, 1.0) * self.fwd_flops
        self.bwd_flops = _as_f64(self.bwd_flops, n, "bwd_flops")
        self.edge_src = _as_i64(self.edge_src, None, "edge_src")
        self.edge_dst = _as_i64(self.edge_dst, None, "edge_dst")
        m = self.edge_src.shape[0]
        if self.edge_dst.shape[0] != m:
            raise GraphError("edge_src and edge_dst differ in length")
        self.edge_bytes = _as_f64(self.edge_bytes, m, "edge_bytes")
        if self.edge_time is not None:
            self.edge_time = _as_f64(self.edge_time, m, "edge_time")
        self.colocation = _as_i64(np.full(n, -1) if self.colocation is None else self.colocation, n, "colocation")
        self.n_ops = _as_i64(np.ones(n) if self.n_ops is None else self.n_ops, n, "n_ops")
        if self.layout_caps is None:
            self.layout_caps = [default_layout_caps(k, p > 0) for k, p in zip(self.kinds, self.param_bytes)]
        self.layout_caps = _as_i64(self.layout_caps, n, "layout_caps")
        self._init_gemms()
        self.measured = {
            str(k): {ph: _as_f64(v[ph], n, f"measured[{k}][{ph}]") for ph in ("fwd", "bwd")}
            for k, v in (self.measured or {}).items()
        }
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, (int, np.integer)) \
                or not 1 <= int(self.batch_size) <= 10**9:
            raise GraphError(f"batch_size must be an integer in [1, 1e9], got {self.batch_size!r}")
        self.batch_size = int(self.batch_size)
        if self.dtype not in DTYPE_BYTES:
            raise GraphError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPE_BYTES)}")
        self.name = str(self.name)
        self._validate_structure()
        if self.mem_bytes is None:
            in_bytes = np.zeros(n)
            np.add.at(in_bytes, self.edge_dst, self.edge_bytes)
            self.mem_bytes = in_bytes + self.out_bytes + self.param_bytes
        self.mem_bytes = _as_f64(self.mem_bytes, n, "mem_bytes")
        _check_range(self.mem_bytes, self.names, "mem_bytes", 0.0, MAX_BYTES * 4)
        self.saved_bytes = _as_f64(np.zeros(n) if self.saved_bytes is None else self.saved_bytes, n, "saved_bytes")
        _check_range(self.saved_bytes, self.names, "saved_bytes", 0.0, MAX_BYTES)

    def _init_gemms(self) -> None:
        node = _as_i64(np.zeros(0) if self.gemm_node is None else self.gemm_node, None, "gemm_node")
        g = node.shape[0]
        shape = np.zeros((0, 4)) if self.gemm_shape is None else self.gemm_shape
        try:
            shape = np.asarray(shape, dtype=np.float64).reshape(g, 4)
        except (TypeError, ValueError):
            raise GraphError(f"gemm_shape must be {g} rows of (m, n, k, batch)") from None
        kind = _as_i64(np.zeros(g) if self.gemm_kind is None else self.gemm_kind, g, "gemm_kind")
        if g:
            if node.min() < 0 or node.max() >= len(self.names):
                raise GraphError("gemm_node names a node that does not exist")
            bad = np.flatnonzero(~np.isfinite(shape).all(axis=1) | (shape < 1).any(axis=1) | (shape > 1e12).any(axis=1))
            if bad.size:
                raise GraphError(f"node {self.names[int(node[bad[0]])]!r}: GEMM shape {shape[bad[0]].tolist()} "
                                 "(m, n, k, batch must be finite, >= 1 and <= 1e12)")
            if not np.isin(kind, (GEMM_DENSE, GEMM_PER_HEAD)).all():
                raise GraphError("gemm_kind must be 0 (dense) or 1 (per head)")
            order = np.argsort(node, kind="stable")
            node, shape, kind = node[order], shape[order], kind[order]
        self.gemm_node, self.gemm_shape, self.gemm_kind = node, shape, kind

    def gemm_ptr(self) -> np.ndarray:
        """CSR pointers of the GEMMs per node: node v's are rows ``gemm_ptr[v]:gemm_ptr[v + 1]``."""
        stamp = (self.num_nodes, self.num_gemms)
        cached = getattr(self, "_gemm_ptr", None)
        if cached is None or cached[0] != stamp:
            ptr = np.zeros(self.num_nodes + 1, dtype=np.int64)
            np.cumsum(np.bincount(self.gemm_node, minlength=self.num_nodes), out=ptr[1:])
            cached = self._gemm_ptr = (stamp, ptr)
        return cached[1]

    @property
    def num_gemms(self) -> int:
        return int(self.gemm_node.shape[0])

    def checkpoint_ends(self) -> np.ndarray:
        """Per node: it is the last (in topological order) of its checkpoint region, the unit a framework
        recomputes at once -- a repeated layer (module path up to its index, ``layers.3``) or a top-level
        module (``embed``; inputs are in none), as Megatron's ``--recompute-method uniform --recompute-num-layers 1`` and the
        executor's blocks do."""
        cached = getattr(self, "_checkpoint_ends", None)
        if cached is None or cached.shape[0] != self.num_nodes:
            region: dict[str, int] = {}
            last = np.full(self.num_nodes, -1, dtype=np.int64)
            for v in self.topological_order().tolist():
                if self.kinds[v] == "input":
                    continue
                parts = self.module_paths[v].split(".") if self.module_paths[v] else [self.names[v]]
                cut = next((i + 1 for i, p in enumerate(parts) if p.isdigit()), 1)
                r = region.setdefault(".".join(parts[:cut]), len(region))
                last[r] = v
            cached = np.zeros(self.num_nodes, dtype=bool)
            cached[last[last >= 0]] = True
            self._checkpoint_ends = cached
        return cached

    def gemms_of(self, v: int) -> list[tuple[float, float, float, float, int]]:
        """The GEMMs of node ``v`` as (m, n, k, batch, kind) at the traced batch."""
        lo, hi = np.searchsorted(self.gemm_node, [v, v + 1])
        return [(*map(float, self.gemm_shape[i]), int(self.gemm_kind[i])) for i in range(lo, hi)]

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check the graph: names, costs and their ranges, edges, acyclicity (raises GraphError)."""
        self._validate_structure()
        _check_range(self.mem_bytes, self.names, "mem_bytes", 0.0, MAX_BYTES * 4)

    def _validate_structure(self) -> None:
        n = self.num_nodes
        if n == 0:
            raise GraphError(f"graph {self.name!r} has no nodes")
        seen: dict[str, int] = {}
        for i, nm in enumerate(self.names):
            if nm in seen:
                raise GraphError(f"duplicate node name {nm!r} (nodes {seen[nm]} and {i})")
            seen[nm] = i
        names = self.names
        for what, arr, hi in (("fwd_flops", self.fwd_flops, MAX_FLOPS), ("bwd_flops", self.bwd_flops, 2 * MAX_FLOPS),
                              ("param_bytes", self.param_bytes, MAX_BYTES), ("out_bytes", self.out_bytes, MAX_BYTES)):
            _check_range(arr, names, what, 0.0, hi)
        _check_range(self.n_ops.astype(np.float64), names, "n_ops", 0, MAX_N_OPS)
        _check_range(self.layout_caps.astype(np.float64), names, "layout_caps", 0, ALL_CAPS)
        _check_range(self.colocation.astype(np.float64), names, "colocation", -1, 2**62)
        for kind, ph in self.measured.items():
            for p, arr in ph.items():
                _check_range(arr, names, f"measured {kind} {p} time", 0.0, MAX_SECONDS)
        for e in range(self.num_edges):
            s, d = int(self.edge_src[e]), int(self.edge_dst[e])
            if not (0 <= s < n) or not (0 <= d < n):
                src = self.names[s] if 0 <= s < n else s
                dst = self.names[d] if 0 <= d < n else d
                raise GraphError(f"edge {e} ({src} -> {dst}) refers to a node that does not exist")
            if s == d:
                raise GraphError(f"edge {e} is a self-loop on node {self.names[s]!r}")
        bad = np.flatnonzero(~np.isfinite(self.edge_bytes) | (self.edge_bytes < 0) | (self.edge_bytes > MAX_BYTES))
        if bad.size:
            e = int(bad[0])
            raise GraphError(
                f"edge {self.names[self.edge_src[e]]} -> {self.names[self.edge_dst[e]]}: bytes is {self.edge_bytes[e]}"
            )
        if self.edge_time is not None:
            bad = np.flatnonzero(~np.isfinite(self.edge_time) | (self.edge_time < 0) | (self.edge_time > MAX_SECONDS))
            if bad.size:
                e = int(bad[0])
                raise GraphError(f"edge {self.names[self.edge_src[e]]} -> {self.names[self.edge_dst[e]]}: "
                                 f"time is {self.edge_time[e]}")
        order = self._kahn()
        if order.shape[0] != n:
            remaining = sorted(set(range(n)) - set(order.tolist()))
            raise GraphError(f"graph is not a DAG: cycle through node {self.names[remaining[0]]!r}")
        self._topo = order

    def _kahn(self) -> np.ndarray:
        n = self.num_nodes
        indeg = np.bincount(self.edge_dst, minlength=n).astype(np.int64)
        order_idx = np.argsort(self.edge_src, kind="stable")
        starts = np.searchsorted(self.edge_src[order_idx], np.arange(n + 1))
        dst_sorted = self.edge_dst[order_idx]
        stack = list(np.flatnonzero(indeg == 0)[::-1])
        out = []
        while stack:
            u = stack.pop()
            out.append(u)
            for v in dst_sorted[starts[u]:starts[u + 1]]:
                indeg[v] -= 1
                if indeg[v] == 0:
                    stack.append(v)
        # Prefer a stable order close to node ids: sort-by-id Kahn is achieved by the stack above
        return np.asarray(out, dtype=np.int64)

    # ------------------------------------------------------------------ basic queries
    @property
    def num_nodes(self) -> int:
        return len(self.names)

    @property
    def num_edges(self) -> int:
        return int(self.edge_src.shape[0])

    def topological_order(self) -> np.ndarray:
        if self._topo is None:
            self._topo = self._kahn()
        return self._topo

    def index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError as exc:
            raise GraphError(f"no node named {name!r}") from exc

    def predecessors(self, i: int) -> np.ndarray:
        return self.edge_src[self.edge_dst == i]

    def successors(self, i: int) -> np.ndarray:
        return self.edge_dst[self.edge_src == i]

    def depth(self) -> np.ndarray:
        """Longest number of edges from any source to each node."""
        d = np.zeros(self.num_nodes, dtype=np.int64)
        pred = self.predecessor_lists()
        for v in self.topological_order():
            ps = pred[v]
            if ps:
                d[v] = 1 + max(d[p] for p in ps)
        return d

    def predecessor_lists(self) -> list[list[int]]:
        """The producers of every node, as a list per node (in edge order)."""
        pred: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for s, t in zip(self.edge_src.tolist(), self.edge_dst.tolist()):
            pred[t].append(s)
        return pred

    def critical_path(self, node_time: np.ndarray | None = None) -> tuple[float, list[int]]:
        """Longest path by node weight (default: forward+backward FLOPs). Returns (length, nodes)."""
        w = (self.fwd_flops + self.bwd_flops) if node_time is None else np.asarray(node_time, dtype=np.float64)
        dist = np.zeros(self.num_nodes)
        arg = np.full(self.num_nodes, -1, dtype=np.int64)
        pred = self.predecessor_lists()
        for v in self.topological_order():
            best, who = 0.0, -1
            for p in pred[v]:
                if dist[p] > best:
                    best, who = dist[p], p
            dist[v] = best + w[v]
            arg[v] = who
        if self.num_nodes == 0:
            return 0.0, []
        end = int(np.argmax(dist))
        path = [end]
        while arg[path[-1]] >= 0:
            path.append(int(arg[path[-1]]))
        return float(dist[end]), path[::-1]

    def fingerprint(self) -> str:
        """A short hash of the graph's structure (node names, kinds, edges): plans record it so a plan
        is not silently applied to another graph that happens to have as many nodes."""
        stamp = (self.num_nodes, self.num_edges)
        cached = getattr(self, "_fp", None)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        import hashlib

        h = hashlib.sha256()
        h.update("\0".join(self.names).encode())
        h.update(b"\1" + "\0".join(self.kinds).encode())
        h.update(np.ascontiguousarray(self.edge_src, dtype=np.int64).tobytes())
        h.update(np.ascontiguousarray(self.edge_dst, dtype=np.int64).tobytes())
        fp = h.hexdigest()[:16]
        self._fp = (stamp, fp)
        return fp

    def total_params(self) -> float:
        return float(self.param_bytes.sum())

    def scaled(self, batch: float) -> float:
        """Factor that turns a batch-proportional quantity at ``batch_size`` into one at ``batch``."""
        return float(batch) / float(self.batch_size)

    def summary(self) -> str:
        return (f"{self.name}: {self.num_nodes} ops, {self.num_edges} edges, "
                f"{self.fwd_flops.sum() / 1e9:.3g} GFLOP fwd, {self.param_bytes.sum() / 2**20:.4g} MiB params, "
                f"batch {self.batch_size}")

    # ------------------------------------------------------------------ conversion
    def to_networkx(self) -> nx.DiGraph:
        g = nx.DiGraph(name=self.name, batch_size=self.batch_size, dtype=self.dtype)
        for i in range(self.num_nodes):
            attrs = dict(kind=self.kinds[i], module=self.module_paths[i], fwd_flops=float(self.fwd_flops[i]),
                         bwd_flops=float(self.bwd_flops[i]), param_bytes=float(self.param_bytes[i]),
                         out_bytes=float(self.out_bytes[i]), mem_bytes=float(self.mem_bytes[i]),
                         colocation=int(self.colocation[i]), layout_caps=int(self.layout_caps[i]),
                         n_ops=int(self.n_ops[i]))
            for kind, ph in self.measured.items():
                attrs[f"time_fwd:{kind}"] = float(ph["fwd"][i])
                attrs[f"time_bwd:{kind}"] = float(ph["bwd"][i])
            g.add_node(self.names[i], **attrs)
        for e in range(self.num_edges):
            attrs = {"bytes": float(self.edge_bytes[e])}
            if self.edge_time is not None:
                attrs["time"] = float(self.edge_time[e])
            s, d = self.names[self.edge_src[e]], self.names[self.edge_dst[e]]
            if g.has_edge(s, d):
                g[s][d]["bytes"] += attrs["bytes"]
            else:
                g.add_edge(s, d, **attrs)
        return g

    @classmethod
    def from_networkx(cls, g: nx.DiGraph, *, name: str | None = None, batch_size: int | None = None) -> OpGraph:
        names = list(g.nodes)
        idx = {nm: i for i, nm in enumerate(names)}
        data = [g.nodes[nm] for nm in names]

        def col(key, default=0.0):
            return [d.get(key, default) for d in data]

        kinds_measured = sorted({k.split(":", 1)[1] for d in data for k in d if k.startswith("time_fwd:")})
        measured = {k: {"fwd": col(f"time_fwd:{k}"), "bwd": col(f"time_bwd:{k}")} for k in kinds_measured}
        edges = list(g.edges(data=True))
        has_time = bool(edges) and all("time" in a for _, _, a in edges)
        bwd = col("bwd_flops", None)
        return cls(
            names=[str(x) for x in names], kinds=col("kind", "op"), module_paths=col("module", ""),
            fwd_flops=col("fwd_flops"), bwd_flops=None if any(b is None for b in bwd) else bwd,
            param_bytes=col("param_bytes"), out_bytes=col("out_bytes"),
            colocation=col("colocation", -1), n_ops=col("n_ops", 1),
            layout_caps=None if any("layout_caps" not in d for d in data) else col("layout_caps"),
            edge_src=[idx[s] for s, _, _ in edges], edge_dst=[idx[t] for _, t, _ in edges],
            edge_bytes=[a.get("bytes", 0.0) for _, _, a in edges],
            edge_time=[a["time"] for _, _, a in edges] if has_time else None,
            measured=measured, batch_size=batch_size or g.graph.get("batch_size", 1),
            dtype=g.graph.get("dtype", "bf16"), name=name or g.graph.get("name", "graph"),
        )

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict:
        nodes = []
        for i in range(self.num_nodes):
            d = {"name": self.names[i], "kind": self.kinds[i], "module": self.module_paths[i],
                 "fwd_flops": float(self.fwd_flops[i]), "bwd_flops": float(self.bwd_flops[i]),
                 "param_bytes": float(self.param_bytes[i]), "out_bytes": float(self.out_bytes[i]),
                 "mem_bytes": float(self.mem_bytes[i]), "layout_caps": int(self.layout_caps[i])}
            if self.colocation[i] >= 0:
                d["colocation"] = int(self.colocation[i])
            if self.n_ops[i] != 1:
                d["n_ops"] = int(self.n_ops[i])
            if self.saved_bytes[i] > 0:
                d["saved_bytes"] = float(self.saved_bytes[i])
            if self.measured:
                d["measured"] = {k: [float(v["fwd"][i]), float(v["bwd"][i])] for k, v in self.measured.items()}
            nodes.append(d)
        for v, shape, kind in zip(self.gemm_node.tolist(), self.gemm_shape.tolist(), self.gemm_kind.tolist()):
            nodes[v].setdefault("gemms", []).append([*shape, int(kind)])
        edges = [[int(s), int(t), float(b)] for s, t, b in zip(self.edge_src, self.edge_dst, self.edge_bytes)]
        if self.edge_time is not None:
            for e, t in zip(edges, self.edge_time):
                e.append(float(t))
        return {"format": FORMAT, "version": VERSION, "name": self.name, "batch_size": self.batch_size,
                "dtype": self.dtype, "meta": self.meta, "nodes": nodes, "edges": edges}

    @classmethod
    def from_dict(cls, d: dict, source: str | os.PathLike | None = None) -> OpGraph:
        """An OpGraph from its JSON dict (checked against ``envs.schema.GraphDoc``; ``source`` names the
        file in error messages). Version-1 files load with ``CAN_REPLICATE`` added where caps != 0."""
        from envs.files import validated
        from envs.schema import GraphDoc

        where = f"{source}: " if source is not None else ""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise GraphError(f"{where}not an rlplace graph (expected \"format\": {FORMAT!r})")
        version = d.get("version")
        if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
            raise GraphError(f"{where}graph file version {version} is newer than this rlplace reads ({VERSION})")
        doc = validated(GraphDoc, d, "graph", GraphError, source)
        nodes, edges = doc.nodes, doc.edges
        kinds_measured = sorted({k for nd in nodes for k in nd.measured})
        for i, nd in enumerate(nodes):
            if kinds_measured and set(nd.measured) != set(kinds_measured):
                raise GraphError(f"{where}nodes[{i}].measured: every node needs times for the same device kinds "
                                 f"({', '.join(kinds_measured)})")
        measured = {k: {"fwd": [nd.measured[k][0] for nd in nodes], "bwd": [nd.measured[k][1] for nd in nodes]}
                    for k in kinds_measured}
        lens = {len(e) for e in edges}
        for e, edge in enumerate(edges):
            for k, (what, hi) in enumerate((("source", None), ("destination", None), ("bytes", MAX_BYTES),
                                              ("time", MAX_SECONDS))[:len(edge)]):
                x = edge[k]
                if hi is None and not isinstance(x, int):
                    raise GraphError(f"{where}edges[{e}][{k}]: the {what} must be a node index (an integer), "
                                     f"got {x!r}")
                if not 0 <= x <= (hi if hi is not None else len(nodes) - 1):
                    raise GraphError(f"{where}edges[{e}][{k}]: {what} {x!r} is out of range "
                                     f"[0, {hi if hi is not None else len(nodes) - 1:g}]")
        if len(lens) > 1:
            raise GraphError(f"{where}edges: give every edge a time or none (found edges of lengths {sorted(lens)})")
        gemm_rows = [(v, g) for v, nd in enumerate(nodes) for g in nd.gemms]
        caps = [nd.layout_caps for nd in nodes] if all(nd.layout_caps is not None for nd in nodes) else None
        if caps is not None and doc.version < 2:
            caps = [c | CAN_REPLICATE if c else c for c in caps]
        try:
            return cls(
                names=[nd.name for nd in nodes], kinds=[nd.kind for nd in nodes],
                module_paths=[nd.module for nd in nodes], fwd_flops=[nd.fwd_flops for nd in nodes],
                bwd_flops=[nd.bwd_flops for nd in nodes] if all(nd.bwd_flops is not None for nd in nodes) else None,
                param_bytes=[nd.param_bytes for nd in nodes], out_bytes=[nd.out_bytes for nd in nodes],
                mem_bytes=[nd.mem_bytes for nd in nodes] if all(nd.mem_bytes is not None for nd in nodes) else None,
                layout_caps=caps, colocation=[nd.colocation for nd in nodes], n_ops=[nd.n_ops for nd in nodes],
                saved_bytes=[nd.saved_bytes for nd in nodes], measured=measured, edge_src=np.array([e[0] for e in edges], dtype=np.int64),
                edge_dst=np.array([e[1] for e in edges], dtype=np.int64),
                edge_bytes=[e[2] for e in edges], edge_time=[e[3] for e in edges] if lens == {4} else None,
                batch_size=doc.batch_size, dtype=doc.dtype, name=doc.name, meta=dict(doc.meta),
                gemm_node=[v for v, _ in gemm_rows], gemm_shape=[g[:4] for _, g in gemm_rows] or np.zeros((0, 4)),
                gemm_kind=np.array([g[4] for _, g in gemm_rows], dtype=np.float64),
            )
        except GraphError as exc:
            raise GraphError(f"{where}{exc}") from None

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> OpGraph:
        """Read a graph JSON file (one-line GraphError for anything wrong with it)."""
        from envs.files import read_document

        return cls.from_dict(read_document(path, "graph file", GraphError), source=path)

    # ------------------------------------------------------------------ subgraphs
    def with_measured(self, device_kind: str, fwd: Sequence[float], bwd: Sequence[float]) -> OpGraph:
        """A copy with measured op times (seconds at ``batch_size``) for one device kind."""
        d = self.to_dict()
        g = OpGraph.from_dict(d)
        g.measured[device_kind] = {"fwd": _as_f64(fwd, self.num_nodes, "fwd"),
                                   "bwd": _as_f64(bwd, self.num_nodes, "bwd")}
        g.validate()
        return g


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    """Write JSON to a temp file beside ``path`` and rename (``envs.files.atomic_write_json``)."""
    from envs.files import atomic_write_json as write

    write(path, obj)


def chain_graph(n: int, *, flops: float = 1e12, param_bytes: float = 0.0, act_bytes: float = 1e6,
                kind: str = "linear", batch_size: int = 1, name: str = "chain") -> OpGraph:
    """n ops in a line with equal costs: the closed-form tests' workhorse."""
    return OpGraph(
        names=[f"op{i}" for i in range(n)], kinds=[kind] * n, fwd_flops=np.full(n, flops),
        param_bytes=np.full(n, param_bytes), out_bytes=np.full(n, act_bytes),
        edge_src=np.arange(n - 1), edge_dst=np.arange(1, n), edge_bytes=np.full(n - 1, act_bytes),
        batch_size=batch_size, name=name, module_paths=[f"layers.{i}" for i in range(n)],
    )



class GraphBuilder:
    """Collects nodes with closed-form costs and their input edges, then builds an OpGraph.

    Each edge carries its producer's output bytes unless ``in_bytes`` says how much the consumer reads
    (e.g. the slice of tokens routed to one expert)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.kinds: list[str] = []
        self.modules: list[str] = []
        self.flops: list[float] = []
        self.params: list[float] = []
        self.outs: list[float] = []
        self.src: list[int] = []
        self.dst: list[int] = []
        self.edge_bytes: list[float] = []
        self.n_ops: list[int] = []
        self.mem: dict[int, float] = {}
        self.caps: dict[int, int] = {}
        self.gemms: list[tuple[int, tuple[float, float, float, float], int]] = []
        self.saved: list[float] = []

    def node(self, name: str, kind: str, module: str, flops: float, param_bytes: float, out_bytes: float,
             inputs: Sequence[int] = (), in_bytes: float | None = None, *, n_ops: int = 1,
             gemms: Sequence[tuple] = (), mem_bytes: float | None = None, caps: int | None = None,
             saved_bytes: float = 0.0) -> int:
        """Add a node; ``gemms``: its matrix multiplies as (m, n, k, batch, kind) (see OpGraph.gemm_node),
        ``n_ops`` its kernels, ``mem_bytes`` the bytes it moves (default: inputs + output + weights),
        ``caps`` its layout capabilities (default: by kind), ``saved_bytes`` the activations it saves for
        its backward beyond its output."""
        idx = len(self.names)
        self.saved.append(float(saved_bytes))
        self.n_ops.append(int(n_ops))
        for gm in gemms:
            self.gemms.append((idx, tuple(float(x) for x in gm[:4]), int(gm[4]) if len(gm) > 4 else GEMM_DENSE))
        if mem_bytes is not None:
            self.mem[idx] = float(mem_bytes)
        if caps is not None:
            self.caps[idx] = int(caps)
        self.names.append(name)
        self.kinds.append(kind)
        self.modules.append(module)
        self.flops.append(float(flops))
        self.params.append(float(param_bytes))
        self.outs.append(float(out_bytes))
        for i in inputs:
            self.src.append(i)
            self.dst.append(idx)
            self.edge_bytes.append(self.outs[i] if in_bytes is None else float(in_bytes))
        return idx

    def build(self, **kwargs) -> OpGraph:
        """The OpGraph; ``kwargs`` go to OpGraph (batch_size, dtype, name, ...)."""
        n = len(self.names)
        params = np.array(self.params)
        mem = None
        if self.mem:
            in_bytes = np.zeros(n)
            np.add.at(in_bytes, np.array(self.dst, dtype=np.int64), np.array(self.edge_bytes))
            mem = in_bytes + np.array(self.outs) + params
            for i, b in self.mem.items():
                mem[i] = b
        caps = None
        if self.caps:
            caps = np.array([self.caps.get(i, default_layout_caps(k, p > 0))
                             for i, (k, p) in enumerate(zip(self.kinds, self.params))], dtype=np.int64)
        return OpGraph(names=self.names, kinds=self.kinds, module_paths=self.modules,
                       fwd_flops=np.array(self.flops), param_bytes=params,
                       out_bytes=np.array(self.outs), edge_src=np.array(self.src, dtype=np.int64),
                       edge_dst=np.array(self.dst, dtype=np.int64), edge_bytes=np.array(self.edge_bytes),
                       n_ops=np.array(self.n_ops, dtype=np.int64), mem_bytes=mem, layout_caps=caps,
                       saved_bytes=np.array(self.saved),
                       gemm_node=np.array([g[0] for g in self.gemms], dtype=np.int64),
                       gemm_shape=np.array([g[1] for g in self.gemms]).reshape(-1, 4),
                       gemm_kind=np.array([g[2] for g in self.gemms], dtype=np.int64), **kwargs)
