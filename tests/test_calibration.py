"""profilers.calibration: op timing on this host and the cpu-local calibration."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from envs.presets import calibrated_cpu_local_path, cpu_local
from envs.topology import Topology
from profilers.calibration import DeviceFit, MeasureError, calibrate_cpu_local, fit_device, measure
from profilers.spec import build_model

warnings.filterwarnings("ignore")


def test_measure_tiny_mlp_attaches_positive_times():
    module, inputs, batch = build_model("mlp:layers=2,hidden=64,batch=8")
    g = measure(module, inputs, batch_size=batch, dtype="fp32", warmup=1, repeats=3)
    assert "cpu" in g.measured
    fwd, bwd = g.measured["cpu"]["fwd"], g.measured["cpu"]["bwd"]
    work = np.array([k != "input" for k in g.kinds])
    assert (fwd[work] > 0).all() and (bwd[work] > 0).all()
    assert fwd[~work].sum() == 0
    assert g.meta["measured_on"]["cpu"]["statistic"] == "median"
    fit = fit_device(g, "cpu")
    assert fit.flops > 0 and fit.bandwidth > 0 and fit.overhead >= 0
    pred = fit.predict(g.fwd_flops[work], g.mem_bytes[work])
    assert (pred > 0).all()


def test_measure_gnmt_and_attention_run_backward():
    module, inputs, batch = build_model("gnmt:layers=2,hidden=16,vocab=20,seq=4,batch=2")
    g = measure(module, inputs, batch_size=batch, dtype="fp32", warmup=0, repeats=1)
    lstm = [i for i, k in enumerate(g.kinds) if k == "lstm"]
    assert all(g.measured["cpu"]["bwd"][i] > 0 for i in lstm)
    module, inputs, batch = build_model("gpt:layers=1,hidden=32,heads=2,seq=8,vocab=32")
    g = measure(module, inputs, batch_size=batch, dtype="fp32", warmup=0, repeats=1)
    assert g.measured["cpu"]["fwd"][g.index("layers.0.attn.sdpa")] > 0


def test_fit_device_recovers_synthetic_rates():
    from envs.graph import chain_graph

    g = chain_graph(10, flops=1e9, act_bytes=1e6)
    flops = np.geomspace(1e6, 1e10, 10)
    g.fwd_flops[:] = flops
    g.bwd_flops[:] = 2 * flops
    t_f = flops / 1e11 + 1e-5
    g = g.with_measured("cpu", t_f, 2 * flops / 1e11 + 1e-5)
    fit = fit_device(g, "cpu")
    assert isinstance(fit, DeviceFit)
    assert fit.flops == pytest.approx(1e11, rel=0.05)
    with pytest.raises(MeasureError):
        fit_device(g, "a100-80g")


def test_calibrate_writes_cpu_local(tmp_path, monkeypatch):
    monkeypatch.setenv("RLPLACE_HOME", str(tmp_path))
    path = calibrated_cpu_local_path()
    assert str(path).startswith(str(tmp_path)) and not path.exists()
    topo, graph, out = calibrate_cpu_local("mlp:layers=2,hidden=128,batch=16", devices=2, link=True,
                                           warmup=1, repeats=3)
    assert out == path and path.exists()
    loaded = cpu_local()
    assert loaded.meta["calibrated"] is True and loaded.num_devices == 2
    d = loaded.devices[0]
    assert d.peak_flops["fp32"] == pytest.approx(topo.devices[0].peak_flops["fp32"])
    assert d.compute_eff == 1.0 and d.mem_eff == 1.0 and d.launch_overhead >= 0
    assert "bf16" in d.peak_flops and loaded.links[0].bandwidth > 0
    assert "gloo" in loaded.meta["link"]["method"] or "defaults" in loaded.meta["link"]["method"]
    assert isinstance(Topology.load(path), Topology)
    assert not list(path.parent.glob(".*.tmp"))  # atomic write left nothing behind


def test_measure_errors():
    module, inputs, batch = build_model("mlp")
    with pytest.raises(MeasureError, match="dtype"):
        measure(module, inputs, batch_size=batch, dtype="int4")
    with pytest.raises(MeasureError):
        measure(module, inputs, batch_size=batch, device="nonsense")


def test_cli_profile_measure(tmp_path, monkeypatch, capsys):
    from agent.cli import main
    from envs.graph import OpGraph

    monkeypatch.setenv("RLPLACE_HOME", str(tmp_path))
    out = tmp_path / "g.json"
    assert main(["profile", "--model", "mlp:layers=2,hidden=32,batch=4", "--dtype", "fp32", "--measure",
                 "--repeats", "1", "--no-link", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "measured on cpu" in text and "calibrated cpu-local" in text
    g = OpGraph.load(out)
    assert (g.measured["cpu"]["fwd"][1:] > 0).all()
    assert calibrated_cpu_local_path().exists()
