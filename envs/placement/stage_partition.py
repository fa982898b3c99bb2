"""Cut a sequence into contiguous pipeline stages: the smallest bottleneck that fits in memory.

The linear-partitioning problem of pipeline planners (PipeDream's partitioner, Narayanan et al., SOSP
2019; the min-max contiguous partition of Bokhari, IEEE TC 1988): items in a fixed order (operators or
groups in topological order) go to ``k`` stages, stage ``s`` taking a contiguous run of them; item ``v``
costs ``time[v, s]`` on stage ``s`` (its device's speed) and ``memory[v, s]`` there (a 1F1B stage near the
front keeps more microbatches' activations); stage ``s`` holds at most ``capacity[s]``. Minimise the
largest stage time. For a bottleneck ``T`` the greedy packing (each stage takes the longest run that
stays within ``T`` and its memory) fits whenever any partition does, so bisection on ``T`` finds the
optimum to a relative tolerance.

Callers build the arrays: :mod:`envs.placement.task_setup` (the refine mode's pipeline starts).
"""

from __future__ import annotations

import numpy as np

RELATIVE_TOLERANCE = 1e-6
MAX_BISECTIONS = 100


def bottleneck_stages(time: np.ndarray, memory: np.ndarray, capacity: np.ndarray,
                      cuts: np.ndarray | None = None) -> np.ndarray | None:
    """The stage of each item (in the given order, non-decreasing, every stage non-empty) minimising the
    largest stage time subject to every stage's memory, or None when no ``k``-stage cut fits in memory.

    ``time``, ``memory`` [n, k]; ``capacity`` [k]; ``cuts``: the positions a stage may start at
    (``1..n-1``; default all of them)."""
    time, memory = np.asarray(time, dtype=np.float64), np.asarray(memory, dtype=np.float64)
    n, k = time.shape
    capacity = np.asarray(capacity, dtype=np.float64)
    if memory.shape != (n, k) or capacity.shape != (k,):
        raise ValueError(f"time {time.shape}, memory {memory.shape} and capacity {capacity.shape} disagree")
    if k < 1 or n < k:
        return None
    ends = np.arange(1, n) if cuts is None else np.unique(np.asarray(cuts, dtype=np.int64))
    ends = np.append(ends[(ends > 0) & (ends < n)], n)  # where a stage may end (exclusive), n last
    if ends.size < k:
        return None
    zero = np.zeros((1, k))
    cum_t = np.vstack([zero, np.cumsum(time, axis=0)])[ends]  # [E, k] at each possible end
    cum_m = np.vstack([zero, np.cumsum(memory, axis=0)])[ends]

    def pack(limit: float) -> list[int] | None:
        """The end index (into ``ends``) of every stage under bottleneck ``limit``, None if it does not fit."""
        chosen, start = [], -1  # ``start``: the previous stage's end index (-1: position 0)
        for s in range(k):
            base_t = cum_t[start, s] if start >= 0 else 0.0
            base_m = cum_m[start, s] if start >= 0 else 0.0
            last = ends.size - 1 - (k - 1 - s)  # leave one end per later stage
            ok_t = np.searchsorted(cum_t[:, s], base_t + limit, side="right") - 1
            ok_m = np.searchsorted(cum_m[:, s], base_m + capacity[s], side="right") - 1
            end = min(last, int(ok_t), int(ok_m))
            if end <= start or (s == k - 1 and end != ends.size - 1):
                return None
            chosen.append(end)
            start = end
        return chosen

    if pack(np.inf) is None:
        return None
    lo, hi = 0.0, float(time.sum(axis=0).max()) + 1e-300
    for _ in range(MAX_BISECTIONS):
        if hi - lo <= RELATIVE_TOLERANCE * hi:
            break
        mid = 0.5 * (lo + hi)
        if pack(mid) is None:
            lo = mid
        else:
            hi = mid
    chosen = pack(hi)
    assert chosen is not None  # pack is monotone in the limit and fits at hi
    stage = np.zeros(n, dtype=np.int64)
    for end in chosen[:-1]:
        stage[ends[end]:] += 1
    return stage
