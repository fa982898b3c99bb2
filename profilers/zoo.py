"""Model zoo: real ``nn.Module`` families with size knobs, for tracing into OpGraphs.

Each family is a builder ``family(**knobs) -> (module, example_inputs)``; every builder takes
``batch`` and small defaults, so ``FAMILIES["gpt"]()`` is a model that traces in well under a second.
Build under ``torch.device("meta")`` (as ``profilers.spec.build_model`` does) to avoid allocating
weights. All members export with ``torch.export`` (static shapes, no data-dependent control flow).

Families: ``mlp``, ``resnet`` (depth, width), ``inception`` (multi-branch CNN), ``gnmt`` (LSTM
encoder-decoder with attention), ``gpt`` (decoder-only), ``bert`` (encoder), ``moe`` (transformer
with top-k routed experts, GShard-style static-capacity dispatch), ``unet`` (2-D or 3-D).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

Built = tuple[nn.Module, tuple[torch.Tensor, ...]]


# ---------------------------------------------------------------------------- MLP
class MLP(nn.Module):
    """``layers`` hidden Linear+ReLU layers, then a classifier: ``layers.N.fc`` / ``head``."""

    def __init__(self, in_dim: int, hidden: int, layers: int, out_dim: int) -> None:
        super().__init__()
        dims = [in_dim] + [hidden] * layers
        self.layers = nn.ModuleList(nn.ModuleDict({"fc": nn.Linear(a, b), "act": nn.ReLU()})
                                    for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(dims[-1], out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer["act"](layer["fc"](x))
        return self.head(x)


def mlp(layers: int = 3, hidden: int = 256, in_dim: int = 784, out: int = 10, batch: int = 32) -> Built:
    return MLP(in_dim, hidden, layers, out), (torch.randn(batch, in_dim),)


# ---------------------------------------------------------------------------- ResNet
class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (self.down(x) if self.down is not None else x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (self.down(x) if self.down is not None else x))


RESNET_STAGES = {18: (BasicBlock, (2, 2, 2, 2)), 34: (BasicBlock, (3, 4, 6, 3)),
                 50: (Bottleneck, (3, 4, 6, 3)), 101: (Bottleneck, (3, 4, 23, 3)),
                 152: (Bottleneck, (3, 8, 36, 3))}


class ResNet(nn.Module):
    """He et al. 2016. Blocks are ``stages.S.B``; ``depth`` in RESNET_STAGES, or any depth >= 10
    with (depth - 2) // 8 basic blocks per stage."""

    def __init__(self, depth: int, width: int, classes: int) -> None:
        super().__init__()
        if depth in RESNET_STAGES:
            block, counts = RESNET_STAGES[depth]
        else:
            block, counts = BasicBlock, (max(1, (depth - 2) // 8),) * 4
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        stages, cin = [], width
        for s, count in enumerate(counts):
            w = width * 2**s
            blocks = []
            for b in range(count):
                blocks.append(block(cin, w, 2 if (b == 0 and s > 0) else 1))
                cin = w * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.ModuleList(stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return self.fc(torch.flatten(self.pool(x), 1))


def resnet(depth: int = 18, width: int = 16, img: int = 64, classes: int = 100, batch: int = 8) -> Built:
    if depth < 10:
        raise ValueError("resnet depth must be >= 10")
    return ResNet(depth, width, classes), (torch.randn(batch, 3, img, img),)


# ---------------------------------------------------------------------------- Inception
class ConvBN(nn.Sequential):
    def __init__(self, cin: int, cout: int, k: int, stride: int = 1) -> None:
        super().__init__(nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class InceptionBlock(nn.Module):
    """Four parallel branches (1x1; 1x1-3x3; 1x1-5x5 as two 3x3; pool-1x1) concatenated
    (Szegedy et al., 2015)."""

    def __init__(self, cin: int, w: int) -> None:
        super().__init__()
        self.b1 = ConvBN(cin, w, 1)
        self.b3 = nn.Sequential(ConvBN(cin, w, 1), ConvBN(w, w, 3))
        self.b5 = nn.Sequential(ConvBN(cin, w // 2, 1), ConvBN(w // 2, w, 3), ConvBN(w, w, 3))
        self.bp = nn.Sequential(nn.MaxPool2d(3, 1, 1), ConvBN(cin, w, 1))
        self.out_channels = 4 * w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b3(x), self.b5(x), self.bp(x)], dim=1)


class Inception(nn.Module):
    def __init__(self, blocks: int, width: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(ConvBN(3, width, 3, 2), ConvBN(width, 2 * width, 3), nn.MaxPool2d(3, 2, 1))
        cin, layers = 2 * width, []
        for i in range(blocks):
            blk = InceptionBlock(cin, width * (1 + i // 2))
            layers.append(blk)
            cin = blk.out_channels
        self.blocks = nn.ModuleList(layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for i, blk in enumerate(self.blocks):
            x = blk(x)
            if i % 3 == 2 and i + 1 < len(self.blocks):
                x = F.max_pool2d(x, 3, 2, 1)
        return self.fc(torch.flatten(self.pool(x), 1))


def inception(blocks: int = 4, width: int = 16, img: int = 64, classes: int = 100, batch: int = 8) -> Built:
    return Inception(blocks, width, classes), (torch.randn(batch, 3, img, img),)


# ---------------------------------------------------------------------------- GNMT
class GNMT(nn.Module):
    """LSTM encoder-decoder with dot-product attention (Wu et al., 2016, simplified): the first
    encoder layer is bidirectional, residual connections from the third layer on, the attention
    context is fed to every decoder layer after the first."""

    def __init__(self, layers: int, hidden: int, vocab: int) -> None:
        super().__init__()
        self.src_emb = nn.Embedding(vocab, hidden)
        self.tgt_emb = nn.Embedding(vocab, hidden)
        enc = [nn.LSTM(hidden, hidden // 2, batch_first=True, bidirectional=True)]
        enc += [nn.LSTM(hidden, hidden, batch_first=True) for _ in range(layers - 1)]
        self.encoder = nn.ModuleList(enc)
        self.decoder = nn.ModuleList([nn.LSTM(hidden, hidden, batch_first=True)]
                                     + [nn.LSTM(2 * hidden, hidden, batch_first=True) for _ in range(layers - 1)])
        self.attn_q = nn.Linear(hidden, hidden, bias=False)
        self.proj = nn.Linear(hidden, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        x = self.src_emb(src)
        for i, lstm in enumerate(self.encoder):
            y, _ = lstm(x)
            x = y + x if i >= 2 else y
        enc = x
        h, _ = self.decoder[0](self.tgt_emb(tgt))
        scores = torch.bmm(self.attn_q(h), enc.transpose(1, 2)) / math.sqrt(enc.shape[-1])
        ctx = torch.bmm(torch.softmax(scores, dim=-1), enc)
        for i, lstm in enumerate(self.decoder[1:], start=1):
            y, _ = lstm(torch.cat([h, ctx], dim=-1))
            h = y + h if i >= 2 else y
        return self.proj(h)


def gnmt(layers: int = 4, hidden: int = 128, vocab: int = 1000, seq: int = 16, batch: int = 8) -> Built:
    if layers < 2 or hidden % 2:
        raise ValueError("gnmt needs layers >= 2 and an even hidden size")
    src = torch.randint(0, vocab, (batch, seq))
    tgt = torch.randint(0, vocab, (batch, seq))
    return GNMT(layers, hidden, vocab), (src, tgt)


# ---------------------------------------------------------------------------- Transformers
class SelfAttention(nn.Module):
    """Multi-head attention: ``qkv`` and ``out`` projections around scaled_dot_product_attention."""

    def __init__(self, hidden: int, heads: int, causal: bool) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class FeedForward(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MoE(nn.Module):
    """Top-k routed experts with a static capacity per expert (GShard, Lepikhin et al., 2021):
    tokens over capacity are dropped; dispatch and combine are dense einsums, so shapes are static
    and the expert FLOPs are those of ``capacity`` tokens each. Experts are ``experts.E.fc1/fc2``."""

    def __init__(self, hidden: int, ffn: int, experts: int, topk: int, capacity_factor: float) -> None:
        super().__init__()
        if not 1 <= topk <= experts:
            raise ValueError(f"topk ({topk}) must be between 1 and experts ({experts})")
        self.topk, self.n, self.cf = topk, experts, capacity_factor
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(hidden, ffn) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        tokens = x.reshape(b * t, c)
        n_tok = b * t
        cap = max(1, math.ceil(self.cf * self.topk * n_tok / self.n))
        probs = torch.softmax(self.router(tokens), dim=-1)  # [T, E]
        gate, idx = torch.topk(probs, self.topk, dim=-1)  # [T, k]
        choice = (idx.unsqueeze(-1) == torch.arange(self.n, device=x.device)).to(x.dtype)  # [T, k, E]
        # position of each (token, choice) in its expert's buffer: choices ranked k-major, then token
        order = choice.transpose(0, 1).reshape(self.topk * n_tok, self.n)
        pos = (torch.cumsum(order, dim=0) - 1.0) * order
        pos = pos.reshape(self.topk, n_tok, self.n).transpose(0, 1)  # [T, k, E]
        slot = (pos.unsqueeze(-1) == torch.arange(cap, device=x.device).to(x.dtype)).to(x.dtype)
        dispatch = (choice.unsqueeze(-1) * slot).sum(1)  # [T, E, C]
        combine = ((choice * gate.unsqueeze(-1)).unsqueeze(-1) * slot).sum(1)
        expert_in = torch.einsum("tec,td->ecd", dispatch, tokens)
        expert_out = torch.stack([ex(expert_in[e]) for e, ex in enumerate(self.experts)], dim=0)
        return torch.einsum("tec,ecd->td", combine, expert_out).reshape(b, t, c)


class Block(nn.Module):
    """Pre-LN transformer block: ``ln1, attn.qkv, attn.out, ln2, mlp.fc1, mlp.fc2`` (or ``moe``)."""

    def __init__(self, hidden: int, heads: int, causal: bool, moe: dict | None = None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = SelfAttention(hidden, heads, causal)
        self.ln2 = nn.LayerNorm(hidden)
        if moe:
            self.moe = MoE(hidden, 4 * hidden, **moe)
        else:
            self.mlp = FeedForward(hidden, 4 * hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        ff = self.moe if hasattr(self, "moe") else self.mlp
        return x + ff(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer (GPT-2 layout): ``wte, wpe, layers.N.*, ln_f, lm_head``."""

    def __init__(self, layers: int, hidden: int, heads: int, seq: int, vocab: int,
                 moe: dict | None = None, moe_every: int = 1, causal: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.layers = nn.ModuleList(
            Block(hidden, heads, causal, moe if (moe and i % moe_every == moe_every - 1) else None)
            for i in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_f(x))


def gpt(layers: int = 2, hidden: int = 64, heads: int = 4, seq: int = 32, vocab: int = 512,
        batch: int = 2) -> Built:
    return GPT(layers, hidden, heads, seq, vocab), (torch.randint(0, vocab, (batch, seq)),)


class BERT(nn.Module):
    """Encoder-only transformer (BERT layout, post-LN): ``embeddings, layers.N.*, pooler``."""

    def __init__(self, layers: int, hidden: int, heads: int, seq: int, vocab: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.typ = nn.Embedding(2, hidden)
        self.ln_emb = nn.LayerNorm(hidden)
        self.layers = nn.ModuleList(PostLNBlock(hidden, heads) for _ in range(layers))
        self.pooler = nn.Linear(hidden, hidden)

    def forward(self, idx: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.ln_emb(self.tok(idx) + self.pos(pos) + self.typ(types))
        for layer in self.layers:
            x = layer(x)
        return torch.tanh(self.pooler(x[:, 0]))


class PostLNBlock(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.attn = SelfAttention(hidden, heads, causal=False)
        self.ln1 = nn.LayerNorm(hidden)
        self.mlp = FeedForward(hidden, 4 * hidden)
        self.ln2 = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


def bert(layers: int = 2, hidden: int = 64, heads: int = 4, seq: int = 32, vocab: int = 512,
         batch: int = 2) -> Built:
    idx = torch.randint(0, vocab, (batch, seq))
    types = torch.zeros(batch, seq, dtype=torch.long)
    return BERT(layers, hidden, heads, seq, vocab), (idx, types)


def moe(layers: int = 2, hidden: int = 64, heads: int = 4, experts: int = 4, topk: int = 2, seq: int = 32,
        vocab: int = 512, every: int = 1, capacity: float = 1.25, batch: int = 2) -> Built:
    """GPT with a routed-experts FFN in every ``every``-th block (Switch/GShard style)."""
    cfg = dict(experts=experts, topk=topk, capacity_factor=float(capacity))
    model = GPT(layers, hidden, heads, seq, vocab, moe=cfg, moe_every=max(1, every))
    return model, (torch.randint(0, vocab, (batch, seq)),)


# ---------------------------------------------------------------------------- U-Net
class UNet(nn.Module):
    """U-Net (Ronneberger et al., 2015; 3-D: Çiçek et al., 2016): ``down.L``, ``bottom``, ``up.L``
    double-conv blocks, max-pool down, transposed-conv up, skip concatenation."""

    def __init__(self, dims: int, levels: int, width: int, cin: int, classes: int) -> None:
        super().__init__()
        if dims not in (2, 3):
            raise ValueError(f"unet dims must be 2 or 3, got {dims}")
        conv = nn.Conv2d if dims == 2 else nn.Conv3d
        norm = nn.BatchNorm2d if dims == 2 else nn.BatchNorm3d
        upconv = nn.ConvTranspose2d if dims == 2 else nn.ConvTranspose3d
        self.pool = nn.MaxPool2d(2) if dims == 2 else nn.MaxPool3d(2)

        def double(a: int, b: int) -> nn.Sequential:
            return nn.Sequential(conv(a, b, 3, padding=1, bias=False), norm(b), nn.ReLU(),
                                 conv(b, b, 3, padding=1, bias=False), norm(b), nn.ReLU())

        chans = [width * 2**i for i in range(levels)]
        self.down = nn.ModuleList(double(a, b) for a, b in zip([cin] + chans[:-1], chans))
        self.bottom = double(chans[-1], 2 * chans[-1])
        self.upsample = nn.ModuleList(upconv(2 * c, c, 2, stride=2) for c in reversed(chans))
        self.up = nn.ModuleList(double(2 * c, c) for c in reversed(chans))
        self.head = conv(chans[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for blk in self.down:
            x = blk(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottom(x)
        for upsample, blk, skip in zip(self.upsample, self.up, reversed(skips)):
            x = blk(torch.cat([upsample(x), skip], dim=1))
        return self.head(x)


def unet(dims: int = 2, levels: int = 3, width: int = 8, img: int = 64, channels: int = 1, classes: int = 2,
         batch: int = 2) -> Built:
    if img % 2**levels:
        raise ValueError(f"unet img ({img}) must be divisible by 2**levels ({2**levels})")
    shape = (batch, channels) + (img,) * dims
    return UNet(dims, levels, width, channels, classes), (torch.randn(shape),)


FAMILIES: dict[str, Callable[..., Built]] = {
    "mlp": mlp, "resnet": resnet, "inception": inception, "gnmt": gnmt, "gpt": gpt, "bert": bert,
    "moe": moe, "unet": unet,
}

# Knob choices the sampler draws from, per family and size class (every combination is valid).
SIZES: dict[str, dict[str, dict[str, list]]] = {
    "mlp": {"small": {"layers": [2, 3, 4, 6], "hidden": [64, 128, 256], "batch": [16, 32, 64]},
            "medium": {"layers": [4, 8, 12], "hidden": [512, 1024, 2048], "batch": [32, 64, 128]},
            "large": {"layers": [8, 16, 24], "hidden": [4096, 8192], "batch": [64, 256]}},
    "resnet": {"small": {"depth": [10, 18], "width": [8, 16], "img": [32, 64], "batch": [4, 8]},
               "medium": {"depth": [18, 34, 50], "width": [32, 64], "img": [112, 224], "batch": [16, 32]},
               "large": {"depth": [50, 101, 152], "width": [64], "img": [224], "batch": [32, 64, 128]}},
    "inception": {"small": {"blocks": [2, 3, 4], "width": [8, 16], "img": [32, 64], "batch": [4, 8]},
                  "medium": {"blocks": [6, 9], "width": [32, 64], "img": [128, 224], "batch": [16, 32]},
                  "large": {"blocks": [9, 12], "width": [64, 96], "img": [299], "batch": [32, 64]}},
    "gnmt": {"small": {"layers": [2, 3, 4], "hidden": [64, 128], "vocab": [500, 1000], "seq": [8, 16],
                       "batch": [4, 8]},
             "medium": {"layers": [4, 8], "hidden": [512, 1024], "vocab": [8000, 32000], "seq": [32, 50],
                        "batch": [32, 64]},
             "large": {"layers": [8], "hidden": [1024, 2048], "vocab": [32000], "seq": [64, 100],
                       "batch": [128, 256]}},
    "gpt": {"small": {"layers": [2, 3, 4], "hidden": [64, 128], "heads": [2, 4], "seq": [16, 32],
                      "vocab": [256, 512], "batch": [2, 4]},
            "medium": {"layers": [12, 24], "hidden": [768, 1024, 2048], "heads": [8, 16], "seq": [512, 1024],
                       "vocab": [32000, 50257], "batch": [4, 8]},
            "large": {"layers": [32, 40, 48], "hidden": [4096, 5120], "heads": [32], "seq": [2048],
                      "vocab": [50257], "batch": [8, 16]}},
    "bert": {"small": {"layers": [2, 3, 4], "hidden": [64, 128], "heads": [2, 4], "seq": [16, 32],
                       "vocab": [256, 512], "batch": [2, 4]},
             "medium": {"layers": [12, 24], "hidden": [768, 1024], "heads": [8, 16], "seq": [128, 512],
                        "vocab": [30522], "batch": [16, 32]},
             "large": {"layers": [24, 48], "hidden": [2048, 4096], "heads": [16, 32], "seq": [512],
                       "vocab": [30522], "batch": [32, 64]}},
    "moe": {"small": {"layers": [2, 3], "hidden": [64, 128], "heads": [2, 4], "experts": [2, 4],
                      "topk": [1, 2], "seq": [16], "vocab": [256], "batch": [2]},
            "medium": {"layers": [8, 12], "hidden": [512, 768], "heads": [8], "experts": [8, 16],
                       "topk": [1, 2], "seq": [256, 512], "vocab": [32000], "every": [2], "batch": [4, 8]},
            "large": {"layers": [24, 32], "hidden": [2048, 4096], "heads": [16, 32], "experts": [8, 64],
                      "topk": [2], "seq": [2048], "vocab": [32000], "every": [2], "batch": [8]}},
    "unet": {"small": {"dims": [2, 3], "levels": [2, 3], "width": [4, 8], "img": [16, 32], "batch": [1, 2]},
             "medium": {"dims": [2, 3], "levels": [3, 4], "width": [16, 32], "img": [64, 128],
                        "batch": [2, 4]},
             "large": {"dims": [2, 3], "levels": [4, 5], "width": [32, 64], "img": [128, 256],
                       "batch": [4, 8]}},
}
