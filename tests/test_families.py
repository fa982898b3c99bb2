"""profilers.families: realistic ranges, family specs with ranges, the seeded sampler; the new zoo families."""

from __future__ import annotations

import random
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from envs.plan import attention_core, expert_layers
from profilers.families import (
    RANGES,
    FamilySpec,
    parse_rule,
    sample,
    sample_family,
    sample_family_specs,
)
from profilers.spec import SpecError, build_model, graph_from_spec, knobs, parse_spec, sample_specs
from profilers.zoo import FAMILIES, SIZES

warnings.filterwarnings("ignore")

NEW = ("vit", "llama", "t5", "dlrm", "twotower", "convnext", "diffusion")

# Ranges that keep each family tiny, so a draw traces in about a second.
TINY = {
    "mlp": {"layers": [1, 3], "hidden": [32, 128], "in_dim": [16, 64], "batch": [2, 8]},
    "resnet": {"depth": {"choices": [10, 18]}, "width": [8, 16], "img": [32, 64], "batch": [2, 4]},
    "inception": {"blocks": [2, 3], "width": [8, 16], "img": [32, 48], "batch": [2, 4]},
    "gnmt": {"layers": [2, 3], "hidden": [32, 64], "vocab": [100, 500], "seq": [4, 8], "batch": [2, 4]},
    "gpt": {"layers": [1, 2], "hidden": [64, 256], "seq": [8, 32], "vocab": 256, "batch": [1, 4]},
    "bert": {"layers": [1, 2], "hidden": [64, 256], "seq": [8, 32], "vocab": 256, "batch": [1, 4]},
    "moe": {"layers": [1, 2], "hidden": [64, 128], "experts": [2, 4], "seq": [8, 16], "vocab": 256, "batch": [1, 2]},
    "unet": {"levels": [2, 3], "width": [4, 8], "img": [16, 32], "batch": [1, 2]},
    "vit": {"img": [32, 64], "patch": {"choices": [8, 16]}, "layers": [1, 2], "hidden": [64, 128], "classes": 10,
            "batch": [1, 4]},
    "llama": {"layers": [1, 2], "hidden": [64, 256], "vocab": 256, "seq": [8, 32], "batch": [1, 4]},
    "t5": {"layers": [1, 2], "hidden": [64, 128], "vocab": 256, "seq": [8, 16], "tgt_seq": [4, 8], "batch": [1, 2]},
    "dlrm": {"tables": [2, 4], "rows": [100, 1000], "dim": [8, 16], "bottom": [16, 32], "top": [16, 32],
             "pooling": [1, 2], "batch": [4, 16]},
    "twotower": {"user_tables": [1, 3], "item_tables": [1, 2], "rows": [100, 1000], "dim": [8, 16],
                 "hidden": [16, 32], "out": [8, 16], "batch": [4, 16]},
    "convnext": {"depth": {"choices": [1, 2]}, "width": {"choices": [8, 16]}, "img": [32, 64], "classes": 10,
                 "batch": [1, 2]},
    "diffusion": {"img": [16, 32], "width": [16, 32], "levels": [2, 3], "blocks": 1, "attn": 1,
                  "heads": {"choices": [2, 4]}, "batch": [1, 2]},
}


def _values(spec: str) -> dict:
    family, values = parse_spec(spec)
    return {**knobs(family), **values}


def test_catalogue_is_complete():
    assert len(FAMILIES) >= 13 and set(NEW) <= set(FAMILIES)
    assert set(RANGES) == set(FAMILIES) == set(SIZES) == set(TINY)
    for fam, r in RANGES.items():
        assert set(r.knobs) <= set(knobs(fam)), fam
        assert {"small", "medium", "large"} <= set(SIZES[fam]), fam
        for size in ("small", "medium", "large"):
            assert set(SIZES[fam][size]) <= set(knobs(fam)), (fam, size)


def _names(g, prefix):
    return [n for n in g.names if n.startswith(prefix)]


