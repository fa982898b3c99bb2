"""Model-family distributions: realistic knob ranges, family specs with ranges, a seeded sampler.

A placement policy that has to generalise to unseen models trains on many families at the sizes people
train them. ``RANGES`` holds, per zoo family, the knob ranges a practitioner would use (GPT / Llama
6-48 layers at hidden 512-8192 and sequence 512-4096, BERT base-large, ViT S-H at 224-384, ResNet
18-152 at batch 32-512, DLRM with 8-64 tables of 1e5-1e7 rows ...), so draws span host-bound small
models and memory-tight big ones. ``batch`` is the global batch (sequences, images or samples).

A :class:`FamilySpec` is what a training config writes for one family::

    {"model": "llama", "knobs": {"layers": [8, 32], "kv_heads": {"choices": [1, 8]}, "seq": 2048}}
    {"model": "hf:llama", "knobs": {"num_hidden_layers": [2, 8], "seq": [256, 1024], "batch": 8}}
    {"model": "path/to/my_model.py:build", "knobs": {"layers": [2, 12], "hidden": [256, 1024]},
     "constraints": ["heads | hidden"]}

``model`` is a zoo family (``profilers.zoo.FAMILIES``), ``hf:NAME`` (a ``profilers.hf.CONFIGS`` name;
knobs are config keys plus ``seq`` and ``batch``) or ``file.py:fn`` (knobs are ``fn``'s keyword
arguments). A knob is a number (fixed), ``[lo, hi]`` (a range, drawn log-uniformly), ``{"choices":
[...]}`` or ``{"lo": .., "hi": .., "step": .., "log": ..}``. Zoo knobs the spec leaves out keep the
family's realistic range; other models' keep their defaults. ``constraints`` add rules between knobs
(``"heads | hidden"``: heads divides hidden; ``"topk <= experts"``; ``"2**levels | img"``).

Validation happens when the spec is built, before anything is traced: an unknown knob, ``lo > hi``, a
value outside what the family accepts (layers 0, a non-number, more than ``MAX_REPEAT`` = 2048 layers,
blocks or tables), or a range where some draw cannot satisfy a rule (heads fixed to 12 while hidden may be
1000) raises one :class:`profilers.spec.SpecError` line naming the family and the knob.

Sampling (:meth:`FamilySpec.sample`, :func:`sample`, :func:`sample_family`, :func:`sample_family_specs`)
draws each knob from its range (log-uniform by default, uniform choices), in the family's order, and snaps
it to the nearest valid value: a multiple of the knob's step that satisfies every rule with the knobs
drawn before it. Some default knobs scale another (``heads`` = hidden / head size with head size 64 or
128, ``kv_heads`` = heads / group, ``ffn`` = 2.6-3.5 x hidden). The same spec and seed give the same
concrete spec string (``llama:layers=24,hidden=3072,...``), which ``profilers.spec.graph_from_spec``
traces.
"""

from __future__ import annotations

import ast
import inspect
import math
import random
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from profilers.spec import MAX_KNOB, SpecError, format_spec, knob_limit
from profilers.zoo import FAMILIES

ENUM_LIMIT = 4096  # a constrained knob's candidates are enumerated up to this many, else probed near the draw
CHECK_BUDGET = 20000  # (knob, context) pairs the feasibility check of a spec visits at most


# ---------------------------------------------------------------------------- knob distributions
@dataclass(frozen=True)
class Knob:
    """One knob's distribution: ``[lo, hi]`` (log-uniform when ``log``, else uniform) or ``choices``
    (uniform). An integer knob snaps to multiples of ``step``; ``step=0`` marks a real-valued knob.
    ``per=(base, "mul" | "div")``: the drawn number scales knob ``base`` (``heads`` = hidden / head size).
    ``user``: the spec gave it, so no value outside it is ever taken."""

    lo: float | None = None
    hi: float | None = None
    choices: tuple[float, ...] | None = None
    step: int = 1
    log: bool = True
    per: tuple[str, str] | None = None
    user: bool = False

    @property
    def fixed(self) -> bool:
        return self.choices is not None and len(set(self.choices)) == 1 and self.per is None

    def describe(self) -> str:
        if self.choices is not None:
            body = (_fmt(self.choices[0]) if self.fixed
                    else "{" + ", ".join(_fmt(c) for c in dict.fromkeys(self.choices)) + "}")
        else:
            body = f"[{_fmt(self.lo)}, {_fmt(self.hi)}]"
        if self.per is not None:
            body = f"{self.per[0]} {'x' if self.per[1] == 'mul' else '/'} {body}"
        return body + (f" step {self.step}" if self.step > 1 else "")


def R(lo: float, hi: float, step: int = 1, log: bool = True) -> Knob:
    return Knob(lo=float(lo), hi=float(hi), step=step, log=log)


def C(*choices: float, step: int = 1) -> Knob:
    return Knob(choices=tuple(float(c) for c in choices), step=step)


def PER(base: str, op: str, knob: Knob, step: int = 1) -> Knob:
    return replace(knob, per=(base, op), step=step)


