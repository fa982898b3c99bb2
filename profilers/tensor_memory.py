"""Peak bytes of live tensor storage in this process: the CPU counterpart of CUDA's
``torch.cuda.max_memory_allocated`` (PyTorch keeps no allocator statistics on the CPU).

:class:`LiveTensorBytes` is a ``TorchDispatchMode``: every storage an op (forward, autograd's backward,
the optimizer, collectives) returns is counted from its first appearance until it is garbage collected
(a weak reference's callback; a wrapper subclass such as DTensor counts its local tensors), and the storages that exist when tracking starts (parameters, gradients,
optimizer state: :meth:`LiveTensorBytes.track`) are counted from the start. ``peak`` is the high-water
mark of the sum, the number the simulator's memory model predicts. What it leaves out, like CUDA's
counter: the allocator's rounding and fragmentation, the interpreter, libraries, communication buffers
of the backend. It slows every op (a Python call per op), so callers run it on one extra step, untimed.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages while active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._seen = WeakIdKeyDictionary()
        self._refs: dict[int, weakref.ref] = {}

    def track(self, tensors: Iterable[torch.Tensor | None]) -> LiveTensorBytes:
        """Count storages that already exist (a model's parameters, gradients, optimizer state)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t)
        return self

    def _add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta" or t.is_sparse:
            return
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            # a wrapper subclass (a DTensor: its storage reports the global size); count its local tensors
            names, _ = t.__tensor_flatten__()
            for name in names:
                inner = getattr(t, name, None)
                if isinstance(inner, torch.Tensor):
                    self._add(inner)
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
            return
        if st in self._seen:
            return
        nbytes = int(st.nbytes())
        self._seen[st] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        key = id(st)
        self._refs[key] = weakref.ref(st, lambda _r, k=key, b=nbytes: self._free(k, b))

    def _free(self, key: int, nbytes: int) -> None:
        self._refs.pop(key, None)
        self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out


def state_tensors(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[torch.Tensor]:
    """The tensors a training step starts with: parameters, their gradients, buffers, optimizer state."""
    out: list[torch.Tensor] = []
    for p in module.parameters():
        out.append(p)
        if p.grad is not None:
            out.append(p.grad)
    out += list(module.buffers())
    if optimizer is not None:
        for state in optimizer.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


__all__ = ["LiveTensorBytes", "state_tensors"]
