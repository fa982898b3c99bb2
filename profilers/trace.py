"""Trace a PyTorch model into an OpGraph with ``torch.export`` on the meta device.

The model and its example inputs are moved to the ``meta`` device (a model already on meta is used
as is; one with real weights is copied to meta without copying its data), so a 7B-parameter model
traces without allocating its weights. ``torch.export`` gives an ATen graph at the training-IR level
(``linear``, ``conv2d``, ``layer_norm``, ``scaled_dot_product_attention``, ``lstm`` stay whole);
from it:

* **operators**: every node that does work becomes an OpGraph node. Nodes that do none (views,
  reshapes, transposes, splits, ``getitem``, asserts, detach, clone/contiguous, same-dtype casts)
  are folded away and edges rewired through them. Nodes that depend on no input and no parameter
  (``zeros``, ``arange``, masks built from constants) are dropped: they are computed once.
* **leaf modules** (modules without submodules) that export as several ops -- Llama's RMSNorm,
  GPT-2's Conv1D, a rotary embedding -- become one node per call (FLOPs summed, ``n_ops`` = the ops
  it stands for, kind from the class name), so the graph shows the layers a user wrote.
* **names** are module paths (``layers.3.mlp.fc1``) for a module's single op, ``path.kind``
  otherwise (``layers.3.attn.sdpa``, ``layers.3.add_1``); ``module_paths`` holds the bare path.
* **graph inputs** are kept as nodes of kind ``input`` with zero FLOPs and ``out_bytes`` = the input
  tensor's size, so the bytes of the first transfer are explicit (the data loader's device matters).
* **forward FLOPs**: a ``torch.fx`` interpretation of the exported graph runs node by node on meta
  tensors under ``FlopCounterMode``; an op the counter does not know gets a work estimate from its
  tensor sizes (output elements times a small per-kind constant; see ``_estimate_flops``) instead of
  zero. ``graph.meta`` keeps ``counted_flops`` (what FlopCounterMode saw) and ``estimated_flops``.
* **parameters and buffers** go to the first operator that consumes them (through folded views),
  counted once, floating ones at the traced dtype; a tied weight used twice is listed in
  ``graph.meta["shared_params"]``.
* **bytes**: ``out_bytes`` from the node's fake tensor (``node.meta["val"]``, all outputs of a
  multi-output op); edge bytes are the bytes of the tensor the consumer receives (a slice of a
  split counts its slice), at most the producer's output; ``mem_bytes`` = inputs + outputs + params.
* **GEMMs**: every matrix multiply an op runs is listed with its shape (``gemm_node``, ``gemm_shape``,
  ``gemm_kind``; the cost model times each by shape, see ``envs.sim.cost.op_times``), at the traced
  batch: a linear / ``addmm`` / ``mm`` / ``matmul`` / ``bmm`` with one sample-independent operand (a
  weight, possibly cast or viewed) is ``GEMM_DENSE`` (m = the samples' rows, e.g. batch x seq; n = out
  features; k = in features; batch = the weight's own batch dims, e.g. experts), convolutions are
  implicit GEMMs (``GEMM_DENSE``, m = N x output pixels, n = C_out / groups, k = C_in / groups x kernel,
  batch = groups; transposed: m = N x input pixels, n = C_out / groups x kernel, k = C_in / groups), a
  batched product of two activations (``bmm``, ``baddbmm``, ``matmul``) is ``GEMM_PER_HEAD``, and
  scaled-dot-product attention runs two (QK^T: s_q x s_k x d, PV: s_q x d_v x s_k; batch = B x heads).
  An op's rows are kept only when their FLOPs do not exceed the op's counted forward FLOPs (else
  ``graph.meta["gemm_rejected"]`` names it); a fused leaf-module node carries its members' rows.
  ``einsum`` (kept whole by export), RNNs and backward GEMMs (the simulator derives them) are not listed.
* **backward FLOPs** are left to OpGraph's default (2x forward for ops with weights, 1x otherwise).
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import operator
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from envs.errors import RlplaceError
from envs.graph import CAN_BATCH, CAN_REPLICATE, GEMM_DENSE, GEMM_PER_HEAD, OpGraph, default_layout_caps
from profilers.mixed_precision import MixedPrecisionCasts

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                                  "tf32": torch.float32}


class TraceError(RlplaceError):
    """A model could not be traced (export failed, or bad arguments to ``trace``)."""


# ---------------------------------------------------------------------------- op classification
# ATen op names (overload packet names, leading underscores stripped) that do no work.
_NO_WORK = {
    "view", "unsafe_view", "reshape", "transpose", "t", "permute", "expand", "expand_as", "unsqueeze",
    "squeeze", "flatten", "unflatten", "split", "split_with_sizes", "chunk", "unbind", "select", "slice",
    "narrow", "alias", "detach", "contiguous", "clone", "lift_fresh_copy", "view_as", "as_strided",
    "movedim", "swapaxes", "numpy_t", "mT", "assert_async", "assert_scalar", "assert_tensor_metadata",
    "functional_assert_async", "sym_size", "sym_numel", "sym_stride", "sym_storage_offset", "set_grad_enabled",
    "dropout_no_op", "broadcast_to", "tensor_split", "align_to", "view_as_real", "view_as_complex",
    "local_scalar_dense", "item", "record_function_enter_new", "record_function_exit", "profiler",
    "enter_autocast", "exit_autocast", "copy", "identity",
}
_CASTS = {"to", "to_copy", "type_as", "type", "float", "half", "bfloat16", "to_dtype", "to_dtype_layout"}

_KIND_MAP = {
    "linear": "linear", "addmm": "linear", "mm": "matmul", "bmm": "matmul", "matmul": "matmul",
    "baddbmm": "matmul", "einsum": "matmul", "addbmm": "matmul",
    "embedding": "embedding", "embedding_bag": "embedding",
    "layer_norm": "layernorm", "native_layer_norm": "layernorm", "rms_norm": "rmsnorm",
    "fused_rms_norm": "rmsnorm", "group_norm": "groupnorm", "native_group_norm": "groupnorm",
    "instance_norm": "instancenorm", "batch_norm": "batchnorm", "native_batch_norm": "batchnorm",
    "native_batch_norm_legit": "batchnorm", "native_batch_norm_legit_functional": "batchnorm",
    "native_batch_norm_legit_no_training": "batchnorm", "batch_norm_with_update": "batchnorm",
    "batch_norm_no_update": "batchnorm", "cudnn_batch_norm": "batchnorm",
    "gelu": "gelu", "relu": "relu", "relu6": "relu", "silu": "silu", "tanh": "tanh", "sigmoid": "sigmoid",
    "hardtanh": "act", "leaky_relu": "act", "elu": "act", "selu": "act", "softplus": "act", "mish": "act",
    "hardswish": "act", "hardsigmoid": "act", "prelu": "act", "glu": "glu",
    "softmax": "softmax", "log_softmax": "softmax", "safe_softmax": "softmax",
    "scaled_dot_product_attention": "sdpa", "scaled_dot_product_flash_attention": "sdpa",
    "scaled_dot_product_efficient_attention": "sdpa", "scaled_dot_product_flash_attention_for_cpu": "sdpa",
    "scaled_dot_product_cudnn_attention": "sdpa",
    "add": "add", "sub": "sub", "rsub": "sub", "mul": "mul", "div": "div",
    "lstm": "lstm", "gru": "gru", "rnn_tanh": "rnn", "rnn_relu": "rnn",
    "dropout": "dropout", "native_dropout": "dropout", "feature_dropout": "dropout",
    "max_pool1d": "maxpool", "max_pool2d": "maxpool", "max_pool3d": "maxpool",
    "max_pool2d_with_indices": "maxpool", "max_pool3d_with_indices": "maxpool",
    "avg_pool1d": "avgpool", "avg_pool2d": "avgpool", "avg_pool3d": "avgpool",
    "adaptive_avg_pool1d": "avgpool", "adaptive_avg_pool2d": "avgpool", "adaptive_avg_pool3d": "avgpool",
    "adaptive_max_pool2d": "maxpool",
    "cat": "cat", "concat": "cat", "concatenate": "cat", "stack": "cat",
    "sum": "reduce", "mean": "reduce", "amax": "reduce", "amin": "reduce", "max": "reduce", "min": "reduce",
    "prod": "reduce", "var": "reduce", "std": "reduce", "var_mean": "reduce", "norm": "reduce",
    "linalg_vector_norm": "reduce", "argmax": "reduce", "logsumexp": "reduce",
    "cross_entropy": "loss", "cross_entropy_loss": "loss", "nll_loss": "loss", "nll_loss_forward": "loss",
    "mse_loss": "loss",
    "topk": "topk", "sort": "topk",
    "index": "gather", "gather": "gather", "index_select": "gather", "scatter": "gather",
    "scatter_add": "gather", "index_put": "gather", "index_add": "gather", "scatter_reduce": "gather",
    "index_reduce": "gather", "index_copy": "gather", "take_along_dim": "gather", "masked_scatter": "gather",
    "upsample_nearest2d": "upsample", "upsample_bilinear2d": "upsample", "upsample_nearest3d": "upsample",
    "upsample_trilinear3d": "upsample", "interpolate": "upsample",
    "pad": "pad", "constant_pad_nd": "pad", "reflection_pad2d": "pad", "replication_pad2d": "pad",
    "pow": "elementwise", "rsqrt": "elementwise", "sqrt": "elementwise", "exp": "elementwise",
    "neg": "elementwise", "cos": "elementwise", "sin": "elementwise", "where": "elementwise",
    "masked_fill": "elementwise", "cumsum": "elementwise", "cumprod": "elementwise", "index_fill": "elementwise",
    "abs": "elementwise", "log": "elementwise",
    "clamp": "elementwise", "clamp_min": "elementwise", "clamp_max": "elementwise", "erf": "elementwise",
    "reciprocal": "elementwise", "square": "elementwise", "eq": "elementwise", "ne": "elementwise",
    "lt": "elementwise", "gt": "elementwise", "le": "elementwise", "ge": "elementwise",
    "logical_and": "elementwise", "logical_or": "elementwise", "logical_not": "elementwise",
    "bitwise_and": "elementwise", "bitwise_or": "elementwise", "bitwise_not": "elementwise",
    "triu": "elementwise", "tril": "elementwise", "floor_divide": "elementwise", "remainder": "elementwise",
    "fill": "elementwise", "zeros_like": "elementwise", "ones_like": "elementwise", "full_like": "elementwise",
    "one_hot": "elementwise", "maximum": "elementwise", "minimum": "elementwise",
    **{c: "cast" for c in ("to", "to_copy", "type_as", "type", "float", "half", "bfloat16", "to_dtype",
                           "to_dtype_layout")},
}
# Estimated FLOPs per output element for ops FlopCounterMode does not count (order-of-magnitude:
# softmax = max, sub, exp, sum, div; layer norm = mean, var, normalise, scale, shift; tanh-GeLU ~8).
_FLOPS_PER_ELEMENT = {"softmax": 5.0, "layernorm": 5.0, "rmsnorm": 4.0, "groupnorm": 5.0,
                      "instancenorm": 5.0, "batchnorm": 4.0, "gelu": 8.0, "silu": 4.0, "loss": 5.0}
_REDUCING = {"reduce", "loss", "maxpool", "avgpool", "topk"}
_CONV_OPS = {"convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
             "convolution_overrideable", "mkldnn_convolution", "cudnn_convolution"}


def _op_name(node: torch.fx.Node) -> str:
    """Bare op name of a call_function node (``aten.linear.default`` -> ``linear``)."""
    t = node.target
    if t is operator.getitem:
        return "getitem"
    if isinstance(t, torch._ops.OpOverload):
        name = t.overloadpacket.__name__
    elif isinstance(t, torch._ops.OpOverloadPacket):
        name = t.__name__
    elif isinstance(t, torch._ops.HigherOrderOperator):
        name = t.name()
    else:
        name = getattr(t, "__name__", str(t))
    name = name.split(".")[-1]
    return name.strip("_").rstrip("_") or name


def _kind(op: str, node: torch.fx.Node, has_params: bool, vals: list[torch.Tensor]) -> str:
    """Normalised op kind (see envs.graph.WEIGHTED_SPLITTABLE / SHARDABLE_ELEMENTWISE)."""
    if op in _CONV_OPS:
        w = node.args[1] if len(node.args) > 1 else None
        wv = w.meta.get("val") if isinstance(w, torch.fx.Node) else None
        dims = (wv.dim() - 2) if isinstance(wv, torch.Tensor) else 2
        return f"conv{dims}d" if dims in (1, 2, 3) else "conv"
    kind = _KIND_MAP.get(op)
    if kind is None:
        kind = re.sub(r"[^a-z0-9_]", "", op.lower()) or "op"
    if kind == "matmul" and has_params:
        kind = "linear"
    return kind


# ---------------------------------------------------------------------------- tensor helpers
def _tensors(v: Any) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in _tensors(x)]
    return []


def _nbytes(v: Any) -> float:
    return float(sum(t.numel() * t.element_size() for t in _tensors(v)))


def _numel(v: Any) -> float:
    return float(sum(t.numel() for t in _tensors(v)))


def _to_meta(v: Any) -> Any:
    """A meta tensor with the shape, stride and dtype of a fake/real tensor (containers recursively)."""
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="meta")
    if isinstance(v, (list, tuple)):
        return type(v)(_to_meta(x) for x in v)
    return v


def _estimate_flops(kind: str, in_vals: list[torch.Tensor], out_val: Any) -> float:
    """Work of an op FlopCounterMode does not count: output elements times a per-kind constant
    (reductions and pools: input elements)."""
    base = _numel(out_val)
    if kind in _REDUCING:
        base = max(base, float(sum(t.numel() for t in in_vals)))
    return base * _FLOPS_PER_ELEMENT.get(kind, 1.0)


# ---------------------------------------------------------------------------- meta copies
def _meta_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The model on the meta device at ``dtype`` without touching the caller's module or copying
    weight data: a module already on meta is deep-copied (cheap); one with real weights is
    deep-copied with every parameter and buffer replaced by an empty meta tensor."""
    memo: dict[int, Any] = {}
    for p in model.parameters(recurse=True):
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers(recurse=True):
        if id(b) not in memo:
            memo[id(b)] = torch.empty_like(b, device="meta")
    m = copy.deepcopy(model, memo)
    return m.to(dtype=dtype)


