"""The list schedule of :mod:`envs.sim.schedule`, computed with wait lists (the compiled simulator's path).

:func:`envs.sim.schedule.list_schedule_hosted` (the specification, used by the reference simulator)
keeps every ready task in one heap keyed by a lower bound of its start; a task popped whose resources
or hosts have become busier since is pushed back with its new start. When k ready tasks wait for the
same busy resources, every task those resources run sends all k of them round the heap again: on a
64-microbatch GPipe step of 95k tasks on 16 devices (a plan the (a) benchmark's searches visit), 41
re-pushes per task and 0.42 s of scheduling. Here, once tasks have gone back to the heap
:data:`PARK_AFTER` times per task (below that the specification's loop is as fast, and it runs
first), a task whose start is bound by its resources or hosts *waits* on the list of the tasks with
exactly its constraints (resources, devices, host cost: they share that bound), a pairing heap ordered
by (priority, task); a second, small heap holds the lists, keyed by the bound and the list's head. A
task's start only grows as the schedule fills, so every key stays a lower bound of the (start,
priority, task) of what it stands for, and the entry at the top of both heaps whose bound is exact is
the ready task of least (start, priority, task): the task the specification schedules next. Same
starts and finishes, bit for bit (tests compare both on random contended task graphs, and the compiled
simulator against the reference one); that step schedules in 0.05 s (``experiments/bench_simulator.py``
has a contended plan beside the usual ones).

Imports :mod:`envs.sim.schedule` (numpy and numba otherwise).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from envs.sim.schedule import _less, _pop, hosted, hosted_loop, hosted_state, start_now, start_task


# ---------------------------------------------------------------------- the lists' heap (indexed)
# Ready tasks stay in the specification's heap (envs.sim.schedule._push/_pop); the wait lists that have
# waiting tasks are in a second, small heap keyed by (bound, head's priority, head), which is re-keyed in
# place; the next entry is the lesser of the two tops.
@njit(cache=True)
def _list_sift(lheap, lpos, le, lp, lt, i, size) -> None:
    """Restore the heap order around position ``i`` (up, then down)."""
    x = lheap[i]
    while i > 0:
        parent = (i - 1) >> 1
        q = lheap[parent]
        if not _less(le[x], lp[x], lt[x], le[q], lp[q], lt[q]):
            break
        lheap[i] = q
        lpos[q] = i
        i = parent
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        a = lheap[c]
        if c + 1 < size:
            b = lheap[c + 1]
            if _less(le[b], lp[b], lt[b], le[a], lp[a], lt[a]):
                c += 1
                a = b
        if not _less(le[a], lp[a], lt[a], le[x], lp[x], lt[x]):
            break
        lheap[i] = a
        lpos[a] = i
        i = c
    lheap[i] = x
    lpos[x] = i


@njit(cache=True)
def _list_key(lheap, lpos, le, lp, lt, size, w, e, p, t) -> int:
    """Key list ``w`` by (e, p, t), inserting it if it is not in the heap; the new size."""
    le[w], lp[w], lt[w] = e, p, t
    i = lpos[w]
    if i < 0:
        lheap[size] = w
        lpos[w] = size
        _list_sift(lheap, lpos, le, lp, lt, size, size + 1)
        return size + 1
    _list_sift(lheap, lpos, le, lp, lt, i, size)
    return size


@njit(cache=True)
def _list_drop_top(lheap, lpos, le, lp, lt, size) -> int:
    lpos[lheap[0]] = -1
    size -= 1
    if size > 0:
        lheap[0] = lheap[size]
        lpos[lheap[0]] = 0
        _list_sift(lheap, lpos, le, lp, lt, 0, size)
    return size


# ---------------------------------------------------------------------- wait lists (pairing heaps)
@njit(cache=True, inline="always")
def _meld(a, b, pri, child, sib) -> int:
    """The root of the pairing heap of roots ``a`` and ``b`` (ordered by (priority, task))."""
    if pri[b] < pri[a] or (pri[b] == pri[a] and b < a):
        a, b = b, a
    sib[b] = child[a]
    child[a] = b
    return a


@njit(cache=True)
def _delete_min(root, pri, child, sib, stack) -> int:
    """The new root after removing ``root`` (two-pass pairing), -1 when the heap is empty."""
    c = child[root]
    child[root] = -1
    k = 0
    while c != -1:
        a = c
        b = sib[a]
        sib[a] = -1
        if b == -1:
            stack[k] = a
            k += 1
            break
        c = sib[b]
        sib[b] = -1
        stack[k] = _meld(a, b, pri, child, sib)
        k += 1
    if k == 0:
        return -1
    r = stack[k - 1]
    for i in range(k - 2, -1, -1):
        r = _meld(stack[i], r, pri, child, sib)
    return r


# ---------------------------------------------------------------------- constraint signatures
@njit(cache=True, inline="always")
def _mix(x):
    """splitmix64's finaliser."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@njit(cache=True)
