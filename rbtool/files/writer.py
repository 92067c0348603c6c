"""The writer side: placing trajectory files, publishing a directory, the auto-save thread.

Publish order is always the same: trajectory files first (each atomically), then the
index, then metadata (rbtool.files.index.write_index), so a reader never meets an index naming
a file that is missing or partly written. The buffer's auto-save and `ingest` both write
through here, holding the directory's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rbtool.errors import RbtoolError, UsageError
from rbtool.files import trajfile
from rbtool.files.fsutil import DirLock, check_target, link_or_copy, staged_dir, write_bytes_atomic
from rbtool.files.index import Index, balanced_blocks, dumps, rank_bounds, write_index
from rbtool.format import MERGE_MAP_FILE
from rbtool.format.layout import TrajectoryInfo, schema_digest
from rbtool.format.ranknames import rank_dir_name
from rbtool.progress import Progress, start_phase

if TYPE_CHECKING:
    from rbtool.files.dirs import CheckpointView

Source = Path | dict[str, Any]


@dataclass
class WriteReport:
    """What writing a set of trajectory files did."""

    reflinked: int = 0  # copy-on-write clones: files of their own that share no writes
    linked: int = 0  # hard links: the same file as the source (the entry records its identity)
    copied: int = 0
    written: int = 0  # serialized (another format, or a trajectory held in memory)
    bytes: int = 0

    def add(self, other: WriteReport) -> None:
        self.reflinked += other.reflinked
        self.linked += other.linked
        self.copied += other.copied
        self.written += other.written
        self.bytes += other.bytes

    def as_json(self) -> dict[str, int]:
        return {
            "reflinked": self.reflinked,
            "linked": self.linked,
            "copied": self.copied,
            "written": self.written,
            "bytes": self.bytes,
        }


def adopt_files(
    writer: AutoSaveWriter, target_dir: Path, index: Index, files: dict[int, Path], held: Iterable[Path]
) -> dict[int, Path]:
    """auto_save on: bring a loaded checkpoint's files (`files`) into the auto-save directory
    `target_dir`, publish its index there, and remove the files it held before (`held`) that
    the load does not list; where each file is now."""
    placed: dict[int, Path] = {}
    report = WriteReport()
    for tid, src in files.items():
        dst = target_dir / index.file_name(tid)
        place_trajectory(src, dst, index.entries[tid], report)
        placed[tid] = dst
    writer.publish(index)
    keep = set(placed.values())
    for path in held:
        if path.parent == target_dir and path not in keep:
            path.unlink(missing_ok=True)
    return placed


def place_trajectory(
    src: Source, dst: Path, entry: dict[str, Any], report: WriteReport, *, link: bool = True
) -> None:
    """Put one trajectory at `dst` (reflink, hard link, copy or serialize); record its size/hash in `entry`.

    With `link` False the file is never a hard link of its source: a reflink or a copy.
    """
    fmt = dst.suffix[1:]
    if isinstance(src, Path) and src.suffix == dst.suffix:
        how = link_or_copy(src, dst, link=link)
        info = dst.stat()
        size = info.st_size
        if entry.get("file_bytes") not in (None, size):
            entry.pop("sha256", None)  # the recorded hash was of another file
        entry["file_bytes"] = size
        if how == "link":
            # a hard link shares its bytes with the source: record the inode's identity, so
            # that a write through either name (in place) is seen by a plain verify
            entry["link"] = {"inode": info.st_ino, "size": size, "mtime_ns": info.st_mtime_ns}
            report.linked += 1
        else:
            entry.pop("link", None)  # a reflink or a copy is a file of its own
            report.reflinked += how == "reflink"
            report.copied += how == "copy"
        report.bytes += size
        return
    traj = trajfile.load(src) if isinstance(src, Path) else src
    data = trajfile.to_bytes(traj, fmt)
    write_bytes_atomic(dst, data, sync_dir=False)
    entry["file_bytes"] = len(data)
    entry["sha256"] = trajfile.sha256_bytes(data)
    entry.pop("link", None)  # a file of its own
    report.written += 1
    report.bytes += len(data)


def fill_dir(
    directory: Path,
    index: Index,
    source_of: Callable[[int], Source],
    progress: Progress | None,
    *,
    link: bool | Callable[[int], bool] = True,
) -> WriteReport:
    """Place every listed trajectory into `directory` and write its index and metadata.

    With `link` False no file is a hard link of its source (see place_trajectory); a function
    of the id says it per trajectory.
    """
    report = WriteReport()
    for tid in index.id_list:
        dst = directory / index.file_name(tid)
        linked = link(tid) if callable(link) else link
        place_trajectory(source_of(tid), dst, index.entries[tid], report, link=linked)
        if progress is not None:
            progress(1)
    write_index(directory, index)
    return report


@dataclass(frozen=True)
class OutputDir:
    """One checkpoint directory of an output: where it goes (`.`, the output itself, or a rank
    directory), the index it lists, and where each listed trajectory comes from."""

    rel: str
    index: Index
    source_of: Callable[[int], Source]


@dataclass(frozen=True)
class Rules:
    """How a library writer treats its output: `overwrite` an existing one (only with something
    of its own kind), report `progress`, hard-link the sources' files (`link`: all, none, or by
    id; reflinks and copies otherwise), or with `dry_run` only check `out` and write nothing."""

    overwrite: bool = False
    progress: Progress | None = None
    link: bool | Callable[[int], bool] = True
    dry_run: bool = False


def write_output(
    out: Path,
    dirs: Sequence[OutputDir],
    rules: Rules = Rules(),
    *,
    renumbered: Mapping[int, dict[str, Any]] | None = None,
) -> WriteReport:
    """The library writers' one way out: every directory of `dirs` filled (fill_dir) in a staging
    directory published at `out` at once, or, with `dry_run`, nothing written and `out` only
    checked as publishing would check it (the report is empty).

    With `renumbered` (the merge map of a rank tree whose ids were renumbered, by new id) each
    directory records its ids' part of it in `merge_map.json` (SPEC §4).
    """
    report = WriteReport()
    if rules.dry_run:
        check_target(out, overwrite=rules.overwrite)
        return report
    progress = rules.progress
    start_phase(progress, sum(d.index.size for d in dirs), "placing trajectory files")
    with staged_dir(out, overwrite=rules.overwrite) as staging:
        for d in dirs:
            directory = staging / d.rel
            directory.mkdir(exist_ok=True)
            report.add(fill_dir(directory, d.index, d.source_of, progress, link=rules.link))
            if renumbered is not None:
                part = [renumbered[i] for i in d.index.id_list]
                write_bytes_atomic(directory / MERGE_MAP_FILE, dumps({"renumbered": part}))
    return report


def write_checkpoint(
    out: Path,
    index: Index,
    source_of: Callable[[int], Source],
    rules: Rules = Rules(),
    *,
    renumbered: Mapping[int, dict[str, Any]] | None = None,
) -> WriteReport:
    """Write a checkpoint listing `index` at `out`, published atomically.

    `source_of(id)` gives the trajectory's current file or its dict. Entries are updated
    in place with each written file's size and hash, so pass a copy you may change. With
    `link` False no file is a hard link of its source; `renumbered` and `dry_run` as for
    write_output.
    """
    return write_output(out, [OutputDir(".", index, source_of)], rules, renumbered=renumbered)


def rank_layout(
    rank: int, world_size: int, split: str, source: Index, source_world_size: int
) -> dict[str, Any]:
    """The `shard` metadata key of a rank directory: the layout it was written for, and its source's."""
    return {
        "rank": rank,
        "world_size": world_size,
        "split": split,
        "source_world_size": source_world_size,
        "source_size": source.size,
        "source_total_samples": source.total_samples,
        "source_trajectory_counter": source.trajectory_counter,
    }


