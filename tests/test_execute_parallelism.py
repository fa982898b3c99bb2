"""Measured execution of ZeRO, selective recomputation, interleaved pipelines and sequence parallelism
(profilers.execute on CPU / gloo): the loss matches the single-process reference, and what the executor
cannot run is refused with an ExecutionError that names it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from envs.errors import PlanError
from envs.plan import megatron_plan, recompute_flags
from envs.presets import cpu_local
from profilers.execute import execute_plan
from profilers.execution_layout import ExecutionError, Recompute, analyze, decompose, node_blocks
from profilers.rank_program import build_seeded_model
from profilers.spec import build_model, graph_from_spec

MLP = "mlp:layers=3,hidden=32,in_dim=16,out=4,batch=8"
GPT = "gpt:layers=2,hidden=32,heads=2,seq=8,vocab=64,batch=4"
GPT4 = "gpt:layers=4,hidden=32,heads=2,seq=8,vocab=64,batch=4"  # 4 layers: 2 virtual stages x pp=2
BERT = "bert:layers=1,hidden=32,heads=2,seq=8,vocab=64,batch=4"


@pytest.fixture(scope="module")
def topo():
    return cpu_local(4)


def _model_graph(spec):
    model, _, _ = build_model(spec)
    return graph_from_spec(spec), model


def _check(report, *, pp=1, dp=1, tp=1):
    """As tests/test_execute.py: the layout ran as planned and the loss matches the reference (rtol 1e-4)."""
    assert (report.pp, report.dp, report.tp) == (pp, dp, tp)
    assert report.world_size == pp * dp * tp
    assert len(report.peak_memory_per_rank) == report.world_size and min(report.peak_memory_per_rank) > 0
    assert report.loss_matches is True, (report.losses, report.reference_losses)
    assert report.loss == pytest.approx(report.reference_loss, rel=1e-4)


# ---------------------------------------------------------------------------- ZeRO
@pytest.mark.parametrize("spec,mbs", [(MLP, 2), (GPT, 1)], ids=["mlp", "gpt"])
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_data_parallel_matches_reference(topo, spec, mbs, zero):
    """ZeRO-1 (ZeroRedundancyOptimizer + DDP), ZeRO-2/3 (FSDP2) on dp=2 with two accumulated microbatches."""
    g, model = _model_graph(spec)
    plan = megatron_plan(g, topo, dp=2, microbatch_size=mbs, zero=zero)
    assert plan.microbatches == 2
    lay = analyze(plan, g, model)
    assert lay.zero == [zero] and f"ZeRO {zero}" in lay.describe()
    report = execute_plan(plan, spec, steps=2, warmup=1, graph=g, check_steps=0)
    _check(report, dp=2)
    assert report.zero == [zero]


@pytest.mark.parametrize("spec,zero", [(GPT, 1), (MLP, 3)], ids=["gpt-zero1", "mlp-zero3"])
def test_zero_with_pipeline_four_ranks(topo, spec, zero):
    """ZeRO per pipeline stage over its replicas: ZeRO-1 beside the flat all-reduce, ZeRO-3 as FSDP2
    inside torch.distributed.pipelining (pp=2 x dp=2)."""
    g, _ = _model_graph(spec)
    plan = megatron_plan(g, topo, pp=2, dp=2, microbatch_size=1, zero=zero)
    report = execute_plan(plan, spec, steps=2, warmup=1, graph=g)
    _check(report, pp=2, dp=2)
    assert report.zero == [zero, zero]


def test_zero_refusals(topo):
    g, model = _model_graph(GPT)
    plan = megatron_plan(g, topo, dp=2, zero=1)
    zero = plan.zero.copy()
    zero[g.names.index("layers.0.mlp.fc1")] = 3
    with pytest.raises(ExecutionError, match=r"mixes ZeRO stages \('wte' zero=1, 'layers.0.mlp.fc1' zero=3\)"):
        analyze(plan.copy(zero=zero), g, model)
    tp_plan = megatron_plan(g, topo, tp=2)  # analyze does not need Plan.validate to have run
    with pytest.raises(ExecutionError, match="ZeRO stage 2 needs data parallelism"):
        analyze(tp_plan.copy(zero=np.full(g.num_nodes, 2)), g, model)


# ---------------------------------------------------------------------------- selective recomputation
def test_selective_recompute_gpt_tensor_parallel_matches_reference(topo):
    g, model = _model_graph(GPT)
    plan = megatron_plan(g, topo, tp=2, recompute="selective")
    assert np.array_equal(plan.recompute, recompute_flags(g, "selective"))
    lay = analyze(plan, g, model)
    assert lay.stages[0].selective == [1, 2] and lay.stages[0].recompute == []  # layers.0, layers.1
    _check(execute_plan(plan, GPT, steps=2, warmup=1, graph=g), tp=2)
    # any other marking recomputes the whole block
    rc = plan.recompute.copy()
    rc[g.names.index("layers.0.mlp.fc1")] = True
    lay = analyze(plan.copy(recompute=rc), g, model)
    assert lay.stages[0].selective == [2] and lay.stages[0].recompute == [1]


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_selective_policy_recomputes_only_the_attention_core():
    """In the backward, selective recomputation re-runs the SDPA kernel but neither the projections
    (addmm) nor the norms; full recomputation re-runs them all; the gradients are those without."""
    model, _ = build_seeded_model(GPT, seed=0)
    block = decompose(model)[0][1].module  # layers.0
    x = torch.randn(2, 8, 32, requires_grad=True)
    block(x).square().sum().backward()
    ref = [p.grad.clone() for p in block.parameters()]
    reran = {}
    for name, mod in (("selective", Recompute(block, selective=True)), ("full", Recompute(block))):
        block.zero_grad(set_to_none=True)
        out = mod(x).square().sum()
        with _OpLog() as log:
            out.backward()
        reran[name] = set(log.ops)
        assert all(torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(ref, block.parameters()))
    sdpa = {op for op in reran["full"] if op.startswith("_scaled_dot_product") and not op.endswith("_backward")}
    assert sdpa and sdpa <= reran["selective"]
    assert {"addmm", "native_layer_norm"} <= reran["full"]
    assert not {"addmm", "native_layer_norm", "gelu"} & reran["selective"]


# ---------------------------------------------------------------------------- interleaved pipeline
def test_interleaved_pipeline_two_virtual_stages_matches_reference(topo):
    g, model = _model_graph(GPT4)
    plan = megatron_plan(g, topo, pp=2, virtual_stages=2, microbatch_size=2)
    lay = analyze(plan, g, model)
    assert (lay.pp, lay.virtual_stages, lay.microbatches) == (2, 2, 2)
    assert [st.blocks for st in lay.stages] == [[0, 1], [2], [3], [4, 5]]  # chunk c on pipeline rank c % 2
    assert [st.devices for st in lay.stages] == [(0,), (1,), (0,), (1,)] and lay.rank_chunks(1) == [1, 3]
    report = execute_plan(plan, GPT4, steps=2, warmup=1, graph=g)
    _check(report, pp=2)
    assert report.virtual_stages == 2


def test_interleaving_refusals(topo):
    g, model = _model_graph(GPT4)
    plan = megatron_plan(g, topo, pp=2, virtual_stages=2, microbatch_size=2)
    with pytest.raises(ExecutionError, match="runs only with the 1f1b schedule"):
        analyze(plan.copy(schedule="gpipe"), g, model)
    with pytest.raises(ExecutionError, match=r"multiple of max\(1, microbatches // pp\) = 2"):
        analyze(plan.copy(microbatches=5, global_batch=10), g, model)  # torch 2.13's rounds rule
    with pytest.raises(ExecutionError, match="model chunks are not 2 chunks on each"):
        analyze(megatron_plan(g, topo, pp=2, microbatch_size=2).copy(virtual_stages=2), g, model)
    # three pipeline stages visited 0, 1, 2, 1, 0, 2: chunk 3 is not on stage 3 % 3
    nb = node_blocks(g, decompose(model)[0])
    groups = [((0,), (1,), (2,), (1,), (0,), (2,))[int(b)] for b in nb]
    with pytest.raises(ExecutionError, match="visit the stages in turn"):
        analyze(plan.copy(groups=groups, microbatches=4), g, model)


# ---------------------------------------------------------------------------- sequence parallelism
@pytest.mark.parametrize("pp", [1, 2])
def test_sequence_parallel_gpt_matches_reference(topo, pp):
    """tp=2 with sequence parallelism; with pp=2 the sequence shards cross the stage boundary (tp rank t
    of stage 0 sends its shard to tp rank t of stage 1)."""
    g, model = _model_graph(GPT)
    plan = megatron_plan(g, topo, tp=2, pp=pp, sequence_parallel=True, microbatch_size=2)
    styles = {k: v for st in analyze(plan, g, model).stages for k, v in st.tp_styles.items()}
    assert styles["wte"] == styles["wpe"] == "row_rep_seq"  # embedding sums reduce-scattered along the sequence
    assert styles["layers.0.ln1"] == styles["ln_f"] == "seq"
    assert styles["layers.0.attn.qkv"] == styles["layers.0.mlp.fc1"] == "col_seq"
    assert styles["layers.0.attn.out"] == styles["layers.0.mlp.fc2"] == "row_seq"
    assert styles["lm_head"] == "col_gather_seq"
    report = execute_plan(plan, GPT, steps=2, warmup=1, graph=g, check_steps=0)  # every step matches
    _check(report, pp=pp, tp=2)


def test_sequence_parallel_refusals(topo):
    g, model = _model_graph(GPT)
    plan = megatron_plan(g, topo, tp=2, sequence_parallel=True)
    lays = list(plan.layouts)
    lays[g.names.index("ln_f")] = "replicate"
    with pytest.raises(ExecutionError, match="'layers.1.add_1' .* is seq_split but feeds 'ln_f' \\(replicate\\)"):
        analyze(plan.copy(layouts=lays), g, model)
    lays = list(megatron_plan(g, topo, tp=2).layouts)
    lays[g.names.index("layers.0.ln1")] = "seq_split"
    with pytest.raises(ExecutionError, match="its input 'add' \\(replicate\\) is not sequence-split"):
        analyze(plan.copy(layouts=lays), g, model)
    bg, bert = _model_graph(BERT)
    with pytest.raises(ExecutionError, match="'pooler' reads only part of its output"):
        analyze(megatron_plan(bg, topo, tp=2, sequence_parallel=True), bg, bert)
    mg, mlp = _model_graph(MLP)
    with pytest.raises(PlanError, match="needs a sequence model"):
        megatron_plan(mg, topo, tp=2, sequence_parallel=True)
    mlp_plan = megatron_plan(mg, topo, tp=2)
    lays = ["seq_split" if lay == "replicate" and mg.edge_dst.tolist().count(v) else lay
            for v, lay in enumerate(mlp_plan.layouts)]
    with pytest.raises(ExecutionError, match="sequence parallelism .* runs only on zoo gpt"):
        analyze(mlp_plan.copy(layouts=lays), mg, mlp)
    dp_plan = megatron_plan(g, topo, dp=2)
    lays = list(dp_plan.layouts)
    lays[g.names.index("ln_f")] = "seq_split"
    with pytest.raises(ExecutionError, match="'ln_f' is seq_split but its stage has tp=1"):
        analyze(dp_plan.copy(layouts=lays), g, model)


# ---------------------------------------------------------------------------- expert parallelism
MOE = "moe:layers=2,hidden=32,experts=4,seq=8,batch=8"


@pytest.mark.parametrize("ep,zero", [(2, 0), (4, 0), (2, 1)], ids=["ep2", "ep4", "ep2-zero1"])
def test_expert_parallel_moe_matches_reference(topo, ep, zero):
    """dp=4 with the experts of every MoE layer over EP groups of ``ep`` ranks (all_to_all_single on gloo);
    the experts' gradients reduced over their replicas only, ZeRO-1 over them too."""
    g, model = _model_graph(MOE)
    plan = megatron_plan(g, topo, dp=4, expert_parallel=ep, zero=zero)
    lay = analyze(plan, g, model)
    assert [x.ep for x in lay.experts] == [ep, ep] and f"expert parallel ep={ep}" in lay.describe()
    assert lay.experts[0].local_experts(0) == list(range(4 // ep))  # EP rank 0 holds the first E/ep experts
    report = execute_plan(plan, MOE, steps=2, warmup=1, graph=g, check_steps=0)
    _check(report, dp=4)


def test_expert_parallel_refusals(topo):
    g, model = _model_graph(MOE)
    with pytest.raises(ExecutionError, match="with pipeline parallelism .* not supported"):
        analyze(megatron_plan(g, topo, dp=2, pp=2, expert_parallel=2, microbatch_size=2), g, model)
    with pytest.raises(ExecutionError, match="ZeRO stage 3 .* not supported"):
        analyze(megatron_plan(g, topo, dp=4, expert_parallel=2, zero=3), g, model)
    with pytest.raises(ExecutionError, match="ZeRO stage 1 needs at least 2 replicas of each expert"):
        plan = megatron_plan(g, topo, dp=4, expert_parallel=4, zero=1)  # the template keeps ZeRO off there
        analyze(plan.copy(zero=np.ones(g.num_nodes, dtype=np.int64)), g, model)
