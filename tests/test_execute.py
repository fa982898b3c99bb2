"""Measured execution of plans (profilers.execute): real torch.distributed runs on CPU / gloo."""

from __future__ import annotations

import json

import pytest

from envs.plan import Plan, megatron_plan, single_device_plan
from envs.presets import cpu_local
from profilers.execute import execute_plan
from profilers.execution_layout import ExecutionError, WorkerError, analyze
from profilers.rank_program import FAIL_ENV
from profilers.spec import build_model, graph_from_spec

MLP = "mlp:layers=3,hidden=32,in_dim=16,out=4,batch=8"
GPT = "gpt:layers=2,hidden=32,heads=2,seq=8,vocab=64,batch=4"


@pytest.fixture(scope="module")
def topo():
    return cpu_local(4)


def _check(report, *, pp=1, dp=1, tp=1, steps=2):
    assert (report.pp, report.dp, report.tp) == (pp, dp, tp)
    assert report.world_size == pp * dp * tp
    assert len(report.step_times) == steps and report.median_step_time_s > 0
    assert len(report.peak_memory_per_rank) == report.world_size and min(report.peak_memory_per_rank) > 0
    # live tensors of these tiny models, not the process (hundreds of MB of interpreter and libraries)
    assert report.memory_kind == "cpu_tensor_peak" and max(report.peak_memory_per_rank) < 8 * 2**20
    assert report.loss_matches is True, (report.losses, report.reference_losses)
    assert report.loss == pytest.approx(report.reference_loss, rel=1e-4)


@pytest.mark.parametrize("schedule,recompute", [("1f1b", "none"), ("gpipe", "full")])
def test_pipeline_two_stages_matches_reference(topo, schedule, recompute):
    g = graph_from_spec(MLP)
    plan = megatron_plan(g, topo, pp=2, microbatch_size=2, schedule=schedule, recompute=recompute)
    assert plan.microbatches == 4
    report = execute_plan(plan, MLP, steps=2, warmup=1, graph=g)
    _check(report, pp=2)
    assert (report.schedule, report.microbatches) == (schedule, 4)


def test_data_parallel_two_ranks_matches_reference(topo):
    g = graph_from_spec(MLP)
    _check(execute_plan(megatron_plan(g, topo, dp=2), MLP, steps=2, warmup=1, graph=g), dp=2)


def test_tensor_parallel_gpt_attention_and_mlp_matches_reference(topo):
    g = graph_from_spec(GPT)
    plan = megatron_plan(g, topo, tp=2)
    model, _, _ = build_model(GPT)
    lay = analyze(plan, g, model)
    assert lay.stages[0].tp_styles["layers.0.attn.qkv"] == "col"
    assert lay.stages[0].tp_styles["layers.0.mlp.fc2"] == "row"
    assert lay.stages[0].attention == ["layers.0.attn", "layers.1.attn"]
    _check(execute_plan(plan, GPT, steps=2, warmup=1, graph=g), tp=2)


def test_pipeline_times_data_parallel_four_ranks(topo):
    g = graph_from_spec(GPT)
    plan = megatron_plan(g, topo, pp=2, dp=2, microbatch_size=1, schedule="gpipe")
    _check(execute_plan(plan, GPT, steps=2, warmup=1, graph=g), pp=2, dp=2)


def test_column_split_gathered_before_replicated_consumers(topo):
    spec = "bert:layers=1,hidden=32,heads=2,seq=8,vocab=64,batch=4"
    g = graph_from_spec(spec)
    model, _, _ = build_model(spec)
    styles = analyze(megatron_plan(g, topo, tp=2), g, model).stages[0].tp_styles
    assert styles["pooler"] == "col_gather" and styles["layers.0.mlp.fc1"] == "col"


def test_analyze_layouts_without_running(topo):
    g = graph_from_spec(GPT)
    model, _, _ = build_model(GPT)
    lay = analyze(megatron_plan(g, topo, pp=2, microbatch_size=1, schedule="gpipe"), g, model)
    assert (lay.pp, lay.microbatches, lay.schedule) == (2, 4, "gpipe")
    assert [st.blocks for st in lay.stages] == [[0, 1], [2, 3]]  # embed+layers.0 | layers.1+head
    assert analyze(single_device_plan(g, topo), g, model).world_size == 1
    # a cut inside a block is refused
    plan = single_device_plan(g, topo)
    plan.groups[g.names.index("layers.0.mlp.fc2")] = (1,)
    with pytest.raises(ExecutionError, match="cuts inside block"):
        analyze(plan, g, model)
    # 1f1b with fewer microbatches than stages
    with pytest.raises(ExecutionError, match="1f1b needs"):
        analyze(megatron_plan(g, topo, pp=2, microbatch_size=4), g, model)
    # tensor parallel on a LayerNorm
    plan = megatron_plan(g, topo, tp=2)
    plan.layouts[g.names.index("layers.0.ln1")] = "col_split"
    with pytest.raises(ExecutionError):
        analyze(plan, g, model)


def test_plan_for_another_model_is_refused(topo):
    other = graph_from_spec("mlp:layers=2,hidden=32,in_dim=16,out=4,batch=8")
    plan = single_device_plan(other, topo)
    with pytest.raises(ExecutionError, match="different model"):
        execute_plan(plan, MLP, steps=1)


def test_worker_crash_is_a_clear_error_not_a_hang(topo, monkeypatch):
    g = graph_from_spec(MLP)
    monkeypatch.setenv(FAIL_ENV, "1")
    with pytest.raises(WorkerError, match="rank 1 failed: .*injected failure"):
        execute_plan(megatron_plan(g, topo, dp=2), MLP, steps=1, warmup=0, graph=g, timeout_s=60,
                     collective_timeout_s=30)


def test_hung_worker_hits_the_deadline(topo, monkeypatch):
    g = graph_from_spec(MLP)
    monkeypatch.setenv(FAIL_ENV, "1:hang")
    with pytest.raises(WorkerError, match="did not finish within 4 s"):
        execute_plan(megatron_plan(g, topo, dp=2), MLP, steps=1, warmup=0, graph=g, check=False, timeout_s=4,
                     collective_timeout_s=60)


def test_cli_bad_input_exits_2(cli, tmp_path, topo):
    code, _, err = cli("run", str(tmp_path / "missing.json"), "--model", MLP)
    assert code == 2 and "not found" in err
    plan = tmp_path / "plan.json"
    single_device_plan(graph_from_spec("mlp:layers=2,hidden=32,in_dim=16,out=4,batch=8"), topo).save(plan)
    code, _, err = cli("run", str(plan), "--model", MLP)
    assert code == 2 and "different model" in err
    code, _, err = cli("run", str(plan), "--model", "nosuchfamily:x=1")
    assert code == 2 and "unknown model family" in err


def test_cli_runs_single_device_plan_json(cli, tmp_path, topo, monkeypatch):
    plan = tmp_path / "plan.json"
    single_device_plan(graph_from_spec(MLP), topo).save(plan)
    code, out, _ = cli("run", str(plan), "--model", MLP, "--steps", "2", "--warmup", "0", "--json")
    assert code == 0, out
    rep = json.loads(out)
    assert rep["world_size"] == 1 and rep["loss_matches"] is True and len(rep["step_times"]) == 2
    assert Plan.load(plan).num_nodes == graph_from_spec(MLP).num_nodes
    monkeypatch.setenv(FAIL_ENV, "0")  # a failing worker: exit 1 with the worker's error
    code, _, err = cli("run", str(plan), "--model", MLP, "--steps", "1")
    assert code == 1 and "rank 0 failed" in err and "injected failure" in err
