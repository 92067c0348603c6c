"""Write a consistent checkpoint from what a damaged one really holds.

Entries whose files are missing, unreadable or altered are dropped; `size` and
`total_samples` are recounted; a lost or corrupt index or metadata is rebuilt from the
trajectory files themselves. The source is only read: the output is built in a staging
directory beside OUT (files hard-linked where possible) and renamed into place whole.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rbtool.errors import InvalidTrajectoryError, RbtoolError, UsageError
from rbtool.files import trajfile
from rbtool.files.dirs import checkpoint_dirs
from rbtool.files.fsutil import file_size
from rbtool.files.index import DEFAULT_SEED, Index
from rbtool.files.writer import OutputDir, Rules, WriteReport, new_entry, write_output
from rbtool.format import (
    FORMATS,
    METADATA_FILE,
    IndexCheck,
    check_json,
    escapes,
    layout,
    parse_trajectory_file_name,
    trajectory_file_name,
)
from rbtool.passes.pool import Throughput, Timer, check_jobs, run_pass
from rbtool.progress import Progress, start_phase


@dataclass
class RepairedCheckpoint:
    """What repairing one checkpoint directory kept, dropped, ignored and fixed."""

    source: Path
    out: Path
    index: Index
    rebuilt_metadata: bool = False
    rebuilt_index: bool = False
    dropped: list[dict[str, Any]] = field(default_factory=list)  # {trajectory_id, file, reason}
    ignored: list[dict[str, Any]] = field(default_factory=list)  # {file, reason}
    fixed: list[dict[str, Any]] = field(default_factory=list)  # {trajectory_id, message}
    sources: dict[int, Path] = field(default_factory=dict)  # the file each kept id is written from

    def as_json(self) -> dict[str, Any]:
        return {
            "source": str(self.source),
            "out": str(self.out),
            "rebuilt_metadata": self.rebuilt_metadata,
            "rebuilt_index": self.rebuilt_index,
            **self.index.state(),
            "dropped": self.dropped,
            "ignored": self.ignored,
            "fixed": self.fixed,
        }


@dataclass
class RepairResult:
    """The repaired checkpoints (one, or one per rank_* directory) and how their files were placed."""

    source: Path
    out: Path
    checkpoints: list[RepairedCheckpoint]
    report: WriteReport = field(default_factory=WriteReport)
    throughput: Throughput = field(default_factory=lambda: Throughput(1))  # the pass reading the files

    def as_json(self) -> dict[str, Any]:
        return {
            "source": str(self.source),
            "out": str(self.out),
            "checkpoints": [c.as_json() for c in self.checkpoints],
            "files": self.report.as_json(),
            **self.throughput.as_json(),
        }


@dataclass(frozen=True)
class _FileFacts:
    """What reading one trajectory file found: why it cannot be used, or what it holds."""

    error: str | None
    info: layout.TrajectoryInfo | None
    sha256: str | None
    size: int


def _read_file(path: Path) -> _FileFacts:
    """Read a file once, load and hash those bytes (on a worker process of the pass)."""
    try:
        data = trajfile.read_file_bytes(path)
        traj = trajfile.load_bytes(data, path)
    except RbtoolError as exc:
        return _FileFacts(" ".join(str(exc).split()), None, None, 0)
    try:
        info = layout.describe_stored(traj, path.name, path.name)
    except InvalidTrajectoryError as exc:
        return _FileFacts(" ".join(str(exc).split()), None, None, len(data))
    return _FileFacts(None, info, trajfile.sha256_bytes(data), len(data))


def _trajectory_files(directory: Path) -> tuple[dict[int, list[Path]], list[tuple[Path, str]]]:
    """Visible files named like trajectories, by id (hidden temporary files are never adopted),
    and the symlinks among them that lead outside the directory (never adopted either)."""
    found: dict[int, list[Path]] = {}
    outside: list[tuple[Path, str]] = []
    for path in sorted(directory.iterdir()):
        parsed = parse_trajectory_file_name(path.name)
        if parsed is not None and not path.name.startswith(".") and path.is_file():
            target = escapes(directory, path.name)
            if target is not None:
                outside.append((path, target))
                continue
            found.setdefault(parsed[0], []).append(path)
    return found, outside


class _Planner:
    """Works out the repaired index of one directory and where each kept file comes from."""

    def __init__(self, source: Path, out: Path) -> None:
        self.source = source
        self.files, outside = _trajectory_files(source)
        self.result = RepairedCheckpoint(source, out, Index())
        self.checked: IndexCheck = check_json(source)
        self.bytes_read = 0  # what the pass over the chosen files read, and how long it took
        self.seconds = 0.0
        for path, target in outside:
            self.result.ignored.append(
                {"file": path.name, "reason": f"a symlink to {target}, outside the checkpoint: not read"}
            )

    def fixed(self, tid: int | None, message: str) -> None:
        self.result.fixed.append({"trajectory_id": tid, "message": message})

    # ------------------------------------------------------------ metadata
    def metadata(self) -> tuple[str | None, int | None, int, dict[str, Any]]:
        """(format or None when unknown, seed, counter floor, extra keys) salvaged from metadata.json."""
        meta = self.checked.meta
        if not meta.readable:
            why = next((p.message for p in self.checked.problems if p.file == METADATA_FILE), "unreadable")
            self.result.rebuilt_metadata = True
            self.fixed(None, f"{why}: rebuilt (seed {DEFAULT_SEED}, format from the files)")
            return None, DEFAULT_SEED, 0, {}
        for p in self.checked.problems:
            if p.file == METADATA_FILE and p.code in ("metadata_invalid", "seed_null"):
                self.fixed(None, f"{p.message}: value not kept")
        # an absent (or null) seed stays absent (unseeded); an invalid one becomes the default
        seed = meta.seed if meta.has_seed else (DEFAULT_SEED if "seed" in meta.invalid else None)
        return meta.trajectory_format, seed, meta.trajectory_counter or 0, dict(meta.extra)

    # --------------------------------------------------------------- index
    def index(self) -> tuple[list[int], dict[int, dict[str, Any]]] | None:
        """(listed ids, valid entries) from the index file, or None when it must be rebuilt."""
        checked = self.checked
        if checked.id_list is None or not checked.index_readable:
            why = next(
                (p.message for p in checked.problems if p.file == checked.index_file),
                f"{checked.index_file}: not an index",
            )
            self.result.rebuilt_index = True
            self.fixed(None, f"{why}: rebuilt from the trajectory files")
            return None
        for p in checked.problems:
            if p.code in ("entry_invalid", "num_samples_mismatch"):
                self.fixed(None, f"{p.message}: entry rebuilt from its file if it has one")
            elif p.code == "index_invalid":
                self.fixed(None, f"{p.message}: left out")
            elif p.code == "duplicate_id":
                self.fixed(
                    p.trajectory_id, f"id {p.trajectory_id} listed more than once: kept its first place"
                )
            elif p.code == "entry_unlisted":
                self.result.ignored.append({"file": None, "reason": f"{p.message}: left out"})
        return list(dict.fromkeys(checked.id_list)), checked.entry_dicts()

    # --------------------------------------------------------------- files
    def choose_file(self, tid: int, entry: dict[str, Any] | None, fmt: str | None) -> Path | None:
        """The file to keep for `tid`: the expected name, else the index's format, else the first."""
        candidates = self.files.get(tid, [])
        if not candidates:
            return None
        expected = trajectory_file_name(tid, entry["model_weights_id"], fmt) if entry and fmt else None

        def rank(path: Path) -> tuple[bool, bool, str]:
            return (path.name != expected, fmt is not None and path.suffix != f".{fmt}", path.name)

        chosen, *others = sorted(candidates, key=rank)
        for other in others:
            self.result.ignored.append(
                {"file": other.name, "reason": f"another file of trajectory {tid}; kept {chosen.name}"}
            )
        return chosen

    def check_file(
        self, tid: int, path: Path, entry: dict[str, Any] | None, facts: _FileFacts
    ) -> dict[str, Any] | None:
        """The entry to keep for a file, or None (recorded as dropped) when the file cannot be used.

        `facts` is what reading the file found (`_read_file`, run by the pass).
        """
        if facts.error is not None or facts.info is None:
            self.drop(tid, path.name, facts.error or "unreadable")
            return None
        info = facts.info
        name_weights_id = layout.name_weights_id(path.name)
        recorded = entry.get("sha256") if entry else None
        # After another writer rewrote the checkpoint, a recorded hash is only a hint: a file
        # that loads and matches its entry is kept (its hash is recomputed when written).
        if isinstance(recorded, str) and facts.sha256 != recorded:
            if not self.checked.meta.foreign:
                self.drop(tid, path.name, "content differs from the sha256 its entry records")
                return None
            assert entry is not None
            entry = {k: v for k, v in entry.items() if k not in ("sha256", "file_bytes")}
            self.fixed(tid, f"{path.name}: sha256 recorded before another writer rewrote it: dropped")
        # The file's own model_weights_id and max_episode_length win over its name and entry:
        # the name may have been changed, the data not.
        weights_id = info.model_weights_id
        if weights_id != name_weights_id:
            self.fixed(tid, f"{path.name} holds model_weights_id {weights_id!r}: named after it")
        if entry is None:
            mel = info.max_episode_length if info.max_episode_length is not None else info.shape[0]
            info = layout.TrajectoryInfo(info.shape, mel, weights_id)
            self.fixed(tid, f"entry rebuilt from {path.name}")
            return new_entry(tid, info, uuid.uuid4().hex)
        kept = dict(entry)
        if list(info.shape) != list(entry["shape"]):
            self.fixed(tid, f"shape {entry['shape']} corrected to {list(info.shape)} from {path.name}")
            kept["shape"] = list(info.shape)
            kept["num_samples"] = info.num_samples
        if weights_id != entry["model_weights_id"]:
            self.fixed(tid, f"model_weights_id {entry['model_weights_id']!r} corrected to {weights_id!r}")
            kept["model_weights_id"] = weights_id
        file_mel = info.max_episode_length
        if file_mel is not None and file_mel != entry["max_episode_length"]:
            self.fixed(tid, f"max_episode_length {entry['max_episode_length']!r} corrected to {file_mel}")
            kept["max_episode_length"] = file_mel
        if kept.get("file_bytes") not in (None, facts.size):
            kept.pop("file_bytes")
        return kept

    def drop(self, tid: int, file: str | None, reason: str) -> None:
        self.result.dropped.append({"trajectory_id": tid, "file": file, "reason": reason})

    # ---------------------------------------------------------------- plan
    def plan(self, progress: Progress | None, jobs: int = 1) -> RepairedCheckpoint:
        """Work out the repaired index; the chosen files are read on `jobs` worker processes."""
        fmt, seed, counter, extra = self.metadata()
        parsed = self.index()
        ids: list[int]
        entries: dict[int, dict[str, Any]]
        if parsed is None:
            ids, entries = sorted(self.files), {}
        else:
            ids, entries = parsed
            for tid in sorted(self.files.keys() - set(ids)):
                for path in self.files[tid]:
                    self.result.ignored.append({"file": path.name, "reason": "not listed in the index"})
        if fmt is None:
            suffixes = [p.suffix[1:] for tid in ids for p in self.files.get(tid, [])]
            fmt = max(FORMATS, key=lambda f: (suffixes.count(f), f == "pt"))
            self.fixed(None, f"trajectory_format {fmt!r} taken from the files")
        index = Index(seed=seed, trajectory_format=fmt, extra_metadata=extra)
        chosen = {tid: self.choose_file(tid, entries.get(tid), fmt) for tid in ids}
        to_read = [path for path in chosen.values() if path is not None]
        start_phase(progress, len(ids), "checking trajectory files")  # each read file, then each missing one
        timer = Timer()
        read = run_pass(
            _read_file,
            to_read,
            jobs=jobs,
            weights=[file_size(p) for p in to_read],
            progress=progress,
            preload=("torch", "rbtool.ops.repair"),
        )
        self.seconds = timer.elapsed()
        facts = dict(zip(to_read, read, strict=True))
        self.bytes_read = sum(f.size for f in read)
        for tid in ids:
            entry = entries.get(tid)
            found = chosen[tid]
            if found is None:
                expected = trajectory_file_name(tid, entry["model_weights_id"], fmt) if entry else None
                self.drop(tid, expected, "file missing")
                if progress is not None:
                    progress(1)
            else:
                kept = self.check_file(tid, found, entry, facts[found])
                if kept is not None:
                    index.entries[tid] = kept
                    index.id_list.append(tid)
                    self.result.sources[tid] = found
        index.trajectory_counter = max(counter, max(ids, default=-1) + 1)
        self.result.index = index
        return self.result


