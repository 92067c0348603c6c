"""Check a checkpoint or buffer directory and report every problem found, not just the first.

The quick check is rbtool.format's validator of the two JSON files (the same one every
loader runs, so quick verification passes exactly what loaders accept) plus the directory
listing: missing, stray and resized files. It never imports torch. `deep=True` also loads
every listed trajectory file safely and checks its tensors against the index.

When another writer rewrote the checkpoint after rbtool recorded sizes and hashes (its
metadata lacks rbtool's keys, SPEC §2), those records are hints: a mismatch is a warning.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np

from rbtool.errors import RbtoolError, UnsafePickleError
from rbtool.files.dirs import checkpoint_dirs
from rbtool.format import (
    ERROR,
    FORMATS,
    INDEX_FILE,
    LEGACY_INDEX_FILE,
    MERGE_MAP_FILE,
    METADATA_FILE,
    PROBLEM_CODES,
    SEVERITIES,
    IndexCheck,
    Problem,
    check_json,
    escapes,
    gc_paused,
    not_a_file,
    one_line,
    parse_trajectory_file_name,
    preview,
    problem,
    trajectory_file_name,
)
from rbtool.format.agreement import entry_disagreements
from rbtool.format.ranknames import rank_dir_name, rank_number
from rbtool.passes.journal import Journal, open_journal
from rbtool.passes.pool import Timer, check_jobs
from rbtool.passes.ranks import FileTask, file_pass, total_jobs
from rbtool.progress import Progress, start_phase

_IGNORED_FILES = {METADATA_FILE, INDEX_FILE, LEGACY_INDEX_FILE, MERGE_MAP_FILE}


@dataclass
class CheckpointReport:
    """The problems of one checkpoint directory; `size` is the index's length when it could be read."""

    path: Path
    size: int | None = None
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(p.severity == ERROR for p in self.problems)

    def add(
        self, code: str, message: str, *, trajectory_id: int | None = None, file: str | None = None
    ) -> None:
        """Record a problem; `message` must be one line (pass exception text through one_line)."""
        self.problems.append(problem(code, message, trajectory_id=trajectory_id, file=file))

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(SEVERITIES, 0)
        for p in self.problems:
            counts[p.severity] += 1
        return counts

    def as_json(self, *, plain: bool = True) -> dict[str, Any]:
        """JSON-ready dict; with plain=False problems stay Problem objects (orjson writes them as is)."""
        problems: list[Any] = [p.as_json() for p in self.problems] if plain else self.problems
        return {"path": str(self.path), "ok": self.ok, "size": self.size, "problems": problems}


@dataclass
class VerifyReport:
    """The result of verifying a path: one report per checkpoint directory found there."""

    path: Path
    deep: bool
    checkpoints: list[CheckpointReport]
    bytes_read: int = 0  # trajectory bytes the deep pass read (each file once)
    seconds: float = 0.0  # how long the deep pass took
    jobs: int = 1
    journal: dict[str, int] | None = None  # with a journal: files of the deep pass, and those reused

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checkpoints)

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(SEVERITIES, 0)
        for report in self.checkpoints:
            for key, value in report.counts().items():
                counts[key] += value
        return counts

    def as_json(self, *, plain: bool = True) -> dict[str, Any]:
        """The JSON document `rbtool verify --json` prints (see CheckpointReport.as_json for `plain`)."""
        return {
            "path": str(self.path),
            "deep": self.deep,
            "ok": self.ok,
            "checkpoints": [c.as_json(plain=plain) for c in self.checkpoints],
            "counts": self.counts(),
            "bytes_read": self.bytes_read,
            "seconds": round(self.seconds, 6),
            "bytes_per_second": round(self.bytes_read / self.seconds)
            if self.deep and self.seconds > 0
            else None,
            "jobs": self.jobs,
            "journal": self.journal,
        }


