"""profilers.zoo and profilers.spec: model families, spec strings, the sampler, the cache."""

from __future__ import annotations

import textwrap
import warnings

import numpy as np
import pytest

from envs.errors import RlplaceError
from envs.graph import OpGraph
from profilers.spec import SpecError, build_model, graph_from_spec, knobs, parse_spec, sample_specs
from profilers.zoo import FAMILIES, SIZES

warnings.filterwarnings("ignore")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_traces_and_validates(family):
    g = graph_from_spec(family)
    g.validate()
    assert g.num_nodes > 5 and g.fwd_flops.sum() > 0 and g.param_bytes.sum() > 0
    assert g.batch_size == knobs(family)["batch"]
    assert np.isfinite(g.mem_bytes).all()


def test_family_specific_structure():
    gpt = graph_from_spec("gpt:layers=3,hidden=32,heads=2,seq=8,vocab=64,batch=2")
    assert sum(n.endswith("attn.qkv") for n in gpt.names) == 3
    assert "layers.2.mlp.fc2" in gpt.names and gpt.batch_size == 2
    moe = graph_from_spec("moe:layers=1,experts=3,topk=2")
    assert {"layers.0.moe.experts.2.fc1", "layers.0.moe.router", "layers.0.moe.topk"} <= set(moe.names)
    u3 = graph_from_spec("unet:dims=3,levels=2,img=8,width=4")
    assert "conv3d" in u3.kinds and "conv2d" not in u3.kinds
    assert "conv2d" in graph_from_spec("unet:dims=2,levels=2,img=8,width=4").kinds
    r = graph_from_spec("resnet:depth=18,width=8,img=32")
    assert r.kinds.count("conv2d") == 20 and r.kinds.count("add") == 8
    assert graph_from_spec("gnmt:layers=2,hidden=16,seq=4").kinds.count("lstm") == 4


def test_gpt_parameter_count_formula():
    L, h, v, s = 2, 64, 100, 16
    g = graph_from_spec(f"gpt:layers={L},hidden={h},heads=4,seq={s},vocab={v}")
    per_layer = 12 * h * h + 13 * h  # qkv, out, fc1, fc2 with biases + 2 layer norms
    expected = L * per_layer + v * h + s * h + 2 * h + v * h
    assert g.param_bytes.sum() == 2 * expected


def test_parse_spec_and_errors():
    assert parse_spec("gpt:layers=24,hidden=2048, heads=16,seq=2048,batch=8") == (
        "gpt", {"layers": 24, "hidden": 2048, "heads": 16, "seq": 2048, "batch": 8})
    assert parse_spec("moe:capacity=1.5") == ("moe", {"capacity": 1.5})
    assert parse_spec("mlp") == ("mlp", {})
    with pytest.raises(SpecError, match="families: bert, convnext, diffusion, dlrm, gnmt, gpt"):
        parse_spec("transformerz:layers=2")
    with pytest.raises(SpecError, match="knobs: layers=2, hidden=64"):
        parse_spec("gpt:depth=3")
    with pytest.raises(SpecError, match="key=value"):
        parse_spec("gpt:layers")
    with pytest.raises(SpecError, match="number"):
        parse_spec("gpt:layers=big")
    with pytest.raises(SpecError, match="divisible"):
        build_model("gpt:hidden=30,heads=4")
    with pytest.raises(SpecError, match="dims"):
        build_model("unet:dims=4")
    assert issubclass(SpecError, RlplaceError)


def test_build_model_is_on_meta():
    module, inputs, batch = build_model("gpt:layers=2,hidden=2048,heads=16,vocab=50000,batch=3")
    assert batch == 3 and inputs[0].shape == (3, 32)
    assert all(p.device.type == "meta" for p in module.parameters())


def test_sampler_is_deterministic_and_valid():
    a = sample_specs(["gpt", "resnet", "moe"], 12, seed=7)
    assert a == sample_specs(["gpt", "resnet", "moe"], 12, seed=7)
    assert a != sample_specs(["gpt", "resnet", "moe"], 12, seed=8)
    assert {s.split(":")[0] for s in a} <= {"gpt", "resnet", "moe"}
    assert sample_specs("gpt,bert", 3, seed=1) == sample_specs(["gpt", "bert"], 3, seed=1)
    for s in a[:4]:
        graph_from_spec(s).validate()
    for fam, sizes in SIZES.items():  # every size class parses and its knobs exist
        for size in sizes:
            for s in sample_specs(fam, 3, seed=0, size=size):
                parse_spec(s)
    with pytest.raises(SpecError, match="size"):
        sample_specs("gpt", 2, seed=0, size="huge")
    with pytest.raises(SpecError, match="unknown model family"):
        sample_specs("nope", 2, seed=0)


