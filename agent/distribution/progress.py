"""A progress bar over task draws: every draw traces a model (seconds each, minutes for a large range)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def drawing(total: int, enabled: bool = True) -> Iterator[Callable]:
    """A bar of ``total`` draws; yields the ``on_draw`` callback of ``agent.distribution.draw_tasks``,
    which advances it and names the member just traced."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not enabled or total < 1) as bar:
        t = bar.add_task("tracing tasks", total=total)

        def on_draw(d) -> None:
            bar.update(t, advance=1, description=f"tracing tasks ({d.spec[:32]})")

        yield on_draw
