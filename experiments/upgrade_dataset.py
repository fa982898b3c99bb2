"""Upgrade a version-1 best-known-plans dataset to version 2.

    python -m experiments.upgrade_dataset OLD_DIR NEW_DIR

Version 1 stored a graph file per structure fingerprint (node names, kinds, edges), so a task whose
graph had the structure of an earlier task at other sizes (a family at another width, sequence or batch)
read the earlier task's graph back: its later rows (expert iteration's target searches) were searched
and valued on that graph. This rebuilds every row's graph from its ``spec`` (a zoo / Hugging Face / file
model spec, or a random-DAG generator id, as :mod:`agent.distribution` drew it), checks it has the row's
fingerprint, re-simulates the row's plan on it (``value`` and ``oom``; the build's heuristic values and
lower bounds were computed on the drawn graph and stay) and writes the rows into a version-2 dataset at
``NEW_DIR`` (graph files named by structure and content), keeping their order. Rows whose plan does not
fit the rebuilt graph are dropped and counted. The new directory is written under a temporary name and
renamed when complete; ``OLD_DIR`` is not changed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rebuild_graph(spec: str):
    """The graph :mod:`agent.distribution` drew for ``spec``."""
    from agent.distribution import DagRanges
    from agent.distribution.random_dags import GENERATORS
    from profilers.spec import graph_from_spec

    name, _, rest = spec.partition(":")
    if name in GENERATORS and rest.startswith("seed="):
        return GENERATORS[name](int(rest[len("seed="):]), DagRanges(), name=spec)
    return graph_from_spec(spec)


def upgrade(old: Path, new: Path, log=print) -> dict:
    """Write the version-2 dataset of the version-1 dataset ``old`` at ``new``; returns the counts."""
    from agent.dataset import Dataset, DatasetError
    from envs.errors import PlanError, RlplaceError
    from envs.evaluator import CachedSimulation
    from envs.files import read_document
    from envs.plan import Plan
    from envs.tasks import Task
    from envs.topology import Topology

    manifest = read_document(old / "manifest.json", "dataset manifest", DatasetError)
    if not isinstance(manifest, dict) or manifest.get("format") != "rlplace.dataset" or manifest.get("version") != 1:
        raise DatasetError(f"{old}: not a version-1 rlplace dataset")
    if new.exists():
        raise DatasetError(f"{new} exists: give a new directory")
    rows = [json.loads(line) for line in (old / "tasks.jsonl").read_text().splitlines() if line.strip()]
    tmp = new.with_name(f".{new.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    ds = Dataset.open(tmp, create=True, params=manifest.get("params"),
                      description=f"{manifest.get('description', '')} (upgraded from version 1)".strip())
    sim = CachedSimulation()
    graphs: dict[str, object] = {}
    topologies: dict[str, Topology] = {}
    counts = {"rows": len(rows), "moved": 0, "revalued": 0, "dropped": 0}
    for row in rows:
        spec = row["spec"]
        if spec not in graphs:
            graphs[spec] = rebuild_graph(spec)
        g = graphs[spec]
        fp = row["task_id"].split("#", 1)[1].split("@", 1)[0]
        if g.fingerprint() != fp:
            raise DatasetError(f"{row['task_id']}: the graph rebuilt from {spec!r} has fingerprint "
                               f"{g.fingerprint()}, not {fp}")
        stored = json.loads((old / row["graph"]).read_text())
        counts["moved"] += stored != g.to_dict()
        if row["topology"] not in topologies:
            topologies[row["topology"]] = Topology.load(old / row["topology"])
        task = Task(g, topologies[row["topology"]], row["global_batch"], name=row["task_id"])
        try:
            plan = Plan.from_dict(row["plan"])
            plan.validate(g, task.topology)
            res = sim.evaluate(g, task.topology, plan, row["objective"])
        except (PlanError, RlplaceError) as exc:
            counts["dropped"] += 1
            log(f"dropped a row of {row['task_id']}: its plan does not fit the rebuilt graph ({exc})")
            continue
        value, oom = float(res.value), bool(res.oom)
        if abs(value - row["value"]) > 1e-9 * max(abs(value), 1e-30) or oom != row["oom"]:
            counts["revalued"] += 1
        out = {k: v for k, v in row.items() if k not in ("graph", "topology")}
        ds.append({**out, "value": value, "oom": oom}, task)
    tmp.rename(new)
    return counts


def main(argv: list[str] | None = None) -> int:
    from envs.errors import RlplaceError

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    args = ap.parse_args(argv)
    try:
        counts = upgrade(args.old, args.new)
    except RlplaceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.new}: {counts['rows'] - counts['dropped']} of {counts['rows']} rows; {counts['moved']} had read "
          f"another task's graph, {counts['revalued']} re-simulated to another value, {counts['dropped']} dropped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
