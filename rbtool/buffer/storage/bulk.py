"""The window's sampled rows read into memory at once, so that a batch is one index_select per field.

A window of trajectories whose sampled rows fit the buffer's memory budget is read whole
when it is loaded: every trajectory's sampled fields flattened (done-like fields without
their bootstrap rows, SPEC §3 step 5) into one `[window samples, ...]` column per field,
what TorchRL's in-memory storage holds. Files are read in chunks, each file once, whole;
their headers come from ptbulk (files of one layout compared with a template, not
parsed one by one) and each layout's fields are cut out of all its files' bytes with a
few slices (`_Plan`), so a tiny file costs its read and not a Python round trip per field.

Anything this reader does not take on (a `.pkl` file, a field that is not contiguous, a
file that cannot be read or disagrees with its index entry) leaves the window to the
readers that read drawn rows only: they report the problem when the file is drawn, as
before, so holding rows never changes what sampling returns or raises.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import queue
import stat
import struct
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from operator import itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import rbtool.buffer.storage.helpread as helpread
from rbtool.buffer.rowmap import load_libc
from rbtool.buffer.storage.held import raw_layout
from rbtool.buffer.storage.view import FieldPath, FlatView, flat_rows
from rbtool.buffer.storage.window import Signature, new_columns, restacked, signature_of
from rbtool.errors import RbtoolError
from rbtool.files import ptbulk
from rbtool.format.bounded import gc_paused
from rbtool.progress import Progress

if TYPE_CHECKING:
    import torch

    from rbtool.buffer.storage.store import TrajectoryStore

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# Files are read and cut into columns this many bytes (or files) at a time.
CHUNK_BYTES = 16 << 20
CHUNK_FILES = 4096
# The helper processes take the ids in segments of this many, in turn.
SEGMENT_FILES = 4096
# A file larger than this is read on its own, not stacked with others of its size.
STACK_FILE_BYTES = ptbulk.BULK_FILE_BYTES

Spec = tuple[Any, tuple[int, ...]]  # (torch dtype, per-sample shape)


def default_hold_budget() -> int:
    """A quarter of the machine's physical memory (1 GiB where it cannot be read)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (ValueError, OSError, AttributeError):
        return 1 << 30


class _Giveup(Exception):
    """The window is left to the row readers (why is not reported: they report it when drawn)."""


class _Plan:
    """How the sampled fields of files of one header, [T, B] = [t, b], come out of their bytes:
    per field its (dtype, row shape) and the byte runs of the file its flat rows are, in order."""

    def __init__(self, header: dict[str, Any], where: str, t: int, b: int, extra_fields: bool) -> None:
        import torch

        self.rows = t * b
        self.fields: list[tuple[FieldPath, Spec, list[tuple[int, int]]]] = []
        for path, spec, extra in raw_layout(header, where, t, b, extra_fields):
            row_bytes = math.prod(spec.shape[2:]) * spec.itemsize
            start = spec.data_start
            if extra:  # epochs of 1 + T/E rows, the first of each a bootstrap row
                epoch = t // extra + 1
                runs = [
                    (start + (e * epoch + 1) * b * row_bytes, start + (e + 1) * epoch * b * row_bytes)
                    for e in range(extra)
                ]
            else:
                runs = [(start, start + t * b * row_bytes)]
            self.fields.append((path, (getattr(torch, spec.dtype), tuple(spec.shape[2:])), runs))


