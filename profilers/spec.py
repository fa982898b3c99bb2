"""Spec strings: one string names a model anywhere a graph is expected.

Three forms, tried in this order:

* a graph JSON file (``graph.json``): loaded with ``OpGraph.load``;
* ``path/to/file.py:build_fn[:knob=value,...]``: **executes that file** and calls
  ``build_fn(**knobs)`` under ``torch.device("meta")`` (``my_model.py:build:layers=4,hidden=256``; a
  knob the function does not take is an error listing those it does); it returns ``(module,
  example_inputs)`` (or just a module, when an input shape is given separately);
* ``hf:NAME[:key=value,...]``: a transformers config from ``profilers.hf.CONFIGS`` (extra ``[hf]``),
  e.g. ``hf:llama-7b:seq=2048,batch=8`` (``seq``, ``batch`` shape the input; other keys override the
  config);
* a zoo member ``family:knob=value,...`` (``gpt:layers=24,hidden=2048,heads=16,seq=2048,batch=8``),
  see ``profilers.zoo.FAMILIES``; ``batch`` is the traced batch size.

:func:`sample_specs` draws zoo specs from the size classes of ``profilers.zoo.SIZES`` or, with
``size="realistic"``, from the realistic ranges of ``profilers.families`` (which also holds family
specs with knob ranges for zoo, ``hf:`` and file models).

Traced graphs are cached in-process (environments ask for the same spec repeatedly); each call
returns a fresh copy, so callers may modify what they get.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import inspect
import os
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from envs.errors import RlplaceError
from envs.graph import OpGraph
from profilers.trace import DTYPES, trace
from profilers.zoo import FAMILIES, SIZES


class SpecError(RlplaceError):
    """A model spec string is malformed or names an unknown family, knob or file."""


def parse_spec(spec: str) -> tuple[str, dict[str, int | float | str]]:
    """``"gpt:layers=2,hidden=64"`` -> ``("gpt", {"layers": 2, "hidden": 64})`` (checked against the
    family's knobs)."""
    if not isinstance(spec, str) or not spec.strip():
        raise SpecError("empty model spec; expected family:knob=value,... "
                        f"(families: {', '.join(sorted(FAMILIES))})")
    family, _, args = spec.strip().partition(":")
    family = family.strip()
    if family not in FAMILIES:
        raise SpecError(f"unknown model family {family!r} in {spec!r}; families: {', '.join(sorted(FAMILIES))} "
                        "(or a graph .json file, or path/to/file.py:build_fn)")
    valid = knobs(family)
    out: dict[str, int | float | str] = {}
    for part in filter(None, (p.strip() for p in args.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or not value.strip():
            raise SpecError(f"bad knob {part!r} in {spec!r}: expected key=value")
        if key not in valid:
            raise SpecError(f"unknown knob {key!r} for {family}; knobs: "
                            + ", ".join(f"{k}={v}" for k, v in valid.items()))
        out[key] = _knob_value(family, key, value.strip(), valid[key], spec)
    return family, out


MAX_KNOB = 10**7  # no zoo knob (layers, widths, sequence, batch, vocabulary) is meaningful above this
# Knobs that repeat a block of the model (the traced graph grows with them, ~5 s of tracing per 100 GPT layers):
# at most MAX_REPEAT, above the deepest published networks (ResNet-1202, He et al. 2016; DeepNet's 1,000-layer
# transformer, Wang et al. 2022), so a mistyped range fails here instead of tracing for hours.
MAX_REPEAT = 2048
REPEAT_KNOBS = frozenset({"layers", "depth", "blocks", "tables", "user_tables", "item_tables", "bottom_layers",
                          "top_layers", "experts", "n_layer", "num_hidden_layers", "num_layers",
                          "num_decoder_layers", "num_encoder_layers", "encoder_layers", "decoder_layers"})


def knob_limit(key: str) -> int:
    """The largest value a knob named ``key`` takes (zoo, transformers-config and model-file knobs)."""
    return MAX_REPEAT if key in REPEAT_KNOBS else MAX_KNOB


def _knob_value(family: str, key: str, text: str, default: Any, spec: str) -> int | float:
    """A knob's value: a number > 0, an integer where the default is one, at most :func:`knob_limit`."""
    value = _number(text)
    if isinstance(value, str) or value != value or value in (float("inf"), float("-inf")):
        raise SpecError(f"knob {key}={text!r} in {spec!r} must be a number")
    if isinstance(default, int) and not isinstance(default, bool):
        if isinstance(value, float):
            if not value.is_integer():
                raise SpecError(f"knob {key}={text!r} of {family} must be an integer")
            value = int(value)
    if not 0 < value <= knob_limit(key):
        raise SpecError(f"knob {key}={text} of {family} must be > 0 and <= {knob_limit(key):g}")
    return value


def knobs(family: str) -> dict[str, Any]:
    """A family's knobs and their defaults."""
    sig = inspect.signature(FAMILIES[family])
    return {k: p.default for k, p in sig.parameters.items()}


def format_spec(family: str, values: dict[str, Any]) -> str:
    return family + (":" + ",".join(f"{k}={v}" for k, v in values.items()) if values else "")


def _number(text: str) -> int | float | str:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _first_line(exc: BaseException) -> str:
    from envs.files import one_line

    return one_line(exc)


_FILE_SPEC = re.compile(r"^(?P<path>.+?\.py):(?P<fn>[A-Za-z_]\w*)(?::(?P<args>.*))?$", re.DOTALL)


def _split_file_spec(spec: str) -> tuple[str, str, str] | None:
    """``"dir/m.py:build:layers=4"`` -> ``("dir/m.py", "build", "layers=4")`` (args ``""`` if none)."""
    m = _FILE_SPEC.match(spec)
    if m is None:
        return None
    return m.group("path"), m.group("fn"), (m.group("args") or "").strip()


def builder_params(builder: Any) -> tuple[dict[str, Any], bool]:
    """A builder's keyword parameters with their defaults (``inspect.Parameter.empty`` for none), and
    whether it takes ``**kwargs``."""
    try:
        sig = inspect.signature(builder)
    except (TypeError, ValueError):
        return {}, True
    params = {k: p.default for k, p in sig.parameters.items()
              if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    return params, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())


def _file_knobs(spec: str, path: str, fn: str, args: str, builder: Any) -> dict[str, int | float]:
    """The keyword knobs of a file spec, checked against the builder's parameters."""
    out: dict[str, int | float] = {}
    if not args:
        return out
    params, open_kw = builder_params(builder)
    for part in filter(None, (p.strip() for p in args.split(","))):
        key, eq, text = part.partition("=")
        key, text = key.strip(), text.strip()
        if not eq or not text or not key.isidentifier():
            raise SpecError(f"bad knob {part!r} in {spec!r}: expected key=value")
        if key not in params and not open_kw:
            raise SpecError(f"{path}:{fn}() takes no knob {key!r}; it accepts: "
                            f"{', '.join(params) or 'no keyword arguments'}")
        value = _number(text)
        if isinstance(value, str) or value != value or value in (float("inf"), float("-inf")):
            raise SpecError(f"knob {key}={text!r} in {spec!r} must be a number")
        default = params.get(key)
        if isinstance(value, float) and isinstance(default, int) and not isinstance(default, bool):
            if not value.is_integer():
                raise SpecError(f"knob {key}={text} of {path}:{fn} must be an integer")
            value = int(value)
        if value > knob_limit(key):
            raise SpecError(f"knob {key}={text} of {path}:{fn} must be <= {knob_limit(key):g}")
        out[key] = value
    return out


def _load_builder(path: str, fn: str):
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"model file not found: {path}")
    digest = hashlib.sha1(str(p.resolve()).encode()).hexdigest()[:12]
    modspec = importlib.util.spec_from_file_location(f"rlplace_user_model_{digest}", p)
    if modspec is None or modspec.loader is None:
        raise SpecError(f"cannot load {path} as a Python file")
    module = importlib.util.module_from_spec(modspec)
    try:
        modspec.loader.exec_module(module)
    except SystemExit as exc:
        raise SpecError(f"executing {path} called sys.exit({exc.code!r}) instead of defining a model") from None
    except Exception as exc:
        raise SpecError(f"executing {path} failed: {type(exc).__name__}: {_first_line(exc)}") from exc
    builder = getattr(module, fn, None)
    if not callable(builder):
        names = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise SpecError(f"{path} has no function {fn!r}; functions there: {', '.join(names) or 'none'}")
    return builder


def build_model(spec: str, *, input_shape: Sequence[int] | None = None,
                batch: int | None = None) -> tuple[nn.Module, tuple, int]:
    """Build the model a zoo or file spec names, on the meta device: ``(module, inputs, batch)``.

    ``input_shape`` (file specs): the example input is a float tensor of that shape, used when
    ``build_fn`` returns only a module (or to override its inputs). ``batch``: for a zoo spec,
    overrides the ``batch`` knob; for a file spec, the batch the inputs hold (default: the leading
    dimension of the first input tensor)."""
    fs = _split_file_spec(spec)
    if fs is not None:
        builder = _load_builder(fs[0], fs[1])
        kw = _file_knobs(spec, *fs, builder)
        with torch.device("meta"):
            try:
                out = builder(**kw)
            except SystemExit as exc:
                raise SpecError(f"{fs[0]}:{fs[1]}() called sys.exit({exc.code!r}) instead of returning a model") \
                    from None
            except Exception as exc:
                raise SpecError(f"{fs[0]}:{fs[1]}() failed: {type(exc).__name__}: {_first_line(exc)}") from exc
            if input_shape is not None:
                shape_input = torch.randn(tuple(int(s) for s in input_shape))
        if isinstance(out, nn.Module):
            module, inputs = out, None
        elif isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], nn.Module):
            module, inputs = out
        else:
            hint = (" of 3: for keyword arguments, give example_inputs as a dict of keyword tensors"
                    if isinstance(out, tuple) and len(out) == 3 else "")
            raise SpecError(f"{fs[0]}:{fs[1]}() must return (module, example_inputs) or a module, "
                            f"got {type(out).__name__}{hint}")
        if input_shape is not None:
            inputs = (shape_input,)
        if inputs is None:
            raise SpecError(f"{fs[0]}:{fs[1]}() returned only a module: give --input-shape")
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        if batch is None:
            first = next((t for t in _flat(inputs) if isinstance(t, torch.Tensor) and t.dim() > 0), None)
            batch = int(first.shape[0]) if first is not None else 1
        return module, inputs, int(batch)
    family, values = parse_spec(spec)
    if batch is not None:
        values["batch"] = int(batch)
    try:
        with torch.device("meta"):
            module, inputs = FAMILIES[family](**values)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise SpecError(f"bad knobs for {family} in {spec!r}: {_first_line(exc)}") from exc
    return module, inputs, int(values.get("batch", knobs(family)["batch"]))