# ------------------------------------------------------------------ the listing
@dataclass
class _Listing:
    """The trajectory files of a directory, by id."""

    by_id: dict[int, list[str]] = field(default_factory=dict)
    badly_named: list[str] = field(default_factory=list)
    outside: dict[int, list[tuple[str, str]]] = field(default_factory=dict)  # symlinks leaving the dir
    not_files: dict[str, str] = field(default_factory=dict)  # trajectory names that are no file: what


def _list_files(directory: Path) -> _Listing:
    """Visible trajectory files (and .pt/.pkl files not named like one); hidden names are ignored."""
    listing = _Listing()
    with os.scandir(directory) as it:
        for entry in it:
            name = entry.name
            if name.startswith(".") or name in _IGNORED_FILES:
                continue
            parsed = parse_trajectory_file_name(name)
            if parsed is None:
                if name.endswith((".pt", ".pkl")) and entry.is_file():
                    listing.badly_named.append(name)
                continue
            if not entry.is_file():
                with contextlib.suppress(OSError):
                    listing.not_files[name] = not_a_file(entry.stat().st_mode)
                continue
            target = escapes(directory, name) if entry.is_symlink() else None
            if target is not None:
                listing.outside.setdefault(parsed[0], []).append((name, target))
                continue
            listing.by_id.setdefault(parsed[0], []).append(name)
    return listing


