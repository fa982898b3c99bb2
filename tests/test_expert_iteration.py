"""Expert iteration (agent.expert_iteration) and the drawn task distribution (agent.distribution): a tiny
two-round run end to end, its resume, the dataset it grows, and bad configs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from agent.train import TrainError, load_config, train

TINY_GPT = {"model": "gpt", "knobs": {"layers": [2, 3], "hidden": [64, 128], "seq": [32, 64], "vocab": 512,
                                      "batch": [8, 16]}, "name": "tiny-gpt"}
TINY_MLP = {"model": "mlp", "knobs": {"layers": [2, 4], "hidden": [64, 256], "batch": [16, 64]}, "name": "tiny-mlp"}
TINY_BERT = {"model": "bert", "knobs": {"layers": [2, 3], "hidden": [64, 128], "seq": [32, 64], "vocab": 512,
                                        "batch": [8, 16]}, "name": "tiny-bert"}
CONFIG = {
    "name": "ei-tiny", "seed": 0, "n_envs": 1,
    "env": {"max_nodes": 16, "max_devices": 4, "mode": "refine"},
    "tasks": {"distribution": {"tasks": 3, "holdout_tasks": 2, "devices": [2, 4], "hosts": [1, 2],
                               "families": [TINY_GPT, TINY_MLP], "holdout_families": [TINY_BERT]}},
    "policy": {"hidden": 16, "rounds": 1, "device_rounds": 1, "dynamic_rounds": 0, "value_hidden": 16},
    "ppo": {"n_steps": 64, "batch_size": 32, "n_epochs": 2},
    "callbacks": {"checkpoint_freq": 1000},
    "self_imitation": {"every": 1, "epochs": 2},
    "expert_iteration": {"rounds": 2, "search_evaluations": 30, "policy_evaluations": 20, "policy_samples": 1,
                         "distill_epochs": 2, "ppo_steps": 128, "eval_samples": 1, "train_eval_tasks": 2,
                         "target_evaluations": 10, "validation_tasks": 2},
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("ei") / "run"
    res = train(load_config(dict(CONFIG)), run_dir=d, progress=False, log=None)
    return d, res


def test_two_rounds_grow_the_dataset_and_report_per_round(run):
    from agent.dataset import Dataset

    d, res = run
    state = json.loads((d / "expert_iteration.json").read_text())["finished"]
    assert [(r, p) for r, p, *_ in state if p != "logged"] == [
        (-1, "validate"), (0, "search"), (0, "distill"), (0, "ppo"), (0, "evaluate"), (0, "validate"), (1, "search"),
        (1, "distill"), (1, "ppo"), (1, "evaluate"), (1, "validate")]
    ds = Dataset.open(d / "dataset")
    best = ds.best()
    assert {r["split"] for r in best.values()} == {"train", "holdout", "validation"}
    assert sorted(r["family"] for r in best.values() if r["split"] == "holdout") == ["tiny-bert", "tiny-bert"]
    assert all(r["family"] in ("tiny-gpt", "tiny-mlp") for r in best.values() if r["split"] != "holdout")
    ids = json.loads((d / "tasks.json").read_text())
    assert 1 <= len(ids["validation"]) <= 2 and not set(ids["validation"]) & set(ids["train"])
    assert all(best[i]["evaluations"] == 0 for i in ids["validation"])  # heuristics only: the yardstick
    assert all(r["value"] <= r["heuristic_value"] or r["oom"] < r["heuristic_oom"] for r in best.values())
    for r in ds.rows:  # rows the target searches added beat the ones before them
        earlier = [x for x in ds.rows[:ds.rows.index(r)] if x["task_id"] == r["task_id"]]
        assert all((r["oom"], r["value"]) < (x["oom"], x["value"]) for x in earlier)
    targets = [json.loads(x) for x in (d / "targets.jsonl").read_text().splitlines()]
    assert {t["task_id"] for t in targets} == {r["task_id"] for r in best.values() if r["split"] == "train"}
    assert all(t["source"] for t in targets)
    assert [x["round"] for x in res.imitation["rounds"]] == [0, 1]
    report = res.imitation["rounds"][-1]
    assert report["zero_shot_n"] == 2 and np.isfinite(report["zero_shot_geomean"]) and report["zero_shot_geomean"] > 0
    assert 0 <= report["agreement"] <= 1 and np.isfinite(report["distill_loss"])
    assert report["replay_fidelity"] == pytest.approx(1.0)  # the targets are plans the environment expresses
    assert 0 < report["targets_vs_best"] <= 1.0 + 1e-9
    assert res.model_path.exists() and (d / "checkpoints" / "round_1_ppo.zip").exists()
    assert np.isfinite(report["validation_geomean"]) and report["validation_geomean"] > 0
    # the training tasks' ratio is the held-out one's (vs each task's best heuristic, a fixed denominator), on
    # the first train_eval_tasks training tasks, by the policy that round evaluated
    from agent.expert_iteration import zero_shot
    from agent.infer import load_policy

    seen = zero_shot(load_policy(str(d / "checkpoints" / "round_1_ppo.zip")), ds, [best[i] for i in ids["train"][:2]],
                     samples=1, seed=CONFIG["seed"])
    assert report["train_geomean"] == pytest.approx(seen["geomean"], rel=1e-9)


def test_the_target_searches_anneal_on_the_configs_schedule(run, monkeypatch):
    """``expert_iteration.target_t0`` / ``target_half_life`` reach the target search (unset: the guided
    search's own schedule); the shipped policy's config pins the schedule it was trained with; a schedule
    that is not a finite number > 0 is refused when the config loads."""
    import agent.guided_search as gs
    from agent.dataset import Dataset
    from agent.expert_iteration import TargetJob, find_target
    from agent.placers.search import HALF_LIFE, T0

    d, _ = run
    seen = []
    real = gs.guided_search
    monkeypatch.setattr(gs, "guided_search", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    ids = json.loads((d / "tasks.json").read_text())
    row = Dataset.open(d / "dataset").best()[ids["train"][0]]
    for t0, half_life in ((None, None), (0.05, 150.0)):
        find_target(TargetJob(row=row, target=None, dataset=str(d / "dataset"), policy=str(d / "model.zip"),
                              samples=0, evaluations=5, uniform=False, seed=0, round=1, t0=t0, half_life=half_life))
    assert [(kw.get("t0"), kw.get("half_life")) for kw in seen] == [(None, None), (0.05, 150.0)]
    ei = load_config(Path(__file__).parents[1] / "experiments" / "configs" / "pretrained.yaml").spec.expert_iteration
    assert (ei.target_t0, ei.target_half_life) == (T0, HALF_LIFE)
    assert load_config(dict(CONFIG)).spec.expert_iteration.target_t0 is None
    for bad in (0, -0.1, float("nan"), float("inf"), "hot"):
        raw = json.loads(json.dumps(CONFIG))
        raw["expert_iteration"]["target_t0"] = bad
        with pytest.raises(TrainError, match="target_t0"):
            load_config(raw)


def test_a_given_policy_seeds_round_0(run, tmp_path, monkeypatch):
    """From a trained policy (``--init``), round 0's targets are found as later rounds' are: from the best
    of the policy's own plans too, with its moves (not uniform ones), so no target is slower than the plan
    the initial policy places by itself."""
    import agent.expert_iteration as ei_mod
    from agent.dataset import Dataset
    from agent.imitation import replay
    from agent.infer import Candidate, load_policy, place, policy_env
    from envs.plan import Plan

    d, res = run
    jobs = []
    real = ei_mod.find_target
    monkeypatch.setattr(ei_mod, "find_target", lambda job: jobs.append(job) or real(job))
    cfg = json.loads(json.dumps(CONFIG))
    cfg["expert_iteration"].update(rounds=1, ppo_steps=0)
    out = tmp_path / "seeded"
    train(load_config(cfg), run_dir=out, progress=False, log=None, init_weights=res.model_path)
    assert jobs and all(not j.uniform and j.samples == CONFIG["expert_iteration"]["policy_samples"] for j in jobs)
    assert json.loads((out / "tasks.json").read_text())["initial_given"] is True  # kept for a resume
    assert json.loads((d / "tasks.json").read_text())["initial_given"] is False  # the fresh network's run
    initial = load_policy(str(res.model_path))
    ds = Dataset.open(out / "dataset")
    targets = [json.loads(x) for x in (out / "targets.jsonl").read_text().splitlines()]
    seeds = {j.row["task_id"]: j.seed for j in jobs}
    for t in targets:
        task = ds.task(ds.best()[t["task_id"]])
        own = min(place(task.graph, task.topology, model=initial, samples=jobs[0].samples, seed=seeds[t["task_id"]],
                        baselines=False).candidates, key=Candidate.key)
        assert (t["oom"], t["value"]) <= (own.oom, own.value * (1 + 1e-9))
        # and the target is a plan the environment expresses: replayed, it takes the time it is valued at
        env, _, _ = policy_env(initial, task, "step_time", None)
        assert replay(env, task, Plan.from_dict(t["plan"])).replay_time == pytest.approx(t["value"], rel=1e-9)


def test_target_candidates_are_valued_as_the_environment_expresses_them(run):
    """A target the policy's environment cannot express (one operator of a coarse group on another
    device) is a candidate at its replayed time, with the replayed plan, not at the time it claims."""
    from agent.expert_iteration import TargetJob, target_candidates
    from agent.imitation import replay
    from agent.infer import load_policy, policy_env
    from envs.examples import transformer_graph
    from envs.plan import single_device_plan
    from envs.presets import preset
    from envs.sim import simulate
    from envs.tasks import Task

    d, res = run
    model = load_policy(str(res.model_path))
    graph = transformer_graph(layers=3, hidden=64, heads=2, seq=32, batch=8, name="coarsened")  # > 16 ops
    task = Task(graph, preset("pcie-4gpu"))
    env, _, _ = policy_env(model, task, "step_time", None)
    env.reset(options={"task": task})
    group_of = env.prepared.grouping.group_of
    v = next(i for i in range(len(group_of)) if (group_of == group_of[i]).sum() > 1)  # in a multi-op group
    split = single_device_plan(task.graph, task.topology, device=0)
    split.groups[v] = (1,)
    claimed = simulate(task.graph, task.topology, split).value
    row = {"source": "single", "objective": "step_time"}
    job = TargetJob(row=row, target={"plan": split.to_dict(), "value": claimed, "oom": False, "source": "split"},
                    dataset=str(d / "dataset"), policy=str(res.model_path), samples=0, evaluations=0, uniform=True,
                    seed=0, round=1)
    best = single_device_plan(graph, task.topology, device=0)
    cands = {src: (key, plan) for key, plan, src in target_candidates(env, task, job, best, model)}
    key, plan = cands["split"]
    shown = replay(env, task, split)
    assert shown.plan.groups[v] != (1,) and key == (shown.oom, shown.replay_time) != (False, claimed)
    assert plan.groups == shown.plan.groups


def test_model_zip_is_the_policy_that_validates_best(run):
    """model.zip is the checkpoint (the initial policy's included) with the best validation ratio."""
    import torch as th
    from sb3_contrib import MaskablePPO

    from agent.expert_iteration import INITIAL, IterationState, selected

    d, res = run
    r, ckpt, geo = selected(IterationState.load(d))
    validated = [x for x in IterationState.load(d).finished if x[1] == "validate"]
    assert len(validated) == 3
    # the run starts from a fresh network: validated as the reference line, never a candidate
    assert validated[0][0] == INITIAL and validated[0][3]["given"] is False
    assert r != INITIAL and geo == max(x[3]["geomean"] for x in validated[1:])
    assert res.imitation["selected_round"] == r
    a = MaskablePPO.load(res.model_path, device="cpu").policy.state_dict()
    b = MaskablePPO.load(ckpt, device="cpu").policy.state_dict()
    assert a.keys() == b.keys() and all(th.equal(a[k], b[k]) for k in a)


def test_selection_prefers_the_earliest_best_and_skips_missing_ratios(tmp_path):
    from agent.expert_iteration import INITIAL, IterationState, selected

    state = IterationState(tmp_path / "state.json")
    assert selected(state) is None  # no validation: the last round's policy
    for r, g in ((INITIAL, 1.0), (0, 0.98), (1, 1.02), (2, None), (3, 1.02)):
        state.mark(r, "evaluate", None, {"geomean": 5.0})  # the held-out test ratio never selects
        state.mark(r, "validate", f"ckpt{r}.zip", {"geomean": g})
    assert selected(state) == (1, "ckpt1.zip", 1.02)


def test_a_fresh_initial_network_is_never_selected(tmp_path):
    """A run from fresh weights validates the untrained network as its reference line; selection hands back
    the best *round* even when the untrained network validated better (a given initial policy stays a
    candidate, as above)."""
    from agent.expert_iteration import INITIAL, IterationState, selected

    state = IterationState(tmp_path / "state.json")
    state.mark(INITIAL, "validate", "initial.zip", {"geomean": 0.94, "given": False})
    for r, g in ((0, 0.91), (1, 0.92)):
        state.mark(r, "validate", f"ckpt{r}.zip", {"geomean": g})
    assert selected(state) == (1, "ckpt1.zip", 0.92)
    given = IterationState(tmp_path / "given.json")
    given.mark(INITIAL, "validate", "initial.zip", {"geomean": 0.94, "given": True})
    given.mark(0, "validate", "ckpt0.zip", {"geomean": 0.91})
    assert selected(given) == (INITIAL, "initial.zip", 0.94)


def test_tensorboard_has_the_round_metrics(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    d, _ = run
    acc = EventAccumulator(str(d / "tb" / "expert_iteration"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for t in ("dataset_rows", "targets_vs_best", "distill_loss", "agreement", "replay_fidelity", "zero_shot_geomean",
              "zero_shot_min", "train_geomean", "validation_geomean"):
        assert f"expert_iteration/{t}" in tags, t
    assert [e.step for e in acc.Scalars("expert_iteration/zero_shot_geomean")] == [0, 1]
    assert "expert_iteration/search_curves" in acc.Tags()["images"]  # the searches' learning curves


def test_resume_redoes_nothing_finished(run):
    d, res = run
    before = (d / "expert_iteration.json").read_text()
    again = train(load_config(dict(CONFIG)), run_dir=d, resume=True, progress=False, log=None)
    assert (d / "expert_iteration.json").read_text() == before
    assert again.num_timesteps == res.num_timesteps


def test_same_seed_same_tasks():
    from agent.config import DistributionSection
    from agent.distribution import draw_distribution

    sec = DistributionSection(**CONFIG["tasks"]["distribution"])
    a, b = draw_distribution(sec), draw_distribution(sec)
    for x, y in zip(a[0] + a[1], b[0] + b[1]):
        assert x.spec == y.spec and x.graph.fingerprint() == y.graph.fingerprint()
        assert x.topology.to_dict() == y.topology.to_dict() and x.split == y.split


@pytest.mark.parametrize("patch, match", [
    ({"expert_iteration": None}, "tasks.distribution is trained with an expert_iteration"),
    ({"tasks": {"builtin": ["gpt-tiny"]}}, "expert_iteration needs tasks.distribution"),
    ({"tasks": {"distribution": {"families": [{"model": "gpt", "knobs": {"layers": [4, 2]}}]}}}, "layers"),
    ({"tasks": {"distribution": {"families": ["tiny-nonsense"]}}}, "unknown task family"),
    ({"tasks": {"distribution": {"families": ["gpt"], "holdout_families": ["gpt"]}}}, "both trained on and held"),
    ({"tasks": {"distribution": {"devices": [8, 2]}}}, "devices"),
    ({"expert_iteration": {"rounds": 0}}, "rounds"),
])
def test_bad_configs_are_one_line_errors(patch, match):
    cfg = {**CONFIG, **patch}
    if cfg.get("expert_iteration") is None:
        cfg.pop("expert_iteration")
    with pytest.raises(TrainError, match=match) as exc:
        load_config(cfg)
    assert "\n" not in str(exc.value)


def test_cli_refuses_an_unreachable_ray_cluster_and_writes_nothing(cli, tmp_path):
    import yaml

    cfg = tmp_path / "ei.yaml"
    cfg.write_text(yaml.safe_dump(CONFIG))
    code, _out, err = cli("train", "--config", str(cfg), "--run-dir", str(tmp_path / "run"), "--ray-address",
                          "127.0.0.1:1", "--no-progress")
    assert code == 2 and "Ray" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_the_pretrained_report_names_the_shipped_round_and_its_validation(run):
    """experiments/train_pretrained's report: per round the validation ratio; the held-out rows are the
    shipped (validated-best) round's."""
    from experiments.train_pretrained import markdown

    d, res = run
    rounds = [{k: v for k, v in r.items() if k != "curves"} for r in res.imitation["rounds"]]
    held = [{"task_id": "t#1", "family": "tiny-bert", "heuristic_name": "m_etf", "heuristic": 0.01, "policy": 0.01,
             "ratio": 1.0}]
    phases = [{"round": -1, "phase": "validate", "geomean": 0.936, "given": False}]
    md = markdown({"config": "c.yaml", "num_timesteps": 1, "phases": phases, "rounds": rounds, "holdout": held,
                   "shipped_round": 1})
    assert "validation geo-mean" in md and "(round 1, shipped)" in md
    assert "initial policy: 0.936 (a fresh network: the reference line, never shipped)" in md
    assert f"{rounds[-1]['validation_geomean']:.3f} |" in md


def test_a_family_whose_members_do_not_build_writes_nothing(cli, tmp_path):
    """A user family whose knob range passes the spec's checks but builds no model (here a negative width)
    is one line, exit 2, before any run directory or dataset is written."""
    import yaml

    (tmp_path / "bad_model.py").write_text(
        "import torch\n"
        "def build(width=64, batch=8):\n"
        "    return torch.nn.Linear(width, width), (torch.randn(batch, width),)\n")
    fam = {"model": f"{tmp_path / 'bad_model.py'}:build", "knobs": {"width": [-64, -8]}, "name": "bad"}
    cfg = {**CONFIG, "tasks": {"distribution": {**CONFIG["tasks"]["distribution"], "families": [fam]}}}
    path = tmp_path / "ei.yaml"
    path.write_text(yaml.safe_dump(cfg))
    code, _out, err = cli("train", "--config", str(path), "--run-dir", str(tmp_path / "run"), "--no-progress")
    assert code == 2 and "'bad'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_init_weights_that_do_not_fit_are_refused_before_the_dataset_is_searched(tmp_path, monkeypatch):
    """Expert iteration checks ``--init`` against the config's network before building its dataset."""
    import agent.dataset
    from agent.infer import PRETRAINED
    from agent.train import InitWeightsMismatch

    def no_build(*_a, **_k):
        raise AssertionError("the dataset was built before the weights were checked")

    monkeypatch.setattr(agent.dataset, "build", no_build)
    with pytest.raises(InitWeightsMismatch, match="do not fit"):
        train(load_config(dict(CONFIG)), run_dir=tmp_path / "run", init_weights=PRETRAINED, progress=False,
              log=None)
    assert not (tmp_path / "run").exists()
