"""Zero-shot placement of user model files: every model file in ``experiments/models/`` on several clusters.

    python -m experiments.bench_user_models [--models convnext,tcn] [--clusters "dgx-a100-80g;hetero"]
                                            [--policy P.zip] [--out experiments/results/agent] [--ray]
    python -m experiments.bench_user_models --large   # LARGE_MODELS instead of the model files

What a user does with a model of their own: ``rlplace profile my_model.py:build`` and ``rlplace place``.
Per model file x cluster preset: the shipped policy's best of greedy + 8 samples vs the best fast
heuristic, ratio = heuristic / policy (> 1: the policy is faster; a policy plan that overflows memory
where the heuristic fits counts 0) -- target (a)'s measurement of ``bench_agent.py`` on more user files
(architectures outside the zoo: ConvNeXt, an LSTM language model, a GCN, a Whisper-like encoder-decoder,
DLRM with ``EmbeddingBag``, a gated-convolution language model, a conv VAE, a CRNN, an MAE, a TCN, an FPN
detector, an EfficientNet, ``nn.Transformer`` seq2seq, Hugging Face GPT-2, Mixtral, Llama and BERT,
MLP-Mixer, WaveNet, Perceiver, a top-2 mixture of experts, a DiT, a Swin-style windowed ViT, PointNet, a
CLIP-style image-text model, a Siamese bi-encoder, an HRNet-style multi-resolution network, an
ensemble of eight CNNs),
without (a)'s untrained-network ablation. A file that
needs an optional package that is not installed (``transformers``: the ``[hf]`` extra) is listed as
skipped. Writes ``user_models.json``, ``.md`` and a heat map ``.png`` into ``--out`` atomically.

``--large``: the same measurement on :data:`LARGE_MODELS`, zoo members at sizes the suite does not have
(Llama-7B, GPT-1.3B, T5-large, ViT-H/14, a 32-expert MoE; ``large_models.*``).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.bench_agent import OUT, _geo, _ratio, write_report  # noqa: E402

MODELS_DIR = ROOT / "experiments" / "models"
CLUSTERS = ("dgx-a100-80g", "pcie-4gpu", "hetero", "a100-80g-cluster:nodes=2")
OPTIONAL = {"transformers": "hf"}  # a package a model file may import -> the extra that installs it
LARGE_MODELS = {  # published sizes (Touvron et al. 2023; GPT-3 XL; Raffel et al. 2020; Dosovitskiy et al. 2021)
    "llama-7b": "llama:layers=32,hidden=4096,heads=32,kv_heads=8,ffn=11008,vocab=32000,seq=2048,batch=8",
    "gpt-1.3b": "gpt:layers=24,hidden=2048,heads=16,seq=2048,vocab=50257,batch=8",
    "t5-large": "t5:layers=24,hidden=1024,heads=16,ffn=4096,vocab=32128,seq=512,batch=16",
    "vit-h14": "vit:img=224,patch=14,layers=32,hidden=1280,heads=16,batch=128",
    "moe-32e": "moe:layers=12,hidden=1024,heads=16,experts=32,topk=2,seq=1024,batch=16",
}


def model_files(names: list[str] | None) -> tuple[list[str], dict[str, str]]:
    """(the model files to place, by stem; {skipped stem: why}) -- every ``*.py`` of ``experiments/models/``
    (or ``names``), skipping those that import an optional package that is not installed."""
    found = sorted(p.stem for p in MODELS_DIR.glob("*.py") if not p.stem.startswith("_"))
    if names:
        unknown = sorted(set(names) - set(found))
        if unknown:
            raise ValueError(f"no model file {', '.join(unknown)} in {MODELS_DIR} (there are: {', '.join(found)})")
        found = [n for n in found if n in names]
    keep, skipped = [], {}
    for stem in found:
        text = (MODELS_DIR / f"{stem}.py").read_text()
        missing = [pkg for pkg in OPTIONAL if f"import {pkg}" in text or f"from {pkg}" in text
                   if importlib.util.find_spec(pkg) is None]
        if missing:
            skipped[stem] = f"needs {missing[0]} (pip install -e '.[{OPTIONAL[missing[0]]}]')"
        else:
            keep.append(stem)
    return keep, skipped


def zero_shot_case(job: tuple[str, str, str]) -> dict:
    """One model file on one cluster: the policy's best of greedy + 8 samples vs the best fast heuristic."""
    from agent.infer import Candidate, cached_policy, place
    from envs.presets import resolve_topology
    from profilers.spec import graph_from_spec

    stem, cluster, policy = job
    spec = LARGE_MODELS.get(stem, f"{MODELS_DIR / stem}.py:build")
    graph, topo = graph_from_spec(spec), resolve_topology(cluster)
    t = time.perf_counter()
    res = place(graph, topo, model=cached_policy(policy), samples=8, seed=0)
    pol = min((c for c in res.candidates if c.kind == "policy"), key=Candidate.key)
    base = res.best_baseline()
    return {"model": stem, "cluster": cluster, "ops": graph.num_nodes, "devices": topo.num_devices,
            "heuristic": base.name, "heuristic_ms": base.value * 1e3, "heuristic_oom": base.oom,
            "policy_ms": pol.value * 1e3, "policy_oom": pol.oom, "policy_plan": pol.name,
            "ratio": _ratio(base, pol), "seconds": round(time.perf_counter() - t, 1)}


