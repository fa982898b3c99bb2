"""Topology: devices and the links, switches and NICs between them.

Links are undirected edges with a per-direction bandwidth (bytes/s), a latency (s) and an efficiency
(achieved fraction of the datasheet bandwidth). Routes never pass through another compute device (GPUs
do not forward each other's traffic): between two devices the route is the widest path (largest
bottleneck bandwidth) over switches, NICs and hosts, ties broken by latency. Routes are searched by a
numba-compiled Dijkstra over CSR arrays of the link graph, one source device at a time, when first needed
(``Topology.graph`` gives the same graph as networkx).
"""

from __future__ import annotations

import heapq
import math
import os
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import networkx as nx
import numpy as np
from numba import njit  # NUMBA_DISABLE_JIT=1 runs these kernels as plain Python, for debugging

from envs.errors import TopologyError

FORMAT = "rlplace.topology"
VERSION = 1
MAX_DEVICES = 16384
"""Most devices one Topology may have. Rows of routes are cached within ``ROW_CACHE_BYTES``, ring blocks
within ``RING_BLOCK_BYTES`` and the dense matrices stop at ``DENSE_MAX_DEVICES``, so memory stays bounded
at any size; this limit bounds the time (an all-reduce over 16,384 GPUs in 2,048 hosts routes from each of
the 2,048 host leaders, a few seconds) and keeps a typo in a file (``count: 2e8``) from building millions
of devices."""
ROW_CACHE_BYTES = 256 * 2**20  # cached route rows (bandwidth + latency, 16 bytes a device per row)
RING_BLOCK_BYTES = 512 * 2**20  # largest member x member route block a ring search keeps (5,792 members)
DENSE_MAX_DEVICES = 4096  # largest bandwidth_matrix / latency_matrix (2 x 128 MiB)


def check_device_count(n: int | float, where: str = "topology") -> None:
    """Raise a one-line :class:`TopologyError` naming ``where`` when ``n`` devices exceed ``MAX_DEVICES``.

    Cheap: call it before building ``n`` devices (a file's ``count:`` entries, a preset's node count)."""
    if n > MAX_DEVICES:
        raise TopologyError(f"{where}: {n:,.0f} devices, more than the limit of {MAX_DEVICES:,} devices per "
                            "topology (envs.topology.MAX_DEVICES)")


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


@dataclass
class Device:
    name: str
    kind: str
    peak_flops: dict[str, float]  # dense peak FLOP/s per dtype (datasheet)
    memory_bytes: float
    mem_bw: float  # bytes/s (datasheet)
    host: int = 0
    compute_eff: float = 0.7  # achieved / peak FLOP/s on large kernels
    mem_eff: float = 0.8  # achieved / peak memory bandwidth
    launch_overhead: float = 5e-6  # s per kernel on the device (its fixed start-up and tail time)
    pays_comm: bool = True  # False for hosts whose transfers the peer's DMA engine drives (dnn-partitioning CPUs)
    sm_count: int = 0  # streaming multiprocessors (GEMM wave quantisation); 0: not modelled
    gemm_tile: int = 128  # output tile edge of the GEMM kernels (cuBLAS' large bf16 tiles are 128 x 128)
    host_overhead: float = 0.0  # s of host (framework) time to issue one kernel; 0: the host never limits
    comm_overhead: float = 0.0  # s of host time to issue one collective (NCCL call through the framework)
    p2p_overhead: float = 0.0  # s of host time per point-to-point transfer (the pipeline engine's send/recv)
    sync_overhead: float = 0.0  # s of host time a collective adds per further rank (rendezvous of the ranks)
    recompute_overhead: float = 0.0  # s a recomputed checkpoint region adds (torch.utils.checkpoint's machinery)

    def flops(self, dtype: str = "bf16") -> float:
        """Achievable FLOP/s for ``dtype`` (falls back to fp32, then to the largest listed)."""
        peak = self.peak_flops.get(dtype) or self.peak_flops.get("fp16" if dtype == "bf16" else dtype)
        if not peak:
            peak = self.peak_flops.get("fp32") or max(self.peak_flops.values())
        return peak * self.compute_eff

    def bandwidth(self) -> float:
        return self.mem_bw * self.mem_eff


@dataclass
class Link:
    a: str
    b: str
    bandwidth: float  # bytes/s per direction (datasheet)
    latency: float = 1e-6
    efficiency: float = 1.0
    kind: str = "link"


