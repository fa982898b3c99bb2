"""A Whisper-style speech-to-text model (Radford et al., 2022): a two-convolution stem over a log-mel
spectrogram, a transformer encoder, and a transformer decoder over text tokens that cross-attends to it.
A user model file for the zero-shot benchmarks (``experiments/bench_user_models.py``)."""

import torch
import torch.nn as nn


class Whisper(nn.Module):
    def __init__(self, mels: int, dim: int, heads: int, enc: int, dec: int, vocab: int):
        super().__init__()
        self.c1 = nn.Conv1d(mels, dim, 3, padding=1)
        self.c2 = nn.Conv1d(dim, dim, 3, stride=2, padding=1)
        enc_layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, batch_first=True)
        self.enc = nn.TransformerEncoder(enc_layer, enc)
        self.emb = nn.Embedding(vocab, dim)
        dec_layer = nn.TransformerDecoderLayer(dim, heads, 4 * dim, batch_first=True)
        self.dec = nn.TransformerDecoder(dec_layer, dec)
        self.head = nn.Linear(dim, vocab)

    def forward(self, audio, tokens):
        a = nn.functional.gelu(self.c1(audio))
        a = nn.functional.gelu(self.c2(a)).transpose(1, 2)
        return self.head(self.dec(self.emb(tokens), self.enc(a)))


def build(mels: int = 80, frames: int = 3000, dim: int = 768, heads: int = 12, enc: int = 12, dec: int = 12,
          vocab: int = 51865, text: int = 224, batch: int = 16):
    inputs = (torch.randn(batch, mels, frames), torch.randint(0, vocab, (batch, text)))
    return Whisper(mels, dim, heads, enc, dec, vocab), inputs