def _structure(family: str, g, v: dict) -> None:
    """What a traced draw of each new family must show (module paths, attention cores, parameters)."""
    core = [g.names[i] for i in np.flatnonzero(attention_core(g))]
    if family == "llama":
        L, h, heads, kv = v["layers"], v["hidden"], v["heads"], v["kv_heads"]
        assert core == [f"layers.{i}.attn.sdpa" for i in range(L)]
        assert {f"layers.{L - 1}.attn.rope", f"layers.{L - 1}.mlp.gate", f"layers.{L - 1}.mlp.down", "lm_head"} \
            <= set(g.names)
        assert g.kinds.count("rmsnorm") == 2 * L + 1 and g.meta["heads"] == heads
        qkv = g.names.index("layers.0.attn.qkv")
        assert g.param_bytes[qkv] == 2 * h * (heads + 2 * kv) * (h // heads)  # grouped-query attention
    elif family == "t5":
        assert len(core) == 3 * v["layers"] and f"decoder.layers.{v['layers'] - 1}.cross_attn.kv" in g.names
        assert g.meta["shared_params"]  # one token embedding for encoder and decoder
    elif family == "vit":
        assert g.kinds[1] == "conv2d" and len(core) == v["layers"] and "patch_embed.cat" in g.names
    elif family == "dlrm":
        assert _names(g, "embeddings.") == [f"embeddings.{i}" for i in range(v["tables"])]
        assert "interaction" in g.names and not core
    elif family == "twotower":
        assert len(_names(g, "user.embeddings.")) == v["user_tables"] and f"item.mlp.{2 * v['layers']}" in g.names
    elif family == "diffusion":  # attention in the lowest level on the way down and up, and twice in the middle
        assert "time.fc1" in g.names and len(core) == 4 and "groupnorm" in g.kinds
    elif family == "convnext":
        assert "stages.3.2.dwconv" in g.names and g.kinds.count("conv2d") == 1 + 3 + (3 + 3 + v["depth"] + 3)  # stem, down, dwconv
    elif family == "moe":
        assert (expert_layers(g)[0] >= 0).any()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_traces_a_small_draw(family):
    spec = FamilySpec(model=family, knobs=TINY[family]).sample(1)
    assert spec == FamilySpec(model=family, knobs=TINY[family]).sample(1)
    g = graph_from_spec(spec)
    g.validate()
    assert g.num_nodes > 5 and g.fwd_flops.sum() > 0 and g.param_bytes.sum() > 0
    v = _values(spec)
    assert g.batch_size == v["batch"]
    _structure(family, g, v)


def test_sampler_is_deterministic():
    for fam in FAMILIES:
        a = [sample_family(fam, s) for s in range(4)]
        assert a == [sample_family(fam, s) for s in range(4)]
        assert len(set(a)) > 1, fam
        assert all(s.startswith(fam + ":") for s in a)
    assert sample_family("llama", random.Random(5)) == sample_family("llama", random.Random(5))
    assert sample_family("llama", np.random.default_rng(5)) == sample_family("llama", np.random.default_rng(5))
    mix = [{"model": "gpt", "weight": 1}, {"model": "vit", "weight": 3}, "dlrm"]
    assert sample_family_specs(mix, 12, seed=3) == sample_family_specs(mix, 12, seed=3)
    assert sample_family_specs(mix, 12, seed=3) != sample_family_specs(mix, 12, seed=4)
    assert sample_specs("gpt,llama,dlrm", 5, seed=2, size="realistic") == \
        sample_specs(["gpt", "llama", "dlrm"], 5, seed=2, size="realistic")
    assert sample("llama", 9) == sample_family("llama", 9) == sample({"model": "llama"}, 9)
    with pytest.raises(SpecError, match="seed"):
        sample_family("gpt", "seven")


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**62))
def test_constraints_hold_for_every_draw(seed):
    for fam, r in RANGES.items():
        spec = sample_family(fam, seed)
        values = _values(spec)
        for text in r.rules:
            assert parse_rule(text).check(values), (spec, text)
        for name, knob in r.knobs.items():
            v = values[name]
            assert v > 0
            if knob.per is None and knob.choices is not None:
                assert v in knob.choices, (spec, name)
            elif knob.per is None:
                assert knob.lo <= v <= knob.hi, (spec, name)
                if knob.step > 1:
                    assert v % knob.step == 0, (spec, name)
        lo, hi = RANGES[fam].knobs["batch"].lo, RANGES[fam].knobs["batch"].hi
        assert lo <= values["batch"] <= hi


def test_realistic_draws_build_on_meta():
    for fam in FAMILIES:
        if fam == "moe":
            continue  # hundreds of experts: slow to build, checked by its constraints above
        module, _, _ = build_model(sample_family(fam, 0))
        assert all(p.device.type == "meta" for p in module.parameters())


