"""Built-in example graphs made from closed-form costs (no tracing needed).

``transformer_graph`` is a GPT-style decoder at operator granularity with Megatron's per-layer FLOP
counts (Narayanan et al., SC'21, Appendix: a linear of n x k by k x m costs 2nkm FLOPs; attention
scores and weighted values cost 2*b*s^2*h each). It serves the Quickstart, the tests' closed forms and
the large-scale simulator check; traced graphs of real models come from ``profilers/``.
"""

from __future__ import annotations

import numpy as np

from envs.graph import (
    CAN_BATCH,
    CAN_COL,
    CAN_REPLICATE,
    CAN_ROW,
    GEMM_DENSE,
    GEMM_PER_HEAD,
    GraphBuilder,
    OpGraph,
)
from envs.plan import DTYPE_BYTES


def transformer_graph(layers: int = 4, hidden: int = 1024, heads: int = 16, seq: int = 1024, vocab: int = 32000,
                      batch: int = 8, dtype: str = "bf16", ffn_mult: int = 4, embeddings: bool = True,
                      fused_attention: bool = False, tie_embeddings: bool = True, name: str | None = None) -> OpGraph:
    """A GPT decoder as Megatron-LM runs it: per layer LayerNorm, the QKV linear, the attention core,
    the output projection, a bias-dropout-add, LayerNorm, the MLP (fc1, bias-GeLU, fc2) and a
    bias-dropout-add; an embedding (word + position, dropout) before, the final LayerNorm, the output
    layer and a vocab-parallel cross-entropy after.

    Every linear lists its GEMM (m = tokens, n = out features, k = in features) and the attention core
    its two per-head batched GEMMs (scores s x s x d and context s x d x s over batch x heads), so the
    simulator times them by shape. The attention core is Megatron's unfused one unless
    ``fused_attention`` (flash attention): it also moves the score tensor Z = b a s^2 x 2 bytes through
    the softmax (read + write) and the dropout (read + write + a one-byte mask), 4.5 Z beyond its GEMMs'
    operands, and saves 5as^2b bytes of them for its backward (Korthikanti et al. 2022, Sec. 4.1).
    ``n_ops`` counts the kernels each node launches in Megatron's eager forward (fused LayerNorm, fused
    bias-GeLU and bias-dropout-add, the fused scale-mask-softmax). ``tie_embeddings``: the output layer
    shares the word embedding's weights (GPT-2, Megatron's default), counted once, at the output layer.
    FLOPs follow Narayanan et al., SC'21, Appendix (2mnk per GEMM)."""
    e = DTYPE_BYTES[dtype]
    b, s, h, f, a = batch, seq, hidden, ffn_mult * hidden, heads
    tok = b * s
    d = h // a
    builder = GraphBuilder()
    node = builder.node

    def linear(nm, mod, k, n, inputs, kernels=1, bias=True):
        return node(nm, "linear", mod, 2 * tok * k * n, (k * n + (n if bias else 0)) * e, tok * n * e, inputs,
                    n_ops=kernels, gemms=[(tok, n, k, 1, GEMM_DENSE)])

    act = tok * h * e
    z = b * a * s * s * e  # the attention scores of the batch
    attn_gemms = [(s, s, d, b * a, GEMM_PER_HEAD), (s, d, s, b * a, GEMM_PER_HEAD)]
    attn_gemm_bytes = sum((m * k + k * n + m * n) * bb * e for m, n, k, bb, _ in attn_gemms)
    # saved for the backward: the softmax output and the dropout output (2 bytes each) and the dropout
    # mask (1 byte) per score: 5as^2b bytes per layer (Korthikanti et al. 2022, Sec. 4.1); flash
    # attention saves none of them
    saved_scores = 2.5 * z
    attn_bytes = attn_gemm_bytes + (0.0 if fused_attention else 4.5 * z) + 2 * act  # + the context's permute
    all_caps = CAN_BATCH | CAN_COL | CAN_ROW | CAN_REPLICATE
    if embeddings:
        emb_params = (0 if tie_embeddings else vocab * h + s * h) * e + (s * h * e if tie_embeddings else 0)
        x = node("embed", "embedding", "embed", tok * h, emb_params, act, [], n_ops=4, caps=all_caps)
    else:
        x = node("input", "input", "input", 0, 0, act, [])
    for li in range(layers):
        p = f"layers.{li}"
        ln1 = node(f"{p}.ln1", "layernorm", f"{p}.ln1", 5 * tok * h, 2 * h * e, act, [x])
        qkv = linear(f"{p}.attn.qkv", f"{p}.attn.qkv", h, 3 * h, [ln1], kernels=2)
        att = node(f"{p}.attn.sdpa", "attention", f"{p}.attn.sdpa", 4 * b * s * s * h + 5 * b * a * s * s, 0, act,
                   [qkv], n_ops=2 if fused_attention else 5, gemms=attn_gemms, mem_bytes=attn_bytes,
                   saved_bytes=0.0 if fused_attention else saved_scores)
        proj = linear(f"{p}.attn.proj", f"{p}.attn.proj", h, h, [att])
        add1 = node(f"{p}.add1", "add", f"{p}", tok * h, 0, act, [x, proj])
        ln2 = node(f"{p}.ln2", "layernorm", f"{p}.ln2", 5 * tok * h, 2 * h * e, act, [add1])
        fc1 = linear(f"{p}.mlp.fc1", f"{p}.mlp.fc1", h, f, [ln2])
        gelu = node(f"{p}.mlp.gelu", "gelu", f"{p}.mlp.gelu", 8 * tok * f, 0, tok * f * e, [fc1])
        fc2 = linear(f"{p}.mlp.fc2", f"{p}.mlp.fc2", f, h, [gelu])
        x = node(f"{p}.add2", "add", f"{p}", tok * h, 0, act, [add1, fc2])
    if embeddings:
        lnf = node("ln_f", "layernorm", "ln_f", 5 * tok * h, 2 * h * e, act, [x])
        head = linear("lm_head", "lm_head", h, vocab, [lnf], bias=False)
        # vocab-parallel cross-entropy on fp32 logits: a cast and ~4 passes (max, exp-sum, log, target)
        node("loss", "cross_entropy", "loss", 5 * tok * vocab, 0, 4, [head], n_ops=8,
             mem_bytes=tok * vocab * (e + 4 * 4))
    return builder.build(batch_size=batch, dtype=dtype,
                         meta={"family": "gpt", "heads": heads, "hidden": hidden, "layers": layers, "seq": seq,
                               "vocab": vocab, "fused_attention": bool(fused_attention),
                               "tie_embeddings": bool(tie_embeddings)},
                         name=name or f"transformer-l{layers}-h{hidden}-s{seq}-b{batch}")