def _signatures(res_ptr, res_idx, dev_ptr, dev_idx, host_bits):
    """(wait list of each task, number of lists): one list per distinct (resources, devices, host cost
    bits); -1 lists if two distinct constraint sets hashed alike (the caller falls back)."""
    n = res_ptr.shape[0] - 1
    hashes = np.empty(n, dtype=np.uint64)
    for t in range(n):
        x = _mix(host_bits[t] + np.uint64(1))
        for k in range(res_ptr[t], res_ptr[t + 1]):
            x = _mix(x + np.uint64(res_idx[k] + 2))
        x = _mix(x + np.uint64(0x9E3779B97F4A7C15))
        for k in range(dev_ptr[t], dev_ptr[t + 1]):
            x = _mix(x + np.uint64(dev_idx[k] + 2))
        hashes[t] = x
    cap = 16
    while cap < 2 * n:
        cap *= 2
    mask = np.uint64(cap - 1)
    slot_hash = np.zeros(cap, dtype=np.uint64)
    slot_list = np.full(cap, -1, dtype=np.int64)
    first = np.empty(n, dtype=np.int64)  # a task of each list, to check the others against
    sig = np.empty(n, dtype=np.int64)
    n_lists = 0
    for t in range(n):
        j = hashes[t] & mask
        while slot_list[j] >= 0 and slot_hash[j] != hashes[t]:
            j = (j + np.uint64(1)) & mask
        if slot_list[j] < 0:
            slot_hash[j] = hashes[t]
            slot_list[j] = n_lists
            first[n_lists] = t
            n_lists += 1
        w = slot_list[j]
        sig[t] = w
        a = first[w]
        if a == t:
            continue
        # the same constraints as the list's first task, or a hash collision
        if res_ptr[t + 1] - res_ptr[t] != res_ptr[a + 1] - res_ptr[a]:
            return sig, -1
        for k in range(res_ptr[t + 1] - res_ptr[t]):
            if res_idx[res_ptr[t] + k] != res_idx[res_ptr[a] + k]:
                return sig, -1
        if host_bits[t] != host_bits[a] or dev_ptr[t + 1] - dev_ptr[t] != dev_ptr[a + 1] - dev_ptr[a]:
            return sig, -1
        for k in range(dev_ptr[t + 1] - dev_ptr[t]):
            if dev_idx[dev_ptr[t] + k] != dev_idx[dev_ptr[a] + k]:
                return sig, -1
    return sig, n_lists


# ---------------------------------------------------------------------- the schedule
@njit(cache=True)
def list_schedule_waitlists(duration, priority, res_ptr, res_idx, succ_ptr, succ_idx, n_pred, n_resources,
                            host_cost, host_sync, dev_ptr, dev_idx, n_devices, park_after):
    """Return (start, finish, number scheduled), equal to :func:`envs.sim.schedule.list_schedule_hosted`
    (without hosts: zero host costs and no devices per task, equal to ``list_schedule``). The
    specification's loop runs until ``park_after`` tasks went back to its heap (where few tasks compete
    the lists would not pay for their set-up), then :func:`_parked_loop` goes on from its state."""
    state, size = hosted_state(priority, n_pred, n_resources, n_devices)
    done = 0
    if park_after > 0:
        size, done = hosted_loop(duration, priority, res_ptr, res_idx, succ_ptr, succ_idx, host_cost, host_sync,
                                 dev_ptr, dev_idx, *state, size, done, park_after)
    if size > 0:
        sig, n_lists = _signatures(res_ptr, res_idx, dev_ptr, dev_idx, host_cost.view(np.uint64))
        if n_lists < 0:  # two constraint sets hashed alike (never seen): the specification's loop to the end
            size, done = hosted_loop(duration, priority, res_ptr, res_idx, succ_ptr, succ_idx, host_cost, host_sync,
                                     dev_ptr, dev_idx, *state, size, done, -1)
        else:
            done = _parked_loop(duration, priority, res_ptr, res_idx, succ_ptr, succ_idx, host_cost, host_sync,
                                dev_ptr, dev_idx, *state, size, done, sig, n_lists)
    return state[0], state[1], done


