"""Interleaved 1F1B (Narayanan et al., SC'21, Sec. 2.2) as Megatron-LM runs it: the program order of
each pipeline rank, the bubble's closed form (p - 1) / (v m) with free communication, the in-flight
window that bounds the activation memory, and interleaving paying off across hosts."""

from __future__ import annotations

import re

import numpy as np
import pytest

from envs.examples import transformer_graph
from envs.plan import megatron_plan
from envs.presets import preset
from envs.sim import simulate
from envs.sim.cost import KIND_COMPUTE, KIND_OPT, interleaved_in_flight
from envs.sim.reference import _Step, simulate_reference
from envs.topology import Device, Link, Topology


def free_topology(n: int) -> Topology:
    """``n`` GPUs whose communication costs nothing (no latency, unbounded bandwidth, no host time)."""
    devs = [Device(f"gpu{i}", "gpu", {"bf16": 312e12}, 80e9, 2e12) for i in range(n)]
    return Topology(devs, [Link(d.name, "sw", 1e30, 0.0) for d in devs], ["sw"], name=f"free{n}")


def megatron_program(p: int, v: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """Rank ``rank``'s (F/B, local chunk, microbatch) sequence, transcribed from Megatron-LM's
    forward_backward_pipelining_with_interleaving (megatron/core/pipeline_parallel/schedules.py:
    get_schedule_table with microbatch groups of p, get_pp_rank_microbatches' warm-up count, the
    backward visiting the chunks in reverse)."""
    table = [(k, c) for g in range(0, m, p) for c in range(v) for k in range(g, g + p)]
    total = m * v
    warm = min((p - rank - 1) * 2 + (v - 1) * p, total)
    fwd = [("F", c, k) for k, c in table]
    bwd = [("B", v - 1 - c, k) for k, c in table]
    out = fwd[:warm]
    for i in range(total - warm):
        out += [fwd[warm + i], bwd[i]]
    return out + bwd[total - warm:]


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (4, 2, 8), (4, 3, 4), (3, 2, 9), (2, 4, 2)])
def test_priorities_are_megatrons_program_order(p, v, m):
    g = transformer_graph(layers=p * v, hidden=256, heads=4, seq=64, vocab=500, batch=m, embeddings=False)
    topo = free_topology(p)
    plan = megatron_plan(g, topo, pp=p, microbatch_size=1, global_batch=m, virtual_stages=v)
    s = _Step(g, topo, plan, "step_time")
    chunk = plan.chunks(g)[0]
    first = {}
    for u in g.topological_order().tolist():
        first.setdefault(int(chunk[u]), u)
    for r in range(p):
        ops = []
        for c in range(v):
            u = first[c * p + r]
            for k in range(m):
                ops += [(s.prio(u, k, False), ("F", c, k)), (s.prio(u, k, True), ("B", c, k))]
        assert [op for _, op in sorted(ops)] == megatron_program(p, v, m, r)


@pytest.mark.parametrize("p, m, layers", [(2, 4, 8), (4, 8, 16), (4, 16, 16), (8, 16, 24)])
def test_bubble_is_p_minus_1_over_v_m_with_free_communication(p, m, layers):
    """Step = work x (1 + (p - 1) / (v m)) + the optimizer (Narayanan et al., SC'21, Sec. 2.2), and
    interleaving is never slower than one chunk per rank."""
    g = transformer_graph(layers=layers, hidden=1024, heads=16, seq=512, vocab=1000, batch=m, embeddings=False)
    topo = free_topology(p)
    steps = {}
    for v in (1, 2, 3, 4):
        if layers % (p * v):
            continue
        rep = simulate(g, topo, megatron_plan(g, topo, pp=p, microbatch_size=1, global_batch=m, virtual_stages=v))
        assert rep.comm_time.max() < 1e-12
        steps[v] = rep.value
        if v == 1:
            continue
        opt = max(float(rep.task_finish[t] - rep.task_start[t]) for t in np.flatnonzero(rep.task_kind == KIND_OPT))
        work = float(rep.compute_time.max()) - opt
        assert rep.value == pytest.approx(work * (1 + (p - 1) / (v * m)) + opt, rel=0.01)
    assert len(steps) >= 2 and all(steps[v] <= steps[1] for v in steps)
    assert all(steps[b] <= steps[a] * (1 + 1e-9) for a, b in zip(sorted(steps), sorted(steps)[1:]))