def mlp_block_graph(hidden: int = 4096, tokens: int = 8192, dtype: str = "bf16") -> OpGraph:
    """A Megatron MLP block alone: fc1 -> gelu -> fc2 (the tensor-parallel closed form)."""
    e = DTYPE_BYTES[dtype]
    h, f, t = hidden, 4 * hidden, tokens
    return OpGraph(
        names=["fc1", "gelu", "fc2"], kinds=["linear", "gelu", "linear"], module_paths=["mlp.fc1", "mlp.gelu", "mlp.fc2"],
        fwd_flops=np.array([2 * t * h * f, 8 * t * f, 2 * t * f * h], dtype=float),
        param_bytes=np.array([h * f * e, 0, f * h * e], dtype=float),
        out_bytes=np.array([t * f * e, t * f * e, t * h * e], dtype=float),
        edge_src=np.array([0, 1]), edge_dst=np.array([1, 2]), edge_bytes=np.array([t * f * e, t * f * e], dtype=float),
        batch_size=1, dtype=dtype, name="mlp-block")


EXAMPLES = {
    "gpt-small": lambda: transformer_graph(layers=4, hidden=1024, heads=16, seq=1024, batch=8, name="gpt-small"),
    "gpt-1.3b": lambda: transformer_graph(layers=24, hidden=2048, heads=16, seq=2048, vocab=50257, batch=8,
                                          name="gpt-1.3b"),
    "mlp-block": mlp_block_graph,
}
