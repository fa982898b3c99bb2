"""The agent's targets (the generalising-policy issue), measured with a policy (default: the shipped one).

    python -m experiments.bench_agent --target a|b|c|d|all [--policy P.zip] [--out experiments/results/agent]
                                      [--quick] [--ray]

(a) **Zero-shot, leave-family-out.** Tasks of the families the shipped policy never trained on
    (``agent.distribution.HOLDOUT_FAMILIES``: vit, t5, inception, twotower, random-series-parallel; drawn
    with a seed no training run uses, on random 2-16-device clusters) and user model files of
    architectures outside the zoo (``experiments/models/``: MLP-Mixer, WaveNet, Perceiver) on presets. Per
    case: the policy's best of greedy + 8 samples (``agent.infer.place(..., baselines=False)``) vs the
    best fast heuristic; ratio = heuristic / policy (> 1: the policy is faster; a policy plan that
    overflows memory where the heuristic fits counts 0). Target: geometric mean >= 1.00, none < 0.90.
    Beside it, the ablation: the same ``place`` call with an untrained network of the policy's
    architecture (``untrained_like``), whose ratio is what the machinery alone achieves.
(b) **Policy-guided search.** On the fast cases of the default suite plus the (a) cases: ``rlplace
    place`` at its default budget (policy, heuristics, guided search) vs the best fast heuristic (target
    geo-mean >= 1.05); at equal simulator evaluations (every simulation counted: the policy's rollouts and
    the guided search) vs MCMC from the best heuristic (target: matches or beats it on >= 80%); and the
    evaluations the guided search needs to reach MCMC's 15-second result (target <= 1/10 of MCMC's).
    The curves (best value vs evaluations) go to ``search_curves.png``.
(c) **Training on a new family.** From the shipped policy, ``--minutes`` (30) of expert iteration on
    the t5 family's ranges (``experiments/configs/target_c.yaml``: training members and held-out members
    drawn from two seeds) vs the shipped policy's zero-shot plans on the held-out members. Target:
    >= 5% faster (geometric mean). Beside it, the family's *headroom*: MCMC with the dataset search's
    evaluations from the shipped policy's plan on each held-out member (``search_ceiling``) — the gain a
    student that matched its teacher would show.
(d) **Latency.** ``rlplace place`` greedy-only (no samples, no heuristics, no search) on a 500-group GPT
    graph (1004 ops). Target <= 1 s.

Every target writes ``<target>.json`` (+ ``.md`` and a plot) into ``--out`` atomically. Plan times are
the simulator's objective value on the operator graph.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "experiments" / "results" / "agent"
HELD_OUT_SEED = 7  # the training configs draw with seeds 0 and 1
USER_MODELS = [("mixer", "experiments/models/mixer.py:build", "dgx-a100-80g"),
               ("wavenet", "experiments/models/wavenet.py:build", "pcie-4gpu"),
               ("perceiver", "experiments/models/perceiver.py:build", "a100-80g-cluster:nodes=2"),
               ("mixer-small", "experiments/models/mixer.py:build:layers=8,hidden=512,batch=64", "hetero"),
               ("moe-top2", "experiments/models/moe_top2.py:build", "pcie-4gpu")]
SUITE_CASES = ["gpt-small@dgx-a100", "mlp-chain@pcie-4gpu", "branching-cnn@dgx1-v100", "moe-wide@dgx-a100",
               "gpt-small@hetero", "gpt-350m@pcie-4gpu", "traced-gpt@pcie-4gpu"]
MCMC_SECONDS = 15.0
D_REPEATS = 5  # (d): timed calls; the median is reported


# ---------------------------------------------------------------------- cases
def held_out_cases(per_family: int) -> list[dict]:
    """The (a) cases: ``per_family`` draws of every held-out family, then the user model files."""
    from agent.distribution import HOLDOUT_FAMILIES
    from agent.distribution.topologies import ClusterRanges

    cases = []
    for fam in HOLDOUT_FAMILIES:
        for i in range(per_family):
            cases.append({"name": f"{fam}#{i}", "family": fam, "draw": [i, HELD_OUT_SEED]})
    clusters = ClusterRanges(devices=(2, 16), hosts=(1, 4))
    for name, spec, topo in USER_MODELS:
        cases.append({"name": f"{name}@{topo}", "family": "user:" + name.split("-")[0], "spec": spec, "topology": topo})
    return [dict(c, clusters=[list(clusters.devices), list(clusters.hosts)]) for c in cases]


def search_cases(quick: bool = False) -> list[dict]:
    """The (b) cases: the default suite's fast cases, then the first held-out members (3 of each with
    ``quick``)."""
    cases = [{"name": c, "suite": c} for c in (SUITE_CASES[:3] if quick else SUITE_CASES)]
    return cases + held_out_cases(1)[: (3 if quick else 8)]


def resolve(case: dict):
    """(graph, topology, description) of a case."""
    from agent.distribution import ClusterRanges, draw_task
    from envs.presets import resolve_topology
    from profilers.spec import graph_from_spec

    if "draw" in case:
        i, seed = case["draw"]
        devices, hosts = case["clusters"]
        d = draw_task(i, seed, [case["family"]], [case["family"]],
                      cluster_ranges=ClusterRanges(devices=tuple(devices), hosts=tuple(hosts)))
        return d.graph, d.topology, f"{d.spec} on {d.topology.num_devices} devices"
    if "suite" in case:
        from agent.benchmark.suite import load_suite, resolve_case

        suite = load_suite("default")
        c = next(c for c in suite.cases if c.name == case["suite"])
        g, t, _ = resolve_case(c, suite.base)
        return g, t, case["suite"]
    spec = str(ROOT / case["spec"]) if case["spec"].startswith("experiments/") else case["spec"]
    return graph_from_spec(spec), resolve_topology(case["topology"]), case["spec"]


def _ratio(heuristic, policy) -> float:
    if policy.oom and not heuristic.oom:
        return 0.0
    return float(heuristic.value / policy.value)


def _geo(xs) -> float:
    """Geometric mean with a ratio of 0 (a plan out of memory) counted as 1e-3, not dropped."""
    from agent.benchmark.results import geomean

    return geomean([max(x, 1e-3) for x in xs])


# ---------------------------------------------------------------------- (a) zero-shot
def zero_shot_case(job: tuple[dict, str]) -> dict:
    from agent.infer import Candidate, cached_policy, load_policy, place

    case, policy = job
    g, topo, what = resolve(case)
    model = cached_policy(policy)
    t = time.perf_counter()
    res = place(g, topo, model=model, samples=8, seed=0)
    seconds = time.perf_counter() - t
    pol = min((c for c in res.candidates if c.kind == "policy"), key=Candidate.key)
    base = res.best_baseline()
    # the ablation: the same machinery (refine starts, samples, best visited) with an untrained network
    fresh = untrained_like(load_policy(policy), seed=0)
    raw = min(place(g, topo, model=fresh, samples=8, seed=0, baselines=False).candidates, key=Candidate.key)
    return {"case": case["name"], "family": case["family"], "what": what, "ops": g.num_nodes,
            "devices": topo.num_devices, "heuristic": base.name, "heuristic_ms": base.value * 1e3,
            "heuristic_oom": base.oom, "policy_ms": pol.value * 1e3, "policy_oom": pol.oom, "policy_plan": pol.name,
            "ratio": _ratio(base, pol), "untrained_ms": raw.value * 1e3, "untrained_ratio": _ratio(base, raw),
            "seconds": round(seconds, 1)}


def untrained_like(model, seed: int = 0):
    """``model`` with the freshly initialised weights of its own architecture (seeded): what the policy's
    training adds is its ratio over this network's in the same machinery (refine starts, samples, the best
    plan visited)."""
    import torch as th

    th.manual_seed(seed)
    fresh = model.policy_class(model.observation_space, model.action_space, model.lr_schedule, **model.policy_kwargs)
    model.policy.load_state_dict(fresh.state_dict())
    return model


def target_a(policy: str, quick: bool, ex) -> dict:
    cases = held_out_cases(2 if quick else 4)
    rows = ex.map(zero_shot_case, [(c, policy) for c in cases])
    ratios = [r["ratio"] for r in rows]
    fams = sorted({r["family"] for r in rows})
    untrained = _geo([r["untrained_ratio"] for r in rows])
    return {"rows": rows, "geomean": _geo(ratios), "min": min(ratios), "wins": sum(x > 1 + 1e-9 for x in ratios),
            "ties": sum(abs(x - 1) <= 1e-9 for x in ratios), "n": len(rows),
            "per_family": {f: _geo([r["ratio"] for r in rows if r["family"] == f]) for f in fams},
            "untrained_geomean": untrained, "training_gain": _geo(ratios) / untrained,
            "target": "geomean >= 1.00 and min >= 0.90"}


# ---------------------------------------------------------------------- (b) policy-guided search
def search_case(job: tuple[dict, str, float]) -> dict:
    from agent.guided_search import guided_search
    from agent.infer import DEFAULT_BUDGET_SECONDS, Candidate, cached_policy, place, run_baselines
    from agent.placers import Budget, run_placer

    case, policy, mcmc_seconds = job
    g, topo, what = resolve(case)
    model = cached_policy(policy)
    base = min(run_baselines(g, topo, "step_time", seed=0), key=Candidate.key)
    t = time.perf_counter()
    res = place(g, topo, model=model, samples=8, seed=0, budget_seconds=DEFAULT_BUDGET_SECONDS)
    place_s = time.perf_counter() - t
    guided_evals = res.evaluations["policy"] + res.evaluations["guided_search"]
    # MCMC from the best heuristic: its curve over evaluations under MCMC_SECONDS of wall clock
    curve_mcmc: list[tuple[int, float]] = []
    mcmc = run_placer("mcmc", g, topo, seed=0, objective="step_time", budget=Budget(seconds=mcmc_seconds),
                      start=base.plan.copy(), on_improve=lambda n, v: curve_mcmc.append((n, v)))
    mcmc_value = float(mcmc.provenance.get("predicted_value", curve_mcmc[-1][1] if curve_mcmc else base.value))
    mcmc_evals = int(mcmc.provenance.get("evaluations", curve_mcmc[-1][0] if curve_mcmc else 0))
    # the same number of evaluations as the guided pipeline used
    eq_value = mcmc_from(g, topo, base.plan, guided_evals)
    # guided search from place's best start with 1/10 of MCMC's evaluations (its rollouts counted)
    start = min([c for c in res.candidates if c.kind in ("policy", "baseline")], key=Candidate.key)
    tenth = max(1, mcmc_evals // 10 - res.evaluations["policy"])
    gs = guided_search(model, g, topo, "step_time", start.plan, seed=0, evaluations=tenth)
    curve_guided = [(res.evaluations["policy"] + n, v) for n, v in gs.curve]
    reach = next((n for n, v in curve_guided if v <= mcmc_value * (1 + 1e-9)), None)
    return {"case": case["name"], "what": what, "heuristic": base.name, "heuristic_ms": base.value * 1e3,
            "place_ms": res.best.value * 1e3, "place_seconds": round(place_s, 1), "place_winner": res.best.name,
            "place_ratio": float(base.value / res.best.value), "guided_evaluations": guided_evals,
            "mcmc_equal_ms": eq_value * 1e3, "guided_vs_mcmc_equal": float(eq_value / res.best.value),
            "mcmc_15s_ms": mcmc_value * 1e3, "mcmc_15s_evaluations": mcmc_evals,
            "guided_tenth_ms": gs.value * 1e3, "guided_reach_evaluations": reach,
            "curve_mcmc": curve_mcmc, "curve_guided": curve_guided, "start_ms": start.value * 1e3}


def target_b(policy: str, quick: bool, ex) -> dict:
    rows = ex.map(search_case, [(c, policy, MCMC_SECONDS) for c in search_cases(quick)])
    reached = [r for r in rows if r["guided_reach_evaluations"] is not None]
    tenth = [r for r in rows if r["guided_reach_evaluations"] is not None
             and r["guided_reach_evaluations"] <= max(1, r["mcmc_15s_evaluations"]) / 10]
    return {"rows": rows, "place_geomean": _geo([r["place_ratio"] for r in rows]),
            "matches_mcmc_equal": sum(r["guided_vs_mcmc_equal"] >= 1 - 1e-9 for r in rows), "n": len(rows),
            "reached_mcmc_15s": len(reached), "within_tenth": len(tenth),
            "target": "place geomean >= 1.05; >= 80% match MCMC at equal evaluations; MCMC's 15 s result in <= 1/10"}


# ---------------------------------------------------------------------- (c) a new family
def target_c(policy: str, quick: bool, minutes: float, family: str | None = None, tasks: int | None = None) -> dict:
    """30 minutes (``minutes``) of expert iteration from ``policy`` on target_c.yaml's family (or ``family``:
    its realistic ranges for training, its held-out members drawn with another seed; ``tasks`` training
    tasks instead of the config's), then both policies' zero-shot plans on the held-out members."""
    from agent.config import DistributionSection
    from agent.distribution import draw_distribution
    from agent.infer import Candidate, load_policy, place
    from agent.train import train

    cfg = target_c_config(family, tasks)
    run = ROOT / "runs" / "bench_agent" / cfg.name
    t = time.perf_counter()
    res = train(cfg, run_dir=run, resume=run.exists(), progress=False, init_weights=None if run.exists() else policy,
                deadline=time.perf_counter() + minutes * 60)
    trained_s = time.perf_counter() - t
    _, held = draw_distribution(DistributionSection(**cfg.raw["tasks"]["distribution"]))
    shipped, tuned = load_policy(policy), load_policy(res.model_path)
    evaluations = int(cfg.spec.expert_iteration.search_evaluations)
    rows = []
    for d in held[: (3 if quick else None)]:
        vals = {}
        for name, model in (("shipped", shipped), ("trained", tuned)):
            r = place(d.graph, d.topology, model=model, samples=8, seed=0, baselines=False)
            vals[name] = min(r.candidates, key=Candidate.key)
        ceiling = search_ceiling(d.graph, d.topology, vals["shipped"].plan, evaluations)
        rows.append({"task": d.spec, "devices": d.topology.num_devices, "shipped_ms": vals["shipped"].value * 1e3,
                     "trained_ms": vals["trained"].value * 1e3,
                     "speedup": float(vals["shipped"].value / vals["trained"].value),
                     "search_ms": ceiling * 1e3, "headroom": float(vals["shipped"].value / ceiling)})
    fam = ", ".join(f if isinstance(f, str) else str(f.get("name") or f["model"])
                    for f in cfg.raw["tasks"]["distribution"]["families"])
    return {"rows": rows, "geomean_speedup": _geo([r["speedup"] for r in rows]), "train_seconds": round(trained_s),
            "minutes": minutes, "family": fam, "tasks": cfg.raw["tasks"]["distribution"]["tasks"],
            "search_evaluations": evaluations, "headroom_geomean": _geo([r["headroom"] for r in rows]),
            "target": "geomean speedup >= 1.05"}


def target_c_config(family: str | None = None, tasks: int | None = None):
    """target_c.yaml as a TrainConfig, for ``family`` and ``tasks`` training tasks where given."""
    from agent.train import load_config
    from envs.files import read_document

    raw = read_document(ROOT / "experiments" / "configs" / "target_c.yaml", "training config", ValueError)
    if family is not None:
        from agent.distribution import RANDOM_FAMILIES

        kind = "generator" if family in RANDOM_FAMILIES else "model"  # a random-DAG family, or a model's
        raw["name"] = f"target_c-{family}"
        raw["tasks"]["distribution"].update(families=[{kind: family, "name": family}],
                                            holdout_families=[{kind: family, "name": f"{family}-heldout"}])
    if tasks is not None:
        raw["name"] = f"{raw['name']}-{tasks}tasks"
        raw["tasks"]["distribution"]["tasks"] = int(tasks)
    return load_config(raw)


def search_ceiling(graph, topology, start, evaluations: int) -> float:
    """The objective value MCMC reaches from ``start`` (the shipped policy's plan) with ``evaluations``
    (the dataset search's budget, seed 0): what a student that matched its teacher's search would gain on
    a held-out member. A family whose headroom is small has little for training to find."""
    return mcmc_from(graph, topology, start, evaluations)


def mcmc_from(graph, topology, start, evaluations: int, seed: int = 0) -> float:
    """The step time of MCMC's plan from ``start`` with ``evaluations`` simulator evaluations (seeded)."""
    from agent.placers import Budget, run_placer

    plan = run_placer("mcmc", graph, topology, seed=seed, objective="step_time",
                      budget=Budget(evaluations=max(int(evaluations), 1)), start=start.copy())
    return float(plan.provenance["predicted_step_time"])  # the placer's own evaluation of its plan


# ---------------------------------------------------------------------- (d) latency
def target_d(policy: str) -> dict:
    from agent.infer import load_policy, place, policy_env
    from envs.examples import transformer_graph
    from envs.presets import resolve_topology
    from envs.tasks import Task

    # 10 ops per layer (+4): 100 layers give 1004 ops, which the environment coarsens to 500 groups
    g = transformer_graph(layers=100, hidden=2048, heads=16, seq=2048, batch=8, name="gpt-l100")
    topo = resolve_topology("dgx-a100-80g")
    model = load_policy(policy)
    env, _, _ = policy_env(model, Task(g, topo), "step_time", 500)
    groups = int(env.reset()[1]["num_groups"])
    place(g, topo, model=model, samples=0, baselines=False, max_groups=500)  # warm-up (imports, caches)
    times, phases = [], []
    for _ in range(D_REPEATS):  # each call prepares the task anew (a fresh environment)
        t = time.perf_counter()
        res = place(g, topo, model=model, samples=0, baselines=False, max_groups=500)
        times.append(time.perf_counter() - t)
        phases.append(res.seconds)
    mid = sorted(range(len(times)), key=times.__getitem__)[len(times) // 2]  # the median call (the machine's noise: +-15% call to call)
    return {"ops": g.num_nodes, "groups": groups, "greedy_seconds": round(times[mid], 3),
            "calls": [round(x, 3) for x in times], "phases": phases[mid], "target": "<= 1 s"}


# ---------------------------------------------------------------------- reports
def markdown(target: str, res: dict) -> str:
    lines = [f"# Agent target ({target})", "", f"`python -m experiments.bench_agent --target {target}`; "
             f"target: {res['target']}.", ""]
    if target == "a":
        ablation = ("" if "untrained_geomean" not in res else
                    f" The same machinery with an untrained network of the policy's architecture: "
                    f"{res['untrained_geomean']:.3f} — training's own gain {res['training_gain']:.3f}.")
        lines += [f"Zero-shot geometric mean {res['geomean']:.3f}, min {res['min']:.3f}; the policy beats the best "
                  f"fast heuristic on {res['wins']}, ties {res['ties']} of {res['n']}.{ablation}", "",
                  "| case | family | model / cluster | ops | devices | best heuristic | ms | policy ms | ratio | "
                  "untrained ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in res["rows"]:
            untrained = f"{r['untrained_ratio']:.3f}" if "untrained_ratio" in r else ""
            lines.append(f"| {r['case']} | {r['family']} | {r['what'][:60]} | {r['ops']} | {r['devices']} | "
                         f"{r['heuristic']} | {r['heuristic_ms']:.3f}{' OOM' if r['heuristic_oom'] else ''} | "
                         f"{r['policy_ms']:.3f}{' OOM' if r['policy_oom'] else ''} | {r['ratio']:.3f} | {untrained} |")
        lines += ["", "Per family: " + ", ".join(f"{k} {v:.3f}" for k, v in res["per_family"].items()) + "."]
    elif target == "b":
        lines += [f"`rlplace place` at its default budget vs the best fast heuristic: geometric mean "
                  f"{res['place_geomean']:.3f}; matches or beats MCMC at equal evaluations on "
                  f"{res['matches_mcmc_equal']} of {res['n']}; reaches MCMC's {MCMC_SECONDS:g}-second result on "
                  f"{res['reached_mcmc_15s']} of {res['n']}, within 1/10 of its evaluations on {res['within_tenth']}.",
                  "", "| case | heuristic ms | place ms | place / heuristic | evaluations | MCMC same evals ms | "
                  "MCMC 15 s ms (evals) | guided with 1/10 ms | evals to reach |", "|---|---|---|---|---|---|---|---|---|"]
        for r in res["rows"]:
            lines.append(f"| {r['case']} | {r['heuristic_ms']:.3f} | {r['place_ms']:.3f} | {r['place_ratio']:.3f} | "
                         f"{r['guided_evaluations']} | {r['mcmc_equal_ms']:.3f} | {r['mcmc_15s_ms']:.3f} "
                         f"({r['mcmc_15s_evaluations']}) | {r['guided_tenth_ms']:.3f} | "
                         f"{r['guided_reach_evaluations'] if r['guided_reach_evaluations'] is not None else '-'} |")
    elif target == "c":
        lines += [f"{res['minutes']:g} minutes of training from the shipped policy on {res.get('tasks', '')} tasks "
                  f"of the {res['family']} family ({res['train_seconds']} s): geometric-mean speed-up on held-out members "
                  f"{res['geomean_speedup']:.3f}.", ""]
        if "headroom_geomean" in res:
            lines += [f"The search's headroom on those members (MCMC with {res['search_evaluations']} evaluations "
                      f"from the shipped policy's plan, what a student matching its teacher would reach): "
                      f"{res['headroom_geomean']:.3f}.", ""]
        lines += ["| task | devices | shipped ms | trained ms | speed-up | search ms | headroom |",
                  "|---|---|---|---|---|---|---|"]
        for r in res["rows"]:
            lines.append(f"| {r['task'][:70]} | {r['devices']} | {r['shipped_ms']:.3f} | {r['trained_ms']:.3f} | "
                         f"{r['speedup']:.3f} | {r.get('search_ms', float('nan')):.3f} | "
                         f"{r.get('headroom', float('nan')):.3f} |")
    else:
        calls = f"; calls {', '.join(f'{x:.3f}' for x in res['calls'])} s" if "calls" in res else ""
        lines += [f"Greedy-only placement of a {res['ops']}-op GPT in {res['groups']} groups: "
                  f"{res['greedy_seconds']:.3f} s, the median call "
                  f"({', '.join(f'{k} {v:.2f} s' for k, v in res['phases'].items())}{calls})."]
    return "\n".join(lines) + "\n"


def plot(target: str, res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from envs.gantt import save_figure

    if target == "a":
        rows = res["rows"]
        fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(rows)), 3.5))
        ax.bar(range(len(rows)), [r["ratio"] for r in rows], color="tab:blue")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(0.9, color="tab:red", lw=0.8, ls="--")
        ax.set_xticks(range(len(rows)), [r["case"] for r in rows], rotation=70, fontsize=7)
        ax.set_ylabel("best heuristic / policy")
        ax.set_title(f"zero-shot on held-out families: geo-mean {res['geomean']:.3f}, min {res['min']:.3f}")
    elif target == "b":
        rows = res["rows"]
        cols = 4
        fig, axes = plt.subplots(math.ceil(len(rows) / cols), cols, figsize=(14, 2.8 * math.ceil(len(rows) / cols)),
                                 squeeze=False)
        for ax, r in zip(axes.flat, rows):
            for key, label in (("curve_mcmc", "MCMC"), ("curve_guided", "policy-guided")):
                c = r[key]
                if c:
                    ax.step([max(n, 1) for n, _ in c], [v * 1e3 / r["start_ms"] for _, v in c], where="post",
                            label=label)
            ax.set_xscale("log")
            ax.set_title(r["case"], fontsize=8)
            ax.set_xlabel("simulator evaluations", fontsize=7)
            ax.set_ylabel("best / start", fontsize=7)
        axes.flat[0].legend(fontsize=7)
        for ax in list(axes.flat)[len(rows):]:
            ax.axis("off")
        fig.tight_layout()
    else:
        return
    save_figure(fig, path)
    plt.close(fig)


def write_report(out: Path, stem: str, res: dict, md: str, draw) -> None:
    """A benchmark's report: ``stem``.json (``res``), .md (``md``) and .png (``draw(path)``) in ``out``,
    each written atomically, and the Markdown printed."""
    from envs.files import atomic_write_json, atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / f"{stem}.json", json.loads(json.dumps(res, default=float)), indent=1)
    atomic_write_text(out / f"{stem}.md", md)
    draw(out / f"{stem}.png")
    print(md)


def _file_name(family: str) -> str:
    """A family name or model file as a file-name part."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", family).strip("-")


def main(argv: list[str] | None = None) -> int:
    from agent.infer import PRETRAINED
    from agent.scale import Executor

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", choices=["a", "b", "c", "d", "all"], default="all")
    ap.add_argument("--policy", default=str(PRETRAINED))
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--quick", action="store_true", help="fewer cases (a smoke run)")
    ap.add_argument("--minutes", type=float, default=30.0, help="(c): training wall clock")
    ap.add_argument("--family", default=None,
                    help="(c): train and hold out this family (a name, or my_model.py:build) instead of "
                         "target_c.yaml's; results go to target_c-FAMILY.*")
    ap.add_argument("--tasks", type=int, default=None,
                    help="(c): this many training tasks instead of target_c.yaml's (results: *-Ntasks.*)")
    ap.add_argument("--ray", action="store_true", help="run the (a) and (b) cases on a local Ray instance")
    args = ap.parse_args(argv)
    if args.tasks is not None and args.tasks < 1:
        ap.error(f"--tasks must be >= 1, got {args.tasks}")
    from agent.infer import load_policy
    from envs.errors import RlplaceError

    try:
        load_policy(args.policy)  # a policy that does not load: one line, before any work
        if args.target in ("c", "all"):
            target_c_config(args.family, args.tasks)  # an unknown family, too
    except RlplaceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    targets = ["a", "b", "c", "d"] if args.target == "all" else [args.target]
    for t in targets:
        t0 = time.time()
        with Executor.from_flags(args.ray) as ex:
            if t == "a":
                res: dict[str, Any] = target_a(args.policy, args.quick, ex)
            elif t == "b":
                res = target_b(args.policy, args.quick, ex)
            elif t == "c":
                res = target_c(args.policy, args.quick, args.minutes, args.family, args.tasks)
            else:
                res = target_d(args.policy)
        res["seconds"] = round(time.time() - t0, 1)
        stem = f"target_{t}" + (f"-{_file_name(args.family)}" if t == "c" and args.family else "") \
            + (f"-{args.tasks}tasks" if t == "c" and args.tasks else "")
        write_report(out, stem, res, markdown(t, res), lambda path, t=t, res=res: plot(t, res, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