class Columns:
    """The window's columns as they are filled: one per field every trajectory so far holds
    with one (dtype, row shape); a field missing from a trajectory, or held with another
    spec, is dropped (it is not in the window's shared schema)."""

    def __init__(self, total_rows: int, budget: int) -> None:
        self.total_rows, self.budget = total_rows, budget
        self.columns: dict[FieldPath, torch.Tensor] = {}
        self.specs: dict[FieldPath, Spec] = {}
        self.at = 0  # rows filled
        self.started = False
        self._arrays: dict[FieldPath, Any] = {}
        self.populating: _Populator | None = None
        self.dropped = False  # a field was dropped after the columns were made

    def stop(self) -> None:
        if self.populating is not None:
            self.populating.stop()

    def begin(self, specs: dict[FieldPath, Spec]) -> None:
        """The next trajectory holds fields `specs`: keep only the columns it shares."""
        import torch

        if not self.started:
            self.started = True
            row_bytes = sum(math.prod(shape) * dtype.itemsize for dtype, shape in specs.values())
            if row_bytes * self.total_rows > self.budget:
                raise _Giveup
            self.specs = dict(specs)
            self.columns = new_columns(
                specs,
                self.total_rows,
                lambda shape, dtype, row_bytes: _huge(torch.empty(shape, dtype=dtype), row_bytes),
            )
            self.populating = _Populator(list(self.columns.values()))
            return
        for path in [p for p, spec in self.specs.items() if specs.get(p) != spec]:
            del self.specs[path], self.columns[path]
            self._arrays.pop(path, None)
            self.dropped = True

    def finish(self) -> None:
        """The columns are filled (the populating thread stopped): the rows of fields dropped
        along the way are let go."""
        if self.dropped:
            self.columns = restacked(self.columns, self.specs, self.at)
            self._arrays.clear()

    def numpy(self, path: FieldPath, rows: int) -> Any:
        """Rows `[at, at + rows)` of a column as a uint8 array of `[rows, row bytes]` (each
        column's array made once: a tensor's numpy view costs microseconds)."""
        import torch

        array = self._arrays.get(path)
        if array is None:
            column = self.columns[path]
            array = self._arrays[path] = column.view(torch.uint8).reshape(self.total_rows, -1).numpy()
        return array[self.at : self.at + rows]


def hold_window(
    store: TrajectoryStore,
    tids: Sequence[int],
    shapes_of: Callable[[Sequence[int]], list[tuple[int, int]]],
    total_rows: int,
    budget: int,
    record: Callable[[list[int], Signature, Callable[[int], Path | None]], None],
    progress: Progress | None = None,
) -> tuple[dict[FieldPath, torch.Tensor], dict[FieldPath, Spec]] | None:
    """Every sampled row of the trajectories `tids` (in order), read into one column per field.

    None when they take more than `budget` bytes, or when a trajectory is one this reader
    does not take on. `record(tids, signature, where)` is told the trajectories whose files
    (or memory) show `signature`; `where(k)`: the path of `tids[k]`'s file. `total_rows`:
    the trajectories' samples, as the index records them.
    """
    columns = Columns(total_rows, budget)
    plans: dict[tuple[int, int, int], tuple[dict[str, Any], _Plan]] = {}
    templates: dict[int, ptbulk.Template | None] = {}  # by file size, for every chunk
    with gc_paused():  # a million files make millions of objects, and no cycle
        reader = _open_reader(store, tids)
    try:
        with gc_paused():
            for item in reader:
                if isinstance(item, tuple):  # a trajectory held in memory
                    tid, traj = item
                    _hold_memory(tid, traj, shapes_of([tid])[0], columns, store, record)
                else:
                    try:
                        _flush(item, columns, plans, templates, store, shapes_of, record, progress)
                    finally:
                        if item.release is not None:  # its buffer is read into again
                            item.release()
    except (_Giveup, RbtoolError, OSError, struct.error, helpread.HelperFailed):
        return None
    finally:
        reader.stop()
        columns.stop()
    if columns.at != total_rows:
        return None
    columns.finish()
    return columns.columns, columns.specs


