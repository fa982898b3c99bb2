"""Plan: everything needed to run one training step of a graph on a topology.

Per node: a device group and a layout.

- ``single``: the whole op on one device.
- ``batch_split``: data parallel; each of the n devices runs 1/n of the microbatch with a full copy of
  the weights; weight gradients are all-reduced over the group.
- ``col_split``: tensor parallel (Megatron column split). An op with weights splits its output
  features (weights split by columns, input replicated, output sharded); a weightless op runs on a
  feature-/head-sharded tensor (e.g. GeLU or attention between a column and a row split).
- ``row_split``: tensor parallel (Megatron row split): weights split by input features, input
  sharded, output a partial sum that the consumer reduces (all-reduce). Embeddings split by vocab.
- ``replicate``: the same op computed redundantly on every tensor-parallel rank (Megatron's
  LayerNorm, residual adds): input and output replicated.
- ``seq_split``: sequence parallelism beside tensor parallelism (Korthikanti et al. 2022, Sec. 4.2.2):
  a token-wise op (LayerNorm, dropout, residual add) of a tensor-parallel group runs on 1/tp of the
  sequence; its input comes from a row split by reduce-scatter and goes to a column split by
  all-gather (in place of the all-reduce), its activations are 1/tp, its weights' gradients are
  all-reduced over the whole group.

Per node also a ZeRO stage over its data-parallel replicas (Rajbhandari et al., SC'20): 1 shards the
optimizer states, 2 also the gradients (reduce-scattered), 3 also the parameters (all-gathered before
each forward and backward); and whether its forward is recomputed in the backward (activation
checkpointing: full recomputation flags every node, selective recomputation only the attention core,
:func:`attention_core`). Globally: the microbatches, the pipeline schedule and the number of virtual
pipeline stages per device (interleaved 1F1B, Narayanan et al. SC'21, Sec. 2.2).

A group of size n may combine data and tensor parallelism: ``dp`` is the data-parallel degree and
tp = n / dp the tensor-parallel degree; devices are ordered dp-major (``group[r * tp + t]``).
Pipeline stages are the distinct device groups in the order the graph first uses them.

Expert parallelism (``ep`` per node, DeepSpeed-MoE, Rajbhandari et al. ICML'22; Megatron-LM's
``--expert-model-parallel-size``): the experts of a mixture-of-experts layer (nodes under a module path
``...experts.<i>...``, :func:`expert_layers`) are spread over ep devices of their data-parallel group.
The group splits into EP groups of ep consecutive ranks; EP rank j of each EP group holds the experts
j*E/ep .. (j+1)*E/ep - 1 (E experts in the layer) and computes them for the tokens of all ep ranks of its
EP group (an all-to-all dispatches the tokens to their experts and one combines them back); an expert's
replicas are the devices of its EP rank in every EP group (dp / ep of them, its gradients all-reduced,
its ZeRO shards spread, over those).
"""

from __future__ import annotations

import marshal
import os
import re
from dataclasses import dataclass, field

import numpy as np

from envs.errors import PlanError
from envs.files import atomic_write_json
from envs.graph import CAN_BATCH, CAN_COL, CAN_REPLICATE, CAN_ROW, DTYPE_BYTES, OpGraph, int_array
from envs.topology import Topology

FORMAT = "rlplace.plan"
VERSION = 3  # 2: per-node ZeRO stage, the seq_split layout, virtual stages; 3: expert parallelism (older files load)
LAYOUTS = ("single", "batch_split", "col_split", "row_split", "replicate", "seq_split")
SCHEDULES = ("gpipe", "1f1b")
RECOMPUTE = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)
# attention-core ops: what selective recomputation recomputes (Korthikanti et al. 2022, Sec. 5: the
# QK^T, softmax, dropout and attention-over-values part of a layer)
ATTENTION_CORE_KINDS = ("attention", "sdpa")
_ATTENTION_INNER_KINDS = ("softmax", "dropout", "matmul", "bmm", "baddbmm", "softmax_heads")
# Mixed-precision Adam: fp16/bf16 weights (2) + grads (2) + fp32 master, momentum, variance (12)
# = 16 bytes per parameter (Rajbhandari et al., ZeRO, SC'20, Sec. 3.1).
ADAM_MIXED_BYTES_PER_PARAM = 16.0
# imported dnn-partitioning workloads state every stored byte (Tarnawski et al., NeurIPS 2020 workloads)
IMPORTED_WORKLOAD_SOURCES = ("dnn-partitioning",)


def plan_defaults(graph: OpGraph) -> dict:
    """dtype and model-state bytes per parameter of the plans built for ``graph`` (by the placers and the
    placement environment alike): the graph's dtype with mixed-precision Adam's 16 bytes; imported
    dnn-partitioning workloads count memory as one byte per stored byte (fp32, 4 B per parameter)."""
    if graph.meta.get("source") in IMPORTED_WORKLOAD_SOURCES:
        return {"dtype": "fp32", "state_bytes_per_param": 4.0}
    dtype = graph.dtype if graph.dtype in DTYPE_BYTES else "bf16"
    return {"dtype": dtype, "state_bytes_per_param": ADAM_MIXED_BYTES_PER_PARAM}


