"""Top-k sampling (SPEC §6): a reward indexer kept beside the buffer and a weighted sampler.

Writes to the buffer stay append-only; the indexer holds one score per sample (its reward)
and answers top-k and recency queries over a window. Scores arrive in batches, and the
ranking is rebuilt at most once per batch, never per write. Draws go through the buffer's
torch generator, so a seed gives the same batch every time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rbtool.buffer.sampling import Draw
from rbtool.errors import RbtoolError, UsageError

if TYPE_CHECKING:
    import torch

STRATEGIES = ("uniform", "topk")
# Trajectories whose rewards are computed lazily are read this many at a time.
FILL_BATCH = 64


def check_k(k: int) -> None:
    """Refuse a k (how many top samples) that is not an integer >= 1."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise UsageError(f"k must be an integer >= 1, got {k!r}")


def check_strategy(strategy: str, k: int | None, temperature: float) -> None:
    """Refuse an unknown strategy, a k below 1, a temperature that is not > 0, or topk without k."""
    if strategy not in STRATEGIES:
        raise UsageError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if k is not None:
        check_k(k)
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise UsageError(f"temperature must be a finite number > 0, got {temperature!r}")
    if strategy == "topk" and k is None:
        raise UsageError("strategy 'topk' needs k (how many top samples are candidates)")


def scores_of_rows(rows: torch.Tensor | None, num_samples: int) -> np.ndarray:
    """Per-sample scores from reward rows `[N, ...]`: summed over trailing dims, as float64.

    Without rewards every score is NaN, which the indexer treats as "no score".
    """
    if rows is None:
        return np.full(num_samples, np.nan)
    import torch

    flat = rows.reshape(int(rows.shape[0]), math.prod(int(d) for d in rows.shape[1:]))
    return flat.to(torch.float64).sum(dim=1).numpy()


def trajectory_scores(traj: dict[str, Any], num_samples: int) -> np.ndarray:
    """Scores of a trajectory dict: its `rewards [T, B, ...]` seen as `[T*B, ...]` rows."""
    import torch

    rewards = traj.get("rewards")
    if not isinstance(rewards, torch.Tensor) or rewards.dim() < 2:
        return scores_of_rows(None, num_samples)
    rows = rewards.reshape(int(rewards.shape[0]) * int(rewards.shape[1]), *rewards.shape[2:])
    return scores_of_rows(rows, num_samples)


@dataclass(frozen=True)
class Candidates:
    """Samples answering a query, best (or most recent) first."""

    trajectory_ids: np.ndarray  # int64
    rows: np.ndarray  # int64, flat row t * B + b in the trajectory
    scores: np.ndarray  # float64, NaN where the sample has no reward

    def __len__(self) -> int:
        return int(self.rows.size)


def _empty() -> Candidates:
    return Candidates(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.float64))


