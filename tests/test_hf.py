"""profilers.hf: transformers models from in-code configs (skipped without the [hf] extra)."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("transformers")

from profilers.hf import CONFIGS, HFError, make_config, trace_hf  # noqa: E402

warnings.filterwarnings("ignore")


def _state_bytes(config, dbytes: int = 2) -> int:
    """Bytes of parameters and buffers (floating ones at ``dbytes``), tied tensors once."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(config)
    tensors = {id(t): t for t in [*m.parameters(), *m.buffers()]}.values()
    return sum(t.numel() * (dbytes if t.is_floating_point() else t.element_size()) for t in tensors)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5"])
def test_tiny_configs_trace(name):
    g = trace_hf(name, batch_size=2, seq=16)
    g.validate()
    assert g.batch_size == 2 and g.num_nodes > 10 and g.fwd_flops.sum() > 0
    assert "sdpa" in g.kinds and "linear" in g.kinds
    assert g.meta["seq"] == 16


def test_llama_structure_and_params():
    g = trace_hf("llama", batch_size=1, seq=8)
    assert "model.layers.0.self_attn.q_proj" in g.names and "model.layers.1.mlp.down_proj" in g.names
    assert "rmsnorm" in g.kinds  # the RMSNorm module's ops are fused into one node
    assert g.param_bytes.sum() + g.meta["unused_param_bytes"] == _state_bytes(make_config("llama"))


def test_config_forms_and_errors():
    from transformers import GPT2Config

    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    g = trace_hf(cfg, batch_size=1, seq=8)
    assert sum(n.endswith("attn.c_attn") for n in g.names) == 1
    g2 = trace_hf({"model_type": "llama", **{k: v for k, v in CONFIGS["llama"].items() if k != "model_type"}},
                  seq=8, num_hidden_layers=1)
    assert sum(n.endswith("self_attn.q_proj") for n in g2.names) == 1
    with pytest.raises(HFError, match="llama-7b"):
        trace_hf("gpt5")
    with pytest.raises(HFError, match="positions"):
        trace_hf("gpt2", seq=100000)


def test_hf_spec_string():
    from profilers.spec import graph_from_spec

    g = graph_from_spec("hf:llama:num_hidden_layers=1,seq=8,batch=3")
    assert g.batch_size == 3 and sum(n.endswith("self_attn.q_proj") for n in g.names) == 1
