"""rlplace export: uniform plans become Megatron-LM arguments, a DeepSpeed config and a torchtitan TOML
whose every flag / key is the runtime's own (tests/data/export_names.json, from the runtimes' source);
plans a runtime cannot express raise NotExpressible naming the part; the CLI writes atomically and
exits 2 with one line and no file for those."""

import json
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pytest

from agent.export import (
    NotExpressible,
    deepspeed_config,
    export,
    megatron_args,
    torchtitan_toml,
    uniform_parallelism,
)
from envs.examples import transformer_graph
from envs.plan import layer_ids, megatron_plan, recompute_flags
from envs.presets import preset
from envs.tasks import moe_graph

try:  # Python 3.11+; on 3.10 the tomli backport, if installed
    import tomllib
except ModuleNotFoundError:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

NAMES = json.loads((Path(__file__).parent / "data" / "export_names.json").read_text())
GPT = dict(layers=8, hidden=256, heads=8, seq=128, vocab=1000, batch=16)


@pytest.fixture(scope="module")
def graphs():
    return {"tied": transformer_graph(**GPT), "untied": transformer_graph(**GPT, tie_embeddings=False),
            "moe": moe_graph(layers=4, experts=8, top_k=2, hidden=256, seq=128, batch=16, vocab=1000)}


@pytest.fixture(scope="module")
def topo():
    return preset("a100-80g-cluster:nodes=2")  # 16 devices


# every exporter branch: tp / pp / dp, virtual stages, SP, full / selective recompute, ZeRO 0-3, bf16 / fp16 / fp32
PLANS = {
    "tp2 pp2 dp2": ("tied", dict(tp=2, pp=2, dp=2, microbatch_size=2)),
    "tp2 pp2 dp2 sp vpp2 selective zero1": ("tied", dict(tp=2, pp=2, dp=2, microbatch_size=2, sequence_parallel=True,
                                                         virtual_stages=2, recompute="selective", zero=1)),
    "tp2 pp2 dp2 sp zero3 full": ("tied", dict(tp=2, pp=2, dp=2, microbatch_size=2, sequence_parallel=True, zero=3,
                                               recompute="full")),
    "pp2 dp2 full zero1": ("tied", dict(pp=2, dp=2, microbatch_size=2, recompute="full", zero=1)),
    "pp4 vpp2": ("tied", dict(pp=4, microbatch_size=1, virtual_stages=2)),
    "pp2 gpipe": ("tied", dict(pp=2, microbatch_size=4, schedule="gpipe")),
    "dp2 fp16": ("tied", dict(dp=2, microbatch_size=4, dtype="fp16")),
    "dp4 zero2 full": ("untied", dict(dp=4, microbatch_size=2, recompute="full", zero=2)),
    "dp4 zero3 fp32": ("untied", dict(dp=4, microbatch_size=2, zero=3, dtype="fp32")),
    "dp4 ddp selective": ("tied", dict(dp=4, microbatch_size=4, recompute="selective")),
    "tp2 dp4 sp zero2 selective": ("untied", dict(tp=2, dp=4, microbatch_size=2, sequence_parallel=True, zero=2,
                                                  recompute="selective")),
    "single device": ("tied", dict(microbatch_size=16)),
    "dp8 ep4": ("moe", dict(dp=8, microbatch_size=2, expert_parallel=4)),
    "dp8 ep8 zero3": ("moe", dict(dp=8, microbatch_size=2, expert_parallel=8, zero=3)),
}


def _plan(graphs, topo, name):
    kind, kw = PLANS[name]
    g = graphs[kind]
    return megatron_plan(g, topo, **kw), g


def _key_paths(doc, prefix=""):
    for k, v in doc.items():
        yield prefix + k
        if isinstance(v, dict):
            yield from _key_paths(v, prefix + k + ".")


def _flags(args):
    return [a for a in args if a.startswith("--")]


def _flag_values(args):
    return {a: b for a, b in zip(args, args[1:] + [""]) if a.startswith("--") and not b.startswith("--")}


def _all_exports(graphs, topo):
    out = {}
    for name in PLANS:
        plan, g = _plan(graphs, topo, name)
        for rt in ("megatron", "deepspeed", "torchtitan"):
            try:
                out[name, rt] = export(plan, g, rt)
            except NotExpressible:
                pass
    return out