@dataclass(frozen=True)
class FamilyRanges:
    """A zoo family's realistic ranges (``knobs``, in draw order), its ``rules`` (what every valid
    model satisfies), ``soft`` rules (realism preferences for knobs the spec leaves to the family,
    dropped when no value meets them) and ``limits`` (the valid interval of a knob, beyond > 0)."""

    knobs: dict[str, Knob]
    rules: tuple[str, ...] = ()
    soft: tuple[str, ...] = ()
    limits: dict[str, tuple[float, float]] | None = None


_HEAD = C(64, 128)  # head sizes of today's transformers
_BATCH_SEQ = R(8, 512, 8)  # global batch of sequences for LLM pretraining

RANGES: dict[str, FamilyRanges] = {
    "mlp": FamilyRanges({"layers": R(2, 16), "hidden": R(256, 8192, 128), "in_dim": R(128, 4096, 64),
                         "out": C(10, 100, 1000), "batch": R(64, 8192, 64)}),
    "resnet": FamilyRanges({"depth": C(18, 34, 50, 101, 152), "width": C(64, 64, 96, 128),
                            "img": R(128, 320, 32, log=False), "classes": C(1000), "batch": R(32, 512, 8)},
                           limits={"depth": (10, MAX_KNOB)}),
    "inception": FamilyRanges({"blocks": R(6, 12), "width": R(32, 96, 16), "img": R(224, 320, 8, log=False),
                               "classes": C(1000), "batch": R(32, 512, 8)}),
    "gnmt": FamilyRanges({"layers": R(4, 8), "hidden": R(512, 2048, 128), "vocab": R(8000, 64000, 1000),
                          "seq": R(20, 64), "batch": R(32, 512, 8)},
                         rules=("2 | hidden",), limits={"layers": (2, MAX_KNOB)}),
    "gpt": FamilyRanges({"layers": R(6, 48), "hidden": R(512, 8192, 256), "heads": PER("hidden", "div", _HEAD),
                         "seq": R(512, 4096, 256), "vocab": C(32000, 50257, 65536, 128256), "batch": _BATCH_SEQ},
                        rules=("heads | hidden",)),
    "bert": FamilyRanges({"layers": R(12, 24), "hidden": R(768, 1024, 256), "heads": PER("hidden", "div", C(64)),
                          "seq": C(128, 256, 512), "vocab": C(30522, 50265), "batch": R(32, 1024, 8)},
                         rules=("heads | hidden",)),
    # moe's dispatch and combine are dense einsums whose work grows with tokens^2: batch stays modest;
    # every expert is its own nodes (3 each), so experts stay at most 32 to keep traces to a few seconds
    "moe": FamilyRanges({"layers": R(8, 32), "hidden": R(512, 4096, 256), "heads": PER("hidden", "div", _HEAD),
                         "experts": C(8, 16, 32), "topk": C(1, 2), "seq": R(512, 2048, 256),
                         "vocab": C(32000, 50257), "every": C(1, 2), "capacity": C(1.0, 1.25, 1.5, 2.0, step=0),
                         "batch": R(4, 32, 4)},
                        rules=("heads | hidden", "topk <= experts")),
    "unet": FamilyRanges({"dims": C(2, 3), "levels": R(3, 5), "width": C(16, 32, 64), "img": R(64, 256, 16),
                          "channels": C(1, 3, 4), "classes": C(2, 4, 14), "batch": R(2, 32, 2)},
                         rules=("2**levels | img",), soft=("img // 2**levels >= 4",),
                         limits={"dims": (2, 3)}),
    "vit": FamilyRanges({"patch": C(14, 16), "img": C(224, 256, 384), "layers": R(6, 32), "hidden": R(384, 1664, 128),
                         "heads": PER("hidden", "div", C(64)), "mlp_ratio": C(4.0, step=0),
                         "classes": C(1000, 21843), "batch": R(32, 4096, 32)},
                        rules=("heads | hidden", "patch | img", "patch <= img")),
    "llama": FamilyRanges({"layers": R(6, 48), "hidden": R(512, 8192, 256), "heads": PER("hidden", "div", _HEAD),
                           "kv_heads": PER("heads", "div", C(1, 2, 4, 8)),
                           "ffn": PER("hidden", "mul", R(2.6, 3.5, log=False), step=256),
                           "vocab": C(32000, 32768, 128256, 151936), "seq": R(512, 4096, 256), "batch": _BATCH_SEQ},
                          rules=("2 * heads | hidden", "kv_heads | heads")),
    "t5": FamilyRanges({"layers": R(6, 24), "hidden": R(512, 2048, 256), "heads": PER("hidden", "div", C(64)),
                        "ffn": PER("hidden", "mul", R(2.5, 4.0, log=False), step=256), "vocab": C(32128, 250112),
                        "seq": C(512, 1024), "tgt_seq": C(128, 256, 512), "batch": R(16, 512, 8)},
                       rules=("heads | hidden",)),
    "dlrm": FamilyRanges({"tables": R(8, 64), "rows": R(1e5, 1e7, 1000), "dim": R(64, 256, 32), "dense": C(13),
                          "bottom": R(256, 1024, 128), "bottom_layers": R(1, 3), "top": R(512, 4096, 128),
                          "top_layers": R(2, 4), "pooling": R(1, 32), "batch": R(1024, 65536, 256)}),
    "twotower": FamilyRanges({"user_tables": R(4, 32), "item_tables": R(2, 16), "rows": R(1e5, 1e7, 1000),
                              "dim": R(32, 128, 32), "hidden": R(256, 2048, 128), "layers": R(2, 4),
                              "out": C(64, 128, 256), "pooling": R(1, 16), "batch": R(1024, 65536, 256)}),
    "convnext": FamilyRanges({"depth": C(9, 27), "width": C(64, 96, 128, 192, 256), "img": R(224, 384, 32),
                              "classes": C(1000, 21841), "batch": R(32, 4096, 32)},
                             limits={"img": (32, MAX_KNOB)}),
    "diffusion": FamilyRanges({"levels": R(3, 6), "img": R(64, 512, 64), "channels": C(3, 4),
                               "width": R(128, 320, 32), "blocks": R(1, 3), "attn": R(1, 3), "heads": C(4, 8),
                               "batch": R(8, 256, 8)},
                              rules=("2 | width", "heads | width", "attn <= levels", "2**(levels - 1) | img"),
                              soft=("img // 2**(levels - 1) <= 32", "img // 2**(levels - 1) >= 4")),
}

