"""The policy-guided search against MCMC at equal evaluations over several seeds: a deterministic yardstick
for changes to the search.

    python -m experiments.bench_search [--evaluations 4000] [--seeds 0,1] [--cases A;B] [--policy P.zip]
                                       [--out experiments/results/agent] [--quick] [--ray]

Target (b) compares at one seed under wall-clock budgets, and the searches' seed-to-seed spread on some
cases (a chain that does or does not leave a basin) is as large as any change to the search. Here every
run has an *evaluation* budget, so a row is the same on any machine: per case (target (b)'s) and seed,
``rlplace place`` with ``max_evaluations`` guided-search evaluations and no time budget (the policy's
rollouts, the heuristics, the policy's refinement and the guided search, as ``place`` runs them) vs MCMC
from the best heuristic with as many evaluations as the whole ``place`` call made (rollouts included, as
(b) counts) and the same seed. Reported: per row both values; pooled, the rows where ``place`` matches or
beats MCMC and the geometric mean of MCMC / place; per case the spread of ``place``'s values over the
seeds (a change to the search smaller than that is noise). Writes ``search_seeds.json`` / ``.md`` / ``.png``
into ``--out`` atomically.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.bench_agent import OUT, _geo, mcmc_from, resolve, search_cases, write_report  # noqa: E402

DEFAULT_EVALUATIONS = 4000  # about what `place` makes in its default 20 s on the median (b) case
DEFAULT_SEEDS = (0, 1)


def all_cases() -> dict[str, dict]:
    """Target (b)'s cases by name: the default suite's fast cases, then the first held-out members."""
    return {c["name"]: c for c in search_cases()}


def seed_row(job: tuple[dict, str, int, int]) -> dict:
    """One (case, seed): ``place`` with an evaluation budget vs MCMC with its evaluations."""
    from agent.infer import Candidate, cached_policy, place, run_baselines
    case, policy, seed, evaluations = job
    g, topo, _ = resolve(case)
    t = time.perf_counter()
    res = place(g, topo, model=cached_policy(policy), samples=8, seed=seed, max_evaluations=evaluations)
    seconds = time.perf_counter() - t
    used = res.evaluations["policy"] + res.evaluations["guided_search"]
    base = min(run_baselines(g, topo, "step_time", seed=0), key=Candidate.key)
    mcmc_value = mcmc_from(g, topo, base.plan, used, seed)
    return {"case": case["name"], "seed": seed, "evaluations": used, "heuristic_ms": base.value * 1e3,
            "place_ms": res.best.value * 1e3, "mcmc_ms": mcmc_value * 1e3,
            "mcmc_over_place": mcmc_value / res.best.value, "place_winner": res.best.name,
            "place_seconds": round(seconds, 1)}


def summarize(rows: list[dict]) -> dict:
    """Pooled parity and geometric mean, and each case's spread over seeds."""
    per_case: dict[str, list[dict]] = {}
    for r in rows:
        per_case.setdefault(r["case"], []).append(r)
    spread = {c: max(r["place_ms"] for r in rs) / min(r["place_ms"] for r in rs) for c, rs in per_case.items()}
    return {"rows": rows, "n": len(rows), "cases": len(per_case),
            "matches_mcmc": sum(r["place_ms"] <= r["mcmc_ms"] * (1 + 1e-9) for r in rows),
            "geomean_mcmc_over_place": _geo([r["mcmc_over_place"] for r in rows]),
            "seed_spread": spread, "median_seed_spread": sorted(spread.values())[len(spread) // 2]}


def markdown(res: dict) -> str:
    lines = ["# Guided search vs MCMC at equal evaluations, over seeds", "",
             f"`python -m experiments.bench_search --evaluations {res['evaluations']} --seeds "
             f"{','.join(map(str, res['seeds']))}` ({res['seconds']} s). `place` matches or beats MCMC from the "
             f"best heuristic on **{res['matches_mcmc']} of {res['n']}** (case, seed) rows; geometric mean of "
             f"MCMC / place **{res['geomean_mcmc_over_place']:.4f}**; median spread of place's value over the seeds "
             f"{res['median_seed_spread']:.4f} (max / min).", "",
             "| case | seed | evaluations | heuristic ms | place ms | MCMC ms | MCMC / place | seed spread |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['case']} | {r['seed']} | {r['evaluations']} | {r['heuristic_ms']:.3f} | "
                     f"{r['place_ms']:.3f} | {r['mcmc_ms']:.3f} | {r['mcmc_over_place']:.4f} | "
                     f"{res['seed_spread'][r['case']]:.4f} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from envs.gantt import save_figure

    names = list(dict.fromkeys(r["case"] for r in res["rows"]))
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(names)), 3.5))
    for r in res["rows"]:
        ax.scatter(names.index(r["case"]), r["mcmc_over_place"], color=f"C{r['seed'] % 10}", s=14,
                   label=f"seed {r['seed']}")
    handles = {h.get_label(): h for h in ax.collections}
    ax.legend(handles.values(), handles.keys(), fontsize=7)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(names)), names, rotation=70, fontsize=7)
    ax.set_ylabel("MCMC / place at equal evaluations")
    ax.set_title(f"{res['matches_mcmc']} of {res['n']} rows >= 1; geo-mean {res['geomean_mcmc_over_place']:.3f}")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from agent.infer import PRETRAINED, load_policy
    from agent.scale import Executor
    from envs.errors import RlplaceError

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--evaluations", type=int, default=DEFAULT_EVALUATIONS,
                    help="the guided search's evaluations per place call")
    ap.add_argument("--seeds", default=",".join(map(str, DEFAULT_SEEDS)), help="comma-separated seeds")
    ap.add_argument("--cases", default=None, help="';'-separated case names (default: target (b)'s)")
    ap.add_argument("--policy", default=str(PRETRAINED))
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--quick", action="store_true", help="three cases (a smoke run)")
    ap.add_argument("--ray", action="store_true", help="run the rows on a local Ray instance")
    args = ap.parse_args(argv)
    cases = all_cases()
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    names = args.cases.split(";") if args.cases else list(cases)[: 3 if args.quick else None]
    unknown = [n for n in names if n not in cases]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; choose from {list(cases)}")
    if args.evaluations < 1:
        ap.error(f"--evaluations must be >= 1, got {args.evaluations}")
    try:
        load_policy(args.policy)  # a policy that does not load: one line, before any work
    except RlplaceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.time()
    jobs = [(cases[n], args.policy, s, args.evaluations) for n in names for s in seeds]
    with Executor.from_flags(args.ray) as ex:
        rows = ex.map(seed_row, jobs)
    res = {**summarize(rows), "evaluations": args.evaluations, "seeds": seeds, "seconds": round(time.time() - t0, 1)}
    write_report(Path(args.out), "search_seeds", res, markdown(res), lambda path: plot(res, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
