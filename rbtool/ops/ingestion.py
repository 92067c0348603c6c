"""Add trajectory files to a buffer directory (auto_save on), continuing its ids.

Every source is opened and checked before anything is written. Files already in the
buffer's format are then placed: a checkpoint's files reflinked or hard-linked, loose files
copied (a reflink is a copy too) unless linking is asked for. The index is published after
every batch (of `batch_size` files or `batch_seconds`, and at least an eighth of the
trajectories listed), so an interruption leaves a valid directory holding every batch
reported as added.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from rbtool.errors import CheckpointError, RbtoolError, UsageError
from rbtool.files import ptbulk, trajfile
from rbtool.files.dirs import open_checkpoint
from rbtool.files.fsutil import LOCK_FILE, make_parents, refuse_file_parent
from rbtool.files.index import Index, init_buffer_dir, read_index
from rbtool.files.sources import Checked, Item, Skipped, check_item, collect_sources
from rbtool.files.writer import BufferWriter, WriteReport, new_entry, record_schema
from rbtool.format import (
    FORMATS,
    INDEX_FILE,
    INT64_LIMIT,
    METADATA_FILE,
    is_checkpoint_dir,
    parse_trajectory_file_name,
)

_TEMP_RE = re.compile(r"^\.trajectory_.*\.tmp$")
# Publishing writes the whole index, which grows with the buffer: a batch is published only
# once it holds at least this fraction of the trajectories listed, so that all the index
# writes of an ingest add up to a few times the last one whatever the buffer's size (a
# million-entry index takes seconds to write; one every 64 files made ingest quadratic).
PUBLISH_FRACTION = 1 / 8


@dataclass
class IngestResult:
    """What an ingest added."""

    buffer: Path
    added_ids: list[int] = field(default_factory=list)
    index: Index = field(default_factory=Index)
    report: WriteReport = field(default_factory=WriteReport)
    removed_leftovers: list[str] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)  # not trajectories, or already there
    duplicates: int = 0  # trajectories skipped because the buffer already holds them


def remove_uncommitted(directory: Path, index: Index) -> list[str]:
    """Delete what an interrupted writer left: temporary files and unlisted files with id >= counter."""
    listed = {index.file_name(i) for i in index.id_list}
    removed = []
    for path in directory.iterdir():
        name = path.name
        parsed = parse_trajectory_file_name(name)
        leftover = bool(_TEMP_RE.match(name)) or (
            parsed is not None and name not in listed and parsed[0] >= index.trajectory_counter
        )
        if leftover and path.is_file():
            path.unlink(missing_ok=True)
            removed.append(name)
    return removed


def _first_missing(directory: Path) -> Path | None:
    """The outermost of `directory` and its parents that does not exist yet (None if it exists)."""
    missing = None
    for path in (directory, *directory.parents):
        if path.exists():
            break
        missing = path
    return missing


@contextlib.contextmanager
def _remove_if_failed_new(directory: Path, created: Path | None) -> Iterator[None]:
    """Remove the directories this call created if it fails before publishing anything."""
    try:
        yield
    except BaseException:
        untouched = {LOCK_FILE, METADATA_FILE, INDEX_FILE}
        if (
            created is not None
            and {p.name for p in directory.iterdir()} <= untouched
            and _is_empty(directory)
        ):
            for name in untouched:
                (directory / name).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                for path in (directory, *directory.parents):
                    path.rmdir()
                    if path == created:
                        break
        raise


def _is_empty(directory: Path) -> bool:
    try:
        return not read_index(directory).id_list
    except RbtoolError:
        return False


CHECK_BATCH = 1024  # sources read and checked together (their headers compared at once)


def _checked(items: Sequence[Item]) -> Iterator[tuple[Item, Checked, str]]:
    """Each source checked, with its sha256 (its recorded one when the size still matches), in
    order; the first source that fails raises its error, as checking them one by one does.

    A file is read once: its bytes are hashed and its header read from them. Small `.pt` files
    are read a batch at a time and their headers read together (rbtool.files.ptbulk: files of
    one layout compared with a template, not parsed one by one), read_header's verdicts."""
    templates: dict[int, ptbulk.Template | None] = {}
    for lo in range(0, len(items), CHECK_BATCH):
        part = items[lo : lo + CHECK_BATCH]
        read = [_read_for_check(item) for item in part]
        small = [k for k, (data, _, _) in enumerate(read) if _bulk_header(part[k], data)]
        headers: dict[int, Any] = {}
        if small:
            found = ptbulk.read_headers(
                [part[k].path for k in small], [cast(bytes, read[k][0]) for k in small], templates
            )
            headers = dict(zip(small, found, strict=True))
        for k, item in enumerate(part):
            data, digest, failed = read[k]
            if failed is not None:
                raise failed
            ready = check_item(item, data, header=headers.get(k))
            if digest is None:
                digest = trajfile.sha256_bytes(data) if data is not None else trajfile.sha256_file(item.path)
            yield item, ready, digest


