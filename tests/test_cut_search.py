"""Moving a pipeline start's stage boundaries (envs.placement.cut_search, task_setup.with_moved_cuts)."""

from __future__ import annotations

import numpy as np
import pytest

from envs.evaluator import EvalResult
from envs.examples import transformer_graph
from envs.placement import task_setup
from envs.placement.cut_search import cut_positions, moved_cuts, stages_from_cuts
from envs.placement.env import PlacementEnv
from envs.plan import contiguous_stages, stage_cuts
from envs.presets import preset
from envs.tasks import Task


def test_moved_cuts_move_one_boundary_to_the_next_layer_either_way():
    g = transformer_graph(layers=6, hidden=64, heads=2, seq=16, vocab=100, batch=4)
    stage = contiguous_stages(g, 3)
    cuts = cut_positions(g, stage)
    assert np.array_equal(stages_from_cuts(g, cuts), stage)
    places = stage_cuts(g, 3).tolist()
    moved = moved_cuts(g, stage)
    assert len(moved) == 4  # two inner boundaries, each one layer earlier and one later
    order = g.topological_order()
    for m in moved:
        assert (np.diff(m[order]) >= 0).all() and set(m.tolist()) == {0, 1, 2}
        new = cut_positions(g, m)
        changed = np.flatnonzero(new != cuts)
        assert changed.size == 1
        i = int(changed[0])
        assert abs(places.index(int(new[i])) - places.index(int(cuts[i]))) == 1
    assert moved_cuts(g, np.zeros(g.num_nodes, dtype=np.int64)) == []


class FavoursAStageSize:
    """Step time = how far the first device's share of the operators is from ``share`` (+1 s)."""

    def __init__(self, share: float):
        self.share = share

    def evaluate(self, graph, topology, plan, objective="step_time"):
        first = np.mean([tuple(grp) == (0,) for grp in plan.groups])
        n = topology.num_devices
        return EvalResult(1.0 + abs(first - self.share), np.zeros(n), np.ones(n), False)


def _pipeline_start(share: float):
    g = transformer_graph(layers=8, hidden=128, heads=4, seq=32, vocab=200, batch=8)
    env = PlacementEnv([Task(g, preset("pcie-4gpu"))], mode="refine", max_nodes=64, max_devices=4,
                       evaluator=FavoursAStageSize(share), microbatch_choices=(1, 2))
    return env


def test_refine_start_moves_a_pipeline_cut_while_the_simulator_says_it_helps(monkeypatch):
    """A pipeline start whose balanced cut is not the fastest is hill-climbed one boundary place at a time
    (at most CUT_SEARCH_EVALUATIONS simulations) and never ends worse than it began; where the cut is
    already the best, the start is kept as it was."""
    real = task_setup.start_assignments
    monkeypatch.setattr(task_setup, "start_assignments",
                        lambda prep: {k: v for k, v in real(prep).items() if k == "pipeline 2 stages"})
    env = _pipeline_start(share=0.3)  # the balanced cut gives device 0 about half of the operators
    env.reset(seed=0)
    prep = env.prepared
    staged = prep.staged["pipeline 2 stages"]
    before = FavoursAStageSize(0.3).evaluate(None, prep.task.topology,
                                             prep.plan(staged.build(staged.stage), 1, "1f1b", 1, "t"))
    start = prep.start
    assert start.name == "pipeline 2 stages (cuts moved)"
    assert start.result.value < before.value
    first = prep.plan(start.assign, 1, "1f1b", 1, "t")
    assert np.mean([tuple(grp) == (0,) for grp in first.groups]) < 0.5

    balanced = prep.plan(staged.build(staged.stage), 1, "1f1b", 1, "t")
    env = _pipeline_start(share=float(np.mean([tuple(grp) == (0,) for grp in balanced.groups])))
    env.reset(seed=0)
    assert env.prepared.start.name == "pipeline 2 stages"


def test_graph_partition_starts_put_each_metis_part_on_its_own_fast_device():
    """The METIS starts: k = 2, 4, ... parts of the groups, each part on one device alone (the fastest
    first), the work shared by speed; the same partitions every time (METIS is seeded)."""
    from envs.placement.options import N_MODIFIERS
    from envs.placement.task_setup import graph_partition_assignments
    from envs.tasks import default_tasks

    t = default_tasks(names=["branching-cnn"])[0]
    env = PlacementEnv([Task(t.graph, preset("hetero"), batch=t.batch)], mode="refine", max_nodes=40, max_devices=8)
    env.reset(seed=0)
    prep = env.prepared
    starts = graph_partition_assignments(prep)
    assert starts and all(name.startswith("graph partition ") for name in starts)
    for name, assign in starts.items():
        k = int(name.split()[2])
        rows = assign // N_MODIFIERS
        assert (assign % N_MODIFIERS == 0).all() and (prep.options.devices[rows].sum(axis=1) == 1).all()
        assert np.unique(np.argmax(prep.options.devices[rows], axis=1)).size == k
    again = graph_partition_assignments(prep)
    assert all(np.array_equal(starts[k], again[k]) for k in starts)


