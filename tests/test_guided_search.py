"""Policy-guided search (agent/guided_search.py), its place / CLI budgets, and `rlplace train --init`."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from agent.guided_search import GuidedSearchError, guided_search
from envs.evaluator import CachedSimulation

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def task():
    """gpt-tiny on a 4-GPU PCIe box, the shipped policy, and the best fast baseline as the start."""
    from agent.infer import Candidate, load_policy, run_baselines
    from envs.presets import resolve_topology
    from envs.tasks import load_builtin_graph

    g, topo = load_builtin_graph("gpt-tiny"), resolve_topology("pcie-4gpu")
    start = min(run_baselines(g, topo, "step_time", seed=0), key=Candidate.key)
    return {"graph": g, "topology": topo, "model": load_policy(), "start": start}


def _search(task, start_plan=None, **kw):
    start = task["start"].plan if start_plan is None else start_plan
    return guided_search(task["model"], task["graph"], task["topology"], "step_time", start, **kw)


def test_deterministic_for_a_seed(task):
    a, b = _search(task, seed=3, evaluations=60), _search(task, seed=3, evaluations=60)
    assert a.plan.key() == b.plan.key() and a.curve == b.curve and a.evaluations == b.evaluations
    assert a.policy_proposals > 0 and a.mcmc_proposals > 0


def test_evaluation_budget_is_respected_and_counted(task):
    ev = CachedSimulation()
    res = _search(task, seed=0, evaluations=40, evaluator=ev)
    assert res.evaluations == 40 == ev.misses  # every new simulation on the operator graph, counted apart
    assert [e for e, _ in res.curve] == sorted(e for e, _ in res.curve) and res.curve[-1][0] == 40
    values = [v for _, v in res.curve]
    assert values == sorted(values, reverse=True)  # best so far never gets worse


def test_never_worse_than_the_start(task):
    res = _search(task, seed=1, evaluations=80)
    assert not res.oom and res.value <= task["start"].value
    res.plan.validate(task["graph"], task["topology"])


def test_time_budget_is_respected(task):
    t = time.perf_counter()
    res = _search(task, seed=0, seconds=0.5)
    assert time.perf_counter() - t < 1.5 and res.seconds < 1.5 and res.evaluations > 1


def test_without_the_policy_it_is_mcmc(task):
    from agent.guided_search import HALF_LIFE, T0
    from agent.placers.search import mcmc

    res = _search(task, seed=2, evaluations=50, policy_fraction=0.0)
    plain = mcmc(task["graph"], task["topology"], seed=2, budget=50, start=task["start"].plan.copy(),
                 t0=T0, half_life=HALF_LIFE)
    assert res.plan.key() == plain.key() and res.policy_proposals == 0


def test_it_anneals_cooler_than_mcmc(task, monkeypatch):
    """The search starts from the best plan place has, so its chain starts cooler and cools faster than
    MCMC's from a heuristic; its schedule is its own (t0, half_life), the rest of MCMC's Annealing."""
    import agent.guided_search as gs
    import agent.placers.search as search

    made = []

    class Recording(search.Annealing):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(gs, "Annealing", Recording)
    _search(task, seed=0, evaluations=5)
    (a,) = made
    assert gs.T0 < search.T0 and gs.HALF_LIFE < search.HALF_LIFE
    assert a.temperature(0) == gs.T0 and a.temperature(gs.HALF_LIFE) == pytest.approx(gs.T0 / 2)
    assert a.stall == search.STALL
    _search(task, seed=0, evaluations=5, t0=0.2, half_life=10.0)
    assert made[1].temperature(10) == pytest.approx(0.1)
    from agent.placers.common import PlacerError

    ev = CachedSimulation()
    with pytest.raises(PlacerError, match="annealing needs"):
        _search(task, seed=0, evaluations=5, t0=0.0, evaluator=ev)
    assert ev.misses == 0  # refused before any simulation


def test_policy_moves_are_proposed_once_per_plan_and_scored_once(task, monkeypatch):
    """Annealing returns to plans it left: from a plan, each (group, action) move is proposed once and
    each group's distribution computed once however often the chain comes back. (A round carried over
    from the plan before may draw a move already proposed here; it re-creates a plan already scored and
    is skipped, never proposed.)"""
    from collections import Counter

    import agent.guided_search as gs

    moves, scored = Counter(), Counter()
    propose, distributions = gs.PolicyProposer.propose, gs.PolicyProposer.distributions

    def counting_propose(self, plan, rng, seen):
        at = (gs.digest(plan), self.assign.tobytes())
        cand, move = propose(self, plan, rng, seen)
        if move is not None:
            moves[(*at, *move)] += 1
        return cand, move

    def counting_distributions(self, groups):
        for v in groups:
            scored[(id(self.untried), v)] += 1  # the moves tried from the current plan
        return distributions(self, groups)

    monkeypatch.setattr(gs.PolicyProposer, "propose", counting_propose)
    monkeypatch.setattr(gs.PolicyProposer, "distributions", counting_distributions)
    res = _search(task, seed=4, evaluations=150, policy_fraction=1.0)
    assert res.evaluations == 150 and res.policy_proposals > 0
    assert moves and max(moves.values()) == 1
    assert scored and max(scored.values()) == 1


def test_when_the_policy_has_nothing_new_the_move_is_mcmcs(task, monkeypatch):
    """A search whose proposer finds no new plan makes ordinary MCMC moves instead and spends its budget;
    a policy-only search (``policy_fraction=1``, expert iteration's) never makes an MCMC move."""
    import agent.guided_search as gs

    monkeypatch.setattr(gs.PolicyProposer, "propose", lambda self, plan, rng, seen: (None, None))
    res = _search(task, seed=5, evaluations=40, policy_fraction=0.7)
    assert res.evaluations == 40 and res.policy_proposals == 0 and res.mcmc_proposals > 0
    res = _search(task, seed=5, evaluations=40, policy_fraction=1.0)
    assert res.policy_proposals == 0 and res.mcmc_proposals == 0 and res.plan.key() == task["start"].plan.key()


@pytest.mark.parametrize("kw, match", [({}, "time budget"), ({"seconds": -1.0}, "seconds"),
                                       ({"evaluations": 0}, "evaluations"),
                                       ({"evaluations": 5, "policy_fraction": 1.5}, "policy_fraction")])
def test_bad_budgets_are_named_errors(task, kw, match):
    with pytest.raises(GuidedSearchError, match=match):
        _search(task, seed=0, **kw)


def test_place_runs_the_guided_search_within_its_budgets(task):
    from agent.infer import PlaceError, place

    g, topo, model = task["graph"], task["topology"], task["model"]
    res = place(g, topo, model=model, samples=1, max_evaluations=30, seed=0)
    assert res.search is not None and res.search.evaluations <= 30
    assert res.best.value <= res.best_baseline().value
    t = time.perf_counter()
    res = place(g, topo, model=model, samples=1, budget_seconds=2.0, seed=0)
    assert time.perf_counter() - t < 3.0 and res.search is not None
    assert place(g, topo, model=model, samples=0, budget_seconds=0.0).search is None
    with pytest.raises(PlaceError, match="--max-evaluations"):
        place(g, topo, model=model, samples=0, max_evaluations=-1)


def test_place_searches_on_the_policys_training_groups_unless_told(task, monkeypatch):
    """The rollouts place the graph on DEFAULT_POLICY_GROUPS groups; the guided search's moves act on the
    groups the policy was trained at (its padding), or on ``max_groups`` when the caller gives it."""
    import agent.guided_search as gs
    from agent.infer import model_shape, place

    seen: list = []
    real = gs.guided_search

    def spy(*a, **kw):
        seen.append(kw["max_groups"])
        return real(*a, **kw)

    monkeypatch.setattr(gs, "guided_search", spy)
    g, topo, model = task["graph"], task["topology"], task["model"]
    place(g, topo, model=model, samples=0, max_evaluations=5, seed=0)
    place(g, topo, model=model, samples=0, max_evaluations=5, seed=0, max_groups=12)
    assert seen == [model_shape(model)["max_nodes"], 12]


def test_place_cli_budgets(cli, tmp_path):
    out = tmp_path / "plan.json"
    code, stdout, _ = cli("place", "-m", "gpt-tiny", "-t", "pcie-4gpu", "--samples", "0", "--budget-seconds", "5",
                          "--max-evaluations", "25", "-o", out)
    assert code == 0 and out.exists()
    line = next(ln for ln in stdout.splitlines() if ln.startswith("guided search:"))
    assert int(line.split()[2]) <= 25
    for bad in (["--budget-seconds", "-1"], ["--budget-seconds", "inf"], ["--max-evaluations", "-2"]):
        code, _, err = cli("place", "-m", "gpt-tiny", "-t", "pcie-4gpu", *bad, "-o", out)
        assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: --")


def test_an_evaluation_budget_alone_gives_the_same_plan_whatever_the_clock(cli, tmp_path, monkeypatch):
    """`--max-evaluations` without `--budget-seconds` puts no wall clock on the search (the default 20 s
    would end it wherever the machine's speed does): the same seed, the same plan, however slow the run."""
    import json

    import agent.infer

    seen, real = [], agent.infer.place

    def spy(*args, **kw):
        seen.append(kw["budget_seconds"])
        return real(*args, **kw)

    monkeypatch.setattr(agent.infer, "place", spy)
    plans = []
    for i in range(2):
        out = tmp_path / f"plan{i}.json"
        code, stdout, _ = cli("place", "-m", "gpt-tiny", "-t", "pcie-4gpu", "--samples", "2", "--max-evaluations",
                              "120", "-o", out)
        assert code == 0 and "guided search: 120 simulator evaluations" in stdout
        plans.append({k: v for k, v in json.loads(out.read_text()).items() if k != "provenance"})
    assert seen == [None, None] and plans[0] == plans[1]
    code, _, _ = cli("place", "-m", "gpt-tiny", "-t", "pcie-4gpu", "--samples", "0", "-o", tmp_path / "p.json")
    assert code == 0 and seen[-1] == agent.infer.DEFAULT_BUDGET_SECONDS  # no evaluation budget: the default clock


def test_train_init_with_a_mismatched_policy_is_a_named_error(cli, tmp_path):
    from agent.infer import PRETRAINED
    from agent.train import InitWeightsMismatch, train

    cfg = ROOT / "experiments" / "configs" / "tiny.yaml"  # hidden 32 vs the shipped policy's 64
    with pytest.raises(InitWeightsMismatch, match="shape"):
        train(cfg, run_dir=tmp_path / "api", init_weights=PRETRAINED, progress=False, log=None)
    assert not (tmp_path / "api").exists()
    code, _, err = cli("train", "-c", cfg, "--run-dir", tmp_path / "cli", "--init", PRETRAINED, "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "do not fit the config's policy" in err


@pytest.mark.parametrize("search", ["mcmc", "guided"])
def test_a_start_plans_global_batch_carries_over_to_every_proposal(task, search):
    """A task may train at another global batch than the graph was traced with: the search explores that
    batch's plans (microbatch counts dividing it), never silently the graph's."""
    from agent.placers.common import Scorer
    from agent.placers.search import mcmc

    g, topo = task["graph"], task["topology"]
    batch = 4 * g.batch_size
    start = task["start"].plan.copy(global_batch=batch, microbatches=batch // 4)  # 8 microbatches: not a divisor of 8
    seen = []
    score = Scorer.__call__

    def spy(self, plan):
        seen.append((plan.global_batch, plan.microbatches))
        return score(self, plan)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Scorer, "__call__", spy)
        if search == "mcmc":
            best = mcmc(g, topo, seed=0, budget=80, start=start)
        else:
            best = _search(task, seed=0, evaluations=80, start_plan=start).plan
    assert len(seen) > 40 and {b for b, _ in seen} == {batch}
    assert all(batch % m == 0 for _, m in seen) and len({m for _, m in seen}) > 1
    assert best.global_batch == batch


def test_an_accepted_policy_move_keeps_the_rounds_other_distributions(task):
    """A round's forward pass serves several accepted moves: after one, the round goes on with the other
    groups' distributions (copies: the plan left keeps its own memory), the moved group's class dropped."""
    import numpy as np

    from agent.guided_search import PolicyProposer, digest

    prop = PolicyProposer(task["model"], task["graph"], task["topology"], "step_time", None, groups_per_round=8)
    plan = task["start"].plan
    prop.sync(plan)
    rng = np.random.default_rng(0)
    cand, move = prop.propose(plan, rng, set())
    assert cand is not None
    before = {u: p.copy() for u, _, p in prop.round}
    left = prop.untried
    prop.accepted(move, digest(cand))
    c = int(prop.prep.class_of[move[0]])
    moved = set(prop.prep.class_members[c]) if c >= 0 else {move[0]}
    assert [u for u, _, _ in prop.round] == [u for u in before if u not in moved]
    for u, _, p in prop.round:
        assert np.array_equal(p, before[u]) and p is not left[u][1]
        p[:] = 0.0  # trying them at the new plan leaves the old plan's memory as it was
    assert all(left[u][1].sum() > 0 for u in before if u not in moved and before[u].sum() > 0)
    assert prop.untried is not left and not prop.untried  # the new plan's own memory starts empty


def test_rollouts_before_a_guided_search_simulate_their_final_plans_only(task):
    """With a guided search to follow, a refine episode simulates its final plan alone, not every step; the
    bench's ``policy`` column stays the zero-shot one (every step simulated)."""
    from agent.benchmark.runner import agent_rows
    from agent.benchmark.suite import AgentSettings
    from agent.infer import place, policy_env
    from envs.evaluator import CachedSimulation
    from envs.tasks import Task

    g, topo, model = task["graph"], task["topology"], task["model"]
    zero = place(g, topo, model=model, samples=2, seed=0, baselines=False)
    searched = place(g, topo, model=model, samples=2, seed=0, max_evaluations=5)

    # the search's place also ran the refinement episodes from the best plan, and still simulated less
    # in its episodes (the refine start's simulations at reset are the same in both)
    counter = CachedSimulation()
    policy_env(model, Task(g, topo), "step_time", None, evaluator=counter)[0].reset()
    setup = counter.misses
    assert 0 < searched.evaluations["policy"] - setup < (zero.evaluations["policy"] - setup) / 2
    rows = dict((label, plan) for label, plan, _ in agent_rows(AgentSettings(samples=2, evaluations=5), g, topo,
                                                                "step_time", 0))
    best_zero = min((c for c in zero.candidates if c.kind == "policy"), key=lambda c: c.key())
    assert rows["policy"].provenance["predicted_step_time"] == best_zero.value
    assert rows["policy+search"].provenance["predicted_step_time"] <= searched.best.value * (1 + 1e-12)


def test_a_search_that_finds_nothing_new_stops_early(task):
    """A 2-operator chain: the guided search given a minute stops once its proposals find no plan it has
    not scored, keeps the best, and says so (``place`` prints it)."""
    from agent.infer import Candidate, run_baselines
    from envs.graph import chain_graph

    g = chain_graph(2, flops=1e10, param_bytes=1e6, act_bytes=1e5)
    start = min(run_baselines(g, task["topology"], "step_time", seed=0), key=Candidate.key)
    res = guided_search(task["model"], g, task["topology"], "step_time", start.plan, seed=0, seconds=60.0,
                        evaluations=10**6)
    assert res.saturated and res.plan.provenance["saturated"] is True
    assert res.evaluations < 10**4 and res.value <= start.value
