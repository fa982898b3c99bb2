"""Environment speed: steps per second of ``rlplace/Placement-v0`` under random masked actions.

    python -m experiments.bench_env [--seconds 3] [--sizes 50 200 500] [--json out.json]

Graphs are GPT-style transformers slightly larger than the requested number of node groups, coarsened
to exactly that many (``coarsen_method="light"``); topologies are a
DGX A100 (8 devices) and an 8-node A100 cluster (64 devices). ``steps/s`` counts every step including
the episode-final evaluation (simulator); ``decision steps/s`` excludes the final step of each episode
(the per-step cost the agent sees, incremental features + mask); ``sim ms`` is the mean final step.
One process, one core.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from envs.examples import transformer_graph
from envs.placement.env import PlacementEnv
from envs.presets import preset
from envs.tasks import Task


def graph_with_groups(groups: int):
    """A transformer slightly larger than ``groups`` nodes (10 per layer + 4), coarsened to ``groups``."""
    layers = max(1, -(-(groups - 4) // 10) + 1)
    return transformer_graph(layers=layers, hidden=1024, heads=16, seq=1024, batch=64, name=f"gpt-l{layers}")


def bench(groups: int, topology: str, seconds: float, seed: int = 0) -> dict:
    topo = preset(topology)
    g = graph_with_groups(groups)
    nd = topo.num_devices
    env = PlacementEnv([Task(g, topo)], max_nodes=groups, max_devices=nd, max_edges=4 * groups,
                       coarsen=True, coarsen_method="light", seed=seed)
    rng = np.random.default_rng(seed)
    obs, info = env.reset(seed=seed)
    steps = episodes = 0
    final_time = 0.0
    t0 = time.perf_counter()
    while True:
        mask = env.action_masks()
        a = int(rng.choice(np.flatnonzero(mask)))
        ts = time.perf_counter()
        obs, r, done, trunc, info = env.step(a)
        steps += 1
        if done:
            final_time += time.perf_counter() - ts
            episodes += 1
            obs, info = env.reset()
            if time.perf_counter() - t0 > seconds:
                break
    wall = time.perf_counter() - t0
    return {"groups": int(env.graph.num_nodes), "devices": nd, "topology": topology,
            "options": env.prepared.options.size,
            "steps": steps, "episodes": episodes, "steps_per_s": steps / wall,
            "decision_steps_per_s": (steps - episodes) / max(wall - final_time, 1e-9),
            "sim_ms": 1e3 * final_time / max(episodes, 1)}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--sizes", type=int, nargs="+", default=[50, 200, 500])
    ap.add_argument("--topologies", nargs="+", default=["dgx-a100-80g", "a100-80g-cluster:nodes=8"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    print(f"{'groups':>6} {'devices':>7} {'options':>7} {'steps/s':>9} {'decision/s':>10} {'sim ms':>8}")
    for size in args.sizes:
        for topo in args.topologies:
            r = bench(size, topo, args.seconds)
            rows.append(r)
            print(f"{r['groups']:>6} {r['devices']:>7} {r['options']:>7} {r['steps_per_s']:>9.0f} "
                  f"{r['decision_steps_per_s']:>10.0f} {r['sim_ms']:>8.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
