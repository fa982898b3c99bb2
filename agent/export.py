"""Export a plan to the launchers users run: Megatron-LM arguments, a DeepSpeed config JSON, a
torchtitan TOML.

A runtime expresses only *uniform* plans: every pipeline stage a contiguous block of whole layers of
equal size, on its own block of ``tp x dp`` ranks in the runtime's rank order (tensor fastest, then
data, then pipeline: Megatron-LM's default ``tp-cp-ep-dp-pp`` order, torchtitan's mesh
``pp, dp, tp`` and DeepSpeed's ``pipe, data, model`` topology), every layer split the way the
runtimes' model code splits it (Megatron's column/row-parallel linears, replicated or
sequence-parallel norms and residual adds), one recomputation level, one ZeRO stage, one
sequence-parallel switch and one expert-parallel degree (Megatron-LM's --expert-model-parallel-size,
torchtitan's expert_parallel_degree beside FSDP, DeepSpeed's MoE(ep_size=...) in model code) for all layers. :func:`uniform_parallelism` recognises such a plan and
returns its :class:`Parallelism`; for any other plan it raises :class:`NotExpressible` naming the
first part the runtimes cannot express (a non-uniform operator placement, uneven stages, mixed
layouts...) -- ``rlplace run`` executes any plan. Each writer then checks what its own runtime lacks
(DeepSpeed's JSON has no tensor parallelism, no interleaving and no ZeRO-2/3 with pipelining;
torchtitan has no ZeRO-1, no DDP beside other parallelism, and always runs sequence parallelism with
tensor parallelism; Megatron-LM's FSDP2 path needs pp=1) and writes the file.

Names are the runtimes' own (checked against ``tests/data/export_names.json``): Megatron-LM
``megatron/training/arguments.py`` (2025); DeepSpeed ``docs/_pages/config-json.md``,
``deepspeed/runtime/zero/config.py`` and ``deepspeed/runtime/pipe/engine.py``; torchtitan
``torchtitan/config/job_config.py`` @000204a4 (the TOML ``[parallelism]`` / ``[training]`` /
``[activation_checkpoint]`` generation of 2025) and ``torchtitan/models/llama3/infra/parallelize.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from envs.errors import RlplaceError
from envs.graph import CAN_BATCH, CAN_REPLICATE, OpGraph
from envs.plan import Plan, attention_core, expert_layers, is_attention_core, layer_ids, megatron_layouts

RUNTIMES = ("megatron", "deepspeed", "torchtitan")
TP_LAYOUTS = ("col_split", "row_split", "replicate", "seq_split")
TOKEN_WISE = ("replicate", "seq_split")  # the two layouts of a node Megatron replicates over tp ranks
FILE_NAMES = {"megatron": "megatron_args.sh", "deepspeed": "ds_config.json", "torchtitan": "torchtitan.toml"}


class NotExpressible(RlplaceError):
    """The plan has a part the requested runtime cannot express (``reason`` says which)."""

    def __init__(self, reason: str, runtime: str | None = None):
        self.reason = reason
        self.runtime = runtime
        who = runtime if runtime else "the runtimes (Megatron-LM, DeepSpeed, torchtitan)"
        super().__init__(f"{who} cannot express this plan: {reason}; run it with rlplace run")


@dataclass(frozen=True)
class Parallelism:
    """A uniform plan in the runtimes' terms."""

    tp: int
    pp: int  # pipeline ranks (distinct device groups)
    dp: int
    virtual_stages: int  # model chunks per pipeline rank (interleaved 1F1B when > 1)
    micro_batch: int  # samples per microbatch per data-parallel rank
    global_batch: int
    microbatches: int  # microbatches per step (gradient accumulation steps)
    schedule: str  # gpipe | 1f1b (the plan's; interleaved when virtual_stages > 1)
    recompute: str  # none | selective | full
    zero: int  # one ZeRO stage for the whole model
    sequence_parallel: bool
    expert_parallel: int  # the experts' expert-parallel degree (1: none); model["experts"]: experts per layer
    dtype: str
    layers: int | None  # repeated layers of the model (None: the graph has no layer structure)
    model: dict = field(default_factory=dict)  # layers / hidden / heads / seq / vocab / tie_embeddings

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def layers_per_chunk(self) -> int | None:
        """Layers in each model chunk (a pipeline stage, or a virtual stage when interleaving)."""
        return None if self.layers is None else self.layers // (self.pp * self.virtual_stages)


