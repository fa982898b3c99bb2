"""PointNet (Qi et al., CVPR 2017), a point-cloud classifier: shared per-point MLPs (1 x 1 convolutions),
two learned input and feature transforms (T-Nets, batched matrix products), a max-pool over the points and
an MLP head. A user model file for the zero-shot benchmarks (``experiments/bench_user_models.py``): no
family like it is in the training distribution."""

import torch
import torch.nn as nn


class TNet(nn.Module):
    """Predicts a k x k transform of the points' features from the whole cloud."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k
        self.features = nn.Sequential(nn.Conv1d(k, 64, 1), nn.BatchNorm1d(64), nn.ReLU(),
                                      nn.Conv1d(64, 128, 1), nn.BatchNorm1d(128), nn.ReLU(),
                                      nn.Conv1d(128, 1024, 1), nn.ReLU())
        self.regress = nn.Sequential(nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                                     nn.Linear(256, k * k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.regress(self.features(x).amax(dim=2)).view(-1, self.k, self.k)
        return torch.bmm(m + torch.eye(self.k, device=x.device), x)


class PointNet(nn.Module):
    def __init__(self, classes: int):
        super().__init__()
        self.input_transform = TNet(3)
        self.mlp1 = nn.Sequential(nn.Conv1d(3, 64, 1), nn.BatchNorm1d(64), nn.ReLU())
        self.feature_transform = TNet(64)
        self.mlp2 = nn.Sequential(nn.Conv1d(64, 128, 1), nn.BatchNorm1d(128), nn.ReLU(), nn.Conv1d(128, 1024, 1))
        self.head = nn.Sequential(nn.Linear(1024, 512), nn.ReLU(), nn.Dropout(0.3), nn.Linear(512, 256), nn.ReLU(),
                                  nn.Linear(256, classes))

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        x = self.mlp2(self.feature_transform(self.mlp1(self.input_transform(points))))
        return self.head(x.amax(dim=2))


def build(points: int = 4096, classes: int = 40, batch: int = 64):
    return PointNet(classes), (torch.randn(batch, 3, points),)
