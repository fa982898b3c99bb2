"""A Swin-style vision transformer (Liu et al., ICCV 2021): self-attention inside non-overlapping windows,
four stages joined by patch merging (2 x 2 neighbours concatenated, then halved by a linear layer), so
the token count falls and the width rises stage by stage (shifted windows left out). A user model file
for the zero-shot benchmarks (``experiments/bench_user_models.py``): no family like it is in the training
distribution."""

import torch
import torch.nn as nn


class WindowBlock(nn.Module):
    def __init__(self, dim: int, heads: int, window: int):
        super().__init__()
        self.window = window
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        k = self.window
        y = self.norm1(x).view(b, h // k, k, w // k, k, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, k * k, c)
        y = self.attn(y, y, y, need_weights=False)[0]
        y = y.view(b, h // k, w // k, k, k, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
        x = x + y
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduce = nn.Linear(4 * dim, 2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], dim=-1)
        return self.reduce(self.norm(x))


class SwinLike(nn.Module):
    def __init__(self, dim: int, depths: tuple[int, ...], heads: tuple[int, ...], window: int, classes: int):
        super().__init__()
        self.embed = nn.Conv2d(3, dim, 4, 4)
        layers: list[nn.Module] = []
        for i, (depth, h) in enumerate(zip(depths, heads)):
            layers += [WindowBlock(dim * 2**i, h, window) for _ in range(depth)]
            if i < len(depths) - 1:
                layers.append(PatchMerging(dim * 2**i))
        self.stages = nn.Sequential(*layers)
        self.head = nn.Linear(dim * 2 ** (len(depths) - 1), classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embed(images).permute(0, 2, 3, 1)
        return self.head(self.stages(x).mean(dim=(1, 2)))


def build(dim: int = 96, img: int = 224, window: int = 7, classes: int = 1000, batch: int = 64):
    """Swin-T's shape by default: depths 2, 2, 6, 2 and 3, 6, 12, 24 heads."""
    return SwinLike(dim, (2, 2, 6, 2), (3, 6, 12, 24), window, classes), (torch.randn(batch, 3, img, img),)
