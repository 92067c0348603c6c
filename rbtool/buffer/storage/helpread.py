"""A large window's small files read by helper processes (rbtool.files.readmany).

Reading a small file costs three system calls; made on a thread, each return from the
kernel waits for the interpreter lock, which the thread that compares and cuts the bytes
holds. Two helper processes, one a core, read into buffers shared with this process (memory
files), while it compares and cuts what they read: measured here, a million one-transition
files are read in about half the time of one reading thread.

The window's ids are cut into segments of SEGMENT_FILES, which the helpers take in turn;
the chunks come out in window order, as from bulk's thread reader. A file a helper could not
read makes the window's rows left to the row readers (as a failed read does on the thread);
a file too large to be read side by side is read here, as a chunk of its own.
"""

from __future__ import annotations

import contextlib
import functools
import os
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, overload

from rbtool.files import readmany

# Used for windows of at least this many files (starting helpers costs about 50 ms).
MIN_FILES = 16_384
HELPERS = 2
BUFFERS = 3  # per helper
_HEAD = struct.Struct("<qq")


class HelperFailed(Exception):
    """A helper could not be started, or stopped early: the window is read another way."""


def usable(count: int) -> bool:
    """True where helpers can read a window of `count` files: many files, Linux memory files,
    and a Python interpreter to start (not an embedding program or a frozen application)."""
    name = os.path.basename(sys.executable or "")
    python = name.startswith(("python", "pypy")) and not getattr(sys, "frozen", False)
    return count >= MIN_FILES and hasattr(os, "memfd_create") and python


class _Helper:
    """One helper process, its shared buffers and its report stream."""

    def __init__(self, dir_fd: int, names: list[str], size: int, room: int, follow: bool) -> None:
        import numpy as np

        self.size = size
        fds: list[int] = []
        try:
            names_fd = os.memfd_create("rbtool-names")
            fds.append(names_fd)
            blob = "\0".join(names).encode("utf-8", "surrogateescape")
            _write_all(names_fd, blob)
            os.lseek(names_fd, 0, os.SEEK_SET)
            buffers_fd = os.memfd_create("rbtool-read")
            fds.append(buffers_fd)
            os.ftruncate(buffers_fd, BUFFERS * size)
            import mmap

            self.shared = mmap.mmap(buffers_fd, BUFFERS * size)
            self.buffers: Any = np.frombuffer(self.shared, dtype=np.uint8)
            argv = [
                str(dir_fd),
                str(names_fd),
                str(buffers_fd),
                str(BUFFERS),
                str(size),
                str(room),
                str(int(follow)),
            ]
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-S", readmany.__file__, *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                pass_fds=(dir_fd, names_fd, buffers_fd),
            )
        except (OSError, ValueError) as exc:
            raise HelperFailed(str(exc)) from None
        finally:
            for fd in fds:
                os.close(fd)
        assert self.process.stdin is not None and self.process.stdout is not None
        self.reports, self.frees = self.process.stdout, self.process.stdin
        self.pending: list[tuple[int, Any, Any]] = []  # (buffer, offsets, results) not yet handed out
        self.uses: dict[int, int] = {}  # buffer -> chunks handed out and not yet cut

    def next_report(self) -> tuple[int, Any, Any]:
        import numpy as np

        head = self.reports.read(_HEAD.size)
        if len(head) != _HEAD.size:
            raise HelperFailed("a helper stopped early")
        number, count = _HEAD.unpack(head)
        body = self.reports.read(16 * count)
        if len(body) != 16 * count or not 0 <= number < BUFFERS:
            raise HelperFailed("a helper stopped early")
        arrays = np.frombuffer(body, dtype=np.int64)
        return number, arrays[:count], arrays[count:]

    def buffer(self, number: int) -> Any:
        return self.buffers[number * self.size : (number + 1) * self.size]

    def release(self, number: int) -> None:
        self.uses[number] -= 1
        if not self.uses[number] and not any(p[0] == number for p in self.pending):
            del self.uses[number]
            with contextlib.suppress(OSError, ValueError):
                self.frees.write(bytes([number]))
                self.frees.flush()

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.frees.close()
        with contextlib.suppress(OSError, ValueError):
            self.process.kill()
        self.process.wait()
        with contextlib.suppress(OSError, ValueError):
            self.reports.close()
        self.buffers = None
        with contextlib.suppress(BufferError):
            self.shared.close()  # a chunk still referring to it keeps the memory mapped


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class _Places(Sequence[tuple[Path, str]]):
    """The (directory, file name) of a chunk's `count` files, the window's names from
    `first`: made when a file is named (in an error), not a tuple a file up front."""

    def __init__(self, directory: Path, names: Sequence[str], first: int, count: int) -> None:
        self.directory, self.names, self.first, self.length = directory, names, first, count

    def __len__(self) -> int:
        return self.length

    @overload
    def __getitem__(self, k: int) -> tuple[Path, str]: ...
    @overload
    def __getitem__(self, k: slice) -> Sequence[tuple[Path, str]]: ...
    def __getitem__(self, k: int | slice) -> Any:
        if isinstance(k, slice):
            return [self[j] for j in range(*k.indices(self.length))]
        if not 0 <= k < self.length:
            raise IndexError(k)
        return self.directory, self.names[self.first + k]


