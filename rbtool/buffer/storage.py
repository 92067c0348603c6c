"""Storage: where a trajectory's rows live and how drawn rows are read into a batch.

A trajectory opened for sampling is a FlatView: every sampled field seen as `[T*B, ...]`
rows, held either in memory (tensors) or left in its `.pt` file (FileRows, read with
pread). Both answer `schema()` and `rows(path, idx, out, dest)`. TrajectoryStore keeps
track of where each trajectory of a buffer is (in memory, in a file, pinned by an open
descriptor) and a bounded set of open views; gather() builds a batch from a Draw.
Samplers never read data; this module never draws.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rbtool.buffer.rowmap import RowMap
from rbtool.buffer.rowmap import available as rowmap_available
from rbtool.buffer.sampling import ids_at
from rbtool.errors import RbtoolError, TrajectoryFileError
from rbtool.files import trajfile
from rbtool.files.ptheader import (
    SMALL_FILE_BYTES,
    TensorSpec,
    UnusualLayout,
    iter_specs,
    open_regular,
    read_header,
)
from rbtool.format.layout import (
    DONE_LIKE,
    NESTED_ORDER,
    SAMPLED_TOP_FIELDS,
    TrajectoryInfo,
    describe,
    done_extra_rows,
    done_rows,
    drop_bootstrap_rows,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

    from rbtool.buffer.batchmem import BatchMemory
    from rbtool.buffer.sampling import Draw

FieldPath = tuple[str, ...]
Schema = dict[FieldPath, tuple[Any, tuple[int, ...]]]  # path -> (dtype, per-sample shape)


class Storage(Protocol):
    """What a sampler's draws are read from: one trajectory's fields as flat rows."""

    def schema(self) -> Schema: ...

    def rows(self, path: FieldPath, idx: Any, out: Any, dest: Any) -> None: ...


# Rows at least this large are read from the file on demand; smaller fields are read whole.
ROW_READ_MIN_BYTES = 2048
# File descriptors kept open across batches (least recently used closed first): a quarter
# of the process's limit, at most 1024.
MAX_OPEN_FDS = max(16, min(1024, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4))
_OPEN_FILES: OrderedDict[int, FileTrajectory | FileHandle] = OrderedDict()


class FileRows:
    """A contiguous tensor left in its `.pt` file: rows are read with pread when drawn.

    Memory-mapping would be simpler, but the kernel maps whole page-cache folios (megabytes)
    on each fault, so a sampler touching a few rows of every file ends up with the whole
    checkpoint resident. Reading rows into the output keeps memory at the batch size.
    """

    def __init__(
        self, owner: FileTrajectory | FileHandle, offset: int, shape: tuple[int, ...], dtype: Any
    ) -> None:
        import torch

        self.owner, self.offset, self.shape, self.dtype = owner, offset, torch.Size(shape), dtype
        self.row_bytes = math.prod(shape[1:]) * dtype.itemsize

    def dim(self) -> int:
        return len(self.shape)

    def reshape(self, *shape: int) -> FileRows:
        """Merge the two leading dims ([T, B, ...] -> [T*B, ...]); the layout is contiguous."""
        return FileRows(self.owner, self.offset, (self.shape[0] * self.shape[1], *self.shape[2:]), self.dtype)

    def take(self, rows: Any, out: Any, dest: Any) -> None:
        """Read stored rows `rows` into rows `dest` of the contiguous tensor `out`."""
        import torch

        size = self.row_bytes
        if size == 0 or not len(rows):
            return
        buffer = memoryview(out.view(torch.uint8).numpy()).cast("B")
        fd, base = self.owner.fd(), self.offset
        for j, row in zip(dest.tolist(), rows.tolist(), strict=True):
            got = os.preadv(fd, [buffer[j * size : (j + 1) * size]], base + row * size)
            if got != size:
                raise TrajectoryFileError(f"{self.owner.path}: truncated (row {row} of a field is cut short)")


class FileHandle:
    """A file read by pread, its descriptor opened on demand and kept in the bounded fd cache."""

    def __init__(self, path: Path, pin: PinnedFile | None = None) -> None:
        self.path, self._pin = path, pin
        self._fd: int | None = None

    def fd(self) -> int:
        if self._pin is not None:
            return self._pin.fd
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
            _OPEN_FILES[id(self)] = self
            while len(_OPEN_FILES) > MAX_OPEN_FDS:
                _OPEN_FILES.popitem(last=False)[1].close()
        else:
            _OPEN_FILES.move_to_end(id(self))
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            _OPEN_FILES.pop(id(self), None)
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


# Rows read from files by this many threads at once when a batch reads at least
# READ_PARALLEL_MIN of them and its first reads show they reach the disk (a read slower than
# READ_SLOW_S on average): pread releases the GIL, and reads waiting on the disk overlap.
# Reads the page cache serves are faster in one thread.
READ_THREADS = 4
READ_PARALLEL_MIN = 64
READ_PROBE = 16
READ_SLOW_S = 40e-6


def read_rows(
    fds: Any, offsets: Any, dests: Any, size: int, out: Any, where: Callable[[int], tuple[Path, int]]
) -> None:
    """pread `size` bytes at `offsets[j]` of descriptor `fds[j]` into row `dests[j]` of the
    contiguous tensor `out`, for every j; `where(j)` names the file and stored row of a read
    that comes up short."""
    import torch

    if not len(fds) or size == 0:
        return
    buffer = memoryview(out.view(torch.uint8).numpy()).cast("B")
    plan = list(zip(fds.tolist(), offsets.tolist(), dests.tolist(), range(len(fds)), strict=True))

    def run(part: list[tuple[int, int, int, int]]) -> None:
        for fd, offset, dest, j in part:
            if os.preadv(fd, [buffer[dest * size : (dest + 1) * size]], offset) != size:
                path, row = where(j)
                raise TrajectoryFileError(f"{path}: truncated (row {row} of a field is cut short)")

    if len(plan) < READ_PARALLEL_MIN:
        run(plan)
        return
    import time
    from concurrent.futures import ThreadPoolExecutor

    start = time.perf_counter()
    run(plan[:READ_PROBE])
    if time.perf_counter() - start < READ_SLOW_S * READ_PROBE:
        run(plan[READ_PROBE:])
        return
    plan = sorted(plan[READ_PROBE:], key=lambda item: (item[0], item[1]))  # each thread: files in order
    step = -(-len(plan) // READ_THREADS)
    with ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="rbtool-read") as pool:
        list(pool.map(run, [plan[i : i + step] for i in range(0, len(plan), step)]))


class FileTrajectory(FileHandle):
    """A `.pt` trajectory opened for sampling: small fields in memory, large rows left on disk.

    The structure and each tensor's place in the file come from the file's header
    (rbtool.files.ptheader: no tensor bytes read, no torch.load); a small file is read whole, in
    one read; in a larger one, fields with large rows stay on disk and are read with pread.
    """

    def __init__(
        self, path: Path, pin: PinnedFile | None = None, header: dict[str, Any] | None = None
    ) -> None:
        # A pinned file is read through its open descriptor: the name may be gone or replaced.
        super().__init__(path, pin)
        read_path = pin.read_path if pin is not None else path
        whole: bytes | None = None
        if header is None:
            whole = _read_small(read_path)
            header = read_header(read_path, whole)
        elif _file_size(read_path) <= SMALL_FILE_BYTES:
            whole = _read_small(read_path)
        self.header = header
        self.info = describe(header, str(path), TensorSpec)
        self._whole = memoryview(whole) if whole is not None else None
        self.data = _map_specs(header, self._place)
        self._whole = None
        self.close()

    def _place(self, spec: TensorSpec) -> Any:
        import torch

        dtype = getattr(torch, spec.dtype)
        row_bytes = math.prod(spec.shape[1:]) * spec.itemsize if spec.dim() >= 2 else 0
        if self._whole is None and spec.is_contiguous() and row_bytes >= ROW_READ_MIN_BYTES:
            return FileRows(self, spec.data_start, spec.shape, dtype)
        if self._whole is not None:
            data = bytearray(self._whole[spec.start : spec.start + spec.nbytes])
        else:
            data = bytearray(spec.nbytes)
            if data and os.preadv(self.fd(), [data], spec.start) != len(data):
                raise TrajectoryFileError(f"{self.path}: truncated (a tensor's data is cut short)")
        if len(data) != spec.nbytes:
            raise TrajectoryFileError(f"{self.path}: truncated (a tensor's data is cut short)")
        raw = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        return raw.view(dtype).as_strided(spec.shape, spec.stride, spec.offset)


def _file_size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError as exc:
        raise TrajectoryFileError(f"{path}: cannot read ({exc.strerror})") from None


def _read_small(path: Path) -> bytes | None:
    """A regular file's bytes when it is small enough to read whole; None otherwise."""
    fd, size = open_regular(path)
    try:
        if size > SMALL_FILE_BYTES:
            return None
        data = os.pread(fd, size, 0)
        if len(data) != size:
            raise TrajectoryFileError(f"{path}: truncated while it was read")
        return data
    except OSError as exc:
        raise TrajectoryFileError(f"{path}: cannot read ({exc.strerror})") from None
    finally:
        os.close(fd)