class _FileChecker:
    """Checks one directory's files against what check_json accepted of its index."""

    def __init__(self, checked: IndexCheck, report: CheckpointReport, *, deep: bool = False) -> None:
        self.checked = checked
        self.deep = deep
        self.directory = checked.directory
        self.report = report
        self.listing = _list_files(self.directory)
        self.fmt = checked.meta.trajectory_format
        # Sizes and hashes are rbtool's records; after another writer they are hints.
        self.hints_only = checked.meta.foreign

    def _expected_name(self, tid: int, entry: Any) -> str | None:
        if entry is None or self.fmt not in FORMATS:
            return None
        return trajectory_file_name(tid, entry["model_weights_id"], self.fmt)

    def check(self) -> None:
        report, listing, checked = self.report, self.listing, self.checked
        for name in sorted(listing.badly_named):
            report.add(
                "stray_file",
                f"{name}: a .pt/.pkl file not named trajectory_<id>_<model_weights_id>.<fmt>",
                file=name,
            )
        if checked.id_list is None or not checked.index_readable:
            return  # without a readable index, no file can be called missing or stray
        listed = dict.fromkeys(checked.id_list)
        counter = max(checked.meta.trajectory_counter or 0, max(listed, default=-1) + 1)
        for tid in sorted(listing.outside.keys() & listed.keys()):
            for name, target in listing.outside[tid]:
                report.add(
                    "file_outside",
                    f"{name}: a symlink to {target}, outside the checkpoint; refused",
                    trajectory_id=tid,
                    file=name,
                )
        found_ids = listing.by_id.keys() | listing.outside.keys()
        unique = np.fromiter(listed, dtype=np.int64, count=len(listed))
        present = np.isin(unique, np.fromiter(found_ids, dtype=np.int64, count=len(found_ids)))
        missing = unique[~present].tolist()
        entries = checked.entries
        if self.fmt in FORMATS and entries.keys() >= set(missing):
            # the bulk case (an index whose files are elsewhere) built list-wise: no per-id calls
            fmt = self.fmt
            weights = [entries[t]["model_weights_id"] for t in missing]
            names = [f"trajectory_{t}_{w}.{fmt}" for t, w in zip(missing, weights, strict=True)]
            odd = listing.not_files
            messages = [
                f"{n}: listed trajectory {t} has no file"
                if n not in odd
                else f"{n}: listed trajectory {t} has no file: the name is {odd[n]}"
                for n, t in zip(names, missing, strict=True)
            ]
            report.problems.extend(
                map(Problem, repeat("file_missing"), repeat(ERROR), missing, names, messages)
            )
        else:
            for tid in missing:
                expected = self._expected_name(tid, entries.get(tid))
                what = listing.not_files.get(expected or "")
                report.add(
                    "file_missing",
                    f"{expected or f'trajectory_{tid}_*'}: listed trajectory {tid} has no file"
                    + (f": the name is {what}" if what else ""),
                    trajectory_id=tid,
                    file=expected,
                )
        unrecorded = 0
        for tid in unique[present].tolist():
            entry = entries.get(tid)
            names = listing.by_id.get(tid, [])
            if not names:
                continue  # only links to files elsewhere: reported above
            expected = self._expected_name(tid, entry)
            if len(names) > 1 and (expected is None or expected in names):
                report.add(
                    "duplicate_files",
                    f"trajectory {tid} has {len(names)} files: {', '.join(sorted(names))}; keep only "
                    f"{expected or 'one'}",
                    trajectory_id=tid,
                    file=expected,
                )
            elif expected is not None and expected not in names:
                report.add(
                    "file_name_mismatch",
                    f"{sorted(names)[0]}: the index expects {expected} for trajectory {tid}",
                    trajectory_id=tid,
                    file=sorted(names)[0],
                )
                continue
            if entry is not None and expected is not None:
                self._check_size(tid, expected, entry)
                if entry.get("file_bytes") is None and entry.get("sha256") is None:
                    unrecorded += 1
        if unrecorded and not self.deep:
            report.add(
                "sizes_unrecorded",
                f"{unrecorded} of {len(listed)} listed files have no recorded size or hash: a quick check "
                "cannot tell a truncated or altered file; only a deep check, which loads every file, can",
            )
        for tid in sorted(listing.by_id.keys() - listed):
            for name in sorted(listing.by_id[tid]):
                if tid >= counter:
                    report.add(
                        "uncommitted_file",
                        f"{name}: not listed, id {tid} >= trajectory_counter {counter}: left by an "
                        "interrupted writer; the next ingest removes it",
                        trajectory_id=tid,
                        file=name,
                    )
                else:
                    report.add(
                        "stray_file",
                        f"{name}: a trajectory file the index does not list (id {tid} < trajectory_counter "
                        f"{counter})",
                        trajectory_id=tid,
                        file=name,
                    )

    def _check_link(self, tid: int, name: str, entry: Any, info: os.stat_result) -> None:
        """A hard link whose inode was written in place since it was linked (both names changed)."""
        link = entry.get("link")
        if not link or self.hints_only or info.st_ino != link.get("inode"):
            return  # not linked, recorded before another writer, or since replaced by another file
        if info.st_size != link.get("size") or info.st_mtime_ns != link.get("mtime_ns"):
            self.report.add(
                "linked_file_changed",
                f"{name}: written in place since it was linked (size {link.get('size')} -> {info.st_size}, "
                "mtime changed); a write through any of its names changes every checkpoint that links it",
                trajectory_id=tid,
                file=name,
            )

    def _check_size(self, tid: int, name: str, entry: Any) -> None:
        recorded = entry.get("file_bytes")
        if recorded is None and not entry.get("link"):
            return
        try:
            info = (self.directory / name).stat()
        except OSError:
            return
        self._check_link(tid, name, entry, info)
        if recorded is None:
            return
        actual = info.st_size
        if recorded != actual:
            code = "file_size_hint" if self.hints_only else "file_size_mismatch"
            why = (
                "another writer rewrote the checkpoint since" if self.hints_only else "truncated or replaced?"
            )
            self.report.add(
                code,
                f"{name}: {actual} bytes but its entry records file_bytes {recorded!r} ({why})",
                trajectory_id=tid,
                file=name,
            )

    # --------------------------------------------------------------- deep
    def deep_tasks(self) -> list[_DeepTask]:
        """One task per file of a listed trajectory, in list order (ids, then names)."""
        checked = self.checked
        if checked.id_list is None:
            return []
        tasks = []
        for tid in dict.fromkeys(checked.id_list):
            entry = _plain_entry(checked.entries.get(tid))
            for name in sorted(self.listing.by_id.get(tid, [])):
                tasks.append(_DeepTask(self.directory / name, tid, entry, self.hints_only))
        return tasks

    def finish_deep(self, tasks: list[_DeepTask], results: list[_DeepResult]) -> int:
        """Add the deep pass's problems in list order and compare schemas; returns the bytes read."""
        schemas: list[tuple[int, str, dict[str, str]]] = []
        total = 0
        for task, (problems, schema, size) in zip(tasks, results, strict=True):
            self.report.problems.extend(problems)
            total += size
            if schema is not None:
                schemas.append((task.tid, task.path.name, schema))
        _compare_schemas(schemas, self.report)
        return total


