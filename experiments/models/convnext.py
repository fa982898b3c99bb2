"""A ConvNeXt image classifier (Liu et al., CVPR 2022): a patchify stem, four stages of blocks with a 7x7
depthwise convolution, LayerNorm and an inverted-bottleneck MLP, strided-convolution downsampling between
stages. A user model file for the zero-shot benchmarks (``experiments/bench_user_models.py``)."""

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pw1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pw2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.pw2(self.act(self.pw1(self.norm(y)))).permute(0, 3, 1, 2)
        return x + y


class ConvNeXt(nn.Module):
    def __init__(self, depths: list[int], dims: list[int], classes: int):
        super().__init__()
        self.stem = nn.Conv2d(3, dims[0], 4, stride=4)
        layers = []
        for i, (n, dim) in enumerate(zip(depths, dims)):
            if i:
                layers.append(nn.Conv2d(dims[i - 1], dim, 2, stride=2))
            layers += [Block(dim) for _ in range(n)]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(dims[-1], classes)

    def forward(self, x):
        return self.head(self.body(self.stem(x)).mean((2, 3)))


def build(depths: int = 3, width: int = 96, img: int = 224, classes: int = 1000, batch: int = 64):
    model = ConvNeXt([depths, depths, 3 * depths, depths], [width, 2 * width, 4 * width, 8 * width], classes)
    return model, (torch.randn(batch, 3, img, img),)