def _map_specs(value: Any, fn: Any) -> Any:
    if isinstance(value, TensorSpec):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_specs(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_specs(v, fn) for v in value]
    return value


def _fd_budget() -> int:
    return max(16, min(1024, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4))


# Files pinned open so that a loaded checkpoint can be deleted or replaced (rotation)
# while the buffer still reads it; beyond this many, files are read by name.
MAX_PINNED = _fd_budget()
_PINNED_COUNT = [0]
_PIN_LOCK = threading.Lock()


class PinnedFile:
    """An open descriptor on a loaded trajectory file: its data stays readable after the
    name is deleted or replaced, as long as the buffer lists it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        info = os.fstat(self.fd)
        self._identity = (info.st_dev, info.st_ino)
        with _PIN_LOCK:
            _PINNED_COUNT[0] += 1

    @classmethod
    def try_open(cls, path: Path) -> PinnedFile | None:
        """Pin `path` if the budget allows and the file opens; None otherwise (read by name)."""
        if _PINNED_COUNT[0] >= MAX_PINNED:
            return None
        try:
            return cls(path)
        except OSError:
            return None

    @property
    def read_path(self) -> Path:
        """A name that opens this descriptor's file (Linux /proc, else /dev/fd)."""
        proc = Path(f"/proc/self/fd/{self.fd}")
        return proc if proc.parent.is_dir() else Path(f"/dev/fd/{self.fd}")

    def current_path(self) -> Path | None:
        """The original name if it still names this file, else None."""
        try:
            info = os.stat(self.path)
        except OSError:
            return None
        return self.path if (info.st_dev, info.st_ino) == self._identity else None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            with _PIN_LOCK:
                _PINNED_COUNT[0] -= 1

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


@dataclass
class FlatField:
    """One field of a trajectory seen as rows of [T*B, ...] without a copy."""

    rows: Any  # the stored tensor (or FileRows) reshaped to [(T + E) * B, ...]
    extra: int  # E: leading bootstrap rows of a done-like field (0 otherwise)


def _ordered_items(traj: dict[str, Any], top: bool) -> list[tuple[str, Any]]:
    """Tensors first in dict order, then nested dicts (the reference's three first)."""
    tensors = [(k, v) for k, v in traj.items() if not isinstance(v, dict)]
    dicts = [(k, v) for k, v in traj.items() if isinstance(v, dict)]
    if top:
        rank = {name: i for i, name in enumerate(NESTED_ORDER)}
        dicts.sort(key=lambda kv: rank.get(kv[0], len(rank)))
    return tensors + dicts


def _is_rows(value: Any) -> bool:
    import torch

    return isinstance(value, (torch.Tensor, FileRows, TensorSpec)) and value.dim() >= 2


def sampled_items(
    traj: dict[str, Any], extra_fields: bool
) -> tuple[list[tuple[FieldPath, Any]], list[FieldPath]]:
    """The (path, tensor) pairs a batch holds, in batch order, and the >= 2-dim ones left out.

    By default these are the reference sampler's: its Trajectory's top-level fields in
    declaration order, then the tensors one level inside curr_obs, next_obs, forward_inputs.
    With `extra_fields` every tensor of >= 2 dims, nested dicts flattened per key.
    """
    every: list[tuple[FieldPath, Any]] = []

    def walk(d: dict[str, Any], prefix: FieldPath, top: bool) -> None:
        for key, value in _ordered_items(d, top):
            if isinstance(value, dict):
                walk(value, (*prefix, key), False)
            elif _is_rows(value):
                every.append(((*prefix, key), value))

    walk(traj, (), True)
    if extra_fields:
        return every, []
    chosen: list[tuple[FieldPath, Any]] = [
        ((name,), traj[name]) for name in SAMPLED_TOP_FIELDS if name in traj and _is_rows(traj[name])
    ]
    for group in NESTED_ORDER:
        nested = traj.get(group)
        if isinstance(nested, dict):
            chosen.extend(((group, k), v) for k, v in nested.items() if _is_rows(v))
    taken = {p for p, _ in chosen}
    return chosen, [p for p, _ in every if p not in taken]


class FlatView:
    """A trajectory dict seen as [T*B, ...] per sampled field (SPEC §3 step 5), lazily.

    `left_out` lists the fields of >= 2 dims the batch does not hold (see sampled_items).
    """

    def __init__(self, traj: dict[str, Any], t: int, b: int, *, extra_fields: bool = False) -> None:
        self.t, self.b = t, b
        self.fields: dict[FieldPath, FlatField] = {}
        items, self.left_out = sampled_items(traj, extra_fields)
        for path, value in items:
            extra = 0
            if len(path) == 1 and path[0] in DONE_LIKE:
                try:
                    extra = done_extra_rows(int(value.shape[0]), t, int(value.shape[1]), b)
                except ValueError as exc:
                    raise RbtoolError(
                        f"field {'.'.join(path)!r} has shape {list(value.shape)}; {exc}"
                    ) from None
            self.fields[path] = FlatField(value.reshape(-1, *value.shape[2:]), extra)

    def schema(self) -> Schema:
        return {p: (f.rows.dtype, tuple(f.rows.shape[1:])) for p, f in self.fields.items()}

    def rows(self, path: FieldPath, idx: Any, out: Any, dest: Any) -> None:
        """Copy stored rows `idx` of field `path` into rows `dest` of the contiguous tensor `out`."""
        import torch

        rows = self.fields[path].rows
        if isinstance(rows, torch.Tensor):
            out.index_copy_(0, torch.as_tensor(dest), rows.index_select(0, torch.as_tensor(idx)))
        else:
            rows.take(idx, out, dest)


class RawTrajectory:
    """A `.pt` trajectory held as bytes: drawn rows are copied out by offset, no tensor built.

    `fields` maps each sampled field held in `data` to (where its first row starts, E
    bootstrap rows): of a small file its sampled fields are held, packed; of a larger one its
    fields with small rows are, and those with large rows are `disk` fields, read row by row with pread
    (FileRows over the flat rows, E), or gathered from the file mapped in a RowMap when the
    buffer maps rows. gather() copies `row bytes` from `start + stored row *
    row bytes`, valid for the C-contiguous fields admitted.
    """

    __slots__ = ("at", "b", "block", "data", "disk", "fields", "file", "t")

    def __init__(
        self,
        data: bytes | bytearray,
        t: int,
        b: int,
        fields: dict[FieldPath, tuple[int, int]],
        disk: dict[FieldPath, tuple[FileRows, int]] | None = None,
        file: tuple[int, FileHandle, int, dict[FieldPath, tuple[int, int]]] | None = None,
    ) -> None:
        import numpy as np

        self.t, self.b = t, b
        self.data = np.frombuffer(data, dtype=np.uint8)
        # once held by a store, `data` is bytes `[at, at + size)` of a HeldBlocks block
        self.block: HeldBlock | None = None
        self.at = 0
        self.fields = fields
        self.disk = disk or {}
        # with disk fields: (trajectory id, its file, the bytes its header needs, where each
        # sampled field starts in the file and its E, shared by files of one header)
        self.file = file