@dataclass(frozen=True)
class _DeepTask(FileTask):
    """One file of the deep pass."""

    hints_only: bool


_DeepResult = tuple[list[Problem], "dict[str, str] | None", int]
# What _deep_check_file reads of an index entry.
_ENTRY_KEYS = ("shape", "model_weights_id", "max_episode_length", "sha256")


def _plain_entry(entry: Any) -> dict[str, Any] | None:
    """The keys of an accepted entry the deep check reads, as a plain dict (entries are structs)."""
    if entry is None:
        return None
    return {key: entry.get(key) for key in _ENTRY_KEYS}


def _deep_task(task: _DeepTask) -> _DeepResult:
    """Check one file (in a worker process): its problems, its schema or None, the bytes read."""
    found = CheckpointReport(task.path.parent)
    schema, size = _deep_check_file(task.path, task.tid, task.entry, found, task.hints_only)
    return found.problems, schema, size


# -------------------------------------------------------------------- deep checks
def _schema_of(traj: dict[str, Any], kind: type) -> dict[str, str]:
    """Field path -> 'dtype[trailing dims]' ('dtype(1-dim)' for per-env vectors)."""
    from rbtool.format.layout import iter_tensors

    out = {}
    for path, tensor in iter_tensors(traj, kind=kind):
        dtype = str(tensor.dtype).removeprefix("torch.")
        trailing = "(1-dim)" if tensor.dim() < 2 else str(list(tensor.shape[2:]))
        out[".".join(path)] = f"{dtype}{trailing}"
    return out


def _deep_check_file(
    path: Path, tid: int, entry: Any, report: CheckpointReport, hints_only: bool
) -> tuple[dict[str, str] | None, int]:
    """Read one file once, hash and load those bytes, check it: (its schema or None, bytes read).

    A `.pt` file laid out as torch.save writes it is checked from its bytes without torch
    (rbtool.files.ptcheck, which accepts only what the torch path loads to the same values);
    any other file, and any file that check does not accept, is loaded with torch."""
    from rbtool.files import ptcheck, trajfile

    name = path.name
    data = b""
    try:
        data = trajfile.read_file_bytes(path)
    except RbtoolError as exc:
        report.add("file_unreadable", one_line(str(exc)), trajectory_id=tid, file=name)
        return None, len(data)
    checked = ptcheck.check_pt(path, data) if path.suffix == ".pt" else None
    if checked is not None:
        schema = _check_checked(checked, data, name, tid, entry, report)
    else:
        import torch

        try:
            traj = trajfile.load_bytes(data, path)
        except UnsafePickleError as exc:
            report.add("file_unsafe", one_line(str(exc)), trajectory_id=tid, file=name)
            return None, len(data)
        except RbtoolError as exc:
            report.add("file_unreadable", one_line(str(exc)), trajectory_id=tid, file=name)
            return None, len(data)

        def bad_tensor(tensor: Any) -> int:
            if tensor.is_floating_point() or tensor.is_complex():
                return int((~torch.isfinite(tensor)).sum())
            return 0

        _check_contents(traj, torch.Tensor, bad_tensor, name, tid, entry, report)
        schema = _schema_of(traj, torch.Tensor)
    recorded = entry.get("sha256") if entry is not None else None
    if isinstance(recorded, str):
        actual = trajfile.sha256_bytes(data)
        if actual != recorded:
            code = "hash_hint" if hints_only else "hash_mismatch"
            why = " (another writer rewrote the checkpoint since)" if hints_only else ""
            report.add(
                code,
                f"{name}: sha256 {actual[:16]}... differs from the recorded {recorded[:16]}...{why}",
                trajectory_id=tid,
                file=name,
            )
    return schema, len(data)


