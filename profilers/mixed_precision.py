"""Trace models that mix dtypes the way automatic mixed precision (AMP) runs them.

The tracer casts the model and its floating inputs to one dtype (bf16 by default). A model that computes
part of its input in fp32 and feeds it to a layer, e.g. a diffusion U-Net's sinusoidal timestep embedding
(``t[:, None].float() * freqs``) going into ``nn.Linear``, then fails on the first layer whose input and
weights differ ("Input type (float) and bias type (c10::BFloat16) should be the same"), although it
trains under ``torch.autocast``. :class:`MixedPrecisionCasts` applies autocast's rule for its
lower-precision ops (PyTorch's "Automatic Mixed Precision" op reference: matmuls, linear layers,
convolutions and attention run in the autocast dtype) and the same cast for normalisations: when one of
these ops receives floating tensors of *different* dtypes, every floating argument is cast to the traced
dtype first. Calls whose floating arguments already agree are left exactly as written (an explicit fp32
``x.float() @ y.float()`` stays fp32), so a model that traces without the rule traces to the same graph
with it. The casts appear in the graph as ordinary ``cast`` operators.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# autocast's lower-precision ops (PyTorch AMP op reference) and the parameterised normalisations
CAST_OPS = frozenset({
    F.linear, F.bilinear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
    F.conv_transpose3d, F.scaled_dot_product_attention, F.layer_norm, F.group_norm, F.batch_norm,
    F.instance_norm, F.embedding_bag, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
    torch.addbmm, torch.einsum, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
    torch.Tensor.mm, torch.Tensor.bmm,
} | ({F.rms_norm} if hasattr(F, "rms_norm") else set()))


def _floating(values: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(_floating(v))
    return out


def _cast(v: Any, dtype: torch.dtype) -> Any:
    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != dtype:
        return v.to(dtype)
    if isinstance(v, (list, tuple)):
        return type(v)(_cast(x, dtype) for x in v)
    return v


class MixedPrecisionCasts(TorchFunctionMode):
    """While active, a call of an op in :data:`CAST_OPS` whose floating tensor arguments have more than
    one dtype runs with all of them cast to ``dtype`` (see the module docstring)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.casts = 0  # calls whose arguments were cast

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in CAST_OPS and len({t.dtype for t in _floating([*args, *kwargs.values()])}) > 1:
            self.casts += 1
            args = tuple(_cast(a, self.dtype) for a in args)
            kwargs = {k: _cast(v, self.dtype) for k, v in kwargs.items()}
        return func(*args, **kwargs)


__all__ = ["MixedPrecisionCasts", "CAST_OPS"]
