"""A temporal convolutional network (Bai et al., 2018): residual blocks of two dilated 1-D convolutions,
the dilation doubling with each block, then a per-timestep linear classifier.
A user model file for the zero-shot benchmarks (``experiments/bench_user_models.py``)."""

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, channels: int, dilation: int):
        super().__init__()
        self.c1 = nn.Conv1d(channels, channels, 3, padding=dilation, dilation=dilation)
        self.c2 = nn.Conv1d(channels, channels, 3, padding=dilation, dilation=dilation)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(x + self.c2(self.act(self.c1(x))))


class TCN(nn.Module):
    def __init__(self, inputs: int, channels: int, levels: int, classes: int):
        super().__init__()
        self.inp = nn.Conv1d(inputs, channels, 1)
        self.blocks = nn.Sequential(*[Block(channels, 2 ** i) for i in range(levels)])
        self.out = nn.Linear(channels, classes)

    def forward(self, x):
        return self.out(self.blocks(self.inp(x)).transpose(1, 2))


def build(inputs: int = 64, channels: int = 512, levels: int = 8, classes: int = 32, length: int = 2048,
          batch: int = 32):
    return TCN(inputs, channels, levels, classes), (torch.randn(batch, inputs, length),)
