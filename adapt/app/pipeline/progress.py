"""Live progress of a run: one bar per stage, a sub-bar for the items a stage reports (blocks, steps).

Stage functions report items through :func:`report_progress`, a context-local channel, so
they need no extra parameter; stage functions that accept a ``progress`` keyword get the same
callable passed in.  When the output is not a terminal, rich prints plain lines instead.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

ProgressCallback = Callable[[int, int, str], None]

_CURRENT: contextvars.ContextVar[ProgressCallback | None] = contextvars.ContextVar("adapt_progress", default=None)

STATUS_STYLE = {
    "passed": ("✓", "green"),
    "failed": ("✗", "red"),
    "error": ("!", "red"),
    "blocked": ("–", "yellow"),
    "skipped": ("·", "dim"),
    "interrupted": ("‖", "yellow"),
    "pending": ("…", "dim"),
}


def report_progress(done: int, total: int, label: str = "") -> None:
    """Called by a stage while it works: ``done`` of ``total`` items, ``label`` names the current one."""
    callback = _CURRENT.get()
    if callback is not None:
        callback(done, total, label)


class RunProgress:
    """The rich display of one pipeline run."""

    def __init__(self, console: Console | None = None, quiet: bool = False):
        self.console = console or Console(stderr=True, soft_wrap=True)
        self.quiet = quiet
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description:<12}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("{task.fields[item]}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
            disable=quiet,
        )

    def __enter__(self) -> RunProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.__exit__(*exc)

    @contextmanager
    def stage(self, name: str, doing: str = "") -> Iterator[ProgressCallback]:
        """Show ``name`` as running (``doing`` until the stage reports items); yields the item-bar callback."""
        task = self._progress.add_task(name, total=None, item=doing)

        def update(done: int, total: int, label: str = "") -> None:
            self._progress.update(task, completed=done, total=total or None, item=label)

        token = _CURRENT.set(update)
        try:
            yield update
        finally:
            _CURRENT.reset(token)
            self._progress.remove_task(task)

    def verdict(self, name: str, status: str, verdict: str, duration_s: float, cached: bool) -> None:
        """The one-line verdict printed when a stage ends."""
        if self.quiet:
            return
        mark, style = STATUS_STYLE.get(status, ("?", "white"))
        timing = "cached" if cached else (f"{duration_s:6.1f}s" if status in ("passed", "failed", "error") else "")
        self.console.print(
            f"[{style}]{mark} {name:<12} {status:<11}[/] [dim]{timing:>7}[/]  {verdict}", highlight=False
        )
