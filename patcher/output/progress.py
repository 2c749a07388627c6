"""Progress for long work, on a terminal only: a wheel being fetched (bytes, rate) and the releases
``anchors record`` goes through.

:func:`progress` gives a bar (rich, imported here and only when a terminal shows it) where stderr is a terminal
and the command is not quiet, and a :class:`Quiet` one that shows nothing otherwise: a pipe and ``-q`` get no
more than the lines the command prints anyway. Only ``drift`` and ``anchors record`` import this module; verify's
fast path, the guard and the other commands never do.
"""

from __future__ import annotations

import sys


class Quiet:
    """Progress that shows nothing (a pipe, ``-q``)."""

    shown = False

    def __enter__(self) -> Quiet:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def task(self, description: str, total: float | None = None, download: bool = False) -> int:
        return 0

    def update(self, task: int, completed: float | None = None, total: float | None = None) -> None:
        return None

    def done(self, task: int) -> None:
        return None


class Bars(Quiet):
    """rich's progress bars on stderr: a download shows its bytes, total and rate; other work its count."""

    shown = True

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        console = Console(stderr=True, width=min(80, Console(stderr=True).width))
        self._downloads = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=20),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        )
        self._counted = Progress(
            TextColumn("{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(), console=console
        )
        self._which: dict[int, Progress] = {}
        self._live = None

    def __enter__(self) -> Bars:
        from rich.console import Group
        from rich.live import Live

        self._live = Live(
            Group(self._counted, self._downloads), console=self._downloads.console, refresh_per_second=8, transient=True
        )
        self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def task(self, description: str, total: float | None = None, download: bool = False) -> int:
        bars = self._downloads if download else self._counted
        task = bars.add_task(description, total=total)
        self._which[task if download else -1 - task] = bars
        return task if download else -1 - task

    def update(self, task: int, completed: float | None = None, total: float | None = None) -> None:
        bars = self._which[task]
        bars.update(task if task >= 0 else -1 - task, completed=completed, total=total)

    def done(self, task: int) -> None:
        bars = self._which.pop(task)
        bars.remove_task(task if task >= 0 else -1 - task)


def progress(quiet: bool = False) -> Quiet:
    """Bars where stderr is a terminal (and not ``quiet``, and TERM is not dumb); nothing shown otherwise."""
    import os

    on_terminal = hasattr(sys.stderr, "isatty") and sys.stderr.isatty() and os.environ.get("TERM") != "dumb"
    return Bars() if on_terminal and not quiet else Quiet()
