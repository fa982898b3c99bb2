import pytest

from envs.errors import TopologyError
from envs.presets import PRESETS, preset, resolve_topology
from envs.topology import Topology


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build(name):
    t = preset(name)
    assert t.num_devices >= 2
    bw = t.bandwidth_matrix
    assert (bw > 0).all()


def test_p2p_alpha_beta():
    t = preset("dgx-a100-80g")
    bw = 300e9 * 0.65
    assert t.bandwidth(0, 1) == pytest.approx(bw)
    assert t.p2p_time(0, 1, 1e9) == pytest.approx(2e-6 + 1e9 / bw)
    assert t.p2p_time(3, 3, 1e9) == 0


def test_ring_all_reduce_closed_form():
    t = preset("dgx-a100-80g")
    S, n, bw, alpha = 1e9, 8, 300e9 * 0.65, 2e-6
    assert t.collective_time("all_reduce", range(n), S) == pytest.approx(2 * (n - 1) / n * S / bw + 2 * (n - 1) * alpha)
    assert t.collective_time("all_gather", range(4), S) == pytest.approx(3 / 4 * S / bw + 3 * alpha)
    assert t.collective_time("reduce_scatter", range(4), S) == pytest.approx(3 / 4 * S / bw + 3 * alpha)


def test_hierarchical_all_reduce_crosses_hosts():
    t = preset("a100-80g-cluster:nodes=2")
    local = t.collective_time("all_reduce", range(8), 1e9)
    both = t.collective_time("all_reduce", range(16), 1e9)
    assert both > local
    # inter-host step carries S/8 per rail at ~22.5 GB/s
    inter = 2 * 1 / 2 * (1e9 / 8) / (25e9 * 0.9)
    assert both == pytest.approx(local + inter + 2 * 3 * 3e-6 * 1 / 1 + 0.0, rel=0.05)


def test_cube_mesh_is_asymmetric():
    t = preset("dgx1-v100")
    assert t.bandwidth(0, 3) == pytest.approx(2 * t.bandwidth(0, 1))  # NV2 vs NV1
    assert t.bandwidth(0, 5) < t.bandwidth(0, 1)  # no NVLink: PCIe/QPI


def test_custom_yaml(tmp_path):
    p = tmp_path / "box.yaml"
    p.write_text("""
name: box
switches: [sw]
devices:
  - {name: gpu, count: 2, kind: a100-80g, peak_flops: {bf16: 312e12}, memory_bytes: 80e9, mem_bw: 2.0e12}
links:
  - {a: gpu0, b: sw, bandwidth: 100e9}
  - {a: gpu1, b: sw, bandwidth: 100e9}
""")
    t = resolve_topology(str(p))
    assert t.num_devices == 2 and t.bandwidth(0, 1) == pytest.approx(100e9)


@pytest.mark.parametrize("links, message", [
    ([{"a": "gpu0", "b": "nope", "bandwidth": 1e9}], "unknown device or switch 'nope'"),
    ([{"a": "gpu0", "b": "gpu1", "bandwidth": 0}], r"links\[0\]\.bandwidth: Input should be greater than 0"),
    ([{"a": "gpu0", "b": "gpu1", "bandwidth": -5}], r"links\[0\]\.bandwidth: Input should be greater than 0"),
    ([], "unreachable"),
])
def test_bad_topologies(links, message):
    d = {"devices": [{"name": "gpu0", "kind": "x", "peak_flops": {"bf16": 1e12}, "memory_bytes": 1e9, "mem_bw": 1e9},
                     {"name": "gpu1", "kind": "x", "peak_flops": {"bf16": 1e12}, "memory_bytes": 1e9, "mem_bw": 1e9}],
         "links": links}
    with pytest.raises(TopologyError, match=message):
        Topology.from_dict(d)


def test_unknown_preset():
    with pytest.raises(TopologyError, match="unknown topology"):
        resolve_topology("dgx-z9000")


def test_round_trip(tmp_path):
    t = preset("dgx1-v100")
    t.save(tmp_path / "t.json")
    u = Topology.load(tmp_path / "t.json")
    assert (u.bandwidth_matrix == t.bandwidth_matrix).all()
