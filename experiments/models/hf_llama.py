"""Llama (Touvron et al., 2023), a decoder-only transformer with grouped-query attention, RMSNorm and a
SwiGLU MLP, as Hugging Face's ``LlamaForCausalLM`` builds it (needs the optional ``transformers``).
A user model file for the zero-shot benchmarks (``experiments/bench_user_models.py``)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build(layers: int = 8, hidden: int = 1024, heads: int = 16, kv_heads: int = 4, seq: int = 1024, batch: int = 8):
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      intermediate_size=hidden * 8 // 3 // 64 * 64, vocab_size=32000, max_position_embeddings=seq, use_cache=False)
    return LlamaForCausalLM(cfg), (torch.randint(0, cfg.vocab_size, (batch, seq)),)
