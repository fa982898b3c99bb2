"""The list scheduler's kernels against a plain heapq implementation of Graham's list scheduling."""

from __future__ import annotations

import heapq

import numpy as np
import pytest

from envs.sim.schedule import csr_and_indegree, list_schedule, list_schedule_hosted, schedule
from envs.sim.waitlist_schedule import waitlist_schedule


def reference_schedule(dur, pri, res, succ, npred, host=None, sync=None, devs=None, nd=0):
    """Tasks keyed by (ready time, priority, id); a popped task that cannot start then (a resource or
    one of its hosts is busy) goes back with its real start; hosts issue tasks in the order they start."""
    n = len(dur)
    start, finish = [-1.0] * n, [-1.0] * n
    ready, remaining = [0.0] * n, list(npred)
    free = {}
    host_free = [0.0] * nd
    heap = [(0.0, pri[t], t) for t in range(n) if remaining[t] == 0]
    heapq.heapify(heap)
    while heap:
        est, p, t = heapq.heappop(heap)
        s = max([est] + [free.get(r, 0.0) for r in res[t]])
        if host is not None:
            s = max([s] + [host_free[d] + host[t] for d in devs[t]])
        if s > est:
            heapq.heappush(heap, (s, p, t))
            continue
        start[t], finish[t] = s, s + dur[t]
        for r in res[t]:
            free[r] = finish[t]
        if host is not None:
            for d in devs[t]:
                host_free[d] = max(finish[t], host_free[d] + host[t]) if sync[t] else host_free[d] + host[t]
        for u in succ[t]:
            ready[u] = max(ready[u], finish[t])
            remaining[u] -= 1
            if remaining[u] == 0:
                heapq.heappush(heap, (ready[u], pri[u], u))
    return start, finish