@dataclass(frozen=True)
class Exported:
    """An exported file: its text, a suggested file name, and notes for the user (what the file cannot say)."""

    runtime: str
    text: str
    filename: str
    notes: tuple[str, ...] = ()


# ---------------------------------------------------------------------- recognising uniform plans
def _stand_in_topology(plan: Plan) -> SimpleNamespace:
    """A topology for validation: a runtime maps plan devices to its own ranks, all accelerators."""
    n = max([d + 1 for g in plan.groups for d in g] + [1])
    return SimpleNamespace(num_devices=n, devices=[SimpleNamespace(kind="gpu", name=f"rank {d}") for d in range(n)])


def _can_seq_split(graph: OpGraph, v: int) -> bool:
    caps = int(graph.layout_caps[v])
    return bool(caps & CAN_REPLICATE and caps & CAN_BATCH) and not is_attention_core(graph, v)


def uniform_parallelism(plan: Plan, graph: OpGraph) -> Parallelism:
    """The plan's tp / pp / dp / batch / recompute / ZeRO / SP settings, or NotExpressible with the reason."""
    plan.validate(graph, _stand_in_topology(plan))
    names = graph.names
    order = graph.topological_order().tolist()
    if plan.dtype == "fp8":
        raise NotExpressible("dtype fp8: the runtimes train an fp32, bf16 or fp16 model (their FP8 options run "
                             "FP8 matrix multiplies beside bf16 weights)")

    # every node on all tp x dp ranks of its stage
    sizes = [len(plan.groups[v]) for v in order]
    width = max(set(sizes), key=sizes.count)
    odd = next((v for v in order if len(plan.groups[v]) != width), None)
    if odd is not None:
        raise NotExpressible(f"node {names[odd]!r} runs on {len(plan.groups[odd])} device(s) "
                             f"{plan.groups[odd]}, the rest of the model on {width}: the runtimes run every "
                             "op of a pipeline stage on all its tp x dp ranks (a non-uniform placement)")
    stage, p = plan.stages(graph)  # a stage is a distinct device group, in order of first use
    for s in range(p):
        v = next(v for v in order if stage[v] == s)
        want = tuple(range(s * width, (s + 1) * width))
        if tuple(plan.groups[v]) != want:
            raise NotExpressible(f"pipeline stage {s} (from node {names[v]!r}) runs on devices "
                                 f"{tuple(plan.groups[v])}, but the runtimes place stage {s} on ranks {want} "
                                 "(tensor fastest, then data, then pipeline): a non-uniform placement")

    # one tensor split, the runtimes' model code's
    mega = megatron_layouts(graph)
    tp_dp: dict[tuple[int, int], int] = {}
    for v in order:
        lay, dpv = plan.layouts[v], int(plan.dp[v])
        tp_v = width // dpv
        tp_dp.setdefault((tp_v, dpv), v)
        if tp_v > 1:
            allowed = TOKEN_WISE if mega[v] == "replicate" else (mega[v],)
            if lay not in allowed:
                raise NotExpressible(f"node {names[v]!r} is {lay}, but Megatron-style model code splits it as "
                                     f"{' or '.join(allowed)}: a layout the runtimes' model code does not have")
    if len(tp_dp) > 1:
        (a, va), (b, vb) = list(tp_dp.items())[:2]
        raise NotExpressible(f"nodes differ in tensor / data parallelism ({names[va]!r} tp={a[0]} dp={a[1]}, "
                             f"{names[vb]!r} tp={b[0]} dp={b[1]}); the runtimes use one tp and one dp for "
                             "the whole model")
    tp, dp = next(iter(tp_dp))
    heads = (graph.meta or {}).get("heads")
    if tp > 1 and isinstance(heads, int) and heads % tp:
        raise NotExpressible(f"tp={tp} does not divide the model's {heads} attention heads (the runtimes split "
                             "attention by head)")

    # pipeline: chunk c on rank c mod p, whole layers, the same number in every chunk
    v_stages = plan.virtual_stages
    chunk, _ = plan.chunks(graph)
    n_chunks = int(chunk.max()) + 1
    head: dict[int, int] = {}  # first node of each chunk
    for v in order:
        head.setdefault(int(chunk[v]), v)
    for c in range(n_chunks):
        v = head[c]
        if c < p * v_stages and stage[v] == c % p:
            continue
        prev = head[c - 1]
        if v_stages == 1:
            raise NotExpressible(f"node {names[prev]!r} runs on {plan.groups[prev]} between nodes on "
                                 f"{plan.groups[v]} (the model returns to {plan.groups[v]} at {names[v]!r}): a "
                                 "non-uniform placement; the runtimes give each pipeline stage one contiguous part "
                                 "of the model")
        raise NotExpressible(f"model chunk {c} (from node {names[v]!r}) is on pipeline stage {int(stage[v])}, but "
                             f"interleaving with {v_stages} virtual stages puts chunk c on stage c mod {p}")
    lid = layer_ids(graph)
    in_layer = lid >= 0
    layers = None
    if in_layer.any():
        where: dict[int, int] = {}
        for v in order:
            if in_layer[v] and where.setdefault(int(lid[v]), int(chunk[v])) != int(chunk[v]):
                raise NotExpressible(f"layer {int(lid[v])} is split between pipeline chunks {where[int(lid[v])]} "
                                     f"and {int(chunk[v])} (at node {names[v]!r}); the runtimes cut between layers")
        layers = len(where)
        counts = [sum(1 for c in where.values() if c == k) for k in range(n_chunks)]
        if len(set(counts)) > 1:
            what = "virtual stages" if v_stages > 1 else "stages"
            raise NotExpressible(f"pipeline {what} hold different numbers of layers ({counts}); the runtimes split "
                                 f"the {layers} layers evenly over {n_chunks} {what}")
    layer_nodes = in_layer if in_layer.any() else np.ones(graph.num_nodes, dtype=bool)

    # sequence parallelism: all token-wise ops of the layers seq_split, or none
    sp = False
    if tp > 1:
        eligible = [v for v in order if layer_nodes[v] and mega[v] == "replicate" and _can_seq_split(graph, v)]
        split = [v for v in eligible if plan.layouts[v] == "seq_split"]
        whole = [v for v in eligible if plan.layouts[v] == "replicate"]
        if split and whole:
            raise NotExpressible(f"sequence parallelism on some token-wise ops but not others ({names[split[0]]!r} "
                                 f"is seq_split, {names[whole[0]]!r} is replicate); the runtimes switch it on "
                                 "for all layers or none")
        sp = bool(split)
        if not sp:
            outside = next((v for v in order if plan.layouts[v] == "seq_split"), None)
            if outside is not None:
                raise NotExpressible(f"node {names[outside]!r} is seq_split but the layers are not: the runtimes "
                                     "have no sequence parallelism outside the layers alone")
        seq = (graph.meta or {}).get("seq")
        if sp and isinstance(seq, int) and seq % tp:
            raise NotExpressible(f"sequence parallelism splits the sequence of {seq} tokens over tp={tp}, which "
                                 "does not divide it")

    recompute = _recompute_level(plan, graph, order, layer_nodes)
    zero = _zero_stage(plan, graph, order)
    experts, ep = _experts(plan, graph)
    batch = plan.batch(graph)
    mbs = batch // plan.microbatches
    meta = graph.meta or {}
    model = {k: meta[k] for k in ("layers", "hidden", "heads", "seq", "vocab", "tie_embeddings") if k in meta}
    if experts:
        model["experts"] = experts
    return Parallelism(tp=tp, pp=p, dp=dp, virtual_stages=v_stages, micro_batch=mbs // dp, global_batch=batch,
                       microbatches=plan.microbatches, schedule=plan.schedule, recompute=recompute, zero=zero,
                       sequence_parallel=sp, expert_parallel=ep, dtype=plan.dtype, layers=layers, model=model)


