"""Bad input never crashes: fuzzed files load as valid objects or raise the named error in one line,
and a table of command-line misuses exits with code 2 (130 for Ctrl-C), one line, no traceback, nothing
written."""

import json
import math
import os

import numpy as np
import pytest
import yaml
from conftest import mutate, mutations
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envs.errors import GraphError, PlanError, RlplaceError, TopologyError
from envs.examples import transformer_graph
from envs.files import parse_text
from envs.graph import OpGraph
from envs.plan import Plan, megatron_plan, single_device_plan
from envs.presets import preset
from envs.sim import simulate
from envs.topology import Topology

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SMALL_GPT = dict(layers=1, hidden=64, heads=2, seq=16, vocab=100, batch=4)


def _graph_doc():
    return transformer_graph(**SMALL_GPT).to_dict()


def _topology_doc():
    d = preset("pcie-4gpu").to_dict()
    return d


def _plan_doc():
    g = transformer_graph(**SMALL_GPT)
    return megatron_plan(g, preset("pcie-4gpu"), tp=2, dp=2, global_batch=4).to_dict()


def _one_line(exc: BaseException) -> None:
    text = str(exc)
    assert text and "\n" not in text, text
    assert "Traceback" not in text


def _text_variants(doc, data):
    """The document as JSON text, maybe truncated or with a byte that is not UTF-8."""
    text = json.dumps(doc)
    how = data.draw(st.sampled_from(["whole", "truncate", "bad-byte"]))
    if how == "truncate":
        return text[:data.draw(st.integers(0, max(len(text) - 1, 0)))].encode()
    if how == "bad-byte":
        k = data.draw(st.integers(0, len(text)))
        return text[:k].encode() + b"\xff\xfe" + text[k:].encode()
    return text.encode()


def _load(tmp_path, raw: bytes, loader, suffix=".json"):
    p = tmp_path / f"doc{suffix}"
    p.write_bytes(raw)
    return loader(p)


@FUZZ
@given(mutation=mutations(), data=st.data())
def test_fuzzed_graph_files(tmp_path_factory, mutation, data):
    tmp = tmp_path_factory.mktemp("g")
    raw = _text_variants(mutate(_graph_doc(), mutation), data)
    try:
        g = _load(tmp, raw, OpGraph.load)
    except GraphError as exc:
        _one_line(exc)
        return
    g.validate()
    rep = simulate(g, preset("pcie-4gpu"), single_device_plan(g, preset("pcie-4gpu")))
    assert math.isfinite(rep.value) and np.isfinite(rep.peak_memory).all()


@FUZZ
@given(mutation=mutations(), data=st.data(), suffix=st.sampled_from([".json", ".yaml"]))
def test_fuzzed_topology_files(tmp_path_factory, mutation, data, suffix):
    tmp = tmp_path_factory.mktemp("t")
    doc = mutate(_topology_doc(), mutation)
    raw = _text_variants(doc, data) if suffix == ".json" else yaml.safe_dump(doc).encode()
    try:
        t = _load(tmp, raw, Topology.load, suffix)
    except TopologyError as exc:
        _one_line(exc)
        return
    g = transformer_graph(**SMALL_GPT)
    rep = simulate(g, t, single_device_plan(g, t))
    assert math.isfinite(rep.value)
    assert all(math.isfinite(t.bandwidth(0, j)) or j == 0 for j in range(t.num_devices))


@FUZZ
@given(mutation=mutations(), data=st.data())
def test_fuzzed_plan_files(tmp_path_factory, mutation, data):
    tmp = tmp_path_factory.mktemp("p")
    raw = _text_variants(mutate(_plan_doc(), mutation), data)
    g, topo = transformer_graph(**SMALL_GPT), preset("pcie-4gpu")
    try:
        plan = _load(tmp, raw, Plan.load)
        plan.validate(g, topo)
    except PlanError as exc:
        _one_line(exc)
        return
    rep = simulate(g, topo, plan)
    assert math.isfinite(rep.value) and rep.value > 0


@FUZZ
@given(mutation=mutations(), data=st.data())
def test_fuzzed_training_configs(tmp_path_factory, mutation, data):
    from agent.train import TrainError, load_config

    tmp = tmp_path_factory.mktemp("c")
    base = yaml.safe_load(open(os.path.join(os.path.dirname(__file__), "..", "experiments", "configs",
                                            "tiny.yaml")))
    doc = mutate(base, mutation)
    raw = yaml.safe_dump(doc).encode() if data.draw(st.booleans()) else _text_variants(doc, data)
    try:
        cfg = _load(tmp, raw, load_config, ".yaml")
    except TrainError as exc:
        _one_line(exc)
        return
    assert cfg.n_envs >= 1 and cfg.total_timesteps >= 1


