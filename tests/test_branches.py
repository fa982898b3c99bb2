"""Concurrent branches (``envs.branches``): the analysis, the coarsening that keeps branches apart, and
the refine start that runs them side by side on disjoint device groups."""

from __future__ import annotations

from dataclasses import replace

import networkx as nx
import numpy as np
import pytest

from envs.branches import balanced_bins, branch_of, branch_regions, concurrent_children, junctions
from envs.coarsen import _label_runs, coarsen
from envs.graph import OpGraph, chain_graph
from envs.placement.env import PlacementEnv
from envs.placement.options import N_MODIFIERS
from envs.presets import preset
from envs.tasks import Task

SIAMESE = "experiments/models/siamese_encoder.py:build:layers=2,width=64,vocab=500,seq=16,batch=8"
HRNET = "experiments/models/hrnet_like.py:build:batch=2,image=64,width=8,stages=2"
ENSEMBLE = "experiments/models/cnn_ensemble.py:build:members=8,width=8,classes=10,blocks=2,batch=16,image=16"
CLIP = ("experiments/models/clip_like.py:build:layers=2,vision_width=128,text_width=64,image=64,vocab=1000,"
        "context=16,embed=64,batch=16")


def _dag(n: int, edges: list[tuple[int, int]], module_paths: list[str] | None = None) -> OpGraph:
    src, dst = (np.array(x, dtype=np.int64) for x in zip(*edges))
    return OpGraph(names=[f"op{i}" for i in range(n)], kinds=["linear"] * n, fwd_flops=np.full(n, 1e9),
                   param_bytes=np.zeros(n), out_bytes=np.full(n, 1e6), edge_src=src, edge_dst=dst,
                   edge_bytes=np.full(len(edges), 1e6), batch_size=8, module_paths=module_paths)


def _prefix_labels(paths: list[str], depth: int) -> np.ndarray:
    """Each path's first ``depth`` components as an integer label; -1 for a shallower path."""
    ids: dict[str, int] = {}
    return np.array([ids.setdefault(".".join(p.split(".")[:depth]), len(ids)) if len(p.split(".")) >= depth else -1
                     for p in paths])


def _clip():
    from profilers.spec import graph_from_spec

    g = graph_from_spec(CLIP)
    tower = np.array([0 if n.startswith(("vision", "patchify", "image")) else 1 if n.startswith(("text", "token"))
                      else -1 for n in g.names])
    return g, tower


def test_junctions_are_the_nodes_comparable_with_every_other():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(2, 30))
        edges = sorted({(int(a), int(b)) for a, b in rng.integers(0, n, (2 * n, 2)) if a < b} | {(0, 1)})
        g = _dag(n, edges)
        nxg = nx.DiGraph(edges)
        nxg.add_nodes_from(range(n))
        want = [len(nx.ancestors(nxg, v)) + len(nx.descendants(nxg, v)) == n - 1 for v in range(n)]
        assert junctions(g).tolist() == want


def test_two_towers_are_one_region_of_two_branches_and_a_chain_has_none():
    # 0 -> (1 -> 2 -> 3) and (4 -> 5) -> 6 -> 7: towers {1,2,3} and {4,5} between junctions 0 and 6
    g = _dag(8, [(0, 1), (1, 2), (2, 3), (0, 4), (4, 5), (3, 6), (5, 6), (6, 7)])
    assert np.flatnonzero(junctions(g)).tolist() == [0, 6, 7]
    assert branch_of(g).tolist() == [-1, 1, 1, 1, 4, 4, -1, -1]
    assert [sorted(b.tolist() for b in r) for r in branch_regions(g)] == [[[1, 2, 3], [4, 5]]]
    # a residual chain: the skip edge orders everything, so no branches
    res = _dag(5, [(0, 1), (1, 2), (0, 2), (2, 3), (3, 4), (2, 4)])
    assert junctions(res).all() and branch_regions(res) == []
    # two diamonds in a row: two regions, in order
    two = _dag(7, [(0, 1), (0, 2), (1, 3), (2, 3), (3, 4), (3, 5), (4, 6), (5, 6)])
    assert [sorted(b.tolist() for b in r) for r in branch_regions(two)] == [[[1], [2]], [[4], [5]]]