def _device_groups(groups: list) -> list[tuple[int, ...]]:
    """Every node's device group as a tuple of ints (:func:`_device_group`); when they are all tuples,
    each distinct one is converted once (a plan's nodes share a few groups)."""
    try:
        distinct = dict.fromkeys(groups)
    except TypeError:  # a list among them
        distinct = None
    if distinct is None or any(type(g) is not tuple for g in distinct):
        return [_device_group(g, i) for i, g in enumerate(groups)]
    canon = {}
    for g in distinct:
        try:
            canon[g] = _device_group(g, -1)
        except PlanError:
            _device_group(g, groups.index(g))  # raises again, naming the first node with it
            raise
    return [canon[g] for g in groups]


def _device_group(g, i: int) -> tuple[int, ...]:
    """A node's device group as a tuple of ints (refusing strings, booleans and non-integral numbers)."""
    if isinstance(g, (str, bytes)) or not hasattr(g, "__iter__"):
        raise PlanError(f"node {i}: devices must be a list of device indices, got {g!r}")
    out = []
    for d in g:
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)):
            if isinstance(d, (float, np.floating)) and float(d).is_integer():
                d = int(d)
            else:
                raise PlanError(f"node {i}: device {d!r} is not a device index (an integer)")
        out.append(int(d))
    return tuple(out)


def _flags(values, n: int) -> np.ndarray:
    """Per-node booleans: bools or 0/1 (a string like "no" is not a flag)."""
    arr = np.asarray(values).reshape(-1)
    if arr.dtype == bool:
        return arr
    if arr.size and not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise PlanError(f"recompute must be true/false per node, got {arr.dtype} values")
    if arr.size and not np.isin(arr, (0, 1)).all():
        raise PlanError("recompute must be true/false (or 0/1) per node")
    return arr.astype(bool)