@pytest.mark.parametrize("text", ["{", "[1,", "NaN", '{"a": Infinity}', "\ufeff{}", "1e999", "{" * 5000])
def test_parse_text_is_one_line(text):
    class E(RlplaceError):
        pass

    try:
        parse_text(text, "x.json", "file", E)
    except E as exc:
        _one_line(exc)


# ---------------------------------------------------------------------- the command line
GPT2 = "gpt:layers=2,hidden=32,heads=2,seq=8,batch=4"


_SEQ = iter(range(10**6))


def _fresh(name: str) -> str:
    stem, _, ext = name.rpartition(".")
    return f"{stem}{next(_SEQ)}.{ext}"


def _graph_file(tmp_path, name="g.json", **change):
    d = _graph_doc()
    for k, v in change.items():
        d[k] = v
    p = tmp_path / _fresh(name)
    p.write_text(json.dumps(d))
    return p


def _node_change(tmp_path, i, key, value, name="g.json"):
    d = _graph_doc()
    d["nodes"][i][key] = value
    p = tmp_path / _fresh(name)
    p.write_text(json.dumps(d))
    return p


def _topo_file(tmp_path, change, name="t.json"):
    d = _topology_doc()
    change(d)
    p = tmp_path / _fresh(name)
    p.write_text(json.dumps(d))
    return p


def _plan_file(tmp_path, change, name="p.json"):
    d = _plan_doc()
    change(d)
    p = tmp_path / _fresh(name)
    p.write_text(json.dumps(d))
    return p


