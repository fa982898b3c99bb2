"""The compiled builder: the simulator's task graph built from arrays, for many evaluations of one graph.

``CompiledSimulator(graph, topology)`` precomputes the graph's static arrays once (topological
positions, the layout rules per node, device specs, edge byte classes) and caches, across plans,
interned device groups and the communication *template* of each kind of edge crossing (the
:func:`envs.sim.cost.layout_crossing` of an edge group: which collectives and transfers a tensor needs
between a producer's and a consumer's layout, and how long each takes). :meth:`CompiledSimulator.evaluate`
turns a plan into per-node and per-edge-group arrays with numpy, lets a numba kernel
(:mod:`envs.sim.kernels`) emit the whole step's task graph (forward/backward of every node for every
microbatch and the communication tasks between them) and list-schedules it.

It builds *exactly* the task graph of the reference builder :func:`envs.sim.reference.simulate_reference`
(same tasks in the same order, same durations, priorities and dependencies), so its results are
identical to it bit for bit (tests/test_simulator_fast.py checks this on random cases). Every cost
formula is :mod:`envs.sim.cost`'s; this module only re-arranges the work. :meth:`CompiledSimulator.delta`
re-evaluates a plan after moving one node, reusing the previous plan's arrays: only the moved node's
times and its edges' crossings are recomputed before re-scheduling. :func:`compiled_simulator` keeps
one per (graph, topology).

Imports :mod:`envs.sim.cost`, :mod:`envs.sim.kernels`, :mod:`envs.sim.schedule`, :mod:`envs.sim.waitlist_schedule`
(and envs.graph/plan/topology).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from envs.graph import OpGraph
from envs.plan import DTYPE_BYTES, Plan
from envs.sim.cost import (
    DDP_BUCKET_BYTES,
    KIND_COMM,
    KIND_OPT,
    L_COL,
    L_ROW,
    L_SEQ,
    LAYOUT_CODE,
    CommTimes,
    Crossing,
    OpTimes,
    StepReport,
    device_specs,
    dp_groups,
    finish_op_times,
    group_op_times,
    layout_crossing,
    memory,
    optimizer_time,
    work_split,
)
from envs.sim.kernels import assemble_tasks, ddp_buckets, expand_groups, group_edges, stage_of
from envs.sim.schedule import busy_times, csr_and_indegree
from envs.sim.waitlist_schedule import waitlist_schedule
from envs.topology import Topology


class EdgeGroups(NamedTuple):
    """A plan's edge groups (producer, consumer group, consumer dp, requirement, column-weighted), in
    order of first edge: what each needs (its template), and who consumes it (CSR over groups)."""

    producer: np.ndarray  # node
    signature: np.ndarray  # template id: see CompiledSimulator.crossing
    nbytes: np.ndarray  # the largest tensor of the group, for one microbatch
    cons_ptr: np.ndarray
    consumers: np.ndarray
    first_edge: np.ndarray


# ---------------------------------------------------------------------- lazy labels
class LazyLabels(Sequence):
    """Task labels built on first use (string formatting is most of the cost of a task graph)."""

    def __init__(self, make):
        self._make = make
        self._list: list[str] | None = None

    def _get(self) -> list[str]:
        if self._list is None:
            self._list = self._make()
        return self._list

    def __getitem__(self, i):
        return self._get()[i]

    def __len__(self) -> int:
        return len(self._get())

    def __iter__(self):
        return iter(self._get())

    def __eq__(self, other):
        return list(self._get()) == list(other)


# ---------------------------------------------------------------------- plan as arrays
class PlanArrays:
    """A plan in array form (what :meth:`CompiledSimulator.evaluate` computes from a Plan and reuses in delta)."""

    __slots__ = ("gid", "lay", "dp", "rc", "zero", "m", "vs", "schedule", "scale", "objective", "dtype", "state_bytes",
                 "fwd", "bwd", "host_f", "host_b", "plan", "like")

    def copy(self) -> PlanArrays:
        c = PlanArrays()
        for s in self.__slots__:
            v = getattr(self, s)
            setattr(c, s, v.copy() if isinstance(v, np.ndarray) else v)
        return c


class CompiledSimulator:
    """Compiled evaluator of plans for one (graph, topology). See the module docstring."""

    def __init__(self, graph: OpGraph, topology: Topology, comm: CommTimes | None = None):
        self.graph = graph
        self.topology = topology
        n = graph.num_nodes
        self.n = n
        self.nd = topology.num_devices
        self.topo_pos = np.empty(n, dtype=np.int64)
        self.topo = graph.topological_order()
        self.topo_pos[self.topo] = np.arange(n)
        self.order_bwd = np.argsort(-self.topo_pos, kind="stable").astype(np.int64)
        self.has_params = graph.param_bytes > 0
        self.is_emb = np.array([k == "embedding" for k in graph.kinds], dtype=bool)
        self.esrc = graph.edge_src.astype(np.int64)
        self.edst = graph.edge_dst.astype(np.int64)
        # edge bytes as ranks (for signature codes), monotone in the value
        self.byte_vals, self.byte_rank = np.unique(graph.edge_bytes, return_inverse=True)
        self.byte_rank = self.byte_rank.astype(np.int64)
        self.act = np.maximum(graph.mem_bytes - graph.param_bytes, 0.0)
        self._et = np.zeros(1) if graph.edge_time is None else np.ascontiguousarray(graph.edge_time, dtype=np.float64)
        self.pbytes = DTYPE_BYTES.get(graph.dtype, 2)
        self.param_mem = graph.meta.get("memory_model") == "param_bytes"
        # device groups (interned across plans) as CSR of sorted devices
        self._gid: dict[tuple[int, ...], int] = {}
        self._groups: list[tuple[int, ...]] = []
        self._g_ptr = [0]
        self._g_dev: list[int] = []
        self._g_arrays = None
        self._specs: dict[str, tuple] = {}
        # communication templates (signature -> id) and their CSR arrays
        # (one index per kind of point-to-point transfer: blocking its hosts, or posted asynchronously as
        # an interleaved pipeline's are; both index the one list of templates)
        self._index = {True: _TemplateIndex(), False: _TemplateIndex()}
        self._tpl: list[Crossing] = []
        self._tpl_arrays = None
        self.comm = comm if comm is not None else CommTimes(topology)  # may be shared (the stage model does)
        self._last: PlanArrays | None = None
        self._prio_cache: dict = {}
        self._group_res: dict = {}
        self._comm_res: tuple | None = None  # _comm_resources' CSR over the interned groups
        self.caps = np.array([d.memory_bytes for d in topology.devices])
        self.dev_bw = np.array([d.bandwidth() for d in topology.devices])
        self.dev_lo = np.array([d.launch_overhead for d in topology.devices])
        self.elem_bytes = DTYPE_BYTES.get(graph.dtype, 2)
        self.hosted = bool(self.comm._hosted.any())  # the hosts limit the schedule (EnvSpec host_overhead > 0)
        self.device_names = [d.name for d in topology.devices]

    # ------------------------------------------------------------------ interning
    def _intern(self, g: tuple[int, ...]) -> int:
        i = self._gid.get(g)
        if i is None:
            i = len(self._groups)
            self._gid[g] = i
            self._groups.append(g)
            s = sorted(set(g))
            self._g_dev.extend(s)
            self._g_ptr.append(len(self._g_dev))
            self._g_arrays = None
        return i

    def _group_arrays(self):
        if self._g_arrays is None:
            ptr = np.asarray(self._g_ptr, dtype=np.int64)
            dev = np.asarray(self._g_dev, dtype=np.int64)
            size = np.array([len(g) for g in self._groups], dtype=np.int64)
            self._g_arrays = (ptr, dev, size)
        return self._g_arrays

    def _device_specs(self, dtype: str):
        """The topology's distinct device specs, the spec of each device, and which specs each interned
        group holds (rebuilt when new groups are interned)."""
        sp = self._specs.get(dtype)
        if sp is None or sp[2].shape[0] != len(self._groups):
            specs, dev_spec = device_specs(self.topology, dtype)
            ptr, dev, _ = self._group_arrays()
            present = np.zeros((len(self._groups), len(specs)), dtype=bool)
            owner = np.repeat(np.arange(len(self._groups)), np.diff(ptr))
            present[owner, dev_spec[dev]] = True
            sp = (specs, dev_spec, present)
            self._specs[dtype] = sp
        return sp

    # ------------------------------------------------------------------ plan -> arrays
    def arrays(self, plan: Plan, objective: str = "step_time") -> PlanArrays:
        graph = self.graph
        pa = PlanArrays()
        intern = self._gid
        ids = [intern.get(g) for g in plan.groups]
        if None in ids:
            ids = [self._intern(g) if i is None else i for g, i in zip(plan.groups, ids)]
        pa.gid = np.array(ids, dtype=np.int64)
        pa.lay = np.array(list(map(LAYOUT_CODE.__getitem__, plan.layouts)), dtype=np.int64)
        pa.dp = np.asarray(plan.dp, dtype=np.int64)
        pa.rc = np.asarray(plan.recompute, dtype=bool)
        pa.zero = np.asarray(plan.zero, dtype=np.int64)
        latency = objective == "latency"
        pa.objective = objective
        pa.m = 1 if latency else int(plan.microbatches)
        pa.vs = 1 if latency else int(plan.virtual_stages)
        pa.schedule = plan.schedule
        pa.scale = (1.0 / graph.batch_size) if latency else plan.microbatch_size(graph) / graph.batch_size
        pa.dtype = plan.dtype
        pa.state_bytes = float(plan.state_bytes_per_param)
        pa.plan = plan
        pa.like = plan
        pa.fwd, pa.bwd, pa.host_f, pa.host_b, _ = self.node_times(pa)
        return pa

    def node_times(self, pa: PlanArrays, nodes: np.ndarray | None = None) -> OpTimes:
        """:func:`envs.sim.cost.node_times` from the plan's arrays (the same function on the same inputs,
        so the same floats), for ``nodes`` only when given."""
        idx = np.arange(self.n) if nodes is None else np.asarray(nodes, dtype=np.int64)
        gid, lay, dp = pa.gid[idx], pa.lay[idx], pa.dp[idx]
        _, _, size = self._group_arrays()
        tp = size[gid] // dp
        split = work_split(lay, tp)
        specs, _, present = self._device_specs(pa.dtype)
        t = group_op_times(self.graph, specs, present[gid] if len(specs) > 1 else None, idx, pa.scale / dp, split,
                           lay, DTYPE_BYTES.get(pa.dtype, 2))
        return finish_op_times(t, pa.rc[idx], dp, pa.objective == "latency")

    # ------------------------------------------------------------------ templates
    def crossing(self, sig: int) -> Crossing:
        """The communication template ``sig`` (an :class:`EdgeGroups` signature)."""
        return self._tpl[sig]

    def _new_template(self, gu, dpu, have, gv, dpv, req, colw, S, et0, latency, scale, replay, blocking) -> int:
        self._tpl.append(layout_crossing(self.comm, gu, dpu, have, gv, dpv, req, colw, S, et0, latency, scale,
                                         replay, blocking_transfers=blocking))
        self._tpl_arrays = None
        return len(self._tpl) - 1

    def _template_arrays(self):
        """The templates as flat CSR arrays (over templates, their tasks and chain steps); templates
        added since the last call are flattened and appended (concatenation, no Python re-walk)."""
        if self._tpl_arrays is not None:
            return self._tpl_arrays
        i64 = np.int64
        nd = self.nd
        old = getattr(self, "_tpl_np", None)
        if old is None:
            old = {k: np.zeros(0, dtype=i64) for k in ("s_tptr", "t_rptr", "t_ridx", "t_dptr", "t_didx", "f_lo",
                                                         "f_n", "b_lo", "b_n", "st_ptr", "st_idx", "t_kind")}
            old.update(s_tptr=np.zeros(1, dtype=i64), t_rptr=np.zeros(1, dtype=i64), t_dptr=np.zeros(1, dtype=i64),
                       st_ptr=np.zeros(1, dtype=i64), t_dur=np.zeros(0), t_bwd=np.zeros(0, dtype=np.bool_), labels=[],
                       t_host=np.zeros(0), t_sync=np.zeros(0, dtype=np.bool_))
            self._n_flat = 0
        nt, nr, ndv = len(old["t_dur"]), len(old["t_ridx"]), len(old["t_didx"])
        nst, nsti = len(old["st_ptr"]) - 1, len(old["st_idx"])
        new = {k: [] for k in old}
        for cr in self._tpl[self._n_flat:]:
            for task in cr.tasks:
                snd, rcv = task.ports  # resources: send port nd + d, receive port 2 nd + d
                res = tuple(nd + d for d in snd) + tuple(2 * nd + d for d in rcv)
                new["t_dur"].append(task.duration)
                new["t_bwd"].append(task.backward)
                new["t_host"].append(task.host)
                new["t_sync"].append(task.sync)
                new["t_ridx"].extend(res)
                nr += len(res)
                new["t_rptr"].append(nr)
                new["t_didx"].extend(task.devices)
                ndv += len(task.devices)
                new["t_dptr"].append(ndv)
                new["labels"].append(task.label)
            nt += len(cr.tasks)
            new["s_tptr"].append(nt)
            # forward steps then backward steps of each template, contiguous: ranges [lo, lo + n)
            for steps, lo, cnt in ((cr.forward, "f_lo", "f_n"), (cr.backward, "b_lo", "b_n")):
                new[lo].append(nst)
                new[cnt].append(len(steps))
                for step in steps:
                    new["st_idx"].extend(step)
                    nsti += len(step)
                    new["st_ptr"].append(nsti)
                    nst += 1
        self._n_flat = len(self._tpl)
        arr = {}
        for k, v in old.items():
            if k == "labels":
                arr[k] = v + new[k]
            elif k == "t_kind":
                arr[k] = np.full(nt, KIND_COMM, dtype=i64)
            else:
                arr[k] = np.concatenate([v, np.asarray(new[k], dtype=v.dtype)])
        self._tpl_np = arr
        out = dict(arr)
        nsig = len(self._tpl)
        for c in ("f", "b"):  # (begin, end) pairs at 2s, 2s+1 for the kernel
            rng = np.empty(2 * nsig, dtype=i64)
            rng[0::2] = arr[c + "_lo"]
            rng[1::2] = arr[c + "_lo"] + arr[c + "_n"]
            out[c + "_rng"] = rng
        self._tpl_arrays = out
        return out

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, plan: Plan, objective: str = "step_time", *, timeline: bool = False,
                 tail: bool = True) -> StepReport:
        """StepReport of ``plan`` (objective ``step_time`` or ``latency``); the plan is not validated.
        (``tail=False`` leaves out the gradient all-reduce and optimizer: the stage model's use.)"""
        if plan.ep.max(initial=1) > 1:
            # expert parallelism: its all-to-alls join many producers to many consumers, which the
            # kernel's edge groups do not; the reference builder is the specification and is used as is
            from envs.sim.reference import simulate_reference

            return simulate_reference(self.graph, self.topology, plan, objective, timeline=timeline)
        pa = self.arrays(plan, objective)
        self._last = pa
        return self._run(pa, timeline, tail)

    def delta(self, plan: Plan | PlanArrays | None, node: int, group: Sequence[int], layout: str,
              dp: int | None = None, recompute: bool | None = None, *, timeline: bool = False):
        """Report of ``plan`` with ``node`` moved to ``group`` / ``layout`` (and ``dp``, default: the
        group size for batch_split, else 1): the same result as a full evaluation of the modified
        plan. ``plan`` may be the PlanArrays of a previous call (``report.plan_arrays``) or None for
        the last plan evaluated; a Plan is converted (and then cached as the last one)."""
        if plan is not None and not isinstance(plan, PlanArrays) and plan.ep.max(initial=1) > 1:
            moved = plan.copy()
            moved.groups[node] = tuple(int(d) for d in group)
            moved.layouts[node] = layout
            moved.dp[node] = int(dp) if dp is not None else (len(moved.groups[node]) if layout == "batch_split" else 1)
            if recompute is not None:
                moved.recompute[node] = bool(recompute)
            return self.evaluate(moved, timeline=timeline)
        if plan is None:
            if self._last is None:
                raise ValueError("delta() needs a plan: nothing has been evaluated yet")
            base = self._last
        elif isinstance(plan, PlanArrays):
            base = plan
        else:
            base = self._last if (self._last is not None and self._last.plan is plan) else self.arrays(plan)
        pa = base.copy()
        pa.plan = None
        g = tuple(int(d) for d in group)
        pa.gid[node] = self._gid[g] if g in self._gid else self._intern(g)
        pa.lay[node] = LAYOUT_CODE[layout]
        pa.dp[node] = int(dp) if dp is not None else (len(g) if layout == "batch_split" else 1)
        if recompute is not None and bool(recompute) != bool(pa.rc[node]):
            pa.rc[node] = bool(recompute)
        t = self.node_times(pa, np.array([node]))
        pa.fwd[node], pa.bwd[node], pa.host_f[node], pa.host_b[node] = (float(x[0]) for x in t[:4])
        self._last = pa
        return self._run(pa, timeline)

    def plan_of(self, pa: PlanArrays, like: Plan) -> Plan:
        """A Plan with the decisions of ``pa`` and the global settings of ``like``."""
        inv = {v: k for k, v in LAYOUT_CODE.items()}
        return like.copy(groups=[self._groups[i] for i in pa.gid.tolist()], layouts=[inv[c] for c in pa.lay.tolist()],
                         dp=pa.dp.copy(), recompute=pa.rc.copy(), zero=pa.zero.copy(),
                         virtual_stages=like.virtual_stages if pa.objective == "latency" else pa.vs)

    def stages(self, pa: PlanArrays) -> tuple[np.ndarray, int]:
        """Plan.stages in arrays: distinct groups in order of first use in topological order."""
        stage, p = stage_of(pa.gid, self.topo, len(self._groups))
        return stage, max(1, int(p))

    def edge_groups(self, pa: PlanArrays, latency: bool) -> EdgeGroups:
        """Edges grouped by (producer, consumer group, consumer dp, requirement, column-weighted), in
        order of first edge; per group its signature id (which communication template it needs)."""
        graph = self.graph
        E = len(self.esrc)
        if E == 0:
            z = np.zeros(0, dtype=np.int64)
            return EdgeGroups(z, z, np.zeros(0), np.zeros(1, dtype=np.int64), z, z)
        et = graph.edge_time
        ku, e0, S, cons_ptr, cons_idx, sig_rows, hh, first, sinv, clash = group_edges(
            self.esrc, self.edst, pa.gid, pa.dp, pa.lay, pa.rc, self.has_params, self.is_emb, self.byte_rank,
            self.byte_vals, float(pa.scale), self._et, et is not None, bool(latency), len(self._groups) + 1,
            int(pa.dp.max()) + 1)
        srow, sh = sig_rows[first], hh[first]
        if clash:  # pragma: no cover - a 64-bit hash collision
            srow, sinv = np.unique(sig_rows, axis=0, return_inverse=True)
            sinv, sh = sinv.reshape(-1), None
        sig_of_row = None
        ix = self._index[pa.vs == 1]
        if sh is not None and ix.hk is not None and ix.sig_rows.shape[1] == srow.shape[1]:
            # fast: find the distinct rows' hashes among the known templates', then check the rows
            idx = np.searchsorted(ix.hk, sh)
            idx[idx >= len(ix.hk)] = 0
            if (ix.hk[idx] == sh).all():
                sids = ix.hv[idx]
                if np.array_equal(ix.sig_rows[sids], srow):
                    sig_of_row = sids
        if sig_of_row is None:
            sig_of_row = self._lookup_templates(ix, srow, sh, pa, latency)
        return EdgeGroups(ku, sig_of_row[sinv], S, cons_ptr, cons_idx, e0)

    def _priorities(self, pa: PlanArrays, stage: np.ndarray, p: int) -> tuple[np.ndarray, np.ndarray]:
        """Priority of F / B of each node and microbatch, (n, m) each (the reference's ``prio``: GPipe all
        forwards then all backwards; 1F1B microbatch-major, backward first; interleaved 1F1B by the
        pipeline rank's program order, :meth:`_program_order`). Read-only: cached per schedule."""
        gpipe, m, N = pa.schedule == "gpipe", pa.m, float(self.n + 1)
        if pa.vs > 1:
            tpos = self.topo_pos.astype(np.float64)
            f_order, b_order = self._program_order(pa, stage, p)
            return f_order * N + tpos[:, None], b_order * N + (N - 1 - tpos)[:, None]
        key = (gpipe, m)
        hit = self._prio_cache.get(key)
        if hit is not None:
            return hit
        tpos = self.topo_pos.astype(np.float64)
        if gpipe:
            fb, bb, slope = tpos.copy(), m * N + (N - 1 - tpos), N
        else:
            fb, bb, slope = N + tpos, N - 1 - tpos, 2 * N
        ks = np.arange(m, dtype=np.int64) * slope
        hit = self._prio_cache[key] = (fb[:, None] + ks[None, :], bb[:, None] + ks[None, :])
        return hit

    def _chunks(self, pa: PlanArrays) -> tuple[np.ndarray, np.ndarray]:
        """Each node's model chunk (Plan.chunks: a new chunk wherever the device group changes along the
        topological order) and each chunk's first node."""
        g = pa.gid[self.topo]
        starts = np.ones(self.n, dtype=bool)
        starts[1:] = g[1:] != g[:-1]
        chunk = np.empty(self.n, dtype=np.int64)
        chunk[self.topo] = np.cumsum(starts) - 1
        return chunk, self.topo[starts]

    def _program_order(self, pa: PlanArrays, stage: np.ndarray, p: int) -> tuple[np.ndarray, np.ndarray]:
        """Place of each node's forward / backward of each microbatch in its pipeline rank's program under
        interleaved 1F1B, (n, m) each (the reference's ``_Step.order``, Megatron-LM's program order)."""
        m, V = pa.m, pa.vs
        total = m * V
        c = (self._chunks(pa)[0] // p)[:, None]
        W = np.minimum((p - stage - 1) * 2 + (V - 1) * p, total)[:, None]
        k = np.arange(m, dtype=np.int64)[None, :]
        base = (k // p) * p * V + k % p
        jf = base + c * p
        jb = base + (V - 1 - c) * p
        f_order = np.where(jf < W, jf, 2 * jf - W)
        b_order = np.where(jb < total - W, W + 2 * jb + 1, total + jb)
        return f_order, b_order

    def _lookup_templates(self, ix: _TemplateIndex, srow, sh, pa, latency) -> np.ndarray:
        """Template id of each distinct signature row in index ``ix``, building the templates not seen
        before."""
        et = self.graph.edge_time
        buf = srow.tobytes()
        rb = srow.shape[1] * 8
        sig_of_row = np.empty(len(srow), dtype=np.int64)
        table = ix.sig
        for i in range(len(srow)):
            kb = buf[i * rb:(i + 1) * rb]
            sid = table.get(kb)
            if sid is None:
                r = srow[i]
                etv = float(r[8:9].view(np.float64)[0]) if et is not None else None
                sid = self._new_template(self._groups[int(r[0])], int(r[1]), int(r[2]), self._groups[int(r[3])],
                                     int(r[4]), int(r[5]), bool(r[6]), float(r[7:8].view(np.float64)[0]), etv,
                                     latency, pa.scale, bool(int(r[-1]) & 2), pa.vs == 1)
                table[kb] = sid
            sig_of_row[i] = sid
        # the hash index: one row per template id
        width = srow.shape[1]
        if ix.sig_rows is None or ix.sig_rows.shape[1] != width:
            ix.sig_rows = np.zeros((0, width), dtype=np.int64)
            ix.sig_h = {}
            ix.hk = ix.hv = None
        nt = len(self._tpl)
        if ix.sig_rows.shape[0] < nt:
            grow = np.zeros((nt - ix.sig_rows.shape[0], width), dtype=np.int64)
            grow[:, 0] = -1  # not a valid group id: never equal to a real row
            ix.sig_rows = np.concatenate([ix.sig_rows, grow])
        ix.sig_rows[sig_of_row] = srow
        if sh is not None:
            for x, sid in zip(sh.tolist(), sig_of_row.tolist()):
                ix.sig_h[x] = sid
            keys = np.fromiter(ix.sig_h.keys(), dtype=np.uint64, count=len(ix.sig_h))
            vals = np.fromiter(ix.sig_h.values(), dtype=np.int64, count=len(ix.sig_h))
            o = np.argsort(keys)
            ix.hk, ix.hv = keys[o], vals[o]
        return sig_of_row

    def _run(self, pa: PlanArrays, want_timeline: bool, tail: bool = True) -> StepReport:
        """The step's task graph (the reference builder's steps, in its task order) and its schedule."""
        latency = pa.objective == "latency"
        stage, p = self.stages(pa)
        pf, pb = self._priorities(pa, stage, p)
        groups = self.edge_groups(pa, latency)
        step = self._compute_and_comm_tasks(pa, groups, pf, pb)
        extra = _ExtraTasks(len(step[0]))
        if not latency and pa.m > 1:
            self._pipeline_constraints(pa, stage, p, extra)
        expand = None
        if not latency and tail:
            self._zero3_gathers(pa, pf, pb, extra)
            grad_syncs, gathers = self._gradient_buckets(pa, pb, extra)
            expand, opt_ids = self._optimizer_updates(pa, grad_syncs, extra)
            self._parameter_gathers(gathers, opt_ids, extra)
        *step, host, sync = step
        step = extra.append_to(*step)  # (drops the kernel's arrays before scheduling)
        if self.hosted:
            extra_host = extra.host
            host = (np.concatenate([host, extra_host]), np.concatenate([sync, np.zeros(len(extra_host), dtype=bool)]))
        else:
            host = None
        return self._schedule_and_report(pa, step, extra, stage, p, groups, expand, want_timeline, host)

    def _compute_and_comm_tasks(self, pa: PlanArrays, groups: EdgeGroups, pf, pb):
        """The compute tasks and every edge group's communication, with their dependencies (the kernel)."""
        latency = pa.objective == "latency"
        K = len(groups.producer)
        if K:  # a group's forward tasks run at its earliest consumer's priority, backward at its producer's
            key_prf = np.minimum.reduceat(pf[groups.consumers], groups.cons_ptr[:-1], axis=0)
        else:
            key_prf = np.zeros((0, pa.m))
        key_prb = pb[groups.producer] if not latency else np.zeros((K, pa.m))
        g_ptr, g_dev, g_size = self._group_arrays()
        ta = self._template_arrays()
        return assemble_tasks(
            self.n, pa.m, latency, pf, pb, pa.fwd, pa.bwd, pa.host_f, pa.host_b, pa.gid, g_ptr, g_dev,
            groups.producer, groups.signature, key_prf, key_prb, groups.cons_ptr, groups.consumers,
            ta["s_tptr"], ta["t_dur"], ta["t_bwd"], ta["t_kind"], ta["t_host"], ta["t_sync"], ta["t_rptr"],
            ta["t_ridx"], ta["t_dptr"], ta["t_didx"], ta["f_rng"], ta["b_rng"], ta["st_ptr"], ta["st_idx"])

    def _pipeline_constraints(self, pa: PlanArrays, stage: np.ndarray, p: int, extra: _ExtraTasks) -> None:
        """GPipe: no backward before the last forward; 1F1B: F(v, k) after B(v, k - (p - stage));
        interleaved 1F1B: :meth:`_interleaved_constraints`."""
        n, m, c = self.n, pa.m, 2
        F0 = np.arange(n, dtype=np.int64) * m * c
        if pa.vs > 1:
            self._interleaved_constraints(pa, stage, p, extra)
        elif pa.schedule == "gpipe":
            last_f = F0 + (m - 1) * c
            ks = np.arange(m, dtype=np.int64)
            extra.deps(np.repeat(last_f, m), (F0[:, None] + ks[None, :] * c + 1).reshape(-1))
        else:
            w = p - stage
            cnt = np.maximum(m - w, 0)
            tot = int(cnt.sum())
            if tot:
                vv = np.repeat(np.arange(n, dtype=np.int64), cnt)
                off = np.arange(tot, dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt, cnt)
                kk = w[vv] + off
                extra.deps(F0[vv] + (kk - w[vv]) * c + 1, F0[vv] + kk * c)

    def _interleaved_constraints(self, pa: PlanArrays, stage: np.ndarray, p: int, extra: _ExtraTasks) -> None:
        """The reference's ``_interleaved_constraints``: on pipeline rank r the forward of its j-th
        chunk-microbatch after the backward of its (j - w)-th, w = (p - r - 1) x 2 + (v - 1) x p + 1; a
        backward of the node's own chunk is its own, of another chunk that chunk's first node's."""
        m, V = pa.m, pa.vs
        chunk, first_of = self._chunks(pa)
        v = np.repeat(np.arange(self.n, dtype=np.int64), m)
        k = np.tile(np.arange(m, dtype=np.int64), self.n)
        r = stage[v]
        j = (k // p) * p * V + (chunk[v] // p) * p + k % p - ((p - r - 1) * 2 + (V - 1) * p + 1)
        keep = j >= 0
        v, k, r, j = v[keep], k[keep], r[keep], j[keep]
        blk, rest = j // (p * V), j % (p * V)
        kk = blk * p + rest % p
        c = (V - 1 - rest // p) * p + r
        u = np.where(c == chunk[v], v, first_of[np.minimum(c, len(first_of) - 1)])
        extra.deps((u * m + kk) * 2 + 1, (v * m + k) * 2)

    def _last_backward(self, m: int) -> np.ndarray:
        """Task id of each node's backward of the last microbatch."""
        return np.arange(self.n, dtype=np.int64) * m * 2 + (m - 1) * 2 + 1

    def _zero3_gathers(self, pa: PlanArrays, pf, pb, extra: _ExtraTasks) -> None:
        """ZeRO-3 weight all-gathers before every forward and backward, prefetched one node ahead
        (the reference's ``_zero3_gathers``, in its task order)."""
        graph, m = self.graph, pa.m
        sel = self.has_params & (pa.zero >= 3) & (pa.dp > 1)
        if not sel.any():
            return
        order = self.topo[sel[self.topo]].tolist()
        by_group: dict[int, list[int]] = {}
        for v in order:
            by_group.setdefault(int(pa.gid[v]), []).append(v)
        src, dst = [], []
        for v in order:
            g = self._groups[int(pa.gid[v])]
            dp = int(pa.dp[v])
            split = (len(g) // dp) if pa.lay[v] in (L_COL, L_ROW) else 1
            t = self.comm.collective("all_gather", dp_groups(g, dp)[0], graph.param_bytes[v] / split)
            devs, host, res = self._group_resources(int(pa.gid[v]))
            nodes = by_group[int(pa.gid[v])]
            i = nodes.index(v)
            name = graph.names[v]
            for k in range(m):
                f_id, b_id = v * m * 2 + k * 2, v * m * 2 + k * 2 + 1
                af = extra.add(t, pf[v, k] - 0.5, KIND_COMM, res, devs, f"allgather params {name} mb{k}", host)
                src.append(af)
                dst.append(f_id)
                if i >= 2:
                    src.append(nodes[i - 2] * m * 2 + k * 2)
                    dst.append(af)
                ab = extra.add(t, pb[v, k] - 0.5, KIND_COMM, res, devs,
                               f"allgather params grad {name} mb{k}", host)
                src += [f_id, ab]
                dst += [ab, b_id]
                if len(nodes) - 1 - i >= 2:
                    src.append(nodes[i + 2] * m * 2 + k * 2 + 1)
                    dst.append(ab)
        extra.deps(np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64))

    def _gradient_buckets(self, pa: PlanArrays, pb, extra: _ExtraTasks):
        """Gradient synchronisation, bucketed in backward order, per (group, dp, split, ZeRO stage,
        sequence split) (the reference's ``_gradient_buckets``). Returns (bucket task, device) pairs for
        the optimizer and the ZeRO-1/2 buckets whose weights are gathered after it."""
        graph, m = self.graph, pa.m
        g_ptr, g_dev, g_size = self._group_arrays()
        seq = pa.lay == L_SEQ
        has_grad = self.has_params & ((pa.dp > 1) | seq)
        if not has_grad.any():
            return (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)), []
        split_tp = (pa.lay == L_COL) | (pa.lay == L_ROW)
        tp = g_size[pa.gid] // pa.dp
        D = int(pa.dp.max()) + 1
        bcode = (((pa.gid * D + pa.dp) * 2 + split_tp) * 4 + pa.zero) * 2 + seq
        # keys numbered in order of first appearance in backward order (dict insertion order)
        ob = self.order_bwd
        sel = ob[has_grad[ob]]
        uq, fi, iv = np.unique(bcode[sel], return_index=True, return_inverse=True)
        rk = np.empty(len(uq), dtype=np.int64)
        rk[np.argsort(fi, kind="stable")] = np.arange(len(uq))
        bkey = np.full(self.n, -1, dtype=np.int64)
        bkey[sel] = rk[iv.reshape(-1)]
        gbytes = graph.param_bytes / np.where(split_tp, tp, 1)
        # buckets: group-major (keys in first-appearance order), as the reference flushes them
        bucket_of, nb, bk, bsize = ddp_buckets(ob, has_grad, bkey, gbytes, float(DDP_BUCKET_BYTES))
        visited = ob[bucket_of >= 0]
        bidx = bucket_of[bucket_of >= 0]
        # task order: by key rank, then bucket creation order within the key
        border = np.lexsort((np.arange(nb), bk))
        # last node of each bucket (in backward order) and the first (for the label)
        last_node = np.empty(nb, dtype=np.int64)
        last_node[bidx] = visited  # later writes win: the last visited node
        first_node = np.empty(nb, dtype=np.int64)
        first_node[bidx[::-1]] = visited[::-1]
        nmem = np.bincount(bidx, minlength=nb)
        members_of = np.argsort(bidx, kind="stable")
        mem_ptr = np.concatenate([[0], np.cumsum(nmem)])
        # the buckets in task order: their deciding node (the last in backward order) and its choices
        v0 = last_node[border]
        gid0, dp0, zero0, sq0 = pa.gid[v0], pa.dp[v0], pa.zero[v0], seq[v0]
        scatter = (zero0 >= 1) & (dp0 > 1) & ~sq0
        per_k = (zero0 >= 2) & ~sq0  # ZeRO-2/3: one task per microbatch, else one after the last
        nk = np.where(per_k, m, 1)
        first_id = extra.next_id + np.concatenate([[0], np.cumsum(nk)[:-1]])
        tid_last = np.empty(nb, dtype=np.int64)  # the bucket's task after the last microbatch
        tid_last[border] = first_id + nk - 1
        comm, sizes = self.comm, bsize[border].tolist()
        firsts, counts = first_node[border].tolist(), nmem[border].tolist()
        t = np.empty(nb)  # per bucket (task order): its collective's time and its group's host cost
        host = np.empty(nb)
        labels, gathers, members_of_group = [], [], {}
        for j, (g, dp, zero, sq, sc, k) in enumerate(zip(gid0.tolist(), dp0.tolist(), zero0.tolist(), sq0.tolist(),
                                                         scatter.tolist(), nk.tolist())):
            members = members_of_group.get((g, dp, sq))
            if members is None:
                members = members_of_group[(g, dp, sq)] = self._groups[g] if sq else dp_groups(self._groups[g], dp)[0]
            kind, label = ("reduce_scatter", "grad reducescatter") if sc else ("all_reduce", "grad allreduce")
            t[j] = comm.collective(kind, members, sizes[j])
            host[j] = self._group_resources(g)[1]
            labels += [(label, firsts[j], counts[j])] * k
            if sc and zero in (1, 2):
                gathers.append((self._groups[g], members, sizes[j], firsts[j], counts[j]))
        # the tasks, bucket by bucket: microbatch k of a per-microbatch bucket, else the last microbatch only
        at_k = per_k[:, None] | (np.arange(m) == m - 1)[None, :]
        task_gid = np.repeat(gid0, nk)
        res_len, res_idx = self._comm_resources(task_gid)
        task, bdevs = expand_groups(task_gid, g_ptr, g_dev)  # each task's devices: its group's
        extra.add_block(np.repeat(t, nk), (pb[v0] + 0.5)[at_k], KIND_COMM, res_len, res_idx, np.diff(g_ptr)[task_gid],
                        bdevs, labels, np.repeat(host, nk))
        per_mb = [(int(b), int(f)) for b, f, pk in zip(border, first_id, per_k) if pk and m > 1]
        extra.deps(self._last_backward(m)[visited], tid_last[bidx])
        for b, first in per_mb:  # ZeRO-2/3: the bucket's task of microbatch k after each node's B(v, k)
            nodes = visited[members_of[mem_ptr[b]:mem_ptr[b + 1]]]
            ks = np.arange(m - 1, dtype=np.int64)
            extra.deps((nodes[None, :] * m * 2 + ks[:, None] * 2 + 1).reshape(-1), np.repeat(first + ks, len(nodes)))
        bt_ids = np.arange(extra.next_id - int(nk.sum()), extra.next_id, dtype=np.int64)[task]
        return (bt_ids, bdevs), gathers

    def _comm_resources(self, gids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per task on interned group ``gids[i]``: its number of communication resources and, flat, the
        resources (every member's send port, then every member's receive port: :meth:`_group_resources`)."""
        table = self._comm_res
        if table is None or len(table[0]) != len(self._groups) + 1:
            rows = [_ports(g, self.nd) for g in self._groups]
            ptr = np.zeros(len(rows) + 1, dtype=np.int64)
            np.cumsum([len(r) for r in rows], out=ptr[1:])
            table = self._comm_res = (ptr, np.fromiter((x for r in rows for x in r), dtype=np.int64, count=int(ptr[-1])))
        ptr, idx = table
        return np.diff(ptr)[gids], expand_groups(gids, ptr, idx)[1]

    def _group_resources(self, gid: int):
        """(sorted devices, host cost of a collective, communication resources) of interned group ``gid``
        (memoised: a gradient bucket or weight gather over the group occupies these)."""
        hit = self._group_res.get(gid)
        if hit is None:
            g = self._groups[gid]
            devs = sorted(set(g))
            hit = devs, self.comm.host(tuple(devs), transfer=False)[0], _ports(g, self.nd)
            self._group_res[gid] = hit
        return hit

    def _optimizer_updates(self, pa: PlanArrays, grad_syncs, extra: _ExtraTasks):
        """One optimizer task per device holding parameters (memory-bound pass over its model states, its
        shard under ZeRO), after its gradient synchronisation and its nodes' last backward. Returns the
        (node, device) pairs and each device's optimizer task id (-1: none)."""
        graph, nd, m = self.graph, self.nd, pa.m
        g_ptr, g_dev, g_size = self._group_arrays()
        split_tp = (pa.lay == L_COL) | (pa.lay == L_ROW)
        tp = g_size[pa.gid] // pa.dp
        owner, ndev_of = expand = expand_groups(pa.gid, g_ptr, g_dev)
        pw = graph.param_bytes / self.pbytes / np.where(split_tp, tp, 1) / np.where(pa.zero >= 1, pa.dp, 1)
        params_dev = np.bincount(ndev_of, weights=pw[owner], minlength=nd)
        has = np.flatnonzero(params_dev > 0)
        t_opt = optimizer_time(params_dev[has], pa.state_bytes, self.dev_bw[has], self.dev_lo[has])
        opt_ids = np.full(nd, -1, dtype=np.int64)
        opt_ids[has] = extra.add_optimizers(t_opt, has.tolist())
        bt_ids, bdevs = grad_syncs
        ok = opt_ids[bdevs] >= 0
        extra.deps(bt_ids[ok], opt_ids[bdevs][ok])
        ok = opt_ids[ndev_of] >= 0
        extra.deps(self._last_backward(m)[owner][ok], opt_ids[ndev_of][ok])
        return expand, opt_ids

    def _parameter_gathers(self, gathers, opt_ids: np.ndarray, extra: _ExtraTasks) -> None:
        """ZeRO-1/2: the updated weights of each bucket all-gathered after its devices' optimizers."""
        if not gathers:
            return
        opt = opt_ids.tolist()
        dur, res, devices, labels, hosts, src, dst = [], [], [], [], [], [], []
        tid = extra.next_id
        for g, members, size, first, count in gathers:  # one task each, ids in order
            dur.append(self.comm.collective("all_gather", members, size))
            devs, host, rs = self._group_resources(self._gid[g])
            res.append(rs)
            devices.append(devs)
            labels.append(("param allgather", first, count))
            hosts.append(host)
            for d in g:
                if opt[d] >= 0:
                    src.append(opt[d])
                    dst.append(tid)
            tid += 1
        extra.add_many(dur, [1e300] * len(dur), KIND_COMM, res, devices, labels, hosts)
        extra.deps(np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64))

    def _schedule_and_report(self, pa: PlanArrays, step, extra: _ExtraTasks, stage, p, groups: EdgeGroups,
                             expand, want_timeline: bool, host=None) -> StepReport:
        """List-schedule the step's tasks on 3 resources per device (and their hosts, when modelled);
        busy times, memory and the report."""
        nd = self.nd
        dur, pri, kind, res_ptr, res_idx, dev_ptr, dev_idx, src, dst = step
        del step
        nt = len(dur)
        succ_ptr, succ_idx, n_pred = csr_and_indegree(src, dst, nt)
        if host is None:
            start, finish, done = waitlist_schedule(dur, pri, res_ptr, res_idx, succ_ptr, succ_idx, n_pred, 3 * nd)
        else:
            start, finish, done = waitlist_schedule(dur, pri, res_ptr, res_idx, succ_ptr, succ_idx, n_pred, 3 * nd,
                                                    host[0], host[1], dev_ptr, dev_idx, nd)
        if done != nt:  # pragma: no cover - would be a bug in the task graph
            raise RuntimeError(f"simulator deadlock: scheduled {done} of {nt} tasks")
        makespan = float(finish.max()) if nt else 0.0
        compute, commt = busy_times(dur, kind, dev_ptr, dev_idx, nd, KIND_COMM)
        mem = self.memory(pa, stage, p, expand)
        total = mem["total"]
        oom = [int(d) for d in np.flatnonzero(total > mem["capacity"])]
        labels = None
        tl = want_timeline
        if tl:
            ta = self._template_arrays()
            labels = LazyLabels(lambda: self._labels(pa, groups.producer, groups.signature, ta["labels"],
                                                     ta["s_tptr"], extra.labels))
        return StepReport(
            objective=pa.objective, value=makespan, makespan=makespan, compute_time=compute, comm_time=commt,
            idle_time=np.maximum(makespan - compute, 0.0), peak_memory=total, memory_capacity=mem["capacity"],
            oom=oom, memory_breakdown=mem, task_start=start if tl else None, task_finish=finish if tl else None,
            task_device_ptr=dev_ptr if tl else None, task_devices=dev_idx if tl else None,
            task_kind=kind if tl else None, task_label=labels, device_names=self.device_names, num_tasks=nt,
            num_tail_tasks=nt - extra.first_id, plan_arrays=pa, fast_path="arrays",
        )
    def _labels(self, pa, ku, ksig, tlabels, s_tptr, extra_labels) -> list[str]:
        names = self.graph.names
        m = pa.m
        out = []
        latency = pa.objective == "latency"
        for v in range(self.n):
            nm = names[v]
            for k in range(m):
                out.append(f"F {nm} mb{k}")
                if not latency:
                    out.append(f"B {nm} mb{k}")
        for q in range(len(ku)):
            s = int(ksig[q])
            fm = tlabels[int(s_tptr[s]):int(s_tptr[s + 1])]
            nm = names[int(ku[q])]
            for k in range(m):
                for f in fm:
                    out.append(f.format(u=nm, k=k))
        for x in extra_labels:
            if isinstance(x, str):
                out.append(x)
            elif isinstance(x, tuple):
                out.append(f"{x[0]} {names[x[1]]}..({x[2]})")
            else:
                out.append(f"optimizer {self.device_names[x]}")
        return out

    # ------------------------------------------------------------------ memory
    def memory(self, pa: PlanArrays, stage: np.ndarray, p: int, expand=None) -> dict[str, np.ndarray]:
        """Vectorised :func:`envs.sim.cost.memory` (recomputation, ZeRO and sequence parallelism fall back
        to :func:`envs.sim.cost.memory` itself)."""
        objective = "latency" if pa.objective == "latency" else "step_time"
        if pa.rc.any() or pa.zero.any() or (pa.lay == L_SEQ).any():
            plan = pa.plan if pa.plan is not None else self.plan_of(pa, pa.like)
            return memory(self.graph, self.topology, plan, stage, p, objective)
        graph = self.graph
        nd = self.nd
        g_ptr, g_dev, g_size = self._group_arrays()
        tp = g_size[pa.gid] // pa.dp
        split = np.where((pa.lay == L_COL) | (pa.lay == L_ROW), tp, 1)
        latency = objective == "latency"
        scale = 1.0 / graph.batch_size if latency else pa.scale
        if latency or self.param_mem:
            st = graph.param_bytes / split
        else:
            st = graph.param_bytes / self.pbytes / split * pa.state_bytes
        out = graph.out_bytes * scale / (1 if latency else pa.dp)
        out = out / np.where(pa.lay == L_COL, tp, 1)
        if not latency and graph.saved_bytes.any():
            saved = graph.saved_bytes * scale / pa.dp
            out = out + saved / work_split(pa.lay, tp)
        if latency:
            inflight = np.ones(self.n)
        elif pa.schedule == "gpipe":
            inflight = np.full(self.n, float(pa.m))
        elif pa.vs > 1:  # cost.interleaved_in_flight, per node
            V = pa.vs
            full, rest = np.divmod(np.minimum((p - stage - 1) * 2 + (V - 1) * p + 1, pa.m * V), p * V)
            inflight = (full * p + np.clip(rest - (self._chunks(pa)[0] // p) * p, 0, p)).astype(np.float64)
        else:
            inflight = np.minimum(pa.m, p - stage).astype(np.float64)
        # the reference adds node by node; bincount accumulates in input order (node-major): same sums
        owner, devs = expand if expand is not None else expand_groups(pa.gid, g_ptr, g_dev)
        states = np.bincount(devs, weights=st[owner], minlength=nd)
        acts = np.bincount(devs, weights=(out * inflight)[owner], minlength=nd)
        transient = np.zeros(nd)
        accumulate = np.zeros(nd)
        if pa.m > 1 and not latency:
            np.maximum.at(accumulate, devs, (graph.param_bytes / split)[owner])
        caps = self.caps
        return {"model_states": states, "activations": acts, "recompute_transient": transient,
                "accumulation_transient": accumulate, "total": states + acts + transient + accumulate, "capacity": caps}


# ---------------------------------------------------------------------- one per (graph, topology)
_CACHE: OrderedDict[tuple[int, int], tuple] = OrderedDict()
_CACHE_SIZE = 16


def _stamp(graph: OpGraph, topology: Topology) -> tuple:
    """Cheap fingerprint of what a CompiledSimulator precomputes (catches replaced or edited arrays)."""
    return (graph.num_nodes, graph.num_edges, float(graph.fwd_flops.sum()), float(graph.bwd_flops.sum()),
            float(graph.param_bytes.sum()), float(graph.out_bytes.sum()), float(graph.edge_bytes.sum()),
            float(graph.mem_bytes.sum()), int(graph.n_ops.sum()), int(graph.edge_src @ np.arange(graph.num_edges)),
            tuple((k, float(v["fwd"].sum()), float(v["bwd"].sum())) for k, v in graph.measured.items()),
            None if graph.edge_time is None else float(graph.edge_time.sum()), graph.batch_size, graph.dtype,
            graph.meta.get("memory_model"), len(topology.devices), id(topology.devices))


def compiled_simulator(graph: OpGraph, topology: Topology) -> CompiledSimulator:
    """The cached :class:`CompiledSimulator` of (graph, topology), built on first use (LRU of 16)."""
    key = (id(graph), id(topology))
    hit = _CACHE.get(key)
    st = _stamp(graph, topology)
    if hit is not None and hit[0] is graph and hit[1] is topology and hit[2] == st:
        _CACHE.move_to_end(key)
        return hit[3]
    sim = CompiledSimulator(graph, topology)
    _CACHE[key] = (graph, topology, st, sim)
    _CACHE.move_to_end(key)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return sim


def _ports(g: tuple[int, ...], nd: int) -> list[int]:
    """The communication resources a collective over group ``g`` holds: every member's send port, then
    every member's receive port (resource ``nd + d`` and ``2 nd + d`` of device ``d``)."""
    return [nd + d for d in g] + [2 * nd + d for d in g]


class _TemplateIndex:
    """Signature rows -> template ids: the exact table (row bytes) and the hash index of the fast path."""

    def __init__(self):
        self.sig: dict[bytes, int] = {}
        self.sig_h: dict[int, int] = {}  # row hash -> template id (checked against sig_rows)
        self.sig_rows: np.ndarray | None = None
        self.hk: np.ndarray | None = None  # sorted known hashes and their template ids
        self.hv: np.ndarray | None = None


class _ExtraTasks:
    """Tasks appended after the kernel's (gradient all-reduces, optimizer updates) and extra dependencies,
    kept as blocks of arrays (one block per call) and concatenated once."""

    def __init__(self, first_id: int):
        self.first_id = self.next_id = first_id
        self._dur: list[np.ndarray] = []
        self._pri: list[np.ndarray] = []
        self._kind: list[np.ndarray] = []
        self._host: list[np.ndarray] = []
        self._res_len: list[np.ndarray] = []  # each task's number of resources, and the resources in order
        self._res_idx: list[np.ndarray] = []
        self._dev_len: list[np.ndarray] = []
        self._dev_idx: list[np.ndarray] = []
        self.labels: list = []  # (label, first node, number of nodes) of a bucket, or an optimizer's device
        self.src: list[np.ndarray] = []
        self.dst: list[np.ndarray] = []

    @property
    def host(self) -> np.ndarray:
        return np.concatenate(self._host) if self._host else np.zeros(0)

    def add(self, dur, pri, kind, res, devices, label, host: float = 0.0) -> int:
        """One task; its id."""
        self.add_many([dur], [pri], kind, [res], [devices], [label], [host])
        return self.next_id - 1

    def add_many(self, dur: list, pri: list, kind: int, res: list, devices: list, labels: list, host: list) -> None:
        """Tasks of one kind, in order (their ids follow ``next_id``); ``res`` and ``devices``: a list each."""
        self.add_block(np.asarray(dur, dtype=np.float64), np.asarray(pri, dtype=np.float64), kind,
                       np.fromiter(map(len, res), dtype=np.int64, count=len(res)),
                       np.fromiter((x for r in res for x in r), dtype=np.int64),
                       np.fromiter(map(len, devices), dtype=np.int64, count=len(devices)),
                       np.fromiter((x for d in devices for x in d), dtype=np.int64), labels,
                       np.asarray(host, dtype=np.float64))

    def add_block(self, dur: np.ndarray, pri: np.ndarray, kind: int, res_len: np.ndarray, res_idx: np.ndarray,
                  dev_len: np.ndarray, dev_idx: np.ndarray, labels: list, host: np.ndarray) -> None:
        """Tasks of one kind as arrays (resources and devices as per-task counts and the flat lists)."""
        self._dur.append(dur)
        self._pri.append(pri)
        self._kind.append(np.full(len(dur), kind, dtype=np.int64))
        self._host.append(host)
        self._res_len.append(res_len)
        self._res_idx.append(res_idx)
        self._dev_len.append(dev_len)
        self._dev_idx.append(dev_idx)
        self.labels.extend(labels)
        self.next_id += len(dur)

    def add_optimizers(self, times: np.ndarray, devices: list[int]) -> np.ndarray:
        """One optimizer task per device (lowest urgency); their task ids."""
        first, k = self.next_id, len(devices)
        one, dev = np.ones(k, dtype=np.int64), np.asarray(devices, dtype=np.int64)
        self.add_block(np.asarray(times, dtype=np.float64), np.full(k, 1e300), KIND_OPT, one, dev, one, dev,
                       list(devices), np.zeros(k))
        return first + np.arange(k, dtype=np.int64)

    def deps(self, src: np.ndarray, dst: np.ndarray) -> None:
        self.src.append(src)
        self.dst.append(dst)

    def append_to(self, dur, pri, kind, res_ptr, res_idx, dev_ptr, dev_idx, src, dst):
        """The kernel's task arrays with these tasks and dependencies appended."""
        if self.next_id > self.first_id:
            dur = np.concatenate([dur, *self._dur])
            pri = np.concatenate([pri, *self._pri])
            kind = np.concatenate([kind, *self._kind])
            res_ptr = np.concatenate([res_ptr, res_ptr[-1] + np.cumsum(np.concatenate(self._res_len))])
            res_idx = np.concatenate([res_idx, *self._res_idx])
            dev_ptr = np.concatenate([dev_ptr, dev_ptr[-1] + np.cumsum(np.concatenate(self._dev_len))])
            dev_idx = np.concatenate([dev_idx, *self._dev_idx])
        if self.src:
            src = np.concatenate([src] + self.src)
            dst = np.concatenate([dst] + self.dst)
        return dur, pri, kind, res_ptr, res_idx, dev_ptr, dev_idx, src, dst
