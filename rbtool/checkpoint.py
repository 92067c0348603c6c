"""Checkpoint directories: write, save from an auto-save directory, build, load, shard, merge.

Every function here publishes its output whole (staging directory, then rename) and never
modifies its inputs. Trajectory files are hard-linked when possible, copied otherwise, and
rewritten only when the target format differs from the source's.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rbtool.dirs import checkpoint_dirs, open_checkpoint
from rbtool.errors import UsageError
from rbtool.format import FORMATS, INDEX_FILE, MERGE_MAP_FILE, METADATA_FILE, trajectory_file_name
from rbtool.fsutil import staged_dir, write_bytes_atomic
from rbtool.index import Index, dumps, window_of

# Re-exported: the writer side and the sources moved to their own modules.
from rbtool.sources import Checked as Checked
from rbtool.sources import Item as Item
from rbtool.sources import check_item as check_item
from rbtool.sources import collect_items as collect_items
from rbtool.writer import Progress, Source, WriteReport, fill_dir, new_entry, write_checkpoint
from rbtool.writer import copied_entries as copied_entries
from rbtool.writer import place_trajectory as place_trajectory


# ------------------------------------------------------------------ save / build
def save_from_autosave_dir(
    directory: str | os.PathLike[str],
    out: str | os.PathLike[str],
    window: int,
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> tuple[Index, WriteReport]:
    """What a buffer with auto_save on over `directory` saves: its sampling window."""
    src_dir, index = open_checkpoint(directory, strict=True)
    sub = copied_entries(index.subset(window_of(index.id_list, window)))
    sub.extra_metadata.pop("shard", None)
    report = write_checkpoint(
        Path(out), sub, lambda i: src_dir / index.file_name(i), overwrite=overwrite, progress=progress
    )
    return sub, report


def build_from_files(
    sources: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    window: int,
    *,
    trajectory_format: str = "pt",
    seed: int | None = 1234,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> tuple[Index, WriteReport]:
    """What a buffer with auto_save off saves after adding the sources' trajectories in order.

    Ids are 0..n-1 in source order, the counter is n, and only the last `window`
    trajectories (all when 0) are written and counted.
    """
    if trajectory_format not in FORMATS:
        raise UsageError(f"format must be 'pt' or 'pkl', got {trajectory_format!r}")
    items = collect_items(sources)
    if window < 0:
        raise UsageError(f"window must be >= 0, got {window}")
    full = Index(seed=seed, trajectory_format=trajectory_format)
    paths: dict[int, Path] = {}
    kept = set(window_of(list(range(len(items))), window))
    for tid, item in enumerate(items):
        checked = check_item(item)
        full.entries[tid] = new_entry(tid, checked.info, uuid.uuid4().hex)
        if checked.sha256 and item.path.suffix == f".{trajectory_format}" and tid in kept:
            full.entries[tid]["sha256"] = checked.sha256
            full.entries[tid]["file_bytes"] = item.path.stat().st_size
        full.id_list.append(tid)
        paths[tid] = item.path
    full.trajectory_counter = len(items)
    sub = full.subset(window_of(full.id_list, window))
    report = write_checkpoint(Path(out), sub, paths.__getitem__, overwrite=overwrite, progress=progress)
    return sub, report


# ------------------------------------------------------------------------- load
def load_state(
    path: str | os.PathLike[str],
    *,
    world_size: int | None = None,
    rank: int | None = None,
    strict: bool = True,
) -> tuple[Index, list[int]]:
    """The index a full or distributed load yields, and the ids dropped for missing files."""
    if (world_size is None) != (rank is None):
        raise UsageError("give both world_size and rank, or neither")
    if world_size is not None and rank is not None:
        Index().rank_block(world_size, rank)  # validate before reading anything
    directory = Path(path)
    before = None
    if not strict:
        from rbtool.index import read_index

        before = read_index(directory)
    _, index = open_checkpoint(directory, strict=strict)
    dropped = [] if before is None else [i for i in before.id_list if i not in index.entries]
    if world_size is not None and rank is not None:
        index = index.rank_block(world_size, rank)
    return index, dropped


def restore(
    ckpt: str | os.PathLike[str],
    buffer_dir: str | os.PathLike[str],
    *,
    world_size: int | None = None,
    rank: int | None = None,
    strict: bool = True,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> tuple[Index, WriteReport]:
    """Restore a (full or per-rank) load of `ckpt` as a buffer directory, so ingest continues its ids."""
    src = Path(ckpt)
    index, _ = load_state(src, world_size=world_size, rank=rank, strict=strict)
    from rbtool.index import read_index

    src_index = read_index(src)
    out = copied_entries(index)
    out.extra_metadata.pop("shard", None)
    report = write_checkpoint(
        Path(buffer_dir), out, lambda i: src / src_index.file_name(i), overwrite=overwrite, progress=progress
    )
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
) -> tuple[list[Index], WriteReport]:
    """Write `out/rank_r` for each rank: exactly what a distributed load by rank r yields."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"world_size must be an integer >= 1, got {world_size!r}")
    src_dir, index = open_checkpoint(ckpt, strict=strict)
    report = WriteReport()
    shards: list[Index] = []
    with staged_dir(Path(out), overwrite=overwrite) as staging:
        for rank in range(world_size):
            part = copied_entries(index.rank_block(world_size, rank))
            part.extra_metadata["shard"] = {
                "rank": rank,
                "world_size": world_size,
                "source_trajectory_counter": index.trajectory_counter,
            }
            rank_dir = staging / f"rank_{rank}"
            rank_dir.mkdir()
            report.add(fill_dir(rank_dir, part, lambda i: src_dir / index.file_name(i), progress))
            shards.append(part)
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
) -> MergeResult:
    """Merge checkpoints into one (SPEC §4).

    Unique ids are kept and the lists concatenated in input order; colliding ids are
    renumbered from 0 by (original id, input order) and the mapping is written to
    `merge_map.json` beside the index.
    """
    inputs = [open_checkpoint(p, strict=strict) for d in dirs for p in checkpoint_dirs(d)]
    if not inputs:
        raise UsageError("nothing to merge")
    fmt = trajectory_format or inputs[0][1].trajectory_format
    if fmt not in FORMATS:
        raise UsageError(f"format must be 'pt' or 'pkl', got {fmt!r}")
    all_ids = [i for _, idx in inputs for i in idx.id_list]
    renumber = len(set(all_ids)) != len(all_ids)
    merged = Index(seed=inputs[0][1].seed, trajectory_format=fmt)
    sources: dict[int, Path] = {}
    mapping: list[dict[str, Any]] = []
    if renumber:
        order = sorted(((i, n) for n, (_, idx) in enumerate(inputs) for i in idx.id_list))
        for new_id, (old_id, n) in enumerate(order):
            src_dir, idx = inputs[n]
            entry = dict(idx.entries[old_id])
            entry["trajectory_id"] = new_id
            merged.entries[new_id] = entry
            merged.id_list.append(new_id)
            sources[new_id] = src_dir / idx.file_name(old_id)
            mapping.append({"input": str(src_dir), "old_id": old_id, "new_id": new_id})
        merged.trajectory_counter = len(order)
    else:
        counter = 0
        for src_dir, idx in inputs:
            for i in idx.id_list:
                merged.entries[i] = dict(idx.entries[i])
                merged.id_list.append(i)
                sources[i] = src_dir / idx.file_name(i)
            shard_info = idx.extra_metadata.get("shard")
            source_counter = (
                shard_info.get("source_trajectory_counter", 0) if isinstance(shard_info, dict) else 0
            )
            counter = max(
                counter, idx.trajectory_counter, source_counter if isinstance(source_counter, int) else 0
            )
        merged.trajectory_counter = max(counter, merged.next_counter())
    result = MergeResult(merged, renumber, mapping)
    with staged_dir(Path(out), overwrite=overwrite) as staging:
        result.report = fill_dir(staging, merged, sources.__getitem__, progress)
        if renumber:
            write_bytes_atomic(staging / MERGE_MAP_FILE, dumps({"renumbered": mapping}))
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
