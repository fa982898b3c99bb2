"""A GraphGPS-style graph transformer (Rampasek et al., "Recipe for a General, Powerful, Scalable Graph
Transformer", NeurIPS 2022) on one fixed random graph: every layer adds a local message-passing branch and a
global attention branch, then a feed-forward block. The local branch is Dwivedi & Bresson's sparse graph
attention ("A Generalization of Transformer Networks to Graphs", 2020): per-edge scores q[dst] . k[src],
softmax over each node's incoming edges (max by scatter_reduce, normaliser and messages summed with
index_add_), values gathered along the edge_index tensor; the global branch is full multi-head self-attention
over all nodes. Inputs are the node features and the (2, edges) long edge_index built in ``build()``. A user model file for the zero-shot
benchmarks (``experiments/bench_user_models.py``)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class SparseEdgeAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, edge_index):
        n, d = x.shape
        h, dh = self.heads, d // self.heads
        src, dst = edge_index[0], edge_index[1]
        q, k, v = self.qkv(x).view(n, 3, h, dh).unbind(1)
        score = (q[dst] * k[src]).sum(-1) * dh ** -0.5  # (edges, heads)
        index = dst[:, None].expand_as(score)
        peak = torch.full((n, h), -1e4, device=x.device, dtype=score.dtype)
        peak = peak.scatter_reduce(0, index, score, reduce="amax", include_self=True)
        weight = torch.exp(score - peak[dst])
        denom = torch.zeros(n, h, device=x.device, dtype=score.dtype).index_add_(0, dst, weight)
        msg = v[src] * (weight / (denom[dst] + 1e-9))[..., None]  # (edges, heads, dh)
        agg = torch.zeros(n, h, dh, device=x.device, dtype=x.dtype).index_add_(0, dst, msg)
        return self.out(agg.reshape(n, d))


class GlobalAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        n, d = x.shape
        q, k, v = self.qkv(x).view(1, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, d))


class GPSLayer(nn.Module):
    def __init__(self, dim: int, heads: int, mult: int = 2, dropout: float = 0.1):
        super().__init__()
        self.local = SparseEdgeAttention(dim, heads)
        self.glob = GlobalAttention(dim, heads)
        self.norm_local = nn.LayerNorm(dim)
        self.norm_global = nn.LayerNorm(dim)
        self.drop = nn.Dropout(dropout)
        self.ffn = nn.Sequential(nn.Linear(dim, mult * dim), nn.ReLU(), nn.Dropout(dropout), nn.Linear(mult * dim, dim))
        self.norm_ffn = nn.LayerNorm(dim)

    def forward(self, x, edge_index):
        local = self.norm_local(x + self.drop(self.local(x, edge_index)))
        glob = self.norm_global(x + self.drop(self.glob(x)))
        h = local + glob
        return self.norm_ffn(h + self.drop(self.ffn(h)))


class GraphTransformer(nn.Module):
    def __init__(self, in_dim: int, dim: int, heads: int, layers: int, classes: int):
        super().__init__()
        self.inp = nn.Linear(in_dim, dim)
        self.layers = nn.ModuleList([GPSLayer(dim, heads) for _ in range(layers)])
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, classes))

    def forward(self, x, edge_index):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h, edge_index)
        return self.head(h)


def build(nodes: int = 4096, edges: int = 65536, in_dim: int = 128, dim: int = 256, heads: int = 8, layers: int = 10,
          classes: int = 40):
    g = torch.Generator().manual_seed(0)
    edge_index = torch.randint(0, nodes, (2, edges), generator=g)
    return GraphTransformer(in_dim, dim, heads, layers, classes), (torch.randn(nodes, in_dim), edge_index)
