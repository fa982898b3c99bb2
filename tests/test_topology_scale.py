"""Compiled routes and rings of envs.topology against the earlier pure-Python algorithm, bit for bit, and the
device-count limits.

``Reference`` is a copy of the routing, ring and collective code of envs/topology.py before the compiled
rewrite (networkx graph, heapq Dijkstra over node names, greedy ring with ``max(left, key=...)``). Every float
must come out identical: presets, the a100 cluster at 1, 2 and 4 nodes and random topologies (switch trees
and meshes, parallel links, device-device links, equal-bandwidth routes of different latencies).
"""

from __future__ import annotations

import contextlib
import heapq
import io
import itertools
from collections.abc import Sequence

import networkx as nx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import envs.topology as topology_mod
from envs.errors import TopologyError
from envs.presets import PRESETS, a100_cluster, preset
from envs.topology import MAX_DEVICES, Device, Link, Topology, check_device_count

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


class Reference:
    """The pure-Python routes, rings and collectives of envs/topology.py before the compiled rewrite."""

    def __init__(self, topo: Topology):
        self.devices = topo.devices
        names = [d.name for d in topo.devices]
        g = nx.Graph()
        g.add_nodes_from(names)
        g.add_nodes_from(topo.switches)
        for ln in topo.links:
            bw = ln.bandwidth * ln.efficiency
            if g.has_edge(ln.a, ln.b):  # parallel links add up (e.g. two NVLinks between a pair)
                g[ln.a][ln.b]["bw"] += bw
                g[ln.a][ln.b]["lat"] = min(g[ln.a][ln.b]["lat"], ln.latency)
            else:
                g.add_edge(ln.a, ln.b, bw=bw, lat=ln.latency)
        self.graph = g
        self._index = {n: i for i, n in enumerate(names)}
        self._rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._ring_cache: dict = {}

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def _row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        if i in self._rows:
            return self._rows[i]
        src = self.devices[i].name
        devs = self._index
        best_bw = {src: float("inf")}
        best_lat = {src: 0.0}
        heap = [(-float("inf"), 0.0, src)]
        done = set()
        while heap:
            nbw, lat, u = heapq.heappop(heap)
            if u in done:
                continue
            done.add(u)
            if u != src and u in devs:
                continue  # devices are endpoints, not routers
            for v, attrs in self.graph[u].items():
                bw = min(-nbw, attrs["bw"])
                lt = lat + attrs["lat"]
                if bw > best_bw.get(v, -1.0) or (bw == best_bw.get(v) and lt < best_lat[v]):
                    best_bw[v], best_lat[v] = bw, lt
                    heapq.heappush(heap, (-bw, lt, v))
        n = self.num_devices
        bw_row = np.zeros(n)
        lat_row = np.zeros(n)
        for j, d in enumerate(self.devices):
            if j == i:
                bw_row[j], lat_row[j] = np.inf, 0.0
            elif d.name in best_bw:
                bw_row[j], lat_row[j] = best_bw[d.name], best_lat[d.name]
            else:
                raise TopologyError(f"no route from {src!r} to {d.name!r} that avoids other devices")
        self._rows[i] = (bw_row, lat_row)
        return self._rows[i]

    def bandwidth(self, i: int, j: int) -> float:
        return float(self._row(i)[0][j])

    def latency(self, i: int, j: int) -> float:
        return float(self._row(i)[1][j])

    def matrices(self) -> tuple[np.ndarray, np.ndarray]:
        rows = [self._row(i) for i in range(self.num_devices)]
        return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])

    def p2p_time(self, i: int, j: int, nbytes: float) -> float:
        if i == j or nbytes <= 0:
            return 0.0
        bw, lat = self._row(i)
        return float(lat[j] + nbytes / bw[j])

    def hosts_of(self, group: Sequence[int]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for d in group:
            out.setdefault(self.devices[d].host, []).append(int(d))
        return out

    def _ring(self, group: Sequence[int]) -> tuple[float, float]:
        key = tuple(sorted(int(g) for g in group))
        if key in self._ring_cache:
            _, bw, lat = self._ring_cache[key]
            return bw, lat
        best = None
        for start in key[: min(len(key), 8)]:
            order = [start]
            left = set(key) - {start}
            while left:
                u = order[-1]
                v = max(left, key=lambda x: (self.bandwidth(u, x), -self.latency(u, x), -x))
                order.append(v)
                left.remove(v)
            pairs = list(zip(order, order[1:] + order[:1]))
            bw = min(self.bandwidth(a, b) for a, b in pairs)
            lat = max(self.latency(a, b) for a, b in pairs)
            if best is None or (bw, -lat) > (best[1], -best[2]):
                best = (order, bw, lat)
        self._ring_cache[key] = best
        return best[1], best[2]

    def collective_time(self, kind: str, group: Sequence[int], nbytes: float) -> float:
        group = list(dict.fromkeys(int(g) for g in group))
        n = len(group)
        if n <= 1 or nbytes <= 0:
            return 0.0
        hosts = self.hosts_of(group)
        if len(hosts) > 1:
            k = min(len(v) for v in hosts.values())
            local = max(hosts.values(), key=len)
            leaders = [v[0] for v in hosts.values()]
            per_rail = nbytes / k
            if kind == "all_reduce":
                return (self.collective_time("reduce_scatter", local, nbytes)
                        + self._flat("all_reduce", leaders, per_rail)
                        + self.collective_time("all_gather", local, nbytes))
            if kind in ("all_gather", "reduce_scatter"):
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
        if kind == "broadcast":
            return nbytes / bw + (n - 1) * alpha
        return (n - 1) / n * nbytes / bw + (n - 1) * alpha

    def hierarchy_groups(self) -> list[tuple[int, ...]]:
        groups: list[tuple[int, ...]] = []
        hosts = self.hosts_of(range(self.num_devices))
        for devs in hosts.values():
            size = 2
            while size <= len(devs):
                for s in range(0, len(devs) - size + 1, size):
                    groups.append(tuple(devs[s:s + size]))
                size *= 2
            if len(devs) > 1 and tuple(devs) not in groups:
                groups.append(tuple(devs))
        host_list = list(hosts.values())
        size = 2
        while size <= len(host_list):
            for s in range(0, len(host_list) - size + 1, size):
                g = tuple(d for h in host_list[s:s + size] for d in h)
                if g not in groups:
                    groups.append(g)
            size *= 2
        every = tuple(range(self.num_devices))
        if self.num_devices > 1 and every not in groups:
            groups.append(every)
        return groups


def _outcome(fn, *args):
    """``fn(*args)``'s value, or the message of the TopologyError it raised (compared as such)."""
    try:
        return fn(*args)
    except TopologyError as exc:
        return ("TopologyError", str(exc))


def _same(a, b) -> bool:
    """Exact equality of floats, arrays (inf == inf) and tuples of them."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape \
            and np.array_equal(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _groups(topo: Topology, rng: np.random.Generator) -> list[tuple[int, ...]]:
    """Groups to compare rings and collectives on: the hierarchy, everything, pairs and random subsets."""
    n = topo.num_devices
    out = list(topo.hierarchy_groups()) + [tuple(range(n))]
    out += [(i, j) for i, j in itertools.combinations(range(min(n, 5)), 2)]
    for _ in range(6):
        k = int(rng.integers(1, n + 1))
        out.append(tuple(int(x) for x in rng.permutation(n)[:k]))
    return out


def assert_matches_reference(topo: Topology, seed: int = 0) -> None:
    """Every route, p2p time, ring and collective of ``topo`` equals the reference's, bit for bit (or both
    raise the same TopologyError); bandwidth_matrix last, so rings are checked on the block path first."""
    ref = Reference(topo)
    n = topo.num_devices
    rng = np.random.default_rng(seed)
    assert topo.hierarchy_groups() == ref.hierarchy_groups()
    assert list(topo.graph.nodes) == list(ref.graph.nodes)
    assert list(topo.graph.edges(data=True)) == list(ref.graph.edges(data=True))
    for i in range(n):
        assert _same(_outcome(topo._row, i), _outcome(ref._row, i)), i
    for i, j in itertools.product(range(n), repeat=2):
        for nbytes in (0.0, 1.0, 3e5, 1e9):
            assert _same(_outcome(topo.p2p_time, i, j, nbytes), _outcome(ref.p2p_time, i, j, nbytes)), (i, j)
    for g in _groups(topo, rng):
        assert _same(_outcome(topo._ring, g), _outcome(ref._ring, g)), g
        for kind in KINDS:
            for nbytes in (1e9, 12345.0):
                assert _same(_outcome(topo.collective_time, kind, g, nbytes),
                             _outcome(ref.collective_time, kind, g, nbytes)), (kind, g)
    mine = _outcome(lambda: (topo.bandwidth_matrix, topo.latency_matrix))
    assert _same(mine, _outcome(ref.matrices))
    if not isinstance(mine[0], str):  # rings again, cut from the dense matrices
        fresh = Reference(topo)
        topo._ring_cache.clear()
        for g in _groups(topo, rng):
            assert _same(topo._ring(g), fresh._ring(g)), g


def _presets() -> list[str]:
    return sorted(set(PRESETS) - {"a100-80g-cluster"}) + [f"a100-80g-cluster:nodes={k}" for k in (1, 2, 4)]


@pytest.mark.parametrize("spec", _presets())
def test_presets_match_reference(spec):
    assert_matches_reference(preset(spec))


@pytest.mark.parametrize("spec", ["dgx1-v100", "hetero", "a100-80g-cluster:nodes=2"])
def test_row_by_row_rings_match_reference(spec, monkeypatch):
    """Rings too large for a route block search routes at each greedy step; rows through a one-row cache."""
    monkeypatch.setattr(topology_mod, "RING_BLOCK_BYTES", 0)
    monkeypatch.setattr(topology_mod, "ROW_CACHE_BYTES", 1)
    topo = preset(spec)
    assert topo._row_capacity == 1
    assert_matches_reference(topo, seed=1)
    assert len(topo._rows) <= 1 or topo._bw is not None


# ---------------------------------------------------------------------- random topologies
BWS = (10e9, 20e9, 25e9, 100e9)  # few values: equal-bandwidth ties are common
LATS = (0.0, 1e-6, 1.5e-6, 3e-6, 0.1, 0.2, 0.3, 1e-7)  # 0.1 + 0.2 != 0.3: the sum order shows
EFFS = (1.0, 0.65, 0.9)


@st.composite
def random_topologies(draw) -> Topology:
    """Devices on switches (a random tree plus extra switch links), parallel links, direct device links."""
    n_dev = draw(st.integers(2, 9))
    n_sw = draw(st.integers(0, 5))
    hosts = draw(st.lists(st.integers(0, 2), min_size=n_dev, max_size=n_dev))
    devices = [Device(f"d{i}", "x", {"bf16": 1e12}, 1e9, 1e9, host=h) for i, h in enumerate(hosts)]
    switches = [f"s{k}" for k in range(n_sw)]
    link = st.tuples(st.sampled_from(BWS), st.sampled_from(LATS), st.sampled_from(EFFS))
    ends: list[tuple[str, str]] = []
    for k in range(1, n_sw):  # a switch tree
        ends.append((f"s{draw(st.integers(0, k - 1))}", f"s{k}"))
    for i in range(n_dev):  # each device on a switch, or on an earlier device when there is none
        if n_sw:
            ends.append((f"d{i}", f"s{draw(st.integers(0, n_sw - 1))}"))
        elif i:
            ends.append((f"d{draw(st.integers(0, i - 1))}", f"d{i}"))
    nodes = [d.name for d in devices] + switches
    extra = draw(st.lists(st.tuples(st.integers(0, len(nodes) - 1), st.integers(0, len(nodes) - 1)), max_size=8))
    ends += [(nodes[a], nodes[b]) for a, b in extra if a != b]  # meshes, device-device links
    ends += [ends[k % len(ends)] for k in draw(st.lists(st.integers(0, 50), max_size=4))]  # parallel links
    links = []
    for a, b in ends:
        bw, lat, eff = draw(link)
        if draw(st.booleans()):
            a, b = b, a
        links.append(Link(a, b, bandwidth=bw, latency=lat, efficiency=eff))
    order = draw(st.permutations(range(len(links))))
    return Topology(devices, [links[k] for k in order], switches, name="random")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_topologies(), st.integers(0, 3))
def test_random_topologies_match_reference(topo, seed):
    assert_matches_reference(topo, seed)


def test_device_reachable_only_through_a_device_raises_like_reference():
    """d2 hangs off d1 only: connected (validation passes) but no route avoids d1, from anywhere."""
    devs = [Device(f"d{i}", "x", {"bf16": 1e12}, 1e9, 1e9) for i in range(3)]
    links = [Link("d0", "sw", 10e9), Link("d1", "sw", 10e9), Link("d1", "d2", 10e9)]
    topo = Topology(devs, links, ["sw"])
    assert_matches_reference(topo)
    with pytest.raises(TopologyError, match="no route from 'd0' to 'd2' that avoids other devices"):
        topo.collective_time("all_reduce", [0, 1], 1e9)


def test_equal_bandwidth_prefers_lower_latency_and_sums_in_path_order():
    """Two switch paths of equal bottleneck: the lower latency one wins; latency is summed source-first."""
    devs = [Device(f"d{i}", "x", {"bf16": 1e12}, 1e9, 1e9) for i in range(2)]
    links = [Link("d0", "a", 10e9, 0.1), Link("a", "d1", 10e9, 0.2), Link("d0", "b", 10e9, 0.2),
             Link("b", "d1", 10e9, 0.2), Link("d0", "d1", 5e9, 0.0), Link("d0", "d1", 4e9, 0.5)]
    topo = Topology(devs, links, ["a", "b"])
    assert topo.bandwidth(0, 1) == 10e9 and topo.latency(0, 1) == 0.1 + 0.2
    assert topo.bandwidth(1, 0) == 10e9 and topo.latency(1, 0) == 0.2 + 0.1
    assert_matches_reference(topo)


# ---------------------------------------------------------------------- limits and large topologies
def test_check_device_count():
    check_device_count(MAX_DEVICES, "x")
    with pytest.raises(TopologyError, match=r"^box\.yaml: 200,000,000 devices, more than the limit of 16,384"):
        check_device_count(2e8, "box.yaml")


def test_topology_over_the_limit_fails_first():
    dev = Device("d", "x", {"bf16": 1e12}, 1e9, 1e9)
    with pytest.raises(TopologyError, match="topology 'big': 16,385 devices, more than the limit") as exc:
        Topology([dev] * (MAX_DEVICES + 1), [], name="big")  # duplicate names: the limit is checked first
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("nodes, message", [(0, "nodes >= 1"), (-3, "nodes >= 1"),
                                            (MAX_DEVICES // 8 + 1, "more than the limit of 16,384")])
def test_a100_cluster_node_limits(nodes, message):
    with pytest.raises(TopologyError, match=message):
        a100_cluster(nodes)


def test_a100_cluster_at_the_limit_name():
    with pytest.raises(TopologyError, match=r"a100-80g-cluster:nodes=2049: 16,392 devices"):
        preset("a100-80g-cluster:nodes=2049")


def _star(n: int) -> Topology:
    devs = [Device(f"d{i}", "x", {"bf16": 1e12}, 1e9, 1e9) for i in range(n)]
    return Topology(devs, [Link(d.name, "sw", 10e9, 1e-6) for d in devs], ["sw"], name="star")


def test_dense_matrix_refused_beyond_its_limit():
    topo = _star(topology_mod.DENSE_MAX_DEVICES + 1)
    with pytest.raises(TopologyError, match="dense bandwidth matrix of 4097 devices"):
        topo.bandwidth_matrix  # noqa: B018
    assert topo.bandwidth(0, 4096) == 10e9 and topo.latency(4096, 0) == 2e-6


def test_row_cache_stays_bounded(monkeypatch):
    monkeypatch.setattr(topology_mod, "ROW_CACHE_BYTES", 16 * 64 * 10)  # ten rows of 64 devices
    topo = _star(64)
    for i in range(64):
        topo.bandwidth(i, 0)
    assert list(topo._rows) == list(range(54, 64))
    assert topo.collective_time("all_reduce", range(64), 1e9) == Reference(topo).collective_time(
        "all_reduce", range(64), 1e9)


def test_show_10k_devices_is_bounded():
    """10,000 GPUs: 64 device rows, 64 link rows, the first-16 matrix; no dense matrix."""
    from agent.commands import topology as show_cmd

    topo = preset("a100-80g-cluster:nodes=1250")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        show_cmd.render(topo)
    text = out.getvalue()
    assert "... 9936 more devices" in text and "... 29936 more links" in text
    devices_table = text.split("links (")[0]
    assert "n7.gpu7" in devices_table and "n8.gpu0" not in devices_table
    assert topo._bw is None and len(topo._rows) == 16
    assert topo.collective_time("all_reduce", range(topo.num_devices), 1e9) > 0
