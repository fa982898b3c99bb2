"""Scale-out: run independent jobs (dataset tasks, benchmark cases, candidate plans) in parallel on Ray,
or one after another in this process when Ray is not asked for.

:class:`Executor` is the one place that knows about Ray. ``Executor()`` runs jobs in-process;
``Executor(ray=True)`` starts a local Ray instance (``num_cpus`` workers, default: this machine's
cores) and ``Executor(address="HOST:PORT")`` joins an existing cluster (``ray start --head`` on one
machine, ``ray start --address=HOST:PORT`` on the others; ``auto`` uses ``RAY_ADDRESS``). The address
is checked with a plain TCP connection first, so an unreachable cluster is one clear error after a few
seconds, not a two-minute hang inside Ray. ``map`` returns results in input order, so the output is
the same whichever way the jobs ran; a job's exception is re-raised in the caller as it would be
in-process. Ray is the optional ``[scale]`` extra: without it, asking for Ray is a :class:`ScaleError`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from envs.errors import RlplaceError

CONNECT_TIMEOUT_S = 5.0


class ScaleError(RlplaceError):
    """Ray was asked for but is not installed, or the cluster address cannot be reached."""


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ScaleError("Ray is not installed: pip install 'rlplace[scale]' (or run without --ray)") from None
    return ray


def check_address(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise ScaleError unless a TCP connection to ``address`` (``HOST:PORT`` or ``ray://HOST:PORT``)
    opens within ``timeout_s``; ``auto`` is resolved by Ray itself."""
    if address == "auto":
        return
    text = address.removeprefix("ray://")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ScaleError(f"bad Ray address {address!r}: expected HOST:PORT (e.g. 10.0.0.1:6379) or 'auto'")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ScaleError(f"cannot reach the Ray cluster at {address} ({exc.strerror or exc}); start it with "
                         "`ray start --head` or run without --ray-address") from None


class Executor:
    """Runs ``fn(item)`` for many items, on Ray or in-process (see the module docstring)."""

    def __init__(self, ray: bool = False, address: str | None = None, num_cpus: int | None = None):
        self.use_ray = bool(ray or address)
        self.address = address
        self.num_cpus = num_cpus
        self._started = False
        self._ray = None

    @classmethod
    def from_flags(cls, ray: bool = False, address: str | None = None) -> Executor:
        return cls(ray=ray, address=address)

    def __enter__(self) -> Executor:
        if self.use_ray:
            ray = _import_ray()
            if not ray.is_initialized():
                if self.address:
                    check_address(self.address)
                    ray.init(address=self.address, log_to_driver=False, include_dashboard=False)
                else:
                    ray.init(num_cpus=self.num_cpus or os.cpu_count() or 1, log_to_driver=False,
                             include_dashboard=False)
                self._started = True
            self._ray = ray
        return self

    def __exit__(self, *exc: object) -> None:
        if self._started and self._ray is not None:
            self._ray.shutdown()
        self._started = False

    @property
    def workers(self) -> int:
        if self.use_ray and self._ray is not None:
            return max(1, int(self._ray.cluster_resources().get("CPU", 1)))
        return 1

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any], *,
            on_result: Callable[[int, Any], None] | None = None) -> list[Any]:
        """``[fn(x) for x in items]``, in input order; ``on_result(index, result)`` as each one finishes
        (in completion order on Ray), e.g. to save finished work before the rest is done."""
        items = list(items)
        if not self.use_ray:
            out = []
            for i, x in enumerate(items):
                r = fn(x)
                if on_result is not None:
                    on_result(i, r)
                out.append(r)
            return out
        if self._ray is None:
            raise ScaleError("Executor(ray=True) must be entered (with Executor(...) as ex:) before map()")
        ray = self._ray
        remote = ray.remote(num_cpus=1)(_call)
        refs = [remote.remote(fn, x) for x in items]
        index = {ref: i for i, ref in enumerate(refs)}
        out: list[Any] = [None] * len(items)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                i = index[ref]
                out[i] = ray.get(ref)
                if on_result is not None:
                    on_result(i, out[i])
        return out


def _call(fn: Callable[[Any], Any], x: Any) -> Any:
    import torch

    torch.set_num_threads(1)  # one core per Ray task
    return fn(x)


def chunks(items: Sequence[Any], size: int) -> list[list[Any]]:
    return [list(items[i:i + size]) for i in range(0, len(items), max(1, size))]


__all__ = ["Executor", "ScaleError", "check_address"]
