"""Compiled evaluator: the simulator's task graph built from arrays, for many evaluations of one graph.

``Simulator(graph, topology)`` precomputes the graph's static arrays once (topological positions, the
layout rules per node, device specs, edge byte classes) and caches, across plans, interned device
groups and the communication *templates* of each kind of edge crossing (which collectives and
transfers a tensor needs between a producer's and a consumer's layout, and how long each takes).
:meth:`Simulator.evaluate` turns a plan into per-node and per-edge-group arrays with numpy, lets a
numba kernel emit the whole step's task graph (forward/backward of every node for every microbatch
and the communication tasks between them) and list-schedules it with :func:`list_schedule`.

It builds *exactly* the task graph of the reference builder ``envs.simulator._schedule_reference``
(same tasks in the same order, same durations, priorities and dependencies), so its results are
identical to it bit for bit (tests/test_simulator_fast.py checks this on random cases). Every cost
formula is the reference's (see envs/simulator.py for their sources); this file only re-arranges the
work. :meth:`Simulator.delta` re-evaluates a plan after moving one node, reusing the previous plan's
arrays: only the moved node's times and its edges' crossings are recomputed before re-scheduling.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from envs.graph import OpGraph
from envs.plan import DTYPE_BYTES, Plan
from envs.schedule_core import csr_and_indegree, list_schedule, njit
from envs.topology import Topology

FULL, FSHARD, PARTIAL = 0, 1, 2
KIND_COMPUTE, KIND_COMM, KIND_OPT = 0, 1, 2
LAYOUT_CODE = {"single": 0, "batch_split": 1, "col_split": 2, "row_split": 3, "replicate": 4}
L_COL, L_ROW = 2, 3
DDP_BUCKET_BYTES = 25 * 2**20  # torch.nn.parallel.DistributedDataParallel bucket_cap_mb=25 (PyTorch docs)


# ---------------------------------------------------------------------- numba kernel
@njit(cache=True)
def _assemble(n, m, latency, slope, fb, bb, ft, bt, node_gid, g_ptr, g_dev,
              key_u, key_sig, key_prf, key_prb, cons_ptr, cons_idx,
              s_tptr, t_dur, t_bwd, t_kind, t_rptr, t_ridx, t_dptr, t_didx,
              s_fptr, s_bptr, st_ptr, st_idx):
    """Emit the compute tasks (node-major, microbatch, F then B) and the communication tasks of every
    edge group (group-major, microbatch, template order) with their dependencies, as flat arrays."""
    c = 1 if latency else 2
    K = key_u.shape[0]
    n_a = n * m * c
    # ---- counts
    nt = n_a
    nres = 0
    ndev = 0
    for v in range(n):
        gs = g_ptr[node_gid[v] + 1] - g_ptr[node_gid[v]]
        nres += gs * c * m
    ndev = nres
    ndep = 0 if latency else n * m
    key_off = np.empty(K + 1, dtype=np.int64)
    key_off[0] = n_a
    for q in range(K):
        s = key_sig[q]
        ntpl = s_tptr[s + 1] - s_tptr[s]
        key_off[q + 1] = key_off[q] + ntpl * m
        r = 0
        dd = 0
        for j in range(s_tptr[s], s_tptr[s + 1]):
            r += t_rptr[j + 1] - t_rptr[j]
            dd += t_dptr[j + 1] - t_dptr[j]
        nres += r * m
        ndev += dd * m
        ncons = cons_ptr[q + 1] - cons_ptr[q]
        prev = 1
        for z in range(s_fptr[2 * s], s_fptr[2 * s + 1]):
            sz = st_ptr[z + 1] - st_ptr[z]
            ndep += prev * sz * m
            prev = sz
        ndep += prev * ncons * m
        if not latency:
            prev = ncons
            for z in range(s_bptr[2 * s], s_bptr[2 * s + 1]):
                sz = st_ptr[z + 1] - st_ptr[z]
                ndep += prev * sz * m
                prev = sz
            ndep += prev * m
    nt = key_off[K]
    dur = np.empty(nt)
    pri = np.empty(nt)
    kind = np.empty(nt, dtype=np.int64)
    res_ptr = np.empty(nt + 1, dtype=np.int64)
    res_idx = np.empty(nres, dtype=np.int64)
    dev_ptr = np.empty(nt + 1, dtype=np.int64)
    dev_idx = np.empty(ndev, dtype=np.int64)
    src = np.empty(ndep, dtype=np.int64)
    dst = np.empty(ndep, dtype=np.int64)
    # ---- compute tasks
    t = 0
    rp = 0
    dp_ = 0
    e = 0
    res_ptr[0] = 0
    dev_ptr[0] = 0
    for v in range(n):
        g = node_gid[v]
        for k in range(m):
            for ph in range(c):
                if ph == 0:
                    dur[t] = ft[v]
                    pri[t] = fb[v] + k * slope
                else:
                    dur[t] = bt[v]
                    pri[t] = bb[v] + k * slope
                    src[e] = t - 1
                    dst[e] = t
                    e += 1
                kind[t] = KIND_COMPUTE
                for x in range(g_ptr[g], g_ptr[g + 1]):
                    res_idx[rp] = g_dev[x]
                    rp += 1
                    dev_idx[dp_] = g_dev[x]
                    dp_ += 1
                t += 1
                res_ptr[t] = rp
                dev_ptr[t] = dp_
    # ---- communication tasks of each edge group
    for q in range(K):
        s = key_sig[q]
        u = key_u[q]
        t0 = s_tptr[s]
        ntpl = s_tptr[s + 1] - t0
        for k in range(m):
            base = key_off[q] + k * ntpl
            for j in range(ntpl):
                jj = t0 + j
                dur[t] = t_dur[jj]
                pri[t] = (key_prb[q] if t_bwd[jj] else key_prf[q]) + k * slope
                kind[t] = t_kind[jj]
                for x in range(t_rptr[jj], t_rptr[jj + 1]):
                    res_idx[rp] = t_ridx[x]
                    rp += 1
                for x in range(t_dptr[jj], t_dptr[jj + 1]):
                    dev_idx[dp_] = t_didx[x]
                    dp_ += 1
                t += 1
                res_ptr[t] = rp
                dev_ptr[t] = dp_
            # forward: F(u) -> steps -> F(consumers)
            fu = (u * m + k) * c
            pz = -1  # -1: the previous step is F(u)
            for z in range(s_fptr[2 * s], s_fptr[2 * s + 1]):
                for y in range(st_ptr[z], st_ptr[z + 1]):
                    b = base + st_idx[y]
                    if pz < 0:
                        src[e] = fu
                        dst[e] = b
                        e += 1
                    else:
                        for w in range(st_ptr[pz], st_ptr[pz + 1]):
                            src[e] = base + st_idx[w]
                            dst[e] = b
                            e += 1
                pz = z
            for ci in range(cons_ptr[q], cons_ptr[q + 1]):
                fv = (cons_idx[ci] * m + k) * c
                if pz < 0:
                    src[e] = fu
                    dst[e] = fv
                    e += 1
                else:
                    for w in range(st_ptr[pz], st_ptr[pz + 1]):
                        src[e] = base + st_idx[w]
                        dst[e] = fv
                        e += 1
            if latency:
                continue
            # backward: B(consumers) -> steps -> B(u)
            pz = -1
            for z in range(s_bptr[2 * s], s_bptr[2 * s + 1]):
                for y in range(st_ptr[z], st_ptr[z + 1]):
                    b = base + st_idx[y]
                    if pz < 0:
                        for ci in range(cons_ptr[q], cons_ptr[q + 1]):
                            src[e] = (cons_idx[ci] * m + k) * c + 1
                            dst[e] = b
                            e += 1
                    else:
                        for w in range(st_ptr[pz], st_ptr[pz + 1]):
                            src[e] = base + st_idx[w]
                            dst[e] = b
                            e += 1
                pz = z
            bu = fu + 1
            if pz < 0:
                for ci in range(cons_ptr[q], cons_ptr[q + 1]):
                    src[e] = (cons_idx[ci] * m + k) * c + 1
                    dst[e] = bu
                    e += 1
            else:
                for w in range(st_ptr[pz], st_ptr[pz + 1]):
                    src[e] = base + st_idx[w]
                    dst[e] = bu
                    e += 1
    return dur, pri, kind, res_ptr, res_idx, dev_ptr, dev_idx, src, dst


@njit(cache=True)
def _buckets(order, has_grad, bkey, gbytes, cap):
    """DDP buckets: walk nodes in backward order, per bucket key fill a bucket until it reaches ``cap``
    bytes. Returns (bucket id per visited node or -1, number of buckets, key of each bucket, size)."""
    nk = 0
    for v in order:
        if has_grad[v] and bkey[v] + 1 > nk:
            nk = bkey[v] + 1
    cur = np.full(nk, -1, dtype=np.int64)
    size = np.zeros(nk)
    out = np.full(order.shape[0], -1, dtype=np.int64)
    bk = np.empty(order.shape[0], dtype=np.int64)
    bsize = np.empty(order.shape[0])
    nb = 0
    for i in range(order.shape[0]):
        v = order[i]
        if not has_grad[v]:
            continue
        q = bkey[v]
        if cur[q] < 0:
            cur[q] = nb
            bk[nb] = q
            size[q] = 0.0
            nb += 1
        out[i] = cur[q]
        size[q] += gbytes[v]
        bsize[cur[q]] = size[q]
        if size[q] >= cap:
            cur[q] = -1
    return out, nb, bk[:nb], bsize[:nb]


@njit(cache=True)
def _group_edges(u, v, gid, dp, lay, has_params, is_emb, byte_rank, byte_vals, scale, et, use_et, latency, G, D):
    """Edges grouped by (producer, consumer group, consumer dp, requirement, column-weighted) in order
    of first edge: producer, first edge, consumers (CSR, edge order), largest tensor of each group,
    and each group's signature row (what its communication template depends on) with a 64-bit hash."""
    E = u.shape[0]
    req = np.empty(E, dtype=np.int64)
    colw = np.empty(E, dtype=np.int64)
    code = np.empty(E, dtype=np.int64)
    for e in range(E):
        w = v[e]
        ly = lay[w]
        r = FULL
        c = 0
        if ly == L_COL:
            r = FULL if has_params[w] else FSHARD
            c = 1 if has_params[w] else 0
        elif ly == L_ROW:
            r = FULL if is_emb[w] else FSHARD
        req[e] = r
        colw[e] = c
        code[e] = (((u[e] * G + gid[w]) * D + dp[w]) * 3 + r) * 2 + c
    order = np.argsort(code, kind="mergesort")
    grp = np.empty(E, dtype=np.int64)
    firsts = np.empty(E, dtype=np.int64)
    K = 0
    i = 0
    while i < E:
        c0 = code[order[i]]
        firsts[K] = order[i]  # stable sort: the smallest edge id of the group
        j = i
        while j < E and code[order[j]] == c0:
            grp[order[j]] = K
            j += 1
        K += 1
        i = j
    fo = np.argsort(firsts[:K], kind="mergesort")
    rank = np.empty(K, dtype=np.int64)
    for q in range(K):
        rank[fo[q]] = q
    cons_ptr = np.zeros(K + 1, dtype=np.int64)
    for e in range(E):
        cons_ptr[rank[grp[e]] + 1] += 1
    for q in range(K):
        cons_ptr[q + 1] += cons_ptr[q]
    fill = cons_ptr[:-1].copy()
    cons_idx = np.empty(E, dtype=np.int64)
    bmax = np.full(K, -1, dtype=np.int64)
    for e in range(E):
        q = rank[grp[e]]
        cons_idx[fill[q]] = v[e]
        fill[q] += 1
        if byte_rank[e] > bmax[q]:
            bmax[q] = byte_rank[e]
    e0 = np.empty(K, dtype=np.int64)
    ku = np.empty(K, dtype=np.int64)
    S = np.empty(K)
    for q in range(K):
        e0[q] = firsts[fo[q]]
        ku[q] = u[e0[q]]
        S[q] = byte_vals[bmax[q]] * scale
    C = 11 if use_et else 9
    rows = np.empty((K, C), dtype=np.int64)
    sbits = S.view(np.int64)
    scale_arr = np.full(1, scale)
    scale_bits = scale_arr.view(np.int64)[0]
    et0 = np.empty(K)
    for q in range(K):
        et0[q] = et[e0[q]] if use_et else 0.0
    ebits = et0.view(np.int64)
    h = np.empty(K, dtype=np.uint64)
    mix = np.uint64(0x9E3779B97F4A7C15)
    for q in range(K):
        a = ku[q]
        la = lay[a]
        have = FSHARD if la == L_COL else (PARTIAL if la == L_ROW else FULL)
        w = v[e0[q]]
        rows[q, 0] = gid[a]
        rows[q, 1] = dp[a]
        rows[q, 2] = have
        rows[q, 3] = gid[w]
        rows[q, 4] = dp[w]
        rows[q, 5] = req[e0[q]]
        rows[q, 6] = colw[e0[q]]
        rows[q, 7] = sbits[q]
        j = 8
        if use_et:
            rows[q, 8] = ebits[q]
            rows[q, 9] = scale_bits
            j = 10
        rows[q, j] = 1 if latency else 0
        x = np.uint64(0)
        for c in range(C):
            x = (x ^ np.uint64(rows[q, c])) * mix
            x = x ^ (x >> np.uint64(29))
        h[q] = x
    # distinct signatures by hash (checking the rows: a collision sets ``clash``)
    ho = np.argsort(h, kind="mergesort")
    first = np.empty(K, dtype=np.int64)
    inv = np.empty(K, dtype=np.int64)
    U = 0
    clash = False
    i = 0
    while i < K:
        a = ho[i]
        first[U] = a
        j = i
        while j < K and h[ho[j]] == h[a]:
            b = ho[j]
            inv[b] = U
            for c in range(C):
                if rows[b, c] != rows[a, c]:
                    clash = True
            j += 1
        U += 1
        i = j
    return ku, e0, S, cons_ptr, cons_idx, rows, h, first[:U], inv, clash


