"""Model zoo: real ``nn.Module`` families with size knobs, for tracing into OpGraphs.

Each family is a builder ``family(**knobs) -> (module, example_inputs)``; every builder takes
``batch`` and small defaults, so ``FAMILIES["gpt"]()`` is a model that traces in well under a second.
Build under ``torch.device("meta")`` (as ``profilers.spec.build_model`` does) to avoid allocating
weights. All members export with ``torch.export`` (static shapes, no data-dependent control flow).

Families: ``mlp``, ``resnet`` (depth, width), ``inception`` (multi-branch CNN), ``gnmt`` (LSTM
encoder-decoder with attention), ``gpt`` (decoder-only), ``bert`` (encoder), ``moe`` (transformer
with top-k routed experts, GShard-style static-capacity dispatch), ``unet`` (2-D or 3-D), ``vit``
(vision transformer), ``llama`` (RMSNorm, rotary positions, grouped-query attention, SwiGLU, untied
head), ``t5`` (encoder-decoder with relative position bias and cross-attention), ``dlrm``
(embedding-bag tables, bottom/top MLPs, dot interaction), ``twotower`` (two-branch retrieval model),
``convnext`` (modern plain CNN), ``diffusion`` (denoising U-Net with timestep embedding and attention
at low resolution).

``SIZES`` holds small discrete size classes (``profilers.spec.sample_specs``);
``profilers.families.RANGES`` the realistic ranges a training distribution draws from.
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
    """Pre-LN transformer block: ``ln1, attn.qkv, attn.out, ln2, mlp.fc1, mlp.fc2`` (or ``moe``);
    the feed-forward width is ``ffn`` (default ``4 * hidden``)."""

    def __init__(self, hidden: int, heads: int, causal: bool, moe: dict | None = None,
                 ffn: int | None = None) -> None:
        super().__init__()
        ffn = 4 * hidden if ffn is None else int(ffn)
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = SelfAttention(hidden, heads, causal)
        self.ln2 = nn.LayerNorm(hidden)
        if moe:
            self.moe = MoE(hidden, ffn, **moe)
        else:
            self.mlp = FeedForward(hidden, ffn)

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


# ---------------------------------------------------------------------------- ViT
class PatchEmbed(nn.Module):
    """Patches to tokens: a ``patch`` x ``patch`` convolution with stride ``patch`` (``proj``), a class
    token prepended, learned positions added."""

    def __init__(self, img: int, patch: int, channels: int, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(channels, hidden, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, hidden))
        self.pos_embed = nn.Parameter(torch.zeros(1, (img // patch) ** 2 + 1, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x).flatten(2).transpose(1, 2)
        return torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed


class ViT(nn.Module):
    """Vision transformer (Dosovitskiy et al., 2021): ``patch_embed``, pre-LN blocks ``layers.N.*``
    (``attn.qkv``, ``attn.out``, ``mlp.fc1``, ``mlp.fc2``), ``ln_f``, a classifier ``head`` on the class token."""

    def __init__(self, img: int, patch: int, layers: int, hidden: int, heads: int, ffn: int, classes: int,
                 channels: int = 3) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(img, patch, channels, hidden)
        self.layers = nn.ModuleList(Block(hidden, heads, causal=False, ffn=ffn) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x)[:, 0])


def vit(img: int = 32, patch: int = 8, layers: int = 2, hidden: int = 64, heads: int = 4, mlp_ratio: float = 4.0,
        classes: int = 10, batch: int = 2) -> Built:
    """ViT-B/16 at 224: ``vit:img=224,patch=16,layers=12,hidden=768,heads=12,classes=1000``."""
    if img % patch:
        raise ValueError(f"vit img ({img}) must be divisible by patch ({patch})")
    ffn = max(1, round(hidden * float(mlp_ratio)))
    return ViT(img, patch, layers, hidden, heads, ffn, classes), (torch.randn(batch, 3, img, img),)


# ---------------------------------------------------------------------------- Llama
class RotaryAngles(nn.Module):
    """cos and signed sin of the rotary angles (Su et al., 2021) for ``T`` positions, ``[T, 1, head_dim]``;
    computed once per forward from positions alone (constants of the traced graph)."""

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.head_dim, self.base = head_dim, float(base)

    def forward(self, t: int, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.head_dim
        inv = 1.0 / self.base ** (torch.arange(0, d, 2, device=ref.device, dtype=torch.float32) / d)
        freqs = torch.outer(torch.arange(t, device=ref.device, dtype=torch.float32), inv)
        cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1)
        sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1)  # rotate_half's sign folded in
        return cos[:, None].to(ref.dtype), sin[:, None].to(ref.dtype)


class Rotary(nn.Module):
    """Rotary position embedding of the queries and keys ``[B, T, heads, head_dim]`` in Llama's
    rotate-half form, ``x cos + rotate_half(x) sin`` with ``rotate_half(x) = [-x2, x1]`` (the sign is
    in ``sin``; swapping the halves is a flip), both rotated in one pass."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
        return x * cos + swapped * sin


