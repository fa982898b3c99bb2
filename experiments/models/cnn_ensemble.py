"""An ensemble of small CNN classifiers whose logits are averaged (Lakshminarayanan et al., "Simple and
Scalable Predictive Uncertainty Estimation using Deep Ensembles", NeurIPS 2017): every member reads the
same images, and ``sum()`` joins the members through a chain of additions. A user model file for the
zero-shot benchmarks (``experiments/bench_user_models.py``): many concurrent branches of equal weight,
host-bound at this size, so each member wants a device (or a pair) of its own; no family like it is in
the training distribution."""

import torch
import torch.nn as nn


def member(width: int, classes: int, blocks: int) -> nn.Sequential:
    """A VGG-style classifier: ``blocks`` blocks of two 3x3 convolutions and a max-pool, doubling the width."""
    layers, c = [], 3
    for i in range(blocks):
        w = width * 2 ** i
        layers += [nn.Conv2d(c, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU(),
                   nn.Conv2d(w, w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        c = w
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes))


class Ensemble(nn.Module):
    def __init__(self, members: int, width: int, classes: int, blocks: int):
        super().__init__()
        self.members = nn.ModuleList([member(width, classes, blocks) for _ in range(members)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(m(x) for m in self.members) / len(self.members)


def build(members: int = 8, width: int = 32, classes: int = 1000, blocks: int = 4, batch: int = 64,
          image: int = 64):
    return Ensemble(members, width, classes, blocks), (torch.randn(batch, 3, image, image),)
