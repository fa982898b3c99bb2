"""A convolutional variational autoencoder (Kingma & Welling, ICLR 2014) with GroupNorm/SiLU blocks like
Stable Diffusion's autoencoder (Rombach et al., CVPR 2022): four strided-conv encoder stages, a
reparameterised latent, four transposed-conv decoder stages. A user model file for the zero-shot benchmarks
(``experiments/bench_user_models.py``)."""

import torch
import torch.nn as nn


def block(inp: int, out: int, down: bool = True) -> nn.Sequential:
    """A stride-2 convolution (transposed when ``down`` is false), GroupNorm, SiLU, then a 3x3 convolution."""
    if down:
        resample = nn.Conv2d(inp, out, 4, 2, 1)
    else:
        resample = nn.ConvTranspose2d(inp, out, 4, 2, 1)
    return nn.Sequential(resample, nn.GroupNorm(8, out), nn.SiLU(), nn.Conv2d(out, out, 3, padding=1), nn.SiLU())


class VAE(nn.Module):
    def __init__(self, width: int, latent: int):
        super().__init__()
        ch = [3, width, 2 * width, 4 * width, 8 * width]
        self.enc = nn.Sequential(*[block(ch[i], ch[i + 1]) for i in range(4)])
        self.mu = nn.Conv2d(8 * width, latent, 1)
        self.lv = nn.Conv2d(8 * width, latent, 1)
        self.dec_in = nn.Conv2d(latent, 8 * width, 1)
        self.dec = nn.Sequential(*[block(ch[4 - i], ch[3 - i] if i < 3 else width, False) for i in range(4)])
        self.out = nn.Conv2d(width, 3, 3, padding=1)

    def forward(self, x):
        h = self.enc(x)
        mu = self.mu(h)
        lv = self.lv(h)
        z = mu + torch.exp(0.5 * lv) * torch.randn_like(mu)
        return self.out(self.dec(self.dec_in(z))), mu, lv


def build(width: int = 128, latent: int = 16, img: int = 256, batch: int = 32):
    return VAE(width, latent), (torch.randn(batch, 3, img, img),)
