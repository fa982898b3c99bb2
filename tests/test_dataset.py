"""The best-known-plans dataset (agent.dataset), its task distribution (agent.distribution) and the
Ray / in-process executor (agent.scale)."""

from __future__ import annotations

import json
import shutil

import pytest

from agent.cli import main
from agent.dataset import TIMING_FIELDS, Dataset, DatasetError, build, jobs_from_draws
from agent.distribution import HOLDOUT_FAMILIES, DistributionError, draw_tasks
from agent.distribution.topologies import random_cluster
from agent.scale import Executor, ScaleError, check_address
from envs.evaluator import CachedSimulation

SEED, N, EVALS = 3, 3, 40
FAMS = ["gpt", "random-layered", "random-series-parallel"]


def _jobs(n: int = N, seed: int = SEED):
    return jobs_from_draws(draw_tasks(n, seed, FAMS), evaluations=EVALS)


def _rows(ds: Dataset) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in ds.rows]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds") / "a"
    ds = Dataset.open(path, create=True, params={"seed": SEED})
    assert build(ds, _jobs(), progress=False) == N
    return path


def test_rows_validate_simulate_and_are_bounded(built):
    ds = Dataset.open(built)
    assert len(ds.rows) == N and len(ds.best()) == N
    sim = CachedSimulation()
    for r in ds.rows:
        task, plan = ds.task(r), ds.plan(r)
        plan.validate(task.graph, task.topology)
        res = sim.evaluate(task.graph, task.topology, plan, r["objective"])
        assert float(res.value) == pytest.approx(r["value"], rel=1e-9)
        assert bool(res.oom) == r["oom"]
        assert (r["oom"], r["value"]) <= (r["heuristic_oom"], r["heuristic_value"])
        assert r["value"] >= r["lower_bound_any"] * (1 - 1e-9)
        if not r["oom"]:
            assert r["value"] >= r["lower_bound"] * (1 - 1e-9)
        assert r["split"] == ("holdout" if r["family"] in HOLDOUT_FAMILIES else "train")


def test_same_seed_same_rows_and_resume_after_kill(built, tmp_path):
    ref = _rows(Dataset.open(built))
    copy = tmp_path / "b"
    shutil.copytree(built, copy)
    f = copy / "tasks.jsonl"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 25])  # a kill in the middle of writing the last row
    ds = Dataset.open(copy, params={"seed": SEED})
    assert len(ds.rows) == N - 1 and f.read_bytes().endswith(b"\n")
    assert build(ds, _jobs(), progress=False) == 1
    assert _rows(Dataset.open(copy)) == ref  # the same seed gives the same rows
    assert build(Dataset.open(copy), _jobs(), progress=False) == 0  # nothing left to do


