"""profilers.trace: the GEMMs a traced graph lists per node (shapes for the cost model)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import profilers.trace as trace_mod
from envs.graph import GEMM_DENSE, GEMM_PER_HEAD, OpGraph
from envs.plan import single_device_plan
from envs.presets import preset
from envs.sim import simulate
from profilers.spec import graph_from_spec
from profilers.trace import trace

warnings.filterwarnings("ignore")
GPT_SPEC = "gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128,batch=8"


def _rows(g: OpGraph, name: str) -> list[tuple]:
    return g.gemms_of(g.index(name))


def _gemm_flops(rows) -> float:
    return sum(2.0 * m * n * k * b for m, n, k, b, _ in rows)


def _assert_rows_within_flops(g: OpGraph) -> None:
    for v in range(g.num_nodes):
        rows = g.gemms_of(v)
        assert _gemm_flops(rows) <= g.fwd_flops[v] * (1 + 1e-6), g.names[v]


def test_linear_mlp_one_dense_row_per_linear():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    g = trace(model, (torch.randn(4, 5, 16),), batch_size=4)
    assert _rows(g, "0") == [(20.0, 32.0, 16.0, 1.0, GEMM_DENSE)]  # m = batch x leading dims
    assert _rows(g, "2") == [(20.0, 8.0, 32.0, 1.0, GEMM_DENSE)]
    assert _rows(g, "1") == [] and _rows(g, "input.input") == []
    assert g.num_gemms == 2
    for name in ("0", "2"):
        assert _gemm_flops(_rows(g, name)) == pytest.approx(g.fwd_flops[g.index(name)], rel=0.01)
    assert g.meta["gemm_flops"] == pytest.approx(_gemm_flops(_rows(g, "0") + _rows(g, "2")))
    assert g.meta["gemm_rejected"] == []


def test_conv_implicit_gemm_rows():
    class Convs(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = nn.Conv2d(3, 8, 3, stride=2, padding=1)
            self.c2 = nn.Conv2d(8, 16, 3, padding=1, groups=4, bias=False)
            self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
            self.up = nn.ConvTranspose2d(16, 4, 2, stride=2)
            self.c3 = nn.Conv1d(4, 6, 5)

        def forward(self, x):
            y = self.up(self.dw(self.c2(self.c1(x))))  # (2, 4, 16, 16)
            return self.c3(y.flatten(2))  # (2, 4, 256) -> (2, 6, 252)

    g = trace(Convs(), (torch.randn(2, 3, 16, 16),), batch_size=2)
    # m = N x H_out x W_out, n = C_out / groups, k = C_in / groups x kernel, batch = groups
    assert _rows(g, "c1") == [(2 * 8 * 8, 8, 3 * 9, 1, GEMM_DENSE)]
    assert _rows(g, "c2") == [(2 * 8 * 8, 4, 2 * 9, 4, GEMM_DENSE)]
    assert _rows(g, "dw") == [(2 * 8 * 8, 1, 9, 16, GEMM_DENSE)]
    # transposed: m = N x input pixels, n = C_out / groups x kernel, k = C_in / groups
    assert _rows(g, "up") == [(2 * 8 * 8, 4 * 4, 16, 1, GEMM_DENSE)]
    assert _rows(g, "c3") == [(2 * 252, 6, 4 * 5, 1, GEMM_DENSE)]
    for name in ("c1", "c2", "dw", "up", "c3"):
        assert _gemm_flops(_rows(g, name)) == pytest.approx(g.fwd_flops[g.index(name)], rel=1e-9), name


class _SelfAttention(nn.Module):
    def __init__(self, hidden: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, h))


def test_sdpa_two_per_head_rows():
    b, s, heads, d = 3, 6, 4, 8
    g = trace(_SelfAttention(hidden=heads * d, heads=heads), (torch.randn(b, s, heads * d),), batch_size=b)
    sdpa = [v for v, k in enumerate(g.kinds) if k == "sdpa"]
    assert len(sdpa) == 1
    rows = g.gemms_of(sdpa[0])
    assert rows == [(s, s, d, b * heads, GEMM_PER_HEAD), (s, d, s, b * heads, GEMM_PER_HEAD)]
    assert _gemm_flops(rows) == pytest.approx(g.fwd_flops[sdpa[0]], rel=0.01)
    assert _rows(g, "qkv") == [(b * s, 3 * heads * d, heads * d, 1, GEMM_DENSE)]
    assert _rows(g, "out") == [(b * s, heads * d, heads * d, 1, GEMM_DENSE)]


def test_cross_attention_sequence_lengths():
    class Cross(nn.Module):
        def forward(self, q, kv):
            return F.scaled_dot_product_attention(q, kv, kv[..., :4])  # d_v = 4

    q, kv = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8)
    g = trace(Cross(), (q, kv), batch_size=2)
    (v,) = [v for v, k in enumerate(g.kinds) if k == "sdpa"]
    assert g.gemms_of(v) == [(5, 7, 8, 6, GEMM_PER_HEAD), (5, 4, 7, 6, GEMM_PER_HEAD)]


def test_bmm_of_two_activations_is_per_head():
    class Gram(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 6)

        def forward(self, x):
            return torch.bmm(x.transpose(1, 2), self.fc(x))  # (3, 5, 4) @ (3, 4, 6)

    g = trace(Gram(), (torch.randn(3, 4, 5),), batch_size=3)
    (v,) = [v for v, k in enumerate(g.kinds) if k == "matmul"]
    assert g.gemms_of(v) == [(5, 6, 4, 3, GEMM_PER_HEAD)]
    assert _rows(g, "fc") == [(12, 6, 5, 1, GEMM_DENSE)]
    _assert_rows_within_flops(g)


def test_matmul_with_parameter_operand_is_dense():
    class Weights(nn.Module):
        def __init__(self):
            super().__init__()
            self.w_right = nn.Parameter(torch.randn(8, 12))
            self.w_left = nn.Parameter(torch.randn(10, 12))
            self.experts = nn.Parameter(torch.randn(4, 10, 6))

        def forward(self, x):  # x: (2, 7, 8)
            y = x @ self.w_right  # (2, 7, 12): weight on the right
            z = self.w_left @ y.transpose(1, 2)  # (2, 10, 7): weight on the left, samples are the columns
            e = z.permute(2, 0, 1).reshape(7, 2, 10)[:4].contiguous()  # (4, 2, 10): 4 "experts" x 2 tokens
            return torch.bmm(e, self.experts)  # per-expert weights: batch = experts

    g = trace(Weights(), (torch.randn(2, 7, 8),), batch_size=2)
    rows = [row for v in range(g.num_nodes) for row in g.gemms_of(v)]
    assert (14, 12, 8, 1, GEMM_DENSE) in rows
    assert (14, 10, 12, 1, GEMM_DENSE) in rows
    assert (2, 6, 10, 4, GEMM_DENSE) in rows
    assert len(rows) == 3
    _assert_rows_within_flops(g)


def test_fused_leaf_module_carries_union_of_member_gemms():
    class TwoMatmuls(nn.Module):  # a leaf module (no submodules) exporting as several ops: one node
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(16, 24))
            self.w2 = nn.Parameter(torch.randn(24, 8))

        def forward(self, x):
            return torch.relu(x @ self.w1) @ self.w2

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = TwoMatmuls()
            self.head = nn.Linear(8, 4)

        def forward(self, x):
            return self.head(self.block(x))

    g = trace(Net(), (torch.randn(5, 16),), batch_size=5)
    v = g.index("block")
    assert g.n_ops[v] >= 3
    assert sorted(g.gemms_of(v)) == sorted([(5, 24, 16, 1, GEMM_DENSE), (5, 8, 24, 1, GEMM_DENSE)])
    assert _rows(g, "head") == [(5, 4, 8, 1, GEMM_DENSE)]
    assert g.num_gemms == 3  # nothing lost, nothing duplicated
    _assert_rows_within_flops(g)


def test_gemms_exceeding_counted_flops_are_dropped(monkeypatch):
    count = trace_mod._count_node_flops

    def halved(ep):
        flops, failed = count(ep)
        return {n: f / 2 for n, f in flops.items()}, failed

    monkeypatch.setattr(trace_mod, "_count_node_flops", halved)
    g = trace(nn.Sequential(nn.Linear(16, 32), nn.ReLU()), (torch.randn(4, 16),), batch_size=4)
    assert g.num_gemms == 0 and g.meta["gemm_rejected"] == ["linear"] and g.meta["gemm_flops"] == 0.0


def test_zoo_gpt_gemms_and_simulated_step_time():
    g = graph_from_spec(GPT_SPEC)
    b, s, h, heads, vocab = 8, 16, 64, 4, 128
    linear = [v for v, k in enumerate(g.kinds) if k == "linear"]
    assert len(linear) == 2 * 4 + 1
    for v in linear:
        rows = g.gemms_of(v)
        assert len(rows) == 1 and rows[0][4] == GEMM_DENSE and rows[0][0] == b * s, g.names[v]
        assert _gemm_flops(rows) == pytest.approx(g.fwd_flops[v], rel=0.01)
    assert _rows(g, "lm_head") == [(b * s, vocab, h, 1, GEMM_DENSE)]
    assert _rows(g, "layers.0.mlp.fc1") == [(b * s, 4 * h, h, 1, GEMM_DENSE)]
    d = h // heads
    assert _rows(g, "layers.1.attn.sdpa") == [(s, s, d, b * heads, GEMM_PER_HEAD),
                                               (s, d, s, b * heads, GEMM_PER_HEAD)]
    gemm_nodes = set(g.gemm_node.tolist())
    assert gemm_nodes == set(linear) | {v for v, k in enumerate(g.kinds) if k == "sdpa"}
    _assert_rows_within_flops(g)
    topo = preset("dgx-a100-80g")
    t = simulate(g, topo, single_device_plan(g, topo), "step_time").value
    assert math.isfinite(t) and t > 0


def test_saved_graph_keeps_gemms(tmp_path):
    g = graph_from_spec(GPT_SPEC)
    assert g.num_gemms > 0
    g.save(tmp_path / "g.json")
    h = OpGraph.load(tmp_path / "g.json")
    np.testing.assert_array_equal(h.gemm_node, g.gemm_node)
    np.testing.assert_array_equal(h.gemm_shape, g.gemm_shape)
    np.testing.assert_array_equal(h.gemm_kind, g.gemm_kind)
