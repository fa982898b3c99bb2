"""A GAN training step with DCGAN networks (Radford, Metz & Chintala, "Unsupervised Representation Learning
with Deep Convolutional Generative Adversarial Networks", ICLR 2016; Goodfellow et al., NeurIPS 2014): a
generator of strided transposed convolutions with BatchNorm/ReLU maps noise to 64x64 images, and a
discriminator of strided convolutions with BatchNorm/LeakyReLU scores images. Both networks live in one
module and one graph: the forward generates a batch from noise, runs the (shared-weight) discriminator on the
real batch and on the generated batch, and returns both sets of logits, the quantities the discriminator and
generator losses are computed from. A user model file for the zero-shot
benchmarks (``experiments/bench_user_models.py``)."""

import torch
import torch.nn as nn


class Generator(nn.Module):
    def __init__(self, noise: int, width: int, channels: int):
        super().__init__()
        mults = [8, 4, 2, 1]
        layers = [nn.ConvTranspose2d(noise, width * 8, 4, 1, 0, bias=False), nn.BatchNorm2d(width * 8), nn.ReLU()]
        for a, b in zip(mults, mults[1:]):
            layers += [nn.ConvTranspose2d(width * a, width * b, 4, 2, 1, bias=False), nn.BatchNorm2d(width * b),
                       nn.ReLU()]
        layers += [nn.ConvTranspose2d(width, channels, 4, 2, 1, bias=False), nn.Tanh()]
        self.net = nn.Sequential(*layers)

    def forward(self, z):
        return self.net(z[:, :, None, None])


class Discriminator(nn.Module):
    def __init__(self, width: int, channels: int):
        super().__init__()
        mults = [1, 2, 4, 8]
        layers = [nn.Conv2d(channels, width, 4, 2, 1, bias=False), nn.LeakyReLU(0.2)]
        for a, b in zip(mults, mults[1:]):
            layers += [nn.Conv2d(width * a, width * b, 4, 2, 1, bias=False), nn.BatchNorm2d(width * b),
                       nn.LeakyReLU(0.2)]
        layers += [nn.Conv2d(width * 8, 1, 4, 1, 0, bias=False)]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x).flatten(1)


class GANPair(nn.Module):
    def __init__(self, noise: int, width: int, channels: int):
        super().__init__()
        self.generator = Generator(noise, width, channels)
        self.discriminator = Discriminator(width, channels)

    def forward(self, z, real):
        fake = self.generator(z)
        return self.discriminator(real), self.discriminator(fake)


def build(batch: int = 64, noise: int = 100, width: int = 128, channels: int = 3):
    # the DCGAN architecture is fixed at 64x64 images (four stride-2 stages from a 4x4 seed)
    return GANPair(noise, width, channels), (torch.randn(batch, noise), torch.randn(batch, channels, 64, 64))