# Rules of transformers configs (profilers.hf), applied when a config has the keys a rule names and,
# where listed, is of one of the model types (rotary models need an even head size).
_ROTARY = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo", "olmo2")
HF_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("num_attention_heads | hidden_size", ()), ("num_key_value_heads | num_attention_heads", ()),
    ("2 * num_attention_heads | hidden_size", _ROTARY), ("n_head | n_embd", ()),
    ("seq <= max_position_embeddings", ()), ("seq <= n_positions", ()))


# ---------------------------------------------------------------------------- rules
_OPS: dict[type, Callable[[int, int], int]] = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b if b else 0, ast.Mod: lambda a, b: a % b if b else 0,
    ast.Pow: lambda a, b: a**b if 0 <= b <= 64 else 0,
}
_CMP: dict[type, Callable[[Any, Any], bool]] = {
    ast.LtE: lambda a, b: a <= b, ast.Lt: lambda a, b: a < b, ast.GtE: lambda a, b: a >= b,
    ast.Gt: lambda a, b: a > b, ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b,
}


@dataclass(frozen=True)
class Rule:
    """A constraint between knobs: ``a | b`` (a divides b) or a comparison ``a <= b``; each side an
    arithmetic expression of knobs and integers (``+ - * // % **``)."""

    text: str
    names: frozenset[str]
    check: Callable[[Mapping[str, float]], bool]


def parse_rule(text: str, where: str = "") -> Rule:
    """``"heads | hidden"`` -> a Rule (SpecError for anything else)."""
    try:
        tree = ast.parse(str(text).strip(), mode="eval").body
    except SyntaxError:
        raise SpecError(f"{where}bad constraint {text!r}: expected 'a | b' (a divides b) or a comparison "
                        "like 'a <= b'") from None
    names: set[str] = set()

    def expr(node: ast.AST) -> Callable[[Mapping[str, float]], float]:
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            value = node.value
            return lambda ctx: value
        if isinstance(node, ast.Name):
            name = node.id
            names.add(name)
            return lambda ctx: ctx[name]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            f, a, b = _OPS[type(node.op)], expr(node.left), expr(node.right)
            return lambda ctx: f(a(ctx), b(ctx))
        raise SpecError(f"{where}bad constraint {text!r}: only knob names, integers and + - * // % ** are allowed")

    if isinstance(tree, ast.BinOp) and isinstance(tree.op, ast.BitOr):
        a, b = expr(tree.left), expr(tree.right)

        def check(ctx: Mapping[str, float]) -> bool:
            d, n = a(ctx), b(ctx)
            return d != 0 and n % d == 0
    elif isinstance(tree, ast.Compare) and len(tree.ops) == 1 and type(tree.ops[0]) in _CMP:
        cmp, a, b = _CMP[type(tree.ops[0])], expr(tree.left), expr(tree.comparators[0])

        def check(ctx: Mapping[str, float]) -> bool:
            return cmp(a(ctx), b(ctx))
    else:
        raise SpecError(f"{where}bad constraint {text!r}: expected 'a | b' (a divides b) or a comparison "
                        "like 'a <= b'")
    if not names:
        raise SpecError(f"{where}constraint {text!r} names no knob")
    return Rule(str(text).strip(), frozenset(names), check)


# ---------------------------------------------------------------------------- helpers
def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v.is_integer() and abs(v) < 1e15:
            return str(int(v))
        return f"{v:.4g}"
    return str(v)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _seed_of(rng_or_seed: Any) -> int:
    if isinstance(rng_or_seed, np.random.Generator):
        return int(rng_or_seed.integers(0, 2**63 - 1))
    if isinstance(rng_or_seed, random.Random):
        return rng_or_seed.getrandbits(63)
    if isinstance(rng_or_seed, (int, np.integer)) and not isinstance(rng_or_seed, bool):
        return int(rng_or_seed)
    raise SpecError(f"a seed must be an integer, random.Random or numpy Generator, got {type(rng_or_seed).__name__}")


