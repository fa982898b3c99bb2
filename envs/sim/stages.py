"""Stage-level pipeline model: the fast path for huge pipeline-parallel plans (e.g. a 1T-parameter GPT
on 512 GPUs with 512 microbatches, ~1.9M tasks at operator level).

A plan qualifies when its pipeline stages form a chain (every edge stays in its stage or goes to the
next one; stages use disjoint devices) and the objective is the training step time. Then every
microbatch does the same work on a stage, so each stage is simulated once at operator level for one
microbatch (its ops, their tensor-parallel collectives and re-layouts, the data-parallel gradient
all-reduce and optimizer: the full task-graph builder on the stage's subgraph). That gives per stage
the forward time Tf, the backward time Tb, and the tail (gradient all-reduce and optimizer after the
last backward). The inter-stage transfers come from the same communication templates as the full
task graph (a step of parallel point-to-point sends lasts as long as its slowest send). The step is
then list-scheduled at stage level: p x m forward and backward tasks on each stage's compute engine,
the transfers on the stages' send/receive ports, with the same 1F1B / GPipe constraints and
priorities as the operator-level graph (Narayanan et al., "Efficient large-scale language model
training on GPU clusters using Megatron-LM", SC'21, Sec. 2.2: 1F1B keeps p - s microbatches in
flight on stage s; GPipe flushes).

Differences to the operator-level graph (measured in tests/test_simulator_fast.py, < 2%): inside a
stage the operator-level schedule may overlap one microbatch's tensor-parallel collectives (which
hold ports, not the compute engine) with the next microbatch's compute, and may interleave ops of
different microbatches; the stage model runs each stage's microbatch as one block. Transfers of
several tensors crossing the same boundary are serialised. Memory is computed exactly as in the full
model (it does not depend on the schedule's details).

Uses the public API of :mod:`envs.sim.compiled` (and :mod:`envs.sim.cost`, :mod:`envs.sim.schedule`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from envs.graph import OpGraph
from envs.plan import Plan
from envs.sim.compiled import CompiledSimulator, LazyLabels, PlanArrays, compiled_simulator
from envs.sim.cost import KIND_COMM, KIND_COMPUTE, KIND_OPT, StepReport
from envs.sim.schedule import list_schedule, to_csr
from envs.topology import Topology


@dataclass
class StageStructure:
    stage: np.ndarray  # stage of each node
    p: int
    groups: list[tuple[int, ...]]  # device group of each stage


def stage_structure(graph: OpGraph, plan: Plan, objective: str = "step_time") -> StageStructure | str:
    """The plan's stage chain, or a string saying why the stage model does not apply."""
    if objective != "step_time":
        return "objective is not step_time"
    if (plan.zero >= 2).any():
        return "ZeRO-2/3 synchronise gradients after every microbatch (the stage model has one tail per step)"
    if plan.virtual_stages > 1:
        return "interleaved pipeline (virtual stages): its chunks do not form a chain of stages"
    if plan.ep.max(initial=1) > 1:
        return "expert parallelism: its experts run on parts of their stage's group"
    stage, p = plan.stages(graph)
    groups: list[tuple[int, ...] | None] = [None] * p
    for v in range(graph.num_nodes):
        groups[int(stage[v])] = plan.groups[v]
    used: set[int] = set()
    for g in groups:
        if used & set(g):
            return "two pipeline stages share a device"
        used |= set(g)
    if graph.num_edges:
        d = stage[graph.edge_dst] - stage[graph.edge_src]
        if ((d != 0) & (d != 1)).any():
            return "an edge skips a pipeline stage (stages do not form a chain)"
    return StageStructure(stage=stage, p=p, groups=list(groups))


