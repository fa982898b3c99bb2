"""Partitioning an operator graph: its placement units and METIS k-way parts.

METIS (Karypis & Kumar, "A Fast and High Quality Multilevel Scheme for Partitioning Irregular Graphs",
SIAM J. Sci. Comput. 1998) through ``pymetis``: vertices are placement units (co-location classes
contracted) weighted by compute time, edges weighted by the bytes they carry (summed both ways), the
parts sized to target shares. Used by the METIS placer (``agent.placers.partition``) and the refine
mode's graph-partition starts (``envs.placement.task_setup``).
"""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np

from envs.graph import OpGraph


def units(graph: OpGraph) -> tuple[np.ndarray, list[np.ndarray]]:
    """Placement units: a co-location class, or a node of no class. Returns (unit of node, nodes of unit)
    with units numbered in order of their first node in topological order."""
    n = graph.num_nodes
    unit = np.full(n, -1, dtype=np.int64)
    of_class: dict[int, int] = {}
    members: list[list[int]] = []
    for v in graph.topological_order().tolist():
        c = int(graph.colocation[v])
        if c >= 0 and c in of_class:
            u = of_class[c]
        else:
            u = len(members)
            members.append([])
            if c >= 0:
                of_class[c] = u
        unit[v] = u
        members[u].append(v)
    return unit, [np.asarray(m, dtype=np.int64) for m in members]

@contextlib.contextmanager
def _quiet_c_stdout():
    """Silence file descriptor 1 (C-level prints) for the duration."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def metis_parts(graph: OpGraph, k: int, weights: np.ndarray, tpwgts: list[float] | None = None,
                seed: int = 0) -> np.ndarray:
    """Part (0..k-1) of each node from METIS on the unit graph."""
    import pymetis

    unit, members = units(graph)
    nu = len(members)
    if k <= 1 or nu < k:
        return np.zeros(graph.num_nodes, dtype=np.int64)
    vw = np.array([weights[m].sum() for m in members])
    vw = np.maximum(1, np.round(vw / max(vw.max(), 1e-30) * 1e6)).astype(np.int64)
    adj: dict[tuple[int, int], float] = {}
    for s, t, b in zip(graph.edge_src.tolist(), graph.edge_dst.tolist(), graph.edge_bytes.tolist()):
        a, c = int(unit[s]), int(unit[t])
        if a == c:
            continue
        key = (min(a, c), max(a, c))
        adj[key] = adj.get(key, 0.0) + b + 1.0
    nbrs: list[list[tuple[int, float]]] = [[] for _ in range(nu)]
    for (a, c), w in adj.items():
        nbrs[a].append((c, w))
        nbrs[c].append((a, w))
    wmax = max(adj.values()) if adj else 1.0
    xadj, adjncy, ew = [0], [], []
    for a in range(nu):
        for c, w in sorted(nbrs[a]):
            adjncy.append(c)
            ew.append(max(1, int(round(w / wmax * 1e6))))
        xadj.append(len(adjncy))
    opts = pymetis.Options(seed=int(seed))
    with _quiet_c_stdout():  # METIS prints its warnings (e.g. for tiny parts) from C
        _, parts = pymetis.part_graph(k, pymetis.CSRAdjacency(xadj, adjncy), vweights=vw.tolist(), eweights=ew,
                                      tpwgts=tpwgts, options=opts)
    parts = np.asarray(parts, dtype=np.int64)
    return parts[unit]
