"""Episodes in a trajectory's done masks: their lengths, returns and how each ended."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rbtool.ops.stats.summary import summarize

# Episode end causes, as codes in EpisodeTally.ended_by.
TERMINATED, TRUNCATED, OTHER = 0, 1, 2


@dataclass
class EpisodeTally:
    """Episodes found in [T, B] done masks, one entry per finished episode."""

    lengths: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    returns: np.ndarray = field(default_factory=lambda: np.empty(0, np.float64))  # NaN without rewards
    partial_start: np.ndarray = field(default_factory=lambda: np.empty(0, bool))
    ended_by: np.ndarray = field(default_factory=lambda: np.empty(0, np.int8))
    open: int = 0

    @staticmethod
    def combine(parts: Sequence[EpisodeTally]) -> EpisodeTally:
        if not parts:
            return EpisodeTally()
        return EpisodeTally(
            lengths=np.concatenate([p.lengths for p in parts]),
            returns=np.concatenate([p.returns for p in parts]),
            partial_start=np.concatenate([p.partial_start for p in parts]),
            ended_by=np.concatenate([p.ended_by for p in parts]),
            open=sum(p.open for p in parts),
        )


def find_episodes(
    done: np.ndarray,
    rewards: np.ndarray | None = None,
    terminated: np.ndarray | None = None,
    truncated: np.ndarray | None = None,
) -> EpisodeTally:
    """Episodes per environment column b of `[T, B]` masks whose bootstrap rows are already dropped.

    A row with done set ends an episode at that step; the episode spans the steps since the
    previous done of its column (or since row 0: then it may have begun in an earlier
    trajectory, flagged in `partial_start`). Steps after a column's last done form an open
    episode, counted in `open` and not among the finished ones. Its return is the sum of the
    rewards over its steps. An end counts as terminated when `terminated` is set there, else
    truncated when `truncated` is set, else other.
    """
    done = np.asarray(done, dtype=bool)
    t, b = done.shape
    cols, steps = np.nonzero(done.T)  # ordered by column, then step
    same_col = np.zeros(steps.size, dtype=bool)
    same_col[1:] = cols[1:] == cols[:-1]
    prev = np.full(steps.size, -1, dtype=np.int64)
    prev[1:][same_col[1:]] = steps[:-1][same_col[1:]]
    lengths = steps - prev
    if rewards is None:
        returns = np.full(steps.size, np.nan)
    else:
        csum = np.cumsum(np.asarray(rewards, dtype=np.float64).T, axis=1)  # [B, T]
        before = np.where(prev >= 0, csum[cols, np.maximum(prev, 0)], 0.0)
        returns = csum[cols, steps] - before
    ended_by = np.full(steps.size, OTHER, dtype=np.int8)
    if truncated is not None:
        ended_by[np.asarray(truncated, dtype=bool)[steps, cols]] = TRUNCATED
    if terminated is not None:
        ended_by[np.asarray(terminated, dtype=bool)[steps, cols]] = TERMINATED
    last_done = np.full(b, -1, dtype=np.int64)
    np.maximum.at(last_done, cols, steps)
    open_count = int(np.count_nonzero(last_done < t - 1)) if t else 0
    return EpisodeTally(lengths, returns, prev == -1, ended_by, open_count)


def episodes_report(tally: EpisodeTally, trajectories: int, bins: int) -> dict[str, Any]:
    """Counts by end cause, open episodes, and length and return distributions."""
    return {
        "trajectories": trajectories,
        "finished": int(tally.lengths.size),
        "terminated": int(np.count_nonzero(tally.ended_by == TERMINATED)),
        "truncated": int(np.count_nonzero(tally.ended_by == TRUNCATED)),
        "other": int(np.count_nonzero(tally.ended_by == OTHER)),
        "partial_start": int(np.count_nonzero(tally.partial_start)),
        "open": tally.open,
        "length": summarize(tally.lengths, bins),
        "return": summarize(tally.returns, bins),
    }
