"""The structure of a `.pt` trajectory file without its tensor data: header-only reads.

A `.pt` file is a zip. Its `<archive>/data.pkl` record pickles the dict; each tensor in it is
`torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`, whose storage is the
persistent id `('storage', torch.<Dtype>Storage, key, location, numel)` naming the record
`<archive>/data/<key>`. This module unpickles data.pkl with an unpickler that knows only those
names and returns the dict with a TensorSpec (dtype, shape, stride, where the bytes are) in
place of each tensor: what sampling, ingest and quick checks need, for a few hundred bytes
read instead of the whole file, and without importing torch.

Every spec passes the checks `trajfile.check_loaded` makes on a loaded tensor (supported dtype,
storage holding the whole view, no stride-0 or overlapping dims, a storage record of exactly the
declared size), and the dict the same rules on its contents (rbtool.format.content: string
keys, bounded nesting, no cycles, ints in int64). Whatever this reader does not know (another
tensor rebuild, a dtype without a legacy storage class, a legacy non-zip file) raises
UnusualLayout: the caller then loads the file with torch, whose loader decides. Hostile bytes
raise TrajectoryFileError or UnsafePickleError, as torch's path would.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from rbtool.errors import RbtoolError, TrajectoryFileError, UnusualLayout
from rbtool.format.content import MAX_DEPTH, checked_content, view_problem

# torch's legacy storage classes: the dtype each stands for, and its size in bytes.
STORAGE_DTYPES = {
    "BoolStorage": ("bool", 1),
    "ByteStorage": ("uint8", 1),
    "CharStorage": ("int8", 1),
    "ShortStorage": ("int16", 2),
    "IntStorage": ("int32", 4),
    "LongStorage": ("int64", 8),
    "HalfStorage": ("float16", 2),
    "BFloat16Storage": ("bfloat16", 2),
    "FloatStorage": ("float32", 4),
    "DoubleStorage": ("float64", 8),
    "ComplexFloatStorage": ("complex64", 8),
    "ComplexDoubleStorage": ("complex128", 16),
}
_KNOWN_VERSIONS = {b"1", b"2", b"3"}  # the zip `version` records of files torch.save writes
MAX_PICKLE_BYTES = 64 << 20  # a trajectory's structure; tensors' bytes are in other records
SMALL_FILE_BYTES = 256 << 10  # files up to this size are read whole, in one read
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., file name length, extra length


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor of a `.pt` file as its header describes it: no data read."""

    dtype: str  # torch dtype name ("float32")
    itemsize: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # storage offset, in elements
    start: int  # where the storage's bytes begin in the file
    nbytes: int  # the storage's size in bytes

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def is_contiguous(self) -> bool:
        if not self.numel():  # no element to lay out (torch says the same)
            return True
        expected = 1
        for size, step in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if size != 1 and step != expected:
                return False
            expected *= size
        return True

    @property
    def data_start(self) -> int:
        """Where the view's first element is in the file."""
        return self.start + self.offset * self.itemsize


# Placeholders are tuples tagged with these markers: a pickle can neither name the markers
# nor change a tuple (a BUILD instruction on one fails), so what was declared stays declared.
_STORAGE = object()
_TENSOR = object()


def _is_storage(value: Any) -> bool:
    return type(value) is tuple and len(value) == 5 and value[0] is _STORAGE


def _is_placeholder(value: Any) -> bool:
    """A tensor placeholder, or a storage one (which only a tensor may hold)."""
    return type(value) is tuple and len(value) == 5 and (value[0] is _TENSOR or value[0] is _STORAGE)


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> Any:
    """What `_rebuild_tensor_v2` becomes: a placeholder checked and placed later."""
    if not _is_storage(storage) or len(rest) not in (2, 3):
        raise UnusualLayout("unexpected tensor arguments")
    requires_grad, hooks = rest[0], rest[1]
    if (
        requires_grad is not False
        or hooks not in ({}, None)
        or (len(rest) == 3 and rest[2] not in ({}, None))
    ):
        raise UnusualLayout("a tensor with gradients, hooks or metadata")
    return (_TENSOR, storage, offset, size, stride)


