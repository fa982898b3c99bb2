"""A Transformer encoder-decoder for translation (Vaswani et al., NeurIPS 2017), built on
``nn.Transformer``, with one token embedding shared by source and target and a linear output head.
A user model file for the zero-shot benchmarks (``experiments/bench_user_models.py``)."""

import torch
import torch.nn as nn


class S2S(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, enc: int, dec: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.tr = nn.Transformer(d, heads, enc, dec, 4 * d, batch_first=True)
        self.out = nn.Linear(d, vocab)

    def forward(self, src, tgt):
        return self.out(self.tr(self.emb(src), self.emb(tgt)))


def build(vocab: int = 32000, d: int = 512, heads: int = 8, enc: int = 6, dec: int = 6, src: int = 256,
          tgt: int = 256, batch: int = 64):
    inputs = (torch.randint(0, vocab, (batch, src)), torch.randint(0, vocab, (batch, tgt)))
    return S2S(vocab, d, heads, enc, dec), inputs