def _meta_inputs(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty(tuple(x.shape), dtype=dtype if x.is_floating_point() else x.dtype, device="meta")
    if isinstance(x, tuple):
        return tuple(_meta_inputs(v, dtype) for v in x)
    if isinstance(x, list):
        return [_meta_inputs(v, dtype) for v in x]
    if isinstance(x, Mapping):
        return {k: _meta_inputs(v, dtype) for k, v in x.items()}
    return x


# ---------------------------------------------------------------------------- export
_HINTS = (
    (("data-dependent", "data dependent", "GuardOnDataDependent", "item()", "Could not guard",
      "could not extract specialized integer", "nonzero"),
     "the model branches on tensor values (data-dependent control flow); rewrite the branch with "
     "torch.cond, make it depend on shapes only, or remove it"),
    (("meta tensor", "on meta", "Cannot copy out of meta tensor", "meta device"),
     "the model reads tensor data while tracing (e.g. .item(), .tolist(), numpy()); trace works on the "
     "meta device, so compute such values from shapes or pass them as Python numbers"),
    (("Unsupported dtype", "not implemented for 'BFloat16'", "not implemented for 'Half'"),
     "an operation does not support the traced dtype (e.g. FFTs in bf16); cast its input with .float() in "
     "the model, as mixed-precision training needs anyway, or trace with --dtype fp32"),
    (("Unsupported", "unsupported"),
     "an operation torch.export does not support; see https://pytorch.org/docs/stable/export.html"),
)


def _export_error(exc: BaseException, name: str) -> TraceError:
    text = f"{type(exc).__name__}: {exc}"
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
    where = ""
    m = re.search(r'File "([^"]+)", line (\d+), in (\w+)\s*\n\s*(.+)', text)
    if m:
        where = f" at {m.group(1).rsplit('/', 1)[-1]}:{m.group(2)} in {m.group(3)}(): {m.group(4).strip()}"
    elif exc.__traceback__ is not None:
        import traceback

        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "site-packages" not in f.filename
                  and "/torch/" not in f.filename
                  and not f.filename.endswith(("profilers/trace.py", "profilers/mixed_precision.py"))]
        if frames:
            f = frames[-1]
            where = f" at {f.filename.rsplit('/', 1)[-1]}:{f.lineno} in {f.name}(): {f.line}"
    hint = "check that the model runs on meta tensors and that torch.export.export(model, inputs) succeeds"
    for keys, h in _HINTS:
        if any(k in text for k in keys):
            hint = h
            break
    return TraceError(f"cannot trace {name!r}: {first[:300]}{where}. Fix: {hint}")