@pytest.mark.parametrize("version, says", [(99, "version 99"), (1, "experiments.upgrade_dataset")])
def test_version_mismatch_is_one_clear_error(built, tmp_path, capsys, version, says):
    """Another version is refused; version 1 (graph files shared across sizes) names the upgrade."""
    copy = tmp_path / "v"
    shutil.copytree(built, copy)
    man = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**man, "version": version}))
    with pytest.raises(DatasetError, match=says):
        Dataset.open(copy)
    before = (copy / "tasks.jsonl").read_bytes()
    rc = main(["dataset", "build", str(copy), "--tasks", "4", "--seed", str(SEED), "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and says in err[0]
    assert (copy / "tasks.jsonl").read_bytes() == before


def test_bad_input_writes_nothing(tmp_path, capsys):
    for args in (["--ray-address", "127.0.0.1:1"], ["--families", "nope"], ["--evaluations", "0"]):
        out = tmp_path / "x"
        rc = main(["dataset", "build", str(out), "--tasks", "1", "-q", *args])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("error:"), (args, err)
        assert not out.exists()
    with pytest.raises(ScaleError, match="bad Ray address"):
        check_address("nohost")
    with pytest.raises(DistributionError):
        draw_tasks(-1, 0)


def test_cli_build_resume_and_show(tmp_path, capsys):
    out = tmp_path / "c"
    args = ["dataset", "build", str(out), "--tasks", "1", "--seed", "1", "-e", "20", "-q",
            "--families", "random-layered"]
    assert main(args) == 0
    assert main(args) == 0 and "all 1 task(s) done" in capsys.readouterr().err
    assert main([*args[:6], "2", *args[7:]]) == 2 and "seed=1, not 2" in capsys.readouterr().err
    assert main(["dataset", "show", str(out)]) == 0
    assert "heur/best" in capsys.readouterr().out


def test_distribution_is_seeded_and_valid():
    rand = FAMS[1:]
    a, b = draw_tasks(4, 11, rand), draw_tasks(5, 11, rand)
    assert [d.graph.fingerprint() for d in a] == [d.graph.fingerprint() for d in b[:4]]  # extends
    for s in range(12):
        topo = random_cluster(s)
        assert 2 <= topo.num_devices <= 64 + 8  # accelerators plus optional host CPUs
        assert len({d.host for d in topo.devices}) <= 8
    kinds = {d.kind for s in range(20) for d in random_cluster(s).devices}
    assert "cpu" in kinds and len(kinds) >= 3


def test_each_draw_is_reported_as_it_is_traced():
    """``on_draw`` (the progress bar's hook) sees every member once, in order, and changes no draw."""
    from agent.distribution.progress import drawing

    seen = []
    got = draw_tasks(3, 11, FAMS[1:], on_draw=seen.append)
    assert [d.spec for d in seen] == [d.spec for d in got] == [d.spec for d in draw_tasks(3, 11, FAMS[1:])]
    with drawing(3, enabled=False) as on_draw:  # the bar's callback takes a draw
        for d in got:
            on_draw(d)


def test_a_dag_generator_can_be_held_out_under_another_name():
    """Training and held-out members of one random-DAG family: the held-out entry names the generator
    under its own name; the graphs are the generator's; a bad generator entry is one line."""
    from agent.config import DistributionSection
    from agent.distribution import draw_distribution

    section = DistributionSection(tasks=2, holdout_tasks=2, seed=5, families=["random-series-parallel"],
                                  holdout_families=[{"generator": "random-series-parallel", "name": "sp-heldout"}])
    train, held = draw_distribution(section)
    assert {d.family for d in train} == {"random-series-parallel"} and {d.family for d in held} == {"sp-heldout"}
    assert all(d.spec.startswith("random-series-parallel:seed=") for d in train + held)
    with pytest.raises(DistributionError, match="generator 'no-such-dag'"):
        draw_tasks(1, 0, [{"generator": "no-such-dag", "name": "x"}])
    with pytest.raises(DistributionError, match="with knobs"):
        draw_tasks(1, 0, [{"generator": "random-layered", "knobs": {}}])


def test_pandas_reads_it(built):
    pd = pytest.importorskip("pandas")
    df = pd.read_json(built / "tasks.jsonl", lines=True)
    assert len(df) == N and {"task_id", "value", "lower_bound", "plan"} <= set(df.columns)


def test_ray_build_equals_in_process(built, tmp_path):
    pytest.importorskip("ray")
    ds = Dataset.open(tmp_path / "r", create=True, params={"seed": SEED})
    with Executor(ray=True, num_cpus=2) as ex:
        assert ex.workers == 2
        build(ds, _jobs(), executor=ex, progress=False)
    assert _rows(ds) == _rows(Dataset.open(built))


def test_graphs_of_one_structure_at_other_sizes_are_stored_apart(tmp_path):
    """A family at another width or batch has the same fingerprint (node names, kinds, edges): each task
    must still read back its own graph, and its row's plan simulate to the row's value."""
    from agent.dataset import TaskJob
    from envs.examples import transformer_graph
    from envs.presets import resolve_topology
    from envs.tasks import Task

    topo = resolve_topology("pcie-4gpu")
    graphs = [transformer_graph(layers=2, hidden=h, heads=2, seq=64, batch=b, name=f"tf-h{h}-b{b}")
              for h, b in ((128, 4), (128, 8), (256, 4))]
    assert len({g.fingerprint() for g in graphs}) == 1
    jobs = [TaskJob(task=Task(g, topo), family="tf", spec=f"tf#{i}", evaluations=0) for i, g in enumerate(graphs)]
    ds = Dataset.open(tmp_path / "d", create=True)
    build(ds, jobs, progress=False)
    ds = Dataset.open(tmp_path / "d")
    rows = {r["spec"]: r for r in ds.rows}
    assert len({r["graph"] for r in rows.values()}) == 3
    sim = CachedSimulation()
    for i, g in enumerate(graphs):
        r = rows[f"tf#{i}"]
        task = ds.task(r)
        assert task.graph.to_dict() == g.to_dict()
        assert sim.evaluate(task.graph, task.topology, ds.plan(r)).value == pytest.approx(r["value"], rel=1e-9)


def test_upgrade_rebuilds_each_rows_graph_and_revalues_its_plan(tmp_path):
    """A version-1 dataset whose second task read the first one's graph (one structure, another size):
    the upgrade gives each row the graph its spec draws and the value its plan has there."""
    from agent.dataset import TaskJob
    from envs.tasks import Task
    from experiments.upgrade_dataset import main, rebuild_graph

    topo = random_cluster(5)
    specs = ["gpt:layers=2,hidden=64,heads=2,seq=32,vocab=512,batch=8",
             "gpt:layers=2,hidden=128,heads=2,seq=32,vocab=512,batch=16"]
    graphs = [rebuild_graph(s) for s in specs]
    assert graphs[0].fingerprint() == graphs[1].fingerprint()
    old = tmp_path / "v1"
    ds = Dataset.open(old, create=True)
    build(ds, [TaskJob(task=Task(g, topo), family="gpt", spec=s, evaluations=10) for g, s in zip(graphs, specs)],
          progress=False)
    shared = json.loads(json.dumps(ds.rows))  # as version 1 wrote them: both rows on the first graph's file
    for r in shared:
        r["graph"] = shared[0]["graph"]
    (old / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in shared))
    (old / "manifest.json").write_text(json.dumps({**ds.manifest, "version": 1}))
    new = tmp_path / "v2"
    assert main([str(old), str(new)]) == 0
    up = Dataset.open(new)
    sim = CachedSimulation()
    for r, g in zip(up.rows, graphs):
        task = up.task(r)
        assert task.graph.to_dict() == g.to_dict()
        assert sim.evaluate(g, task.topology, up.plan(r)).value == pytest.approx(r["value"], rel=1e-9)
    assert main([str(old), str(new)]) == 2  # the new directory exists: one line, nothing overwritten
