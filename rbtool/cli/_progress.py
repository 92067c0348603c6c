"""Progress on stderr: Rich bars for a person at a terminal, phase lines with -v otherwise.

Bars never go to stdout and never show with --json, --jsonl, -q or --no-progress; an
`Advance` is what the library's `progress` callables are given.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rbtool.cli._consoles import detail, err, settings
from rbtool.cli._output import printable


def show_progress(json_mode: bool) -> bool:
    """Progress bars only for a person at a terminal, never with --json, --jsonl, -q or --no-progress,
    and under torchrun only on rank 0 (one bar, not one per rank over each other)."""
    return (
        not json_mode and settings.progress and _stderr_is_terminal() and os.environ.get("RANK", "0") == "0"
    )


def _stderr_is_terminal() -> bool:
    # FORCE_COLOR (set by many CI systems for colour in their logs) makes Rich treat a log as a
    # terminal; colour, yes, but a log gets no progress bars: then the device itself decides.
    if not err.is_terminal:
        return False
    if "FORCE_COLOR" not in os.environ:
        return True
    try:
        return err.file.isatty()
    except (AttributeError, ValueError):
        return False


class Advance:
    """What `progress_bar` yields: `advance(n)` counts n more done; `advance.start(total, description)`
    begins a counted phase (library functions call it before each loop they report)."""

    def __init__(self, progress: Any = None, task: Any = None) -> None:
        self._progress = progress
        self._task = task

    def __call__(self, n: int = 1) -> None:
        if self._progress is not None and n:
            self._progress.advance(self._task, n)

    def phase(self, done: int, description: str) -> None:
        """Name the phase under way, `done` steps of the bar's total behind it."""
        if self._progress is not None:
            self._progress.update(self._task, completed=done, description=printable(description))

    def start(self, total: int | None, description: str | None = None) -> None:
        if self._progress is not None:
            changes: dict[str, Any] = {"total": total, "completed": 0}
            if description is not None:
                changes["description"] = printable(description)
            self._progress.reset(self._task, **changes)


class _PhaseLog(Advance):
    """An Advance for -v without a bar: one stderr line per phase, with the time the last one took."""

    def __init__(self, description: str) -> None:
        import time

        super().__init__()
        self._clock = time.perf_counter
        self._description = description
        self._started = self._clock()
        self._done = 0
        detail(f"{description} ...")

    def __call__(self, n: int = 1) -> None:
        self._done += n

    def _finished(self, now: float) -> None:
        done = f"{self._done} done " if self._done else ""
        detail(f"{self._description}: {done}in {now - self._started:.2f} s")

    def _next(self, description: str | None) -> None:
        now = self._clock()
        self._finished(now)
        self._description = description or self._description
        self._started, self._done = now, 0
        detail(f"{self._description} ...")

    def phase(self, done: int, description: str) -> None:
        if description != self._description:
            self._next(description)

    def start(self, total: int | None, description: str | None = None) -> None:
        self._next(description)

    def finish(self) -> None:
        self._finished(self._clock())


@contextmanager
def _phases(description: str) -> Iterator[Advance]:
    log = _PhaseLog(description)
    yield log
    log.finish()


@contextmanager
def progress_bar(description: str, total: int | None, enabled: bool) -> Iterator[Advance]:
    """A Rich progress bar on stderr with a count, the time taken and an ETA; yields an Advance.

    Disabled, the Advance does nothing (with -v it names each phase and its time on stderr).
    Transient: the bar is gone once the work is done.
    """
    if not enabled:
        if settings.verbose:
            with _phases(description) as advance:
                yield advance
        else:
            yield Advance()
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(
        # a description names inputs: plain text (no markup read from a name), escaped by `err`
        TextColumn("{task.description}", style="progress.description", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=err,
        transient=True,
    ) as progress:
        yield Advance(progress, progress.add_task(printable(description), total=total))
