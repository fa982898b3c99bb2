"""The min-max contiguous stage cut (envs.placement.stage_partition) against brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from envs.placement.stage_partition import bottleneck_stages


def _brute_force(time, memory, capacity, cuts):
    """The smallest bottleneck over every feasible cut, or None."""
    n, k = time.shape
    best = None
    for starts in itertools.combinations(sorted(cuts), k - 1):
        bounds = [0, *starts, n]
        ok, worst = True, 0.0
        for s in range(k):
            lo, hi = bounds[s], bounds[s + 1]
            ok &= memory[lo:hi, s].sum() <= capacity[s]
            worst = max(worst, time[lo:hi, s].sum())
        if ok and (best is None or worst < best):
            best = worst
    return best


@pytest.mark.parametrize("seed", range(40))
def test_bottleneck_stages_is_the_best_feasible_cut(seed):
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(2, 9)), int(rng.integers(1, 4))
    k = min(k, n)
    time = rng.lognormal(0.0, 1.0, (n, 1)) / rng.uniform(0.5, 2.0, (1, k))  # heterogeneous stage speeds
    memory = rng.uniform(0.0, 1.0, (n, 1)) * np.linspace(1.5, 1.0, k)[None, :]  # front stages keep more
    capacity = rng.uniform(0.6, 2.5, k)
    cuts = np.flatnonzero(rng.random(n - 1) < 0.7) + 1 if seed % 2 else np.arange(1, n)
    stage = bottleneck_stages(time, memory, capacity, cuts)
    best = _brute_force(time, memory, capacity, cuts.tolist())
    if best is None:
        assert stage is None
        return
    assert stage is not None and stage.shape == (n,)
    assert (np.diff(stage) >= 0).all() and np.unique(stage).tolist() == list(range(k))  # contiguous, none empty
    assert set((np.flatnonzero(np.diff(stage)) + 1).tolist()) <= set(cuts.tolist())
    for s in range(k):
        assert memory[stage == s, s].sum() <= capacity[s] + 1e-12
    bottleneck = max(time[stage == s, s].sum() for s in range(k))
    assert bottleneck == pytest.approx(best, rel=1e-5)


def test_bottleneck_stages_moves_work_off_a_slow_stage_and_weights_off_a_small_one():
    time = np.ones((6, 2)) * np.array([1.0, 2.0])  # stage 1's device is half as fast
    stage = bottleneck_stages(time, np.zeros((6, 2)), np.ones(2))
    assert np.bincount(stage).tolist() == [4, 2]  # 4 x 1 vs 2 x 2
    memory = np.ones((6, 2))
    stage = bottleneck_stages(time, memory, np.array([2.0, 10.0]))  # stage 0 holds only two items
    assert np.bincount(stage).tolist() == [2, 4]
    assert bottleneck_stages(time, memory, np.array([2.0, 3.0])) is None  # 6 items, room for 5
    assert bottleneck_stages(time[:1], memory[:1], np.ones(2)) is None  # fewer items than stages


def test_bottleneck_stages_refuses_mismatched_arrays():
    with pytest.raises(ValueError, match="disagree"):
        bottleneck_stages(np.ones((4, 2)), np.ones((4, 3)), np.ones(2))
