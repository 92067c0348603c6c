"""RLinf's `PriorityStore`: the `maxsize` trajectories of highest priority, for async PPO.

Drop-in for `rlinf.data.storage.replay.PriorityStore`. Items are ordered by
`(priority, arrival)`: among equal priorities the oldest is the lowest, so it is evicted
first and listed last by `topn`. RLinf's priority is `(min_version, mean_version)`, compared
as a tuple. The store counts the items that left it (evicted, refused or removed) without
ever having been handed out by `topn` (`discarded_unused` in `get_metric`).

Where RLinf's own store breaks, this one does not (docs/decisions.md): with `maxsize` 0
(or less) `add` keeps nothing and returns False, where RLinf raises IndexError (0) or
returns True for an item it drops at once (negative); `topn(0)` is empty, where RLinf's
`items[-0:]` hands out every item; a negative `n` is an error.
"""

from __future__ import annotations

import bisect
import operator
from typing import Any, Generic, TypeVar

from rbtool.errors import UsageError

T = TypeVar("T")


def _versions(data: Any) -> Any:
    """A trajectory's `versions` tensor (attribute, or key of a dict trajectory), or None."""
    if isinstance(data, dict):
        return data.get("versions")
    return data.versions


class PriorityStore(Generic[T]):
    """The `maxsize` items of highest priority (RLinf's, same arguments and behaviour)."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._seq = 0
        self._keys: list[tuple[Any, int]] = []  # (priority, arrival), ascending
        self._items: list[tuple[Any, int, T]] = []  # (priority, arrival, data), in the same order
        self._used_seqs: set[int] = set()
        self._discarded_unused = 0

    def add(self, priority: tuple[float, float], data: T) -> bool:
        """Keep `data` unless the store is full and `priority` is below its lowest; when full,
        the lowest (oldest among equals) makes room. True when `data` was kept."""
        if self.maxsize <= 0:
            self._discarded_unused += 1
            return False
        if len(self._items) >= self.maxsize and priority < self._keys[0][0]:
            self._discarded_unused += 1
            return False
        key = (priority, self._seq)
        at = bisect.bisect_right(self._keys, key)
        self._keys.insert(at, key)
        self._items.insert(at, (priority, self._seq, data))
        self._seq += 1
        while len(self._items) > self.maxsize:
            self._keys.pop(0)
            self._left(self._items.pop(0)[1])
        return True

    def topn(self, n: int) -> list[T]:
        """The `n` items of highest priority, highest first (all when fewer); each marked used."""
        n = operator.index(n)
        if n < 0:
            raise UsageError(f"topn needs n >= 0, got {n}")
        items = self._items[max(0, len(self._items) - n) :] if n else []
        for _, seq, _ in items:
            self._used_seqs.add(seq)
        return [data for _, _, data in reversed(items)]

    def remove_below(self, threshold: Any) -> None:
        """Drop every item whose priority's first element (the min version) is below `threshold`."""
        below = [item[0][0] < threshold for item in self._items]
        for item, gone in zip(self._items, below, strict=True):
            if gone:
                self._left(item[1])
        self._keys = [key for key, gone in zip(self._keys, below, strict=True) if not gone]
        self._items = [item for item, gone in zip(self._items, below, strict=True) if not gone]

    def get_metric(self) -> dict[Any, Any]:
        """`{version: {"ratio": share of all version cells}, ..., "discarded_unused": n}` over the
        items' rounded `versions`; only `discarded_unused` when no item has versions."""
        import torch

        total = 0
        counts: dict[int, int] = {}
        for _, _, data in self._items:
            versions = _versions(data)
            if versions is None:
                continue
            flat = torch.round(versions.reshape(-1)).to(torch.int64)
            values, found = torch.unique(flat, return_counts=True)
            for value, count in zip(values.tolist(), found.tolist(), strict=True):
                counts[value] = counts.get(value, 0) + count
            total += flat.numel()
        result: dict[Any, Any] = {}
        if total:
            result = {value: {"ratio": count / total} for value, count in counts.items()}
        result["discarded_unused"] = self._discarded_unused
        return result

    def __len__(self) -> int:
        return len(self._items)

    def _left(self, seq: int) -> None:
        """An item left the store: counted when it was never handed out."""
        if seq in self._used_seqs:
            self._used_seqs.discard(seq)
        else:
            self._discarded_unused += 1
