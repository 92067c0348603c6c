"""A whole `.pt` trajectory checked without torch: the deep pass's fast path.

`verify --deep` reads every byte of every file. For a file laid out exactly as torch.save
writes it, `check_pt` takes the bytes already read and checks what the torch path
(rbtool.files.trajfile.load_bytes: the zip checks, torch.load with weights_only,
check_loaded) would look at, and more strictly:

- the zip: end records at the very end (the zip64 ones where torch.save puts them), a central
  directory of exactly its declared size, every record stored (not compressed), ASCII names
  unique even without case (torch's zip reader looks names up without case) under one
  `<archive>/` prefix, no extra fields in the directory, each local header agreeing with its
  directory entry (name, method, flags), records in order and never overlapping;
- `data.pkl`: its CRC-32 (Python's zipfile, which the torch path reads it with, checks it;
  torch's own reader checks no record's CRC, so no other record's is checked either), and
  every pickle instruction one of the few torch.save writes and torch's weights-only
  unpickler runs: no BUILD, no lists, no other globals than a tensor's rebuild, the legacy
  storage classes and OrderedDict, each spelled exactly;
- `version`, `byteorder` (little), `.storage_alignment` and `.data/serialization_id` (UTF-8)
  as torch's loader reads them;
- the structure (rbtool.files.ptheader, the rules of rbtool.format.content): every tensor
  non-empty, of sizes and strides torch accepts, inside a storage record of exactly its
  declared size, each record of one dtype; values only dicts, tensors, strings, ints,
  floats, bools and None, `model_weights_id` a string and `max_episode_length` an int.

Anything else, damaged or merely unusual, gives None: the caller then takes the torch path,
which finds and words the problem. So a file this module accepts is one the torch path
loads to the same values, and what the deep pass checks after loading (shapes against the
index, done rows, non-finite values, the schema) is computed from the TensorSpecs here.

Files of one writer differ only in their tensors' bytes and CRC-32s, their serialization id
and the archive's name (torch.save names it after the file). A small file's layout, once
checked, is remembered: a file of the same size whose every byte the checks read is the same
(one XOR under a mask) and whose archive name is one ASCII name without "/" throughout is that
layout, the checks being a function of those bytes; only its serialization id is checked anew.
"""

from __future__ import annotations

import functools
import itertools
import struct
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from rbtool.files.ptheader import STORAGE_DTYPES, TensorSpec, iter_specs, read_header
from rbtool.format.schema import INT64_LIMIT

_EOCD = struct.Struct("<4sHHHHIIH")  # sig, disk, cd disk, entries here, entries, cd size, cd offset, comment
_LOCATOR = struct.Struct("<4sIQI")  # sig, disk of the zip64 end record, its offset, disks
# sig, record size, versions, disks, entries here, entries, cd size, offset
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")
# sig, made by, needed, flags, method, time, date, crc, comp, size, name, extra, comment, disk, attrs, offset
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
# sig, needed, flags, method, time, date, crc, comp, size, name, extra
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_DESCRIPTOR_FLAG = 0x8  # sizes and CRC in a data descriptor after the data (torch.save sets it)
_UTF8_FLAG = 0x800
_FLAGS = (0, _DESCRIPTOR_FLAG, _UTF8_FLAG, _DESCRIPTOR_FLAG | _UTF8_FLAG)
_MAX_EXTRACT_VERSION = 63
_BOUND = 1 << 40  # sizes, strides and offsets beyond this are left to torch's loader
_RECORDS = {
    "data.pkl",
    "version",
    "byteorder",
    ".format_version",
    ".storage_alignment",
    ".data/serialization_id",
}
_FLOATING = {"float16": 0x7C00, "bfloat16": 0x7F80, "float32": 0x7F800000, "float64": 0x7FF0000000000000}
_COMPLEX = {"complex64": "float32", "complex128": "float64"}
_UINTS = {2: "<u2", 4: "<u4", 8: "<u8"}


