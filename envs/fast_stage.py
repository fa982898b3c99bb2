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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from envs.graph import OpGraph
from envs.plan import Plan
from envs.schedule_core import list_schedule, to_csr
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


def _subgraph(graph: OpGraph, keep: np.ndarray) -> OpGraph:
    pos = np.full(graph.num_nodes, -1, dtype=np.int64)
    pos[keep] = np.arange(len(keep))
    es = np.flatnonzero((pos[graph.edge_src] >= 0) & (pos[graph.edge_dst] >= 0))
    return OpGraph(
        names=[graph.names[i] for i in keep], kinds=[graph.kinds[i] for i in keep],
        module_paths=[graph.module_paths[i] for i in keep], fwd_flops=graph.fwd_flops[keep],
        bwd_flops=graph.bwd_flops[keep], param_bytes=graph.param_bytes[keep], out_bytes=graph.out_bytes[keep],
        mem_bytes=graph.mem_bytes[keep], layout_caps=graph.layout_caps[keep], n_ops=graph.n_ops[keep],
        measured={k: {"fwd": v["fwd"][keep], "bwd": v["bwd"][keep]} for k, v in graph.measured.items()},
        edge_src=pos[graph.edge_src[es]], edge_dst=pos[graph.edge_dst[es]], edge_bytes=graph.edge_bytes[es],
        edge_time=None if graph.edge_time is None else graph.edge_time[es], batch_size=graph.batch_size,
        dtype=graph.dtype, name=f"{graph.name}[stage]", meta=dict(graph.meta))