def _check_checked(
    checked: Any, data: bytes, name: str, tid: int, entry: Any, report: CheckpointReport
) -> dict[str, str]:
    """_check_contents on a file of a layout rbtool.files.ptcheck checked; what depends only on the
    layout (its shape, fields and schema) is worked out once per layout, when it finds nothing."""
    from rbtool.files.ptheader import TensorSpec

    structure = checked.structure
    layout = checked.memo.get("verify") if structure.get("model_weights_id") is not None else None
    counts = checked.nonfinite(data)
    if layout is None:
        found = CheckpointReport(report.path)
        _check_contents(structure, TensorSpec, lambda spec: counts.get(id(spec), 0), name, tid, entry, found)
        report.problems.extend(found.problems)
        schema = _schema_of(structure, TensorSpec)
        if not found.problems and structure.get("model_weights_id") is not None:
            from rbtool.format import layout as rules

            info = rules.describe(
                {k: v for k, v in structure.items() if k not in rules.DONE_LIKE}, name, TensorSpec
            )
            checked.memo["verify"] = (info, schema)
        return schema
    info, schema = layout
    if entry is not None:
        _compare_entry(name, tid, info, structure, entry, report)
    if counts:
        from rbtool.format.layout import iter_tensors

        for field_path, spec in iter_tensors(structure, kind=TensorSpec):
            bad = counts.get(id(spec), 0)
            if bad:
                report.add(
                    "non_finite",
                    f"{name}: field {'.'.join(field_path)!r} holds {bad} NaN/Inf value(s)",
                    trajectory_id=tid,
                    file=name,
                )
    return schema


def _check_contents(
    traj: dict[str, Any],
    kind: type[Any],
    nonfinite: Any,
    name: str,
    tid: int,
    entry: Any,
    report: CheckpointReport,
) -> None:
    """The checks of a loaded file's values, whoever loaded it: tensors of `kind` (torch's, or
    TensorSpecs of a header), `nonfinite(tensor)` counting a tensor's NaN/Inf values."""
    from rbtool.errors import InvalidTrajectoryError
    from rbtool.format import layout

    traj = layout.with_stored_defaults(traj, name)
    plain = {k: v for k, v in traj.items() if k not in layout.DONE_LIKE}
    try:
        info = layout.describe(plain, name, kind)
    except InvalidTrajectoryError as exc:
        report.add("trajectory_invalid", one_line(str(exc)), trajectory_id=tid, file=name)
        info = None
    if info is not None:
        t, b = info.shape[0], info.shape[1]
        for key in layout.DONE_LIKE:
            value = traj.get(key)
            if not isinstance(value, kind) or value.dim() < 2:
                continue
            try:
                layout.done_extra_rows(int(value.shape[0]), t, int(value.shape[1]), b)
            except ValueError as exc:
                report.add(
                    "done_rows_invalid",
                    f"{name}: field {key!r} has shape {list(value.shape)}; {exc}",
                    trajectory_id=tid,
                    file=name,
                )
        if entry is not None:
            _compare_entry(name, tid, info, traj, entry, report)
    for field_path, tensor in layout.iter_tensors(traj, kind=kind):
        bad = nonfinite(tensor)
        if bad:
            report.add(
                "non_finite",
                f"{name}: field {'.'.join(field_path)!r} holds {bad} NaN/Inf value(s)",
                trajectory_id=tid,
                file=name,
            )


def _compare_entry(
    name: str, tid: int, info: Any, traj: dict[str, Any], entry: Any, report: CheckpointReport
) -> None:
    found = entry_disagreements(
        name, info.shape, info.model_weights_id, traj.get("max_episode_length"), entry
    )
    for key, message in found:
        code = "shape_mismatch" if key in ("shape", "num_samples") else "field_mismatch"
        report.add(code, message, trajectory_id=tid, file=name)


