"""`rlplace simulate`: predicted step time and memory of a plan (filled in with the simulator)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    pass
