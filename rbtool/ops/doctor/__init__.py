"""Check what is in the trajectories, not only that the files are whole (`rbtool doctor`).

`verify --deep` proves a checkpoint whole; doctor reads the same files once more, on the same
pass machinery (workers, torchrun ranks, journals, rank trees), and looks at the data: NaN,
frozen actions, blank cameras, done flags, observation pairing, policy identity and staleness,
duplicates, rewards, episodes and the index's agreement with the files. docs/cli.md gives
each check's exact rule.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rbtool.errors import RbtoolError, UsageError
from rbtool.files.dirs import checkpoint_dirs, missing_files
from rbtool.files.index import read_index
from rbtool.format import one_line
from rbtool.ops.doctor.batch import Segment, SegmentResult, check_segment, cut_segments, segment_files
from rbtool.ops.doctor.findings import (
    CHECKS,
    ERROR,
    INFO,
    LEVELS,
    WARNING,
    Finding,
    Report,
    runs,
    select_checks,
)
from rbtool.ops.doctor.trajectory import Options, Result, Traits, weights_id_of
from rbtool.passes.journal import open_journal
from rbtool.passes.pool import CHUNKS_PER_WORKER, Timer, check_jobs, streaming
from rbtool.passes.ranks import ranked_pass, total_jobs
from rbtool.progress import Progress, start_phase


def _listed(directory: Path, report: Report) -> list[tuple[str, int, dict[str, Any] | None]]:
    """(file name, id, entry) of each listed trajectory whose file exists; an unreadable index or
    missing files become findings of the index check."""
    try:
        index = read_index(directory)
        missing = missing_files(directory, index)
    except RbtoolError as exc:
        report.findings.append(
            Finding(
                "index",
                ERROR,
                [],
                f"{directory}: cannot read the index: {one_line(str(exc))}",
                "run `rbtool verify` on the checkpoint and repair it",
                checkpoint=str(directory),
            )
        )
        return []
    if missing:
        report.findings.append(
            Finding(
                "index",
                INFO,
                missing,
                f"{directory}: {len(missing)} listed trajectories have no file (ids {runs(missing)}); "
                "the others were checked",
                "run `rbtool verify` for the whole picture and `rbtool repair` to drop them",
                checkpoint=str(directory),
            )
        )
    gone = set(missing)
    ids = list(dict.fromkeys(i for i in index.id_list if i not in gone))
    entries = [index.entries.get(tid) for tid in ids]
    plain = [None if e is None else {k: e.get(k) for k in _ENTRY_KEYS} for e in entries]
    return list(zip(index.file_names(ids), ids, plain, strict=True))


_ENTRY_KEYS = ("shape", "num_samples", "model_weights_id", "max_episode_length")


def _buffer_checks(
    report: Report, files: list[tuple[Path, int, str]], results: list[Result], options: Options,
    max_staleness: float | None,
) -> None:  # fmt: skip
    """The checks across trajectories: duplicates and staleness (`files`: each result's
    directory, id and file name)."""
    if "duplicates" in options.checks:
        seen: dict[str, tuple[Path, int, str]] = {}
        for file, result in zip(files, results, strict=True):
            fp = result.traits.fingerprint
            if fp is None:
                continue
            first = seen.setdefault(fp, file)
            if first is file:
                continue
            directory, tid, name = file
            where = "" if first[0] == directory else f" in {first[0]}"
            report.findings.append(
                Finding(
                    "duplicates",
                    WARNING,
                    [first[1], tid],
                    f"{name}: its tensors equal those of trajectory {first[1]}{where} byte for byte",
                    "the same rollout was ingested twice: drop one (`rbtool filter`) so it is not sampled "
                    "twice as often",
                    checkpoint=str(directory),
                )
            )
    if "policy" in options.checks and max_staleness is not None:
        newest_of = [(f, r.traits.newest_version) for f, r in zip(files, results, strict=True)]
        known = [v for _, v in newest_of if v is not None]
        if not known:
            return
        newest = max(known)
        for (directory, tid, name), version in newest_of:
            if version is not None and newest - version > max_staleness:
                report.findings.append(
                    Finding(
                        "policy",
                        WARNING,
                        [tid],
                        f"{name}: newest version {version:g} is {newest - version:g} behind the "
                        f"newest in the checkpoint ({newest:g}), more than {max_staleness:g}",
                        "stale data trains an off-policy learner on an old policy: shrink the sampling "
                        "window or drop the old trajectories",
                        field="versions",
                        checkpoint=str(directory),
                    )
                )


def _unread(f: Finding) -> bool:
    """An index or file that could not be read (not an entry disagreement, which names its key)."""
    return f.check == "index" and f.field is None


def _unpaired(report: Report, files: list[tuple[Path, int, str]], results: list[Result]) -> None:
    """One info per checkpoint directory, with every id it holds for, that observations were
    not recorded as transitions (no next_obs equals the following curr_obs)."""
    ids: dict[Path, list[int]] = {}
    for (directory, tid, _), result in zip(files, results, strict=True):
        if result.traits.unpaired:
            ids.setdefault(directory, []).append(tid)
    for directory, held in ids.items():
        n = len(held)
        report.findings.append(
            Finding(
                "pairing",
                INFO,
                held,
                f"{n} trajector{'y' if n == 1 else 'ies'} (ids {runs(held, 10)}): next_obs never equals "
                "the following curr_obs anywhere: the observations were not recorded as transitions, "
                "so their pairing was not checked",
                "nothing to do unless this buffer was filled by RLinf's env worker; then its "
                "transitions are broken",
                field="next_obs",
                checkpoint=str(directory),
            )
        )


def doctor(
    path: str | os.PathLike[str],
    *,
    checks: Iterable[str] | None = None,
    skip: Iterable[str] = (),
    frozen_fields: Iterable[str] = ("actions",),
    reward_range: tuple[float, float] | None = None,
    max_staleness: float | None = None,
    progress: Progress | None = None,
    jobs: int | None = None,
    journal: str | os.PathLike[str] | None = None,
) -> Report:
    """Check the data of a checkpoint, a buffer directory or a folder of rank_* directories.

    `checks` (default: all of CHECKS) less `skip` run; `frozen_fields` are the dotted field
    paths the frozen check looks at; `reward_range` (low, high) turns the rewards check on;
    `max_staleness` (versions) turns the staleness half of the policy check on. The pass runs
    on `jobs` workers, over torchrun ranks when started by torchrun, and with `journal` (a
    directory) a rerun takes the recorded findings of unchanged files.
    """
    chosen = select_checks(checks, skip)
    if reward_range is not None and not reward_range[0] <= reward_range[1]:
        raise UsageError(f"reward range {list(reward_range)}: the low end is above the high end")
    if jobs is not None:
        check_jobs(jobs)
    root = Path(path)
    options = Options(
        chosen,
        tuple(frozen_fields),
        None if reward_range is None else (float(reward_range[0]), float(reward_range[1])),
    )
    opened = open_journal(journal, {"command": "doctor", "input": str(root.absolute())})
    timer = Timer()
    report = Report(root, chosen, jobs=total_jobs(jobs))
    listed: list[tuple[Path, list[tuple[str, int, dict[str, Any] | None]]]] = []
    for directory in checkpoint_dirs(root):
        report.checkpoints.append(str(directory))
        listed.append((directory, _listed(directory, report)))
    report.trajectories = sum(len(files) for _, files in listed)
    start_phase(progress, report.trajectories, "checking trajectory files")
    # consecutive files a task (small files of one layout checked together), one a task when a
    # journal records them or a remote checkpoint's feed fetches them
    single = opened is not None or streaming()
    most = segment_files(report.trajectories, total_jobs(jobs) * CHUNKS_PER_WORKER, single)
    segments = [s for directory, files in listed for s in cut_segments(directory, files, options, most)]
    checked = ranked_pass(
        check_segment,
        segments,
        jobs=jobs,
        progress=progress,
        preload=("numpy", "rbtool.ops.doctor.batch"),  # torch: in a worker, when check_file needs it
        describe=lambda segment: str(segment.directory / segment.names[0]),
        journal=opened,
        files=Segment.paths,
        types=(SegmentResult, Finding, Result, Traits),
        units=lambda segment: len(segment.names),
    )
    results = [result for got in checked for result in got.results]
    files = [(directory, tid, name) for directory, named in listed for name, tid, _ in named]
    for (directory, _, _), result in zip(files, results, strict=True):
        if not result.findings:
            continue
        where = sys.intern(str(directory))
        for finding in result.findings:  # one copy of each directory and advice, not one a finding
            finding.checkpoint, finding.advice = where, sys.intern(finding.advice)
        report.findings.extend(result.findings)
    report.bytes_read = sum(result.size for result in results)
    _buffer_checks(report, files, results, options, max_staleness)
    if "pairing" in chosen:
        _unpaired(report, files, results)
    # what could not be read is said whatever was chosen: a check left out is not a file skipped
    report.findings = [f for f in report.findings if f.check in chosen or _unread(f)]
    report.sort()
    report.journal = None if opened is None else opened.counts()
    report.seconds = timer.elapsed()
    return report


__all__ = [
    "CHECKS",
    "ERROR",
    "INFO",
    "LEVELS",
    "WARNING",
    "Finding",
    "Report",
    "doctor",
    "runs",
    "select_checks",
    "weights_id_of",
]
