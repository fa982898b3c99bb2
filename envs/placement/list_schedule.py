"""Memory-constrained list scheduling of a DAG on devices: ETF and SCT, on plain arrays.

The algorithm of Baechi's m-ETF / m-SCT (Jeon et al., SoCC 2020; ETF: Hwang, Chow, Anger & Lee, SIAM J.
Comput. 1989; SCT: Hanen & Munier 1995): among all ready (node, device) pairs, schedule the one that
finishes first, a node's start being the later of its device's free time and its inputs' arrival. A
device is eligible for a node only while it has memory left for the node's placement unit (a
co-location class moves as one: its first member placed pins it); when no device has room, the allowed
device with the most free memory takes it. With ``fav_parent`` (SCT), a node whose favourite parent's
device has room and is free by the time the node's data is ready stays on that device.

Callers build the arrays: :mod:`agent.placers.baechi` on operators (the m-ETF / m-SCT heuristics), and
:mod:`envs.placement.task_setup` on the environment's groups (the refine mode's list-scheduled start).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def list_schedule(order: Sequence[int], tau: np.ndarray, edge_src: np.ndarray, edge_dst: np.ndarray,
                  arrival_delay: Callable[[int, int], np.ndarray], unit: np.ndarray, unit_memory: np.ndarray,
                  unit_allowed: np.ndarray, capacity: np.ndarray,
                  fav_parent: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(device of each node, memory used per device).

    ``order``: the nodes in topological order (ties among ready nodes go to the earlier one); ``tau``
    [n, nd]: each node's time on each device; ``arrival_delay(e, a)`` [nd]: the delay of edge ``e``'s
    tensor from device ``a`` to each device (0 on ``a``); ``unit`` [n]: each node's placement unit,
    ``unit_memory`` [U] and ``unit_allowed`` [U, nd] per unit; ``capacity`` [nd]; ``fav_parent`` [n]
    (-1: none) for SCT, None for ETF."""
    n, nd = tau.shape
    in_edges: list[list[int]] = [[] for _ in range(n)]
    succ: list[list[int]] = [[] for _ in range(n)]
    for e in range(len(edge_src)):
        in_edges[int(edge_dst[e])].append(e)
        succ[int(edge_src[e])].append(int(edge_dst[e]))
    remaining = np.bincount(np.asarray(edge_dst, dtype=np.int64), minlength=n).astype(np.int64)
    device = np.full(n, -1, dtype=np.int64)
    unit_dev = np.full(len(unit_memory), -1, dtype=np.int64)
    finish_t = np.zeros(n)
    free_at = np.zeros(nd)
    used = np.zeros(nd)
    ready: list[int] = [int(v) for v in order if remaining[v] == 0]
    data_ready: dict[int, np.ndarray] = {}

    def arrival(v: int) -> np.ndarray:
        arr = np.zeros(nd)
        for e in in_edges[v]:
            u = int(edge_src[e])
            arr = np.maximum(arr, finish_t[u] + arrival_delay(e, int(device[u])))
        return arr

    for v in ready:
        data_ready[v] = arrival(v)
    while ready:
        R = np.asarray(ready, dtype=np.int64)
        arr = np.stack([data_ready[v] for v in ready])
        fin = np.maximum(arr, free_at[None, :]) + tau[R]
        ok = np.zeros_like(fin, dtype=bool)
        for i, v in enumerate(ready):
            u = unit[v]
            if unit_dev[u] >= 0:
                ok[i, unit_dev[u]] = True
                continue
            ok[i] = unit_allowed[u] & (used + unit_memory[u] <= capacity)
            if not ok[i].any():  # nowhere fits: the most free memory among the allowed devices
                free = np.where(unit_allowed[u], capacity - used, -np.inf)
                ok[i, int(np.argmax(free))] = True
            p = -1 if fav_parent is None else int(fav_parent[v])
            if p >= 0 and device[p] >= 0 and ok[i, device[p]] and free_at[device[p]] <= arr[i, device[p]] + 1e-12:
                keep = int(device[p])
                ok[i] = False
                ok[i, keep] = True
        i, d = divmod(int(np.argmin(np.where(ok, fin, np.inf))), nd)
        v = int(R[i])
        device[v] = d
        finish_t[v] = fin[i, d]
        free_at[d] = fin[i, d]
        u = unit[v]
        if unit_dev[u] < 0:
            unit_dev[u] = d
            used[d] += unit_memory[u]
        ready.pop(i)
        del data_ready[v]
        for w in succ[v]:
            remaining[w] -= 1
            if remaining[w] == 0:
                ready.append(int(w))
                data_ready[int(w)] = arrival(int(w))
    return unit_dev[unit], used


def favourite_parents(n: int, edge_src: np.ndarray, edge_dst: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """SCT's favourite parent of each node (-1: none): every node's favourite child is the child it sends
    the most data to (``weight`` per edge; the first such edge on ties), and a child keeps the first
    parent that chose it."""
    out_best: dict[int, tuple[float, int]] = {}
    for e in range(len(edge_src)):
        u, v = int(edge_src[e]), int(edge_dst[e])
        if u not in out_best or float(weight[e]) > out_best[u][0]:
            out_best[u] = (float(weight[e]), v)
    fav = np.full(n, -1, dtype=np.int64)
    for u, (_, v) in out_best.items():
        if fav[v] < 0:
            fav[v] = u
    return fav
