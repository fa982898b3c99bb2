"""The training distribution of placement tasks: model families at realistic sizes
(``profilers.families``: the model zoo's families with the knob ranges practitioners use, Hugging Face
configs, a user's own ``my_model.py:build`` with knob ranges), random layered and series-parallel DAGs
(:mod:`agent.distribution.random_dags`), placed on random clusters (:mod:`agent.distribution.topologies`:
2-64 devices, 1-8 hosts, mixed kinds incl. CPUs, link tiers from PCIe to NVSwitch and InfiniBand, tight
and loose memory).

Task ``i`` of seed ``s`` depends only on ``(s, i)``: a larger ``n`` with the same seed extends the list
(so a dataset grows incrementally). A draw whose model states cannot fit the cluster at all (16 bytes
per parameter of mixed-precision Adam beyond 90% of all the devices' memory, or one operator's beyond
the largest device even split over every device) is drawn again, deterministically.

Tasks are split by *family*: a ``holdout`` family's tasks are never trained on, so a policy trained on
the ``train`` split meets unseen kinds of model (leave-family-out evaluation). A family is a name (a
zoo family or a DAG generator) or a :class:`profilers.families.FamilySpec` mapping (``{"model":
"my_model.py:build", "knobs": {"layers": [2, 12]}, "name": "mine"}``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from agent.distribution.random_dags import GENERATORS, DagRanges
from agent.distribution.topologies import ClusterRanges, random_cluster
from envs.errors import RlplaceError
from envs.graph import OpGraph
from envs.topology import Topology

ZOO_FAMILIES = ("mlp", "resnet", "inception", "gnmt", "gpt", "bert", "moe", "unet", "vit", "llama", "t5", "dlrm",
                "twotower", "convnext", "diffusion")
RANDOM_FAMILIES = tuple(GENERATORS)
FAMILIES = ZOO_FAMILIES + RANDOM_FAMILIES
# held out of training: a vision transformer, an encoder-decoder, a multi-branch CNN, an embedding-heavy
# retrieval model and irregular series-parallel graphs, each with relatives in the training families
HOLDOUT_FAMILIES = ("vit", "t5", "inception", "twotower", "random-series-parallel")
TRAIN_FAMILIES = tuple(f for f in FAMILIES if f not in HOLDOUT_FAMILIES)
STATE_BYTES = 16.0  # mixed-precision Adam per parameter (Rajbhandari et al. SC'20)
MAX_REDRAWS = 64


class DistributionError(RlplaceError):
    """A bad task-distribution request (unknown family, a bad family spec, n < 0)."""


@dataclass(frozen=True)
class TaskDraw:
    """One drawn task: its graph, cluster, family, spec (model spec or generator id) and split."""

    graph: OpGraph
    topology: Topology
    family: str
    spec: str
    split: str
    seed: int


# ---------------------------------------------------------------------- families
@dataclass(frozen=True)
class Family:
    """A family of the distribution: its name and how to draw a model of it."""

    name: str
    spec: Any = None  # profilers.families.FamilySpec, or None for a DAG generator
    generator: str | None = None  # the DAG generator (default: the name) when spec is None

    def draw(self, seed: int, dag_ranges: DagRanges = DagRanges()) -> tuple[OpGraph, str]:
        """The graph for ``seed`` and its spec string."""
        if self.spec is None:
            gen = self.generator or self.name
            spec = f"{gen}:seed={seed}"
            return GENERATORS[gen](seed, dag_ranges, name=spec), spec
        from profilers.spec import graph_from_spec

        spec = self.spec.sample(seed)
        return graph_from_spec(spec), spec


def family(entry: str | Mapping[str, Any] | Family) -> Family:
    """A :class:`Family` from a name or a family-spec mapping (one-line :class:`DistributionError`)."""
    if isinstance(entry, Family):
        return entry
    from profilers.families import FamilySpec
    from profilers.spec import SpecError

    if isinstance(entry, str):
        if entry in GENERATORS:
            return Family(entry)
        if entry not in ZOO_FAMILIES and not entry.startswith("hf:") and ".py:" not in entry:
            raise DistributionError(f"unknown task family {entry!r}; families: {', '.join(FAMILIES)} "
                                    "(or hf:NAME, file.py:fn, or a family spec mapping)")
    if isinstance(entry, Mapping) and "generator" in entry:  # a DAG generator under another name
        gen, extra = entry["generator"], sorted(set(entry) - {"generator", "name"})
        if gen not in GENERATORS or extra:
            raise DistributionError(f"a generator family is {{generator: {'|'.join(GENERATORS)}, name: NAME}}; got "
                                    f"generator {gen!r}" + (f" with {', '.join(extra)}" if extra else ""))
        return Family(str(entry.get("name") or gen), None, str(gen))
    try:
        if isinstance(entry, Mapping):
            body = {k: v for k, v in entry.items() if k != "name"}
            spec = FamilySpec.parse(body)
            name = str(entry.get("name") or body.get("model"))
        else:
            spec, name = FamilySpec.parse(entry), entry
    except SpecError as exc:
        raise DistributionError(str(exc)) from None
    return Family(name, spec)


def families(entries: Sequence[str | Mapping[str, Any]]) -> list[Family]:
    out = [family(e) for e in entries]
    if not out:
        raise DistributionError("the task distribution needs at least one family")
    names = [f.name for f in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise DistributionError(f"family {dup!r} is listed twice (give family specs distinct 'name's)")
    return out


# ---------------------------------------------------------------------- drawing tasks
def fits_somewhere(graph: OpGraph, topology: Topology) -> bool:
    """The model states can fit the cluster at all (see the module docstring)."""
    params = graph.param_bytes / 2.0  # bf16 weights
    mem = np.array([d.memory_bytes for d in topology.devices])
    return bool(params.sum() * STATE_BYTES <= 0.9 * mem.sum()
                and params.max(initial=0.0) * STATE_BYTES / topology.num_devices <= mem.max())


def draw_task(i: int, seed: int, families_: Sequence[str | Mapping | Family] = FAMILIES,
              holdout: Sequence[str] = HOLDOUT_FAMILIES, dag_ranges: DagRanges = DagRanges(),
              cluster_ranges: ClusterRanges = ClusterRanges()) -> TaskDraw:
    """Task ``i`` of the distribution for ``seed`` (see the module docstring)."""
    fams = families(families_)
    rng = np.random.default_rng([int(seed), int(i)])
    fam = fams[int(rng.integers(len(fams)))]
    for _ in range(MAX_REDRAWS):
        gseed, cseed, tseed = (int(x) for x in rng.integers(0, 2**31 - 1, size=3))
        try:
            graph, spec = fam.draw(gseed, dag_ranges)
        except RlplaceError as exc:
            raise DistributionError(f"family {fam.name!r}: {exc}") from None
        topo = random_cluster(cseed, cluster_ranges)
        if fits_somewhere(graph, topo):
            return TaskDraw(graph, topo, fam.name, spec, "holdout" if fam.name in set(holdout) else "train", tseed)
    raise DistributionError(f"family {fam.name!r}: no draw of {MAX_REDRAWS} fits its cluster's memory; give "
                            "smaller knob ranges or larger clusters")


def draw_tasks(n: int, seed: int, families_: Sequence[str | Mapping | Family] = FAMILIES,
               holdout: Sequence[str] = HOLDOUT_FAMILIES, dag_ranges: DagRanges = DagRanges(),
               cluster_ranges: ClusterRanges = ClusterRanges(),
               on_draw: Callable[[TaskDraw], None] | None = None) -> list[TaskDraw]:
    """Tasks ``0 .. n-1`` of the distribution for ``seed`` (``on_draw``: called with each one as it is
    drawn, e.g. to show progress: a draw traces a model)."""
    if n < 0:
        raise DistributionError(f"the number of tasks must be >= 0, got {n}")
    fams = families(families_)
    out = []
    for i in range(n):
        out.append(draw_task(i, seed, fams, holdout, dag_ranges, cluster_ranges))
        if on_draw is not None:
            on_draw(out[-1])
    return out


def _section_streams(section) -> tuple[ClusterRanges, list[Family], list[Family]]:
    """A ``tasks.distribution`` section's cluster ranges, training families and held-out families (a
    family in both is a one-line error)."""
    clusters = ClusterRanges(devices=tuple(section.devices), hosts=tuple(section.hosts),
                             memory_scale=tuple(section.memory_scale))
    train_fams = families(section.families if section.families is not None else TRAIN_FAMILIES)
    held_fams = families(section.holdout_families if section.holdout_families is not None else HOLDOUT_FAMILIES)
    overlap = {f.name for f in train_fams} & {f.name for f in held_fams}
    if overlap:
        raise DistributionError(f"families both trained on and held out: {', '.join(sorted(overlap))}")
    return clusters, train_fams, held_fams


def draw_distribution(section, on_draw: Callable[[TaskDraw], None] | None = None) -> tuple[list[TaskDraw],
                                                                                          list[TaskDraw]]:
    """(training tasks, held-out tasks) of a training config's ``tasks.distribution`` section
    (:class:`agent.config.DistributionSection`): ``tasks`` draws over the training families and
    ``holdout_tasks`` over the held-out ones, from two seeded streams."""
    clusters, train_fams, held_fams = _section_streams(section)
    held = [f.name for f in held_fams]
    train = draw_tasks(section.tasks, section.seed, train_fams, held, cluster_ranges=clusters, on_draw=on_draw)
    holdout = draw_tasks(section.holdout_tasks, section.seed + 1, held_fams, held, cluster_ranges=clusters,
                         on_draw=on_draw)
    return train, holdout


def draw_validation(section, n: int, on_draw: Callable[[TaskDraw], None] | None = None) -> list[TaskDraw]:
    """``n`` validation tasks of a ``tasks.distribution`` section: training-family draws from a third
    seeded stream (``seed + 2``; split ``validation``), members of the trained families that the
    training's own draws (stream ``seed``) almost surely are not — the caller drops any that coincide."""
    clusters, train_fams, held_fams = _section_streams(section)
    return [replace(d, split="validation") for d in draw_tasks(n, section.seed + 2, train_fams,
                                                               [f.name for f in held_fams], cluster_ranges=clusters,
                                                               on_draw=on_draw)]


def draw_graph(family_: str | Mapping, seed: int, dag_ranges: DagRanges = DagRanges()) -> tuple[OpGraph, str]:
    """The graph of a family (name or spec) for ``seed`` and its spec string."""
    return family(family_).draw(seed, dag_ranges)


__all__ = ["FAMILIES", "HOLDOUT_FAMILIES", "TRAIN_FAMILIES", "RANDOM_FAMILIES", "ZOO_FAMILIES", "ClusterRanges",
           "DagRanges", "DistributionError", "Family", "TaskDraw", "draw_distribution", "draw_graph", "draw_task",
           "draw_validation",
           "draw_tasks", "families", "family", "fits_somewhere"]
