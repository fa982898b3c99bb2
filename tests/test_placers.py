"""Placers: valid plans with provenance, constraints respected, known optima found, determinism."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from agent.placers import PLACERS, PlacerError, run_placer
from agent.placers.common import Budget
from envs.examples import transformer_graph
from envs.graph import OpGraph, chain_graph
from envs.presets import preset
from envs.sim import simulate
from envs.topology import Device, Link, Topology

SMALL = {"seed": 0, "budget": Budget(evaluations=12, seconds=10.0)}


def two_devices(memory: float = 80e9) -> Topology:
    devs = [Device(f"g{i}", "gpu", {"bf16": 100e12}, memory, 1e12, launch_overhead=1e-6) for i in range(2)]
    links = [Link("g0", "sw", bandwidth=10e9), Link("g1", "sw", bandwidth=10e9)]
    return Topology(devs, links, ["sw"], name="two")


@pytest.fixture(scope="module")
def tiny_gpt() -> OpGraph:
    return transformer_graph(layers=2, hidden=256, heads=4, seq=128, vocab=1000, batch=4)


def colocated_graph() -> OpGraph:
    """Forward + backward nodes with co-location classes and one CPU-only node (dnn-partitioning style)."""
    g = chain_graph(6, flops=1e10, param_bytes=1e6, act_bytes=1e5)
    col = np.array([0, 1, 2, 2, 1, 0])
    return OpGraph(names=g.names, kinds=g.kinds, fwd_flops=g.fwd_flops, param_bytes=g.param_bytes,
                   out_bytes=g.out_bytes, edge_src=g.edge_src, edge_dst=g.edge_dst, edge_bytes=g.edge_bytes,
                   colocation=col, batch_size=4, module_paths=g.module_paths, meta={"cpu_only": [3]})


PROVENANCE = {"placer", "seed", "predicted_step_time", "peak_memory", "oom", "objective"}


@pytest.mark.parametrize("name", list(PLACERS))
def test_every_placer_returns_a_valid_plan(name, tiny_gpt):
    for topo, obj in ((preset("pcie-4gpu"), "step_time"), (preset("hetero"), "throughput")):
        plan = run_placer(name, tiny_gpt, topo, objective=obj, **SMALL)
        plan.validate(tiny_gpt, topo)
        assert PROVENANCE <= set(plan.provenance)
        assert plan.provenance["placer"] == name
        rep = simulate(tiny_gpt, topo, plan, obj, timeline=False)
        assert plan.provenance["predicted_step_time"] == pytest.approx(rep.value)


@pytest.mark.parametrize("name", list(PLACERS))
def test_colocation_and_cpu_only_respected(name):
    g = colocated_graph()
    topo = preset("hetero")
    plan = run_placer(name, g, topo, **SMALL)
    plan.validate(g, topo)  # checks the co-location classes
    assert plan.groups[0] == plan.groups[5] and plan.groups[1] == plan.groups[4]
    assert all(topo.devices[d].kind == "cpu" for d in plan.groups[3])
    assert plan.groups[2] == plan.groups[3]


def test_unknown_placer_and_bad_budget(tiny_gpt):
    with pytest.raises(PlacerError):
        run_placer("nope", tiny_gpt, preset("pcie-4gpu"))
    with pytest.raises(PlacerError):
        run_placer("mcmc", tiny_gpt, preset("pcie-4gpu"), budget={"minutes": 1})
    with pytest.raises(PlacerError):
        run_placer("single_device", tiny_gpt, preset("pcie-4gpu"), objective="speed")


def test_single_device_picks_a_device_that_fits():
    g = transformer_graph(layers=24, hidden=2048, seq=512, batch=8)  # ~1.3B params: 21 GB of Adam state
    topo = preset("hetero")  # A100 80 GB fits, the T4s (16 GB) do not
    plan = run_placer("single_device", g, topo, **SMALL)
    assert not plan.provenance["oom"]
    assert topo.devices[plan.groups[0][0]].kind == "a100-80g"


def brute_force_chain() -> tuple[OpGraph, Topology, float]:
    """4 ops on 2 devices, single layouts only; one device holds only two ops' states."""
    g = chain_graph(4, flops=2e12, param_bytes=1e9, act_bytes=5e7, batch_size=1)
    g = OpGraph(names=g.names, kinds=g.kinds, fwd_flops=np.array([2e12, 1e12, 3e12, 2e12]), param_bytes=g.param_bytes,
                out_bytes=g.out_bytes, edge_src=g.edge_src, edge_dst=g.edge_dst, edge_bytes=g.edge_bytes,
                layout_caps=np.zeros(4, dtype=np.int64), batch_size=1, module_paths=g.module_paths)
    topo = two_devices(memory=2 * 8e9 + 1e9)  # 8 GB of Adam state per op: two ops per device
    from agent.placers.common import assignment_plan

    best = np.inf
    for assign in itertools.product(range(2), repeat=4):
        p = assignment_plan(g, topo, list(assign))
        r = simulate(g, topo, p, timeline=False)
        if not r.is_oom:
            best = min(best, r.value)
    return g, topo, best