@dataclass(frozen=True)
class _Resolved:
    """A family spec resolved against its model: knobs in draw order, their kinds and validity limits,
    rules, and defaults of the knobs the spec does not draw (for rule checks)."""

    family: str  # label in messages and the spec string's head
    knobs: dict[str, Knob]
    is_int: dict[str, bool]
    limits: dict[str, tuple[float, float]]
    rules: tuple[Rule, ...]
    soft: tuple[Rule, ...]
    defaults: dict[str, float]
    emit: tuple[str, ...]  # knobs written into the spec string, in order

    # -------------------------------------------------------------- candidates
    def interval(self, name: str, ctx: Mapping[str, float]) -> tuple[float, float]:
        k = self.knobs[name]
        xs = (k.lo, k.hi) if k.choices is None else (min(k.choices), max(k.choices))
        if k.per is None:
            return float(xs[0]), float(xs[1])
        base = ctx[k.per[0]]
        vals = [base * x if k.per[1] == "mul" else base / x for x in xs]
        return min(vals), max(vals)

    def raw(self, name: str, ctx: Mapping[str, float], rng: np.random.Generator) -> float:
        k = self.knobs[name]
        if k.choices is not None:
            x = k.choices[int(rng.integers(len(k.choices)))]
        elif k.log and k.lo > 0:
            x = math.exp(rng.uniform(math.log(k.lo), math.log(k.hi))) if k.hi > k.lo else k.lo
        else:
            x = rng.uniform(k.lo, k.hi) if k.hi > k.lo else k.lo
        if k.per is not None:
            base = ctx[k.per[0]]
            x = base * x if k.per[1] == "mul" else base / x
        return float(x)

    def active(self, name: str, known: set[str], soft: bool = False) -> list[Rule]:
        """Rules that involve ``name`` and only knobs known once it is drawn."""
        rules = self.soft if soft else self.rules
        return [r for r in rules if name in r.names and r.names <= known | {name}]

    def _ok(self, rules: list[Rule], ctx: dict[str, float], name: str, v: float) -> bool:
        ctx[name] = v
        return all(r.check(ctx) for r in rules)

    def _grid(self, lo: float, hi: float, step: int) -> tuple[int, int]:
        """Indices ``i`` of the multiples ``i * step`` in [lo, hi] (first, last)."""
        return math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)

    def candidates(self, name: str, ctx: Mapping[str, float], raw: float | None = None,
                   lo_hi: tuple[float, float] | None = None) -> list[float]:
        """Valid values of ``name`` given the knobs in ``ctx`` (all of them when there are at most
        ENUM_LIMIT; else those nearest ``raw``, or a spread over the range when ``raw`` is None)."""
        k = self.knobs[name]
        known = set(ctx) | set(self.defaults)
        full = {**self.defaults, **ctx}
        rules = self.active(name, known)
        vlo, vhi = self.limits[name]
        if k.choices is not None and k.per is None and lo_hi is None:
            vals = sorted({float(c) for c in k.choices})
            return [v for v in vals if self._ok(rules, full, name, v)]
        lo, hi = lo_hi if lo_hi is not None else self.interval(name, ctx)
        lo, hi = max(lo, vlo), min(hi, vhi)
        if not self.is_int[name]:
            return [v for v in ({lo, hi} if raw is None else {min(max(raw, lo), hi)})
                    if lo <= hi and self._ok(rules, full, name, v)]
        step = max(1, k.step)
        first, last = self._grid(lo, hi, step)
        if first > last and step > 1:
            step, (first, last) = 1, self._grid(lo, hi, 1)
        if first > last:
            return []
        if last - first < ENUM_LIMIT:
            return [float(i * step) for i in range(first, last + 1) if self._ok(rules, full, name, float(i * step))]
        centres = ([raw] if raw is not None else
                   [math.exp(x) for x in np.linspace(math.log(max(lo, 1)), math.log(hi), 32)])
        found: set[float] = set()
        for c in centres:
            i0 = min(max(round(c / step), first), last)
            for d in range(ENUM_LIMIT):
                hits = [i for i in ((i0 - d, i0 + d) if d else (i0,))
                        if first <= i <= last and self._ok(rules, full, name, float(i * step))]
                if hits:
                    found.update(float(i * step) for i in hits)
                    break
        return sorted(found)

    # -------------------------------------------------------------- drawing
    def order(self) -> list[str]:
        """Draw order: fixed knobs first, then the rest in the family's order (bases before the knobs
        that scale them)."""
        names = list(self.knobs)
        return [n for n in names if self.knobs[n].fixed] + [n for n in names if not self.knobs[n].fixed]

    def draw(self, seed: int) -> dict[str, float]:
        ctx: dict[str, float] = {}
        for name in self.order():
            rng = np.random.default_rng([seed & (2**63 - 1), zlib.crc32(f"{self.family}.{name}".encode())])
            raw = self.raw(name, ctx, rng)
            cands = self.candidates(name, ctx, raw)
            if not cands and not self.knobs[name].user:  # a realism default that cannot be met: any valid value
                cands = self.candidates(name, ctx, raw, lo_hi=self.limits[name])
            if not cands:
                raise SpecError(f"{self.family}: no value of knob {name} in {self.knobs[name].describe()} "
                                f"satisfies {self._rule_text(name, ctx)} with {self._ctx_text(name, ctx)}")
            soft = self.active(name, set(ctx) | set(self.defaults), soft=True)
            if soft:
                full = {**self.defaults, **ctx}
                preferred = [v for v in cands if self._ok(soft, full, name, v)]
                cands = preferred or cands
            ctx[name] = min(cands, key=lambda v: (abs(math.log(v / raw)) if v > 0 and raw > 0 else abs(v - raw), v))
            if not self.is_int[name]:
                ctx[name] = float(f"{ctx[name]:.4g}")
        return ctx

    def spec_string(self, values: Mapping[str, float]) -> str:
        out = {}
        for name in self.emit:
            v = values[name]
            out[name] = int(round(v)) if self.is_int[name] else float(v)
        return format_spec(self.family, out)

    # -------------------------------------------------------------- validation
    def _rule_text(self, name: str, ctx: Mapping[str, float]) -> str:
        rules = self.active(name, set(ctx) | set(self.defaults))
        return " and ".join(repr(r.text) for r in rules) or "the knob's limits"

    def _ctx_text(self, name: str, ctx: Mapping[str, float]) -> str:
        rules = self.active(name, set(ctx) | set(self.defaults))
        k = self.knobs[name]
        used = sorted({n for r in rules for n in r.names if n != name} | ({k.per[0]} if k.per else set()))
        full = {**self.defaults, **ctx}
        return ", ".join(f"{n}={_fmt(full[n])}" for n in used if n in full) or "no other knob"

    def check(self) -> None:
        """Every draw of every knob finds a valid value (SpecError naming the knob otherwise); a
        depth-first walk over the values of the knobs that later knobs depend on, at most CHECK_BUDGET steps."""
        order = self.order()
        deps: dict[str, set[str]] = {}
        for i, name in enumerate(order):
            known = set(order[:i]) | set(self.defaults)
            d = {n for r in self.active(name, known) for n in r.names if n != name and n in self.knobs}
            k = self.knobs[name]
            if k.per is not None:
                d.add(k.per[0])
            deps[name] = d
        needed = [set().union(*(deps[n] for n in order[i:])) for i in range(len(order) + 1)]
        seen: set[tuple] = set()
        budget = [CHECK_BUDGET]
        listed = {n: set() for n, k in self.knobs.items() if k.user and k.choices is not None and k.per is None}

        def walk(i: int, ctx: dict[str, float]) -> None:
            if i == len(order) or budget[0] <= 0:
                return
            key = (i, tuple(sorted((n, ctx[n]) for n in needed[i] if n in ctx)))
            if key in seen:
                return
            seen.add(key)
            budget[0] -= 1
            name = order[i]
            cands = self.candidates(name, ctx)
            if not cands and not self.knobs[name].user:
                mid = self.raw_mid(name, ctx)
                cands = self.candidates(name, ctx, mid, lo_hi=self.limits[name])
            if not cands:
                raise SpecError(f"{self.family}: knob {name}: no value in {self.knobs[name].describe()} satisfies "
                                f"{self._rule_text(name, ctx)} when {self._ctx_text(name, ctx)}")
            if name in listed:
                listed[name].update(cands)
            if name in needed[i + 1]:
                for v in cands:
                    walk(i + 1, {**ctx, name: v})
            else:
                walk(i + 1, ctx)

        walk(0, {})
        if budget[0] > 0:  # the walk saw every case: a listed choice no draw can take is a mistake
            for name, hit in listed.items():
                never = [c for c in dict.fromkeys(self.knobs[name].choices) if float(c) not in hit]
                if never:
                    known = set(order[:order.index(name)]) | set(self.defaults)
                    rules = " and ".join(repr(r.text) for r in self.active(name, known)) or "the knob's limits"
                    raise SpecError(f"{self.family}: knob {name}: choice {_fmt(never[0])} is never valid "
                                    f"(it fails {rules} for every draw of the other knobs)")

    def raw_mid(self, name: str, ctx: Mapping[str, float]) -> float:
        lo, hi = self.interval(name, ctx)
        return math.sqrt(max(lo, 1e-9) * max(hi, 1e-9))


