"""Coarsening: sums preserved, DAG kept, module boundaries, co-location, plan expansion, 100k ops."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest

from envs.coarsen import METHODS, Grouping, _label_runs, _module_levels, coarse_graph, coarsen
from envs.errors import GraphError, PlanError
from envs.graph import CAN_BATCH, CAN_COL, CAN_ROW, OpGraph, chain_graph
from envs.plan import Plan, megatron_layouts
from envs.presets import dgx_a100_80g
from experiments.bench_coarsen import layered_graph, training_graph

SUMMED = ("fwd_flops", "bwd_flops", "param_bytes", "out_bytes", "mem_bytes")


def _layer_of(graph: OpGraph) -> np.ndarray:
    return np.array([int(p.split(".")[1]) if p.startswith("layers.") else -1 for p in graph.module_paths])


def _random_dag(rng: np.random.Generator, n: int, p: float) -> OpGraph:
    src, dst = [], []
    for i in range(n):
        for j in range(i + 1, n):
            if rng.random() < p:
                src.append(i)
                dst.append(j)
    perm = rng.permutation(n)  # ids no longer in topological order
    mods = [".".join(f"m{rng.integers(0, 3)}" for _ in range(rng.integers(0, 4))) for _ in range(n)]
    return OpGraph(names=[f"o{i}" for i in range(n)], kinds=["linear"] * n,
                   fwd_flops=rng.random(n) * (rng.random(n) < 0.8), param_bytes=rng.random(n),
                   out_bytes=rng.random(n), edge_src=perm[src], edge_dst=perm[dst],
                   edge_bytes=rng.random(len(src)), edge_time=rng.random(len(src)), module_paths=mods,
                   colocation=np.where(rng.random(n) < 0.2, rng.integers(0, 4, n), -1),
                   measured={"gpu": {"fwd": rng.random(n), "bwd": rng.random(n)}})


def _assert_valid(fine: OpGraph, coarse: OpGraph, grouping: Grouping, max_nodes: int) -> None:
    assert coarse.num_nodes <= max_nodes
    assert grouping.num_groups == coarse.num_nodes
    assert grouping.group_of.shape == (fine.num_nodes,)
    assert np.array_equal(np.unique(grouping.group_of), np.arange(coarse.num_nodes))
    for attr in SUMMED:
        assert np.isclose(getattr(coarse, attr).sum(), getattr(fine, attr).sum()), attr
    assert coarse.n_ops.sum() == fine.n_ops.sum()
    for kind, ph in fine.measured.items():
        for p in ("fwd", "bwd"):
            assert np.isclose(coarse.measured[kind][p].sum(), ph[p].sum())
    again = OpGraph.from_dict(coarse.to_dict())  # full validation again, incl. the DAG check
    assert nx.is_directed_acyclic_graph(again.to_networkx())
    assert len(set(coarse.names)) == coarse.num_nodes
    # group ids follow a topological order of the coarse graph
    assert np.all(coarse.edge_src < coarse.edge_dst)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("max_nodes", [1, 2, 7, 40, 150])
def test_sums_dag_and_limit_on_layered_graph(method, max_nodes):
    g = layered_graph(12, 30)
    coarse, grouping = coarsen(g, max_nodes, method)
    _assert_valid(g, coarse, grouping, max_nodes)


def test_random_dags_stay_acyclic_and_keep_colocation():
    rng = np.random.default_rng(0)
    for _ in range(60):
        g = _random_dag(rng, int(rng.integers(2, 40)), float(rng.uniform(0.05, 0.4)))
        for method in METHODS:
            k = int(rng.integers(1, g.num_nodes + 2))
            coarse, grouping = coarsen(g, k, method)
            _assert_valid(g, coarse, grouping, k)
            for c in set(g.colocation.tolist()) - {-1}:
                ids = {int(coarse.colocation[x]) for x in grouping.group_of[g.colocation == c]}
                assert len(ids) == 1 and -1 not in ids


def test_light_merge_avoids_the_cycle():
    # a -> b -> c and a -> c: merging a with c (the lightest producer of the lightest op) would put b
    # on a cycle; the merger must take b instead.
    g = OpGraph(names=["a", "b", "c"], kinds=["add"] * 3, fwd_flops=[1.0, 100.0, 0.5], param_bytes=[0, 0, 0],
                out_bytes=[1, 1, 1], edge_src=[0, 1, 0], edge_dst=[1, 2, 2], edge_bytes=[1, 1, 1])
    coarse, grouping = coarsen(g, 2, "light")
    assert coarse.num_nodes == 2
    a, b, c = grouping.group_of.tolist()
    assert a != c and b == c


def test_module_grouping_splits_a_module_that_cannot_be_contiguous():
    # a, c, d in module "m", b in "n": one group for "m" would form a cycle through b
    g = OpGraph(names=["a", "b", "c", "d"], kinds=["add"] * 4, fwd_flops=np.ones(4), param_bytes=np.zeros(4),
                out_bytes=np.ones(4), edge_src=[0, 1, 2], edge_dst=[1, 2, 3], edge_bytes=[1, 1, 1],
                module_paths=["m.x", "n.y", "m.z", "m.w"])
    coarse, grouping = coarsen(g, 2, "module")
    assert coarse.num_nodes == 1  # depth 1 needs 3 runs > 2; depth 0 is one group
    coarse, grouping = coarsen(g, 3, "module")
    a, b, c, d = grouping.group_of.tolist()
    assert grouping.level == 1 and len({a, b, c}) == 3 and c == d
    assert coarse.names == ["a", "b", "m"]  # single ops keep their names; else the common prefix


def test_cyclic_grouping_is_rejected():
    g = chain_graph(3)
    with pytest.raises(GraphError, match="DAG"):
        coarse_graph(g, np.array([0, 1, 0]))


def test_tied_embedding_module_is_split_but_colocated():
    g = layered_graph(6, 20, tied=True)
    emb, head = g.index("embed"), g.index("head")
    for method in METHODS:
        coarse, grouping = coarsen(g, 10, method)
        _assert_valid(g, coarse, grouping, 10)
        ge, gh = grouping.group_of[emb], grouping.group_of[head]
        assert ge == gh or coarse.colocation[ge] == coarse.colocation[gh] >= 0
        # a plan honouring the coarse co-location expands to one honouring the fine one
        topo = dgx_a100_80g()
        dev = {}
        groups = []
        for i in range(coarse.num_nodes):
            c = int(coarse.colocation[i])
            groups.append((dev.setdefault(c, i % 8),) if c >= 0 else (i % 8,))
        plan = Plan(groups=groups, layouts=["single"] * coarse.num_nodes)
        plan.validate(coarse, topo)
        grouping.expand(plan).validate(g, topo)


def test_module_boundaries_kept_on_layered_graph():
    g = layered_graph(40, 25)
    layer = _layer_of(g)
    for method, k in (("module", 60), ("auto", 20), ("partition", 20)):
        coarse, grouping = coarsen(g, k, method)
        _assert_valid(g, coarse, grouping, k)
        for li in range(40):  # no layer is cut
            assert len(set(grouping.group_of[layer == li].tolist())) == 1, (method, li)
    coarse, grouping = coarsen(g, 60, "module")
    assert grouping.level == 2
    for gi in range(coarse.num_nodes):  # and at depth 2 no group spans two layers
        assert len(set(layer[grouping.group_of == gi].tolist())) == 1
    assert "layers.7" in coarse.names


def test_auto_balances_layers():
    g = layered_graph(200, 20)
    coarse, grouping = coarsen(g, 64, "auto")
    layer = _layer_of(g)
    per_group = [len(set(layer[grouping.group_of == i].tolist()) - {-1}) for i in range(coarse.num_nodes)]
    assert coarse.num_nodes <= 64 and max(per_group) <= 8  # no group snowballs


@pytest.mark.parametrize("method", ["auto", "light"])
def test_forward_backward_classes_do_not_chain(method):
    # forward op i and its backward twin share a class; a naive union of classes over merged groups
    # ties every class together and forces the whole model onto one device
    g = training_graph(2000)
    coarse, grouping = coarsen(g, 64, method)
    _assert_valid(g, coarse, grouping, 64)
    ids, count = np.unique(coarse.colocation[coarse.colocation >= 0], return_counts=True)
    assert ids.size >= 16 and count.max() <= 4
    w = coarse.fwd_flops
    assert w.max() / w.sum() < 4 / 64


def test_expand_and_project_round_trip():
    g = layered_graph(8, 20)
    topo = dgx_a100_80g()
    coarse, grouping = coarsen(g, 12, "auto")
    n = coarse.num_nodes
    layouts = ["batch_split" if coarse.layout_caps[i] & CAN_BATCH and i % 3 == 0 else "single" for i in range(n)]
    groups = [(0, 1) if lay == "batch_split" else (i % 8,) for i, lay in enumerate(layouts)]
    plan = Plan(groups=groups, layouts=layouts, recompute=np.arange(n) % 2 == 0, microbatches=4,
                schedule="gpipe", global_batch=16, provenance={"placer": "test"})
    plan.validate(coarse, topo)
    fine = grouping.expand(plan)
    assert fine.num_nodes == g.num_nodes
    fine.validate(g, topo)
    for op, gi in enumerate(grouping.group_of.tolist()):
        assert fine.groups[op] == plan.groups[gi] and fine.layouts[op] == plan.layouts[gi]
        assert fine.dp[op] == plan.dp[gi] and fine.recompute[op] == plan.recompute[gi]
    assert (fine.microbatches, fine.schedule, fine.global_batch) == (4, "gpipe", 16)
    back = grouping.project(fine)
    assert back.groups == plan.groups and back.layouts == plan.layouts
    assert np.array_equal(back.dp, plan.dp) and np.array_equal(back.recompute, plan.recompute)
    assert grouping.restrict(fine).groups == plan.groups
    with pytest.raises(PlanError):
        grouping.expand(fine)
    with pytest.raises(PlanError):
        grouping.project(plan)
    again = Grouping.from_dict(grouping.to_dict())
    assert np.array_equal(again.group_of, grouping.group_of) and again.num_groups == grouping.num_groups


def test_project_takes_the_majority():
    g = chain_graph(4)
    grouping = Grouping(group_of=np.array([0, 0, 0, 1]), num_groups=2)
    plan = Plan(groups=[(1,), (2,), (2,), (3,)], layouts=["single"] * 4)
    assert grouping.project(plan).groups == [(2,), (3,)]
    plan = Plan(groups=[(1,), (2,), (3,), (3,)], layouts=["single"] * 4)
    assert grouping.project(plan).groups[0] == (1,)  # three-way tie: the first op
    assert g.num_nodes == grouping.num_ops


def test_edges_count_each_producer_tensor_once():
    # a feeds c1 and c2 (one 10-byte tensor), b feeds c1 (5 bytes); group {c1, c2}
    g = OpGraph(names=["a", "b", "c1", "c2"], kinds=["linear", "add", "gelu", "relu"],
                fwd_flops=[1.0, 5.0, 3.0, 1.0], param_bytes=[4.0, 0, 0, 0], out_bytes=[10.0, 5.0, 1, 1],
                edge_src=[0, 0, 1], edge_dst=[2, 3, 2], edge_bytes=[10.0, 10.0, 5.0], edge_time=[2.0, 2.0, 1.0],
                layout_caps=[CAN_BATCH | CAN_COL | CAN_ROW, CAN_BATCH | CAN_COL, CAN_BATCH | CAN_COL, CAN_BATCH],
                module_paths=["x.a", "y", "z.c", "z.d"])
    coarse = coarse_graph(g, np.array([0, 1, 2, 2]))
    edges = {(int(s), int(t)): (b, tt) for s, t, b, tt in
             zip(coarse.edge_src, coarse.edge_dst, coarse.edge_bytes, coarse.edge_time)}
    assert edges == {(0, 2): (10.0, 2.0), (1, 2): (5.0, 1.0)}
    # c1 runs on a's column split as Megatron-LM shards it, c2 cannot: a group that mixes Megatron's layouts
    # may still be tensor parallel, operator by operator (envs.coarsen.tensor_parallel_blocks)
    assert coarse.layout_caps[2] == CAN_BATCH | CAN_COL | CAN_ROW
    assert coarse_graph(g, np.array([0, 1, 2, 1])).layout_caps[1] == CAN_BATCH  # b and c2 replicated: the AND
    assert coarse.kinds[2] == "gelu"  # the member with the most FLOPs
    assert coarse.names == ["a", "b", "z"]
    merged = coarse_graph(g, np.array([0, 0, 1, 1]))
    assert merged.edge_bytes.tolist() == [15.0] and merged.edge_time.tolist() == [3.0]
    assert merged.n_ops.tolist() == [2, 2]


def test_disconnected_ops_still_reach_the_limit():
    n = 50
    g = OpGraph(names=[f"o{i}" for i in range(n)], kinds=["add"] * n, fwd_flops=np.arange(n, dtype=float),
                param_bytes=np.zeros(n), out_bytes=np.ones(n), edge_src=[], edge_dst=[], edge_bytes=[])
    for method in METHODS:
        coarse, grouping = coarsen(g, 7, method)
        _assert_valid(g, coarse, grouping, 7)


def test_small_graph_is_returned_op_for_op():
    g = layered_graph(2, 20)
    coarse, grouping = coarsen(g, g.num_nodes, "auto")
    assert coarse.num_nodes == g.num_nodes
    assert sorted(coarse.names) == sorted(g.names)


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "8", None])
def test_bad_max_nodes(bad):
    with pytest.raises(GraphError):
        coarsen(chain_graph(4), bad)


def test_unknown_method():
    with pytest.raises(GraphError, match="method"):
        coarsen(chain_graph(4), 2, "metis")


def test_meta_per_op_lists_dropped_and_cpu_only_mapped():
    g = chain_graph(6)
    g.meta = {"source": "x", "cpu_only": [4], "node_ids": list(range(6))}
    coarse, grouping = coarsen(g, 2, "light")
    assert coarse.meta["source"] == "x" and "node_ids" not in coarse.meta
    assert coarse.meta["cpu_only"] == [int(grouping.group_of[4])]
    assert coarse.meta["coarsened"]["num_ops"] == 6


def test_100k_ops_to_512_groups_without_cutting_a_layer():
    """(Its speed, under a minute, is experiments/bench_coarsen.py's budget.)"""
    g = layered_graph(1000, 100)
    assert g.num_nodes >= 100_000
    coarse, grouping = coarsen(g, 512, "auto")
    assert coarse.num_nodes <= 512
    per_layer = grouping.group_of[_layer_of(g) >= 0].reshape(1000, 100)  # layers are contiguous op ranges
    assert (per_layer == per_layer[:, :1]).all()  # no layer cut


def _unet():
    from profilers.spec import graph_from_spec

    return graph_from_spec("diffusion:img=32,width=32,levels=3,blocks=1,attn=1,batch=8")


def test_auto_groups_never_mix_megatron_layouts():
    """A U-Net's module-level groups (whole ResNet blocks) would mix column-split convolutions with
    replicated norms; ``auto`` splits its module runs where Megatron's layout changes, at the deepest
    module depth that still fits, so a plan with Megatron's per-operator layouts is a plan on the groups."""
    g = _unet()
    layouts = np.array(megatron_layouts(g))
    _, by_module = coarsen(g, 64, "module")
    assert any(len(set(layouts[by_module.group_of == k].tolist())) > 1 for k in range(by_module.num_groups))
    coarse, grouping = coarsen(g, 64, "auto")
    _assert_valid(g, coarse, grouping, 64)
    assert grouping.info.get("layout_pure")
    for k in range(grouping.num_groups):
        assert len(set(layouts[grouping.group_of == k].tolist())) == 1
    deeper = grouping.level + 1
    if deeper < len(_module_levels(g)):  # the deepest depth that fits: one deeper does not
        assert _label_runs(g, _module_levels(g)[deeper] * 8 + np.unique(layouts, return_inverse=True)[1]).max() >= 64


def test_auto_mixes_layouts_only_when_no_layout_pure_grouping_fits():
    g = _unet()
    layouts = np.array(megatron_layouts(g))
    runs = int(_label_runs(g, np.unique(layouts, return_inverse=True)[1]).max()) + 1  # depth 0 split by layout
    coarse, grouping = coarsen(g, runs - 1, "auto")
    _assert_valid(g, coarse, grouping, runs - 1)
    assert not grouping.info.get("layout_pure")
    assert any(len(set(layouts[grouping.group_of == k].tolist())) > 1 for k in range(grouping.num_groups))
