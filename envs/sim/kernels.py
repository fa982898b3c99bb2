"""The compiled builder's numba kernels: emit the task graph from arrays, group edges, fill DDP buckets.

Every rule comes from :mod:`envs.sim.cost` (the layout rules are its own functions, compiled here);
these kernels only re-arrange the work of the reference builder so that it runs on arrays. Imports
:mod:`envs.sim.cost` and :mod:`envs.sim.schedule` (for ``njit``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from envs.sim import cost
from envs.sim.cost import KIND_COMPUTE

_produced_state = njit(cache=True)(cost.produced_state)
_required_state = njit(cache=True)(cost.required_state)
_column_weighted = njit(cache=True)(cost.column_weighted)


# ---------------------------------------------------------------------- task graph
@njit(cache=True)
def assemble_tasks(n, m, latency, pf, pb, ft, bt, hf, hb, node_gid, g_ptr, g_dev,
                   key_u, key_sig, key_prf, key_prb, cons_ptr, cons_idx,
                   s_tptr, t_dur, t_bwd, t_kind, t_host, t_sync, t_rptr, t_ridx, t_dptr, t_didx,
                   s_fptr, s_bptr, st_ptr, st_idx):
    """Emit the compute tasks (node-major, microbatch, F then B) and the communication tasks of every
    edge group (group-major, microbatch, template order) with their dependencies, as flat arrays.

    Edge group q: producer ``key_u[q]``, template ``key_sig[q]``, consumers ``cons_idx[cons_ptr[q]:
    cons_ptr[q + 1]]``, its forward tasks of microbatch k at priority ``key_prf[q, k]``, its backward ones at
    ``key_prb[q, k]`` (the compute tasks' at ``pf[v, k]`` / ``pb[v, k]``). Template s: tasks ``s_tptr[s]:s_tptr[s + 1]`` (duration, backward flag, kind,
    resources and devices as CSR), forward steps ``s_fptr[2s]:s_fptr[2s + 1]`` and backward steps
    ``s_bptr[2s]:s_bptr[2s + 1]``, step z holding template tasks ``st_idx[st_ptr[z]:st_ptr[z + 1]]``. Each
    task also gets its host cost (``hf`` / ``hb`` per node, ``t_host`` per template task) and whether it
    blocks the host (``t_sync``)."""
    c = 1 if latency else 2
    key_off, nres, ndev, ndep = _count_tasks(n, m, latency, node_gid, g_ptr, key_sig, cons_ptr, s_tptr,
                                             t_rptr, t_dptr, s_fptr, s_bptr, st_ptr)
    nt = key_off[-1]
    dur = np.empty(nt)
    pri = np.empty(nt)
    host = np.empty(nt)
    sync = np.zeros(nt, dtype=np.bool_)
    kind = np.empty(nt, dtype=np.int64)
    res_ptr = np.empty(nt + 1, dtype=np.int64)
    res_idx = np.empty(nres, dtype=np.int64)
    dev_ptr = np.empty(nt + 1, dtype=np.int64)
    dev_idx = np.empty(ndev, dtype=np.int64)
    src = np.empty(ndep, dtype=np.int64)
    dst = np.empty(ndep, dtype=np.int64)
    res_ptr[0] = 0
    dev_ptr[0] = 0
    t, rp, dq, e = _emit_compute_tasks(n, m, c, pf, pb, ft, bt, hf, hb, node_gid, g_ptr, g_dev,
                                       dur, pri, host, kind, res_ptr, res_idx, dev_ptr, dev_idx, src, dst)
    # the ends of a chain: F(u) or B(u), and the consumers' F or B
    width = 1
    for q in range(key_u.shape[0]):
        width = max(width, cons_ptr[q + 1] - cons_ptr[q])
    first = np.empty(width, dtype=np.int64)
    last = np.empty(width, dtype=np.int64)
    for q in range(key_u.shape[0]):
        s = key_sig[q]
        t0 = s_tptr[s]
        ntpl = s_tptr[s + 1] - t0
        c0, c1 = cons_ptr[q], cons_ptr[q + 1]
        for k in range(m):
            base = key_off[q] + k * ntpl
            t, rp, dq = _emit_template_tasks(t0, ntpl, key_prf[q, k], key_prb[q, k], t_dur, t_bwd,
                                             t_kind, t_host, t_sync, t_rptr, t_ridx, t_dptr, t_didx, t, rp, dq,
                                             dur, pri, host, sync, kind, res_ptr, res_idx, dev_ptr, dev_idx)
            # forward: F(u) -> steps -> F(consumers)
            fu = (key_u[q] * m + k) * c
            first[0] = fu
            for i in range(c0, c1):
                last[i - c0] = (cons_idx[i] * m + k) * c
            e = _wire_chain(src, dst, e, first, 1, s_fptr[2 * s], s_fptr[2 * s + 1], st_ptr, st_idx, base,
                            last, c1 - c0)
            if latency:
                continue
            # backward: B(consumers) -> steps -> B(u)
            for i in range(c0, c1):
                first[i - c0] = (cons_idx[i] * m + k) * c + 1
            last[0] = fu + 1
            e = _wire_chain(src, dst, e, first, c1 - c0, s_bptr[2 * s], s_bptr[2 * s + 1], st_ptr, st_idx, base,
                            last, 1)
    return dur, pri, kind, res_ptr, res_idx, dev_ptr, dev_idx, src, dst, host, sync


@njit(cache=True, inline="always")
def _chain_size(n_first, lo, hi, st_ptr, n_last):
    """Dependencies of a chain first -> steps lo..hi -> last (all pairs between consecutive steps)."""
    prev = n_first
    cnt = 0
    for z in range(lo, hi):
        sz = st_ptr[z + 1] - st_ptr[z]
        cnt += prev * sz
        prev = sz
    return cnt + prev * n_last


@njit(cache=True, inline="always")
def _count_tasks(n, m, latency, node_gid, g_ptr, key_sig, cons_ptr, s_tptr, t_rptr, t_dptr, s_fptr, s_bptr,
                 st_ptr):
    """Sizes of the output arrays: the first task id of each edge group (and the total), resources,
    devices and dependencies."""
    c = 1 if latency else 2
    K = key_sig.shape[0]
    n_a = n * m * c
    nres = 0
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
        ndep += _chain_size(1, s_fptr[2 * s], s_fptr[2 * s + 1], st_ptr, ncons) * m
        if not latency:
            ndep += _chain_size(ncons, s_bptr[2 * s], s_bptr[2 * s + 1], st_ptr, 1) * m
    return key_off, nres, ndev, ndep


@njit(cache=True, inline="always")
def _emit_compute_tasks(n, m, c, pf, pb, ft, bt, hf, hb, node_gid, g_ptr, g_dev,
                        dur, pri, host, kind, res_ptr, res_idx, dev_ptr, dev_idx, src, dst):
    """F (and B after it) of every node and microbatch, on the node's group; returns the next free
    task, resource, device and dependency slots."""
    t = 0
    rp = 0
    dq = 0
    e = 0
    for v in range(n):
        g = node_gid[v]
        for k in range(m):
            for ph in range(c):
                if ph == 0:
                    dur[t] = ft[v]
                    pri[t] = pf[v, k]
                    host[t] = hf[v]
                else:
                    dur[t] = bt[v]
                    pri[t] = pb[v, k]
                    host[t] = hb[v]
                    src[e] = t - 1
                    dst[e] = t
                    e += 1
                kind[t] = KIND_COMPUTE
                for x in range(g_ptr[g], g_ptr[g + 1]):
                    res_idx[rp] = g_dev[x]
                    rp += 1
                    dev_idx[dq] = g_dev[x]
                    dq += 1
                t += 1
                res_ptr[t] = rp
                dev_ptr[t] = dq
    return t, rp, dq, e


@njit(cache=True, inline="always")
def _emit_template_tasks(t0, ntpl, pri_f, pri_b, t_dur, t_bwd, t_kind, t_host, t_sync, t_rptr, t_ridx, t_dptr,
                         t_didx, t, rp, dq, dur, pri, host, sync, kind, res_ptr, res_idx, dev_ptr, dev_idx):
    """A template's tasks for one microbatch (forward ones at ``pri_f``, backward ones at ``pri_b``);
    returns the next free task, resource and device slots."""
    for j in range(t0, t0 + ntpl):
        dur[t] = t_dur[j]
        host[t] = t_host[j]
        sync[t] = t_sync[j]
        pri[t] = pri_b if t_bwd[j] else pri_f
        kind[t] = t_kind[j]
        for x in range(t_rptr[j], t_rptr[j + 1]):
            res_idx[rp] = t_ridx[x]
            rp += 1
        for x in range(t_dptr[j], t_dptr[j + 1]):
            dev_idx[dq] = t_didx[x]
            dq += 1
        t += 1
        res_ptr[t] = rp
        dev_ptr[t] = dq
    return t, rp, dq


@njit(cache=True, inline="always")
def _wire_chain(src, dst, e, first, n_first, lo, hi, st_ptr, st_idx, base, last, n_last):
    """Dependencies first -> steps lo..hi (tasks ``base + st_idx``) -> last: every task of a step after
    every task of the step before. Returns the next free dependency slot."""
    for z in range(lo, hi + 1):
        # the tasks of this step (of the last set, after the steps) after those of the previous one
        n_next = n_last if z == hi else st_ptr[z + 1] - st_ptr[z]
        for j in range(n_next):
            b = last[j] if z == hi else base + st_idx[st_ptr[z] + j]
            if z == lo:
                for i in range(n_first):
                    src[e] = first[i]
                    dst[e] = b
                    e += 1
            else:
                for w in range(st_ptr[z - 1], st_ptr[z]):
                    src[e] = base + st_idx[w]
                    dst[e] = b
                    e += 1
    return e


# ---------------------------------------------------------------------- gradient buckets
@njit(cache=True)
def ddp_buckets(order, has_grad, bkey, gbytes, cap):
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


# ---------------------------------------------------------------------- edge groups
@njit(cache=True)
def group_edges(u, v, gid, dp, lay, rc, has_params, is_emb, byte_rank, byte_vals, scale, et, use_et, latency, G, D):
    """Edges grouped by (producer, consumer group, consumer dp, requirement, column-weighted) in order
    of first edge: producer, first edge, consumers (CSR, edge order), largest tensor of each group,
    and each group's signature row (what its communication template depends on) with a 64-bit hash;
    the distinct signatures (first row of each, signature of each group, whether two hashes clashed)."""
    req, colw, code = _edge_codes(u, v, gid, dp, lay, has_params, is_emb, G, D)
    gq, e0 = _groups_in_edge_order(code)
    K = e0.shape[0]
    cons_ptr, cons_idx, bmax = _consumers(gq, v, byte_rank, K)
    ku = np.empty(K, dtype=np.int64)
    S = np.empty(K)
    for q in range(K):
        ku[q] = u[e0[q]]
        S[q] = byte_vals[bmax[q]] * scale
    rows, h = _signature_rows(ku, e0, S, v, gid, dp, lay, rc, req, colw, scale, et, use_et, latency)
    first, inv, clash = _distinct_rows(rows, h)
    return ku, e0, S, cons_ptr, cons_idx, rows, h, first, inv, clash


@njit(cache=True)
def _edge_codes(u, v, gid, dp, lay, has_params, is_emb, G, D):
    """Per edge: the consumer's required state, whether it is column-weighted, and the group code
    (producer, consumer group, consumer dp, requirement, column-weighted) as one integer."""
    E = u.shape[0]
    req = np.empty(E, dtype=np.int64)
    colw = np.empty(E, dtype=np.int64)
    code = np.empty(E, dtype=np.int64)
    for e in range(E):
        w = v[e]
        r = _required_state(lay[w], has_params[w], is_emb[w])
        c = 1 if _column_weighted(lay[w], has_params[w]) else 0
        req[e] = r
        colw[e] = c
        code[e] = (((u[e] * G + gid[w]) * D + dp[w]) * 4 + r) * 2 + c
    return req, colw, code


@njit(cache=True)
def _groups_in_edge_order(code):
    """Group of each edge (equal codes), groups numbered in order of their first edge; first edge of each."""
    E = code.shape[0]
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
    gq = np.empty(E, dtype=np.int64)
    for e in range(E):
        gq[e] = rank[grp[e]]
    e0 = np.empty(K, dtype=np.int64)
    for q in range(K):
        e0[q] = firsts[fo[q]]
    return gq, e0


@njit(cache=True)
def _consumers(gq, v, byte_rank, K):
    """Consumers of each group (CSR, in edge order) and the rank of its largest tensor."""
    E = gq.shape[0]
    cons_ptr = np.zeros(K + 1, dtype=np.int64)
    for e in range(E):
        cons_ptr[gq[e] + 1] += 1
    for q in range(K):
        cons_ptr[q + 1] += cons_ptr[q]
    fill = cons_ptr[:-1].copy()
    cons_idx = np.empty(E, dtype=np.int64)
    bmax = np.full(K, -1, dtype=np.int64)
    for e in range(E):
        q = gq[e]
        cons_idx[fill[q]] = v[e]
        fill[q] += 1
        if byte_rank[e] > bmax[q]:
            bmax[q] = byte_rank[e]
    return cons_ptr, cons_idx, bmax


@njit(cache=True)
def _signature_rows(ku, e0, S, v, gid, dp, lay, rc, req, colw, scale, et, use_et, latency):
    """Per group what its crossing depends on: producer group, dp and state, consumer group, dp and
    requirement, column-weighted, tensor bytes (bits), [measured edge time and scale (bits)], latency
    + 2 x the producer's recomputation (its forward collectives replayed); a 64-bit hash of each row."""
    K = ku.shape[0]
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
        w = v[e0[q]]
        rows[q, 0] = gid[a]
        rows[q, 1] = dp[a]
        rows[q, 2] = _produced_state(lay[a])
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
        rows[q, j] = (1 if latency else 0) + (2 if rc[a] else 0)
        x = np.uint64(0)
        for c in range(C):
            x = (x ^ np.uint64(rows[q, c])) * mix
            x = x ^ (x >> np.uint64(29))
        h[q] = x
    return rows, h


@njit(cache=True)
def _distinct_rows(rows, h):
    """Distinct signatures by hash (checking the rows: a collision sets ``clash``): the first row of
    each distinct signature and the signature of each row."""
    K, C = rows.shape
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
    return first[:U], inv, clash


# ---------------------------------------------------------------------- stages and groups
@njit(cache=True)
def stage_of(gid, topo, G):
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
def expand_groups(gid, g_ptr, g_dev):
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
