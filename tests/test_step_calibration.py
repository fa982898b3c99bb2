"""Calibration of a topology to measured step times (profilers.step_calibration, rlplace calibrate)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from envs.plan import megatron_plan, single_device_plan
from envs.presets import cpu_local, preset
from envs.topology import Topology
from profilers import step_calibration as sc
from profilers.spec import graph_from_spec

HEADER = ",".join(sc.CSV_COLUMNS)
# gpus, global batch, micro, hidden, heads, layers, seq, tp, dp, pp
CONFIGS = [(1, 8, 2, 256, 8, 4, 128, 1, 1, 1), (2, 8, 2, 256, 8, 4, 128, 2, 1, 1), (2, 8, 1, 256, 8, 4, 128, 1, 2, 1),
           (4, 8, 1, 256, 8, 4, 128, 1, 1, 4), (4, 8, 2, 256, 8, 4, 128, 2, 2, 1), (8, 16, 2, 256, 8, 4, 128, 2, 2, 2),
           (2, 8, 4, 512, 8, 2, 128, 1, 1, 2), (4, 8, 2, 512, 8, 2, 128, 4, 1, 1), (8, 16, 1, 512, 8, 2, 128, 2, 4, 1),
           (1, 4, 1, 512, 8, 2, 128, 1, 1, 1), (8, 8, 1, 512, 8, 2, 128, 8, 1, 1), (4, 16, 4, 512, 8, 2, 128, 1, 4, 1)]
TRUTH = {"device.compute_eff": 0.55, "device.host_overhead": 3e-5, "device.comm_overhead": 4e-5,
         "link.efficiency": 0.5}


def write_csv(path, rows, times):
    lines = [HEADER] + [",".join(map(str, r)) + f",{t:.6f}" for r, t in zip(rows, times)]
    path.write_text("\n".join(lines) + "\n")
    return path


def synthetic_csv(tmp_path, base: Topology):
    """The CONFIGS with the step times a topology carrying TRUTH predicts (ms)."""
    placeholder = write_csv(tmp_path / "p.csv", CONFIGS, [1.0] * len(CONFIGS))
    samples = sc.samples_from_csv(placeholder, base, vocab=1024)
    truth = sc.predict(samples, sc.with_parameters(base, TRUTH))
    return write_csv(tmp_path / "runs.csv", CONFIGS, truth * 1e3), truth


@pytest.fixture(scope="module")
def a100():
    return preset("dgx-a100-80g")


def test_csv_rows_become_megatron_plans_grouped_by_model(tmp_path, a100):
    path = write_csv(tmp_path / "r.csv", CONFIGS, [100.0 + i for i in range(len(CONFIGS))])
    samples = sc.samples_from_csv(path, a100, vocab=1024)
    assert len(samples) == len(CONFIGS)
    assert {s.model for s in samples} == {"h256-L4", "h512-L2"}
    s = samples[5]
    prov = s.plan.provenance
    assert (prov["tp"], prov["dp"], prov["pp"]) == (2, 2, 2) and s.plan.global_batch == 16
    # Megatron's micro-batch is per data-parallel rank: 4 micro-batches of 2 x dp 2 samples
    assert s.plan.microbatch_size(s.graph) == 4 and s.plan.microbatches == 4 and s.measured == pytest.approx(0.105)
    assert s.config == {"model": "h256-L4", "tp": 2, "pp": 2, "dp": 2, "micro": 2}
    assert samples[0].graph is samples[1].graph  # one graph per model and batch


@pytest.mark.parametrize("text, message", [
    ("a,b\n1,2\n", "missing column"),
    (HEADER + "\n", "no rows"),
    (HEADER + "\n1,8,2,256,8,4,128,1,1,1,0\n", "positive"),
    (HEADER + "\n1,8,2,256,8,4,128,1,1,1,-3\n", "positive"),
    (HEADER + "\n1,8,2,256,8,4,128,1,1,1,abc\n", "must be a number"),
    (HEADER + "\n4,8,2,256,8,4,128,1,1,1,10\n", "tp x dp x pp = 1"),
    (HEADER + "\n16,16,1,256,8,4,128,1,16,1,10\n", "has 8"),
    (HEADER + "\n1,8,2.5,256,8,4,128,1,1,1,10\n", "integers"),
    (HEADER + "\n2,8,3,256,8,4,128,1,2,1,10\n", "line 2"),  # 8 is not a multiple of 3 x 2
])
def test_bad_csv_is_one_clear_error(tmp_path, a100, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(sc.CalibrationError, match=message):
        sc.samples_from_csv(path, a100, vocab=1024)


def test_split_by_model_keeps_models_whole(tmp_path, a100):
    samples = sc.samples_from_csv(write_csv(tmp_path / "r.csv", CONFIGS, [10.0] * len(CONFIGS)), a100, vocab=1024)
    fit_set, held = sc.split_by_model(samples, holdout=["h512-L2"])
    assert {s.model for s in held} == {"h512-L2"} and {s.model for s in fit_set} == {"h256-L4"}
    fit_set, held = sc.split_by_model(samples, 0.3, seed=1)
    assert not ({s.model for s in held} & {s.model for s in fit_set}) and len(fit_set) + len(held) == len(samples)
    with pytest.raises(sc.CalibrationError, match="no measurements of model"):
        sc.split_by_model(samples, holdout=["h9-L9"])
    with pytest.raises(sc.CalibrationError, match="leave no rows"):
        sc.split_by_model(samples, holdout=["h512-L2", "h256-L4"])


def test_metrics_of_a_perfect_and_a_biased_prediction():
    m = np.array([1.0, 2.0, 3.0, 4.0])
    perfect = sc.metrics(m, m, ["a", "a", "a", "b"])
    assert perfect["mape"] == 0 and perfect["spearman"] == pytest.approx(1) and perfect["max_factor"] == 1
    assert perfect["spearman_within_min"] == pytest.approx(1)  # only model a has 3 rows
    biased = sc.metrics(1.5 * m, m)
    assert biased["mape"] == pytest.approx(0.5) and biased["mean_ratio"] == pytest.approx(1.5)
    assert biased["rms_log_error"] == pytest.approx(np.log(1.5))


def test_fit_recovers_the_parameters_that_generated_the_times(tmp_path, a100):
    path, truth = synthetic_csv(tmp_path, a100)
    samples = sc.samples_from_csv(path, a100, vocab=1024)
    before = sc.metrics(sc.predict(samples, a100), truth)
    res = sc.fit(samples, a100, tuple(TRUTH), max_nfev=80)
    assert before["mape"] > 0.1 and res.metrics["mape"] < 0.01
    for k in ("device.compute_eff", "device.host_overhead"):
        assert res.values[k] == pytest.approx(TRUTH[k], rel=0.05), k
    assert res.topology.devices[3].compute_eff == pytest.approx(res.values["device.compute_eff"])
    assert res.topology.meta["calibrated"] and a100.devices[0].compute_eff != res.values["device.compute_eff"]


def test_fit_of_absolute_rates_from_far_off_guesses():
    """A device without a datasheet: its rates are fitted from several starting points."""
    base = cpu_local(2)
    truth = {"device.peak_flops": 2.0e10, "device.mem_bw": 3e9, "device.launch_overhead": 6e-5,
             "link.latency": 8e-4, "link.bandwidth": 6e8}
    samples = []
    for spec in ("mlp:layers=3,hidden=256,in_dim=64,out=16,batch=32", "gpt:layers=2,hidden=64,heads=4,seq=16,batch=8"):
        g = graph_from_spec(spec, dtype="fp32")
        plans = [single_device_plan(g, base, dtype="fp32"), megatron_plan(g, base, dp=2, dtype="fp32"),
                 megatron_plan(g, base, pp=2, microbatch_size=2, dtype="fp32"),
                 megatron_plan(g, base, pp=2, microbatch_size=1, schedule="gpipe", dtype="fp32"),
                 megatron_plan(g, base, tp=2, dtype="fp32"), megatron_plan(g, base, dp=2, microbatch_size=1, dtype="fp32")]
        samples += [sc.Sample(g, p, 1.0, model=spec) for p in plans]
    for s, t in zip(samples, sc.predict(samples, sc.with_parameters(base, truth))):
        s.measured = float(t)
    res = sc.fit(samples, base, sc.ABSOLUTE_FIT, starts=3, loss="soft_l1", max_nfev=300)
    assert res.metrics["mape"] < 0.02
    for k in ("device.peak_flops", "device.launch_overhead", "link.latency", "link.bandwidth"):
        assert res.values[k] == pytest.approx(truth[k], rel=0.1), k


def test_fit_refuses_unusable_requests(a100):
    with pytest.raises(sc.CalibrationError, match="at least one measurement"):
        sc.fit([], a100)
    g = graph_from_spec("mlp:layers=2,hidden=16,in_dim=8,out=4,batch=8")
    s = sc.Sample(g, single_device_plan(g, a100), 0.01)
    with pytest.raises(sc.CalibrationError, match="unknown parameter"):
        sc.fit([s], a100, ("device.speed",))
    with pytest.raises(sc.CalibrationError, match="unknown parameter"):
        sc.with_parameters(a100, {"link.colour": 1.0})


def test_run_records_are_samples_and_plans_are_checked(tmp_path, a100):
    g = graph_from_spec("mlp:layers=2,hidden=16,in_dim=8,out=4,batch=8")
    plan = megatron_plan(g, a100, dp=8)
    rec = {"model": "mlp:layers=2,hidden=16,in_dim=8,out=4,batch=8", "plan": plan.to_dict(),
           "median_step_time_s": 0.02, "dp": 8}
    path = tmp_path / "runs.jsonl"
    path.write_text(json.dumps(rec) + "\n\n" + json.dumps({**rec, "median_step_time_s": 0.03}) + "\n")
    samples = sc.samples_from_runs(path)
    assert [s.measured for s in samples] == [0.02, 0.03] and samples[0].config["dp"] == 8
    sc.check_samples(samples, a100)
    with pytest.raises(sc.CalibrationError, match="measurement 1"):
        sc.check_samples(samples, cpu_local(2))  # 8 ranks on 2 devices
    path.write_text(json.dumps({**rec, "median_step_time_s": -1}) + "\n")
    with pytest.raises(sc.CalibrationError, match="must be positive"):
        sc.samples_from_runs(path)
    path.write_text('{"model": "mlp"}\n')
    with pytest.raises(sc.CalibrationError, match="not a run record"):
        sc.samples_from_runs(path)


def test_cli_calibrate_writes_topology_and_report(cli, tmp_path, a100):
    path, _ = synthetic_csv(tmp_path, a100)
    out = tmp_path / "cal" / "a100-fitted.json"
    out.parent.mkdir()
    code, text, err = cli("calibrate", "-m", str(path), "-t", "dgx-a100-80g", "-o", str(out), "--vocab", "1024",
                          "--holdout-models", "h512-L2", "--params", "compute_eff,host_overhead,comm_overhead",
                          "--max-evaluations", "30")
    assert code == 0, err
    assert "held out: 6 rows" in text and "device.compute_eff" in text
    topo = Topology.load(out)
    assert topo.meta["calibrated"] and topo.meta["held_out"]["n"] == 6
    report = (out.parent / "calibration.md").read_text()
    assert "| held out | 6 |" in report and "| tp | 8 |" in report
    rows = (out.parent / "calibration.csv").read_text().splitlines()
    assert rows[0].startswith("model,tp,pp") and len(rows) == 1 + len(CONFIGS)
    assert (out.parent / "calibration.png").stat().st_size > 1000


@pytest.mark.parametrize("make, extra, message", [
    (lambda p: p.write_text("a,b\n1,2\n"), (), "missing column"),
    (lambda p: p.write_text(HEADER + "\n1,8,2,256,8,4,128,1,1,1,0\n"), (), "positive"),
    (lambda p: p.write_text(HEADER + "\n16,16,1,256,8,4,128,1,16,1,10\n"), (), "has 8"),
    (lambda p: p.write_text(HEADER + "\n1,8,2,256,8,4,128,1,1,1,10\n"), ("--params", "speed"), "unknown parameter"),
    (lambda p: p.write_text(HEADER + "\n1,8,2,256,8,4,128,1,1,1,10\n"), ("--recompute", "some"), "--recompute"),
    (lambda p: None, (), "not found"),
])
def test_cli_calibrate_bad_input_exits_2_and_writes_nothing(cli, tmp_path, make, extra, message):
    path = tmp_path / "m.csv"
    make(path)
    out = tmp_path / "out" / "t.json"
    out.parent.mkdir()
    code, _, err = cli("calibrate", "-m", str(path), "-o", str(out), *extra)
    assert code == 2 and message in err
    assert list(out.parent.iterdir()) == []