class GQAttention(nn.Module):
    """Grouped-query attention (Ainslie et al., 2023) with rotary positions: a fused ``qkv`` projection
    ((heads + 2 kv_heads) x head_dim outputs, no bias), ``rope`` on queries and keys, causal
    scaled_dot_product_attention where each key/value head serves heads / kv_heads query heads, ``out``."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, causal: bool = True) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        if heads % kv_heads:
            raise ValueError(f"heads ({heads}) must be divisible by kv_heads ({kv_heads})")
        if (hidden // heads) % 2:
            raise ValueError(f"the head size hidden / heads ({hidden // heads}) must be even for rotary positions")
        self.heads, self.kv_heads, self.head_dim, self.causal = heads, kv_heads, hidden // heads, causal
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.rope = Rotary()
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        b, t, c = x.shape
        h, kv, d = self.heads, self.kv_heads, self.head_dim
        qk, v = self.qkv(x).view(b, t, h + 2 * kv, d).split([h + kv, kv], dim=2)
        q, k = self.rope(qk, *angles).split([h, kv], dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=self.causal, enable_gqa=kv != h)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class SwiGLU(nn.Module):
    """Gated feed-forward (Shazeer, 2020): ``down(silu(gate(x)) * up(x))``, no biases."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    """Pre-norm decoder block: ``ln1`` (RMSNorm), ``attn.qkv``, ``attn.rope``, ``attn.out``, ``ln2``,
    ``mlp.gate``, ``mlp.up``, ``mlp.down``."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.ln1 = nn.RMSNorm(hidden, eps=1e-5)
        self.attn = GQAttention(hidden, heads, kv_heads)
        self.ln2 = nn.RMSNorm(hidden, eps=1e-5)
        self.mlp = SwiGLU(hidden, ffn)

    def forward(self, x: torch.Tensor, angles: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), angles)
        return x + self.mlp(self.ln2(x))


