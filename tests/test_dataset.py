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


def test_version_mismatch_is_one_clear_error(built, tmp_path, capsys):
    copy = tmp_path / "v"
    shutil.copytree(built, copy)
    man = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**man, "version": 99}))
    with pytest.raises(DatasetError, match="version 99"):
        Dataset.open(copy)
    before = (copy / "tasks.jsonl").read_bytes()
    rc = main(["dataset", "build", str(copy), "--tasks", "4", "--seed", str(SEED), "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "version 99" in err[0]
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
