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