@njit(cache=True)
def _stage_of(gid, topo, G):
    """Plan.stages: distinct groups numbered in order of first use in topological order."""
    lut = np.full(G, -1, dtype=np.int64)
    p = 0
    for i in range(topo.shape[0]):
        g = gid[topo[i]]
        if lut[g] < 0:
            lut[g] = p
            p += 1
    out = np.empty(gid.shape[0], dtype=np.int64)
    for v in range(gid.shape[0]):
        out[v] = lut[gid[v]]
    return out, p


@njit(cache=True)
def _expand(gid, g_ptr, g_dev):
    """(node, device) pairs of every node's group, node-major: the owners and the devices."""
    tot = 0
    for v in range(gid.shape[0]):
        tot += g_ptr[gid[v] + 1] - g_ptr[gid[v]]
    owner = np.empty(tot, dtype=np.int64)
    devs = np.empty(tot, dtype=np.int64)
    k = 0
    for v in range(gid.shape[0]):
        for x in range(g_ptr[gid[v]], g_ptr[gid[v] + 1]):
            owner[k] = v
            devs[k] = g_dev[x]
            k += 1
    return owner, devs


# ---------------------------------------------------------------------- lazy labels
class _Labels(Sequence):
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
    """A plan in array form (what :meth:`Simulator.evaluate` computes from a Plan and reuses in delta)."""

    __slots__ = ("gid", "lay", "dp", "rc", "m", "schedule", "scale", "objective", "dtype", "state_bytes",
                 "fwd", "bwd", "plan", "like")

    def copy(self) -> PlanArrays:
        c = PlanArrays()
        for s in self.__slots__:
            v = getattr(self, s)
            setattr(c, s, v.copy() if isinstance(v, np.ndarray) else v)
        return c


