"""A masked autoencoder (He et al., CVPR 2022): a pre-norm ViT encoder sees only a fixed random subset of
the patches; a narrower decoder fills the rest with mask tokens, restores patch order and predicts pixels.
A user model file for the zero-shot benchmarks (``experiments/bench_user_models.py``)."""

import torch
import torch.nn as nn


class MAE(nn.Module):
    def __init__(self, img: int, patch: int, dim: int, enc: int, dec_dim: int, dec: int, keep: float):
        super().__init__()
        n = (img // patch) ** 2
        self.keep = int(n * keep)
        self.p = patch
        self.embed = nn.Conv2d(3, dim, patch, patch)
        self.pos = nn.Parameter(torch.zeros(1, n, dim))
        enc_layer = nn.TransformerEncoderLayer(dim, dim // 64, 4 * dim, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(enc_layer, enc)
        self.proj = nn.Linear(dim, dec_dim)
        self.mask_tok = nn.Parameter(torch.zeros(1, 1, dec_dim))
        self.dpos = nn.Parameter(torch.zeros(1, n, dec_dim))
        dec_layer = nn.TransformerEncoderLayer(dec_dim, dec_dim // 64, 4 * dec_dim, batch_first=True,
                                               norm_first=True)
        self.dec = nn.TransformerEncoder(dec_layer, dec)
        self.pred = nn.Linear(dec_dim, patch * patch * 3)
        g = torch.Generator().manual_seed(0)
        self.register_buffer("order", torch.randperm(n, generator=g))

    def forward(self, x):
        t = self.embed(x).flatten(2).transpose(1, 2) + self.pos
        b, n, d = t.shape
        kept = t[:, self.order[:self.keep]]
        h = self.proj(self.enc(kept))
        full = torch.cat([h, self.mask_tok.expand(b, n - self.keep, -1)], 1)
        full = full[:, torch.argsort(self.order)] + self.dpos
        return self.pred(self.dec(full))


def build(img: int = 224, patch: int = 16, dim: int = 1024, enc: int = 24, dec_dim: int = 512, dec: int = 8,
          keep: float = 0.25, batch: int = 64):
    return MAE(img, patch, dim, enc, dec_dim, dec, keep), (torch.randn(batch, 3, img, img),)