def _compare_schemas(schemas: list[tuple[int, str, dict[str, str]]], report: CheckpointReport) -> None:
    """One warning per trajectory whose schema differs from the first readable one's."""
    if not schemas:
        return
    ref_id, _, ref = schemas[0]
    for tid, name, schema in schemas[1:]:
        if schema == ref:
            continue
        diffs = [f"lacks {p}" for p in ref if p not in schema]
        diffs += [f"has extra {p} {schema[p]}" for p in schema if p not in ref]
        diffs += [f"{p} is {schema[p]} (not {ref[p]})" for p in ref if p in schema and schema[p] != ref[p]]
        report.add(
            "schema_differs",
            f"{name}: fields differ from trajectory {ref_id}'s: {preview(diffs)}",
            trajectory_id=tid,
            file=name,
        )


# ------------------------------------------------------------------------ entry points
def verify_checkpoint(
    directory: str | os.PathLike[str],
    *,
    deep: bool = False,
    progress: Progress | None = None,
    jobs: int | None = None,
) -> CheckpointReport:
    """Check one checkpoint or buffer directory and return every problem found."""
    path = Path(directory)
    report, files = _check_one(path, deep)
    if deep:
        _run_deep([files], progress, check_jobs(jobs), None)
    return report


def _check_one(path: Path, deep: bool) -> tuple[CheckpointReport, _FileChecker]:
    """The quick check of one directory (the JSON files and the listing)."""
    with gc_paused():
        checked = check_json(path)
        report = CheckpointReport(path, checked.raw_list_len if checked.id_list is not None else None)
        report.problems.extend(checked.problems)
        files = _FileChecker(checked, report, deep=deep)
        files.check()
    return report, files


def _run_deep(
    checkers: list[_FileChecker], progress: Progress | None, jobs: int | None, journal: Journal | None
) -> int:
    """The deep pass over every checker's files at once, `jobs` workers per rank; returns the bytes read."""
    per_checker = [c.deep_tasks() for c in checkers]
    tasks = [t for ts in per_checker for t in ts]
    start_phase(progress, len(tasks), "loading trajectory files")
    # .pt files of torch.save's layout are checked without torch (rbtool.files.ptcheck); workers
    # import it when a file needs it, and start with it when a format always does
    torch = ("torch",) if any(t.path.suffix != ".pt" for t in tasks) else ()
    preload = (*torch, "rbtool.ops.verify", "rbtool.files.ptcheck")
    if tasks:
        from rbtool.files.ptcheck import torch_is_recent

        torch_is_recent()  # (read once here: forked workers inherit it)
    results = file_pass(
        _deep_task, tasks, jobs, progress, journal, preload=preload, types=(Problem,), hashes=_hashes
    )
    total, start = 0, 0
    for checker, own in zip(checkers, per_checker, strict=True):
        total += checker.finish_deep(own, results[start : start + len(own)])
        start += len(own)
    return total


def _hashes(task: _DeepTask) -> tuple[str | None]:
    """The sha256 the index records for the task's file (None where it records none)."""
    return (_recorded_sha256(task.entry),)


def _recorded_sha256(entry: dict[str, Any] | None) -> str | None:
    recorded = entry.get("sha256") if entry is not None else None
    return recorded if isinstance(recorded, str) else None


