"""Run a Plan's training step for real with ``torch.distributed`` and measure it.

``execute_plan(plan, "gpt:layers=2,...", steps=5)`` builds the model a zoo (or file) spec names
with a fixed seed, splits it as :mod:`profilers.exec_plan` describes (pipeline stages with
``torch.distributed.pipelining``, data parallel with DDP, tensor parallel with DTensor
``parallelize_module``), launches one local worker process per rank (``torch.multiprocessing``
with the forkserver start method where the platform has it, else spawn; gloo on CPU or NCCL on
CUDA; a free localhost port) and trains ``warmup + steps`` SGD steps
on synthetic data (MSE against random targets; every rank generates the same global batch from the
seed and takes its slice). Under ``torchrun`` (``RANK`` / ``WORLD_SIZE`` set) it runs as that rank
instead of launching workers; ``WORLD_SIZE`` must equal the plan's ``pp * dp * tp``.

Which plans run is spelled out in :mod:`profilers.exec_plan`. The plan's device indices name ranks,
not hardware: spawned workers on CUDA use ``cuda:(plan device % visible GPUs)``, torchrun ranks
``cuda:LOCAL_RANK``. The plan's ``dtype`` is not used: the caller picks the execution dtype
(default fp32, where the reference check is tightest).

The report holds the median step time after warm-up (the slowest rank's wall time per step), the
peak memory per rank (CUDA: ``torch.cuda.max_memory_allocated``; CPU: the worker process's peak
resident set size, which includes the Python/torch baseline) and the loss of every step next to a
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
import socket
import statistics
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from profilers.exec_plan import (
    Chain,
    ExecLayout,
    ExecutionError,
    Recompute,
    WorkerError,
    analyze,
    apply_tensor_parallel,
    decompose,
)

if TYPE_CHECKING:  # spawned workers import this module: keep envs.graph (networkx) out of them
    from envs.graph import OpGraph
    from envs.plan import Plan

__all__ = ["ExecReport", "ExecutionError", "WorkerError", "execute_plan"]

FAIL_ENV = "RLPLACE_EXEC_FAIL_RANK"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
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
    memory_kind: str = "cpu_max_rss"
    warmup: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Job:
    """Everything a worker needs (pickled to spawned processes)."""

    spec: str
    layout: ExecLayout
    steps: int
    warmup: int
    backend: str
    seed: int
    lr: float
    dtype: str
    out_shape: tuple[int, ...]
    collective_timeout_s: float
    threads: int
    zoo: tuple[str, dict[str, Any]] | None = None  # the parsed zoo spec (workers skip profilers.spec)
    fail: str = ""  # the RLPLACE_EXEC_FAIL_RANK hook, read by the launcher
    result_path: str | None = None


# ---------------------------------------------------------------------------- model and data
def build_seeded_model(spec: str, seed: int, dtype: str = "fp32",
                       zoo: tuple[str, dict[str, Any]] | None = None) -> tuple[nn.Module, tuple]:
    """The model a spec names with real weights drawn from ``seed`` (identical in every process);
    ``zoo``: the spec already parsed into ``(family, knobs)``."""
    torch.manual_seed(seed)
    if zoo is None and ".py:" in spec:
        from profilers.spec import build_model

        model, inputs, _ = build_model(spec)
        model = model.to_empty(device="cpu")
        torch.manual_seed(seed)
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
            elif any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False)):
                raise ExecutionError(f"module {type(m).__name__} in {spec} has weights but no reset_parameters(); "
                                     "the executor cannot initialise it reproducibly")
    else:
        from profilers.zoo import FAMILIES

        if zoo is None:
            from profilers.spec import parse_spec

            zoo = parse_spec(spec)
        family, values = zoo
        with torch.device("cpu"):
            model, inputs = FAMILIES[family](**values)
    model = model.to(_DTYPES[dtype])
    return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def make_batch(example: tuple, highs: list[int | None], batch: int, out_shape: tuple[int, ...], seed: int,
               step: int, dtype: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The global batch of step ``step``: inputs shaped like ``example`` with ``batch`` rows, and a target."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    xs = []
    for i, x in enumerate(example):
        shape = (batch, *x.shape[1:])
        if x.dtype.is_floating_point:
            xs.append(torch.randn(shape, generator=g).to(_DTYPES[dtype]))
        else:
            hi = highs[i] if i < len(highs) and highs[i] is not None else 2
            xs.append(torch.randint(0, max(1, int(hi)), shape, generator=g, dtype=x.dtype))
    target = torch.randn((batch, *out_shape[1:]), generator=g).to(_DTYPES[dtype])
    return xs, target


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The training loss (mean squared error, computed in fp32)."""
    return F.mse_loss(output.float(), target.float())




# ---------------------------------------------------------------------------- one rank
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024.0  # KiB on Linux