class Simulator:
    """Compiled evaluator of plans for one (graph, topology). See the module docstring."""

    def __init__(self, graph: OpGraph, topology: Topology):
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
        self._sig: dict[bytes, int] = {}
        self._sig_h: dict[int, int] = {}  # row hash -> template id (checked against _sig_rows)
        self._sig_rows: np.ndarray | None = None
        self._hk: np.ndarray | None = None  # sorted known hashes and their template ids
        self._hv: np.ndarray | None = None
        self._tpl: list[dict] = []
        self._tpl_arrays = None
        from envs.simulator import _Comm

        self.comm = _Comm(topology, graph)
        self._last: PlanArrays | None = None
        self._prio_cache: dict = {}
        self.caps = np.array([d.memory_bytes for d in topology.devices])
        self.dev_bw = np.array([d.bandwidth() for d in topology.devices])
        self.dev_lo = np.array([d.launch_overhead for d in topology.devices])
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
        """Distinct (kind, FLOP/s, bandwidth, launch overhead) among devices; spec index per device."""
        sp = self._specs.get(dtype)
        if sp is None:
            keys: dict[tuple, int] = {}
            per_dev = []
            for d in self.topology.devices:
                key = (d.kind, d.flops(dtype), d.bandwidth(), d.launch_overhead)
                per_dev.append(keys.setdefault(key, len(keys)))
            sp = (list(keys), np.asarray(per_dev, dtype=np.int64))
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
        latency = objective == "latency"
        pa.objective = objective
        pa.m = 1 if latency else int(plan.microbatches)
        pa.schedule = plan.schedule
        pa.scale = (1.0 / graph.batch_size) if latency else plan.microbatch_size(graph) / graph.batch_size
        pa.dtype = plan.dtype
        pa.state_bytes = float(plan.state_bytes_per_param)
        pa.plan = plan
        pa.like = plan
        pa.fwd, pa.bwd = self.node_times(pa)
        return pa

    def node_times(self, pa: PlanArrays, nodes: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised ``envs.simulator.node_times`` (same formulas, same floating-point operations),
        with the latency objective's x dp applied; for ``nodes`` only when given."""
        graph = self.graph
        idx = slice(None) if nodes is None else nodes
        gid, lay, dp = pa.gid[idx], pa.lay[idx], pa.dp[idx]
        ptr, dev, size = self._group_arrays()
        tp = size[gid] // dp
        split = np.where((lay == L_COL) | (lay == L_ROW), tp, 1)
        s = pa.scale / dp
        specs, dev_spec = self._device_specs(pa.dtype)
        fwd = np.zeros(len(gid))
        bwd = np.zeros(len(gid))
        if len(specs) == 1:
            masks = [None]
        else:  # heterogeneous groups: a node's time is its slowest member's
            present = np.zeros((len(self._groups), len(specs)), dtype=bool)
            owner = np.repeat(np.arange(len(self._groups)), np.diff(ptr))
            present[owner, dev_spec[dev]] = True
            masks = [present[gid, i] for i in range(len(specs))]
        for i, (kind, rate, bw, lo) in enumerate(specs):
            meas = graph.measured.get(kind)
            if meas is not None:
                f = meas["fwd"][idx] * s / split
                b = meas["bwd"][idx] * s / split
            else:
                act = self.act[idx] * s
                byt = (act + graph.param_bytes[idx]) / split
                ov = graph.n_ops[idx] * lo
                f = np.maximum(graph.fwd_flops[idx] * s / split / rate, byt / bw) + ov
                b = np.maximum(graph.bwd_flops[idx] * s / split / rate, 2 * byt / bw) + ov
            if masks[i] is None:
                fwd, bwd = f, b
            else:
                fwd = np.where(masks[i], np.maximum(fwd, f), fwd)
                bwd = np.where(masks[i], np.maximum(bwd, b), bwd)
        rc = pa.rc[idx]
        if pa.rc.any():
            bwd = bwd + np.where(rc, fwd, 0.0)
        if pa.objective == "latency":
            fwd = fwd * dp.astype(np.float64)
        return fwd, bwd

    # ------------------------------------------------------------------ templates
    def _template(self, gu, dpu, have, gv, dpv, req, colw, S, et0, latency, scale) -> int:
        from envs.simulator import _redistribution, _tp_groups

        nd = self.nd
        comm = self.comm
        tasks: list[tuple] = []

        def add(dur, bwd, devices, label, ports):
            snd, rcv = ports
            res = tuple(nd + d for d in snd) + tuple(2 * nd + d for d in rcv)
            tasks.append((float(dur), bool(bwd), res, tuple(sorted(set(devices))), label))
            return len(tasks) - 1

        fwd_chain: list[list[int]] = []
        bwd_chain: list[list[int]] = []
        tpu, tpv = len(gu) // dpu, len(gv) // dpv
        same = gu == gv and dpu == dpv
        if same:
            tg = _tp_groups(gu, dpu)[0]
            if have == PARTIAL and req == FULL:
                fwd_chain.append([add(comm.coll("all_reduce", tg, S / dpu), False, gu, "allreduce {u} mb{k}",
                                      (gu, gu))])
            elif have == PARTIAL and req == FSHARD:
                fwd_chain.append([add(comm.coll("reduce_scatter", tg, S / dpu), False, gu,
                                      "reducescatter {u} mb{k}", (gu, gu))])
                if not latency:
                    bwd_chain.append([add(comm.coll("all_gather", tg, S / dpu), True, gu,
                                          "allgather grad {u} mb{k}", (gu, gu))])
            elif have == FSHARD and req == FULL:
                fwd_chain.append([add(comm.coll("all_gather", tg, S / dpu), False, gu, "allgather {u} mb{k}",
                                      (gu, gu))])
            elif have == FULL and req == FSHARD and not latency and tpu > 1:
                bwd_chain.append([add(comm.coll("all_gather", tg, S / dpu), True, gu, "allgather grad {u} mb{k}",
                                      (gu, gu))])
        else:
            if have == PARTIAL:
                fwd_chain.append([add(comm.coll("all_reduce", _tp_groups(gu, dpu)[0], S / dpu), False, gu,
                                      "allreduce {u} mb{k}", (gu, gu))])
            elif have == FSHARD and tpu > 1:
                fwd_chain.append([add(comm.coll("all_gather", _tp_groups(gu, dpu)[0], S / dpu), False, gu,
                                      "allgather {u} mb{k}", (gu, gu))])
            moves = _redistribution(gu, dpu, gv, dpv, req, S)
            if moves:
                step, back = [], []
                for a, b, nb, trank in moves:
                    if et0 is not None:  # measured transfer time of the tensor, scaled with the samples
                        t = et0 * (scale * (nb / S if S > 0 else 1.0))
                    else:
                        t = comm.p2p(a, b, nb)
                    step.append(add(t, False, (a, b), f"send {{u}} {a}->{b} mb{{k}}", ((a,), (b,))))
                    if not latency and (req == FSHARD or trank == 0):
                        back.append(add(t, True, (a, b), f"send grad {{u}} {b}->{a} mb{{k}}", ((b,), (a,))))
                fwd_chain.append(step)
                if back:
                    bwd_chain.append(back)
        if colw and not latency and tpv > 1:
            # Megatron's "f": the input gradient of a column-split linear is a partial sum
            t = comm.coll("all_reduce", _tp_groups(gv, dpv)[0], S / dpv)
            bwd_chain.insert(0, [add(t, True, gv, "allreduce grad {u} mb{k}", (gv, gv))])
        self._tpl.append({"tasks": tasks, "f": fwd_chain, "b": bwd_chain})
        self._tpl_arrays = None
        return len(self._tpl) - 1

    def _template_arrays(self):
        """The templates as flat CSR arrays (over templates, their tasks and chain steps); templates
        added since the last call are flattened and appended (concatenation, no Python re-walk)."""
        if self._tpl_arrays is not None:
            return self._tpl_arrays
        i64 = np.int64
        old = getattr(self, "_tpl_np", None)
        if old is None:
            old = {k: np.zeros(0, dtype=i64) for k in ("s_tptr", "t_rptr", "t_ridx", "t_dptr", "t_didx", "f_lo",
                                                         "f_n", "b_lo", "b_n", "st_ptr", "st_idx", "t_kind")}
            old.update(s_tptr=np.zeros(1, dtype=i64), t_rptr=np.zeros(1, dtype=i64), t_dptr=np.zeros(1, dtype=i64),
                       st_ptr=np.zeros(1, dtype=i64), t_dur=np.zeros(0), t_bwd=np.zeros(0, dtype=np.bool_), labels=[])
            self._n_flat = 0
        nt, nr, ndv = len(old["t_dur"]), len(old["t_ridx"]), len(old["t_didx"])
        nst, nsti = len(old["st_ptr"]) - 1, len(old["st_idx"])
        new = {k: [] for k in old}
        for tp in self._tpl[self._n_flat:]:
            for dur, bwd, res, devs, lab in tp["tasks"]:
                new["t_dur"].append(dur)
                new["t_bwd"].append(bwd)
                new["t_ridx"].extend(res)
                nr += len(res)
                new["t_rptr"].append(nr)
                new["t_didx"].extend(devs)
                ndv += len(devs)
                new["t_dptr"].append(ndv)
                new["labels"].append(lab)
            nt += len(tp["tasks"])
            new["s_tptr"].append(nt)
            # forward steps then backward steps of each template, contiguous: ranges [lo, lo + n)
            for chain, lo, cnt in (("f", "f_lo", "f_n"), ("b", "b_lo", "b_n")):
                new[lo].append(nst)
                new[cnt].append(len(tp[chain]))
                for step in tp[chain]:
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
    def evaluate(self, plan: Plan, objective: str = "step_time", *, timeline: bool = False, _tail: bool = True):
        """StepReport of ``plan`` (objective ``step_time`` or ``latency``); the plan is not validated.
        (``_tail=False`` leaves out the gradient all-reduce and optimizer: the stage model's use.)"""
        pa = self.arrays(plan, objective)
        self._last = pa
        return self._run(pa, timeline, _tail)

    def delta(self, plan: Plan | PlanArrays | None, node: int, group: Sequence[int], layout: str,
              dp: int | None = None, recompute: bool | None = None, *, timeline: bool = False):
        """Report of ``plan`` with ``node`` moved to ``group`` / ``layout`` (and ``dp``, default: the
        group size for batch_split, else 1): the same result as a full evaluation of the modified
        plan. ``plan`` may be the PlanArrays of a previous call (``report.plan_arrays``) or None for
        the last plan evaluated; a Plan is converted (and then cached as the last one)."""
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
            pa.fwd, pa.bwd = self.node_times(pa)
        else:
            pa.fwd[node], pa.bwd[node] = self._node_time(pa, node)
        self._last = pa
        return self._run(pa, timeline)

    def _node_time(self, pa: PlanArrays, v: int) -> tuple[float, float]:
        """``node_times`` of one node in scalar arithmetic (the same operations, so the same floats)."""
        graph = self.graph
        g = self._groups[int(pa.gid[v])]
        dp = int(pa.dp[v])
        lay = int(pa.lay[v])
        split = len(g) // dp if lay in (L_COL, L_ROW) else 1
        s = pa.scale / dp
        specs, dev_spec = self._device_specs(pa.dtype)
        tf = tb = 0.0
        for i in sorted({int(dev_spec[d]) for d in g}):
            kind, rate, bw, lo = specs[i]
            meas = graph.measured.get(kind)
            if meas is not None:
                f = float(meas["fwd"][v]) * s / split
                b = float(meas["bwd"][v]) * s / split
            else:
                act = float(self.act[v]) * s
                byt = (act + float(graph.param_bytes[v])) / split
                ov = int(graph.n_ops[v]) * lo
                f = max(float(graph.fwd_flops[v]) * s / split / rate, byt / bw) + ov
                b = max(float(graph.bwd_flops[v]) * s / split / rate, 2 * byt / bw) + ov
            tf, tb = max(tf, f), max(tb, b)
        if pa.rc[v]:
            tb = tb + tf
        if pa.objective == "latency":
            tf = tf * float(dp)
        return tf, tb

    def plan_of(self, pa: PlanArrays, like: Plan) -> Plan:
        """A Plan with the decisions of ``pa`` and the global settings of ``like``."""
        inv = {v: k for k, v in LAYOUT_CODE.items()}
        return like.copy(groups=[self._groups[i] for i in pa.gid.tolist()], layouts=[inv[c] for c in pa.lay.tolist()],
                         dp=pa.dp.copy(), recompute=pa.rc.copy())

    def stages(self, pa: PlanArrays) -> tuple[np.ndarray, int]:
        """Plan.stages in arrays: distinct groups in order of first use in topological order."""
        stage, p = _stage_of(pa.gid, self.topo, len(self._groups))
        return stage, max(1, int(p))

    def _edge_groups(self, pa: PlanArrays, latency: bool):
        """Edges grouped by (producer, consumer group, consumer dp, requirement, column-weighted), in
        order of first edge; per group its signature id (which communication template it needs)."""
        graph = self.graph
        E = len(self.esrc)
        if E == 0:
            z = np.zeros(0, dtype=np.int64)
            return z, z, np.zeros(0), np.zeros(1, dtype=np.int64), z, z
        et = graph.edge_time
        ku, e0, S, cons_ptr, cons_idx, sig_rows, hh, first, sinv, clash = _group_edges(
            self.esrc, self.edst, pa.gid, pa.dp, pa.lay, self.has_params, self.is_emb, self.byte_rank,
            self.byte_vals, float(pa.scale), self._et, et is not None, bool(latency), len(self._groups) + 1,
            int(pa.dp.max()) + 1)
        srow, sh = sig_rows[first], hh[first]
        if clash:  # pragma: no cover - a 64-bit hash collision
            srow, sinv = np.unique(sig_rows, axis=0, return_inverse=True)
            sinv, sh = sinv.reshape(-1), None
        sig_of_row = None
        if sh is not None and self._hk is not None and self._sig_rows.shape[1] == srow.shape[1]:
            # fast: find the distinct rows' hashes among the known templates', then check the rows
            idx = np.searchsorted(self._hk, sh)
            idx[idx >= len(self._hk)] = 0
            if (self._hk[idx] == sh).all():
                sids = self._hv[idx]
                if np.array_equal(self._sig_rows[sids], srow):
                    sig_of_row = sids
        if sig_of_row is None:
            sig_of_row = self._lookup_templates(srow, sh, pa, latency)
        return ku, sig_of_row[sinv], S, cons_ptr, cons_idx, e0

    def _priorities(self, gpipe: bool, m: int):
        """Priority of F / B of each node at microbatch 0, and the step per microbatch (the reference's
        ``prio``: GPipe all forwards then all backwards; 1F1B microbatch-major, backward first)."""
        key = (gpipe, m)
        hit = self._prio_cache.get(key)
        if hit is None:
            N = float(self.n + 1)
            tpos = self.topo_pos.astype(np.float64)
            if gpipe:
                hit = (tpos.copy(), m * N + (N - 1 - tpos), N)
            else:
                hit = (N + tpos, N - 1 - tpos, 2 * N)
            self._prio_cache[key] = hit
        return hit

    def _lookup_templates(self, srow, sh, pa, latency) -> np.ndarray:
        """Template id of each distinct signature row, building the templates not seen before."""
        et = self.graph.edge_time
        buf = srow.tobytes()
        rb = srow.shape[1] * 8
        sig_of_row = np.empty(len(srow), dtype=np.int64)
        table = self._sig
        for i in range(len(srow)):
            kb = buf[i * rb:(i + 1) * rb]
            sid = table.get(kb)
            if sid is None:
                r = srow[i]
                etv = float(r[8:9].view(np.float64)[0]) if et is not None else None
                sid = self._template(self._groups[int(r[0])], int(r[1]), int(r[2]), self._groups[int(r[3])],
                                     int(r[4]), int(r[5]), bool(r[6]), float(r[7:8].view(np.float64)[0]), etv,
                                     latency, pa.scale)
                table[kb] = sid
            sig_of_row[i] = sid
        # the hash index: one row per template id
        width = srow.shape[1]
        if self._sig_rows is None or self._sig_rows.shape[1] != width:
            self._sig_rows = np.zeros((0, width), dtype=np.int64)
            self._sig_h = {}
            self._hk = self._hv = None
        nt = len(self._tpl)
        if self._sig_rows.shape[0] < nt:
            grow = np.zeros((nt - self._sig_rows.shape[0], width), dtype=np.int64)
            grow[:, 0] = -1  # not a valid group id: never equal to a real row
            self._sig_rows = np.concatenate([self._sig_rows, grow])
        self._sig_rows[sig_of_row] = srow
        if sh is not None:
            for x, sid in zip(sh.tolist(), sig_of_row.tolist()):
                self._sig_h[x] = sid
            keys = np.fromiter(self._sig_h.keys(), dtype=np.uint64, count=len(self._sig_h))
            vals = np.fromiter(self._sig_h.values(), dtype=np.int64, count=len(self._sig_h))
            o = np.argsort(keys)
            self._hk, self._hv = keys[o], vals[o]
        return sig_of_row

    def _run(self, pa: PlanArrays, want_timeline: bool, tail: bool = True):
        from envs.simulator import StepReport

        graph = self.graph
        n, nd = self.n, self.nd
        latency = pa.objective == "latency"
        m = pa.m
        gpipe = pa.schedule == "gpipe"
        stage, p = self.stages(pa)
        fb, bb, slope = self._priorities(gpipe, m)
        ku, ksig, _S, cons_ptr, cons_idx, _e0 = self._edge_groups(pa, latency)
        K = len(ku)
        if K:
            key_prf = np.minimum.reduceat(fb[cons_idx], cons_ptr[:-1])
        else:
            key_prf = np.zeros(0)
        key_prb = bb[ku] if not latency else np.zeros(K)
        g_ptr, g_dev, g_size = self._group_arrays()
        ta = self._template_arrays()
        dur, pri, kind, res_ptr, res_idx, dev_ptr, dev_idx, src, dst = _assemble(
            n, m, latency, slope, fb, bb, pa.fwd, pa.bwd, pa.gid, g_ptr, g_dev,
            ku, ksig, key_prf, key_prb, cons_ptr, cons_idx,
            ta["s_tptr"], ta["t_dur"], ta["t_bwd"], ta["t_kind"], ta["t_rptr"], ta["t_ridx"], ta["t_dptr"],
            ta["t_didx"], ta["f_rng"], ta["b_rng"], ta["st_ptr"], ta["st_idx"])
        nt_a = len(dur)
        c = 1 if latency else 2
        extra_dur, extra_pri, extra_kind, extra_res, extra_src, extra_dst, extra_labels = [], [], [], [], [], [], []
        # pipeline schedule constraints
        if not latency and m > 1:
            F0 = np.arange(n, dtype=np.int64) * m * c
            if gpipe:
                last_f = F0 + (m - 1) * c
                ks = np.arange(m, dtype=np.int64)
                extra_src.append(np.repeat(last_f, m))
                extra_dst.append((F0[:, None] + ks[None, :] * c + 1).reshape(-1))
            else:
                w = p - stage
                cnt = np.maximum(m - w, 0)
                tot = int(cnt.sum())
                if tot:
                    vv = np.repeat(np.arange(n, dtype=np.int64), cnt)
                    off = np.arange(tot, dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt, cnt)
                    kk = w[vv] + off
                    extra_src.append(F0[vv] + (kk - w[vv]) * c + 1)
                    extra_dst.append(F0[vv] + kk * c)
        nxt = nt_a
        opt_ids = np.full(nd, -1, dtype=np.int64)
        expand = None
        ex_dev_ptr = [0]
        ex_dev_idx: list[int] = []
        if not latency and tail:
            split_tp = (pa.lay == L_COL) | (pa.lay == L_ROW)
            tp = g_size[pa.gid] // pa.dp
            # data-parallel gradient all-reduce, bucketed in backward order, per (group, dp, split)
            has_grad = self.has_params & (pa.dp > 1)
            if has_grad.any():
                from envs.simulator import _dp_groups

                D = int(pa.dp.max()) + 1
                bcode = (pa.gid * D + pa.dp) * 2 + split_tp
                # keys numbered in order of first appearance in backward order (dict insertion order)
                ob = self.order_bwd
                sel = ob[has_grad[ob]]
                uq, fi, iv = np.unique(bcode[sel], return_index=True, return_inverse=True)
                rk = np.empty(len(uq), dtype=np.int64)
                rk[np.argsort(fi, kind="stable")] = np.arange(len(uq))
                bkey = np.full(n, -1, dtype=np.int64)
                bkey[sel] = rk[iv.reshape(-1)]
                gbytes = graph.param_bytes / np.where(split_tp, tp, 1)
                # buckets: group-major (keys in first-appearance order), as the reference flushes them
                bucket_of, nb, bk, bsize = _buckets(ob, has_grad, bkey, gbytes, float(DDP_BUCKET_BYTES))
                visited = ob[bucket_of >= 0]
                bidx = bucket_of[bucket_of >= 0]
                # task order: by key rank, then bucket creation order within the key
                border = np.lexsort((np.arange(nb), bk))
                tid_of_bucket = np.empty(nb, dtype=np.int64)
                tid_of_bucket[border] = nxt + np.arange(nb)
                # last node of each bucket (in backward order) and the first (for the label)
                last_node = np.empty(nb, dtype=np.int64)
                last_node[bidx] = visited  # later writes win: the last visited node
                first_node = np.empty(nb, dtype=np.int64)
                first_node[bidx[::-1]] = visited[::-1]
                nmem = np.bincount(bidx, minlength=nb)
                key_node = np.empty(int(bk.max()) + 1, dtype=np.int64)
                key_node[bkey[visited]] = visited
                for b in border.tolist():
                    v0 = int(last_node[b])
                    gtuple = self._groups[int(pa.gid[v0])]
                    t = self.comm.coll("all_reduce", _dp_groups(gtuple, int(pa.dp[v0]))[0], float(bsize[b]))
                    extra_dur.append(t)
                    extra_pri.append(bb[v0] + (m - 1) * slope + 0.5)
                    extra_kind.append(KIND_COMM)
                    s_ = sorted(set(gtuple))
                    extra_res.append([nd + d for d in gtuple] + [2 * nd + d for d in gtuple])
                    ex_dev_idx.extend(s_)
                    ex_dev_ptr.append(len(ex_dev_idx))
                    extra_labels.append((int(first_node[b]), int(nmem[b])))
                Bl = np.arange(n, dtype=np.int64) * m * c + (m - 1) * c + 1
                extra_src.append(Bl[visited])
                extra_dst.append(tid_of_bucket[bidx])
                nxt += nb
                # optimizer depends on every bucket of each member device
                bgid = pa.gid[last_node]
                cnt = g_size[bgid]
                bt_ids = np.repeat(tid_of_bucket, cnt)
                bdevs = np.concatenate([g_dev[g_ptr[g]:g_ptr[g + 1]] for g in bgid.tolist()]) if nb else \
                    np.zeros(0, dtype=np.int64)
            else:
                bt_ids = np.zeros(0, dtype=np.int64)
                bdevs = np.zeros(0, dtype=np.int64)
            # optimizer update: memory-bound pass over the model states (read + write)
            owner, ndev_of = expand = _expand(pa.gid, g_ptr, g_dev)
            pw = graph.param_bytes / self.pbytes / np.where(split_tp, tp, 1)
            params_dev = np.bincount(ndev_of, weights=pw[owner], minlength=nd)
            has = np.flatnonzero(params_dev > 0)
            # Adam is memory-bound: one read and one write of all model states (ZeRO, SC'20, Sec. 3)
            t_opt = 2 * params_dev[has] * pa.state_bytes / self.dev_bw[has] + self.dev_lo[has]
            opt_ids[has] = nxt + np.arange(len(has))
            nxt += len(has)
            extra_dur.extend(t_opt.tolist())
            extra_pri.extend([1e300] * len(has))
            extra_kind.extend([KIND_OPT] * len(has))
            hl = has.tolist()
            extra_res.extend([d] for d in hl)
            ex_dev_idx.extend(hl)
            ex_dev_ptr.extend(range(len(ex_dev_idx) - len(hl) + 1, len(ex_dev_idx) + 1))
            extra_labels.extend(hl)
            ok = opt_ids[bdevs] >= 0
            extra_src.append(bt_ids[ok])
            extra_dst.append(opt_ids[bdevs][ok])
            Bl = np.arange(n, dtype=np.int64) * m * c + (m - 1) * c + 1
            ok = opt_ids[ndev_of] >= 0
            extra_src.append(Bl[owner][ok])
            extra_dst.append(opt_ids[ndev_of][ok])
        # ---------------------------------------------------------------- combine and schedule
        nt = nxt
        if nt > nt_a:
            dur = np.concatenate([dur, np.asarray(extra_dur, dtype=np.float64)])
            pri = np.concatenate([pri, np.asarray(extra_pri, dtype=np.float64)])
            kind = np.concatenate([kind, np.asarray(extra_kind, dtype=np.int64)])
            rc_ = np.fromiter((len(r) for r in extra_res), dtype=np.int64, count=len(extra_res))
            res_ptr = np.concatenate([res_ptr, res_ptr[-1] + np.cumsum(rc_)])
            res_idx = np.concatenate([res_idx, np.fromiter((x for r in extra_res for x in r), dtype=np.int64)])
            dev_ptr = np.concatenate([dev_ptr, dev_ptr[-1] + np.asarray(ex_dev_ptr[1:], dtype=np.int64)])
            dev_idx = np.concatenate([dev_idx, np.asarray(ex_dev_idx, dtype=np.int64)])
        if extra_src:
            src = np.concatenate([src] + extra_src)
            dst = np.concatenate([dst] + extra_dst)
        succ_ptr, succ_idx, n_pred = csr_and_indegree(src, dst, nt)
        start, finish, done = list_schedule(dur, pri, res_ptr, res_idx, succ_ptr, succ_idx, n_pred, 3 * nd)
        if done != nt:  # pragma: no cover - would be a bug in the task graph
            raise RuntimeError(f"simulator deadlock: scheduled {done} of {nt} tasks")
        makespan = float(finish.max()) if nt else 0.0
        dev_counts = np.diff(dev_ptr)
        w = np.repeat(dur, dev_counts)
        kind_rep = np.repeat(kind, dev_counts)
        compute = np.bincount(dev_idx, weights=w * (kind_rep != KIND_COMM), minlength=nd)
        commt = np.bincount(dev_idx, weights=w * (kind_rep == KIND_COMM), minlength=nd)
        mem = self.memory(pa, stage, p, expand)
        total = mem["total"]
        oom = [int(d) for d in np.flatnonzero(total > mem["capacity"])]
        labels = None
        if want_timeline:
            labels = _Labels(lambda: self._labels(pa, ku, ksig, ta["labels"], ta["s_tptr"], extra_labels))
        rep = StepReport(
            objective=pa.objective, step_time=makespan, makespan=makespan, compute_time=compute, comm_time=commt,
            idle_time=np.maximum(makespan - compute, 0.0), peak_memory=total, memory_capacity=mem["capacity"],
            oom=oom, memory_breakdown=mem, task_start=start if want_timeline else None,
            task_finish=finish if want_timeline else None, task_device_ptr=dev_ptr if want_timeline else None,
            task_devices=dev_idx if want_timeline else None, task_kind=kind if want_timeline else None,
            task_label=labels, device_names=self.device_names, num_tasks=nt,
        )
        rep.plan_arrays = pa
        rep.fast_path = "arrays"
        rep._n_tail = nt - nt_a  # gradient all-reduce and optimizer tasks (the last ones)
        return rep

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
            if isinstance(x, tuple):
                out.append(f"grad allreduce {names[x[0]]}..({x[1]})")
            else:
                out.append(f"optimizer {self.device_names[x]}")
        return out

    # ------------------------------------------------------------------ memory
    def memory(self, pa: PlanArrays, stage: np.ndarray, p: int, expand=None) -> dict[str, np.ndarray]:
        """Vectorised ``envs.simulator.memory`` (recomputation falls back to the reference loop)."""
        objective = "latency" if pa.objective == "latency" else "step_time"
        if pa.rc.any():
            from envs.simulator import memory

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
        if latency:
            inflight = np.ones(self.n)
        elif pa.schedule == "gpipe":
            inflight = np.full(self.n, float(pa.m))
        else:
            inflight = np.minimum(pa.m, p - stage).astype(np.float64)
        # the reference adds node by node; bincount accumulates in input order (node-major): same sums
        owner, devs = expand if expand is not None else _expand(pa.gid, g_ptr, g_dev)
        states = np.bincount(devs, weights=st[owner], minlength=nd)
        acts = np.bincount(devs, weights=(out * inflight)[owner], minlength=nd)
        transient = np.zeros(nd)
        caps = self.caps
        return {"model_states": states, "activations": acts, "recompute_transient": transient,
                "total": states + acts + transient, "capacity": caps}


# ---------------------------------------------------------------------- simulate() entry point
FAST_PATH_TASKS = 200_000  # above this many tasks simulate() switches to the stage-level pipeline model
_CACHE: OrderedDict[tuple[int, int], tuple] = OrderedDict()
_CACHE_SIZE = 16


def _stamp(graph: OpGraph, topology: Topology) -> tuple:
    """Cheap fingerprint of what a Simulator precomputes (catches replaced or edited arrays)."""
    return (graph.num_nodes, graph.num_edges, float(graph.fwd_flops.sum()), float(graph.bwd_flops.sum()),
            float(graph.param_bytes.sum()), float(graph.out_bytes.sum()), float(graph.edge_bytes.sum()),
            float(graph.mem_bytes.sum()), int(graph.n_ops.sum()), int(graph.edge_src @ np.arange(graph.num_edges)),
            tuple((k, float(v["fwd"].sum()), float(v["bwd"].sum())) for k, v in graph.measured.items()),
            None if graph.edge_time is None else float(graph.edge_time.sum()), graph.batch_size, graph.dtype,
            graph.meta.get("memory_model"), len(topology.devices), id(topology.devices))


def simulator_for(graph: OpGraph, topology: Topology) -> Simulator:
    """The cached :class:`Simulator` of (graph, topology), built on first use (LRU of 16)."""
    key = (id(graph), id(topology))
    hit = _CACHE.get(key)
    st = _stamp(graph, topology)
    if hit is not None and hit[0] is graph and hit[1] is topology and hit[2] == st:
        _CACHE.move_to_end(key)
        return hit[3]
    sim = Simulator(graph, topology)
    _CACHE[key] = (graph, topology, st, sim)
    _CACHE.move_to_end(key)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return sim


def estimated_tasks(graph: OpGraph, plan: Plan, objective: str = "step_time") -> int:
    """Lower bound on the full task graph's size: compute tasks of every node and microbatch."""
    m = 1 if objective == "latency" else plan.microbatches
    return graph.num_nodes * m * (1 if objective == "latency" else 2)


def simulate_fast(graph: OpGraph, topology: Topology, plan: Plan, objective: str = "step_time", *,
                  timeline: bool = False, fast_path: bool | None = None):
    """``simulate`` without validation for the step_time / latency objectives (see envs.simulator)."""
    from envs.errors import PlanError

    if fast_path or (fast_path is None and objective == "step_time"
                     and estimated_tasks(graph, plan, objective) > FAST_PATH_TASKS):
        from envs.fast_stage import stage_simulate, stage_structure

        why = stage_structure(graph, plan, objective) if objective == "step_time" else "objective is not step_time"
        if isinstance(why, str):
            if fast_path:
                raise PlanError(f"fast_path=True but the plan does not qualify for the stage model: {why}")
        else:
            return stage_simulate(graph, topology, plan, why, timeline=timeline)
    return simulator_for(graph, topology).evaluate(plan, objective, timeline=timeline)
