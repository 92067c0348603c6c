"""Convert: rewrite a checkpoint (or every rank of a rank tree) with its files in another format.

Streaming: each file is read, re-serialised and written on its own, so only the
trajectories in flight (about two per worker process) are in memory. Files already in the target format
are placed as every writer places them (reflink, else hard link, else copy; no hard link
with `link=False`). A rank tree keeps its layout: OUT/rank_<r> for each rank, ids and
metadata kept.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rbtool.errors import UsageError
from rbtool.files.dirs import checkpoint_dirs, open_checkpoint
from rbtool.files.fsutil import check_target, fs_errors, link_or_copy, publish_dir, staged_dir
from rbtool.files.index import Index, write_index
from rbtool.files.writer import WriteReport, copied_entries, place_trajectory
from rbtool.format import FORMATS, MERGE_MAP_FILE
from rbtool.passes import ranks
from rbtool.passes.journal import Journal, open_journal
from rbtool.passes.pool import Throughput, Timer, check_jobs, default_jobs
from rbtool.progress import Progress, start_phase


@dataclass
class ConvertResult:
    """Each written checkpoint (its path relative to OUT, "." for one) and what writing did."""

    source: Path
    trajectory_format: str
    checkpoints: list[tuple[str, Index]]
    jobs: int
    report: WriteReport = field(default_factory=WriteReport)
    throughput: Throughput = field(default_factory=lambda: Throughput(1))  # the files read to rewrite
    journal: dict[str, int] | None = None  # a resumable pass: files placed, and those from the journal


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


def _recorded_sha256(entry: dict[str, Any]) -> str | None:
    recorded = entry.get("sha256")
    return recorded if isinstance(recorded, str) else None


def _place_again(task: _Task) -> tuple[WriteReport, dict[str, Any], int]:
    """`_place` over whatever an interrupted run left at the destination (a resumed pass redoes it)."""
    task.dst.unlink(missing_ok=True)
    return _place(task)


def resume_dirs(out: Path, journal: Path | None) -> tuple[Path, Path]:
    """Where a resumable convert builds `out` (a fixed hidden directory beside it) and journals."""
    staging = out.parent / f".{out.name}{RESUME_STAGING}"
    return staging, journal if journal is not None else out.parent / f".{out.name}{RESUME_JOURNAL}"


RESUME_STAGING = ".rbtool-resume-staging"
RESUME_JOURNAL = ".rbtool-resume-journal"


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
    journal: str | os.PathLike[str] | None = None,
    dry_run: bool = False,
) -> ConvertResult:
    """Write `out` holding `source`'s trajectories in `trajectory_format`, on `jobs` worker processes.

    Files to rewrite are read once each, the largest first (default jobs: the cores this
    process may use); files already in the format are placed without being read. With
    `dry_run` nothing is read or written (no journal either): the result lists the
    checkpoints `out` would hold.

    Under torchrun, or with `journal` (a directory), the pass is resumable (rbtool.passes.ranks):
    every rank places its share of the files in a fixed hidden directory beside `out`,
    journaling each (in `journal`, default another hidden directory beside `out`); rank 0
    writes the index and metadata and publishes `out` once every rank is done, then removes
    the default journal. A run that fails leaves both for the next run to resume from;
    `out` itself is never half-written.
    """
    if trajectory_format not in FORMATS:
        raise UsageError(f"format must be 'pt' or 'pkl', got {trajectory_format!r}")
    if jobs is not None:
        check_jobs(jobs)
    root = Path(source)
    dirs = checkpoint_dirs(root)
    opened = [open_checkpoint(d, strict=strict) for d in dirs]
    tree = dirs != [root]
    world = ranks.current()
    result = ConvertResult(root, trajectory_format, [], ranks.total_jobs(jobs))
    target = Path(out)
    if dry_run:
        check_target(target, overwrite=overwrite)
        for directory, index in opened:
            converted = copied_entries(index)
            converted.trajectory_format = trajectory_format
            result.checkpoints.append((directory.name if tree else ".", converted))
        return result
    if world.size > 1 or journal is not None:
        check_target(target, overwrite=overwrite)  # refused before any file is placed, as publishing would
        staging, journal_dir = resume_dirs(target, None if journal is None else Path(journal))
        identity = {
            "command": "convert",
            "input": str(root.absolute()),
            "out": str(target.absolute()),
            "format": trajectory_format,
            "link": link,
        }
        ranks.on_leader(world, lambda: _make_dir(staging))
        resumed = open_journal(journal_dir, identity)
        _convert_into(staging, opened, tree, result, progress, jobs, link, resumed, world)
        result.journal = None if resumed is None else resumed.counts()

        def publish() -> None:
            publish_dir(staging, target, overwrite=overwrite)
            if journal is None:
                shutil.rmtree(journal_dir, ignore_errors=True)

        ranks.on_leader(world, publish)
        return result
    with staged_dir(target, overwrite=overwrite) as staging:
        _convert_into(staging, opened, tree, result, progress, jobs, link, None, world)
    return result


def _make_dir(path: Path) -> None:
    with fs_errors(path):
        path.mkdir(parents=True, exist_ok=True)


def _convert_into(
    staging: Path,
    opened: list[tuple[Path, Index]],
    tree: bool,
    result: ConvertResult,
    progress: Progress | None,
    jobs: int | None,
    link: bool,
    journal: Journal | None,
    world: ranks.World,
) -> None:
    """Place every file of `opened` under `staging` (this rank's share), then (rank 0) the JSON files."""
    trajectory_format = result.trajectory_format
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
    placed = ranks.ranked_pass(
        _place if journal is None else _place_again,
        tasks,
        jobs=jobs,
        # only rewritten files are read: they weigh, linked ones hardly
        weights=[_size(t.src) if t.src.suffix != t.dst.suffix else 0 for t in tasks],
        progress=progress,
        preload=("torch", "rbtool.ops.conversion"),
        journal=journal,
        files=lambda t: (t.src, t.dst),
        types=(WriteReport,),
        hashes=lambda t: (_recorded_sha256(t.entry), None),
    )
    result.throughput = Throughput(result.jobs, sum(n for _, _, n in placed), timer.elapsed())
    for task, (report, entry, _) in zip(tasks, placed, strict=True):
        result.report.add(report)
        task.entry.clear()
        task.entry.update(entry)  # the converted index's own entry
    if not world.leader:
        return  # rank 0 writes the JSON files
    for (directory, _), (target, converted) in zip(opened, targets, strict=True):
        if (directory / MERGE_MAP_FILE).is_file():
            link_or_copy(directory / MERGE_MAP_FILE, target / MERGE_MAP_FILE, link=link)
        write_index(target, converted)


__all__ = ["ConvertResult", "convert", "default_jobs"]
