"""An EfficientNet-B0-style classifier (Tan & Le, ICML 2019): seven stages of MBConv blocks (1x1 expand,
3x3 depthwise, 1x1 project, residual where shapes allow; no squeeze-and-excitation), scaled by width and
depth multipliers. A user model file for the zero-shot benchmarks (``experiments/bench_user_models.py``)."""

import torch
import torch.nn as nn


class MB(nn.Module):
    def __init__(self, inp: int, out: int, expand: int, stride: int):
        super().__init__()
        h = inp * expand
        self.f = nn.Sequential(
            nn.Conv2d(inp, h, 1, bias=False), nn.BatchNorm2d(h), nn.SiLU(),
            nn.Conv2d(h, h, 3, stride, 1, groups=h, bias=False), nn.BatchNorm2d(h), nn.SiLU(),
            nn.Conv2d(h, out, 1, bias=False), nn.BatchNorm2d(out),
        )
        self.res = stride == 1 and inp == out

    def forward(self, x):
        if self.res:
            return x + self.f(x)
        return self.f(x)


class Eff(nn.Module):
    def __init__(self, width: float, depth: float, classes: int):
        super().__init__()
        c = [int(x * width) for x in (32, 16, 24, 40, 80, 112, 192, 320)]
        strides = (1, 2, 2, 2, 1, 2, 1)
        repeats = (1, 2, 2, 3, 3, 4, 1)
        layers = [nn.Conv2d(3, c[0], 3, 2, 1)]
        for j, (stride, n) in enumerate(zip(strides, repeats)):
            expand = 1 if j == 0 else 6
            for r in range(max(1, int(n * depth))):
                if r == 0:
                    layers.append(MB(c[j], c[j + 1], expand, stride))
                else:
                    layers.append(MB(c[j + 1], c[j + 1], expand, 1))
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(c[-1], classes)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


def build(width: float = 1.0, depth: float = 1.0, img: int = 224, classes: int = 1000, batch: int = 256):
    return Eff(width, depth, classes), (torch.randn(batch, 3, img, img),)