# ---------------------------------------------------------------------- validation helpers
def _check_device(d: Device) -> None:
    """One-line TopologyError if a device's rates, memory or efficiencies are out of range."""
    if d.memory_bytes <= 0 or not math.isfinite(d.memory_bytes):
        raise TopologyError(f"device {d.name!r}: memory_bytes must be > 0, got {d.memory_bytes}")
    if d.mem_bw <= 0 or not math.isfinite(d.mem_bw):
        raise TopologyError(f"device {d.name!r}: mem_bw must be > 0, got {d.mem_bw}")
    if not d.peak_flops or any((not math.isfinite(v)) or v <= 0 for v in d.peak_flops.values()):
        raise TopologyError(f"device {d.name!r}: peak_flops must be positive, got {d.peak_flops}")
    for attr in ("compute_eff", "mem_eff"):
        v = getattr(d, attr)
        if not (0 < v <= 1):
            raise TopologyError(f"device {d.name!r}: {attr} must be in (0, 1], got {v}")
    for attr in ("launch_overhead", "host_overhead", "comm_overhead", "p2p_overhead", "sync_overhead",
                 "recompute_overhead"):
        v = getattr(d, attr)
        if not (isinstance(v, (int, float)) and math.isfinite(v) and 0 <= v <= 1.0):
            raise TopologyError(f"device {d.name!r}: {attr} must be in [0, 1] s, got {v}")
    for attr, lo in (("sm_count", 0), ("gemm_tile", 1)):
        v = getattr(d, attr)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= 100_000:
            raise TopologyError(f"device {d.name!r}: {attr} must be an integer in [{lo}, 100000], got {v!r}")
    if isinstance(d.host, bool) or not isinstance(d.host, (int, np.integer)) or d.host < 0:
        raise TopologyError(f"device {d.name!r}: host must be an integer >= 0, got {d.host!r}")
    if not isinstance(d.name, str) or not isinstance(d.kind, str):
        raise TopologyError(f"device {d.name!r}: name and kind must be strings")


def _check_link(ln: Link, node_id: dict[str, int]) -> None:
    """One-line TopologyError if a link's ends are unknown or equal, or its rates are out of range."""
    for end in (ln.a, ln.b):
        if end not in node_id:
            raise TopologyError(f"link {ln.a} -- {ln.b}: unknown device or switch {end!r}")
    if ln.a == ln.b:
        raise TopologyError(f"link {ln.a} -- {ln.b} connects a node to itself")
    if not (math.isfinite(ln.bandwidth) and ln.bandwidth > 0):
        raise TopologyError(f"link {ln.a} -- {ln.b}: bandwidth must be > 0, got {ln.bandwidth}")
    if not (math.isfinite(ln.latency) and ln.latency >= 0):
        raise TopologyError(f"link {ln.a} -- {ln.b}: latency must be >= 0, got {ln.latency}")
    if not (0 < ln.efficiency <= 1):
        raise TopologyError(f"link {ln.a} -- {ln.b}: efficiency must be in (0, 1], got {ln.efficiency}")