def test_exact_placers_find_the_brute_force_optimum():
    g, topo, best = brute_force_chain()
    assert np.isfinite(best)
    dp = run_placer("pipedream", g, topo, seed=0)
    assert not dp.provenance["oom"]
    assert dp.provenance["predicted_step_time"] <= best * (1 + 1e-9)
    mc = run_placer("mcmc", g, topo, seed=0, budget=Budget(evaluations=60))
    assert not mc.provenance["oom"]
    assert mc.provenance["predicted_step_time"] <= best * (1 + 1e-9)


def test_mcmc_larger_budget_never_worse(tiny_gpt):
    topo = preset("pcie-4gpu")
    for seed in (0, 1):
        small = run_placer("mcmc", tiny_gpt, topo, seed=seed, budget=Budget(evaluations=15))
        large = run_placer("mcmc", tiny_gpt, topo, seed=seed, budget=Budget(evaluations=45))
        ks = (small.provenance["oom"], small.provenance["predicted_step_time"])
        kl = (large.provenance["oom"], large.provenance["predicted_step_time"])
        assert kl <= ks


@pytest.mark.parametrize("name", ["random_search", "mcmc", "metis"])
def test_deterministic_for_a_seed(name, tiny_gpt):
    topo = preset("dgx1-v100")
    a = run_placer(name, tiny_gpt, topo, seed=3, budget=Budget(evaluations=20))
    b = run_placer(name, tiny_gpt, topo, seed=3, budget=Budget(evaluations=20))
    assert a.key() == b.key()
    assert a.provenance["predicted_step_time"] == b.provenance["predicted_step_time"]


def test_megatron_beats_single_device_on_a_big_transformer():
    g = transformer_graph(layers=8, hidden=2048, seq=1024, batch=8)
    topo = preset("dgx-a100-80g")
    single = run_placer("single_device", g, topo)
    mega = run_placer("megatron_3d", g, topo, budget=Budget(evaluations=60))
    assert mega.provenance["predicted_step_time"] < single.provenance["predicted_step_time"] / 2
    assert set(mega.provenance["config"]) >= {"tp", "pp", "dp", "microbatch_size", "schedule", "recompute"}


def test_megatron_configs_go_coarse_to_fine():
    """Every parallel shape (tp, pp, dp) is tried once, all devices first, before any shape's second
    microbatch size; a pipeline's first configuration fills it with >= 4 microbatches per stage."""
    from agent.placers.templates import PIPELINE_FILL, megatron_configs

    g = transformer_graph(layers=8, hidden=512, seq=128, batch=64)
    cfgs = megatron_configs(g, preset("dgx-a100-80g"))
    shape = [(c["tp"], c["pp"], c["dp"]) for c in cfgs]
    n_shapes = len(set(shape))
    assert len(set(shape[:n_shapes])) == n_shapes  # one of each shape first
    totals = [c["total"] for c in cfgs[:n_shapes]]
    assert totals == sorted(totals, reverse=True) and totals[0] == 8
    for c in cfgs[:n_shapes]:
        m = 64 // c["dp"] // c["microbatch_size"]
        if c["pp"] == 1:
            assert m == 1
        else:
            assert c["schedule"] == "1f1b" and (m >= PIPELINE_FILL * c["pp"] or c["microbatch_size"] == 1)
    assert len(cfgs) == len({tuple(sorted(c.items())) for c in cfgs})  # nothing twice


def test_megatron_short_budget_reaches_a_pipeline():
    """32 evaluations (the fast baseline's) reach the pipeline a 4-GPU PCIe box wants for an MLP chain,
    which the shapes' microbatch sizes listed first (data parallel) used to exhaust."""
    g = chain_graph(24, flops=4e12, param_bytes=2e8, act_bytes=4e7, batch_size=64)
    topo = preset("pcie-4gpu")
    short = run_placer("megatron_3d", g, topo, budget=Budget(evaluations=32))
    full = run_placer("megatron_3d", g, topo)
    assert short.provenance["config"]["pp"] > 1
    assert short.provenance["predicted_step_time"] <= full.provenance["predicted_step_time"] * 1.05


def test_caps_allow_sequence_splits_only_on_token_wise_ops_of_a_tensor_parallel_group():
    from agent.placers.common import caps_allow
    from envs.graph import CAN_BATCH, CAN_COL, CAN_REPLICATE

    token_wise = CAN_BATCH | CAN_REPLICATE
    assert caps_allow(token_wise, "seq_split", 4, 2) and caps_allow(token_wise, "seq_split", 8, 1)
    assert not caps_allow(token_wise, "seq_split", 4, 4)  # tp = 1: nothing to split the sequence over
    assert not caps_allow(CAN_BATCH | CAN_COL, "seq_split", 4, 1)  # not replicable: not token-wise