def summary(rows: list[dict], skipped: dict[str, str]) -> dict:
    ratios = [r["ratio"] for r in rows]
    models = sorted({r["model"] for r in rows})
    return {"rows": rows, "skipped": skipped, "n": len(rows), "geomean": _geo(ratios), "min": min(ratios),
            "below_0_90": sum(x < 0.9 for x in ratios), "wins": sum(x > 1 + 1e-9 for x in ratios),
            "per_model": {m: _geo([r["ratio"] for r in rows if r["model"] == m]) for m in models},
            "target": "(a)'s: geomean >= 1.00 and min >= 0.90"}


def markdown(res: dict, what: str = "user model files", command: str = "") -> str:
    lines = [f"# Zero-shot placement of {what}", "",
             f"`python -m experiments.bench_user_models{command}`; the shipped policy's greedy + 8 samples vs the best fast "
             "heuristic (ratio > 1: the policy is faster); target (a)'s: geomean >= 1.00, min >= 0.90.", "",
             f"{res['n']} cases: geometric mean {res['geomean']:.3f}, min {res['min']:.3f}, "
             f"{res['below_0_90']} below 0.90, {res['wins']} wins. Took {res.get('seconds', 0):.0f} s.", "",
             "| model | cluster | ops | devices | best heuristic | heuristic ms | policy ms | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(res["rows"], key=lambda r: r["ratio"]):
        oom = lambda flag: " (OOM)" if flag else ""
        lines.append(f"| {r['model']} | {r['cluster']} | {r['ops']} | {r['devices']} | {r['heuristic']} | "
                     f"{r['heuristic_ms']:.3f}{oom(r['heuristic_oom'])} | {r['policy_ms']:.3f}{oom(r['policy_oom'])} | "
                     f"{r['ratio']:.3f} |")
    lines += ["", "Per model: " + ", ".join(f"{m} {v:.3f}" for m, v in res["per_model"].items()) + "."]
    if res["skipped"]:
        lines += ["", "Skipped: " + "; ".join(f"{m} ({why})" for m, why in res["skipped"].items()) + "."]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path, what: str = "user model files") -> None:
    """A heat map of the ratios, models x clusters."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from envs.gantt import save_figure

    models = sorted({r["model"] for r in res["rows"]})
    clusters = list(dict.fromkeys(r["cluster"] for r in res["rows"]))
    grid = np.full((len(models), len(clusters)), np.nan)
    for r in res["rows"]:
        grid[models.index(r["model"]), clusters.index(r["cluster"])] = r["ratio"]
    fig, ax = plt.subplots(figsize=(2 + 1.6 * len(clusters), 1 + 0.35 * len(models)))
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0.8, vmax=1.2, aspect="auto")
    ax.set_xticks(range(len(clusters)), clusters, rotation=20, ha="right", fontsize=8)
    ax.set_yticks(range(len(models)), models, fontsize=8)
    for (i, j), v in np.ndenumerate(grid):
        if not np.isnan(v):
            ax.text(j, i, f"{v:.3f}", ha="center", va="center", fontsize=7)
    fig.colorbar(im, ax=ax, label="best heuristic / policy (zero-shot)")
    ax.set_title(f"{what}: geomean {res['geomean']:.3f}, min {res['min']:.3f}")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from agent.infer import PRETRAINED, load_policy
    from agent.scale import Executor
    from envs.errors import RlplaceError
    from envs.presets import resolve_topology

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=None, help="comma-separated model file stems (default: all)")
    ap.add_argument("--clusters", default=";".join(CLUSTERS), help="';'-separated cluster presets")
    ap.add_argument("--policy", default=str(PRETRAINED))
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--ray", action="store_true", help="run the cases on a local Ray instance")
    ap.add_argument("--large", action="store_true", help="the large zoo models of LARGE_MODELS instead")
    args = ap.parse_args(argv)
    clusters = [c for c in args.clusters.split(";") if c]
    try:  # bad input: one line, before any work
        if args.large and args.models:
            raise ValueError("--large places LARGE_MODELS; it does not take --models")
        if args.large:
            stems, skipped = list(LARGE_MODELS), {}
        else:
            stems, skipped = model_files(args.models.split(",") if args.models else None)
        for c in clusters:
            resolve_topology(c)
        load_policy(args.policy)
    except (RlplaceError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not stems or not clusters:
        print("error: no model file or no cluster to place", file=sys.stderr)
        return 2
    t0 = time.time()
    jobs = [(m, c, args.policy) for m in stems for c in clusters]
    with Executor.from_flags(args.ray) as ex:
        rows = ex.map(zero_shot_case, jobs)
    res = summary(rows, skipped)
    res["seconds"] = round(time.time() - t0, 1)
    name, what = ("large_models", "large zoo models") if args.large else ("user_models", "user model files")
    write_report(Path(args.out), name, res, markdown(res, what, " --large" if args.large else ""),
                 lambda path: plot(res, path, what))
    return 0


if __name__ == "__main__":
    sys.exit(main())
