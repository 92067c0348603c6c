"""How long work reports progress: one callable, told how many units were just done.

Every library function that takes `progress` takes this; the command line passes a bar's
`advance`, tests a counter. Units are the function's own (trajectories, files, bytes) and
are said in its docstring. Work of several counted phases announces each with `start_phase`.
"""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[int], None]


def start_phase(progress: Progress | None, total: int, description: str) -> None:
    """Tell a progress callback that has a `start(total, description)` method (the command
    line's bars) that a counted phase of `total` units begins; a plain callback just counts."""
    start = getattr(progress, "start", None)
    if start is not None:
        start(total, description)