def _exports_for(graphs, topo, runtime):
    """(plan name, export, its Parallelism) of every plan ``runtime`` expresses."""
    for (name, rt), ex in _all_exports(graphs, topo).items():
        if rt == runtime:
            yield name, ex, uniform_parallelism(*_plan(graphs, topo, name))


def test_every_emitted_name_is_the_runtimes_own(graphs, topo):
    seen = {"megatron": set(), "deepspeed": set(), "torchtitan": set()}
    for name in PLANS:
        plan, g = _plan(graphs, topo, name)
        par = uniform_parallelism(plan, g)
        for rt, make in (("megatron", megatron_args), ("deepspeed", deepspeed_config), ("torchtitan", torchtitan_toml)):
            try:
                made = make(par)
            except NotExpressible:
                continue
            if rt == "megatron":
                emitted = set(_flags(made))
                for flag, value in _flag_values(made).items():
                    if flag in NAMES["megatron"]["choices"]:
                        assert value in NAMES["megatron"]["choices"][flag], (name, flag, value)
            elif rt == "deepspeed":
                emitted = set(_key_paths(made))
            else:
                doc = tomllib.loads(made)
                emitted = set(_key_paths(doc)) - set(doc)  # section.key (sections themselves are not keys)
                flat = {f"{s}.{k}": v for s, sec in doc.items() for k, v in sec.items()}
                for key, value in flat.items():
                    if key in NAMES["torchtitan"]["choices"]:
                        assert value in NAMES["torchtitan"]["choices"][key], (name, key, value)
            known = set(NAMES[rt]["flags" if rt == "megatron" else "keys"])
            assert emitted <= known, (name, rt, sorted(emitted - known))
            seen[rt] |= emitted
    # the plans above exercise every branch of every writer
    assert seen["megatron"] == set(NAMES["megatron"]["flags"])
    assert seen["deepspeed"] == set(NAMES["deepspeed"]["keys"])
    assert seen["torchtitan"] == set(NAMES["torchtitan"]["keys"])
    assert all(NAMES[rt]["source"] for rt in seen)


def test_megatron_values_and_launch_script(graphs, topo, tmp_path):
    plan, g = _plan(graphs, topo, "tp2 pp2 dp2 sp vpp2 selective zero1")
    ex = export(plan, g, "megatron")
    args = shlex.split(ex.text.split("pretrain_gpt.py", 1)[1].replace("\\\n", " "))
    vals = _flag_values(args)
    assert vals["--tensor-model-parallel-size"] == "2" and vals["--pipeline-model-parallel-size"] == "2"
    assert vals["--micro-batch-size"] == "2" and vals["--global-batch-size"] == "16"  # 2 x dp 2 x 4 microbatches
    assert vals["--num-layers-per-virtual-pipeline-stage"] == "2"  # 8 layers / (pp 2 x v 2)
    assert vals["--recompute-granularity"] == "selective" and "--recompute-method" not in vals
    assert {"--sequence-parallel", "--use-distributed-optimizer", "--bf16"} <= set(args)
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in ex.text
    assert args[-1] == "$@"
    script = tmp_path / ex.filename
    script.write_text(ex.text)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    # full recompute, FSDP2 (ZeRO-2 without resharding), no CUDA_DEVICE_MAX_CONNECTIONS=1 beside FSDP
    plan, g = _plan(graphs, topo, "tp2 dp4 sp zero2 selective")
    text = export(plan, g, "megatron").text
    assert "--use-torch-fsdp2" in text and "--torch-fsdp2-no-reshard-after-forward" in text
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in text.split("pretrain_gpt.py")[0].replace("# ", "")
    plan, g = _plan(graphs, topo, "pp2 dp2 full zero1")
    vals = _flag_values(megatron_args(uniform_parallelism(plan, g)))
    assert (vals["--recompute-granularity"], vals["--recompute-method"], vals["--recompute-num-layers"]) == (
        "full", "uniform", "1")
    plan, g = _plan(graphs, topo, "dp4 zero3 fp32")
    args = megatron_args(uniform_parallelism(plan, g))
    assert "--use-torch-fsdp2" in args and "--torch-fsdp2-no-reshard-after-forward" not in args
    assert not {"--bf16", "--fp16"} & set(args)


