"""Run a Plan's training step for real with ``torch.distributed`` and measure it.

``execute_plan(plan, "gpt:layers=2,...", steps=5)`` builds the model a zoo (or file) spec names
with a fixed seed, splits it as :mod:`profilers.execution_layout` describes (pipeline stages with
``torch.distributed.pipelining``, interleaved with ``ScheduleInterleaved1F1B``; data parallel with DDP,
ZeRO-1 with ``ZeroRedundancyOptimizer``, ZeRO-2/3 with FSDP2 ``fully_shard``; tensor and sequence
parallel with DTensor ``parallelize_module``; full or selective activation recomputation with
``torch.utils.checkpoint``), launches one local worker process per rank (``torch.multiprocessing``
with the forkserver start method where the platform has it, else spawn; gloo on CPU or NCCL on
CUDA; a free localhost port) and trains ``warmup + steps`` SGD steps
on synthetic data (MSE against random targets; every rank generates the same global batch from the
seed and takes its slice). Under ``torchrun`` (``RANK`` / ``WORLD_SIZE`` set) it runs as that rank
instead of launching workers; ``WORLD_SIZE`` must equal the plan's ``pp * dp * tp``.

Which plans run is spelled out in :mod:`profilers.execution_layout`; what each rank runs is
:mod:`profilers.rank_program` (shared with the measured evaluator's pool). The plan's device indices name ranks,
not hardware: spawned workers on CUDA use ``cuda:(plan device % visible GPUs)``, torchrun ranks
``cuda:LOCAL_RANK``. The plan's ``dtype`` is not used: the caller picks the execution dtype
(default fp32, where the reference check is tightest).

The report holds the median step time after warm-up (the slowest rank's wall time per step), the
peak memory per rank (CUDA: ``torch.cuda.max_memory_allocated``; CPU: the peak bytes of live tensors
over one extra, untimed step, ``profilers.tensor_memory``: what the simulator's memory model predicts) and the loss of every step next to a
single-process reference (same seed, same data, same microbatch/replica chunks, same SGD updates),
so a wrong split shows as a loss mismatch (default tolerance: rtol 1e-4 in fp32, 2e-2 in bf16, over
the first two steps: the forward, backward, gradient reduction and one update).

Every collective has a timeout (``init_process_group(timeout=...)``) and the launcher joins its
workers with a deadline: a crashed or hung worker raises :class:`WorkerError`, never hangs.
``RLPLACE_EXEC_FAIL_RANK=<rank>`` makes that rank raise after joining the process group, and
``RLPLACE_EXEC_FAIL_RANK=<rank>:hang`` makes it hang there (test hooks for the failure paths).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from profilers.execution_layout import ExecLayout, ExecutionError, WorkerError, analyze, decompose
from profilers.rank_program import (
    DTYPES,
    FAIL_ENV,
    Job,
    build_seeded_model,
    free_port,
    inject_failure,
    make_batch,
    mse,
    train_rank,
)

if TYPE_CHECKING:  # spawned workers import this module: keep envs.graph (networkx) out of them
    from envs.graph import OpGraph
    from envs.plan import Plan

__all__ = ["ExecReport", "execute_plan", "prepare"]

_RTOL = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 1e-2}


@dataclass
class ExecReport:
    """What a measured execution of a plan gave (times in seconds, memory in bytes)."""

    median_step_time_s: float
    step_times: list[float]  # timed steps only (after warm-up); the slowest rank per step
    peak_memory_per_rank: list[float]
    loss: float  # the last step's loss
    reference_loss: float | None
    loss_matches: bool | None
    losses: list[float] = field(default_factory=list)  # every step, warm-up included
    reference_losses: list[float] | None = None
    world_size: int = 1
    pp: int = 1
    dp: int = 1
    tp: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    backend: str = "gloo"
    memory_kind: str = "cpu_tensor_peak"
    warmup: int = 0
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved 1F1B when > 1)
    zero: list[int] = field(default_factory=list)  # the ZeRO stage of each pipeline stage

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------- one rank
def _run_rank(rank: int, world: int, local_rank: int, job: Job, init_method: str) -> dict[str, Any]:
    """Join the run's process group as ``rank`` and run the rank program on the plan's mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(max(1, job.threads))
    if job.backend == "nccl":
        if not torch.cuda.is_available():
            raise ExecutionError("backend nccl needs CUDA devices")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(job.backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=job.collective_timeout_s))
    try:
        inject_failure(job.fail, rank)
        lay = job.layout
        mesh = init_device_mesh(device.type, (lay.pp, lay.dp, lay.tp), mesh_dim_names=("pp", "dp", "tp"))
        result = train_rank(rank, job, device, mesh)
    except BaseException as exc:
        _record_error(job, rank, exc)  # before the group goes down and the peers fail in turn
        raise
    finally:
        dist.destroy_process_group()
    if rank == 0 and job.result_path:
        Path(job.result_path).write_text(json.dumps(result))
    return result