def _experts(plan: Plan, graph: OpGraph) -> tuple[int, int]:
    """(experts per mixture-of-experts layer, 0 without any; their one expert-parallel degree)."""
    layer, _, count = expert_layers(graph)
    mine = layer >= 0
    if not mine.any():
        return 0, 1
    counts, degrees = sorted({int(c) for c in count[mine]}), sorted({int(e) for e in plan.ep[mine]})
    if len(counts) > 1:
        raise NotExpressible(f"mixture-of-experts layers with different numbers of experts ({counts}); the runtimes "
                             "build every MoE layer with one --num-experts")
    if len(degrees) > 1:
        raise NotExpressible(f"expert layers with different expert-parallel degrees ({degrees}); the runtimes use "
                             "one expert-parallel degree for the whole model")
    return counts[0], degrees[0]


def _recompute_level(plan: Plan, graph: OpGraph, order: list[int], layer_nodes: np.ndarray) -> str:
    """none (nothing recomputed), selective (exactly the layers' attention core) or full (every layer node;
    what lies outside the layers may be either)."""
    rc = plan.recompute
    selective = attention_core(graph) & layer_nodes
    if not rc.any():
        return "none"
    if selective.any() and np.array_equal(rc, selective):
        return "selective"
    if rc[layer_nodes].all():
        return "full"
    wants = {"none": np.zeros_like(rc), "selective": selective, "full": np.where(layer_nodes, True, rc)}
    level = min(wants, key=lambda k: int((wants[k] != rc).sum()))
    v = next(v for v in order if wants[level][v] != rc[v])
    raise NotExpressible(f"layers differ in recomputation: closest is {level!r}, but node {graph.names[v]!r} is "
                         f"{'' if rc[v] else 'not '}recomputed; the runtimes set one level for all layers (none, "
                         "selective = the attention core, full = every layer node)")