# ---------------------------------------------------------------------------- user knobs
def _user_knob(family: str, name: str, value: Any, default: Knob | None, is_int: bool,
               limits: tuple[float, float]) -> Knob:
    """A knob of a spec: a number, [lo, hi], {choices: [...]} or {lo, hi, step, log}."""
    where = f"{family}: knob {name}"
    shape = "a number, [lo, hi], {choices: [...]} or {lo: .., hi: .., step: .., log: ..}"

    def number(v: Any, what: str = "") -> float:
        if not _is_number(v):
            raise SpecError(f"{where}{what} must be a number, got {v!r} (a knob is {shape})")
        if is_int and not float(v).is_integer():
            raise SpecError(f"{where}{what} must be an integer, got {v!r}")
        lo, hi = limits
        if not lo <= v <= hi:
            raise SpecError(f"{where}{what}={_fmt(v)} is out of range: {family} takes {name} in "
                            f"[{_fmt(lo)}, {_fmt(hi)}]")
        return float(v)

    step = default.step if (default is not None and is_int) else (1 if is_int else 0)
    log = default.log if default is not None else True
    if isinstance(value, Mapping):
        extra = set(value) - {"choices", "lo", "hi", "step", "log"}
        if extra or ("choices" in value and len(value) > 1):
            raise SpecError(f"{where}: unexpected key(s) {', '.join(sorted(map(str, extra or set(value))))}; "
                            f"a knob is {shape}")
        if "choices" in value:
            ch = value["choices"]
            if not isinstance(ch, (list, tuple)) or not ch:
                raise SpecError(f"{where}: choices must be a non-empty list of numbers")
            return Knob(choices=tuple(number(c, " choice") for c in ch), step=step, user=True)
        if "lo" not in value or "hi" not in value:
            raise SpecError(f"{where}: a range needs lo and hi; a knob is {shape}")
        lo, hi = number(value["lo"], " lo"), number(value["hi"], " hi")
        if "step" in value:
            s = value["step"]
            if not (isinstance(s, int) and not isinstance(s, bool) and s >= 1) or not is_int:
                raise SpecError(f"{where}: step must be an integer >= 1 (integer knobs only), got {s!r}")
            step = s
        if "log" in value:
            if not isinstance(value["log"], bool):
                raise SpecError(f"{where}: log must be true or false, got {value['log']!r}")
            log = value["log"]
    elif isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise SpecError(f"{where}: a range is [lo, hi] (two numbers), got {len(value)} items; "
                            "write {choices: [...]} for a list of values")
        lo, hi = number(value[0], " lo"), number(value[1], " hi")
    else:
        return Knob(choices=(number(value),), step=step, user=True)
    if lo > hi:
        raise SpecError(f"{where}: range [{_fmt(lo)}, {_fmt(hi)}] has lo > hi")
    if is_int and step > 1 and math.ceil(lo / step - 1e-9) > math.floor(hi / step + 1e-9):
        step = 1  # the family's step does not fit this range: any integer
    return Knob(lo=lo, hi=hi, step=step, log=log, user=True)


