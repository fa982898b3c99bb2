"""profilers.trace: torch.export on the meta device -> OpGraph."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from envs.errors import RlplaceError
from envs.graph import CAN_COL, CAN_ROW
from profilers.trace import TraceError, trace
from profilers.zoo import gnmt, gpt, inception, mlp, resnet

warnings.filterwarnings("ignore")
NO_WORK = {"view", "reshape", "transpose", "t", "permute", "getitem", "expand", "unsqueeze", "split",
           "unbind", "detach", "clone", "alias", "contiguous", "slice", "select"}


def _meta_total_flops(model: nn.Module, inputs: tuple, dtype=torch.bfloat16) -> int:
    with torch.device("meta"):
        m = model.to("meta", dtype)
    args = tuple(x.to("meta", dtype) if x.is_floating_point() else x.to("meta") for x in inputs)
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        m(*args)
    return fc.get_total_flops()


def _param_bytes(model: nn.Module, dbytes: int = 2) -> float:
    tot = sum(p.numel() * dbytes for p in model.parameters())
    tot += sum(b.numel() * (dbytes if b.is_floating_point() else b.element_size()) for b in model.buffers())
    return float(tot)


def test_mlp_nodes_bytes_and_edges():
    model, inputs = mlp(layers=3, hidden=256, in_dim=784, out=10, batch=32)
    g = trace(model, inputs, batch_size=32)
    assert g.num_nodes == 8 and g.num_edges == 7  # input, 4 linear, 3 relu
    assert g.kinds.count("linear") == 4 and g.kinds.count("relu") == 3 and g.kinds[0] == "input"
    assert g.names[:3] == ["input.x", "layers.0.fc", "layers.0.act"]
    assert g.batch_size == 32 and g.dtype == "bf16"
    assert g.out_bytes[0] == 32 * 784 * 2  # float input cast to bf16
    assert g.out_bytes[g.index("layers.0.fc")] == 32 * 256 * 2
    assert g.out_bytes[g.index("head")] == 32 * 10 * 2
    assert g.fwd_flops[g.index("layers.0.fc")] == 2 * 32 * 784 * 256
    assert g.fwd_flops[0] == 0
    np.testing.assert_array_equal(g.edge_bytes, g.out_bytes[g.edge_src])  # chain: whole tensor moves
    # bwd default: 2x for ops with weights, 1x otherwise
    i = g.index("layers.1.act")
    assert g.bwd_flops[i] == g.fwd_flops[i] and g.bwd_flops[1] == 2 * g.fwd_flops[1]
    li = g.index("layers.1.fc")
    in_b = g.edge_bytes[g.edge_dst == li].sum()
    assert g.mem_bytes[li] == in_b + g.out_bytes[li] + g.param_bytes[li]
    assert g.layout_caps[li] & CAN_COL and g.layout_caps[li] & CAN_ROW


@pytest.mark.parametrize("build", [lambda: mlp(), lambda: resnet(depth=10, width=8, img=32, batch=2),
                                   lambda: gpt(), lambda: gnmt(layers=2, hidden=32, seq=6)])
def test_flops_sum_matches_model_flop_counter(build):
    model, inputs = build()
    g = trace(model, inputs, batch_size=inputs[0].shape[0])
    total = _meta_total_flops(*build())
    assert g.meta["counted_flops"] == pytest.approx(total, rel=1e-9)
    assert g.fwd_flops.sum() == pytest.approx(g.meta["counted_flops"] + g.meta["estimated_flops"])
    # uncounted ops get a size-based cost, not zero
    work = [i for i, k in enumerate(g.kinds) if k != "input"]
    assert (g.fwd_flops[work] > 0).all()


@pytest.mark.parametrize("build", [lambda: mlp(), lambda: gpt(), lambda: gnmt(layers=2, hidden=32, seq=6),
                                   lambda: resnet(depth=10, width=8, img=32, batch=2)])
def test_every_parameter_counted_once(build):
    model, inputs = build()
    g = trace(model, inputs, batch_size=2)
    assert g.param_bytes.sum() + g.meta["unused_param_bytes"] == _param_bytes(model)
    assert g.meta["unused_param_bytes"] <= 8 * 64  # at most BatchNorm's int64 step counters


def test_param_bytes_follow_dtype():
    model, inputs = mlp(layers=2, hidden=32, in_dim=16)
    g32 = trace(model, inputs, batch_size=32, dtype="fp32")
    g16 = trace(model, inputs, batch_size=32, dtype="fp16")
    assert g32.param_bytes.sum() == _param_bytes(model, 4) == 2 * g16.param_bytes.sum()
    assert g32.out_bytes[1] == 2 * g16.out_bytes[1] and g16.dtype == "fp16"


def test_transformer_names_and_kinds():
    model, inputs = gpt(layers=2, hidden=64, heads=4, seq=16, vocab=128, batch=2)
    g = trace(model, inputs, batch_size=2, name="tiny-gpt")
    for name in ("wte", "wpe", "layers.0.ln1", "layers.0.attn.qkv", "layers.0.attn.sdpa", "layers.0.attn.out",
                 "layers.1.mlp.fc1", "layers.1.mlp.gelu", "layers.1.mlp.fc2", "ln_f", "lm_head"):
        assert name in g.names, name
    assert g.module_paths[g.index("layers.1.mlp.fc1")] == "layers.1.mlp.fc1"
    assert g.kinds[g.index("layers.0.attn.sdpa")] == "sdpa"
    assert g.kinds[g.index("layers.0.ln1")] == "layernorm"
    assert not NO_WORK & set(g.kinds)
    # qkv -> sdpa carries all of q, k and v (3 slices of one tensor)
    qkv, sdpa = g.index("layers.0.attn.qkv"), g.index("layers.0.attn.sdpa")
    e = np.flatnonzero((g.edge_src == qkv) & (g.edge_dst == sdpa))
    assert e.size == 1 and g.edge_bytes[e[0]] == g.out_bytes[qkv] == 2 * 16 * 3 * 64 * 2
    assert g.name == "tiny-gpt"


class _ScatterMessages(nn.Module):
    """Graph attention's edge softmax: a per-node max by scatter_reduce, sums by index_add_, a cumprod."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, edge_index):
        src, dst = edge_index[0], edge_index[1]
        score = self.proj(x)[src].sum(-1)
        peak = x.new_zeros(x.shape[0]).scatter_reduce(0, dst, score, reduce="amax", include_self=False)
        w = torch.exp(score - peak[dst])
        total = x.new_zeros(x.shape[0]).index_add_(0, dst, w)
        out = torch.zeros_like(x).index_add_(0, dst, x[src] * (w / total[dst]).unsqueeze(-1))
        return torch.cumprod(torch.sigmoid(out), dim=-1)


