"""RLinf's `TrajectoryCache`: flattened trajectories in fixed slots of one preallocated buffer.

Drop-in for `rlinf.data.storage.replay.TrajectoryCache`, with its arguments, methods and
behaviour: `max_size` slots used in turn (FIFO: the slot after the last one written is
overwritten next, whatever was read since), every slot as long as the longest trajectory
put so far (the buffer is reallocated, and the slots copied, when a longer one comes), the
buffer laid out like the trajectory that (re)allocated it. `get` returns views into the
buffer, not copies. The buffer itself keeps its own memory (`TrajectoryReplayBuffer` holds
whole trajectories, with the rows this cache drops), but the same capacity rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def _lengths(trajectory: dict[str, Any]) -> dict[str, Any]:
    """The first dim of every tensor, nested as the trajectory is. ValueError when the
    trajectory, or a dict inside it, holds no tensor (as RLinf's cache refuses it)."""
    import torch

    lengths: dict[str, Any] = {}
    for key, value in trajectory.items():
        if isinstance(value, torch.Tensor):
            lengths[key] = int(value.shape[0])
        elif isinstance(value, dict):
            lengths[key] = _lengths(value)
    if not lengths:
        raise ValueError("Trajectory contains no tensor fields.")
    return lengths


def _longest(lengths: dict[str, Any]) -> int:
    return max((_longest(v) if isinstance(v, dict) else int(v) for v in lengths.values()), default=0)


def _alloc_like(trajectory: dict[str, Any], rows: int) -> dict[str, Any]:
    """Empty tensors of `rows` rows shaped like the trajectory's; other values kept as they are."""
    import torch

    out: dict[str, Any] = {}
    for key, value in trajectory.items():
        if isinstance(value, torch.Tensor):
            out[key] = torch.empty((rows, *value.shape[1:]), dtype=value.dtype, device=value.device)
        elif isinstance(value, dict):
            out[key] = _alloc_like(value, rows)
        else:
            out[key] = value
    return out


def _write(trajectory: dict[str, Any], buffer: dict[str, Any], start: int) -> None:
    import torch

    for key, value in trajectory.items():
        if isinstance(value, torch.Tensor):
            buffer[key][start : start + value.shape[0]] = value
        elif isinstance(value, dict):
            _write(value, buffer[key], start)
        else:
            buffer[key] = value


def _copy_rows(src: dict[str, Any], dst: dict[str, Any], src_rows: slice, dst_rows: slice) -> None:
    import torch

    for key, value in src.items():
        if isinstance(value, torch.Tensor):
            dst[key][dst_rows] = value[src_rows]
        elif isinstance(value, dict):
            _copy_rows(value, dst[key], src_rows, dst_rows)
        else:
            dst[key] = value


class TrajectoryCache:
    """FIFO cache for storing flattened trajectories (RLinf's, same arguments and behaviour)."""

    def __init__(self, max_size: int = 5) -> None:
        self.cache: dict[int, int] = {}  # trajectory id -> slot
        self.max_size = max_size
        self._buffer: dict[str, Any] | None = None
        self._traj_num_samples: int | None = None  # the slot length
        self._traj_key_lengths: dict[int, dict[str, Any]] = {}
        self._last_slot = 0
        self._slot_to_id: dict[int, int] = {}

    def get(self, trajectory_id: int) -> dict[str, Any] | None:
        """The cached trajectory's fields as views of its slot (each its own length), or None."""
        if trajectory_id not in self.cache or self._buffer is None:
            return None
        assert self._traj_num_samples is not None
        start = self.cache[trajectory_id] * self._traj_num_samples
        return self._slice(self._buffer, start, self._traj_key_lengths.get(trajectory_id))

    def get_buffer(self) -> dict[str, Any] | None:
        """The whole buffer: slot `s` is rows `s * get_slot_length()` on."""
        return self._buffer

    def get_slot_length(self) -> int | None:
        """Rows per slot (the longest trajectory put since the last clear), or None when empty."""
        return self._traj_num_samples

    def put(self, trajectory_id: int, trajectory: dict[str, torch.Tensor | Any]) -> None:
        """Write a flattened trajectory into its slot (a new id takes the next slot in turn,
        evicting the id there). ValueError when it, or a dict in it, holds no tensor."""
        lengths = _lengths(trajectory)
        self._make_room(_longest(lengths), trajectory)
        assert self._buffer is not None and self._traj_num_samples is not None
        slot = self.cache.get(trajectory_id)
        if slot is None:
            slot = self._last_slot
            evicted = self._slot_to_id.get(slot)
            if evicted is not None:
                self.cache.pop(evicted, None)
                self._traj_key_lengths.pop(evicted, None)
            self._slot_to_id[slot] = trajectory_id
            self.cache[trajectory_id] = slot
            self._last_slot = (self._last_slot + 1) % self.max_size
        _write(trajectory, self._buffer, slot * self._traj_num_samples)
        self._traj_key_lengths[trajectory_id] = lengths

    def clear(self) -> None:
        """Drop every trajectory and the buffer; the next put starts at slot 0."""
        self.cache.clear()
        self._buffer = None
        self._traj_num_samples = None
        self._traj_key_lengths.clear()
        self._last_slot = 0
        self._slot_to_id.clear()

    def _make_room(self, rows: int, trajectory: dict[str, Any]) -> None:
        """Allocate the buffer (first put), or grow every slot to `rows` keeping what they hold."""
        if self._traj_num_samples is None:
            self._traj_num_samples = rows
            self._buffer = _alloc_like(trajectory, self.max_size * rows)
            return
        old = self._traj_num_samples
        if rows <= old:
            return
        grown = _alloc_like(trajectory, self.max_size * rows)
        if self._buffer is not None:
            for slot in self.cache.values():
                start, to = slot * old, slot * rows
                _copy_rows(self._buffer, grown, slice(start, start + old), slice(to, to + old))
        self._buffer = grown
        self._traj_num_samples = rows

    def _slice(self, buffer: dict[str, Any], start: int, lengths: dict[str, Any] | None) -> dict[str, Any]:
        import torch

        assert self._traj_num_samples is not None
        out: dict[str, Any] = {}
        for key, value in buffer.items():
            if isinstance(value, torch.Tensor):
                rows = self._traj_num_samples if lengths is None or key not in lengths else int(lengths[key])
                out[key] = value[start : start + rows]
            elif isinstance(value, dict):
                out[key] = self._slice(value, start, None if lengths is None else lengths.get(key))
            else:
                out[key] = value
        return out


class CachedIds:
    """The ids RLinf's cache of `capacity` slots would hold, without their data: the last
    `capacity` distinct ids put (none when `capacity` < 1), for `get_stats()["cache_size"]`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._ids: dict[int, None] = {}  # insertion order: the oldest first

    def put(self, ids: Iterable[int]) -> None:
        for tid in ids:
            if tid in self._ids or not self.capacity:
                continue
            if len(self._ids) == self.capacity:
                del self._ids[next(iter(self._ids))]
            self._ids[tid] = None

    def reset(self, ids: Sequence[int] = ()) -> None:
        """Hold the last `capacity` of `ids` (what a load puts in the cache), or nothing."""
        self._ids.clear()
        self.put(ids[max(0, len(ids) - self.capacity) :] if self.capacity else ())

    def __len__(self) -> int:
        return len(self._ids)