def test_deepspeed_batch_identity(graphs, topo):
    checked = 0
    for name, ex, par in _exports_for(graphs, topo, "deepspeed"):
        cfg = json.loads(ex.text)
        # DeepSpeed asserts train_batch_size == micro * gas * (data-parallel world size), not the GPU count
        assert cfg["train_batch_size"] == (cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"]
                                           * par.dp), name
        assert cfg["gradient_accumulation_steps"] == par.microbatches
        if par.pp > 1:
            assert cfg["zero_optimization"]["stage"] < 2
        checked += 1
    assert checked >= 5


def test_torchtitan_toml_parses_and_batches_add_up(graphs, topo):
    checked = 0
    for name, ex, par in _exports_for(graphs, topo, "torchtitan"):
        doc = tomllib.loads(ex.text)
        pa, tr = doc["parallelism"], doc["training"]
        dp = pa["data_parallel_replicate_degree"] * pa["data_parallel_shard_degree"]
        assert dp == par.dp and pa["tensor_parallel_degree"] * pa["pipeline_parallel_degree"] * dp == par.world
        accumulation = tr["global_batch_size"] // (tr["local_batch_size"] * dp)
        pipeline_mb = tr["local_batch_size"] // pa.get("pipeline_parallel_microbatch_size", tr["local_batch_size"])
        assert accumulation * pipeline_mb == par.microbatches, name
        if par.pp > 1:
            assert pa["pipeline_parallel_layers_per_stage"] * par.pp * par.virtual_stages == par.layers
        assert doc["activation_checkpoint"]["mode"] == par.recompute
        checked += 1
    assert checked >= 5
    plan, g = _plan(graphs, topo, "tp2 pp2 dp2 sp zero3 full")
    pa = tomllib.loads(export(plan, g, "torchtitan").text)["parallelism"]
    assert (pa["data_parallel_shard_degree"], pa["fsdp_reshard_after_forward"]) == (2, "always")
    plan, g = _plan(graphs, topo, "pp4 vpp2")
    assert tomllib.loads(export(plan, g, "torchtitan").text)["parallelism"]["pipeline_parallel_schedule"] == (
        "Interleaved1F1B")


def test_uniform_parallelism_reads_the_plan(graphs, topo):
    plan, g = _plan(graphs, topo, "tp2 pp2 dp2 sp vpp2 selective zero1")
    par = uniform_parallelism(plan, g)
    assert (par.tp, par.pp, par.dp, par.virtual_stages, par.layers_per_chunk) == (2, 2, 2, 2, 2)
    assert (par.recompute, par.zero, par.sequence_parallel, par.expert_parallel) == ("selective", 1, True, 1)
    assert (par.micro_batch, par.microbatches, par.global_batch) == (2, 4, 16)
    # the fields set by hand are read the same way
    base, g = _plan(graphs, topo, "tp2 pp2 dp2")
    lays = ["seq_split" if lay == "replicate" else lay for lay in base.layouts]
    hand = base.copy(layouts=lays, zero=np.where(base.dp > 1, 3, 0), recompute=recompute_flags(g, "full"))
    par = uniform_parallelism(hand, g)
    assert (par.sequence_parallel, par.zero, par.recompute) == (True, 3, "full")


def _moved(plan, g, node, devices):
    i = g.names.index(node)
    groups = list(plan.groups)
    groups[i] = devices
    return plan.copy(groups=groups)