class FavoursAStageSizeOrOneDevice(FavoursAStageSize):
    """As FavoursAStageSize for plans on two devices; ``single`` seconds for a plan on one device."""

    def __init__(self, share: float, single: float):
        super().__init__(share)
        self.single = single

    def evaluate(self, graph, topology, plan, objective="step_time"):
        if len({tuple(grp) for grp in plan.groups}) == 1:
            n = topology.num_devices
            return EvalResult(self.single, np.zeros(n), np.ones(n), False)
        return super().evaluate(graph, topology, plan, objective)


def test_a_pipeline_start_near_the_best_start_has_its_cuts_moved_and_can_overtake_it(monkeypatch):
    """The best pipeline start, when it did not win but came within NEAR_BEST_MARGIN of the start that
    did, is hill-climbed too and becomes the start if it then beats it (a 2-stage data-parallel pipeline
    of a gated-convolution LM on two 8-A100 nodes: 45.9 ms balanced, 42.3 ms with its cut moved, vs data
    parallelism on one node's 43.8 ms); outside the margin it is left alone."""
    real = task_setup.start_assignments
    monkeypatch.setattr(task_setup, "start_assignments", lambda prep: {
        k: v for k, v in real(prep).items() if k in ("pipeline 2 stages", "single_device")})
    g = transformer_graph(layers=8, hidden=128, heads=4, seq=32, vocab=200, batch=8)

    def start(single: float):
        env = PlacementEnv([Task(g, preset("pcie-4gpu"))], mode="refine", max_nodes=64, max_devices=4,
                           evaluator=FavoursAStageSizeOrOneDevice(0.3, single), microbatch_choices=(1, 2))
        env.reset(seed=0)
        prep = env.prepared
        balanced = prep.plan(prep.staged["pipeline 2 stages"].build(prep.staged["pipeline 2 stages"].stage),
                             1, "1f1b", 1, "t")
        return prep.start, FavoursAStageSize(0.3).evaluate(None, prep.task.topology, balanced).value

    s, balanced = start(single=1.15)
    assert balanced > 1.15 and balanced <= 1.15 * (1 + task_setup.NEAR_BEST_MARGIN)
    assert s.name == "pipeline 2 stages (cuts moved)" and s.result.value < 1.15
    s, balanced = start(single=balanced / (1 + task_setup.NEAR_BEST_MARGIN) - 1e-6)  # just outside the margin
    assert s.name == "single_device"


def test_a_pipeline_start_near_the_best_is_tried_with_gpipe_at_every_count(monkeypatch):
    """The start tries GPipe only at a pipeline's best 1F1B count; a pipeline near the best start is then
    tried with GPipe at every count its placements allow (a GPT on three single-H100 hosts: 9.33 ms with
    GPipe at 4 microbatches, 11.2 ms at the best 1F1B count)."""
    real = task_setup.start_assignments
    monkeypatch.setattr(task_setup, "start_assignments",
                        lambda prep: {k: v for k, v in real(prep).items() if k == "pipeline 2 stages"})

    class GPipeAtFour:
        times = {("1f1b", 1): 2.0, ("1f1b", 2): 1.8, ("1f1b", 4): 1.9, ("gpipe", 4): 1.0}

        def evaluate(self, graph, topology, plan, objective="step_time"):
            n = topology.num_devices
            return EvalResult(self.times.get((plan.schedule, plan.microbatches), 3.0), np.zeros(n), np.ones(n), False)

    g = transformer_graph(layers=4, hidden=128, heads=4, seq=32, vocab=200, batch=8)
    env = PlacementEnv([Task(g, preset("pcie-4gpu"))], mode="refine", max_nodes=64, max_devices=4,
                       evaluator=GPipeAtFour(), microbatch_choices=(1, 2, 4))
    env.reset(seed=0)
    start, prep = env.prepared.start, env.prepared
    assert start.result.value == 1.0 and int(prep.mb_counts[start.mb_idx]) == 4
    assert task_setup.SCHEDULES[start.schedule] == "gpipe"