def _read_for_check(item: Item) -> tuple[bytes | None, str | None, RbtoolError | None]:
    """(the file's bytes when they are read, its recorded sha256 when it is taken, the read's
    error): a file whose recorded hash still holds is read only when it is a small `.pt`."""
    entry = item.entry
    try:
        size = item.path.stat().st_size
        if entry is not None and entry.get("sha256") and entry.get("file_bytes") == size:
            small = item.path.suffix == ".pt" and size <= ptbulk.BULK_FILE_BYTES
            return (trajfile.read_file_bytes(item.path) if small else None), str(entry["sha256"]), None
        return trajfile.read_file_bytes(item.path), None, None
    except OSError:
        return None, None, None  # check_item names the problem, as it did alone
    except RbtoolError as exc:
        return None, None, exc


def _bulk_header(item: Item, data: bytes | None) -> bool:
    return data is not None and item.path.suffix == ".pt" and 0 < len(data) <= ptbulk.BULK_FILE_BYTES


def _identities(index: Index) -> tuple[dict[str, int], dict[str, int]]:
    """What the buffer already holds: uuid -> id, and content hash -> id (its files' and sources')."""
    uuids: dict[str, int] = {}
    hashes: dict[str, int] = {}
    for tid in index.id_list:
        entry = index.entries[tid]
        if entry.get("uuid"):
            uuids.setdefault(entry["uuid"], tid)
        for key in ("sha256", "source_sha256"):
            if entry.get(key):
                hashes.setdefault(entry[key], tid)
    return uuids, hashes


def _already_held(
    source_uuid: str | None, digest: str, uuids: dict[str, int], hashes: dict[str, int]
) -> int | None:
    """The id under which the buffer holds this trajectory already, or None."""
    if source_uuid is not None and source_uuid in uuids:
        return uuids[source_uuid]
    return hashes.get(digest)


def _admit(
    item: Item,
    ready: Checked,
    digest: str,
    index: Index,
    known: tuple[dict[str, int], dict[str, int]],
    allow_duplicates: bool,
    result: IngestResult,
) -> int | None:
    """Give a checked source its id and entry in `index` (not yet listed), or skip it as held already."""
    uuids, hashes = known
    source_uuid = item.entry.get("uuid") if item.entry else None
    held = _already_held(source_uuid, digest, uuids, hashes)
    if held is not None and not allow_duplicates:
        result.skipped.append(Skipped(item.path, f"already in the buffer as id {held}"))
        result.duplicates += 1
        return None
    tid = index.trajectory_counter
    if tid + 1 >= INT64_LIMIT:  # the counter after it would pass 2**63 - 1, which no reader takes
        raise CheckpointError(
            f"{result.buffer}: trajectory_counter {tid} leaves no id for {item.path}: ids and the counter "
            "stay below 2**63 - 1; ingest into a new buffer"
        )
    # a source's uuid is kept (so it is known next time), unless the buffer has it already
    kept = source_uuid if isinstance(source_uuid, str) and source_uuid not in uuids else None
    entry = new_entry(tid, ready.info, kept or uuid.uuid4().hex)
    record_schema(index, entry, ready.schema, ready.schema_digest)
    index.entries[tid] = entry
    uuids[entry["uuid"]] = tid
    hashes.setdefault(digest, tid)
    return tid


def _target_index(directory: Path, trajectory_format: str | None) -> Index:
    """The index an ingest adds to: the buffer directory's, in its own format, or a new one's."""
    if not is_checkpoint_dir(directory):
        return Index(trajectory_format=trajectory_format or "pt")
    _, index = open_checkpoint(directory, strict=True)
    _refuse_other_format(directory, index, trajectory_format)
    return index


def _plan(
    sources: Sequence[str | os.PathLike[str]],
    directory: Path,
    trajectory_format: str | None,
    recursive: bool,
    allow_duplicates: bool,
    on_checked: Callable[[int], None] | None,
) -> IngestResult:
    """What an ingest would add, every source checked as a real one checks it; nothing is written."""
    refuse_file_parent(directory)
    index = _target_index(directory, trajectory_format)
    result = IngestResult(directory, index=index)
    collected = collect_sources(sources, recursive=recursive, exclude=[Path(os.path.realpath(directory))])
    result.skipped.extend(collected.skipped)
    known = _identities(index)
    for item, ready, digest in _checked(collected.items):
        if on_checked is not None:
            on_checked(1)
        tid = _admit(item, ready, digest, index, known, allow_duplicates, result)
        if tid is not None:
            index.id_list.append(tid)
            index.trajectory_counter = tid + 1
            result.added_ids.append(tid)
    return result


def _refuse_other_format(directory: Path, index: Index, trajectory_format: str | None) -> None:
    if trajectory_format is not None and trajectory_format != index.trajectory_format:
        raise UsageError(
            f"{directory}: holds {index.trajectory_format} files; cannot ingest as {trajectory_format}"
        )


def _remove_unlisted(directory: Path, index: Index, ids: list[int]) -> None:
    """Remove the files of `ids` that the directory's index on disk does not list: an interrupted
    batch's, placed (or being placed) but never published. An interrupt can also land after a
    batch's index is written and before the batch is forgotten, so the index on disk decides;
    when it cannot be read, nothing is removed (a stray file is safer than a listed one gone)."""
    try:
        listed = set(read_index(directory).id_list)
    except RbtoolError:
        return
    for tid in ids:
        if tid not in listed:
            (directory / index.file_name(tid)).unlink(missing_ok=True)


