"""Convert: rewrite a checkpoint (or every rank of a rank tree) with its files in another format.

Streaming: each file is read, re-serialised and written on its own, so only the
trajectories in flight (about two per worker process) are in memory. Files already in the target format
are placed as every writer places them (reflink, else hard link, else copy; no hard link
with `link=False`). A rank tree keeps its layout: OUT/rank_<r> for each rank, ids and
metadata kept.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rbtool.dirs import checkpoint_dirs, open_checkpoint
from rbtool.errors import UsageError
from rbtool.format import FORMATS, MERGE_MAP_FILE
from rbtool.fsutil import check_target, link_or_copy, staged_dir
from rbtool.index import Index, write_index
from rbtool.passes import Throughput, Timer, check_jobs, default_jobs, run_pass
from rbtool.writer import Progress, WriteReport, copied_entries, place_trajectory, start_phase


@dataclass
class ConvertResult:
    """Each written checkpoint (its path relative to OUT, "." for one) and what writing did."""

    source: Path
    trajectory_format: str
    checkpoints: list[tuple[str, Index]]
    jobs: int
    report: WriteReport = field(default_factory=WriteReport)
    throughput: Throughput = field(default_factory=lambda: Throughput(1))  # the files read to rewrite


@dataclass(frozen=True)
class _Task:
    """One file to place (it pickles: it is sent to a worker process)."""

    src: Path
    dst: Path
    entry: dict[str, Any]
    link: bool

    def __str__(self) -> str:
        return str(self.src)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _place(task: _Task) -> tuple[WriteReport, dict[str, Any], int]:
    """Place one file (on a worker process): what was done, its updated entry, the bytes read."""
    report = WriteReport()
    entry = dict(task.entry)
    place_trajectory(task.src, task.dst, entry, report, link=task.link)
    return report, entry, _size(task.src) if report.written else 0


def convert(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    trajectory_format: str,
    *,
    jobs: int | None = None,
    strict: bool = True,
    overwrite: bool = False,
    progress: Progress | None = None,
    link: bool = True,
    dry_run: bool = False,
) -> ConvertResult:
    """Write `out` holding `source`'s trajectories in `trajectory_format`, on `jobs` worker processes.

    Files to rewrite are read once each, the largest first (default jobs: the cores this
    process may use); files already in the format are placed without being read. With
    `dry_run` nothing is read or written: the result lists the checkpoints `out` would hold.
    """
    if trajectory_format not in FORMATS:
        raise UsageError(f"format must be 'pt' or 'pkl', got {trajectory_format!r}")
    workers = check_jobs(jobs)
    root = Path(source)
    dirs = checkpoint_dirs(root)
    opened = [open_checkpoint(d, strict=strict) for d in dirs]
    tree = dirs != [root]
    result = ConvertResult(root, trajectory_format, [], workers)
    if dry_run:
        check_target(Path(out), overwrite=overwrite)
        for directory, index in opened:
            converted = copied_entries(index)
            converted.trajectory_format = trajectory_format
            result.checkpoints.append((directory.name if tree else ".", converted))
        return result
    with staged_dir(Path(out), overwrite=overwrite) as staging:
        tasks: list[_Task] = []
        targets: list[tuple[Path, Index]] = []
        for directory, index in opened:
            rel = directory.name if tree else "."
            target = staging / rel
            target.mkdir(exist_ok=True)
            converted = copied_entries(index)
            converted.trajectory_format = trajectory_format
            for tid in index.id_list:
                dst = target / converted.file_name(tid)
                tasks.append(_Task(directory / index.file_name(tid), dst, converted.entries[tid], link))
            targets.append((target, converted))
            result.checkpoints.append((rel, converted))

        timer = Timer()
        start_phase(progress, len(tasks), "rewriting trajectory files")
        placed = run_pass(
            _place,
            tasks,
            jobs=workers,
            # only rewritten files are read: they weigh, linked ones hardly
            weights=[_size(t.src) if t.src.suffix != t.dst.suffix else 0 for t in tasks],
            progress=progress,
            preload=("torch", "rbtool.conversion"),
        )
        result.throughput = Throughput(workers, sum(n for _, _, n in placed), timer.elapsed())
        for task, (report, entry, _) in zip(tasks, placed, strict=True):
            result.report.add(report)
            task.entry.clear()
            task.entry.update(entry)  # the converted index's own entry
        for (directory, _), (target, converted) in zip(opened, targets, strict=True):
            if (directory / MERGE_MAP_FILE).is_file():
                link_or_copy(directory / MERGE_MAP_FILE, target / MERGE_MAP_FILE, link=link)
            write_index(target, converted)
    return result


__all__ = ["ConvertResult", "convert", "default_jobs"]
