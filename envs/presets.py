"""Topology presets for real machines, with datasheet numbers (source next to each value), and
:func:`resolve_topology`, which turns a preset name or a topology file into a :class:`Topology`.

Datasheet peaks stay peaks; achievable fractions live in the efficiency factors (device
``compute_eff``/``mem_eff``, link ``efficiency``) so calibration changes those, not the peaks.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from envs.errors import TopologyError
from envs.topology import Device, Link, Topology, check_device_count

GB = 1e9
GiB = 2**30


# Fitted by `rlplace calibrate` on the 1,440 measured Megatron-DeepSpeed runs of ../shared/calibration
# (vTrain's megatron-a100-single-node.csv: GPT 0.35-1.3B on one DGX A100, full recomputation; held-out
# models: MAPE 6-9%, experiments/results/calibration/): GEMM efficiency, and the software stack's host
# time per kernel (PyTorch eager + Megatron + DeepSpeed activation checkpointing), per collective, per
# pipeline transfer, and per further rank a collective waits for. A faster stack (CUDA graphs,
# torch.compile) has smaller host times: calibrate your own with `rlplace calibrate`.
A100_FITTED = dict(compute_eff=0.80, host_overhead=68e-6, comm_overhead=0.6e-6, p2p_overhead=0.4e-6,
                   sync_overhead=5.3e-6)


def _a100(name: str, host: int = 0) -> Device:
    # NVIDIA A100 datasheet: 312 TFLOP/s bf16/fp16 tensor, 19.5 fp32, 156 tf32; 80 GB HBM2e at 2,039 GB/s;
    # 108 SMs (A100 whitepaper)
    return Device(name, "a100-80g", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
                  80 * GB, 2039 * GB, host=host, mem_eff=0.8, launch_overhead=5e-6, sm_count=108, **A100_FITTED)


def _h100(name: str, host: int = 0) -> Device:
    # NVIDIA H100 SXM datasheet: 989 TFLOP/s bf16/fp16 dense, 67 fp32; 80 GB HBM3 at 3,350 GB/s; 132 SMs
    return Device(name, "h100-80g", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
                  80 * GB, 3350 * GB, host=host, compute_eff=0.65, mem_eff=0.8, launch_overhead=4e-6, sm_count=132)


def _v100(name: str, host: int = 0) -> Device:
    # NVIDIA V100 SXM2 datasheet: 125 TFLOP/s fp16 tensor (no bf16: bf16 runs at fp32 rate), 15.7 fp32;
    # 32 GB HBM2 at 900 GB/s; 80 SMs
    return Device(name, "v100-32g", {"fp16": 125e12, "bf16": 15.7e12, "fp32": 15.7e12},
                  32 * GB, 900 * GB, host=host, compute_eff=0.7, mem_eff=0.8, launch_overhead=6e-6, sm_count=80)


def _t4(name: str, host: int = 0) -> Device:
    # NVIDIA T4 datasheet: 65 TFLOP/s fp16 tensor, 8.1 fp32; 16 GB GDDR6 at 320 GB/s; 40 SMs
    return Device(name, "t4", {"fp16": 65e12, "bf16": 8.1e12, "fp32": 8.1e12}, 16 * GB, 320 * GB,
                  host=host, compute_eff=0.6, mem_eff=0.8, launch_overhead=6e-6, sm_count=40)


# NVLink3 through NVSwitch: 300 GB/s per direction per GPU (A100 datasheet); measured send/recv about
# 65% of that (nccl-tests p2p on DGX A100), hence efficiency 0.65. Latency per hop ~1 us.
NVLINK3 = dict(bandwidth=300 * GB, latency=1e-6, efficiency=0.65)
# NVLink4 through NVSwitch: 450 GB/s per direction per GPU (H100 datasheet).
NVLINK4 = dict(bandwidth=450 * GB, latency=1e-6, efficiency=0.65)
# NVLink2 (V100): 25 GB/s per direction per link, 6 links per GPU (V100 datasheet).
NVLINK2_LINK = dict(bandwidth=25 * GB, latency=1e-6, efficiency=0.8)
# PCIe 3.0 x16 ~16 GB/s, 4.0 x16 ~32 GB/s per direction, ~1-2 us (PCI-SIG spec rates).
PCIE3 = dict(bandwidth=16 * GB, latency=1.5e-6, efficiency=0.8)
PCIE4 = dict(bandwidth=32 * GB, latency=1.5e-6, efficiency=0.8)
# InfiniBand HDR 200 Gb/s = 25 GB/s per port per direction, ~2-5 us end to end (Mellanox HDR datasheet).
IB_HDR = dict(bandwidth=25 * GB, latency=3e-6, efficiency=0.9)
IB_NDR = dict(bandwidth=50 * GB, latency=3e-6, efficiency=0.9)
# Intel UPI/QPI between sockets: ~20 GB/s per direction usable (Intel Xeon platform brief).
QPI = dict(bandwidth=20 * GB, latency=1e-6, efficiency=0.8)


def _nvswitch_node(make: Callable[[str, int], Device], host: int, n: int, nvlink: dict, prefix: str = "gpu"):
    devs = [make(f"{prefix}{host * n + i}" if host else f"{prefix}{i}", host) for i in range(n)]
    sw = f"nvswitch{host}"
    links = [Link(d.name, sw, kind="nvlink", **nvlink) for d in devs]
    return devs, [sw], links


def dgx_a100_80g() -> Topology:
    devs, sws, links = _nvswitch_node(_a100, 0, 8, NVLINK3)
    return Topology(devs, links, sws, name="dgx-a100-80g")


def dgx_h100() -> Topology:
    devs, sws, links = _nvswitch_node(_h100, 0, 8, NVLINK4)
    return Topology(devs, links, sws, name="dgx-h100")


def a100_cluster(nodes: int = 2) -> Topology:
    """``nodes`` DGX A100 boxes: NVSwitch inside, one HDR-200 NIC per GPU into a rail-optimised fabric
    (DGX A100 user guide: 8 compute NICs per node)."""
    if nodes < 1:
        raise TopologyError("a100-80g-cluster needs nodes >= 1")
    check_device_count(nodes * 8, f"a100-80g-cluster:nodes={nodes}")  # before building anything
    devices, switches, links = [], ["ib-fabric"], []
    for h in range(nodes):
        devs = [_a100(f"n{h}.gpu{i}", h) for i in range(8)]
        sw = f"n{h}.nvswitch"
        switches.append(sw)
        devices += devs
        for i, d in enumerate(devs):
            nic = f"n{h}.nic{i}"
            switches.append(nic)
            links.append(Link(d.name, sw, kind="nvlink", **NVLINK3))
            links.append(Link(d.name, nic, kind="pcie", **PCIE4))
            links.append(Link(nic, "ib-fabric", kind="infiniband", **IB_HDR))
    return Topology(devices, links, switches, name=f"a100-80g-cluster:nodes={nodes}")


# DGX-1 (V100) hybrid cube-mesh NVLink: number of NVLinks between GPU pairs (DGX-1 whitepaper,
# `nvidia-smi topo -m` on DGX-1V: NV1 / NV2). Other pairs go over PCIe switches and QPI.
DGX1_NVLINKS = {(0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 3): 1, (1, 5): 2, (2, 3): 2,
                (2, 6): 1, (3, 7): 1, (4, 5): 1, (4, 6): 1, (4, 7): 2, (5, 6): 2, (5, 7): 1, (6, 7): 2}


def dgx1_v100() -> Topology:
    devs = [_v100(f"gpu{i}") for i in range(8)]
    links = []
    for (a, b), k in DGX1_NVLINKS.items():
        for _ in range(k):
            links.append(Link(f"gpu{a}", f"gpu{b}", kind="nvlink", **NVLINK2_LINK))
    switches = ["pcie0", "pcie1", "pcie2", "pcie3", "cpu0", "cpu1"]
    for i in range(8):
        links.append(Link(f"gpu{i}", f"pcie{i // 2}", kind="pcie", **PCIE3))
    for s in range(4):
        links.append(Link(f"pcie{s}", f"cpu{s // 2}", kind="pcie", **PCIE3))
    links.append(Link("cpu0", "cpu1", kind="qpi", **QPI))
    return Topology(devs, links, switches, name="dgx1-v100")


def pcie_4gpu() -> Topology:
    """Four A100 PCIe-attached GPUs, two per PCIe 4.0 switch, switches under one host root complex."""
    devs = [_a100(f"gpu{i}") for i in range(4)]
    links = [Link(f"gpu{i}", f"plx{i // 2}", kind="pcie", **PCIE4) for i in range(4)]
    links += [Link(f"plx{s}", "host", kind="pcie", **PCIE4) for s in range(2)]
    return Topology(devs, links, ["plx0", "plx1", "host"], name="pcie-4gpu")


def hetero() -> Topology:
    """Mixed generations on one host: 2x A100, 2x V100, 2x T4 on PCIe 4.0/3.0 plus the host CPU."""
    devs = [_a100("a100.0"), _a100("a100.1"), _v100("v100.0"), _v100("v100.1"), _t4("t4.0"), _t4("t4.1"),
            # 2-socket Xeon (e.g. 8380: 40 cores x 2.3 GHz x 32 FP32 FLOP/cycle ~ 2.9 TFLOP/s fp32 per socket);
            # 8 DDR4-3200 channels ~ 205 GB/s per socket (Intel ark)
            Device("cpu", "cpu", {"fp32": 5.9e12, "bf16": 5.9e12}, 512 * GB, 410 * GB, compute_eff=0.5,
                   mem_eff=0.6, launch_overhead=2e-5)]
    links = [Link("a100.0", "a100.1", kind="nvlink", bandwidth=100 * GB, latency=1e-6, efficiency=0.65)]
    links += [Link(d.name, "rc", kind="pcie", **(PCIE4 if d.kind == "a100-80g" else PCIE3)) for d in devs[:6]]
    links.append(Link("cpu", "rc", kind="membus", bandwidth=64 * GB, latency=5e-7, efficiency=0.8))
    return Topology(devs, links, ["rc"], name="hetero")


def rlplace_home() -> Path:
    return Path(os.environ.get("RLPLACE_HOME", Path.home() / ".rlplace"))


def calibrated_cpu_local_path() -> Path:
    return rlplace_home() / "topologies" / "cpu-local.json"


def cpu_local(devices: int = 2) -> Topology:
    """This host's CPU cores as ``devices`` local devices. Defaults are conservative guesses for one
    modern x86 core with AVX2 (2 FMA x 8 fp32 lanes x ~3 GHz ~ 100 GFLOP/s peak); `rlplace profile
    --measure` replaces them with measured numbers (written to ~/.rlplace/topologies/cpu-local.json)."""
    if devices < 1:
        raise TopologyError("cpu-local needs devices >= 1")
    check_device_count(devices, f"cpu-local:devices={devices}")
    path = calibrated_cpu_local_path()
    if path.exists():
        topo = Topology.load(path)
        topo.meta["calibrated"] = True
        if devices == topo.num_devices:
            return topo
        # same measured device and link, another count of devices
        dev0, link0 = topo.devices[0], topo.links[0]
        devs = [Device(**{**dev0.__dict__, "name": f"cpu{i}"}) for i in range(devices)]
        links = [Link(d.name, "shm", kind=link0.kind, bandwidth=link0.bandwidth, latency=link0.latency,
                      efficiency=link0.efficiency) for d in devs]
        return Topology(devs, links, ["shm"], name="cpu-local", meta=dict(topo.meta))
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = 16 * GiB
    devs = [Device(f"cpu{i}", "cpu", {"fp32": 100e9, "bf16": 100e9}, mem / devices, 20 * GB, compute_eff=0.5,
                   mem_eff=0.5, launch_overhead=2e-5) for i in range(devices)]
    # Inter-process copy through shared memory: ~5 GB/s, ~20 us per message (gloo on loopback, order of)
    links = [Link(d.name, "shm", kind="shm", bandwidth=5 * GB, latency=2e-5, efficiency=1.0) for d in devs]
    return Topology(devs, links, ["shm"], name="cpu-local", meta={"calibrated": False})


PRESETS: dict[str, Callable[..., Topology]] = {
    "dgx-a100-80g": dgx_a100_80g,
    "a100-80g-cluster": a100_cluster,
    "dgx-h100": dgx_h100,
    "dgx1-v100": dgx1_v100,
    "pcie-4gpu": pcie_4gpu,
    "hetero": hetero,
    "cpu-local": cpu_local,
}


def preset(spec: str) -> Topology:
    """``name`` or ``name:key=value,...`` (e.g. ``a100-80g-cluster:nodes=4``)."""
    name, _, args = spec.partition(":")
    if name not in PRESETS:
        raise TopologyError(f"unknown topology preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    kwargs = {}
    for part in filter(None, args.split(",")):
        key, eq, value = part.partition("=")
        if not eq:
            raise TopologyError(f"bad preset argument {part!r} in {spec!r} (expected key=value)")
        try:
            kwargs[key.strip()] = int(value)
        except ValueError as exc:
            raise TopologyError(f"preset argument {key}={value!r} must be an integer") from exc
    try:
        return PRESETS[name](**kwargs)
    except TypeError as exc:
        raise TopologyError(f"bad arguments for preset {name!r}: {exc}") from exc


def resolve_topology(spec: str | Topology) -> Topology:
    """A preset name (``dgx-a100-80g``, ``a100-80g-cluster:nodes=4``) or a yaml/JSON file."""
    if isinstance(spec, Topology):
        return spec
    name = str(spec).split(":", 1)[0]
    if name in PRESETS:
        return preset(str(spec))
    if os.path.exists(spec):
        return Topology.load(spec)
    raise TopologyError(f"unknown topology {spec!r}: not a preset ({', '.join(sorted(PRESETS))}) nor a file")
