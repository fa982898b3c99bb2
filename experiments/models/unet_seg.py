"""A 2D segmentation U-Net (Ronneberger, Fischer & Brox, "U-Net: Convolutional Networks for Biomedical Image
Segmentation", MICCAI 2015): a contracting path of four 2x2-max-pool levels of double 3x3 convolutions, a
bottleneck, and an expanding path of four transposed-convolution upsamplings, each concatenated with the
encoder feature map of the same resolution (long skip connections) before another double convolution; a
1x1 convolution gives per-pixel class logits. BatchNorm after each convolution as in most modern re-
implementations, and padded convolutions so the skips need no cropping. A user model file for the zero-shot
benchmarks (``experiments/bench_user_models.py``)."""

import torch
import torch.nn as nn


def double_conv(inp: int, out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(inp, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(),
                         nn.Conv2d(out, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU())


class Up(nn.Module):
    """Transposed-convolution upsampling, concatenation with the skip, then a double convolution."""

    def __init__(self, inp: int, out: int):
        super().__init__()
        self.up = nn.ConvTranspose2d(inp, out, 2, stride=2)
        self.conv = double_conv(2 * out, out)

    def forward(self, x, skip):
        return self.conv(torch.cat([skip, self.up(x)], 1))


class UNet(nn.Module):
    def __init__(self, in_channels: int, width: int, levels: int, classes: int):
        super().__init__()
        ch = [width * 2 ** i for i in range(levels + 1)]
        self.inc = double_conv(in_channels, ch[0])
        self.pool = nn.MaxPool2d(2)
        self.down = nn.ModuleList([double_conv(ch[i], ch[i + 1]) for i in range(levels)])
        self.up = nn.ModuleList([Up(ch[i + 1], ch[i]) for i in reversed(range(levels))])
        self.head = nn.Conv2d(ch[0], classes, 1)

    def forward(self, x):
        skips = [self.inc(x)]
        for down in self.down:
            skips.append(down(self.pool(skips[-1])))
        h = skips.pop()
        for up in self.up:
            h = up(h, skips.pop())
        return self.head(h)


def build(batch: int = 16, image: int = 256, in_channels: int = 3, width: int = 64, levels: int = 4,
          classes: int = 21):
    return UNet(in_channels, width, levels, classes), (torch.randn(batch, in_channels, image, image),)
