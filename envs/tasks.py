"""Tasks for the placement environments: what to place (graph), where (topology), at which batch.

A :class:`Task` is one (OpGraph, Topology, global batch) triple. An environment draws one task per
episode from a *task source*: a list of tasks (drawn uniformly) or a callable ``rng -> Task``.
``envs/`` never imports ``profilers/``: to train over model-family specs, the caller resolves specs
into graphs and passes a sampler, e.g.::

    from profilers.spec import graph_from_spec, sample_specs
    specs = sample_specs(["gpt", "resnet"], n=32, seed=0)
    sampler = graph_sampler([graph_from_spec(s) for s in specs], ["dgx-a100-80g"])
    env = PlacementEnv(tasks=sampler)

The no-argument default (:func:`default_tasks`) places the small graphs shipped in ``envs/data/``
(GPT-style transformers of a few sizes, an MLP chain, a branching CNN and a wide mixture-of-experts
model; see :func:`builtin_graph_factories`) on a DGX A100 (8x A100 80GB).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from envs.errors import EnvError
from envs.examples import transformer_graph
from envs.graph import GraphBuilder, OpGraph
from envs.plan import DTYPE_BYTES
from envs.presets import resolve_topology
from envs.topology import Topology

DATA_DIR = Path(__file__).with_name("data")
DEFAULT_TOPOLOGY = "dgx-a100-80g"


@dataclass(eq=False)
class Task:
    """One placement problem: ``graph`` on ``topology`` at global ``batch`` (None: the graph's traced batch).

    ``name`` identifies the task in ``info["task_id"]``; it defaults to ``graph.name@topology.name``.
    Tasks compare by identity: environments cache per-task work (coarsening, features, reference
    times) keyed by the task object, so re-use one Task object rather than rebuilding it."""

    graph: OpGraph
    topology: Topology
    batch: int | None = None
    name: str = ""
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.graph, OpGraph):
            raise EnvError(f"Task.graph must be an OpGraph, got {type(self.graph).__name__}")
        if isinstance(self.topology, str):
            self.topology = resolve_topology(self.topology)
        if not isinstance(self.topology, Topology):
            raise EnvError(f"Task.topology must be a Topology or preset name, got {type(self.topology).__name__}")
        if self.batch is not None:
            if int(self.batch) < 1:
                raise EnvError(f"task batch must be >= 1, got {self.batch}")
            self.batch = int(self.batch)
        if not self.name:
            self.name = f"{self.graph.name}@{self.topology.name}"

    @property
    def global_batch(self) -> int:
        return int(self.batch if self.batch is not None else self.graph.batch_size)


TaskSource = Sequence[Task] | Callable[[np.random.Generator], Task]


def uniform_sampler(tasks: Sequence[Task]) -> Callable[[np.random.Generator], Task]:
    """A sampler drawing uniformly from a fixed list of tasks."""
    tasks = list(tasks)
    if not tasks:
        raise EnvError("uniform_sampler needs at least one task")

    def sample(rng: np.random.Generator) -> Task:
        return tasks[int(rng.integers(len(tasks)))]

    return sample


def graph_sampler(graphs: Sequence[OpGraph] | Callable[[np.random.Generator], OpGraph],
                  topologies: Sequence[Topology | str] = (DEFAULT_TOPOLOGY,),
                  batches: Sequence[int | None] = (None,)) -> Callable[[np.random.Generator], Task]:
    """A sampler over the product of graphs x topologies x batches, each drawn uniformly.

    ``graphs`` is a list or a callable ``rng -> OpGraph`` (e.g. one that resolves a random model-family
    spec with ``profilers.spec``; the caller owns that import). Tasks built from a listed graph are
    re-used, so per-task caches hit; a callable's graphs make new tasks."""
    topos = [resolve_topology(t) for t in topologies]
    if not topos:
        raise EnvError("graph_sampler needs at least one topology")
    batches = list(batches) or [None]
    if callable(graphs):
        def sample_fn(rng: np.random.Generator) -> Task:
            g = graphs(rng)
            return Task(g, topos[int(rng.integers(len(topos)))], batches[int(rng.integers(len(batches)))])
        return sample_fn
    tasks = [Task(g, t, b) for g in graphs for t in topos for b in batches]
    return uniform_sampler(tasks)


# ---------------------------------------------------------------------- built-in graphs
def mlp_chain_graph(layers: int = 12, width: int = 4096, tokens: int = 4096, batch: int = 8,
                    dtype: str = "bf16", name: str | None = None) -> OpGraph:
    """A deep MLP: linear -> relu repeated, widths alternating 1x / 2x (a pure chain)."""
    e = DTYPE_BYTES[dtype]
    builder = GraphBuilder()
    prev, w_in = -1, width
    for i in range(layers):
        w_out = width * (2 if i % 2 == 0 else 1)
        fc = builder.node(f"layers.{i}.fc", "linear", f"layers.{i}.fc", 2.0 * tokens * w_in * w_out,
                          w_in * w_out * e, tokens * w_out * e, [prev] if prev >= 0 else [])
        prev = builder.node(f"layers.{i}.act", "relu", f"layers.{i}.act", tokens * w_out, 0.0, tokens * w_out * e,
                            [fc])
        w_in = w_out
    return builder.build(batch_size=batch, dtype=dtype,
                         name=name or f"mlp-chain-l{layers}-w{width}")


def branching_cnn_graph(blocks: int = 6, channels: int = 256, image: int = 28, batch: int = 16,
                        dtype: str = "bf16", name: str | None = None) -> OpGraph:
    """An Inception-like CNN: a stem, then blocks of three parallel branches (1x1 conv; 1x1 -> 3x3 conv;
    max-pool -> 1x1 conv) joined by a concat, every other block halving the resolution; pooled head."""
    e = DTYPE_BYTES[dtype]
    builder = GraphBuilder()

    def node(nm, kind, fl, pb, ob, inputs):  # module path = node name
        return builder.node(nm, kind, nm, fl, pb, ob, inputs)

    hw, c = image * image, channels
    x = node("stem.conv", "conv2d", 2 * batch * hw * 3 * c * 9, 3 * c * 9 * e, batch * hw * c * e, [])
    for b in range(blocks):
        p = f"blocks.{b}"
        q = c // 4
        b1 = node(f"{p}.b1.conv", "conv2d", 2 * batch * hw * c * q, c * q * e, batch * hw * q * e, [x])
        r2 = node(f"{p}.b2.reduce", "conv2d", 2 * batch * hw * c * q, c * q * e, batch * hw * q * e, [x])
        b2 = node(f"{p}.b2.conv", "conv2d", 2 * batch * hw * q * 2 * q * 9, q * 2 * q * 9 * e,
                  batch * hw * 2 * q * e, [r2])
        pl = node(f"{p}.b3.pool", "maxpool", batch * hw * c * 9, 0, batch * hw * c * e, [x])
        b3 = node(f"{p}.b3.conv", "conv2d", 2 * batch * hw * c * q, c * q * e, batch * hw * q * e, [pl])
        cat = node(f"{p}.concat", "concat", batch * hw * c, 0, batch * hw * c * e, [b1, b2, b3])
        x = node(f"{p}.relu", "relu", batch * hw * c, 0, batch * hw * c * e, [cat])
        if b % 2 == 1 and hw > 16:
            hw //= 4
            x = node(f"{p}.down", "avgpool", batch * hw * 4 * c, 0, batch * hw * c * e, [x])
    gap = node("head.pool", "avgpool", batch * hw * c, 0, batch * c * e, [x])
    fc = node("head.fc", "linear", 2 * batch * c * 1000, c * 1000 * e, batch * 1000 * e, [gap])
    node("loss", "cross_entropy", 3 * batch * 1000, 0, 4, [fc])
    return builder.build(batch_size=batch, dtype=dtype,
                         name=name or f"branching-cnn-b{blocks}-c{channels}")


def moe_graph(layers: int = 2, experts: int = 8, top_k: int = 2, hidden: int = 1024, seq: int = 1024,
              batch: int = 8, vocab: int = 32000, dtype: str = "bf16", name: str | None = None) -> OpGraph:
    """A wide mixture-of-experts transformer: per layer an attention block, then a router and
    ``experts`` parallel expert MLPs (each seeing ``top_k / experts`` of the tokens) summed back."""
    e = DTYPE_BYTES[dtype]
    tok, h, f = batch * seq, hidden, 4 * hidden
    builder = GraphBuilder()
    node = builder.node

    act = tok * h * e
    x = node("embed", "embedding", "embed", tok * h, vocab * h * e, act, [])
    share = top_k / experts
    for li in range(layers):
        p = f"layers.{li}"
        ln1 = node(f"{p}.ln1", "layernorm", f"{p}.ln1", 5 * tok * h, 2 * h * e, act, [x])
        qkv = node(f"{p}.attn.qkv", "linear", f"{p}.attn.qkv", 6 * tok * h * h, 3 * h * h * e, 3 * act, [ln1])
        att = node(f"{p}.attn.sdpa", "attention", f"{p}.attn.sdpa", 4 * batch * seq * seq * h, 0, act, [qkv])
        proj = node(f"{p}.attn.proj", "linear", f"{p}.attn.proj", 2 * tok * h * h, h * h * e, act, [att])
        add1 = node(f"{p}.add1", "add", p, tok * h, 0, act, [x, proj])
        ln2 = node(f"{p}.ln2", "layernorm", f"{p}.ln2", 5 * tok * h, 2 * h * e, act, [add1])
        router = node(f"{p}.moe.router", "linear", f"{p}.moe.router", 2 * tok * h * experts, h * experts * e,
                      act, [ln2])
        outs_e = []
        for k in range(experts):
            outs_e.append(node(f"{p}.moe.experts.{k}", "expert", f"{p}.moe.experts.{k}",
                               4 * tok * share * h * f, 2 * h * f * e, act * share, [router], act * share))
        comb = node(f"{p}.moe.combine", "add", f"{p}.moe", tok * h * top_k, 0, act, outs_e)
        x = node(f"{p}.add2", "add", p, tok * h, 0, act, [add1, comb])
    lnf = node("ln_f", "layernorm", "ln_f", 5 * tok * h, 2 * h * e, act, [x])
    head = node("lm_head", "linear", "lm_head", 2 * tok * h * vocab, vocab * h * e, tok * vocab * e, [lnf])
    node("loss", "cross_entropy", "loss", 3 * tok * vocab, 0, 4, [head])
    return builder.build(batch_size=batch, dtype=dtype,
                         name=name or f"moe-l{layers}-e{experts}-h{hidden}")


def builtin_graph_factories() -> dict[str, Callable[[], OpGraph]]:
    """The generators of the graphs shipped in ``envs/data/`` (file stem -> factory)."""
    return {
        "gpt-tiny": lambda: transformer_graph(layers=2, hidden=512, heads=8, seq=512, vocab=32000, batch=8,
                                              name="gpt-tiny"),
        "gpt-small": lambda: transformer_graph(layers=4, hidden=1024, heads=16, seq=1024, batch=8, name="gpt-small"),
        "gpt-medium": lambda: transformer_graph(layers=8, hidden=2048, heads=16, seq=1024, vocab=50257, batch=8,
                                                name="gpt-medium"),
        "gpt-1.3b": lambda: transformer_graph(layers=24, hidden=2048, heads=16, seq=2048, vocab=50257, batch=8,
                                              name="gpt-1.3b"),
        "mlp-chain": lambda: mlp_chain_graph(layers=12, width=4096, tokens=4096, batch=8, name="mlp-chain"),
        "branching-cnn": lambda: branching_cnn_graph(blocks=6, channels=256, image=28, batch=16,
                                                     name="branching-cnn"),
        "moe-wide": lambda: moe_graph(layers=2, experts=8, top_k=2, hidden=1024, seq=1024, batch=8, name="moe-wide"),
    }


def write_builtin_graphs(directory: str | Path = DATA_DIR) -> list[Path]:
    """(Re)generate the shipped graph JSONs (``python -m envs.tasks``)."""
    out = []
    for stem, make in builtin_graph_factories().items():
        path = Path(directory) / f"{stem}.json"
        make().save(path)
        out.append(path)
    return out


def builtin_graph_names() -> list[str]:
    return sorted(p.stem for p in DATA_DIR.glob("*.json"))


def load_builtin_graph(name: str) -> OpGraph:
    path = DATA_DIR / f"{name}.json"
    if not path.exists():
        raise EnvError(f"no built-in graph {name!r}; have {', '.join(builtin_graph_names()) or 'none'}")
    return OpGraph.load(path)


_DEFAULT_CACHE: dict[tuple, list[Task]] = {}


def default_tasks(topology: Topology | str = DEFAULT_TOPOLOGY, names: Sequence[str] | None = None) -> list[Task]:
    """The built-in graphs on ``topology`` (default: DGX A100 80GB), one task per graph.

    The returned list is cached per (topology spec, names) so that environments built without
    arguments share task objects (and so their per-task caches)."""
    key = (topology if isinstance(topology, str) else id(topology), tuple(names) if names else None)
    if key not in _DEFAULT_CACHE:
        topo = resolve_topology(topology)
        chosen = list(names) if names else builtin_graph_names()
        if not chosen:
            raise EnvError(f"no built-in graphs found in {DATA_DIR}")
        _DEFAULT_CACHE[key] = [Task(load_builtin_graph(n), topo, name=f"{n}@{topo.name}") for n in chosen]
    return _DEFAULT_CACHE[key]


if __name__ == "__main__":  # pragma: no cover
    for p in write_builtin_graphs():
        print(p, OpGraph.load(p).summary())
