"""The one default window of every command that takes --window, and the line that says what it kept."""

from __future__ import annotations

from typing import Any

from rbtool.cli._options import SUMMARY_ITEMS
from rbtool.cli._output import format_ids

# TrajectoryReplayBuffer's own default sample_window_size (and RLinf's): `sample`, `stats` and
# `checkpoint save` reproduce what a buffer built with defaults would draw or save (docs/decisions.md).
DEFAULT_WINDOW = 100


def window_line(window: int, kept: Any, listed: Any) -> str:
    """`window 100: kept ids 900-999 of 0-999 (the last 100 of 1000 trajectories)`, and why.

    `listed` are the ids the window was taken from (in list order), `kept` what it kept (lists
    or numpy arrays of ids).
    """
    n = len(listed)
    if window == 0:
        why = f"0 keeps all {n}"
    elif n <= window:
        why = f"the last {window}: all {n}, fewer than {window}"
    else:
        why = f"the last {window} of {n} trajectories; 0 keeps all"
    ids = format_ids(kept, SUMMARY_ITEMS)
    return f"window {window}: kept ids {ids} of {format_ids(listed, SUMMARY_ITEMS)} ({why})"
