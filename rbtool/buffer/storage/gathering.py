"""Gathering a batch: the drawn rows of each field copied into the batch's tensors.

Draws covered by the window's rows held in memory (CachedRows) are one index_select per
field; draws from files held as bytes are gathered from their blocks in place (their large
rows read with pread, or through a RowMap); the others are read view by view. Samplers never
read data; this module never draws.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rbtool.buffer.batchmem import numpy_dtype
from rbtool.buffer.rowmap import RowMap
from rbtool.buffer.sampling import ids_at
from rbtool.buffer.storage.held import HeldBlock, RawTrajectory, overlapping_rows
from rbtool.buffer.storage.ptfile import files_read_together, read_rows
from rbtool.buffer.storage.view import FieldPath, FlatField, FlatView, Schema, nest
from rbtool.buffer.storage.window import CachedRows, Stack
from rbtool.format.layout import done_rows

if TYPE_CHECKING:
    import numpy as np
    import torch

    from rbtool.buffer.batchmem import BatchMemory
    from rbtool.buffer.sampling import Draw


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
    if (
        cached is not None
        and cached.first == 0
        and cached.stop == len(draw.window_ids)
        and schema.keys() <= cached.columns.keys()
    ):
        return _gather_held(draw, schema, cached, empty)
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
    draws = _Draws(positions, local, draw.window_ids, view_of, raws_of, rowmap)
    groups: dict[str, _Group] = {}  # draws read view by view: all of them, or those not cached

    def group(key: str) -> _Group:
        if key not in groups:
            groups[key] = _Group(every if key == "every" else uncovered, draws)
        return groups[key]

    out: dict[FieldPath, torch.Tensor] = {}
    if cached is not None and cached.stacks and covered is not None and covered.size == count:
        assert cache_rows is not None
        _take_stacks(cached.stacks, schema, cache_rows, out)
    for path, (dtype, shape) in schema.items():
        if path in out:
            continue
        in_cache = cached is not None and covered is not None and path in cached.columns
        if in_cache and covered is not None and covered.size == count:
            assert cached is not None and cache_rows is not None
            source = cached.byte_rows.get(path) if cached.byte_rows is not None else None
            out[path] = _take(cached.columns[path], cache_rows, empty(path, (count, *shape), dtype), source)
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


def _gather_held(
    draw: Draw,
    schema: Schema,
    cached: CachedRows,
    empty: Callable[[FieldPath, tuple[int, ...], Any], torch.Tensor],
) -> dict[str, Any]:
    """The batch when `cached` holds every field of the whole window: one copy a stack of
    fields held side by side, one a field for the others (a small one into a numpy array of
    its own, a large one into `empty`'s memory)."""
    import numpy as np

    rows = draw.global_indices if not cached.shift else draw.global_indices + cached.shift
    count = rows.shape[0]
    out: dict[FieldPath, torch.Tensor] = {}
    if cached.stacks:
        _take_stacks(cached.stacks, schema, rows, out)
    byte_rows = cached.byte_rows or {}
    index = None
    for path, (dtype, shape) in schema.items():
        if path in out:
            continue
        source = byte_rows.get(path)
        row_bytes = math.prod(shape) * dtype.itemsize
        kind = numpy_dtype(dtype)
        if source is not None and kind is not None and 0 < count * row_bytes <= SERIAL_GATHER_BYTES:
            if index is None:
                index = rows.numpy()
            taken = np.empty((count, row_bytes), dtype=np.uint8)
            source.take(index, axis=0, out=taken)
            out[path] = _tensor_of(taken, dtype, kind, (count, *shape))
        else:
            out[path] = _take(cached.columns[path], rows, empty(path, (count, *shape), dtype), source)
    return nest({path: out[path] for path in schema})


# A field's gather of at most this many bytes is a copy on this thread (numpy's take): an
# index_select that large would run as a parallel region, whose threads (OpenMP, spinning
# at its barrier) cost more than the copy when other processes share the cores.
SERIAL_GATHER_BYTES = 1 << 20


def _take(column: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, source: Any = None) -> torch.Tensor:
    """Rows `rows` of a contiguous `column` into `out` (`[len(rows), ...]`, contiguous);
    `source`: the column's rows as bytes, when known already."""
    import torch

    row_bytes = math.prod(out.shape[1:]) * out.element_size()
    if not row_bytes or not out.shape[0] or out.shape[0] * row_bytes > SERIAL_GATHER_BYTES:
        return torch.index_select(column, 0, rows, out=out)
    if source is None:
        source = column.reshape(-1).view(torch.uint8).reshape(column.shape[0], row_bytes).numpy()
    target = out.reshape(-1).view(torch.uint8).reshape(out.shape[0], row_bytes).numpy()
    source.take(rows.numpy(), axis=0, out=target)
    return out


# A stack's fields come out of one gather as views of one array when the batch's rows of
# them take at most this many bytes: a field a caller keeps keeps that array, so it stays
# small. Larger ones are gathered field by field, each into memory of its own.
STACK_BATCH_BYTES = 64 << 10


def _take_stacks(
    stacks: Sequence[Stack],
    schema: Schema,
    rows: torch.Tensor,
    out: dict[FieldPath, torch.Tensor],
) -> None:
    """Rows `rows` of the fields held side by side (`stacks`) into `out`, one copy a stack
    (of the stacks whose fields the batch takes as the stack holds them, and whose rows
    take at most STACK_BATCH_BYTES): each field's tensor a contiguous part of one array."""
    import numpy as np

    count = rows.shape[0]
    index = None
    for stack in stacks:
        fields, _, row_bytes = stack.array.shape
        if fields * count * row_bytes > STACK_BATCH_BYTES or not _takes_all(schema, stack):
            continue
        if index is None:
            index = rows.numpy()
        taken = np.empty((fields, count, row_bytes), dtype=np.uint8)
        stack.array.take(index, axis=1, out=taken)
        for k, path in enumerate(stack.paths):
            dtype, shape = stack.specs[k]
            out[path] = _tensor_of(taken[k], dtype, stack.kinds[k], (count, *shape))


def _tensor_of(rows: Any, dtype: Any, kind: Any, shape: tuple[int, ...]) -> torch.Tensor:
    """The bytes `rows` (a contiguous uint8 numpy array) as a tensor of `dtype` and `shape`:
    one torch call on a numpy view where numpy has the dtype (`kind`), torch's views where
    it has none (bfloat16, ...)."""
    import torch

    if kind is None:
        return torch.from_numpy(rows).view(dtype).reshape(shape)
    return torch.from_numpy(rows.view(kind).reshape(shape))


def _takes_all(schema: Schema, stack: Stack) -> bool:
    """Whether the batch takes every field of `stack`, as the stack holds it."""
    return all(schema.get(path) == spec for path, spec in zip(stack.paths, stack.specs, strict=True))


@dataclass
class _Draws:
    """A Draw as its readers take it: each draw's window position and stored row, and how the
    drawn trajectories are reached (as views, as held bytes, through the row map)."""

    positions: np.ndarray
    local: np.ndarray
    window_ids: Sequence[int]
    view_of: Callable[[int], FlatView]
    raws_of: Callable[[list[int]], list[RawTrajectory | None]] | None
    rowmap: RowMap | None


class _Group:
    """Draws (a selection of a Draw's rows) read trajectory by trajectory: those of small files
    held as bytes together (_RawRows), the others view by view (_ViewRows)."""

    def __init__(self, selection: Any, draws: _Draws) -> None:
        import numpy as np

        self.parts: list[_RawRows | _ViewRows] = []
        positions, local = draws.positions, draws.local
        if draws.raws_of is not None and selection.size:
            unique, inverse = np.unique(positions[selection], return_inverse=True)
            raws = draws.raws_of(ids_at(draws.window_ids, unique.tolist()))
            held = np.array([r is not None for r in raws], dtype=bool)
            if held.any():
                mask = held[inverse]
                kept = [r for r in raws if r is not None]
                slot = np.cumsum(held) - 1  # unique position -> index in kept
                chosen = selection[mask]
                self.parts.append(_RawRows(chosen, slot[inverse[mask]], local[chosen], kept, draws.rowmap))
                selection = selection[~mask]
        if selection.size:
            self.parts.append(_ViewRows(selection, draws))

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
        # done: files are read in runs the descriptor cache keeps open.
        at_once = files_read_together()
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

    def __init__(self, selection: Any, draws: _Draws) -> None:
        import numpy as np
        import torch

        order = np.argsort(draws.positions[selection], kind="stable")
        self.dest = selection[order]
        self.local = draws.local[self.dest]
        unique, starts, counts = np.unique(draws.positions[self.dest], return_index=True, return_counts=True)
        self.counts = counts
        self.views = [draws.view_of(draws.window_ids[k]) for k in unique.tolist()]
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