class Llama(nn.Module):
    """Decoder-only LLM in the Llama 2/3 layout (Touvron et al., 2023): ``wte``, the rotary angles
    ``rope`` (shared by all layers), ``layers.N.*``, ``ln_f`` (RMSNorm), an untied ``lm_head``."""

    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.rope = RotaryAngles(hidden // heads)
        self.layers = nn.ModuleList(LlamaBlock(hidden, heads, kv_heads, ffn) for _ in range(layers))
        self.ln_f = nn.RMSNorm(hidden, eps=1e-5)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        angles = self.rope(idx.shape[1], x)
        for layer in self.layers:
            x = layer(x, angles)
        return self.lm_head(self.ln_f(x))


def llama(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, ffn: int = 172, vocab: int = 512,
          seq: int = 32, batch: int = 2) -> Built:
    """Llama-2-7B: ``llama:layers=32,hidden=4096,heads=32,kv_heads=32,ffn=11008,vocab=32000,seq=4096``."""
    return Llama(layers, hidden, heads, kv_heads, ffn, vocab), (torch.randint(0, vocab, (batch, seq)),)


# ---------------------------------------------------------------------------- T5
class RelativeBias(nn.Module):
    """T5's bucketed relative position bias (Raffel et al., 2020): an ``[1, heads, q, k]`` additive
    attention bias from a ``buckets`` x ``heads`` table (plus the causal mask in the decoder); the
    bucket of each (query, key) pair depends only on positions."""

    def __init__(self, heads: int, causal: bool, buckets: int = 32, max_distance: int = 128) -> None:
        super().__init__()
        self.causal, self.buckets, self.max_distance = causal, buckets, max_distance
        self.table = nn.Embedding(buckets, heads)

    def _bucket(self, rel: torch.Tensor) -> torch.Tensor:
        n, out = self.buckets, torch.zeros_like(rel)
        if self.causal:
            rel = -torch.clamp(rel, max=0)
        else:
            n //= 2
            out = out + (rel > 0).long() * n
            rel = rel.abs()
        exact = n // 2
        far = exact + (torch.log(rel.float().clamp(min=1) / exact) / math.log(self.max_distance / exact)
                       * (n - exact)).long()
        return out + torch.where(rel < exact, rel, torch.clamp(far, max=n - 1))

    def forward(self, q_len: int, k_len: int, ref: torch.Tensor) -> torch.Tensor:
        ctx = torch.arange(q_len, device=ref.device)[:, None]
        mem = torch.arange(k_len, device=ref.device)[None, :]
        bias = self.table(self._bucket(mem - ctx)).permute(2, 0, 1).unsqueeze(0).to(ref.dtype)
        if self.causal:
            mask = torch.ones(q_len, k_len, dtype=torch.bool, device=ref.device).triu(1)
            bias = bias.masked_fill(mask, float("-inf"))
        return bias


class T5Attention(nn.Module):
    """Multi-head attention without biases: self-attention fuses ``qkv``; cross-attention has ``q`` on
    the decoder stream and ``kv`` on the encoder output; ``out``; an additive position bias."""

    def __init__(self, hidden: int, heads: int, cross: bool) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        self.heads, self.cross = heads, cross
        if cross:
            self.q = nn.Linear(hidden, hidden, bias=False)
            self.kv = nn.Linear(hidden, 2 * hidden, bias=False)
        else:
            self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        b, t, c = x.shape
        h, d = self.heads, c // self.heads
        if self.cross:
            q = self.q(x).view(b, t, h, d).transpose(1, 2)
            k, v = self.kv(memory).view(b, memory.shape[1], 2, h, d).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q, k, v = self.qkv(x).view(b, t, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class T5FeedForward(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn, bias=False)
        self.fc2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


class T5Block(nn.Module):
    """Pre-norm (RMSNorm) block: ``ln1, attn`` (+ ``ln_cross, cross_attn`` in the decoder), ``ln2, mlp``."""

    def __init__(self, hidden: int, heads: int, ffn: int, decoder: bool) -> None:
        super().__init__()
        self.ln1 = nn.RMSNorm(hidden, eps=1e-6)
        self.attn = T5Attention(hidden, heads, cross=False)
        if decoder:
            self.ln_cross = nn.RMSNorm(hidden, eps=1e-6)
            self.cross_attn = T5Attention(hidden, heads, cross=True)
        self.ln2 = nn.RMSNorm(hidden, eps=1e-6)
        self.mlp = T5FeedForward(hidden, ffn)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), bias=bias)
        if memory is not None:
            x = x + self.cross_attn(self.ln_cross(x), memory)
        return x + self.mlp(self.ln2(x))


