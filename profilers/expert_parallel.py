"""Expert parallelism on the ranks: a zoo MoE layer's experts spread over an EP group, tokens exchanged.

:func:`install_experts` replaces each expert-parallel ``profilers.zoo.MoE`` of a rank's model (the
layers :class:`profilers.execution_layout.ExpertLayout` lists) by an :class:`ExpertParallelMoE` that keeps
only this rank's experts (EP rank j of its EP group holds experts j*E/ep .. (j+1)*E/ep - 1, the
placement of ``envs.sim.cost.expert_hosts``) and runs GShard's exchange (Lepikhin et al., 2021,
Sec. 2.2; DeepSpeed-MoE, Rajbhandari et al., ICML'22): after the dense dispatch einsum each rank holds
``[E, C, d]`` for its own tokens; an ``all_to_all_single`` inside the EP group sends expert block j to EP
rank j, which runs its experts on the concatenated tokens of the group (``[ep * C, d]`` each); the reverse
all-to-all brings the outputs back before the combine einsum. gloo supports ``all_to_all_single`` in
torch 2.13 on CPU; the exchange is a small autograd Function whose backward is the same all-to-all (with
equal splits the exchange is its own inverse), not ``torch.distributed.nn.functional.all_to_all_single``
(deprecated in torch 2.13, it warns on every call).

Gradients: the expert parameters are left out of DDP; after the backward each rank sums its experts'
gradients over the experts' replicas (the same EP rank in every EP group, dp / ep ranks) and divides by
dp (each rank's expert gradient already sums the losses of its EP group's ep ranks).
:class:`ExpertShards` does that, and gives the experts' optimizer (plain SGD, or ZeRO-1 over their
replicas).

The EP and replica groups are created with ``new_group(..., use_local_synchronization=True)`` (only the
member ranks take part, so the measured evaluator's pool ranks outside the plan need not), EP groups
first and replica groups second on every rank, and kept per process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from profilers.execution_layout import ExpertLayout

_GROUPS: dict[tuple[int, tuple[int, ...]], Any] = {}


def process_group(ranks: tuple[int, ...]) -> Any:
    """The process group of the global ``ranks`` (this rank among them), created once per process and
    default group with local synchronization (only the members call it)."""
    import torch.distributed as dist

    key = (id(dist.distributed_c10d._get_default_group()), tuple(ranks))
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _GROUPS[key]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with equal splits along dim 0; its gradient is the same exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        import torch.distributed as dist

        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def exchange(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Block i of ``x`` (dim 0 in group-size equal blocks) to rank i of ``group``; block i of the result
    came from rank i. Differentiable (the backward is the same exchange)."""
    return _AllToAll.apply(x, group)


