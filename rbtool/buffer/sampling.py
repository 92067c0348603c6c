"""Uniform window sampler: draw global sample ids and map them to (trajectory, row).

The draw follows the reference implementation step by step (randint, bucketize with
right=True) so that a seed, a window and a checkpoint give the same batch bit for bit.
A sampler only computes draws; reading the drawn rows is the storage's job
(rbtool.buffer.storage.gather).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, overload

from rbtool.errors import EmptyBufferError, UsageError

if TYPE_CHECKING:
    import numpy as np
    import torch


class Draw:
    """The result of drawing sample positions in a window: the window-relative sample ids
    drawn (`global_indices`), and for each its window position and row in its trajectory.

    The positions and rows may be worked out on first use (`locate`): a batch taken from
    rows held in memory needs only the sample ids.
    """

    def __init__(
        self,
        window_ids: Sequence[int],
        global_indices: torch.Tensor,
        positions: torch.Tensor | None = None,
        local_indices: torch.Tensor | None = None,
        locate: Callable[[], tuple[np.ndarray, np.ndarray]] | None = None,
    ) -> None:
        if (positions is None or local_indices is None) and locate is None:
            raise ValueError("a Draw needs its positions and rows, or how to work them out")
        self.window_ids = window_ids
        self.global_indices = global_indices
        self._located = None if positions is None or local_indices is None else (positions, local_indices)
        self._locate = locate

    def _found(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._located is None:
            import torch

            assert self._locate is not None
            positions, local = self._locate()
            self._located = (torch.from_numpy(positions), torch.from_numpy(local))
        return self._located

    @property
    def positions(self) -> torch.Tensor:
        """Each draw's index into window_ids."""
        return self._found()[0]

    @property
    def local_indices(self) -> torch.Tensor:
        """Each draw's row in its trajectory's sampled rows."""
        return self._found()[1]

    @property
    def trajectory_ids(self) -> list[int]:
        return [self.window_ids[int(k)] for k in self.positions]


def check_budget(name: str, value: object) -> None:
    """A memory budget argument: None or a number of bytes >= 0."""
    if value is not None and (isinstance(value, bool) or value < 0):  # type: ignore[operator]
        raise UsageError(f"{name} must be None or a number of bytes >= 0, got {value!r}")


def check_num_chunks(num_chunks: int) -> None:
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise UsageError(f"num_chunks must be an integer >= 1, got {num_chunks!r}")


def _is_bool(value: object) -> bool:
    dtype = getattr(value, "dtype", None)
    return isinstance(value, bool) or (dtype is not None and str(dtype) in ("bool", "torch.bool"))


def as_num_chunks(value: object) -> int:
    """A number of chunks as an int: any integer RLinf's sampler takes (int, numpy integers,
    a 0-d integer tensor), >= 0. Booleans, floats and tensors of other shapes are refused."""
    if type(value) is int and value >= 0:
        return value
    shape = getattr(value, "shape", ())
    try:
        if _is_bool(value) or tuple(shape) != ():
            raise TypeError
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise UsageError(f"num_chunks must be an integer >= 0, got {value!r}") from None
    if number < 0:
        raise UsageError(f"num_chunks must be an integer >= 0, got {number}")
    return number


def effective_window(value: object, name: str = "sample_window_size") -> int:
    """The window a `sample_window_size` gives, as RLinf reads it (`max(0, int(value))`): a
    number truncated to an int, 0 and anything negative meaning every trajectory.
    Booleans, strings and numbers that are no int (NaN, infinities) are refused."""
    if _is_bool(value) or isinstance(value, (str, bytes)):
        raise UsageError(f"{name} must be a number, got {value!r}")
    try:
        number = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        raise UsageError(f"{name} must be a number, got {value!r}") from None
    return max(0, number)


def check_total(total: int) -> int:
    if total == 0:
        raise EmptyBufferError("cannot sample from an empty buffer (the window holds no samples)")
    return total


def check_draw(num_samples: Sequence[int], num_chunks: int) -> int:
    """Validate a request before anything is drawn; returns the window's total samples."""
    check_num_chunks(num_chunks)
    return check_total(int(sum(num_samples)))


