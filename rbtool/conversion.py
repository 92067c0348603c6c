"""Convert: rewrite a checkpoint (or every rank of a rank tree) with its files in another format.

Streaming: each file is read, re-serialised and written on its own, so only the
trajectories in flight (one per worker) are in memory. Files already in the target format
are placed as every writer places them (reflink, else hard link, else copy; no hard link
with `link=False`). A rank tree keeps its layout: OUT/rank_<r> for each rank, ids and
metadata kept.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from rbtool.dirs import checkpoint_dirs, open_checkpoint
from rbtool.errors import UsageError
from rbtool.format import FORMATS, MERGE_MAP_FILE
from rbtool.fsutil import link_or_copy, staged_dir
from rbtool.index import Index, write_index
from rbtool.writer import Progress, WriteReport, copied_entries, place_trajectory


@dataclass
class ConvertResult:
    """Each written checkpoint (its path relative to OUT, "." for one) and what writing did."""

    source: Path
    trajectory_format: str
    checkpoints: list[tuple[str, Index]]
    jobs: int
    report: WriteReport = field(default_factory=WriteReport)


def default_jobs() -> int:
    """One worker per available core."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on every platform
        return max(1, os.cpu_count() or 1)


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
) -> ConvertResult:
    """Write `out` holding `source`'s trajectories in `trajectory_format`, on `jobs` threads."""
    if trajectory_format not in FORMATS:
        raise UsageError(f"format must be 'pt' or 'pkl', got {trajectory_format!r}")
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise UsageError(f"jobs must be an integer >= 1, got {jobs!r}")
    workers = jobs or default_jobs()
    root = Path(source)
    dirs = checkpoint_dirs(root)
    opened = [open_checkpoint(d, strict=strict) for d in dirs]
    tree = dirs != [root]
    result = ConvertResult(root, trajectory_format, [], workers)
    with staged_dir(Path(out), overwrite=overwrite) as staging:
        tasks: list[tuple[Path, Path, dict[str, object]]] = []
        targets: list[tuple[Path, Index]] = []
        for directory, index in opened:
            rel = directory.name if tree else "."
            target = staging / rel
            target.mkdir(exist_ok=True)
            converted = copied_entries(index)
            converted.trajectory_format = trajectory_format
            for tid in index.id_list:
                dst = target / converted.file_name(tid)
                tasks.append((directory / index.file_name(tid), dst, converted.entries[tid]))
            targets.append((target, converted))
            result.checkpoints.append((rel, converted))

        def one(task: tuple[Path, Path, dict[str, object]]) -> WriteReport:
            report = WriteReport()
            place_trajectory(task[0], task[1], task[2], report, link=link)
            return report

        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rbtool-convert") as pool:
            for report in pool.map(one, tasks):
                result.report.add(report)
                if progress is not None:
                    progress(1)
        for (directory, _), (target, converted) in zip(opened, targets, strict=True):
            if (directory / MERGE_MAP_FILE).is_file():
                link_or_copy(directory / MERGE_MAP_FILE, target / MERGE_MAP_FILE, link=link)
            write_index(target, converted)
    return result


__all__ = ["ConvertResult", "convert", "default_jobs"]
