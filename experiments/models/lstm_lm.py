"""A word-level LSTM language model (Hochreiter & Schmidhuber, 1997; Zaremba et al., 2014): token
embedding, a stacked LSTM and a linear head over the vocabulary.
A user model file for the zero-shot benchmarks (``experiments/bench_user_models.py``)."""

import torch
import torch.nn as nn


class LM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.rnn = nn.LSTM(dim, dim, layers, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x):
        out = self.rnn(self.emb(x))[0]  # the output sequence; the final (h, c) states are unused
        return self.head(out)


def build(vocab: int = 32000, dim: int = 1024, layers: int = 4, seq: int = 256, batch: int = 32):
    return LM(vocab, dim, layers), (torch.randint(0, vocab, (batch, seq)),)
