"""The ``rlplace`` command line: a thin shell over library functions.

Each sub-command lives in ``agent/commands/<name>.py`` and exposes ``register(app)``. What a user can
get wrong never shows a traceback:

- usage errors (unknown option, missing option, ``--tp abc``, out-of-range numbers) print typer's usage
  line and the error, exit code 2;
- bad input (an :class:`envs.errors.RlplaceError`, and the OS / parse errors a file can cause) prints one
  line ``error: ...``, exit code 2;
- Ctrl-C prints one line ``interrupted``, exit code 130 (``rlplace train`` saves a resumable checkpoint
  first);
- anything else is a bug in rlplace: the traceback is shown, headed "internal error, please report".
"""

from __future__ import annotations

import importlib
import sys
import traceback

import typer

from envs.errors import RlplaceError
from envs.files import one_line

COMMAND_MODULES = [
    "agent.commands.simulate",
    "agent.commands.calibrate",
    "agent.commands.topology",
    "agent.commands.import_cmd",
    "agent.commands.profile",
    "agent.commands.bench",
    "agent.commands.run",
    "agent.commands.train",
    "agent.commands.place",
    "agent.commands.demo",
    "agent.commands.export",
    "agent.commands.dataset",
]
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="rlplace: learn device placement and parallelism plans for deep-learning models.")

for _mod in COMMAND_MODULES:
    importlib.import_module(_mod).register(app)


def _usage_error_class() -> type[Exception]:
    """The command-line parser's own exception base (click's ``ClickException``, which typer bundles in
    recent releases and imports from click in older ones): found through a class typer exports."""
    for cls in typer.BadParameter.__mro__:
        if cls.__name__ == "ClickException":
            return cls
    raise ImportError("typer.BadParameter does not derive from ClickException")  # pragma: no cover


USAGE_ERROR = _usage_error_class()


def fail(message: str) -> None:
    """Print one clear error line and exit 2."""
    typer.echo(f"error: {message}", err=True)
    raise SystemExit(EXIT_BAD_INPUT)


def _os_error_line(exc: OSError) -> str:
    what = exc.strerror or one_line(exc)
    return f"{exc.filename}: {what}" if exc.filename else what


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (see the module docstring)."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        rc = app(args=args, prog_name="rlplace", standalone_mode=False)
        if rc == EXIT_INTERRUPTED:  # typer turns a KeyboardInterrupt inside a command into Exit(130)
            typer.echo("interrupted", err=True)
        return rc if isinstance(rc, int) and not isinstance(rc, bool) else 0
    except USAGE_ERROR as exc:  # usage: typer prints the usage line and the message
        exc.show()
        return int(getattr(exc, "exit_code", EXIT_BAD_INPUT) or EXIT_BAD_INPUT)
    except (typer.Abort, KeyboardInterrupt):
        typer.echo("interrupted", err=True)
        return EXIT_INTERRUPTED
    except typer.Exit as exc:
        return int(exc.exit_code or 0)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return int(exc.code or 0)
        typer.echo(f"error: {exc.code}", err=True)
        return EXIT_BAD_INPUT
    except RlplaceError as exc:
        typer.echo(f"error: {one_line(exc, 1000)}", err=True)
        return EXIT_BAD_INPUT
    except (OSError, UnicodeError) as exc:  # files the user named or asked for
        line = _os_error_line(exc) if isinstance(exc, OSError) else one_line(exc)
        typer.echo(f"error: {line}", err=True)
        return EXIT_BAD_INPUT
    except MemoryError:
        typer.echo("error: out of memory (the input is too large for this machine)", err=True)
        return EXIT_BAD_INPUT
    except Exception:  # noqa: BLE001 - a bug: say so and show it
        typer.echo("internal error, please report it with the traceback below:", err=True)
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
