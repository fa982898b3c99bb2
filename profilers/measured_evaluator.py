"""Measured rewards: an :class:`envs.evaluator.PlanEvaluator` that *runs* every plan it is asked about.

``MeasuredEvaluator("mlp:layers=2,...", steps=3, warmup=1, workers=2)`` keeps a **persistent pool**
of ``workers`` local processes (forkserver where the platform has it, else spawn) joined in one
``torch.distributed`` gloo group for its whole life. Each evaluation sends the plan's execution job
(:func:`profilers.execute.prepare` -> :class:`profilers.execution_layout.ExecLayout`) to every worker
over a pipe; ranks ``0 .. w-1`` of a plan that needs ``w = pp * dp * tp`` ranks run the executor's own
rank program (:func:`profilers.rank_program.train_rank`: the stage / DDP / tensor-parallel program of
the plan) on a ``(pp, dp, tp)`` :class:`~torch.distributed.device_mesh.DeviceMesh` over those ranks
(created collectively once per mesh shape and kept), timing ``warmup + steps`` SGD steps (the slowest
rank's wall time per step, as :func:`profilers.execute.execute_plan` does); ranks ``>= w`` only take
part in creating the sub-groups. No process is started per evaluation.

**Result.** ``step_time`` is the median of the timed steps. ``peak_memory`` / ``memory_capacity`` /
``oom`` come from the simulator's memory model of the plan (on CPU the measured peak RSS includes the
Python/torch baseline of each worker and says little about the plan; it is kept in
``extra["measured_peak_rss"]``, per plan device). ``extra`` also holds ``measured=True``, the timed
``step_times``, ``simulated_step_time`` and the layout (``world_size``, ``pp``, ``dp``, ``tp``).

**Refused plans** (the executor cannot run them: a pipeline cut inside a block, mixed stage shapes,
dp x tp in one stage, a layout DTensor cannot express, ...; or they need more ranks than the pool has)
do not raise: they return a flagged result so an environment never crashes mid-training —
``extra["refused"] = True`` with the executor's reason in ``extra["reason"]``, ``step_time`` = the
simulator's prediction x ``refused_factor`` (default 10), and ``oom=True`` with ``peak_memory`` set to
``refused_overflow`` (default 2) x capacity on the plan's devices, so the environment's OOM path
scores it at most ``-1 - log(refused_overflow)``. Objectives other than ``step_time`` raise
:class:`~profilers.execution_layout.ExecutionError` (only whole training steps are measured).

**Cache.** Results (measured and refused) are cached by ``(objective, graph size, plan.key())`` in a
bounded LRU: a repeated plan is not re-measured (``measurements`` counts the plans sent to the pool,
``hits`` / ``misses`` the cache).

**Failures never hang.** Every collective has ``collective_timeout`` and every evaluation a
``timeout`` deadline; a worker that raises, dies or overruns tears the whole pool down (its gloo group
is unusable after a failed collective) and raises :class:`~profilers.execution_layout.WorkerError` (an
``RlplaceError``) naming the first failing rank and its message. The next evaluation starts a fresh
pool. With ``on_worker_error="penalize"`` the failure is instead returned as a refused result
(``extra["worker_error"]``), for long unattended training. The ``RLPLACE_EXEC_FAIL_RANK`` hook of
:mod:`profilers.rank_program` (``<rank>`` raise, ``<rank>:hang`` hang) is read in the parent at every
evaluation and applied by that worker after it has joined the plan's sub-groups.

``close()`` (or leaving a ``with`` block) stops the workers.
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from collections import OrderedDict
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from profilers.execution_layout import ExecLayout, ExecutionError, WorkerError
from profilers.rank_program import FAIL_ENV, Job, free_port, inject_failure, train_rank

if TYPE_CHECKING:  # workers import this module: keep envs.graph (networkx) out of them
    from envs.evaluator import EvalResult
    from envs.graph import OpGraph
    from envs.plan import Plan
    from envs.topology import Topology

__all__ = ["MeasuredEvaluator"]

_PRELOAD = ["profilers.measured_evaluator", "profilers.rank_program", "profilers.zoo", "torch.distributed.pipelining",
            "torch.distributed.tensor.parallel", "torch.nn.parallel"]


# ---------------------------------------------------------------------------- worker side
def _mesh_for(shape: tuple[int, int, int], meshes: dict) -> tuple[Any, Any]:
    """The ``(pp, dp, tp)`` DeviceMesh over ranks ``0 .. w-1`` and a process group of those ranks;
    created collectively by every pool rank (``new_group`` needs all of them) once per shape."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    hit = meshes.get(shape)
    if hit is None:
        w = shape[0] * shape[1] * shape[2]
        mesh = DeviceMesh("cpu", torch.arange(w).reshape(shape), mesh_dim_names=("pp", "dp", "tp"))
        group = dist.new_group(list(range(w)))
        hit = meshes[shape] = (mesh, group)
    return hit


