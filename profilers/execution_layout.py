"""Translate a Plan into its execution layout: blocks, pipeline stages, rank mesh, TP styles.

:func:`analyze` checks that a plan can run and returns the :class:`ExecLayout` that
:mod:`profilers.rank_program` runs on every rank (launched by :mod:`profilers.execute` or the
measured evaluator's pool).

A model is executed as a chain of **blocks** (its top-level sequence: for ``gpt`` and ``moe`` the
embeddings, each ``layers.N`` and the final norm + head; for ``mlp`` each ``layers.N`` and ``head``;
for ``bert`` the embeddings, each layer and the pooler; for ``resnet`` each layer of the stem, each
residual block ``stages.S.B`` and the pooling head; for a top-level ``nn.Sequential`` (e.g. a
``file.py:build_fn`` spec) its children). Other models (``gnmt``, ``inception``, ``unet``) are
refused. Graph nodes are
mapped to blocks through their module paths (nodes without one, e.g. a top-level ``add`` or an
input, belong to the block of the node before them in topological order, or the first block).

Which plans run (everything else is refused with an :class:`ExecutionError` that says why):

* **stages**: the plan's pipeline stages (``Plan.stages``: distinct device groups in topological
  order) must cut only *between* blocks, each block on one stage, stages in block order, and no
  device in two stages. ``pp`` = number of stages.
* **every stage has the same shape** ``dp x tp`` (the same group size and data-parallel degree for
  all its nodes); ranks form a ``(pp, dp, tp)`` mesh, rank ``s*dp*tp + r*tp + t`` running device
  ``group_s[r*tp + t]`` of stage ``s`` (the plan's dp-major order).
* **data parallel** (``dp > 1``, ``tp == 1``): each replica gets a contiguous ``batch / dp`` slice
  of the global batch; DDP over the replicas without pipeline stages, and with them one flat
  gradient all-reduce per stage over its replicas after the pipeline schedule.
* **ZeRO** (``Plan.zero``, over a stage's data-parallel replicas; one value for all weighted nodes of
  a pipeline stage, else refused naming the nodes; stage > 0 needs ``dp >= 2``). Stage 1:
  ``torch.distributed.optim.ZeroRedundancyOptimizer`` around the SGD optimizer (each replica keeps
  the optimizer state of and updates its share of the parameters, then broadcasts them), beside DDP,
  or beside the flat all-reduce with pipeline stages. Stages 2 and 3: FSDP2
  (``torch.distributed.fsdp.fully_shard`` on each block, then on the stage's chunk, over the stage's
  dp mesh; also inside ``torch.distributed.pipelining``, with and without interleaving); gradients
  are reduce-scattered (with ``pp == 1`` after every microbatch, accumulated sharded). Stage 3
  reshards the parameters after the forward (all-gathered again for the backward); stage 2 keeps
  them gathered from the forward to the backward (``reshard_after_forward=False``: ZeRO-2's
  communication, one all-gather and one reduce-scatter per step), but FSDP2 keeps parameters
  sharded *between* steps, so its memory at rest is ZeRO-3's, not ZeRO-2's full replica.
* **tensor parallel** (``tp > 1``, ``dp == 1``): DTensor ``parallelize_module`` on the stage's
  blocks. ``col_split`` / ``row_split`` on nodes with weights need an ``nn.Linear`` (or
  ``nn.Embedding``) at the node's module path, with the split dimension divisible by ``tp``;
  weightless ``col_split`` nodes must be elementwise activations between a column and a row split,
  or the attention core of ``profilers.zoo.SelfAttention`` (``qkv`` col, ``out`` row; heads
  divisible by tp; the executor regroups ``qkv``'s rows so each rank holds whole heads). A column
  split whose consumers (after elementwise col_split ops) are not split is gathered right away
  (``output_layouts=Replicate``; the elementwise ops then run replicated); a row split fed
  by a replicated tensor shards it first (``input_layouts=Replicate``). Column-split tensors never
  cross a pipeline-stage boundary. Everything else runs replicated.
* **sequence parallel** (``seq_split``, inside a tensor-parallel stage; zoo ``gpt`` / ``moe`` / ``bert``
  models, activations ``[batch, seq, hidden]``, the sequence divisible by tp): a region of
  ``seq_split`` ops on 1/tp of the sequence, entered from row splits whose partial sums are
  reduce-scattered along the sequence (``RowwiseParallel`` with a sequence-sharded output; an
  embedding's too: ``wte`` / ``wpe`` of gpt) in place of the all-reduce, and left into column-split
  Linears that all-gather it (``ColwiseParallel(input_layouts=Shard(1))``). Norms with weights
  (``nn.LayerNorm`` / ``nn.RMSNorm``) run as DTensor ``SequenceParallel`` (their weight gradients summed
  over the group); weightless ``seq_split`` ops must be token-wise (residual adds, dropout,
  activations). Model inputs marked ``seq_split`` (token ids) are given whole to every rank. A
  sequence-split tensor may cross a pipeline-stage boundary (each tp rank sends its shard to the same
  tp rank of the next stage), must not feed a replicated op, a row split or the model's output, nor be
  read in part (e.g. bert's pooler on token 0). The model's output is whole (gathered) on every tp
  rank, so the loss needs no 1/tp scaling.
* ``dp > 1`` together with ``tp > 1`` in one stage is refused (no 2-D DDP x TP).
* **pipeline** (``pp > 1``): ``torch.distributed.pipelining`` ``PipelineStage`` +
  ``ScheduleGPipe`` / ``Schedule1F1B`` with the plan's microbatches (1F1B needs
  ``microbatches >= pp``). With ``pp == 1`` microbatches are gradient-accumulation steps.
* **interleaved pipeline** (``Plan.virtual_stages`` = v > 1, ``Plan.chunks``): ``pp * v`` model chunks,
  each a contiguous run of whole blocks, chunk ``c`` on pipeline stage ``c % pp`` (each rank owns
  chunks ``r, r + pp, ...``, one ``PipelineStage`` each) under ``ScheduleInterleaved1F1B``. Needs the
  1f1b schedule, ``pp >= 2`` and (torch 2.13) the microbatches a multiple of
  ``max(1, microbatches // pp)`` (the plan itself asks for a multiple of pp).
* **recompute**: a block is recomputed when any of its nodes is marked: *selectively* when the
  marked nodes are exactly the block's attention-core nodes (``envs.plan.attention_core``; the plan's
  ``recompute="selective"``): non-reentrant ``torch.utils.checkpoint`` with a selective-checkpoint
  context (``create_selective_checkpoint_contexts``) whose policy recomputes the attention core's ops
  (SDPA kernels, softmax, dropout, activation ``bmm``) and saves every other op's output; otherwise the
  whole block (non-reentrant ``torch.utils.checkpoint``).
* **expert parallel** (``Plan.ep`` > 1 on the experts of a mixture-of-experts layer): zoo ``MoE`` layers
  only (``profilers.zoo.MoE``: dense dispatch and combine einsums), one degree per layer dividing dp
  and the layer's experts, EP rank j of each EP group (``ep`` consecutive data-parallel replicas)
  holding experts ``j*E/ep .. (j+1)*E/ep - 1`` (``envs.sim.cost.expert_hosts``); tokens exchanged with
  ``all_to_all_single`` (:mod:`profilers.expert_parallel`), the experts' gradients reduced over their
  own replicas. Refused: with pipeline stages (pp > 1), ZeRO-2/3 (FSDP2 would shard a rank's own
  experts over the whole data-parallel group), ZeRO-1 on experts with a single replica, placements
  other than the one above.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from envs.errors import RlplaceError

if TYPE_CHECKING:  # workers import this module: keep it light (no networkx through envs.graph)
    from envs.graph import OpGraph
    from envs.plan import Plan

ELEMENTWISE_KINDS = frozenset({"relu", "gelu", "silu", "tanh", "sigmoid", "act", "dropout"})
# weightless ops that run token by token on a sequence shard (seq_split): residual adds, dropout, activations
TOKENWISE_KINDS = ELEMENTWISE_KINDS | {"add", "sub", "mul", "residual"}


class ExecutionError(RlplaceError):
    """A plan cannot be executed as such, or its execution failed (the message says which and why)."""


class WorkerError(ExecutionError):
    """A worker process crashed, hung past its timeout, or exited abnormally; ``worker_traceback``
    holds the failing worker's traceback when it left one."""

    def __init__(self, message: str, worker_traceback: str | None = None) -> None:
        super().__init__(message)
        self.worker_traceback = worker_traceback


