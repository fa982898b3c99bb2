"""A CRNN text recogniser (Shi et al., TPAMI 2017): a convolutional feature extractor, then a two-layer
bidirectional GRU over the image's columns and a per-column classifier (the logits a CTC loss reads).
A user model file for the zero-shot benchmarks (``experiments/bench_user_models.py``)."""

import torch
import torch.nn as nn


class CRNN(nn.Module):
    def __init__(self, classes: int, hidden: int):
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv2d(1, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(128, 256, 3, padding=1), nn.BatchNorm2d(256), nn.ReLU(), nn.MaxPool2d((2, 1)),
        )
        self.rnn = nn.GRU(256 * 4, hidden, 2, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(2 * hidden, classes)

    def forward(self, x):
        f = self.cnn(x)
        b, c, h, w = f.shape
        seq = f.permute(0, 3, 1, 2).reshape(b, w, c * h)
        return self.fc(self.rnn(seq)[0])


def build(classes: int = 100, hidden: int = 512, height: int = 32, width: int = 512, batch: int = 64):
    return CRNN(classes, hidden), (torch.randn(batch, 1, height, width),)
