"""Benchmark tracing on the meta device: time, node count and memory for large models.

Prints, per model: parameters, trace wall time (cold = first trace in the process, warm = again), OpGraph nodes/edges, forward TFLOPs, the peak
Python-heap growth while tracing (tracemalloc) and the process's peak RSS (ru_maxrss; cumulative, so
each model runs in a fresh subprocess). Models: zoo ``gpt`` at ~125M, ~1.3B and ~13B parameters and,
when ``transformers`` is installed, a Llama-7B config through ``profilers.hf``.

    python experiments/bench_trace.py [--only gpt-125m,llama-7b]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
import tracemalloc
import warnings

CASES = {
    "gpt-125m": "gpt:layers=12,hidden=768,heads=12,seq=1024,vocab=50257,batch=8",
    "gpt-1.3b": "gpt:layers=24,hidden=2048,heads=16,seq=2048,vocab=50257,batch=8",
    "gpt-13b": "gpt:layers=40,hidden=5120,heads=40,seq=2048,vocab=50257,batch=8",
    "llama-7b": "hf:llama-7b",
}


def run_case(name: str) -> dict:
    """Trace one case in this process and return its numbers."""
    warnings.filterwarnings("ignore")
    import torch  # noqa: F401 - import cost is not trace cost

    from profilers.spec import clear_cache, graph_from_spec

    spec = CASES[name]

    def once():
        if spec.startswith("hf:"):
            from profilers.hf import trace_hf

            return trace_hf(spec[3:], batch_size=8, seq=2048)
        return graph_from_spec(spec)

    t0 = time.perf_counter()
    graph = once()  # cold: includes torch.export's first-use set-up
    dt = time.perf_counter() - t0
    clear_cache()
    t0 = time.perf_counter()
    once()
    warm = time.perf_counter() - t0
    clear_cache()
    tracemalloc.start()  # a third run for memory: tracemalloc slows Python down several-fold
    once()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    dbytes = 2  # bf16
    return {"case": name, "params_M": graph.param_bytes.sum() / dbytes / 1e6, "trace_s": dt, "warm_s": warm,
            "nodes": graph.num_nodes, "edges": graph.num_edges, "fwd_TFLOP": graph.fwd_flops.sum() / 1e12,
            "tracemalloc_peak_MiB": peak / 2**20, "peak_rss_MiB": rss / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(CASES), help="comma list of cases: " + ", ".join(CASES))
    ap.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case, print JSON
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case)))
        return
    try:
        import transformers  # noqa: F401

        has_hf = True
    except ImportError:
        has_hf = False
    print(f"{'case':10s} {'params':>9s} {'cold s':>7s} {'warm s':>7s} {'nodes':>6s} {'edges':>6s} {'fwd TFLOP':>10s} "
          f"{'tracemalloc MiB':>16s} {'peak RSS MiB':>13s}")
    for name in args.only.split(","):
        name = name.strip()
        if name not in CASES:
            sys.exit(f"unknown case {name!r}; cases: {', '.join(CASES)}")
        if CASES[name].startswith("hf:") and not has_hf:
            print(f"{name:10s} skipped (transformers not installed)")
            continue
        out = subprocess.run([sys.executable, __file__, "--case", name], capture_output=True, text=True)
        if out.returncode:
            print(f"{name:10s} FAILED: {out.stderr.strip().splitlines()[-1] if out.stderr else out.returncode}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{r['case']:10s} {r['params_M']:8.0f}M {r['trace_s']:7.2f} {r['warm_s']:7.2f} {r['nodes']:6d} {r['edges']:6d} "
              f"{r['fwd_TFLOP']:10.1f} {r['tracemalloc_peak_MiB']:16.1f} {r['peak_rss_MiB']:13.0f}")


if __name__ == "__main__":
    main()