# One sampled field of a header: (path, spec, E bootstrap rows).
RawLayout = list[tuple[FieldPath, TensorSpec, int]]


def raw_layout(header: dict[str, Any], where: str, t: int, b: int, extra_fields: bool) -> RawLayout:
    """The sampled fields of a header whose trajectory the index says is [T, B] = [t, b].

    Raises UnusualLayout for a sampled field that is not C-contiguous (left to a view).
    """
    info = describe(header, where, TensorSpec)
    if info.shape[:2] != (t, b):
        raise TrajectoryFileError(
            f"{where}: tensors are [T, B] = {list(info.shape[:2])} but the index says {[t, b]}"
        )
    layout: RawLayout = []
    items, _ = sampled_items(header, extra_fields)
    for path, spec in items:
        if not spec.is_contiguous():
            raise UnusualLayout(f"field {'.'.join(path)!r} is not contiguous")
        extra = 0
        if len(path) == 1 and path[0] in DONE_LIKE:
            try:
                extra = done_extra_rows(spec.shape[0], t, spec.shape[1], b)
            except ValueError as exc:
                raise TrajectoryFileError(
                    f"{where}: field {'.'.join(path)!r} has shape {list(spec.shape)}; {exc}"
                ) from None
        layout.append((path, spec, extra))
    return layout


def header_extent(header: dict[str, Any]) -> int:
    """How many bytes a file must hold for every tensor its header declares."""
    return max((spec.start + spec.nbytes for _, spec in iter_specs(header)), default=0)


# Small files held as bytes for sampling, least recently used dropped first beyond this.
RAW_CACHE_MAX_BYTES = 384 << 20
# The held bytes are packed into blocks of this size (bytes larger than this get a block of
# their own): a batch gathers from each block its draws reach, so fewer, larger blocks mean
# fewer gathers per field.
HELD_BLOCK_BYTES = 64 << 20


class HeldBlock:
    """One block of held bytes: `buf[:used]` written, `live` of them still held."""

    __slots__ = ("buf", "live", "raws", "used", "views")

    def __init__(self, size: int) -> None:
        import numpy as np

        self.buf = np.empty(size, dtype=np.uint8)  # pages are touched only as bytes are written
        self.used = self.live = 0
        self.raws: dict[int, RawTrajectory] = {}  # id -> the held raws whose bytes are here
        self.views: dict[int, Any] = {}  # row bytes -> overlapping_rows(buf, row bytes)


def overlapping_rows(buf: Any, row_bytes: int) -> Any:
    """A read-only `[n, row_bytes]` view of a uint8 array whose row i is bytes `[i, i + row_bytes)`:
    indexing it with start bytes gathers rows of any alignment, one copy per row."""
    from numpy.lib.stride_tricks import as_strided

    return as_strided(buf, (max(buf.size - row_bytes + 1, 0), row_bytes), (1, 1), writeable=False)


class HeldBlocks:
    """The bytes of the RawTrajectories a store holds, packed one after the other in a few blocks.

    A batch gathers its drawn rows from the blocks in place (one gather per field per block
    its draws reach), instead of concatenating the drawn files' bytes first. Bytes are only
    ever appended (to the last block); a block other than the last whose live bytes fall to
    half of what it holds has them moved to the last block and is let go, so the blocks hold
    at most about twice the live bytes, and no byte is moved more often than one is freed.
    A batch that still reads a block let go (or a raw dropped meanwhile) keeps its memory
    alive through its own references: nothing it reads is ever overwritten.
    Not thread-safe: the store calls it under its lock for held bytes.
    """

    def __init__(self, block_bytes: int | None = None) -> None:
        self.block_bytes = HELD_BLOCK_BYTES if block_bytes is None else block_bytes
        self.blocks: list[HeldBlock] = []
        self.moved = 0  # bytes moved out of blocks let go

    def put(self, raw: RawTrajectory) -> None:
        """Copy `raw`'s bytes into the last block (a new one when they do not fit) and point it there."""
        size = raw.data.size
        if not size:
            return  # nothing to read in place (every sampled field of it is in its file)
        while True:
            last = self.blocks[-1] if self.blocks else None
            if last is not None and last.used + size <= last.buf.size:
                break
            self.blocks.append(HeldBlock(max(self.block_bytes, size)))
            if last is not None:
                self._settle(last)  # no longer the last: held to the bound from now on
        at = last.used
        last.buf[at : at + size] = raw.data
        raw.data, raw.block, raw.at = last.buf[at : at + size], last, at
        last.used += size
        last.live += size
        last.raws[id(raw)] = raw

    def free(self, raw: RawTrajectory) -> None:
        """`raw` is no longer held: its bytes are dead (its own `data` still reads them)."""
        block = raw.block
        if block is None or block.raws.pop(id(raw), None) is None:
            return
        block.live -= raw.data.size
        if not block.live:
            self.blocks.remove(block)
        elif block is not self.blocks[-1]:
            self._settle(block)

    def _settle(self, block: HeldBlock) -> None:
        """A block other than the last holding half its bytes dead or more: its live bytes
        move to the last block, and it is let go."""
        if 2 * block.live > block.used:
            return
        self.blocks.remove(block)
        for moved in list(block.raws.values()):
            self.moved += moved.data.size
            self.put(moved)

    def clear(self) -> None:
        self.blocks = []

    @property
    def reserved(self) -> int:
        """Bytes of the blocks' written parts (live and dead)."""
        return sum(block.used for block in self.blocks)


def open_trajectory(path: Path, pin: PinnedFile | None = None) -> tuple[dict[str, Any], TrajectoryInfo]:
    """A trajectory file's fields (large `.pt` rows left on disk where possible) and its info.

    Errors name the file, also when it is read through its pinned descriptor.
    """
    try:
        return _open_trajectory(path, pin)
    except TrajectoryFileError as exc:
        if pin is None:
            raise
        raise type(exc)(str(exc).replace(str(pin.read_path), str(path))) from None


def _open_trajectory(path: Path, pin: PinnedFile | None) -> tuple[dict[str, Any], TrajectoryInfo]:
    if path.suffix == ".pt":
        try:
            opened = FileTrajectory(path, pin)
            return opened.data, opened.info
        except UnusualLayout:
            pass  # layouts the header reader does not know: torch's own loader decides
    read_path = pin.read_path if pin is not None else path
    traj = trajfile.load(read_path, mmap=True, suffix=path.suffix)
    return traj, describe(traj, str(path))


