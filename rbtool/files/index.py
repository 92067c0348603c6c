"""The in-memory index of a checkpoint: read and write it, id and rank arithmetic.

What the two JSON files may hold is rbtool.format's business; this module reads them through
its validator and writes them back. It never imports torch: index-only commands stay fast.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import Any

import orjson

from rbtool.errors import UsageError
from rbtool.files.fsutil import write_bytes_atomic
from rbtool.format import (
    FORMAT_VERSION,
    INDEX_FILE,
    METADATA_FILE,
    SCHEMAS_KEY,
    check_json,
    is_checkpoint_dir,
    trajectory_file_name,
    trajectory_file_names,
)


def rank_bounds(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous block when n items are split over world_size ranks.

    The first `n % world_size` ranks take one item more.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"world_size must be an integer >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise UsageError(f"rank must be in [0, {world_size}), got {rank!r}")
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def balanced_blocks(num_samples: Sequence[int], world_size: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's contiguous block, balancing samples instead of counts.

    Rank r's block ends where the running total of samples comes closest to r+1 shares of
    the whole, so every rank's samples lie within the largest trajectory's of the mean.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"world_size must be an integer >= 1, got {world_size!r}")
    prefix = [0]
    for n in num_samples:
        prefix.append(prefix[-1] + n)
    total = prefix[-1]
    cuts = [0]
    for r in range(1, world_size):
        # closest prefix to r/world_size of the total, in integers: |N * P_k - r * S|
        target = r * total
        k = _closest(prefix, world_size, target)
        cuts.append(max(k, cuts[-1]))
    cuts.append(len(num_samples))
    return [(cuts[r], cuts[r + 1]) for r in range(world_size)]


def _closest(prefix: Sequence[int], world_size: int, target: int) -> int:
    """The position k whose world_size * prefix[k] is closest to target (the lower on a tie)."""
    lo, hi = 0, len(prefix)
    while lo < hi:  # first k with world_size * prefix[k] >= target
        mid = (lo + hi) // 2
        if world_size * prefix[mid] < target:
            lo = mid + 1
        else:
            hi = mid
    k = min(lo, len(prefix) - 1)
    if k > 0 and target - world_size * prefix[k - 1] <= world_size * prefix[k] - target:
        return k - 1
    return k


def window_start(count: int, window_size: int, name: str = "window size") -> int:
    """Where the sample window (SPEC §6) of a list of `count` begins: its last `window_size`
    items, all of them (0) when `window_size` is 0 or the list is shorter. `name` is what the
    error calls a negative `window_size`."""
    if window_size < 0:
        raise UsageError(f"{name} must be >= 0, got {window_size}")
    if window_size == 0 or window_size >= count:
        return 0
    return count - window_size


def window_of(id_list: Sequence[int], window_size: int) -> list[int]:
    """The last `window_size` ids of the list; all of them when 0 or the list is shorter."""
    return list(id_list[window_start(len(id_list), window_size) :])


_WEIGHTS_ID, _SHAPE, _TB = itemgetter("model_weights_id"), itemgetter("shape"), itemgetter(0, 1)
DEFAULT_SEED = 1234  # RLinf's buffer's default seed: recorded when a checkpoint is made without one


@dataclass
class Index:
    """A checkpoint's metadata and trajectory index, held in memory.

    `entries` maps id to the entry as stored in JSON; `id_list` is the insertion order.
    `extra_metadata` keeps metadata keys rbtool does not interpret, so they survive a rewrite.
    """

    entries: dict[int, dict[str, Any]] = field(default_factory=dict)
    id_list: list[int] = field(default_factory=list)
    trajectory_counter: int = 0
    seed: int | None = DEFAULT_SEED
    trajectory_format: str = "pt"
    extra_metadata: dict[str, Any] = field(default_factory=dict)
    # rbtool's table of field schemas (digest -> fields), which entries name by "schema"
    schemas: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.id_list)

    @property
    def total_samples(self) -> int:
        entries = self.entries
        return sum(entries[i]["num_samples"] for i in self.id_list)

    def file_name(self, trajectory_id: int) -> str:
        entry = self.entries[trajectory_id]
        return trajectory_file_name(trajectory_id, entry["model_weights_id"], self.trajectory_format)

    def file_names(self, ids: Sequence[int]) -> list[str]:
        """file_name of each id, at once."""
        weights = map(_WEIGHTS_ID, map(self.entries.__getitem__, ids))
        return trajectory_file_names(ids, weights, self.trajectory_format)

    def shapes(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        """[T, B] of each id, as its entry records it, at once."""
        return list(map(_TB, map(_SHAPE, map(self.entries.__getitem__, ids))))

    def next_counter(self) -> int:
        """The smallest counter that keeps ids unique: above every listed id."""
        return max(self.id_list, default=-1) + 1

    def subset(self, ids: Iterable[int], trajectory_counter: int | None = None) -> Index:
        """A new index listing only `ids` (in the given order)."""
        ids = list(ids)
        counter = self.trajectory_counter if trajectory_counter is None else trajectory_counter
        return Index(
            entries={i: self.entries[i] for i in ids},
            id_list=ids,
            trajectory_counter=counter,
            seed=self.seed,
            trajectory_format=self.trajectory_format,
            extra_metadata=dict(self.extra_metadata),
            schemas=self.schemas,
        )

    def rank_block(self, world_size: int, rank: int) -> Index:
        """What a distributed load by `rank` keeps: its block, counter = block's max id + 1."""
        start, end = rank_bounds(len(self.id_list), world_size, rank)
        ids = self.id_list[start:end]
        return self.subset(ids, trajectory_counter=max(ids, default=-1) + 1)

    def state(self) -> dict[str, Any]:
        """The four numbers a load reports, as a JSON-ready dict."""
        return {
            "size": self.size,
            "total_samples": self.total_samples,
            "trajectory_counter": self.trajectory_counter,
            "trajectory_id_list": list(self.id_list),
        }

    def metadata_json(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "trajectory_format": self.trajectory_format,
            "size": self.size,
            "total_samples": self.total_samples,
            "trajectory_counter": self.trajectory_counter,
        }
        if self.seed is not None:  # never "seed": null: the reference implementation cannot load it
            meta["seed"] = self.seed
        for key, value in self.extra_metadata.items():
            meta.setdefault(key, value)
        meta["format_version"] = FORMAT_VERSION
        if self.schemas:
            used = {self.entries[i].get("schema") for i in self.id_list}
            table = {d: fields for d, fields in self.schemas.items() if d in used}
            if table:
                meta[SCHEMAS_KEY] = table
        return meta

    def index_json(self) -> dict[str, Any]:
        return {
            "trajectory_index": {str(i): self.entries[i] for i in self.id_list},
            "trajectory_id_list": list(self.id_list),
        }