# ---------------------------------------------------------------------------- blocks
class Chain(nn.Module):
    """Blocks run one after the other; the first may take several inputs, the rest take one."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](*args)
        for b in self.blocks[1:]:
            x = b(x)
        return x


_ATTENTION_CORE_OPS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                       "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                       "_scaled_dot_product_attention_math", "scaled_dot_product_attention", "_softmax", "softmax",
                       "native_dropout", "dropout", "bmm", "baddbmm")


def selective_policy(ctx, op, *args, **kwargs):
    """Selective recomputation (Korthikanti et al. 2022): recompute the attention core's aten ops (fused
    SDPA kernels, softmax, dropout, ``bmm`` / ``baddbmm``: QK^T and attention over values) in the
    backward, save every other op's output (projections, norms, MLP). ``bmm`` occurs only for activation
    x activation products here: a Linear on a 3-D input runs ``mm`` / ``addmm``."""
    from torch.utils.checkpoint import CheckpointPolicy

    name = getattr(getattr(op, "overloadpacket", op), "__name__", "")
    return CheckpointPolicy.PREFER_RECOMPUTE if name in _ATTENTION_CORE_OPS else CheckpointPolicy.MUST_SAVE


class Recompute(nn.Module):
    """Activation recomputation of one block (non-reentrant ``torch.utils.checkpoint``): the whole
    block (``selective=False``), or only its attention core (``selective=True``: a selective
    checkpoint context with :func:`selective_policy`)."""

    def __init__(self, inner: nn.Module, selective: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.selective = selective

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        import functools

        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        if self.selective:
            return checkpoint(self.inner, *args, use_reentrant=False,
                              context_fn=functools.partial(create_selective_checkpoint_contexts, selective_policy))
        return checkpoint(self.inner, *args, use_reentrant=False)


class _GPTEmbed(nn.Module):
    def __init__(self, wte: nn.Module, wpe: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


class _BERTEmbed(nn.Module):
    def __init__(self, tok: nn.Module, pos: nn.Module, typ: nn.Module, ln: nn.Module) -> None:
        super().__init__()
        self.tok, self.pos, self.typ, self.ln = tok, pos, typ, ln

    def forward(self, idx: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        return self.ln(self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)) + self.typ(types))


class _BERTPool(nn.Module):
    def __init__(self, pooler: nn.Module) -> None:
        super().__init__()
        self.pooler = pooler

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.pooler(x[:, 0]))


class _MLPLayer(nn.Module):
    def __init__(self, layer: nn.ModuleDict) -> None:
        super().__init__()
        self.fc, self.act = layer["fc"], layer["act"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class _ResNetHead(nn.Module):
    def __init__(self, pool: nn.Module, fc: nn.Module) -> None:
        super().__init__()
        self.pool, self.fc = pool, fc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(x), 1))


@dataclass
class Block:
    """One block of the model's top-level sequence and the module-path prefixes it owns."""

    name: str
    module: nn.Module
    prefixes: tuple[str, ...]


