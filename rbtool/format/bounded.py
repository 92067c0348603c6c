"""Bounded JSON: every JSON document rbtool reads, decoded within limits on its size, nesting and
integers, its refusals one line each (never RecursionError, MemoryError or a crash)."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rbtool.format.problems import int_text, one_line

# Every JSON document rbtool reads may come from someone else, so each is bounded before it
# is decoded: its size (a document larger than its limit is refused before a byte is parsed,
# and an index by the memory decoding it would take), its nesting (counted by a flat scan of
# the bytes, never by recursion: the decoders recurse and would raise RecursionError or, past
# the C stack, crash) and its integers (64-bit: what the writers can write back).
MAX_JSON_DEPTH = 64  # rbtool's own documents nest 5 deep at most; LeRobot's a few more
MAX_JSON_BYTES = 16 << 20  # metadata, markers, sidecars, info.json, one journal line
JSON_BYTES_ENV = "RBTOOL_MAX_JSON_BYTES"
INDEX_BYTES_ENV = "RBTOOL_MAX_INDEX_BYTES"
# Memory the decoded index takes per byte of JSON, measured on rbtool-written indexes (about
# 300 bytes an entry): the typed decode and the entry dicts loaders build from it, together.
INDEX_MEMORY_PER_BYTE = 5
JSON_INT_RANGE = (-(1 << 63), 1 << 64)  # int64 and uint64 (what orjson writes back)
_SCAN_CHUNK = 1 << 22


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic collector: decoding a big index makes millions of objects and no cycles."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        # Move the survivors to the oldest generation without traversing them, so that the
        # first collections after re-enabling do not walk millions of young objects.
        gc.freeze()
        gc.unfreeze()
        if enabled:
            gc.enable()


class _Absent:
    """Marks a JSON value that could not be had (missing file, invalid JSON)."""


ABSENT: Any = _Absent()


def decode_json(data: bytes) -> Any:
    """Plain JSON to Python objects (the one untyped decoder: the same numbers everywhere)."""
    import msgspec

    with gc_paused():
        return msgspec.json.decode(data)


def json_error(exc: Exception) -> str:
    """A decoder's error on one line, without msgspec's prefix."""
    return one_line(str(exc)).removeprefix("JSON is malformed: ")


def env_bytes(name: str, default: int) -> int:
    """A byte count from the environment (plain digits, optionally with a K/M/G suffix)."""
    from rbtool.errors import UsageError

    text = os.environ.get(name, "").strip()
    if not text:
        return default
    match = re.fullmatch(r"([0-9]{1,15})([KMG]i?B?|B)?", text, flags=re.IGNORECASE)
    if match is None:
        raise UsageError(f"{name}={text!r} is not a byte count (for example 1048576, 64M or 2G)")
    scale = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[(match.group(2) or "")[:1].upper()]
    return int(match.group(1)) * scale


def max_json_bytes() -> int:
    """The size limit of a small JSON document (RBTOOL_MAX_JSON_BYTES, default 16 MiB)."""
    return env_bytes(JSON_BYTES_ENV, MAX_JSON_BYTES)


def human_bytes(n: float) -> str:
    """A byte count the way messages print it: 512 B, 3.2 MiB, 7.1 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _proc_kib(path: str, key: bytes) -> int | None:
    """A `Key:  N kB` line of a /proc file, in bytes, or None."""
    with contextlib.suppress(OSError, ValueError, IndexError), open(path, "rb") as handle:
        for line in handle:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return None


def available_memory() -> int | None:
    """Bytes this process may still allocate: the least of free memory (MemAvailable), the
    room left under its address-space limit (RLIMIT_AS) and under its cgroup's limit; None
    when none of them can be read."""
    import resource

    bounds: list[int] = []
    free = _proc_kib("/proc/meminfo", b"MemAvailable:")
    if free is not None:
        bounds.append(free)
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        bounds.append(max(soft - (_proc_kib("/proc/self/status", b"VmSize:") or 0), 0))
    with contextlib.suppress(OSError, ValueError):
        cg = Path("/sys/fs/cgroup")
        top = cg / "memory.max"
        if top.is_file():
            text = top.read_text().strip()
            if text != "max":
                bounds.append(max(int(text) - int((cg / "memory.current").read_text()), 0))
    return min(bounds) if bounds else None


