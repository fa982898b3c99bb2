"""Reading and writing rlplace's files: one place for every file a user gives or rlplace produces.

Reading (:func:`read_document`): a path must exist, be a regular readable file and hold UTF-8 text that
parses as JSON or YAML (by suffix; JSON with NaN or Infinity is refused). Every failure raises the
caller's named error (a subclass of :class:`envs.errors.RlplaceError`) with one line that names the
file. :func:`validated` checks parsed data against a pydantic schema (``envs.schema``) and turns the
first problem into one such line, naming the field (``nodes[3].fwd_flops``).

Writing (:func:`atomic_write_bytes`, :func:`atomic_write_text`, :func:`atomic_write_json`,
:func:`atomic_output`): the content goes to a temporary file beside the target, is flushed to disk and
renamed over the target, so a crash or a kill leaves either the old file or the new one, never a
half-written one. New files get the permissions of ``open()`` (0666 minus the umask), not mkstemp's 0600.
:func:`check_output_path` says before any work whether a path can be written at all.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from envs.errors import RlplaceError

MAX_MESSAGE = 300  # characters of a foreign exception's text kept in a one-line error


class OutputPathError(RlplaceError):
    """An output path cannot be written (it is a directory, lies under a file, is not writable)."""


def one_line(exc: BaseException | str, limit: int = MAX_MESSAGE) -> str:
    """The first line of an exception's text, at most ``limit`` characters (for one-line errors)."""
    text = str(exc).strip() or type(exc).__name__
    first = text.splitlines()[0].strip()
    more = len(text.splitlines()) > 1
    if len(first) > limit:
        first, more = first[:limit].rstrip(), True
    return first + (" ..." if more else "")