def decompose(model: nn.Module) -> tuple[list[Block], list[int | None]]:
    """The model as a chain of blocks (same forward as ``model``), plus for each model input the
    exclusive upper bound of its integer values (``None``: a float input)."""
    from profilers import zoo

    if isinstance(model, zoo.GPT):
        blocks = [Block("embed", _GPTEmbed(model.wte, model.wpe), ("wte", "wpe"))]
        blocks += [Block(f"layers.{i}", m, (f"layers.{i}",)) for i, m in enumerate(model.layers)]
        blocks.append(Block("head", nn.Sequential(model.ln_f, model.lm_head), ("ln_f", "lm_head")))
        return blocks, [model.wte.num_embeddings]
    if isinstance(model, zoo.BERT):
        blocks = [Block("embed", _BERTEmbed(model.tok, model.pos, model.typ, model.ln_emb),
                        ("tok", "pos", "typ", "ln_emb"))]
        blocks += [Block(f"layers.{i}", m, (f"layers.{i}",)) for i, m in enumerate(model.layers)]
        blocks.append(Block("pooler", _BERTPool(model.pooler), ("pooler",)))
        return blocks, [model.tok.num_embeddings, 1]
    if isinstance(model, zoo.MLP):
        blocks = [Block(f"layers.{i}", _MLPLayer(m), (f"layers.{i}",)) for i, m in enumerate(model.layers)]
        blocks.append(Block("head", model.head, ("head",)))
        return blocks, [None]
    if isinstance(model, zoo.ResNet):
        blocks = [Block(f"stem.{i}", m, (f"stem.{i}",)) for i, m in enumerate(model.stem)]
        for s, stage in enumerate(model.stages):
            blocks += [Block(f"stages.{s}.{b}", m, (f"stages.{s}.{b}",)) for b, m in enumerate(stage)]
        blocks.append(Block("head", _ResNetHead(model.pool, model.fc), ("pool", "fc")))
        return blocks, [None]
    if isinstance(model, nn.Sequential):
        return [Block(name, m, (name,)) for name, m in model.named_children()], [None]
    raise ExecutionError(f"cannot execute a {type(model).__name__}: the executor knows the block sequence of "
                         "zoo gpt, bert, mlp, resnet and of top-level nn.Sequential models")


def node_blocks(graph: OpGraph, blocks: list[Block]) -> np.ndarray:
    """Block index of every graph node, by module path prefix (see the module docstring)."""
    out = np.full(graph.num_nodes, -1, dtype=np.int64)
    prev = 0
    for v in graph.topological_order().tolist():
        path = graph.module_paths[v]
        hit = -1
        if graph.kinds[v] != "input" and path:
            for b, blk in enumerate(blocks):
                if any(path == p or path.startswith(p + ".") for p in blk.prefixes):
                    hit = b
                    break
        out[v] = hit if hit >= 0 else (prev if graph.kinds[v] != "input" else 0)
        prev = int(out[v])
    return out


# ---------------------------------------------------------------------------- layout
@dataclass
class StageLayout:
    """One pipeline stage (with interleaving: one model chunk): its plan device group, blocks, ZeRO
    stage, recomputation and tensor-parallel styles."""

    index: int
    devices: tuple[int, ...]
    blocks: list[int]
    recompute: list[int] = field(default_factory=list)  # blocks recomputed whole
    # module path -> style: "col" (sharded output), "col_gather", "row" (sharded input), "row_rep"; with
    # sequence parallelism also "seq" (a SequenceParallel norm), "col_seq" / "col_gather_seq" (the input
    # all-gathered from sequence shards), "row_seq" / "row_rep_seq" (the output reduce-scattered to them)
    tp_styles: dict[str, str] = field(default_factory=dict)
    attention: list[str] = field(default_factory=list)  # SelfAttention paths with whole heads per rank
    selective: list[int] = field(default_factory=list)  # blocks whose attention core only is recomputed
    zero: int = 0  # ZeRO stage over the stage's data-parallel replicas


@dataclass
class ExpertLayout:
    """One expert-parallel mixture-of-experts layer (a zoo ``MoE`` at ``path``): its ``experts`` split over
    EP groups of ``ep`` consecutive data-parallel replicas, ``hosts[e]`` the replicas holding expert e
    (``envs.sim.cost.expert_hosts``: EP rank j of every EP group holds experts j*E/ep .. (j+1)*E/ep - 1),
    ``zero`` the ZeRO stage (0 or 1) of its experts over their replicas."""

    path: str
    ep: int
    experts: int
    hosts: list[tuple[int, ...]]
    zero: int = 0

    def local_experts(self, replica: int) -> list[int]:
        """The experts data-parallel replica ``replica`` keeps (and computes for its EP group)."""
        return [e for e, h in enumerate(self.hosts) if replica in h]

    def replica_group(self, replica: int) -> list[int]:
        """The replicas holding the same experts as ``replica`` (its expert-data-parallel group)."""
        return list(self.hosts[self.local_experts(replica)[0]])


