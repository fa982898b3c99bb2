"""DiT (Peebles & Xie, ICCV 2023), a diffusion transformer: patchified latents, transformer blocks whose
layer norms are modulated by the timestep and class embedding (adaLN), a linear decoder of noise and
variance. A user model file for the zero-shot benchmarks (``experiments/bench_user_models.py``): no family
like it is in the training distribution."""

import torch
import torch.nn as nn


class DiTBlock(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False)
        self.attn = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(c).unsqueeze(1).chunk(6, dim=-1)
        y = self.norm1(x) * (1 + scale1) + shift1
        x = x + gate1 * self.attn(y, y, y, need_weights=False)[0]
        y = self.norm2(x) * (1 + scale2) + shift2
        return x + gate2 * self.mlp(y)


class DiT(nn.Module):
    def __init__(self, img: int, patch: int, channels: int, hidden: int, heads: int, layers: int, classes: int):
        super().__init__()
        self.patchify = nn.Conv2d(channels, hidden, patch, patch)
        self.pos = nn.Parameter(torch.zeros(1, (img // patch) ** 2, hidden))
        self.timestep = nn.Sequential(nn.Linear(256, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.label = nn.Embedding(classes + 1, hidden)  # + the null class of classifier-free guidance
        self.blocks = nn.ModuleList(DiTBlock(hidden, heads) for _ in range(layers))
        self.decode = nn.Linear(hidden, patch * patch * channels * 2)

    def forward(self, latents: torch.Tensor, t_freq: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.patchify(latents).flatten(2).transpose(1, 2) + self.pos
        c = self.timestep(t_freq) + self.label(labels)
        for block in self.blocks:
            x = block(x, c)
        return self.decode(x)


def build(img: int = 32, patch: int = 2, channels: int = 4, hidden: int = 768, heads: int = 12, layers: int = 12,
          classes: int = 1000, batch: int = 64):
    """DiT-B/2 on 32 x 32 latents by default (a 256 x 256 image through a VAE)."""
    model = DiT(img, patch, channels, hidden, heads, layers, classes)
    return model, (torch.randn(batch, channels, img, img), torch.randn(batch, 256), torch.randint(0, classes, (batch,)))