def test_megatron_starts_take_the_operators_layouts_on_layout_pure_groups():
    """On groups that never mix Megatron layouts (``coarsen``'s ``auto``), the Megatron starts give every
    operator the layout Megatron-LM gives it (``group_megatron_layouts``: each group its operators' most
    common layout), and on a U-Net its tensor x data plan is as fast as Megatron-LM's."""
    from envs.plan import megatron_layouts, megatron_plan
    from envs.sim import simulate
    from profilers.spec import graph_from_spec

    g = graph_from_spec("diffusion:img=32,width=32,levels=3,blocks=1,attn=1,batch=8")
    topo = preset("dgx-a100-80g")
    env = PlacementEnv([Task(g, topo)], mode="refine", max_nodes=64, max_devices=8)
    env.reset(seed=0)
    p = env._p
    assert p.grouping.info.get("layout_pure")
    per_group = task_setup.group_megatron_layouts(p)
    assert [per_group[v] for v in p.grouping.group_of.tolist()] == megatron_layouts(g)
    starts = task_setup.megatron_assignments(p)
    name = "megatron tp2 dp4"
    plan = p.plan(starts[name], 1, "1f1b", 1, name)
    reference = megatron_plan(g, topo, tp=2, dp=4)
    assert plan.layouts == reference.layouts
    assert simulate(g, topo, plan).value <= simulate(g, topo, reference).value * 1.001


def test_refine_start_interleaves_a_pipeline_as_megatron_does():
    """Llama-7B (batch 8) on 4 PCIe A100s: the best start is 4 single-GPU stages interleaved 4 ways at 8
    microbatches (GPipe's 4 stages: 1.085 s; megatron_3d's pp4 x v4 plan: 0.891 s); the episode starts
    there with its virtual stages, and a move that breaks the chunks evaluates without interleaving."""
    from envs.placement.env import PlacementEnv
    from envs.placement.observation import VIRTUAL_STAGE_CHOICES
    from envs.presets import preset
    from envs.tasks import Task
    from profilers.spec import graph_from_spec

    g = graph_from_spec("llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=11008,vocab=32000,seq=2048,batch=8")
    env = PlacementEnv([Task(g, preset("pcie-4gpu"))], mode="refine", max_nodes=128)
    env.reset(seed=0)
    start = env.prepared.start
    assert "interleaved x" in start.name and VIRTUAL_STAGE_CHOICES[start.vs] > 1
    assert start.result.value < 0.95 and not start.result.oom
    plan = env._current_plan()
    assert plan.virtual_stages == VIRTUAL_STAGE_CHOICES[start.vs] and plan.microbatches % 4 == 0
    moved = env._assign.copy()
    moved[: moved.size // 2] = moved[0]  # the first half of the groups on the first stage: no longer chunked
    assert env._plan_for(moved, env._globals()).virtual_stages == 1


def test_groups_that_mix_column_and_row_splits_run_megatrons_layouts():
    """A 24-layer GPT in 64 groups: most groups hold a linear Megatron-LM splits by columns and one it
    splits by rows (``envs.coarsen.tensor_parallel_blocks``). Such a group may still be tensor parallel: a
    column split gives each operator its Megatron-LM layout, a row split the same with sequence
    parallelism; so the Megatron starts are Megatron-LM's plans exactly, and the search's moves keep them."""
    from envs.coarsen import tensor_parallel_blocks
    from envs.graph import CAN_COL, CAN_ROW
    from envs.plan import megatron_plan
    from envs.sim import simulate

    g = transformer_graph(layers=24, hidden=256, heads=4, seq=64, vocab=500, batch=8)
    topo = preset("dgx-a100-80g")
    env = PlacementEnv([Task(g, topo)], mode="refine", max_nodes=64, max_devices=8)
    env.reset(seed=0)
    p = env._p
    mixed = tensor_parallel_blocks(g, p.grouping.group_of, p.grouping.num_groups)
    assert mixed.sum() > p.grouping.num_groups // 2
    assert ((p.graph.layout_caps[mixed] & (CAN_COL | CAN_ROW)) == CAN_COL | CAN_ROW).all()
    starts = task_setup.megatron_assignments(p)
    for name, sp in (("megatron tp2 dp4", False), ("megatron tp2 dp4 sp", True)):
        plan = p.plan(starts[name], 1, "1f1b", 1, name)
        reference = megatron_plan(g, topo, tp=2, dp=4, sequence_parallel=sp)
        assert plan.layouts == reference.layouts
        assert simulate(g, topo, plan).value == pytest.approx(simulate(g, topo, reference).value, rel=1e-9)
        assert (task_setup.express(p, reference) == starts[name]).all()  # and back
        # a move of a mixed group to its own placement again changes nothing
        v = int(np.flatnonzero(mixed)[0])
        assert p.apply_action(plan, [v], int(starts[name][v])).layouts == plan.layouts