@functools.cache
def torch_is_recent() -> bool:
    """Whether the torch path would load files at all: torch installed and not refused as too old
    (read from its metadata: importing torch costs seconds)."""
    import importlib.metadata
    import re

    from rbtool.files.trajfile import MIN_TORCH

    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return False
    found = re.match(r"(\d+)\.(\d+)", version)
    return found is not None and (int(found.group(1)), int(found.group(2))) >= MIN_TORCH


# ------------------------------------------------------------------ the pickle's instructions
def _fixed(*pairs: tuple[bytes, int]) -> dict[int, int]:
    return {code[0]: size for code, size in pairs}


# Instructions with a fixed-size argument, by opcode: what torch.save's protocol-2 pickle of a
# dict of tensors holds, and torch's weights-only unpickler runs the way the C unpickler does.
_FIXED_ARGS = _fixed(
    (b"\x80", 1), (b"}", 0), (b"q", 1), (b"r", 4), (b"(", 0), (b"J", 4), (b"K", 1), (b"M", 2),
    (b"G", 8), (b"\x88", 0), (b"\x89", 0), (b"N", 0), (b"Q", 0), (b"t", 0), (b"\x85", 0),
    (b"\x86", 0), (b"\x87", 0), (b")", 0), (b"R", 0), (b"s", 0), (b"u", 0), (b"h", 1), (b"j", 4),
)  # fmt: skip
_BINUNICODE, _LONG1, _GLOBAL, _STOP = b"X"[0], b"\x8a"[0], b"c"[0], b"."[0]
_LONG_MEMO = {b"r"[0], b"j"[0]}  # LONG_BINPUT, LONG_BINGET
_MAX_MEMO = 1 << 20
_GLOBALS = {
    b"torch._utils\n_rebuild_tensor_v2\n",
    b"collections\nOrderedDict\n",
    *(f"torch\n{name}\n".encode() for name in STORAGE_DTYPES),
}


def _plain_instructions(pickled: bytes) -> bool:
    """Whether every instruction up to STOP is one of _FIXED_ARGS, BINUNICODE, LONG1 or a GLOBAL
    of _GLOBALS (no BUILD, no list, no other global; nothing runs here)."""
    pos, end = 0, len(pickled)
    fixed = _FIXED_ARGS
    while pos < end:
        op = pickled[pos]
        pos += 1
        size = fixed.get(op)
        if size is not None:
            if op in _LONG_MEMO and int.from_bytes(pickled[pos : pos + 4], "little") >= _MAX_MEMO:
                return False  # the C unpickler would size its memo to it
            pos += size
        elif op == _BINUNICODE:
            if pos + 4 > end:
                return False
            pos += 4 + int.from_bytes(pickled[pos : pos + 4], "little")
        elif op == _LONG1:
            if pos >= end:
                return False
            pos += 1 + pickled[pos]
        elif op == _GLOBAL:
            first = pickled.find(b"\n", pos)
            second = pickled.find(b"\n", first + 1) if first >= 0 else -1
            if second < 0 or pickled[pos : second + 1] not in _GLOBALS:
                return False
            pos = second + 1
        else:
            return op == _STOP
    return False


_SCANNED: dict[bytes, bool] = {}  # data.pkl bytes -> _plain_instructions (files of one writer share them)
_SCANNED_MAX = 4096
_SCANNED_PICKLE = 64 << 10  # larger pickles are scanned each time, not kept


def _plain_pickle(pickled: bytes) -> bool:
    if len(pickled) > _SCANNED_PICKLE:
        return _plain_instructions(pickled)
    known = _SCANNED.get(pickled)
    if known is None:
        known = _plain_instructions(pickled)
        if len(_SCANNED) >= _SCANNED_MAX:
            del _SCANNED[next(iter(_SCANNED))]
        _SCANNED[pickled] = known
    return known


