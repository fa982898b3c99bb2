"""A NeRF radiance-field MLP (Mildenhall et al., "NeRF: Representing Scenes as Neural Radiance Fields for View
Synthesis", ECCV 2020) with its training-step rendering: sample points along each ray (origin + t * direction)
are flattened into one large batch (1024 rays x 64 samples = 65536 points by default), frequency-encoded
(10 octaves for positions, 4 for view directions), and passed through 8 fully connected ReLU layers of width
256 with the encoded input concatenated again before the 5th; a density head, a 256-wide feature layer, and a
128-wide view-dependent colour head follow. Densities and colours are reshaped back to (rays, samples) and
alpha-composited (exclusive cumulative product of transmittances) into per-ray colours. Only the coarse network
is modelled (the fine network is an identical copy evaluated on resampled points). A user model file for the zero-shot
benchmarks (``experiments/bench_user_models.py``)."""

import torch
import torch.nn as nn


def positional_encoding(x: torch.Tensor, octaves: int) -> torch.Tensor:
    """[x, sin(2^k x), cos(2^k x) for k < octaves] along the last dimension."""
    freqs = 2.0 ** torch.arange(octaves, device=x.device, dtype=x.dtype)
    scaled = (x[..., None, :] * freqs[:, None]).flatten(-2)  # (..., octaves * dims)
    return torch.cat([x, torch.sin(scaled), torch.cos(scaled)], -1)


class NeRFMLP(nn.Module):
    def __init__(self, width: int, depth: int, skip: int, pos_octaves: int, dir_octaves: int):
        super().__init__()
        self.pos_octaves, self.dir_octaves, self.skip = pos_octaves, dir_octaves, skip
        pos_dim, dir_dim = 3 + 6 * pos_octaves, 3 + 6 * dir_octaves
        self.layers = nn.ModuleList(
            [nn.Linear(pos_dim if i == 0 else width + (pos_dim if i == skip else 0), width) for i in range(depth)])
        self.sigma = nn.Linear(width, 1)
        self.feature = nn.Linear(width, width)
        self.view = nn.Linear(width + dir_dim, width // 2)
        self.rgb = nn.Linear(width // 2, 3)

    def forward(self, points, dirs):
        p = positional_encoding(points, self.pos_octaves)
        d = positional_encoding(dirs, self.dir_octaves)
        h = p
        for i, layer in enumerate(self.layers):
            if i == self.skip:
                h = torch.cat([h, p], -1)
            h = torch.relu(layer(h))
        sigma = torch.relu(self.sigma(h)).squeeze(-1)
        rgb = torch.sigmoid(self.rgb(torch.relu(self.view(torch.cat([self.feature(h), d], -1)))))
        return sigma, rgb


class NeRF(nn.Module):
    def __init__(self, width: int = 256, depth: int = 8, skip: int = 5, pos_octaves: int = 10, dir_octaves: int = 4):
        super().__init__()
        self.mlp = NeRFMLP(width, depth, skip, pos_octaves, dir_octaves)

    def forward(self, rays_o, rays_d, t_vals):
        rays, samples = t_vals.shape
        points = (rays_o[:, None, :] + rays_d[:, None, :] * t_vals[..., None]).reshape(rays * samples, 3)
        dirs = (rays_d / rays_d.norm(dim=-1, keepdim=True))[:, None, :].expand(rays, samples, 3).reshape(-1, 3)
        sigma, rgb = self.mlp(points, dirs)
        sigma, rgb = sigma.view(rays, samples), rgb.view(rays, samples, 3)
        # volume rendering: alpha_i = 1 - exp(-sigma_i delta_i), w_i = alpha_i prod_{j<i} (1 - alpha_j)
        delta = torch.cat([t_vals[:, 1:] - t_vals[:, :-1], torch.full_like(t_vals[:, :1], 1e10)], -1)
        delta = delta * rays_d.norm(dim=-1, keepdim=True)
        alpha = 1 - torch.exp(-sigma * delta)
        trans = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha + 1e-10], -1), -1)[:, :-1]
        weights = alpha * trans
        return (weights[..., None] * rgb).sum(1), (weights * t_vals).sum(1)


def build(rays: int = 1024, samples: int = 64, width: int = 256, depth: int = 8, skip: int = 5,
          pos_octaves: int = 10, dir_octaves: int = 4, near: float = 2.0, far: float = 6.0):
    t_vals = near + (far - near) * (torch.linspace(0, 1, samples)[None, :] + torch.rand(rays, samples) / samples)
    inputs = (torch.randn(rays, 3), torch.randn(rays, 3), t_vals)
    return NeRF(width, depth, skip, pos_octaves, dir_octaves), inputs