def _publish(writer: BufferWriter, index: Index, batch: list[int], result: IngestResult) -> list[int]:
    """Write the index listing `batch`; from then on its files belong to the directory."""
    writer.publish(index)
    result.added_ids.extend(batch)
    return batch


def ingest(
    sources: Sequence[str | os.PathLike[str]],
    buffer_dir: str | os.PathLike[str],
    *,
    trajectory_format: str | None = None,
    batch_size: int = 64,
    batch_seconds: float = 0.5,
    on_wait: Callable[[str], None] | None = None,
    on_checked: Callable[[int], None] | None = None,
    on_published: Callable[[list[int]], None] | None = None,
    recursive: bool = False,
    allow_duplicates: bool = False,
    link: bool | None = None,
    dry_run: bool = False,
) -> IngestResult:
    """Add the trajectories of `sources` (files, folders of files, checkpoints) to `buffer_dir`.

    A new directory gets `trajectory_format` (default pt); an existing one keeps its own and
    a differing `trajectory_format` is an error. `on_published` receives the ids of each batch
    once the index that lists them is on disk.

    Ingest is idempotent: a trajectory the buffer already holds (the same content, or the
    same uuid when it comes from a checkpoint) is skipped and counted, so re-running an
    interrupted ingest adds only what is missing; `allow_duplicates` adds it again. The
    buffer itself is never a source. Folders are walked in natural order (`t2` before
    `t10`), their subfolders too with `recursive`; whatever is passed over is in `skipped`.

    How files are placed: by default a checkpoint's files (a buffer, checkpoint or rank
    tree given as a source, or met in a walked folder) may be hard-linked, while loose files
    are copied, since whoever wrote them may write them again in place. `link` True links
    loose files too; `link` False links nothing. A reflink (copy-on-write clone) is used
    wherever the file system can, since it is a file of its own.

    With `dry_run` every source is checked and the ids it would get are worked out, but
    nothing is created, written or removed (the result's report counts no file).
    """
    directory = Path(buffer_dir)
    buffer_real = Path(os.path.realpath(directory))
    for source in sources:
        real = Path(os.path.realpath(source))
        if real == buffer_real or buffer_real in real.parents:
            raise UsageError(
                f"{source}: is the buffer directory {directory} (or inside it); it cannot be its own source"
            )
    if trajectory_format is not None and trajectory_format not in FORMATS:
        raise UsageError(f"format must be 'pt' or 'pkl', got {trajectory_format!r}")
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"{directory}: exists and is not a directory; choose a directory path")
    if dry_run:
        return _plan(sources, directory, trajectory_format, recursive, allow_duplicates, on_checked)
    created = _first_missing(directory)
    make_parents(directory)
    # A new directory appears with an empty index and metadata at once (built aside, renamed).
    init_buffer_dir(directory, Index(trajectory_format=trajectory_format or "pt"))
    with (
        BufferWriter(directory, wait=True, on_wait=on_wait) as writer,
        _remove_if_failed_new(directory, created),
    ):
        index = _target_index(directory, trajectory_format)
        result = IngestResult(directory, index=index)
        result.removed_leftovers = remove_uncommitted(directory, index)

        collected = collect_sources(sources, recursive=recursive, exclude=[buffer_real])
        result.skipped.extend(collected.skipped)
        checked = []
        for one in _checked(collected.items):
            checked.append(one)
            if on_checked is not None:
                on_checked(1)
        known = _identities(index)

        batch: list[int] = []  # ids whose files may be in the directory but not in its index yet
        last_publish = time.monotonic()
        try:
            for item, ready, digest in checked:
                tid = _admit(item, ready, digest, index, known, allow_duplicates, result)
                if tid is None:
                    continue
                batch.append(tid)  # before its file is placed: an interrupt from here on removes it
                entry = index.entries[tid]
                linked = item.entry is not None if link is None else link  # from a checkpoint?
                writer.place(ready.path, index.file_name(tid), entry, result.report, link=linked)
                if "sha256" not in entry and ready.path.suffix == f".{index.trajectory_format}":
                    entry["sha256"] = digest  # the file is the source's bytes
                elif entry.get("sha256") != digest:
                    entry["source_sha256"] = digest  # rewritten: remember what it came from
                index.id_list.append(tid)
                index.trajectory_counter = tid + 1
                due = len(batch) >= batch_size or time.monotonic() - last_publish >= batch_seconds
                if due and len(batch) >= PUBLISH_FRACTION * len(index.id_list):
                    published, batch = _publish(writer, index, batch, result), []
                    if on_published is not None:
                        on_published(published)
                    last_publish = time.monotonic()
            if batch:
                published, batch = _publish(writer, index, batch, result), []
                if on_published is not None:
                    on_published(published)
        except BaseException:
            _remove_unlisted(directory, index, batch)
            raise
    return result