# ------------------------------------------------------------------ the zip
def _directory(data: bytes) -> tuple[int, int, int] | None:
    """(entries, central directory offset, its size) from end records at the very end, or None."""
    size = len(data)
    if size < _EOCD.size or data[:4] != b"PK\x03\x04":
        return None
    sig, disk, cd_disk, here, count, cd_size, cd_offset, comment = _EOCD.unpack_from(data, size - _EOCD.size)
    if sig != b"PK\x05\x06" or comment or disk or cd_disk or here != count:
        return None
    end = size - _EOCD.size
    at = end - _LOCATOR.size
    if at >= _EOCD64.size and data[at : at + 4] == b"PK\x06\x07":
        _, locator_disk, offset, disks = _LOCATOR.unpack_from(data, at)
        end = at - _EOCD64.size
        if locator_disk or disks != 1 or offset != end:
            return None
        sig, record, _, _, disk, cd_disk, here64, count64, size64, offset64 = _EOCD64.unpack_from(data, end)
        if sig != b"PK\x06\x06" or record != _EOCD64.size - 12 or disk or cd_disk or here64 != count64:
            return None
        if count not in (count64, 0xFFFF) or cd_size not in (size64, 0xFFFFFFFF):
            return None
        if cd_offset not in (offset64, 0xFFFFFFFF):
            return None
        count, cd_size, cd_offset = count64, size64, offset64
    elif count == 0xFFFF or 0xFFFFFFFF in (cd_size, cd_offset):
        return None
    if cd_offset + cd_size != end:
        return None
    return count, cd_offset, cd_size


class _Zip(NamedTuple):
    """A checked zip: each record's (data start, size, CRC-32) by name, and where its headers are."""

    records: dict[str, tuple[int, int, int]]
    headers: dict[str, tuple[int, int, bool]]  # (local header, central entry, CRC in a descriptor)
    cd_end: int  # where the end records begin


def _records(data: bytes) -> _Zip | None:
    """Every record, each checked as the module says, or None."""
    found = _directory(data)
    if found is None:
        return None
    count, pos, cd_size = found
    cd_end = pos + cd_size
    records: dict[str, tuple[int, int, int]] = {}
    headers: dict[str, tuple[int, int, bool]] = {}
    placed: list[tuple[int, int]] = []  # (local header offset, data end)
    for _ in range(count):
        if pos + _CENTRAL.size > cd_end:
            return None
        entry = pos
        (sig, _, needed, flags, method, _, _, crc, comp, size, name_len, extra_len, comment_len, disk, _, _,
         offset) = _CENTRAL.unpack_from(data, pos)  # fmt: skip
        pos += _CENTRAL.size
        raw = data[pos : pos + name_len]
        pos += name_len
        if (
            sig != b"PK\x01\x02"
            or needed > _MAX_EXTRACT_VERSION
            or flags not in _FLAGS
            or method
            or comp != size
            or extra_len
            or comment_len
            or disk
            or len(raw) != name_len
            or not raw.isascii()
            or 0xFFFFFFFF in (size, offset)
        ):
            return None
        if offset + _LOCAL.size > cd_end:
            return None
        (lsig, _, lflags, lmethod, _, _, lcrc, lcomp, lsize, lname_len, lextra_len) = _LOCAL.unpack_from(
            data, offset
        )
        start = offset + _LOCAL.size + lname_len + lextra_len
        if (
            lsig != b"PK\x03\x04"
            or lflags != flags
            or lmethod
            or data[offset + _LOCAL.size : offset + _LOCAL.size + lname_len] != raw
            or (not flags & _DESCRIPTOR_FLAG and (lcrc, lcomp, lsize) != (crc, size, size))
        ):
            return None
        name = raw.decode("ascii")
        if name in records:
            return None
        records[name] = (start, size, crc)
        headers[name] = (offset, entry, bool(flags & _DESCRIPTOR_FLAG))
        placed.append((offset, start + size))
    if pos != cd_end or len({n.lower() for n in records}) != len(records):
        return None
    placed.sort()
    for (_, data_end), (next_offset, _) in itertools.pairwise(placed):
        if data_end > next_offset:
            return None
    if placed and placed[-1][1] > cd_end - cd_size:
        return None
    return _Zip(records, headers, cd_end)