def test_annealing_reheats_a_chain_that_stalls():
    """T = T0 * 2^(-(k - k0) / HALF_LIFE): k0 moves to k after `stall` evaluations without a new best."""
    from agent.placers.search import HALF_LIFE, T0, T_MIN, Annealing

    rng = np.random.default_rng(0)
    a = Annealing(stall=100)
    assert a.temperature(0) == T0 and a.temperature(HALF_LIFE) == pytest.approx(T0 / 2)
    a.new_best(50)
    a.accept(0.0, 0.0, 149, rng)
    assert a.reheats == 0 and a.temperature(149) == pytest.approx(T0 * 2 ** (-149 / HALF_LIFE))
    a.accept(0.0, 0.0, 150, rng)  # 100 evaluations since the last best
    assert a.reheats == 1 and a.temperature(150) == T0
    a.accept(0.0, 0.0, 249, rng)
    assert a.reheats == 1 and a.temperature(200) == pytest.approx(T0 * 2 ** (-50 / HALF_LIFE))
    a.accept(0.0, 0.0, 250, rng)  # 100 since the reheat
    assert a.reheats == 2
    off = Annealing(stall=0)
    off.accept(0.0, 0.0, 10**6, rng)
    assert off.reheats == 0 and off.temperature(10**6) == T_MIN
    hot, cold = Annealing(stall=0), Annealing(stall=0)  # Metropolis: worse moves pass when hot, not when cold
    assert sum(hot.accept(0.01, 0.0, 0, np.random.default_rng(i)) for i in range(200)) > 100
    assert sum(cold.accept(0.01, 0.0, 5000, np.random.default_rng(i)) for i in range(200)) == 0
    own = Annealing(stall=0, t0=0.2, half_life=10.0)  # a schedule of its own (the guided search's)
    assert own.temperature(0) == 0.2 and own.temperature(20) == pytest.approx(0.05)
    from agent.placers.common import PlacerError

    for bad in ({"t0": 0.0}, {"t0": -1.0}, {"half_life": 0.0}, {"t0": float("nan")}, {"half_life": float("inf")}):
        with pytest.raises(PlacerError, match="annealing needs"):
            Annealing(**bad)


def test_a_reheated_mcmc_chain_still_never_gets_worse_with_budget(tiny_gpt, monkeypatch):
    """Reheating depends only on the chain's history: a larger budget extends the same trajectory."""
    import agent.placers.search as search

    monkeypatch.setattr(search, "STALL", 10)
    topo = preset("pcie-4gpu")
    runs = [run_placer("mcmc", tiny_gpt, topo, seed=1, budget=Budget(evaluations=n)) for n in (30, 60, 120)]
    assert runs[-1].provenance["reheats"] >= 1
    keys = [(r.provenance["oom"], r.provenance["predicted_step_time"]) for r in runs]
    assert keys == sorted(keys, reverse=True)


def test_the_scorer_counts_calls_in_a_row_that_score_nothing_new():
    from agent.placers.common import REPEATS_TO_STOP, Scorer
    from envs.plan import single_device_plan

    g, topo = chain_graph(3, flops=1e10, param_bytes=1e6, act_bytes=1e5), two_devices()
    scorer = Scorer(g, topo, "step_time", Budget(evaluations=10))
    a, b = single_device_plan(g, topo, 0), single_device_plan(g, topo, 1)
    scorer(a)
    for _ in range(3):
        scorer(a)
    assert (scorer.evaluations, scorer.repeats) == (1, 3) and not scorer.saturated()
    scorer(b)
    assert (scorer.evaluations, scorer.repeats) == (2, 0)
    scorer.repeats = REPEATS_TO_STOP
    assert scorer.saturated() and not scorer.exhausted()  # the budget itself is not spent


def test_annealing_on_a_space_it_has_seen_stops_instead_of_spinning():
    """Two operators on two devices: a few dozen plans. MCMC given a minute and a million evaluations stops
    once its proposals find nothing new, says so, and keeps the best plan."""
    g, topo = chain_graph(2, flops=1e10, param_bytes=1e6, act_bytes=1e5), two_devices()
    plan = run_placer("mcmc", g, topo, seed=0, budget=Budget(evaluations=10**6, seconds=60.0))
    prov = plan.provenance
    assert prov["saturated"] is True and prov["evaluations"] < 1000
    again = run_placer("mcmc", g, topo, seed=0, budget=Budget(evaluations=10**6, seconds=60.0))
    assert again.key() == plan.key()  # deterministic: the stop depends on the proposals, not the clock
