"""MLP-Mixer (Tolstikhin et al., NeurIPS 2021): patch embedding, then blocks of token-mixing and
channel-mixing MLPs. A user model file for the zero-shot benchmarks
(``experiments/bench_agent.py``, ``experiments/bench_user_models.py``): no family like it is in the training
distribution."""

import torch
import torch.nn as nn


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, hidden: int, token_mlp: int, channel_mlp: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.token_fc1 = nn.Linear(tokens, token_mlp)
        self.token_fc2 = nn.Linear(token_mlp, tokens)
        self.norm2 = nn.LayerNorm(hidden)
        self.channel_fc1 = nn.Linear(hidden, channel_mlp)
        self.channel_fc2 = nn.Linear(channel_mlp, hidden)

    def forward(self, x):
        y = self.norm1(x).transpose(1, 2)
        x = x + self.token_fc2(torch.nn.functional.gelu(self.token_fc1(y))).transpose(1, 2)
        return x + self.channel_fc2(torch.nn.functional.gelu(self.channel_fc1(self.norm2(x))))


class Mixer(nn.Module):
    def __init__(self, layers: int, hidden: int, patch: int, img: int, classes: int):
        super().__init__()
        tokens = (img // patch) ** 2
        self.stem = nn.Conv2d(3, hidden, patch, stride=patch)
        self.layers = nn.Sequential(*[MixerBlock(tokens, hidden, hidden // 2, 4 * hidden) for _ in range(layers)])
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        x = self.stem(x).flatten(2).transpose(1, 2)
        return self.head(self.norm(self.layers(x)).mean(1))


def build(layers: int = 12, hidden: int = 768, patch: int = 16, img: int = 224, classes: int = 1000,
          batch: int = 256):
    return Mixer(layers, hidden, patch, img, classes), (torch.randn(batch, 3, img, img),)
