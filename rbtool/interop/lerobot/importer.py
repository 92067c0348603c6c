"""Import: a LeRobot dataset into a buffer directory, created if needed and locked, published
in batches; a failed import leaves the directory as it was, an interrupted one keeps its
published batches and a rerun goes on from them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rbtool.errors import CheckpointError, RbtoolError, UsageError
from rbtool.files import trajfile
from rbtool.files.dirs import open_checkpoint
from rbtool.files.fsutil import make_parents, refuse_file_parent, write_bytes_atomic
from rbtool.files.index import Index, init_buffer_dir, read_index
from rbtool.files.writer import BufferWriter, new_entry
from rbtool.format import check_weights_id, is_checkpoint_dir
from rbtool.format.layout import with_stored_defaults
from rbtool.interop.lerobot.episodes import episodes_as_trajectories
from rbtool.interop.lerobot.extras import require_arrow
from rbtool.interop.lerobot.features import view_fields
from rbtool.interop.lerobot.limits import ID_LIMIT
from rbtool.interop.lerobot.reader import LeRobotSource
from rbtool.interop.lerobot.rebuild import rebuild
from rbtool.interop.lerobot.results import ImportResult
from rbtool.interop.lerobot.sidecar import trajectory_digest
from rbtool.progress import Progress


def count_units(
    source: str | os.PathLike[str], *, episodes: Sequence[int] | None = None, use_sidecar: bool = True
) -> int:
    """How many trajectories an import of `source` writes (for a progress total)."""
    dataset = LeRobotSource(source)
    sidecar = dataset.sidecar() if use_sidecar and episodes is None else None
    if sidecar is not None:
        return len(sidecar.get("trajectories", []))
    if episodes is not None:
        return len(episodes)
    return int(dataset.info.get("total_episodes") or 0)


def _check_target(directory: Path, trajectory_format: str | None) -> None:
    """Refuse a trajectory format other than pt or pkl, and a buffer path that is not a directory."""
    if trajectory_format is not None and trajectory_format not in ("pt", "pkl"):
        raise UsageError(f"format must be 'pt' or 'pkl', got {trajectory_format!r}")
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"{directory}: exists and is not a directory; choose a directory path")


@contextlib.contextmanager
def _target(
    directory: Path, trajectory_format: str | None, on_wait: Callable[[str], None] | None
) -> Iterator[tuple[BufferWriter, Index, bool]]:
    """The buffer directory, created if needed and locked: (writer, its index, whether it is new).

    A directory this call created is removed again if the call fails (interrupted, only if
    nothing was published).
    """
    _check_target(directory, trajectory_format)
    created = None
    for path in (directory, *directory.parents):
        if path.exists():
            break
        created = path
    try:
        make_parents(directory)
        init_buffer_dir(directory, Index(trajectory_format=trajectory_format or "pt"))
        with BufferWriter(directory, wait=True, on_wait=on_wait) as writer:
            _, index = open_checkpoint(directory, strict=True)
            yield writer, index, created is not None
    except Exception:
        if created is not None:  # a failed import leaves nothing of what it created
            shutil.rmtree(created, ignore_errors=True)
        raise
    except BaseException:
        if created is not None:
            with contextlib.suppress(RbtoolError, OSError):
                if not read_index(directory).id_list:
                    shutil.rmtree(created, ignore_errors=True)
        raise


class _NoWriter:
    """What a dry-run import writes through: nothing."""

    def place(self, *args: Any, **kwargs: Any) -> None:
        pass

    def publish(self, index: Index) -> None:
        pass


@contextlib.contextmanager
def _dry_target(directory: Path, trajectory_format: str | None) -> Iterator[tuple[Any, Index, bool]]:
    """_target without creating, locking or writing anything: (a writer that writes nothing, index, new)."""
    _check_target(directory, trajectory_format)
    refuse_file_parent(directory)
    if is_checkpoint_dir(directory):
        _, index = open_checkpoint(directory, strict=True)
        yield _NoWriter(), index, False
    else:
        yield _NoWriter(), Index(trajectory_format=trajectory_format or "pt"), not directory.exists()


def import_lerobot(
    source: str | os.PathLike[str],
    buffer_dir: str | os.PathLike[str],
    *,
    episodes: Sequence[int] | None = None,
    field_map: dict[str, str] | None = None,
    drop: Sequence[str] = (),
    use_sidecar: bool = True,
    model_weights_id: str | None = None,
    trajectory_format: str | None = None,
    batch_size: int = 64,
    on_wait: Callable[[str], None] | None = None,
    progress: Progress | None = None,
    on_published: Callable[[list[int]], None] | None = None,
    dry_run: bool = False,
) -> ImportResult:
    """Add the episodes of the LeRobot dataset at `source` to the buffer directory `buffer_dir`.

    A dataset rbtool exported (it has the sidecar) is rebuilt trajectory by trajectory, every
    tensor as it was; into a new or empty buffer directory it keeps its ids, counter, seed
    and metadata. Any other dataset, or a selection of `episodes`, or `use_sidecar=False`,
    gives one trajectory per episode with B = 1 (see docs/lerobot.md for the fields).
    `field_map` maps feature names to dotted buffer fields; `drop` leaves features out.
    With `dry_run` every episode is read and given its id as a real import would, but nothing
    is created, locked or written (`on_published` is not called).
    """
    require_arrow()
    dataset = LeRobotSource(source)
    directory = Path(buffer_dir)
    sidecar = dataset.sidecar() if use_sidecar and episodes is None and not field_map and not drop else None
    if model_weights_id is not None:
        check_weights_id(model_weights_id, "model_weights_id")
    result = ImportResult(directory, dataset.root, dataset.version, "rbtool" if sidecar else "episodes")
    # Everything the dataset can be refused for before decoding is refused here, before the
    # buffer directory is created, locked or written.
    if sidecar is not None:
        items = rebuild(dataset, sidecar)
        for name, c in sidecar["columns"].items():
            result.fields.update(view_fields(name, c["path"], int(c.get("views") or 0)))
    else:
        items = episodes_as_trajectories(dataset, episodes, field_map or {}, drop, model_weights_id, result)
    before = None if dry_run else _BufferState.capture(directory)
    target = (
        _dry_target(directory, trajectory_format)
        if dry_run
        else _target(directory, trajectory_format, on_wait)
    )
    with target as (writer, index, is_new):
        result.index = index
        batch: list[int] = []
        try:
            _import_items(
                items,
                sidecar,
                directory,
                writer,
                index,
                is_new,
                trajectory_format,
                batch,
                result,
                progress=progress,
                on_published=on_published,
                dry_run=dry_run,
                batch_size=batch_size,
            )
        except Exception:
            # A bad dataset found while decoding: the buffer goes back to what it was.
            if before is not None:
                before.restore(directory, [*result.added_ids, *batch], index)
            result.added_ids.clear()
            raise
        except BaseException:
            # Interrupted (Ctrl-C): the published batches stay, and a rerun goes on from them;
            # files of the unpublished batch are not in the on-disk index: remove them.
            for tid in batch:
                (directory / index.file_name(tid)).unlink(missing_ok=True)
            raise
    if sidecar:
        result.episodes = sum(int(r.get("episodes", [0, 0])[1]) for r in sidecar["trajectories"])
    return result


class _BufferState:
    """What a buffer directory held before an import: its index, metadata and lock file, so a
    failed import puts them back (and removes what it created) as they were."""

    NAMES = ("trajectory_index.json", "trajector_index.json", "metadata.json", ".rbtool.lock")

    def __init__(self, existed: bool, files: dict[str, bytes | None]) -> None:
        self.existed = existed
        self.files = files

    @classmethod
    def capture(cls, directory: Path) -> _BufferState:
        files: dict[str, bytes | None] = {}
        existed = directory.is_dir() and not directory.is_symlink()
        for name in cls.NAMES:
            path = directory / name
            try:
                files[name] = (
                    path.read_bytes() if existed and path.is_file() and not path.is_symlink() else None
                )
            except OSError:
                files[name] = None
        return cls(existed, files)

    def restore(self, directory: Path, added: Sequence[int], index: Index) -> None:
        """Remove the files of `added`, then put the index and metadata back (or remove them)."""
        if not self.existed:
            return  # _target removes the directory it created
        with contextlib.suppress(OSError):
            for tid in added:
                (directory / index.file_name(tid)).unlink(missing_ok=True)
            for name, data in self.files.items():
                path = directory / name
                if name == ".rbtool.lock":
                    if data is None:
                        path.unlink(missing_ok=True)  # it is held: no one else can be writing
                    continue
                if data is None:
                    path.unlink(missing_ok=True)
                elif not path.is_file() or path.read_bytes() != data:
                    write_bytes_atomic(path, data)


def _import_items(
    items: Iterator[tuple[dict[str, Any], dict[str, Any] | None, int]],
    sidecar: dict[str, Any] | None,
    directory: Path,
    writer: Any,
    index: Index,
    is_new: bool,
    trajectory_format: str | None,
    batch: list[int],
    result: ImportResult,
    *,
    progress: Progress | None,
    on_published: Callable[[list[int]], None] | None,
    dry_run: bool,
    batch_size: int,
) -> None:
    """Write the trajectories of `items` into the buffer, publishing every `batch_size`."""
    if trajectory_format is not None and not is_new and trajectory_format != index.trajectory_format:
        raise UsageError(
            f"{directory}: holds {index.trajectory_format} files; cannot import as {trajectory_format}"
        )
    counter = 0
    resumed: set[int] = set()
    if sidecar is not None:
        # Into a buffer that never assigned an id, the export comes back as it was; into
        # one an interrupted import of it left (its first ids, same entries), it goes on.
        ckpt = sidecar["checkpoint"]
        resumed = _resumed_ids(directory, index, sidecar)
        if (not index.id_list and index.trajectory_counter == 0) or resumed:
            index.seed = ckpt.get("seed")
            index.extra_metadata = dict(ckpt.get("extra_metadata") or {})
            if is_new and trajectory_format is None:
                index.trajectory_format = ckpt.get("trajectory_format") or "pt"
            result.kept_ids = True
            counter = int(ckpt.get("trajectory_counter") or 0)

    def publish() -> None:
        writer.publish(index)
        result.added_ids.extend(batch)
        if on_published is not None and batch and not dry_run:
            on_published(list(batch))
        batch.clear()

    for traj, entry, frames in items:
        if result.kept_ids and entry is not None and int(entry["trajectory_id"]) in resumed:
            result.skipped += 1
            if progress is not None:
                progress(1)
            continue
        if entry is not None:
            # An exported trajectory: its entry comes back (sizes, hashes and a link's
            # identity describe a file, and are the new file's).
            tid = int(entry["trajectory_id"]) if result.kept_ids else index.trajectory_counter
            new = {k: v for k, v in entry.items() if k not in ("file_bytes", "sha256", "link")}
            new["trajectory_id"] = tid
            if not result.kept_ids or not new.get("uuid"):
                new["uuid"] = uuid.uuid4().hex
        else:
            tid = index.trajectory_counter
            traj, info = trajfile.normalize(traj, f"{result.dataset}: episode as trajectory {tid}")
            new = new_entry(tid, info, uuid.uuid4().hex)
        if tid >= ID_LIMIT - 1:
            raise CheckpointError(f"{directory}: trajectory id {tid} would pass 2**63 - 1")
        if tid in index.entries:
            raise CheckpointError(f"{directory}: already lists trajectory id {tid}")
        index.entries[tid] = new
        writer.place(traj, index.file_name(tid), new, result.report)
        index.id_list.append(tid)
        index.trajectory_counter = max(index.trajectory_counter, tid + 1)
        batch.append(tid)
        result.frames += frames
        if progress is not None:
            progress(1)
        if len(batch) >= batch_size:
            publish()
    index.trajectory_counter = max(index.trajectory_counter, counter)
    if batch or result.kept_ids:
        publish()


def _resumed_ids(directory: Path, index: Index, sidecar: dict[str, Any]) -> set[int]:
    """The ids an interrupted import of this export left in `index` (empty if it is not one).

    Such a buffer lists a prefix of the export's ids, each with the exported entry (sizes,
    hashes and uuids aside) and the exported content (its digest), and the export's seed.
    """
    ckpt = sidecar.get("checkpoint") or {}
    ids = list(ckpt.get("trajectory_id_list") or [])
    done = index.id_list
    if not done or done != ids[: len(done)] or index.seed != ckpt.get("seed"):
        return set()
    records = {int(r["trajectory_id"]): r for r in sidecar.get("trajectories", [])}
    hints = ("uuid", "file_bytes", "sha256", "link")
    for tid in done:
        mine = {k: v for k, v in index.entries[tid].items() if k not in hints}
        theirs = {k: v for k, v in (records.get(tid, {}).get("entry") or {}).items() if k not in hints}
        if mine != theirs:
            return set()
    for tid in done:  # entries alike: the contents decide
        name = index.file_name(tid)
        if trajectory_digest(
            with_stored_defaults(trajfile.load(directory / name, mmap=True), name)
        ) != records[tid].get("digest"):
            return set()
    return set(done)
