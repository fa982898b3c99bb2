"""BERT (Devlin et al., NAACL 2019), an encoder-only transformer with a masked-language-model head, as
Hugging Face's ``BertForMaskedLM`` builds it (needs the optional ``transformers``).
A user model file for the zero-shot benchmarks (``experiments/bench_user_models.py``)."""

import torch
from transformers import BertConfig, BertForMaskedLM


def build(layers: int = 12, hidden: int = 768, heads: int = 12, seq: int = 512, batch: int = 32):
    cfg = BertConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, intermediate_size=4 * hidden)
    return BertForMaskedLM(cfg), (torch.randint(0, cfg.vocab_size, (batch, seq)),)