def _cases(tmp_path):
    """(label, argv, exit code, text the error line must contain, paths that must not exist afterwards)."""
    t = tmp_path
    (t / "adir").mkdir()
    (t / "afile").write_text("x")
    nonutf = t / "bad.json"
    nonutf.write_bytes(b"\xff\xfe{}")
    exits = t / "exits.py"
    exits.write_text("import sys\ndef build():\n    sys.exit(0)\n")
    noext = t / "graphfile"
    noext.write_text(json.dumps(_graph_doc()))
    other = transformer_graph(layers=1, hidden=64, heads=2, seq=16, vocab=100, batch=4, name="other")
    other.names[0] = "renamed"
    other_path = t / "other.json"
    OpGraph.from_dict({**other.to_dict(), "nodes": [dict(n, name=f"x{i}") for i, n in
                                                    enumerate(other.to_dict()["nodes"])]}).save(other_path)
    out = t / "out.json"
    sim = ["simulate", "--graph"]
    g_ok = _graph_file(t, "ok.json")

    def d_edit(f):
        def change(d):
            f(d)
        return change

    return [
        ("no arguments", [], 2, "", []),
        ("not a number", ["simulate", "--tp", "abc"], 2, "Invalid value for '--tp'", []),
        ("missing option", ["place"], 2, "Missing option", []),
        ("unknown option", ["simulate", "--bogus"], 2, "No such option", []),
        ("unknown command", ["simulte"], 2, "No such command", []),
        ("version abc", sim + [_graph_file(t, version="abc")], 2, "version", []),
        ("newer version", sim + [_graph_file(t, version=99)], 2, "newer", []),
        ("flops as string", sim + [_node_change(t, 1, "fwd_flops", "12")], 2, "fwd_flops", []),
        ("flops as list", sim + [_node_change(t, 1, "fwd_flops", [1, 2])], 2, "fwd_flops", []),
        ("flops 1e308", sim + [_node_change(t, 1, "fwd_flops", 1e308)], 2, "fwd_flops", []),
        ("batch as string", sim + [_graph_file(t, batch_size="8")], 2, "batch_size", []),
        ("nodes as dict", sim + [_graph_file(t, nodes={"a": 1})], 2, "nodes", []),
        ("edges by name", sim + [_graph_file(t, edges=[["embed", "x", 1.0]])], 2, "edges[0]", []),
        ("edge 1.7", sim + [_graph_file(t, edges=[[0, 1.7, 1.0]])], 2, "edges[0][1]", []),
        ("colocation x", sim + [_node_change(t, 0, "colocation", "x")], 2, "colocation", []),
        ("zero nodes", sim + [_graph_file(t, nodes=[], edges=[])], 2, "nodes", []),
        ("negative n_ops", sim + [_node_change(t, 2, "n_ops", -3)], 2, "n_ops", []),
        ("negative mem_bytes", sim + [_node_change(t, 2, "mem_bytes", -1.0)], 2, "mem_bytes", []),
        ("layout_caps -1", sim + [_node_change(t, 2, "layout_caps", -1)], 2, "layout_caps", []),
        ("dtype int3", sim + [_graph_file(t, dtype="int3")], 2, "dtype", []),
        ("not utf-8", sim + [nonutf], 2, "not UTF-8", []),
        ("graph is a directory", sim + [t / "adir"], 2, "directory", []),
        ("topology is a directory", ["simulate", "--topology", t / "adir"], 2, "directory", []),
        ("graph file without .json", sim + [noext, "--json"], 0, "", []),
        ("launch_overhead NaN", ["simulate", "--topology", _topo_file(
            t, d_edit(lambda d: d["devices"][0].update(launch_overhead=float("nan"))))], 2, "not valid JSON", []),
        ("host abc", ["simulate", "--topology", _topo_file(
            t, d_edit(lambda d: d["devices"][0].update(host="abc")), "t2.json")], 2, "host", []),
        ("count 2e8", ["simulate", "--topology", _topo_file(
            t, d_edit(lambda d: d["devices"][0].update(count=200_000_000)), "t3.json")], 2, "limit", []),
        ("cluster too big", ["topology", "show", "a100-80g-cluster:nodes=5000"], 2, "limit", []),
        ("plan devices 1.9", sim + [g_ok, "--topology", "pcie-4gpu", "--plan", _plan_file(
            t, d_edit(lambda d: d["nodes"][0].update(devices=[1.9])))], 2, "devices", []),
        ("plan devices string", sim + [g_ok, "--topology", "pcie-4gpu", "--plan", _plan_file(
            t, d_edit(lambda d: d["nodes"][0].update(devices="0123")), "p2.json")], 2, "devices", []),
        ("plan recompute no", sim + [g_ok, "--topology", "pcie-4gpu", "--plan", _plan_file(
            t, d_edit(lambda d: d["nodes"][0].update(recompute="no")), "p3.json")], 2, "recompute", []),
        ("plan global_batch eight", sim + [g_ok, "--topology", "pcie-4gpu", "--plan", _plan_file(
            t, d_edit(lambda d: d.update(global_batch="eight")), "p4.json")], 2, "global_batch", []),
        ("plan version x", sim + [g_ok, "--topology", "pcie-4gpu", "--plan", _plan_file(
            t, d_edit(lambda d: d.update(version="x")), "p5.json")], 2, "version", []),
        ("plan for another graph", sim + [other_path, "--topology", "pcie-4gpu", "--plan", _plan_file(
            t, d_edit(lambda d: None), "p6.json")], 2, "made for graph", []),
        ("tp 0", ["simulate", "--tp", "0"], 2, "--tp", []),
        ("global batch 0", ["simulate", "--global-batch", "0"], 2, "--global-batch", []),
        ("microbatch size 0", ["simulate", "--microbatch-size", "0"], 2, "--microbatch-size", []),
        ("microbatch size -1", ["simulate", "--microbatch-size", "-1"], 2, "--microbatch-size", []),
        ("tp 3 on 2 heads", sim + [GPT2, "--topology", "pcie-4gpu", "--tp", "3"], 2, "heads", []),
        ("gpt layers -2", sim + ["gpt:layers=-2"], 2, "layers", []),
        ("mlp hidden -5", sim + ["mlp:hidden=-5"], 2, "hidden", []),
        ("build calls sys.exit", sim + [f"{exits}:build"], 2, "sys.exit", []),
        ("output is a directory", sim + [g_ok, "-o", t / "adir"], 2, "directory", []),
        ("output under a file", sim + [g_ok, "-o", t / "afile" / "p.json"], 2, "is a file", [t / "afile" / "p.json"]),
        ("gantt under a file", sim + [g_ok, "-o", out, "--gantt", t / "afile" / "g.png"], 2, "is a file", [out]),
        ("place search nan", ["place", "--model", g_ok, "--search-seconds", "nan", "-o", out], 2, "search", [out]),
        ("place search inf", ["place", "--model", g_ok, "--search-seconds", "inf", "-o", out], 2, "search", [out]),
        ("place max-groups 0", ["place", "--model", g_ok, "--max-groups", "0", "-o", out], 2, "--max-groups", [out]),
        ("place gantt under a file", ["place", "--model", g_ok, "-o", out, "--gantt", t / "afile" / "x.png"], 2,
         "is a file", [out]),
        ("place output dir", ["place", "--model", g_ok, "-o", t / "adir"], 2, "directory", []),
        # the topology name is checked before the model is traced (a build that would fail is never run)
        ("place topology before model", ["place", "--model", f"{exits}:build", "-t", "dgx-z", "-o", out], 2,
         "unknown topology", [out]),
        ("simulate topology before model", sim + [f"{exits}:build", "--topology", "dgx-z"], 2, "unknown topology", []),
        ("import output under a file", ["import", nonutf, "-o", t / "afile" / "x"], 2, "is a file", []),
        ("bench out is a file", ["bench", "--suite", "smoke", "--out", t / "afile"], 2, "is a file", []),
        ("run timeout -1", ["run", out, "--model", GPT2, "--timeout", "-1"], 2, "--timeout", []),
        ("run steps 0", ["run", out, "--model", GPT2, "--steps", "0"], 2, "--steps", []),
        ("train total steps 0", ["train", "--config", "experiments/configs/tiny.yaml", "--total-steps", "0",
                                 "--run-dir", t / "run"], 2, "--total-steps", [t / "run"]),
        ("demo bogus model", ["demo", "--model", "bogus", "--out", t / "demo"], 2, "bogus", [t / "demo"]),
        ("policy not a zip", ["place", "--model", g_ok, "--policy", t / "afile", "-o", out], 2, "cannot load policy",
         [out]),
        ("broken yaml suite", ["bench", "--suite", _write(t / "s.yaml", "cases: [\n"), "--out", t / "b"], 2,
         "YAML", []),
    ]


