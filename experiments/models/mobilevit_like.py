"""A MobileViT-S-style classifier (Mehta & Rastegari, "MobileViT: Light-weight, General-purpose, and
Mobile-friendly Vision Transformer", ICLR 2022 / arXiv 2021): MobileNetV2 inverted-residual blocks
(1x1 expand, 3x3 depthwise, 1x1 project) for the early stages and downsampling, interleaved with MobileViT
blocks that encode local context with convolutions, unfold the map into 2x2 patches, run small pre-norm
transformers across patches (one sequence per pixel position within a patch), fold back, and fuse with the
block's input by concatenation and a 3x3 convolution. A user model file for the zero-shot
benchmarks (``experiments/bench_user_models.py``)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


def conv_bn(inp: int, out: int, k: int = 1, stride: int = 1, groups: int = 1, act: bool = True) -> nn.Sequential:
    layers = [nn.Conv2d(inp, out, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(out)]
    if act:
        layers.append(nn.SiLU())
    return nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    """MobileNetV2 block: expand, depthwise, linear projection, residual when shapes match."""

    def __init__(self, inp: int, out: int, stride: int = 1, expand: int = 4):
        super().__init__()
        hidden = inp * expand
        self.use_res = stride == 1 and inp == out
        self.net = nn.Sequential(conv_bn(inp, hidden), conv_bn(hidden, hidden, 3, stride, groups=hidden),
                                 conv_bn(hidden, out, act=False))

    def forward(self, x):
        y = self.net(x)
        return x + y if self.use_res else y


class TransformerLayer(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp), nn.SiLU(), nn.Linear(mlp, dim))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class MobileViTBlock(nn.Module):
    def __init__(self, channels: int, dim: int, depth: int, heads: int = 4, patch: int = 2):
        super().__init__()
        self.patch = patch
        self.local = nn.Sequential(conv_bn(channels, channels, 3), nn.Conv2d(channels, dim, 1, bias=False))
        self.transformer = nn.Sequential(*[TransformerLayer(dim, heads, 2 * dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.project = conv_bn(dim, channels)
        self.fuse = conv_bn(2 * channels, channels, 3)

    def forward(self, x):
        y = self.local(x)
        b, d, h, w = y.shape
        p = self.patch
        # unfold: (b, d, h, w) -> (b * p * p, patches, d)
        y = y.reshape(b, d, h // p, p, w // p, p).permute(0, 3, 5, 2, 4, 1).reshape(b * p * p, (h // p) * (w // p), d)
        y = self.norm(self.transformer(y))
        # fold back
        y = y.reshape(b, p, p, h // p, w // p, d).permute(0, 5, 3, 1, 4, 2).reshape(b, d, h, w)
        return self.fuse(torch.cat([x, self.project(y)], 1))


class MobileViT(nn.Module):
    def __init__(self, channels: list[int], dims: list[int], depths: list[int], classes: int):
        super().__init__()
        c = channels
        self.body = nn.Sequential(
            conv_bn(3, c[0], 3, 2),
            InvertedResidual(c[0], c[1]),
            InvertedResidual(c[1], c[2], 2), InvertedResidual(c[2], c[2]), InvertedResidual(c[2], c[2]),
            InvertedResidual(c[2], c[3], 2), MobileViTBlock(c[3], dims[0], depths[0]),
            InvertedResidual(c[3], c[4], 2), MobileViTBlock(c[4], dims[1], depths[1]),
            InvertedResidual(c[4], c[5], 2), MobileViTBlock(c[5], dims[2], depths[2]),
            conv_bn(c[5], 4 * c[5]),
        )
        self.head = nn.Linear(4 * c[5], classes)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


def build(batch: int = 64, image: int = 256, width: float = 1.0, classes: int = 1000):
    channels = [int(c * width) for c in (16, 32, 64, 96, 128, 160)]
    dims = [int(d * width) for d in (144, 192, 240)]
    return MobileViT(channels, dims, [2, 4, 3], classes), (torch.randn(batch, 3, image, image),)