def _allreduce_grads(module: nn.Module, group, dp: int) -> None:
    """Average the gradients of a pipeline stage over its data-parallel replicas: one flat all-reduce
    after the schedule (DDP inside ``torch.distributed.pipelining`` trips a reducer assertion in
    torch 2.13 when a stage runs several microbatches)."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    flat /= dp
    for g, new in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(new)


def _train(rank: int, job: _Job, device: torch.device) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    lay = job.layout
    s, r, tp_rank = lay.coords(rank)
    stage = lay.stages[s]
    model, example = build_seeded_model(job.spec, job.seed, job.dtype, job.zoo)
    blocks, highs = decompose(model)
    mesh = init_device_mesh(device.type, (lay.pp, lay.dp, lay.tp), mesh_dim_names=("pp", "dp", "tp"))
    stage_mod: nn.Module = Chain([Recompute(blocks[b].module) if b in stage.recompute else blocks[b].module
                                  for b in stage.blocks]).to(device)
    if lay.tp > 1:
        apply_tensor_parallel(model, stage, mesh["tp"], lay.tp)
    del model, blocks
    dp_group = mesh["dp"].get_group() if lay.dp > 1 else None
    if lay.dp > 1 and lay.pp == 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        stage_mod = DDP(stage_mod, process_group=dp_group,
                        device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(stage_mod.parameters(), lr=job.lr, foreach=False)
    first, last = s == 0, s == lay.pp - 1
    m = lay.microbatches
    if lay.pp > 1:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        pstage = PipelineStage(stage_mod, s, lay.pp, device, group=mesh["pp"].get_group())
        sched = (ScheduleGPipe if lay.schedule == "gpipe" else Schedule1F1B)(pstage, m, loss_fn=mse)
    per_replica = lay.batch // lay.dp
    rows = slice(r * per_replica, (r + 1) * per_replica)
    reporter = last and tp_rank == 0  # one loss per data-parallel replica
    times: list[float] = []
    losses: list[float] = []
    for step in range(job.warmup + job.steps):
        xs, y = make_batch(example, highs, lay.batch, job.out_shape, job.seed, step, job.dtype)
        xs = [x[rows].to(device) for x in xs] if first else []
        y = y[rows].to(device)
        _sync(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if lay.pp > 1:
            mb_losses: list[torch.Tensor] = []
            sched.step(*xs, target=y if last else None, losses=mb_losses if last else None, return_outputs=False)
            loss = torch.stack([x.detach().float() for x in mb_losses]).mean() if last else torch.zeros(())
        else:
            loss = torch.zeros((), device=device)
            chunks = [torch.tensor_split(x, m) for x in xs]
            ys = torch.tensor_split(y, m)
            for j in range(m):
                ctx = stage_mod.no_sync() if lay.dp > 1 and j < m - 1 else nullcontext()
                with ctx:
                    part = mse(stage_mod(*[c[j] for c in chunks]), ys[j]) / m
                    part.backward()
                loss = loss + part.detach()
        if lay.pp > 1 and dp_group is not None:
            _allreduce_grads(stage_mod, dp_group, lay.dp)
        opt.step()
        _sync(device)
        dt = time.perf_counter() - t0
        tt = torch.tensor([dt], dtype=torch.float64, device=device)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)  # the step takes as long as its slowest rank
        lv = torch.tensor([float(loss) / lay.dp if reporter else 0.0], dtype=torch.float64, device=device)
        dist.all_reduce(lv)
        times.append(float(tt.item()))
        losses.append(float(lv.item()))
    mem = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)
    mem[rank] = _peak_memory(device)
    dist.all_reduce(mem)
    return {"times": times, "losses": losses, "memory": mem.cpu().tolist()}


def _run_rank(rank: int, world: int, local_rank: int, job: _Job, init_method: str) -> dict[str, Any]:
    import torch.distributed as dist

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
        fail_rank, _, mode = job.fail.strip().partition(":")
        if fail_rank and int(fail_rank) == rank:
            if mode == "hang":
                time.sleep(3600)
            raise RuntimeError(f"injected failure on rank {rank} ({FAIL_ENV})")
        result = _train(rank, job, device)
    except BaseException as exc:
        _record_error(job, rank, exc)  # before the group goes down and the peers fail in turn
        raise
    finally:
        dist.destroy_process_group()
    if rank == 0 and job.result_path:
        Path(job.result_path).write_text(json.dumps(result))
    return result


def _spawned(index: int, job: _Job, port: int) -> None:
    """Entry point of a spawned local worker (rank = its index). A failure is also written to
    ``error_<rank>.json`` next to the result, with its time, so the launcher can name the first one
    (the other ranks then fail too, with 'connection closed by peer')."""
    try:
        _run_rank(index, job.layout.world_size, job.layout.plan_device(index), job, f"tcp://127.0.0.1:{port}")
    except BaseException as exc:
        _record_error(job, index, exc)
        raise


def _record_error(job: _Job, rank: int, exc: BaseException) -> None:
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
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _first_error(folder: str) -> tuple[int, dict[str, Any]] | None:
    """The earliest failure a worker recorded in ``folder``: ``(rank, {time, message, traceback})``."""
    errs = []
    for path in Path(folder).glob("error_*.json"):
        try:
            errs.append((int(path.stem.split("_")[1]), json.loads(path.read_text())))
        except (ValueError, OSError):
            continue
    return min(errs, key=lambda e: e[1]["time"]) if errs else None


def _launch(job: _Job, timeout_s: float) -> dict[str, Any]:
    import multiprocessing

    import torch.multiprocessing as mp

    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if method == "forkserver":  # the server imports torch once; each worker is a fork of it
        multiprocessing.set_forkserver_preload(["profilers.execute", "profilers.zoo", "torch.distributed.pipelining",
                                                "torch.distributed.tensor.parallel", "torch.nn.parallel"])
    with tempfile.TemporaryDirectory(prefix="rlplace-exec-") as tmp:
        job.result_path = os.path.join(tmp, "result.json")
        ctx = mp.start_processes(_spawned, args=(job, _free_port()), nprocs=job.layout.world_size, join=False,
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


def reference_losses(job: _Job) -> list[float]:
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
    if dtype not in _DTYPES:
        raise ExecutionError(f"unknown dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")
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
    job = _Job(spec=model_spec, layout=lay, steps=steps, warmup=warmup, backend=backend, seed=seed, lr=lr,
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
                      memory_kind="cuda_max_allocated" if backend == "nccl" else "cpu_max_rss", warmup=warmup)
