"""A graph convolutional network (Kipf & Welling, ICLR 2017) on one large graph: each layer sums the
neighbours' features along a fixed random edge list (gather + ``index_add`` scatter), then a linear layer
with a residual connection. A user model file for the zero-shot benchmarks
(``experiments/bench_user_models.py``)."""

import torch
import torch.nn as nn


class GCN(nn.Module):
    def __init__(self, nodes: int, edges: int, dim: int, layers: int, classes: int):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("src", torch.randint(0, nodes, (edges,), generator=g))
        self.register_buffer("dst", torch.randint(0, nodes, (edges,), generator=g))
        self.inp = nn.Linear(dim, dim)
        self.lins = nn.ModuleList([nn.Linear(dim, dim) for _ in range(layers)])
        self.out = nn.Linear(dim, classes)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        for lin in self.lins:
            m = torch.zeros_like(h).index_add(0, self.dst, h[self.src])
            h = torch.relu(lin(m)) + h
        return self.out(h)


def build(nodes: int = 100000, edges: int = 1000000, dim: int = 256, layers: int = 6, classes: int = 64):
    return GCN(nodes, edges, dim, layers, classes), (torch.randn(nodes, dim),)