class HelperReader:
    """The files of `tids` (all in `directory`, named `names`) read by helper processes:
    yields bulk._Chunks in window order (made by `make_chunk(buf, release)`); a file too
    large to be read side by side comes from `read_large(name)` as a chunk of its own."""

    def __init__(
        self,
        directory: Path,
        tids: Sequence[int],
        names: Sequence[str],
        segment: int,
        size: int,
        room: int,
        make_chunk: Callable[[Any, Callable[[], None] | None], Any],
        read_large: Callable[[int], bytes],
        follow: bool = True,
    ) -> None:
        self.directory, self.tids, self.names, self.segment = directory, tids, names, segment
        self.room, self.make_chunk, self.read_large = room, make_chunk, read_large
        self.helpers: list[_Helper] = []
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            starts = range(0, len(tids), segment)
            for h in range(HELPERS):
                mine: list[str] = []
                for first in starts[h::HELPERS]:
                    mine += names[first : first + segment]
                self.helpers.append(_Helper(dir_fd, mine, size, room, follow))
        except BaseException:
            self.stop()
            raise
        finally:
            os.close(dir_fd)

    def __iter__(self) -> Iterator[Any]:
        for number, first in enumerate(range(0, len(self.tids), self.segment)):
            yield from self._segment(self.helpers[number % HELPERS], first)

    def _segment(self, helper: _Helper, first: int) -> Iterator[Any]:
        """The chunks of the segment starting at window position `first`."""
        stop = min(first + self.segment, len(self.tids))
        at = first
        while at < stop:
            if not helper.pending:
                helper.pending.append(helper.next_report())
            number, offsets, results = helper.pending[0]
            take = min(len(offsets), stop - at)
            if take == len(offsets):
                helper.pending.pop(0)
            else:
                helper.pending[0] = (number, offsets[take:], results[take:])
            yield from self._cut(helper, number, offsets[:take], results[:take], at)
            at += take

    def _cut(self, helper: _Helper, number: int, offsets: Any, results: Any, at: int) -> Iterator[Any]:
        """Chunks of the files at window positions `at...` a helper read into buffer `number`."""
        if len(results) and int(results.min()) < 0:
            raise HelperFailed("a file could not be read")  # a read's failure: as on the thread
        large = [int(k) for k in (results >= self.room).nonzero()[0]]
        bounds = zip([0, *(k + 1 for k in large)], [*large, len(offsets)], strict=True)
        pieces = [(start, end) for start, end in bounds]
        # the chunks of this part are counted before the first is cut (and one more, let go
        # below), so that the buffer is freed after the last of them
        helper.uses[number] = helper.uses.get(number, 0) + sum(end > start for start, end in pieces) + 1
        buf = helper.buffer(number)
        for start, end in pieces:
            if end > start:
                chunk = self.make_chunk(buf, functools.partial(helper.release, number))
                chunk.tids = list(self.tids[at + start : at + end])
                chunk.offsets = offsets[start:end].tolist()
                chunk.sizes = results[start:end].tolist()
                chunk.places = _Places(self.directory, self.names, at + start, end - start)
                yield chunk
            if end < len(offsets):  # a file too large to be read side by side, in its place
                yield self._large(at + end)
        helper.release(number)

    def _large(self, position: int) -> Any:
        import numpy as np

        data = self.read_large(position)
        chunk = self.make_chunk(np.frombuffer(data, dtype=np.uint8), None)
        chunk.tids, chunk.offsets, chunk.sizes = [self.tids[position]], [0], [len(data)]
        chunk.places = [(self.directory, self.names[position])]
        return chunk

    def stop(self) -> None:
        for helper in self.helpers:
            helper.stop()
