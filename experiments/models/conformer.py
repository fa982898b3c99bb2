"""A speech Conformer encoder (Gulati et al., "Conformer: Convolution-augmented Transformer for Speech
Recognition", Interspeech 2020): a 4x convolutional subsampling of (batch, frames, 80) log-mel features,
then blocks that sandwich multi-head self-attention and a convolution module (pointwise conv, GLU, depthwise
conv, BatchNorm, Swish, pointwise conv) between two half-step (macaron) feed-forward modules, ending in a
LayerNorm; a linear CTC head over a subword vocabulary on top. The attention's relative positional encoding
is a learned per-head bias over clipped relative distances (a simplification of Transformer-XL's). A user model file for the zero-shot
benchmarks (``experiments/bench_user_models.py``)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int = 4):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, mult * dim), nn.SiLU(), nn.Dropout(0.1),
                                 nn.Linear(mult * dim, dim), nn.Dropout(0.1))

    def forward(self, x):
        return self.net(x)


class RelPosMHSA(nn.Module):
    def __init__(self, dim: int, heads: int, max_rel: int = 64):
        super().__init__()
        self.heads = heads
        self.max_rel = max_rel
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.rel_bias = nn.Embedding(2 * max_rel + 1, heads)
        self.out = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        pos = torch.arange(t, device=x.device)
        rel = (pos[None, :] - pos[:, None]).clamp(-self.max_rel, self.max_rel) + self.max_rel
        bias = self.rel_bias(rel).permute(2, 0, 1).unsqueeze(0).to(q.dtype)  # (1, heads, t, t)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.drop(self.out(y.transpose(1, 2).reshape(b, t, d)))


class ConvModule(nn.Module):
    def __init__(self, dim: int, kernel: int = 31):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.pw1 = nn.Conv1d(dim, 2 * dim, 1)
        self.dw = nn.Conv1d(dim, dim, kernel, padding=kernel // 2, groups=dim)
        self.bn = nn.BatchNorm1d(dim)
        self.pw2 = nn.Conv1d(dim, dim, 1)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        y = F.glu(self.pw1(self.norm(x).transpose(1, 2)), dim=1)
        y = self.pw2(F.silu(self.bn(self.dw(y))))
        return self.drop(y.transpose(1, 2))


class ConformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kernel: int):
        super().__init__()
        self.ff1 = FeedForward(dim)
        self.mhsa = RelPosMHSA(dim, heads)
        self.conv = ConvModule(dim, kernel)
        self.ff2 = FeedForward(dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        x = x + 0.5 * self.ff1(x)
        x = x + self.mhsa(x)
        x = x + self.conv(x)
        x = x + 0.5 * self.ff2(x)
        return self.norm(x)


class Conformer(nn.Module):
    def __init__(self, mels: int, dim: int, heads: int, layers: int, kernel: int, vocab: int):
        super().__init__()
        self.subsample = nn.Sequential(nn.Conv2d(1, dim, 3, stride=2), nn.ReLU(),
                                       nn.Conv2d(dim, dim, 3, stride=2), nn.ReLU())
        freq = ((mels - 1) // 2 - 1) // 2
        self.proj = nn.Linear(dim * freq, dim)
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.Sequential(*[ConformerBlock(dim, heads, kernel) for _ in range(layers)])
        self.ctc = nn.Linear(dim, vocab)

    def forward(self, feats):
        h = self.subsample(feats.unsqueeze(1))  # (batch, dim, frames/4, mels/4)
        b, c, t, f = h.shape
        h = self.drop(self.proj(h.permute(0, 2, 1, 3).reshape(b, t, c * f)))
        return self.ctc(self.blocks(h)).log_softmax(-1)


def build(batch: int = 32, frames: int = 1600, mels: int = 80, dim: int = 256, heads: int = 4, layers: int = 8,
          kernel: int = 31, vocab: int = 1024):
    return Conformer(mels, dim, heads, layers, kernel, vocab), (torch.randn(batch, frames, mels),)