def stage_simulate(graph: OpGraph, topology: Topology, plan: Plan, ss: StageStructure, *,
                   timeline: bool = False) -> StepReport:
    """StepReport of ``plan`` from the stage-level pipeline model (see the module docstring)."""
    m = plan.microbatches
    full = compiled_simulator(graph, topology)
    pa = full.arrays(plan, "step_time")
    blocks = _stage_blocks(graph, topology, plan, ss, full)
    xfer = _boundary_transfers(full, pa, ss.stage, ss.p, topology.num_devices)
    # the compute part of each stage's block: the sum of its ops' times (at most the block)
    Cf, Cb = np.zeros(ss.p), np.zeros(ss.p)
    np.add.at(Cf, ss.stage, pa.fwd)
    np.add.at(Cb, ss.stage, pa.bwd)
    Cf, Cb = np.minimum(Cf, blocks.Tf), np.minimum(Cb, blocks.Tb)
    sg = _StageGraph(ss.p, m, plan.schedule == "gpipe", graph.num_nodes, blocks, xfer, Cf, Cb)
    start, finish = sg.schedule()
    makespan = float(finish.max())
    compute = blocks.per_mb_compute * m + blocks.tail_compute
    commt = blocks.per_mb_comm * m + blocks.tail_comm + (xfer.f_dev + xfer.b_dev) * m
    stg, pp_ = full.stages(pa)
    mem = full.memory(pa, stg, pp_)
    total = mem["total"]
    oom = [int(d) for d in np.flatnonzero(total > mem["capacity"])]
    rep = StepReport(objective="step_time", value=makespan, makespan=makespan, compute_time=compute,
                     comm_time=commt, idle_time=np.maximum(makespan - compute, 0.0), peak_memory=total,
                     memory_capacity=mem["capacity"], oom=oom, memory_breakdown=mem,
                     device_names=full.device_names, num_tasks=sg.nt, fast_path="stages")
    if timeline:
        _add_timeline(rep, sg, ss, start, finish)
    rep.stage_times = {"forward": blocks.Tf, "backward": blocks.Tb, "forward_compute": Cf, "backward_compute": Cb,
                       "tail": blocks.tail, "send": xfer.f, "send_grad": xfer.b}
    return rep


def _subgraph(graph: OpGraph, keep: np.ndarray) -> OpGraph:
    pos = np.full(graph.num_nodes, -1, dtype=np.int64)
    pos[keep] = np.arange(len(keep))
    es = np.flatnonzero((pos[graph.edge_src] >= 0) & (pos[graph.edge_dst] >= 0))
    gs = np.flatnonzero(pos[graph.gemm_node] >= 0)
    return OpGraph(
        names=[graph.names[i] for i in keep], kinds=[graph.kinds[i] for i in keep],
        module_paths=[graph.module_paths[i] for i in keep], fwd_flops=graph.fwd_flops[keep],
        bwd_flops=graph.bwd_flops[keep], param_bytes=graph.param_bytes[keep], out_bytes=graph.out_bytes[keep],
        mem_bytes=graph.mem_bytes[keep], saved_bytes=graph.saved_bytes[keep], layout_caps=graph.layout_caps[keep], n_ops=graph.n_ops[keep],
        measured={k: {"fwd": v["fwd"][keep], "bwd": v["bwd"][keep]} for k, v in graph.measured.items()},
        edge_src=pos[graph.edge_src[es]], edge_dst=pos[graph.edge_dst[es]], edge_bytes=graph.edge_bytes[es],
        edge_time=None if graph.edge_time is None else graph.edge_time[es], batch_size=graph.batch_size,
        dtype=graph.dtype, name=f"{graph.name}[stage]", meta=dict(graph.meta),
        gemm_node=pos[graph.gemm_node[gs]], gemm_shape=graph.gemm_shape[gs], gemm_kind=graph.gemm_kind[gs])


@dataclass
class _Blocks:
    """Per stage: one microbatch's forward and backward block (Tf, Tb) and the tail after the last
    backward; the topological span of its nodes; per device the busy times per microbatch and in tails."""

    Tf: np.ndarray
    Tb: np.ndarray
    tail: np.ndarray
    first_pos: np.ndarray
    last_pos: np.ndarray
    per_mb_compute: np.ndarray
    per_mb_comm: np.ndarray
    tail_compute: np.ndarray
    tail_comm: np.ndarray