def _zero_stage(plan: Plan, graph: OpGraph, order: list[int]) -> int:
    """The ZeRO stage of the nodes that hold parameters over data-parallel replicas (all must share it; an
    expert with one replica per expert-parallel group has nothing to shard)."""
    first: dict[int, int] = {}
    for v in order:
        if plan.replicas(v) > 1 and graph.param_bytes[v] > 0:
            first.setdefault(int(plan.zero[v]), v)
    if len(first) > 1:
        (a, va), (b, vb) = list(first.items())[:2]
        raise NotExpressible(f"ZeRO stages differ between nodes ({graph.names[va]!r} stage {a}, {graph.names[vb]!r} "
                             f"stage {b}); the runtimes take one ZeRO stage for the whole model")
    return next(iter(first), 0)


# ---------------------------------------------------------------------- Megatron-LM
def megatron_args(par: Parallelism) -> list[str]:
    """Megatron-LM ``pretrain_gpt.py`` arguments (data parallelism is implied: world / (tp x pp))."""
    if par.pp > 1 and par.schedule == "gpipe":
        raise NotExpressible("the GPipe schedule: Megatron-LM pipelines with 1F1B (interleaved with virtual "
                             "stages) only", "megatron")
    fsdp = par.zero >= 2
    if fsdp:
        if par.pp > 1:
            raise NotExpressible(f"ZeRO stage {par.zero} with pipeline parallelism (pp={par.pp}): Megatron-LM's "
                                 "--use-torch-fsdp2 requires --pipeline-model-parallel-size 1, and its distributed "
                                 "optimizer is ZeRO-1 only", "megatron")
        if par.dtype == "fp16":
            raise NotExpressible(f"ZeRO stage {par.zero} in fp16: Megatron-LM's --use-torch-fsdp2 does not support "
                                 "--fp16", "megatron")
        if par.model.get("tie_embeddings", False):
            raise NotExpressible(f"ZeRO stage {par.zero} with tied embeddings: Megatron-LM's --use-torch-fsdp2 "
                                 "requires --untie-embeddings-and-output-weights, a different model", "megatron")
    args = ["--tensor-model-parallel-size", str(par.tp), "--pipeline-model-parallel-size", str(par.pp),
            "--micro-batch-size", str(par.micro_batch), "--global-batch-size", str(par.global_batch)]
    if par.virtual_stages > 1:
        if not par.layers_per_chunk:
            raise NotExpressible("virtual stages on a graph without repeated layers: Megatron-LM counts "
                                 "--num-layers-per-virtual-pipeline-stage in transformer layers", "megatron")
        args += ["--num-layers-per-virtual-pipeline-stage", str(par.layers_per_chunk)]
    if par.sequence_parallel:
        args.append("--sequence-parallel")
    if par.recompute == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif par.recompute == "selective":
        args += ["--recompute-granularity", "selective"]  # --recompute-modules defaults to core_attn
    if par.zero == 1:
        args.append("--use-distributed-optimizer")
    elif fsdp:
        args += ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion", "--ckpt-format", "torch_dist"]
        if par.zero == 2:
            args.append("--torch-fsdp2-no-reshard-after-forward")
    if par.dtype in ("bf16", "fp16"):
        args.append(f"--{par.dtype}")
    if par.model.get("experts"):
        args += ["--num-experts", str(par.model["experts"])]
    if par.expert_parallel > 1:  # carved out of the data-parallel ranks (ep divides dp)
        args += ["--expert-model-parallel-size", str(par.expert_parallel)]
    m = par.model
    for key, flag in (("layers", "--num-layers"), ("hidden", "--hidden-size"), ("heads", "--num-attention-heads"),
                      ("seq", "--seq-length")):
        if key in m:
            args += [flag, str(m[key])]
    if "seq" in m:
        args += ["--max-position-embeddings", str(m["seq"])]
    if m.get("tie_embeddings") is False:
        args.append("--untie-embeddings-and-output-weights")
    return args


