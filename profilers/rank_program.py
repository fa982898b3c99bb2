"""The program one rank runs to train a plan's split model, shared by both launchers.

:func:`profilers.execute.execute_plan` (one process group per run) and
:class:`profilers.measured_evaluator.MeasuredEvaluator` (a persistent pool, a sub-mesh per plan) send
each rank a :class:`Job` and call :func:`train_rank` in it: build the model from the seed, keep this
rank's pipeline stage (its model chunks: blocks, full or selective recomputation, tensor- and
sequence-parallel styles of :class:`profilers.execution_layout.ExecLayout`, expert-parallel MoE layers
keeping this rank's experts, :mod:`profilers.expert_parallel`), wrap it in DDP, ZeRO
(``ZeroRedundancyOptimizer`` for stage 1, FSDP2 ``fully_shard`` for stages 2 and 3) or a pipeline
schedule (GPipe, 1F1B, interleaved 1F1B), and time ``warmup + steps`` SGD steps on synthetic data
(the slowest rank's wall time per step). Also here: the synthetic data (:func:`make_batch`), the loss
(:func:`mse`), peak memory, a free localhost port and the ``RLPLACE_EXEC_FAIL_RANK`` test hook. Spawned workers import this module: it needs torch and
:mod:`profilers.execution_layout` only (no networkx, no ``envs.graph``).
"""

from __future__ import annotations

import socket
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from profilers.execution_layout import (
    Chain,
    ExecLayout,
    ExecutionError,
    Recompute,
    apply_tensor_parallel,
    decompose,
)