def _archive_prefix(records: dict[str, tuple[int, int, int]]) -> str | None:
    """The one `<archive>/` every record is under, with the records torch's loader reads, or None."""
    first = next(iter(records), "")
    slash = first.find("/")
    if slash <= 0:
        return None
    prefix = first[: slash + 1]
    for name in records:
        if not name.startswith(prefix):
            return None
        rest = name[len(prefix) :]
        storage = rest.startswith("data/") and "/" not in rest[5:] and rest != "data/data.pkl"
        if rest not in _RECORDS and not storage:  # (the torch path scans any */data.pkl as a pickle)
            return None
    if not {"data.pkl", "version", "byteorder"} <= {n[len(prefix) :] for n in records}:
        return None
    return prefix


def _record(data: bytes, place: tuple[int, int, int]) -> bytes:
    start, size, _ = place
    return data[start : start + size]


# ------------------------------------------------------------------ the structure
def _plain_values(value: Any) -> bool:
    """Only dicts, tensors, strings, ints, floats, bools and None (no tuples, which a header
    reads as lists, and torch's loader as tuples)."""
    for item in value.values():
        kind = type(item)
        if kind is dict:
            if not _plain_values(item):
                return False
        elif kind not in (TensorSpec, str, int, float, bool) and item is not None:
            return False
    return True


def _specs_plain(structure: dict[str, Any]) -> bool:
    """Every tensor non-empty, in bounds torch's loader takes, and each record of one dtype."""
    records: dict[int, tuple[str, int]] = {}
    for _, spec in iter_specs(structure):
        if spec.numel() == 0 or spec.offset >= _BOUND or spec.nbytes >= _BOUND:
            return False
        if any(v >= _BOUND for v in spec.shape) or any(v >= _BOUND for v in spec.stride):
            return False
        seen = records.setdefault(spec.start, (spec.dtype, spec.nbytes))
        if seen != (spec.dtype, spec.nbytes):
            return False
    return True


def _check_whole(path: Path, data: bytes) -> Checked | None:
    """The checks of the module docstring, every one of them, on one file's bytes."""
    found = _records(data)
    if found is None:
        return None
    records = found.records
    prefix = _archive_prefix(records)
    if prefix is None:
        return None
    pickle_place = records[f"{prefix}data.pkl"]
    pickled = _record(data, pickle_place)
    if zlib.crc32(pickled) != pickle_place[2] or not _plain_pickle(pickled):
        return None
    if _record(data, records[f"{prefix}byteorder"]) != b"little":
        return None
    alignment = records.get(f"{prefix}.storage_alignment")
    if alignment is not None:
        try:
            int(_record(data, alignment))
        except ValueError:
            return None
    try:
        structure = read_header(path, data)
    except Exception:  # damaged or unusual: the torch path words it
        return None
    if not _plain_values(structure) or not _specs_plain(structure):
        return None
    weights, mel = structure.get("model_weights_id"), structure.get("max_episode_length")
    if not (weights is None or type(weights) is str) or not (mel is None or type(mel) is int):
        return None
    if mel is not None and not -INT64_LIMIT <= mel < INT64_LIMIT:
        return None
    ident = records.get(f"{prefix}.data/serialization_id")
    checked = Checked(structure, *_skeleton(data, found, prefix), len(data))
    checked.ident = None if ident is None else ident[:2]
    return checked if checked.ident_readable(data) else None