def index_size_problem(size: int) -> str | None:
    """Why an index file of `size` bytes is not decoded (the memory it would take), or None.

    RBTOOL_MAX_INDEX_BYTES, when set, is the largest index file read; otherwise the memory
    decoding would take (INDEX_MEMORY_PER_BYTE per byte) must fit in what is available.
    """
    need = size * INDEX_MEMORY_PER_BYTE
    if os.environ.get(INDEX_BYTES_ENV, "").strip():
        limit = env_bytes(INDEX_BYTES_ENV, 0)
        if size <= limit:
            return None
        return (
            f"{human_bytes(size)} of JSON would take about {human_bytes(need)} of memory to decode, "
            f"more than {INDEX_BYTES_ENV}={limit} ({human_bytes(limit)} of JSON) allows"
        )
    room = available_memory()
    if room is None or need <= room:
        return None
    return (
        f"{human_bytes(size)} of JSON would take about {human_bytes(need)} of memory to decode, "
        f"more than the {human_bytes(room)} available; free memory or set {INDEX_BYTES_ENV} to the "
        "largest index to read"
    )


def json_size_problem(size: int, max_bytes: int) -> str | None:
    """Why a document of `size` bytes is over its limit `max_bytes`, or None."""
    if size <= max_bytes:
        return None
    return (
        f"{human_bytes(size)}, more than the {human_bytes(max_bytes)} a document of its kind may hold "
        f"(decoding it would take about {human_bytes(size * INDEX_MEMORY_PER_BYTE)} of memory; "
        f"{JSON_BYTES_ENV} raises the limit)"
    )


