"""A gated-convolution language model in the style of the state-space LMs H3 and Mamba (Fu et al., ICLR
2023; Gu & Dao, 2023): each block runs a short causal depthwise convolution, a cumulative-sum scan scaled by
a learned decay, and a SiLU gate. A user model file for the zero-shot benchmarks
(``experiments/bench_user_models.py``)."""

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, dim: int, kernel: int = 4):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.inp = nn.Linear(dim, 4 * dim)
        self.conv = nn.Conv1d(2 * dim, 2 * dim, kernel, padding=kernel - 1, groups=2 * dim)
        self.decay = nn.Parameter(torch.rand(2 * dim))
        self.out = nn.Linear(2 * dim, dim)

    def forward(self, x):
        length = x.shape[1]
        u, z = self.inp(self.norm(x)).chunk(2, -1)
        u = self.conv(u.transpose(1, 2))[..., :length].transpose(1, 2)
        h = torch.cumsum(torch.sigmoid(self.decay) * nn.functional.silu(u), 1)
        return x + self.out(h * nn.functional.silu(z))


class Net(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(*[Block(dim) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, t):
        return self.head(self.blocks(self.emb(t)))


def build(vocab: int = 50000, dim: int = 1024, layers: int = 24, seq: int = 2048, batch: int = 8):
    return Net(vocab, dim, layers), (torch.randint(0, vocab, (batch, seq)),)