def _stage_blocks(graph: OpGraph, topology: Topology, plan: Plan, ss: StageStructure,
                  full: CompiledSimulator) -> _Blocks:
    """Each stage's subgraph simulated for one microbatch at operator level, without and with the tail."""
    nd, p, m = topology.num_devices, ss.p, plan.microbatches
    mb = plan.batch(graph) // m
    z = np.zeros
    bl = _Blocks(Tf=z(p), Tb=z(p), tail=z(p), first_pos=z(p, dtype=np.int64), last_pos=z(p, dtype=np.int64),
                 per_mb_compute=z(nd), per_mb_comm=z(nd), tail_compute=z(nd), tail_comm=z(nd))
    tpos = full.topo_pos
    for s in range(p):
        keep = np.flatnonzero(ss.stage == s)
        bl.first_pos[s] = tpos[keep].min()
        bl.last_pos[s] = tpos[keep].max()
        sub = _subgraph(graph, keep)
        sp = plan.copy(groups=[plan.groups[i] for i in keep], layouts=[plan.layouts[i] for i in keep],
                       dp=plan.dp[keep], recompute=plan.recompute[keep], zero=plan.zero[keep], ep=plan.ep[keep],
                       microbatches=1,
                       global_batch=mb, virtual_stages=1)
        sim = CompiledSimulator(sub, topology, comm=full.comm)  # sharing the collective-time cache
        r0 = sim.evaluate(sp, "step_time", timeline=True, tail=False)
        n_s = len(keep)
        fi0 = r0.task_finish
        f_end = float(fi0[0:2 * n_s:2].max())
        b_end = float(fi0[1:2 * n_s:2].max())
        bl.Tf[s], bl.Tb[s] = f_end, b_end - f_end
        r = sim.evaluate(sp, "step_time", timeline=True)
        bl.tail[s] = max(float(r.task_finish.max()) - b_end, 0.0)
        _add_busy_times(r, bl)
    return bl


def _add_busy_times(r: StepReport, bl: _Blocks) -> None:
    """Per-device busy time of a stage's one-microbatch report: its step tasks, and its tail (gradient
    all-reduce and optimizer)."""
    st, fi, kd = r.task_start, r.task_finish, r.task_kind
    n_step = r.num_tasks - r.num_tail_tasks
    dptr, didx = r.task_device_ptr, r.task_devices
    cnt = np.diff(dptr)
    owner = np.repeat(np.arange(r.num_tasks), cnt)
    dur = (fi - st)[owner]
    is_tail = owner >= n_step
    comm = kd[owner] == KIND_COMM
    np.add.at(bl.per_mb_compute, didx[~is_tail & ~comm], dur[~is_tail & ~comm])
    np.add.at(bl.per_mb_comm, didx[~is_tail & comm], dur[~is_tail & comm])
    np.add.at(bl.tail_compute, didx[is_tail & ~comm], dur[is_tail & ~comm])
    np.add.at(bl.tail_comm, didx[is_tail & comm], dur[is_tail & comm])


@dataclass
class _Transfers:
    """Per stage boundary s -> s+1 the forward sends and backward gradient sends of one microbatch,
    and per device the time they keep it busy."""

    f: np.ndarray
    b: np.ndarray
    f_dev: np.ndarray
    b_dev: np.ndarray


def _boundary_transfers(full: CompiledSimulator, pa: PlanArrays, stage: np.ndarray, p: int, nd: int) -> _Transfers:
    """Inter-stage transfers from the full plan's communication templates: each step of a crossing
    lasts as long as its slowest task; crossings of one boundary add up."""
    groups = full.edge_groups(pa, False)
    x = _Transfers(f=np.zeros(max(p - 1, 0)), b=np.zeros(max(p - 1, 0)), f_dev=np.zeros(nd), b_dev=np.zeros(nd))
    for q in range(len(groups.producer)):
        su = int(stage[groups.producer[q]])
        sv = int(stage[groups.consumers[groups.cons_ptr[q]]])
        if sv == su:
            continue
        cr = full.crossing(int(groups.signature[q]))
        for chain, X, acc in ((cr.forward, x.f, x.f_dev), (cr.backward, x.b, x.b_dev)):
            for step in chain:
                X[su] += max(cr.tasks[j].duration for j in step)
                for j in step:
                    for d in cr.tasks[j].devices:
                        acc[d] += cr.tasks[j].duration
    return x