def json_depth_problem(data: bytes | bytearray | memoryview, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """Why `data` nests deeper than `max_depth`, or None: a flat scan of its bytes.

    Escaped backslashes, then escaped quotes, are dropped (left to right, as a decoder pairs
    them), then everything but quotes and brackets; what is left is counted with numpy: `[`
    and `{` against `]` and `}` where no string is open. For valid JSON the count is the
    nesting; for invalid JSON it is at least the nesting a decoder reaches before it stops at
    the first error (everything before the first backslash outside a string is counted
    exactly). About 0.2 s for a 64 MiB index, no recursion, memory a fraction of the input.
    """
    import numpy as np

    text = bytes(data) if not isinstance(data, bytes) else data
    if b"\\" in text:
        text = text.replace(b"\\\\", b"")
    if b"\\" in text:
        text = text.replace(b'\\"', b"")
    marks = np.frombuffer(text.translate(None, _NOT_MARKS), dtype=np.uint8)
    del text
    depth = 0  # nesting before the chunk
    in_string = 0  # 1 while a string is open at the chunk's start
    for start in range(0, marks.size, _SCAN_CHUNK):
        chunk = marks[start : start + _SCAN_CHUNK]
        quote = chunk == 34
        parity = (np.cumsum(quote, dtype=np.int32) + in_string) & 1
        step = ((chunk == 91) | (chunk == 123)).astype(np.int32) * 2 - 1
        step[quote | parity.astype(bool)] = 0  # a quote, or a bracket inside a string
        running = np.cumsum(step, dtype=np.int32)  # a chunk is below 2**31 marks
        if int(running.max()) + depth > max_depth:
            return f"nests deeper than {max_depth} levels"
        depth, in_string = int(running[-1]) + depth, int(parity[-1])
    return None


_NOT_MARKS = bytes(sorted(set(range(256)) - set(b'"[]{}')))


def json_value_problem(value: Any) -> str | None:
    """Why a decoded document holds an integer beyond 64 bits, or None (walked without recursion)."""
    lo, hi = JSON_INT_RANGE
    stack = [value]
    pop, push = stack.pop, stack.extend
    while stack:
        item = pop()
        kind = type(item)
        if kind is dict:
            push(item.values())
        elif kind is list:
            push(item)
        elif kind is int:
            if not lo <= item < hi:
                return f"holds the integer {int_text(item)}, beyond the 64-bit range [-2**63, 2**64)"
        elif kind is not str and kind is not float and kind is not bool and item is not None:
            names = getattr(item, "__struct_fields__", ())  # a decoder's struct
            push(getattr(item, n) for n in names)
    return None


def decode_bounded(
    data: bytes | bytearray | memoryview,
    *,
    max_depth: int = MAX_JSON_DEPTH,
    decoder: Any = None,
    check_ints: bool = True,
) -> tuple[Any, str | None]:
    """(value, None) for a document within its depth and integer limits, else (ABSENT, why).

    The size limit is the caller's (it is checked before the bytes are read). `decoder` is
    a msgspec Decoder to use instead of plain JSON. `check_ints=False` leaves the integers to
    a caller that checks every value it reads against a schema (and reads no other).
    """
    import msgspec

    why = json_depth_problem(data, max_depth)
    if why is not None:
        return ABSENT, why
    try:
        with gc_paused():
            value = msgspec.json.decode(data) if decoder is None else decoder.decode(data)
    except msgspec.DecodeError as exc:
        return ABSENT, f"invalid JSON ({json_error(exc)})"
    except RecursionError:  # pragma: no cover - the depth scan comes first
        return ABSENT, f"nests deeper than {max_depth} levels"
    except MemoryError:
        return ABSENT, f"{human_bytes(len(data))} of JSON ran out of memory while decoding"
    if check_ints:
        why = json_value_problem(value)
        if why is not None:
            return ABSENT, why
    return value, None


def read_json_bytes(
    data: bytes | bytearray | memoryview,
    what: str,
    *,
    max_bytes: int | None = None,
    max_depth: int = MAX_JSON_DEPTH,
    error: type[Exception] | None = None,
) -> Any:
    """The value of the JSON document `data`, or one error naming `what` (a file, a key, a line).

    Refuses, before decoding, a document over `max_bytes` (default: RBTOOL_MAX_JSON_BYTES) or
    nesting deeper than `max_depth`, then any integer beyond 64 bits and any invalid JSON.
    Never RecursionError, MemoryError or a crash: every refusal is `error` (CheckpointError).
    """
    if error is None:
        from rbtool.errors import CheckpointError

        error = CheckpointError
    limit = max_json_bytes() if max_bytes is None else max_bytes
    why = json_size_problem(len(data), limit)
    if why is None:
        value, why = decode_bounded(data, max_depth=max_depth)
        if why is None:
            return value
    raise error(one_line(f"{what}: {why}"))


def read_json_file(
    path: str | os.PathLike[str],
    what: str | None = None,
    *,
    max_bytes: int | None = None,
    max_depth: int = MAX_JSON_DEPTH,
    error: type[Exception] | None = None,
) -> Any:
    """The value of the JSON file `path`, read through read_json_bytes: its size is checked
    before a byte is read, and only a regular file is read (never a FIFO or a device)."""
    if error is None:
        from rbtool.errors import CheckpointError

        error = CheckpointError
    name = str(path) if what is None else what
    limit = max_json_bytes() if max_bytes is None else max_bytes
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise error(one_line(f"{name}: cannot read ({exc.strerror})")) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{name}: {not_a_file(info.st_mode)}, not a regular file")
        why = json_size_problem(info.st_size, limit)
        if why is not None:
            raise error(one_line(f"{name}: {why}"))
        with os.fdopen(os.dup(fd), "rb") as handle:
            data = handle.read(limit + 1)
    except OSError as exc:
        raise error(one_line(f"{name}: cannot read ({exc.strerror})")) from None
    finally:
        os.close(fd)
    return read_json_bytes(data, name, max_bytes=limit, max_depth=max_depth, error=error)


def not_a_file(mode: int) -> str:
    """What a name that is no regular file is, from its st_mode: `a directory`, `a FIFO`, ..."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a socket or other special file"
