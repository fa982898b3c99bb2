"""A mixture-of-experts language model as users often write it (Shazeer et al., ICLR 2017; Mixtral's top-2
routing): a softmax gate keeps each token's top-k experts and every expert runs on every token, masked by
its gate weight (dense dispatch, no capacity). A user model file for the zero-shot benchmarks
(``experiments/bench_agent.py``, ``experiments/bench_user_models.py``)."""

import torch
import torch.nn as nn


class MoE(nn.Module):
    def __init__(self, dim: int, experts: int, k: int):
        super().__init__()
        self.k = k
        self.gate = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(
            [nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(experts)])

    def forward(self, x):
        weights = torch.softmax(self.gate(x), -1)
        top, index = weights.topk(self.k, -1)
        mask = torch.zeros_like(weights).scatter(-1, index, top)
        return sum(mask[..., e:e + 1] * expert(x) for e, expert in enumerate(self.experts))


class MoELM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, experts: int, k: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = nn.ModuleList([nn.MultiheadAttention(dim, heads, batch_first=True) for _ in range(layers)])
        self.moe = nn.ModuleList([MoE(dim, experts, k) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for attn, moe in zip(self.attn, self.moe):
            x = x + attn(x, x, x, need_weights=False)[0]
            x = x + moe(x)
        return self.head(x)


def build(vocab: int = 32000, dim: int = 512, layers: int = 4, heads: int = 8, experts: int = 8, k: int = 2,
          seq: int = 512, batch: int = 16):
    return MoELM(vocab, dim, layers, heads, experts, k), (torch.randint(0, vocab, (batch, seq)),)