def megatron_script(par: Parallelism) -> tuple[str, list[str]]:
    """A bash launch script for ``pretrain_gpt.py`` and notes."""
    args = megatron_args(par)
    lines = ["#!/usr/bin/env bash",
             f"# Megatron-LM launch of an rlplace plan: {par.world} GPUs, tp={par.tp} pp={par.pp} dp={par.dp}"
             + (f", {par.virtual_stages} virtual stages per rank" if par.virtual_stages > 1 else "")
             + f", {par.microbatches} microbatch(es) of {par.micro_batch} per data-parallel rank.",
             "# Flags: megatron/training/arguments.py (Megatron-LM, 2025). Append data, tokenizer, optimizer and",
             "# schedule arguments (--data-path, --tokenizer-type, --lr, --train-iters, ...) on the command line.",
             "set -euo pipefail"]
    if par.tp > 1 and par.zero < 2:  # Megatron asserts it for tp > 1 (before Blackwell); FSDP asserts it unset
        lines.append("export CUDA_DEVICE_MAX_CONNECTIONS=1")
    lines += ["NNODES=${NNODES:-1}", f"GPUS_PER_NODE=${{GPUS_PER_NODE:-$(( {par.world} / NNODES ))}}",
              "torchrun --nnodes \"$NNODES\" --nproc_per_node \"$GPUS_PER_NODE\" --node_rank \"${NODE_RANK:-0}\" \\",
              "    --master_addr \"${MASTER_ADDR:-localhost}\" --master_port \"${MASTER_PORT:-6000}\" \\",
              "    pretrain_gpt.py \\"]
    lines += [f"    {flag} \\" for flag in _pairs(args)]
    lines.append('    "$@"')
    notes = []
    if par.zero >= 2:
        notes.append(f"ZeRO-{par.zero} uses Megatron-LM's --use-torch-fsdp2 (torch FSDP2; Megatron calls it not yet "
                     "stable); do not set CUDA_DEVICE_MAX_CONNECTIONS=1 with it")
    if "vocab" in par.model:
        notes.append(f"the vocabulary ({par.model['vocab']}) comes from the tokenizer arguments you add")
    return "\n".join(lines) + "\n", notes


def _pairs(args: list[str]) -> list[str]:
    """``--flag value`` pairs and lone ``--switch``es, one per line."""
    out, i = [], 0
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            out.append(f"{args[i]} {args[i + 1]}")
            i += 2
        else:
            out.append(args[i])
            i += 1
    return out