def test_balanced_bins_put_the_heaviest_first_into_the_lightest_bin():
    assert balanced_bins([5.0, 1.0, 4.0, 3.0], 2) == [[0, 1], [2, 3]]
    assert balanced_bins([1.0], 3) == [[0]]  # empty bins dropped
    loads = np.random.default_rng(1).random(12)
    bins = balanced_bins(loads.tolist(), 3)
    assert sorted(i for b in bins for i in b) == list(range(12))
    sums = [loads[b].sum() for b in bins]
    assert max(sums) - min(sums) <= loads.max()  # LPT: within one item of balanced


@pytest.mark.parametrize("max_nodes", [28, 32, 40, 48])
def test_auto_groups_never_mix_two_towers(max_nodes):
    """A layout-pure run at a shallow module depth used to take a two-tower model's ops of one layout
    from both towers in turn (10 of 28 groups mixed at max_nodes 28-40); the towers could then not run on
    different devices."""
    g, tower = _clip()
    _, grouping = coarsen(g, max_nodes)
    for k in range(grouping.num_groups):
        assert not {0, 1} <= set(tower[grouping.group_of == k].tolist())


@pytest.mark.parametrize("max_nodes", [7, 16, 25, 40])
def test_auto_groups_never_mix_the_two_calls_of_a_shared_encoder(max_nodes):
    """A Siamese model's two encoder calls have the same module paths: module runs used to take both
    calls' layers together (25 of 26 groups mixed at max_nodes 37-49, some at every size)."""
    from profilers.spec import graph_from_spec

    g = graph_from_spec(SIAMESE)
    regions = branch_regions(g)
    assert [len(r) for r in regions] == [2]
    side = np.full(g.num_nodes, -1)
    for i, b in enumerate(regions[0]):
        side[b] = i
    _, grouping = coarsen(g, max_nodes)
    assert grouping.num_groups <= max_nodes
    for k in range(grouping.num_groups):
        assert not {0, 1} <= set(side[grouping.group_of == k].tolist())


def test_branch_labels_give_way_when_even_one_run_per_branch_is_too_many():
    g, _ = _clip()
    coarse, grouping = coarsen(g, 3)
    assert coarse.num_nodes <= 3 and grouping.num_groups == coarse.num_nodes


def test_branch_start_runs_the_towers_side_by_side_on_the_two_quads():
    from envs.placement.task_setup import branch_parallel_assignments, data_parallel_assignments

    g, tower = _clip()
    env = PlacementEnv([Task(g, preset("dgx-a100-80g"))], mode="refine", max_nodes=40)
    env.reset(seed=0)
    prep = env.prepared
    starts = branch_parallel_assignments(prep)
    # two towers: the two quads only (four pairs would leave two idle), the rest on all eight or on one quad
    assert list(starts) == ["branches on 2 x a100-80g x4", "branches on 2 x a100-80g x4, the rest on the lightest"]
    rows = starts["branches on 2 x a100-80g x4"] // N_MODIFIERS
    opts = prep.options
    op_group = [opts.groups[rows[prep.grouping.group_of[v]]] for v in range(g.num_nodes)]
    vision = {op_group[v] for v in range(g.num_nodes) if g.names[v].startswith("vision.encoder")}
    text = {op_group[v] for v in range(g.num_nodes) if g.names[v].startswith("text.encoder")}
    assert vision == {(0, 1, 2, 3)} and text == {(4, 5, 6, 7)}
    branch = np.flatnonzero(branch_of(prep.graph) >= 0)
    assert all(opts.groups[rows[v]] == tuple(range(8)) for v in range(prep.graph.num_nodes) if v not in branch)
    # host-bound at 2 samples per GPU: each quad's hosts issue one tower's operators
    time = {name: env._scoring.evaluate(prep, prep.plan(a, 1, "1f1b", 1, "test")).value
            for name, a in {**starts, **data_parallel_assignments(prep)}.items()}
    assert time["branches on 2 x a100-80g x4"] < 0.7 * time["data parallel a100-80g x8"]


def _member_of(g: OpGraph) -> np.ndarray:
    """Each op's ensemble member (-1: the input, the additions that join them, the mean)."""
    return np.array([int(p.split(".")[1]) if p.startswith("members.") else -1 for p in g.module_paths])


