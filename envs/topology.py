"""Topology: devices and the links, switches and NICs between them.

Links are undirected edges of a networkx graph with a per-direction bandwidth (bytes/s), a latency
(s) and an efficiency (achieved fraction of the datasheet bandwidth). Routes never pass through
another compute device (GPUs do not forward each other's traffic): between two devices the route is
the widest path (largest bottleneck bandwidth) over switches, NICs and hosts, ties broken by latency.
"""

from __future__ import annotations

import heapq
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import networkx as nx
import numpy as np

from envs.errors import TopologyError

FORMAT = "rlplace.topology"
VERSION = 1


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
    launch_overhead: float = 5e-6  # s per kernel
    pays_comm: bool = True  # False for hosts whose transfers the peer's DMA engine drives (dnn-partitioning CPUs)

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


@dataclass(eq=False)
class Topology:
    devices: list[Device]
    links: list[Link]
    switches: list[str] = field(default_factory=list)
    name: str = "topology"
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()
        self._rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._ring_cache: dict[tuple[int, ...], tuple[list[int], float, float]] = {}
        self._bw: np.ndarray | None = None
        self._lat: np.ndarray | None = None

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        if not self.devices:
            raise TopologyError("topology has no devices")
        names = [d.name for d in self.devices]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise TopologyError(f"duplicate device name {sorted(dup)[0]!r}")
        sw_dup = set(names) & set(self.switches)
        if sw_dup:
            raise TopologyError(f"{sorted(sw_dup)[0]!r} is both a device and a switch")
        for d in self.devices:
            if d.memory_bytes <= 0 or not np.isfinite(d.memory_bytes):
                raise TopologyError(f"device {d.name!r}: memory_bytes must be > 0, got {d.memory_bytes}")
            if d.mem_bw <= 0 or not np.isfinite(d.mem_bw):
                raise TopologyError(f"device {d.name!r}: mem_bw must be > 0, got {d.mem_bw}")
            if not d.peak_flops or any((not np.isfinite(v)) or v <= 0 for v in d.peak_flops.values()):
                raise TopologyError(f"device {d.name!r}: peak_flops must be positive, got {d.peak_flops}")
            for attr in ("compute_eff", "mem_eff"):
                v = getattr(d, attr)
                if not (0 < v <= 1):
                    raise TopologyError(f"device {d.name!r}: {attr} must be in (0, 1], got {v}")
            if d.launch_overhead < 0:
                raise TopologyError(f"device {d.name!r}: launch_overhead must be >= 0")
        known = set(names) | set(self.switches)
        g = nx.Graph()
        g.add_nodes_from(names)
        g.add_nodes_from(self.switches)
        for ln in self.links:
            for end in (ln.a, ln.b):
                if end not in known:
                    raise TopologyError(f"link {ln.a} -- {ln.b}: unknown device or switch {end!r}")
            if ln.a == ln.b:
                raise TopologyError(f"link {ln.a} -- {ln.b} connects a node to itself")
            if not (np.isfinite(ln.bandwidth) and ln.bandwidth > 0):
                raise TopologyError(f"link {ln.a} -- {ln.b}: bandwidth must be > 0, got {ln.bandwidth}")
            if not (np.isfinite(ln.latency) and ln.latency >= 0):
                raise TopologyError(f"link {ln.a} -- {ln.b}: latency must be >= 0, got {ln.latency}")
            if not (0 < ln.efficiency <= 1):
                raise TopologyError(f"link {ln.a} -- {ln.b}: efficiency must be in (0, 1], got {ln.efficiency}")
            bw = ln.bandwidth * ln.efficiency
            if g.has_edge(ln.a, ln.b):  # parallel links add up (e.g. two NVLinks between a pair)
                g[ln.a][ln.b]["bw"] += bw
                g[ln.a][ln.b]["lat"] = min(g[ln.a][ln.b]["lat"], ln.latency)
            else:
                g.add_edge(ln.a, ln.b, bw=bw, lat=ln.latency)
        if len(self.devices) > 1:
            comp = nx.node_connected_component(g, names[0])
            for n in names:
                if n not in comp:
                    raise TopologyError(f"device {n!r} is unreachable from {names[0]!r}")
        self.graph = g
        self._index = {n: i for i, n in enumerate(names)}

    # ------------------------------------------------------------------ routes
    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def device_index(self, name: str) -> int:
        if name not in self._index:
            raise TopologyError(f"no device named {name!r} in topology {self.name!r}")
        return self._index[name]

    def _row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Widest-path bandwidth and its latency from device i to every device."""
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
        """Achievable bytes/s from device i to device j (inf for i == j)."""
        return float(self._row(i)[0][j])

    def latency(self, i: int, j: int) -> float:
        return float(self._row(i)[1][j])

    @property
    def bandwidth_matrix(self) -> np.ndarray:
        if self._bw is None:
            rows = [self._row(i) for i in range(self.num_devices)]
            self._bw = np.stack([r[0] for r in rows])
            self._lat = np.stack([r[1] for r in rows])
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
        out: dict[int, list[int]] = {}
        for d in group:
            out.setdefault(self.devices[d].host, []).append(int(d))
        return out

    def _ring(self, group: Sequence[int]) -> tuple[float, float]:
        """Bottleneck bandwidth and worst latency of a good ring order over ``group`` (greedy widest)."""
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
        """Time of a collective of ``nbytes`` (the full tensor) over ``group`` of devices.

        kind: "all_reduce", "all_gather", "reduce_scatter", "broadcast". Within a host a ring:
        all-reduce 2(n-1)/n*S/B + 2(n-1)*alpha, all-gather / reduce-scatter (n-1)/n*S/B + (n-1)*alpha
        (Thakur, Rabenseifner & Gropp, "Optimization of collective communication operations in MPICH",
        2005). Across hosts two levels: reduce-scatter inside each host, all-reduce of S/k across hosts
        over k parallel rails, all-gather inside (as NCCL's tree/ring hierarchy; Sergeev & Del Balso,
        Horovod 2018)."""
        group = list(dict.fromkeys(int(g) for g in group))
        n = len(group)
        if n <= 1 or nbytes <= 0:
            return 0.0
        if kind not in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
            raise ValueError(f"unknown collective {kind!r}")
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
        return (n - 1) / n * nbytes / bw + (n - 1) * alpha

    # ------------------------------------------------------------------ summaries
    def fastest_device(self, dtype: str = "bf16") -> int:
        return int(np.argmax([d.flops(dtype) for d in self.devices]))

    def aggregate_flops(self, dtype: str = "bf16") -> float:
        return float(sum(d.flops(dtype) for d in self.devices))

    def hierarchy_groups(self) -> list[tuple[int, ...]]:
        """Device groups aligned with the hierarchy: each host's devices in powers of two, hosts, all."""
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

    def describe(self) -> str:
        return f"{self.name}: {self.num_devices} devices on {len(self.hosts_of(range(self.num_devices)))} host(s)"

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "name": self.name, "meta": self.meta,
                "devices": [asdict(d) for d in self.devices], "switches": list(self.switches),
                "links": [asdict(ln) for ln in self.links]}

    @classmethod
    def from_dict(cls, d: dict) -> Topology:
        if not isinstance(d, dict):
            raise TopologyError("topology file must hold a mapping")
        try:
            devices = []
            for dev in d["devices"]:
                dev = dict(dev)
                count = int(dev.pop("count", 1))
                base = dev.get("name", dev.get("kind", "dev"))
                for c in range(count):
                    x = dict(dev)
                    x["name"] = base if count == 1 else f"{base}{c}"
                    x["peak_flops"] = {k: float(v) for k, v in dict(x["peak_flops"]).items()}
                    for key in ("memory_bytes", "mem_bw"):
                        x[key] = float(x[key])
                    devices.append(Device(**x))
            links = [Link(**{k: (float(v) if k in ("bandwidth", "latency", "efficiency") else v)
                             for k, v in ln.items()}) for ln in d.get("links", [])]
            return cls(devices=devices, links=links, switches=list(d.get("switches", [])),
                       name=d.get("name", "custom"), meta=d.get("meta", {}))
        except TopologyError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise TopologyError(f"malformed topology: {exc}") from exc

    def save(self, path: str | os.PathLike) -> None:
        from envs.graph import atomic_write_json

        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Topology:
        p = Path(path)
        if not p.exists():
            raise TopologyError(f"topology file not found: {path}")
        text = p.read_text()
        try:
            if p.suffix in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
        except Exception as exc:  # yaml.YAMLError / JSONDecodeError
            raise TopologyError(f"cannot parse topology file {path}: {exc}") from exc
        return cls.from_dict(data)


def resolve_topology(spec: str | Topology) -> Topology:
    """A preset name (``dgx-a100-80g``, ``a100-80g-cluster:nodes=4``) or a yaml/JSON file."""
    if isinstance(spec, Topology):
        return spec
    from envs.presets import PRESETS, preset

    name = str(spec).split(":", 1)[0]
    if name in PRESETS:
        return preset(str(spec))
    if os.path.exists(spec):
        return Topology.load(spec)
    raise TopologyError(f"unknown topology {spec!r}: not a preset ({', '.join(sorted(PRESETS))}) nor a file")
