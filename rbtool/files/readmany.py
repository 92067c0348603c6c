"""Many small files of one directory read by a helper process into shared memory.

A small file costs three system calls, and a thread making them shares the interpreter
lock with the thread that uses the bytes: each return from the kernel waits for the lock,
and two reading threads go no faster than one. Helper processes do not share it: two of
them read a checkpoint's small files about twice as fast as one thread, while the parent
compares and cuts what they read (rbtool.buffer.storage.bulk).

Run as `python readmany.py DIR_FD NAMES_FD BUFFERS_FD COUNT SIZE ROOM FOLLOW`, with the
descriptors inherited: DIR_FD the directory, NAMES_FD a memory file of the file names
(NUL-separated, in the order to read), BUFFERS_FD a memory file of COUNT buffers of SIZE
bytes; FOLLOW 0 opens no symbolic link. The files are read in order into a free buffer,
each at an eight-byte-aligned offset, at most ROOM bytes each (a file that fills ROOM is
larger than the parent reads this way: it reads it itself). Standard input gives the
numbers of the buffers the parent is done with (one byte each; all are free at the
start), standard output reports each filled buffer: its number and its file count (two
int64), then the offset of each file and what its read returned (int64 each), or
-1 - errno for a file that could not be read. The
process imports nothing of rbtool's and never writes a file.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
from array import array

_HEAD = struct.Struct("<qq")


def main(argv: list[str]) -> int:
    dir_fd, names_fd, buffers_fd, count, size, room, follow = (int(a) for a in argv)
    with open(names_fd, "rb", closefd=True) as handle:
        names = handle.read().split(b"\0") if os.fstat(names_fd).st_size else []
    shared = mmap.mmap(buffers_fd, count * size)
    os.close(buffers_fd)
    free = list(range(count))
    out = sys.stdout.buffer
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | (0 if follow else getattr(os, "O_NOFOLLOW", 0))
    open_, preadv, close = os.open, os.preadv, os.close
    view = memoryview(shared)
    at = limit = 0
    number = -1
    offsets, results = array("q"), array("q")

    def report() -> None:
        out.write(_HEAD.pack(number, len(offsets)) + offsets.tobytes() + results.tobytes())
        out.flush()

    for name in names:
        if number < 0:
            if not free:
                got = os.read(0, 1)
                if not got:
                    return 0  # the parent stopped
                free.append(got[0])
            number = free.pop()
            at, limit = number * size, (number + 1) * size - room - 8
            offsets, results = array("q"), array("q")
        try:
            fd = open_(name, flags, dir_fd=dir_fd)
            try:
                n = preadv(fd, [view[at : at + room]], 0)
            finally:
                close(fd)
        except OSError as exc:
            n = -1 - (exc.errno or 0)
        offsets.append(at - number * size)
        results.append(n)
        if n > 0:
            at = (at + n + 7) & ~7
        if at > limit:
            report()
            number = -1
    if number >= 0:
        report()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (BrokenPipeError, KeyboardInterrupt):
        sys.exit(0)