class _StageGraph:
    """The stage-level task graph. Each stage's forward (backward) of a microbatch is two tasks: its
    compute (on the stage's compute engine) then the rest of its block (the collectives that do not
    overlap its own compute, on the stage's ports), so the engine is free for the next microbatch
    meanwhile, as in the operator-level graph. Then the boundary transfers, then one tail per stage.

    Task ids: Fc(s,k) = 4(s*m + k), Fx = +1, Bc = +2, Bx = +3; then Xf(s,k), Xb(s,k) for s < p-1; then
    the tails. Resources: stage compute engines 0..p-1, send ports p..2p-1, receive ports 2p..3p-1."""

    def __init__(self, p: int, m: int, gpipe: bool, n_nodes: int, bl: _Blocks, xfer: _Transfers,
                 Cf: np.ndarray, Cb: np.ndarray):
        self.p, self.m = p, m
        S_, K_ = np.meshgrid(np.arange(p), np.arange(m), indexing="ij")
        self.S_, self.K_ = S_, K_ = S_.reshape(-1), K_.reshape(-1)
        self.nc = nc = 4 * p * m
        self.Fc = Fc = (S_ * m + K_) * 4
        self.Fx, self.Bc, self.Bx = Fc + 1, Fc + 2, Fc + 3
        self.nx = (p - 1) * m
        sel = S_ < p - 1
        self.xs, self.xk = S_[sel], K_[sel]
        self.nt = nc + 2 * self.nx + p
        pri = self._block_tasks(gpipe, float(n_nodes + 1), bl, Cf, Cb)
        self._dependencies(gpipe, sel)
        self._transfer_and_tail_tasks(sel, pri, bl, xfer)
        self._resources()

    def _block_tasks(self, gpipe, N, bl, Cf, Cb) -> np.ndarray:
        """Durations and priorities of the compute / rest-of-block tasks (the operator graph's
        priorities of the stage's first node forward and last node backward)."""
        S_, K_, m, Fc, Fx, Bc, Bx = self.S_, self.K_, self.m, self.Fc, self.Fx, self.Bc, self.Bx
        fpos, bpos = bl.first_pos[S_].astype(np.float64), bl.last_pos[S_].astype(np.float64)
        if gpipe:
            pf, pb = K_ * N + fpos, m * N + K_ * N + (N - 1 - bpos)
        else:
            pf, pb = K_ * 2 * N + (N + fpos), K_ * 2 * N + (N - 1 - bpos)
        dur = np.empty(self.nc)
        pri = np.empty(self.nc)
        Tf, Tb = bl.Tf, bl.Tb
        dur[Fc], dur[Fx], dur[Bc], dur[Bx] = Cf[S_], Tf[S_] - Cf[S_], Cb[S_], Tb[S_] - Cb[S_]
        pri[Fc], pri[Fx], pri[Bc], pri[Bx] = pf, pf, pb, pb
        self.dur, self.pri = dur, pri
        return pri

    def _dependencies(self, gpipe, sel) -> None:
        """Within a block, the pipeline schedule (GPipe flush / 1F1B in-flight limit), the transfers
        (forward s -> s+1 after Fx(s,k), before Fc(s+1,k); backward after Bx(s+1,k), before Bc(s,k)),
        and the tails after each stage's last backward."""
        S_, K_, m, p, Fc, Fx, Bc, Bx = self.S_, self.K_, self.m, self.p, self.Fc, self.Fx, self.Bc, self.Bx
        src = [Fc, Fx, Bc]
        dst = [Fx, Bc, Bx]
        if gpipe:
            src.append((S_ * m + (m - 1)) * 4 + 1)
            dst.append(Bc)
        else:
            w = p - S_
            ok = K_ >= w
            src.append(((S_ * m + K_ - w) * 4 + 3)[ok])
            dst.append(Fc[ok])
        nc, nx_ = self.nc, self.nx
        xf_id = nc + np.arange(nx_)
        xb_id = nc + nx_ + np.arange(nx_)
        F_next = Fc[sel] + 4 * m
        src += [Fx[sel], xf_id, Bx[sel] + 4 * m, xb_id]
        dst += [xf_id, F_next, xb_id, Bc[sel]]
        tail_id = nc + 2 * nx_ + np.arange(p)
        src.append((np.arange(p) * m + (m - 1)) * 4 + 3)
        dst.append(tail_id)
        self.src = np.concatenate(src).astype(np.int64)
        self.dst = np.concatenate(dst).astype(np.int64)

    def _transfer_and_tail_tasks(self, sel, pri, bl, xfer) -> None:
        """Transfers at their consumer block's priority; tails last."""
        nx_, xs, p = self.nx, self.xs, self.p
        F_next = self.Fc[sel] + 4 * self.m
        xdur = np.concatenate([xfer.f[xs], xfer.b[xs]]) if nx_ else np.zeros(0)
        xpri = np.concatenate([pri[F_next], pri[self.Bc[sel]]]) if nx_ else np.zeros(0)
        self.dur = np.concatenate([self.dur, xdur, bl.tail])
        self.pri = np.concatenate([self.pri, xpri, np.full(p, 1e300)])

    def _resources(self) -> None:
        """Compute tasks and tails hold their stage's engine; rest-of-block tasks the stage's send and
        receive ports; a transfer the sender's send port and the receiver's receive port."""
        p, nc, nx_, nt, S_, xs = self.p, self.nc, self.nx, self.nt, self.S_, self.xs
        counts = np.full(nt, 2, dtype=np.int64)
        counts[self.Fc], counts[self.Bc] = 1, 1
        counts[nc + 2 * nx_:] = 1
        res_ptr = np.zeros(nt + 1, dtype=np.int64)
        np.cumsum(counts, out=res_ptr[1:])
        res_idx = np.empty(int(res_ptr[-1]), dtype=np.int64)
        res_idx[res_ptr[self.Fc]], res_idx[res_ptr[self.Bc]] = S_, S_
        for ids in (self.Fx, self.Bx):
            res_idx[res_ptr[ids]], res_idx[res_ptr[ids] + 1] = p + S_, 2 * p + S_
        xo = res_ptr[nc:nc + nx_]
        res_idx[xo], res_idx[xo + 1] = p + xs, 2 * p + xs + 1
        xo = res_ptr[nc + nx_:nc + 2 * nx_]
        res_idx[xo], res_idx[xo + 1] = p + xs + 1, 2 * p + xs
        res_idx[res_ptr[nc + 2 * nx_:nt]] = np.arange(p)
        self.res_ptr, self.res_idx = res_ptr, res_idx

    def schedule(self) -> tuple[np.ndarray, np.ndarray]:
        nt = self.nt
        succ_ptr, succ_idx = to_csr(self.src, self.dst, nt)
        n_pred = np.bincount(self.dst, minlength=nt).astype(np.int64)
        start, finish, done = list_schedule(self.dur, self.pri, self.res_ptr, self.res_idx, succ_ptr, succ_idx,
                                            n_pred, 3 * self.p)
        if done != nt:  # pragma: no cover
            raise RuntimeError(f"stage model deadlock: scheduled {done} of {nt} tasks")
        return start, finish


