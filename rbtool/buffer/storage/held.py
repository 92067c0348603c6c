""".pt files held as bytes for sampling: RawTrajectory, and the few blocks (HeldBlocks) they are packed in.

A trajectory held as bytes has its drawn rows copied out by offset, no tensor built: what
holding a file of a given header needs (raw_layout, header_extent) is worked out from the
header alone, once per header (HeldLayout), and a batch gathers from the blocks in place.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rbtool.buffer.storage.ptfile import (
    ROW_READ_MIN_BYTES,
    FileHandle,
    FileRows,
    PinnedFile,
    read_exactly,
)
from rbtool.buffer.storage.view import FieldPath, bootstrap_rows, check_shape, sampled_items
from rbtool.errors import RbtoolError, TrajectoryFileError
from rbtool.files.ptheader import TensorSpec, UnusualLayout, iter_specs
from rbtool.format.layout import describe


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
    check_shape(describe(header, where, TensorSpec), t, b, where)
    layout: RawLayout = []
    items, _ = sampled_items(header, extra_fields)
    for path, spec in items:
        if not spec.is_contiguous():
            raise UnusualLayout(f"field {'.'.join(path)!r} is not contiguous")
        try:
            extra = bootstrap_rows(path, spec.shape, t, b)
        except RbtoolError as exc:
            raise TrajectoryFileError(f"{where}: {exc}") from None
        layout.append((path, spec, extra))
    return layout


def header_extent(header: dict[str, Any]) -> int:
    """How many bytes a file must hold for every tensor its header declares."""
    return max((spec.start + spec.nbytes for _, spec in iter_specs(header)), default=0)


def _packing(layout: RawLayout) -> tuple[dict[FieldPath, tuple[int, int]], list[tuple[int, int]]]:
    """The fields of `layout` packed one after the other: where each starts in the packed bytes
    (and its E), and the bytes `[start, stop)` of the file each is copied from."""
    fields: dict[FieldPath, tuple[int, int]] = {}
    pieces: list[tuple[int, int]] = []
    at = 0
    for path, spec, extra in layout:
        size = spec.numel() * spec.itemsize
        pieces.append((spec.data_start, spec.data_start + size))
        fields[path] = (at, extra)
        at += size
    return fields, pieces


class HeldLayout:
    """How the files of one header whose trajectories are [T, B] = [t, b] are held as bytes.

    Headers are shared by files of one structure: so is what is derived from them, worked out
    once, and so are the field tables (a batch looks each field up once per layout, not once
    per drawn file). Never changed once made.
    """

    def __init__(self, header: dict[str, Any], where: str, t: int, b: int, extra_fields: bool) -> None:
        self.header, self.t, self.b = header, t, b
        layout = raw_layout(header, where, t, b, extra_fields)
        self.extent = header_extent(header)
        # a small file is held as its sampled fields packed one after the other
        self.packed, self.pieces = _packing(layout)
        # a larger one as its fields with small rows packed, the others left on disk; where each
        # sampled field starts in the file, and its E (for mapping the file)
        wide = [math.prod(spec.shape[2:]) * spec.itemsize >= ROW_READ_MIN_BYTES for _, spec, _ in layout]
        self.disk = [field for field, on_disk in zip(layout, wide, strict=True) if on_disk]
        self.small_packed, self.small_pieces = _packing(
            [field for field, on_disk in zip(layout, wide, strict=True) if not on_disk]
        )
        self.table = {path: (spec.data_start, extra) for path, spec, extra in layout}

    def hold(self, data: bytes, where: Path) -> RawTrajectory:
        """A small file of this layout, read whole as `data`, held as its packed sampled fields."""
        if len(data) < self.extent:
            raise TrajectoryFileError(f"{where}: truncated (a tensor's data is cut short)")
        return RawTrajectory(b"".join([data[a:z] for a, z in self.pieces]), self.t, self.b, self.packed)

    def hold_large(self, tid: int, path: Path, pin: PinnedFile | None) -> RawTrajectory:
        """A large file of this layout held: fields with small rows read and packed, the others
        left on disk (FileRows); with what mapping the file needs."""
        import torch

        handle = FileHandle(path, pin)
        disk: dict[FieldPath, tuple[FileRows, int]] = {}
        for field_path, spec, extra in self.disk:
            shape = (spec.shape[0] * spec.shape[1], *spec.shape[2:])
            disk[field_path] = (FileRows(handle, spec.data_start, shape, getattr(torch, spec.dtype)), extra)
        packed = bytearray(sum(stop - start for start, stop in self.small_pieces))
        view = memoryview(packed)
        for (start, stop), (at, _) in zip(self.small_pieces, self.small_packed.values(), strict=True):
            read_exactly(handle, view[at : at + stop - start], start)
        handle.close()
        file = (tid, handle, self.extent, self.table)
        return RawTrajectory(packed, self.t, self.b, self.small_packed, disk, file)


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
