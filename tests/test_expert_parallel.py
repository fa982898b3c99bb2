"""Expert parallelism: the all-to-all's closed form, where experts run and what they hold, the plan
format, bad combinations, and the searches finding it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from agent.placers import run_placer
from agent.placers.common import Budget
from envs.errors import PlanError
from envs.examples import transformer_graph
from envs.plan import Plan, data_parallel_plan, expert_layers, megatron_plan
from envs.presets import preset
from envs.sim import simulate
from envs.sim.cost import expert_exchanges, expert_hosts
from envs.sim.reference import simulate_reference
from envs.tasks import moe_graph

LAYERS, EXPERTS, TOPK, HIDDEN, SEQ, BATCH = 2, 8, 2, 512, 256, 16


@pytest.fixture(scope="module")
def moe():
    return moe_graph(layers=LAYERS, experts=EXPERTS, top_k=TOPK, hidden=HIDDEN, seq=SEQ, batch=BATCH, vocab=4000)


@pytest.fixture(scope="module")
def dgx():
    return preset("dgx-a100-80g")


def _devices_by_label(rep, prefix: str) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for r in rep.timeline():
        if r["label"].startswith(prefix):
            out.setdefault(r["label"], set()).add(int(r["device"]))
    return out


def _ep_plan(moe, topo, ep, **kw):
    return megatron_plan(moe, topo, dp=8, microbatch_size=2, global_batch=BATCH, expert_parallel=ep, **kw)


# ---------------------------------------------------------------------- the all-to-all
def test_all_to_all_is_pairwise_exchange_inside_a_host_and_two_phases_across(dgx):
    S = 64 * 2**20
    for n in (2, 4, 8):
        group = list(range(n))
        bw, alpha = dgx._ring(group)
        assert dgx.collective_time("all_to_all", group, S) == pytest.approx((n - 1) / n * S / bw + (n - 1) * alpha)
    two = preset("a100-80g-cluster:nodes=2")
    group = [0, 1, 2, 3, 8, 9, 10, 11]  # 4 devices on each of 2 hosts
    local = two.collective_time("all_to_all", [0, 1, 2, 3], S)
    bw, alpha = two._ring([0, 8])
    assert two.collective_time("all_to_all", group, S) == pytest.approx(local + S / 2 / bw + alpha)
    assert dgx.collective_time("all_to_all", [3], S) == 0.0


# ---------------------------------------------------------------------- where experts run
def test_experts_are_found_by_module_path(moe):
    layer, index, count = expert_layers(moe)
    assert sorted(set(layer[layer >= 0].tolist())) == list(range(LAYERS))
    assert (count[layer >= 0] == EXPERTS).all() and (count[layer < 0] == 0).all()
    assert sorted(index[layer == 0].tolist()) == list(range(EXPERTS))
    assert (expert_layers(transformer_graph(layers=2, hidden=64, heads=4, seq=32, vocab=100, batch=2))[0] < 0).all()


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_each_expert_runs_on_its_ep_rank_of_every_ep_group(moe, dgx, ep):
    plan = _ep_plan(moe, dgx, ep)
    hosts = expert_hosts(moe, plan)
    layer, index, _ = expert_layers(moe)
    for v in np.flatnonzero(layer >= 0):
        j = int(index[v]) // (EXPERTS // ep)  # contiguous blocks of E/ep experts per EP rank
        assert hosts[v] == tuple(q * ep + j for q in range(8 // ep))
    runs = _devices_by_label(simulate(moe, dgx, plan), "F layers.0.moe.experts.")
    assert len(runs) == EXPERTS * plan.microbatches
    for label, devices in runs.items():
        k = int(label.split("experts.")[1].split()[0])
        assert devices == set(hosts[int(np.flatnonzero((layer == 0) & (index == k))[0])])


def test_expert_model_states_divide_by_the_expert_parallel_degree(moe, dgx):
    layer = expert_layers(moe)[0]
    expert_states = moe.param_bytes[layer >= 0].sum() / 2 * 16  # mixed-precision Adam, 16 B per parameter
    dense_states = moe.param_bytes[layer < 0].sum() / 2 * 16
    for ep in (1, 2, 4, 8):
        states = simulate(moe, dgx, _ep_plan(moe, dgx, ep) if ep > 1 else
                          megatron_plan(moe, dgx, dp=8, microbatch_size=2, global_batch=BATCH)).memory_breakdown
        assert np.allclose(states["model_states"], dense_states + expert_states / ep)


def test_dispatch_and_combine_all_to_alls_carry_each_ranks_routed_tokens(moe, dgx):
    ep = 4
    plan = _ep_plan(moe, dgx, ep)
    rep = simulate(moe, dgx, plan)
    m = plan.microbatches
    a2a = [r for r in rep.timeline() if "alltoall" in r["label"]]
    assert len(_devices_by_label(rep, "alltoall")) == LAYERS * 2 * 2 * m  # dispatch + combine, fwd + bwd
    assert all(len(d) == 8 for d in _devices_by_label(rep, "alltoall").values())
    per_rank = 2 * SEQ * HIDDEN * 2 * TOPK  # a rank's 2 samples, bf16, each token sent to top-k experts
    expect = dgx.collective_time("all_to_all", list(range(ep)), per_rank)
    for r in a2a:
        assert r["end"] - r["start"] == pytest.approx(expect)
    ex = expert_exchanges(moe, plan)
    assert [e.label.split()[0] for e in ex] == ["dispatch", "combine"] * LAYERS


def test_expert_gradients_reduce_over_their_replicas_only(moe, dgx):
    def grad_sync(ep):
        plan = _ep_plan(moe, dgx, ep) if ep > 1 else megatron_plan(moe, dgx, dp=8, microbatch_size=2,
                                                                   global_batch=BATCH)
        return _devices_by_label(simulate(moe, dgx, plan), "grad allreduce")
    assert {len(d) for d in grad_sync(1).values()} == {8}
    assert {len(d) for d in grad_sync(4).values()} == {8, 2}  # dense weights over 8, experts over dp/ep = 2
    assert {len(d) for d in grad_sync(8).values()} == {8}  # one replica per expert: nothing to reduce


def test_expert_parallelism_with_zero_and_recomputation(moe, dgx):
    plan = _ep_plan(moe, dgx, 4, zero=1, recompute="full")
    assert (plan.zero[plan.ep > 1] == 1).all()
    rep = simulate(moe, dgx, plan)
    assert any(r["label"].startswith("re-alltoall dispatch") for r in rep.timeline())
    one = _ep_plan(moe, dgx, 8, zero=1)
    assert (one.zero[one.ep > 1] == 0).all()  # one replica per expert: nothing for ZeRO to shard
    with pytest.raises(PlanError, match="ZeRO stage 1 needs at least 2 replicas"):
        one.copy(zero=np.ones(moe.num_nodes, dtype=np.int64)).validate(moe, dgx)


def test_every_objective_and_builder_agree_on_expert_parallel_plans(moe, dgx):
    plan = _ep_plan(moe, dgx, 4, zero=1)
    for objective in ("step_time", "latency"):
        a = simulate(moe, dgx, plan, objective)
        b = simulate_reference(moe, dgx, plan, objective)
        assert a.value == b.value and np.array_equal(a.peak_memory, b.peak_memory)
    thr = simulate(moe, dgx, plan, "throughput")
    assert thr.value > 0 and thr.comm_time.max() > 0


def test_a_traced_mixture_of_experts_model_takes_expert_parallelism():
    pytest.importorskip("torch")
    from agent.resolve import resolve_graph

    g = resolve_graph("moe:layers=2,hidden=64,heads=4,experts=4,topk=2,seq=32,batch=8")
    topo = preset("pcie-4gpu")
    mem = [simulate(g, topo, megatron_plan(g, topo, dp=4, microbatch_size=2, expert_parallel=ep)).peak_memory.max()
           for ep in (1, 2, 4)]
    assert mem[0] > mem[1] > mem[2]


# ---------------------------------------------------------------------- plan format and bad input
def test_plan_round_trip_keeps_ep_and_older_plans_load(moe, dgx, tmp_path):
    plan = _ep_plan(moe, dgx, 4)
    plan.save(tmp_path / "p.json")
    back = Plan.load(tmp_path / "p.json")
    assert np.array_equal(back.ep, plan.ep) and back.key() == plan.key()
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["version"] == 3
    doc["version"] = 2
    for nd in doc["nodes"]:
        nd.pop("ep", None)
    (tmp_path / "v2.json").write_text(json.dumps(doc))
    assert (Plan.load(tmp_path / "v2.json").ep == 1).all()


def test_bad_expert_parallel_combinations_name_the_conflict(moe, dgx):
    gpt = transformer_graph(layers=2, hidden=64, heads=4, seq=32, vocab=100, batch=8)
    with pytest.raises(PlanError, match="needs a mixture-of-experts model"):
        megatron_plan(gpt, dgx, dp=8, expert_parallel=2)
    with pytest.raises(PlanError, match="needs a mixture-of-experts model"):
        data_parallel_plan(gpt, dgx).copy(ep=np.full(gpt.num_nodes, 2)).validate(gpt, dgx)
    with pytest.raises(PlanError, match="does not divide dp=8"):
        megatron_plan(moe, dgx, dp=8, microbatch_size=2, global_batch=BATCH, expert_parallel=3)
    with pytest.raises(PlanError, match="tensor parallelism"):
        megatron_plan(moe, dgx, tp=2, dp=4, microbatch_size=2, global_batch=BATCH, expert_parallel=2)
    plan = _ep_plan(moe, dgx, 4)
    layer = expert_layers(moe)[0]
    v = int(np.flatnonzero(layer == 0)[0])
    odd = plan.ep.copy()
    odd[v] = 2
    with pytest.raises(PlanError, match="the experts of one layer differ"):
        plan.copy(ep=odd).validate(moe, dgx)
    router = int(np.flatnonzero(np.char.endswith(np.array(moe.names), "layers.0.moe.router"))[0])
    moved = plan.copy()
    moved.groups[router], moved.layouts[router], moved.dp[router] = (0,), "single", 1
    with pytest.raises(PlanError, match="must be data-parallel .* on the experts' group"):
        moved.validate(moe, dgx)
    not_expert = plan.ep.copy()
    not_expert[router] = 2
    with pytest.raises(PlanError, match="is not an expert"):
        plan.copy(ep=not_expert).validate(moe, dgx)
    eight = moe_graph(layers=1, experts=6, top_k=2, hidden=64, seq=32, batch=16, vocab=100)
    with pytest.raises(PlanError, match="does not divide the 6 experts"):
        megatron_plan(eight, dgx, dp=8, microbatch_size=2, global_batch=16, expert_parallel=4)


def test_cli_simulates_expert_parallelism_and_refuses_it_without_experts(cli):
    code, out, _ = cli("simulate", "-g", "moe-wide", "--dp", "8", "--expert-parallel", "4", "--json")
    assert code == 0 and json.loads(out)["value_s"] > 0
    code, _, err = cli("simulate", "-g", "gpt-small", "--dp", "8", "--expert-parallel", "2")
    assert code == 2 and "mixture-of-experts" in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------- search
def test_megatron_sweep_finds_expert_parallelism_and_classic_space_has_none(moe, dgx):
    new = run_placer("megatron_3d", moe, dgx, budget=Budget(evaluations=300, seconds=60))
    old = run_placer("megatron_3d", moe, dgx, budget=Budget(evaluations=300, seconds=60), choices="classic")
    assert new.ep.max() > 1 and old.ep.max() == 1
    assert simulate(moe, dgx, new).value < simulate(moe, dgx, old).value


def test_mcmc_moves_the_expert_parallel_degree_and_keeps_plans_valid(moe, dgx):
    from agent.placers.search import PlanSpace, _propose

    space = PlanSpace(moe, dgx)
    rng = np.random.default_rng(0)
    plan = _ep_plan(moe, dgx, 2)
    degrees = set()
    for _ in range(400):
        q = _propose(space, plan, rng)
        if q is None:
            continue
        degrees.add(int(q.ep.max()))
        q.validate(moe, dgx)  # every proposal is a valid plan (ep reset where a move broke it)
    assert {1, 2} <= degrees and len(degrees) >= 3


@pytest.mark.parametrize("seed", range(3))
def test_lower_bound_holds_for_expert_parallel_plans(seed, dgx):
    from agent.lower_bound import lower_bound

    rng = np.random.default_rng(seed)
    g = moe_graph(layers=2, experts=8, top_k=2, hidden=int(rng.choice([256, 512, 1024])), seq=256, batch=16,
                  vocab=2000)
    lb = lower_bound(g, dgx)
    for ep in (2, 4, 8):
        plan = megatron_plan(g, dgx, dp=8, microbatch_size=int(rng.choice([1, 2])), global_batch=16,
                             expert_parallel=ep, zero=int(rng.integers(0, 2)),
                             recompute=str(rng.choice(["none", "full"])))
        rep = simulate(g, dgx, plan, timeline=False)
        assert lb["lower_bound_any"] <= rep.value * (1 + 1e-9)
        if not rep.is_oom:
            assert lb["lower_bound"] <= rep.value * (1 + 1e-9)
