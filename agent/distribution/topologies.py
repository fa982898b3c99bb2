"""Random clusters for the training distribution: 2-64 devices on 1-8 hosts, mixed device kinds
(A100, H100, V100, T4, host CPUs), link tiers from PCIe through NVLink and NVSwitch inside a host to
InfiniBand or Ethernet between hosts, with tight or loose memory.

Each host draws a device kind and an intra-host fabric the kind really comes with (NVSwitch for
A100/H100 SXM boxes, NVLink pairs or PCIe switches for PCIe cards, PCIe for T4s), a device count
(1, 2, 4 or 8) and optionally a host CPU as an extra device; hosts are joined by one NIC per
accelerator into a fabric of one tier. ``memory_scale`` shrinks device memory (a "tight" cluster
models smaller SKUs or memory reserved by other jobs). Numbers are the presets' datasheet values
(``envs.presets``, sources cited there). Same seed, same cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from envs.presets import (
    GB,
    IB_HDR,
    IB_NDR,
    NVLINK2_LINK,
    NVLINK3,
    NVLINK4,
    PCIE3,
    PCIE4,
    _a100,
    _h100,
    _t4,
    _v100,
)
from envs.topology import Device, Link, Topology

# 100 Gb/s Ethernet with RoCE: 12.5 GB/s per port per direction, ~5-10 us (Mellanox ConnectX-5 datasheet)
ETH100 = dict(bandwidth=12.5 * GB, latency=8e-6, efficiency=0.8)
KINDS = {"a100": _a100, "h100": _h100, "v100": _v100, "t4": _t4}
FABRICS = {"a100": ("nvswitch", "pcie"), "h100": ("nvswitch",), "v100": ("nvlink-pairs", "pcie"), "t4": ("pcie",)}
NVLINK_OF = {"a100": NVLINK3, "h100": NVLINK4, "v100": dict(NVLINK2_LINK, bandwidth=NVLINK2_LINK["bandwidth"] * 2)}
NICS = {"ib-ndr": IB_NDR, "ib-hdr": IB_HDR, "eth-100g": ETH100}


@dataclass(frozen=True)
class ClusterRanges:
    devices: tuple[int, int] = (2, 64)
    hosts: tuple[int, int] = (1, 8)
    memory_scale: tuple[float, float] = (0.25, 1.0)  # tight ... loose
    cpu_share: float = 0.15  # chance that a host also offers its CPU as a device
    mixed_share: float = 0.3  # chance that hosts differ in device kind


def _cpu(name: str, host: int) -> Device:
    # 2-socket Xeon host (see envs.presets.hetero): ~5.9 TFLOP/s fp32, 410 GB/s DDR4, 512 GB
    return Device(name, "cpu", {"fp32": 5.9e12, "bf16": 5.9e12}, 512 * GB, 410 * GB, host=host, compute_eff=0.5,
                  mem_eff=0.6, launch_overhead=2e-5)


def random_cluster(seed: int, ranges: ClusterRanges = ClusterRanges(), name: str | None = None) -> Topology:
    """A random cluster (see the module docstring)."""
    rng = np.random.default_rng(seed)
    hosts = int(rng.integers(ranges.hosts[0], ranges.hosts[1] + 1))
    per_host_max = max(1, ranges.devices[1] // hosts)
    counts = [c for c in (1, 2, 4, 8) if c <= per_host_max] or [1]
    per_host = int(rng.choice(counts))
    if hosts * per_host < ranges.devices[0]:
        per_host = min(8, max(per_host, -(-ranges.devices[0] // hosts)))
    base_kind = str(rng.choice(list(KINDS), p=[0.45, 0.2, 0.2, 0.15]))
    mixed = hosts > 1 and rng.random() < ranges.mixed_share
    scale = float(rng.uniform(*ranges.memory_scale))
    nic = NICS[str(rng.choice(list(NICS), p=[0.3, 0.5, 0.2]))]
    devices: list[Device] = []
    links: list[Link] = []
    switches: list[str] = ["fabric"] if hosts > 1 else []
    for h in range(hosts):
        kind = str(rng.choice(list(KINDS))) if mixed else base_kind
        fabric = str(rng.choice(FABRICS[kind])) if per_host > 1 else "pcie"
        devs = []
        for i in range(per_host):
            d = KINDS[kind](f"h{h}.{kind}{i}", h)
            d.memory_bytes *= scale
            devs.append(d)
        root = f"h{h}.pcie"
        switches.append(root)
        pcie = PCIE4 if kind in ("a100", "h100") else PCIE3
        if fabric == "nvswitch":
            sw = f"h{h}.nvswitch"
            switches.append(sw)
            links += [Link(d.name, sw, kind="nvlink", **NVLINK_OF[kind]) for d in devs]
        elif fabric == "nvlink-pairs":
            links += [Link(devs[i].name, devs[i + 1].name, kind="nvlink", **NVLINK_OF[kind])
                      for i in range(0, per_host - 1, 2)]
        links += [Link(d.name, root, kind="pcie", **pcie) for d in devs]
        if rng.random() < ranges.cpu_share:
            cpu = _cpu(f"h{h}.cpu", h)
            devs.append(cpu)
            links.append(Link(cpu.name, root, kind="membus", bandwidth=64 * GB, latency=5e-7, efficiency=0.8))
        if hosts > 1:  # one NIC per accelerator (GPUDirect RDMA); the host's PCIe root reaches NIC 0 too
            for i, d in enumerate(devs):
                if d.kind == "cpu":
                    continue
                nic_name = f"h{h}.nic{i}"
                switches.append(nic_name)
                links.append(Link(d.name, nic_name, kind="pcie", **pcie))
                links.append(Link(nic_name, "fabric", kind="network", **nic))
                if i == 0:
                    links.append(Link(root, nic_name, kind="pcie", **pcie))
        devices += devs
    return Topology(devices, links, switches, name=name or f"cluster-{seed}",
                    meta={"generator": "random_cluster", "seed": int(seed), "memory_scale": round(scale, 3)})