def export_meta(model: nn.Module, example_inputs: Any, *, dtype: str = "bf16",
                name: str = "model") -> torch.export.ExportedProgram:
    """``torch.export`` of ``model`` on the meta device at ``dtype``; failures become TraceError."""
    if dtype not in DTYPES:
        raise TraceError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    tdt = DTYPES[dtype]
    if not isinstance(model, nn.Module):
        raise TraceError(f"trace expects an nn.Module, got {type(model).__name__}")
    m = _meta_model(model, tdt)
    inputs = _meta_inputs(example_inputs, tdt)
    if isinstance(inputs, Mapping):
        args, kwargs = (), dict(inputs)
    elif isinstance(inputs, tuple):
        args, kwargs = inputs, {}
    elif isinstance(inputs, list):
        args, kwargs = tuple(inputs), {}
    else:
        args, kwargs = (inputs,), {}
    with warnings.catch_warnings(), _quiet_torch_logs():
        warnings.simplefilter("ignore")
        try:
            with MixedPrecisionCasts(tdt):  # a layer fed a mix of dtypes runs at ``dtype``, as under AMP
                return torch.export.export(m, args, kwargs=kwargs, strict=False)
        except Exception as exc:  # torch raises many types (UserError, GuardOnDataDependentSymNode, ...)
            raise _export_error(exc, name) from exc


