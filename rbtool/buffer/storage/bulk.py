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
import math
import os
import queue
import stat
import struct
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rbtool.buffer.rowmap import load_libc
from rbtool.buffer.storage.held import raw_layout
from rbtool.buffer.storage.ptfile import PinnedFile
from rbtool.buffer.storage.view import FieldPath, FlatView, flat_rows
from rbtool.buffer.storage.window import Signature, signature_of
from rbtool.errors import RbtoolError
from rbtool.files import ptbulk
from rbtool.progress import Progress

if TYPE_CHECKING:
    import torch

    from rbtool.buffer.storage.store import TrajectoryStore

# Files are read and cut into columns this many bytes (or files) at a time.
CHUNK_BYTES = 64 << 20
CHUNK_FILES = 4096
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

    def begin(self, specs: dict[FieldPath, Spec]) -> None:
        """The next trajectory holds fields `specs`: keep only the columns it shares."""
        import torch

        if not self.started:
            self.started = True
            row_bytes = sum(math.prod(shape) * dtype.itemsize for dtype, shape in specs.values())
            if row_bytes * self.total_rows > self.budget:
                raise _Giveup
            self.specs = dict(specs)
            self.columns = {
                p: _huge(torch.empty((self.total_rows, *shape), dtype=dtype))
                for p, (dtype, shape) in specs.items()
            }
            return
        for path in [p for p, spec in self.specs.items() if specs.get(p) != spec]:
            del self.specs[path], self.columns[path]

    def numpy(self, path: FieldPath, rows: int) -> Any:
        """Rows `[at, at + rows)` of a column as a uint8 array of `[rows, row bytes]`."""
        import torch

        column = self.columns[path][self.at : self.at + rows]
        return column.view(torch.uint8).reshape(rows, -1).numpy()


def hold_window(
    store: TrajectoryStore,
    tids: Sequence[int],
    shape_of: Callable[[int], tuple[int, int]],
    total_rows: int,
    budget: int,
    record: Callable[[int, Signature, Path | None], None],
    progress: Progress | None = None,
) -> tuple[dict[FieldPath, torch.Tensor], dict[FieldPath, Spec]] | None:
    """Every sampled row of the trajectories `tids` (in order), read into one column per field.

    None when they take more than `budget` bytes, or when a trajectory is one this reader
    does not take on. `record(tid, signature, path)` is told each trajectory's signature as
    its file shows it. `total_rows`: the trajectories' samples, as the index records them.
    """
    columns = Columns(total_rows, budget)
    plans: dict[tuple[int, int, int], tuple[dict[str, Any], _Plan]] = {}
    templates: dict[int, ptbulk.Template | None] = {}  # by file size, for every chunk
    reader = _Reader(store, tids)
    try:
        for item in reader:
            if isinstance(item, tuple):  # a trajectory held in memory
                tid, traj = item
                _hold_memory(tid, traj, shape_of(tid), columns, store, record)
            else:
                _flush(item, columns, plans, templates, store, shape_of, record, progress)
    except (_Giveup, RbtoolError, OSError, struct.error):
        return None
    finally:
        reader.stop()
    if columns.at != total_rows:
        return None
    return columns.columns, columns.specs


