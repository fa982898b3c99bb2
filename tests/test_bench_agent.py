"""Benchmark suite: the agent columns (policy, policy+search), the classic-space column, the suite's
graph and topology forms, bad agent sections and Ray addresses, and Ray == in-process."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest

from agent.benchmark.results import agent_summary
from agent.benchmark.runner import run_suite
from agent.benchmark.suite import SuiteError, load_suite, resolve_case
from agent.placers import PLACERS, SEARCH_PLACERS, run_placer

TINY = "transformer:layers=2,hidden=128,heads=2,seq=64,vocab=500,batch=4"
SUITE = f"""
name: tiny-agent
seed: 3
budget: {{evaluations: 6}}
placers: [data_parallel, megatron_3d, megatron_3d_classic]
agent: {{samples: 1, evaluations: 12}}
cases:
  - {{name: tiny@pcie, graph: "{TINY}", topology: pcie-4gpu}}
  - {{name: dag@cluster, graph: "random-layered:seed=1", topology: "cluster:seed=11,memory_scale=0.5"}}
"""
STABLE = ("case", "placer", "graph", "topology", "objective", "nodes", "devices", "predicted", "peak_memory_gb", "oom",
          "evaluations", "lower_bound", "ratio_best", "ratio_lb", "status", "note")  # all but planning_s


def _suite(tmp_path, text: str = SUITE):
    p = tmp_path / "suite.yaml"
    p.write_text(text)
    return load_suite(str(p))


def _stable(rows) -> list[tuple]:
    return [tuple(getattr(r, f) for f in STABLE) for r in rows]


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    suite = _suite(tmp)
    rows = run_suite(suite, tmp / "out", log=lambda _m: None, progress=False, gantt=False)
    return suite, rows, tmp / "out"


def test_agent_columns_are_computed(ran):
    suite, rows, out = ran
    by = {(r.case, r.placer): r for r in rows}
    for case in ("tiny@pcie", "dag@cluster"):
        pol, ps = by[(case, "policy")], by[(case, "policy+search")]
        assert pol.status == "ok" and ps.status == "ok"
        assert pol.evaluations >= 2  # the greedy rollout and one sample (a refine episode simulates every step)
        assert ps.evaluations > 12  # the policy's plans, place's baselines, the guided search's
        assert (ps.oom, ps.predicted) <= (pol.oom, pol.predicted)  # the search starts from the best so far
        assert math.isfinite(pol.ratio_best) and pol.ratio_lb >= 1 - 1e-9
    order = [r.placer for r in rows if r.case == "tiny@pcie"]
    assert order == ["data_parallel", "megatron_3d", "megatron_3d_classic", "policy", "policy+search"]
    md = (out / "results.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| case | objective"))
    assert header.rstrip(" |").endswith("megatron_3d_classic | policy | policy+search")
    for col in ("policy", "policy+search"):
        s = agent_summary(rows, col)
        assert s is not None and s["cases"] == 2 and s["wins"] + s["ties"] + s["losses"] == 2
        assert f"`{col}` beats the best baseline in **{s['wins']} of 2** cases" in md
    with open(out / "results.csv") as f:
        got = list(csv.DictReader(f))
    assert {r["placer"] for r in got} >= {"policy", "policy+search"} and "note" in got[0]
    assert not list(out.glob(".*.tmp"))


def test_classic_space_column(ran, tmp_path):
    suite, rows, out = ran
    assert "megatron_3d_classic" in PLACERS and "megatron_3d_classic" in SEARCH_PLACERS
    md = (out / "results.md").read_text()
    assert "## Plan spaces: classic vs today's" in md and "| tiny@pcie | tp" in md
    from envs.examples import transformer_graph
    from envs.presets import preset

    g = transformer_graph(layers=2, hidden=128, heads=2, seq=64, vocab=500, batch=4)
    plan = run_placer("megatron_3d_classic", g, preset("pcie-4gpu"), seed=0, budget=40)
    assert plan.provenance["placer"] == "megatron_3d_classic" and plan.provenance["choices"] == "classic"
    cfg = plan.provenance["config"]
    assert cfg["zero"] == 0 and not cfg["sequence_parallel"] and cfg["recompute"] in ("none", "full")
    assert int(np.max(plan.zero)) == 0 and plan.virtual_stages == 1


def test_ray_rows_equal_in_process(ran, tmp_path):
    pytest.importorskip("ray")
    from agent.scale import Executor

    suite, rows, _ = ran
    with Executor(ray=True, num_cpus=2) as ex:
        assert ex.workers == 2
        got = run_suite(suite, tmp_path / "ray", executor=ex, log=lambda _m: None, progress=False, gantt=False)
    assert _stable(got) == _stable(rows)
    assert (tmp_path / "ray" / "results.md").exists()


def test_suite_forms_resolve(tmp_path):
    from agent.distribution.topologies import random_cluster

    suite = _suite(tmp_path, """