def test_draws_cover_the_ranges():
    draws = [_values(sample_family("llama", s)) for s in range(300)]
    col = {k: np.array([d[k] for d in draws]) for k in draws[0]}
    assert col["layers"].min() <= 8 and col["layers"].max() >= 40
    assert col["hidden"].min() <= 768 and col["hidden"].max() >= 6144
    assert col["seq"].min() <= 768 and col["seq"].max() >= 3584
    assert col["batch"].min() <= 16 and col["batch"].max() >= 384
    assert set(col["vocab"]) == {32000, 32768, 128256, 151936}
    assert (col["kv_heads"] < col["heads"]).any() and (col["kv_heads"] == col["heads"]).any()
    head = col["hidden"] // col["heads"]
    assert set(np.unique(head)) <= {64, 128} and len(np.unique(head)) == 2
    ratio = col["ffn"] / col["hidden"]
    assert ratio.min() >= 2.4 and ratio.max() <= 3.7
    vit = [_values(sample_family("vit", s)) for s in range(60)]
    assert {d["img"] for d in vit} == {224, 256, 384} and {d["patch"] for d in vit} == {14, 16}
    dl = np.array([_values(sample_family("dlrm", s))["rows"] for s in range(100)])
    assert dl.min() < 3e5 and dl.max() > 3e6  # log-uniform over 1e5..1e7


def test_sizes_span_small_to_large():
    draws = [sample_family("gpt", s) for s in range(40)]
    size = [_values(d)["layers"] * _values(d)["hidden"] ** 2 for d in draws]
    params = [sum(p.numel() for p in build_model(draws[i])[0].parameters())
              for i in (int(np.argmin(size)), int(np.argmax(size)))]
    assert params[0] < 3e8 and params[1] > 1e10  # host-bound small ones and memory-tight big ones


@pytest.mark.parametrize("spec,match", [
    ({"model": "llama", "knobs": {"layerz": 3}}, r"llama: unknown knob 'layerz'; knobs: layers"),
    ({"model": "llama", "knobs": {"layers": 0}}, r"llama: knob layers=0 is out of range"),
    ({"model": "llama", "knobs": {"layers": [8, 4]}}, r"llama: knob layers: range \[8, 4\] has lo > hi"),
    ({"model": "gpt", "knobs": {"hidden": "wide"}}, r"gpt: knob hidden must be a number"),
    ({"model": "gpt", "knobs": {"layers": 2.5}}, r"gpt: knob layers must be an integer"),
    ({"model": "gpt", "knobs": {"layers": [1, 2, 3]}}, r"gpt: knob layers: a range is \[lo, hi\]"),
    ({"model": "gpt", "knobs": {"layers": {"choices": []}}}, r"gpt: knob layers: choices"),
    ({"model": "gpt", "knobs": {"heads": 12, "hidden": 1000}}, r"gpt: knob heads: .*'heads \| hidden'.*hidden=1000"),
    ({"model": "llama", "knobs": {"heads": 32, "kv_heads": 3}}, r"llama: knob kv_heads: .*'kv_heads \| heads'"),
    ({"model": "gpt", "knobs": {"heads": 12, "hidden": {"choices": [768, 1000]}}},
     r"gpt: knob hidden: choice 1000 is never valid \(it fails 'heads \| hidden'"),
    ({"model": "moe", "knobs": {"topk": 4, "experts": [2, 3]}}, r"moe: knob experts: .*'topk <= experts'"),
    ({"model": "vit", "knobs": {"patch": 14, "img": {"choices": [224, 256]}}}, r"vit: knob img: choice 256 is never"),
    ({"model": "vit", "knobs": {"patch": 14, "img": 256}}, r"vit: knob img: no value in 256 .*patch=14"),
    ({"model": "unet", "knobs": {"dims": 4}}, r"unet: knob dims=4 is out of range"),
    # a block count far above any published network would trace for hours: refused before anything is traced
    ({"model": "gpt", "knobs": {"layers": [1, 100000]}}, r"gpt: knob layers hi=100000 is out of range: .*\[1, 2048\]"),
    ({"model": "resnet", "knobs": {"depth": 5000}}, r"resnet: knob depth=5000 is out of range: .*\[10, 2048\]"),
    ({"model": "hf:llama", "knobs": {"num_hidden_layers": [2, 10**5]}}, r"hf:llama: knob num_hidden_layers hi="),
    ({"model": "gpt", "constraints": ["layers |"]}, r"gpt: bad constraint"),
    ({"model": "gpt", "constraints": ["depth | hidden"]}, r"gpt: constraint 'depth \| hidden' names unknown knob"),
    ({"model": "nope"}, r"unknown model family 'nope'; families: bert"),
    ({"model": "gpt:layers=2"}, r"give knobs under knobs"),
    ({"model": "gpt", "weight": 0}, r"weight"),
    ({"model": "gpt", "size": 3}, r"size"),
])
def test_family_spec_errors_are_one_line(spec, match):
    with pytest.raises(SpecError, match=match) as info:
        FamilySpec.parse(spec)
    assert "\n" not in str(info.value)


