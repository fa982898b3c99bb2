"""GPT-2 (Radford et al., 2019), a decoder-only transformer language model, as Hugging Face's
``GPT2LMHeadModel`` builds it (needs the optional ``transformers``).
A user model file for the zero-shot benchmarks (``experiments/bench_user_models.py``)."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def build(layers: int = 12, hidden: int = 768, heads: int = 12, seq: int = 1024, batch: int = 16):
    cfg = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=seq, use_cache=False)
    return GPT2LMHeadModel(cfg), (torch.randint(0, cfg.vocab_size, (batch, seq)),)