def _refused(graphs, topo, case):
    """(plan, graph, runtime, words the reason must contain) for each NotExpressible case."""
    g = graphs["tied"]
    if case == "non-uniform placement":
        plan = megatron_plan(g, topo, microbatch_size=16)
        return _moved(plan, g, "layers.3.mlp.fc1", (1,)), g, "megatron", "'layers.3.mlp.fc1' runs on (1,)"
    if case == "stages on other ranks":
        plan = megatron_plan(g, topo, pp=2, microbatch_size=4)
        swap = {(0,): (1,), (1,): (0,)}
        return plan.copy(groups=[swap[gr] for gr in plan.groups]), g, "deepspeed", "non-uniform placement"
    if case == "different tp per node":
        plan = megatron_plan(g, topo, tp=2, dp=2, microbatch_size=4)
        i = g.names.index("layers.2.mlp.gelu")
        dps, lays = plan.dp.copy(), list(plan.layouts)
        dps[i], lays[i] = 4, "batch_split"
        return plan.copy(dp=dps, layouts=lays), g, "megatron", "tensor / data parallelism"
    if case == "mixed recompute":
        plan = megatron_plan(g, topo, pp=2, microbatch_size=4)
        rc = (layer_ids(g) >= 0) & (layer_ids(g) < 4)
        return plan.copy(recompute=rc), g, "megatron", "recomputation"
    if case == "mixed sequence parallelism":
        plan = megatron_plan(g, topo, tp=2, microbatch_size=4, sequence_parallel=True)
        lays = list(plan.layouts)
        lays[g.names.index("layers.5.ln2")] = "replicate"
        return plan.copy(layouts=lays), g, "megatron", "some token-wise ops but not others"
    if case == "mixed zero":
        plan = megatron_plan(g, topo, dp=4, microbatch_size=4, zero=1)
        z = plan.zero.copy()
        z[g.names.index("layers.0.attn.qkv")] = 2
        return plan.copy(zero=z), g, "deepspeed", "ZeRO stages differ"
    if case == "uneven stages":
        plan = megatron_plan(g, topo, pp=2, microbatch_size=4)
        i = g.names.index("layers.4.ln1")
        layer4 = [v for v in range(g.num_nodes) if layer_ids(g)[v] == 4]
        groups = list(plan.groups)
        for v in layer4:
            groups[v] = plan.groups[i - 1]
        return plan.copy(groups=groups), g, "torchtitan", "different numbers of layers"
    if case == "deepspeed zero2 with pp":
        return megatron_plan(g, topo, pp=2, dp=2, microbatch_size=2, zero=2), g, "deepspeed", "ZeRO stage 2"
    if case == "torchtitan tp without sp":
        return megatron_plan(g, topo, tp=2, dp=2, microbatch_size=2, zero=3), g, "torchtitan", "sequence parallelism"
    if case == "torchtitan zero1":
        return megatron_plan(g, topo, dp=4, microbatch_size=2, zero=1), g, "torchtitan", "ZeRO stage 1"
    if case == "torchtitan ddp beside tp":
        plan = megatron_plan(g, topo, tp=2, dp=2, microbatch_size=2, sequence_parallel=True)
        return plan, g, "torchtitan", "DDP"
    if case == "megatron fsdp with pp":
        return megatron_plan(graphs["untied"], topo, pp=2, dp=2, microbatch_size=2, zero=3), graphs["untied"], \
            "megatron", "--use-torch-fsdp2"
    if case == "megatron fsdp with tied embeddings":
        return megatron_plan(g, topo, dp=2, microbatch_size=2, zero=3), g, "megatron", "tied embeddings"
    if case == "megatron gpipe":
        return megatron_plan(g, topo, pp=2, microbatch_size=4, schedule="gpipe"), g, "megatron", "GPipe"
    if case == "deepspeed tp":
        return megatron_plan(g, topo, tp=2, microbatch_size=4), g, "deepspeed", "tensor parallelism"
    if case == "deepspeed virtual stages":
        return megatron_plan(g, topo, pp=2, microbatch_size=4, virtual_stages=2), g, "deepspeed", "interleaved"
    raise AssertionError(case)


REFUSED = ["non-uniform placement", "stages on other ranks", "different tp per node", "mixed recompute",
           "mixed sequence parallelism", "mixed zero", "uneven stages", "deepspeed zero2 with pp",
           "torchtitan tp without sp", "torchtitan zero1", "torchtitan ddp beside tp", "megatron fsdp with pp",
           "megatron fsdp with tied embeddings", "megatron gpipe", "deepspeed tp", "deepspeed virtual stages"]


@pytest.mark.parametrize("case", REFUSED)
def test_not_expressible_names_the_part(graphs, topo, case):
    plan, g, runtime, words = _refused(graphs, topo, case)
    with pytest.raises(NotExpressible) as err:
        export(plan, g, runtime)
    text = str(err.value)
    assert text.startswith(f"{runtime} cannot express this plan: ") and text.endswith("; run it with rlplace run")
    assert words in err.value.reason and "\n" not in text
    assert err.value.runtime == runtime


def test_non_uniform_placement_is_refused_by_every_runtime(graphs, topo):
    plan, g, _, _ = _refused(graphs, topo, "non-uniform placement")
    for rt in ("megatron", "deepspeed", "torchtitan"):
        with pytest.raises(NotExpressible, match=f"^{rt} cannot express"):
            export(plan, g, rt)


# ---------------------------------------------------------------------- the command line
@pytest.fixture
def files(tmp_path, graphs, topo):
    g = graphs["tied"]
    g.save(tmp_path / "graph.json")
    megatron_plan(g, topo, tp=2, pp=2, dp=2, microbatch_size=2, sequence_parallel=True, zero=1).save(
        tmp_path / "plan.json")
    return tmp_path


