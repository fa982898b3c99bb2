"""Policy-guided search vs plain MCMC from the same start, at equal simulator evaluation counts.

    python -m experiments.bench_guided_search [--quick] [--evaluations N] [--seeds K] [--policy P.zip]
                                              [--out experiments/results/guided_search]

For each case (small, fast cases of ``experiments/suites/default.yaml``) the start is the best fast
heuristic (``agent.infer.run_baselines``); from it, :func:`agent.guided_search.guided_search` runs twice
under the same evaluation budget and seed: with the policy's proposals (its default ``policy_fraction``),
without them (``policy_fraction=0``, which is exactly ``agent.placers.search.mcmc``'s trajectory), and,
as an ablation that separates the move space from the policy, with the same group moves whose options
are drawn uniformly (``uniform_moves=True``).
Printed and written per case and seed: both best values at 1/4, 1/2 and all of the budget, whether the
guided search matches or beats MCMC at the full budget, and the evaluations each needs to reach MCMC's
final value. The learning curves (best value / start value vs evaluations) go to ``curve.png``; the
numbers to ``bench.json`` and ``bench.md`` (each written to a temporary name and renamed).

``--quick`` (3 cases, 400 evaluations, 2 seeds) takes about a minute on 2 cores; the default (6 cases,
2000 evaluations — about MCMC's 15 seconds on these cases — and 3 seeds) under 10 minutes. Nothing here is tuned to the cases: the search runs with its
defaults.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

CASES = ["gpt-small@dgx-a100", "mlp-chain@pcie-4gpu", "branching-cnn@dgx1-v100", "moe-wide@dgx-a100",
         "gpt-small@hetero", "gpt-350m@pcie-4gpu"]
QUICK = CASES[:3]
LABELS = {"guided": "policy-guided", "mcmc": "MCMC", "uniform": "uniform group moves"}
OUT = Path(__file__).resolve().parent / "results" / "guided_search"


def suite_cases(names: list[str]) -> list[tuple[str, Any, Any, str]]:
    """(name, graph, topology, objective) of the named cases of the default suite."""
    from agent.benchmark.suite import load_suite, resolve_case

    suite = load_suite("default")
    by_name = {c.name: c for c in suite.cases}
    out = []
    for n in names:
        case = by_name[n]
        g, topo, _ = resolve_case(case, suite.base)
        out.append((n, g, topo, case.objective))
    return out


def value_at(curve: list[tuple[int, float]], evaluations: int) -> float:
    """The best value a curve had reached after ``evaluations`` evaluations."""
    return min(v for e, v in curve if e <= evaluations)


def evaluations_to_reach(curve: list[tuple[int, float]], target: float) -> int | None:
    """The first evaluation count at which a curve is at or below ``target`` (None: never)."""
    return next((e for e, v in curve if v <= target * (1 + 1e-12)), None)


def run_case(name: str, graph, topology, objective: str, model, evaluations: int, seed: int) -> dict[str, Any]:
    """Guided and plain search from the best fast heuristic, same budget and seed."""
    from agent.guided_search import guided_search
    from agent.infer import Candidate, run_baselines

    start = min(run_baselines(graph, topology, objective, seed=seed), key=Candidate.key)
    runs = {}
    for label, kw in (("guided", {}), ("mcmc", {"policy_fraction": 0.0}), ("uniform", {"uniform_moves": True})):
        t = time.perf_counter()
        res = guided_search(model, graph, topology, objective, start.plan, seed=seed, evaluations=evaluations, **kw)
        runs[label] = {"value": res.value, "oom": res.oom, "evaluations": res.evaluations, "curve": res.curve,
                       "seconds": round(time.perf_counter() - t, 2), "policy_proposals": res.policy_proposals,
                       "mcmc_proposals": res.mcmc_proposals, "accepted": res.accepted}
    g, m = runs["guided"]["curve"], runs["mcmc"]["curve"]
    checkpoints = {f"{k}/4": max(1, evaluations * k // 4) for k in (1, 2, 4)}
    return {"case": name, "seed": seed, "start": start.name, "start_value": start.value, "budget": evaluations,
            "at": {c: {"guided": value_at(g, e), "mcmc": value_at(m, e)} for c, e in checkpoints.items()},
            "guided_matches_mcmc": runs["guided"]["value"] <= runs["mcmc"]["value"] * (1 + 1e-12),
            "guided_matches_uniform": runs["guided"]["value"] <= runs["uniform"]["value"] * (1 + 1e-12),
            "to_reach_mcmc_final": {"guided": evaluations_to_reach(g, runs["mcmc"]["value"]),
                                    "mcmc": evaluations_to_reach(m, runs["mcmc"]["value"]),
                                    "uniform": evaluations_to_reach(runs["uniform"]["curve"], runs["mcmc"]["value"])},
            "runs": runs}


def summary(rows: list[dict]) -> dict[str, Any]:
    ratios = [r["runs"]["mcmc"]["value"] / r["runs"]["guided"]["value"] for r in rows]
    return {"rows": len(rows), "guided_matches_or_beats": sum(r["guided_matches_mcmc"] for r in rows),
            "guided_matches_or_beats_uniform": sum(r["guided_matches_uniform"] for r in rows),
            "geomean_uniform_over_guided": math.exp(sum(math.log(r["runs"]["uniform"]["value"] / r["runs"]["guided"]["value"])
                                                        for r in rows) / len(rows)),
            "geomean_mcmc_over_guided": math.exp(sum(math.log(x) for x in ratios) / len(ratios)),
            "neither_improved_start": sum(r["runs"]["guided"]["value"] >= r["start_value"]
                                          and r["runs"]["mcmc"]["value"] >= r["start_value"] for r in rows),
            "guided_improved_start": sum(r["runs"]["guided"]["value"] < r["start_value"] for r in rows),
            "mcmc_improved_start": sum(r["runs"]["mcmc"]["value"] < r["start_value"] for r in rows)}


def markdown(rows: list[dict], summ: dict, meta: dict) -> str:
    ms = 1e3
    lines = ["# Policy-guided search vs MCMC (equal evaluations)\n",
             f"policy `{meta['policy']}`, {meta['evaluations']} evaluations per run, seeds {meta['seeds']}, "
             f"{meta['seconds']:.0f} s in all. Values in ms (lower is better); `reach` = evaluations to reach "
             f"MCMC's final value (`-`: never within the budget).\n",
             "| case | seed | start | start ms | guided 1/4 | MCMC 1/4 | guided 1/2 | MCMC 1/2 | guided | MCMC | "
             "uniform moves | guided reach | MCMC reach |", "|" + "---|" * 13]
    for r in rows:
        a, reach = r["at"], r["to_reach_mcmc_final"]
        lines.append(f"| {r['case']} | {r['seed']} | {r['start']} | {r['start_value'] * ms:.3f} | "
                     f"{a['1/4']['guided'] * ms:.3f} | {a['1/4']['mcmc'] * ms:.3f} | {a['2/4']['guided'] * ms:.3f} | "
                     f"{a['2/4']['mcmc'] * ms:.3f} | {a['4/4']['guided'] * ms:.3f} | {a['4/4']['mcmc'] * ms:.3f} | "
                     f"{r['runs']['uniform']['value'] * ms:.3f} | "
                     f"{reach['guided'] if reach['guided'] is not None else '-'} | {reach['mcmc']} |")
    lines.append(f"\nguided matches or beats MCMC at the full budget on {summ['guided_matches_or_beats']}/"
                 f"{summ['rows']} runs ({summ['neither_improved_start']} of them ties where neither search "
                 f"improved the start); geometric mean of MCMC / guided value {summ['geomean_mcmc_over_guided']:.4f} "
                 f"(> 1: guided better); guided improved the start on {summ['guided_improved_start']}, MCMC on "
                 f"{summ['mcmc_improved_start']}. Ablation (the same group moves, options drawn uniformly instead of "
                 f"from the policy): guided matches or beats it on {summ['guided_matches_or_beats_uniform']}/"
                 f"{summ['rows']}, geometric mean of uniform / guided value {summ['geomean_uniform_over_guided']:.4f}.\n")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Best value / start value vs evaluations, one panel per case (every seed drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from envs.files import atomic_output

    cases = list(dict.fromkeys(r["case"] for r in rows))
    cols = min(3, len(cases))
    fig, axes = plt.subplots((len(cases) + cols - 1) // cols, cols, figsize=(4.5 * cols, 3.4 * math.ceil(len(cases) / cols)),
                             squeeze=False)
    for ax, case in zip(axes.flat, cases):
        for r in (r for r in rows if r["case"] == case):
            for label, color in (("guided", "tab:blue"), ("mcmc", "tab:orange"), ("uniform", "tab:gray")):
                curve = r["runs"][label]["curve"]
                xs = [e for e, _ in curve] + [r["budget"]]
                ys = [v / r["start_value"] for _, v in curve] + [curve[-1][1] / r["start_value"]]
                ax.step(xs, ys, where="post", color=color, alpha=0.8, linestyle=("-", "--", ":")[r["seed"] % 3],
                        label=f"{LABELS[label]} (seed {r['seed']})")
        ax.set_title(case, fontsize=9)
        ax.set_xlabel("simulator evaluations")
        ax.set_ylabel("best / start value")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(cases):]:
        ax.axis("off")
    fig.tight_layout()
    with atomic_output(path, "learning curve") as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 cases, 400 evaluations, 2 seeds (about a minute)")
    ap.add_argument("--evaluations", type=int, default=None, help="evaluations per run (default 2000; quick 400)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per case (default 3; quick 2)")
    ap.add_argument("--policy", default=None, help="policy zip (default: the shipped policy)")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    import torch as th

    from agent.infer import PRETRAINED, load_policy
    from envs.files import atomic_write_json, atomic_write_text

    th.set_num_threads(1)
    evaluations = a.evaluations or (400 if a.quick else 2000)
    seeds = list(range(a.seeds or (2 if a.quick else 3)))
    t0 = time.perf_counter()
    model = load_policy(a.policy)
    rows = []
    for name, g, topo, objective in suite_cases(QUICK if a.quick else CASES):
        for seed in seeds:
            r = run_case(name, g, topo, objective, model, evaluations, seed)
            rows.append(r)
            reach = r["to_reach_mcmc_final"]
            print(f"{name} seed {seed}: start {r['start']} {r['start_value'] * 1e3:.3f} ms; guided "
                  f"{r['runs']['guided']['value'] * 1e3:.3f} ms vs MCMC {r['runs']['mcmc']['value'] * 1e3:.3f} ms at "
                  f"{evaluations} evaluations (uniform moves {r['runs']['uniform']['value'] * 1e3:.3f} ms); to reach MCMC's "
                  f"final: guided {reach['guided']}, MCMC {reach['mcmc']} "
                  f"({r['runs']['guided']['seconds']} s / {r['runs']['mcmc']['seconds']} s)", flush=True)
    summ = summary(rows)
    meta = {"policy": str(a.policy or PRETRAINED.name), "evaluations": evaluations, "seeds": seeds,
            "quick": a.quick, "seconds": time.perf_counter() - t0}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(rows, summ, meta)
    atomic_write_text(out / "bench.md", md)
    atomic_write_json(out / "bench.json", {"meta": meta, "summary": summ, "rows": rows})
    plot(rows, out / "curve.png")
    print(md.splitlines()[-1] if md.strip() else "")
    print(f"wrote {out / 'bench.md'}, {out / 'bench.json'}, {out / 'curve.png'} in {meta['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