cases:
  - {name: moe, graph: "moe-transformer:layers=2,experts=4,top_k=2,hidden=256,seq=64,batch=4,vocab=1000", topology: dgx-a100-80g}
  - {name: sp, graph: "random-series-parallel:seed=0", topology: "cluster:seed=12"}
  - {name: tight, graph: "random-layered:seed=3", topology: "cluster:seed=12,memory_scale=0.25"}
""")
    assert suite.agent is None
    graphs = {}
    for case in suite.cases:
        g, topo, expert = resolve_case(case, suite.base)
        g.validate()
        graphs[case.name] = (g, topo)
        assert expert is None
    moe = graphs["moe"][0]
    assert sum(k == "expert" for k in moe.kinds) == 2 * 4
    drawn = random_cluster(12)
    free, tight = graphs["sp"][1], graphs["tight"][1]
    assert [d.name for d in free.devices] == [d.name for d in drawn.devices] == [d.name for d in tight.devices]
    assert {d.kind for d in free.devices} >= {"cpu"} and len({d.kind for d in free.devices}) >= 3
    ratios = [b.memory_bytes / a.memory_bytes for a, b in zip(drawn.devices, tight.devices) if a.kind != "cpu"]
    assert ratios == pytest.approx([0.25 / drawn.meta["memory_scale"]] * len(ratios), rel=1e-2)
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-12)  # one scale for every accelerator
    assert graphs["sp"][0].num_nodes == 25 and tight.name == "cluster:seed=12,memory_scale=0.25"


@pytest.mark.parametrize("text,needle", [
    ("agent: {samples: -1}\n", "agent.samples"),
    ("agent: {evaluations: 1.5}\n", "agent.evaluations"),
    ("agent: {colour: red}\n", "agent.colour"),
    ("agent: yes please\n", "agent"),
    ("cases:\n  - {graph: 'random-layered:seed=-1', topology: pcie-4gpu}\n", "seed"),
    ("cases:\n  - {graph: 'random-layered:ops=3,seed=1', topology: pcie-4gpu}\n", "ops"),
    ("cases:\n  - {graph: 'moe-transformer:experts=0', topology: pcie-4gpu}\n", "experts"),
    ("cases:\n  - {graph: 'moe-transformer:bogus=1', topology: pcie-4gpu}\n", "bogus"),
    ("cases:\n  - {graph: 'transformer:layers', topology: pcie-4gpu}\n", "key=value"),
    ("cases:\n  - {graph: gpt-small, topology: 'cluster:seed=x'}\n", "seed"),
    ("cases:\n  - {graph: gpt-small, topology: 'cluster:seed=1,memory_scale=2'}\n", "memory_scale"),
    ("cases:\n  - {graph: gpt-small, topology: 'cluster:nodes=2,seed=1'}\n", "nodes"),
])
def test_bad_agent_section_and_forms(tmp_path, text, needle):
    if not text.startswith("cases"):
        text += "cases:\n  - {graph: gpt-small, topology: pcie-4gpu}\n"
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(SuiteError, match=needle) as exc:
        load_suite(str(p))
    assert "\n" not in str(exc.value)


def test_cli_bad_input_exits_2_and_writes_nothing(tmp_path, cli):
    p = tmp_path / "s.yaml"
    p.write_text(f"placers: [data_parallel]\nagent: {{samples: 0, evaluations: 0}}\ncases:\n"
                 f"  - {{graph: '{TINY}', topology: pcie-4gpu}}\n")
    for args, needle in ((["--ray-address", "127.0.0.1:1"], "cannot reach the Ray cluster"),
                         (["--ray-address", "nohost"], "bad Ray address"),
                         (["--policy", tmp_path / "missing.zip"], "policy file not found"),
                         (["--no-agent", "--policy", "x.zip"], "--no-agent"),
                         (["--agent-evaluations", "-1"], "--agent-evaluations")):
        out = tmp_path / "out"
        code, _, err = cli("bench", "--suite", p, "--out", out, "-q", *args)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and needle in lines[0], (args, err)
        assert not out.exists()


def test_cli_agent_flags(tmp_path, cli):
    """--no-agent drops the suite's agent columns; --agent-evaluations 0 keeps only the policy column."""
    p = tmp_path / "s.yaml"
    p.write_text(f"placers: [data_parallel]\nagent: {{samples: 0, evaluations: 5}}\ncases:\n"
                 f"  - {{graph: '{TINY}', topology: pcie-4gpu}}\n")
    code, _, err = cli("bench", "--suite", p, "--out", tmp_path / "a", "-q", "--no-agent", "--no-gantt")
    assert code == 0, err
    with open(tmp_path / "a" / "results.csv") as f:
        assert [r["placer"] for r in csv.DictReader(f)] == ["data_parallel"]
    code, _, err = cli("bench", "--suite", p, "--out", tmp_path / "b", "-q", "--agent-evaluations", "0", "--no-gantt")
    assert code == 0, err
    with open(tmp_path / "b" / "results.csv") as f:
        assert [r["placer"] for r in csv.DictReader(f)] == ["data_parallel", "policy"]
