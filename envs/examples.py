"""Built-in example graphs made from closed-form costs (no tracing needed).

``transformer_graph`` is a GPT-style decoder at operator granularity with Megatron's per-layer FLOP
counts (Narayanan et al., SC'21, Appendix: a linear of n x k by k x m costs 2nkm FLOPs; attention
scores and weighted values cost 2*b*s^2*h each). It serves the Quickstart, the tests' closed forms and
the large-scale simulator check; traced graphs of real models come from ``profilers/``.
"""

from __future__ import annotations

import numpy as np

from envs.graph import GraphBuilder, OpGraph
from envs.plan import DTYPE_BYTES


def transformer_graph(layers: int = 4, hidden: int = 1024, heads: int = 16, seq: int = 1024, vocab: int = 32000,
                      batch: int = 8, dtype: str = "bf16", ffn_mult: int = 4, embeddings: bool = True,
                      name: str | None = None) -> OpGraph:
    e = DTYPE_BYTES[dtype]
    b, s, h, f = batch, seq, hidden, ffn_mult * hidden
    tok = b * s
    builder = GraphBuilder()
    node = builder.node

    act = tok * h * e
    if embeddings:
        x = node("embed", "embedding", "embed", tok * h, vocab * h * e, act, [])
    else:
        x = node("input", "input", "input", 0, 0, act, [])
    for li in range(layers):
        p = f"layers.{li}"
        ln1 = node(f"{p}.ln1", "layernorm", f"{p}.ln1", 5 * tok * h, 2 * h * e, act, [x])
        qkv = node(f"{p}.attn.qkv", "linear", f"{p}.attn.qkv", 2 * tok * h * 3 * h, (3 * h * h + 3 * h) * e,
                   3 * act, [ln1])
        att = node(f"{p}.attn.sdpa", "attention", f"{p}.attn.sdpa", 4 * b * s * s * h, 0, act, [qkv])
        proj = node(f"{p}.attn.proj", "linear", f"{p}.attn.proj", 2 * tok * h * h, (h * h + h) * e, act, [att])
        add1 = node(f"{p}.add1", "add", f"{p}", tok * h, 0, act, [x, proj])
        ln2 = node(f"{p}.ln2", "layernorm", f"{p}.ln2", 5 * tok * h, 2 * h * e, act, [add1])
        fc1 = node(f"{p}.mlp.fc1", "linear", f"{p}.mlp.fc1", 2 * tok * h * f, (h * f + f) * e, tok * f * e, [ln2])
        gelu = node(f"{p}.mlp.gelu", "gelu", f"{p}.mlp.gelu", 8 * tok * f, 0, tok * f * e, [fc1])
        fc2 = node(f"{p}.mlp.fc2", "linear", f"{p}.mlp.fc2", 2 * tok * f * h, (f * h + h) * e, act, [gelu])
        x = node(f"{p}.add2", "add", f"{p}", tok * h, 0, act, [add1, fc2])
    if embeddings:
        lnf = node("ln_f", "layernorm", "ln_f", 5 * tok * h, 2 * h * e, act, [x])
        head = node("lm_head", "linear", "lm_head", 2 * tok * h * vocab, vocab * h * e, tok * vocab * e, [lnf])
        node("loss", "cross_entropy", "loss", 3 * tok * vocab, 0, 4, [head])
    return builder.build(batch_size=batch, dtype=dtype, meta={"family": "gpt", "heads": heads, "hidden": hidden,
                                                              "layers": layers, "seq": seq},
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