class T5Stack(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, decoder: bool) -> None:
        super().__init__()
        self.rel_bias = RelativeBias(heads, causal=decoder)
        self.layers = nn.ModuleList(T5Block(hidden, heads, ffn, decoder) for _ in range(layers))
        self.ln_f = nn.RMSNorm(hidden, eps=1e-6)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        bias = self.rel_bias(x.shape[1], x.shape[1], x)
        for layer in self.layers:
            x = layer(x, bias, memory)
        return self.ln_f(x)


class T5(nn.Module):
    """Encoder-decoder transformer (T5 v1.1 layout, Raffel et al., 2020): a ``shared`` token embedding,
    ``encoder.layers.N.*`` and ``decoder.layers.N.*`` (self-attention with relative position bias;
    the decoder's is causal and followed by ``cross_attn`` on the encoder output), an untied ``lm_head``."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, vocab: int) -> None:
        super().__init__()
        self.shared = nn.Embedding(vocab, hidden)
        self.encoder = T5Stack(layers, hidden, heads, ffn, decoder=False)
        self.decoder = T5Stack(layers, hidden, heads, ffn, decoder=True)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        memory = self.encoder(self.shared(src))
        return self.lm_head(self.decoder(self.shared(tgt), memory))


def t5(layers: int = 2, hidden: int = 64, heads: int = 4, ffn: int = 256, vocab: int = 512, seq: int = 32,
       tgt_seq: int = 32, batch: int = 2) -> Built:
    """T5-base-like: ``t5:layers=12,hidden=768,heads=12,ffn=3072,vocab=32128,seq=512,tgt_seq=128``."""
    src = torch.randint(0, vocab, (batch, seq))
    tgt = torch.randint(0, vocab, (batch, tgt_seq))
    return T5(layers, hidden, heads, ffn, vocab), (src, tgt)


# ---------------------------------------------------------------------------- recommendation
def _mlp_stack(widths: list[int], last_relu: bool) -> nn.Sequential:
    mods: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        mods.append(nn.Linear(a, b))
        if last_relu or i < len(widths) - 2:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


class DotInteraction(nn.Module):
    """DLRM's feature interaction: the pairwise dot products of the dense vector and the pooled
    embeddings (a batched ``x x^T`` of ``[B, n, dim]``, its strict upper triangle kept), concatenated
    with the dense vector."""

    def forward(self, dense: torch.Tensor, pooled: list[torch.Tensor]) -> torch.Tensor:
        x = torch.stack([dense, *pooled], dim=1)
        z = torch.bmm(x, x.transpose(1, 2))
        n = x.shape[1]
        i, j = torch.triu_indices(n, n, offset=1, device=x.device)
        return torch.cat([dense, z[:, i, j]], dim=1)


class DLRM(nn.Module):
    """Deep learning recommendation model (Naumov et al., 2019): a ``bottom`` MLP on dense features,
    ``tables`` sum-pooled embedding bags ``embeddings.T`` (``rows`` x ``dim``) on multi-hot sparse
    features, the pairwise dot ``interaction``, a ``top`` MLP to one click logit. The embedding tables
    hold almost all parameters."""

    def __init__(self, tables: int, rows: int, dim: int, dense: int, bottom: int, bottom_layers: int, top: int,
                 top_layers: int) -> None:
        super().__init__()
        self.bottom = _mlp_stack([dense] + [bottom] * bottom_layers + [dim], last_relu=True)
        self.embeddings = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(tables))
        self.interaction = DotInteraction()
        n = tables + 1
        self.top = _mlp_stack([dim + n * (n - 1) // 2] + [top] * top_layers + [1], last_relu=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        pooled = [emb(sparse[:, t]) for t, emb in enumerate(self.embeddings)]
        return self.top(self.interaction(self.bottom(dense), pooled))


def dlrm(tables: int = 8, rows: int = 1000, dim: int = 16, dense: int = 13, bottom: int = 64, bottom_layers: int = 2,
         top: int = 64, top_layers: int = 2, pooling: int = 2, batch: int = 32) -> Built:
    """MLPerf DLRM (Criteo 1TB): ``dlrm:tables=26,rows=10000000,dim=128,bottom=512,bottom_layers=2,top=1024,
    top_layers=3,pooling=1``; ``pooling`` ids per sample and table."""
    inputs = (torch.randn(batch, dense), torch.randint(0, rows, (batch, tables, pooling)))
    return DLRM(tables, rows, dim, dense, bottom, bottom_layers, top, top_layers), inputs


class Tower(nn.Module):
    """One tower: sum-pooled embedding bags ``embeddings.T``, concatenated, an ``mlp`` to ``out``."""

    def __init__(self, tables: int, rows: int, dim: int, hidden: int, layers: int, out: int) -> None:
        super().__init__()
        self.embeddings = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(tables))
        self.mlp = _mlp_stack([tables * dim] + [hidden] * layers + [out], last_relu=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([emb(ids[:, t]) for t, emb in enumerate(self.embeddings)], dim=1))


class TwoTower(nn.Module):
    """Two-tower retrieval model (Yi et al., 2019): independent ``user`` and ``item`` towers (two
    branches with no edge between them until the end) scored against each other with in-batch
    negatives (``[B, B]`` logits)."""

    def __init__(self, user_tables: int, item_tables: int, rows: int, dim: int, hidden: int, layers: int,
                 out: int) -> None:
        super().__init__()
        self.user = Tower(user_tables, rows, dim, hidden, layers, out)
        self.item = Tower(item_tables, rows, dim, hidden, layers, out)

    def forward(self, user_ids: torch.Tensor, item_ids: torch.Tensor) -> torch.Tensor:
        return self.user(user_ids) @ self.item(item_ids).t()


def twotower(user_tables: int = 4, item_tables: int = 2, rows: int = 1000, dim: int = 16, hidden: int = 64,
             layers: int = 2, out: int = 32, pooling: int = 2, batch: int = 32) -> Built:
    ids = (torch.randint(0, rows, (batch, user_tables, pooling)), torch.randint(0, rows, (batch, item_tables, pooling)))
    return TwoTower(user_tables, item_tables, rows, dim, hidden, layers, out), ids


# ---------------------------------------------------------------------------- ConvNeXt
class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    """``dwconv`` (7x7 depthwise), ``norm``, ``fc1`` (4x), GELU, ``fc2``, layer scale, residual."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(ch, ch, 7, padding=3, groups=ch)
        self.norm = nn.LayerNorm(ch, eps=1e-6)
        self.fc1 = nn.Linear(ch, 4 * ch)
        self.fc2 = nn.Linear(4 * ch, ch)
        self.gamma = nn.Parameter(torch.full((ch,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        y = self.fc2(F.gelu(self.fc1(y))) * self.gamma
        return x + y.permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    """ConvNeXt (Liu et al., 2022): a 4x4 stride-4 ``stem``, four stages ``stages.S.B`` of (3, 3,
    ``depth``, 3) blocks at widths ``width`` x (1, 2, 4, 8), ``down.S`` (LayerNorm, 2x2 stride-2 conv)
    between them, global pooling, ``norm``, ``head``."""

    def __init__(self, depth: int, width: int, classes: int) -> None:
        super().__init__()
        widths = [width * 2**s for s in range(4)]
        self.stem = nn.Sequential(nn.Conv2d(3, width, 4, 4), LayerNorm2d(width, eps=1e-6))
        self.down = nn.ModuleList(nn.Sequential(LayerNorm2d(a, eps=1e-6), nn.Conv2d(a, b, 2, 2))
                                  for a, b in zip(widths[:-1], widths[1:]))
        self.stages = nn.ModuleList(nn.Sequential(*(ConvNeXtBlock(w) for _ in range(n)))
                                    for w, n in zip(widths, (3, 3, depth, 3)))
        self.norm = nn.LayerNorm(widths[-1], eps=1e-6)
        self.head = nn.Linear(widths[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for s, stage in enumerate(self.stages):
            if s:
                x = self.down[s - 1](x)
            x = stage(x)
        return self.head(self.norm(x.mean(dim=(2, 3))))


def convnext(depth: int = 3, width: int = 16, img: int = 64, classes: int = 100, batch: int = 4) -> Built:
    """ConvNeXt-T: ``convnext:depth=9,width=96,img=224,classes=1000``; -S: depth=27; -B: depth=27,width=128."""
    if img < 32:
        raise ValueError(f"convnext img ({img}) must be >= 32 (the stem and three downsamplings divide it by 32)")
    return ConvNeXt(depth, width, classes), (torch.randn(batch, 3, img, img),)


# ---------------------------------------------------------------------------- diffusion U-Net
def _group_norm(ch: int) -> nn.GroupNorm:
    return nn.GroupNorm(math.gcd(32, ch), ch)


class TimestepEmbed(nn.Module):
    """Sinusoidal embedding of the diffusion timestep, then ``fc1``, SiLU, ``fc2`` (Ho et al., 2020)."""

    def __init__(self, width: int, dim: int) -> None:
        super().__init__()
        self.width = width
        self.fc1 = nn.Linear(width, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.width // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        args = t[:, None].float() * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(self.fc1.weight.dtype)
        return self.fc2(F.silu(self.fc1(emb)))


class ResBlock(nn.Module):
    """``norm1``, SiLU, ``conv1``, + ``temb`` (timestep projection), ``norm2``, SiLU, ``conv2``, residual
    (``skip``: a 1x1 conv when the width changes)."""

    def __init__(self, cin: int, cout: int, tdim: int) -> None:
        super().__init__()
        self.norm1 = _group_norm(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.temb = nn.Linear(tdim, cout)
        self.norm2 = _group_norm(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb(F.silu(t))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return (self.skip(x) if self.skip is not None else x) + h


class SpatialAttention(nn.Module):
    """Self-attention over the pixels of a feature map: ``norm``, ``qkv``, SDPA, ``out``, residual."""

    def __init__(self, ch: int, heads: int) -> None:
        super().__init__()
        if ch % heads:
            raise ValueError(f"channels ({ch}) must be divisible by heads ({heads})")
        self.heads = heads
        self.norm = _group_norm(ch)
        self.qkv = nn.Linear(ch, 3 * ch)
        self.out = nn.Linear(ch, ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, hh, ww = x.shape
        t = hh * ww
        y = self.norm(x).flatten(2).transpose(1, 2)
        q, k, v = self.qkv(y).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v)
        y = self.out(y.transpose(1, 2).reshape(b, t, c))
        return x + y.transpose(1, 2).reshape(b, c, hh, ww)


class DiffusionLevel(nn.Module):
    def __init__(self, cin: int, cout: int, blocks: int, tdim: int, heads: int, attn: bool) -> None:
        super().__init__()
        self.res = nn.ModuleList(ResBlock(cin if i == 0 else cout, cout, tdim) for i in range(blocks))
        self.attn = nn.ModuleList(SpatialAttention(cout, heads) for _ in range(blocks)) if attn else None

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        for i, res in enumerate(self.res):
            x = res(x, t)
            if self.attn is not None:
                x = self.attn[i](x)
        return x


class DiffusionUNet(nn.Module):
    """Denoising U-Net of diffusion models (Ho et al., 2020; Dhariwal & Nichol, 2021; Stable Diffusion's
    layout without text conditioning): a ``time`` embedding fed to every residual block, ``levels``
    resolutions with ``blocks`` residual blocks each at widths ``width`` x (1, 2, 4, 4, ...), spatial
    attention in the ``attn`` lowest-resolution levels and the ``mid`` block, strided-conv
    ``downsample.L``, nearest + conv ``upsample.L``, skip concatenations."""

    def __init__(self, channels: int, width: int, levels: int, blocks: int, attn: int, heads: int) -> None:
        super().__init__()
        tdim = 4 * width
        chans = [width * min(2**i, 4) for i in range(levels)]
        has_attn = [i >= levels - attn for i in range(levels)]
        self.time = TimestepEmbed(width, tdim)
        self.stem = nn.Conv2d(channels, width, 3, padding=1)
        self.down = nn.ModuleList(DiffusionLevel(a, b, blocks, tdim, heads, at)
                                  for a, b, at in zip([width] + chans[:-1], chans, has_attn))
        self.downsample = nn.ModuleList(nn.Conv2d(c, c, 3, stride=2, padding=1) for c in chans[:-1])
        self.mid = DiffusionLevel(chans[-1], chans[-1], 2, tdim, heads, True)
        self.up = nn.ModuleList(DiffusionLevel(2 * c, c, blocks, tdim, heads, at)
                                for c, at in zip(reversed(chans), reversed(has_attn)))
        self.upsample = nn.ModuleList(nn.Conv2d(a, b, 3, padding=1)
                                      for a, b in zip(list(reversed(chans))[:-1], list(reversed(chans))[1:]))
        self.out_norm = _group_norm(width)
        self.out = nn.Conv2d(width, channels, 3, padding=1)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        t = self.time(timestep)
        x = self.stem(x)
        skips = []
        for i, level in enumerate(self.down):
            x = level(x, t)
            skips.append(x)
            if i < len(self.downsample):
                x = self.downsample[i](x)
        x = self.mid(x, t)
        for i, level in enumerate(self.up):
            x = level(torch.cat([x, skips.pop()], dim=1), t)
            if i < len(self.upsample):
                x = self.upsample[i](F.interpolate(x, scale_factor=2.0, mode="nearest"))
        return self.out(F.silu(self.out_norm(x)))


def diffusion(img: int = 16, channels: int = 4, width: int = 32, levels: int = 3, blocks: int = 1, attn: int = 1,
              heads: int = 4, batch: int = 2) -> Built:
    """Stable-Diffusion-1.x-sized (latent 64x64, no text): ``diffusion:img=64,channels=4,width=320,levels=4,
    blocks=2,attn=3,heads=8``; pixel-space ADM at 256: img=256,channels=3,width=256,levels=6,attn=3."""
    if img % 2 ** (levels - 1):
        raise ValueError(f"diffusion img ({img}) must be divisible by 2**(levels - 1) ({2 ** (levels - 1)})")
    if attn > levels:
        raise ValueError(f"diffusion attn ({attn}) must be at most levels ({levels})")
    if width % 2:
        raise ValueError(f"diffusion width ({width}) must be even (the timestep embedding is sin/cos pairs)")
    model = DiffusionUNet(channels, width, levels, blocks, attn, heads)
    return model, (torch.randn(batch, channels, img, img), torch.randint(0, 1000, (batch,)).float())


FAMILIES: dict[str, Callable[..., Built]] = {
    "mlp": mlp, "resnet": resnet, "inception": inception, "gnmt": gnmt, "gpt": gpt, "bert": bert,
    "moe": moe, "unet": unet, "vit": vit, "llama": llama, "t5": t5, "dlrm": dlrm, "twotower": twotower,
    "convnext": convnext, "diffusion": diffusion,
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
    "vit": {"small": {"img": [32, 64], "patch": [8, 16], "layers": [2, 3], "hidden": [64, 128], "heads": [2, 4],
                      "classes": [10], "batch": [2, 4]},
            "medium": {"img": [224], "patch": [16], "layers": [6, 12], "hidden": [384, 768], "heads": [6, 12],
                       "classes": [1000], "batch": [32, 64]},
            "large": {"img": [224], "patch": [14, 16], "layers": [24, 32], "hidden": [1024, 1280], "heads": [16],
                      "classes": [1000], "batch": [64, 256]}},
    "llama": {"small": {"layers": [2, 3], "hidden": [64, 128], "heads": [4], "kv_heads": [1, 2, 4],
                        "ffn": [172, 344], "vocab": [256, 512], "seq": [16, 32], "batch": [2]},
              "medium": {"layers": [12, 16, 24], "hidden": [1024, 2048], "heads": [16], "kv_heads": [4, 8, 16],
                         "ffn": [2816, 5632], "vocab": [32000, 128256], "seq": [1024, 2048], "batch": [8, 16]},
              "large": {"layers": [32, 40], "hidden": [4096, 5120], "heads": [32], "kv_heads": [8, 32],
                        "ffn": [11008, 13824, 14336], "vocab": [32000, 128256], "seq": [4096], "batch": [16, 64]}},
    "t5": {"small": {"layers": [1, 2], "hidden": [64, 128], "heads": [2, 4], "ffn": [128, 256], "vocab": [256, 512],
                     "seq": [16, 32], "tgt_seq": [8, 16], "batch": [2]},
           "medium": {"layers": [6, 12], "hidden": [512, 768], "heads": [8], "ffn": [2048, 3072], "vocab": [32128],
                      "seq": [512], "tgt_seq": [128], "batch": [32, 64]},
           "large": {"layers": [24], "hidden": [1024, 2048], "heads": [16, 32], "ffn": [4096, 5120],
                     "vocab": [32128], "seq": [512], "tgt_seq": [128, 512], "batch": [64, 128]}},
    "dlrm": {"small": {"tables": [4, 8], "rows": [1000, 10000], "dim": [16, 32], "bottom": [64, 128],
                       "top": [64, 128], "pooling": [1, 4], "batch": [32, 128]},
             "medium": {"tables": [16, 26], "rows": [100000, 1000000], "dim": [64, 128], "bottom": [256, 512],
                        "top": [512, 1024], "pooling": [1, 8], "batch": [2048, 8192]},
             "large": {"tables": [26, 64], "rows": [10000000], "dim": [128, 256], "bottom": [512],
                       "top": [1024, 2048], "top_layers": [3], "pooling": [1, 16], "batch": [32768, 65536]}},
    "twotower": {"small": {"user_tables": [2, 4], "item_tables": [1, 2], "rows": [1000, 10000], "dim": [16, 32],
                           "hidden": [64, 128], "layers": [2], "out": [32], "batch": [32, 128]},
                 "medium": {"user_tables": [8, 16], "item_tables": [4, 8], "rows": [100000, 1000000], "dim": [64],
                            "hidden": [512, 1024], "layers": [2, 3], "out": [128], "batch": [4096]},
                 "large": {"user_tables": [24, 32], "item_tables": [12, 16], "rows": [10000000], "dim": [128],
                           "hidden": [2048], "layers": [3, 4], "out": [256], "batch": [16384, 65536]}},
    "convnext": {"small": {"depth": [2, 3], "width": [8, 16], "img": [32, 64], "classes": [10, 100], "batch": [2, 4]},
                 "medium": {"depth": [9], "width": [64, 96], "img": [224], "classes": [1000], "batch": [32, 64]},
                 "large": {"depth": [27], "width": [128, 192], "img": [224, 384], "classes": [1000],
                           "batch": [64, 256]}},
    "diffusion": {"small": {"img": [16, 32], "channels": [3, 4], "width": [16, 32], "levels": [2, 3], "blocks": [1],
                            "attn": [1], "heads": [2, 4], "batch": [1, 2]},
                  "medium": {"img": [64], "channels": [4], "width": [128, 192], "levels": [3, 4], "blocks": [2],
                             "attn": [2], "heads": [4, 8], "batch": [8, 16]},
                  "large": {"img": [64, 256], "channels": [3, 4], "width": [256, 320], "levels": [4, 5],
                            "blocks": [2], "attn": [2, 3], "heads": [8], "batch": [16, 64]}},
}
