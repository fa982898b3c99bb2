"""The task distribution of the best-known-plans dataset (:mod:`agent.dataset`): model-zoo specs
(``profilers.zoo``, the ``small`` size class), random layered and series-parallel DAGs
(:mod:`agent.distribution.random_dags`) and the built-in graphs, placed on random clusters
(:mod:`agent.distribution.topologies`: 2-64 devices, 1-8 hosts, mixed kinds incl. CPUs, link tiers).

Task ``i`` of seed ``s`` depends only on ``(s, i)``: a larger ``n`` with the same seed extends the list
(so a dataset grows incrementally). Tasks are split into ``train`` and ``holdout`` by *family*: every
task of a holdout family is a holdout task, so a policy trained on the train split meets unseen kinds
of model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from agent.distribution.random_dags import GENERATORS, DagRanges
from agent.distribution.topologies import ClusterRanges, random_cluster
from envs.errors import RlplaceError
from envs.graph import OpGraph
from envs.topology import Topology

ZOO_FAMILIES = ("mlp", "resnet", "inception", "gnmt", "gpt", "bert", "moe", "unet")
RANDOM_FAMILIES = tuple(GENERATORS)
FAMILIES = ZOO_FAMILIES + RANDOM_FAMILIES
HOLDOUT_FAMILIES = ("inception", "unet", "random-series-parallel")


class DistributionError(RlplaceError):
    """A bad task-distribution request (unknown family, n < 0)."""


@dataclass(frozen=True)
class TaskDraw:
    """One drawn task: its graph, cluster, family, spec (zoo spec or generator id) and split."""

    graph: OpGraph
    topology: Topology
    family: str
    spec: str
    split: str
    seed: int


def _check(families: Sequence[str]) -> list[str]:
    fams = list(families)
    if not fams:
        raise DistributionError("the task distribution needs at least one family")
    bad = [f for f in fams if f not in FAMILIES]
    if bad:
        raise DistributionError(f"unknown task famil{'ies' if len(bad) > 1 else 'y'} {', '.join(bad)}; "
                                f"families: {', '.join(FAMILIES)}")
    return fams


def draw_graph(family: str, seed: int, dag_ranges: DagRanges = DagRanges()) -> tuple[OpGraph, str]:
    """The graph of ``family`` for ``seed`` and its spec string."""
    _check([family])
    if family in GENERATORS:
        spec = f"{family}:seed={seed}"
        return GENERATORS[family](seed, dag_ranges, name=spec), spec
    from profilers.spec import graph_from_spec, sample_specs

    spec = sample_specs([family], 1, seed=seed)[0]
    return graph_from_spec(spec), spec


def draw_task(i: int, seed: int, families: Sequence[str] = FAMILIES, holdout: Sequence[str] = HOLDOUT_FAMILIES,
              dag_ranges: DagRanges = DagRanges(), cluster_ranges: ClusterRanges = ClusterRanges()) -> TaskDraw:
    """Task ``i`` of the distribution for ``seed`` (see the module docstring)."""
    fams = _check(families)
    rng = np.random.default_rng([int(seed), int(i)])
    family = fams[int(rng.integers(len(fams)))]
    gseed, cseed = (int(x) for x in rng.integers(0, 2**31 - 1, size=2))
    graph, spec = draw_graph(family, gseed, dag_ranges)
    topo = random_cluster(cseed, cluster_ranges)
    return TaskDraw(graph, topo, family, spec, "holdout" if family in set(holdout) else "train",
                    int(rng.integers(0, 2**31 - 1)))


def draw_tasks(n: int, seed: int, families: Sequence[str] = FAMILIES, holdout: Sequence[str] = HOLDOUT_FAMILIES,
               dag_ranges: DagRanges = DagRanges(), cluster_ranges: ClusterRanges = ClusterRanges()) -> list[TaskDraw]:
    """Tasks ``0 .. n-1`` of the distribution for ``seed``."""
    if n < 0:
        raise DistributionError(f"the number of tasks must be >= 0, got {n}")
    return [draw_task(i, seed, families, holdout, dag_ranges, cluster_ranges) for i in range(n)]


__all__ = ["FAMILIES", "HOLDOUT_FAMILIES", "RANDOM_FAMILIES", "ZOO_FAMILIES", "ClusterRanges", "DagRanges",
           "DistributionError", "TaskDraw", "draw_graph", "draw_task", "draw_tasks"]
