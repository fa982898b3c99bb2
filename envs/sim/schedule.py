"""Priority list scheduling of a task DAG on exclusive resources (compiled with numba).

Each task has a duration, a priority (lower runs first among tasks that could start at the same
time), a set of resources it holds for its whole duration (a device's compute engine, a device's
send or receive port) and predecessors. A task starts at the earliest time when all predecessors
have finished and all its resources are free; among tasks competing for a start time, the one with
the lowest priority value goes first (Graham's list scheduling, non-preemptive).

A leaf of :mod:`envs.sim`: numpy and numba only.
"""

from __future__ import annotations

import numpy as np
from numba import njit  # NUMBA_DISABLE_JIT=1 runs these kernels as plain Python, for debugging


@njit(cache=True, inline="always")
def _less(ea, pa, ta, eb, pb, tb) -> bool:
    """(earliest start, priority, task) order of the ready queue (tasks are distinct: no ties)."""
    if ea != eb:
        return ea < eb
    if pa != pb:
        return pa < pb
    return ta < tb


@njit(cache=True, inline="always")
def _push(he, hp, ht, size, e, p, t) -> int:
    """Insert (e, p, t) into the binary min-heap of ``size`` entries held in (he, hp, ht); the new size."""
    i = size
    while i > 0:
        parent = (i - 1) >> 1
        if not _less(e, p, t, he[parent], hp[parent], ht[parent]):
            break
        he[i], hp[i], ht[i] = he[parent], hp[parent], ht[parent]
        i = parent
    he[i], hp[i], ht[i] = e, p, t
    return size + 1


@njit(cache=True, inline="always")
def _pop(he, hp, ht, size) -> int:
    """Remove the minimum (the caller read it at index 0); the new size."""
    size -= 1
    e, p, t = he[size], hp[size], ht[size]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and _less(he[c + 1], hp[c + 1], ht[c + 1], he[c], hp[c], ht[c]):
            c += 1
        if not _less(he[c], hp[c], ht[c], e, p, t):
            break
        he[i], hp[i], ht[i] = he[c], hp[c], ht[c]
        i = c
    if size > 0:
        he[i], hp[i], ht[i] = e, p, t
    return size


@njit(cache=True)
def list_schedule(duration, priority, res_ptr, res_idx, succ_ptr, succ_idx, n_pred, n_resources):
    """Return (start, finish, number scheduled). ``res_*`` and ``succ_*`` are CSR adjacency arrays. The
    ready queue is a binary heap on (earliest start, priority, task)."""
    n = duration.shape[0]
    # :func:`hosted_loop` with no host taking part: no host time, no devices per task
    state, size = hosted_state(priority, n_pred, n_resources, 0)
    _, done = hosted_loop(duration, priority, res_ptr, res_idx, succ_ptr, succ_idx, np.zeros(n), np.zeros(n, dtype=np.bool_),
                          np.zeros(n + 1, dtype=np.int64), np.zeros(0, dtype=np.int64), *state, size, 0, -1)
    return state[0], state[1], done


@njit(cache=True)
def list_schedule_hosted(duration, priority, res_ptr, res_idx, succ_ptr, succ_idx, n_pred, n_resources,
                         host_cost, host_sync, dev_ptr, dev_idx, n_devices):
    """:func:`list_schedule` with each device's host issuing the work: task t also needs every one of its
    devices' hosts to have issued it, ``host_cost[t]`` seconds of host time after that host issued the
    previous task it started (hosts never wait for their GPU: the framework runs ahead, asynchronously),
    except after a task with ``host_sync[t]``, whose finish the hosts of its devices wait for (a blocking
    transfer). A host-bound step (small kernels, Python overhead) runs at the hosts' pace; a GPU-bound
    one is unchanged. Hosts issue in the order tasks start, which is program order per device."""
    state, size = hosted_state(priority, n_pred, n_resources, n_devices)
    _, done = hosted_loop(duration, priority, res_ptr, res_idx, succ_ptr, succ_idx, host_cost, host_sync, dev_ptr,
                          dev_idx, *state, size, 0, -1)
    return state[0], state[1], done


@njit(cache=True)
def hosted_state(priority, n_pred, n_resources, n_devices):
    """The state :func:`hosted_loop` starts from: ((start, finish, ready_at, remaining predecessors, resource
    free times, host free times, the ready heap's he, hp, ht), heap size), the tasks without predecessors
    in the heap."""
    n = priority.shape[0]
    he, hp, ht = np.empty(n), np.empty(n), np.empty(n, dtype=np.int64)
    size = 0
    for t in range(n):
        if n_pred[t] == 0:
            size = _push(he, hp, ht, size, 0.0, priority[t], t)
    state = (np.full(n, -1.0), np.full(n, -1.0), np.zeros(n), n_pred.copy(), np.zeros(n_resources), np.zeros(n_devices),
             he, hp, ht)
    return state, size


@njit(cache=True)
def hosted_loop(duration, priority, res_ptr, res_idx, succ_ptr, succ_idx, host_cost, host_sync, dev_ptr, dev_idx,
                start, finish, ready_at, remaining, free, host_free, he, hp, ht, size, done, max_repush):
    """:func:`list_schedule_hosted`'s loop on its state (the ready heap (he, hp, ht) of ``size`` entries,
    ``done`` tasks scheduled); returns (heap size, done). With ``max_repush >= 0`` it stops once that
    many tasks went back to the heap, the state complete (:mod:`envs.sim.waitlist_schedule` goes on)."""
    repushed = 0
    while size > 0:
        est, pr, t = he[0], hp[0], ht[0]
        size = _pop(he, hp, ht, size)
        s = est
        for k in range(res_ptr[t], res_ptr[t + 1]):
            r = res_idx[k]
            if free[r] > s:
                s = free[r]
        h = host_cost[t]
        for k in range(dev_ptr[t], dev_ptr[t + 1]):
            issued = host_free[dev_idx[k]] + h
            if issued > s:
                s = issued
        if s > est:
            size = _push(he, hp, ht, size, s, pr, t)
            repushed += 1
            if repushed == max_repush:
                break
            continue
        size = start_task(t, s, duration, priority, res_ptr, res_idx, succ_ptr, succ_idx, host_cost, host_sync,
                          dev_ptr, dev_idx, start, finish, ready_at, remaining, free, host_free, he, hp, ht, size)
        done += 1
    return size, done