def _default_value(v: Any) -> float | None:
    return float(v) if _is_number(v) else None


def _resolve_zoo(model: str, knobs: Mapping[str, Any], constraints: Sequence[str]) -> _Resolved:
    from profilers.spec import knobs as zoo_knobs

    ranges = RANGES.get(model)
    sig = zoo_knobs(model)
    unknown = [k for k in knobs if k not in sig]
    if unknown:
        raise SpecError(f"{model}: unknown knob {unknown[0]!r}; knobs: {', '.join(sig)}")
    is_int = {k: not isinstance(v, float) for k, v in sig.items()}
    limits = {k: (1.0 if is_int[k] else 1e-9, float(knob_limit(k))) for k in sig}
    base = dict(ranges.knobs) if ranges is not None else {}
    for k, (lo, hi) in ((ranges.limits or {}) if ranges is not None else {}).items():
        limits[k] = (float(lo), min(float(hi), limits[k][1]))
    out: dict[str, Knob] = {}
    for name in sig:  # the builder's order, ranges first
        if name in knobs:
            out[name] = _user_knob(model, name, knobs[name], base.get(name), is_int[name], limits[name])
        elif name in base:
            out[name] = base[name]
    for name, k in out.items():
        if k.per is not None and k.per[0] not in out:
            out[name] = Knob(choices=(float(sig[name]),))
    order = [n for n in ranges.knobs if n in out] if ranges is not None else []
    order += [n for n in out if n not in order]
    out = {n: out[n] for n in order}
    defaults = {k: float(v) for k, v in sig.items() if k not in out and _default_value(v) is not None}
    rules = tuple(parse_rule(r, f"{model}: ") for r in ((ranges.rules if ranges else ()) + tuple(constraints)))
    soft = tuple(parse_rule(r, f"{model}: ") for r in (ranges.soft if ranges else ()))
    return _finish(model, out, is_int, limits, rules, soft, defaults, tuple(n for n in sig if n in out))