def test_scatter_ops_are_gathers():
    """Scatter and index reductions are classified with the gathers, not as kinds of their own."""
    edge_index = torch.stack([torch.arange(12) % 6, (torch.arange(12) * 5 + 1) % 6])
    g = trace(_ScatterMessages(), (torch.randn(6, 8), edge_index), batch_size=6, dtype="fp32")
    assert {"scatter_reduce", "index_add", "cumprod"}.isdisjoint(g.kinds)
    assert g.kinds.count("gather") >= 3 and "elementwise" in g.kinds


def test_lstm_and_multibranch():
    model, inputs = gnmt(layers=3, hidden=32, vocab=50, seq=5, batch=2)
    g = trace(model, inputs, batch_size=2)
    lstm = [i for i, k in enumerate(g.kinds) if k == "lstm"]
    assert len(lstm) == 6 and all(g.param_bytes[i] > 0 for i in lstm)
    assert g.names.count("input.src") == 1 and "input.tgt" in g.names
    model, inputs = inception(blocks=2, width=8, img=32, batch=2)
    g = trace(model, inputs, batch_size=2)
    cats = [i for i, k in enumerate(g.kinds) if k == "cat"]
    assert len(cats) == 2 and all((g.edge_dst == i).sum() == 4 for i in cats)


def test_real_model_left_untouched_and_no_allocation():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    w = model[0].weight.detach().clone()
    g = trace(model, (torch.randn(3, 16),), batch_size=3)
    assert g.num_nodes == 4
    assert model[0].weight.device.type == "cpu" and torch.equal(model[0].weight, w)
    assert model[0].weight.dtype == torch.float32


def test_sdpa_model_with_kwargs_inputs():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(32, 96)

        def forward(self, x, *, scale: torch.Tensor):
            q, k, v = self.proj(x).view(2, 8, 3, 4, 8).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v) * scale

    g = trace(Attn(), {"x": torch.randn(2, 8, 32), "scale": torch.ones(1)}, batch_size=2)
    assert "sdpa" in g.kinds and {"input.x", "input.scale"} <= set(g.names)


