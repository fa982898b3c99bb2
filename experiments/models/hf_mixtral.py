"""Mixtral (Jiang et al., 2024), a sparse mixture-of-experts decoder with top-2 routing and grouped-query
attention, as Hugging Face's ``MixtralForCausalLM`` builds it (needs the optional ``transformers``).
A user model file for the zero-shot benchmarks (``experiments/bench_user_models.py``)."""

import torch
from transformers import MixtralConfig, MixtralForCausalLM


def build(layers: int = 4, hidden: int = 1024, experts: int = 8, seq: int = 512, batch: int = 8):
    cfg = MixtralConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_attention_heads=16,
        num_key_value_heads=4,
        num_local_experts=experts,
        num_experts_per_tok=2,
        vocab_size=32000,
        max_position_embeddings=seq,
        use_cache=False,
    )
    return MixtralForCausalLM(cfg), (torch.randint(0, 32000, (batch, seq)),)