@dataclass
class ExecLayout:
    """How a plan runs: ``pp x dp x tp`` ranks, its stages (``pp * virtual_stages`` model chunks when
    interleaved: chunk ``c`` on pipeline rank ``c % pp``), microbatches and schedule."""

    pp: int
    dp: int
    tp: int
    stages: list[StageLayout]
    microbatches: int
    schedule: str
    batch: int
    num_blocks: int
    virtual_stages: int = 1
    experts: list[ExpertLayout] = field(default_factory=list)  # the expert-parallel MoE layers

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(pipeline stage, dp replica, tp rank)`` of a global rank."""
        s, rest = divmod(rank, self.dp * self.tp)
        r, t = divmod(rest, self.tp)
        return s, r, t

    def rank_chunks(self, stage: int) -> list[int]:
        """The model chunks (indices into ``stages``) pipeline stage ``stage`` runs: ``stage + k * pp``."""
        return [stage + k * self.pp for k in range(self.virtual_stages)]

    def plan_device(self, rank: int) -> int:
        s, r, t = self.coords(rank)
        return self.stages[s].devices[r * self.tp + t]

    @property
    def zero(self) -> list[int]:
        """The ZeRO stage of each pipeline stage."""
        return [self.stages[s].zero for s in range(self.pp)]

    def describe(self) -> str:
        parts = [f"pp={self.pp} dp={self.dp} tp={self.tp}", f"{self.microbatches} microbatch(es)"]
        if self.pp > 1:
            parts.append(self.schedule if self.virtual_stages == 1
                         else f"interleaved 1f1b, {self.virtual_stages} virtual stages")
        if any(self.zero):
            parts.append("ZeRO " + "/".join(str(z) for z in self.zero))
        if any(st.selective for st in self.stages):
            parts.append("selective recompute")
        if any(s == "seq" or s.endswith("_seq") for st in self.stages for s in st.tp_styles.values()):
            parts.append("sequence parallel")
        if self.experts:
            parts.append("expert parallel ep=" + "/".join(sorted({str(x.ep) for x in self.experts})))
        return ", ".join(parts)


def _module_at(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path) if path else None
    except AttributeError:
        return None


def analyze(plan: Plan, graph: OpGraph, model: nn.Module) -> ExecLayout:
    """Check that ``plan`` (for ``graph``, traced from ``model``) can run, and say how."""
    if plan.num_nodes != graph.num_nodes:
        raise ExecutionError(f"the plan has {plan.num_nodes} nodes but the model's graph {graph.name!r} has "
                             f"{graph.num_nodes}: the plan was made for a different model")
    n = graph.num_nodes
    batch = plan.batch(graph)
    m = plan.microbatches
    if m < 1 or batch % m:
        raise ExecutionError(f"global batch {batch} does not split into {m} microbatches")
    blocks, _ = decompose(model)
    nb = node_blocks(graph, blocks)
    stage_of, pp = plan.stages(graph)
    vs = int(getattr(plan, "virtual_stages", 1) or 1)
    if vs < 1:
        raise ExecutionError(f"virtual_stages must be >= 1, got {vs}")
    # the units blocks are assigned to: pipeline stages, or with interleaving the model chunks
    unit_of, n_units, what = stage_of, pp, "stage"
    if vs > 1:
        unit_of, _ = plan.chunks(graph)
        n_units, what = int(unit_of.max()) + 1, "chunk"
        _check_interleaving(plan, graph, stage_of, unit_of, n_units, pp, vs, m)
    # each block in one unit, units in block order
    block_unit = np.full(len(blocks), -1, dtype=np.int64)
    for v in range(n):
        b, s = int(nb[v]), int(unit_of[v])
        if block_unit[b] >= 0 and block_unit[b] != s:
            others = [graph.names[u] for u in range(n) if nb[u] == b and unit_of[u] != s][:3]
            raise ExecutionError(f"the plan cuts inside block {blocks[b].name!r} (node {graph.names[v]!r} on "
                                 f"{what} {s}, {', '.join(repr(o) for o in others)} on {what} {block_unit[b]}); "
                                 "the executor splits pipeline stages only between blocks: "
                                 + ", ".join(blk.name for blk in blocks))
        block_unit[b] = s
    for b in range(len(blocks)):  # a block no node maps to rides with the block before it
        if block_unit[b] < 0:
            block_unit[b] = block_unit[b - 1] if b else 0
    if np.any(np.diff(block_unit) < 0) or len(set(block_unit.tolist())) != n_units:
        raise ExecutionError(f"the plan's {what}s are not contiguous in block order (block -> {what}: "
                             f"{dict(zip((blk.name for blk in blocks), block_unit.tolist()))}); the executor "
                             "runs only linear pipelines")
    groups: list[tuple[int, ...]] = [()] * pp
    for v in range(n):
        groups[int(stage_of[v])] = plan.groups[v]
    seen: dict[int, int] = {}
    for s, g in enumerate(groups):
        for d in g:
            if d in seen:
                raise ExecutionError(f"device {d} serves pipeline stages {seen[d]} and {s}; the executor needs "
                                     "disjoint device groups per stage")
            seen[d] = s
    dps = {int(plan.dp[v]) for v in range(n)}
    sizes = {len(g) for g in groups}
    if len(dps) != 1 or len(sizes) != 1:
        raise ExecutionError(f"stages differ in shape (group sizes {sorted(sizes)}, dp degrees {sorted(dps)}); the "
                             "executor needs the same dp x tp on every stage and node")
    dp = dps.pop()
    width = sizes.pop()
    tp = width // dp
    if dp > 1 and tp > 1:
        raise ExecutionError(f"dp={dp} combined with tp={tp} in one stage is not supported by the executor "
                             "(pure data or pure tensor parallelism per stage)")
    if (batch // m) % dp:
        raise ExecutionError(f"microbatch of {batch // m} samples does not split over dp={dp}")
    if plan.schedule not in ("gpipe", "1f1b"):
        raise ExecutionError(f"unknown schedule {plan.schedule!r}")
    if pp > 1 and vs == 1 and plan.schedule == "1f1b" and m < pp:
        raise ExecutionError(f"1f1b needs at least as many microbatches as stages ({m} < {pp}); use gpipe or more "
                             "microbatches")
    stages = [StageLayout(c, groups[c % pp], [b for b in range(len(blocks)) if block_unit[b] == c])
              for c in range(n_units)]
    _recompute(plan, graph, nb, block_unit, stages)
    in_ep = _expert_parallel_nodes(plan, graph)
    for s, z in enumerate(_zero_stages(plan, graph, stage_of, pp, dp, in_ep)):
        for c in range(s, n_units, pp):
            stages[c].zero = z
    experts = _expert_layouts(plan, graph, model, in_ep, pp, dp, stages[0].zero) if in_ep.any() else []
    if tp > 1:
        _TensorParallelLayout(plan, graph, model, unit_of, stages, tp).fill()
    else:
        bad = [v for v in range(n) if plan.layouts[v] == "seq_split"
               or (plan.layouts[v] in ("col_split", "row_split") and width > 1)]
        if bad:
            raise ExecutionError(f"node {graph.names[bad[0]]!r} is {plan.layouts[bad[0]]} but its stage has tp=1")
    return ExecLayout(pp=pp, dp=dp, tp=tp, stages=stages, microbatches=m, schedule=plan.schedule, batch=batch,
                      num_blocks=len(blocks), virtual_stages=vs, experts=experts)


def _check_interleaving(plan: Plan, graph: OpGraph, stage_of: np.ndarray, chunk_of: np.ndarray, n_chunks: int,
                        pp: int, vs: int, m: int) -> None:
    """Interleaved 1F1B (``torch.distributed.pipelining.ScheduleInterleaved1F1B``): ``vs`` chunks per
    pipeline stage, chunk ``c`` on stage ``c % pp``, and torch 2.13's microbatch rule."""
    if pp < 2:
        raise ExecutionError(f"virtual_stages={vs} (interleaving) needs pipeline parallelism, but the plan has "
                             "one pipeline stage")
    if plan.schedule != "1f1b":
        raise ExecutionError(f"virtual_stages={vs} (interleaving) runs only with the 1f1b schedule "
                             f"(ScheduleInterleaved1F1B), not {plan.schedule!r}")
    if n_chunks != pp * vs:
        raise ExecutionError(f"virtual_stages={vs}: the plan's {n_chunks} model chunks are not {vs} chunks on each "
                             f"of its {pp} pipeline stages")
    for v in range(graph.num_nodes):
        c = int(chunk_of[v])
        if int(stage_of[v]) != c % pp:
            raise ExecutionError(f"interleaving: model chunk {c} (node {graph.names[v]!r}) is on pipeline stage "
                                 f"{int(stage_of[v])}, but interleaved 1F1B runs chunk c on stage c % {pp} = "
                                 f"{c % pp} (the chunks must visit the stages in turn)")
    rounds = max(1, m // pp)
    if m % rounds:
        raise ExecutionError(f"interleaved 1f1b: torch's ScheduleInterleaved1F1B needs the microbatches ({m}) to "
                             f"be a multiple of max(1, microbatches // pp) = {rounds}; use a multiple of pp={pp}")


def _recompute(plan: Plan, graph: OpGraph, nb: np.ndarray, block_unit: np.ndarray,
               stages: list[StageLayout]) -> None:
    """Per block: nothing flagged, nothing recomputed; exactly its attention-core nodes flagged
    (``envs.plan.attention_core``), selective recomputation; anything else flagged, the whole block."""
    from envs.plan import attention_core

    core = attention_core(graph)
    for b in range(int(nb.max()) + 1 if nb.size else 0):
        nodes = np.flatnonzero(nb == b)
        flagged = nodes[plan.recompute[nodes]]
        if not flagged.size:
            continue
        st = stages[int(block_unit[b])]
        in_core = nodes[core[nodes]]
        if in_core.size < nodes.size and np.array_equal(flagged, in_core):
            st.selective.append(b)
        else:
            st.recompute.append(b)


def _zero_stages(plan: Plan, graph: OpGraph, stage_of: np.ndarray, pp: int, dp: int,
                 skip: np.ndarray | None = None) -> list[int]:
    """The ZeRO stage of each pipeline stage: one value over its weighted nodes (but the ``skip`` ones:
    expert-parallel experts, sharded over their own replicas, :func:`_expert_layouts`)."""
    out = []
    zero = getattr(plan, "zero", None)
    for s in range(pp):
        nodes = [v for v in range(graph.num_nodes) if stage_of[v] == s and graph.param_bytes[v] > 0
                 and (skip is None or not skip[v])]
        by_stage: dict[int, str] = {}
        for v in nodes:
            by_stage.setdefault(int(zero[v]) if zero is not None else 0, graph.names[v])
        if len(by_stage) > 1:
            raise ExecutionError(f"pipeline stage {s} mixes ZeRO stages ("
                                 + ", ".join(f"{name!r} zero={z}" for z, name in sorted(by_stage.items()))
                                 + "); the executor shards a stage's model states as a whole, so all weighted "
                                 "nodes of a stage need one ZeRO stage")
        z = next(iter(by_stage), 0)
        if z not in (0, 1, 2, 3):
            raise ExecutionError(f"node {by_stage[z]!r}: ZeRO stage {z} is not 0, 1, 2 or 3")
        if z and dp < 2:
            raise ExecutionError(f"node {by_stage[z]!r}: ZeRO stage {z} needs data parallelism (dp >= 2), "
                                 f"but pipeline stage {s} has dp={dp}")
        out.append(z)
    return out


def _expert_parallel_nodes(plan: Plan, graph: OpGraph) -> np.ndarray:
    """Per node: an expert of a layer with expert-parallel degree > 1 (``Plan.ep``)."""
    ep = getattr(plan, "ep", None)
    if ep is None or int(np.max(ep, initial=1)) <= 1:
        return np.zeros(graph.num_nodes, dtype=bool)
    from envs.plan import expert_layers

    layer = expert_layers(graph)[0]
    on = np.zeros(graph.num_nodes, dtype=bool)
    for L in {int(x) for x in layer[(ep > 1) & (layer >= 0)]}:
        on |= layer == L
    if ((ep > 1) & ~on).any():
        v = int(np.flatnonzero((ep > 1) & ~on)[0])
        raise ExecutionError(f"node {graph.names[v]!r} is not an expert, but has expert-parallel degree {int(ep[v])}")
    return on


def _expert_layouts(plan: Plan, graph: OpGraph, model: nn.Module, in_ep: np.ndarray, pp: int, dp: int,
                    stage_zero: int) -> list[ExpertLayout]:
    """The expert-parallel MoE layers: zoo ``MoE`` modules, one ep per layer dividing dp and the experts,
    without pipeline stages or ZeRO-2/3, their experts placed as ``envs.sim.cost.expert_hosts`` says."""
    from envs.plan import expert_layers
    from envs.sim.cost import expert_hosts
    from profilers.zoo import MoE

    ep_max = int(plan.ep[in_ep].max())
    if pp > 1:
        raise ExecutionError(f"expert parallelism (ep={ep_max}) with pipeline parallelism (pp={pp}) is not supported "
                             "by the executor: the experts' all-to-alls and replica-group gradient reduction run "
                             "only in the non-pipelined data-parallel program; use pp=1")
    if stage_zero >= 2:
        raise ExecutionError(f"expert parallelism (ep={ep_max}) with ZeRO stage {stage_zero} is not supported by the "
                             "executor: FSDP2 would shard each rank's own experts over the whole data-parallel "
                             "group, not over each expert's replicas; use ZeRO stage 0 or 1")
    layer, index, _ = expert_layers(graph)
    hosts = expert_hosts(graph, plan)
    out = []
    for L in sorted({int(x) for x in layer[in_ep]}):
        members = np.flatnonzero(layer == L)
        v0 = int(members[0])
        path = graph.module_paths[v0].rsplit(".experts.", 1)[0]
        mod = _module_at(model, path)
        if not isinstance(mod, MoE):
            raise ExecutionError(f"node {graph.names[v0]!r}: expert parallelism runs only on zoo MoE layers "
                                 f"(profilers.zoo.MoE: dense dispatch and combine), not on module {path!r} "
                                 f"({type(mod).__name__})")
        eps = {int(plan.ep[v]) for v in members}
        if len(eps) > 1:
            raise ExecutionError(f"the experts of {path!r} differ in expert-parallel degree ({sorted(eps)}); "
                                 "a layer's experts are spread over one EP group size")
        ep = eps.pop()
        if dp % ep or mod.n % ep:
            raise ExecutionError(f"{path!r}: expert-parallel degree {ep} must divide dp={dp} and the layer's "
                                 f"{mod.n} experts")
        zeros = {int(plan.zero[v]) for v in members if graph.param_bytes[v] > 0}
        if len(zeros) > 1:
            raise ExecutionError(f"the experts of {path!r} mix ZeRO stages {sorted(zeros)}")
        zero = zeros.pop() if zeros else 0
        if zero >= 2:
            raise ExecutionError(f"{path!r}: ZeRO stage {zero} on expert-parallel experts is not supported by the "
                                 "executor (FSDP2 over each expert's replicas); use ZeRO stage 0 or 1")
        if zero and dp // ep < 2:
            raise ExecutionError(f"{path!r}: ZeRO stage {zero} needs at least 2 replicas of each expert, but "
                                 f"dp={dp} with ep={ep} keeps one")
        group = plan.groups[v0]
        per_expert: list[tuple[int, ...]] = [()] * mod.n
        for v in members.tolist():
            per_expert[int(index[v])] = tuple(group.index(d) for d in hosts[v])
        per = mod.n // ep
        want = [tuple(q * ep + e // per for q in range(dp // ep)) for e in range(mod.n)]
        if per_expert != want:  # the exchange sends expert block j to EP rank j
            raise ExecutionError(f"{path!r}: the experts' placement {per_expert} is not EP rank j holding experts "
                                 f"j*E/ep .. (j+1)*E/ep - 1 of each EP group, which the executor's all-to-all needs")
        out.append(ExpertLayout(path=path, ep=ep, experts=mod.n, hosts=per_expert, zero=zero))
    return out


class _TensorParallelLayout:
    """Fills ``tp_styles`` / ``attention`` of each stage of a ``tp > 1`` plan, refusing layouts DTensor TP
    cannot express: nodes are visited in topological order; a weighted node must be an ``nn.Linear`` /
    ``nn.Embedding`` split by columns (sharded output, or gathered right away when nothing downstream is
    split) or rows; a weightless split node must sit between a column and a row split (an elementwise
    activation, or the attention core of a zoo ``SelfAttention``). Sequence parallelism (``seq_split``):
    a region of norms and token-wise ops on sequence shards, entered from row splits (reduce-scatter)
    and left into column splits (all-gather); see the module docstring."""

    def __init__(self, plan: Plan, graph: OpGraph, model: nn.Module, stage_of: np.ndarray,
                 stages: list[StageLayout], tp: int) -> None:
        n = graph.num_nodes
        self.graph, self.model, self.stage_of, self.stages, self.tp = graph, model, stage_of, stages, tp
        self.pred = [graph.predecessors(v).tolist() for v in range(n)]
        self.succ = [graph.successors(v).tolist() for v in range(n)]
        self.lay = plan.layouts
        self.sharded = [self.lay[v] == "col_split" for v in range(n)]  # the node's output is column-split
        # the node's output is sequence-split (model inputs, e.g. token ids, are given whole to every rank:
        # an embedding needs every token; its output is reduce-scattered along the sequence instead)
        self.seq = [self.lay[v] == "seq_split" and graph.kinds[v] != "input" for v in range(n)]
        self.edge_bytes = {(int(a), int(b)): float(x) for a, b, x in
                           zip(graph.edge_src.tolist(), graph.edge_dst.tolist(), graph.edge_bytes.tolist())}
        self.sp_error = self._sequence_parallel_error() if any(self.seq) else None
        self.weighted = [graph.param_bytes[v] > 0 for v in range(n)]
        self.gathered: set[int] = set()  # elementwise col_split ops that run on a gathered (replicated) tensor

    def fill(self) -> None:
        for v in self.graph.topological_order().tolist():
            self._node(v)
        self._check_attention_cores()

    def _node(self, v: int) -> None:
        lay = self.lay
        who = f"node {self.graph.names[v]!r} ({self.graph.kinds[v]})"
        if lay[v] in ("single", "batch_split"):
            raise ExecutionError(f"{who} is {lay[v]} inside a tensor-parallel stage")
        for u in self.succ[v]:
            if self.sharded[v] and self.stage_of[u] != self.stage_of[v]:
                raise ExecutionError(f"{who} passes a column-split tensor across a pipeline stage boundary to "
                                     f"{self.graph.names[u]!r}")
        if lay[v] == "replicate":
            if any(self.sharded[p] for p in self.pred[v]):
                raise ExecutionError(f"{who} is replicate but is fed a column-split tensor")
            if any(self.seq[p] for p in self.pred[v]):
                raise ExecutionError(f"{who} is replicate but is fed a sequence-split tensor; a sequence split "
                                     "(seq_split) ends at a column-split Linear, which all-gathers the sequence")
            return
        mod = _module_at(self.model, self.graph.module_paths[v])
        if lay[v] == "seq_split":
            if self.graph.kinds[v] != "input":
                self._seq_split(v, who, mod)
            return
        if self.weighted[v]:
            self._split_module(v, who, mod)
        elif v not in self.gathered:
            self._split_activation(v, who, mod)

    def _styles(self, v: int) -> dict[str, str]:
        return self.stages[int(self.stage_of[v])].tp_styles

    def _split_module(self, v: int, who: str, mod: nn.Module | None) -> None:
        """A weighted node: the style of its nn.Linear / nn.Embedding, its split dimension divisible by tp."""
        path = self.graph.module_paths[v]
        if not isinstance(mod, (nn.Linear, nn.Embedding)):
            raise ExecutionError(f"{who} is {self.lay[v]}, but the executor splits only nn.Linear and nn.Embedding "
                                 f"(module {path!r} is {type(mod).__name__})")
        in_sh = [self.sharded[p] for p in self.pred[v]]
        in_seq = [self.seq[p] for p in self.pred[v]]
        if self.lay[v] == "col_split":
            if any(in_sh):
                raise ExecutionError(f"{who} is col_split but its input is already sharded")
            if any(in_seq) and (not all(in_seq) or not isinstance(mod, nn.Linear)):
                raise ExecutionError(f"{who}: only a column-split nn.Linear with sequence-split inputs only can "
                                     "end a sequence split (all-gather)")
            dim = mod.out_features if isinstance(mod, nn.Linear) else mod.embedding_dim
            style = self._column_style(v, who, mod)
            self._styles(v)[path] = style + "_seq" if any(in_seq) else style
        else:
            dim = mod.in_features if isinstance(mod, nn.Linear) else mod.num_embeddings
            if any(in_sh) and not all(in_sh):
                raise ExecutionError(f"{who} is row_split with both sharded and replicated inputs")
            if any(in_sh) and isinstance(mod, nn.Embedding):
                raise ExecutionError(f"{who}: a row-split embedding needs replicated indices")
            if any(in_seq):
                raise ExecutionError(f"{who} is row_split but is fed a sequence-split tensor")
            to_seq = [self.lay[u] == "seq_split" for u in self.succ[v]]
            if any(to_seq) and not all(to_seq):
                raise ExecutionError(f"{who} is row_split with both sequence-split (seq_split) and other consumers")
            style = "row" if any(in_sh) else "row_rep"
            if to_seq and all(to_seq):  # reduce-scatter to sequence shards in place of the all-reduce
                style += "_seq"
                self.seq[v] = True
            self._styles(v)[path] = style
        if dim % self.tp:
            raise ExecutionError(f"{who}: dimension {dim} is not divisible by tp={self.tp}")

    def _column_style(self, v: int, who: str, mod: nn.Module) -> str:
        """``col`` when every consumer (after elementwise col_split ops) is split, ``col_gather`` when none
        is (the output is gathered right away and the elementwise ops run replicated)."""
        inside, ends = self._region(v)
        cons = [self.lay[u] in ("col_split", "row_split") for u in ends]
        if cons and all(cons) and isinstance(mod, nn.Linear):
            return "col"
        if not any(cons):
            self.gathered.update(inside)
            for u in (v, *inside):
                self.sharded[u] = False
            return "col_gather"
        raise ExecutionError(f"{who} is col_split with both split and replicated consumers")

    def _region(self, v: int) -> tuple[set[int], set[int]]:
        """Weightless elementwise col_split ops downstream of ``v``, and the ops they (and v) feed."""
        inside: set[int] = set()
        ends: set[int] = set()
        stack = [v]
        while stack:
            for u in self.succ[stack.pop()]:
                if self.lay[u] == "col_split" and not self.weighted[u] and self.graph.kinds[u] in ELEMENTWISE_KINDS:
                    if u not in inside:
                        inside.add(u)
                        stack.append(u)
                else:
                    ends.add(u)
        return inside, ends

    def _split_activation(self, v: int, who: str, mod: nn.Module | None) -> None:
        """A weightless split node between a column split and a row split."""
        from profilers.zoo import SelfAttention

        lay, kind, path = self.lay, self.graph.kinds[v], self.graph.module_paths[v]
        if lay[v] == "row_split":
            raise ExecutionError(f"{who} has no weights to row_split")
        if not self.pred[v] or not all(self.sharded[p] for p in self.pred[v]):
            raise ExecutionError(f"{who} is col_split but its input is not column-split")
        if not self.succ[v] or not all(lay[u] in ("col_split", "row_split") for u in self.succ[v]):
            raise ExecutionError(f"{who} is col_split but feeds a replicated op; end the split with a row_split")
        if kind in ELEMENTWISE_KINDS:
            return
        if kind == "sdpa" and isinstance(mod, SelfAttention):
            qkv, out = f"{path}.qkv", f"{path}.out"
            out_ok = any(self.graph.module_paths[u] == out and lay[u] == "row_split" for u in range(len(lay)))
            if self._styles(v).get(qkv) not in ("col", "col_seq") or not out_ok:
                raise ExecutionError(f"{who}: attention runs split only with {qkv!r} col_split and {out!r} row_split")
            if mod.heads % self.tp:
                raise ExecutionError(f"{who}: {mod.heads} heads do not split over tp={self.tp}")
            self.stages[int(self.stage_of[v])].attention.append(path)
            return
        raise ExecutionError(f"{who} is col_split, but the executor shards only elementwise activations and "
                             "zoo SelfAttention between a column and a row split")

    def _sequence_parallel_error(self) -> str | None:
        """Why this model cannot run sequence-parallel (None: it can): activations must be
        ``[batch, seq, hidden]`` (zoo gpt / moe / bert) with the sequence divisible by tp."""
        from profilers.zoo import BERT, GPT

        if not isinstance(self.model, (GPT, BERT)):
            return (f"sequence parallelism (seq_split) runs only on zoo gpt, moe and bert models (activations "
                    f"[batch, seq, hidden]), not on a {type(self.model).__name__}")
        pos = self.model.wpe if isinstance(self.model, GPT) else self.model.pos
        if pos.num_embeddings % self.tp:
            return f"sequence parallelism: sequence length {pos.num_embeddings} is not divisible by tp={self.tp}"
        return None

    def _seq_split(self, v: int, who: str, mod: nn.Module | None) -> None:
        """A sequence-split node: a norm (SequenceParallel) or a token-wise weightless op on sequence
        shards, fed by sequence-split tensors and feeding seq_split ops or column-split Linears."""
        if self.sp_error:
            raise ExecutionError(f"{who}: {self.sp_error}")
        names, lay, kind = self.graph.names, self.lay, self.graph.kinds[v]
        if not self.pred[v]:
            raise ExecutionError(f"{who} is seq_split but has no input; a sequence split starts at a row split")
        for u in self.pred[v]:
            if not self.seq[u]:
                raise ExecutionError(f"{who} is seq_split but its input {names[u]!r} ({lay[u]}) is not "
                                     "sequence-split; a sequence split starts at a row-split Linear or Embedding "
                                     "(reduce-scatter)")
        if not self.succ[v]:
            raise ExecutionError(f"{who} is seq_split but is the model's output; end the sequence split with a "
                                 "column-split Linear (all-gather)")
        for u in self.succ[v]:
            if not (lay[u] == "seq_split" or (lay[u] == "col_split" and self.weighted[u])):
                raise ExecutionError(f"{who} is seq_split but feeds {names[u]!r} ({lay[u]}); a sequence split "
                                     "ends at a column-split Linear (all-gather)")
            if self.edge_bytes.get((v, u), 0.0) < self.graph.out_bytes[v]:
                raise ExecutionError(f"{who} is seq_split but {names[u]!r} reads only part of its output (e.g. "
                                     "one token, like a pooler); a sequence split must feed whole tensors")
        if self.weighted[v]:
            if not isinstance(mod, (nn.LayerNorm, nn.RMSNorm)):
                raise ExecutionError(f"{who} is seq_split, but the executor runs only nn.LayerNorm / nn.RMSNorm "
                                     "weights on sequence shards")
            self._styles(v)[self.graph.module_paths[v]] = "seq"
        elif kind not in TOKENWISE_KINDS:
            raise ExecutionError(f"{who} is seq_split, but the executor runs only norms and token-wise ops "
                                 f"({', '.join(sorted(TOKENWISE_KINDS))}) on sequence shards")

    def _check_attention_cores(self) -> None:
        """A column-split qkv must come with its attention core split by heads."""
        from profilers.zoo import SelfAttention

        for st in self.stages:
            for path in st.tp_styles:
                parent = path.rpartition(".")[0]
                if isinstance(_module_at(self.model, parent), SelfAttention) and path.endswith(".qkv") \
                        and parent not in st.attention:
                    raise ExecutionError(f"{path!r} is col_split but its attention core is not split by heads")


# ---------------------------------------------------------------------------- TP helpers
def regroup_qkv(attn: nn.Module, tp: int) -> None:
    """Reorder the rows of ``attn.qkv`` so that a contiguous 1/tp shard holds q, k and v of whole heads."""
    c = attn.out.in_features
    per = c // tp
    idx = [torch.arange(j * c + r * per, j * c + (r + 1) * per) for r in range(tp) for j in range(3)]
    perm = torch.cat(idx).to(attn.qkv.weight.device)
    with torch.no_grad():
        attn.qkv.weight.copy_(attn.qkv.weight[perm].clone())
        if attn.qkv.bias is not None:
            attn.qkv.bias.copy_(attn.qkv.bias[perm].clone())


def _local_heads_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """SelfAttention forward on this rank's heads (qkv column-split after :func:`regroup_qkv`)."""
    h = self.qkv(x)  # with sequence parallelism x is a sequence shard, h the whole (gathered) sequence
    b, t, _ = h.shape
    q, k, v = h.view(b, t, 3, self.heads // self.tp_degree, -1).permute(2, 0, 3, 1, 4).unbind(0)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
    return self.out(y.transpose(1, 2).reshape(b, t, -1))


_ROWWISE_TO_SEQUENCE: list[type] = []


def _rowwise_to_sequence(**kw):
    """A ``RowwiseParallel`` whose partial output is reduce-scattered along the sequence dimension, found
    at run time as ``ndim - 2`` (``[batch, seq, hidden]``, or ``[seq, hidden]`` for a position embedding).
    The class is made on first use (torch.distributed.tensor is imported lazily here)."""
    if not _ROWWISE_TO_SEQUENCE:
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import RowwiseParallel

        class RowwiseToSequence(RowwiseParallel):
            def __init__(self, **kw) -> None:
                super().__init__(output_layouts=Shard(1), **kw)

            @staticmethod
            def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
                seq = (Shard(outputs.ndim - 2),)
                if tuple(outputs.placements) != seq:
                    outputs = outputs.redistribute(placements=seq)
                return outputs.to_local() if use_local_output else outputs

        _ROWWISE_TO_SEQUENCE.append(RowwiseToSequence)
    return _ROWWISE_TO_SEQUENCE[0](**kw)


def apply_tensor_parallel(model: nn.Module, stage: StageLayout, mesh, tp: int) -> None:
    """``parallelize_module`` the stage's split modules on the 1-D ``mesh`` (in place)."""
    import types

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    for path in stage.attention:
        attn = model.get_submodule(path)
        regroup_qkv(attn, tp)
        attn.tp_degree = tp
        attn.forward = types.MethodType(_local_heads_forward, attn)
    seq = Shard(1)  # activations [batch, seq, hidden]
    styles = {"col": lambda: ColwiseParallel(),
              "col_gather": lambda: ColwiseParallel(output_layouts=Replicate()),
              "row": lambda: RowwiseParallel(),
              "row_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
              "seq": lambda: SequenceParallel(use_local_output=True),
              "col_seq": lambda: ColwiseParallel(input_layouts=seq),
              "col_gather_seq": lambda: ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
              "row_seq": lambda: _rowwise_to_sequence(),
              "row_rep_seq": lambda: _rowwise_to_sequence(input_layouts=Replicate())}
    if stage.tp_styles:
        parallelize_module(model, mesh, {p: styles[s]() for p, s in stage.tp_styles.items()})