def plan_repair(
    source: str | os.PathLike[str], out: str | os.PathLike[str] = "", *, jobs: int | None = None
) -> RepairedCheckpoint:
    """What repairing one checkpoint directory would write, without writing anything."""
    return _Planner(Path(source), Path(out)).plan(None, check_jobs(jobs))


def _refuse_overlap(source: Path, out: Path) -> None:
    src, dst = Path(os.path.realpath(source)), Path(os.path.realpath(out))
    if src == dst or src in dst.parents or dst in src.parents:
        raise UsageError(f"{out} overlaps the source {source}; write the repaired checkpoint elsewhere")


def repair(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
    link: bool = True,
    jobs: int | None = None,
    dry_run: bool = False,
) -> RepairResult:
    """Write a consistent copy of the checkpoint at `path` (or of each of its rank_* checkpoints) to `out`.

    A folder of rank_* directories gives `out/rank_<r>` for each. The source is never modified;
    with `link` False no file is a hard link of its files (a reflink or a copy). Each file is
    read once (loaded and hashed from the same bytes), on `jobs` worker processes (default:
    the cores this process may use). With `dry_run` the files are checked and the plan made,
    but nothing is written (`out` is only checked as publishing would check it).
    """
    workers = check_jobs(jobs)
    source, target = Path(path), Path(out)
    _refuse_overlap(source, target)
    dirs = checkpoint_dirs(source)
    single = dirs == [source]
    planners = [_Planner(d, target if single else target / d.name) for d in dirs]
    plans = [planner.plan(progress, workers) for planner in planners]
    throughput = Throughput(workers, sum(p.bytes_read for p in planners), sum(p.seconds for p in planners))
    result = RepairResult(source, target, plans, throughput=throughput)
    outputs = [OutputDir("." if single else p.source.name, p.index, p.sources.__getitem__) for p in plans]
    result.report = write_output(target, outputs, Rules(overwrite, link=link, dry_run=dry_run))
    return result


__all__ = ["RepairResult", "RepairedCheckpoint", "plan_repair", "repair"]