def rank_parts(index: Index, blocks: list[tuple[int, int]]) -> list[Index]:
    """Each rank's index for [start, end) blocks of the list: counter = the block's largest id + 1."""
    parts = []
    for start, end in blocks:
        ids = index.id_list[start:end]
        parts.append(copied_entries(index.subset(ids, trajectory_counter=max(ids, default=-1) + 1)))
    return parts


SPLITS = ("count", "samples")


def check_split(world_size: int, split: str = "count") -> None:
    """UsageError unless `world_size` is an integer >= 1 and `split` one of SPLITS."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"world_size must be an integer >= 1, got {world_size!r}")
    if split not in SPLITS:
        raise UsageError(f"split must be 'count' or 'samples', got {split!r}")


def split_blocks(index: Index, world_size: int, split: str = "count") -> list[tuple[int, int]]:
    """[start, end) of each rank's block of the list: by count (a distributed load's) or by samples."""
    check_split(world_size, split)
    if split == "count":
        return [rank_bounds(index.size, world_size, r) for r in range(world_size)]
    entries = index.entries
    return balanced_blocks([entries[i]["num_samples"] for i in index.id_list], world_size)


def split_ranks(index: Index, world_size: int, split: str, source_world_size: int) -> list[Index]:
    """Each output rank's index of `index` (a checkpoint, or a rank tree's merge of
    `source_world_size` ranks) cut into `world_size` blocks, each recording its layout in `shard`."""
    parts = rank_parts(index, split_blocks(index, world_size, split))
    for rank, part in enumerate(parts):
        part.extra_metadata = {"shard": rank_layout(rank, world_size, split, index, source_world_size)}
    return parts


def write_ranks(out: Path, parts: list[Index], view: CheckpointView, rules: Rules = Rules()) -> WriteReport:
    """Write `out/rank_r` for each part of `view`'s index, the whole tree published at once, each
    rank recording its part of the merge map when the view's ids were renumbered (`link` and
    `dry_run` as for write_output)."""
    dirs = [OutputDir(rank_dir_name(rank), part, view.file_of) for rank, part in enumerate(parts)]
    renumbered = None if rules.dry_run else view.merge_map()  # a dry run writes no map
    return write_output(out, dirs, rules, renumbered=renumbered)


def copied_entries(index: Index) -> Index:
    """A copy of `index` whose entries may be changed without touching the original."""
    sub = index.subset(index.id_list)
    sub.entries = {i: dict(e) for i, e in sub.entries.items()}
    return sub


def new_entry(tid: int, info: TrajectoryInfo, uuid_hex: str) -> dict[str, Any]:
    return {
        "num_samples": info.num_samples,
        "trajectory_id": tid,
        "max_episode_length": info.max_episode_length,
        "shape": list(info.shape),
        "model_weights_id": info.model_weights_id,
        "uuid": uuid_hex,
    }


def record_schema(
    index: Index, entry: dict[str, Any], fields: list[list[Any]] | None, digest: str | None = None
) -> None:
    """Name a trajectory's field schema in its entry, the schema itself in the index's table
    (`digest`: the schema's, when worked out already)."""
    if fields is None:
        return
    digest = schema_digest(fields) if digest is None else digest
    index.schemas.setdefault(digest, fields)
    entry["schema"] = digest


class BufferWriter:
    """Writes into a buffer directory it holds locked, always in the publish order.

    Trajectory files are placed first (each atomically), then `publish` writes the index
    that lists them, then the metadata. `ingest` writes through one of these; the buffer's
    auto-save through its threaded form, AutoSaveWriter. With `wait`, a directory another
    process holds is waited for (`on_wait` is told who holds it); else it is refused.
    """

    def __init__(
        self, directory: Path, *, wait: bool = False, on_wait: Callable[[str], None] | None = None
    ) -> None:
        self.directory = directory
        self._lock = DirLock(directory, wait=wait, on_wait=on_wait)
        self._lock.acquire()

    def place(
        self, src: Source, name: str, entry: dict[str, Any], report: WriteReport, *, link: bool = True
    ) -> Path:
        """Place one trajectory file (see place_trajectory) and record its size/hash in `entry`."""
        path = self.directory / name
        place_trajectory(src, path, entry, report, link=link)
        return path

    def write_file(self, name: str, data: bytes) -> Path:
        """One trajectory file's bytes, atomically (temporary name, then rename)."""
        path = self.directory / name
        write_bytes_atomic(path, data, sync_dir=False)
        return path

    def publish(self, index: Index) -> None:
        """Index, then metadata; every file they name must already be placed."""
        write_index(self.directory, index)

    def close(self) -> None:
        """Release the directory."""
        self._lock.release()

    def __enter__(self) -> BufferWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AutoSaveWriter(BufferWriter):
    """A BufferWriter whose writes run on one background thread, in submission order.

    A trajectory file job, then the publish job of the index that lists it: the published
    index only names complete files. The first failure is re-raised by flush().
    """

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, wait=False)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rbtool-writer")
        self._pending: list[Future[None]] = []
        self._guard = threading.Lock()
        self._broken: str | None = None  # why the first failed job failed

    def submit(self, job: Callable[[], None]) -> None:
        """Queue a job. Once a job has failed, later jobs do not run: an index published after
        a failed file write would name a file that is missing."""

        def guarded() -> None:
            if self._broken is not None:
                raise RbtoolError(f"not written: an earlier background write failed ({self._broken})")
            try:
                job()
            except BaseException as exc:
                self._broken = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise

        with self._guard:
            self._pending.append(self._executor.submit(guarded))

    def failed(self) -> bool:
        with self._guard:
            return any(f.done() and f.exception() is not None for f in self._pending)

    def flush(self) -> None:
        """Wait until every submitted job is done; re-raise the first that failed."""
        with self._guard:
            pending, self._pending = self._pending, []
        errors = []
        for fut in pending:
            try:
                fut.result()
            except BaseException as exc:  # collected and re-raised below
                errors.append(exc)
        if errors:
            raise RbtoolError(f"a background write to {self.directory} failed: {errors[0]}") from errors[0]

    def close(self, wait: bool = True) -> None:
        """Stop the thread (after its jobs when `wait`) and release the directory."""
        try:
            self._executor.shutdown(wait=wait)
        finally:
            super().close()
