"""The ``rlplace`` command line: a thin shell over library functions.

Each sub-command lives in ``agent/commands/<name>.py`` and exposes ``register(app)``. Bad input
anywhere prints one clear message and exits with code 2 (no traceback).
"""

from __future__ import annotations

import importlib
import sys

import typer

from envs.errors import RlplaceError

COMMAND_MODULES = [
    "agent.commands.simulate",
    "agent.commands.topology",
    "agent.commands.import_cmd",
    "agent.commands.profile",
    "agent.commands.bench",
    "agent.commands.run",
    "agent.commands.train",
    "agent.commands.place",
    "agent.commands.demo",
]

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="rlplace: learn device placement and parallelism plans for deep-learning models.")

for _mod in COMMAND_MODULES:
    importlib.import_module(_mod).register(app)


def fail(message: str) -> None:
    """Print one clear error line and exit 2."""
    typer.echo(f"error: {message}", err=True)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    try:
        app(args=argv, standalone_mode=False)
    except RlplaceError as exc:
        fail(str(exc))
    except FileNotFoundError as exc:
        fail(f"file not found: {exc.filename}")
    except typer.Exit as exc:
        return int(exc.exit_code or 0)
    except SystemExit as exc:
        return int(exc.code or 0) if isinstance(exc.code, int) else 2
    except Exception as exc:  # click usage errors and friends
        import click

        if isinstance(exc, click.exceptions.ClickException):
            typer.echo(f"error: {exc.format_message()}", err=True)
            raise SystemExit(2) from None
        if isinstance(exc, click.exceptions.Abort):
            raise SystemExit(130) from None
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