def read_index(directory: str | os.PathLike[str]) -> Index:
    """Read a checkpoint or buffer directory's metadata and index, refusing what format rejects.

    The checks are rbtool.format.check_json's, so this accepts exactly what quick
    verification passes. Only an interrupted two-file publish (metadata one update behind
    its index) is read by recounting `size`, `total_samples` and `trajectory_counter`.
    """
    checked = check_json(directory)
    checked.raise_first()
    meta = checked.meta
    assert checked.id_list is not None
    index = Index(
        entries=checked.entry_dicts(),
        id_list=list(checked.id_list),
        trajectory_counter=0,
        seed=meta.seed,
        trajectory_format=meta.trajectory_format or "pt",
        extra_metadata=dict(meta.extra),
        schemas=meta.schemas,
    )
    index.trajectory_counter = max(meta.trajectory_counter or 0, index.next_counter())
    return index


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


def write_index(directory: str | os.PathLike[str], index: Index) -> None:
    """Publish index then metadata, each atomically; files they name must already be complete."""
    directory = Path(directory)
    write_bytes_atomic(directory / INDEX_FILE, dumps(index.index_json()), sync_dir=False)
    write_bytes_atomic(directory / METADATA_FILE, dumps(index.metadata_json()))


def init_buffer_dir(directory: Path, index: Index) -> None:
    """Make `directory` a valid (empty) buffer directory before anything is written into it.

    A new directory is built beside its final name and renamed into place, so no reader ever
    sees an index without metadata. If another process creates it meanwhile, theirs is kept.
    """
    import shutil

    from rbtool.files.fsutil import new_staging_dir

    if not directory.exists():
        staging = new_staging_dir(directory)
        try:
            write_index(staging, index)
            os.rename(staging, directory)
        except OSError:
            if not directory.is_dir():
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    if not is_checkpoint_dir(directory):
        write_index(directory, index)


__all__ = [
    "Index",
    "balanced_blocks",
    "dumps",
    "init_buffer_dir",
    "rank_bounds",
    "read_index",
    "window_of",
    "window_start",
    "write_index",
]
