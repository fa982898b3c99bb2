"""A Perceiver-style model (Jaegle et al., ICML 2021): a small latent array cross-attends to a long input,
then a latent self-attention tower. A user model file for the zero-shot benchmarks
(``experiments/bench_agent.py``, ``experiments/bench_user_models.py``)."""

import torch
import torch.nn as nn


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, context):
        b, n, d = x.shape
        q = self.q(x).view(b, n, self.heads, d // self.heads).transpose(1, 2)
        k, v = self.kv(context).view(b, context.shape[1], 2, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, context=None):
        h = self.norm1(x)
        x = x + self.attn(h, h if context is None else context)
        return x + self.mlp(self.norm2(x))


class Perceiver(nn.Module):
    def __init__(self, layers: int, latents: int, dim: int, heads: int, in_dim: int, classes: int):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(latents, dim))
        self.embed = nn.Linear(in_dim, dim)
        self.cross = Block(dim, 1)
        self.layers = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        context = self.embed(x)
        z = self.latents.unsqueeze(0).expand(x.shape[0], -1, -1)
        z = self.cross(z, context)
        for layer in self.layers:
            z = layer(z)
        return self.head(z.mean(1))


def build(layers: int = 12, latents: int = 256, dim: int = 1024, heads: int = 8, inputs: int = 8192,
          in_dim: int = 256, classes: int = 1000, batch: int = 64):
    return Perceiver(layers, latents, dim, heads, in_dim, classes), (torch.randn(batch, inputs, in_dim),)