def _serve(rank: int, msg: dict[str, Any], meshes: dict) -> dict[str, Any] | None:
    """One job on this pool rank: join the plan's sub-groups, then (ranks of the plan only) run the rank
    program on its sub-mesh, times and memory only (losses are the executor's check, not measured here)."""
    job: Job = msg["job"]
    lay = job.layout
    mesh, group = _mesh_for((lay.pp, lay.dp, lay.tp), meshes)
    inject_failure(str(msg.get("fail", "")), rank)
    if rank >= lay.world_size:
        return None
    return train_rank(rank, job, torch.device("cpu"), mesh, group, record_loss=False)


def _worker_main(rank: int, world: int, port: int, conn: Any, threads: int, collective_timeout_s: float) -> None:
    """A pool worker: join the gloo group, then serve jobs from ``conn`` until ``None`` or an error."""
    import torch.distributed as dist

    torch.set_num_threads(max(1, threads))
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=collective_timeout_s))
        conn.send({"ok": True, "ready": True})
    except BaseException as exc:
        conn.send({"ok": False, "message": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        return
    meshes: dict = {}
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            try:
                conn.send({"ok": True, "result": _serve(rank, msg, meshes)})
            except BaseException as exc:  # the group's state is unknown now: report and leave
                conn.send({"ok": False, "message": f"{type(exc).__name__}: {exc}",
                           "traceback": traceback.format_exc()})
                break
    except (EOFError, OSError):  # the parent went away
        pass
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass


# ---------------------------------------------------------------------------- parent side
class _Pool:
    """``size`` worker processes in one gloo group, fed over pipes (see the module docstring)."""

    def __init__(self, size: int, threads: int, collective_timeout_s: float, start_timeout_s: float) -> None:
        import multiprocessing

        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        if method == "forkserver":
            multiprocessing.set_forkserver_preload(_PRELOAD)
        ctx = multiprocessing.get_context(method)
        self.size = size
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        port = free_port()
        try:
            for rank in range(size):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_worker_main, args=(rank, size, port, child, threads, collective_timeout_s),
                                daemon=True, name=f"rlplace-measure-{rank}")
                p.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(p)
            self._collect(start_timeout_s, "start")
        except BaseException:
            self.close()
            raise

    def _collect(self, timeout_s: float, what: str) -> list[dict[str, Any]]:
        """One reply per worker, or WorkerError (first failure, death or the deadline)."""
        from multiprocessing.connection import wait

        replies: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < self.size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(f"pool workers did not {what} within {timeout_s:.0f} s (hung or too slow); "
                                  f"ranks without a reply: {sorted(set(range(self.size)) - set(replies))}")
            pending = {r: c for r, c in enumerate(self.conns) if r not in replies}
            sentinels = {self.procs[r].sentinel: r for r in pending}
            ready = wait(list(pending.values()) + list(sentinels), timeout=min(left, 1.0))
            for obj in ready:
                if obj in sentinels:
                    continue
                r = next(k for k, c in pending.items() if c is obj)
                try:
                    msg = obj.recv()
                except (EOFError, OSError):  # it died without a word
                    self.procs[r].join(2)
                    raise WorkerError(f"rank {r} exited abnormally (exit code {self.procs[r].exitcode})") from None
                if not msg.get("ok"):
                    raise WorkerError(f"rank {r} failed: {msg.get('message')}", msg.get("traceback"))
                replies[r] = msg
            for r in pending:
                if r not in replies and not self.procs[r].is_alive() and not self.conns[r].poll():
                    raise WorkerError(f"rank {r} exited abnormally (exit code {self.procs[r].exitcode})")
        return [replies[r] for r in range(self.size)]

    def run(self, msg: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        for c in self.conns:
            c.send(msg)
        replies = self._collect(timeout_s, "finish")
        return replies[0]["result"]

    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except (OSError, ValueError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            p.join(max(0.05, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for c in self.conns:
            c.close()
        self.conns, self.procs = [], []


class MeasuredEvaluator:
    """Measured step times from a persistent pool of worker processes (see the module docstring).

    ``model_spec``: the zoo (or ``file.py:fn``) spec whose model the graphs were traced from; ``steps``
    timed steps after ``warmup`` per plan; ``workers``: the pool's world size (plans needing more ranks
    are refused); ``timeout``: seconds per evaluation (and for the pool's start);
    ``collective_timeout``: seconds per collective; ``threads``: torch threads per worker."""

    def __init__(self, model_spec: str, *, steps: int = 3, warmup: int = 1, workers: int = 2,
                 timeout: float = 120.0, collective_timeout: float = 60.0, threads: int = 1, seed: int = 0,
                 lr: float = 1e-2, dtype: str = "fp32", refused_factor: float = 10.0,
                 refused_overflow: float = 2.0, on_worker_error: str = "raise", cache_size: int = 4096) -> None:
        if steps < 1 or warmup < 0 or workers < 1:
            raise ExecutionError(f"need steps >= 1, warmup >= 0, workers >= 1; got {steps}, {warmup}, {workers}")
        if on_worker_error not in ("raise", "penalize"):
            raise ExecutionError("on_worker_error must be 'raise' or 'penalize'")
        if refused_factor <= 1 or refused_overflow <= 1:
            raise ExecutionError("refused_factor and refused_overflow must be > 1")
        self.model_spec = model_spec
        self.steps, self.warmup, self.workers = int(steps), int(warmup), int(workers)
        self.timeout, self.collective_timeout = float(timeout), float(collective_timeout)
        self.threads, self.seed, self.lr, self.dtype = int(threads), int(seed), float(lr), dtype
        self.refused_factor, self.refused_overflow = float(refused_factor), float(refused_overflow)
        self.on_worker_error = on_worker_error
        self.cache_size = int(cache_size)
        self._cache: OrderedDict[tuple, EvalResult] = OrderedDict()
        self._pool: _Pool | None = None
        self._zoo = None
        if ".py:" not in model_spec:
            from profilers.spec import parse_spec

            self._zoo = parse_spec(model_spec)
        self.hits = self.misses = self.measurements = self.refusals = 0
        self.pool_starts = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> MeasuredEvaluator:
        """Start the worker pool now (otherwise the first measurement does)."""
        if self._pool is None or not self._pool.alive():
            if self._pool is not None:
                self._pool.close()
            self._pool = None
            self._pool = _Pool(self.workers, self.threads, self.collective_timeout, self.timeout)
            self.pool_starts += 1
        return self

    def close(self) -> None:
        """Stop the worker processes (the cache stays; a later measurement starts a new pool)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> MeasuredEvaluator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, graph: OpGraph, topology: Topology, plan: Plan, objective: str = "step_time") -> EvalResult:
        if objective != "step_time":
            raise ExecutionError(f"MeasuredEvaluator measures whole training steps; objective {objective!r} "
                                 "is not supported (use step_time)")
        key = (objective, graph.num_nodes, plan.key())
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return hit
        self.misses += 1
        res = self._evaluate(graph, topology, plan, objective)
        self._cache[key] = res
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return res

    def _evaluate(self, graph: OpGraph, topology: Topology, plan: Plan, objective: str) -> EvalResult:
        import numpy as np

        from envs.errors import RlplaceError
        from envs.evaluator import EvalResult
        from envs.sim import simulate
        from profilers.execute import prepare

        sim = simulate(graph, topology, plan, objective, timeline=False, validate=False)
        try:
            _, lay, out_shape = prepare(plan, self.model_spec, graph)
            if lay.world_size > self.workers:
                raise ExecutionError(f"the plan needs {lay.world_size} ranks ({lay.describe()}) but the "
                                     f"measurement pool has {self.workers} workers")
        except RlplaceError as exc:
            return self._refused(plan, sim, str(exc))
        try:
            out = self.measure_layout(lay, out_shape)
        except WorkerError as exc:
            if self.on_worker_error == "raise":
                raise
            res = self._refused(plan, sim, f"worker error: {exc}")
            res.extra["worker_error"] = str(exc)
            return res
        rss = np.zeros(topology.num_devices)
        for rank, mem in enumerate(out["memory"]):
            d = lay.plan_device(rank)
            if d < rss.size:
                rss[d] = max(rss[d], mem)
        timed = out["times"][self.warmup:]
        return EvalResult(value=float(statistics.median(timed)),
                          peak_memory=np.asarray(sim.peak_memory, dtype=np.float64),
                          memory_capacity=np.asarray(sim.memory_capacity, dtype=np.float64), oom=bool(sim.is_oom),
                          extra={"measured": True, "refused": False, "step_times": timed,
                                 "simulated_step_time": float(sim.value), "measured_peak_rss": rss,
                                 "world_size": lay.world_size, "pp": lay.pp, "dp": lay.dp, "tp": lay.tp,
                                 "microbatches": lay.microbatches, "schedule": lay.schedule})

    def _refused(self, plan: Plan, sim: Any, reason: str) -> EvalResult:
        import numpy as np

        from envs.evaluator import EvalResult

        self.refusals += 1
        cap = np.asarray(sim.memory_capacity, dtype=np.float64)
        peak = np.asarray(sim.peak_memory, dtype=np.float64).copy()
        used = plan.devices_used()
        peak[used] = np.maximum(peak[used], self.refused_overflow * cap[used])
        return EvalResult(value=float(sim.value) * self.refused_factor, peak_memory=peak, memory_capacity=cap,
                          oom=True, extra={"measured": False, "refused": True, "reason": reason,
                                           "simulated_step_time": float(sim.value)})

    def measure_layout(self, lay: ExecLayout, out_shape: tuple[int, ...]) -> dict[str, Any]:
        """Run one prepared layout on the pool: ``{"times": [...], "memory": [...]}`` (warm-up steps
        included in ``times``). Raises WorkerError (the pool is then closed) on any worker failure."""
        if lay.world_size > self.workers:
            raise ExecutionError(f"the layout needs {lay.world_size} ranks but the pool has {self.workers}")
        self.start()
        job = Job(spec=self.model_spec, layout=lay, steps=self.steps, warmup=self.warmup, backend="gloo",
                   seed=self.seed, lr=self.lr, dtype=self.dtype, out_shape=tuple(out_shape),
                   collective_timeout_s=self.collective_timeout, threads=self.threads, zoo=self._zoo,
                  tensor_memory=False)
        self.measurements += 1
        try:
            assert self._pool is not None
            return self._pool.run({"job": job, "fail": os.environ.get(FAIL_ENV, "")}, self.timeout)
        except BaseException:
            self.close()  # a failed collective leaves the group unusable
            raise

    def clear(self) -> None:
        self._cache.clear()
        self.hits = self.misses = 0