def verify(
    path: str | os.PathLike[str],
    *,
    deep: bool = False,
    progress: Progress | None = None,
    jobs: int | None = None,
    journal: str | os.PathLike[str] | None = None,
) -> VerifyReport:
    """Check a checkpoint, a buffer directory, or each checkpoint of a folder of rank_* directories.

    The deep pass runs on `jobs` worker processes (default: the cores this process may use),
    over the files of every checkpoint at once; under torchrun the files are shared among
    the ranks (rbtool.passes.ranks). With `journal` (a directory), each checked file is recorded
    there, and a rerun takes the recorded results of unchanged files. `progress(1)` is called
    per file of the deep pass; a callback with a `start(total, description)` method also hears
    of each phase (checkpoints checked, then files loaded) and counts the checkpoints too.
    """
    if jobs is not None:
        check_jobs(jobs)
    root = Path(path)
    opened = None
    if deep:
        opened = open_journal(journal, {"command": "verify deep", "input": str(root.absolute())})
    workers = total_jobs(jobs) if deep else check_jobs(jobs)
    timer = Timer()
    dirs = checkpoint_dirs(root)
    start_phase(progress, len(dirs), "checking index files and listings")
    checked = []
    phases = progress if hasattr(progress, "start") else None  # a plain callback counts files only
    for d in dirs:
        checked.append(_check_one(d, deep))
        if phases is not None:
            phases(1)
    report = VerifyReport(root, deep, [r for r, _ in checked], jobs=workers)
    if dirs != [root]:
        report.checkpoints = _with_missing_ranks(root, [f for _, f in checked], report.checkpoints)
    if deep:
        report.bytes_read = _run_deep([f for _, f in checked], progress, jobs, opened)
        report.journal = None if opened is None else opened.counts()
    report.seconds = timer.elapsed()
    return report


def _recorded_layout(files: _FileChecker) -> tuple[int, int] | None:
    """(rank, world size) a rank directory's metadata records (its `shard` key), if any."""
    info = files.checked.meta.extra.get("shard")
    if not isinstance(info, dict):
        return None
    rank, world_size = info.get("rank"), info.get("world_size")
    if type(rank) is not int or type(world_size) is not int or not 0 <= rank < world_size:
        return None
    return rank, world_size


def _with_missing_ranks(
    root: Path, files: list[_FileChecker], reports: list[CheckpointReport]
) -> list[CheckpointReport]:
    """The reports of a rank tree, with one failed report for each rank directory that the tree's
    own rank metadata records but that is not there (and a problem on each directory holding
    another rank than its name says)."""
    layouts = [_recorded_layout(f) for f in files]
    sizes = sorted({lay[1] for lay in layouts if lay is not None})
    if not sizes:
        return reports  # nothing recorded (the reference implementation's ranks): nothing to expect
    held: set[int] = set()
    for f, report, lay in zip(files, reports, layouts, strict=True):
        number = rank_number(f.directory.name)
        if lay is None:
            if number is not None:
                held.add(number)
            continue
        held.add(lay[0])
        if number is not None and number != lay[0]:
            report.add(
                "rank_misplaced",
                f"{f.directory.name}: its metadata records rank {lay[0]} of world size {lay[1]}, not rank "
                f"{number}; rename it {rank_dir_name(lay[0])} or reshard the tree",
            )
    expected = range(max(sizes))
    missing = [r for r in expected if r not in held]
    if not missing:
        return reports
    found = ", ".join(f.directory.name for f in files)
    layout = " and ".join(map(str, sizes))
    by_name = {rep.path.name: rep for rep in reports}
    extra = []
    for r in missing:
        name = rank_dir_name(r)
        missing_report = by_name.get(name)  # a directory of that name holding another rank
        if missing_report is None:
            missing_report = CheckpointReport(root / name)
            extra.append((r, missing_report))
        missing_report.add(
            "rank_missing",
            f"{name}: missing; the tree's rank directories record world size {layout} (ranks 0-"
            f"{max(sizes) - 1}) and {found} {'is' if len(files) == 1 else 'are'} there; the tree "
            "lacks that rank's trajectories",
            file=name,
        )
    numbered = [(rank_number(rep.path.name), rep) for rep in reports]
    merged = sorted(
        [(n if n is not None else -1, rep) for n, rep in numbered] + extra, key=lambda item: item[0]
    )
    return [rep for _, rep in merged]


__all__ = [
    "PROBLEM_CODES",
    "CheckpointReport",
    "Problem",
    "VerifyReport",
    "verify",
    "verify_checkpoint",
]