def stage_simulate(graph: OpGraph, topology: Topology, plan: Plan, ss: StageStructure, *, timeline: bool = False):
    """StepReport of ``plan`` from the stage-level pipeline model (see the module docstring)."""
    from envs.fast_sim import KIND_COMM, KIND_COMPUTE, KIND_OPT, Simulator, _Labels, simulator_for
    from envs.simulator import StepReport

    nd = topology.num_devices
    p, m = ss.p, plan.microbatches
    stage = ss.stage
    gpipe = plan.schedule == "gpipe"
    full = simulator_for(graph, topology)
    pa = full.arrays(plan, "step_time")
    mb = plan.batch(graph) // m
    Tf, Tb, tail = np.zeros(p), np.zeros(p), np.zeros(p)
    per_mb_compute, per_mb_comm = np.zeros(nd), np.zeros(nd)
    tail_compute, tail_comm = np.zeros(nd), np.zeros(nd)
    first_pos = np.zeros(p, dtype=np.int64)
    last_pos = np.zeros(p, dtype=np.int64)
    tpos = full.topo_pos
    for s in range(p):
        keep = np.flatnonzero(stage == s)
        first_pos[s] = tpos[keep].min()
        last_pos[s] = tpos[keep].max()
        sub = _subgraph(graph, keep)
        sp = plan.copy(groups=[plan.groups[i] for i in keep], layouts=[plan.layouts[i] for i in keep],
                       dp=plan.dp[keep], recompute=plan.recompute[keep], microbatches=1, global_batch=mb)
        sim = Simulator(sub, topology)
        sim.comm = full.comm  # share the collective-time cache
        r0 = sim.evaluate(sp, "step_time", timeline=True, _tail=False)
        n_s = len(keep)
        fi0 = r0.task_finish
        f_end = float(fi0[0:2 * n_s:2].max())
        b_end = float(fi0[1:2 * n_s:2].max())
        Tf[s], Tb[s] = f_end, b_end - f_end
        r = sim.evaluate(sp, "step_time", timeline=True)
        st, fi, kd = r.task_start, r.task_finish, r.task_kind
        tail[s] = max(float(fi.max()) - b_end, 0.0)
        # per-device busy time: one microbatch's step tasks, and the tail (gradient all-reduce, optimizer)
        n_step = r.num_tasks - r._n_tail
        dptr, didx = r.task_device_ptr, r.task_devices
        cnt = np.diff(dptr)
        owner = np.repeat(np.arange(r.num_tasks), cnt)
        dur = (fi - st)[owner]
        is_tail = owner >= n_step
        comm = kd[owner] == KIND_COMM
        np.add.at(per_mb_compute, didx[~is_tail & ~comm], dur[~is_tail & ~comm])
        np.add.at(per_mb_comm, didx[~is_tail & comm], dur[~is_tail & comm])
        np.add.at(tail_compute, didx[is_tail & ~comm], dur[is_tail & ~comm])
        np.add.at(tail_comm, didx[is_tail & comm], dur[is_tail & comm])
    # inter-stage transfers from the full plan's communication templates
    ku, ksig, _S, cons_ptr, cons_idx, _e0 = full._edge_groups(pa, False)
    ta = full._template_arrays()
    Xf, Xb = np.zeros(max(p - 1, 0)), np.zeros(max(p - 1, 0))
    xf_dev, xb_dev = np.zeros(nd), np.zeros(nd)
    for q in range(len(ku)):
        su = int(stage[ku[q]])
        sv = int(stage[cons_idx[cons_ptr[q]]])
        if sv == su:
            continue
        tpl = full._tpl[int(ksig[q])]
        tasks = tpl["tasks"]
        for chain, X, acc in ((tpl["f"], Xf, xf_dev), (tpl["b"], Xb, xb_dev)):
            for step in chain:
                X[su] += max(tasks[j][0] for j in step)
                for j in step:
                    for d in tasks[j][3]:
                        acc[d] += tasks[j][0]
    del ta
    # ---------------------------------------------------------------- stage-level task graph
    # Each stage's forward (backward) of a microbatch is two tasks: its compute (the sum of its ops'
    # times, on the stage's compute engine) then the rest of its critical path (the collectives that
    # do not overlap its own compute, on the stage's ports), so the engine is free for the next
    # microbatch meanwhile, as in the operator-level graph.
    # ids: Fc(s,k) = 4(s*m + k), Fx = +1, Bc = +2, Bx = +3; then Xf(s,k), Xb(s,k) for s < p-1; then tails
    Cf, Cb = np.zeros(p), np.zeros(p)
    np.add.at(Cf, stage, pa.fwd)
    np.add.at(Cb, stage, pa.bwd)
    Cf, Cb = np.minimum(Cf, Tf), np.minimum(Cb, Tb)
    N = float(graph.num_nodes + 1)
    S_, K_ = np.meshgrid(np.arange(p), np.arange(m), indexing="ij")
    S_, K_ = S_.reshape(-1), K_.reshape(-1)
    nc = 4 * p * m
    Fc = (S_ * m + K_) * 4
    Fx, Bc, Bx = Fc + 1, Fc + 2, Fc + 3
    fpos, bpos = first_pos[S_].astype(np.float64), last_pos[S_].astype(np.float64)
    if gpipe:
        pf, pb = K_ * N + fpos, m * N + K_ * N + (N - 1 - bpos)
    else:
        pf, pb = K_ * 2 * N + (N + fpos), K_ * 2 * N + (N - 1 - bpos)
    dur = np.empty(nc)
    pri = np.empty(nc)
    dur[Fc], dur[Fx], dur[Bc], dur[Bx] = Cf[S_], Tf[S_] - Cf[S_], Cb[S_], Tb[S_] - Cb[S_]
    pri[Fc], pri[Fx], pri[Bc], pri[Bx] = pf, pf, pb, pb
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
    # transfers: forward s -> s+1 after Fx(s,k), before Fc(s+1,k); backward after Bx(s+1,k), before Bc(s,k)
    nx_ = (p - 1) * m
    sel = S_ < p - 1
    xs, xk = S_[sel], K_[sel]
    xf_id = nc + np.arange(nx_)
    xb_id = nc + nx_ + np.arange(nx_)
    F_next = Fc[sel] + 4 * m
    src += [Fx[sel], xf_id, Bx[sel] + 4 * m, xb_id]
    dst += [xf_id, F_next, xb_id, Bc[sel]]
    xdur = np.concatenate([Xf[xs], Xb[xs]]) if nx_ else np.zeros(0)
    xpri = np.concatenate([pri[F_next], pri[Bc[sel]]]) if nx_ else np.zeros(0)
    # tails: after the last backward of each stage
    tail_id = nc + 2 * nx_ + np.arange(p)
    src.append((np.arange(p) * m + (m - 1)) * 4 + 3)
    dst.append(tail_id)
    nt = nc + 2 * nx_ + p
    dur = np.concatenate([dur, xdur, tail])
    pri = np.concatenate([pri, xpri, np.full(p, 1e300)])
    # resources: stage compute engines 0..p-1, send ports p..2p-1, receive ports 2p..3p-1
    counts = np.full(nt, 2, dtype=np.int64)
    counts[Fc], counts[Bc] = 1, 1
    counts[nc + 2 * nx_:] = 1
    res_ptr = np.zeros(nt + 1, dtype=np.int64)
    np.cumsum(counts, out=res_ptr[1:])
    res_idx = np.empty(int(res_ptr[-1]), dtype=np.int64)
    res_idx[res_ptr[Fc]], res_idx[res_ptr[Bc]] = S_, S_
    for ids in (Fx, Bx):
        res_idx[res_ptr[ids]], res_idx[res_ptr[ids] + 1] = p + S_, 2 * p + S_
    xo = res_ptr[nc:nc + nx_]
    res_idx[xo], res_idx[xo + 1] = p + xs, 2 * p + xs + 1
    xo = res_ptr[nc + nx_:nc + 2 * nx_]
    res_idx[xo], res_idx[xo + 1] = p + xs + 1, 2 * p + xs
    res_idx[res_ptr[nc + 2 * nx_:nt]] = np.arange(p)
    src_a = np.concatenate(src).astype(np.int64)
    dst_a = np.concatenate(dst).astype(np.int64)
    succ_ptr, succ_idx = to_csr(src_a, dst_a, nt)
    n_pred = np.bincount(dst_a, minlength=nt).astype(np.int64)
    start, finish, done = list_schedule(dur, pri, res_ptr, res_idx, succ_ptr, succ_idx, n_pred, 3 * p)
    if done != nt:  # pragma: no cover
        raise RuntimeError(f"stage model deadlock: scheduled {done} of {nt} tasks")
    makespan = float(finish.max())
    compute = per_mb_compute * m + tail_compute
    commt = per_mb_comm * m + tail_comm + (xf_dev + xb_dev) * m
    stg, pp_ = full.stages(pa)
    mem = full.memory(pa, stg, pp_)
    total = mem["total"]
    oom = [int(d) for d in np.flatnonzero(total > mem["capacity"])]
    kinds = np.concatenate([np.tile([KIND_COMPUTE, KIND_COMM, KIND_COMPUTE, KIND_COMM], p * m),
                            np.full(2 * nx_, KIND_COMM), np.full(p, KIND_OPT)])
    rep = StepReport(objective="step_time", step_time=makespan, makespan=makespan, compute_time=compute,
                     comm_time=commt, idle_time=np.maximum(makespan - compute, 0.0), peak_memory=total,
                     memory_capacity=mem["capacity"], oom=oom, memory_breakdown=mem,
                     device_names=full.device_names, num_tasks=nt, fast_path="stages")
    if timeline:
        gdev = [sorted(g) for g in ss.groups]
        owner_stage = np.concatenate([S_.repeat(4), xs, xs, np.arange(p)])
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

        rep.task_label = _Labels(labels)
    rep.stage_times = {"forward": Tf, "backward": Tb, "forward_compute": Cf, "backward_compute": Cb, "tail": tail,
                       "send": Xf, "send_grad": Xb}
    return rep