def test_block_counts_are_limited_in_spec_strings_too():
    from profilers.spec import MAX_REPEAT, graph_from_spec

    model = Path(__file__).resolve().parents[1] / "experiments" / "models" / "mixer.py"
    for spec in ("gpt:layers=100000", "hf:llama:num_hidden_layers=5000", f"{model}:build:layers=100000"):
        with pytest.raises(SpecError, match=r"layers=\d+ .*<= 2048"):
            graph_from_spec(spec)
    with pytest.raises(SpecError, match=r"knob layers hi=100000 is out of range"):  # a builder's `layers` too
        FamilySpec.parse({"model": f"{model}:build", "knobs": {"layers": [1, 100000]}})
    assert FamilySpec.parse({"model": "resnet", "knobs": {"depth": [18, 1202]}})  # ResNet-1202 stays drawable
    assert FamilySpec.parse({"model": "gpt", "knobs": {"layers": [1, MAX_REPEAT], "seq": [128, 10**6]}})


def test_range_snaps_to_valid_values():
    fs = FamilySpec(model="llama", knobs={"heads": 12, "hidden": [512, 4096], "layers": 4, "seq": 128})
    for s in range(20):
        v = _values(fs.sample(s))
        assert v["heads"] == 12 and v["hidden"] % 24 == 0 and v["heads"] % v["kv_heads"] == 0
        assert v["layers"] == 4 and v["seq"] == 128
    assert fs.ranges()["heads"] == "12" and fs.ranges()["kv_heads"] == "heads / {1, 2, 4, 8}"
    vit = FamilySpec(model="vit", knobs={"patch": 16, "img": [200, 300], "mlp_ratio": [2, 4]})
    for s in range(10):
        v = _values(vit.sample(s))
        assert v["img"] % 16 == 0 and 200 <= v["img"] <= 300 and 2 <= v["mlp_ratio"] <= 4
    fs = FamilySpec(model="gpt", knobs={"layers": {"lo": 2, "hi": 40, "step": 2, "log": False}},
                    constraints=["layers <= 2 * heads"])
    for s in range(10):
        v = _values(fs.sample(s))
        assert v["layers"] % 2 == 0 and v["layers"] <= 2 * v["heads"]


def test_user_file_family(tmp_path):
    f = tmp_path / "my_model.py"
    f.write_text(textwrap.dedent("""
        import torch, torch.nn as nn

        class Net(nn.Module):
            def __init__(self, layers, hidden, heads):
                super().__init__()
                self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
                self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))

            def forward(self, x):
                x = self.attn(x, x, x, need_weights=False)[0]
                for layer in self.layers:
                    x = torch.relu(layer(x))
                return x

        def build(layers=2, hidden=32, heads=4, batch=2, seq=8):
            return Net(layers, hidden, heads), (torch.randn(batch, seq, hidden),)
    """))
    fs = FamilySpec(model=f"{f}:build", knobs={"layers": [1, 4], "hidden": {"choices": [32, 48, 64]},
                                                "heads": [2, 8], "batch": [2, 16]},
                    constraints=["heads | hidden"])
    specs = [fs.sample(s) for s in range(8)]
    assert specs == [fs.sample(s) for s in range(8)]
    for spec in specs:
        assert spec.startswith(f"{f}:build:layers=")
        kw = dict(p.split("=") for p in spec.rsplit(":", 1)[1].split(","))
        kw = {k: int(v) for k, v in kw.items()}
        assert 1 <= kw["layers"] <= 4 and kw["hidden"] % kw["heads"] == 0 and 2 <= kw["batch"] <= 16
    g = graph_from_spec(specs[0])
    kw = {k: int(v) for k, v in (p.split("=") for p in specs[0].rsplit(":", 1)[1].split(","))}
    assert g.batch_size == kw["batch"] and g.kinds.count("linear") >= kw["layers"]
    with pytest.raises(SpecError, match=r"unknown knob 'depth'; build\(\) accepts: layers, hidden, heads, batch, seq"):
        FamilySpec(model=f"{f}:build", knobs={"depth": [1, 2]})
    with pytest.raises(SpecError, match=r"knob heads: .*'heads \| hidden'"):
        FamilySpec(model=f"{f}:build", knobs={"hidden": 30, "heads": 4}, constraints=["heads | hidden"])
    with pytest.raises(SpecError, match="no function 'nothere'"):
        FamilySpec(model=f"{f}:nothere")