# ---------------------------------------------------------------------- DeepSpeed
def deepspeed_config(par: Parallelism) -> dict:
    """A DeepSpeed config JSON (the stage count of a pipeline is code: ``PipelineModule(num_stages=...)``)."""
    if par.tp > 1:
        raise NotExpressible(f"tensor parallelism (tp={par.tp}): a DeepSpeed config has no tensor parallelism (it "
                             "comes from the model code, e.g. Megatron-DeepSpeed); export --to megatron", "deepspeed")
    if par.pp > 1 and par.zero >= 2:
        raise NotExpressible(f"ZeRO stage {par.zero} with pipeline parallelism (pp={par.pp}): DeepSpeed's "
                             "PipelineEngine allows ZeRO stage 0 or 1 only", "deepspeed")
    if par.virtual_stages > 1:
        raise NotExpressible(f"{par.virtual_stages} virtual stages per rank: DeepSpeed's PipelineEngine has no "
                             "interleaved schedule", "deepspeed")
    if par.pp > 1 and par.schedule == "gpipe":
        raise NotExpressible("the GPipe schedule: DeepSpeed's PipelineEngine runs 1F1B (TrainSchedule) only",
                             "deepspeed")
    if par.recompute == "selective":
        raise NotExpressible("selective recomputation: DeepSpeed's config checkpoints whole layers only (selective "
                             "recomputation is model code, e.g. Megatron-DeepSpeed)", "deepspeed")
    gas = par.global_batch // (par.micro_batch * par.dp)
    cfg: dict = {"train_batch_size": par.global_batch, "train_micro_batch_size_per_gpu": par.micro_batch,
                 "gradient_accumulation_steps": gas, "zero_optimization": {"stage": par.zero}}
    if par.dtype in ("bf16", "fp16"):
        cfg[par.dtype] = {"enabled": True}
    if par.recompute == "full":
        cfg["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False,
                                           "cpu_checkpointing": False}
        if par.pp > 1:
            cfg["pipeline"] = {"activation_checkpoint_interval": 1}
    return cfg


def _deepspeed_notes(par: Parallelism) -> list[str]:
    notes = [f"launch {par.world} ranks (deepspeed --num_gpus ...); DeepSpeed derives dp={par.dp} from them"]
    if par.pp > 1:
        layers = f"{par.layers} layers" if par.layers else "layers"
        notes.append(f"the pipeline is code: build the model as PipelineModule(layers=..., num_stages={par.pp}, "
                     f"partition_method='type:<your transformer layer class>') to split the {layers} evenly")
    elif par.recompute == "full":
        notes.append("wrap each transformer layer in deepspeed.checkpointing.checkpoint (the activation_checkpointing "
                     "section configures it)")
    if par.expert_parallel > 1:
        notes.append(f"expert parallelism is model code: build each MoE layer as deepspeed.moe.layer.MoE(..., "
                     f"num_experts={par.model.get('experts')}, ep_size={par.expert_parallel})")
    return notes


# ---------------------------------------------------------------------- torchtitan
TORCHTITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B"}