class _HeaderUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch" and name in STORAGE_DTYPES:
            return name
        if module == "collections" and name == "OrderedDict":
            return dict
        raise UnusualLayout(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if (
            not isinstance(pid, tuple)
            or len(pid) != 5
            or pid[0] != "storage"
            or pid[1] not in STORAGE_DTYPES
            or type(pid[2]) is not str
            or pid[3] != "cpu"
            or type(pid[4]) is not int
        ):
            raise UnusualLayout("an unexpected storage")
        dtype, itemsize = STORAGE_DTYPES[pid[1]]
        return (_STORAGE, dtype, itemsize, pid[2], pid[4])


def _ints(value: Any) -> tuple[int, ...] | None:
    if not isinstance(value, tuple) or not all(type(v) is int for v in value):
        return None
    return value


def _tensor_problem(size: tuple[int, ...], stride: tuple[int, ...], offset: int, held: int) -> str | None:
    """trajfile._tensor_problem for a tensor described by its header."""
    if any(d < 0 for d in size) or any(s < 0 for s in stride) or offset < 0:
        return "has a negative size, stride or offset"
    return view_problem(size, stride, offset, held)


_EOCD = struct.Struct("<4s4xHHIIH")  # signature, entries on disk, entries, cd size, cd offset, comment
_ZIP64_LOCATOR = struct.Struct("<4sIQI")
_ZIP64_EOCD = struct.Struct("<4sQHHIIQQQQ")
# sig, method, crc32, comp, size, name/extra/comment lengths, offset
_CENTRAL = struct.Struct("<4s6xH4xIIIHHH8xI")
_TAIL = 1 << 16


class _Record(NamedTuple):
    size: int
    stored: bool
    header_offset: int
    crc32: int = 0


class _Archive:
    """The zip directory of a `.pt` file, parsed from its central directory (no zipfile).

    Bytes come from `read(offset, n)`: a slice of the file already in memory, or a pread.
    """

    def __init__(self, path: Path, read: Any, size: int, whole: bytes | None = None) -> None:
        self.path, self._read, self.size = path, read, size
        self._whole = whole  # the file's bytes, when it was read whole
        self.records = self._directory()
        total = 0
        for name, record in self.records.items():
            if not record.stored:
                raise TrajectoryFileError(f"{path}: zip record {name!r:.80} is compressed")
            total += record.size
        if total > size:
            raise TrajectoryFileError(f"{path}: zip records claim more bytes than the file holds")
        pickles = [n for n in self.records if n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise UnusualLayout("no single data.pkl record")
        self.prefix = pickles[0][: -len("data.pkl")]

    def _directory(self) -> dict[str, _Record]:
        tail_start = max(0, self.size - _TAIL - _EOCD.size)
        whole = self._whole
        tail = (
            whole
            if whole is not None and tail_start == 0
            else bytes(self._read(tail_start, self.size - tail_start))
        )
        at = tail.rfind(b"PK\x05\x06")
        if at < 0 or len(tail) - at < _EOCD.size:
            raise UnusualLayout("not a zip")
        _, _, count, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, at)
        if 0xFFFF in (count,) or 0xFFFFFFFF in (cd_size, cd_offset):
            loc = at - _ZIP64_LOCATOR.size
            if loc < 0:
                raise UnusualLayout("a zip64 archive without its locator")
            signature, _, eocd64, _ = _ZIP64_LOCATOR.unpack_from(tail, loc)
            if signature != b"PK\x06\x07":
                raise UnusualLayout("a zip64 archive without its locator")
            head = self._read(eocd64, _ZIP64_EOCD.size)
            if len(head) != _ZIP64_EOCD.size or head[:4] != b"PK\x06\x06":
                raise TrajectoryFileError(f"{self.path}: a zip64 directory record is damaged")
            _, _, _, _, _, _, _, count, cd_size, cd_offset = _ZIP64_EOCD.unpack(head)
        if cd_offset + cd_size > self.size or count > cd_size // _CENTRAL.size:
            raise TrajectoryFileError(f"{self.path}: truncated (the zip directory is cut short)")
        directory = bytes(self._read(cd_offset, cd_size))
        records: dict[str, _Record] = {}
        pos = 0
        for _ in range(count):
            if pos + _CENTRAL.size > len(directory):
                raise TrajectoryFileError(f"{self.path}: the zip directory is damaged")
            signature, method, crc, comp, size, name_len, extra_len, comment_len, offset = (
                _CENTRAL.unpack_from(directory, pos)
            )
            if signature != b"PK\x01\x02":
                raise TrajectoryFileError(f"{self.path}: the zip directory is damaged")
            pos += _CENTRAL.size
            name = str(directory[pos : pos + name_len], "utf-8", "replace")
            if comp == 0xFFFFFFFF or size == 0xFFFFFFFF or offset == 0xFFFFFFFF:
                extra = directory[pos + name_len : pos + name_len + extra_len]
                comp, size, offset = _zip64_sizes(extra, comp, size, offset)
            pos += name_len + extra_len + comment_len
            if name in records:
                raise TrajectoryFileError(f"{self.path}: zip record {name!r:.80} appears twice")
            records[name] = _Record(size, method == 0 and comp == size, offset, crc)
        return records

    def data_start(self, name: str) -> tuple[int, int]:
        """(first byte, size) of a record's data in the file, from its local header."""
        record = self.records.get(name)
        if record is None:
            raise TrajectoryFileError(f"{self.path}: a tensor's storage record {name!r:.80} is missing")
        head = self._read(record.header_offset, _LOCAL_HEADER.size)
        if len(head) != _LOCAL_HEADER.size:
            raise TrajectoryFileError(f"{self.path}: truncated (a zip record header is cut short)")
        signature, name_len, extra_len = _LOCAL_HEADER.unpack(head)
        if signature != b"PK\x03\x04":
            raise TrajectoryFileError(f"{self.path}: a zip record header is damaged")
        start = record.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        if start + record.size > self.size:
            raise TrajectoryFileError(f"{self.path}: truncated (a tensor's data is cut short)")
        return start, record.size

    def read(self, name: str, limit: int) -> bytes:
        start, size = self.data_start(name)
        if size > limit:
            raise TrajectoryFileError(f"{self.path}: record {name!r:.80} is too large ({size} bytes)")
        data = self._read(start, size)
        if len(data) != size:
            raise TrajectoryFileError(f"{self.path}: truncated (record {name!r:.80} is cut short)")
        return bytes(data)


def _zip64_sizes(extra: bytes, comp: int, size: int, offset: int) -> tuple[int, int, int]:
    """The 8-byte sizes and offset of a zip64 extra field, for the fields that overflowed."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4 : pos + 4 + length]
        if tag == 1:
            values = [v for (v,) in struct.iter_unpack("<Q", body[: len(body) // 8 * 8])]
            if size == 0xFFFFFFFF and values:
                size = values.pop(0)
            if comp == 0xFFFFFFFF and values:
                comp = values.pop(0)
            if offset == 0xFFFFFFFF and values:
                offset = values.pop(0)
            return comp, size, offset
        pos += 4 + length
    raise UnusualLayout("a zip64 record without its sizes")


def _build(path: Path, archive: _Archive, value: Any) -> Any:
    """The unpickled structure with each tensor placeholder checked and made a TensorSpec."""
    places: dict[str, tuple[int, int]] = {}

    def spec(where: str, item: tuple[Any, ...]) -> TensorSpec:
        _, (_, dtype, itemsize, key, numel), offset, size, stride = item
        size, stride = _ints(size), _ints(stride)
        if size is None or stride is None or len(size) != len(stride) or type(offset) is not int:
            raise TrajectoryFileError(f"{where} has a malformed size or stride")
        place = places.get(key)
        if place is None:
            place = places[key] = archive.data_start(f"{archive.prefix}data/{key}")
        start, nbytes = place
        if numel < 0 or nbytes != numel * itemsize:
            raise TrajectoryFileError(
                f"{where}: its storage record holds {nbytes} bytes, not the {numel} elements declared"
            )
        problem = _tensor_problem(size, stride, offset, numel)
        if problem is not None:
            raise TrajectoryFileError(f"{where} {problem}")
        return TensorSpec(dtype, itemsize, size, stride, offset, start, nbytes)

    def tensor(where: str, item: tuple[Any, ...]) -> TensorSpec:
        if _is_storage(item):  # a storage outside a tensor: refused as the tuple it is
            raise TrajectoryFileError(f"{where} holds a {type(item).__name__}")
        return spec(where, item)

    return checked_content(value, str(path), _is_placeholder, tensor)


def _parse(path: Path, read: Any, size: int, whole: bytes | None = None) -> dict[str, Any]:
    archive = _Archive(path, read, size, whole)
    byteorder = f"{archive.prefix}byteorder"
    if byteorder in archive.records and archive.read(byteorder, 16) != b"little":
        raise UnusualLayout("big-endian data")
    version = f"{archive.prefix}version"
    if version in archive.records and archive.read(version, 16).strip() not in _KNOWN_VERSIONS:
        raise UnusualLayout("a file format version torch.save does not write")  # torch's loader decides
    data = archive.read(f"{archive.prefix}data.pkl", MAX_PICKLE_BYTES)
    # Files of one writer often share their structure byte for byte (same pickle, records at
    # the same places): then the result is the same, and is reused.
    storages = f"{archive.prefix}data/"
    places = tuple(
        (n[len(storages) :], *archive.data_start(n)) for n in archive.records if n.startswith(storages)
    )
    key = (data, places)
    known = _KNOWN.get(key)
    if known is not None:
        return known
    try:
        raw = _HeaderUnpickler(data).load()
    except RbtoolError:
        raise
    except RecursionError:
        raise TrajectoryFileError(f"{path}: nests deeper than {MAX_DEPTH} levels") from None
    except Exception as exc:  # bad bytes: torch's loader would refuse them too
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TrajectoryFileError(f"{path}: not a readable .pt trajectory ({message})") from None
    structure = _build(path, archive, raw)
    if not isinstance(structure, dict):
        raise TrajectoryFileError(f"{path}: holds a {type(structure).__name__}, expected a trajectory dict")
    if len(_KNOWN) >= _KNOWN_MAX:
        del _KNOWN[next(iter(_KNOWN))]
    _KNOWN[key] = structure
    return structure


# Headers already built, by (data.pkl bytes, storage record places): shared, never changed.
_KNOWN: dict[tuple[bytes, tuple[tuple[str, int, int], ...]], dict[str, Any]] = {}
_KNOWN_MAX = 4096


def known_header(pickle: bytes, places: tuple[tuple[str, int, int], ...]) -> dict[str, Any] | None:
    """The header already built for a file with these data.pkl bytes whose tensor records are
    at `places` ((key, first byte, size) each, in directory order), or None."""
    return _KNOWN.get((pickle, places))


def open_regular(path: Path) -> tuple[int, int]:
    """(descriptor, size) of a regular file, opened without blocking (a FIFO never hangs a
    reader); anything else is refused with one line naming it. The caller closes it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise TrajectoryFileError(f"{path}: no such file or directory") from None
    except OSError as exc:
        raise TrajectoryFileError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise TrajectoryFileError(f"{path}: cannot read ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise TrajectoryFileError(f"{path}: not a regular file")
    return fd, info.st_size


def read_header(path: Path, data: bytes | None = None) -> dict[str, Any]:
    """A `.pt` trajectory's dict with a TensorSpec for each tensor, reading no tensor bytes.

    The dict may be shared with other files of the same structure: never change it.
    `data`: the file's bytes, when they were read already (nothing more is read then).
    Raises UnusualLayout for layouts this reader leaves to torch's loader.
    """
    if data is not None:
        view = memoryview(data)
        return _parse(path, lambda offset, n: view[offset : offset + n], len(data), bytes(data))
    fd, size = open_regular(path)
    try:
        if size <= SMALL_FILE_BYTES:  # one read for the whole file
            whole = os.pread(fd, size, 0)
            view = memoryview(whole)
            return _parse(path, lambda offset, n: view[offset : offset + n], len(whole), whole)
        return _parse(path, lambda offset, n: os.pread(fd, n, offset), size)
    except OSError as exc:
        raise TrajectoryFileError(f"{path}: cannot read ({exc.strerror})") from None
    finally:
        os.close(fd)


def read_small(path: Path, limit: int = SMALL_FILE_BYTES) -> bytes | None:
    """A regular file's bytes when it holds at most `limit` of them (read whole, in one read);
    None otherwise. Errors as read_header names them."""
    fd, size = open_regular(path)
    try:
        if size > limit:
            return None
        data = os.pread(fd, size, 0)
        if len(data) != size:
            raise TrajectoryFileError(f"{path}: truncated while it was read")
        return data
    except OSError as exc:
        raise TrajectoryFileError(f"{path}: cannot read ({exc.strerror})") from None
    finally:
        os.close(fd)


def map_specs(value: Any, fn: Any) -> Any:
    """A header's structure with `fn(spec)` in place of each TensorSpec (dicts and lists
    rebuilt, every other value as it is): how a header becomes a trajectory of tensors."""
    if isinstance(value, TensorSpec):
        return fn(value)
    if isinstance(value, dict):
        return {k: map_specs(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [map_specs(v, fn) for v in value]
    return value


LOCAL_HEADER_BYTES = _LOCAL_HEADER.size  # the fixed part of a record's local header


@dataclass(frozen=True)
class ZipRecord:
    """A record of a `.pt` zip as its central directory lists it."""

    name: str
    header_offset: int  # where its local header begins
    size: int
    crc32: int


def zip_records(path: Path, read: Any, size: int) -> list[ZipRecord]:
    """The records of a `.pt` file of `size` bytes from its zip directory, bytes from `read(offset, n)`.

    Reads the tail (end-of-central-directory record) and the central directory only.
    Raises UnusualLayout or TrajectoryFileError as read_header does.
    """
    archive = _Archive(path, read, size)
    return [ZipRecord(n, r.header_offset, r.size, r.crc32) for n, r in archive.records.items()]


def record_data_start(path: Path, record: ZipRecord, read: Any) -> int:
    """Where a record's data begins, from its local header (`read(offset, n)` gives the bytes)."""
    head = bytes(read(record.header_offset, _LOCAL_HEADER.size))
    if len(head) != _LOCAL_HEADER.size:
        raise TrajectoryFileError(f"{path}: truncated (a zip record header is cut short)")
    signature, name_len, extra_len = _LOCAL_HEADER.unpack(head)
    if signature != b"PK\x03\x04":
        raise TrajectoryFileError(f"{path}: a zip record header is damaged")
    return record.header_offset + _LOCAL_HEADER.size + name_len + extra_len


def parse_header(path: Path, read: Any, size: int) -> dict[str, Any]:
    """read_header() over bytes from `read(offset, n)` instead of a local file of `size` bytes."""
    return _parse(path, read, size)


def iter_specs(
    structure: dict[str, Any], prefix: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], TensorSpec]]:
    """(path, spec) for every tensor of a header, depth first in dict order."""
    for key, value in structure.items():
        if isinstance(value, TensorSpec):
            yield (*prefix, key), value
        elif isinstance(value, dict):
            yield from iter_specs(value, (*prefix, key))
