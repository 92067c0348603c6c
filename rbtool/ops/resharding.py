"""Reshard: M rank directories (or one checkpoint) to N, in one step.

The source is read as the merge of its ranks (SPEC §4) and cut into N contiguous blocks in
list order: by count, exactly as a distributed load cuts it (SPEC §3), or balancing total
samples. Files are linked, never rewritten; each rank records the layout it was written for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rbtool.errors import UsageError
from rbtool.files.dirs import CheckpointView, open_view
from rbtool.files.fsutil import check_target, staged_dir, write_bytes_atomic
from rbtool.files.index import Index, balanced_blocks, dumps, rank_bounds
from rbtool.files.writer import WriteReport, fill_dir, rank_layout, rank_parts, start_phase
from rbtool.format import MERGE_MAP_FILE
from rbtool.format.ranknames import rank_dir_name
from rbtool.progress import Progress

SPLITS = ("count", "samples")


@dataclass
class RankPlan:
    """What one output rank holds."""

    rank: int
    index: Index
    bytes: int

    def as_json(self) -> dict[str, Any]:
        return {"rank": self.rank, **self.index.state(), "bytes": self.bytes}


@dataclass
class ReshardResult:
    """The plan, and what writing it did (nothing when it was a dry run)."""

    view: CheckpointView
    world_size: int
    split: str
    ranks: list[RankPlan]
    dry_run: bool
    report: WriteReport = field(default_factory=WriteReport)


def split_blocks(index: Index, world_size: int, split: str = "count") -> list[tuple[int, int]]:
    """[start, end) of each rank's block of the list: by count (a distributed load's) or by samples."""
    if split not in SPLITS:
        raise UsageError(f"split must be 'count' or 'samples', got {split!r}")
    if split == "count":
        return [rank_bounds(index.size, world_size, r) for r in range(world_size)]
    entries = index.entries
    return balanced_blocks([entries[i]["num_samples"] for i in index.id_list], world_size)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def plan(
    source: str | os.PathLike[str], world_size: int, *, split: str = "count", strict: bool = True
) -> tuple[CheckpointView, list[Index]]:
    """The source's view and each output rank's index (with its layout in `shard`)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"world_size must be an integer >= 1, got {world_size!r}")
    if split not in SPLITS:
        raise UsageError(f"split must be 'count' or 'samples', got {split!r}")
    view = open_view(source, strict=strict)
    parts = rank_parts(view.index, split_blocks(view.index, world_size, split))
    for rank, part in enumerate(parts):
        part.extra_metadata = {"shard": rank_layout(rank, world_size, split, view.index, len(view.dirs))}
    return view, parts


def reshard(
    source: str | os.PathLike[str],
    world_size: int,
    out: str | os.PathLike[str],
    *,
    split: str = "count",
    strict: bool = True,
    dry_run: bool = False,
    overwrite: bool = False,
    progress: Progress | None = None,
    link: bool = True,
) -> ReshardResult:
    """Write `out/rank_0 .. rank_{N-1}` from a checkpoint or rank tree; with `dry_run`, only plan.

    When the source's ranks had colliding ids they are renumbered (SPEC §4) and each rank
    directory records its part of the mapping in `merge_map.json`. With `link` False no
    file is a hard link of the source's (a reflink or a copy).
    """
    view, parts = plan(source, world_size, split=split, strict=strict)
    ranks = [RankPlan(r, p, sum(_size(view.file_of(i)) for i in p.id_list)) for r, p in enumerate(parts)]
    result = ReshardResult(view, world_size, split, ranks, dry_run)
    if dry_run:
        check_target(Path(out), overwrite=overwrite)  # fails where publishing would
        return result
    mapping = {m["new_id"]: m for m in view.mapping()}
    start_phase(progress, sum(part.size for part in parts), "placing trajectory files")
    with staged_dir(Path(out), overwrite=overwrite) as staging:
        for rank, part in enumerate(parts):
            rank_dir = staging / rank_dir_name(rank)
            rank_dir.mkdir()
            result.report.add(fill_dir(rank_dir, part, view.file_of, progress, link=link))
            if mapping:
                renumbered = [mapping[i] for i in part.id_list]
                write_bytes_atomic(rank_dir / MERGE_MAP_FILE, dumps({"renumbered": renumbered}))
    return result


__all__ = ["SPLITS", "RankPlan", "ReshardResult", "plan", "reshard", "split_blocks"]