def _flat(x: Any) -> list:
    if isinstance(x, (list, tuple)):
        return [y for v in x for y in _flat(v)]
    if isinstance(x, dict):
        return [y for v in x.values() for y in _flat(v)]
    return [x]


def graph_from_spec(spec: str | OpGraph, *, dtype: str = "bf16", input_shape: Sequence[int] | None = None,
                    batch: int | None = None) -> OpGraph:
    """The OpGraph a spec names (a graph JSON, ``file.py:build_fn`` or a zoo member), cached."""
    if isinstance(spec, OpGraph):
        return spec
    if dtype not in DTYPES:
        raise SpecError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    shape = tuple(int(s) for s in input_shape) if input_shape is not None else None
    if str(spec).endswith(".json") or (os.path.isfile(str(spec)) and _split_file_spec(str(spec)) is None):
        if not os.path.exists(spec):
            raise SpecError(f"graph file not found: {spec}")
        return OpGraph.load(spec)
    if str(spec).startswith("hf:"):
        return copy.deepcopy(_cached_hf(spec, dtype, batch))
    key_spec = spec
    fs = _split_file_spec(spec)
    if fs is not None:  # a file may change between calls: key on its content too
        p = Path(fs[0])
        if p.is_file():
            key_spec = f"{spec}#{hashlib.sha1(p.read_bytes()).hexdigest()}"
    else:
        family, values = parse_spec(spec)
        key_spec = format_spec(family, dict(sorted(values.items())))
    return copy.deepcopy(_cached_graph(key_spec, spec, dtype, shape, batch))


