"""An HRNet-style classifier (Wang et al., "Deep High-Resolution Representation Learning for Visual
Recognition", TPAMI 2020): four resolution branches side by side, fused after every stage (each branch's
output resampled by a 1x1 convolution into every other resolution and summed). A user model file for the
zero-shot benchmarks (``experiments/bench_user_models.py``): concurrent branches that no junction
separates (the fusion joins them every stage), many small operators (host-bound at this size, so running
the branches on different GPUs pays); no family like it is in the training distribution."""

import torch
import torch.nn as nn


def residual_block(channels: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
                         nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels))


class Stage(nn.Module):
    """One block per branch, then every branch's output resampled into every resolution and summed."""

    def __init__(self, channels: list[int]):
        super().__init__()
        self.branches = nn.ModuleList([residual_block(c) for c in channels])
        self.fuse = nn.ModuleDict({f"{j}to{i}": nn.Conv2d(channels[j], channels[i], 1)
                                   for i in range(len(channels)) for j in range(len(channels)) if i != j})

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        ys = [torch.relu(block(x) + x) for block, x in zip(self.branches, xs)]
        out = []
        for i, y in enumerate(ys):
            acc = y
            for j, other in enumerate(ys):
                if i != j:
                    acc = acc + nn.functional.interpolate(self.fuse[f"{j}to{i}"](other), size=y.shape[-2:])
            out.append(torch.relu(acc))
        return out


class HRNet(nn.Module):
    def __init__(self, width: int, stages: int, resolutions: int, classes: int):
        super().__init__()
        channels = [width * 2 ** i for i in range(resolutions)]
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, stride=4, padding=1), nn.ReLU())
        self.down = nn.ModuleList([nn.Conv2d(channels[i], channels[i + 1], 3, stride=2, padding=1)
                                   for i in range(resolutions - 1)])
        self.stages = nn.ModuleList([Stage(channels) for _ in range(stages)])
        self.head = nn.Linear(sum(channels), classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs = [self.stem(x)]
        for down in self.down:
            xs.append(down(xs[-1]))
        for stage in self.stages:
            xs = stage(xs)
        return self.head(torch.cat([x.mean((2, 3)) for x in xs], 1))


def build(batch: int = 32, image: int = 256, width: int = 32, stages: int = 4, resolutions: int = 4,
          classes: int = 1000):
    return HRNet(width, stages, resolutions, classes), (torch.randn(batch, 3, image, image),)
