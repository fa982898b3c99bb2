"""Simulator fidelity on this host: predicted vs measured step times, before and after calibration.

``python -m experiments.fidelity [--plans 30] [--out experiments/results/fidelity] [--install]``

For small zoo models (mlp and gpt, a few sizes) on the ``cpu-local`` topology (2 devices) it builds a
diverse set of plans the executor can run (single device with 1-4 microbatches, data parallel over 2,
2-stage pipelines with GPipe / 1F1B and several microbatch counts, tensor parallel over 2, each with
and without full recomputation), measures every plan with :class:`profilers.measured_evaluator.
MeasuredEvaluator` (a persistent gloo pool per model; median of the timed steps), simulates it on the
*uncalibrated* ``cpu-local`` defaults, then fits the device's and link's rates
(``profilers.step_calibration.ABSOLUTE_FIT``: FLOP/s, memory bandwidth, time per kernel, link latency
and bandwidth; robust loss, several starts) on a training subset (random 60%) and reports Spearman
rank correlation and MAPE on the training and the held-out plans, before and after. Plans are in fp32, as executed,
with 8 bytes of model state per parameter (SGD: weights + gradients).

Outputs (``--out``, each written atomically): ``results.json`` (every plan, measured and predicted
times, metrics, fitted parameters), ``results.md`` (the table), ``cpu-local-calibrated.json`` (the
fitted topology, ``Topology.save``), ``fidelity.png`` (log-log predicted vs measured, before/after).
``--install`` also writes the fitted topology as this host's ``cpu-local`` calibration
(``envs.presets.calibrated_cpu_local_path()``).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from envs.files import atomic_write_json, atomic_write_text
from envs.gantt import save_figure
from envs.plan import Plan, megatron_plan, single_device_plan
from envs.topology import Topology
from profilers.step_calibration import ABSOLUTE_FIT, PARAMETERS, Sample, fit, metrics, predict

MODELS = ["mlp:layers=3,hidden=128,in_dim=64,out=16,batch=16",
          "mlp:layers=4,hidden=512,in_dim=256,out=64,batch=32",
          "gpt:layers=2,hidden=32,heads=2,seq=8,vocab=64,batch=4",
          "gpt:layers=2,hidden=64,heads=4,seq=16,vocab=128,batch=8"]
STATE_BYTES = 8.0  # fp32 SGD: weights + gradients


@contextmanager
def _uncalibrated():
    """``cpu_local()`` ignores any calibration file while inside (RLPLACE_HOME -> an empty folder)."""
    old = os.environ.get("RLPLACE_HOME")
    with tempfile.TemporaryDirectory(prefix="rlplace-nocal-") as tmp:
        os.environ["RLPLACE_HOME"] = tmp
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("RLPLACE_HOME", None)
            else:
                os.environ["RLPLACE_HOME"] = old


def default_topology(devices: int = 2) -> Topology:
    from envs.presets import cpu_local

    with _uncalibrated():
        return cpu_local(devices)


def candidate_plans(graph: Any, topo: Topology) -> list[tuple[str, Plan]]:
    """Diverse plans for one graph (some may be refused by the executor; callers filter)."""
    b = graph.batch_size
    out: list[tuple[str, Plan]] = []
    kw = dict(dtype="fp32")

    def add(label: str, plan: Plan) -> None:
        plan.state_bytes_per_param = STATE_BYTES
        out.append((label, plan))

    for m in (1, 2, 4):
        if b % m == 0:
            p = single_device_plan(graph, topo, global_batch=b, **kw)
            p.microbatches = m
            add(f"single mb={m}", p)
    add("single recompute", single_device_plan(graph, topo, global_batch=b, **kw).copy(
        recompute=np.ones(graph.num_nodes, dtype=bool)))
    for mbs in (b // 2, b // 4):
        if mbs >= 1:
            add(f"dp2 mbs={mbs}", megatron_plan(graph, topo, dp=2, microbatch_size=mbs, **kw))
    for sched in ("1f1b", "gpipe"):
        for mbs in (b // 2, b // 4, max(1, b // 8)):
            for rc in ("none", "full"):
                if sched == "1f1b" and b // mbs < 2:
                    continue
                add(f"pp2 {sched} mbs={mbs} rc={rc}",
                    megatron_plan(graph, topo, pp=2, microbatch_size=mbs, schedule=sched, recompute=rc, **kw))
    for rc in ("none", "full"):
        add(f"tp2 rc={rc}", megatron_plan(graph, topo, tp=2, recompute=rc, **kw))
    add("tp2 mb=2", megatron_plan(graph, topo, tp=2, microbatch_size=max(1, b // 2), **kw))
    uniq: dict[bytes, tuple[str, Plan]] = {}
    for label, p in out:
        uniq.setdefault(p.key(), (label, p))
    return list(uniq.values())


def plot(path: Path, measured: np.ndarray, before: np.ndarray, after: np.ndarray, train: np.ndarray) -> None:
    """Log-log predicted vs measured, before and after calibration (PNG, written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5), sharex=True, sharey=True)
    lo = min(measured.min(), before.min(), after.min()) * 0.7
    hi = max(measured.max(), before.max(), after.max()) * 1.4
    for ax, pred, title in ((axes[0], before, "before (cpu-local defaults)"), (axes[1], after, "after (fitted)")):
        ax.loglog([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.scatter(measured[train] * 1e3, pred[train] * 1e3, s=18, label="train")
        ax.scatter(measured[~train] * 1e3, pred[~train] * 1e3, s=18, marker="^", label="held-out")
        ax.set_xlim(lo * 1e3, hi * 1e3)
        ax.set_ylim(lo * 1e3, hi * 1e3)
        ax.set_xlabel("measured step time (ms)")
        ax.set_title(title)
        ax.legend()
    axes[0].set_ylabel("simulated step time (ms)")
    fig.tight_layout()
    save_figure(fig, path)


def run(plans: int = 30, out: str | os.PathLike = "experiments/results/fidelity", *, steps: int = 5,
        warmup: int = 2, rounds: int = 3, seed: int = 0, train_fraction: float = 0.6, install: bool = False,
        models: list[str] | None = None, params: tuple[str, ...] = ABSOLUTE_FIT, log=print) -> dict[str, Any]:
    """Measure, simulate, fit and report (see the module docstring); returns the results dict."""
    t_start = time.time()
    topo0 = default_topology(2)
    rng = random.Random(seed)
    cands, refused = runnable_plans(models or MODELS, topo0, plans, rng, log)
    times = measure_rounds(cands, topo0, rounds, steps, warmup, rng, refused, t_start, log)
    samples, spread = measured_samples(cands, times, log)
    t_meas = time.time() - t_start
    train = train_split(len(samples), train_fraction, rng)
    meas = np.array([s.measured for s in samples])
    before = predict(samples, topo0)
    res = fit([s for s, t in zip(samples, train) if t], topo0, params, starts=3, loss="soft_l1",
              max_nfev=400)
    after = predict(samples, res.topology)
    report: dict[str, Any] = {"command": f"python -m experiments.fidelity --plans {plans} --rounds {rounds} --steps "
                                         f"{steps} --warmup {warmup} --seed {seed}", "host_cpus": os.cpu_count(), "steps": steps, "warmup": warmup, "seed": seed,
                              "n_plans": len(samples), "n_train": int(train.sum()), "n_heldout": int((~train).sum()),
                              "measure_seconds": t_meas, "rounds": rounds,
                              "round_spread_median": float(np.median(spread)) if spread else None,
                              "round_mape_to_median": _noise(samples), "fit_evaluations": res.evaluations,
                              "params_before": {p: PARAMETERS[p].read(topo0) for p in params}, "params_after": res.values,
                              "metrics": {}, "plans": [], "refused": refused}
    for name, pred in (("before", before), ("after", after)):
        report["metrics"][name] = {"train": metrics(pred[train], meas[train]),
                                   "heldout": metrics(pred[~train], meas[~train]) if (~train).any() else None,
                                   "all": metrics(pred, meas)}
    for i, s in enumerate(samples):
        report["plans"].append({"model": s.model, "plan": s.config["plan"], "train": bool(train[i]),
                                "measured_s": float(meas[i]), "before_s": float(before[i]), "after_s": float(after[i]),
                                "round_times": s.config["round_times"]})
    write_outputs(Path(out), report, res, install, meas, before, after, train, t_start)
    log(markdown(report))
    return report


def runnable_plans(models: list[str], topo: Topology, limit: int, rng: random.Random,
                   log) -> tuple[list[tuple[str, str, Any, Plan]], list[dict[str, str]]]:
    """``(model, label, graph, plan)`` of the candidate plans the executor accepts (at most ``limit``,
    dropped at random and evenly, so every model stays represented), and the refused ones with reasons."""
    from profilers.execute import prepare
    from profilers.spec import graph_from_spec

    cands: list[tuple[str, str, Any, Plan]] = []
    refused: list[dict[str, str]] = []
    for spec in models:
        g = graph_from_spec(spec, dtype="fp32")
        for label, p in candidate_plans(g, topo):
            try:
                prepare(p, spec, g)
            except Exception as exc:  # noqa: BLE001 - the executor's reason is reported
                refused.append({"model": spec, "plan": label, "reason": str(exc)[:200]})
                continue
            cands.append((spec, label, g, p))
    log(f"{len(cands)} runnable plans ({len(refused)} refused by the executor)")
    if len(cands) > limit:
        rng.shuffle(cands)
        cands = sorted(cands[:limit], key=lambda c: (c[0], c[1]))
    return cands, refused


def measure_rounds(cands: list, topo: Topology, rounds: int, steps: int, warmup: int, rng: random.Random,
                   refused: list[dict[str, str]], t_start: float, log) -> dict[int, list[float]]:
    """Measured step times of every plan, one per round: one persistent pool per model, all alive, so
    rounds interleave models; each round visits the plans in a new random order (host load drifts) and
    re-measures (an independent measurement). Plans the pool refuses are added to ``refused``."""
    from profilers.measured_evaluator import MeasuredEvaluator

    times: dict[int, list[float]] = {i: [] for i in range(len(cands))}
    with ExitStack() as stack:
        evs = {spec: stack.enter_context(MeasuredEvaluator(spec, steps=steps, warmup=warmup, workers=2, timeout=120))
               for spec in dict.fromkeys(c[0] for c in cands)}
        for rnd in range(rounds):
            order = list(range(len(cands)))
            rng.shuffle(order)
            for i in order:
                spec, label, g, p = cands[i]
                ev = evs[spec]
                ev.clear()
                r = ev.evaluate(g, topo, p)
                if r.extra.get("refused"):
                    if rnd == 0:
                        refused.append({"model": spec, "plan": label, "reason": r.extra["reason"][:200]})
                    continue
                times[i].append(r.value)
            log(f"round {rnd + 1}/{rounds} done ({time.time() - t_start:.0f} s)")
    return times


def measured_samples(cands: list, times: dict[int, list[float]], log) -> tuple[list[Sample], list[float]]:
    """One fitting sample per measured plan (the median over rounds) and each plan's max/min spread."""
    samples: list[Sample] = []
    spread = []
    for i, (spec, label, g, p) in enumerate(cands):
        if not times[i]:
            continue
        t = float(np.median(times[i]))
        spread.append(max(times[i]) / min(times[i]))
        samples.append(Sample(g, p, t, model=spec, config={"plan": label, "round_times": times[i]}))
        log(f"  {spec[:40]:40s} {label:28s} measured {t * 1e3:8.2f} ms  (rounds: "
            + ", ".join(f"{x * 1e3:.1f}" for x in times[i]) + ")")
    return samples, spread


def train_split(n: int, train_fraction: float, rng: random.Random) -> np.ndarray:
    """A random ``train_fraction`` of ``n`` samples (at least one) for fitting; the rest is held out."""
    order = list(range(n))
    rng.shuffle(order)
    train = np.zeros(n, dtype=bool)
    train[order[:max(1, int(round(train_fraction * n)))]] = True
    return train


def write_outputs(outdir: Path, report: dict[str, Any], res: Any, install: bool, meas: np.ndarray,
                  before: np.ndarray, after: np.ndarray, train: np.ndarray, t_start: float) -> None:
    """The fitted topology (and with ``install`` this host's calibration), results.json, results.md and
    the plot; ``report`` gains ``installed`` and ``total_seconds``."""
    outdir.mkdir(parents=True, exist_ok=True)
    res.topology.meta.update({"fidelity": {k: report["metrics"]["after"][k] for k in ("train", "heldout")},
                              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    res.topology.save(outdir / "cpu-local-calibrated.json")
    if install:
        from envs.presets import calibrated_cpu_local_path

        res.topology.save(calibrated_cpu_local_path())
        report["installed"] = str(calibrated_cpu_local_path())
    report["total_seconds"] = time.time() - t_start
    atomic_write_json(outdir / "results.json", report)
    atomic_write_text(outdir / "results.md", markdown(report))
    plot(outdir / "fidelity.png", meas, before, after, train)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _noise(samples: list[Sample]) -> float | None:
    """Mean |round time - plan median| / plan median: the measurement noise floor of any MAPE."""
    errs = [abs(t - s.measured) / s.measured for s in samples for t in s.config["round_times"]
            if len(s.config["round_times"]) > 1]
    return float(np.mean(errs)) if errs else None


def markdown(rep: dict[str, Any]) -> str:
    def row(name: str, split: str) -> str:
        m = rep["metrics"][name][split]
        if m is None:
            return ""
        return f"| {name} | {split} | {m['n']} | {m['spearman']:.3f} | {100 * m['mape']:.1f}% | {m['mean_ratio']:.3f} |"

    lines = ["# Simulator fidelity on cpu-local (measured with a persistent gloo pool)", "",
             f"`{rep.get('command', '')}` ({rep.get('total_seconds', 0):.0f} s)", "",
             f"{rep['n_plans']} plans ({rep['n_train']} train, {rep['n_heldout']} held-out), median of "
             f"{rep['steps']} timed steps after {rep['warmup']} warm-up per round, median of {rep['rounds']} rounds "
             f"(plans visited in a new random order each round); host CPUs: {rep['host_cpus']}. Measurement noise: "
             f"a round deviates from the plan's median by {_pct(rep['round_mape_to_median'])} on average "
             f"(median max/min over rounds {rep['round_spread_median'] or float('nan'):.2f}).", "",
             "| topology | split | n | Spearman | MAPE | mean sim/meas |", "|---|---|---|---|---|---|"]
    for name in ("before", "after"):
        for split in ("train", "heldout", "all"):
            r = row(name, split)
            if r:
                lines.append(r)
    lines += ["", "| parameter | before (defaults) | after (fitted) |", "|---|---|---|"]
    for k, v in rep["params_before"].items():
        lines.append(f"| {k} | {v:.4g} | {rep['params_after'][k]:.4g} |")
    lines += ["", "| model | plan | split | measured ms | before ms | after ms |", "|---|---|---|---|---|---|"]
    for p in rep["plans"]:
        lines.append(f"| {p['model']} | {p['plan']} | {'train' if p['train'] else 'held-out'} | "
                     f"{p['measured_s'] * 1e3:.2f} | {p['before_s'] * 1e3:.3f} | {p['after_s'] * 1e3:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plans", type=int, default=30, help="number of plans to measure (at most)")
    ap.add_argument("--out", default="experiments/results/fidelity")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="independent measurements per plan (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--install", action="store_true", help="also write the fit as this host's cpu-local calibration")
    a = ap.parse_args(argv)
    run(a.plans, a.out, steps=a.steps, warmup=a.warmup, rounds=a.rounds, seed=a.seed, install=a.install)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
