""".pt files held as bytes for sampling: RawTrajectory, and the few blocks (HeldBlocks) they are packed in.

A trajectory held as bytes has its drawn rows copied out by offset, no tensor built: what
holding a file of a given header needs (raw_layout, header_extent) is worked out from the
header alone, and a batch gathers from the blocks in place.
"""

from __future__ import annotations

from typing import Any

from rbtool.buffer.storage.ptfile import FileHandle, FileRows
from rbtool.buffer.storage.view import FieldPath, sampled_items
from rbtool.errors import TrajectoryFileError
from rbtool.files.ptheader import TensorSpec, UnusualLayout, iter_specs
from rbtool.format.layout import DONE_LIKE, describe, done_extra_rows


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
