"""Filter: a new checkpoint of the trajectories of a checkpoint (or rank tree) that match.

Criteria read from the index (policy id, ids, sample counts, the last N) cost nothing;
version criteria read each trajectory's `versions` field (memory-mapped for `.pt`). Files
are linked, counts recomputed, the counter kept so that ids continue without colliding.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rbtool.errors import CheckpointError, UsageError
from rbtool.files import trajfile
from rbtool.files.dirs import CheckpointView, open_view
from rbtool.files.index import Index
from rbtool.files.writer import Rules, WriteReport, copied_entries, write_checkpoint
from rbtool.progress import Progress, start_phase


@dataclass
class Criteria:
    """What a kept trajectory must satisfy; None (or empty) means no condition.

    A trajectory's versions are the values of its `versions` field: it is within
    [min_version, max_version] when all of them are, and its staleness is the newest
    version in the whole checkpoint minus its oldest. `last` applies after the others.
    """

    model_weights_ids: Sequence[str] = ()
    min_version: float | None = None
    max_version: float | None = None
    max_staleness: float | None = None
    min_id: int | None = None
    max_id: int | None = None
    last: int | None = None
    min_samples: int | None = None

    def needs_versions(self) -> bool:
        return any(v is not None for v in (self.min_version, self.max_version, self.max_staleness))

    def check(self) -> None:
        for name in ("last", "min_samples", "max_staleness"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise UsageError(f"{name} must be >= 0, got {value}")
        if self.min_id is not None and self.max_id is not None and self.min_id > self.max_id:
            raise UsageError(f"min_id {self.min_id} is above max_id {self.max_id}")
        if (
            self.min_version is not None
            and self.max_version is not None
            and self.min_version > self.max_version
        ):
            raise UsageError(f"min_version {self.min_version} is above max_version {self.max_version}")


@dataclass
class FilterResult:
    """Which ids were kept and dropped (in list order), and what writing did."""

    view: CheckpointView
    index: Index
    dropped: list[int]
    versions: dict[int, tuple[float, float]] | None
    dry_run: bool
    report: WriteReport = field(default_factory=WriteReport)


def trajectory_versions(path: Path, trajectory_id: int) -> tuple[float, float]:
    """(oldest, newest) value of a trajectory file's `versions` field."""
    import torch

    traj = trajfile.load(path, mmap=True)
    versions = traj.get("versions")
    if not isinstance(versions, torch.Tensor) or versions.numel() == 0:
        raise CheckpointError(
            f"{path}: trajectory {trajectory_id} has no versions field; version criteria need one"
        )
    values = versions.detach().to(torch.float64)
    return float(values.min()), float(values.max())


def select(
    view: CheckpointView, criteria: Criteria, progress: Progress | None = None
) -> tuple[list[int], dict[int, tuple[float, float]] | None]:
    """The ids of the view that match, in list order, and each trajectory's versions when read."""
    criteria.check()
    index = view.index
    wanted = set(criteria.model_weights_ids)
    kept = []
    for tid in index.id_list:
        entry = index.entries[tid]
        if wanted and entry["model_weights_id"] not in wanted:
            continue
        if criteria.min_id is not None and tid < criteria.min_id:
            continue
        if criteria.max_id is not None and tid > criteria.max_id:
            continue
        if criteria.min_samples is not None and entry["num_samples"] < criteria.min_samples:
            continue
        kept.append(tid)
    versions = None
    if criteria.needs_versions():
        versions = {}
        # staleness is relative to the newest version anywhere in the checkpoint
        read = index.id_list if criteria.max_staleness is not None else kept
        start_phase(progress, len(read), "reading versions")
        for tid in read:
            versions[tid] = trajectory_versions(view.file_of(tid), tid)
            if progress is not None:
                progress(1)
        newest = max((hi for _, hi in versions.values()), default=0.0)

        def matches(tid: int) -> bool:
            lo, hi = versions[tid]
            if criteria.min_version is not None and lo < criteria.min_version:
                return False
            if criteria.max_version is not None and hi > criteria.max_version:
                return False
            return criteria.max_staleness is None or newest - lo <= criteria.max_staleness

        kept = [tid for tid in kept if matches(tid)]
    if criteria.last is not None:
        kept = kept[len(kept) - criteria.last :] if criteria.last else []
    return kept, versions


def filter_checkpoint(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    criteria: Criteria,
    *,
    strict: bool = True,
    dry_run: bool = False,
    overwrite: bool = False,
    progress: Progress | None = None,
    link: bool = True,
) -> FilterResult:
    """Write a checkpoint of the trajectories of `source` that match `criteria` (nothing with `dry_run`).

    The output keeps the source's ids (a rank tree's merged ids, with their mapping in
    `merge_map.json` when they were renumbered), seed, format and counter. With `link` False
    no file is a hard link of the source's (a reflink or a copy).
    """
    view = open_view(source, strict=strict)
    kept, versions = select(view, criteria, progress)
    index = copied_entries(view.index.subset(kept))
    index.extra_metadata.pop("shard", None)
    keep = set(kept)
    dropped = [i for i in view.index.id_list if i not in keep]
    result = FilterResult(view, index, dropped, versions, dry_run)
    merge_map = None if dry_run else view.merge_map()  # a dry run writes no map
    kept_map = {i: m for i, m in merge_map.items() if i in keep} if merge_map else None
    result.report = write_checkpoint(
        Path(out),
        index,
        view.file_of,
        Rules(overwrite, progress, link, dry_run),
        renumbered=kept_map or None,
    )
    return result


def describe_criteria(criteria: Criteria) -> dict[str, Any]:
    """The criteria as a JSON-ready dict (unset ones null)."""
    return {
        "model_weights_id": list(criteria.model_weights_ids),
        "min_version": criteria.min_version,
        "max_version": criteria.max_version,
        "max_staleness": criteria.max_staleness,
        "min_id": criteria.min_id,
        "max_id": criteria.max_id,
        "last": criteria.last,
        "min_samples": criteria.min_samples,
    }


__all__ = [
    "Criteria",
    "FilterResult",
    "describe_criteria",
    "filter_checkpoint",
    "select",
    "trajectory_versions",
]
