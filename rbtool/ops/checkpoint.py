"""Checkpoint directories: write, save from an auto-save directory, build, load, shard, merge.

Every function here publishes its output whole (staging directory, then rename) and never
modifies its inputs. Trajectory files are reflinked (copy-on-write) where the file system
can, else hard-linked (the entry records the link's identity), else copied, and rewritten
only when the target format differs from the source's. `link=False` makes no hard link.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rbtool.errors import UsageError
from rbtool.files.dirs import CheckpointView, open_view, shard_counter, warn_layout
from rbtool.files.index import DEFAULT_SEED, Index, window_of

# Re-exported: the writer side and the sources moved to their own modules.
from rbtool.files.sources import Checked as Checked
from rbtool.files.sources import Item as Item
from rbtool.files.sources import check_item as check_item
from rbtool.files.sources import collect_items as collect_items
from rbtool.files.writer import (
    Progress,
    Rules,
    Source,
    WriteReport,
    check_split,
    fill_dir,
    new_entry,
    record_schema,
    split_ranks,
    start_phase,
    write_checkpoint,
    write_ranks,
)
from rbtool.files.writer import copied_entries as copied_entries
from rbtool.files.writer import place_trajectory as place_trajectory
from rbtool.format import FORMATS, INDEX_FILE, MERGE_MAP_FILE, METADATA_FILE, trajectory_file_name


# ------------------------------------------------------------------ save / build
def save_from_autosave_dir(
    directory: str | os.PathLike[str],
    out: str | os.PathLike[str],
    window: int,
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
    link: bool = True,
    dry_run: bool = False,
) -> tuple[Index, WriteReport]:
    """What a buffer with auto_save on over `directory` (or a rank tree's merge) saves: its window."""
    view = open_view(directory, strict=True)
    index = view.index
    sub = copied_entries(index.subset(window_of(index.id_list, window)))
    sub.extra_metadata.pop("shard", None)
    report = write_checkpoint(Path(out), sub, view.file_of, Rules(overwrite, progress, link, dry_run))
    return sub, report


def build_from_files(
    sources: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    window: int,
    *,
    trajectory_format: str = "pt",
    seed: int | None = DEFAULT_SEED,
    overwrite: bool = False,
    progress: Progress | None = None,
    link: bool | None = None,
    dry_run: bool = False,
) -> tuple[Index, WriteReport]:
    """What a buffer with auto_save off saves after adding the sources' trajectories in order.

    Ids are 0..n-1 in source order, the counter is n, and only the last `window`
    trajectories (all when 0) are written and counted. Files are placed as `ingest` places
    them: by default a checkpoint's files may be hard-linked and loose files are copied
    (whoever wrote them may write them again in place); `link` True links loose files too,
    False links nothing.
    """
    if trajectory_format not in FORMATS:
        raise UsageError(f"format must be 'pt' or 'pkl', got {trajectory_format!r}")
    items = collect_items(sources)
    if window < 0:
        raise UsageError(f"window must be >= 0, got {window}")
    full = Index(seed=seed, trajectory_format=trajectory_format)
    paths: dict[int, Path] = {}
    from_checkpoint: set[int] = set()  # ids whose source is a checkpoint's file
    kept = set(window_of(list(range(len(items))), window))
    start_phase(progress, len(items), "reading trajectory files")
    phases = progress if hasattr(progress, "start") else None  # a plain callback counts files placed
    for tid, item in enumerate(items):
        checked = check_item(item)
        if phases is not None:
            phases(1)
        full.entries[tid] = new_entry(tid, checked.info, uuid.uuid4().hex)
        record_schema(full, full.entries[tid], checked.schema, checked.schema_digest)
        if checked.sha256 and item.path.suffix == f".{trajectory_format}" and tid in kept:
            full.entries[tid]["sha256"] = checked.sha256
            full.entries[tid]["file_bytes"] = item.path.stat().st_size
        full.id_list.append(tid)
        paths[tid] = item.path
        if item.entry is not None:
            from_checkpoint.add(tid)
    full.trajectory_counter = len(items)
    sub = full.subset(window_of(full.id_list, window))
    placed = from_checkpoint.__contains__ if link is None else link
    report = write_checkpoint(Path(out), sub, paths.__getitem__, Rules(overwrite, progress, placed, dry_run))
    return sub, report


# ------------------------------------------------------------------------- load
def load_state(
    path: str | os.PathLike[str],
    *,
    world_size: int | None = None,
    rank: int | None = None,
    strict: bool = True,
) -> tuple[Index, list[int]]:
    """The index a full or distributed load yields, and the ids dropped for missing files.

    A rank tree loads as the merge of its ranks. A rank directory loaded over a world size
    other than the one it was written for gives a RankLayoutWarning.
    """
    view = open_load_view(path, world_size=world_size, rank=rank, strict=strict)
    index = view.index
    if world_size is not None and rank is not None:
        index = index.rank_block(world_size, rank)
    return index, view.dropped_ids()


def open_load_view(
    path: str | os.PathLike[str],
    *,
    world_size: int | None = None,
    rank: int | None = None,
    strict: bool = True,
) -> CheckpointView:
    """The view a (full or distributed) load reads, after checking the rank arguments."""
    if (world_size is None) != (rank is None):
        raise UsageError("give both world_size and rank, or neither")
    if world_size is not None and rank is not None:
        Index().rank_block(world_size, rank)  # validate before reading anything
    view = open_view(path, strict=strict)
    warn_layout(view, world_size, rank)
    return view


def restore(
    ckpt: str | os.PathLike[str],
    buffer_dir: str | os.PathLike[str],
    *,
    world_size: int | None = None,
    rank: int | None = None,
    strict: bool = True,
    overwrite: bool = False,
    progress: Progress | None = None,
    link: bool = True,
    dry_run: bool = False,
) -> tuple[Index, WriteReport]:
    """Restore a (full or per-rank) load of `ckpt` as a buffer directory, so ingest continues its ids."""
    view = open_load_view(ckpt, world_size=world_size, rank=rank, strict=strict)
    index = view.index
    if world_size is not None and rank is not None:
        index = index.rank_block(world_size, rank)
    out = copied_entries(index)
    out.extra_metadata.pop("shard", None)
    report = write_checkpoint(Path(buffer_dir), out, view.file_of, Rules(overwrite, progress, link, dry_run))
    return out, report


# ------------------------------------------------------------------ shard / merge
def shard(
    ckpt: str | os.PathLike[str],
    world_size: int,
    out: str | os.PathLike[str],
    *,
    strict: bool = True,
    overwrite: bool = False,
    progress: Progress | None = None,
    link: bool = True,
    dry_run: bool = False,
) -> tuple[list[Index], WriteReport]:
    """Write `out/rank_r` for each rank: exactly what a distributed load by rank r yields.

    reshard's count split: a rank tree given as `ckpt` is read merged, and when its ids were
    renumbered each rank directory records its part of the mapping in `merge_map.json`.
    """
    check_split(world_size)
    view = open_view(ckpt, strict=strict)
    shards = split_ranks(view.index, world_size, "count", len(view.dirs))
    report = write_ranks(Path(out), shards, view, Rules(overwrite, progress, link, dry_run))
    return shards, report


@dataclass
class MergeResult:
    index: Index
    renumbered: bool
    mapping: list[dict[str, Any]] = field(default_factory=list)
    report: WriteReport = field(default_factory=WriteReport)


def merge(
    dirs: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    strict: bool = True,
    trajectory_format: str | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
    link: bool = True,
    dry_run: bool = False,
) -> MergeResult:
    """Merge checkpoints into one (SPEC §4).

    Unique ids are kept and the lists concatenated in input order; colliding ids are
    renumbered from 0 by (original id, input order) and the mapping is written to
    `merge_map.json` beside the index.
    """
    if not dirs:
        raise UsageError("nothing to merge")
    view = open_view(dirs, strict=strict)
    fmt = trajectory_format or view.index.trajectory_format
    if fmt not in FORMATS:
        raise UsageError(f"format must be 'pt' or 'pkl', got {fmt!r}")
    merged = copied_entries(view.index)
    merged.trajectory_format = fmt
    merged.extra_metadata = {}
    renumber = view.renumbered
    if not renumber:  # the counter a sharded source had, so ids keep continuing from it
        merged.trajectory_counter = max(merged.trajectory_counter, *map(shard_counter, view.indexes))
    result = MergeResult(merged, renumber, view.mapping())
    result.report = write_checkpoint(
        Path(out),
        merged,
        view.file_of,
        Rules(overwrite, progress, link, dry_run),
        renumbered=view.merge_map() if renumber and not dry_run else None,
    )
    return result


__all__ = [
    "INDEX_FILE",
    "METADATA_FILE",
    "MERGE_MAP_FILE",
    "MergeResult",
    "WriteReport",
    "Checked",
    "Item",
    "Progress",
    "Source",
    "build_from_files",
    "check_item",
    "copied_entries",
    "fill_dir",
    "new_entry",
    "place_trajectory",
    "collect_items",
    "load_state",
    "merge",
    "restore",
    "save_from_autosave_dir",
    "shard",
    "trajectory_file_name",
    "write_checkpoint",
]