@dataclass(eq=False)
class Plan:
    groups: list[tuple[int, ...]]
    layouts: list[str]
    dp: np.ndarray | None = None
    recompute: np.ndarray | None = None
    microbatches: int = 1
    schedule: str = "1f1b"
    global_batch: int | None = None  # None: the graph's traced batch
    dtype: str = "bf16"
    state_bytes_per_param: float = ADAM_MIXED_BYTES_PER_PARAM
    provenance: dict = field(default_factory=dict)
    graph_id: dict | None = None  # {"name", "num_nodes", "fingerprint"} of the graph the plan was made for
    zero: np.ndarray | None = None  # ZeRO stage (0-3) per node over its data-parallel replicas
    virtual_stages: int = 1  # model chunks per pipeline device (interleaved 1F1B when > 1)
    ep: np.ndarray | None = None  # expert-parallel degree per node (1: not expert-parallel)

    def __post_init__(self) -> None:
        n = len(self.groups)
        self.groups = _device_groups(self.groups)
        self.layouts = [str(x) for x in self.layouts]
        if len(self.layouts) != n:
            raise PlanError(f"plan has {n} groups but {len(self.layouts)} layouts")
        if self.dp is None:
            self.dp = np.array([len(g) if lay == "batch_split" else 1 for g, lay in zip(self.groups, self.layouts)],
                               dtype=np.int64)
        self.dp = int_array(self.dp, "dp", PlanError)
        self.recompute = np.zeros(n, dtype=bool) if self.recompute is None else _flags(self.recompute, n)
        self.zero = np.zeros(n, dtype=np.int64) if self.zero is None else int_array(self.zero, "zero", PlanError)
        self.ep = np.ones(n, dtype=np.int64) if self.ep is None else int_array(self.ep, "ep", PlanError)
        if (self.dp.shape[0] != n or self.recompute.shape[0] != n or self.zero.shape[0] != n
                or self.ep.shape[0] != n):
            raise PlanError("plan arrays (dp, recompute, zero, ep) do not match the number of nodes")
        for what in ("microbatches", "global_batch", "virtual_stages"):
            v = getattr(self, what)
            if v is None and what == "global_batch":
                continue
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise PlanError(f"{what} must be an integer, got {v!r}")
            setattr(self, what, int(v))
        self.state_bytes_per_param = float(self.state_bytes_per_param)

    def bind(self, graph: OpGraph) -> Plan:
        """Record which graph this plan is for (checked by :meth:`validate`); returns the plan."""
        self.graph_id = {"name": graph.name, "num_nodes": graph.num_nodes, "fingerprint": graph.fingerprint()}
        return self

    @property
    def num_nodes(self) -> int:
        return len(self.groups)

    def batch(self, graph: OpGraph) -> int:
        return int(self.global_batch if self.global_batch is not None else graph.batch_size)

    def microbatch_size(self, graph: OpGraph) -> float:
        return self.batch(graph) / self.microbatches

    def tp(self, i: int) -> int:
        return len(self.groups[i]) // int(self.dp[i])

    def replicas(self, i: int) -> int:
        """How many copies of node i's weights the plan keeps (over which its gradients are reduced and
        its ZeRO shards spread): its data-parallel degree, divided by its expert-parallel degree."""
        return int(self.dp[i]) // int(self.ep[i])

    def devices_used(self) -> list[int]:
        return sorted({d for g in self.groups for d in g})

    def stages(self, graph: OpGraph) -> tuple[np.ndarray, int]:
        """Pipeline stage of each node: distinct device groups in order of first use in topological order."""
        stage_of_group: dict[tuple[int, ...], int] = {}
        stage = np.zeros(self.num_nodes, dtype=np.int64)
        for v in graph.topological_order():
            g = self.groups[v]
            if g not in stage_of_group:
                stage_of_group[g] = len(stage_of_group)
            stage[v] = stage_of_group[g]
        return stage, max(1, len(stage_of_group))

    # ------------------------------------------------------------------ validation
    def validate(self, graph: OpGraph, topology: Topology) -> None:
        if self.num_nodes != graph.num_nodes:
            raise PlanError(f"plan has {self.num_nodes} nodes, graph {graph.name!r} has {graph.num_nodes}")
        if self.graph_id and self.graph_id.get("fingerprint") != graph.fingerprint():
            raise PlanError(f"the plan was made for graph {self.graph_id.get('name')!r} (fingerprint "
                            f"{self.graph_id.get('fingerprint')}), not for {graph.name!r} ({graph.fingerprint()})")
        if self.microbatches < 1:
            raise PlanError(f"microbatches must be >= 1, got {self.microbatches}")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if self.dtype not in DTYPE_BYTES:
            raise PlanError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPE_BYTES)}")
        if not (np.isfinite(self.state_bytes_per_param) and self.state_bytes_per_param >= 0):
            raise PlanError("state_bytes_per_param must be >= 0")
        batch = self.batch(graph)
        if batch < 1:
            raise PlanError(f"global batch must be >= 1, got {batch}")
        if batch % self.microbatches:
            raise PlanError(f"global batch {batch} is not divisible by {self.microbatches} microbatches")
        if self.zero.size and (self.zero.min() < 0 or self.zero.max() > 3):
            raise PlanError(f"ZeRO stage must be 0, 1, 2 or 3, got {int(self.zero[(self.zero < 0) | (self.zero > 3)][0])}")
        self._validate_virtual_stages(graph)
        self._validate_expert_parallel(graph)
        mb = batch // self.microbatches
        nd = topology.num_devices
        seen: set[tuple] = set()  # a (group, layout, dp, caps, zero, ep) passes or fails wherever it appears
        for i, (g, lay, dp, caps, z, ep) in enumerate(zip(self.groups, self.layouts, self.dp.tolist(),
                                                         graph.layout_caps.tolist(), self.zero.tolist(),
                                                         self.ep.tolist())):
            if (g, lay, dp, caps, z, ep) in seen:
                continue
            seen.add((g, lay, dp, caps, z, ep))
            who = f"node {graph.names[i]!r}"
            if not g:
                raise PlanError(f"{who}: empty device group")
            if len(set(g)) != len(g):
                raise PlanError(f"{who}: device group {g} repeats a device")
            if min(g) < 0 or max(g) >= nd:
                raise PlanError(f"{who}: device group {g} is outside the topology's {nd} devices")
            if lay not in LAYOUTS:
                raise PlanError(f"{who}: unknown layout {lay!r}; choose one of {', '.join(LAYOUTS)}")
            if dp < 1 or len(g) % dp:
                raise PlanError(f"{who}: dp={dp} does not divide its group of {len(g)} devices")
            if lay == "single" and len(g) != 1:
                raise PlanError(f"{who}: layout 'single' needs exactly one device, got {g}")
            if lay == "batch_split" and dp != len(g):
                raise PlanError(f"{who}: batch_split over {len(g)} devices needs dp={len(g)}, got {dp}")
            if (dp > 1 or lay == "batch_split") and not caps & CAN_BATCH:
                raise PlanError(f"{who} ({graph.kinds[i]}) cannot be split by batch")
            if lay == "col_split" and not caps & CAN_COL:
                raise PlanError(f"{who} ({graph.kinds[i]}) does not allow col_split")
            if lay == "row_split" and not caps & CAN_ROW:
                raise PlanError(f"{who} ({graph.kinds[i]}) does not allow row_split")
            if lay == "replicate" and not caps & CAN_REPLICATE:
                raise PlanError(f"{who} ({graph.kinds[i]}) does not allow replicate (it may run on one device only)"
                                if not caps else f"{who} ({graph.kinds[i]}) does not allow replicate")
            if mb % dp:
                raise PlanError(f"{who}: microbatch of {mb} samples does not split over dp={dp}")
            if z > 0 and dp < 2:
                raise PlanError(f"{who}: ZeRO stage {z} needs data parallelism (dp >= 2), but dp={dp}: "
                                "ZeRO shards model states over the data-parallel replicas")
            if z > 0 and self.replicas(i) < 2:
                raise PlanError(f"{who}: ZeRO stage {z} needs at least 2 replicas of the expert, but dp={dp} "
                                f"with expert parallelism ep={int(self.ep[i])} keeps one")
            if lay == "seq_split":
                if len(g) // dp < 2:
                    raise PlanError(f"{who}: sequence parallelism (seq_split) needs tensor parallelism "
                                    f"(tp >= 2), but its group of {len(g)} devices with dp={dp} has tp=1")
                if not (caps & CAN_REPLICATE and caps & CAN_BATCH) or is_attention_core(graph, i):
                    raise PlanError(f"{who} ({graph.kinds[i]}) cannot be split along the sequence "
                                    "(seq_split is for token-wise ops: norms, dropout, residual adds)")
        for i in graph.meta.get("cpu_only") or []:  # ops the accelerators cannot run (imported workloads)
            bad = [d for d in self.groups[int(i)] if topology.devices[d].kind != "cpu"]
            if bad:
                raise PlanError(f"node {graph.names[int(i)]!r} runs only on CPUs but is placed on "
                                f"{topology.devices[bad[0]].name!r}")
        classes: dict[int, int] = {}
        for i, c in enumerate(graph.colocation.tolist()):
            if c < 0:
                continue
            j = classes.setdefault(c, i)
            if self.groups[i] != self.groups[j] or self.layouts[i] != self.layouts[j]:
                raise PlanError(f"co-location class {c} is split: {graph.names[j]!r} on {self.groups[j]} "
                                f"but {graph.names[i]!r} on {self.groups[i]}")

    def _validate_virtual_stages(self, graph: OpGraph) -> None:
        """Interleaving: v model chunks per device, the chunks visiting the pipeline's devices in turn
        (chunk c on device c mod p, Narayanan et al. SC'21, Sec. 2.2); Megatron-LM needs the microbatches
        to be a multiple of the pipeline depth."""
        v = self.virtual_stages
        if v < 1:
            raise PlanError(f"virtual_stages must be >= 1, got {v}")
        if v == 1:
            return
        if self.schedule != "1f1b":
            raise PlanError(f"virtual stages (interleaving) need the 1f1b schedule, got {self.schedule!r}")
        chunks, p = self.chunks(graph)
        if p < 2:
            raise PlanError(f"virtual_stages={v} needs pipeline parallelism (at least 2 pipeline devices)")
        if chunks.max() + 1 != p * v:
            raise PlanError(f"virtual_stages={v}: the plan's {int(chunks.max()) + 1} model chunks are not "
                            f"{v} chunks on each of its {p} pipeline device groups")
        stage, _ = self.stages(graph)
        bad = np.flatnonzero(stage != chunks % p)
        if bad.size:
            raise PlanError(f"virtual_stages={v}: model chunk {int(chunks[bad[0]])} (node {graph.names[bad[0]]!r}) is "
                            f"not on pipeline rank {int(chunks[bad[0]]) % p}: interleaving visits the ranks in turn")
        if self.microbatches % p:
            raise PlanError(f"interleaving needs the microbatches ({self.microbatches}) to be a multiple of "
                            f"the pipeline depth ({p})")

    def _validate_expert_parallel(self, graph: OpGraph) -> None:
        """Expert parallelism: only on the experts of a mixture-of-experts layer, all of a layer's experts
        alike, data-parallel (batch_split, tp = 1) over a group whose data-parallel degree ep divides, ep
        dividing the layer's experts; the ops that feed the experts and that the experts feed (the
        dispatch and combine all-to-alls' ends) data-parallel on the same group."""
        ep = self.ep
        if ep.size and ep.min() < 1:
            raise PlanError(f"expert-parallel degree must be >= 1, got {int(ep.min())}")
        if ep.max(initial=1) <= 1:
            return
        layer, index, count = expert_layers(graph)
        if (layer < 0).all():
            raise PlanError(f"expert parallelism (ep={int(ep.max())}) needs a mixture-of-experts model, but graph "
                            f"{graph.name!r} has no experts (no module path '...experts.<i>...')")
        bad = np.flatnonzero((ep > 1) & (layer < 0))
        if bad.size:
            raise PlanError(f"node {graph.names[bad[0]]!r} is not an expert, but has expert-parallel degree "
                            f"{int(ep[bad[0]])}")
        first: dict[int, int] = {}
        for v in np.flatnonzero(layer >= 0).tolist():
            u = first.setdefault(int(layer[v]), v)
            if (self.groups[v], int(ep[v]), int(self.dp[v])) != (self.groups[u], int(ep[u]), int(self.dp[u])):
                raise PlanError(f"the experts of one layer differ: {graph.names[u]!r} on {self.groups[u]} with "
                                f"ep={int(ep[u])}, {graph.names[v]!r} on {self.groups[v]} with ep={int(ep[v])}: "
                                "expert parallelism spreads a layer's experts over one group")
            e = int(ep[v])
            if e <= 1:
                continue
            who = f"node {graph.names[v]!r}"
            if self.layouts[v] != "batch_split":
                raise PlanError(f"{who}: expert parallelism needs the experts data-parallel (batch_split), "
                                f"got {self.layouts[v]!r}")
            if int(self.dp[v]) % e:
                raise PlanError(f"{who}: expert-parallel degree {e} does not divide its data-parallel degree "
                                f"{int(self.dp[v])}")
            if int(count[v]) % e:
                raise PlanError(f"{who}: expert-parallel degree {e} does not divide the layer's {int(count[v])} "
                                "experts")
        for e in range(graph.num_edges):
            a, b = int(graph.edge_src[e]), int(graph.edge_dst[e])
            if (layer[a], index[a]) == (layer[b], index[b]):
                continue  # inside one expert (or outside every expert)
            for x, y in ((a, b), (b, a)):
                if layer[x] < 0 or ep[x] <= 1:
                    continue
                if layer[y] >= 0 and ep[y] > 1:
                    raise PlanError(f"experts {graph.names[x]!r} and {graph.names[y]!r} are connected: an "
                                    "expert-parallel layer's experts exchange tokens only through its dispatch "
                                    "and combine")
                if (self.layouts[y] != "batch_split" or self.groups[y] != self.groups[x]
                        or int(self.dp[y]) != int(self.dp[x])):
                    raise PlanError(f"node {graph.names[y]!r} exchanges tokens with the expert-parallel "
                                    f"{graph.names[x]!r}: it must be data-parallel (batch_split) on the experts' "
                                    f"group {self.groups[x]} (the all-to-all runs inside it)")

    def chunks(self, graph: OpGraph) -> tuple[np.ndarray, int]:
        """(model chunk of each node, number of distinct device groups): a new chunk starts wherever the
        device group changes along the topological order (contiguous runs of one group)."""
        chunk = np.zeros(self.num_nodes, dtype=np.int64)
        groups: dict[tuple[int, ...], int] = {}
        prev, c = None, -1
        for v in graph.topological_order():
            g = self.groups[v]
            if g != prev:
                c += 1
                prev = g
                groups.setdefault(g, len(groups))
            chunk[v] = c
        return chunk, max(1, len(groups))

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict:
        d = {"format": FORMAT, "version": VERSION, "microbatches": self.microbatches,
             "schedule": self.schedule, "virtual_stages": self.virtual_stages, "global_batch": self.global_batch,
             "dtype": self.dtype, "state_bytes_per_param": self.state_bytes_per_param, "provenance": self.provenance,
             "nodes": [{"devices": list(g), "layout": lay, "dp": int(dp), "recompute": bool(rc), "zero": int(z),
                        **({"ep": int(e)} if e > 1 else {})}
                       for g, lay, dp, rc, z, e in zip(self.groups, self.layouts, self.dp, self.recompute,
                                                       self.zero, self.ep)]}
        if self.graph_id:
            d["graph"] = dict(self.graph_id)
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str | os.PathLike | None = None) -> Plan:
        """A Plan from its JSON dict (checked against ``envs.schema.PlanDoc``; ``source`` names the file)."""
        from envs.files import validated
        from envs.schema import PlanDoc

        where = f"{source}: " if source is not None else ""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise PlanError(f"{where}not an rlplace plan (expected \"format\": {FORMAT!r})")
        version = d.get("version")
        if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
            raise PlanError(f"{where}plan file version {version} is newer than this rlplace reads ({VERSION})")
        doc = validated(PlanDoc, d, "plan", PlanError, source)
        nodes = doc.nodes
        try:
            return cls(groups=[tuple(nd.devices) for nd in nodes], layouts=[nd.layout for nd in nodes],
                       dp=[nd.dp for nd in nodes], recompute=[nd.recompute for nd in nodes],
                       zero=[nd.zero for nd in nodes], ep=[nd.ep for nd in nodes],
                       virtual_stages=doc.virtual_stages,
                       microbatches=doc.microbatches, schedule=doc.schedule, global_batch=doc.global_batch,
                       dtype=doc.dtype, state_bytes_per_param=doc.state_bytes_per_param,
                       provenance=dict(doc.provenance),
                       graph_id=doc.graph.model_dump() if doc.graph is not None else None)
        except PlanError as exc:
            raise PlanError(f"{where}{exc}") from None

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        """Read a plan JSON file (one-line PlanError for anything wrong with it)."""
        from envs.files import read_document

        return cls.from_dict(read_document(path, "plan file", PlanError), source=path)

    def key(self) -> bytes:
        """A hashable identity of the plan's decisions (for in-memory evaluation caches, not stable across
        Python versions): ``marshal`` format 2, which writes equal values alike whatever objects hold them
        (no back-references), of the groups, layouts, the per-node arrays' bytes and the global choices;
        ~7x faster than the JSON it replaces on 300 nodes."""
        arrays = tuple(np.asarray(a, dtype=t).tobytes() for a, t in ((self.dp, np.int64), (self.recompute, np.bool_),
                                                                      (self.zero, np.int64), (self.ep, np.int64)))
        return marshal.dumps((self.groups, self.layouts, arrays, self.microbatches, self.schedule, self.global_batch,
                              self.dtype, self.state_bytes_per_param, self.virtual_stages), 2)

    def copy(self, **changes) -> Plan:
        """An independent copy with ``changes`` (field values, checked as the constructor checks them)."""
        fields = dict(groups=list(self.groups), layouts=list(self.layouts), dp=self.dp.copy(),
                      recompute=self.recompute.copy(), microbatches=self.microbatches, schedule=self.schedule,
                      global_batch=self.global_batch, dtype=self.dtype,
                      state_bytes_per_param=self.state_bytes_per_param, provenance=dict(self.provenance),
                      graph_id=self.graph_id, zero=self.zero.copy(), virtual_stages=self.virtual_stages,
                      ep=self.ep.copy())
        unknown = set(changes) - set(fields)
        if unknown:
            raise PlanError(f"Plan.copy: unknown field(s) {', '.join(sorted(unknown))}")
        fields.update(changes)
        return Plan(**fields)