def _write(p, text):
    p.write_text(text)
    return p


def test_command_line_misuse_table(tmp_path, cli, monkeypatch):
    monkeypatch.chdir(os.path.join(os.path.dirname(__file__), ".."))
    failures = []
    for label, argv, code, needle, absent in _cases(tmp_path):
        rc, out, err = cli(*argv)
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        problems = []
        if rc != code:
            problems.append(f"exit {rc}, expected {code}")
        if "Traceback" in err or "Traceback" in out:
            problems.append("traceback")
        if code == 2 and label not in ("no arguments",):
            error_lines = [ln for ln in lines if ln.startswith(("error:", "Error:"))]
            if len(error_lines) != 1:
                problems.append(f"{len(error_lines)} error lines: {lines[-3:]}")
            elif needle and needle not in error_lines[0]:
                problems.append(f"message {error_lines[0]!r} lacks {needle!r}")
        if code == 2 and not lines and argv:
            problems.append("no message")
        for p in absent:
            if os.path.exists(p):
                problems.append(f"{p} was written")
        if problems:
            failures.append(f"{label}: {'; '.join(problems)}")
    assert not failures, "\n".join(failures)


def test_json_output_is_valid_json(cli):
    rc, out, _ = cli("simulate", "--graph", "gpt-small", "--json")
    assert rc == 0
    json.loads(out, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))


def test_outputs_follow_the_umask(tmp_path, cli):
    old = os.umask(0o022)
    try:
        rc, _, _ = cli("simulate", "--graph", "gpt-small", "-o", tmp_path / "p.json", "--gantt", tmp_path / "g.png")
    finally:
        os.umask(old)
    assert rc == 0
    for name in ("p.json", "g.png"):
        assert (os.stat(tmp_path / name).st_mode & 0o777) == 0o644
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temp file left


def test_ctrl_c_during_place_exits_130(cli, monkeypatch, tmp_path):
    import agent.infer

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(agent.infer, "place", interrupted)
    rc, _, err = cli("place", "--model", "gpt-small", "-o", tmp_path / "p.json")
    assert rc == 130 and err.strip() == "interrupted"
    assert not (tmp_path / "p.json").exists()


def test_a_bug_says_internal_error(cli, monkeypatch):
    import agent.commands.simulate as sim

    def broken(*_a, **_k):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(sim, "simulate", broken)
    rc, _, err = cli("simulate")
    assert rc == 1 and err.startswith("internal error, please report")
