"""Random operator graphs for the training distribution: layered DAGs and series-parallel graphs whose
costs look like real layers (GEMMs, convolutions, attention, embeddings, normalisations, elementwise
ops), so that a policy trained on them meets the mix of compute-bound and memory-bound work, weights
and activations it sees in real models.

Costs follow the closed forms the model zoo uses (a linear of m x k by k x n costs 2mnk FLOPs and holds
k x n weights; an elementwise op over e elements moves about 2-3 e values; attention over s tokens of
width h costs 4 b s^2 h FLOPs), with the sizes drawn log-uniformly over the ranges of real models
(widths 64-8192, tokens per sample 1-4096, batches 1-64). Every node gets a module path
``layers.<i>.<name>`` so coarsening and layer-aware placers see repeated layers. Same seed, same graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from envs.graph import GraphBuilder, OpGraph

BYTES = 2  # bf16 activations and weights


@dataclass(frozen=True)
class DagRanges:
    """Log-uniform ranges the generator draws from."""

    width: tuple[int, int] = (64, 8192)
    tokens: tuple[int, int] = (1, 4096)  # tokens (or pixels) per sample of a layer's activations
    batch: tuple[int, int] = (1, 64)
    layers: tuple[int, int] = (2, 24)
    ops: tuple[int, int] = (16, 400)  # target operator count of a graph


def _loguniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(np.exp(rng.uniform(np.log(lo), np.log(hi))))


def _pow2(rng: np.random.Generator, lo: int, hi: int) -> int:
    return int(2 ** rng.integers(int(np.log2(lo)), int(np.log2(hi)) + 1))


class _Ops:
    """Adds operators of realistic kinds with closed-form costs to a GraphBuilder."""

    def __init__(self, rng: np.random.Generator, batch: int, tokens: int):
        self.b = GraphBuilder()
        self.rng = rng
        self.batch, self.tokens = batch, tokens

    def elems(self, width: int) -> float:
        return float(self.batch * self.tokens * width)

    def linear(self, name: str, module: str, k: int, n: int, inputs) -> int:
        m = self.batch * self.tokens
        return self.b.node(name, "linear", module, 2.0 * m * k * n, k * n * BYTES, m * n * BYTES, inputs)

    def conv(self, name: str, module: str, cin: int, cout: int, ksize: int, inputs) -> int:
        m = self.batch * self.tokens
        return self.b.node(name, "conv2d", module, 2.0 * m * cin * cout * ksize * ksize, cin * cout * ksize * ksize
                           * BYTES, m * cout * BYTES, inputs)

    def elementwise(self, name: str, module: str, kind: str, width: int, inputs, flops_per: float = 1.0) -> int:
        e = self.elems(width)
        return self.b.node(name, kind, module, flops_per * e, 0.0, e * BYTES, inputs)

    def norm(self, name: str, module: str, width: int, inputs) -> int:
        e = self.elems(width)
        return self.b.node(name, "layernorm", module, 5.0 * e, 2 * width * BYTES, e * BYTES, inputs)

    def attention(self, name: str, module: str, width: int, inputs) -> int:
        s = self.tokens
        return self.b.node(name, "attention", module, 4.0 * self.batch * s * s * width, 0.0,
                           self.elems(width) * BYTES, inputs)

    def embedding(self, name: str, module: str, vocab: int, width: int, inputs) -> int:
        e = self.elems(width)
        return self.b.node(name, "embedding", module, e, vocab * width * BYTES, e * BYTES, inputs)


def _block(ops: _Ops, layer: int, width: int, x: int) -> tuple[int, int]:
    """One layer of a random kind (MLP, attention, convolution or a branching block): its output node and
    output width."""
    rng = ops.rng
    p = f"layers.{layer}"
    kind = rng.choice(["mlp", "attention", "conv", "branch", "gated"], p=[0.3, 0.25, 0.2, 0.15, 0.1])
    if kind == "mlp":
        hidden = int(width * rng.choice([1, 2, 4]))
        h = ops.linear(f"{p}.fc1", f"{p}.mlp.fc1", width, hidden, [x])
        a = ops.elementwise(f"{p}.act", f"{p}.mlp.act", str(rng.choice(["gelu", "relu", "silu"])), hidden, [h], 8.0)
        y = ops.linear(f"{p}.fc2", f"{p}.mlp.fc2", hidden, width, [a])
        return ops.elementwise(f"{p}.add", p, "add", width, [x, y]), width
    if kind == "attention":
        n = ops.norm(f"{p}.ln", f"{p}.ln", width, [x])
        qkv = ops.linear(f"{p}.qkv", f"{p}.attn.qkv", width, 3 * width, [n])
        att = ops.attention(f"{p}.sdpa", f"{p}.attn.sdpa", width, [qkv])
        o = ops.linear(f"{p}.proj", f"{p}.attn.proj", width, width, [att])
        return ops.elementwise(f"{p}.add", p, "add", width, [x, o]), width
    if kind == "conv":
        cout = int(width * rng.choice([1, 2]))
        c = ops.conv(f"{p}.conv", f"{p}.conv", width, cout, int(rng.choice([1, 3])), [x])
        bn = ops.elementwise(f"{p}.bn", f"{p}.bn", "batchnorm", cout, [c], 4.0)
        return ops.elementwise(f"{p}.relu", f"{p}.relu", "relu", cout, [bn]), cout
    if kind == "branch":
        k = int(rng.integers(2, 5))
        outs = []
        for j in range(k):
            w = max(16, width // k)
            h = ops.linear(f"{p}.b{j}.fc", f"{p}.b{j}.fc", width, w, [x])
            outs.append(ops.elementwise(f"{p}.b{j}.act", f"{p}.b{j}.act", "relu", w, [h]))
        wsum = max(16, width // k) * k
        return ops.elementwise(f"{p}.concat", f"{p}.concat", "concat", wsum, outs), wsum
    hidden = int(width * rng.choice([2, 3]))
    g = ops.linear(f"{p}.gate", f"{p}.mlp.gate", width, hidden, [x])
    u = ops.linear(f"{p}.up", f"{p}.mlp.up", width, hidden, [x])
    m = ops.elementwise(f"{p}.glu", f"{p}.mlp.glu", "mul", hidden, [g, u], 4.0)
    d = ops.linear(f"{p}.down", f"{p}.mlp.down", hidden, width, [m])
    return ops.elementwise(f"{p}.add", p, "add", width, [x, d]), width


def layered_dag(seed: int, ranges: DagRanges = DagRanges(), name: str | None = None) -> OpGraph:
    """A chain of random layers (MLP, attention, convolution, branching and gated blocks) between an
    embedding or input projection and a head, with skip connections; widths and sizes drawn from
    ``ranges`` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    batch = _pow2(rng, *ranges.batch)
    tokens = max(1, int(_loguniform(rng, *ranges.tokens)))
    width = _pow2(rng, *ranges.width)
    layers = int(rng.integers(ranges.layers[0], ranges.layers[1] + 1))
    ops = _Ops(rng, batch, tokens)
    if rng.random() < 0.4:
        vocab = int(_loguniform(rng, 1e3, 2e5))
        x = ops.embedding("embed", "embed", vocab, width, [])
    else:
        x = ops.linear("input", "input", max(8, width // 8), width, [])
    outs = [x]
    for li in range(layers):
        x, width = _block(ops, li, width, x)
        if len(outs) > 2 and rng.random() < 0.1:  # an occasional long skip (U-Net / DenseNet style)
            skip = outs[int(rng.integers(0, len(outs) - 1))]
            x = ops.elementwise(f"layers.{li}.skip", f"layers.{li}", "add", width, [x, skip])
        outs.append(x)
    head = ops.linear("head", "head", width, int(_loguniform(rng, 2, 1e5)), [x])
    ops.b.node("loss", "cross_entropy", "loss", 3.0 * ops.elems(1), 0.0, 4.0, [head])
    return ops.b.build(batch_size=batch, dtype="bf16", name=name or f"layered-dag-{seed}",
                       meta={"family": "random-layered", "seed": int(seed)})


def series_parallel_dag(seed: int, ranges: DagRanges = DagRanges(), name: str | None = None) -> OpGraph:
    """A random series-parallel graph: a recursive composition of operators in series (a chain) and in
    parallel (a fork into branches joined by an add or concat), like Inception- and NAS-style cells. The
    number of operators is drawn from ``ranges.ops``; each leaf is a linear, a convolution or an
    elementwise op of the current width."""
    rng = np.random.default_rng(seed)
    batch = _pow2(rng, *ranges.batch)
    tokens = max(1, int(_loguniform(rng, *ranges.tokens)))
    width = _pow2(rng, *ranges.width)
    target = int(_loguniform(rng, *ranges.ops))
    ops = _Ops(rng, batch, tokens)
    counter = [0]
    cell = [0]

    def leaf(x: int) -> int:
        i = counter[0]
        counter[0] += 1
        p = f"layers.{cell[0]}"
        r = rng.random()
        if r < 0.45:
            return ops.linear(f"{p}.fc{i}", f"{p}.fc{i}", width, width, [x])
        if r < 0.65:
            return ops.conv(f"{p}.conv{i}", f"{p}.conv{i}", width, width, int(rng.choice([1, 3])), [x])
        kind = str(rng.choice(["relu", "gelu", "layernorm", "dropout"]))
        return ops.elementwise(f"{p}.{kind}{i}", f"{p}.{kind}{i}", kind, width, [x], 4.0)

    def build(x: int, budget: int) -> int:
        if budget <= 1:
            return leaf(x)
        if rng.random() < 0.55:  # series
            a = max(1, int(budget * rng.uniform(0.3, 0.7)))
            return build(build(x, a), budget - a)
        k = int(rng.integers(2, 5))  # parallel: k branches, then a join
        shares = rng.dirichlet(np.ones(k)) * (budget - 1)
        branches = [build(x, max(1, int(s))) for s in shares]
        i = counter[0]
        counter[0] += 1
        kind = "add" if rng.random() < 0.5 else "concat"
        return ops.elementwise(f"layers.{cell[0]}.join{i}", f"layers.{cell[0]}.join{i}", kind, width, branches)

    x = ops.linear("input", "input", max(8, width // 8), width, [])
    cells = int(rng.integers(1, 9))
    for c in range(cells):
        cell[0] = c
        x = build(x, max(1, target // cells))
    head = ops.linear("head", "head", width, int(_loguniform(rng, 2, 1e4)), [x])
    ops.b.node("loss", "cross_entropy", "loss", 3.0 * ops.elems(1), 0.0, 4.0, [head])
    return ops.b.build(batch_size=batch, dtype="bf16", name=name or f"sp-dag-{seed}",
                       meta={"family": "random-series-parallel", "seed": int(seed)})


GENERATORS = {"random-layered": layered_dag, "random-series-parallel": series_parallel_dag}
