"""The lower bound never exceeds a simulated result (random graphs, random valid plans, all objectives)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.lower_bound import lower_bound
from agent.placers import run_placer
from agent.placers.common import Budget, check_restrictions
from agent.placers.search import PlanSpace, random_plan
from envs.errors import PlanError
from envs.examples import transformer_graph
from envs.graph import CAN_BATCH, CAN_COL, CAN_ROW, OpGraph
from envs.presets import preset
from envs.sim import simulate
from envs.topology import Device, Link, Topology


def small_topology(kind: int) -> Topology:
    if kind == 0:
        return preset("pcie-4gpu")
    if kind == 1:
        return preset("hetero")
    # two unequal devices with little memory (OOM plans are common)
    devs = [Device("fast", "f", {"bf16": 200e12}, 2e9, 2e12, launch_overhead=2e-6),
            Device("slow", "s", {"bf16": 50e12}, 1e9, 5e11, launch_overhead=5e-6)]
    return Topology(devs, [Link("fast", "slow", bandwidth=20e9, latency=2e-6)], name="pair")


@st.composite
def graphs(draw) -> OpGraph:
    n = draw(st.integers(2, 7))
    edges = [(i, j) for j in range(1, n) for i in range(j) if draw(st.booleans())]
    if not edges:
        edges = [(0, 1)]
    fl = [draw(st.floats(1e8, 5e12)) for _ in range(n)]
    pb = [draw(st.sampled_from([0.0, 1e6, 5e7, 2e8])) for _ in range(n)]
    ob = [draw(st.floats(1e4, 5e8)) for _ in range(n)]
    caps = [draw(st.sampled_from([0, CAN_BATCH, CAN_BATCH | CAN_COL, CAN_BATCH | CAN_COL | CAN_ROW])) for _ in range(n)]
    batch = draw(st.sampled_from([1, 2, 4, 8]))
    return OpGraph(names=[f"n{i}" for i in range(n)], kinds=["linear"] * n, fwd_flops=fl, param_bytes=pb,
                   out_bytes=ob, edge_src=[a for a, _ in edges], edge_dst=[b for _, b in edges],
                   edge_bytes=[ob[a] for a, _ in edges], layout_caps=caps, batch_size=batch,
                   module_paths=[f"layers.{i // 2}" for i in range(n)])


@settings(max_examples=70, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(g=graphs(), topo_kind=st.integers(0, 2), seed=st.integers(0, 10**6),
       objective=st.sampled_from(["step_time", "throughput", "latency"]))
def test_lower_bound_never_exceeds_the_simulator(g, topo_kind, seed, objective):
    topo = small_topology(topo_kind)
    lb = lower_bound(g, topo, objective)
    space = PlanSpace(g, topo)
    rng = np.random.default_rng(seed)
    checked = 0
    for _ in range(12):
        plan = random_plan(space, rng)
        try:
            plan.validate(g, topo)
            check_restrictions(g, topo, plan)
        except PlanError:
            continue
        rep = simulate(g, topo, plan, objective, timeline=False)
        value = rep.value
        assert lb["lower_bound_any"] <= value * (1 + 1e-9)
        if not rep.is_oom:
            assert lb["lower_bound"] <= value * (1 + 1e-9)
        checked += 1
        if checked >= 3:
            break


def test_lower_bound_below_placers_and_components():
    g = transformer_graph(layers=2, hidden=512, seq=256, batch=8)
    topo = preset("dgx-a100-80g")
    lb = lower_bound(g, topo)
    assert lb["lower_bound"] >= max(lb["critical_path"], lb["aggregate"]) > 0
    assert lb["aggregate"] >= lb["work_over_throughput"] * (1 - 1e-6)
    for name in ("single_device", "data_parallel", "megatron_3d", "pipedream"):
        p = run_placer(name, g, topo, budget=Budget(evaluations=20))
        assert p.provenance["predicted_step_time"] >= lb["lower_bound"]


def test_memory_forced_bound():
    """When one device cannot hold the model states, the memory-aware bound rises above the plain one."""
    devs = [Device("big", "f", {"bf16": 400e12}, 3e9, 2e12), Device("small", "s", {"bf16": 10e12}, 64e9, 5e11)]
    topo = Topology(devs, [Link("big", "small", bandwidth=20e9)], name="pair")
    g = transformer_graph(layers=2, hidden=1024, seq=128, batch=2, embeddings=False)  # ~25M params: 0.4 GB states
    lb_free = lower_bound(g, topo, state_bytes_per_param=16.0)
    g_big = transformer_graph(layers=4, hidden=2048, seq=128, batch=2, embeddings=False)  # ~200M: 3.2 GB
    lb = lower_bound(g_big, topo)
    assert lb_free["memory_feasible"] and lb["memory_feasible"]
    assert lb["aggregate_memory"] > lb["aggregate"]
    assert lb["lower_bound"] >= lb["lower_bound_any"]


def test_unknown_objective():
    with pytest.raises(Exception, match="objective"):
        lower_bound(transformer_graph(layers=1, hidden=64, seq=16, batch=1), preset("pcie-4gpu"), "fast")