_NOISY_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.export", "torch._export",
                  "torch._subclasses.fake_tensor", "torch.fx.experimental.recording")


@contextlib.contextmanager
def _quiet_torch_logs():
    """Silence torch's logs and stderr prints (export prints a partial graph on failure) while
    exporting: a failure is reported as one TraceError instead."""
    names = set(_NOISY_LOGGERS) | {"torch"} | {n for n in logging.root.manager.loggerDict if n.startswith("torch.")}
    loggers = [logging.getLogger(n) for n in sorted(names)]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR + 1)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, lvl in zip(loggers, levels):
            lg.setLevel(lvl)


# ---------------------------------------------------------------------------- flops per node
class _FlopInterpreter(torch.fx.Interpreter):
    """Runs an exported graph node by node on meta tensors, recording FlopCounterMode's count per node."""

    def __init__(self, gm: torch.fx.GraphModule, counter: FlopCounterMode) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.counter = counter
        self.flops: dict[torch.fx.Node, float] = {}
        self.failed: set[torch.fx.Node] = set()

    def placeholder(self, target, args, kwargs):  # noqa: D102 - values come from the node's fake tensor
        return _to_meta(self._current.meta.get("val"))

    def run_node(self, n: torch.fx.Node) -> Any:
        self._current = n
        if n.op != "call_function":
            return super().run_node(n)
        before = self.counter.get_total_flops()
        try:
            out = super().run_node(n)
        except Exception:  # an op without a meta kernel: take shapes from export's fake tensor
            self.failed.add(n)
            out = _to_meta(n.meta.get("val"))
        self.flops[n] = float(self.counter.get_total_flops() - before)
        return out


def _grouped_mm_flops(a_shape, b_shape, *_args, out_shape=None, **_kwargs) -> int:
    """``aten._grouped_mm`` (torch's grouped GEMM: the fused experts of Hugging Face MoE models such as
    Mixtral in transformers 5), which FlopCounterMode does not count: 2 x M x N x K summed over the
    groups (torch/_meta_registrations.py's shapes): a 2-D x 2-D product groups along K (2 M K_total N);
    otherwise every output element sums over ``a``'s last dimension (2-D x 3-D: the token rows of each
    expert times its [K, N] weight)."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * int(np.prod(out_shape)) * a_shape[-1]


# the ops FlopCounterMode does not count that do GEMM work
_EXTRA_FLOP_FORMULAS = {op: _grouped_mm_flops for op in
                        [getattr(torch.ops.aten, "_grouped_mm", None)] if op is not None}


def _count_node_flops(ep: torch.export.ExportedProgram) -> tuple[dict[torch.fx.Node, float], set]:
    counter = FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOP_FORMULAS)
    interp = _FlopInterpreter(ep.graph_module, counter)
    with counter, torch.no_grad():
        interp.run(enable_io_processing=False)
    return interp.flops, interp.failed


# ---------------------------------------------------------------------------- graph building
def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # older exporters spell ModuleList children as getattr(L['self'].layers, '3')
    path = re.sub(r"getattr\(L\['self'\]\.?([\w.]*), '(\w+)'\)", r"\1.\2", str(path))
    path = path.replace("L['self'].", "").replace("L['self']", "")
    return path.strip(".")


def _module_type(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    typ = list(stack.values())[-1][1]
    return typ if isinstance(typ, str) else f"{getattr(typ, '__module__', '')}.{getattr(typ, '__qualname__', '')}"


# Kind of a fused leaf module from its class name (checked in order; first match wins).
_MODULE_KINDS = (("rmsnorm", "rmsnorm"), ("layernorm", "layernorm"), ("groupnorm", "groupnorm"),
                 ("batchnorm", "batchnorm"), ("rotary", "rotary"), ("gelu", "gelu"), ("silu", "silu"),
                 ("swish", "silu"), ("relu", "relu"), ("softmax", "softmax"), ("dropout", "dropout"),
                 ("embedding", "embedding"))


def _fuse_leaf_modules(kept: list[torch.fx.Node], rec: dict,
                       edge: dict[tuple[int, int], float]) -> tuple[list[torch.fx.Node], dict]:
    """Merge each call of a leaf module (one without submodules) that exported as several ops --
    e.g. Llama's RMSNorm (cast, pow, mean, rsqrt, mul...) or GPT-2's Conv1D (view, addmm) -- into
    one node. A call is a maximal run of consecutive nodes (in execution order) with the same module
    path, so the merged group is convex and the graph stays a DAG. The merged node sums FLOPs,
    parameters and ``n_ops`` (kernel launches), outputs the bytes that leave the group and takes its
    kind from the class name (``..RMSNorm`` -> rmsnorm) or else from its heaviest op."""
    paths = {rec[n]["path"] for n in kept if rec[n]["path"]}
    parents = {p.rsplit(".", i)[0] for p in paths for i in range(1, p.count(".") + 1)}
    groups: list[list[int]] = []
    for i, n in enumerate(kept):
        r = rec[n]
        fusable = r["kind"] != "input" and r["path"] and r["path"] not in parents
        if fusable and groups and rec[kept[groups[-1][-1]]]["path"] == r["path"] \
                and rec[kept[groups[-1][-1]]]["kind"] != "input":
            groups[-1].append(i)
        else:
            groups.append([i])
    if all(len(g) == 1 for g in groups):
        return kept, edge
    gid = {i: k for k, g in enumerate(groups) for i in g}
    new_edge: dict[tuple[int, int], float] = {}
    leaving: dict[int, float] = {}
    internal_in: dict[int, float] = {}
    for (s, d), b in edge.items():
        gs, gd = gid[s], gid[d]
        if gs == gd:
            internal_in[gd] = internal_in.get(gd, 0.0) + b
            continue
        new_edge[(gs, gd)] = new_edge.get((gs, gd), 0.0) + b
        leaving[s] = max(leaving.get(s, 0.0), b)
    out_nodes: list[torch.fx.Node] = []
    for k, g in enumerate(groups):
        rep = kept[g[-1]]
        if len(g) > 1:
            members = [rec[kept[i]] for i in g]
            out = sum(rec[kept[i]]["out"] for i in g if i in leaving) or members[-1]["out"]
            mtype = members[-1].get("mtype", "").rsplit(".", 1)[-1].lower()
            kind = next((v for key, v in _MODULE_KINDS if key in mtype), None)
            has_params = any(m["params"] for m in members)
            if kind is None:
                heavy = max(members, key=lambda m: m["flops"])
                kind = "linear" if (heavy["kind"] == "matmul" and has_params) else heavy["kind"]
            rec[rep] = dict(
                kind=kind, op=kind, path=members[-1]["path"], leaf=True, mtype=members[-1].get("mtype", ""),
                flops=sum(m["flops"] for m in members), counted=sum(m["counted"] for m in members),
                estimated=sum(m["estimated"] for m in members), out=out,
                params=set().union(*(m["params"] for m in members)),
                in_bytes=max(0.0, sum(m["in_bytes"] for m in members) - internal_in.get(k, 0.0)),
                n_ops=sum(m.get("n_ops", 1) for m in members),
                members=[x for m in members for x in m["members"]])
        out_nodes.append(rep)
    for (s, d), b in list(new_edge.items()):
        new_edge[(s, d)] = min(b, rec[out_nodes[s]]["out"])
    return out_nodes, new_edge


def _is_torch_leaf(node: torch.fx.Node) -> bool:
    """Whether the innermost module around ``node`` is a built-in torch.nn layer (Linear, Conv2d...)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return False
    typ = list(stack.values())[-1][1]
    typ = typ if isinstance(typ, str) else f"{getattr(typ, '__module__', '')}.{getattr(typ, '__name__', '')}"
    return typ.startswith("torch.nn.modules.") and not typ.startswith("torch.nn.modules.container.")


