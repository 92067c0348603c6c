"""Write a consistent checkpoint from what a damaged one really holds.

Entries whose files are missing, unreadable or altered are dropped; `size` and
`total_samples` are recounted; a lost or corrupt index or metadata is rebuilt from the
trajectory files themselves. The source is only read: the output is built in a staging
directory beside OUT (files hard-linked where possible) and renamed into place whole.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from rbtool import trajfile
from rbtool.checkpoint import WriteReport, fill_dir, new_entry
from rbtool.dirs import checkpoint_dirs
from rbtool.errors import CheckpointError, InvalidTrajectoryError, RbtoolError, UsageError
from rbtool.fsutil import staged_dir
from rbtool.index import (
    FORMATS,
    INDEX_FILE,
    LEGACY_INDEX_FILE,
    METADATA_FILE,
    Index,
    parse_entry,
    parse_metadata,
    parse_trajectory_file_name,
    trajectory_file_name,
)

Progress = Callable[[int], None]
DEFAULT_SEED = 1234
_KNOWN_METADATA = (
    "trajectory_format",
    "size",
    "total_samples",
    "trajectory_counter",
    "seed",
    "format_version",
)


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

    def as_json(self) -> dict[str, Any]:
        return {
            "source": str(self.source),
            "out": str(self.out),
            "checkpoints": [c.as_json() for c in self.checkpoints],
            "files": self.report.as_json(),
        }


def _read_json(path: Path) -> tuple[Any, str | None]:
    """(parsed JSON, None), or (None, why it is unusable)."""
    try:
        return orjson.loads(path.read_bytes()), None
    except FileNotFoundError:
        return None, "missing"
    except OSError as exc:
        return None, f"unreadable ({exc.strerror})"
    except orjson.JSONDecodeError as exc:
        return None, f"invalid JSON ({' '.join(str(exc).split())})"


def _trajectory_files(directory: Path) -> dict[int, list[Path]]:
    """Visible files named like trajectories, by id (hidden temporary files are never adopted)."""
    found: dict[int, list[Path]] = {}
    for path in sorted(directory.iterdir()):
        parsed = parse_trajectory_file_name(path.name)
        if parsed is not None and not path.name.startswith(".") and path.is_file():
            found.setdefault(parsed[0], []).append(path)
    return found


class _Planner:
    """Works out the repaired index of one directory and where each kept file comes from."""

    def __init__(self, source: Path, out: Path) -> None:
        self.source = source
        self.files = _trajectory_files(source)
        self.result = RepairedCheckpoint(source, out, Index())

    def fixed(self, tid: int | None, message: str) -> None:
        self.result.fixed.append({"trajectory_id": tid, "message": message})

    # ------------------------------------------------------------ metadata
    def metadata(self) -> tuple[str | None, int | None, int, dict[str, Any]]:
        """(format or None when unknown, seed, counter floor, extra keys) salvaged from metadata.json."""
        meta, why = _read_json(self.source / METADATA_FILE)
        if why is None and not isinstance(meta, dict):
            why = f"not a JSON object ({type(meta).__name__})"
        if why is not None:
            self.result.rebuilt_metadata = True
            self.fixed(None, f"{METADATA_FILE} {why}: rebuilt (seed {DEFAULT_SEED}, format from the files)")
            return None, DEFAULT_SEED, 0, {}
        assert isinstance(meta, dict)
        good: dict[str, Any] = {}
        for key in ("trajectory_format", "trajectory_counter", "seed"):
            if key not in meta:
                continue
            try:
                parse_metadata({key: meta[key]}, Path(METADATA_FILE))
                good[key] = meta[key]
            except CheckpointError as exc:
                self.fixed(None, f"{exc}: value not kept")
        extra = {k: v for k, v in meta.items() if k not in _KNOWN_METADATA}
        # an absent seed reads as None (unseeded), as read_index reads it; an invalid one as the default
        seed = None if "seed" not in meta else good.get("seed", DEFAULT_SEED)
        return good.get("trajectory_format"), seed, good.get("trajectory_counter", 0), extra

    # --------------------------------------------------------------- index
    def index(self) -> tuple[list[int], dict[int, dict[str, Any]]] | None:
        """(listed ids, valid entries) from the index file, or None when it must be rebuilt."""
        name = INDEX_FILE
        if not (self.source / INDEX_FILE).is_file() and (self.source / LEGACY_INDEX_FILE).is_file():
            name = LEGACY_INDEX_FILE
        raw, why = _read_json(self.source / name)
        table = raw.get("trajectory_index") if isinstance(raw, dict) else None
        id_list = raw.get("trajectory_id_list") if isinstance(raw, dict) else None
        if why is None and (not isinstance(table, dict) or not isinstance(id_list, list)):
            why = "not an index ('trajectory_index' object and 'trajectory_id_list' list)"
        if why is not None or not isinstance(table, dict) or not isinstance(id_list, list):
            self.result.rebuilt_index = True
            self.fixed(None, f"{name} {why}: rebuilt from the trajectory files")
            return None
        entries: dict[int, dict[str, Any]] = {}
        for key, value in table.items():
            try:
                tid, entry = parse_entry(key, value, Path(name))
            except CheckpointError as exc:
                self.fixed(None, f"{exc}: entry rebuilt from its file if it has one")
                continue
            entries[tid] = dict(entry)
        ids: list[int] = []
        seen: set[int] = set()
        for value in id_list:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                self.fixed(None, f"{name}: trajectory_id_list value {value!r} is not an id: left out")
            elif value in seen:
                self.fixed(value, f"id {value} listed more than once: kept its first place")
            else:
                seen.add(value)
                ids.append(value)
        for tid in sorted(entries.keys() - seen):
            self.result.ignored.append(
                {"file": None, "reason": f"index entry {tid} is not in trajectory_id_list: left out"}
            )
        return ids, entries

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

    def check_file(self, tid: int, path: Path, entry: dict[str, Any] | None) -> dict[str, Any] | None:
        """The entry to keep for a file, or None (recorded as dropped) when the file cannot be used."""
        try:
            traj = trajfile.load(path)
        except RbtoolError as exc:
            self.drop(tid, path.name, " ".join(str(exc).split()))
            return None
        parsed = parse_trajectory_file_name(path.name)
        name_weights_id = parsed[1] if parsed else ""
        if traj.get("model_weights_id") is None:
            traj = {**traj, "model_weights_id": name_weights_id}
        try:
            info = trajfile.describe(traj, path.name)
        except InvalidTrajectoryError as exc:
            self.drop(tid, path.name, " ".join(str(exc).split()))
            return None
        recorded = entry.get("sha256") if entry else None
        if isinstance(recorded, str) and trajfile.sha256_file(path) != recorded:
            self.drop(tid, path.name, "content differs from the sha256 its entry records")
            return None
        # The file's own model_weights_id and max_episode_length win over its name and entry:
        # the name may have been changed, the data not.
        weights_id = info.model_weights_id
        if weights_id != name_weights_id:
            self.fixed(tid, f"{path.name} holds model_weights_id {weights_id!r}: named after it")
        if entry is None:
            mel = info.max_episode_length if info.max_episode_length is not None else info.shape[0]
            info = trajfile.TrajectoryInfo(info.shape, mel, weights_id)
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
        if kept.get("file_bytes") not in (None, path.stat().st_size):
            kept.pop("file_bytes")
        return kept

    def drop(self, tid: int, file: str | None, reason: str) -> None:
        self.result.dropped.append({"trajectory_id": tid, "file": file, "reason": reason})

    # ---------------------------------------------------------------- plan
    def plan(self, progress: Progress | None) -> RepairedCheckpoint:
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
        for tid in ids:
            entry = entries.get(tid)
            chosen = self.choose_file(tid, entry, fmt)
            if chosen is None:
                expected = trajectory_file_name(tid, entry["model_weights_id"], fmt) if entry else None
                self.drop(tid, expected, "file missing")
            else:
                kept = self.check_file(tid, chosen, entry)
                if kept is not None:
                    index.entries[tid] = kept
                    index.id_list.append(tid)
                    self.result.sources[tid] = chosen
            if progress is not None:
                progress(1)
        index.trajectory_counter = max(counter, max(ids, default=-1) + 1)
        self.result.index = index
        return self.result


def plan_repair(source: str | os.PathLike[str], out: str | os.PathLike[str] = "") -> RepairedCheckpoint:
    """What repairing one checkpoint directory would write, without writing anything."""
    return _Planner(Path(source), Path(out)).plan(None)


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
) -> RepairResult:
    """Write a consistent copy of the checkpoint at `path` (or of each of its rank_* checkpoints) to `out`.

    A folder of rank_* directories gives `out/rank_<r>` for each. The source is never modified.
    """
    source, target = Path(path), Path(out)
    _refuse_overlap(source, target)
    dirs = checkpoint_dirs(source)
    single = dirs == [source]
    plans = [_Planner(d, target if single else target / d.name).plan(progress) for d in dirs]
    result = RepairResult(source, target, plans)
    with staged_dir(target, overwrite=overwrite) as staging:
        for plan in plans:
            directory = staging if single else staging / plan.source.name
            directory.mkdir(exist_ok=True)
            result.report.add(fill_dir(directory, plan.index, plan.sources.__getitem__, None))
    return result


__all__ = ["RepairResult", "RepairedCheckpoint", "plan_repair", "repair"]
