"""Benchmark suite: the smoke suite writes its report; bad suites are clear errors (CLI exit 2)."""

from __future__ import annotations

import csv

import pytest

from agent.benchmark.runner import run_suite
from agent.benchmark.suite import SuiteError, load_suite


def test_smoke_suite_writes_csv_markdown_and_plots(tmp_path):
    suite = load_suite("smoke")
    rows = run_suite(suite, tmp_path, log=lambda _m: None, progress=False)
    assert {r.case for r in rows} == {c.name for c in suite.cases}
    assert all(r.status == "ok" for r in rows)
    for r in rows:
        assert r.ratio_best >= 1 - 1e-9 or r.oom
        assert r.ratio_lb >= 1 - 1e-9
    with open(tmp_path / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    md = (tmp_path / "results.md").read_text()
    assert "| case |" in md and "lower bound" in md
    assert (tmp_path / "ratios.png").stat().st_size > 1000
    assert len(list((tmp_path / "gantt").glob("*.png"))) == len(suite.cases)
    assert not list(tmp_path.glob(".*.tmp"))


def test_missing_workload_is_skipped(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("placers: [single_device]\ncases:\n"
                 "  - {graph: 'dnn-partitioning:/nonexistent/x.json', objective: throughput}\n"
                 "  - {graph: 'transformer:layers=1,hidden=64,heads=2,seq=16,vocab=100,batch=2', topology: pcie-4gpu}\n")
    msgs: list[str] = []
    rows = run_suite(load_suite(str(p)), tmp_path / "out", log=msgs.append, progress=False, gantt=False)
    assert len(rows) == 1 and any("skipping" in m for m in msgs)


@pytest.mark.parametrize("text", [
    "cases: []\n",
    "not: a suite\n",
    "cases:\n  - {graph: gpt-small}\n",  # no topology
    "cases:\n  - {graph: gpt-small, topology: pcie-4gpu, objective: speed}\n",
    "placers: [nope]\ncases:\n  - {graph: gpt-small, topology: pcie-4gpu}\n",
    "cases:\n  - {graph: gpt-small, topology: pcie-4gpu, colour: red}\n",
    "budget: {minutes: 3}\ncases:\n  - {graph: gpt-small, topology: pcie-4gpu}\n",
    "cases: [\n",
])
def test_bad_suite_is_an_error(tmp_path, text):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(SuiteError):
        load_suite(str(p))


def test_cli_bad_suite_exits_2(tmp_path, cli):
    code, _, err = cli("bench", "--suite", "no-such-suite", "--out", tmp_path)
    assert code == 2 and "unknown suite" in err and len(err.strip().splitlines()) == 1


def test_bad_suite_error_names_the_field(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("cases:\n  - {graph: gpt-small, topology: pcie-4gpu, objective: speed}\n")
    with pytest.raises(SuiteError, match=r"cases\[0\]\.objective"):
        load_suite(str(p))


def test_suite_name_without_the_suites_folder_is_a_clear_error(tmp_path, monkeypatch):
    import agent.benchmark.suite as suite_module

    monkeypatch.setattr(suite_module, "SUITES_DIR", tmp_path / "not-a-checkout" / "experiments" / "suites")
    with pytest.raises(SuiteError, match="no folder .*pip install -e"):
        load_suite("default")