@functools.lru_cache(maxsize=256)
def _cached_graph(_key: str, spec: str, dtype: str, input_shape: tuple[int, ...] | None,
                  batch: int | None) -> OpGraph:
    module, inputs, b = build_model(spec, input_shape=input_shape, batch=batch)
    g = trace(module, inputs, batch_size=b, dtype=dtype, name=spec)
    if _split_file_spec(spec) is None:  # a zoo member: record the shape knobs plans depend on
        family, values = parse_spec(spec)
        full = {**knobs(family), **values}
        g.meta.update({"family": family, **({"heads": int(full["heads"])} if "heads" in full else {})})
    return g


@functools.lru_cache(maxsize=64)
def _cached_hf(spec: str, dtype: str, batch: int | None) -> OpGraph:
    """``hf:NAME[:key=value,...]`` -> profilers.hf.trace_hf (``seq`` and ``batch`` are trace knobs,
    other keys override the config, e.g. ``hf:llama:num_hidden_layers=4,seq=256,batch=2``)."""
    _, _, rest = spec.partition(":")
    name, _, args = rest.partition(":")
    kw: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in args.split(","))):
        key, eq, value = part.partition("=")
        if not eq:
            raise SpecError(f"bad knob {part!r} in {spec!r}: expected key=value")
        key, num = key.strip(), _number(value.strip())
        if key in REPEAT_KNOBS and isinstance(num, (int, float)) and num > MAX_REPEAT:
            raise SpecError(f"knob {key}={value.strip()} in {spec!r} must be <= {MAX_REPEAT}")
        kw[key] = num
    seq = int(kw.pop("seq", 128))
    b = int(batch if batch is not None else kw.pop("batch", 1))
    kw.pop("batch", None)
    from profilers.hf import trace_hf

    return trace_hf(name, batch_size=b, seq=seq, dtype=dtype, name=spec, **kw)