def _spawned(index: int, job: Job, port: int) -> None:
    """Entry point of a spawned local worker (rank = its index). A failure is also written to
    ``error_<rank>.json`` next to the result, with its time, so the launcher can name the first one
    (the other ranks then fail too, with 'connection closed by peer')."""
    try:
        _run_rank(index, job.layout.world_size, job.layout.plan_device(index), job, f"tcp://127.0.0.1:{port}")
    except BaseException as exc:
        _record_error(job, index, exc)
        raise


def _record_error(job: Job, rank: int, exc: BaseException) -> None:
    """Write ``error_<rank>.json`` (time, message, traceback) next to the result, once per rank."""
    if not job.result_path:
        return
    path = Path(job.result_path).with_name(f"error_{rank}.json")
    if path.exists():
        return
    import traceback

    err = {"time": time.time(), "message": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    path.write_text(json.dumps(err))


# ---------------------------------------------------------------------------- launcher
def _first_error(folder: str) -> tuple[int, dict[str, Any]] | None:
    """The earliest failure a worker recorded in ``folder``: ``(rank, {time, message, traceback})``."""
    errs = []
    for path in Path(folder).glob("error_*.json"):
        try:
            errs.append((int(path.stem.split("_")[1]), json.loads(path.read_text())))
        except (ValueError, OSError):
            continue
    return min(errs, key=lambda e: e[1]["time"]) if errs else None


def _launch(job: Job, timeout_s: float) -> dict[str, Any]:
    import multiprocessing

    import torch.multiprocessing as mp

    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if method == "forkserver":  # the server imports torch once; each worker is a fork of it
        multiprocessing.set_forkserver_preload(["profilers.execute", "profilers.rank_program", "profilers.zoo",
                                                "torch.distributed.pipelining",
                                                "torch.distributed.tensor.parallel", "torch.nn.parallel"])
    with tempfile.TemporaryDirectory(prefix="rlplace-exec-") as tmp:
        job.result_path = os.path.join(tmp, "result.json")
        ctx = mp.start_processes(_spawned, args=(job, free_port()), nprocs=job.layout.world_size, join=False,
                                 start_method=method)
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise WorkerError(f"workers did not finish within {timeout_s:.0f} s (hung or too slow); "
                                      "killed them")
        except mp.ProcessRaisedException as exc:
            first = _first_error(tmp)
            if first is not None:
                raise WorkerError(f"rank {first[0]} failed: {first[1]['message']}", first[1]["traceback"]) from exc
            lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
            raise WorkerError(f"rank {exc.error_index} failed: {lines[-1] if lines else exc}") from exc
        except mp.ProcessExitedException as exc:
            first = _first_error(tmp)
            if first is not None:
                raise WorkerError(f"rank {first[0]} failed: {first[1]['message']}", first[1]["traceback"]) from exc
            raise WorkerError(f"rank {exc.error_index} exited abnormally (code {exc.exit_code}, "
                              f"signal {exc.signal_name})") from exc
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
                    p.join(5)
                    if p.is_alive():
                        p.kill()
                        p.join(5)
        if not os.path.exists(job.result_path):
            raise WorkerError("workers finished without writing a result")
        return json.loads(Path(job.result_path).read_text())


def reference_losses(job: Job) -> list[float]:
    """Single-process losses of the same steps (same seed, data, chunks and SGD updates) on the CPU."""
    lay = job.layout
    model, example = build_seeded_model(job.spec, job.seed, job.dtype, job.zoo)
    _, highs = decompose(model)
    opt = torch.optim.SGD(model.parameters(), lr=job.lr, foreach=False)
    chunks = lay.dp * lay.microbatches
    size = lay.batch // chunks
    out = []
    for step in range(job.warmup + job.steps):
        xs, y = make_batch(example, highs, lay.batch, job.out_shape, job.seed, step, job.dtype)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for c in range(chunks):
            sl = slice(c * size, (c + 1) * size)
            part = mse(model(*[x[sl] for x in xs]), y[sl]) / chunks
            part.backward()
            total += float(part.detach())
        opt.step()
        out.append(total)
    return out


def prepare(plan: Plan | str | os.PathLike, model_spec: str,
            graph: OpGraph | None = None) -> tuple[Plan, ExecLayout, tuple[int, ...]]:
    """Load and check a plan against the model a spec names: ``(plan, execution layout, output
    shape)``, or ExecutionError when the plan cannot run."""
    from envs.plan import Plan
    from profilers.spec import build_model, graph_from_spec

    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    g = graph if graph is not None else graph_from_spec(model_spec)
    model, inputs, _ = build_model(model_spec)
    if plan.num_nodes == g.num_nodes:  # the plan's own checks (layouts vs op kinds, batch splits, ...);
        # the executor runs on whatever devices it has, so any device index >= 0 is fine here
        from types import SimpleNamespace

        plan.validate(g, SimpleNamespace(num_devices=max([d + 1 for grp in plan.groups for d in grp] + [1])))
    lay = analyze(plan, g, model)
    with torch.no_grad():
        out = model(*inputs)
    if not isinstance(out, torch.Tensor):
        raise ExecutionError(f"{model_spec}: the executor needs a model with one tensor output, "
                             f"got {type(out).__name__}")
    return plan, lay, tuple(out.shape)


def execute_plan(plan: Plan | str | os.PathLike, model_spec: str, steps: int = 5, *, warmup: int = 1,
                 backend: str | None = None, seed: int = 0, lr: float = 1e-2, dtype: str = "fp32",
                 check: bool = True, check_steps: int = 2, rtol: float | None = None, atol: float = 1e-6,
                 timeout_s: float = 300.0,
                 collective_timeout_s: float = 120.0, threads: int = 1, graph: OpGraph | None = None) -> ExecReport:
    """Execute ``plan`` for the model ``model_spec`` names: ``warmup + steps`` training steps, measured.

    ``backend``: ``gloo`` (CPU) or ``nccl`` (CUDA); default nccl when CUDA is available. ``check``:
    also run the single-process reference, and compare the losses of the first ``check_steps`` steps
    (``rtol``, ``atol``; 0: all). Two steps cover the forward pass, the backward pass with its
    gradient reductions and one update; later steps may drift apart in ill-conditioned models (e.g.
    BatchNorm over a few samples amplifies fp32 rounding), so the report keeps every step of both.
    ``timeout_s`` bounds the whole run of the local workers, ``collective_timeout_s`` every collective.
    ``graph``: the plan's graph, when the caller has it (default: traced from the spec).
    Raises ExecutionError for plans it cannot run, WorkerError when a worker fails or hangs."""
    if steps < 1 or warmup < 0:
        raise ExecutionError(f"need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    if dtype not in DTYPES:
        raise ExecutionError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("gloo", "nccl"):
        raise ExecutionError(f"unknown backend {backend!r}; choose gloo or nccl")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ExecutionError("backend nccl needs CUDA devices; use --backend gloo on CPU")
    plan, lay, out_shape = prepare(plan, model_spec, graph)
    zoo = None
    if ".py:" not in model_spec:
        from profilers.spec import parse_spec

        zoo = parse_spec(model_spec)
    job = Job(spec=model_spec, layout=lay, steps=steps, warmup=warmup, backend=backend, seed=seed, lr=lr,
               dtype=dtype, out_shape=out_shape, collective_timeout_s=collective_timeout_s, threads=threads, zoo=zoo,
               fail=os.environ.get(FAIL_ENV, ""))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: be that rank
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != lay.world_size:
            raise ExecutionError(f"WORLD_SIZE={world} but the plan needs {lay.world_size} ranks ({lay.describe()})")
        result = _run_rank(rank, world, int(os.environ.get("LOCAL_RANK", rank)), job, "env://")
        check = check and rank == 0
    else:
        result = _launch(job, timeout_s)
    ref = reference_losses(job) if check else None
    tol = _RTOL[dtype] if rtol is None else rtol
    n_check = len(result["losses"]) if check_steps <= 0 else check_steps
    matches = None if ref is None else all(abs(a - b) <= atol + tol * abs(b)
                                           for a, b in list(zip(result["losses"], ref))[:n_check])
    timed = result["times"][warmup:]
    return ExecReport(median_step_time_s=float(statistics.median(timed)), step_times=timed,
                      peak_memory_per_rank=result["memory"], loss=result["losses"][-1],
                      reference_loss=None if ref is None else ref[-1], loss_matches=matches,
                      losses=result["losses"], reference_losses=ref, world_size=lay.world_size, pp=lay.pp,
                      dp=lay.dp, tp=lay.tp, microbatches=lay.microbatches, schedule=lay.schedule, backend=backend,
                      memory_kind="cuda_max_allocated" if backend == "nccl" else "cpu_tensor_peak", warmup=warmup,
                      virtual_stages=lay.virtual_stages, zero=lay.zero)
