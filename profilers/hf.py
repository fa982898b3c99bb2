"""Trace Hugging Face ``transformers`` models (extra ``[hf]``) into OpGraphs, without downloads.

Configs are built in code (``CONFIGS``: tiny members of each architecture, plus full-size
``llama-7b`` and ``gpt2-124m``), models from ``from_config`` on the meta device with
``use_cache=False`` and SDPA attention, then traced with ``profilers.trace`` (``torch.export``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from envs.errors import RlplaceError
from envs.graph import OpGraph
from profilers.trace import export_meta, graph_from_export

# model_type -> config keyword arguments. Tiny ones trace in about a second on a laptop CPU.
CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=256,
                 bos_token_id=0, eos_token_id=0),
    "llama": dict(model_type="llama", num_hidden_layers=2, hidden_size=64, intermediate_size=172,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=256),
    "bert": dict(model_type="bert", num_hidden_layers=2, hidden_size=64, intermediate_size=256,
                 num_attention_heads=4, vocab_size=512, max_position_embeddings=256),
    "t5": dict(model_type="t5", num_layers=2, num_decoder_layers=2, d_model=64, d_ff=256, num_heads=4,
               d_kv=16, vocab_size=512),
    # full-size published architectures (configs only; nothing is downloaded)
    "gpt2-124m": dict(model_type="gpt2", n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
                      n_positions=1024),
    "llama-7b": dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, intermediate_size=11008,
                     num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                     max_position_embeddings=4096, rms_norm_eps=1e-5),
}


class HFError(RlplaceError):
    """transformers is missing, or a config cannot be built or traced."""


def _transformers():
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise HFError("profilers.hf needs transformers: pip install 'rlplace[hf]'") from exc
    return transformers


def _one_line(exc: BaseException) -> str:
    from envs.files import one_line

    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return one_line(lines[-1] if len(lines) > 1 and lines[0].endswith(":") else exc)


def make_config(config: Any, **overrides: Any):
    """A ``PretrainedConfig`` from a config object, a dict with ``model_type``, or a name in CONFIGS."""
    tf = _transformers()
    if isinstance(config, tf.PretrainedConfig):
        cfg = config
        for k, v in overrides.items():
            setattr(cfg, k, v)
    else:
        if isinstance(config, str):
            if config not in CONFIGS:
                raise HFError(f"unknown transformers config {config!r}; names: {', '.join(sorted(CONFIGS))} "
                              "(or pass a PretrainedConfig / a dict with model_type)")
            kw = dict(CONFIGS[config])
        elif isinstance(config, Mapping):
            kw = dict(config)
        else:
            raise HFError(f"config must be a PretrainedConfig, dict or name, got {type(config).__name__}")
        kw.update(overrides)
        model_type = kw.pop("model_type", None)
        if not model_type:
            raise HFError("a config dict needs 'model_type' (e.g. 'llama')")
        try:
            cfg = tf.AutoConfig.for_model(model_type, **kw)
        except Exception as exc:  # ValueError, KeyError, huggingface_hub's StrictDataclassClassValidationError ...
            raise HFError(f"cannot build a {model_type!r} config: {_one_line(exc)}") from exc
    cfg.use_cache = False
    cfg._attn_implementation = "sdpa"
    return cfg


def build_hf(config: Any, *, batch_size: int = 1, seq: int = 128, **overrides: Any):
    """``(model, inputs)`` on the meta device: a causal-LM head for decoder-only architectures, a
    seq2seq LM for encoder-decoders, the bare model otherwise; ``inputs`` is a kwargs dict."""
    tf = _transformers()
    cfg = make_config(config, **overrides)
    max_pos = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if max_pos and seq > max_pos:
        raise HFError(f"seq {seq} exceeds the config's {max_pos} positions")
    mapping = tf.models.auto.modeling_auto
    mt = cfg.model_type
    with torch.device("meta"):
        if getattr(cfg, "is_encoder_decoder", False):
            model = tf.AutoModelForSeq2SeqLM.from_config(cfg)
        elif mt in mapping.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not getattr(cfg, "is_encoder", False) \
                and mt not in ("bert", "roberta", "electra", "xlm-roberta"):
            model = tf.AutoModelForCausalLM.from_config(cfg)
        else:
            model = tf.AutoModel.from_config(cfg)
    ids = torch.zeros(batch_size, seq, dtype=torch.long, device="meta")
    inputs: dict[str, torch.Tensor] = {"input_ids": ids}
    if getattr(cfg, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = torch.zeros(batch_size, seq, dtype=torch.long, device="meta")
    return model, inputs


def trace_hf(config: Any, *, batch_size: int = 1, seq: int = 128, dtype: str = "bf16",
             name: str | None = None, **overrides: Any) -> OpGraph:
    """Trace a transformers model (config object, dict with ``model_type``, or a CONFIGS name with
    keyword overrides, e.g. ``trace_hf("llama", num_hidden_layers=4)``) at ``batch_size`` x ``seq``."""
    model, inputs = build_hf(config, batch_size=batch_size, seq=seq, **overrides)
    gname = name or (config if isinstance(config, str) else model.config.model_type)
    ep = export_meta(model, inputs, dtype=dtype, name=gname)
    g = graph_from_export(ep, batch_size=batch_size, dtype=dtype, name=gname)
    g.meta["hf_model"] = type(model).__name__
    g.meta["seq"] = seq
    heads = getattr(model.config, "num_attention_heads", None)
    if isinstance(heads, int):
        g.meta["heads"] = heads  # tensor parallelism splits attention by heads (envs.plan.megatron checks it)
    return g
