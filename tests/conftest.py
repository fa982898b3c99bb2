import os

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """Keep calibration files and caches out of the user's home."""
    monkeypatch.setenv("RLPLACE_HOME", str(tmp_path / "rlplace-home"))


@pytest.fixture
def cli(capsys):
    """Run ``rlplace ARGS...`` in-process: returns (exit code, stdout, stderr)."""
    from agent.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # pragma: no cover - main returns its code; kept for safety
            code = exc.code if isinstance(exc.code, int) else 2
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


# ---------------------------------------------------------------------- file fuzzing (shared strategies)
def json_paths(doc, prefix=()):
    """Every (path, value) in a JSON-like document, containers included."""
    yield prefix, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from json_paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from json_paths(v, prefix + (i,))


BAD_VALUES = ["abc", "", None, True, False, [], {}, [1, 2], {"x": 1}, -1, 0, 1.7, -1e30, 1e308, 2**70,
              float("nan"), float("inf"), float("-inf"), "1e9", "0123", -0.0]


def mutations():
    """A hypothesis strategy of functions that break a JSON-like document in one place (wrong type,
    missing or extra key, NaN / inf / negative / huge number)."""
    from hypothesis import strategies as st

    return st.tuples(st.integers(min_value=0, max_value=10**9),
                     st.sampled_from(["replace", "delete", "extra", "append"]),
                     st.sampled_from(BAD_VALUES))


def mutate(doc, mutation):
    """Apply one ``mutations()`` draw to a deep copy of ``doc``."""
    import copy

    doc = copy.deepcopy(doc)
    pick, how, value = mutation
    paths = list(json_paths(doc))
    path, target = paths[pick % len(paths)]
    if how == "extra" and isinstance(target, dict):
        target["unknown_key_x"] = value
        return doc
    if how == "append" and isinstance(target, list):
        target.append(value)
        return doc
    if not path:
        return value if how == "replace" else {}
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if how == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc


# ---------------------------------------------------------------------- simulator cases (shared strategy)
_SIM_TOPOLOGIES: dict = {}


def simulation_cases():
    """A hypothesis strategy of random (graph, topology, plan): 2-14 ops with short-range edges (linears
    timed by their GEMM shapes half of the time), on one of five topologies (four presets and a PCIe box
    whose hosts issue the work: host, collective and transfer overheads and wave quantisation), each op
    single / batch-split / column- or row-split on 1, 2 or 4 devices, recomputed or not, 1 or 2
    microbatches, GPipe or 1F1B (tests/test_simulator*.py)."""
    from hypothesis import strategies as st

    from envs.graph import OpGraph
    from envs.plan import Plan
    from envs.presets import preset

    if not _SIM_TOPOLOGIES:
        _SIM_TOPOLOGIES.update({name: preset(name) for name in ("dgx-a100-80g", "dgx1-v100", "pcie-4gpu", "hetero")})
        hosted = preset("pcie-4gpu")
        for i, d in enumerate(hosted.devices):
            d.host_overhead, d.comm_overhead, d.p2p_overhead, d.sm_count = 2e-5 * (1 + i % 2), 3e-5, 1e-4, 108
            d.recompute_overhead = 5e-5 * (i % 2)
        from envs.topology import Topology

        _SIM_TOPOLOGIES["pcie-4gpu-hosted"] = Topology(hosted.devices, hosted.links, hosted.switches, name="hosted")
    topos = _SIM_TOPOLOGIES

    @st.composite
    def cases(draw):
        n = draw(st.integers(2, 14))
        edges = sorted({(i, j) for i in range(n) for j in range(i + 1, n) if draw(st.booleans()) and j - i <= 3})
        flops = draw(st.lists(st.floats(1e8, 1e12), min_size=n, max_size=n))
        params = draw(st.lists(st.sampled_from([0.0, 1e5, 1e7]), min_size=n, max_size=n))
        shapes = draw(st.booleans())
        gemm = [(v, (8.0 * 64, 2048.0, max(1.0, p / 2 / 2048), 1.0)) for v, p in enumerate(params) if p and shapes]
        g = OpGraph(names=[f"n{i}" for i in range(n)], kinds=["linear" if p else "relu" for p in params],
                    fwd_flops=flops, param_bytes=params, out_bytes=[1e6] * n,
                    edge_src=[a for a, _ in edges], edge_dst=[b for _, b in edges], edge_bytes=[1e6] * len(edges),
                    batch_size=8, n_ops=draw(st.lists(st.integers(1, 4), min_size=n, max_size=n)),
                    gemm_node=[v for v, _ in gemm], gemm_shape=[s for _, s in gemm] or None,
                    gemm_kind=[v % 2 for v, _ in gemm])
        topo = topos[draw(st.sampled_from(sorted(topos)))]
        nd = topo.num_devices
        groups, layouts = [], []
        for v in range(n):
            lay = draw(st.sampled_from(["single", "single", "batch_split", "col_split", "row_split"]))
            caps = int(g.layout_caps[v])
            if lay == "col_split" and not caps & 2 or lay == "row_split" and not caps & 4:
                lay = "single"
            if lay == "single":
                groups.append((draw(st.integers(0, nd - 1)),))
            else:
                size = draw(st.sampled_from([2, 4]))
                start = draw(st.integers(0, nd - size))
                groups.append(tuple(range(start, start + size)))
            layouts.append(lay)
        m = draw(st.sampled_from([1, 2]))
        rc = draw(st.lists(st.booleans(), min_size=n, max_size=n)) if draw(st.booleans()) else None
        plan = Plan(groups=groups, layouts=layouts, microbatches=m, recompute=rc,
                    schedule=draw(st.sampled_from(["gpipe", "1f1b"])), global_batch=8)
        return g, topo, plan

    return cases()


def gpu_only(topo):
    """``topo`` with its hosts out of the picture (no host, collective, transfer or sync time) and no
    wave quantisation: the roofline closed forms of the device side (tests/test_simulator*.py)."""
    from envs.topology import Topology

    for d in topo.devices:
        d.host_overhead = d.comm_overhead = d.p2p_overhead = d.sync_overhead = 0.0
        d.sm_count = 0
    return Topology(topo.devices, topo.links, topo.switches, name=topo.name + "-gpu-only")
