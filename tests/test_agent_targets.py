"""The agent-target benchmark script (experiments/bench_agent.py): bad input and target (c)'s headroom."""

from __future__ import annotations


def test_an_unknown_family_is_one_line_and_exit_2(tmp_path, capsys):
    from experiments.bench_agent import main

    assert main(["--target", "c", "--family", "no-such-family", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown model family 'no-such-family'" in err[0]
    assert not (tmp_path / "out").exists()


def test_the_search_ceiling_is_never_worse_than_its_start():
    from agent.infer import Candidate, run_baselines
    from envs.evaluator import CachedSimulation
    from envs.presets import resolve_topology
    from envs.tasks import load_builtin_graph
    from experiments.bench_agent import search_ceiling

    g, topo = load_builtin_graph("gpt-tiny"), resolve_topology("pcie-4gpu")
    start = max(run_baselines(g, topo, "step_time", seed=0), key=Candidate.key)  # the worst fast heuristic
    ceiling = search_ceiling(g, topo, start.plan, 200)
    assert ceiling <= CachedSimulation().evaluate(g, topo, start.plan).value
    assert ceiling == search_ceiling(g, topo, start.plan, 200)  # seeded


def test_target_c_report_shows_the_headroom():
    from experiments.bench_agent import markdown

    row = {"task": "twotower:x", "devices": 2, "shipped_ms": 12.0, "trained_ms": 10.0, "speedup": 1.2,
           "search_ms": 8.0, "headroom": 1.5}
    md = markdown("c", {"rows": [row], "geomean_speedup": 1.2, "train_seconds": 1800, "minutes": 30,
                        "family": "twotower", "tasks": 16, "search_evaluations": 3000, "headroom_geomean": 1.5,
                        "target": "geomean speedup >= 1.05"})
    assert "headroom on those members (MCMC with 3000 evaluations" in md and "| 8.000 | 1.500 |" in md


def test_the_untrained_ablation_is_the_policys_architecture_with_fresh_seeded_weights():
    """(a)'s ablation: the shipped policy's network re-initialised (seeded) keeps its shapes and settings
    and loses its weights; the same seed gives the same network."""
    import torch as th

    from agent.infer import load_policy
    from experiments.bench_agent import untrained_like

    trained = load_policy(None).policy.state_dict()
    a = untrained_like(load_policy(None), seed=0).policy.state_dict()
    b = untrained_like(load_policy(None), seed=0).policy.state_dict()
    assert a.keys() == trained.keys() and all(a[k].shape == trained[k].shape for k in a)
    assert all(th.equal(a[k], b[k]) for k in a)
    assert not all(th.equal(a[k], trained[k]) for k in a)


def test_target_a_report_shows_the_untrained_ablation():
    from experiments.bench_agent import markdown

    row = {"case": "vit#0", "family": "vit", "what": "vit:x", "ops": 10, "devices": 2, "heuristic": "m_etf",
           "heuristic_ms": 10.0, "heuristic_oom": False, "policy_ms": 9.0, "policy_oom": False, "ratio": 1.111,
           "untrained_ms": 10.0, "untrained_ratio": 1.0}
    md = markdown("a", {"rows": [row], "geomean": 1.111, "min": 1.111, "wins": 1, "ties": 0, "n": 1,
                        "per_family": {"vit": 1.111}, "untrained_geomean": 1.0, "training_gain": 1.111,
                        "target": "geomean >= 1.00 and min >= 0.90"})
    assert "untrained network of the policy's architecture: 1.000 — training's own gain 1.111" in md
    assert "| 1.111 | 1.000 |" in md


# ---------------------------------------------------------------------- experiments/bench_search.py
def test_search_seeds_rows_are_deterministic_and_mcmc_gets_places_evaluations():
    from agent.infer import PRETRAINED
    from experiments.bench_search import all_cases, seed_row

    job = (all_cases()["mlp-chain@pcie-4gpu"], str(PRETRAINED), 1, 40)
    a, b = seed_row(job), seed_row(job)
    a.pop("place_seconds"), b.pop("place_seconds")
    assert a == b and a["seed"] == 1
    assert a["place_ms"] <= a["heuristic_ms"] and a["mcmc_ms"] <= a["heuristic_ms"]
    assert 40 < a["evaluations"] and abs(a["mcmc_over_place"] - a["mcmc_ms"] / a["place_ms"]) < 1e-12


def test_search_seeds_summary_pools_rows_and_measures_the_seed_spread():
    from experiments.bench_search import markdown, summarize

    rows = [{"case": "x", "seed": 0, "place_ms": 10.0, "mcmc_ms": 12.0, "mcmc_over_place": 1.2},
            {"case": "x", "seed": 1, "place_ms": 12.5, "mcmc_ms": 10.0, "mcmc_over_place": 0.8},
            {"case": "y", "seed": 0, "place_ms": 5.0, "mcmc_ms": 5.0, "mcmc_over_place": 1.0}]
    res = summarize(rows)
    assert res["n"] == 3 and res["cases"] == 2 and res["matches_mcmc"] == 2
    assert abs(res["geomean_mcmc_over_place"] - (1.2 * 0.8) ** (1 / 3)) < 1e-12
    assert res["seed_spread"] == {"x": 1.25, "y": 1.0}
    for r in rows:
        r.update(evaluations=100, heuristic_ms=13.0)
    md = markdown({**res, "evaluations": 100, "seeds": [0, 1], "seconds": 1.0})
    assert "**2 of 3**" in md and "| x | 1 | 100 | 13.000 | 12.500 | 10.000 | 0.8000 | 1.2500 |" in md


def test_search_seeds_bad_arguments_exit_2_before_any_work(tmp_path, capsys):
    import pytest

    from experiments.bench_search import main

    for bad in (["--cases", "no-such-case"], ["--seeds", "a,b"], ["--evaluations", "0"]):
        with pytest.raises(SystemExit) as exc:
            main([*bad, "--out", str(tmp_path / "out")])
        assert exc.value.code == 2
    assert main(["--policy", str(tmp_path / "missing.zip"), "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def test_user_model_benchmark_bad_input_is_one_line_and_exit_2_before_any_work(tmp_path, capsys):
    from experiments.bench_user_models import main

    for argv in (["--models", "no-such-model"], ["--clusters", "no-such-preset"], ["--policy", str(tmp_path / "x.zip")],
                 ["--large", "--models", "mixer"], ["--large", "--clusters", "no-such-preset"]):
        assert main(argv + ["--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ")
    assert not (tmp_path / "out").exists()


def test_user_model_benchmark_skips_files_whose_optional_package_is_missing(monkeypatch):
    import importlib.util

    import experiments.bench_user_models as bench

    stems, skipped = bench.model_files(None)
    assert {"mixer", "wavenet", "perceiver", "moe_top2"} <= set(stems) and not set(stems) & set(skipped)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    stems2, skipped2 = bench.model_files(None)
    hf = {p.stem for p in bench.MODELS_DIR.glob("*.py")
          if "import transformers" in p.read_text() or "from transformers" in p.read_text()}
    assert set(skipped2) == hf and "pip install -e '.[hf]'" in "".join(skipped2.values())
    assert set(stems2) == (set(stems) | set(skipped)) - hf


def test_user_model_benchmark_report_counts_cases_below_0_90():
    from experiments.bench_user_models import markdown, summary

    rows = [{"model": m, "cluster": "pcie-4gpu", "ops": 10, "devices": 4, "heuristic": "data_parallel",
             "heuristic_ms": 10.0, "heuristic_oom": False, "policy_ms": 10.0 / r, "policy_oom": False,
             "policy_plan": "policy greedy", "ratio": r, "seconds": 1.0} for m, r in (("a", 1.1), ("b", 0.8))]
    res = summary(rows, {"c": "needs transformers"})
    assert res["below_0_90"] == 1 and res["min"] == 0.8 and abs(res["geomean"] - (1.1 * 0.8) ** 0.5) < 1e-12
    md = markdown(res)
    assert md.index("| b |") < md.index("| a |") and "Skipped: c (needs transformers)" in md