def test_file_spec_keyword_knobs(tmp_path):
    f = tmp_path / "net.py"
    f.write_text(textwrap.dedent("""
        import torch, torch.nn as nn

        def build(layers=1, width=8, batch=3):
            body = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())]
            return nn.Sequential(*body), (torch.randn(batch, width),)

        def anything(**kw):
            return nn.Linear(kw.get("width", 4), 2), (torch.randn(2, kw.get("width", 4)),)
    """))
    g = graph_from_spec(f"{f}:build:layers=3,width=16,batch=5")
    assert g.kinds == ["input"] + ["linear", "relu"] * 3 and g.batch_size == 5
    assert graph_from_spec(f"{f}:build").kinds == ["input", "linear", "relu"]
    assert graph_from_spec(f"{f}:anything:width=6").param_bytes.sum() == 2 * (6 * 2 + 2)
    with pytest.raises(SpecError, match=r"build\(\) takes no knob 'depth'; it accepts: layers, width, batch"):
        graph_from_spec(f"{f}:build:depth=2")
    with pytest.raises(SpecError, match="must be a number"):
        graph_from_spec(f"{f}:build:layers=many")
    with pytest.raises(SpecError, match="key=value"):
        graph_from_spec(f"{f}:build:layers")
    with pytest.raises(SpecError, match="integer"):
        graph_from_spec(f"{f}:build:layers=1.5")


def test_hf_family_spec():
    pytest.importorskip("transformers")
    fs = FamilySpec(model="hf:llama", knobs={"num_hidden_layers": [1, 4], "hidden_size": [64, 256],
                                             "seq": [16, 64], "batch": 2})
    for s in range(10):
        spec = fs.sample(s)
        assert spec.startswith("hf:llama:") and spec == fs.sample(s)
        kw = {k: int(v) for k, v in (p.split("=") for p in spec.split(":", 2)[2].split(","))}
        assert kw["hidden_size"] % 8 == 0 and 16 <= kw["seq"] <= 64  # 2 x 4 heads divide it (rotary)
    with pytest.raises(SpecError, match="hf:llama: unknown knob 'layers'; numeric config keys"):
        FamilySpec(model="hf:llama", knobs={"layers": 3})
    with pytest.raises(SpecError, match="unknown transformers config 'nope'"):
        FamilySpec(model="hf:nope")


# ---------------------------------------------------------------------------- the new zoo members
def _params(spec: str) -> int:
    module, _, _ = build_model(spec)
    return sum(p.numel() for p in module.parameters())


def test_published_sizes():
    vit_b = "vit:img=224,patch=16,layers=12,hidden=768,heads=12,classes=1000,batch=1"
    assert abs(_params(vit_b) - 86.57e6) < 0.1e6
    module, inputs, _ = build_model(vit_b)
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        module(*inputs)
    assert abs(fc.get_total_flops() / 2 - 17.5e9) < 0.4e9  # multiply-adds per image
    llama_7b = "llama:layers=32,hidden=4096,heads=32,kv_heads=32,ffn=11008,vocab=32000,seq=4096"
    assert abs(_params(llama_7b) - 6.74e9) < 0.01e9
    assert abs(_params("llama:layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,vocab=128256") - 70.55e9) < 0.1e9
    assert abs(_params("convnext:depth=9,width=96,img=224,classes=1000") - 28.59e6) < 0.1e6
    assert abs(_params("t5:layers=12,hidden=768,heads=12,ffn=3072,vocab=32128") - 247.6e6) < 0.5e6
    dlrm = "dlrm:tables=26,rows=10000000,dim=128,bottom=512,bottom_layers=2,top=1024,top_layers=3"
    module, _, _ = build_model(dlrm)
    emb = sum(p.numel() for n, p in module.named_parameters() if n.startswith("embeddings."))
    assert emb == 26 * 10**7 * 128 and emb / _params(dlrm) > 0.999


def test_new_family_errors():
    with pytest.raises(SpecError, match="divisible by kv_heads"):
        build_model("llama:heads=4,kv_heads=3")
    with pytest.raises(SpecError, match="divisible by patch"):
        build_model("vit:img=30,patch=8")
    with pytest.raises(SpecError, match=r"2\*\*\(levels - 1\)"):
        build_model("diffusion:img=18,levels=3")


def test_cli_profile_new_family(tmp_path, capsys):
    from agent.cli import main

    assert main(["profile", "--model", "vit:layers=1,hidden=32,heads=2", "-o", str(tmp_path / "g.json")]) == 0
    assert "GFLOP" in capsys.readouterr().out
