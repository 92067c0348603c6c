"""One address range over many `.pt` files, so that the drawn rows of a field are one gather.

Each file is mapped (read-only, shared, whole) at its own page-aligned slot of one reserved
range; a field's row `r` of the file at slot `s` starts at byte `s + data start + r * row
bytes`. Since slots are page-aligned and torch aligns each record to 64 bytes, every row
start is a multiple of `step = gcd(64, row bytes, ...)`, so one overlapping strided view
`[n, row bytes]` with strides `(step, 1)` addresses every row of every mapped file, and a
batch is one `index_select` per field (what TorchRL's one memory-mapped array gives it).

Slots are handed out in order and released when a file leaves the window; when the range is
full, the live mappings are moved (mremap, no file reopened) into a range twice the size they
need, so adds and evictions cost O(files added + files left) amortised, never O(window).

Mapped file pages are page cache (reclaimable, shared with every reader of the file), but
they count in the process's resident set: with a `budget`, the mapping's resident pages are
dropped (MADV_DONTNEED; the page cache keeps them) after a batch that leaves more than
`budget` bytes of file pages resident. Linux only (mremap); elsewhere `available()` is False.
A mapped file that is truncated while mapped makes reads past its end fault (SIGBUS), which
is why mapping is a setting and reading with pread the default.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import sys
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from rbtool.errors import RbtoolError

if TYPE_CHECKING:
    import torch

PAGE = mmap.PAGESIZE
ALIGN = 64  # torch's zip writer starts every record at a multiple of 64 bytes
FIRST_RESERVE = 1 << 30

_PROT_NONE, _PROT_READ = 0, 1
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_MAP_POPULATE = 0x8000
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_MADV_DONTNEED = 4
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc: Any = None


def load_libc() -> Any:
    """libc through ctypes, its mapping calls typed (loaded once)."""
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        void, size, c_int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        libc.mmap.restype = void
        libc.mmap.argtypes = [void, size, c_int, c_int, c_int, ctypes.c_long]
        libc.mremap.restype = void
        libc.mremap.argtypes = [void, size, size, c_int, void]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc = libc
    return _libc


def available() -> bool:
    """True where files can be mapped into one reserved range (Linux, 64-bit)."""
    if not sys.platform.startswith("linux") or sys.maxsize < 2**32:
        return False
    try:
        libc = load_libc()
        return all(hasattr(libc, name) for name in ("mmap", "mremap", "munmap", "madvise"))
    except OSError:
        return False


def _pages(size: int) -> int:
    return -(-size // PAGE) * PAGE


def _check(result: Any, what: str) -> int:
    if result is None or result == _MAP_FAILED:
        errno = ctypes.get_errno()
        raise RbtoolError(f"cannot {what}: {os.strerror(errno)}")
    return int(result)


def _file_resident() -> int:
    """Bytes of file-backed pages resident in this process (statm's third field)."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[2]) * PAGE


class RowMap:
    """Files mapped side by side in one reserved address range, each under a key."""

    def __init__(self, budget: int | None = None) -> None:
        self.libc = load_libc()
        self.budget = budget
        self.base = 0
        self.reserved = 0
        self.end = 0  # the next free slot
        self.live = 0  # bytes of live slots
        self.slots: dict[int, tuple[int, int]] = {}  # key -> (offset, mapped size)
        self.moves = 0  # times the live mappings were moved to a larger range
        self.drops = 0  # times resident pages were dropped to stay under the budget
        self._views: dict[tuple[int, int], torch.Tensor] = {}
        self._resident_base: int | None = None
        # A gather holds `lock` from the first mapping to the last row copied, so nothing is
        # unmapped or moved under it; releases asked for meanwhile (by another thread, which
        # may hold the store's lock) wait in `_released` until the next gather begins.
        self.lock = threading.RLock()
        self._released: deque[int] = deque()

    def __len__(self) -> int:
        return len(self.slots)

    def _reserve(self, size: int) -> int:
        flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE
        return _check(self.libc.mmap(None, size, _PROT_NONE, flags, -1, 0), "reserve address space")

    def _grow(self, need: int) -> None:
        """Move every live mapping, packed in key order, into a range with room for `need` more."""
        size = max(FIRST_RESERVE, _pages(2 * (self.live + need)))
        new = self._reserve(size)
        at = 0
        moved: dict[int, tuple[int, int]] = {}
        for key, (offset, length) in self.slots.items():
            flags = _MREMAP_MAYMOVE | _MREMAP_FIXED
            _check(self.libc.mremap(self.base + offset, length, length, flags, new + at), "move a mapping")
            moved[key] = (at, length)
            at += length
        if self.reserved:
            self.libc.munmap(self.base, self.reserved)
        self.base, self.reserved, self.end, self.slots = new, size, at, moved
        self._views.clear()
        self.moves += 1

    def offset(self, key: int, fd: int, size: int) -> int:
        """Where the file `fd` (`size` bytes) starts in the range, mapping it the first time."""
        slot = self.slots.get(key)
        if slot is not None:
            return slot[0]
        length = _pages(max(size, 1))
        if self.end + length > self.reserved:
            self._grow(length)
        if self.budget is not None and self._resident_base is None:
            self._resident_base = _file_resident()
        at = self.base + self.end
        # without a budget every page ends up mapped: map them now, in one call per file,
        # rather than one fault per drawn row later
        flags = _MAP_SHARED | _MAP_FIXED | (_MAP_POPULATE if self.budget is None else 0)
        _check(self.libc.mmap(at, length, _PROT_READ, flags, fd, 0), "map a trajectory file")
        self.slots[key] = (self.end, length)
        self.end += length
        self.live += length
        return self.end - length

    def release(self, key: int) -> None:
        """Unmap a file when the next gather begins (any thread may ask, without the lock)."""
        self._released.append(key)

    def settle(self) -> None:
        """Unmap the files released since the last gather: their slots go back to the
        reservation (not reused until the next move). Called with `lock` held."""
        while self._released:
            slot = self.slots.pop(self._released.popleft(), None)
            if slot is None:
                continue
            offset, length = slot
            flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED
            _check(self.libc.mmap(self.base + offset, length, _PROT_NONE, flags, -1, 0), "unmap a file")
            self.live -= length

    def rows(self, row_bytes: int, starts: Any) -> tuple[torch.Tensor, Any]:
        """A strided view of rows of `row_bytes` and the index of each row starting at `starts`."""
        import numpy as np
        import torch

        step = math.gcd(ALIGN, row_bytes, int(np.gcd.reduce(starts)) if len(starts) else 0)
        view = self._views.get((row_bytes, step))
        if view is None:
            count = (self.reserved - row_bytes) // step + 1
            memory = (ctypes.c_uint8 * self.reserved).from_address(self.base)
            flat = torch.frombuffer(memory, dtype=torch.uint8)
            view = self._views[(row_bytes, step)] = torch.as_strided(flat, (count, row_bytes), (step, 1))
        return view, starts // step

    def after_batch(self) -> None:
        """Drop the mapping's resident pages when more than the budget of file pages is resident."""
        if self.budget is None or self._resident_base is None:
            return
        resident = _file_resident()
        if resident - self._resident_base > self.budget:
            if self.libc.madvise(self.base, self.reserved, _MADV_DONTNEED) != 0:
                raise RbtoolError(f"cannot drop mapped pages: {os.strerror(ctypes.get_errno())}")
            self._resident_base = _file_resident()
            self.drops += 1

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def close(self) -> None:
        """Unmap everything; only when no gather can be running (or from __del__)."""
        self._views.clear()
        self._released.clear()
        if self.reserved:
            self.libc.munmap(self.base, self.reserved)
        self.base = self.reserved = self.end = self.live = 0
        self.slots.clear()
        self._resident_base = None
