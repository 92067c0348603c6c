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

from rbtool.files.dirs import CheckpointView, open_view
from rbtool.files.fsutil import file_size
from rbtool.files.index import Index
from rbtool.files.writer import (
    SPLITS,
    Rules,
    WriteReport,
    check_split,
    split_blocks,
    split_ranks,
    write_ranks,
)
from rbtool.progress import Progress


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


def plan(
    source: str | os.PathLike[str], world_size: int, *, split: str = "count", strict: bool = True
) -> tuple[CheckpointView, list[Index]]:
    """The source's view and each output rank's index (with its layout in `shard`)."""
    check_split(world_size, split)
    view = open_view(source, strict=strict)
    return view, split_ranks(view.index, world_size, split, len(view.dirs))


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
    ranks = [RankPlan(r, p, sum(file_size(view.file_of(i)) for i in p.id_list)) for r, p in enumerate(parts)]
    result = ReshardResult(view, world_size, split, ranks, dry_run)
    result.report = write_ranks(Path(out), parts, view, Rules(overwrite, progress, link, dry_run))
    return result


__all__ = ["SPLITS", "RankPlan", "ReshardResult", "plan", "reshard", "split_blocks"]
