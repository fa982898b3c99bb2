import networkx as nx
import numpy as np
import pytest

from envs.errors import GraphError
from envs.examples import transformer_graph
from envs.graph import OpGraph, chain_graph


def _graph(**over):
    kw = dict(names=["a", "b", "c"], kinds=["linear", "relu", "linear"], fwd_flops=[2.0, 1.0, 2.0],
              param_bytes=[4.0, 0.0, 4.0], out_bytes=[8.0, 8.0, 8.0], edge_src=[0, 1], edge_dst=[1, 2],
              edge_bytes=[8.0, 8.0])
    kw.update(over)
    return OpGraph(**kw)


def test_backward_flops_derived_from_weights():
    g = _graph()
    assert g.bwd_flops.tolist() == [4.0, 1.0, 4.0]


def test_json_round_trip(tmp_path):
    g = transformer_graph(layers=2, hidden=64, seq=16, batch=2)
    g = g.with_measured("a100-80g", np.full(g.num_nodes, 1e-3), np.full(g.num_nodes, 2e-3))
    p = tmp_path / "g.json"
    g.save(p)
    h = OpGraph.load(p)
    assert h.names == g.names and h.module_paths == g.module_paths
    np.testing.assert_allclose(h.fwd_flops, g.fwd_flops)
    np.testing.assert_allclose(h.measured["a100-80g"]["bwd"], 2e-3)
    assert h.batch_size == 2 and h.edge_src.tolist() == g.edge_src.tolist()
    assert not list(tmp_path.glob(".*tmp")), "temp files left behind"


def test_networkx_round_trip():
    g = transformer_graph(layers=1, hidden=32, seq=8, batch=1)
    nxg = g.to_networkx()
    assert isinstance(nxg, nx.DiGraph) and nx.is_directed_acyclic_graph(nxg)
    h = OpGraph.from_networkx(nxg)
    assert sorted(h.names) == sorted(g.names)
    assert h.fwd_flops.sum() == pytest.approx(g.fwd_flops.sum())


def test_topological_order_and_critical_path():
    g = chain_graph(5, flops=1.0)
    assert g.topological_order().tolist() == [0, 1, 2, 3, 4]
    length, path = g.critical_path(np.ones(5))
    assert length == 5 and path == [0, 1, 2, 3, 4]
    # diamond: longest branch wins
    d = OpGraph(names=list("abcd"), kinds=["op"] * 4, fwd_flops=[1, 5, 1, 1], param_bytes=[0] * 4,
                out_bytes=[1] * 4, edge_src=[0, 0, 1, 2], edge_dst=[1, 2, 3, 3], edge_bytes=[1] * 4)
    length, path = d.critical_path(d.fwd_flops)
    assert length == 7 and path == [0, 1, 3]


@pytest.mark.parametrize("over, message", [
    (dict(edge_src=[0, 1, 2], edge_dst=[1, 2, 0], edge_bytes=[1, 1, 1]), "not a DAG"),
    (dict(edge_src=[0, 5], edge_dst=[1, 2]), "does not exist"),
    (dict(names=["a", "a", "c"]), "duplicate node name 'a'"),
    (dict(fwd_flops=[1.0, -1.0, 1.0]), "node 'b': fwd_flops"),
    (dict(out_bytes=[1.0, 1.0, float("nan")]), "node 'c': out_bytes"),
    (dict(edge_bytes=[1.0, -3.0]), "edge b -> c"),
])
def test_validation_names_the_offender(over, message):
    with pytest.raises(GraphError, match=message):
        _graph(**over)


def test_load_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(GraphError, match="not valid JSON"):
        OpGraph.load(bad)
    with pytest.raises(GraphError, match="not found"):
        OpGraph.load(tmp_path / "missing.json")
    other = tmp_path / "other.json"
    other.write_text('{"format": "something"}')
    with pytest.raises(GraphError, match="not an rlplace graph"):
        OpGraph.load(other)