# ---------------------------------------------------------------------- reading
def _reject_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def read_text(path: str | os.PathLike, what: str, error: type[RlplaceError]) -> str:
    """The UTF-8 text of ``path``; ``what`` names the file in messages ("graph file")."""
    p = Path(path)
    try:
        if p.is_dir():
            raise error(f"{what} {p} is a directory, not a file")
        data = p.read_bytes()
    except FileNotFoundError:
        raise error(f"{what} not found: {p}") from None
    except PermissionError:
        raise error(f"cannot read {what} {p}: permission denied") from None
    except OSError as exc:
        raise error(f"cannot read {what} {p}: {one_line(exc.strerror or exc)}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what} {p} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


def parse_text(text: str, path: str | os.PathLike, what: str, error: type[RlplaceError]) -> Any:
    """JSON (or YAML for ``.yaml`` / ``.yml`` paths) parsed from ``text``."""
    p = Path(path)
    if p.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            return yaml.load(text, Loader=_yaml_loader())  # noqa: S506 - a SafeLoader subclass
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            problem = getattr(exc, "problem", None) or one_line(exc)
            raise error(f"{what} {p} is not valid YAML{where}: {problem}") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise error(f"{what} {p} is not valid JSON (line {exc.lineno}, column {exc.colno}): {exc.msg}") from None
    except (ValueError, RecursionError) as exc:
        raise error(f"{what} {p} is not valid JSON: {one_line(exc)}") from None


_YAML_LOADER = None


def _yaml_loader():
    """PyYAML's SafeLoader that also reads ``300e9`` and ``1e-6`` as floats (YAML 1.1 wants a dot and a
    sign in the exponent, so those would be strings; users write them in topology files)."""
    global _YAML_LOADER
    if _YAML_LOADER is None:
        import re

        import yaml

        class Loader(yaml.SafeLoader):
            pass

        Loader.add_implicit_resolver(
            "tag:yaml.org,2002:float",
            re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
            list("-+0123456789"))
        _YAML_LOADER = Loader
    return _YAML_LOADER


def read_document(path: str | os.PathLike, what: str, error: type[RlplaceError]) -> Any:
    """Read and parse a JSON / YAML file (see the module docstring)."""
    return parse_text(read_text(path, what, error), path, what, error)


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def validation_message(exc, where: str = "") -> str:
    """One line for a pydantic ``ValidationError``: the first problem's field and message."""
    errors = exc.errors(include_url=False)
    if not errors:  # pragma: no cover - pydantic always lists at least one
        return f"{where}invalid"
    e = errors[0]
    msg = e.get("msg", "invalid")
    if e.get("type") == "missing":
        msg = "missing (required)"
    elif e.get("type") == "extra_forbidden":
        msg = "unknown key"
    elif e.get("type") == "value_error":  # a validator's own message
        msg = msg.removeprefix("Value error, ")
    elif "input" in e and e.get("type") not in ("model_type", "dict_type", "list_type"):
        shown = repr(e["input"])
        if len(shown) > 60:
            shown = shown[:57] + "..."
        msg += f", got {shown}"
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"{where}{_loc(tuple(e.get('loc', ())))}: {msg}{more}"


def validated(schema, data: Any, what: str, error: type[RlplaceError], path: str | os.PathLike | None = None):
    """``schema.model_validate(data)``; a problem raises ``error`` naming the file (or ``what``) and field."""
    from pydantic import ValidationError

    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        where = f"{path}: " if path is not None else f"{what}: "
        raise error(validation_message(exc, where)) from None
    except RecursionError:
        raise error(f"{path or what}: nested too deeply") from None


# ---------------------------------------------------------------------- writing
_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def check_output_path(path: str | os.PathLike, what: str = "output") -> Path:
    """Refuse, before any work, a path that cannot become a file: an existing directory, a path under a
    regular file, or a folder without write permission. Returns the path."""
    p = Path(path)
    if str(path) == "" or p.name in ("", ".", ".."):
        raise OutputPathError(f"{what} path {str(path)!r} does not name a file")
    if p.is_dir():
        raise OutputPathError(f"cannot write {what} {p}: it is a directory")
    parent = p.parent
    for anc in [parent, *parent.parents]:
        if anc.exists():
            if not anc.is_dir():
                raise OutputPathError(f"cannot write {what} {p}: {anc} is a file, not a directory")
            if not os.access(anc, os.W_OK | os.X_OK):
                raise OutputPathError(f"cannot write {what} {p}: {anc} is not writable")
            break
    return p


def check_output_dir(path: str | os.PathLike, what: str = "output directory") -> Path:
    """Like :func:`check_output_path` for a directory that may already exist."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OutputPathError(f"cannot use {what} {p}: it is a file, not a directory")
    if not p.exists():
        check_output_path(p, what)
    elif not os.access(p, os.W_OK | os.X_OK):
        raise OutputPathError(f"cannot use {what} {p}: it is not writable")
    return p


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, what: str = "output") -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; renamed over ``path`` when the block ends without an
    exception (and removed otherwise). For writers that take a file name (matplotlib, torch, SB3)."""
    p = check_output_path(path, what)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputPathError(f"cannot create the folder of {what} {p}: {one_line(exc.strerror or exc)}") from None
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp" + p.suffix, dir=p.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, p)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, what: str = "output") -> Path:
    """Write ``data`` to ``path`` atomically (see the module docstring)."""
    with atomic_output(path, what) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str, what: str = "output") -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), what)


def finite_json(obj: Any, *, indent: int | None = None) -> str:
    """``json.dumps`` that refuses NaN and Infinity (they are not JSON)."""
    try:
        return json.dumps(obj, indent=indent, separators=None if indent else (",", ":"), allow_nan=False)
    except ValueError as exc:  # a non-finite number: a bug upstream, never valid output
        raise ValueError(f"refusing to write non-finite numbers as JSON: {exc}") from None


def atomic_write_json(path: str | os.PathLike, obj: Any, what: str = "output", indent: int | None = None) -> Path:
    return atomic_write_text(path, finite_json(obj, indent=indent), what)


def is_finite(x: float) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