class RewardIndex:
    """Per-sample reward scores of trajectories, updated in batches; top-k and recency queries.

    `add` stages a batch; the staged batches are merged when a query needs them, which also
    invalidates the cached ranking once for the whole batch.
    """

    def __init__(self) -> None:
        self._scores: dict[int, np.ndarray] = {}
        self._order: dict[int, int] = {}  # trajectory id -> insertion sequence
        self._next_seq = 0
        self._pending: list[list[tuple[int, np.ndarray]]] = []
        self._version = 0
        self._ranking: tuple[tuple[int, tuple[int, ...]], Candidates] | None = None

    # --------------------------------------------------------------- updates
    def add(self, batch: Iterable[tuple[int, np.ndarray]]) -> None:
        """Stage one batch of (trajectory id, per-sample scores); a re-added id replaces its scores."""
        staged = [(int(tid), np.asarray(scores, dtype=np.float64).reshape(-1)) for tid, scores in batch]
        if staged:
            self._pending.append(staged)

    def _commit(self) -> None:
        """Merge the staged batches; taking the list whole keeps a batch staged meanwhile for later."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        for batch in pending:
            for tid, scores in batch:
                if tid not in self._order:
                    self._order[tid] = self._next_seq
                    self._next_seq += 1
                self._scores[tid] = scores
        self._version += 1

    def retain(self, ids: Iterable[int]) -> None:
        """Forget every trajectory not in `ids` (those that left the sampling window)."""
        self._commit()
        keep = set(ids)
        gone = [tid for tid in self._scores if tid not in keep]
        for tid in gone:
            del self._scores[tid]
            del self._order[tid]
        if gone:
            self._version += 1

    def fill(
        self, ids: Sequence[int], scores_of: Callable[[int], np.ndarray], batch_size: int = FILL_BATCH
    ) -> None:
        """Index the trajectories of `ids` not indexed yet, `batch_size` at a time (lazy loading)."""
        todo = self.missing(ids)
        for start in range(0, len(todo), batch_size):
            self.add([(tid, scores_of(tid)) for tid in todo[start : start + batch_size]])

    # --------------------------------------------------------------- queries
    def __contains__(self, tid: object) -> bool:
        self._commit()
        return tid in self._scores

    def __len__(self) -> int:
        self._commit()
        return len(self._scores)

    def missing(self, ids: Sequence[int]) -> list[int]:
        """Ids of `ids` that have no scores yet, in the given order."""
        self._commit()
        return [tid for tid in ids if tid not in self._scores]

    def _selected(self, ids: Sequence[int] | None) -> list[int]:
        self._commit()
        if ids is None:
            return sorted(self._scores, key=self._order.__getitem__)
        absent = [tid for tid in ids if tid not in self._scores]
        if absent:
            raise RbtoolError(f"trajectories {absent[:20]} have not been indexed yet")
        return list(ids)

    def _columns(self, ids: list[int]) -> Candidates:
        """Every sample of `ids`, in that order, as (trajectory id, row, score) columns."""
        if not ids:
            return _empty()
        parts = [self._scores[tid] for tid in ids]
        sizes = np.fromiter((p.size for p in parts), dtype=np.int64, count=len(parts))
        tids = np.repeat(np.asarray(ids, dtype=np.int64), sizes)
        starts = np.repeat(np.cumsum(sizes) - sizes, sizes)
        rows = np.arange(int(sizes.sum()), dtype=np.int64) - starts
        return Candidates(tids, rows, np.concatenate(parts))

    def ranking(self, ids: Sequence[int] | None = None) -> Candidates:
        """Every scored sample of `ids` (all indexed when None), highest score first.

        Ties go to the lower trajectory id, then the lower row; NaN scores are left out.
        Cached until the next batch is merged or the ids change.
        """
        chosen = self._selected(ids)
        key = (self._version, tuple(chosen))
        if self._ranking is not None and self._ranking[0] == key:
            return self._ranking[1]
        cols = self._columns(chosen)
        scored = ~np.isnan(cols.scores)
        tids, rows, scores = cols.trajectory_ids[scored], cols.rows[scored], cols.scores[scored]
        order = np.lexsort((rows, tids, -scores))
        ranked = Candidates(tids[order], rows[order], scores[order])
        self._ranking = (key, ranked)
        return ranked

    def top_k(self, k: int, ids: Sequence[int] | None = None) -> Candidates:
        """The min(k, scored samples) highest-scoring samples of `ids`, no duplicates, best first."""
        check_k(k)
        ranked = self.ranking(ids)
        return Candidates(ranked.trajectory_ids[:k], ranked.rows[:k], ranked.scores[:k])

    def recent(self, k: int, ids: Sequence[int] | None = None) -> Candidates:
        """The k most recent samples: last trajectory first (insertion order), then higher row first.

        `ids` gives the insertion order (a buffer passes its window); None uses the order added.
        """
        check_k(k)
        chosen = self._selected(ids)
        taken: list[int] = []
        count = 0
        for tid in reversed(chosen):
            if count >= k:
                break
            taken.append(tid)
            count += self._scores[tid].size
        cols = self._columns(taken[::-1])
        columns = (cols.trajectory_ids, cols.rows, cols.scores)
        tids, rows, scores = (np.ascontiguousarray(c[::-1][:k]) for c in columns)
        return Candidates(tids, rows, scores)


def softmax_weights(scores: np.ndarray, temperature: float) -> np.ndarray:
    """softmax(score / temperature) in float64 with the maximum subtracted; sums to 1, never NaN.

    Computed as exp((score - max) / temperature), which equals the textbook form for
    temperature > 0 but cannot overflow: 1e308 / 0.5 would be inf, and inf - inf is NaN.
    NaN scores weigh 0; when the maximum is +inf (or every score is -inf) the weight is
    shared equally by the samples holding it.
    """
    if not (math.isfinite(temperature) and temperature > 0):
        raise UsageError(f"temperature must be a finite number > 0, got {temperature!r}")
    s = np.asarray(scores, dtype=np.float64)
    if s.size == 0:
        return np.empty(0, np.float64)
    s = np.where(np.isnan(s), -np.inf, s)
    top = s.max()
    if np.isinf(top):
        weights = (s == top).astype(np.float64)
    else:
        with np.errstate(over="ignore", under="ignore"):
            weights = np.exp((s - top) / temperature)
    return weights / weights.sum()


def weighted_draw(weights: np.ndarray, n: int, generator: torch.Generator) -> torch.Tensor:
    """n positions drawn with replacement by `weights`, through the cumulative distribution.

    The cumulative sum is pinned to 1.0 from the last positive weight on, so rounding can
    neither leave a gap above the last value nor let a zero-weight tail be drawn.
    """
    import torch

    w = np.asarray(weights, dtype=np.float64)
    positive = np.flatnonzero(w > 0)
    if positive.size == 0:
        raise RbtoolError("cannot draw: no candidate has a positive weight")
    cdf = np.cumsum(w)
    cdf[positive[-1] :] = 1.0
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    return torch.searchsorted(torch.from_numpy(cdf), u, right=True)


def draw_topk(
    window_ids: Sequence[int],
    num_samples: Sequence[int],
    candidates: Candidates,
    num_chunks: int,
    temperature: float,
    generator: torch.Generator,
    *,
    clamp: bool = True,
) -> Draw:
    """Draw `num_chunks` samples among `candidates` with softmax weights, as a window Draw.

    `num_chunks` is clamped to the window's samples, as uniform sampling does (unless
    `clamp=False`: for studying how draws spread; the buffer always clamps).
    """
    import torch

    if num_chunks < 1:
        raise UsageError(f"num_chunks must be >= 1, got {num_chunks}")
    total = int(sum(num_samples))
    if total == 0:
        raise RbtoolError("cannot sample from an empty buffer (the window holds no samples)")
    if len(candidates) == 0:
        raise RbtoolError("cannot sample top-k: no sample in the window has a reward")
    count = min(num_chunks, total) if clamp else num_chunks
    picks = weighted_draw(softmax_weights(candidates.scores, temperature), count, generator)
    window = np.asarray(window_ids, dtype=np.int64)
    by_id = np.argsort(window, kind="stable")
    cand_pos = torch.from_numpy(by_id[np.searchsorted(window[by_id], candidates.trajectory_ids)])
    cand_rows = torch.from_numpy(candidates.rows)
    sizes = torch.as_tensor(list(num_samples), dtype=torch.long)
    starts = sizes.cumsum(0) - sizes
    positions = cand_pos[picks]
    local = cand_rows[picks]
    return Draw(list(window_ids), starts[positions] + local, positions, local)