def _resolve_hf(model: str, knobs: Mapping[str, Any], constraints: Sequence[str]) -> _Resolved:
    from profilers.hf import CONFIGS, HFError, make_config

    name = model.partition(":")[2]
    if name not in CONFIGS:
        raise SpecError(f"{model}: unknown transformers config {name!r}; names: {', '.join(sorted(CONFIGS))}")
    model_type = CONFIGS[name]["model_type"]
    cfg = {"seq": 128, "batch": 1, **{k: v for k, v in CONFIGS[name].items() if _is_number(v)}}
    if any(k not in cfg for k in knobs):  # a key CONFIGS does not set: ask the config itself
        try:
            full = make_config(name).to_dict()
        except HFError as exc:
            raise SpecError(f"{model}: {exc}") from None
        cfg = {**{k: v for k, v in full.items() if _is_number(v)}, **cfg}
    unknown = [k for k in knobs if k not in cfg]
    if unknown:
        raise SpecError(f"{model}: unknown knob {unknown[0]!r}; numeric config keys: {', '.join(sorted(cfg))}")
    is_int = {k: isinstance(v, int) for k, v in cfg.items()}
    limits = {k: (1.0 if is_int[k] else 1e-12, float(knob_limit(k))) for k in cfg}
    out = {k: _user_knob(model, k, knobs[k], None, is_int[k], limits[k]) for k in sorted(knobs)}
    defaults = {k: float(v) for k, v in cfg.items() if k not in out}
    rules = [parse_rule(r) for r, types in HF_RULES if not types or model_type in types]
    rules = [r for r in rules if r.names <= set(cfg)]
    rules += [parse_rule(r, f"{model}: ") for r in constraints]
    return _finish(model, out, is_int, limits, tuple(rules), (), defaults, tuple(out))


def _resolve_file(model: str, knobs: Mapping[str, Any], constraints: Sequence[str]) -> _Resolved:
    from profilers.spec import _load_builder, _split_file_spec, builder_params

    path, fn, args = _split_file_spec(model)
    if args:
        raise SpecError(f"{model}: give the knobs of a file model under knobs, not in the model string")
    builder = _load_builder(path, fn)
    params, open_kw = builder_params(builder)
    unknown = [k for k in knobs if k not in params and not open_kw]
    if unknown:
        raise SpecError(f"{model}: unknown knob {unknown[0]!r}; {fn}() accepts: {', '.join(params) or 'no keywords'}")
    missing = [k for k, v in params.items() if v is inspect.Parameter.empty and k not in knobs]
    if missing:
        raise SpecError(f"{model}: {fn}() needs knob {missing[0]!r} (it has no default)")
    is_int = {}
    for k in knobs:
        d = params.get(k, inspect.Parameter.empty)
        if _is_number(d):
            is_int[k] = isinstance(d, int)
        else:
            vals = _numbers_in(knobs[k])
            is_int[k] = bool(vals) and all(isinstance(v, int) for v in vals)
    limits = {k: (-float(MAX_KNOB), float(knob_limit(k))) for k in knobs}  # a `layers` keyword is a block count too
    out = {k: _user_knob(model, k, knobs[k], None, is_int[k], limits[k]) for k in knobs}
    defaults = {k: float(v) for k, v in params.items() if k not in out and _is_number(v)}
    rules = tuple(parse_rule(r, f"{model}: ") for r in constraints)
    return _finish(model, out, is_int, limits, rules, (), defaults, tuple(out))


def _numbers_in(v: Any) -> list[Any]:
    if isinstance(v, Mapping):
        v = v.get("choices", [v.get("lo"), v.get("hi")])
    if isinstance(v, (list, tuple)):
        return list(v)
    return [v]


def _finish(family: str, knobs: dict[str, Knob], is_int: dict[str, bool], limits: dict[str, tuple[float, float]],
            rules: tuple[Rule, ...], soft: tuple[Rule, ...], defaults: dict[str, float],
            emit: tuple[str, ...]) -> _Resolved:
    known = set(knobs) | set(defaults)
    for r in rules + soft:
        bad = sorted(r.names - known)
        if bad:
            raise SpecError(f"{family}: constraint {r.text!r} names unknown knob {bad[0]!r}; knobs: "
                            f"{', '.join(sorted(known))}")
        floats = sorted(n for n in r.names if not is_int.get(n, True))
        if floats:
            raise SpecError(f"{family}: constraint {r.text!r} names real-valued knob {floats[0]!r}; "
                            "constraints relate integer knobs")
    res = _Resolved(family, knobs, is_int, limits, rules, soft, defaults, emit)
    res.check()
    return res


def resolve(model: str, knobs: Mapping[str, Any] | None = None, constraints: Sequence[str] = ()) -> _Resolved:
    """Validate a family spec against its model (SpecError, one line, naming the family and knob)."""
    from profilers.spec import _split_file_spec

    knobs = dict(knobs or {})
    if not isinstance(model, str) or not model.strip():
        raise SpecError("a family spec needs a model: a zoo family, hf:NAME or path/to/file.py:fn; "
                        f"families: {', '.join(sorted(FAMILIES))}")
    model = model.strip()
    if model.startswith("hf:"):
        return _resolve_hf(model, knobs, constraints)
    if _split_file_spec(model) is not None:
        return _resolve_file(model, knobs, constraints)
    if ":" in model:
        raise SpecError(f"family spec model {model!r}: give knobs under knobs, not in the model string")
    if model not in FAMILIES:
        raise SpecError(f"unknown model family {model!r}; families: {', '.join(sorted(FAMILIES))} "
                        "(or hf:NAME, or path/to/file.py:fn)")
    return _resolve_zoo(model, knobs, constraints)