def test_data_dependent_control_flow_raises_trace_error():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            y = self.fc(x)
            if y.sum() > 0:
                return y * 2
            return y

    with pytest.raises(TraceError) as exc:
        trace(Branchy(), (torch.randn(2, 8),), batch_size=2)
    msg = str(exc.value)
    assert "torch.cond" in msg and "Branchy" in msg and "y.sum() > 0" in msg
    assert isinstance(exc.value, RlplaceError)


def test_bad_arguments():
    model, inputs = mlp()
    with pytest.raises(TraceError, match="dtype"):
        trace(model, inputs, batch_size=2, dtype="int3")
    with pytest.raises(TraceError, match="batch_size"):
        trace(model, inputs, batch_size=0)
    with pytest.raises(TraceError, match="nn.Module"):
        trace(lambda x: x, inputs, batch_size=2)


def test_json_roundtrip(tmp_path):
    model, inputs = gpt()
    g = trace(model, inputs, batch_size=2)
    g.save(tmp_path / "g.json")
    from envs.graph import OpGraph

    h = OpGraph.load(tmp_path / "g.json")
    assert h.names == g.names and np.allclose(h.fwd_flops, g.fwd_flops)


def test_model_mixing_dtypes_traces_as_under_autocast():
    """A sinusoidal timestep embedding computed in fp32 (``.float()``) feeding bf16 layers, as diffusion
    U-Nets write it: the pure-bf16 trace fails on the first layer, the autocast rule casts its input."""

    class TimestepNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.temb = nn.Linear(16, 8)
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.out = nn.Conv2d(8, 3, 3, padding=1)

        def forward(self, x, t):
            freqs = torch.exp(-torch.arange(8, device=x.device) / 8.0)
            e = t[:, None].float() * freqs[None]
            h = self.conv(x) + self.temb(torch.cat([e.sin(), e.cos()], 1))[:, :, None, None]  # fp32
            return self.out(h)

    g = trace(TimestepNet(), (torch.randn(4, 3, 8, 8), torch.randint(0, 1000, (4,))), batch_size=4)
    assert "cast" in g.kinds and "conv" in " ".join(g.kinds)


def test_mixed_precision_casts_only_mixed_calls():
    from profilers.mixed_precision import MixedPrecisionCasts

    a32, b32 = torch.randn(2, 3), torch.randn(3, 4)
    with MixedPrecisionCasts(torch.bfloat16) as mode:
        same = torch.matmul(a32, b32)  # written in fp32 on purpose: left as it is
        mixed = torch.matmul(a32, b32.bfloat16())
        lin = F.linear(a32, torch.randn(5, 3, dtype=torch.bfloat16))
    assert same.dtype == torch.float32 and mixed.dtype == torch.bfloat16 and lin.dtype == torch.bfloat16
    assert mode.casts == 2


def test_op_without_the_traced_dtype_names_the_line_and_the_fix():
    class Spectral(nn.Module):
        def __init__(self):
            super().__init__()
            self.lift = nn.Linear(8, 8)

        def forward(self, x):
            return torch.fft.rfft(self.lift(x), dim=-1).abs()

    with pytest.raises(TraceError) as exc:
        trace(Spectral(), (torch.randn(2, 8),), batch_size=2)
    msg = str(exc.value)
    assert "torch.fft.rfft" in msg and "--dtype fp32" in msg and "mixed_precision" not in msg
    g = trace(Spectral(), (torch.randn(2, 8),), batch_size=2, dtype="fp32")
    assert g.num_nodes >= 3


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without the grouped GEMM")
def test_grouped_gemm_of_fused_experts_counts_its_flops():
    """torch's grouped GEMM (the fused experts of Hugging Face MoE models: each token row times its
    expert's [K, N] weight), which FlopCounterMode leaves at zero, counts 2 x rows x K x N."""

    class FusedExperts(nn.Module):
        def __init__(self, experts: int, k: int, n: int):
            super().__init__()
            self.w = nn.Parameter(torch.randn(experts, k, n))

        def forward(self, x):
            rows = x.shape[0]
            offs = torch.arange(1, self.w.shape[0] + 1, dtype=torch.int32, device=x.device) * (rows // self.w.shape[0])
            return torch._grouped_mm(x, self.w, offs=offs)

    rows, k, n, experts = 256, 64, 128, 4
    g = trace(FusedExperts(experts, k, n), (torch.randn(rows, k),), batch_size=rows)
    grouped = [v for v in range(g.num_nodes) if "grouped" in g.names[v]]
    assert len(grouped) == 1
    assert g.fwd_flops[grouped[0]] == pytest.approx(2 * rows * k * n)
    assert g.param_bytes[grouped[0]] == pytest.approx(experts * k * n * 2)
