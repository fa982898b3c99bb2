"""A YOLO-style single-stage detector with a feature pyramid (Redmon & Farhadi, 2018; Lin et al., CVPR
2017): a conv-BN-SiLU backbone, a top-down FPN with nearest-neighbour upsampling, and a head per level
predicting 3 anchors x (box, objectness, classes). A user model file for the zero-shot benchmarks
(``experiments/bench_user_models.py``)."""

import torch
import torch.nn as nn


def conv_bn_silu(inp: int, out: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(inp, out, 3, stride, 1, bias=False), nn.BatchNorm2d(out), nn.SiLU())


class Det(nn.Module):
    def __init__(self, width: int, classes: int):
        super().__init__()
        w = width
        self.stem = conv_bn_silu(3, w, 2)
        self.c2 = nn.Sequential(conv_bn_silu(w, 2 * w, 2), conv_bn_silu(2 * w, 2 * w))
        self.c3 = nn.Sequential(conv_bn_silu(2 * w, 4 * w, 2), conv_bn_silu(4 * w, 4 * w))
        self.c4 = nn.Sequential(conv_bn_silu(4 * w, 8 * w, 2), conv_bn_silu(8 * w, 8 * w))
        self.c5 = nn.Sequential(conv_bn_silu(8 * w, 16 * w, 2), conv_bn_silu(16 * w, 16 * w))
        self.l3 = nn.Conv2d(4 * w, 4 * w, 1)
        self.l4 = nn.Conv2d(8 * w, 4 * w, 1)
        self.l5 = nn.Conv2d(16 * w, 4 * w, 1)
        self.heads = nn.ModuleList(
            [nn.Sequential(conv_bn_silu(4 * w, 4 * w), nn.Conv2d(4 * w, 3 * (5 + classes), 1)) for _ in range(3)]
        )

    def forward(self, x):
        c3 = self.c3(self.c2(self.stem(x)))
        c4 = self.c4(c3)
        c5 = self.c5(c4)
        p5 = self.l5(c5)
        p4 = self.l4(c4) + nn.functional.interpolate(p5, scale_factor=2.0)
        p3 = self.l3(c3) + nn.functional.interpolate(p4, scale_factor=2.0)
        return [head(p).flatten(1).sum(1) for head, p in zip(self.heads, (p3, p4, p5))]


def build(width: int = 32, classes: int = 80, img: int = 640, batch: int = 32):
    return Det(width, classes), (torch.randn(batch, 3, img, img),)
