"""A CLIP-style contrastive image-text model (Radford et al., ICML 2021): a ViT image encoder and a
Transformer text encoder side by side, each projected to a shared embedding, and the image x text
similarity matrix. A user model file for the zero-shot benchmarks (``experiments/bench_user_models.py``):
two towers that no path orders, which the policy can run on disjoint device groups; no family like it is
in the training distribution."""

import torch
import torch.nn as nn


class Tower(nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        layer = nn.TransformerEncoderLayer(width, max(1, width // 64), 4 * width, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.encoder(x)[:, 0])


class CLIP(nn.Module):
    def __init__(self, image: int, patch: int, vision_width: int, text_width: int, layers: int, vocab: int,
                 context: int, embed: int):
        super().__init__()
        self.patchify = nn.Conv2d(3, vision_width, patch, patch)
        self.image_pos = nn.Parameter(torch.zeros(1, (image // patch) ** 2, vision_width))
        self.token = nn.Embedding(vocab, text_width)
        self.text_pos = nn.Parameter(torch.zeros(1, context, text_width))
        self.vision = Tower(vision_width, layers)
        self.text = Tower(text_width, layers)
        self.image_proj = nn.Linear(vision_width, embed, bias=False)
        self.text_proj = nn.Linear(text_width, embed, bias=False)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        x = self.patchify(images).flatten(2).transpose(1, 2) + self.image_pos
        i = nn.functional.normalize(self.image_proj(self.vision(x)), dim=-1)
        t = nn.functional.normalize(self.text_proj(self.text(self.token(tokens) + self.text_pos)), dim=-1)
        return i @ t.t()


def build(batch: int = 128, layers: int = 12, image: int = 224, patch: int = 16, vision_width: int = 768,
          text_width: int = 512, vocab: int = 49408, context: int = 77, embed: int = 512):
    model = CLIP(image, patch, vision_width, text_width, layers, vocab, context, embed)
    return model, (torch.randn(batch, 3, image, image), torch.randint(0, vocab, (batch, context)))
