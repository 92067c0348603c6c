"""`.pt` trajectory files read for sampling: rows read with pread, the descriptor cache, pinned files.

A trajectory file opened for sampling (FileTrajectory) holds its small fields in memory and
leaves fields with large rows in the file (FileRows), read row by row when drawn. Descriptors
are opened on demand and kept in a bounded cache (FileHandle); a loaded checkpoint's files
can be pinned open (PinnedFile) so that they stay readable when their names are deleted or
replaced.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rbtool.errors import TrajectoryFileError
from rbtool.files import trajfile
from rbtool.files.ptheader import (
    SMALL_FILE_BYTES,
    TensorSpec,
    UnusualLayout,
    map_specs,
    read_header,
)
from rbtool.files.ptheader import read_small as read_whole
from rbtool.format.layout import TrajectoryInfo, describe

# Rows at least this large are read from the file on demand; smaller fields are read whole.
ROW_READ_MIN_BYTES = 2048


def _fd_budget() -> int:
    """A quarter of the process's descriptor limit, at least 16 and at most 1024."""
    return max(16, min(1024, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4))


# File descriptors kept open across batches (least recently used closed first).
MAX_OPEN_FDS = _fd_budget()
_OPEN_FILES: OrderedDict[int, FileHandle] = OrderedDict()


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
        import numpy as np

        stored = np.asarray(rows, dtype=np.int64)
        if self.row_bytes and stored.size:  # no descriptor opened when there is nothing to read
            fds = np.full(stored.size, self.owner.fd(), dtype=np.int64)
            offsets = self.offset + stored * self.row_bytes
            read_rows(fds, offsets, dest, self.row_bytes, out, lambda j: (self.owner.path, int(stored[j])))


def files_read_together() -> int:
    """How many files a reader may take descriptors of and read together: the cache closes its
    least recently used past MAX_OPEN_FDS (and the number of a closed one is handed to the next
    file opened), so the descriptors of half that many all stay open until their reads are done."""
    return max(1, MAX_OPEN_FDS // 2)


def close_open_files() -> None:
    """Close every descriptor the cache keeps open (files reopen on demand)."""
    for opened in list(_OPEN_FILES.values()):
        opened.close()


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


def read_exactly(handle: FileHandle, buffer: Any, offset: int) -> None:
    """Fill `buffer` with the file's bytes from `offset` on; a short read means the file is cut short."""
    if len(buffer) and os.preadv(handle.fd(), [buffer], offset) != len(buffer):
        raise TrajectoryFileError(f"{handle.path}: truncated (a tensor's data is cut short)")


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
        read_path = name_to_read(path, pin)
        whole: bytes | None = None
        if header is None:
            whole = read_small(read_path)
            header = read_header(read_path, whole)
        elif _file_size(read_path) <= SMALL_FILE_BYTES:
            whole = read_small(read_path)
        self.header = header
        self.info = describe(header, str(path), TensorSpec)
        self._whole = memoryview(whole) if whole is not None else None
        self.data = map_specs(header, self._place)
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
            read_exactly(self, data, spec.start)
        if len(data) != spec.nbytes:
            raise TrajectoryFileError(f"{self.path}: truncated (a tensor's data is cut short)")
        raw = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        return raw.view(dtype).as_strided(spec.shape, spec.stride, spec.offset)


def _file_size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError as exc:
        raise TrajectoryFileError(f"{path}: cannot read ({exc.strerror})") from None


def read_small(path: Path) -> bytes | None:
    """A regular file's bytes when it is small enough to read whole; None otherwise."""
    return read_whole(path, SMALL_FILE_BYTES)


# Files pinned open so that a loaded checkpoint can be deleted or replaced (rotation)
# while the buffer still reads it; beyond this many, files are read by name.
MAX_PINNED = _fd_budget()
_PINNED_COUNT = [0]
_PIN_LOCK = threading.Lock()


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class PinnedFile:
    """An open descriptor on a loaded trajectory file: its data stays readable after the
    name is deleted or replaced, as long as the buffer lists it."""

    def __init__(self, path: Path, follow: bool = True) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | (0 if follow else _NOFOLLOW))
        info = os.fstat(self.fd)
        self._identity = (info.st_dev, info.st_ino)
        with _PIN_LOCK:
            _PINNED_COUNT[0] += 1

    @staticmethod
    def budget_spent() -> bool:
        """True when no more files may be pinned."""
        return _PINNED_COUNT[0] >= MAX_PINNED

    @classmethod
    def try_open(cls, path: Path, follow: bool = True) -> PinnedFile | None:
        """Pin `path` if the budget allows and the file opens; None otherwise (read by name).
        `follow=False`: a symbolic link does not open."""
        if cls.budget_spent():
            return None
        try:
            return cls(path, follow)
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


def name_to_read(path: Path, pin: PinnedFile | None) -> Path:
    """The name `path`'s file is read by: its pinned descriptor's when pinned (the name may be
    gone or replaced since)."""
    return path if pin is None else pin.read_path


@contextlib.contextmanager
def naming(path: Path, pin: PinnedFile | None) -> Iterator[None]:
    """File errors raised inside name `path`, also those of reading it through its pinned descriptor."""
    try:
        yield
    except TrajectoryFileError as exc:
        if pin is None:
            raise
        raise type(exc)(str(exc).replace(str(pin.read_path), str(path))) from None


def open_trajectory(
    path: Path, pin: PinnedFile | None = None, header: dict[str, Any] | None = None
) -> tuple[dict[str, Any], TrajectoryInfo]:
    """A trajectory file's fields (large `.pt` rows left on disk where possible) and its info.

    `header` is a `.pt` file's header when it was read already (its structure is not read
    again). Errors name the file, also when it is read through its pinned descriptor.
    """
    with naming(path, pin):
        if path.suffix == ".pt":
            try:
                opened = FileTrajectory(path, pin, header)
                return opened.data, opened.info
            except UnusualLayout:
                pass  # layouts the header reader does not know: torch's own loader decides
        traj = trajfile.load(name_to_read(path, pin), mmap=True, suffix=path.suffix)
        info = describe(traj, str(path))
    return traj, info


def file_header(path: Path, pin: PinnedFile | None, data: bytes | None = None) -> dict[str, Any]:
    """The header of the `.pt` file `path` (`data`: its bytes, when read whole), read through its
    pinned descriptor when pinned; errors name `path`."""
    with naming(path, pin):
        header = read_header(name_to_read(path, pin), data)
    return header
