"""Closed forms the simulator must reproduce, and properties on random cases."""

import numpy as np
import pytest
from conftest import gpu_only, simulation_cases
from hypothesis import HealthCheck, given, settings

from envs.examples import transformer_graph
from envs.graph import OpGraph, chain_graph
from envs.plan import Plan, data_parallel_plan, megatron_plan, single_device_plan
from envs.presets import preset
from envs.sim import simulate
from envs.topology import Topology

LAUNCH = 5e-6


@pytest.fixture(scope="module")
def dgx():
    return gpu_only(preset("dgx-a100-80g"))


A100 = preset("dgx-a100-80g").devices[0].flops("bf16")  # achievable bf16 FLOP/s of the preset


def op_time(flops):
    return flops / A100 + LAUNCH


def test_single_device_is_sum_of_op_times_plus_optimizer(dgx):
    g = chain_graph(6, flops=1e12, param_bytes=2e6, act_bytes=1.0)
    r = simulate(g, dgx, single_device_plan(g, dgx))
    params = 6 * 2e6 / 2
    opt = 2 * params * 16 / (2039e9 * 0.8) + LAUNCH
    expect = 6 * op_time(1e12) + 6 * op_time(2e12) + opt
    assert r.value == pytest.approx(expect, rel=1e-9)
    assert r.comm_time.sum() == 0


def test_two_device_chain_is_both_ops_plus_one_transfer(dgx):
    g = chain_graph(2, flops=1e12, act_bytes=1e9)
    plan = Plan(groups=[(0,), (1,)], layouts=["single", "single"])
    xfer = dgx.p2p_time(0, 1, 1e9)
    lat = simulate(g, dgx, plan, "latency")
    assert lat.value == pytest.approx(2 * op_time(1e12) + xfer, rel=1e-9)
    step = simulate(g, dgx, plan)
    assert step.value == pytest.approx(2 * op_time(1e12) + 2 * op_time(1e12) + 2 * xfer, rel=1e-9)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (8, 16), (4, 1)])
def test_pipeline_closed_form(dgx, schedule, p, m):
    g = chain_graph(p, flops=4e12, act_bytes=1.0, batch_size=m)
    plan = Plan(groups=[(i,) for i in range(p)], layouts=["single"] * p, microbatches=m, schedule=schedule,
                global_batch=m)
    r = simulate(g, dgx, plan)
    tf = op_time(4e12 / m)
    tb = tf  # param-free ops: backward = forward FLOPs
    assert r.value == pytest.approx((m + p - 1) * (tf + tb), rel=0.01)


def test_1f1b_stashes_fewer_activations_than_gpipe(dgx):
    g = chain_graph(4, flops=1e12, act_bytes=1e9, batch_size=8)
    mk = lambda s: Plan(groups=[(i,) for i in range(4)], layouts=["single"] * 4, microbatches=8, schedule=s,
                        global_batch=8)
    gp = simulate(g, dgx, mk("gpipe")).memory_breakdown["activations"][:4]
    of = simulate(g, dgx, mk("1f1b")).memory_breakdown["activations"][:4]
    np.testing.assert_allclose(gp, 8 * 1e9 / 8)
    np.testing.assert_allclose(of, [4 * 1e9 / 8, 3 * 1e9 / 8, 2 * 1e9 / 8, 1 * 1e9 / 8])


def _allreduces(report, grad):
    return [(lab, report.task_finish[i] - report.task_start[i]) for i, lab in enumerate(report.task_label)
            if lab.startswith("allreduce grad" if grad else "allreduce ") and (grad or "grad" not in lab)]


@pytest.mark.parametrize("t", [2, 4, 8])
def test_megatron_mlp_block_one_all_reduce_each_way(dgx, t):
    # input -> fc1 (col) -> gelu (col) -> fc2 (row) -> residual add (replicated)
    g = transformer_graph(layers=1, hidden=1024, seq=512, batch=4, embeddings=False)
    keep = [i for i, nm in enumerate(g.names) if nm in ("layers.0.ln2", "layers.0.mlp.fc1", "layers.0.mlp.gelu",
                                                         "layers.0.mlp.fc2", "layers.0.add2")]
    sub = _subgraph(g, keep)
    plan = megatron_plan(sub, dgx, tp=t, global_batch=4, microbatch_size=4)
    assert plan.layouts == ["replicate", "col_split", "col_split", "row_split", "replicate"]
    r = simulate(sub, dgx, plan)
    fwd, bwd = _allreduces(r, grad=False), _allreduces(r, grad=True)
    assert len(fwd) == 1 and len(bwd) == 1
    S = 4 * 512 * 1024 * 2
    expect = dgx.collective_time("all_reduce", range(t), S)
    assert fwd[0][1] == pytest.approx(expect) and bwd[0][1] == pytest.approx(expect)