def _add_timeline(rep: StepReport, sg: _StageGraph, ss: StageStructure, start, finish) -> None:
    """The stage-level tasks as the report's timeline (a stage's tasks on all its devices)."""
    p, m, nc, nx_, nt, xs, xk = sg.p, sg.m, sg.nc, sg.nx, sg.nt, sg.xs, sg.xk
    kinds = np.concatenate([np.tile([KIND_COMPUTE, KIND_COMM, KIND_COMPUTE, KIND_COMM], p * m),
                            np.full(2 * nx_, KIND_COMM), np.full(p, KIND_OPT)])
    gdev = [sorted(g) for g in ss.groups]
    owner_stage = np.concatenate([sg.S_.repeat(4), xs, xs, np.arange(p)])
    devs = [gdev[s] if i < nc or i >= nc + 2 * nx_ else sorted(set(gdev[s]) | set(gdev[s + 1]))
            for i, s in enumerate(owner_stage.tolist())]
    dptr = np.zeros(nt + 1, dtype=np.int64)
    np.cumsum([len(x) for x in devs], out=dptr[1:])
    rep.task_start, rep.task_finish, rep.task_kind = start, finish, kinds
    rep.task_device_ptr, rep.task_devices = dptr, np.fromiter((d for x in devs for d in x), dtype=np.int64)

    def labels():
        out = []
        for s in range(p):
            for k in range(m):
                out += [f"F stage{s} mb{k}", f"F comm stage{s} mb{k}", f"B stage{s} mb{k}",
                        f"B comm stage{s} mb{k}"]
        out += [f"send stage{s}->{s + 1} mb{k}" for s, k in zip(xs.tolist(), xk.tolist())]
        out += [f"send grad stage{s + 1}->{s} mb{k}" for s, k in zip(xs.tolist(), xk.tolist())]
        out += [f"grad sync + optimizer stage{s}" for s in range(p)]
        return out

    rep.task_label = LazyLabels(labels)
