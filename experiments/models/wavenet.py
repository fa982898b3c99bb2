"""A WaveNet-style stack (van den Oord et al., 2016): dilated causal 1-D convolutions with gated
activations, residual and skip connections summed over every layer (a graph with one long skip fan-in).
A user model file for the zero-shot benchmarks (``experiments/bench_agent.py``, ``experiments/bench_user_models.py``)."""

import torch
import torch.nn as nn


class GatedLayer(nn.Module):
    def __init__(self, channels: int, skip: int, dilation: int):
        super().__init__()
        self.dilation = dilation
        self.filter = nn.Conv1d(channels, channels, 2, dilation=dilation)
        self.gate = nn.Conv1d(channels, channels, 2, dilation=dilation)
        self.res = nn.Conv1d(channels, channels, 1)
        self.skip = nn.Conv1d(channels, skip, 1)

    def forward(self, x):
        y = nn.functional.pad(x, (self.dilation, 0))
        z = torch.tanh(self.filter(y)) * torch.sigmoid(self.gate(y))
        return x + self.res(z), self.skip(z)


class WaveNet(nn.Module):
    def __init__(self, layers: int, channels: int, skip: int, classes: int):
        super().__init__()
        self.inp = nn.Conv1d(1, channels, 1)
        self.layers = nn.ModuleList([GatedLayer(channels, skip, 2 ** (i % 10)) for i in range(layers)])
        self.out1 = nn.Conv1d(skip, skip, 1)
        self.out2 = nn.Conv1d(skip, classes, 1)

    def forward(self, x):
        x = self.inp(x)
        total = 0
        for layer in self.layers:
            x, s = layer(x)
            total = total + s
        return self.out2(torch.relu(self.out1(torch.relu(total))))


def build(layers: int = 30, channels: int = 128, skip: int = 256, classes: int = 256, samples: int = 16000,
          batch: int = 16):
    return WaveNet(layers, channels, skip, classes), (torch.randn(batch, 1, samples),)