def _dtype_bytes(dtype: str) -> int:
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


def trace(model: nn.Module, example_inputs: Any, *, batch_size: int, dtype: str = "bf16",
          name: str | None = None) -> OpGraph:
    """Trace ``model`` called on ``example_inputs`` (a tensor, tuple of tensors or dict of keyword
    tensors whose leading dimension is ``batch_size``) into an OpGraph at ``dtype``."""
    if int(batch_size) < 1:
        raise TraceError(f"batch_size must be >= 1, got {batch_size}")
    gname = name or type(model).__name__
    ep = export_meta(model, example_inputs, dtype=dtype, name=gname)
    return graph_from_export(ep, batch_size=int(batch_size), dtype=dtype, name=gname)


def graph_from_export(ep: torch.export.ExportedProgram, *, batch_size: int, dtype: str,
                      name: str) -> OpGraph:
    """Build the OpGraph of an ExportedProgram traced on meta tensors (see the module docstring)."""
    return graph_and_members(ep, batch_size=batch_size, dtype=dtype, name=name)[0]


def graph_and_members(ep: torch.export.ExportedProgram, *, batch_size: int, dtype: str,
                      name: str) -> tuple[OpGraph, list[list[torch.fx.Node]]]:
    """The OpGraph and, per OpGraph node, the exported fx nodes that do its work (in order)."""
    flops_of, failed = _count_node_flops(ep)
    param_target, user_inputs = _signature_inputs(ep)
    flow = _Dataflow(param_target, flops_of, _dtype_bytes(dtype))
    for n in ep.graph.nodes:
        flow.visit(n)
    edge = flow.edge_bytes()
    own_flops = {n: flow.rec[n]["flops"] for n in flow.kept}  # before fusion replaces the records
    kept, edge = _fuse_leaf_modules(flow.kept, flow.rec, edge)
    gemms, rejected = _graph_gemms(kept, flow.rec, own_flops, _sample_dependent(ep, user_inputs))
    graph = _op_graph(flow, kept, edge, _node_names(kept, flow.rec, user_inputs), failed, gemms, rejected,
                      batch_size=batch_size, dtype=dtype, name=name)
    return graph, [list(flow.rec[n]["members"]) for n in kept]


def _signature_inputs(ep: torch.export.ExportedProgram) -> tuple[dict[str, str], list[str]]:
    """The placeholders that hold parameters, buffers or constants (placeholder name -> their target),
    and the names of the user inputs."""
    from torch.export.graph_signature import InputKind

    param_target: dict[str, str] = {}
    user_inputs: list[str] = []
    for spec in ep.graph_signature.input_specs:
        arg_name = getattr(spec.arg, "name", None)
        if arg_name is None:
            continue
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            param_target[arg_name] = spec.target or arg_name
        elif spec.kind == InputKind.USER_INPUT:
            user_inputs.append(arg_name)
    return param_target, user_inputs


def _inputs_of(n: torch.fx.Node) -> list[torch.fx.Node]:
    return [a for a in n.all_input_nodes if a.op != "get_attr"]