class _Chunk:
    """Files read side by side into one buffer: file k's bytes are `buf[offsets[k]:][:sizes[k]]`,
    each file starting eight-byte aligned (files of one size in a row form a strided array)."""

    def __init__(self, buf: Any, release: Callable[[], None] | None = None) -> None:
        self.buf = buf
        self.release = release  # called when the chunk is cut: its buffer is read into again
        self.tids: list[int] = []
        self.offsets: list[int] = []
        self.sizes: list[int] = []
        self.places: Sequence[tuple[Path, str]] = []  # (directory, name) of each file

    def where(self, k: int) -> Path:
        directory, name = self.places[k]
        return directory / name

    def where_from(self, first: int) -> Callable[[int], Path]:
        """where(), counted from file `first`."""
        return lambda k: self.where(first + k)


class _Reader:
    """The trajectories' files read in order on a thread, ahead of their cutting: yields
    _Chunks, and (tid, dict) for a trajectory held in memory; raises _Giveup at a
    trajectory that is not a `.pt` file, and what a read raised.

    One thread: its system calls wait in the kernel without the GIL, but each return waits
    for the GIL, so two threads read small files no faster than one (helper processes do:
    rbtool.buffer.storage.helpread). Small files are read straight into a few reused
    buffers (fresh memory would cost a page fault every 4 KiB); a larger file makes a
    chunk of its own."""

    BUFFERS = 2

    def __init__(self, store: TrajectoryStore, tids: Sequence[int]) -> None:
        import numpy as np

        self.store, self.tids = store, tids
        self.stopped = threading.Event()
        self.lane = _Lane(queue.Queue(maxsize=self.BUFFERS), queue.Queue())
        for _ in range(self.BUFFERS):
            self.lane.free.put(np.empty(_buffer_bytes(len(tids)), dtype=np.uint8))
        self.thread = threading.Thread(target=self._run, name="rbtool-hold-reader", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        dir_fds: dict[Path, int] = {}
        try:
            if self._read(self.lane, self.tids, dir_fds):
                self.lane.put(_END, self.stopped)
        except BaseException as exc:  # handed to the consumer
            self.lane.put(exc, self.stopped)
        finally:
            for fd in dir_fds.values():
                os.close(fd)

    def _read(self, lane: _Lane, tids: Sequence[int], dir_fds: dict[Path, int]) -> bool:
        """Read the files into chunks (False: stopped). The loop is what a small file costs
        besides its three system calls: kept to a few list operations."""
        import numpy as np

        store, stopped = self.store, self.stopped
        memory, pins = store.memory, store.pins
        places = store.files.places(tids, memory)
        open_, preadv, close = os.open, os.preadv, os.close
        flags = _read_flags(store.follow_links)
        room = STACK_FILE_BYTES + 1  # a read of more than this finds a file too large to stack
        chunk: _Chunk | None = None
        view: memoryview | None = None
        at = limit = 0
        last_dir, dir_fd = None, -1
        for tid, (directory, name) in zip(tids, places, strict=True):
            if memory and tid in memory:
                if chunk is not None and not lane.put(chunk, stopped):
                    return False
                chunk = None
                if not lane.put((tid, memory[tid]), stopped):
                    return False
                continue
            if not name.endswith(".pt"):
                raise _Giveup
            if chunk is None:
                buf = lane.buffer(stopped)
                if buf is None:
                    return False
                chunk = _Chunk(buf, functools.partial(lane.free.put, buf))
                view, at, limit = memoryview(buf), 0, buf.size - room - 8
                named: list[tuple[Path, str]] = []
                ids, offsets, sizes, chunk.places = chunk.tids, chunk.offsets, chunk.sizes, named
            assert view is not None
            pin = pins.get(tid) if pins else None
            if pin is not None:
                fd = pin.fd
            else:
                if directory is not last_dir:
                    dir_fd = dir_fds.get(directory, -1)
                    if dir_fd < 0:
                        dir_fd = dir_fds[directory] = open_(directory, os.O_RDONLY | os.O_DIRECTORY)
                    last_dir = directory
                fd = open_(name, flags, dir_fd=dir_fd)
            try:
                n = preadv(fd, [view[at : at + room]], 0)
                large = _read_large(fd) if n == room else None
            finally:
                if pin is None:
                    close(fd)
            if large is not None:  # a chunk of its own, after the files before it
                if chunk.tids and not lane.put(chunk, stopped):
                    return False
                if not chunk.tids:
                    lane.free.put(chunk.buf)
                chunk = None
                alone = _Chunk(np.frombuffer(large, dtype=np.uint8))
                alone.tids, alone.offsets, alone.sizes = [tid], [0], [len(large)]
                alone.places = [(directory, name)]
                if not lane.put(alone, stopped):
                    return False
                continue
            ids.append(tid)
            offsets.append(at)
            sizes.append(n)
            named.append((directory, name))
            at = (at + n + 7) & ~7
            if at > limit or len(ids) >= CHUNK_FILES:
                if not lane.put(chunk, stopped):
                    return False
                chunk = None
        return chunk is None or lane.put(chunk, stopped)

    def __iter__(self) -> Iterator[Any]:
        while (item := self.lane.queue.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


_END = object()  # the reader's last item


class _Lane:
    """The reading thread's queue of chunks, and its free buffers."""

    def __init__(self, chunks: queue.Queue[Any], free: queue.Queue[Any]) -> None:
        self.queue, self.free = chunks, free

    def put(self, item: Any, stopped: threading.Event) -> bool:
        while not stopped.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def buffer(self, stopped: threading.Event) -> Any:
        while not stopped.is_set():
            try:
                return self.free.get(timeout=0.1)
            except queue.Empty:
                continue
        return None


def _open_reader(store: TrajectoryStore, tids: Sequence[int]) -> Any:
    """The reader of a window's files: helper processes for the many files of one directory
    that a load leaves (after the pinned ones, read here), else a thread."""
    pinned = len(store.pins)
    rest = tids[pinned:]
    if not helpread.usable(len(rest)) or not set(tids[:pinned]) >= store.pins.keys():
        return _Reader(store, tids)
    if store.memory and not store.memory.keys().isdisjoint(tids):
        return _Reader(store, tids)
    places = store.files.places(rest)
    directory = places[0][0]
    directories = set(map(id, map(itemgetter(0), places)))  # a loaded checkpoint's: one object
    if len(directories) > 1 and any(d != directory for d, _ in places):
        return _Reader(store, tids)
    names = list(map(itemgetter(1), places))
    if not all(name.endswith(".pt") for name in names):
        return _Reader(store, tids)
    room, size = STACK_FILE_BYTES + 1, _buffer_bytes(len(rest))
    try:
        read_large = functools.partial(_read_named, directory, names, store.follow_links)
        helpers = helpread.HelperReader(
            directory, rest, names, SEGMENT_FILES, size, room, _Chunk, read_large, store.follow_links
        )
    except helpread.HelperFailed:
        return _Reader(store, tids)
    return _Joined(_Reader(store, tids[:pinned]) if pinned else None, helpers)


class _Joined:
    """A thread reader's chunks (the pinned files first), then the helpers'."""

    def __init__(self, first: _Reader | None, helpers: helpread.HelperReader) -> None:
        self.first, self.helpers = first, helpers

    def __iter__(self) -> Iterator[Any]:
        if self.first is not None:
            yield from self.first
        yield from self.helpers

    def stop(self) -> None:
        if self.first is not None:
            self.first.stop()
        self.helpers.stop()


def _read_named(directory: Path, names: Sequence[str], follow: bool, k: int) -> bytes:
    """All of file `names[k]`, too large to be read side by side (by name: _read_large's rules)."""
    fd = os.open(directory / names[k], _read_flags(follow))
    try:
        return _read_large(fd)
    finally:
        os.close(fd)


def _read_flags(follow: bool) -> int:
    """How a window's files are opened: without blocking (a FIFO never hangs the reader), and
    without following a symbolic link unless `follow`."""
    return os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | (0 if follow else _NOFOLLOW)


def _buffer_bytes(files: int) -> int:
    """The size of a reading buffer: CHUNK_BYTES, less for a window of few files, and room
    for one file too large to stack (its read finds it so)."""
    return min(CHUNK_BYTES, max(STACK_FILE_BYTES + 9, files * (STACK_FILE_BYTES + 8)))


_HUGE_PAGE = 2 << 20
_PAGE = 4096
_MADV_HUGEPAGE = 14


def _huge(column: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """`column`, its untouched memory advised to be backed by huge pages where it spans them
    and its rows are larger than a page (Linux): a batch's rows are scattered over the
    column, and with 4 KiB pages each of a row's pages costs a TLB miss (several memory
    reads under a hypervisor); measured here, the gather of bench.py's image batches took
    20-25% less time. Rows of a page or less are left to 4 KiB pages: a row costs one miss
    either way (steady sample(256) of a million one-transition trajectories took 0.23-0.24
    ms with huge pages, 0.25 without), while a fresh huge page costs far more to fault in
    where free memory goes back to a hypervisor (here 2.2 s a GiB against 0.46 s: the
    million-file load took 10.8-12.4 s with huge pages, 9.4-9.8 s without)."""
    nbytes = column.numel() * column.element_size()
    if row_bytes <= _PAGE or nbytes < 2 * _HUGE_PAGE or not sys.platform.startswith("linux"):
        return column
    start = -(-column.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    stop = (column.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    with contextlib.suppress(OSError, AttributeError):
        load_libc().madvise(start, stop - start, _MADV_HUGEPAGE)  # advice only: a refusal changes nothing
    return column


_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault pages in writable, their contents untouched
_POPULATE_BYTES = 32 << 20  # a column's bytes populated a call


class _Populator:
    """The columns' memory faulted in ahead of their filling, on a thread of its own.

    A window of a million tiny files fills 3 GB of fresh memory: faulting it in page by
    page on the filling thread took 1.7-1.9 s of a 10 s load (and, with huge pages advised,
    the kernel's compaction stalls there). The thread asks the kernel to populate the
    columns a slice of rows at a time, in the order they are filled; the call leaves the
    contents alone, so it races with nothing the filling thread writes, and it holds no
    interpreter lock while the kernel works. Where the kernel cannot (before Linux 5.14,
    not Linux), the thread stops at its first refusal and the pages fault in as before."""

    def __init__(self, columns: list[torch.Tensor]) -> None:
        self.columns = columns
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="rbtool-hold-populate", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        if not sys.platform.startswith("linux") or not self.columns:
            return
        try:
            madvise = load_libc().madvise
        except (OSError, AttributeError):
            return
        rows = self.columns[0].shape[0]
        spans = [(c.data_ptr(), c.numel() * c.element_size() // max(1, rows)) for c in self.columns]
        step = max(1, _POPULATE_BYTES // max(1, max(row_bytes for _, row_bytes in spans)))
        for first in range(0, rows, step):
            for base, row_bytes in spans:
                start = (base + first * row_bytes) // _PAGE * _PAGE
                stop = base + min(rows, first + step) * row_bytes
                if self.stopped.is_set():
                    return
                if stop > start and madvise(start, stop - start, _MADV_POPULATE_WRITE) != 0:
                    return

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


def _read_large(fd: int) -> bytes:
    """All of a file larger than the stacked ones, refused (_Giveup) when it is not a regular
    file or has holes (a stand-in filled as drawn, whose unfetched bytes are not data)."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_blocks * 512 < info.st_size:
        raise _Giveup
    data = os.pread(fd, info.st_size, 0)
    if len(data) != info.st_size:
        raise _Giveup
    return data


def _hold_memory(
    tid: int,
    traj: dict[str, Any],
    shape: tuple[int, int],
    columns: Columns,
    store: TrajectoryStore,
    record: Callable[[list[int], Signature, Callable[[int], Path | None]], None],
) -> None:
    view = FlatView(traj, *shape, extra_fields=store.extra_fields)
    record([tid], signature_of(traj, store.extra_fields), lambda k: None)
    columns.begin({p: f.spec for p, f in view.fields.items()})
    rows = shape[0] * shape[1]
    for path in columns.specs:
        columns.columns[path][columns.at : columns.at + rows] = flat_rows(view, path)
    columns.at += rows


def _flush(
    chunk: _Chunk,
    columns: Columns,
    plans: dict[tuple[int, int, int], tuple[dict[str, Any], _Plan]],
    templates: dict[int, ptbulk.Template | None],
    store: TrajectoryStore,
    shapes_of: Callable[[Sequence[int]], list[tuple[int, int]]],
    record: Callable[[list[int], Signature, Callable[[int], Path | None]], None],
    progress: Progress | None,
) -> None:
    """Cut a chunk's sampled rows into the columns: its files of one size in a row are one
    strided array, their headers read at once (ptbulk) and their fields cut together."""
    import numpy as np

    sizes, offsets, tids = chunk.sizes, chunk.offsets, chunk.tids
    k = 0
    while k < len(tids):
        size = sizes[k]
        stop = k + 1
        while stop < len(tids) and sizes[stop] == size:
            stop += 1
        stride = (size + 7) & ~7
        rows = np.lib.stride_tricks.as_strided(
            chunk.buf[offsets[k] :], shape=(stop - k, size), strides=(stride, 1), writeable=False
        )
        if size > STACK_FILE_BYTES:  # a large file alone: parsed, not compared
            headers: list[Any] = [ptbulk.read_headers([chunk.where(k)], [rows[0].tobytes()])[0]]
        else:
            headers = ptbulk.headers_of(rows, chunk.where_from(k), templates)
        _cut(rows, headers, k, chunk, columns, plans, store, shapes_of, record)
        if progress is not None:
            progress(stop - k)
        k = stop


def _cut(
    rows: Any,
    headers: list[Any],
    first: int,
    chunk: _Chunk,
    columns: Columns,
    plans: dict[tuple[int, int, int], tuple[dict[str, Any], _Plan]],
    store: TrajectoryStore,
    shapes_of: Callable[[Sequence[int]], list[tuple[int, int]]],
    record: Callable[[list[int], Signature, Callable[[int], Path | None]], None],
) -> None:
    """Cut files of one size (`rows`, chunk files `first`...) into the columns, a run of
    files of one header and [T, B] at a time."""
    tids = chunk.tids[first : first + len(headers)]
    shapes = shapes_of(tids)
    j = 0
    while j < len(headers):
        header, shape = headers[j], shapes[j]
        if isinstance(header, Exception):  # UnusualLayout too: left to the row readers
            raise _Giveup
        end = j + 1
        while end < len(headers) and headers[end] is header and shapes[end] == shape:
            end += 1
        t, b = shape
        key = (id(header), t, b)
        known = plans.get(key)
        if known is None or known[0] is not header:
            known = plans[key] = (
                header,
                _Plan(header, str(chunk.where(first + j)), t, b, store.extra_fields),
            )
        plan = known[1]
        record(tids[j:end], store.header_signature(header), chunk.where_from(first + j))
        columns.begin({path: spec for path, spec, _ in plan.fields})
        count = end - j
        taken = plan.rows * count
        if columns.at + taken > columns.total_rows:
            raise _Giveup
        part = rows[j:end]
        for field, (_, row_shape), byte_runs in plan.fields:
            if field not in columns.columns or not math.prod(row_shape):
                continue
            out = columns.numpy(field, taken).reshape(count, -1)
            at = 0
            for start, stop in byte_runs:
                out[:, at : at + stop - start] = part[:, start:stop]
                at += stop - start
        columns.at += taken
        j = end