def route(moe: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(dispatch [T, E, C], combine [T, E, C], C)`` of ``profilers.zoo.MoE.forward`` for ``tokens``
    ``[T, d]``: top-k routing with a static capacity C per expert (GShard), the same ops in the same order."""
    n_tok = tokens.shape[0]
    cap = max(1, math.ceil(moe.cf * moe.topk * n_tok / moe.n))
    probs = torch.softmax(moe.router(tokens), dim=-1)
    gate, idx = torch.topk(probs, moe.topk, dim=-1)
    choice = (idx.unsqueeze(-1) == torch.arange(moe.n, device=tokens.device)).to(tokens.dtype)
    order = choice.transpose(0, 1).reshape(moe.topk * n_tok, moe.n)
    pos = (torch.cumsum(order, dim=0) - 1.0) * order
    pos = pos.reshape(moe.topk, n_tok, moe.n).transpose(0, 1)
    slot = (pos.unsqueeze(-1) == torch.arange(cap, device=tokens.device).to(tokens.dtype)).to(tokens.dtype)
    dispatch = (choice.unsqueeze(-1) * slot).sum(1)
    combine = ((choice * gate.unsqueeze(-1)).unsqueeze(-1) * slot).sum(1)
    return dispatch, combine, cap


class ExpertParallelMoE(nn.Module):
    """A zoo MoE layer with this rank's experts only (``local_experts``, experts ``first ..``), its
    tokens exchanged over ``group`` (the EP group, ``ep`` ranks) around them."""

    def __init__(self, moe: nn.Module, local: list[int], group: Any, ep: int) -> None:
        super().__init__()
        self.topk, self.n, self.cf = moe.topk, moe.n, moe.cf
        self.router = moe.router
        self.local_experts = nn.ModuleList(moe.experts[e] for e in local)
        self.first, self.ep, self.group = local[0], ep, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        tokens = x.reshape(b * t, c)
        dispatch, combine, cap = route(self, tokens)
        expert_in = torch.einsum("tec,td->ecd", dispatch, tokens)  # [E, C, d]: this rank's tokens
        got = exchange(expert_in, self.group).view(self.ep, self.n // self.ep, cap, c)  # [src, local e, C, d]
        outs = torch.stack([ex(got[:, k].reshape(self.ep * cap, c)).view(self.ep, cap, c)
                            for k, ex in enumerate(self.local_experts)], dim=1)
        expert_out = exchange(outs.reshape(self.n, cap, c), self.group)  # [E, C, d]: this rank's tokens again
        return torch.einsum("tec,ecd->td", combine, expert_out).reshape(b, t, c)


@dataclass
class ExpertShards:
    """This rank's expert parameters, by the process group of their replicas (None: one replica) and
    ZeRO stage (0 or 1), for the gradient reduction and the optimizer."""

    dp: int
    sets: list[tuple[Any, int, list[nn.Parameter]]] = field(default_factory=list)  # (replica group, zero, params)

    def params(self) -> list[nn.Parameter]:
        return [p for _, _, ps in self.sets for p in ps]

    def reduce_grads(self) -> None:
        """Sum each expert's gradients over its replicas and divide by dp (one flat all-reduce per set)."""
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        for group, _, ps in self.sets:
            grads = [p.grad for p in ps if p.grad is not None]
            if not grads:
                continue
            flat = _flatten_dense_tensors(grads)
            if group is not None:
                dist.all_reduce(flat, group=group)
            flat /= self.dp
            for g, new in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(new)

    def optimizers(self, lr: float) -> list[torch.optim.Optimizer]:
        """SGD for the experts (ZeRO-1's ``ZeroRedundancyOptimizer`` over their replicas where zero is 1)."""
        out: list[torch.optim.Optimizer] = []
        for group, zero, ps in self.sets:
            if zero == 1 and group is not None:
                from torch.distributed.optim import ZeroRedundancyOptimizer

                out.append(ZeroRedundancyOptimizer(ps, optimizer_class=torch.optim.SGD, process_group=group,
                                                   lr=lr, foreach=False))
            else:
                out.append(torch.optim.SGD(ps, lr=lr, foreach=False))
        return out


def install_experts(model: nn.Module, layers: list[ExpertLayout], replica: int, dp_ranks: list[int],
                    dp: int) -> ExpertShards:
    """Replace every expert-parallel MoE of ``model`` by its :class:`ExpertParallelMoE` for data-parallel
    replica ``replica`` (``dp_ranks``: the global ranks of the replicas, in order); returns the rank's
    expert parameters. Every rank of the data-parallel group must call it (the groups are collective)."""
    shards = ExpertShards(dp)
    groups: list[tuple[Any, Any]] = []
    for lay in layers:  # every EP group first, then every replica group: one order on every rank
        base = replica - replica % lay.ep
        groups.append((process_group(tuple(dp_ranks[base:base + lay.ep])), None))
    for i, lay in enumerate(layers):
        reps = tuple(dp_ranks[j] for j in lay.replica_group(replica))
        groups[i] = (groups[i][0], process_group(reps) if len(reps) > 1 else None)
    for lay, (ep_group, rep_group) in zip(layers, groups):
        parent_path, _, name = lay.path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        layer = ExpertParallelMoE(getattr(parent, name), lay.local_experts(replica), ep_group, lay.ep)
        setattr(parent, name, layer)
        shards.sets.append((rep_group, lay.zero, list(layer.local_experts.parameters())))
    return shards


class Optimizers:
    """Several optimizers stepped as one (the non-expert optimizer and the experts')."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def state(self) -> dict:
        return {k: v for o in self.optimizers for k, v in o.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.optimizers:
            o.step()


__all__ = ["ExpertParallelMoE", "ExpertShards", "Optimizers", "exchange", "install_experts", "process_group",
           "route"]