def _skeleton(data: bytes, found: _Zip, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """The positions of every byte the checks read but the archive's name: all but the tensors'
    bytes, their CRC-32s where a data descriptor (which no reader reads) also holds them, the
    descriptors, and the serialization id (random, checked on its own); and the positions of
    the archive's name in each record's two names, one row per name (torch.save names the
    archive after the file, so files of one layout differ there)."""
    ranges: list[tuple[int, int]] = [(0, 4)]
    names: list[np.ndarray] = []
    free = f"{prefix}data/"
    archive = len(prefix) - 1  # the name before its "/"
    for name, (start, size, _) in found.records.items():
        local, entry, described = found.headers[name]
        ranges.append((local, local + _LOCAL.size))
        ranges.append((local + _LOCAL.size + archive, start))  # the rest of the name, the extra field
        names.append(np.arange(local + _LOCAL.size, local + _LOCAL.size + archive, dtype=np.intp))
        varies = name.startswith(free) or name == f"{prefix}.data/serialization_id"
        if not varies:
            ranges.append((start, start + size))
        if varies and described:
            ranges.append((entry, entry + 16))  # up to the CRC-32
            ranges.append((entry + 20, entry + _CENTRAL.size))
        else:
            ranges.append((entry, entry + _CENTRAL.size))
        names_at = entry + _CENTRAL.size
        ranges.append((names_at + archive, names_at + len(name)))
        names.append(np.arange(names_at, names_at + archive, dtype=np.intp))
    ranges.append((found.cd_end, len(data)))
    skeleton = np.concatenate([np.arange(a, b, dtype=np.intp) for a, b in ranges if b > a])
    return skeleton, np.stack(names)


class Checked:
    """A `.pt` layout that passed every check: its structure, and how to tell another file of the
    same layout (every byte the checks read the same) and count its non-finite values quickly."""

    def __init__(
        self, structure: dict[str, Any], skeleton: np.ndarray, archive: np.ndarray, size: int
    ) -> None:
        self.structure = structure
        self.size = size
        self.skeleton = skeleton
        self.archive = archive
        self.mask = self.expected = np.zeros(0, dtype=np.uint8)  # set by remember()
        self.memo: dict[str, Any] = {}  # the caller's results that depend on the structure only
        self.ident: tuple[int, int] | None = None  # where the serialization id is (start, size)
        self.floats = [spec for _, spec in iter_specs(structure) if is_floating(spec)]
        self.exact_only: list[TensorSpec] = list(self.floats)  # counted one by one
        self.groups: list[tuple[np.dtype[Any], np.ndarray, Any]] = []  # tested at once: see remember()

    def remember(self, data: bytes) -> None:
        """Make this layout one to recognise in other files (`data`: the checked file's bytes):
        the bytes the checks read under a mask, and the contiguous whole-storage floats at
        aligned places as one index per dtype, to test them all at once."""
        self.mask = np.zeros(self.size, dtype=np.uint8)  # 0xFF where the checks read a byte
        self.mask[self.skeleton] = 0xFF
        self.expected = np.frombuffer(data, dtype=np.uint8) & self.mask
        by_kind: dict[tuple[str, int], list[np.ndarray]] = {}
        self.exact_only = []
        for spec in self.floats:
            component = _COMPLEX.get(spec.dtype, spec.dtype)
            width = spec.itemsize // (2 if spec.dtype in _COMPLEX else 1)
            whole = spec.offset == 0 and spec.is_contiguous() and spec.numel() * spec.itemsize == spec.nbytes
            if not whole or spec.start % width:
                self.exact_only.append(spec)
                continue
            first = spec.start // width
            by_kind.setdefault((_UINTS[width], _FLOATING[component]), []).append(
                np.arange(first, first + spec.nbytes // width, dtype=np.intp)
            )
        for (uint, mask), parts in by_kind.items():
            kind = np.dtype(uint)
            self.groups.append((kind, np.concatenate(parts), kind.type(mask)))

    def same_layout(self, data: bytes) -> bool:
        """Whether `data` holds this layout: the same size and every byte the checks read the same."""
        if len(data) != self.size:
            return False
        octets = np.frombuffer(data, dtype=np.uint8)
        if np.bitwise_and(np.bitwise_xor(octets, self.expected), self.mask).any():
            return False
        names = octets[self.archive]  # the archive's name, the same in every record's two names
        first = names[0].tobytes()
        return bool((names == names[0]).all()) and first.isascii() and b"/" not in first

    def ident_readable(self, data: bytes) -> bool:
        """Whether the serialization id is text: torch's loader reads it as UTF-8 (for its logs)."""
        if self.ident is None:
            return True
        start, size = self.ident
        try:
            data[start : start + size].decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True

    def nonfinite(self, data: bytes) -> dict[int, int]:
        """NaN/Inf counts of this layout's floating tensors in `data`, by id() of their spec (those
        not listed hold none)."""
        counts = {id(spec): nonfinite(spec, data) for spec in self.exact_only}
        for uint, index, mask in self.groups:
            bits = np.frombuffer(data, dtype=uint, count=len(data) // uint.itemsize)[index]
            if (np.bitwise_and(bits, mask) == mask).any():
                return {id(spec): nonfinite(spec, data) for spec in self.floats}
        return {k: v for k, v in counts.items() if v}


# Layouts remembered, by _layout_key: files up to _REMEMBERED_FILE bytes, _REMEMBERED_BYTES of
# them at most (each holds a mask and the bytes of its file, and float indices up to its size).
_LAYOUTS: dict[tuple[int, int, bytes], Checked] = {}
_REMEMBERED_FILE = 1 << 20
_REMEMBERED_BYTES = 32 << 20
_remembered = 0


def _layout_key(data: bytes) -> tuple[int, int, bytes] | None:
    """(size, central directory offset, first record's bytes): what tells layouts apart cheaply."""
    size = len(data)
    if size < _EOCD.size + _CENTRAL.size:
        return None
    cd_offset = int.from_bytes(data[size - 6 : size - 2], "little")
    if cd_offset + _CENTRAL.size > size:
        return None
    first = _CENTRAL.unpack_from(data, cd_offset)
    comp, offset = first[8], first[16]
    if offset + _LOCAL.size > size:
        return None
    local = _LOCAL.unpack_from(data, offset)
    start = offset + _LOCAL.size + local[9] + local[10]
    return size, cd_offset, data[start : start + comp]


def check_pt(path: Path, data: bytes) -> Checked | None:
    """The checked layout of a `.pt` file's bytes, when the file is laid out as torch.save writes
    it and passes every check of the module docstring; else None (the caller loads it with torch).

    A file of a layout already checked (every byte the checks read the same) is that layout.
    Its structure may be shared: never change it."""
    if not torch_is_recent():
        return None  # the torch path refuses every file: it says why
    key = _layout_key(data)
    known = _LAYOUTS.get(key) if key is not None else None
    if known is not None and known.same_layout(data):
        return known if known.ident_readable(data) else None
    checked = _check_whole(path, data)
    if checked is None or key is None or len(data) > _REMEMBERED_FILE:
        return checked  # (a large file's own checks cost little beside its read and hash)
    checked.remember(data)
    global _remembered
    if known is not None:  # the same key, another layout: this one takes its place
        _remembered -= _LAYOUTS.pop(key).size
    while _LAYOUTS and _remembered + len(data) > _REMEMBERED_BYTES:
        _remembered -= _LAYOUTS.pop(next(iter(_LAYOUTS))).size
    _LAYOUTS[key] = checked
    _remembered += len(data)
    return checked


# ------------------------------------------------------------------ values
def is_floating(spec: TensorSpec) -> bool:
    return spec.dtype in _FLOATING or spec.dtype in _COMPLEX


def nonfinite(spec: TensorSpec, data: bytes) -> int:
    """How many of a floating or complex tensor's elements are NaN or infinite (torch.isfinite's
    count), from its storage's bytes in `data`; 0 for other dtypes."""
    component = _COMPLEX.get(spec.dtype, spec.dtype)
    mask = _FLOATING.get(component)
    if mask is None:
        return 0
    parts = 2 if spec.dtype in _COMPLEX else 1
    width = spec.itemsize // parts
    bits = np.frombuffer(data, dtype=_UINTS[width], count=spec.nbytes // width, offset=spec.start)
    bad = (bits & np.array(mask, dtype=bits.dtype)) == mask
    if parts == 2:
        bad = bad.reshape(-1, 2).any(axis=1)
    if spec.offset == 0 and spec.is_contiguous() and spec.numel() == bad.size:
        return int(np.count_nonzero(bad))
    # a view of part of its storage: the elements it reaches (inside the storage, checked)
    view = np.lib.stride_tricks.as_strided(
        bad[spec.offset :], shape=spec.shape, strides=spec.stride, writeable=False
    )
    return int(np.count_nonzero(view))


__all__ = ["Checked", "check_pt", "is_floating", "nonfinite", "torch_is_recent"]
