"""A DLRM recommendation model (Naumov et al., 2019): sum-pooled ``EmbeddingBag`` tables for the sparse
features, a bottom MLP for the dense ones, pairwise dot-product interactions and a top MLP.
A user model file for the zero-shot benchmarks (``experiments/bench_user_models.py``)."""

import torch
import torch.nn as nn


class DLRM(nn.Module):
    def __init__(self, tables: int, rows: int, dim: int, dense: int):
        super().__init__()
        self.bags = nn.ModuleList([nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(tables)])
        self.bot = nn.Sequential(nn.Linear(dense, 512), nn.ReLU(), nn.Linear(512, dim))
        n = tables + 1
        self.top = nn.Sequential(nn.Linear(n * (n - 1) // 2 + dim, 1024), nn.ReLU(), nn.Linear(1024, 1))

    def forward(self, dense, idx):
        z = [self.bot(dense)] + [bag(idx[:, i]) for i, bag in enumerate(self.bags)]
        t = torch.stack(z, 1)
        inter = torch.bmm(t, t.transpose(1, 2))
        iu = torch.triu_indices(t.shape[1], t.shape[1], 1)
        return self.top(torch.cat([z[0], inter[:, iu[0], iu[1]]], 1))


def build(tables: int = 26, rows: int = 1000000, dim: int = 128, dense: int = 13, pooling: int = 20,
          batch: int = 2048):
    inputs = (torch.randn(batch, dense), torch.randint(0, rows, (batch, tables, pooling)))
    return DLRM(tables, rows, dim, dense), inputs