class IdRange(Sequence[int]):
    """Ids `lo..hi-1` (positions) of an id list, seen without copying it."""

    def __init__(self, ids: Sequence[int], lo: int, hi: int) -> None:
        self.ids, self.lo, self.hi = ids, lo, hi

    def __len__(self) -> int:
        return self.hi - self.lo

    @overload
    def __getitem__(self, k: int) -> int: ...
    @overload
    def __getitem__(self, k: slice) -> list[int]: ...
    def __getitem__(self, k: int | slice) -> int | list[int]:
        if isinstance(k, slice):
            return list(self.ids[self.lo : self.hi])[k]
        if not -len(self) <= k < len(self):
            raise IndexError(k)
        return self.ids[self.lo + k % len(self)]


def ids_at(ids: Sequence[int], positions: list[int]) -> list[int]:
    """`[ids[k] for k in positions]`, without a call per position for an IdRange."""
    if isinstance(ids, IdRange):
        seen, lo = ids.ids, ids.lo
        return [seen[lo + k] for k in positions]
    return [ids[k] for k in positions]


class SampleCounts:
    """Cumulative sample counts along an id list, extended as ids are added.

    A window is a range of positions `[lo, hi)`: its total and the mapping of a drawn sample
    id to (position, row) cost O(1) and O(log n) whatever the window's size (SPEC §3 steps
    2 and 4 without summing the window).
    """

    def __init__(self, counts: Iterable[int] = ()) -> None:
        import numpy as np

        self._cum = np.zeros(1024, dtype=np.int64)
        self._n = 0
        self.extend(counts)

    def __len__(self) -> int:
        return self._n

    def extend(self, counts: Iterable[int]) -> None:
        import numpy as np

        add = np.fromiter(counts, dtype=np.int64)
        need = self._n + add.size + 1
        if need > self._cum.size:
            grown = np.zeros(max(need, 2 * self._cum.size), dtype=np.int64)
            grown[: self._n + 1] = self._cum[: self._n + 1]
            self._cum = grown
        if add.size:
            np.cumsum(add, out=self._cum[self._n + 1 : need])
            self._cum[self._n + 1 : need] += self._cum[self._n]
        self._n += add.size

    def total(self, lo: int, hi: int) -> int:
        return int(self._cum[hi] - self._cum[lo])

    def start(self, position: int) -> int:
        """The first cumulative sample of a position (its rows begin there)."""
        return int(self._cum[position])

    def locate(self, lo: int, hi: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Window-relative sample ids -> (window positions, local rows): bucketize(right=True)."""
        base = self._cum[lo]
        absolute = ids + base
        positions = self._cum[lo + 1 : hi + 1].searchsorted(absolute, side="right")
        return positions, absolute - self._cum[lo + positions]


def draw_range(
    ids: Sequence[int], counts: SampleCounts, lo: int, hi: int, num_chunks: int, generator: torch.Generator
) -> Draw:
    """draw_uniform over the window `ids[lo:hi]`, whose counts are kept in `counts`.

    The same random numbers and the same mapping as draw_uniform (so the same batches), at a
    cost that follows `num_chunks`, not the window.
    """
    import torch

    check_num_chunks(num_chunks)
    total = check_total(counts.total(lo, hi))
    drawn = torch.randint(0, total, (min(num_chunks, total),), generator=generator)
    # the counts of positions up to hi never change once added: worked out when first asked
    return Draw(IdRange(ids, lo, hi), drawn, locate=lambda: counts.locate(lo, hi, drawn.numpy()))


def draw_uniform(
    window_ids: Sequence[int],
    num_samples: Sequence[int],
    num_chunks: int,
    generator: torch.Generator,
    *,
    clamp: bool = True,
) -> Draw:
    """SPEC §3 steps 2-4: clamp, randint over the window's total, bucketize to (trajectory, row).

    With `clamp=False` exactly `num_chunks` ids are drawn even when the window holds fewer
    samples (for studying how draws spread; the buffer always clamps).
    """
    import numpy as np
    import torch

    total = check_draw(num_samples, num_chunks)
    if clamp:
        num_chunks = min(num_chunks, total)
    ids = torch.randint(0, total, (num_chunks,), generator=generator)
    # searchsorted(side="right") is bucketize(right=True); numpy avoids torch's thread pool here.
    sizes = np.asarray(num_samples, dtype=np.int64)
    cum = np.cumsum(sizes)
    positions = np.searchsorted(cum, ids.numpy(), side="right")
    local = ids.numpy() - (cum - sizes)[positions]
    return Draw(list(window_ids), ids, torch.from_numpy(positions), torch.from_numpy(local))
