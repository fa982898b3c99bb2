"""A multi-modal late-fusion model (Baltrusaitis, Ahuja & Morency, "Multimodal Machine Learning: A Survey and
Taxonomy", TPAMI 2019; encoders after He et al., "Deep Residual Learning for Image Recognition", CVPR 2016 and
Vaswani et al., "Attention Is All You Need", NeurIPS 2017): three independent encoders, a ResNet-18-style
image CNN, a pre-norm transformer text encoder over token ids (mean-pooled), and a tabular MLP, each produce an
embedding; the embeddings are concatenated and fused by an MLP classification head. The three branches share
nothing until the fusion, so they can run concurrently. A user model file for the zero-shot
benchmarks (``experiments/bench_user_models.py``)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    def __init__(self, inp: int, out: int, stride: int = 1):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(inp, out, 3, stride, 1, bias=False), nn.BatchNorm2d(out), nn.ReLU(),
                                  nn.Conv2d(out, out, 3, 1, 1, bias=False), nn.BatchNorm2d(out))
        self.short = (nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False), nn.BatchNorm2d(out))
                      if stride != 1 or inp != out else nn.Identity())

    def forward(self, x):
        return torch.relu(self.body(x) + self.short(x))


class ImageEncoder(nn.Module):
    def __init__(self, width: int, embed: int):
        super().__init__()
        ch = [width, 2 * width, 4 * width, 8 * width]
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        blocks = []
        for i, c in enumerate(ch):
            blocks += [BasicBlock(ch[i - 1] if i else width, c, 2 if i else 1), BasicBlock(c, c)]
        self.blocks = nn.Sequential(*blocks)
        self.proj = nn.Linear(ch[-1], embed)

    def forward(self, x):
        return self.proj(self.blocks(self.stem(x)).mean((2, 3)))


class TextLayer(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class TextEncoder(nn.Module):
    def __init__(self, vocab: int, context: int, dim: int, heads: int, layers: int, embed: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(context, dim) * 0.02)
        self.layers = nn.Sequential(*[TextLayer(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, embed)

    def forward(self, tokens):
        h = self.layers(self.tok(tokens) + self.pos[: tokens.shape[1]])
        return self.proj(self.norm(h).mean(1))


class TabularEncoder(nn.Module):
    def __init__(self, features: int, hidden: int, embed: int):
        super().__init__()
        self.net = nn.Sequential(nn.BatchNorm1d(features), nn.Linear(features, hidden), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, embed))

    def forward(self, x):
        return self.net(x)


class LateFusion(nn.Module):
    def __init__(self, width: int, vocab: int, context: int, text_dim: int, heads: int, text_layers: int,
                 features: int, tab_hidden: int, embed: int, classes: int):
        super().__init__()
        self.image = ImageEncoder(width, embed)
        self.text = TextEncoder(vocab, context, text_dim, heads, text_layers, embed)
        self.tabular = TabularEncoder(features, tab_hidden, embed)
        self.head = nn.Sequential(nn.LayerNorm(3 * embed), nn.Linear(3 * embed, 2 * embed), nn.GELU(),
                                  nn.Dropout(0.1), nn.Linear(2 * embed, embed), nn.GELU(), nn.Linear(embed, classes))

    def forward(self, images, tokens, table):
        z = torch.cat([self.image(images), self.text(tokens), self.tabular(table)], -1)
        return self.head(z)


def build(batch: int = 32, image: int = 224, width: int = 64, vocab: int = 30522, context: int = 128,
          text_dim: int = 512, heads: int = 8, text_layers: int = 6, features: int = 64, tab_hidden: int = 512,
          embed: int = 512, classes: int = 100):
    model = LateFusion(width, vocab, context, text_dim, heads, text_layers, features, tab_hidden, embed, classes)
    inputs = (torch.randn(batch, 3, image, image), torch.randint(0, vocab, (batch, context)),
              torch.randn(batch, features))
    return model, inputs
