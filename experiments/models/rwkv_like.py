"""An RWKV/RetNet-style language model computed in parallel form (Peng et al., "RWKV: Reinventing RNNs for
the Transformer Era", 2023; Sun et al., "Retentive Network: A Successor to Transformer for Large Language
Models", 2023). Each layer has a time-mixing sublayer, where RWKV's token shift (interpolating each position
with the previous one) feeds the query/key/value/gate projections of multi-scale retention, evaluated as
(Q K^T * D) V with a per-head causal exponential-decay matrix D[n, m] = gamma^(n - m) built from arange (no
Python loop over time) followed by a per-head GroupNorm and a swish gate; and a channel-mixing sublayer
(RWKV's token-shifted squared-ReLU MLP with a sigmoid receptance gate). Retention's xPos rotation is left out.
A user model file for the zero-shot
benchmarks (``experiments/bench_user_models.py``)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


def token_shift(x: torch.Tensor) -> torch.Tensor:
    """x[:, t] -> x[:, t - 1], zeros at t = 0."""
    return F.pad(x, (0, 0, 1, -1))


class TimeMix(nn.Module):
    """Token shift + multi-scale retention in its parallel form."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.mix = nn.Parameter(torch.rand(4, dim))  # q, k, v, g interpolation weights
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.g = nn.Linear(dim, dim, bias=False)
        self.gn = nn.GroupNorm(heads, dim)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x, decay):
        b, t, d = x.shape
        h = self.heads
        prev = token_shift(x)
        m = self.mix[:, None, None, :]
        xq, xk, xv, xg = (x * m + prev * (1 - m)).unbind(0)
        q = self.q(xq).view(b, t, h, d // h).transpose(1, 2)
        k = self.k(xk).view(b, t, h, d // h).transpose(1, 2) * (d // h) ** -0.5
        v = self.v(xv).view(b, t, h, d // h).transpose(1, 2)
        scores = (q @ k.transpose(-1, -2)) * decay.to(q.dtype)
        scores = scores / scores.abs().sum(-1, keepdim=True).clamp(min=1)
        y = (scores @ v).transpose(1, 2).reshape(b * t, d)
        y = self.gn(y).view(b, t, d)
        return self.out(F.silu(self.g(xg)) * y)


class ChannelMix(nn.Module):
    """RWKV channel mixing: token shift, squared-ReLU key, sigmoid receptance gate."""

    def __init__(self, dim: int, mult: int = 4):
        super().__init__()
        self.mix = nn.Parameter(torch.rand(2, dim))
        self.key = nn.Linear(dim, mult * dim, bias=False)
        self.value = nn.Linear(mult * dim, dim, bias=False)
        self.receptance = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        prev = token_shift(x)
        m = self.mix[:, None, None, :]
        xk, xr = (x * m + prev * (1 - m)).unbind(0)
        return torch.sigmoid(self.receptance(xr)) * self.value(torch.relu(self.key(xk)) ** 2)


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.time = TimeMix(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.channel = ChannelMix(dim)

    def forward(self, x, decay):
        x = x + self.time(self.ln1(x), decay)
        return x + self.channel(self.ln2(x))


class RetentionLM(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.ln_in = nn.LayerNorm(dim)
        self.layers = nn.ModuleList([Layer(dim, heads) for _ in range(layers)])
        self.ln_out = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("log_gamma", torch.log(1 - 2.0 ** (-5.0 - torch.arange(heads, dtype=torch.float32))))

    def forward(self, tokens):
        t = tokens.shape[1]
        # decay matrix D[h, n, m] = gamma_h^(n - m) for n >= m, else 0, rows normalised as in RetNet; built
        # once per step from arange and shared by every layer
        pos = torch.arange(t, device=tokens.device, dtype=torch.float32)
        dist = pos[:, None] - pos[None, :]
        decay = torch.where(dist >= 0, torch.exp(self.log_gamma[:, None, None] * dist.clamp(min=0)), 0.0)
        decay = decay / decay.sum(-1, keepdim=True).sqrt()
        x = self.ln_in(self.emb(tokens))
        for layer in self.layers:
            x = layer(x, decay)
        return self.head(self.ln_out(x))


def build(batch: int = 16, seq: int = 1024, vocab: int = 32000, dim: int = 768, heads: int = 12, layers: int = 12):
    return RetentionLM(vocab, dim, heads, layers), (torch.randint(0, vocab, (batch, seq)),)