@pytest.mark.parametrize("max_nodes", [12, 20, 28, 40])
def test_concurrent_groups_never_put_two_ensemble_members_together(max_nodes):
    """The light merge after the concurrent split joins a group to a neighbour whose every op it precedes
    or follows first: along chain edges alone (a producer's only consumer), the input's group took the
    first layers of two members, and the chain of additions the last layers of two more."""
    from profilers.spec import graph_from_spec

    g = graph_from_spec(ENSEMBLE)
    member = _member_of(g)
    coarse, split = coarsen(g, max_nodes, "concurrent")
    assert split.method == "concurrent" and coarse.num_nodes <= max_nodes
    for k in range(split.num_groups):
        assert len(set(member[(split.group_of == k) & (member >= 0)].tolist())) <= 1
    if max_nodes == 20:  # along chain edges first, the merge that followed the split put two members together
        _, chains = coarsen(g, max_nodes, "concurrent-chains")
        assert chains.method == "concurrent-chains"
        assert any(len(set(member[(chains.group_of == k) & (member >= 0)].tolist())) > 1
                   for k in range(chains.num_groups))


def test_branch_starts_cut_the_devices_at_every_size_and_put_the_rest_on_the_lightest_part():
    """Eight members on 8 GPUs: two quads, four pairs and eight single GPUs (one member each); the joining
    ops either data parallel over all eight or with the least loaded part. Each member alone on a GPU
    with the additions beside the lightest member is the fastest of them (host-bound: a data-parallel
    group issues every operator on every host)."""
    from envs.placement.task_setup import branch_parallel_assignments
    from profilers.spec import graph_from_spec

    g = graph_from_spec(ENSEMBLE)
    env = PlacementEnv([Task(g, preset("dgx-a100-80g"))], mode="refine", max_nodes=40)
    env.reset(seed=0)
    prep, opts = env.prepared, env.prepared.options
    starts = branch_parallel_assignments(prep)
    names = [f"branches on {n} x a100-80g x{8 // n}" for n in (2, 4, 8)]
    assert list(starts) == [x for n in names for x in (n, f"{n}, the rest on the lightest")]
    member = _member_of(g)
    singles = starts["branches on 8 x a100-80g x1, the rest on the lightest"] // N_MODIFIERS
    device_of = {m: {opts.groups[singles[prep.grouping.group_of[v]]] for v in np.flatnonzero(member == m)}
                 for m in range(8)}
    assert sorted(d for m in range(8) for d in device_of[m]) == [(i,) for i in range(8)]  # one GPU each
    rest = {opts.groups[singles[prep.grouping.group_of[v]]] for v in np.flatnonzero(member < 0)}
    assert len(rest) == 1 and len(next(iter(rest))) == 1  # the joining ops on one GPU, not all eight
    time = {name: env._scoring.evaluate(prep, prep.plan(a, 1, "1f1b", 1, "test")).value for name, a in starts.items()}
    assert min(time, key=time.get) == "branches on 8 x a100-80g x1, the rest on the lightest"
    assert time["branches on 8 x a100-80g x1, the rest on the lightest"] < 0.7 * time["branches on 2 x a100-80g x4"]


def test_no_branch_start_without_branches_or_for_small_branches():
    from envs.placement.task_setup import branch_parallel_assignments

    env = PlacementEnv([Task(chain_graph(8, batch_size=64), preset("dgx-a100-80g"))], mode="refine", max_nodes=8,
                       coarsen=False)
    env.reset(seed=0)
    assert branch_parallel_assignments(env.prepared) == {}
    # a long chain with one small side branch: under MIN_BRANCH_LOAD of the step, not a major branch
    edges = [(i, i + 1) for i in range(19)] + [(4, 20), (20, 6)]
    env = PlacementEnv([Task(_dag(21, edges), preset("dgx-a100-80g"))], mode="refine", max_nodes=21,
                       coarsen=False)
    env.reset(seed=0)
    assert branch_regions(env.prepared.graph) != []
    assert branch_parallel_assignments(env.prepared) == {}