@njit(cache=True)
def busy_times(duration, kind, dev_ptr, dev_idx, n_devices, comm_kind):
    """Per device: seconds busy computing (every task not of ``comm_kind``) and communicating."""
    compute = np.zeros(n_devices)
    comm = np.zeros(n_devices)
    for t in range(duration.shape[0]):
        for k in range(dev_ptr[t], dev_ptr[t + 1]):
            if kind[t] == comm_kind:
                comm[dev_idx[k]] += duration[t]
            else:
                compute[dev_idx[k]] += duration[t]
    return compute, comm


def schedule(duration, priority, res_ptr, res_idx, succ_ptr, succ_idx, n_pred, n_resources,
             host_cost=None, host_sync=None, dev_ptr=None, dev_idx=None, n_devices: int = 0):
    """Start and finish of every task: :func:`list_schedule_hosted` when any task costs host time,
    else the plain :func:`list_schedule`."""
    if hosted(host_cost, host_sync):
        return list_schedule_hosted(duration, priority, res_ptr, res_idx, succ_ptr, succ_idx, n_pred, n_resources,
                                    np.ascontiguousarray(host_cost, dtype=np.float64),
                                    np.ascontiguousarray(host_sync, dtype=np.bool_), dev_ptr, dev_idx, int(n_devices))
    return list_schedule(duration, priority, res_ptr, res_idx, succ_ptr, succ_idx, n_pred, n_resources)


@njit(cache=True, inline="always")
def start_now(t, ready_at, res_ptr, res_idx, free, host_cost, dev_ptr, dev_idx, host_free) -> float:
    """When task t could start as of now: its ready time, its resources' and its hosts' (a lower bound of
    its start, as resources and hosts only get busier; exact when it is the next to start)."""
    s = ready_at[t]
    for k in range(res_ptr[t], res_ptr[t + 1]):
        if free[res_idx[k]] > s:
            s = free[res_idx[k]]
    h = host_cost[t]
    for k in range(dev_ptr[t], dev_ptr[t + 1]):
        if host_free[dev_idx[k]] + h > s:
            s = host_free[dev_idx[k]] + h
    return s


@njit(cache=True, inline="always")
def start_task(t, s, duration, priority, res_ptr, res_idx, succ_ptr, succ_idx, host_cost, host_sync, dev_ptr,
               dev_idx, start, finish, ready_at, remaining, free, host_free, he, hp, ht, size) -> int:
    """Task t starts at s: its finish, its resources' and hosts' new free times, and the successors it
    makes ready pushed to the heap keyed by their :func:`start_now` (the order of starts is the same as
    with the ready time, with fewer re-pushes); the heap's new size."""
    f = s + duration[t]
    start[t] = s
    finish[t] = f
    for k in range(res_ptr[t], res_ptr[t + 1]):
        free[res_idx[k]] = f
    h = host_cost[t]
    for k in range(dev_ptr[t], dev_ptr[t + 1]):
        d = dev_idx[k]
        host_free[d] = max(f, host_free[d] + h) if host_sync[t] else host_free[d] + h
    for k in range(succ_ptr[t], succ_ptr[t + 1]):
        u = succ_idx[k]
        if f > ready_at[u]:
            ready_at[u] = f
        remaining[u] -= 1
        if remaining[u] == 0:
            e = start_now(u, ready_at, res_ptr, res_idx, free, host_cost, dev_ptr, dev_idx, host_free)
            size = _push(he, hp, ht, size, e, priority[u], u)
    return size


def hosted(host_cost, host_sync) -> bool:
    """Whether the hosts take part in the schedule (some task costs host time or blocks its host)."""
    return host_cost is not None and bool(host_cost.any() or (host_sync is not None and host_sync.any()))


@njit(cache=True)
def _csr(src, dst, n):
    ptr = np.zeros(n + 1, dtype=np.int64)
    for i in range(src.shape[0]):
        ptr[src[i] + 1] += 1
    for i in range(n):
        ptr[i + 1] += ptr[i]
    fill = ptr[:-1].copy()
    idx = np.empty(src.shape[0], dtype=np.int64)
    for i in range(src.shape[0]):  # counting sort: stable in the order the pairs were given
        idx[fill[src[i]]] = dst[i]
        fill[src[i]] += 1
    return ptr, idx


@njit(cache=True)
def _csr_indeg(src, dst, n):
    ptr, idx = _csr(src, dst, n)
    indeg = np.zeros(n, dtype=np.int64)
    for i in range(dst.shape[0]):
        indeg[dst[i]] += 1
    return ptr, idx, indeg


def csr_and_indegree(src: np.ndarray, dst: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``to_csr`` plus the number of predecessors of each task."""
    return _csr_indeg(np.ascontiguousarray(src, dtype=np.int64), np.ascontiguousarray(dst, dtype=np.int64), int(n))


def to_csr(lists_src: np.ndarray, lists_dst: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR (ptr, idx) of pairs (src -> dst) for src in range(n), successors in the order given."""
    return _csr(np.ascontiguousarray(lists_src, dtype=np.int64), np.ascontiguousarray(lists_dst, dtype=np.int64),
                int(n))