def interleaved_where_valid(plan: Plan, graph: OpGraph, virtual_stages: int) -> Plan:
    """``plan`` with ``virtual_stages`` model chunks per pipeline rank where its placement and microbatches
    allow them (:meth:`Plan._validate_virtual_stages`), else without interleaving: a search move that
    keeps the chunks visiting the ranks in turn (one inside a chunk, or one at a chunk's edge onto its
    neighbour's devices) keeps the interleaved schedule, one that breaks them falls back to 1F1B."""
    if virtual_stages > 1:
        trial = plan if plan.virtual_stages == virtual_stages else plan.copy(virtual_stages=virtual_stages)
        try:
            trial._validate_virtual_stages(graph)
            return trial
        except PlanError:
            pass
    return plan if plan.virtual_stages == 1 else plan.copy(virtual_stages=1)


def is_attention_core(graph: OpGraph, v: int) -> bool:
    """Whether node v is part of an attention core: a fused attention op, or a parameter-free softmax,
    dropout or activation x activation matmul inside an attention module."""
    kind = graph.kinds[v]
    if kind in ATTENTION_CORE_KINDS:
        return True
    path = graph.module_paths[v].lower()
    return (kind in _ATTENTION_INNER_KINDS and graph.param_bytes[v] == 0
            and ("attn" in path or "attention" in path))