@njit(cache=True)
def _parked_loop(duration, priority, res_ptr, res_idx, succ_ptr, succ_idx, host_cost, host_sync, dev_ptr, dev_idx,
                 start, finish, ready_at, remaining, free, host_free, he, hp, ht, size, done, sig, n_lists) -> int:
    """The schedule from the specification loop's state, a task found waiting parked on its list
    ``sig[t]``; returns the number of tasks scheduled."""
    n = duration.shape[0]
    root = np.full(n_lists, -1, dtype=np.int64)
    child, sib, stack = np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64), np.empty(n, dtype=np.int64)
    lheap, lpos = np.empty(n_lists, dtype=np.int64), np.full(n_lists, -1, dtype=np.int64)
    le, lp, lt = np.empty(n_lists), np.empty(n_lists), np.empty(n_lists, dtype=np.int64)
    lsize = 0
    w = -1
    while size > 0 or lsize > 0:
        from_list = lsize > 0 and (size == 0 or _less(le[lheap[0]], lp[lheap[0]], lt[lheap[0]], he[0], hp[0], ht[0]))
        if from_list:
            w = lheap[0]
            e, t = le[w], root[w]
        else:
            e, t = he[0], ht[0]
        s = start_now(t, ready_at, res_ptr, res_idx, free, host_cost, dev_ptr, dev_idx, host_free)
        if s > e:  # a stale bound
            if from_list:  # the list's bound moved (its tasks share it): re-key the list
                _list_key(lheap, lpos, le, lp, lt, lsize, w, s, priority[t], t)
                continue
            size = _pop(he, hp, ht, size)
            v = sig[t]
            root[v] = t if root[v] == -1 else _meld(root[v], t, priority, child, sib)
            if root[v] == t:  # a new head: the list's key is its bound now (t's start)
                lsize = _list_key(lheap, lpos, le, lp, lt, lsize, v, s, priority[t], t)
            continue
        # t starts at s: it is the ready task of least (start, priority, task)
        if from_list:
            root[w] = _delete_min(t, priority, child, sib, stack)
        else:
            size = _pop(he, hp, ht, size)
        size = start_task(t, s, duration, priority, res_ptr, res_idx, succ_ptr, succ_idx, host_cost, host_sync,
                          dev_ptr, dev_idx, start, finish, ready_at, remaining, free, host_free, he, hp, ht, size)
        done += 1
        if from_list:  # t left its list: the list's key is its new head's start now
            head = root[w]
            if head == -1:
                lsize = _list_drop_top(lheap, lpos, le, lp, lt, lsize)
            else:
                b = start_now(head, ready_at, res_ptr, res_idx, free, host_cost, dev_ptr, dev_idx, host_free)
                _list_key(lheap, lpos, le, lp, lt, lsize, w, b, priority[head], head)
    return done


PARK_AFTER = 0.5  # tasks found waiting, per task, before waiting tasks park (measured: 0.25-0.5 best)


def waitlist_schedule(duration, priority, res_ptr, res_idx, succ_ptr, succ_idx, n_pred, n_resources,
                      host_cost=None, host_sync=None, dev_ptr=None, dev_idx=None, n_devices: int = 0,
                      park_after: int | None = None):
    """:func:`envs.sim.schedule.schedule` (same arguments, same result) by :func:`list_schedule_waitlists`
    (``park_after``: tasks found waiting before the lists are used; default :data:`PARK_AFTER` per task)."""
    n = duration.shape[0]
    if hosted(host_cost, host_sync):
        host_cost = np.ascontiguousarray(host_cost, dtype=np.float64)
        host_sync = np.ascontiguousarray(host_sync, dtype=np.bool_)
    else:  # no host takes part: no devices per task
        host_cost, host_sync = np.zeros(n), np.zeros(n, dtype=np.bool_)
        dev_ptr, dev_idx, n_devices = np.zeros(n + 1, dtype=np.int64), np.zeros(0, dtype=np.int64), 0
    park = int(PARK_AFTER * n + 64 if park_after is None else park_after)
    return list_schedule_waitlists(duration, priority, res_ptr, res_idx, succ_ptr, succ_idx, n_pred, int(n_resources),
                                   host_cost, host_sync, dev_ptr, dev_idx, int(n_devices), park)