def test_chunk_microbatches_in_flight_stay_within_megatrons_window():
    """At most (p - r - 1) x 2 + (v - 1) x p + 1 chunk-microbatches have run their forward and not yet
    finished their backward on rank r (the activations memory() counts), and rank 0 reaches it."""
    p, v, m = 4, 2, 8
    g = transformer_graph(layers=p * v, hidden=512, heads=8, seq=256, vocab=500, batch=m, embeddings=False)
    topo = free_topology(p)
    plan = megatron_plan(g, topo, pp=p, microbatch_size=1, global_batch=m, virtual_stages=v)
    rep = simulate_reference(g, topo, plan)
    chunk = plan.chunks(g)[0]
    first = {}
    for u in g.topological_order().tolist():
        first.setdefault(int(chunk[u]), g.names[u])
    start, finish = {}, {}
    for t in np.flatnonzero(rep.task_kind == KIND_COMPUTE):
        hit = re.fullmatch(r"([FB]) (\S+) mb(\d+)", rep.task_label[t])
        if hit:
            key = (hit[1], hit[2], int(hit[3]))
            start[key], finish[key] = float(rep.task_start[t]), float(rep.task_finish[t])
    for r in range(p):
        spans = [(start[("F", first[c * p + r], k)], finish[("B", first[c * p + r], k)])
                 for c in range(v) for k in range(m)]
        peak = max(sum(a <= t < b for a, b in spans) for t, _ in spans)
        window = (p - r - 1) * 2 + (v - 1) * p + 1
        assert peak <= window
        assert sum(interleaved_in_flight(p, v, r, c, m) for c in range(v)) == min(window, m * v)
        if r == 0:
            assert peak == window


def test_interleaving_shortens_a_multi_host_pipeline():
    """Tensor parallelism inside each host, the pipeline across 4 hosts: the smaller bubble is worth
    v times the stage crossings (Korthikanti et al. 2022 ran 175B and 530B with 3 virtual stages)."""
    g = transformer_graph(layers=24, hidden=4096, heads=32, seq=2048, vocab=8000, batch=8)
    topo = preset("a100-80g-cluster:nodes=4")
    t = {v: simulate(g, topo, megatron_plan(g, topo, tp=8, pp=4, microbatch_size=1, global_batch=8,
                                            virtual_stages=v), timeline=False).value for v in (1, 2, 3)}
    assert t[3] < t[2] < t[1]


def test_moves_keep_interleaving_while_the_chunks_visit_the_ranks_in_turn():
    """A search move inside a chunk, or at a chunk's edge onto its neighbour's devices, keeps the
    interleaved schedule; one that breaks the chunks falls back to 1F1B (envs.plan.interleaved_where_valid,
    used by the environment, the guided search's moves and MCMC's)."""
    from envs.plan import interleaved_where_valid

    topo = preset("dgx-a100-80g")
    g = transformer_graph(layers=8, hidden=256, heads=4, seq=64, vocab=100, batch=8)
    plan = megatron_plan(g, topo, pp=2, dp=2, virtual_stages=2, microbatch_size=1, global_batch=8)
    chunk, _ = plan.chunks(g)
    order = g.topological_order()
    c0 = [int(v) for v in order if chunk[v] == 0]
    inside, edge = c0[len(c0) // 2], c0[-1]
    rank1 = plan.groups[int(next(v for v in order if chunk[v] == 1))]

    def moved(v, group):
        groups = list(plan.groups)
        groups[v] = group
        return plan.copy(groups=groups, virtual_stages=1)

    assert interleaved_where_valid(moved(edge, rank1), g, 2).virtual_stages == 2  # the boundary moves
    assert interleaved_where_valid(moved(inside, rank1), g, 2).virtual_stages == 1  # chunk 0 split in three
    assert interleaved_where_valid(plan.copy(microbatches=4), g, 2).virtual_stages == 2
    assert interleaved_where_valid(plan.copy(microbatches=1, global_batch=8), g, 2).virtual_stages == 1


def test_mcmc_placement_moves_keep_a_valid_interleaving():
    """MCMC's proposals from an interleaved plan: every one interleaves only where its chunks allow it, and
    some that move operators keep the interleaving (the chunks' edges move)."""
    from agent.placers.search import PlanSpace, _propose

    topo = preset("dgx-a100-80g")
    g = transformer_graph(layers=8, hidden=256, heads=4, seq=64, vocab=100, batch=8)
    plan = megatron_plan(g, topo, pp=2, dp=2, virtual_stages=2, microbatch_size=1, global_batch=8)
    space, rng = PlanSpace(g, topo, 8), np.random.default_rng(0)
    kept = 0
    for _ in range(300):
        cand = _propose(space, plan, rng)
        if cand is None:
            continue
        cand._validate_virtual_stages(g)
        kept += cand.virtual_stages == 2 and cand.groups != plan.groups
    assert kept > 0
