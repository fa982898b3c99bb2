"""Memory-tight dense models: the best Megatron-style plan in today's space vs the space before ZeRO,
sequence parallelism, selective recomputation and interleaving.

    python -m experiments.bench_parallelism [--quick] [--seconds S] [--out experiments/results/parallelism]

For each case ``megatron_3d`` sweeps (tp, pp, dp, microbatch size, schedule) under the same budget twice:
with ``choices="classic"`` (recomputation none or full, nothing else) and with every choice (ZeRO 0-3,
sequence parallelism, selective recomputation, 2-4 virtual stages). Prints and writes per case the two
best plans, their predicted step times, peak memory and the speed-up, and the geometric mean
(the parallelism issue's target: >= 1.15x over the memory-tight dense cases). Writes ``bench.md`` and
``bench.json`` atomically. The mixture-of-experts case (16 layers of 8 experts, 17B parameters, on 32
A100s) is reported beside them: there the new space adds expert parallelism.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

# name, layers, hidden, heads, seq, global batch, topology, dtype (V100s have no bf16: fp16 there)
CASES = [
    ("gpt-7b@8xV100", 32, 4096, 32, 2048, 32, "dgx1-v100", "fp16"),
    ("gpt-13b@16xA100", 40, 5120, 40, 4096, 32, "a100-80g-cluster:nodes=2", "bf16"),
    ("gpt-30b@32xA100", 60, 6656, 52, 2048, 64, "a100-80g-cluster:nodes=4", "bf16"),
    ("gpt-70b@64xA100", 80, 8192, 64, 4096, 128, "a100-80g-cluster:nodes=8", "bf16"),
]
# name, layers, hidden, experts, top-k, seq, global batch, topology (envs.tasks.moe_graph, bf16)
MOE_CASES = [("moe-17b-e8@32xA100", 16, 4096, 8, 2, 2048, 64, "a100-80g-cluster:nodes=4")]
QUICK = CASES[:2]


def case_graph(case: tuple, moe: bool):
    """The case's graph: a GPT (envs.examples.transformer_graph) or a mixture-of-experts transformer."""
    from envs.examples import transformer_graph
    from envs.tasks import moe_graph

    if moe:
        name, layers, hidden, experts, topk, seq, gb, _ = case
        return moe_graph(layers=layers, experts=experts, top_k=topk, hidden=hidden, seq=seq, batch=gb, vocab=51200,
                         name=name)
    name, layers, hidden, heads, seq, gb, _, dtype = case
    return transformer_graph(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=51200, batch=gb, dtype=dtype)


def run_case(case: tuple, seconds: float, log=print, moe: bool = False) -> dict[str, Any]:
    from agent.placers import run_placer
    from agent.placers.common import Budget
    from envs.presets import preset
    from envs.sim import simulate

    name, topo_name = case[0], case[7 if moe else 6]
    g = case_graph(case, moe)
    topo = preset(topo_name)
    row: dict[str, Any] = {"case": name, "params_b": round(g.total_params() / 2 / 1e9, 2), "gpus": topo.num_devices,
                           "moe": moe}
    for space in ("classic", "all"):
        t0 = time.time()
        plan = run_placer("megatron_3d", g, topo, budget=Budget(seconds=seconds), choices=space)
        rep = simulate(g, topo, plan, timeline=False)
        row[space] = {"step_s": rep.value, "peak_gib": float(rep.peak_memory.max() / 2**30), "oom": rep.is_oom,
                      "config": plan.provenance.get("config"), "evaluations": plan.provenance.get("evaluations"),
                      "search_s": round(time.time() - t0, 1)}
        log(f"{name} {space}: {rep.value:.3f} s, {row[space]['peak_gib']:.1f} GiB, {plan.provenance.get('config')}")
    row["speedup"] = row["classic"]["step_s"] / row["all"]["step_s"]
    return row


def report(rows: list[dict], seconds: float) -> tuple[str, dict]:
    sp = [r["speedup"] for r in rows if not r["moe"]]
    geo = math.exp(sum(math.log(x) for x in sp) / len(sp)) if sp else float("nan")

    def cfg(c):
        keys = ("tp", "pp", "dp", "microbatch_size", "zero", "sequence_parallel", "recompute", "virtual_stages",
                "expert_parallel")
        return " ".join(f"{k}={c[k]}" for k in keys if k in c)

    lines = ["# Memory-tight dense models: today's plan space vs the classic one", "",
             f"`python -m experiments.bench_parallelism` (megatron_3d, {seconds:g} s of search per space and case).",
             "", "| case | params (B) | GPUs | classic best | step (s) | new best | step (s) | speed-up "
             "| simulations (classic / new) | search s (classic / new) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, a = r["classic"], r["all"]
        lines.append(f"| {r['case']} | {r['params_b']} | {r['gpus']} | {cfg(c['config'] or {})}"
                     f"{' (OOM)' if c['oom'] else ''} | {c['step_s']:.3f} | {cfg(a['config'] or {})}"
                     f"{' (OOM)' if a['oom'] else ''} | {a['step_s']:.3f} | {r['speedup']:.3f} "
                     f"| {c['evaluations']} / {a['evaluations']} | {c['search_s']:g} / {a['search_s']:g} |")
    lines += ["", f"Geometric mean speed-up over the dense cases {geo:.3f} (target >= 1.15). A search that took "
              f"its whole {seconds:g} s stopped before the end of the sweep (plans that run out of memory are "
              "decided by their memory, not simulated, once a fitting plan is known)."]
    moe = [r for r in rows if r["moe"]]
    if moe:
        lines.append("Mixture of experts: " + ", ".join(f"{r['case']} {r['speedup']:.3f}" for r in moe) + ".")
    return "\n".join(lines) + "\n", {"rows": rows, "geomean_speedup": geo, "seconds_per_search": seconds}


def main(argv: list[str] | None = None) -> None:
    from envs.files import atomic_write_json, atomic_write_text

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the two smaller cases only")
    ap.add_argument("--seconds", type=float, default=60.0, help="search seconds per space and case")
    ap.add_argument("--out", default="experiments/results/parallelism")
    a = ap.parse_args(argv)
    rows = [run_case(c, a.seconds) for c in (QUICK if a.quick else CASES)]
    rows += [run_case(c, a.seconds, moe=True) for c in ([] if a.quick else MOE_CASES)]
    md, js = report(rows, a.seconds)
    print(md)
    from pathlib import Path

    Path(a.out).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(a.out) / "bench.md", md)
    atomic_write_json(Path(a.out) / "bench.json", js)


if __name__ == "__main__":
    main()
