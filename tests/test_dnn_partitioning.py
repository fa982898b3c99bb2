"""Importer of the dnn-partitioning workloads (Tarnawski et al., NeurIPS 2020) and its max-load objective."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from agent.cli import main
from envs.coarsen import coarsen
from envs.errors import PlanError, RlplaceError
from envs.graph import OpGraph
from envs.plan import Plan
from envs.topology import Topology
from profilers.dnn_partitioning import (
    WorkloadError,
    accelerator_memory,
    device_loads,
    import_split,
    import_workload,
    max_load,
)

DATA = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "dnn-partitioning"
BERT24 = DATA / "throughput" / "layer-graphs" / "bert24_training.json"
EXPERT = DATA / "human-experts" / "bert24_training_expert.json"
SAMPLES = sorted((DATA / "throughput").glob("*/*.json")) if DATA.is_dir() else []
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"sample workloads not found at {DATA}")


def _one_device(graph: OpGraph, device: int = 0) -> Plan:
    return Plan(groups=[(device,)] * graph.num_nodes, layouts=["single"] * graph.num_nodes)


def _write(tmp_path: Path, nodes: list[dict], edges: list[dict], fpgas: int = 2, cpus: int = 1) -> Path:
    p = tmp_path / "w.json"
    p.write_text(json.dumps({"maxSizePerFPGA": 100.0, "maxFPGAs": fpgas, "maxCPUs": cpus,
                             "nodes": nodes, "edges": edges}))
    return p


def _node(i: int, fpga: float, cpu: float, color=None, fpga_ok: bool = True, size: float = 1.0) -> dict:
    d = {"name": f"n{i}", "id": i, "supportedOnFpga": fpga_ok, "cpuLatency": cpu, "fpgaLatency": fpga,
         "isBackwardNode": False, "size": size}
    if color is not None:
        d["colorClass"] = color
    return d


@needs_data
def test_expert_split_max_load():
    graph, topo = import_workload(BERT24)
    plan = import_split(EXPERT, graph, topo)
    assert max_load(graph, topo, plan) == pytest.approx(49.405, rel=1e-4)


@needs_data
def test_everything_on_one_accelerator():
    graph, topo = import_workload(BERT24)
    assert max_load(graph, topo, _one_device(graph)) == pytest.approx(217.813, rel=1e-4)


@needs_data
def test_splitting_a_colour_class_is_invalid():
    graph, topo = import_workload(BERT24)
    plan = import_split(EXPERT, graph, topo)
    cls = graph.colocation
    i = int(np.flatnonzero(cls >= 0)[0])
    j = int(np.flatnonzero((cls == cls[i]) & (np.arange(graph.num_nodes) != i))[0])
    groups = list(plan.groups)
    groups[j] = ((plan.groups[i][0] + 1) % 6,)
    with pytest.raises(PlanError, match="co-location"):
        max_load(graph, topo, plan.copy(groups=groups))


@needs_data
@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_import_every_sample(path):
    raw = json.loads(path.read_text())
    graph, topo = import_workload(path)
    assert graph.num_nodes == len(raw["nodes"]) and graph.num_edges == len(raw["edges"])
    assert graph.meta["source"] == "dnn-partitioning" and graph.meta["objective"] == "throughput"
    assert graph.meta["node_ids"] == [nd["id"] for nd in raw["nodes"]]
    assert sorted(graph.measured) == ["accel", "cpu"]
    assert np.allclose(graph.measured["accel"]["fwd"], [nd["fpgaLatency"] for nd in raw["nodes"]])
    assert np.allclose(graph.measured["cpu"]["fwd"], [nd["cpuLatency"] for nd in raw["nodes"]])
    assert not graph.bwd_flops.any() and not graph.measured["accel"]["bwd"].any()
    assert np.allclose(graph.edge_time, [e["cost"] for e in raw["edges"]])
    assert np.allclose(graph.param_bytes, [nd["size"] for nd in raw["nodes"]])
    colours = [nd.get("colorClass") for nd in raw["nodes"]]
    assert [int(c) if c is not None else -1 for c in colours] == graph.colocation.tolist()
    kinds = [d.kind for d in topo.devices]
    assert kinds == ["accel"] * raw["maxFPGAs"] + ["cpu"] * raw["maxCPUs"]
    for d in topo.devices:
        assert d.pays_comm == (d.kind == "accel")
        if d.kind == "accel":
            assert d.memory_bytes == raw["maxSizePerFPGA"]
    # the files survive rlplace's own JSON round trip
    g2 = OpGraph.from_dict(json.loads(json.dumps(graph.to_dict())))
    t2 = Topology.from_dict(json.loads(json.dumps(topo.to_dict())))
    plan = _one_device(graph)
    assert max_load(g2, t2, plan) == pytest.approx(max_load(graph, topo, plan))
    # and coarsen to a valid smaller graph
    coarse, grouping = coarsen(graph, 32)
    assert coarse.num_nodes <= 32 and coarse.meta["objective"] == "throughput"


def test_communication_semantics(tmp_path):
    # 0 -> 1, 0 -> 2, 0 -> 3 (cost 2 on every out-edge of 0), 1 -> 3 (cost 5)
    nodes = [_node(0, 1.0, 10.0), _node(1, 2.0, 20.0), _node(2, 3.0, 30.0), _node(3, 4.0, 40.0)]
    edges = [{"sourceId": 0, "destId": d, "cost": 2.0, "size": 8.0} for d in (1, 2, 3)]
    edges.append({"sourceId": 1, "destId": 3, "cost": 5.0, "size": 8.0})
    graph, topo = import_workload(_write(tmp_path, nodes, edges))
    # accel0: {0}, accel1: {1, 2}, cpu: {3}
    plan = Plan(groups=[(0,), (1,), (1,), (2,)], layouts=["single"] * 4)
    loads = device_loads(graph, topo, plan)
    # accel0: latency 1 + sends 0's tensor once (2); accel1: 2 + 3 + receives 0 once (2) + sends 1 (5)
    # cpu: latency 40, pays no communication
    assert loads.tolist() == [3.0, 12.0, 40.0]
    assert max_load(graph, topo, plan) == 40.0
    everything_on_1 = Plan(groups=[(1,)] * 4, layouts=["single"] * 4)
    assert device_loads(graph, topo, everything_on_1).tolist() == [0.0, 10.0, 0.0]
    assert accelerator_memory(graph, topo, plan).tolist() == [1.0, 2.0, 1.0]


def test_cpu_only_nodes(tmp_path):
    nodes = [_node(0, 1.0, 10.0), _node(1, 0.0, 20.0, fpga_ok=False)]
    graph, topo = import_workload(_write(tmp_path, nodes, [{"sourceId": 0, "destId": 1, "cost": 1.0, "size": 1}]))
    assert graph.meta["cpu_only"] == [1]
    with pytest.raises(PlanError, match="not supported"):
        max_load(graph, topo, _one_device(graph))
    assert max_load(graph, topo, Plan(groups=[(0,), (2,)], layouts=["single"] * 2)) == 20.0
    with pytest.raises(WorkloadError, match="CPU"):
        import_workload(_write(tmp_path, nodes, [], cpus=0))


def test_split_errors(tmp_path):
    nodes = [_node(5, 1.0, 1.0, color=1), _node(7, 1.0, 1.0, color=1), _node(9, 1.0, 1.0)]
    graph, topo = import_workload(_write(tmp_path, nodes, []))
    split = tmp_path / "s.json"

    def read(d: dict) -> Plan:
        split.write_text(json.dumps(d))
        return import_split(split, graph, topo)

    plan = read({"fpgas": [{"nodes": [5, 7]}, {"nodes": [9]}], "cpus": [{"nodes": []}]})
    assert plan.groups == [(0,), (0,), (1,)]  # ids, not positions
    assert read({"fpgas": [], "cpus": [{"nodes": [5, 7, 9]}]}).groups == [(2,)] * 3
    for bad, msg in (({"fpgas": [{"nodes": [5, 7]}]}, "unassigned"),
                     ({"fpgas": [{"nodes": [5, 7, 9, 9]}]}, "twice"),
                     ({"fpgas": [{"nodes": [5, 7, 9, 11]}]}, "not in graph"),
                     ({"fpgas": [{"nodes": []}, {"nodes": []}, {"nodes": [5, 7, 9]}]}, "only 2"),
                     ({"fpgas": [{"nodes": [5]}, {"nodes": [7, 9]}]}, "co-location")):
        with pytest.raises(RlplaceError, match=msg):
            read(bad)
    with pytest.raises(WorkloadError, match="not found"):
        import_split(tmp_path / "missing.json", graph, topo)


@pytest.mark.parametrize("content", ["{not json", "[]", '{"maxFPGAs": 1}',
                                     '{"maxFPGAs": 1, "maxSizePerFPGA": 1, "nodes": [{"id": 1}]}',
                                     '{"maxFPGAs": 1, "maxSizePerFPGA": 1, "nodes": [{"id": 1, "cpuLatency": 1, '
                                     '"fpgaLatency": -1}]}',
                                     '{"maxFPGAs": 1, "maxSizePerFPGA": 1, "nodes": [{"id": 1, "cpuLatency": 1, '
                                     '"fpgaLatency": 1}], "edges": [{"sourceId": 1, "destId": 2, "cost": 1}]}',
                                     '{"maxFPGAs": 1, "maxSizePerFPGA": 1, "nodes": [{"id": 1, "cpuLatency": 1, '
                                     '"fpgaLatency": 1}], "edges": [{"sourceId": 1, "destId": 1, "cost": 1}]}'])
def test_malformed_files(tmp_path, content):
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(WorkloadError):
        import_workload(p)


def test_missing_file(tmp_path):
    with pytest.raises(WorkloadError, match="not found"):
        import_workload(tmp_path / "nope.json")


@needs_data
def test_cli_writes_graph_topology_and_plan(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["import", "--format", "dnn-partitioning", str(BERT24), "-o", str(out), "--split", str(EXPERT)])
    assert rc == 0
    graph, topo, plan = OpGraph.load(out / "graph.json"), Topology.load(out / "topology.json"), \
        Plan.load(out / "plan.json")
    assert max_load(graph, topo, plan) == pytest.approx(49.405, rel=1e-4)
    assert "49.40" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["graph.json", "plan.json", "topology.json"]


def test_cli_bad_input_exits_2(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{oops")
    out = tmp_path / "out"
    for argv in (["import", "--format", "dnn-partitioning", str(bad), "-o", str(out)],
                 ["import", "--format", "nope", str(bad), "-o", str(out)],
                 ["import", str(tmp_path / "missing.json"), "-o", str(out)]):
        assert main(argv) == 2
    assert not out.exists()


def test_plan_validation_enforces_cpu_only_nodes():
    import pytest as _pytest

    from envs.errors import PlanError as _PlanError
    from envs.graph import chain_graph
    from envs.plan import Plan
    from envs.topology import Device, Link, Topology

    g = chain_graph(2)
    g.meta["cpu_only"] = [1]
    topo = Topology([Device("acc", "accel", {"fp32": 1e12}, 1e9, 1e9), Device("cpu", "cpu", {"fp32": 1e11}, 1e9, 1e9)],
                    [Link("acc", "cpu", bandwidth=1e9)])
    Plan(groups=[(0,), (1,)], layouts=["single"] * 2).validate(g, topo)
    with _pytest.raises(_PlanError, match="runs only on CPUs"):
        Plan(groups=[(0,), (0,)], layouts=["single"] * 2).validate(g, topo)


@needs_data
@pytest.mark.parametrize("path", SAMPLES[:3], ids=lambda p: p.stem)
def test_every_placer_puts_each_operator_on_one_device(path):
    """The paper's model has no redundant copies: an imported workload allows only ``single`` (caps 0),
    so no placer may replicate or split an operator, and the environment offers nothing else."""
    from agent.placers import PLACERS, run_placer
    from envs.placement.env import PlacementEnv
    from envs.tasks import Task

    graph, topo = import_workload(path)
    assert (graph.layout_caps == 0).all()
    for name in PLACERS:
        plan = run_placer(name, graph, topo, seed=0, objective="throughput",
                          budget={"evaluations": 12, "seconds": 20.0})
        assert all(len(g) == 1 for g in plan.groups), name
        assert set(plan.layouts) == {"single"}, name
    env = PlacementEnv([Task(graph, topo)], max_nodes=32, max_devices=topo.num_devices, objective="throughput")
    env.reset(seed=0)
    opts = env.prepared.options
    allowed = opts.allowed(env.prepared.graph.layout_caps)
    assert not allowed[:, [len(g) > 1 for g in opts.groups]].any()


def test_replicate_needs_its_capability_bit():
    from envs.graph import chain_graph

    g = chain_graph(3)
    g.layout_caps[:] = 0
    g.validate()
    topo = Topology.from_dict({"devices": [{"name": "a", "kind": "x", "peak_flops": {"fp32": 1e12},
                                            "memory_bytes": 1e9, "mem_bw": 1e9, "count": 2}],
                               "switches": ["s"], "links": [{"a": "a0", "b": "s", "bandwidth": 1e9},
                                                            {"a": "a1", "b": "s", "bandwidth": 1e9}]})
    rep = Plan(groups=[(0, 1)] * 3, layouts=["replicate"] * 3)
    with pytest.raises(PlanError, match="does not allow replicate"):
        rep.validate(g, topo)
    old = g.to_dict()
    old["version"] = 1  # a version-1 file: caps 0 keeps meaning "one device only"
    assert (OpGraph.from_dict(old).layout_caps == 0).all()
    old["nodes"][0]["layout_caps"] = 1
    assert OpGraph.from_dict(old).layout_caps[0] == 1 | 8


def test_environment_counts_a_workloads_memory_as_the_placers_do(tmp_path):
    """The placement environment's plans, memory estimates and reference plans for an imported workload
    use the workload's memory model (fp32, 4 B per parameter: one byte per stated byte), as the placers'
    plans do; with mixed-precision Adam's 16 B the four nodes below would overflow the accelerator."""
    from agent.placers import run_placer
    from envs.evaluator import CachedSimulation
    from envs.placement.env import PlacementEnv
    from envs.placement.task_setup import reference_plans
    from envs.plan import plan_defaults
    from envs.tasks import Task

    nodes = [_node(i, 1.0, 10.0, size=20.0) for i in range(4)]  # 80 of an accelerator's 100
    edges = [{"sourceId": i, "destId": i + 1, "cost": 1.0, "size": 1.0} for i in range(3)]
    graph, topo = import_workload(_write(tmp_path, nodes, edges))
    task = Task(graph, topo)
    env = PlacementEnv([task], mode="refine", max_nodes=4, coarsen=False, objective="throughput")
    env.reset(seed=0)
    prep = env.prepared
    assert plan_defaults(graph) == {"dtype": "fp32", "state_bytes_per_param": 4.0}
    assert prep.states.sum() == pytest.approx(graph.param_bytes.sum())
    plan = prep.plan(np.zeros(4, dtype=np.int64), 1, "1f1b", 1, "test")  # everything on accelerator 0
    assert (plan.dtype, plan.state_bytes_per_param) == ("fp32", 4.0)
    assert all(p.state_bytes_per_param == 4.0 for p in reference_plans(graph, task).values())
    ev = CachedSimulation()
    mine = ev.evaluate(graph, topo, plan, "throughput")
    theirs = ev.evaluate(graph, topo, run_placer("single_device", graph, topo), "throughput")
    assert not mine.oom and mine.peak_memory.max() == pytest.approx(theirs.peak_memory.max())
    assert not prep.start.result.oom


def test_a_node_without_work_is_equally_fast_on_every_placement(tmp_path):
    """A zero-latency workload node (no FLOPs or bytes; the workload's devices have no launch overhead)
    gets speed feature 0 on every placement, not log2(0) clipped to -12, and without a numpy warning."""
    import warnings

    from envs.placement.env import PlacementEnv
    from envs.tasks import Task

    nodes = [_node(0, 1.0, 10.0), _node(1, 0.0, 0.0), _node(2, 2.0, 5.0)]
    edges = [{"sourceId": i, "destId": i + 1, "cost": 1.0, "size": 1.0} for i in range(2)]
    graph, topo = import_workload(_write(tmp_path, nodes, edges))
    env = PlacementEnv([Task(graph, topo)], mode="refine", max_nodes=3, coarsen=False, objective="throughput")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        env.reset(seed=0)
    speed = env.prepared.speed
    idle = int(np.flatnonzero(graph.fwd_flops + graph.bwd_flops + graph.mem_bytes == 0)[0])
    assert (speed[idle] == 0).all()
    assert (np.delete(speed, idle, axis=0) != 0).any()  # the others still differ by placement