def test_cache_returns_fresh_copies():
    a = graph_from_spec("mlp:layers=2")
    a.fwd_flops[:] = 0
    b = graph_from_spec("mlp:layers=2")
    assert b.fwd_flops.sum() > 0 and b is not a
    assert graph_from_spec("mlp:layers=2,hidden=256").names == b.names  # default knob, same key


def test_file_spec(tmp_path):
    f = tmp_path / "mymodel.py"
    f.write_text(textwrap.dedent("""
        import torch, torch.nn as nn

        def build():
            assert torch.empty(1).device.type == "meta"
            return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2)), (torch.randn(5, 8),)

        def module_only():
            return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())

        def broken():
            raise RuntimeError("boom")

        class Masked(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 8)

            def forward(self, x, mask=None):
                return self.fc(x) * mask

        def keywords():
            return Masked(), {"x": torch.randn(5, 8), "mask": torch.ones(5, 8)}

        def args_and_keywords():
            return Masked(), (torch.randn(5, 8),), {"mask": torch.ones(5, 8)}
    """))
    g = graph_from_spec(f"{f}:build")
    assert g.num_nodes == 4 and g.batch_size == 5 and g.kinds == ["input", "linear", "gelu", "linear"]
    g2 = graph_from_spec(f"{f}:module_only", input_shape=(2, 3, 8, 8))
    assert g2.kinds == ["input", "conv2d", "relu"] and g2.batch_size == 2
    with pytest.raises(SpecError, match="input-shape"):
        graph_from_spec(f"{f}:module_only")
    with pytest.raises(SpecError, match="no function 'nothere'.*build"):
        graph_from_spec(f"{f}:nothere")
    with pytest.raises(SpecError, match="boom"):
        graph_from_spec(f"{f}:broken")
    with pytest.raises(SpecError, match="not found"):
        graph_from_spec(f"{tmp_path}/missing.py:build")
    # keyword inputs: a dict of keyword tensors; a (module, args, kwargs) triple says so in its error
    g3 = graph_from_spec(f"{f}:keywords")
    assert g3.batch_size == 5 and g3.kinds.count("input") == 2 and "linear" in g3.kinds
    with pytest.raises(SpecError, match="tuple of 3: for keyword arguments, give example_inputs as a dict"):
        graph_from_spec(f"{f}:args_and_keywords")


def test_graph_json_spec(tmp_path):
    g = graph_from_spec("bert")
    g.save(tmp_path / "bert.json")
    h = graph_from_spec(str(tmp_path / "bert.json"))
    assert isinstance(h, OpGraph) and h.names == g.names
    with pytest.raises(SpecError, match="not found"):
        graph_from_spec(str(tmp_path / "nope.json"))


def test_cli_profile(tmp_path, capsys):
    from agent.cli import main

    out = tmp_path / "g.json"
    assert main(["profile", "--model", "gpt:layers=2,hidden=32,heads=2", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ops" in text and "GFLOP" in text and "params" in text
    assert OpGraph.load(out).num_nodes > 10
    assert main(["profile", "--model", "mlp", "--batch", "7", "--dtype", "fp32", "-o", str(out)]) == 0
    g = OpGraph.load(out)
    assert g.batch_size == 7 and g.dtype == "fp32"


@pytest.mark.parametrize("argv", [["profile", "--model", "gpx:layers=2"],
                                  ["profile", "--model", "gpt:layerz=2"],
                                  ["profile", "--model", "nofile.py:build"],
                                  ["profile", "--model", "gpt", "--dtype", "int7"],
                                  ["profile", "--model", "gpt", "--input-shape", "2,3"]])
def test_cli_profile_bad_input_exits_2(argv, capsys):
    from agent.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")


def test_cli_trace_error_is_one_line(tmp_path, capsys):
    from agent.cli import main

    f = tmp_path / "branchy.py"
    f.write_text(textwrap.dedent("""
        import torch, torch.nn as nn

        class Branchy(nn.Module):
            def forward(self, x):
                if x.sum() > 0:
                    return x * 2
                return x

        def build():
            return Branchy(), (torch.randn(2, 3),)
    """))
    assert main(["profile", "--model", f"{f}:build"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torch.cond" in err[0] and "x.sum() > 0" in err[0]