FAIL_ENV = "RLPLACE_EXEC_FAIL_RANK"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Job:
    """Everything a rank needs to run a plan (pickled to spawned processes)."""

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
    tensor_memory: bool = True  # CPU: peak live tensor bytes of one extra step (else the process's peak RSS)


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
    model = model.to(DTYPES[dtype])
    return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def make_batch(example: tuple, highs: list[int | None], batch: int, out_shape: tuple[int, ...], seed: int,
               step: int, dtype: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The global batch of step ``step``: inputs shaped like ``example`` with ``batch`` rows, and a target."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    xs = []
    for i, x in enumerate(example):
        shape = (batch, *x.shape[1:])
        if x.dtype.is_floating_point:
            xs.append(torch.randn(shape, generator=g).to(DTYPES[dtype]))
        else:
            hi = highs[i] if i < len(highs) and highs[i] is not None else 2
            xs.append(torch.randint(0, max(1, int(hi)), shape, generator=g, dtype=x.dtype))
    target = torch.randn((batch, *out_shape[1:]), generator=g).to(DTYPES[dtype])
    return xs, target


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The training loss (mean squared error, computed in fp32)."""
    return F.mse_loss(output.float(), target.float())


# ---------------------------------------------------------------------------- one rank
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(device: torch.device) -> float:
    """This process's peak memory in bytes: CUDA's max allocated, or on CPU the peak resident set (what
    the measured evaluator reports; ``rlplace run`` counts live tensors, profilers.tensor_memory)."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024.0  # KiB on Linux


def allreduce_grads(module: nn.Module, group, dp: int) -> None:
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


def inject_failure(hook: str, rank: int) -> None:
    """The ``RLPLACE_EXEC_FAIL_RANK`` test hook: ``<rank>`` raises on that rank, ``<rank>:hang`` hangs it."""
    fail_rank, _, mode = hook.strip().partition(":")
    if fail_rank and int(fail_rank) == rank:
        if mode == "hang":
            time.sleep(3600)
        raise RuntimeError(f"injected failure on rank {rank} ({FAIL_ENV})")


def train_rank(rank: int, job: Job, device: torch.device, mesh: Any, group: Any = None,
               record_loss: bool = True) -> dict[str, Any]:
    """Rank ``rank``'s part of ``job.warmup + job.steps`` SGD steps of the plan on ``mesh`` (the plan's
    ``(pp, dp, tp)`` DeviceMesh; ``group``: the process group of the plan's ranks, None for the default
    group). Returns the per-step times (the slowest rank's), the loss of every step when
    ``record_loss`` (the replicas' mean, from the last stage) and every rank's peak memory."""
    import torch.distributed as dist

    lay = job.layout
    s, r, tp_rank = lay.coords(rank)
    first, last = s == 0, s == lay.pp - 1
    chunks, example, highs, experts = _stage_modules(job, s, device, mesh, r)
    zero = lay.stages[s].zero
    dp_group = mesh["dp"].get_group() if lay.dp > 1 else None
    expert_ids = {id(p) for p in experts.params()} if experts is not None else set()
    if lay.dp > 1 and zero >= 2:  # ZeRO-2 / ZeRO-3: FSDP2 over the replicas (reduce-scatters the gradients)
        chunks = [shard_fully(c, mesh["dp"], zero) for c in chunks]
    elif lay.dp > 1 and lay.pp == 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        if expert_ids:  # expert-parallel experts: reduced over their own replicas (ExpertShards.reduce_grads)
            DDP._set_params_and_buffers_to_ignore_for_model(
                chunks[0], [n for n, p in chunks[0].named_parameters() if id(p) in expert_ids])
        chunks = [DDP(chunks[0], process_group=dp_group,
                      device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)]
    stage_mod = chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)
    params = [p for c in chunks for p in c.parameters() if id(p) not in expert_ids]
    if zero == 1:  # ZeRO-1: each replica updates (and keeps optimizer state for) its share of the parameters
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt: Any = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD, process_group=dp_group,
                                           lr=job.lr, foreach=False)
    else:
        opt = torch.optim.SGD(params, lr=job.lr, foreach=False)
    if experts is not None:
        from profilers.expert_parallel import Optimizers

        opt = Optimizers([opt, *experts.optimizers(job.lr)])
    schedule = _pipeline_schedule(chunks, s, lay, device, mesh) if lay.pp > 1 else None
    rows = slice(r * (lay.batch // lay.dp), (r + 1) * (lay.batch // lay.dp))
    reporter = last and tp_rank == 0  # one loss per data-parallel replica
    times: list[float] = []
    losses: list[float] = []

    def batch(step: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        xs, y = make_batch(example, highs, lay.batch, job.out_shape, job.seed, step, job.dtype)
        return ([x[rows].to(device) for x in xs] if first else []), y[rows].to(device)

    def train_step(xs: list[torch.Tensor], y: torch.Tensor) -> Any:
        opt.zero_grad(set_to_none=True)
        if schedule is not None:
            loss = _pipeline_step(schedule, xs, y, last, record_loss)
        else:
            loss = _accumulated_step(stage_mod, xs, y, lay.microbatches, lay.dp > 1 and zero < 2, device,
                                     record_loss)
        if lay.pp > 1 and dp_group is not None and zero < 2:
            allreduce_grads(stage_mod, dp_group, lay.dp)
        if experts is not None:
            experts.reduce_grads()
        opt.step()
        return loss

    for step in range(job.warmup + job.steps):
        xs, y = batch(step)
        sync(device)
        t0 = time.perf_counter()
        loss = train_step(xs, y)
        sync(device)
        tt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(tt, op=dist.ReduceOp.MAX, group=group)  # the step takes as long as its slowest rank
        times.append(float(tt.item()))
        if record_loss:
            lv = torch.tensor([float(loss) / lay.dp if reporter else 0.0], dtype=torch.float64, device=device)
            dist.all_reduce(lv, group=group)
            losses.append(float(lv.item()))
    mem = torch.zeros(lay.world_size, dtype=torch.float64, device=device)
    if device.type == "cpu" and job.tensor_memory:
        from profilers.tensor_memory import LiveTensorBytes, state_tensors

        opt.zero_grad(set_to_none=True)  # a step starts without gradients
        xs, y = batch(job.warmup + job.steps)
        tracker = LiveTensorBytes().track([*state_tensors(stage_mod, opt), *xs, y])
        with tracker:  # one more step, untimed: tracking slows every op
            train_step(xs, y)
        mem[rank] = float(tracker.peak)
    else:
        mem[rank] = peak_memory(device)
    dist.all_reduce(mem, group=group)
    out: dict[str, Any] = {"times": times, "memory": mem.cpu().tolist()}
    if record_loss:
        out["losses"] = losses
    return out


def _stage_modules(job: Job, stage: int, device: torch.device, mesh: Any,
                   replica: int) -> tuple[list[nn.Module], tuple, list, Any]:
    """This rank's model chunks of the seeded model (one per chunk of pipeline stage ``stage``; one unless
    interleaved): each a Chain of its blocks, recomputed ones wrapped, tensor-parallel modules split over
    ``mesh["tp"]``, expert-parallel MoE layers keeping data-parallel replica ``replica``'s experts; also the
    model's example inputs, the inputs' index ranges and the rank's expert parameters
    (``profilers.expert_parallel.ExpertShards``, None without expert parallelism)."""
    lay = job.layout
    model, example = build_seeded_model(job.spec, job.seed, job.dtype, job.zoo)
    experts = None
    if lay.experts:
        from profilers.expert_parallel import install_experts

        experts = install_experts(model, lay.experts, replica, [int(x) for x in mesh["dp"].mesh.tolist()], lay.dp)
    blocks, highs = decompose(model)
    chunks: list[nn.Module] = []
    for c in lay.rank_chunks(stage):
        spec = lay.stages[c]
        mods = [Recompute(blocks[b].module) if b in spec.recompute
                else Recompute(blocks[b].module, selective=True) if b in spec.selective
                else blocks[b].module for b in spec.blocks]
        chunks.append(Chain(mods).to(device))
        if lay.tp > 1:
            apply_tensor_parallel(model, spec, mesh["tp"], lay.tp)
    return chunks, example, highs, experts


def shard_fully(chunk: nn.Module, dp_mesh: Any, zero: int) -> nn.Module:
    """ZeRO-2 / ZeRO-3 with FSDP2 (``torch.distributed.fsdp.fully_shard``) over the data-parallel mesh:
    each block, then the chunk. Stage 3 reshards the parameters after the forward (all-gathered again
    for the backward); stage 2 keeps them gathered from the forward through the backward (ZeRO-2's
    communication: one all-gather, one reduce-scatter per step), but like FSDP2 itself keeps them
    sharded between steps, so its memory at rest is ZeRO-3's."""
    from torch.distributed.fsdp import fully_shard

    reshard = zero >= 3
    for block in chunk.blocks:
        if any(True for _ in block.parameters()):
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(chunk, mesh=dp_mesh, reshard_after_forward=reshard)
    return chunk


def _pipeline_schedule(chunks: list[nn.Module], stage: int, lay: ExecLayout, device: torch.device, mesh: Any):
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    group = mesh["pp"].get_group()
    if lay.virtual_stages > 1:  # chunk c of the model is pipeline stage c of pp * v, on rank c % pp
        stages = [PipelineStage(mod, c, lay.pp * lay.virtual_stages, device, group=group)
                  for mod, c in zip(chunks, lay.rank_chunks(stage))]
        return ScheduleInterleaved1F1B(stages, lay.microbatches, loss_fn=mse)
    pstage = PipelineStage(chunks[0], stage, lay.pp, device, group=group)
    return (ScheduleGPipe if lay.schedule == "gpipe" else Schedule1F1B)(pstage, lay.microbatches, loss_fn=mse)


def _pipeline_step(schedule, xs: list[torch.Tensor], y: torch.Tensor, last: bool,
                   record_loss: bool) -> torch.Tensor | None:
    """One pipelined forward and backward over the microbatches; the last stage's mean loss."""
    mb_losses: list[torch.Tensor] = []
    schedule.step(*xs, target=y if last else None, losses=mb_losses if last else None, return_outputs=False)
    if not record_loss:
        return None
    return torch.stack([x.detach().float() for x in mb_losses]).mean() if last else torch.zeros(())


def _accumulated_step(module: nn.Module, xs: list[torch.Tensor], y: torch.Tensor, microbatches: int, ddp: bool,
                      device: torch.device, record_loss: bool) -> torch.Tensor | None:
    """Forward and backward of each microbatch in turn (gradient accumulation; with DDP, ``ddp``, the
    gradients are reduced only with the last one; FSDP2 reduce-scatters every microbatch's gradients and
    accumulates them sharded); the summed loss."""
    loss = torch.zeros((), device=device) if record_loss else None
    chunks = [torch.tensor_split(x, microbatches) for x in xs]
    ys = torch.tensor_split(y, microbatches)
    for j in range(microbatches):
        ctx = module.no_sync() if ddp and j < microbatches - 1 else nullcontext()
        with ctx:
            part = mse(module(*[c[j] for c in chunks]), ys[j]) / microbatches
            part.backward()
        if record_loss:
            loss = loss + part.detach()
    return loss


def free_port() -> int:
    """A free TCP port on localhost (the launchers' rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


__all__ = ["Job", "FAIL_ENV", "DTYPES", "build_seeded_model", "make_batch", "mse", "train_rank", "peak_memory",
           "allreduce_grads", "inject_failure", "free_port", "sync"]
