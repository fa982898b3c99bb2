"""Schemas of rlplace's files: graph JSON, topology yaml/JSON and plan JSON (pydantic, strict).

Each schema says the type and range of every field; ``extra="forbid"`` makes a misspelt key an error
instead of a silent default. Numbers are finite and bounded (:data:`LIMITS`), integers are integers
(``1.7`` is not a node index, ``true`` is not a count), strings are strings. The schemas check *shape*;
the cross-field rules (a DAG, edges that name existing nodes, links between known devices, a plan that
fits its graph) are the objects' own ``validate`` methods. :mod:`envs.files` turns a schema failure into
one line naming the file and the field.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from envs.graph import DTYPE_BYTES

# Bounds on what a file may say: far beyond any real model or machine, small enough that every time
# the simulator derives from them stays a finite float with room to spare.
LIMITS = {
    "flops": 1e24,  # FLOPs of one op at the traced batch (a 1T-parameter GPT's largest GEMM is ~1e19)
    "bytes": 1e18,  # bytes of one tensor, parameter set or memory (1 EB)
    "seconds": 1e6,  # a measured op or transfer time
    "batch": 10**9,
    "n_ops": 10**9,
    "nodes": 5_000_000,  # operators in one graph file
    "flop_rate": 1e18,  # FLOP/s of one device
    "bandwidth": 1e15,  # bytes/s of one link or memory system
    "latency": 1.0,  # seconds of one link's latency or one kernel's launch overhead
    "hosts": 10**6,
    "microbatches": 10**6,
    "state_bytes_per_param": 1024.0,
}
DTYPES = tuple(DTYPE_BYTES)


def _num(lo: float, hi: float, *, gt: bool = False):
    if gt:
        return Annotated[float, Field(gt=lo, le=hi, allow_inf_nan=False, strict=True)]
    return Annotated[float, Field(ge=lo, le=hi, allow_inf_nan=False, strict=True)]


def _int(lo: int, hi: int):
    return Annotated[int, Field(ge=lo, le=hi, strict=True)]


Flops = _num(0.0, LIMITS["flops"])
Bytes = _num(0.0, LIMITS["bytes"])
Seconds = _num(0.0, LIMITS["seconds"])
Fraction = _num(0.0, 1.0, gt=True)
Name = Annotated[str, Field(min_length=1, max_length=1000, strict=True)]
Text = Annotated[str, Field(max_length=10_000, strict=True)]
Dtype = Literal[DTYPES]
Count = Annotated[int, Field(ge=0, le=10**9, strict=True)]


class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# ---------------------------------------------------------------------- graph
class GraphNodeDoc(_Doc):
    name: Name
    kind: Name = "op"
    module: Text = ""
    fwd_flops: Flops = 0.0
    bwd_flops: Flops | None = None
    param_bytes: Bytes = 0.0
    out_bytes: Bytes = 0.0
    mem_bytes: Bytes | None = None
    layout_caps: _int(0, 15) | None = None
    colocation: _int(-1, 10**9) = -1
    n_ops: _int(0, LIMITS["n_ops"]) = 1
    saved_bytes: Bytes = 0.0
    measured: dict[Name, Annotated[list[Seconds], Field(min_length=2, max_length=2)]] = Field(default_factory=dict)
    # matrix multiplies: [m, n, k, batch, kind] (kind 0 dense, 1 per head; see envs.graph.OpGraph.gemm_node)
    gemms: list[Annotated[list[Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False, strict=True)]],
                          Field(min_length=5, max_length=5)]] = Field(default_factory=list)


# [source index, destination index, bytes] or [..., bytes, measured seconds]; the indices' integrality
# and every range are checked by OpGraph.from_dict (a JSON array holds one number type for all four)
Number = Annotated[float, Field(allow_inf_nan=False, strict=True)] | Annotated[int, Field(strict=True)]
GraphEdgeDoc = Annotated[list[Number], Field(min_length=3, max_length=4)]


class GraphDoc(_Doc):
    format: Literal["rlplace.opgraph"]
    version: _int(1, 10**6)
    name: Text = "graph"
    batch_size: _int(1, LIMITS["batch"]) = 1
    dtype: Dtype = "bf16"
    meta: dict = Field(default_factory=dict)
    nodes: Annotated[list[GraphNodeDoc], Field(min_length=1, max_length=LIMITS["nodes"])]
    edges: list[GraphEdgeDoc] = Field(default_factory=list)


# ---------------------------------------------------------------------- topology
class DeviceDoc(_Doc):
    name: Name | None = None
    kind: Name
    peak_flops: Annotated[dict[Name, _num(0.0, LIMITS["flop_rate"], gt=True)], Field(min_length=1)]
    memory_bytes: _num(0.0, LIMITS["bytes"], gt=True)
    mem_bw: _num(0.0, LIMITS["bandwidth"], gt=True)
    host: _int(0, LIMITS["hosts"]) = 0
    compute_eff: Fraction = 0.7
    mem_eff: Fraction = 0.8
    launch_overhead: _num(0.0, LIMITS["latency"]) = 5e-6
    pays_comm: Annotated[bool, Field(strict=True)] = True
    sm_count: _int(0, 100_000) = 0
    gemm_tile: _int(1, 100_000) = 128
    host_overhead: _num(0.0, LIMITS["latency"]) = 0.0
    comm_overhead: _num(0.0, LIMITS["latency"]) = 0.0
    p2p_overhead: _num(0.0, LIMITS["latency"]) = 0.0
    sync_overhead: _num(0.0, LIMITS["latency"]) = 0.0
    recompute_overhead: _num(0.0, LIMITS["latency"]) = 0.0
    count: _int(1, 10**9) = 1


class LinkDoc(_Doc):
    a: Name
    b: Name
    bandwidth: _num(0.0, LIMITS["bandwidth"], gt=True)
    latency: _num(0.0, LIMITS["latency"]) = 1e-6
    efficiency: Fraction = 1.0
    kind: Name = "link"


class TopologyDoc(_Doc):
    format: Literal["rlplace.topology"] | None = None
    version: _int(1, 10**6) | None = None
    name: Text = "custom"
    meta: dict = Field(default_factory=dict)
    devices: Annotated[list[DeviceDoc], Field(min_length=1)]
    switches: list[Name] = Field(default_factory=list)
    links: list[LinkDoc] = Field(default_factory=list)


# ---------------------------------------------------------------------- plan
class PlanNodeDoc(_Doc):
    devices: Annotated[list[_int(0, 10**7)], Field(min_length=1)]
    layout: Literal["single", "batch_split", "col_split", "row_split", "replicate", "seq_split"]
    dp: _int(1, 10**7) = 1
    recompute: Annotated[bool, Field(strict=True)] = False
    zero: _int(0, 3) = 0
    ep: _int(1, 10**7) = 1


class PlanGraphDoc(_Doc):
    name: Text = ""
    num_nodes: _int(1, LIMITS["nodes"])
    fingerprint: Annotated[str, Field(min_length=1, max_length=128, strict=True)]


class PlanDoc(_Doc):
    format: Literal["rlplace.plan"]
    version: _int(1, 10**6)
    microbatches: _int(1, LIMITS["microbatches"]) = 1
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    virtual_stages: _int(1, 1024) = 1
    global_batch: _int(1, LIMITS["batch"]) | None = None
    dtype: Dtype = "bf16"
    state_bytes_per_param: _num(0.0, LIMITS["state_bytes_per_param"]) = 16.0
    provenance: dict = Field(default_factory=dict)
    graph: PlanGraphDoc | None = None
    nodes: Annotated[list[PlanNodeDoc], Field(min_length=1, max_length=LIMITS["nodes"])]


__all__ = ["LIMITS", "DTYPES", "GraphDoc", "GraphNodeDoc", "TopologyDoc", "DeviceDoc", "LinkDoc", "PlanDoc",
           "PlanNodeDoc", "PlanGraphDoc"]