class TrajectoryStore:
    """Where each trajectory of a buffer is: in memory, in a file (maybe pinned open).

    Opened trajectories are kept as FlatViews, least recently used dropped first beyond
    `max_open`. Methods that change the maps take `lock` (shared with the writer thread).
    """

    def __init__(
        self,
        *,
        max_open: int,
        extra_fields: bool,
        lock: threading.RLock,
        row_map: bool = False,
        row_map_budget: int | None = None,
    ) -> None:
        self.max_open = max_open
        self.extra_fields = extra_fields
        self.lock = lock
        self.memory: dict[int, dict[str, Any]] = {}
        self.files: dict[int, Path] = {}
        self.pins: dict[int, PinnedFile] = {}
        self.views: OrderedDict[int, FlatView] = OrderedDict()
        # what sampling knows of each trajectory without its data: its signature, and the
        # header of its file (so that reopening a view reads no structure again)
        self.signatures: dict[int, Signature] = {}
        self.headers: dict[int, dict[str, Any]] = {}
        self._interned: dict[Signature, Signature] = {}
        self.recorded: set[int] = set()  # ids whose signature came from the index's record
        self._signature_keys: dict[tuple[Any, ...], Signature] = {}
        self._by_header: dict[int, tuple[dict[str, Any], Signature]] = {}
        # (header id, t, b) -> (header, its layout, the bytes it needs, RawTrajectory.fields)
        self._raw_layouts: dict[
            tuple[int, int, int],
            tuple[
                dict[str, Any],
                RawLayout,
                int,
                dict[FieldPath, tuple[int, int]],
                list[tuple[int, int]],
                dict[FieldPath, tuple[int, int]],
            ],
        ] = {}
        # id(layout) -> (layout, the packed-field table of a large file of that layout)
        self._packed_tables: dict[int, tuple[RawLayout, dict[FieldPath, tuple[int, int]]]] = {}
        # small files held as bytes (RawTrajectory), and the ids known not to be held so
        self.raws: OrderedDict[int, RawTrajectory] = OrderedDict()
        self._raw_lock = threading.Lock()  # the held bytes are filled by several readers at once
        self.raw_bytes = 0
        self.held = HeldBlocks()
        self.not_raw: set[int] = set()
        # large rows of held files, mapped side by side (None: read with pread)
        self.rowmap: RowMap | None = None
        if row_map and rowmap_available():
            self.rowmap = RowMap(row_map_budget)

    def holds(self, tid: int) -> bool:
        return tid in self.memory or tid in self.files

    def __len__(self) -> int:
        return len(self.memory.keys() | self.files.keys())

    def put(self, tid: int, traj: dict[str, Any]) -> None:
        with self.lock:
            self.memory[tid] = traj

    def set_files(self, files: dict[int, Path], *, pin: bool) -> None:
        """Replace everything held by these files (pinned open when `pin`)."""
        with self.lock:
            self.clear()
            self.files = dict(files)
            if pin:
                for tid, path in files.items():
                    opened = PinnedFile.try_open(path)
                    if opened is not None:
                        self.pins[tid] = opened

    def drop(self, tid: int) -> None:
        with self.lock:
            self.memory.pop(tid, None)
            self.files.pop(tid, None)
            self.views.pop(tid, None)
            self.signatures.pop(tid, None)
            self.recorded.discard(tid)
            self.headers.pop(tid, None)
            self._drop_raw(tid)
            if self.rowmap is not None:
                self.rowmap.release(tid)
            pinned = self.pins.pop(tid, None)
            if pinned is not None:
                pinned.close()

    def clear_views(self) -> None:
        """Drop every open view (the data stays where it is; views reopen on demand)."""
        with self.lock:
            self.views.clear()
            for opened in list(_OPEN_FILES.values()):
                opened.close()

    def clear(self) -> None:
        with self.lock:
            self.memory.clear()
            self.files.clear()
            self.views.clear()
            self.signatures.clear()
            self.recorded.clear()
            self.headers.clear()
            with self._raw_lock:
                self.raws.clear()
                self.held.clear()
                self.raw_bytes = 0
            self.not_raw.clear()
            if self.rowmap is not None:
                # a gather may still be reading the old map: it is unmapped when let go
                self.rowmap = RowMap(self.rowmap.budget)
            for pinned in self.pins.values():
                pinned.close()
            self.pins.clear()

    def source(self, tid: int) -> Path | dict[str, Any]:
        """What a checkpoint writer copies for `tid`: its file when that name still holds it."""
        with self.lock:
            held = self.memory.get(tid)
            if held is not None:
                return held
            path = self.files[tid]
            pinned = self.pins.get(tid)
        if pinned is None or pinned.current_path() is not None:
            return path
        return trajfile.load(pinned.read_path, suffix=path.suffix)

    def view(self, tid: int, t: int, b: int) -> FlatView:
        view = self.views.get(tid)
        if view is not None:
            self.views.move_to_end(tid)
            return view
        with self.lock:
            traj = self.memory.get(tid)
            path = self.files.get(tid)
            pinned = self.pins.get(tid)
        if traj is None:
            if path is None:
                raise RbtoolError(f"trajectory {tid} is neither in memory nor on disk")
            traj, info = self._open(tid, path, pinned)
            if info.shape[:2] != (t, b):
                raise TrajectoryFileError(
                    f"{path}: tensors are [T, B] = {list(info.shape[:2])} but the index says {[t, b]}"
                )
        try:
            view = FlatView(traj, t, b, extra_fields=self.extra_fields)
        except RbtoolError as exc:
            raise TrajectoryFileError(f"{path or f'trajectory {tid}'}: {exc}") from None
        self.check_recorded(tid, view_signature(view), path)
        self.views[tid] = view
        while len(self.views) > self.max_open:
            self.views.popitem(last=False)
        return view

    def _open(self, tid: int, path: Path, pinned: PinnedFile | None) -> tuple[dict[str, Any], TrajectoryInfo]:
        header = self.headers.get(tid)
        if header is None or path.suffix != ".pt":
            return open_trajectory(path, pinned)
        try:
            opened = FileTrajectory(path, pinned, header)
        except TrajectoryFileError as exc:
            if pinned is None:
                raise
            raise type(exc)(str(exc).replace(str(pinned.read_path), str(path))) from None
        return opened.data, opened.info

    def header(self, tid: int) -> dict[str, Any] | None:
        """The header of a held `.pt` file (read once, then kept); None when it has none to read."""
        header = self.headers.get(tid)
        if header is not None:
            return header
        with self.lock:
            path = self.files.get(tid)
            pinned = self.pins.get(tid)
        if path is None or path.suffix != ".pt" or tid in self.memory:
            return None
        read_path = pinned.read_path if pinned is not None else path
        try:
            header = read_header(read_path)
        except UnusualLayout:
            return None
        except TrajectoryFileError as exc:
            raise type(exc)(str(exc).replace(str(read_path), str(path))) from None
        self.headers[tid] = header
        return header

    def _drop_raw(self, tid: int) -> None:
        with self._raw_lock:
            raw = self.raws.pop(tid, None)
            if raw is not None:
                self.raw_bytes -= raw.data.size
                self.held.free(raw)
            self.not_raw.discard(tid)

    def written(self, tid: int, path: Path) -> None:
        """A held trajectory's file is complete: read it from there and free the memory."""
        with self.lock:
            self.files[tid] = path
            self.memory.pop(tid, None)
            self.not_raw.discard(tid)

    def raw_many(
        self, tids: list[int], shape_of: Callable[[int], tuple[int, int]]
    ) -> list[RawTrajectory | None]:
        """raw() of each id (a batch's drawn files: the held ones under one lock)."""
        with self._raw_lock:
            found = [self.raws.get(tid) for tid in tids]
            for tid, raw in zip(tids, found, strict=True):
                if raw is not None:
                    self.raws.move_to_end(tid)
        for j, raw in enumerate(found):
            if raw is None:
                found[j] = self.raw(tids[j], *shape_of(tids[j]))
        return found

    def raw(self, tid: int, t: int, b: int) -> RawTrajectory | None:
        """The trajectory as bytes (see RawTrajectory), or None (in memory, unusual, .pkl)."""
        with self._raw_lock:
            raw = self.raws.get(tid)
            if raw is not None:
                self.raws.move_to_end(tid)
                return raw
        if tid in self.not_raw:
            return None
        with self.lock:
            path = self.files.get(tid)
            pinned = self.pins.get(tid)
            if path is None or tid in self.memory or path.suffix != ".pt":
                # noted under the lock: written() (the writer thread) clears the note when
                # the trajectory's file is complete, and must not be overtaken by it
                self.not_raw.add(tid)
                return None
        read_path = pinned.read_path if pinned is not None else path
        try:
            data = _read_small(read_path)
            header = self.headers.get(tid) or read_header(read_path, data)
            # headers are shared by files of one structure: so is what is derived from them
            known = self._raw_layouts.get((id(header), t, b))
            if known is None or known[0] is not header:
                if len(self._raw_layouts) >= 4096:
                    self._raw_layouts.clear()
                layout = raw_layout(header, str(path), t, b, self.extra_fields)
                # a small file is held as its sampled fields packed one after the other: where
                # each is in the file, and where it is in the packed bytes (shared, never changed)
                pieces, fields, at = [], {}, 0
                for field_path, spec, extra in layout:
                    size = spec.numel() * spec.itemsize
                    pieces.append((spec.data_start, spec.data_start + size))
                    fields[field_path] = (at, extra)
                    at += size
                table = {field_path: (spec.data_start, extra) for field_path, spec, extra in layout}
                known = (header, layout, header_extent(header), fields, pieces, table)
                self._raw_layouts[(id(header), t, b)] = known
            self.check_recorded(tid, self._header_signature(header), path)
            if data is not None:
                if len(data) < known[2]:
                    raise TrajectoryFileError(f"{path}: truncated (a tensor's data is cut short)")
                raw = RawTrajectory(b"".join([data[a:z] for a, z in known[4]]), t, b, known[3])
            else:
                raw = self._packed(path, pinned, t, b, known[1], (tid, known[2], known[5]))
        except UnusualLayout:
            self.not_raw.add(tid)
            return None
        except RbtoolError as exc:
            message = str(exc).replace(str(read_path), str(path))
            if not message.startswith(str(path)):
                message = f"{path}: {message}"
            raise TrajectoryFileError(message) from None
        with self._raw_lock:
            self.headers.setdefault(tid, header)
            held = self.raws.get(tid)
            if held is not None:  # another reader held it first
                return held
            self.held.put(raw)
            self.raws[tid] = raw
            self.raw_bytes += raw.data.size
            while self.raw_bytes > RAW_CACHE_MAX_BYTES and len(self.raws) > 1:
                _, dropped = self.raws.popitem(last=False)
                self.raw_bytes -= dropped.data.size
                self.held.free(dropped)
        return raw

    def _packed(
        self,
        path: Path,
        pinned: PinnedFile | None,
        t: int,
        b: int,
        layout: RawLayout,
        file: tuple[int, int, dict[FieldPath, tuple[int, int]]],
    ) -> RawTrajectory:
        """A large file as a RawTrajectory: fields with small rows read and packed, the others
        left on disk. `file` is (trajectory id, the bytes the header needs, the field table), for
        mapping it."""
        import torch

        handle = FileHandle(path, pinned)
        small = []
        disk: dict[FieldPath, tuple[FileRows, int]] = {}
        for field_path, spec, extra in layout:
            row_bytes = math.prod(spec.shape[2:]) * spec.itemsize
            if row_bytes >= ROW_READ_MIN_BYTES:
                rows = spec.shape[0] * spec.shape[1]
                shape = (rows, *spec.shape[2:])
                disk[field_path] = (
                    FileRows(handle, spec.data_start, shape, getattr(torch, spec.dtype)),
                    extra,
                )
            else:
                small.append((field_path, spec, extra))
        packed = bytearray(sum(spec.numel() * spec.itemsize for _, spec, _ in small))
        view = memoryview(packed)
        fields: dict[FieldPath, tuple[int, int]] = {}
        at = 0
        for field_path, spec, extra in small:
            size = spec.numel() * spec.itemsize
            if size and os.preadv(handle.fd(), [view[at : at + size]], spec.data_start) != size:
                raise TrajectoryFileError(f"{path}: truncated (a tensor's data is cut short)")
            fields[field_path] = (at, extra)
            at += size
        handle.close()
        # the table follows from the layout alone: files of one layout share it, so a batch
        # looks each field up once per layout, not once per drawn file
        shared = self._packed_tables.get(id(layout))
        if shared is not None and shared[0] is layout:
            fields = shared[1]
        else:
            if len(self._packed_tables) >= 4096:
                self._packed_tables.clear()
            self._packed_tables[id(layout)] = (layout, fields)
        return RawTrajectory(packed, t, b, fields, disk, (file[0], handle, file[1], file[2]))

    def read_headers(
        self, trajectories: Sequence[tuple[int, int, int]], progress: Callable[[int], None] | None = None
    ) -> None:
        """Read the headers of many held files (tid, T, B) at once, on a few threads.

        A small file is read whole for its header: its bytes are kept too (raw()), so the
        draws that follow find them held. Files without a readable header are left for
        signature() to open, and to report.
        """
        from concurrent.futures import ThreadPoolExecutor

        def read(part: Sequence[tuple[int, int, int]]) -> None:
            for tid, t, b in part:
                with contextlib.suppress(RbtoolError):
                    if self.raw(tid, t, b) is None:
                        self.header(tid)
                if progress is not None:
                    progress(1)

        tids = list(trajectories)
        workers = min(8, 2 * (os.cpu_count() or 1))
        step = -(-len(tids) // workers)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(read, [tids[i : i + step] for i in range(0, len(tids), step)]))

    def intern(self, signature: Signature) -> Signature:
        return self._interned.setdefault(signature, signature)

    def signature(self, tid: int, t: int, b: int, recorded: Signature | None = None) -> Signature:
        """What a batch takes from trajectory `tid` (fields, dtypes, row shapes; fields left out).

        From the first of: what is known already, `recorded` (the index's schema), the
        trajectory in memory, its file's header, the trajectory opened.
        """
        known = self.signatures.get(tid)
        if known is not None:
            return known
        if recorded is not None:
            self.recorded.add(tid)  # checked against the file when it is opened
        else:
            with self.lock:
                traj = self.memory.get(tid)
            if traj is not None:
                recorded = signature_of(traj, self.extra_fields)
            else:
                header = self.header(tid)
                if header is not None:
                    recorded = self._header_signature(header)
                else:
                    view = self.view(tid, t, b)
                    recorded = view_signature(view)
        signature = self.signatures[tid] = self.intern(recorded)
        return signature

    def _header_signature(self, header: dict[str, Any]) -> Signature:
        """signature_of(header), computed once per distinct structure (headers are shared)."""
        known = self._by_header.get(id(header))
        if known is not None and known[0] is header:
            return known[1]
        key = tuple((p, v.dtype, len(v.shape), v.shape[2:]) for p, v in iter_specs(header))
        signature = self._signature_keys.get(key)
        if signature is None:
            signature = self._signature_keys[key] = signature_of(header, self.extra_fields)
        if len(self._by_header) >= 4096:
            self._by_header.clear()
        self._by_header[id(header)] = (header, signature)
        return signature

    def forget(self, tid: int) -> None:
        """Drop what is known of a trajectory that left the window (its data stays held)."""
        self.signatures.pop(tid, None)
        self.recorded.discard(tid)
        self.headers.pop(tid, None)

    def check_recorded(self, tid: int, actual: Signature, path: Path | None) -> None:
        """A trajectory whose signature came from its index entry must hold those fields."""
        if tid in self.recorded and self.intern(actual) is not self.signatures.get(tid):
            raise TrajectoryFileError(
                f"{path or f'trajectory {tid}'}: its fields differ from the schema its index entry "
                "records; rbtool repair rewrites the index from the files"
            )

    def schema(self, tid: int, t: int, b: int) -> Schema:
        return dict(self.signature(tid, t, b)[0])


# What a batch takes from one trajectory: ((path, (dtype, row shape)), ...) in batch order, and
# the paths of the >= 2-dim fields it leaves out. Equal signatures are shared (interned).
Signature = tuple[tuple[tuple[FieldPath, tuple[Any, tuple[int, ...]]], ...], tuple[FieldPath, ...]]


def _torch_dtype(dtype: Any) -> Any:
    if isinstance(dtype, str):
        import torch

        return getattr(torch, dtype)
    return dtype


def signature_of(traj: dict[str, Any], extra_fields: bool) -> Signature:
    """The signature of a trajectory dict, of tensors or of a header's TensorSpecs."""
    items, left_out = sampled_items(traj, extra_fields)
    fields = tuple((p, (_torch_dtype(v.dtype), tuple(int(d) for d in v.shape[2:]))) for p, v in items)
    return fields, tuple(left_out)


def recorded_signature(fields: list[list[Any]], extra_fields: bool) -> Signature:
    """The signature of a schema an index records (layout.field_schema), without the file."""
    import torch

    skeleton: dict[str, Any] = {}
    for path, dtype, rest, extra in fields:
        node = skeleton
        for key in path[:-1]:
            node = node.setdefault(key, {})
        itemsize = getattr(torch, dtype).itemsize if hasattr(torch, dtype) else 1
        shape = (1 + extra, 1, *rest)
        node[path[-1]] = TensorSpec(dtype, itemsize, shape, shape, 0, 0, 0)
    return signature_of(skeleton, extra_fields)


def view_signature(view: FlatView) -> Signature:
    fields = tuple(
        (p, (f.rows.dtype, tuple(int(d) for d in f.rows.shape[1:]))) for p, f in view.fields.items()
    )
    return fields, tuple(view.left_out)


class WindowSchema:
    """The fields a window's trajectories share (SPEC §3 step 6), kept as the window moves.

    Counts each distinct signature over the window's positions `[lo, hi)`; when the window
    only moves forward (ids added at the end, old ones leaving at the front) only what
    entered and what left is looked at. The shared schema is worked out over the distinct
    signatures, in the first trajectory's field order.
    """

    def __init__(self) -> None:
        self.counts: dict[Signature, int] = {}
        self.members: deque[Signature] = deque()  # the signature at each window position
        self.generation: object = None
        self.lo = self.hi = 0
        self._shared: tuple[tuple[Any, ...], Schema, list[str]] | None = None

    @property
    def first(self) -> Signature | None:
        return self.members[0] if self.members else None

    def track(
        self,
        generation: object,
        lo: int,
        hi: int,
        signature_at: Callable[[int], Signature],
        left: Callable[[int], None] | None = None,
    ) -> None:
        """Bring the counts to positions `[lo, hi)`; `left(position)` for each that left."""
        if generation is not self.generation or lo < self.lo or hi < self.hi or lo > self.hi:
            if left is not None and generation is self.generation:
                for position in range(self.lo, min(self.hi, lo)):
                    left(position)
            self.counts, self.members = {}, deque()
            self.lo = self.hi = lo
        counts, members = self.counts, self.members
        for position in range(self.hi, hi):
            sig = signature_at(position)
            counts[sig] = counts.get(sig, 0) + 1
            members.append(sig)
        for position in range(self.lo, lo):
            sig = members.popleft()
            counts[sig] -= 1
            if not counts[sig]:
                del counts[sig]
            if left is not None:
                left(position)
        self.generation, self.lo, self.hi = generation, lo, hi

    def shared(self) -> tuple[Schema, list[str]]:
        """The shared schema and the fields left out anywhere in the window (dotted names)."""
        key = (self.first, *self.counts)
        if self._shared is not None and self._shared[0] == key:
            return self._shared[1], self._shared[2]
        distinct = [dict(sig[0]) for sig in self.counts]
        schema: Schema = {}
        if self.first is not None:
            schema = {p: spec for p, spec in self.first[0] if all(d.get(p) == spec for d in distinct)}
        left_out: dict[str, None] = {}
        for sig in self.counts:
            left_out.update(dict.fromkeys(".".join(p) for p in sig[1]))
        self._shared = (key, schema, list(left_out))
        return schema, list(left_out)


def shared_schema(schemas: Sequence[Schema]) -> Schema:
    """Fields present in every schema with the same dtype and per-sample shape (first's order)."""
    if not schemas:
        return {}
    first, rest = schemas[0], schemas[1:]
    return {p: spec for p, spec in first.items() if all(s.get(p) == spec for s in rest)}


def nest(flat: dict[FieldPath, Any]) -> dict[str, Any]:
    """{('curr_obs', 'states'): x} -> {'curr_obs': {'states': x}}."""
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


# Fields whose rows are held in memory are concatenated over the window when they total
# at most this many bytes: then a batch costs one index_select per field.
WINDOW_CACHE_MAX_BYTES = 512 << 20


def flat_rows(view: FlatView, path: FieldPath) -> torch.Tensor:
    """A held field as [T*B, ...] rows, done-like bootstrap rows dropped (a copy when E > 0)."""
    field = view.fields[path]
    if not field.extra:
        return field.rows
    stored = field.rows.reshape(view.t + field.extra, view.b, *field.rows.shape[1:])
    return drop_bootstrap_rows(stored, view.t).reshape(-1, *field.rows.shape[1:])


def window_cache(
    window_ids: Sequence[int], schema: Schema, view_of: Callable[[int], FlatView]
) -> dict[FieldPath, torch.Tensor]:
    """The window's in-memory fields, each concatenated into one [window samples, ...] tensor.

    Row `g` of each is the window's global sample `g`, so a draw's ids index it directly.
    Fields left on disk in any trajectory, and windows over the byte budget, are left out.
    """
    import torch

    views = [view_of(tid) for tid in window_ids]
    held = [p for p in schema if all(isinstance(v.fields[p].rows, torch.Tensor) for v in views)]
    per_row = sum(math.prod(schema[p][1]) * schema[p][0].itemsize for p in held)
    if per_row * sum(v.t * v.b for v in views) > WINDOW_CACHE_MAX_BYTES:
        return {}
    return {p: torch.cat([flat_rows(v, p) for v in views]) for p in held}


@dataclass
class CachedRows:
    """Rows of a run of the window's trajectories, already concatenated in memory.

    Draws at window positions `[first, stop)` read row `global index + shift` of `columns`.
    """

    columns: dict[FieldPath, torch.Tensor]
    first: int
    stop: int
    shift: int


class RowCache:
    """The sampled rows of trajectories added to a buffer, concatenated as they are added.

    Covers a run of id-list positions `[lo, hi)`; row 0 is cumulative sample `base`. Adding
    appends (amortised O(rows)); when the window has moved past more rows than it still
    covers, the dead rows are dropped. A field that a newly added trajectory lacks (or holds
    with another dtype or row shape) stops being cached. Bounded by `max_bytes`: past it,
    trajectories are not cached and are read from their views.
    """

    def __init__(self, max_bytes: int = WINDOW_CACHE_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.reset(0, 0)

    def reset(self, position: int, base: int) -> None:
        self.columns: dict[FieldPath, torch.Tensor] = {}
        self.specs: dict[FieldPath, tuple[Any, tuple[int, ...]]] = {}
        self.lo = self.hi = position
        self.base = base
        self.rows = 0
        self.full = False

    def _row_bytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for dtype, shape in self.specs.values())

    def append(self, position: int, base: int, view: FlatView) -> None:
        """Cache trajectory `position` (its first sample is cumulative sample `base`)."""
        import torch

        if position != self.hi or (self.full and self.lo == self.hi):
            self.reset(position, base)
        if self.full:
            return
        fields = {p: f for p, f in view.fields.items() if isinstance(f.rows, torch.Tensor)}
        specs = {p: (f.rows.dtype, tuple(f.rows.shape[1:])) for p, f in fields.items()}
        if self.lo == self.hi:
            self.specs = specs
            self.columns = {}
        else:
            for path in [p for p, spec in self.specs.items() if specs.get(p) != spec]:
                del self.specs[path]
                self.columns.pop(path, None)
        n = view.t * view.b
        if (self.rows + n) * self._row_bytes() > self.max_bytes:
            self.full = True
            return
        for path in self.specs:
            rows = flat_rows(view, path)
            column = self.columns.get(path)
            if column is None or column.shape[0] < self.rows + n:
                grown = torch.empty((max(2 * (self.rows + n), 64), *rows.shape[1:]), dtype=rows.dtype)
                if column is not None:
                    grown[: self.rows] = column[: self.rows]
                column = self.columns[path] = grown
            column[self.rows : self.rows + n] = rows
        self.rows += n
        self.hi += 1

    def trim(self, lo: int, base: int) -> None:
        """The window now starts at position `lo` (cumulative sample `base`): drop dead rows."""
        if lo >= self.hi:
            if self.lo != self.hi or self.full:
                self.reset(lo, base)
            return
        dead = base - self.base
        if lo > self.lo and dead > self.rows - dead:
            self.columns = {p: c[dead : self.rows].clone() for p, c in self.columns.items()}
            self.rows -= dead
            self.lo, self.base = lo, base

    def covering(self, lo: int, hi: int, window_base: int) -> CachedRows | None:
        """What this cache holds of the window `[lo, hi)` whose first sample is `window_base`."""
        first, stop = max(self.lo, lo), min(self.hi, hi)
        if first >= stop or not self.columns:
            return None
        columns = {p: c[: self.rows] for p, c in self.columns.items()}
        return CachedRows(columns, first - lo, stop - lo, window_base - self.base)


def gather(
    draw: Draw,
    schema: Schema,
    view_of: Callable[[int], FlatView],
    cached: dict[FieldPath, torch.Tensor] | CachedRows | None = None,
    raws_of: Callable[[list[int]], list[RawTrajectory | None]] | None = None,
    rowmap: RowMap | None = None,
    memory: BatchMemory | None = None,
) -> dict[str, Any]:
    """Build the batch, copying only the drawn rows (into memory from `memory` when given).

    Draws covered by `cached` (a RowCache's run, or a window_cache covering the whole window)
    cost one index_select per field. Draws from small files held as bytes (`raws_of`) cost one
    gather of rows per field per block of held bytes they reach (their large rows one pread per row, or with
    `rowmap` one index_select per field over the mapped files). The others are grouped by
    trajectory; each (trajectory, field) pair costs one index_select (or one read per row for
    fields left on disk) written into its rows of the output. The index arithmetic is done in
    numpy: on a few hundred numbers torch's thread pool costs more than the work.
    """
    if rowmap is None:
        return _gather(draw, schema, view_of, cached, raws_of, None, memory)
    with rowmap.lock:  # nothing is unmapped or moved while this batch reads the map
        rowmap.settle()
        batch = _gather(draw, schema, view_of, cached, raws_of, rowmap, memory)
        rowmap.after_batch()
    return batch


def _gather(
    draw: Draw,
    schema: Schema,
    view_of: Callable[[int], FlatView],
    cached: dict[FieldPath, torch.Tensor] | CachedRows | None,
    raws_of: Callable[[list[int]], list[RawTrajectory | None]] | None,
    rowmap: RowMap | None,
    memory: BatchMemory | None = None,
) -> dict[str, Any]:
    import numpy as np
    import torch

    def empty(path: FieldPath, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if memory is None:
            return torch.empty(shape, dtype=dtype)
        return memory.empty(path, shape, dtype)

    if isinstance(cached, dict):
        cached = CachedRows(cached, 0, len(draw.window_ids), 0) if cached else None
    positions = draw.positions.numpy()
    local = draw.local_indices.numpy()
    count = positions.size
    covered: np.ndarray | None = None
    cache_rows: torch.Tensor | None = None
    if cached is not None:
        mask = (positions >= cached.first) & (positions < cached.stop)
        if mask.any():
            covered = np.flatnonzero(mask)
            cache_rows = torch.from_numpy(draw.global_indices.numpy()[covered] + cached.shift)
    every = np.arange(count)
    uncovered = every if covered is None else np.flatnonzero(~mask)
    groups: dict[str, _Group] = {}  # draws read view by view: all of them, or those not cached

    def group(key: str) -> _Group:
        if key not in groups:
            selection = every if key == "every" else uncovered
            groups[key] = _Group(selection, positions, local, draw.window_ids, view_of, raws_of, rowmap)
        return groups[key]

    out: dict[FieldPath, torch.Tensor] = {}
    for path, (dtype, shape) in schema.items():
        in_cache = cached is not None and covered is not None and path in cached.columns
        if in_cache and covered is not None and covered.size == count:
            assert cached is not None and cache_rows is not None
            column = cached.columns[path]
            out[path] = torch.index_select(column, 0, cache_rows, out=empty(path, (count, *shape), dtype))
            continue
        target = empty(path, (count, *shape), dtype)
        if in_cache:
            assert cached is not None and covered is not None and cache_rows is not None
            target.index_copy_(0, torch.from_numpy(covered), cached.columns[path].index_select(0, cache_rows))
            group("uncovered").fill(path, target)
        else:
            group("every").fill(path, target)
        out[path] = target
    return nest({path: out[path] for path in schema})


class _Group:
    """Draws (a selection of a Draw's rows) read trajectory by trajectory: those of small files
    held as bytes together (_RawRows), the others view by view (_ViewRows)."""

    def __init__(
        self,
        selection: Any,
        positions: Any,
        local: Any,
        window_ids: Sequence[int],
        view_of: Callable[[int], FlatView],
        raws_of: Callable[[list[int]], list[RawTrajectory | None]] | None,
        rowmap: RowMap | None = None,
    ) -> None:
        import numpy as np

        self.parts: list[_RawRows | _ViewRows] = []
        if raws_of is not None and selection.size:
            unique, inverse = np.unique(positions[selection], return_inverse=True)
            raws = raws_of(ids_at(window_ids, unique.tolist()))
            held = np.array([r is not None for r in raws], dtype=bool)
            if held.any():
                mask = held[inverse]
                kept = [r for r in raws if r is not None]
                slot = np.cumsum(held) - 1  # unique position -> index in kept
                chosen = selection[mask]
                self.parts.append(_RawRows(chosen, slot[inverse[mask]], local[chosen], kept, rowmap))
                selection = selection[~mask]
        if selection.size:
            self.parts.append(_ViewRows(selection, positions, local, window_ids, view_of))

    def fill(self, path: FieldPath, target: Any) -> None:
        for part in self.parts:
            part.fill(path, target)


class _RawRows:
    """Draws from files held as bytes: one gather of rows per field per block of held bytes
    (HeldBlocks) that the draws reach, read in place.

    With a row map, when every drawn file can be mapped, every field of them (small rows
    too) is one index_select over the map.
    """

    def __init__(
        self, dest: Any, slots: Any, local: Any, raws: list[RawTrajectory], rowmap: RowMap | None = None
    ) -> None:
        import numpy as np

        self.dest, self.slots, self.local, self.raws = dest, slots, local, raws
        self.rowmap = rowmap
        self._tb: tuple[Any, Any] | None = None
        self._data: tuple[list[Any], Any, Any] | None = None
        # where each raw's file starts in the row map (None: not every one is mapped)
        self.mapped = self._map_all() if rowmap is not None else None
        # the raws sharing one field table (tables are shared by files of one header)
        layouts: dict[int, tuple[dict[FieldPath, tuple[int, int]], list[int]]] = {}
        for k, raw in enumerate(raws):
            table = raw.fields if self.mapped is None else raw.file[3]  # type: ignore[index]
            layouts.setdefault(id(table), (table, []))[1].append(k)
        self.layouts = [(fields, np.array(ks, dtype=np.int64)) for fields, ks in layouts.values()]

    def _map_all(self) -> Any:
        if any(raw.file is None for raw in self.raws):
            return None
        return self._mapped_starts(range(len(self.raws)))

    @property
    def data(self) -> tuple[list[Any], Any, Any]:
        """Where the held bytes are, read in place: the blocks the raws' bytes are in, where
        each raw's bytes start in its block, and which block each raw's bytes are in."""
        import numpy as np

        if self._data is None:
            blocks: list[Any] = []  # HeldBlocks, or the bytes of a raw not in one
            where: dict[int, int] = {}  # id(block) -> index in blocks
            block_of = np.empty(len(self.raws), dtype=np.int64)
            start = np.empty(len(self.raws), dtype=np.int64)
            for k, raw in enumerate(self.raws):
                block, at = (raw.data, 0) if raw.block is None else (raw.block, raw.at)
                j = where.get(id(block))
                if j is None:
                    j = where[id(block)] = len(blocks)
                    blocks.append(block)
                block_of[k], start[k] = j, at
            self._data = (blocks, start, block_of)
        return self._data

    def _copy_held(self, out: Any, first: Any, row_bytes: int, chosen: Any = None) -> None:
        """Rows of `row_bytes` starting at bytes `first` of each draw's block into rows
        `dest` of `out` (of the draws `chosen` only, when given: `first` is then theirs)."""
        import numpy as np

        blocks, _, block_of = self.data
        dest = self.dest if chosen is None else self.dest[chosen]

        def rows_of(block: Any) -> Any:
            if not isinstance(block, HeldBlock):
                return overlapping_rows(block, row_bytes)
            view = block.views.get(row_bytes)
            if view is None:
                view = block.views[row_bytes] = overlapping_rows(block.buf, row_bytes)
            return view

        if len(blocks) == 1:
            out[dest] = rows_of(blocks[0])[first]
            return
        of_draw = block_of[self.slots if chosen is None else self.slots[chosen]]
        for j, buf in enumerate(blocks):
            mine = np.flatnonzero(of_draw == j)
            if mine.size:
                out[dest[mine]] = rows_of(buf)[first[mine]]

    def _rows(self, extras: Any) -> Any:
        """Stored rows of each draw for a field with per-draw bootstrap rows `extras`."""
        import numpy as np

        if not extras.any():
            return self.local
        if self._tb is None:
            self._tb = (
                np.array([r.t for r in self.raws], dtype=np.int64)[self.slots],
                np.array([r.b for r in self.raws], dtype=np.int64)[self.slots],
            )
        return done_rows(self.local, self._tb[0], self._tb[1], extras)

    def _gather_mapped(self, chosen: Any, byte: Any, row_bytes: int, target: Any) -> None:
        """Rows of `row_bytes` starting at map bytes `byte` into rows `dest[chosen]` of `target`."""
        import torch

        assert self.rowmap is not None
        view, index = self.rowmap.rows(row_bytes, byte)
        flat = target.view(torch.uint8).reshape(target.shape[0], row_bytes)
        if chosen.size == target.shape[0]:  # every row of the batch: written in place
            torch.index_select(view, 0, torch.from_numpy(index), out=flat)
        else:
            flat.index_copy_(
                0, torch.from_numpy(self.dest[chosen]), view.index_select(0, torch.from_numpy(index))
            )

    def fill(self, path: FieldPath, target: Any) -> None:
        import numpy as np
        import torch

        row_bytes = math.prod(target.shape[1:]) * target.element_size()
        if not row_bytes:
            return
        count = len(self.raws)
        starts = np.zeros(count, dtype=np.int64)
        extras = np.zeros(count, dtype=np.int64)
        if self.mapped is not None:  # every field of every raw from the map
            for table, ks in self.layouts:
                starts[ks], extras[ks] = table[path]
            rows = self._rows(extras[self.slots])
            byte = (self.mapped + starts)[self.slots] + rows * row_bytes
            self._gather_mapped(np.arange(self.dest.size), byte, row_bytes, target)
            return
        held = np.zeros(count, dtype=bool)
        for fields, ks in self.layouts:
            entry = fields.get(path)
            if entry is not None:
                starts[ks], extras[ks], held[ks] = entry[0], entry[1], True
        others = np.flatnonzero(~held).tolist()
        disk = [self.raws[k].disk[path] for k in others]  # (file rows, E) of each raw not holding it
        extras[others] = [extra for _, extra in disk]
        rows = self._rows(extras[self.slots])
        out = target.view(torch.uint8).reshape(target.shape[0], row_bytes).numpy()
        file_start = self.data[1]
        if not others:
            self._copy_held(out, (file_start + starts)[self.slots] + rows * row_bytes, row_bytes)
            return
        in_data = held[self.slots]
        if in_data.any():
            chosen = np.flatnonzero(in_data)
            first = (file_start + starts)[self.slots[chosen]] + rows[chosen] * row_bytes
            self._copy_held(out, first, row_bytes, chosen)
        if self.rowmap is not None:
            mapped = self._mapped_starts(others)
            if mapped is not None:
                chosen = np.flatnonzero(~in_data)
                where = np.zeros(count, dtype=np.int64)  # raw -> where its field starts in the map
                where[others] = mapped + np.array([self.raws[k].disk[path][0].offset for k in others])
                self._gather_mapped(
                    chosen, where[self.slots[chosen]] + rows[chosen] * row_bytes, row_bytes, target
                )
                return
        # fields with large rows: one pread per draw, at its file's field start + row * row bytes
        # (descriptors taken here, in one thread: the descriptor cache is not shared safely)
        fds = np.zeros(count, dtype=np.int64)
        field_start = np.zeros(count, dtype=np.int64)
        field_start[others] = [rows_of.offset for rows_of, _ in disk]
        chosen = np.flatnonzero(~in_data)
        slots, stored = self.slots[chosen], rows[chosen]
        offsets = field_start[slots] + stored * row_bytes
        # The descriptors of the files read together must all stay open until their reads are
        # done: the cache closes its least recently used past MAX_OPEN_FDS (and the number of
        # a closed one is handed to the next file opened), so files are read in runs of half that.
        at_once = max(1, MAX_OPEN_FDS // 2)
        for first in range(0, len(others), at_once):
            part = others[first : first + at_once]
            fds[part] = [rows_of.owner.fd() for rows_of, _ in disk[first : first + at_once]]
            mine = np.arange(slots.size) if len(part) == len(others) else np.flatnonzero(np.isin(slots, part))

            def named(j: int, mine: Any = mine) -> tuple[Path, int]:
                return self.raws[int(slots[mine[j]])].disk[path][0].owner.path, int(stored[mine[j]])

            read_rows(fds[slots[mine]], offsets[mine], self.dest[chosen[mine]], row_bytes, target, named)

    def _mapped_starts(self, ks: Sequence[int]) -> Any:
        """Where the file of each raw in `ks` starts in the row map (mapped as needed), or None
        when one cannot be mapped (held in memory only, or shorter than its header says: the
        pread path reports it)."""
        import numpy as np

        rowmap = self.rowmap
        assert rowmap is not None
        while True:
            moves = rowmap.moves
            starts = np.empty(len(ks), dtype=np.int64)
            for j, k in enumerate(ks):
                file = self.raws[k].file
                if file is None:
                    return None
                key, handle, extent, _ = file
                slot = rowmap.slots.get(key)
                if slot is None:
                    fd = handle.fd()
                    size = os.fstat(fd).st_size
                    if size < extent:
                        return None
                    starts[j] = rowmap.offset(key, fd, size)
                else:
                    starts[j] = slot[0]
            if rowmap.moves == moves:  # no mapping moved while these were worked out
                return starts


class _ViewRows:
    """Draws read view by view, grouped by trajectory."""

    def __init__(
        self,
        selection: Any,
        positions: Any,
        local: Any,
        window_ids: Sequence[int],
        view_of: Callable[[int], FlatView],
    ) -> None:
        import numpy as np
        import torch

        order = np.argsort(positions[selection], kind="stable")
        self.dest = selection[order]
        self.local = local[self.dest]
        unique, starts, counts = np.unique(positions[self.dest], return_index=True, return_counts=True)
        self.counts = counts
        self.views = [view_of(window_ids[k]) for k in unique.tolist()]
        self.bounds = list(zip(starts.tolist(), (starts + counts).tolist(), strict=True))
        self.plain = [torch.from_numpy(self.local[a:z]) for a, z in self.bounds]
        self.dest_t = torch.from_numpy(self.dest)
        self._tb: tuple[Any, Any] | None = None

    def rows_of(self, fields: list[FlatField]) -> list[Any]:
        import numpy as np
        import torch

        if not any(f.extra for f in fields):
            return self.plain
        if self._tb is None:
            self._tb = (
                np.repeat([v.t for v in self.views], self.counts),
                np.repeat([v.b for v in self.views], self.counts),
            )
        extra = np.repeat([f.extra for f in fields], self.counts)
        mapped = done_rows(self.local, self._tb[0], self._tb[1], extra)
        return [torch.from_numpy(mapped[a:z]) for a, z in self.bounds]

    def fill(self, path: FieldPath, target: Any) -> None:
        """Write the drawn rows of field `path` into their rows of `target`."""
        import torch

        fields = [view.fields[path] for view in self.views]
        rows = self.rows_of(fields)
        if all(isinstance(f.rows, torch.Tensor) for f in fields):
            part = torch.empty((self.dest.size, *target.shape[1:]), dtype=target.dtype)
            for field, idx, (a, z) in zip(fields, rows, self.bounds, strict=True):
                torch.index_select(field.rows, 0, idx, out=part[a:z])
            target.index_copy_(0, self.dest_t, part)
        else:  # rows read from files go straight to their final places
            for view, idx, (a, z) in zip(self.views, rows, self.bounds, strict=True):
                view.rows(path, idx, target, self.dest[a:z])


def view_scores(view: FlatView) -> np.ndarray:
    """Scores of a trajectory already open as a FlatView (reads only its reward rows).

    Rewards with wide rows may still be in their file (read on demand by the sampler);
    they are then read whole, once, into a tensor.
    """
    import numpy as np
    import torch

    from rbtool.buffer.topk import scores_of_rows

    field = view.fields.get(("rewards",))
    if field is None:
        return scores_of_rows(None, view.t * view.b)
    rows = field.rows
    if not isinstance(rows, torch.Tensor):
        every = np.arange(int(rows.shape[0]))
        full = torch.empty(tuple(rows.shape), dtype=rows.dtype)
        rows.take(every, full, every)
        rows = full
    return scores_of_rows(rows, view.t * view.b)