class _Dataflow:
    """One pass over the exported graph in order: which fx nodes do work (``kept``, with a record each in
    ``rec``), and for every node where its data comes from (the kept producers it reads through folded
    views), which parameters it carries to its first consumer, and whether it is live (depends on a user
    input or a parameter)."""

    def __init__(self, param_target: dict[str, str], flops_of: dict[torch.fx.Node, float], dbytes: int) -> None:
        self.param_target, self.flops_of, self.dbytes = param_target, flops_of, dbytes
        self.origins: dict[torch.fx.Node, set[torch.fx.Node]] = {}
        self.params: dict[torch.fx.Node, set[str]] = {}
        self.live: dict[torch.fx.Node, bool] = {}
        self.kept: list[torch.fx.Node] = []
        self.rec: dict[torch.fx.Node, dict] = {}
        self.param_bytes_of: dict[str, float] = {}
        self.assigned: dict[str, torch.fx.Node] = {}  # parameter -> the op it is counted on
        self.shared: dict[str, list[str]] = {}  # parameter -> every op that uses it (tied weights)

    def _set(self, n: torch.fx.Node, origins: set, params: set, live: bool) -> None:
        self.origins[n], self.params[n], self.live[n] = origins, params, live

    def visit(self, n: torch.fx.Node) -> None:
        if n.op == "placeholder":
            self._placeholder(n)
        elif n.op == "call_function":
            self._call(n)

    def _placeholder(self, n: torch.fx.Node) -> None:
        """A parameter (its bytes, carried to the first consumer) or a user input (kept as an input node)."""
        val = n.meta.get("val")
        if n.name in self.param_target:
            tgt = self.param_target[n.name]
            t = val if isinstance(val, torch.Tensor) else None
            if t is not None:
                per = self.dbytes if t.is_floating_point() else t.element_size()
                self.param_bytes_of[tgt] = float(t.numel() * per)
            self._set(n, set(), {tgt}, True)
            return
        self._set(n, {n}, set(), True)
        self.kept.append(n)
        self.rec[n] = dict(kind="input", op="input", path="", members=[], flops=0.0, counted=0.0, estimated=0.0,
                           out=_nbytes(val), in_bytes=0.0, params=set())

    def _does_no_work(self, n: torch.fx.Node, op: str, ins: list[torch.fx.Node], val: Any) -> bool:
        """Views, reshapes, getitem, same-dtype casts, dropout with p = 0, ops without tensor output."""
        no_work = op in _NO_WORK or op == "getitem" or not _tensors(val)
        if op in _CASTS:
            src = [v for a in ins for v in _tensors(a.meta.get("val"))]
            outs = _tensors(val)
            no_work = no_work or (bool(src) and bool(outs) and src[0].dtype == outs[0].dtype)
        if op in ("dropout", "native_dropout") and len(n.args) > 1 and n.args[1] == 0:
            no_work = True
        return no_work

    def _call(self, n: torch.fx.Node) -> None:
        ins = _inputs_of(n)
        op = _op_name(n)
        val = n.meta.get("val")
        is_live = any(self.live.get(a, False) for a in ins)
        in_params = set().union(*(self.params.get(a, set()) for a in ins)) if ins else set()
        in_origins = set().union(*(self.origins.get(a, set()) for a in ins)) if ins else set()
        # constants (no input, no parameter) and parameter-only updates whose result only leaves the
        # graph (BatchNorm's num_batches_tracked += 1) are not part of the step's dataflow
        if not is_live or (not in_origins and all(u.op == "output" for u in n.users)):
            self._set(n, set(), set(), False)
            return
        if self._does_no_work(n, op, ins, val) and self.flops_of.get(n, 0.0) == 0.0:
            self._set(n, in_origins, in_params, True)  # folded: its readers read its producers
            return
        self.kept.append(n)
        self._set(n, {n}, set(), True)
        in_vals = [t for a in ins if self.origins.get(a) for t in _tensors(a.meta.get("val"))]
        kind = _kind(op, n, bool(in_params), in_vals)
        counted = self.flops_of.get(n, 0.0)
        estimated = 0.0 if counted > 0 else _estimate_flops(kind, in_vals, val)
        self.rec[n] = dict(kind=kind, op=op, path=_module_path(n), leaf=_is_torch_leaf(n), mtype=_module_type(n),
                           members=[n], flops=counted + estimated, counted=counted, estimated=estimated,
                           out=_nbytes(val), params=self._claim(n, in_params), srcs=in_origins)

    def _claim(self, n: torch.fx.Node, in_params: set[str]) -> set[str]:
        """The parameters ``n`` reads that no earlier op has claimed (later users are recorded as shared)."""
        mine = set()
        for p in sorted(in_params):
            if p in self.assigned:
                self.shared.setdefault(p, [self.assigned[p].name]).append(n.name)
            else:
                self.assigned[p] = n
                mine.add(p)
        return mine

    def edge_bytes(self) -> dict[tuple[int, int], float]:
        """Per (producer, consumer) index pair of ``kept``, the bytes of each argument the consumer receives
        from it (at most the producer's output); also sets each record's ``in_bytes``."""
        index = {n: i for i, n in enumerate(self.kept)}
        edge: dict[tuple[int, int], float] = {}
        for n in self.kept:
            if n.op == "placeholder":
                continue
            in_bytes = 0.0
            for a in _inputs_of(n):
                if a.name in self.param_target:
                    continue
                b = _nbytes(a.meta.get("val"))
                srcs = {a} if a in index else self.origins.get(a, set())
                if srcs:
                    in_bytes += b
                for s in srcs:
                    key = (index[s], index[n])
                    edge[key] = edge.get(key, 0.0) + min(b, self.rec[s]["out"])
            self.rec[n]["in_bytes"] = in_bytes
        for (s, d), b in list(edge.items()):
            edge[(s, d)] = min(b, self.rec[self.kept[s]]["out"])
        return edge


# ---------------------------------------------------------------------------- GEMMs
_MATMUL_OPERANDS = {"linear": (0, 1), "mm": (0, 1), "bmm": (0, 1), "matmul": (0, 1), "addmm": (1, 2),
                    "baddbmm": (1, 2), "addbmm": (1, 2)}  # op -> the argument positions of its two factors
_MAX_GEMM_DIM = 10**12  # OpGraph's bound on a GEMM's m, n, k and batch
Gemm = tuple[int, int, int, int, int]  # (m, n, k, batch, kind) at the traced batch


