"""Turn user-facing names into objects: graph specs, topology names, plan files."""

from __future__ import annotations

import os

from envs.errors import GraphError
from envs.examples import EXAMPLES
from envs.graph import OpGraph


def resolve_graph(spec: str | OpGraph) -> OpGraph:
    """A built-in example (``envs.examples``: ``gpt-small``, ``gpt-1.3b``; or a graph shipped in
    ``envs/data``: ``gpt-tiny``, ``gpt-medium``, ``moe-wide``, ...), a graph JSON file, or a model spec
    (``gpt:layers=4``, ``file.py:build_fn``) traced by ``profilers``."""
    if isinstance(spec, OpGraph):
        return spec
    spec = str(spec)
    if spec in EXAMPLES:
        return EXAMPLES[spec]()
    from envs.tasks import builtin_graph_names, load_builtin_graph

    if spec in builtin_graph_names():
        return load_builtin_graph(spec)
    if os.path.isdir(spec):
        raise GraphError(f"graph {spec} is a directory, not a graph file or model spec")
    if spec.endswith(".json") or (os.path.isfile(spec) and ".py:" not in spec):
        return OpGraph.load(spec)  # a graph file, whatever its suffix (OpGraph.load says what is wrong)
    try:
        from profilers.spec import graph_from_spec
    except ImportError as exc:  # pragma: no cover - profilers ship with rlplace
        raise GraphError(f"unknown graph {spec!r}: not an example ({', '.join(EXAMPLES)}) nor a JSON file") from exc
    return graph_from_spec(spec)