# ---------------------------------------------------------------------------- the config model
class FamilySpec(BaseModel):
    """One model family of a training distribution: ``model`` (zoo family, ``hf:NAME`` or
    ``path/to/file.py:fn``), ``knobs`` (name -> number, ``[lo, hi]``, ``{choices: [...]}`` or ``{lo, hi,
    step, log}``), extra ``constraints`` (``"heads | hidden"``, ``"topk <= experts"``) and a ``weight``
    (relative frequency among several specs). Built (``FamilySpec(...)``, :meth:`parse`) it is
    validated: a problem raises one SpecError line naming the family and the knob."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    knobs: dict[str, Any] = Field(default_factory=dict)
    constraints: list[str] = Field(default_factory=list)
    weight: float = Field(1.0, gt=0, allow_inf_nan=False)
    _resolved: _Resolved | None = PrivateAttr(default=None)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise SpecError(_validation_line(exc, data)) from None

    @model_validator(mode="after")
    def _check(self) -> FamilySpec:
        self._resolved = resolve(self.model, self.knobs, self.constraints)
        return self

    @classmethod
    def parse(cls, obj: FamilySpec | Mapping[str, Any] | str) -> FamilySpec:
        """A FamilySpec from itself, a mapping (``{model, knobs, constraints, weight}``) or a model name."""
        if isinstance(obj, FamilySpec):
            return obj
        if isinstance(obj, str):
            return cls(model=obj)
        if not isinstance(obj, Mapping):
            raise SpecError(f"a family spec is a mapping {{model, knobs}} or a model name, got {type(obj).__name__}")
        return cls(**dict(obj))

    @property
    def resolved(self) -> _Resolved:
        if self._resolved is None:
            self._resolved = resolve(self.model, self.knobs, self.constraints)
        return self._resolved

    def sample(self, seed: int | random.Random | np.random.Generator) -> str:
        """A concrete spec string, the same for the same seed."""
        res = self.resolved
        return res.spec_string(res.draw(_seed_of(seed)))

    def ranges(self) -> dict[str, str]:
        """Each drawn knob's range, as text (``{"layers": "[6, 48]", "heads": "hidden / {64, 128}"}``)."""
        return {k: v.describe() for k, v in self.resolved.knobs.items()}


def _validation_line(exc: ValidationError, data: Mapping[str, Any]) -> str:
    err = exc.errors()[0]
    msg = str(err.get("msg", exc))
    for prefix in ("Value error, ",):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    if err.get("type") == "value_error" or not loc:
        return msg.splitlines()[0] if msg else "bad family spec"
    return f"family spec {data.get('model', '?')!r}: {loc}: {msg}".splitlines()[0]


# ---------------------------------------------------------------------------- sampling API
def sample(spec: FamilySpec | Mapping[str, Any] | str, seed: int | random.Random | np.random.Generator) -> str:
    """A concrete spec string drawn from a family spec (a FamilySpec, its mapping, or a model name)."""
    return FamilySpec.parse(spec).sample(seed)


def sample_family(name: str, rng_or_seed: int | random.Random | np.random.Generator) -> str:
    """A zoo family drawn over its realistic ranges (``RANGES``): ``sample_family("llama", 3)``."""
    if name not in FAMILIES:
        raise SpecError(f"unknown model family {name!r}; families: {', '.join(sorted(FAMILIES))}")
    return _default_spec(name).sample(rng_or_seed)


_DEFAULTS: dict[str, FamilySpec] = {}


def _default_spec(name: str) -> FamilySpec:
    if name not in _DEFAULTS:
        _DEFAULTS[name] = FamilySpec(model=name)
    return _DEFAULTS[name]


def sample_family_specs(specs: Sequence[FamilySpec | Mapping[str, Any] | str], n: int, seed: int) -> list[str]:
    """``n`` concrete spec strings from several family specs, each picked with probability
    proportional to its ``weight``; the same arguments give the same list."""
    parsed = [FamilySpec.parse(s) for s in specs]
    if not parsed:
        raise SpecError("sample_family_specs needs at least one family spec")
    if not isinstance(n, int) or n < 0:
        raise SpecError(f"n must be an integer >= 0, got {n!r}")
    rng = np.random.default_rng(_seed_of(seed))
    p = np.array([s.weight for s in parsed], dtype=float)
    p /= p.sum()
    picks = rng.choice(len(parsed), size=n, p=p)
    seeds = rng.integers(0, 2**63 - 1, size=n)
    return [parsed[int(i)].sample(int(s)) for i, s in zip(picks, seeds)]


def describe_ranges(name: str) -> dict[str, str]:
    """A zoo family's realistic ranges, as text per knob."""
    return _default_spec(name).ranges() if name in FAMILIES else {}


__all__ = ["FamilyRanges", "FamilySpec", "HF_RULES", "Knob", "RANGES", "Rule", "describe_ranges", "parse_rule",
           "resolve", "sample", "sample_family", "sample_family_specs"]
