"""Specification of memory-constrained list scheduling (m-ETF / m-SCT) on arrays, and of the refine-mode
start it gives the environment."""

from __future__ import annotations

import numpy as np

from envs.graph import OpGraph
from envs.placement.env import PlacementEnv
from envs.placement.list_schedule import favourite_parents, list_schedule
from envs.placement.options import N_MODIFIERS
from envs.placement.task_setup import list_schedule_assignments, start_assignments
from envs.presets import preset
from envs.tasks import Task


def two_chains(n: int = 3):
    """Two independent chains of n nodes, a source feeding both and a sink joining them."""
    src, dst = [], []
    for c in range(2):
        first = 1 + c * n
        src += [0] + list(range(first, first + n - 1)) + [first + n - 1]
        dst += [first] + list(range(first + 1, first + n)) + [2 * n + 1]
    return 2 * n + 2, np.array(src), np.array(dst)


def schedule(tau, src, dst, delay=0.0, unit=None, unit_memory=None, capacity=None, fav=None):
    n, nd = tau.shape
    unit = np.arange(n) if unit is None else unit
    u = int(unit.max()) + 1
    unit_memory = np.zeros(u) if unit_memory is None else unit_memory
    capacity = np.full(nd, 1e9) if capacity is None else capacity
    arrival = lambda e, a: np.where(np.arange(nd) == a, 0.0, delay)  # noqa: E731
    return list_schedule(list(range(n)), tau, src, dst, arrival, unit, unit_memory, np.ones((u, nd), bool), capacity,
                         fav)


def test_etf_runs_independent_chains_in_parallel():
    n, src, dst = two_chains()
    device, used = schedule(np.ones((n, 2)), src, dst)
    chain_a, chain_b = device[1:4], device[4:7]
    assert len(set(chain_a)) == 1 and len(set(chain_b)) == 1 and chain_a[0] != chain_b[0]
    assert used.tolist() == [0.0, 0.0]


def test_costly_transfers_keep_everything_on_one_device():
    n, src, dst = two_chains()
    device, _ = schedule(np.ones((n, 2)), src, dst, delay=100.0)
    assert len(set(device.tolist())) == 1


def test_memory_caps_what_a_device_takes_and_units_move_together():
    n, src, dst = two_chains()
    # each chain is one unit (co-located), and a device holds one chain's memory only
    unit = np.array([2, 0, 0, 0, 1, 1, 1, 2])
    device, used = schedule(np.ones((n, 2)), src, dst, delay=100.0, unit=unit, unit_memory=np.array([6.0, 6.0, 0.0]),
                            capacity=np.array([10.0, 10.0]))
    assert device[1] == device[2] == device[3] and device[4] == device[5] == device[6]
    assert device[1] != device[4]  # transfers are dear, but the second chain does not fit beside the first
    assert sorted(used.tolist()) == [6.0, 6.0]


def test_nothing_fits_goes_to_the_device_with_most_free_memory():
    tau, src, dst = np.ones((2, 2)), np.array([0]), np.array([1])
    device, used = schedule(tau, src, dst, unit_memory=np.array([5.0, 50.0]), capacity=np.array([10.0, 20.0]))
    assert device.tolist() == [0, 1]  # device 0 has 5 bytes left, device 1 all its 20
    assert used.tolist() == [5.0, 50.0]


def test_sct_favourite_child_follows_its_parent():
    n, src, dst = two_chains()
    weight = np.ones(len(src))
    weight[0] = 10.0  # the source sends most to the first chain
    fav = favourite_parents(n, src, dst, weight)
    assert fav[1] == 0 and fav[4] == -1 and fav[2] == 1
    device, _ = schedule(np.ones((n, 2)), src, dst, delay=0.5, fav=fav)
    assert device[1] == device[0]


def tower_graph(towers: int = 4, depth: int = 3) -> OpGraph:
    """``towers`` independent towers of equal cost (no weights), joined by a cheap sink."""
    names, src, dst = ["input"], [], []
    for t in range(towers):
        for k in range(depth):
            names.append(f"tower{t}.layer{k}")
            src.append(0 if k == 0 else len(names) - 2)
            dst.append(len(names) - 1)
    sink = len(names)
    names.append("concat")
    for t in range(towers):
        src.append(1 + t * depth + depth - 1)
        dst.append(sink)
    n = len(names)
    flops = np.full(n, 4e12)
    flops[[0, sink]] = 1e6
    return OpGraph(names=names, kinds=["linear"] * n, fwd_flops=flops, param_bytes=np.zeros(n),
                   out_bytes=np.full(n, 1e5), edge_src=np.array(src), edge_dst=np.array(dst),
                   edge_bytes=np.full(len(src), 1e5), batch_size=8, name="towers",
                   module_paths=[nm.split(".")[0] for nm in names])


def test_refine_starts_include_the_list_scheduled_operator_placement():
    env = PlacementEnv([Task(tower_graph(), preset("dgx-a100-80g"))], mode="refine", max_nodes=40)
    env.reset(seed=0)
    prep = env.prepared
    starts = list_schedule_assignments(prep)
    assert starts, "towers on 8 GPUs: the list schedule spreads them"
    rows = np.arange(prep.graph.num_nodes)
    for name, assign in starts.items():
        assert name.startswith("list schedule")
        assert assign.shape == rows.shape and (assign % N_MODIFIERS == 0).all()  # no modifier
        assert prep.allowed[rows, assign // N_MODIFIERS].all()
        assert np.unique(assign).size > 1
    assert set(starts) <= set(start_assignments(prep))


def test_a_chain_gets_no_list_scheduled_start():
    from envs.graph import chain_graph

    env = PlacementEnv([Task(chain_graph(12, batch_size=8), preset("dgx-a100-80g"))], mode="refine", max_nodes=40)
    env.reset(seed=0)
    assert list_schedule_assignments(env.prepared) == {}  # no branches to overlap
    assert any(k.startswith("pipeline") for k in start_assignments(env.prepared))  # the pipelines cut it instead
