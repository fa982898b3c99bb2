"""A Siamese bi-encoder (Sentence-BERT style, Reimers & Gurevych, EMNLP 2019): one Transformer encoder
applied to two inputs, the pooled embeddings u, v combined as (u, v, |u - v|) for a classifier. A user model
file for the zero-shot benchmarks (``experiments/bench_user_models.py``): the two calls share every weight
and every module path, and no path orders them; no family like it is in the training distribution."""

import torch
import torch.nn as nn


class BiEncoder(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, classes: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, max(1, width // 64), 4 * width, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.classify = nn.Linear(3 * width, classes)

    def encode(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embed(tokens)).mean(dim=1)

    def forward(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        u, v = self.encode(first), self.encode(second)
        return self.classify(torch.cat([u, v, (u - v).abs()], dim=-1))


def build(batch: int = 64, seq: int = 128, width: int = 512, layers: int = 6, vocab: int = 30000, classes: int = 3):
    tokens = lambda: torch.randint(0, vocab, (batch, seq))  # noqa: E731
    return BiEncoder(vocab, width, layers, classes), (tokens(), tokens())