def torchtitan_toml(par: Parallelism) -> str:
    """A torchtitan job config (TOML) with the parallelism, batch and activation-checkpoint sections."""
    who = "torchtitan"
    if par.zero == 1:
        raise NotExpressible("ZeRO stage 1: torchtitan shards with FSDP (ZeRO-2/3 like) or replicates (DDP); it has "
                             "no optimizer-state-only sharding", who)
    if par.tp > 1 and not par.sequence_parallel:
        raise NotExpressible("tensor parallelism without sequence parallelism: torchtitan's tensor parallelism "
                             "always shards the sequence of the norms and residual adds", who)
    if par.zero == 0 and par.dp > 1 and (par.tp > 1 or par.pp > 1):
        raise NotExpressible(f"data parallelism without ZeRO (DDP, dp={par.dp}) beside tensor or pipeline "
                             "parallelism: torchtitan's DDP is 1-D only ('DDP has not supported > 1D "
                             "parallelism'); ZeRO-2/3 (FSDP) is", who)
    if par.dtype == "fp16":
        raise NotExpressible("dtype fp16: torchtitan's mixed_precision_param is bfloat16 or float32", who)
    if par.expert_parallel > 1 and par.zero < 2:
        raise NotExpressible(f"expert parallelism (ep={par.expert_parallel}) beside replicated (DDP) weights: "
                             "torchtitan's expert_parallel_degree borrows its ranks from FSDP's "
                             "data_parallel_shard_degree", who)
    if par.pp > 1 and par.virtual_stages > 1 and not par.layers_per_chunk:
        raise NotExpressible("virtual stages on a graph without repeated layers", who)
    shard = par.dp if par.zero >= 2 else 1
    replicate = 1 if par.zero >= 2 else par.dp
    lines = [f"# torchtitan job config of an rlplace plan: {par.world} GPUs, tp={par.tp} pp={par.pp} dp={par.dp}"
             + (f", {par.virtual_stages} virtual stages per rank" if par.virtual_stages > 1 else "") + ".",
             "# Keys: torchtitan/config/job_config.py (2025 TOML generation). Set [model] name / flavor and [job]",
             "# yourself; launch with NGPU=" + str(par.world) + " ./run_train.sh --job.config_file <this file>.",
             "", "[parallelism]", f"data_parallel_replicate_degree = {replicate}",
             f"data_parallel_shard_degree = {shard}", f"tensor_parallel_degree = {par.tp}",
             f"pipeline_parallel_degree = {par.pp}"]
    if par.zero >= 2:
        lines.append(f'fsdp_reshard_after_forward = "{"never" if par.zero == 2 else "always"}"')
    if par.expert_parallel > 1:
        lines.append(f"expert_parallel_degree = {par.expert_parallel}")
    if par.pp > 1:
        sched = "Interleaved1F1B" if par.virtual_stages > 1 else TORCHTITAN_SCHEDULES[par.schedule]
        lines += [f'pipeline_parallel_schedule = "{sched}"', f"pipeline_parallel_microbatch_size = {par.micro_batch}"]
        if par.layers_per_chunk:
            lines.append(f"pipeline_parallel_layers_per_stage = {par.layers_per_chunk}")
    # without pipelining, torchtitan accumulates gradients over local batches; with it, the pipeline
    # splits one local batch into pipeline_parallel_microbatch_size pieces
    local = par.micro_batch if par.pp == 1 else par.global_batch // par.dp
    lines += ["", "[training]", f"local_batch_size = {local}", f"global_batch_size = {par.global_batch}"]
    if "seq" in par.model:
        lines.append(f"seq_len = {par.model['seq']}")
    lines.append(f'mixed_precision_param = "{"bfloat16" if par.dtype == "bf16" else "float32"}"')
    lines += ["", "[activation_checkpoint]", f'mode = "{par.recompute}"']
    if par.recompute == "selective":
        lines.append('selective_ac_option = "op"')
    return "\n".join(lines) + "\n"


def _torchtitan_notes(par: Parallelism) -> list[str]:
    notes = []
    if par.recompute == "selective":
        notes.append("torchtitan's selective (op) checkpointing saves matmul and attention outputs and recomputes the "
                     "rest of each layer, not exactly the attention core the plan recomputes")
    return notes


# ---------------------------------------------------------------------- entry point
def export(plan: Plan, graph: OpGraph, runtime: str) -> Exported:
    """``plan`` as ``runtime``'s file; NotExpressible (naming the runtime) says what cannot be expressed."""
    if runtime not in RUNTIMES:
        raise RlplaceError(f"unknown runtime {runtime!r}; choose one of {', '.join(RUNTIMES)}")
    try:
        par = uniform_parallelism(plan, graph)
        if runtime == "megatron":
            text, notes = megatron_script(par)
        elif runtime == "deepspeed":
            text, notes = json.dumps(deepspeed_config(par), indent=2) + "\n", _deepspeed_notes(par)
        else:
            text, notes = torchtitan_toml(par), _torchtitan_notes(par)
    except NotExpressible as exc:
        if exc.runtime == runtime:
            raise
        raise NotExpressible(exc.reason, runtime) from None
    return Exported(runtime=runtime, text=text, filename=FILE_NAMES[runtime], notes=tuple(notes))


__all__ = ["export", "uniform_parallelism", "Parallelism", "Exported", "NotExpressible", "RUNTIMES",
           "megatron_args", "megatron_script", "deepspeed_config", "torchtitan_toml"]