_EXPERT_RE = re.compile(r"^(.*?\bexperts)\.(\d+)(?:\.|$)")


def expert_layers(graph: OpGraph) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per node (layer, expert, experts in the layer): the mixture-of-experts layer it is an expert of
    (numbered in order of first appearance; -1 for a node outside any expert), its expert's index
    under that layer's ``experts`` module (``layers.3.moe.experts.5.fc1`` -> 5, as in torch.nn.ModuleList
    names of GShard/Switch/Mixtral-style models) and how many experts the layer has (0 outside)."""
    layer = np.full(graph.num_nodes, -1, dtype=np.int64)
    index = np.full(graph.num_nodes, -1, dtype=np.int64)
    ids: dict[str, int] = {}
    for v, path in enumerate(graph.module_paths):
        m = _EXPERT_RE.match(path)
        if m:
            layer[v] = ids.setdefault(m.group(1), len(ids))
            index[v] = int(m.group(2))
    count = np.zeros(graph.num_nodes, dtype=np.int64)
    for L in range(len(ids)):
        members = layer == L
        count[members] = int(index[members].max()) + 1
    return layer, index, count


def attention_core(graph: OpGraph) -> np.ndarray:
    """Per node: recomputed under selective recomputation (the attention core)."""
    return np.array([is_attention_core(graph, v) for v in range(graph.num_nodes)], dtype=bool)


def sequence_splittable(graph: OpGraph) -> np.ndarray:
    """Per node: sequence parallelism may split it (a token-wise op of a sequence model that can run
    replicated and split by samples, not an attention core, not a model input: the embedding reads
    every token)."""
    if "heads" not in graph.meta and "seq" not in graph.meta:
        return np.zeros(graph.num_nodes, dtype=bool)
    fed = np.zeros(graph.num_nodes, dtype=bool)
    fed[graph.edge_dst] = True
    caps = graph.layout_caps
    return fed & ((caps & CAN_REPLICATE) > 0) & ((caps & CAN_BATCH) > 0) & ~attention_core(graph)


def recompute_flags(graph: OpGraph, mode: str | bool) -> np.ndarray:
    """Per-node recomputation of a plan-wide mode: ``none``, ``selective`` (the attention core,
    Korthikanti et al. 2022) or ``full`` (every node, Chen et al. 2016); True/False mean full/none."""
    if mode is True or mode == "full":
        return np.ones(graph.num_nodes, dtype=bool)
    if mode is False or mode == "none" or mode is None:
        return np.zeros(graph.num_nodes, dtype=bool)
    if mode == "selective":
        return attention_core(graph)
    raise PlanError(f"unknown recomputation {mode!r}; choose one of {', '.join(RECOMPUTE)}")


# ---------------------------------------------------------------------- builders
def single_device_plan(graph: OpGraph, topology: Topology, device: int | None = None, **kw) -> Plan:
    d = topology.fastest_device(kw.get("dtype", "bf16")) if device is None else int(device)
    n = graph.num_nodes
    return Plan(groups=[(d,)] * n, layouts=["single"] * n, provenance={"placer": "single_device"}, **kw).bind(graph)


def data_parallel_plan(graph: OpGraph, topology: Topology, group: tuple[int, ...] | None = None, **kw) -> Plan:
    g = tuple(range(topology.num_devices)) if group is None else tuple(group)
    layouts = ["batch_split" if (c & CAN_BATCH) else "single" for c in graph.layout_caps.tolist()]
    groups = [g if lay == "batch_split" else (g[0],) for lay in layouts]
    return Plan(groups=groups, layouts=layouts, provenance={"placer": "data_parallel"}, **kw).bind(graph)


_LAYER_RE = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_ids(graph: OpGraph) -> np.ndarray:
    """Repeated-layer index per node from its module path (``layers.3.mlp`` -> 3), -1 if none."""
    out = np.full(graph.num_nodes, -1, dtype=np.int64)
    for i, p in enumerate(graph.module_paths):
        m = _LAYER_RE.search(p)
        if m:
            out[i] = int(m.group(1))
    return out


def stage_cuts(graph: OpGraph, pp: int) -> np.ndarray:
    """Where in the topological order a pipeline stage may start: where the repeated-layer index changes,
    or anywhere when the graph has fewer than ``pp - 1`` such places."""
    layers = layer_ids(graph)[graph.topological_order()]
    cand = np.flatnonzero(layers[1:] != layers[:-1]) + 1
    return cand if cand.size >= pp - 1 else np.arange(1, graph.num_nodes)


def contiguous_stages(graph: OpGraph, pp: int, weights: np.ndarray | None = None,
                      shares: np.ndarray | None = None) -> np.ndarray:
    """Split the topological order into ``pp`` contiguous stages balanced by ``weights`` (default FLOPs),
    cutting only where the layer index changes when the graph has layers. ``shares`` [pp]: each stage's
    fraction of the total weight (default equal; a faster device's stage takes a larger share)."""
    order = graph.topological_order()
    w = (graph.fwd_flops + graph.bwd_flops) if weights is None else np.asarray(weights, dtype=np.float64)
    w = w[order] + 1e-12
    cum = np.cumsum(w)
    total = cum[-1]
    cand_arr = stage_cuts(graph, pp)
    cuts: list[int] = []
    bounds = np.arange(1, pp) / pp if shares is None else np.cumsum(shares)[:-1] / np.sum(shares)
    for s in range(1, pp):
        target = total * bounds[s - 1]
        pos = cand_arr[np.argmin(np.abs(cum[cand_arr - 1] - target))]
        lo = cuts[-1] + 1 if cuts else 1
        pos = max(pos, lo)
        cuts.append(int(min(pos, len(order) - (pp - s))))
    stage_in_order = np.zeros(len(order), dtype=np.int64)
    for c in cuts:
        stage_in_order[c:] += 1
    stage = np.zeros(graph.num_nodes, dtype=np.int64)
    stage[order] = stage_in_order
    return stage


def layer_stages(graph: OpGraph, pp: int) -> np.ndarray | None:
    """Megatron-LM's pipeline split: the repeated layers evenly over ``pp`` stages (layers % pp == 0), what
    comes before the first layer (the embedding) on the first stage, what comes after the last (the final
    norm, the output layer, the loss) on the last; None when the graph has no layers or they do not divide."""
    lid = layer_ids(graph)
    layers = sorted({int(x) for x in lid if x >= 0})
    if not layers or len(layers) % pp:
        return None
    per = len(layers) // pp
    rank = {L: i for i, L in enumerate(layers)}
    stage = np.zeros(graph.num_nodes, dtype=np.int64)
    seen_layer = False
    for v in graph.topological_order().tolist():
        if lid[v] >= 0:
            stage[v] = rank[int(lid[v])] // per
            seen_layer = True
        else:
            stage[v] = pp - 1 if seen_layer else 0
    return stage


def megatron_layouts(graph: OpGraph) -> list[str]:
    """Megatron tensor-parallel layouts: a weighted op fed by a sharded tensor is row-split, otherwise
    column-split; weightless per-feature ops stay sharded between them; everything else replicated;
    embeddings vocab-parallel (row). (Shoeybi et al., "Megatron-LM", 2019, Sec. 3.)"""
    sharded = np.zeros(graph.num_nodes, dtype=bool)
    pred = graph.predecessor_lists()
    layouts = ["replicate"] * graph.num_nodes
    for v in graph.topological_order():
        caps = int(graph.layout_caps[v])
        in_sharded = any(sharded[p] for p in pred[v])
        weighted = graph.param_bytes[v] > 0
        if graph.kinds[v] == "embedding" and caps & CAN_ROW:
            layouts[v] = "row_split"
        elif weighted and caps & CAN_ROW and in_sharded:
            layouts[v] = "row_split"
        elif weighted and caps & CAN_COL and not in_sharded:
            layouts[v], sharded[v] = "col_split", True
        elif not weighted and caps & CAN_COL and in_sharded:
            layouts[v], sharded[v] = "col_split", True
    return layouts


def sequence_parallel_layouts(layouts: list[str], splittable) -> list[str]:
    """Megatron-LM's sequence parallelism (Korthikanti et al., 2022): the nodes ``layouts`` replicates
    between the tensor-parallel regions (norms, dropouts, residual adds) sequence-split instead where
    ``splittable`` says they may be."""
    return ["seq_split" if lay == "replicate" and splittable[v] else lay for v, lay in enumerate(layouts)]


def megatron_plan(graph: OpGraph, topology: Topology, *, tp: int = 1, pp: int = 1, dp: int = 1,
             microbatch_size: int | None = None, global_batch: int | None = None, schedule: str = "1f1b",
             recompute: str | bool = "none", dtype: str = "bf16", zero: int = 0, sequence_parallel: bool = False,
             virtual_stages: int = 1, expert_parallel: int = 1) -> Plan:
    """The standard 3-D (tensor x pipeline x data) configuration for a transformer graph, with
    Megatron-LM's and DeepSpeed's options: ``recompute`` none / selective (the attention core) / full,
    ``zero`` the ZeRO stage of the data-parallel replicas, ``sequence_parallel`` the token-wise ops of the
    tensor-parallel layers sequence-split, ``virtual_stages`` model chunks per pipeline rank (interleaved
    1F1B: the layers in pp x v equal chunks, chunk c on rank c mod pp), ``expert_parallel`` the experts
    of every mixture-of-experts layer spread over that many data-parallel ranks (tp = 1)."""
    if min(tp, pp, dp) < 1:
        raise PlanError("tp, pp and dp must be >= 1")
    if zero not in ZERO_STAGES:
        raise PlanError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero!r}")
    if zero and dp < 2:
        raise PlanError(f"ZeRO stage {zero} needs data parallelism (dp >= 2), got dp={dp}")
    if sequence_parallel and tp < 2:
        raise PlanError(f"sequence parallelism needs tensor parallelism (tp >= 2), got tp={tp}")
    if virtual_stages < 1:
        raise PlanError(f"virtual stages must be >= 1, got {virtual_stages}")
    if virtual_stages > 1 and pp < 2:
        raise PlanError(f"virtual stages (interleaving) need pipeline parallelism (pp >= 2), got pp={pp}")
    if virtual_stages > 1 and schedule != "1f1b":
        raise PlanError(f"virtual stages (interleaving) need the 1f1b schedule, got {schedule!r}")
    if expert_parallel < 1:
        raise PlanError(f"expert-parallel degree must be >= 1, got {expert_parallel}")
    if expert_parallel > 1:
        elayer, _, ecount = expert_layers(graph)
        if (elayer < 0).all():
            raise PlanError(f"expert parallelism (ep={expert_parallel}) needs a mixture-of-experts model, but "
                            f"graph {graph.name!r} has no experts (no module path '...experts.<i>...')")
        if tp > 1:
            raise PlanError("expert parallelism with tensor parallelism is not in the plan space: use tp=1 "
                            "(the experts' EP groups are data-parallel ranks)")
        if dp % expert_parallel:
            raise PlanError(f"expert-parallel degree {expert_parallel} does not divide dp={dp}")
        bad = sorted({int(c) for c in ecount[elayer >= 0] if c % expert_parallel})
        if bad:
            raise PlanError(f"expert-parallel degree {expert_parallel} does not divide the {bad[0]} experts of a layer")
    if tp * pp * dp > topology.num_devices:
        raise PlanError(f"tp*pp*dp = {tp * pp * dp} exceeds the topology's {topology.num_devices} devices")
    if pp > graph.num_nodes:
        raise PlanError(f"pp={pp} exceeds the graph's {graph.num_nodes} nodes")
    heads = graph.meta.get("heads")
    if tp > 1 and isinstance(heads, int) and heads % tp:
        raise PlanError(f"tp={tp} does not divide the model's {heads} attention heads (Megatron splits by head)")
    gb = int(global_batch if global_batch is not None else graph.batch_size)
    mbs = int(microbatch_size if microbatch_size is not None else max(1, gb // max(dp, 1)))
    if gb % (mbs * dp):
        raise PlanError(f"global batch {gb} is not a multiple of microbatch size {mbs} x dp {dp}")
    m = gb // mbs // dp
    if virtual_stages > 1:
        chunk = layer_stages(graph, pp * virtual_stages)
        if chunk is None:
            n_layers = len({int(x) for x in layer_ids(graph) if x >= 0})
            raise PlanError(f"{virtual_stages} virtual stages x pp={pp} do not divide the model's {n_layers} layers")
        if m % pp:
            raise PlanError(f"interleaving needs the microbatches ({m}) to be a multiple of pp={pp}")
        stage = chunk % pp
    else:
        even = layer_stages(graph, pp)
        stage = even if even is not None else contiguous_stages(graph, pp)
    layouts = megatron_layouts(graph) if tp > 1 else ["replicate"] * graph.num_nodes
    if sequence_parallel:
        if "heads" not in graph.meta and "seq" not in graph.meta:
            raise PlanError(f"sequence parallelism needs a sequence model (graph {graph.name!r} records no "
                            "attention heads or sequence length)")
        layouts = sequence_parallel_layouts(layouts, sequence_splittable(graph))
    width = tp * dp
    groups, dps, lays = [], [], []
    for v in range(graph.num_nodes):
        base = int(stage[v]) * width
        g = tuple(range(base, base + width))
        lay = layouts[v]
        caps = int(graph.layout_caps[v])
        if tp == 1:
            lay = "batch_split" if dp > 1 and caps & CAN_BATCH else "single"
            if lay == "single":
                g = (base,)
        elif dp > 1 and not caps & CAN_BATCH:
            lay, g = "single", (base,)
        groups.append(g)
        lays.append(lay)
        dps.append(len(g) // tp if lay in ("col_split", "row_split", "replicate", "seq_split") else len(g))
    eps = np.ones(graph.num_nodes, dtype=np.int64)
    if expert_parallel > 1:
        eps[(expert_layers(graph)[0] >= 0) & (np.array(dps) > 1)] = expert_parallel
    zeros = [zero if d // e > 1 else 0 for d, e in zip(dps, eps.tolist())]
    mode = "full" if recompute is True else ("none" if recompute is False else recompute)
    prov = {"placer": "megatron", "tp": tp, "pp": pp, "dp": dp, "microbatch_size": mbs}
    if zero or sequence_parallel or virtual_stages > 1 or mode == "selective" or expert_parallel > 1:
        prov.update(zero=zero, sequence_parallel=bool(sequence_parallel), virtual_stages=virtual_stages,
                    recompute=mode)
    if expert_parallel > 1:
        prov["expert_parallel"] = expert_parallel
    return Plan(groups=groups, layouts=lays, dp=dps, recompute=recompute_flags(graph, mode), zero=zeros, ep=eps,
                microbatches=m, schedule=schedule, global_batch=gb, dtype=dtype, virtual_stages=virtual_stages,
                provenance=prov).bind(graph)


def standard_plans(graph: OpGraph, topology: Topology, global_batch: int | None = None,
                   dtype: str = "bf16") -> dict[str, Plan]:
    """The plans every comparison starts from, by name: the whole graph on the fastest device; data
    parallelism over the largest hierarchy group whose size divides the batch; and the Megatron
    templates over all devices that are valid for the graph (tensor parallel across all, pipeline
    across all with 4 microbatches per stage, and 2-way tensor x pipeline)."""
    gb = int(graph.batch_size if global_batch is None else global_batch)
    n = topology.num_devices
    plans = {"single device": single_device_plan(graph, topology, global_batch=gb, dtype=dtype)}
    groups = sorted([tuple(range(n))] + list(topology.hierarchy_groups()), key=len, reverse=True)
    dp_group = next((g for g in groups if len(g) > 1 and gb % len(g) == 0), None)
    if dp_group is not None:
        plans[f"data parallel x{len(dp_group)}"] = data_parallel_plan(graph, topology, group=dp_group,
                                                                       global_batch=gb, dtype=dtype)
    for tp, pp in ((n, 1), (1, n), (2, n // 2)):
        if tp * pp != n or (tp == 1 and pp == 1):
            continue
        mbs = max(1, gb // (4 * pp)) if pp > 1 else gb
        try:
            plans[f"megatron tp{tp} pp{pp}"] = megatron_plan(graph, topology, tp=tp, pp=pp, dp=1, microbatch_size=mbs,
                                                             global_batch=gb, dtype=dtype)
        except PlanError:
            continue
    return plans