@pytest.mark.parametrize("seed", range(40))
def test_kernels_schedule_exactly_as_the_reference(seed):
    rng = np.random.default_rng(seed)
    n, nr = int(rng.integers(5, 120)), int(rng.integers(2, 10))
    nd = max(1, nr // 3)
    edges = sorted({(int(u), v) for v in range(1, n) for u in rng.choice(v, size=min(v, int(rng.integers(0, 4))),
                                                                              replace=False)})
    src = np.array([e[0] for e in edges], dtype=np.int64)
    dst = np.array([e[1] for e in edges], dtype=np.int64)
    sp, si, npred = csr_and_indegree(src, dst, n)
    dur = rng.choice([0.0, 0.5, 1.0, 2.0], size=n) if seed % 2 else rng.random(n)
    pri = rng.permutation(n).astype(np.float64)
    res = [sorted(rng.choice(nr, size=int(rng.integers(1, 3)), replace=False).tolist()) for _ in range(n)]
    devs = [sorted(rng.choice(nd, size=min(nd, int(rng.integers(1, 3))), replace=False).tolist()) for _ in range(n)]
    host = rng.random(n) * [0.0, 0.1, 1.0][seed % 3]
    sync = rng.random(n) < 0.2
    succ = [si[sp[t]:sp[t + 1]].tolist() for t in range(n)]
    rp = np.concatenate([[0], np.cumsum([len(r) for r in res])]).astype(np.int64)
    ri = np.array([x for r in res for x in r], dtype=np.int64)
    dp = np.concatenate([[0], np.cumsum([len(d) for d in devs])]).astype(np.int64)
    di = np.array([x for d in devs for x in d], dtype=np.int64)
    s, f, done = list_schedule(dur, pri, rp, ri, sp, si, npred, nr)
    rs, rf = reference_schedule(dur.tolist(), pri.tolist(), res, succ, npred.tolist())
    assert done == n and s.tolist() == rs and f.tolist() == rf
    s, f, done = list_schedule_hosted(dur, pri, rp, ri, sp, si, npred, nr, host, sync, dp, di, nd)
    rs, rf = reference_schedule(dur.tolist(), pri.tolist(), res, succ, npred.tolist(), host.tolist(), sync.tolist(),
                                devs, nd)
    assert done == n and s.tolist() == rs and f.tolist() == rf


# ---------------------------------------------------------------------- the wait-list scheduler
def contended_tasks(seed: int, n: int, hosted: bool):
    """A random task DAG where many tasks are ready at once on few resources: wide layers, tied
    priorities, zero and equal durations, one to three resources and one or two devices per task, host
    costs from a few values (so tasks share wait lists) and blocking transfers."""
    rng = np.random.default_rng(seed)
    nr, nd = int(rng.integers(1, 7)), int(rng.integers(1, 4))
    width = int(rng.integers(1, 40))
    edges = sorted({(int(u), v) for v in range(width, n)
                    for u in rng.choice(v, size=min(v, int(rng.integers(0, 3))), replace=False)})
    src = np.array([e[0] for e in edges], dtype=np.int64)
    dst = np.array([e[1] for e in edges], dtype=np.int64)
    sp, si, npred = csr_and_indegree(src, dst, n)
    dur = rng.choice([0.0, 0.25, 0.5, 1.0], size=n) if seed % 2 else rng.random(n)
    pri = rng.integers(0, max(2, n // 4), size=n).astype(np.float64)  # many ties: the task id decides
    res = [sorted(rng.choice(nr, size=int(rng.integers(1, min(nr, 3) + 1)), replace=False).tolist()) for _ in range(n)]
    devs = [sorted(rng.choice(nd, size=int(rng.integers(1, min(nd, 2) + 1)), replace=False).tolist())
            for _ in range(n)]
    rp = np.concatenate([[0], np.cumsum([len(r) for r in res])]).astype(np.int64)
    ri = np.array([x for r in res for x in r], dtype=np.int64)
    dp = np.concatenate([[0], np.cumsum([len(d) for d in devs])]).astype(np.int64)
    di = np.array([x for d in devs for x in d], dtype=np.int64)
    host = rng.choice([0.0, 0.01, 0.1, 0.3], size=n) if hosted else np.zeros(n)
    sync = (rng.random(n) < 0.2) & hosted
    return (dur, pri, rp, ri, sp, si, npred, nr, host, sync, dp, di, nd)


@pytest.mark.parametrize("seed", range(60))
def test_the_wait_list_scheduler_schedules_exactly_as_the_specification(seed):
    """Same starts and finishes, bit for bit, as envs.sim.schedule's scheduler (with and without hosts)."""
    for hosted in (False, True):
        args = contended_tasks(seed, int(np.random.default_rng(seed).integers(2, 400)), hosted)
        s, f, done = schedule(*args)
        for park_after in (0, 16, None):  # parks from the first wait, after some, after the default share
            ws, wf, wdone = waitlist_schedule(*args, park_after=park_after)
            assert done == wdone == len(args[0])
            assert ws.tolist() == s.tolist() and wf.tolist() == f.tolist()


def test_the_wait_lists_schedule_a_crowd_on_one_resource_as_the_specification():
    """Hundreds of independent tasks ready at once on one resource, host costs of a few values (the
    specification re-pushes every waiting task after each start): same schedule, one task at a time."""
    n = 600
    args = contended_tasks(0, n, True)
    sp, si = np.zeros(n + 1, dtype=np.int64), np.zeros(0, dtype=np.int64)
    args = (args[0], args[1], np.arange(n + 1, dtype=np.int64), np.zeros(n, dtype=np.int64), sp, si,
            np.zeros(n, dtype=np.int64), 1, *args[8:])
    s, f, _ = schedule(*args)
    ws, wf, done = waitlist_schedule(*args, park_after=0)
    assert done == n and ws.tolist() == s.tolist() and wf.tolist() == f.tolist()
    order = np.argsort(s, kind="stable")
    assert np.all(f[order][:-1] <= s[order][1:])


def test_tasks_share_a_wait_list_exactly_when_their_constraints_are_equal():
    """One list per distinct (resources, devices, host cost): tasks of a list share their bound."""
    from envs.sim.waitlist_schedule import _signatures

    args = contended_tasks(3, 300, True)
    rp, ri, dp, di, host = args[2], args[3], args[10], args[11], args[8]
    sig, n_lists = _signatures(rp, ri, dp, di, np.ascontiguousarray(host, dtype=np.float64).view(np.uint64))
    keys = [(tuple(ri[rp[t]:rp[t + 1]]), tuple(di[dp[t]:dp[t + 1]]), float(host[t])) for t in range(len(host))]
    assert n_lists == len(set(keys))
    for a in range(len(keys)):
        for b in range(a + 1, len(keys)):
            assert (sig[a] == sig[b]) == (keys[a] == keys[b])
