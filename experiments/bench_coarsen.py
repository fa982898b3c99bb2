"""Coarsening speed: synthetic graphs of 10k and 100k ops to <= 512 groups: a layered transformer-like
graph with module paths, and a training graph with explicit backward nodes and co-location classes.

Run: ``python -m experiments.bench_coarsen [--sizes 10000 100000] [--max-nodes 512] [--methods auto]``.
Budget: a graph of 100k ops or more coarsens in under a minute (:data:`BUDGET_S`) with every method; a
run over budget says so and exits 1.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from envs.coarsen import coarsen
from envs.graph import OpGraph

BUDGET_S = 60.0  # seconds to coarsen a graph of BUDGET_OPS ops or more
BUDGET_OPS = 100_000


def layered_graph(layers: int, ops_per_layer: int = 100, *, heads: int = 8, hidden: int = 1024,
                  seq: int = 512, batch: int = 8, tied: bool = False, name: str | None = None) -> OpGraph:
    """A transformer-like graph: embedding, ``layers`` blocks of exactly ``ops_per_layer`` ops (pre-norm
    attention with per-head branches, residual adds, an MLP padded with elementwise ops), a final norm,
    an LM head and a loss. Module paths look like ``layers.3.attn.core``. With ``tied`` the head is
    the embedding module called again (module path ``embed``, one co-location class with it), which
    makes the ``embed`` module non-contiguous."""
    heads = max(1, min(heads, (ops_per_layer - 15) // 3))
    pad = ops_per_layer - (15 + 3 * heads)
    if pad < 0:
        raise ValueError("ops_per_layer must be >= 18")
    tok = batch * seq
    act = tok * hidden * 2.0
    names: list[str] = []
    kinds: list[str] = []
    mods: list[str] = []
    flops: list[float] = []
    params: list[float] = []
    src: list[int] = []
    dst: list[int] = []
    coloc: list[int] = []

    def op(nm: str, mod: str, kind: str, fl: float, pb: float, inputs: list[int], c: int = -1) -> int:
        i = len(names)
        names.append(nm)
        mods.append(mod)
        kinds.append(kind)
        flops.append(fl)
        params.append(pb)
        coloc.append(c)
        for j in inputs:
            src.append(j)
            dst.append(i)
        return i

    lin = 2.0 * tok * hidden * hidden
    ew = float(tok * hidden)
    x = op("embed", "embed", "embedding", ew, 32000 * hidden * 2.0, [], 0 if tied else -1)
    for li in range(layers):
        p = f"layers.{li}"
        a = op(f"{p}.ln1.mean", f"{p}.ln1", "layernorm", ew, 0.0, [x])
        a = op(f"{p}.ln1.norm", f"{p}.ln1", "layernorm", ew, 2.0 * hidden * 2, [a])
        q = op(f"{p}.attn.q_proj", f"{p}.attn.q_proj", "linear", lin, hidden * hidden * 2.0, [a])
        k = op(f"{p}.attn.k_proj", f"{p}.attn.k_proj", "linear", lin, hidden * hidden * 2.0, [a])
        v = op(f"{p}.attn.v_proj", f"{p}.attn.v_proj", "linear", lin, hidden * hidden * 2.0, [a])
        outs = []
        for h in range(heads):
            m = f"{p}.attn.core"
            s = op(f"{m}.scores{h}", m, "matmul", 2.0 * tok * seq * hidden / heads, 0.0, [q, k])
            s = op(f"{m}.softmax{h}", m, "softmax_heads", tok * seq / heads * 5.0, 0.0, [s])
            outs.append(op(f"{m}.av{h}", m, "matmul", 2.0 * tok * seq * hidden / heads, 0.0, [s, v]))
        c = op(f"{p}.attn.concat", f"{p}.attn", "cat", 0.0, 0.0, outs)
        o = op(f"{p}.attn.o_proj", f"{p}.attn.o_proj", "linear", lin, hidden * hidden * 2.0, [c])
        r = op(f"{p}.add1", p, "add", ew, 0.0, [x, o])
        b = op(f"{p}.ln2.mean", f"{p}.ln2", "layernorm", ew, 0.0, [r])
        b = op(f"{p}.ln2.norm", f"{p}.ln2", "layernorm", ew, 2.0 * hidden * 2, [b])
        b = op(f"{p}.mlp.fc1", f"{p}.mlp.fc1", "linear", 4 * lin, 4 * hidden * hidden * 2.0, [b])
        b = op(f"{p}.mlp.act", f"{p}.mlp.act", "gelu", 4 * ew, 0.0, [b])
        for j in range(pad):
            b = op(f"{p}.mlp.ew{j}", f"{p}.mlp.ew", "elementwise", 4 * ew, 0.0, [b])
        b = op(f"{p}.mlp.fc2", f"{p}.mlp.fc2", "linear", 4 * lin, 4 * hidden * hidden * 2.0, [b])
        b = op(f"{p}.mlp.dropout", f"{p}.mlp.dropout", "dropout", ew, 0.0, [b])
        x = op(f"{p}.add2", p, "add", ew, 0.0, [r, b])
    x = op("final_norm", "final_norm", "layernorm", ew, 2.0 * hidden * 2, [x])
    x = op("head", "embed" if tied else "head", "linear", 2.0 * tok * hidden * 32000,
           0.0 if tied else 32000 * hidden * 2.0, [x], 0 if tied else -1)
    op("loss", "", "cross_entropy", tok * 32000 * 3.0, 0.0, [x])
    n = len(names)
    e_src = np.asarray(src, dtype=np.int64)
    out_bytes = np.full(n, act)
    return OpGraph(names=names, kinds=kinds, module_paths=mods, fwd_flops=np.asarray(flops),
                   param_bytes=np.asarray(params), out_bytes=out_bytes, edge_src=e_src,
                   edge_dst=np.asarray(dst, dtype=np.int64), edge_bytes=out_bytes[e_src],
                   colocation=np.asarray(coloc, dtype=np.int64), batch_size=batch,
                   name=name or f"layered{layers}x{ops_per_layer}")


def training_graph(forward: int, *, skip_every: int = 7, seed: int = 0) -> OpGraph:
    """A training graph with explicit backward nodes, as the dnn-partitioning workloads list them: a
    forward chain (with skip edges), then the backward chain in reverse; forward op i feeds its
    backward twin and shares a co-location class with it. Coarsening must not tie every class together."""
    h = forward
    n = 2 * h
    src = list(range(h - 1)) + list(range(h, n - 1)) + list(range(h - 1)) + [h - 1]
    dst = list(range(1, h)) + list(range(h + 1, n)) + [n - 1 - i for i in range(h - 1)] + [h]
    for i in range(0, h - 3, skip_every):
        src.append(i)
        dst.append(i + 3)
    rng = np.random.default_rng(seed)
    return OpGraph(names=[f"f{i}" for i in range(h)] + [f"b{h - 1 - i}" for i in range(h)],
                   kinds=["linear"] * h + ["linear_grad"] * h, fwd_flops=rng.uniform(0.5, 1.5, n) * 1e9,
                   bwd_flops=np.zeros(n), param_bytes=np.zeros(n), out_bytes=np.ones(n),
                   edge_src=np.asarray(src), edge_dst=np.asarray(dst), edge_bytes=np.ones(len(src)),
                   colocation=np.r_[np.arange(h), np.arange(h)[::-1]], name=f"training{n}")


def bench(sizes: list[int], max_nodes: int, methods: list[str], ops_per_layer: int = 100) -> list[dict]:
    """Time coarsening of a ``layered_graph`` and a ``training_graph`` of each size (ops) with each method
    (``module`` only on the layered graph); prints one line each and returns the rows."""
    rows = []
    for size in sizes:
        t0 = time.perf_counter()
        graphs = [layered_graph(max(1, size // ops_per_layer), ops_per_layer), training_graph(size // 2)]
        built = (time.perf_counter() - t0) / 2
        for g, method in [(g, m) for g in graphs for m in methods]:
            if g.name.startswith("training") and method == "module":
                continue  # no module paths
            t0 = time.perf_counter()
            cg, grouping = coarsen(g, max_nodes, method)
            dt = time.perf_counter() - t0
            w = cg.fwd_flops + cg.bwd_flops
            cls = np.unique(cg.colocation[cg.colocation >= 0]).size
            row = {"graph": g.name, "classes": cls, "ops": g.num_nodes,
                   "edges": g.num_edges, "method": method, "groups": cg.num_nodes, "coarse_edges": cg.num_edges, "level": grouping.level, "seconds": dt, "build_s": built,
                   "max_over_mean_flops": float(w.max() / w.mean())}
            rows.append(row)
            print(f"{row['graph']:<16} {row['ops']:>7} ops {row['edges']:>7} edges  {method:<9} -> "
                  f"{row['groups']:>4} groups ({cls} co-location classes) "
                  f"{row['coarse_edges']:>5} edges (level {row['level']})  {dt:7.2f} s  "
                  f"(graph built in {built:.2f} s; heaviest group {row['max_over_mean_flops']:.2f}x mean)",
                  flush=True)
            if g.num_nodes >= BUDGET_OPS:
                row["within_budget"] = dt < BUDGET_S
                print(f"{'':<16} {BUDGET_OPS // 1000}k-op budget {BUDGET_S:.0f} s: "
                      f"{'ok' if row['within_budget'] else 'EXCEEDED'}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--max-nodes", type=int, default=512)
    ap.add_argument("--methods", nargs="+", default=["auto", "module", "light", "partition"])
    args = ap.parse_args(argv)
    rows = bench(args.sizes, args.max_nodes, args.methods)
    return 1 if any(r.get("within_budget") is False for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