def clear_cache() -> None:
    _cached_graph.cache_clear()
    _cached_hf.cache_clear()


SAMPLE_SIZES = ("small", "medium", "large", "realistic")


def sample_specs(families: str | Sequence[str], n: int, seed: int, size: str = "small") -> list[str]:
    """``n`` zoo specs drawn from ``families`` (a name, a comma list or a sequence) with knob values
    from ``profilers.zoo.SIZES[family][size]``, or with ``size="realistic"`` from the family's realistic
    ranges (``profilers.families.RANGES``); the same arguments give the same list."""
    fams = [f.strip() for f in families.split(",")] if isinstance(families, str) else list(families)
    if not fams:
        raise SpecError("sample_specs needs at least one family")
    for f in fams:
        if f not in FAMILIES:
            raise SpecError(f"unknown model family {f!r}; families: {', '.join(sorted(FAMILIES))}")
        if size != "realistic" and size not in SIZES[f]:
            raise SpecError(f"unknown size {size!r} for {f}; sizes: {', '.join(SIZES[f])}, realistic")
    if n < 0:
        raise SpecError(f"n must be >= 0, got {n}")
    rng = random.Random(f"{seed}:{size}:{','.join(fams)}")
    out = []
    for _ in range(n):
        fam = fams[rng.randrange(len(fams))]
        if size == "realistic":
            from profilers.families import sample_family

            out.append(sample_family(fam, rng.getrandbits(63)))
            continue
        choices = SIZES[fam][size]
        out.append(format_spec(fam, {k: rng.choice(v) for k, v in choices.items()}))
    return out