def _sample_dependent(ep: torch.export.ExportedProgram, user_inputs: Sequence[str]) -> dict[torch.fx.Node, bool]:
    """Per fx node, whether its value depends on a user input (the samples) rather than on parameters,
    buffers and constants only (a weight cast to bf16 or transposed is still a weight)."""
    users = set(user_inputs)
    dep: dict[torch.fx.Node, bool] = {}
    for n in ep.graph.nodes:
        dep[n] = n.name in users if n.op == "placeholder" else any(dep.get(a, False) for a in n.all_input_nodes)
    return dep


def _dims(t: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Static (shape, stride) of a tensor value, or None (not a tensor, or a symbolic size)."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        shape, stride = tuple(t.shape), tuple(t.stride())
    except (RuntimeError, NotImplementedError):  # sparse or otherwise strideless
        return None
    if not all(isinstance(x, int) for x in shape + stride):
        return None
    return shape, stride


def _prod(xs: Sequence[int]) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def _matmul_gemm(a: tuple, b: tuple, dep_a: bool, dep_b: bool) -> Gemm | None:
    """The GEMM of ``A[..., M, K] @ B[..., K, N]`` (``a``, ``b``: (shape, stride); 1-D factors as in
    torch.matmul). Two sample-dependent factors: a per-head batched GEMM over the broadcast batch dims. One:
    a dense weight GEMM whose m are the sample side's rows (all its batch dims folded in, so the transpose
    ``W @ X`` counts as ``X^T @ W^T``), batch = the weight's own (not broadcast) batch dims. None: no row."""
    (sa, ta), (sb, tb) = a, b
    if len(sa) == 1:
        sa, ta = (1, sa[0]), (0, ta[0])
    if len(sb) == 1:
        sb, tb = (sb[0], 1), (tb[0], 0)
    if len(sa) < 2 or len(sb) < 2 or sa[-1] != sb[-2] or not (dep_a or dep_b):
        return None
    m_, k_, n_ = sa[-2], sa[-1], sb[-1]
    try:
        batch = _prod(torch.broadcast_shapes(sa[:-2], sb[:-2]))
    except RuntimeError:
        return None
    if dep_a and dep_b:
        return (m_, n_, k_, batch, GEMM_PER_HEAD)
    w_shape, w_stride = (sb, tb) if dep_a else (sa, ta)
    rows, out_features = batch * (m_ if dep_a else n_), (n_ if dep_a else m_)
    wb = _prod(d for d, st in zip(w_shape[:-2], w_stride[:-2]) if st != 0)  # expanded dims have stride 0
    if wb < 1 or rows % wb:
        wb = 1
    return (rows // wb, out_features, k_, wb, GEMM_DENSE)


def _conv_gemm(n: torch.fx.Node, op: str, x: tuple, w: tuple) -> Gemm | None:
    """A convolution as an implicit GEMM (groups from the shapes: weight [C_out, C_in / g, *kernel], for a
    transposed one [C_in, C_out / g, *kernel]): m = N x output pixels, n = C_out / g, k = C_in / g x kernel,
    batch = g; transposed (the data gradient of a convolution): m = N x input pixels, n = C_out / g x kernel,
    k = C_in / g. Both give FlopCounterMode's count exactly."""
    out = _dims(n.meta.get("val"))
    (sx, _), (sw, _) = x, w
    sd = len(sw) - 2
    if out is None or sd < 1 or len(sx) < sd + 1 or len(out[0]) < sd + 1:
        return None
    so = out[0]
    batch_n, c_in, kernel = _prod(sx[:-(sd + 1)]), sx[-(sd + 1)], _prod(sw[2:])
    transposed = "transpose" in op or (op in ("convolution", "convolution_overrideable") and len(n.args) > 6
                                       and n.args[6] is True)
    if transposed:
        c_out, cout_g = so[-(sd + 1)], sw[1]
        if cout_g < 1 or c_out % cout_g or sw[0] != c_in:
            return None
        g = c_out // cout_g
        if c_in % g:
            return None
        return (batch_n * _prod(sx[-sd:]), cout_g * kernel, c_in // g, g, GEMM_DENSE)
    c_out, cin_g = sw[0], sw[1]
    if cin_g < 1 or c_in % cin_g:
        return None
    g = c_in // cin_g
    if c_out % g:
        return None
    return (batch_n * _prod(so[-sd:]), c_out // g, cin_g * kernel, g, GEMM_DENSE)


def _sdpa_gemms(args: tuple) -> list[Gemm]:
    """The two batched GEMMs of scaled-dot-product attention on q [..., s_q, d], k [..., s_k, d],
    v [..., s_k, d_v]: QK^T (s_q, s_k, d) and PV (s_q, d_v, s_k), batch = B x query heads."""
    qkv = [_dims(a.meta.get("val")) if isinstance(a, torch.fx.Node) else None for a in args[:3]]
    if len(qkv) < 3 or any(t is None or len(t[0]) < 2 for t in qkv):
        return []
    (sq, _), (sk, _), (sv, _) = qkv
    if sk[-1] != sq[-1] or sv[-2] != sk[-2]:
        return []
    batch = _prod(sq[:-2])
    return [(sq[-2], sk[-2], sq[-1], batch, GEMM_PER_HEAD), (sq[-2], sv[-1], sk[-2], batch, GEMM_PER_HEAD)]


def _fx_gemms(n: torch.fx.Node, dep: Mapping[torch.fx.Node, bool]) -> list[Gemm]:
    """The matrix multiplies one exported op runs (forward only; see the module docstring)."""
    if n.op != "call_function":
        return []
    op = _op_name(n)

    def operand(i: int) -> tuple[tuple | None, bool]:
        a = n.args[i] if len(n.args) > i else None
        if not isinstance(a, torch.fx.Node):
            return None, False
        return _dims(a.meta.get("val")), dep.get(a, False)

    if "scaled_dot_product" in op and "attention" in op and "backward" not in op:
        return _sdpa_gemms(tuple(n.args))
    if op in _MATMUL_OPERANDS:
        (a, da), (b, db) = (operand(i) for i in _MATMUL_OPERANDS[op])
        if a is None or b is None:
            return []
        if op == "linear":  # weight [N, K] (or [K]): the factor is its transpose
            if len(b[0]) not in (1, 2):
                return []
            b = (b[0][::-1], b[1][::-1]) if len(b[0]) == 2 else (b[0], b[1])
        row = _matmul_gemm(a, b, da, db)
        return [row] if row is not None else []
    if op in _CONV_OPS:
        (x, dx), (w, dw) = operand(0), operand(1)
        if x is None or w is None or not dx or dw:  # a weight convolving the samples
            return []
        row = _conv_gemm(n, op, x, w)
        return [row] if row is not None else []
    return []


def _graph_gemms(kept: Sequence[torch.fx.Node], rec: dict, own_flops: Mapping[torch.fx.Node, float],
                 dep: Mapping[torch.fx.Node, bool]) -> tuple[list[tuple[int, Gemm]], list[str]]:
    """Per OpGraph node (index into ``kept``), the GEMMs of the fx ops it stands for (its ``members``; a fused
    leaf-module node has all of theirs), and the ops whose GEMMs were dropped because their FLOPs exceed
    what the op counted (``own_flops``: each fx op's forward FLOPs before fusion)."""
    rows: list[tuple[int, Gemm]] = []
    rejected: set[str] = set()
    for v, node in enumerate(kept):
        for member in rec[node]["members"]:
            gemms = [g for g in _fx_gemms(member, dep) if all(1 <= x <= _MAX_GEMM_DIM for x in g[:4])]
            if not gemms:
                continue
            gflops = sum(2.0 * m * nn_ * k * b for m, nn_, k, b, _ in gemms)
            if gflops > own_flops.get(member, 0.0) * (1.0 + 1e-6):
                rejected.add(_op_name(member))
                continue
            rows.extend((v, g) for g in gemms)
    return rows, sorted(rejected)


def _op_graph(flow: _Dataflow, kept: list[torch.fx.Node], edge: dict[tuple[int, int], float], names: list[str],
              failed: set, gemms: Sequence[tuple[int, Gemm]] = (), gemm_rejected: Sequence[str] = (), *,
              batch_size: int, dtype: str, name: str) -> OpGraph:
    """The OpGraph of the kept (and fused) nodes: costs, layout capabilities, GEMMs (node index, (m, n, k,
    batch, kind)) and the trace's meta."""
    rec, param_bytes_of = flow.rec, flow.param_bytes_of
    kinds = [rec[n]["kind"] for n in kept]
    pbytes = np.array([sum(param_bytes_of.get(p, 0.0) for p in rec[n]["params"]) for n in kept])
    out_bytes = np.array([rec[n]["out"] for n in kept])
    in_bytes = np.array([rec[n]["in_bytes"] for n in kept])
    caps = np.array([CAN_BATCH | CAN_REPLICATE if k == "input" else default_layout_caps(k, pb > 0)
                     for k, pb in zip(kinds, pbytes)], dtype=np.int64)
    es = sorted(edge)
    unused = sorted(set(param_bytes_of) - set(flow.assigned))
    meta = {
        "source": "torch.export",
        "torch": torch.__version__,
        "counted_flops": float(sum(rec[n]["counted"] for n in kept)),
        "estimated_flops": float(sum(rec[n]["estimated"] for n in kept)),
        "param_count_bytes": float(sum(param_bytes_of.values())),
        "unused_params": unused,
        "unused_param_bytes": float(sum(param_bytes_of[p] for p in unused)),
        "shared_params": {k: v for k, v in flow.shared.items()},
        "inputs": "kept as nodes of kind 'input' (zero FLOPs, out_bytes = input size)",
        "no_meta_kernel": sorted({_op_name(n) for n in failed}),
        "gemm_flops": float(sum(2.0 * m * n_ * k * b for _, (m, n_, k, b, _) in gemms)),
        "gemm_rejected": list(gemm_rejected),
    }
    return OpGraph(
        names=names, kinds=kinds, module_paths=[rec[n]["path"] for n in kept],
        fwd_flops=np.array([rec[n]["flops"] for n in kept]), param_bytes=pbytes, out_bytes=out_bytes,
        mem_bytes=in_bytes + out_bytes + pbytes, layout_caps=caps,
        n_ops=np.array([rec[n].get("n_ops", 1) for n in kept], dtype=np.int64),
        edge_src=[s for s, _ in es], edge_dst=[d for _, d in es], edge_bytes=[edge[k] for k in es],
        gemm_node=np.array([v for v, _ in gemms], dtype=np.int64),
        gemm_shape=np.array([g[:4] for _, g in gemms], dtype=np.float64).reshape(-1, 4),
        gemm_kind=np.array([g[4] for _, g in gemms], dtype=np.int64),
        batch_size=batch_size, dtype=dtype, name=name, meta=meta,
    )


def _node_names(kept: Sequence[torch.fx.Node], rec: dict, user_inputs: Sequence[str]) -> list[str]:
    """Readable unique names: the module path when a module holds one op (``layers.3.mlp.fc1``),
    ``path.kind`` otherwise (``layers.3.add``, numbered ``layers.3.add_1`` on repeats)."""
    per_path: dict[str, int] = {}
    for n in kept:
        p = rec[n]["path"]
        if p:
            per_path[p] = per_path.get(p, 0) + 1
    out: list[str] = []
    used: dict[str, int] = {}
    for n in kept:
        r = rec[n]
        if r["kind"] == "input":
            base = f"input.{n.name}"
        elif r["path"] and per_path[r["path"]] == 1 and (r.get("leaf", False) or r["params"]):
            base = r["path"]
        else:
            base = f"{r['path']}.{r['kind']}" if r["path"] else r["kind"]
        nm = base
        if nm in used:
            used[base] += 1
            nm = f"{base}_{used[base]}"
            while nm in used:
                used[base] += 1
                nm = f"{base}_{used[base]}"
        used.setdefault(nm, 0)
        out.append(nm)
    return out