def test_cli_writes_the_file(cli, files):
    out = files / "launch" / "megatron.sh"
    out.parent.mkdir()
    rc, stdout, err = cli("export", files / "plan.json", "--model", files / "graph.json", "--to", "megatron",
                          "--out", out)
    assert rc == 0, err
    assert stdout == "" and f"written to {out}" in err
    from envs.graph import OpGraph
    from envs.plan import Plan

    want = export(Plan.load(files / "plan.json"), OpGraph.load(files / "graph.json"), "megatron").text
    assert out.read_text() == want
    assert sorted(p.name for p in out.parent.iterdir()) == ["megatron.sh"]  # no temp file left
    rc, stdout, err = cli("export", files / "plan.json", "-m", files / "graph.json", "--to", "megatron")  # stdout
    assert rc == 0 and stdout == want and "written" not in err


def test_cli_refuses_with_one_line_and_writes_nothing(cli, files):
    out = files / "ds.json"
    rc, stdout, err = cli("export", files / "plan.json", "--model", files / "graph.json", "--to", "deepspeed",
                          "-o", out)
    assert rc == 2 and stdout == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert lines[0].startswith("error: deepspeed cannot express this plan: tensor parallelism (tp=2)")
    assert lines[0].endswith("; run it with rlplace run")
    assert not out.exists() and sorted(p.name for p in files.iterdir()) == ["graph.json", "plan.json"]
    out.write_text("keep")  # an existing file is left as it was
    rc, _, _ = cli("export", files / "plan.json", "--model", files / "graph.json", "--to", "deepspeed", "-o", out)
    assert rc == 2 and out.read_text() == "keep"


def test_cli_usage_errors(cli, files):
    rc, _, err = cli("export", files / "plan.json", "--model", files / "graph.json", "--to", "colossalai",
                     "-o", files / "x")
    assert rc == 2 and "colossalai" in err and "Traceback" not in err
    assert not (files / "x").exists()
    rc, _, err = cli("export", files / "plan.json", "--to", "megatron")  # --model is required
    assert rc == 2 and "--model" in err
    rc, _, err = cli("export", files / "missing.json", "--model", files / "graph.json", "--to", "megatron")
    assert rc == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1
    rc, _, err = cli("export", files / "plan.json", "--model", "gpt-small", "--to", "megatron")  # another graph
    assert rc == 2 and err.startswith("error: ") and "Traceback" not in err


def test_expert_parallelism_is_exported_or_refused(graphs, topo):
    """A plan's expert parallelism reaches the runtimes: Megatron-LM's --num-experts and
    --expert-model-parallel-size, torchtitan's expert_parallel_degree beside FSDP (its experts borrow the
    shard ranks; beside DDP it refuses), DeepSpeed's MoE layer argument as a note (model code); an expert
    with one replica needs no ZeRO stage of its own."""
    plan, g = _plan(graphs, topo, "dp8 ep4")
    par = uniform_parallelism(plan, g)
    assert (par.expert_parallel, par.model["experts"], par.dp) == (4, 8, 8)
    values = _flag_values(megatron_args(par))
    assert values["--expert-model-parallel-size"] == "4" and values["--num-experts"] == "8"
    with pytest.raises(NotExpressible, match="expert parallelism"):
        export(plan, g, "torchtitan")
    assert any("ep_size=4" in n for n in export(plan, g, "deepspeed").notes)
    plan, g = _plan(graphs, topo, "dp8 ep8 zero3")
    doc = tomllib.loads(export(plan, g, "torchtitan").text)
    assert doc["parallelism"]["expert_parallel_degree"] == 8 and doc["parallelism"]["data_parallel_shard_degree"] == 8
    # a dense model's plan says nothing about experts; layers of different expert-parallel degrees are refused
    assert "--num-experts" not in megatron_args(uniform_parallelism(*_plan(graphs, topo, "dp4 ddp selective")))
    mixed, g = _plan(graphs, topo, "dp8 ep4")
    from envs.plan import expert_layers

    layer, _, _ = expert_layers(g)
    mixed.ep[layer == 0] = 2
    with pytest.raises(NotExpressible, match="different expert-parallel degrees"):
        uniform_parallelism(mixed, g)