def test_concurrent_children_are_the_sibling_modules_no_path_joins():
    # stem -> two branches of two ops -> the stage's own merge op -> a head of two ops in sequence
    paths = ["stem", "stage.branches.0.conv", "stage.branches.0.norm", "stage.branches.1.conv",
             "stage.branches.1.norm", "stage.branches", "head.fc1", "head.fc2"]
    g = _dag(8, [(0, 1), (1, 2), (0, 3), (3, 4), (2, 5), (4, 5), (5, 6), (6, 7)], paths)
    parent, child = _prefix_labels(paths, 2), _prefix_labels(paths, 3)
    load = np.full(8, 1 / 8)
    kept = concurrent_children(g, parent, child, load)
    assert kept.tolist() == [-1, child[1], child[1], child[3], child[3], -1, -1, -1]
    assert child[1] != child[3]
    # the head's two modules are children of "head" (depth 1) in sequence: never kept apart
    assert (concurrent_children(g, _prefix_labels(paths, 1), _prefix_labels(paths, 2), load)[6:] == -1).all()
    # too little beyond the heaviest child, or a child too light for a group of its own: none
    assert (concurrent_children(g, parent, child, load, min_load=0.3) == -1).all()
    light = load.copy()
    light[[3, 4]] = 1e-4
    assert (concurrent_children(g, parent, child, light, min_load=0.0, min_child_load=0.01) == -1).all()


def test_connected_runs_never_join_chains_no_edge_joins():
    # x feeds two chains of one label (a -> b, c -> d): one run of that label, or two when connected
    g = _dag(5, [(0, 1), (1, 2), (0, 3), (3, 4)])
    labels = np.array([0, 1, 1, 1, 1])
    plain, connected = _label_runs(g, labels), _label_runs(g, labels, connected=True)
    assert plain.tolist() == [0, 1, 1, 1, 1]
    assert connected.tolist() == [0, 1, 1, 2, 2]
    # an op whose input is in the run continues it
    assert _label_runs(chain_graph(4), np.zeros(4, dtype=np.int64), connected=True).tolist() == [0, 0, 0, 0]


def _hrnet_branch_of() -> tuple[OpGraph, np.ndarray]:
    from profilers.spec import graph_from_spec

    g = graph_from_spec(HRNET)
    branch = np.array([".".join(p.split(".")[:4]) if p.startswith("stages.") and ".branches." in p else ""
                       for p in g.module_paths])
    return g, branch


@pytest.mark.parametrize("max_nodes", [24, 36, 48, 66])
def test_concurrent_groups_keep_an_hrnet_stages_resolution_branches_apart(max_nodes):
    """auto's runs of a stage interleave its four resolution branches; concurrent's never mix two."""
    g, branch = _hrnet_branch_of()

    def mixed(grouping) -> int:
        return sum(len({b for b in branch[grouping.group_of == k] if b}) > 1 for k in range(grouping.num_groups))

    _, auto = coarsen(g, max_nodes, "auto")
    coarse, split = coarsen(g, max_nodes, "concurrent")
    assert mixed(auto) > 0 and mixed(split) == 0
    assert split.method == "concurrent" and split.info["concurrent_children"] > 0
    assert coarse.num_nodes == split.num_groups <= max_nodes


def test_concurrent_is_auto_where_no_child_is_kept_apart():
    from envs.examples import transformer_graph

    g = transformer_graph(layers=6, hidden=256, heads=4, seq=64, batch=4)
    _, auto = coarsen(g, 24, "auto")
    _, split = coarsen(g, 24, "concurrent")
    assert split.method == "auto" and "concurrent_children" not in split.info
    assert (split.group_of == auto.group_of).all()


def test_refine_env_takes_the_grouping_with_the_faster_start():
    """On a host-bound HRNet the groups that keep the branches apart start faster (branches on different
    GPUs); the environment keeps whichever grouping's refine start is faster (auto's, then concurrent's
    on a tie), of auto's and the two merges after the concurrent split."""
    from envs.placement.task_setup import prepare_task, refine_start

    g, _ = _hrnet_branch_of()
    task = Task(g, preset("dgx-a100-80g"))
    env = PlacementEnv([task], mode="refine", max_nodes=48)
    env.reset(seed=0)
    starts = {}
    for method in ("auto", "concurrent", "concurrent-chains"):
        prep = prepare_task(task, replace(env._settings, coarsen_method=method))
        assert prep.grouping.method == method
        starts[method] = refine_start(prep, env._scoring, env.refine_init, env.microbatch_choices, "test").result.value
    chosen = env.prepared.grouping.method
    assert starts[chosen] == min(starts.values())
    assert chosen == min(starts, key=starts.get)  # the first of the fastest
    assert starts["concurrent"] < starts["auto"] or starts["concurrent-chains"] < starts["auto"]
    assert env.prepared.start.result.value == starts[chosen]
    # place mode keeps auto's groups (the policy's training distribution)
    assert PlacementEnv([task], mode="place", max_nodes=48)._prepare(task).grouping.method == "auto"