def test_megatron_transformer_layer_two_all_reduces_each_way(dgx):
    g = transformer_graph(layers=2, hidden=512, seq=256, batch=2, embeddings=False)
    r = simulate(g, dgx, megatron_plan(g, dgx, tp=4, global_batch=2, microbatch_size=2))
    assert len(_allreduces(r, grad=False)) == 4 and len(_allreduces(r, grad=True)) == 4


def _subgraph(g: OpGraph, keep):
    pos = {old: new for new, old in enumerate(keep)}
    es = [e for e in range(g.num_edges) if g.edge_src[e] in pos and g.edge_dst[e] in pos]
    return OpGraph(names=[g.names[i] for i in keep], kinds=[g.kinds[i] for i in keep],
                   module_paths=[g.module_paths[i] for i in keep], fwd_flops=g.fwd_flops[keep],
                   param_bytes=g.param_bytes[keep], out_bytes=g.out_bytes[keep],
                   edge_src=[pos[g.edge_src[e]] for e in es], edge_dst=[pos[g.edge_dst[e]] for e in es],
                   edge_bytes=g.edge_bytes[es], batch_size=g.batch_size)


def test_data_parallel_scaling(dgx):
    g = transformer_graph(layers=2, hidden=1024, seq=512, batch=16)
    one = simulate(g, dgx, single_device_plan(g, dgx))
    dp = simulate(g, dgx, data_parallel_plan(g, dgx))
    m1, m8 = one.memory_breakdown, dp.memory_breakdown
    np.testing.assert_allclose(m8["model_states"], m1["model_states"][0])  # full replica everywhere
    assert m8["activations"][0] == pytest.approx(m1["activations"][0] / 8)
    # the work divides by 8, every device still launches every kernel (forward ops, backward ops and GEMMs)
    launches = LAUNCH * (2 * g.n_ops.sum() + g.num_gemms)
    work = one.compute_time[0] - _opt(one) - launches
    assert dp.compute_time[0] == pytest.approx(work / 8 + launches + _opt(one), rel=0.02)
    # between perfect overlap of the bucketed gradient all-reduce and none at all
    ideal = (one.value - _opt(one) - launches) / 8 + launches + _opt(one)
    ar = sum(f - s for s, f, lab in zip(dp.task_start, dp.task_finish, dp.task_label) if lab.startswith("grad allreduce"))
    # the buckets' all-reduces move all gradients once; each bucket adds the ring's latency steps
    assert ar == pytest.approx(dgx.collective_time("all_reduce", range(8), g.param_bytes.sum()), rel=0.1)
    assert ideal * (1 - 1e-9) <= dp.value <= ideal + ar + 1e-9
    assert dp.comm_time[0] > 0


def _opt(report):
    return float(report.task_finish[-1] - report.task_start[-1])


def test_memory_overflow_is_flagged(dgx):
    g = chain_graph(2, flops=1e9, param_bytes=20e9, act_bytes=1.0)  # 10 G params x 16 B = 320 GB
    r = simulate(g, dgx, single_device_plan(g, dgx))
    assert r.is_oom and r.oom == [0] and r.to_dict()["oom"] is True
    r2 = simulate(g, dgx, Plan(groups=[(i,) for i in range(2)], layouts=["single"] * 2))
    assert r2.oom == [0, 1]


def test_recompute_trades_memory_for_time(dgx):
    g = transformer_graph(layers=2, hidden=1024, seq=1024, batch=8)
    base = simulate(g, dgx, megatron_plan(g, dgx, global_batch=8, microbatch_size=8))
    rc = simulate(g, dgx, megatron_plan(g, dgx, global_batch=8, microbatch_size=8, recompute="full"))
    assert rc.peak_memory[0] < base.peak_memory[0]
    assert rc.value > base.value


def test_throughput_is_microbatches_times_busiest_device_per_microbatch(dgx):
    g = chain_graph(4, flops=1e12, act_bytes=1.0, batch_size=4)
    plan = Plan(groups=[(0,), (0,), (1,), (1,)], layouts=["single"] * 4, microbatches=4, global_batch=4)
    r = simulate(g, dgx, plan, "throughput")
    per_op = 2 * op_time(1e12 / 4)
    x = dgx.p2p_time(0, 1, 1.0 / 4)
    assert r.value == pytest.approx(4 * (2 * per_op + x), rel=1e-9)  # per global batch: 4 microbatches
    assert r.makespan == pytest.approx((4 + 2 - 1) * (2 * per_op + x), rel=1e-9)