class _Reader:
    """The trajectories' files read in order on a thread, a chunk ahead of their cutting
    (the reads wait in the kernel without the GIL while the last chunk is cut): yields
    chunks of (tid, path, bytes), and (tid, dict) for a trajectory held in memory; raises
    _Giveup at a trajectory that is not a `.pt` file, and what a read raised."""

    def __init__(self, store: TrajectoryStore, tids: Sequence[int]) -> None:
        self.store, self.tids = store, tids
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=2)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="rbtool-hold-reader", daemon=True)
        self.thread.start()

    def _put(self, item: Any) -> bool:
        while not self.stopped.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        store = self.store
        try:
            chunk: list[tuple[int, Path, bytes]] = []
            size = 0
            for tid in self.tids:
                traj = store.memory.get(tid)
                if traj is not None:
                    if (chunk and not self._put(chunk)) or not self._put((tid, traj)):
                        return
                    chunk, size = [], 0
                    continue
                path = store.files.get(tid)
                if path is None or not str(path).endswith(".pt"):
                    raise _Giveup
                data = _read(path, store.pins.get(tid))
                chunk.append((tid, path, data))
                size += len(data)
                if size >= CHUNK_BYTES or len(chunk) >= CHUNK_FILES:
                    if not self._put(chunk):
                        return
                    chunk, size = [], 0
            if chunk:
                self._put(chunk)
            self._put(None)
        except BaseException as exc:  # handed to the consumer
            self._put(exc)

    def __iter__(self) -> Iterator[Any]:
        while True:
            item = self.queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _huge(column: torch.Tensor) -> torch.Tensor:
    """`column`, its untouched memory advised to be backed by huge pages where it spans them
    (Linux): a batch's rows are scattered over the column, and with 4 KiB pages each row's
    pages cost a TLB miss (several memory reads under a hypervisor); measured here, the
    gather of bench.py's image batches took 20-25% less time."""
    nbytes = column.numel() * column.element_size()
    if nbytes < 2 * _HUGE_PAGE or not sys.platform.startswith("linux"):
        return column
    start = -(-column.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    stop = (column.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    with contextlib.suppress(OSError, AttributeError):
        load_libc().madvise(start, stop - start, _MADV_HUGEPAGE)  # advice only: a refusal changes nothing
    return column


def _read(path: Path, pin: PinnedFile | None) -> bytes:
    """A file's bytes, through its pinned descriptor when it has one. A small file is one
    read (no fstat): what is not a regular file reads as nothing a header can come from."""
    fd = pin.fd if pin is not None else os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        data = os.pread(fd, STACK_FILE_BYTES + 1, 0)
        if len(data) <= STACK_FILE_BYTES:
            return data
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_blocks * 512 < info.st_size:
            raise _Giveup  # not a regular file, or one with holes (a stand-in filled as drawn)
        size = info.st_size
        data = os.pread(fd, size, 0)
    finally:
        if pin is None:
            os.close(fd)
    if len(data) != size:
        raise _Giveup
    return data


def _hold_memory(
    tid: int,
    traj: dict[str, Any],
    shape: tuple[int, int],
    columns: Columns,
    store: TrajectoryStore,
    record: Callable[[int, Signature, Path | None], None],
) -> None:
    view = FlatView(traj, *shape, extra_fields=store.extra_fields)
    record(tid, signature_of(traj, store.extra_fields), None)
    columns.begin({p: f.spec for p, f in view.fields.items()})
    rows = shape[0] * shape[1]
    for path in columns.specs:
        columns.columns[path][columns.at : columns.at + rows] = flat_rows(view, path)
    columns.at += rows


def _flush(
    chunk: list[tuple[int, Path, bytes]],
    columns: Columns,
    plans: dict[tuple[int, int, int], tuple[dict[str, Any], _Plan]],
    templates: dict[int, ptbulk.Template | None],
    store: TrajectoryStore,
    shape_of: Callable[[int], tuple[int, int]],
    record: Callable[[int, Signature, Path | None], None],
    progress: Progress | None,
) -> None:
    """Cut a chunk of files' sampled rows into the columns, files of one plan and size at once."""
    import numpy as np

    if not chunk:
        return
    small = [k for k, (_, _, data) in enumerate(chunk) if len(data) <= STACK_FILE_BYTES]
    headers: list[Any] = [None] * len(chunk)
    found = ptbulk.read_headers([chunk[k][1] for k in small], [chunk[k][2] for k in small], templates)
    for k, header in zip(small, found, strict=True):
        headers[k] = header
    for k, (_, path, data) in enumerate(chunk):
        if headers[k] is None:
            headers[k] = ptbulk.read_headers([path], [data])[0]
    # runs of consecutive files of one plan and size are cut together
    runs: list[tuple[_Plan, int, list[int]]] = []
    for k, (tid, path, data) in enumerate(chunk):
        header = headers[k]
        if isinstance(header, Exception):  # UnusualLayout too: left to the row readers
            raise _Giveup
        t, b = shape_of(tid)
        key = (id(header), t, b)
        known = plans.get(key)
        if known is None or known[0] is not header:
            known = plans[key] = (header, _Plan(header, str(path), t, b, store.extra_fields))
        plan = known[1]
        record(tid, store.header_signature(header), path)
        if runs and runs[-1][0] is plan and runs[-1][1] == len(data):
            runs[-1][2].append(k)
        else:
            runs.append((plan, len(data), [k]))
    for plan, size, ks in runs:
        columns.begin({path: spec for path, spec, _ in plan.fields})
        rows = plan.rows * len(ks)
        if columns.at + rows > columns.total_rows:
            raise _Giveup
        if len(ks) == 1:
            stacked = np.frombuffer(chunk[ks[0]][2], dtype=np.uint8).reshape(1, size)
        else:
            stacked = np.frombuffer(b"".join([chunk[k][2] for k in ks]), dtype=np.uint8).reshape(
                len(ks), size
            )
        for field, (_, shape), byte_runs in plan.fields:
            if field not in columns.columns or not math.prod(shape):
                continue
            out = columns.numpy(field, rows).reshape(len(ks), -1)
            at = 0
            for start, stop in byte_runs:
                out[:, at : at + stop - start] = stacked[:, start:stop]
                at += stop - start
        columns.at += rows
        if progress is not None:
            progress(len(ks))