def _merge_links(links: Sequence[Link], node_id: dict[str, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Checked links as undirected edges: (ends (m, 2) node ids, bandwidth * efficiency, latency), one edge per
    node pair in first-seen order. Parallel links add up their bandwidth in link order (e.g. two NVLinks
    between a pair) and keep the smallest latency."""
    edge_of: dict[tuple[int, int], int] = {}
    ends: list[tuple[int, int]] = []
    bws: list[float] = []
    lats: list[float] = []
    for ln in links:
        _check_link(ln, node_id)
        bw = ln.bandwidth * ln.efficiency
        a, b = node_id[ln.a], node_id[ln.b]
        k = edge_of.setdefault((min(a, b), max(a, b)), len(ends))
        if k < len(ends):
            bws[k] += bw
            lats[k] = min(lats[k], ln.latency)
        else:
            ends.append((a, b))
            bws.append(bw)
            lats.append(ln.latency)
    return (np.array(ends, dtype=np.int64).reshape(-1, 2), np.array(bws, dtype=np.float64),
            np.array(lats, dtype=np.float64))


def _link_csr(ends: np.ndarray, bws: np.ndarray, lats: np.ndarray, n_nodes: int):
    """Both directions of every edge as CSR arrays: (ptr, neighbour, bandwidth, latency)."""
    src = np.concatenate([ends[:, 0], ends[:, 1]])
    order = np.argsort(src, kind="stable")
    ptr = np.zeros(n_nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(src, minlength=n_nodes), out=ptr[1:])
    nbr = np.concatenate([ends[:, 1], ends[:, 0]])[order]
    return ptr, nbr, np.concatenate([bws, bws])[order], np.concatenate([lats, lats])[order]


# ---------------------------------------------------------------------- compiled routing kernels
@njit(cache=True)
def _reachable(ptr, nbr, start):
    """Nodes connected to ``start`` by any links (devices included), as a boolean mask."""
    n = ptr.shape[0] - 1
    seen = np.zeros(n, dtype=np.bool_)
    stack = np.empty(n, dtype=np.int64)
    seen[start] = True
    stack[0] = start
    top = 1
    while top > 0:
        top -= 1
        u = stack[top]
        for k in range(ptr[u], ptr[u + 1]):
            v = nbr[k]
            if not seen[v]:
                seen[v] = True
                stack[top] = v
                top += 1
    return seen


@njit(cache=True)
def _widest_from(ptr, nbr, ebw, elat, n_dev, src, best_bw, best_lat, done):
    """Widest routes (largest bottleneck bandwidth, ties broken by the lowest latency) from device ``src``
    to every node, into ``best_bw`` / ``best_lat`` (-1 / 0 where none). Nodes ``< n_dev`` are devices:
    endpoints that never forward traffic. Returns whether every device is reached.

    Dijkstra on (-bandwidth, latency): a route's bandwidth is the min over its links, its latency the sum
    ``lat + link_lat`` accumulated from the source in path order. Labels are popped in non-decreasing
    order and later pops cannot improve a popped label, so a node's label is the best offer of its
    expanded neighbours whatever the order of ties; a device's label is therefore final without ever being
    queued. This exact arithmetic keeps the results identical bit for bit to the earlier pure-Python search
    (heap of node names, devices queued and skipped)."""
    best_bw[:] = -1.0
    best_lat[:] = 0.0
    done[:] = False
    best_bw[src] = np.inf
    heap = [(-np.inf, 0.0, src)]
    while len(heap) > 0:
        nbw, lat, u = heapq.heappop(heap)
        if done[u]:
            continue
        done[u] = True
        ubw = -nbw
        for k in range(ptr[u], ptr[u + 1]):
            v = nbr[k]
            bw = ebw[k] if ebw[k] < ubw else ubw
            lt = lat + elat[k]
            if bw > best_bw[v] or (bw == best_bw[v] and lt < best_lat[v]):
                best_bw[v] = bw
                best_lat[v] = lt
                if v >= n_dev:  # devices are endpoints, not routers
                    heapq.heappush(heap, (-bw, lt, v))
    for d in range(n_dev):
        if best_bw[d] < 0:
            return False
    return True


@njit(cache=True)
def _take(best_bw, best_lat, src, cols, row_bw, row_lat):
    """Row of routes from ``src`` to the devices ``cols`` (inf bandwidth, 0 latency to itself)."""
    for c in range(cols.shape[0]):
        j = cols[c]
        if j == src:
            row_bw[c] = np.inf
            row_lat[c] = 0.0
        else:
            row_bw[c] = best_bw[j]
            row_lat[c] = best_lat[j]


@njit(cache=True)
def _route_block(ptr, nbr, ebw, elat, n_dev, sources, cols, out_bw, out_lat):
    """Routes from each device of ``sources`` to each of ``cols`` into ``out_bw[s, c]`` / ``out_lat[s, c]``
    (see :func:`_widest_from`); returns, per source, whether it reaches every device."""
    n_nodes = ptr.shape[0] - 1
    best_bw = np.empty(n_nodes)
    best_lat = np.empty(n_nodes)
    done = np.empty(n_nodes, dtype=np.bool_)
    complete = np.ones(sources.shape[0], dtype=np.bool_)
    for s in range(sources.shape[0]):
        complete[s] = _widest_from(ptr, nbr, ebw, elat, n_dev, sources[s], best_bw, best_lat, done)
        _take(best_bw, best_lat, sources[s], cols, out_bw[s], out_lat[s])
    return complete


@njit(cache=True)
def _pick_next(bw, lat, left):
    """Index of the ``left`` entry with the largest (bw, -lat, -index): the ring's next device."""
    best = -1
    for x in range(bw.shape[0]):
        if left[x] and (best < 0 or bw[x] > bw[best] or (bw[x] == bw[best] and lat[x] < lat[best])):
            best = x
    return best


@njit(cache=True)
def _greedy_ring(ptr, nbr, ebw, elat, n_dev, members, start, block_bw, block_lat):
    """Greedy ring over ``members`` (sorted device ids) from position ``start``: each next member is the one
    left with the largest (bandwidth, -latency, -index) from the current one; the last goes back to the
    start. Routes come from the member x member ``block_bw`` / ``block_lat``, or, when those are empty
    (0 x 0), from a route search at each step (memory bounded, n searches).

    Returns (order of positions, bandwidth and latency of each pair of the ring, -1 or the position whose
    routes miss a device, where the search stopped)."""
    n = members.shape[0]
    search = block_bw.shape[0] == 0
    n_nodes = ptr.shape[0] - 1
    best_bw = np.empty(n_nodes if search else 0)
    best_lat = np.empty(n_nodes if search else 0)
    done = np.empty(n_nodes if search else 0, dtype=np.bool_)
    row_bw = np.empty(n)
    row_lat = np.empty(n)
    left = np.ones(n, dtype=np.bool_)
    left[start] = False
    order = np.empty(n, dtype=np.int64)
    order[0] = start
    pair_bw = np.empty(n)
    pair_lat = np.empty(n)
    u = start
    for k in range(n):  # pair k: from order[k] to order[k + 1] (back to the start for the last)
        if search:
            if not _widest_from(ptr, nbr, ebw, elat, n_dev, members[u], best_bw, best_lat, done):
                return order, pair_bw, pair_lat, u
            _take(best_bw, best_lat, members[u], members, row_bw, row_lat)
        else:
            row_bw[:] = block_bw[u]
            row_lat[:] = block_lat[u]
        v = start
        if k < n - 1:
            v = _pick_next(row_bw, row_lat, left)
            left[v] = False
            order[k + 1] = v
        pair_bw[k] = row_bw[v]
        pair_lat[k] = row_lat[v]
        u = v
    return order, pair_bw, pair_lat, -1


@dataclass(eq=False)
class Topology:
    """Devices, the switches/NICs/hosts between them and the links (see the module docstring).

    At most ``MAX_DEVICES`` (16,384) devices: ``__init__`` (through :meth:`validate`) raises a
    :class:`TopologyError` above it before any other work. Routes are computed per source device when
    first asked for and cached (at most ``ROW_CACHE_BYTES`` of rows); the dense :attr:`bandwidth_matrix`
    is built only when asked for and only up to ``DENSE_MAX_DEVICES`` devices, so memory stays bounded.
    """

    devices: list[Device]
    links: list[Link]
    switches: list[str] = field(default_factory=list)
    name: str = "topology"
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check devices and links (one-line :class:`TopologyError` on the first problem) and build the
        routing graph: node ids are the devices in order, then the switches; parallel links merged."""
        check_device_count(len(self.devices), f"topology {self.name!r}")
        if not self.devices:
            raise TopologyError("topology has no devices")
        names = [d.name for d in self.devices]
        dup = [n for n, c in Counter(names).items() if c > 1]
        if dup:
            raise TopologyError(f"duplicate device name {sorted(dup)[0]!r}")
        sw_dup = set(names) & set(self.switches)
        if sw_dup:
            raise TopologyError(f"{sorted(sw_dup)[0]!r} is both a device and a switch")
        for d in self.devices:
            _check_device(d)
        node_id = {n: i for i, n in enumerate(names)}
        for s in self.switches:
            node_id.setdefault(s, len(node_id))
        ends, bws, lats = _merge_links(self.links, node_id)
        self._node_names = list(node_id)
        self._ptr, self._nbr, self._ebw, self._elat = _link_csr(ends, bws, lats, len(node_id))
        self._edges = (ends, bws, lats)
        if len(self.devices) > 1:
            seen = _reachable(self._ptr, self._nbr, 0)
            for n in names:
                if not seen[node_id[n]]:
                    raise TopologyError(f"device {n!r} is unreachable from {names[0]!r}")
        self._index = {n: i for i, n in enumerate(names)}
        self._graph: nx.Graph | None = None
        self._rows: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._row_capacity = max(1, ROW_CACHE_BYTES // (16 * len(self.devices)))
        self._ring_cache: dict[tuple[int, ...], tuple[list[int], float, float]] = {}
        self._bw: np.ndarray | None = None
        self._lat: np.ndarray | None = None

    @property
    def graph(self) -> nx.Graph:
        """The link graph as networkx (nodes: device and switch names; edge attrs ``bw``, ``lat`` of the
        merged parallel links). Built on first use; routing itself runs on compiled CSR arrays."""
        if self._graph is None:
            g = nx.Graph()
            g.add_nodes_from(self._node_names)
            ends, bws, lats = self._edges
            for (a, b), bw, lat in zip(ends.tolist(), bws.tolist(), lats.tolist()):
                g.add_edge(self._node_names[a], self._node_names[b], bw=bw, lat=lat)
            self._graph = g
        return self._graph

    # ------------------------------------------------------------------ routes
    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def device_index(self, name: str) -> int:
        if name not in self._index:
            raise TopologyError(f"no device named {name!r} in topology {self.name!r}")
        return self._index[name]

    def _routes(self, sources: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Route bandwidths and latencies from each device of ``sources`` to each of ``cols`` (arrays of
        shape (len(sources), len(cols))) and, per source, whether it reaches every device."""
        bw = np.empty((len(sources), len(cols)))
        lat = np.empty((len(sources), len(cols)))
        ok = _route_block(self._ptr, self._nbr, self._ebw, self._elat, len(self.devices),
                          np.asarray(sources, dtype=np.int64), np.asarray(cols, dtype=np.int64), bw, lat)
        return bw, lat, ok

    def _row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Widest-path bandwidth and its latency from device i to every device (cached, least recently
        used rows dropped beyond ``ROW_CACHE_BYTES``)."""
        if self._bw is not None:
            return self._bw[i], self._lat[i]
        if i in self._rows:
            self._rows.move_to_end(i)
            return self._rows[i]
        n = self.num_devices
        src = range(n)[i]  # a negative index counts from the end, a bad one raises IndexError (as a list)
        bw, lat, ok = self._routes(np.array([src]), np.arange(n))
        if not ok[0]:
            j = next(j for j in range(n) if j != src and bw[0, j] < 0)
            raise TopologyError(f"no route from {self.devices[src].name!r} to {self.devices[j].name!r} "
                                "that avoids other devices")
        self._rows[i] = (bw[0], lat[0])
        while len(self._rows) > self._row_capacity:
            self._rows.popitem(last=False)
        return self._rows[i]

    def bandwidth(self, i: int, j: int) -> float:
        """Achievable bytes/s from device i to device j (inf for i == j)."""
        return float(self._row(i)[0][j])

    def latency(self, i: int, j: int) -> float:
        return float(self._row(i)[1][j])

    @property
    def bandwidth_matrix(self) -> np.ndarray:
        """Dense device x device route bandwidths (with :attr:`latency_matrix`); at most
        ``DENSE_MAX_DEVICES`` devices, beyond that use :meth:`bandwidth` / :meth:`latency`."""
        if self._bw is None:
            n = self.num_devices
            if n > DENSE_MAX_DEVICES:
                raise TopologyError(f"topology {self.name!r}: a dense bandwidth matrix of {n} devices is over the "
                                    f"limit of {DENSE_MAX_DEVICES} (DENSE_MAX_DEVICES); use bandwidth(i, j)")
            every = np.arange(n)
            bw, lat, ok = self._routes(every, every)
            if not ok.all():
                self._row(int(np.flatnonzero(~ok)[0]))  # raises for the first device missing a route
            self._bw, self._lat = bw, lat
            self._rows.clear()
        return self._bw

    @property
    def latency_matrix(self) -> np.ndarray:
        self.bandwidth_matrix  # noqa: B018 - fills both
        return self._lat

    def p2p_time(self, i: int, j: int, nbytes: float) -> float:
        """Alpha-beta point-to-point time: latency + bytes / bottleneck bandwidth (Hockney, 1994)."""
        if i == j or nbytes <= 0:
            return 0.0
        bw, lat = self._row(i)
        return float(lat[j] + nbytes / bw[j])

    # ------------------------------------------------------------------ collectives
    def hosts_of(self, group: Sequence[int]) -> dict[int, list[int]]:
        """The devices of ``group`` per host, hosts and devices in first-seen order (linear time)."""
        out: dict[int, list[int]] = {}
        for d in group:
            out.setdefault(self.devices[d].host, []).append(int(d))
        return out

    def _ring(self, group: Sequence[int]) -> tuple[float, float]:
        """Bottleneck bandwidth and worst latency of a good ring order over ``group`` (greedy widest).

        From each of the 8 lowest-numbered devices, a greedy ring (:func:`_greedy_ring`); the start whose
        ring has the largest (bottleneck bandwidth, -worst latency) wins (the first one on ties). Routes
        come from one member x member block when it fits in ``RING_BLOCK_BYTES``, else from a route search
        at each step of the greedy (memory bounded, slower)."""
        key = tuple(sorted(int(g) for g in group))
        if key in self._ring_cache:
            _, bw, lat = self._ring_cache[key]
            return bw, lat
        members = np.array(sorted(set(key)), dtype=np.int64)
        block_bw, block_lat = self._ring_block(members)
        best = None
        for start in range(len(set(key[: min(len(key), 8)]))):
            order, pair_bw, pair_lat, missing = _greedy_ring(self._ptr, self._nbr, self._ebw, self._elat,
                                                             self.num_devices, members, start, block_bw, block_lat)
            if missing >= 0:
                self._row(int(members[missing]))  # raises: the first route missing, in the greedy's order
            bw, lat = float(pair_bw.min()), float(pair_lat.max())
            if best is None or (bw, -lat) > (best[1], -best[2]):
                best = ([int(members[p]) for p in order], bw, lat)
        self._ring_cache[key] = best
        return best[1], best[2]

    def _ring_block(self, members: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Member x member route bandwidths and latencies for a ring search: cut from the dense matrices
        when they exist, else routed when they fit in ``RING_BLOCK_BYTES`` and every member reaches every
        device; empty (0 x 0: the greedy routes each step) otherwise."""
        if self._bw is not None:
            return self._bw[np.ix_(members, members)], self._lat[np.ix_(members, members)]
        if 16 * len(members) ** 2 <= RING_BLOCK_BYTES:
            bw, lat, ok = self._routes(members, members)
            if ok.all():
                return bw, lat
        return np.empty((0, 0)), np.empty((0, 0))

    def collective_time(self, kind: str, group: Sequence[int], nbytes: float) -> float:
        """Time of a collective of ``nbytes`` (the full tensor) over ``group`` of devices.

        kind: "all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all" (``nbytes``: each
        rank's send buffer, 1/n of it to every rank). Within a host a ring:
        all-reduce 2(n-1)/n*S/B + 2(n-1)*alpha, all-gather / reduce-scatter (n-1)/n*S/B + (n-1)*alpha
        (Thakur, Rabenseifner & Gropp, "Optimization of collective communication operations in MPICH",
        2005). Across hosts two levels: reduce-scatter inside each host, all-reduce of S/k across hosts
        over k parallel rails, all-gather inside (as NCCL's tree/ring hierarchy; Sergeev & Del Balso,
        Horovod 2018). All-to-all: pairwise exchange, n - 1 rounds of S/n, (n-1)/n*S/B + (n-1)*alpha
        (Thakur et al. 2005); across hosts two phases, inside each host then between hosts on every rail
        (the 2-D hierarchical all-to-all of Tutel, Hwang et al., MLSys'23, Sec. 3.3)."""
        group = list(dict.fromkeys(int(g) for g in group))
        n = len(group)
        if n <= 1 or nbytes <= 0:
            return 0.0
        if kind not in COLLECTIVES:
            raise ValueError(f"unknown collective {kind!r}")
        hosts = self.hosts_of(group)
        if len(hosts) > 1:
            k = min(len(v) for v in hosts.values())
            local = max(hosts.values(), key=len)
            leaders = [v[0] for v in hosts.values()]
            if kind == "all_to_all":
                return self._flat(kind, leaders, nbytes) + self.collective_time(kind, local, nbytes)
            per_rail = nbytes / k
            if kind == "all_reduce":
                return (self.collective_time("reduce_scatter", local, nbytes)
                        + self._flat("all_reduce", leaders, per_rail)
                        + self.collective_time("all_gather", local, nbytes))
            if kind in ("all_gather", "reduce_scatter"):
                # inter-host part carries (h-1)/h of the data over k rails, then the intra-host part
                return self._flat(kind, leaders, per_rail) + self.collective_time(kind, local, nbytes)
            return self._flat("broadcast", leaders, nbytes) + self.collective_time("broadcast", local, nbytes)
        return self._flat(kind, group, nbytes)

    def _flat(self, kind: str, group: Sequence[int], nbytes: float) -> float:
        n = len(group)
        if n <= 1:
            return 0.0
        bw, alpha = self._ring(group)
        if kind == "all_reduce":
            return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * alpha
        if kind == "broadcast":  # pipelined ring broadcast: ~S/B + (n-1)*alpha
            return nbytes / bw + (n - 1) * alpha
        # all-gather, reduce-scatter and all-to-all move (n-1)/n of S per rank in n-1 steps
        return (n - 1) / n * nbytes / bw + (n - 1) * alpha

    # ------------------------------------------------------------------ summaries
    def fastest_device(self, dtype: str = "bf16") -> int:
        return int(np.argmax([d.flops(dtype) for d in self.devices]))

    def aggregate_flops(self, dtype: str = "bf16") -> float:
        return float(sum(d.flops(dtype) for d in self.devices))

    def devices_by_kind(self) -> dict[str, list[int]]:
        """Device indices of each device kind, kinds in order of first appearance."""
        kinds: dict[str, list[int]] = {}
        for d, dev in enumerate(self.devices):
            kinds.setdefault(dev.kind, []).append(d)
        return kinds

    def hierarchy_groups(self) -> list[tuple[int, ...]]:
        """Device groups aligned with the hierarchy: each host's devices in powers of two, hosts, all
        (first-made order, no repeats; a set of the groups so far keeps it linear in their total size)."""
        groups: list[tuple[int, ...]] = []
        seen: set[tuple[int, ...]] = set()

        def add(g: tuple[int, ...], check: bool = True) -> None:
            if not (check and g in seen):
                groups.append(g)
                seen.add(g)

        hosts = self.hosts_of(range(self.num_devices))
        for devs in hosts.values():
            size = 2
            while size <= len(devs):
                for s in range(0, len(devs) - size + 1, size):
                    add(tuple(devs[s:s + size]), check=False)
                size *= 2
            if len(devs) > 1:
                add(tuple(devs))
        host_list = list(hosts.values())
        size = 2
        while size <= len(host_list):
            for s in range(0, len(host_list) - size + 1, size):
                add(tuple(d for h in host_list[s:s + size] for d in h))
            size *= 2
        if self.num_devices > 1:
            add(tuple(range(self.num_devices)))
        return groups

    def describe(self) -> str:
        return f"{self.name}: {self.num_devices} devices on {len(self.hosts_of(range(self.num_devices)))} host(s)"

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "name": self.name, "meta": self.meta,
                "devices": [asdict(d) for d in self.devices], "switches": list(self.switches),
                "links": [asdict(ln) for ln in self.links]}

    @classmethod
    def from_dict(cls, d: dict, source: str | os.PathLike | None = None) -> Topology:
        """A Topology from its yaml/JSON mapping (checked against ``envs.schema.TopologyDoc``; ``source``
        names the file in messages). A device with ``count: k`` becomes ``k`` devices ``name0..name{k-1}``."""
        from envs.files import validated
        from envs.schema import TopologyDoc

        where = f"{source}: " if source is not None else ""
        if not isinstance(d, dict):
            raise TopologyError(f"{where}a topology file must hold a mapping with 'devices', 'switches', 'links'")
        version = d.get("version")
        if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
            raise TopologyError(f"{where}topology file version {version} is newer than this rlplace reads ({VERSION})")
        doc = validated(TopologyDoc, d, "topology", TopologyError, source)
        check_device_count(sum(dev.count for dev in doc.devices), f"{where}topology".rstrip(": ") or "topology")
        devices = []
        for dev in doc.devices:
            fields = dev.model_dump(exclude={"count", "name"})
            base = dev.name if dev.name is not None else dev.kind
            for c in range(dev.count):
                devices.append(Device(name=base if dev.count == 1 else f"{base}{c}", **fields))
        links = [Link(**ln.model_dump()) for ln in doc.links]
        try:
            return cls(devices=devices, links=links, switches=list(doc.switches), name=doc.name, meta=dict(doc.meta))
        except TopologyError as exc:
            raise TopologyError(f"{where}{exc}") from None

    def save(self, path: str | os.PathLike) -> None:
        from envs.files import atomic_write_json

        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Topology:
        """Read a topology yaml/JSON file (one-line TopologyError for anything wrong with it)."""
        from envs.files import read_document

        return cls.from_dict(read_document(path, "topology file", TopologyError), source=path)