# ---------------------------------------------------------------------- properties
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(simulation_cases())
def test_properties(case):
    g, topo, plan = case
    r = simulate(g, topo, plan)
    # every task scheduled exactly once, none before time 0, none overlapping on a device's engine
    assert r.num_tasks > 0 and (r.task_start >= 0).all() and (r.task_finish >= r.task_start).all()
    rows = [x for x in r.timeline() if x["kind"] != "comm"]
    for d in {x["device"] for x in rows}:
        spans = sorted((x["start"], x["end"]) for x in rows if x["device"] == d)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))
    # lower bounds: total work over aggregate throughput; critical path of unsplit ops on the fastest device
    rates = np.array([d.flops(plan.dtype) for d in topo.devices])
    work = (g.fwd_flops + g.bwd_flops).sum()
    assert r.value >= work / rates.sum() * (1 - 1e-9)
    if all(lay == "single" for lay in plan.layouts):
        mb = plan.microbatch_size(g) / g.batch_size
        cp, _ = g.critical_path((g.fwd_flops + g.bwd_flops) * mb / rates.max())
        assert r.value >= cp * (1 - 1e-9)
    # deterministic
    again = simulate(g, topo, plan)
    assert again.value == r.value and (again.peak_memory == r.peak_memory).all()


# ---------------------------------------------------------------------- structure
SIM_LAYERS = {"cost": 0, "schedule": 0, "waitlist_schedule": 1, "throughput": 1, "reference": 1, "kernels": 1, "compiled": 2, "stages": 3,
              "__init__": 4}
SIM_MAY_IMPORT = {"__future__", "collections", "dataclasses", "heapq", "math", "typing", "numpy", "numba", "envs.graph",
                  "envs.plan", "envs.topology", "envs.errors"}


def test_simulator_package_imports_only_downward():
    """envs/sim: every module imports only modules below it (and the world model, numpy, numba)."""
    import ast
    from pathlib import Path

    import envs.sim

    root = Path(envs.sim.__file__).parent
    assert {p.stem for p in root.glob("*.py")} == set(SIM_LAYERS)
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                targets = [f"{node.module}.{a.name}" if node.module == "envs.sim" else node.module for a in node.names]
            else:
                continue
            for name in targets:
                if name.startswith("envs.sim."):
                    below = name.split(".")[2]
                    assert SIM_LAYERS[below] < SIM_LAYERS[path.stem], f"{path.name} imports {name}"
                else:
                    assert name in SIM_MAY_IMPORT or name.split(".")[0] in SIM_MAY_IMPORT, f"{path.name} imports {name}"


# ---------------------------------------------------------------------- shape-aware costs and the hosts
def test_gemm_time_by_shape_and_wave_quantisation():
    from envs.sim.cost import gemm_time, wave_efficiency

    # 2 x 2 output tiles of 128 on 108 SMs: one wave with 4 of 108 SMs busy
    assert wave_efficiency(256.0, 256.0, 1.0, 108, 128) == pytest.approx(4 / 108)
    # 108 tiles fill one wave exactly, 109 need a second one that is nearly empty
    assert wave_efficiency(128.0 * 108, 128.0, 1.0, 108, 128) == pytest.approx(1.0)
    assert wave_efficiency(128.0 * 109, 128.0, 1.0, 108, 128) == pytest.approx(109 / 216)
    assert wave_efficiency(100.0, 100.0, 7.0, 0, 128) == 1.0  # no SM count: not modelled
    rate, bw = 250e12, 1.6e12
    big = gemm_time(8192.0, 8192.0, 8192.0, 1.0, rate, bw, 108, 128, 2.0)
    assert big == pytest.approx(2 * 8192.0 ** 3 / (rate * wave_efficiency(8192.0, 8192.0, 1.0, 108, 128)))
    thin = gemm_time(1.0, 8192.0, 8192.0, 1.0, rate, bw, 0, 128, 2.0)  # a GEMV: memory-bound
    assert thin == pytest.approx((8192.0 + 8192.0 ** 2 + 8192.0) * 2.0 / bw)


def test_a_linear_is_timed_by_its_gemms_split_like_megatron(dgx):
    from envs.graph import GEMM_DENSE, GraphBuilder

    b = GraphBuilder()
    m, n, k = 4096, 8192, 2048
    b.node("fc", "linear", "fc", 2.0 * m * n * k, k * n * 2, m * n * 2, [], gemms=[(m, n, k, 1, GEMM_DENSE)])
    g = b.build(batch_size=4)
    one = simulate(g, dgx, single_device_plan(g, dgx))
    bw = dgx.devices[0].bandwidth()
    fwd = max(2.0 * m * n * k / A100, (m * k + k * n + m * n) * 2 / bw) + LAUNCH
    tasks = {lab: f - s for s, f, lab in zip(one.task_start, one.task_finish, one.task_label)}
    assert tasks["F fc mb0"] == pytest.approx(fwd, rel=1e-12)
    assert tasks["B fc mb0"] == pytest.approx(2 * (fwd - LAUNCH) + 2 * LAUNCH, rel=1e-12)  # dgrad + wgrad
    col = simulate(g, dgx, Plan(groups=[tuple(range(4))], layouts=["col_split"], dp=[1]))
    ctasks = {lab: f - s for s, f, lab in zip(col.task_start, col.task_finish, col.task_label)}
    assert ctasks["F fc mb0"] == pytest.approx(max(2.0 * m * n * k / 4 / A100, (m * k + k * n / 4 + m * n / 4) * 2 / bw)
                                               + LAUNCH, rel=1e-12)


def _hosted(host=0.0, comm=0.0, sync=0.0):
    t = gpu_only(preset("dgx-a100-80g"))
    for d in t.devices:
        d.host_overhead, d.comm_overhead, d.sync_overhead = host, comm, sync
    return Topology(t.devices, t.links, t.switches, name="hosted")


def test_host_bound_chain_runs_at_the_hosts_pace():
    g = chain_graph(20, flops=1e6, act_bytes=1.0)  # tiny kernels: microseconds on the GPU
    gpu = simulate(g, _hosted(), single_device_plan(g, _hosted()))
    host = 1e-4
    r = simulate(g, _hosted(host), single_device_plan(g, _hosted(host)))
    # 20 forward and 20 backward kernels, each issued ``host`` seconds after the one before: the last
    # (op0's backward) starts at 40 x host and the step ends when it does
    last = r.task_label.index("B op0 mb0")
    assert r.task_start[last] == pytest.approx(40 * host, rel=1e-12)
    assert r.value == pytest.approx(40 * host + r.task_finish[last] - r.task_start[last], rel=1e-12)
    assert gpu.value < 40 * host / 10
    big = chain_graph(20, flops=1e13, act_bytes=1.0)  # device-bound: the host runs ahead; only the first
    hosted = simulate(big, _hosted(host), single_device_plan(big, _hosted(host))).value  # kernel waits for it
    assert hosted - simulate(big, _hosted(), single_device_plan(big, _hosted())).value == pytest.approx(host)


def test_collectives_cost_host_time_growing_with_the_group():
    from envs.sim.cost import CommTimes

    c = CommTimes(_hosted(host=1e-5, comm=2e-5, sync=3e-6))
    assert c.host((0, 1), transfer=False) == (pytest.approx(2e-5 + 3e-6), False)
    assert c.host(tuple(range(8)), transfer=False) == (pytest.approx(2e-5 + 7 * 3e-6), False)
    assert c.host((0, 1), transfer=True)[1] is True  # a transfer blocks its hosts


def test_recomputation_replays_the_forward_all_reduces(dgx):
    """Megatron-LM: two all-reduces per layer forward, two backward, and with full recomputation the two
    forward ones again in the backward pass (Korthikanti et al. 2022)."""
    g = transformer_graph(layers=2, hidden=1024, heads=16, seq=256, vocab=1000, embeddings=False)
    for rc, want in (("none", 0), ("full", 2 * 2)):
        r = simulate(g, dgx, megatron_plan(g, dgx, tp=8, recompute=rc))
        replays = [lab for lab in r.task_label if lab.startswith("re-allreduce")]
        assert len(replays) == want


def test_each_recomputed_region_pays_the_checkpoint_overhead_once_per_microbatch():
    g = transformer_graph(layers=3, hidden=256, heads=4, seq=64, vocab=500, batch=4)
    regions = int(g.checkpoint_ends().sum())
    assert regions == 3 + 4  # the layers; embedding, final norm, head and loss (top-level modules)
    base = gpu_only(preset("dgx-a100-80g"))
    over = gpu_only(preset("dgx-a100-80g"))
    for d in over.devices:
        d.recompute_overhead = 1e-3
    for rc, extra in (("none", 0.0), ("full", 1e-3 * regions * 2)):
        plans = [megatron_plan(g, t, microbatch_size=2, recompute=rc) for t in (base, over)]
        diff = simulate(g, over, plans[1]).value - simulate(g, base, plans[0]).value
        assert diff == pytest.approx(extra, rel=1e-9, abs=1e-12)
