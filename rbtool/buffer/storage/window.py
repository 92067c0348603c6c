"""What sampling knows of a window without its data, and the window's rows held in memory.

Each trajectory's Signature (the fields a batch takes from it, from memory, the index's
recorded schema or the file's header); WindowSchema, the fields the window's trajectories
share, kept as the window moves; RowCache (and window_cache), the rows of fields held in
memory concatenated over the window, so that a batch costs one index_select per field;
new_columns and stacks_of, the columns of small rows side by side, so that a batch takes
the fields of one row size with one call.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from rbtool.buffer.batchmem import numpy_dtype
from rbtool.buffer.storage.view import FieldPath, FlatView, Schema, flat_rows, nest, sampled_items
from rbtool.files.ptheader import TensorSpec

if TYPE_CHECKING:
    import torch

# What a batch takes from one trajectory: ((path, (dtype, row shape)), ...) in batch order, and
# the paths of the >= 2-dim fields it leaves out. Equal signatures are shared (interned).
Signature = tuple[tuple[tuple[FieldPath, tuple[Any, tuple[int, ...]]], ...], tuple[FieldPath, ...]]


def _torch_dtype(dtype: Any) -> Any:
    if isinstance(dtype, str):
        import torch

        return getattr(torch, dtype)
    return dtype


def signature_of(traj: dict[str, Any], extra_fields: bool) -> Signature:
    """The signature of a trajectory dict, of tensors or of a header's TensorSpecs."""
    items, left_out = sampled_items(traj, extra_fields)
    fields = tuple((p, (_torch_dtype(v.dtype), tuple(int(d) for d in v.shape[2:]))) for p, v in items)
    return fields, tuple(left_out)


def recorded_signature(fields: list[list[Any]], extra_fields: bool) -> Signature:
    """The signature of a schema an index records (layout.field_schema), without the file."""
    import torch

    specs: dict[FieldPath, TensorSpec] = {}
    for path, dtype, rest, extra in fields:
        itemsize = getattr(torch, dtype).itemsize if hasattr(torch, dtype) else 1
        shape = (1 + extra, 1, *rest)
        specs[tuple(path)] = TensorSpec(dtype, itemsize, shape, shape, 0, 0, 0)
    return signature_of(nest(specs), extra_fields)


def view_signature(view: FlatView) -> Signature:
    """The signature of a trajectory open as a FlatView."""
    return tuple((p, f.spec) for p, f in view.fields.items()), tuple(view.left_out)


class WindowSchema:
    """The fields a window's trajectories share (SPEC §3 step 6), kept as the window moves.

    Counts each distinct signature over the window's positions `[lo, hi)`; when the window
    only moves forward (ids added at the end, old ones leaving at the front) only what
    entered and what left is looked at. The shared schema is worked out over the distinct
    signatures, in the first trajectory's field order.
    """

    def __init__(self) -> None:
        self.counts: dict[Signature, int] = {}
        self.members: deque[Signature] = deque()  # the signature at each window position
        self.generation: object = None
        self.lo = self.hi = 0
        self._shared: tuple[tuple[Any, ...], Schema, list[str]] | None = None

    @property
    def first(self) -> Signature | None:
        return self.members[0] if self.members else None

    def track(
        self,
        generation: object,
        lo: int,
        hi: int,
        signature_at: Callable[[int], Signature],
        left: Callable[[int], None] | None = None,
        signatures_in: Callable[[int, int], list[Signature]] | None = None,
    ) -> None:
        """Bring the counts to positions `[lo, hi)`; `left(position)` for each that left.
        `signatures_in(start, stop)`: signature_at over a range, at once."""
        if generation is not self.generation or lo < self.lo or hi < self.hi or lo > self.hi:
            if left is not None and generation is self.generation:
                for position in range(self.lo, min(self.hi, lo)):
                    left(position)
            self.counts, self.members = {}, deque()
            self.lo = self.hi = lo
        counts, members = self.counts, self.members
        if hi - self.hi > 64 and signatures_in is not None:  # many at once: counted in C
            entered = signatures_in(self.hi, hi)
            members.extend(entered)
            # counted by identity (signatures are shared, and a tuple's hash is not kept)
            distinct = dict(zip(map(id, entered), entered, strict=True))
            for key, n in Counter(map(id, entered)).items():
                sig = distinct[key]
                counts[sig] = counts.get(sig, 0) + n
        else:
            for position in range(self.hi, hi):
                sig = signature_at(position)
                counts[sig] = counts.get(sig, 0) + 1
                members.append(sig)
        for position in range(self.lo, lo):
            sig = members.popleft()
            counts[sig] -= 1
            if not counts[sig]:
                del counts[sig]
            if left is not None:
                left(position)
        self.generation, self.lo, self.hi = generation, lo, hi

    def shared(self) -> tuple[Schema, list[str]]:
        """The shared schema and the fields left out anywhere in the window (dotted names)."""
        key = (self.first, *self.counts)
        if self._shared is not None and self._shared[0] == key:
            return self._shared[1], self._shared[2]
        distinct = [dict(sig[0]) for sig in self.counts]
        schema = shared_schema([dict(self.first[0]), *distinct] if self.first is not None else [])
        left_out: dict[str, None] = {}
        for sig in self.counts:
            left_out.update(dict.fromkeys(".".join(p) for p in sig[1]))
        self._shared = (key, schema, list(left_out))
        return schema, list(left_out)


def shared_schema(schemas: Sequence[Schema]) -> Schema:
    """Fields present in every schema with the same dtype and per-sample shape (first's order)."""
    if not schemas:
        return {}
    first, rest = schemas[0], schemas[1:]
    return {p: spec for p, spec in first.items() if all(s.get(p) == spec for s in rest)}


# Fields whose rows are held in memory are concatenated over the window when they total
# at most this many bytes: then a batch costs one index_select per field.
WINDOW_CACHE_MAX_BYTES = 512 << 20


def _row_bytes(specs: Iterable[tuple[Any, tuple[int, ...]]]) -> int:
    """Bytes of one row of fields of these (dtype, per-sample shape)."""
    return sum(math.prod(shape) * dtype.itemsize for dtype, shape in specs)


def window_cache(
    window_ids: Sequence[int], schema: Schema, view_of: Callable[[int], FlatView]
) -> dict[FieldPath, torch.Tensor]:
    """The window's in-memory fields, each concatenated into one [window samples, ...] tensor.

    Row `g` of each is the window's global sample `g`, so a draw's ids index it directly.
    Fields left on disk in any trajectory, and windows over the byte budget, are left out.
    """
    import torch

    views = [view_of(tid) for tid in window_ids]
    held = [p for p in schema if all(isinstance(v.fields[p].rows, torch.Tensor) for v in views)]
    if _row_bytes(schema[p] for p in held) * sum(v.t * v.b for v in views) > WINDOW_CACHE_MAX_BYTES:
        return {}
    return {p: torch.cat([flat_rows(v, p) for v in views]) for p in held}


# Fields of at most this many bytes a row are held side by side, those of one row size in
# one `[fields, rows, row bytes]` array: a batch takes them with one call where it took one
# a field (bench.py's eleven small fields: five calls). Larger rows keep columns of their own.
STACK_ROW_BYTES = 4096


def new_columns(
    specs: dict[FieldPath, tuple[Any, tuple[int, ...]]],
    rows: int,
    make: Callable[[tuple[int, ...], Any, int], torch.Tensor] | None = None,
) -> dict[FieldPath, torch.Tensor]:
    """Uninitialised `[rows, ...]` columns for fields `specs` (path -> (dtype, row shape)),
    fields of one row size of at most STACK_ROW_BYTES made as views of one array (each view
    contiguous). `make(shape, dtype, row bytes)` allocates (torch.empty by default)."""
    import torch

    if make is None:
        make = lambda shape, dtype, row_bytes: torch.empty(shape, dtype=dtype)  # noqa: E731
    sizes = {path: _row_bytes([spec]) for path, spec in specs.items()}
    by_size: dict[int, list[FieldPath]] = {}
    for path, row_bytes in sizes.items():
        if rows and 0 < row_bytes <= STACK_ROW_BYTES:
            by_size.setdefault(row_bytes, []).append(path)
    stacked: dict[FieldPath, torch.Tensor] = {}
    for row_bytes, paths in by_size.items():
        if len(paths) > 1:
            array = make((len(paths), rows, row_bytes), torch.uint8, row_bytes)
            for k, path in enumerate(paths):
                dtype, shape = specs[path]
                stacked[path] = array[k].view(dtype).reshape(rows, *shape)
    return {
        path: stacked[path] if path in stacked else make((rows, *shape), dtype, sizes[path])
        for path, (dtype, shape) in specs.items()
    }


def restacked(
    columns: dict[FieldPath, torch.Tensor], specs: dict[FieldPath, tuple[Any, tuple[int, ...]]], used: int
) -> dict[FieldPath, torch.Tensor]:
    """`columns` with their small-row fields made side by side again (their first `used` rows
    copied), once some fields were dropped: the dropped fields' rows are let go."""
    small = {p: specs[p] for p in columns if _row_bytes([specs[p]]) <= STACK_ROW_BYTES}
    rows = next(iter(columns.values())).shape[0] if columns else 0
    fresh = new_columns(small, rows)
    for path, column in fresh.items():
        column[:used] = columns[path][:used]
    return {p: fresh.get(p, c) for p, c in columns.items()}


@dataclass(frozen=True)
class Stack:
    """Columns held side by side: `rows` is a `[fields, rows apart, row bytes]` uint8 view of
    them (stacks_of; `array`, the same as numpy), `paths` and `specs` the fields in that order."""

    rows: torch.Tensor
    array: Any
    paths: tuple[FieldPath, ...]
    specs: tuple[tuple[Any, tuple[int, ...]], ...]
    kinds: tuple[Any, ...]  # each field's numpy dtype (None: one numpy lacks)


def stacks_of(columns: dict[FieldPath, torch.Tensor]) -> list[Stack]:
    """The columns that lie side by side in memory (as new_columns makes them): columns of
    one storage, row size and length, a whole number of rows apart from each other, each run
    as one C-contiguous `[fields, rows apart, row bytes]` view reaching to where the next
    column starts (a column's spare rows, in a RowCache; numpy's take copies a view that is
    not contiguous, which would cost the whole column a batch). Found from where the tensors
    are and bounded by their storage, so a view is only ever of the storage the columns are
    in, and a batch reads only the columns' own rows from it."""
    import torch

    groups: dict[tuple[int, int, int], list[tuple[int, FieldPath, torch.Tensor]]] = {}
    for path, column in columns.items():
        if not column.numel() or not column.is_contiguous():
            continue
        row_bytes = column.numel() // column.shape[0] * column.element_size()
        if row_bytes <= STACK_ROW_BYTES:
            key = (column.untyped_storage().data_ptr(), row_bytes, column.shape[0])
            groups.setdefault(key, []).append((column.data_ptr(), path, column))
    stacks = []
    for (_, row_bytes, rows), members in groups.items():
        members.sort(key=lambda m: m[0])
        gaps = {b[0] - a[0] for a, b in pairwise(members)}
        step = min(gaps, default=0)
        if len(gaps) != 1 or step < rows * row_bytes or step % row_bytes:
            continue
        storage = members[0][2].untyped_storage()
        if members[-1][0] + step > storage.data_ptr() + storage.nbytes():
            continue  # the last column's rows-apart would reach past its storage
        first = members[0][2].reshape(-1).view(torch.uint8)
        apart = step // row_bytes
        view = torch.as_strided(first, (len(members), apart, row_bytes), (step, row_bytes, 1))
        specs = tuple((c.dtype, tuple(c.shape[1:])) for _, _, c in members)
        kinds = tuple(numpy_dtype(c.dtype) for _, _, c in members)
        stacks.append(Stack(view, view.numpy(), tuple(p for _, p, _ in members), specs, kinds))
    return stacks


@dataclass
class CachedRows:
    """Rows of a run of the window's trajectories, already concatenated in memory.

    Draws at window positions `[first, stop)` read row `global index + shift` of `columns`.
    """

    columns: dict[FieldPath, torch.Tensor]
    first: int
    stop: int
    shift: int
    # each column's rows as bytes (`[rows, row bytes]` uint8 numpy views), where known
    byte_rows: dict[FieldPath, Any] | None = None
    # the columns held side by side (stacks_of)
    stacks: Sequence[Stack] = ()


class RowCache:
    """The sampled rows of trajectories added to a buffer, concatenated as they are added.

    Covers a run of id-list positions `[lo, hi)`; row 0 is cumulative sample `base`. Adding
    appends (amortised O(rows)); when the window has moved past more rows than it still
    covers, the dead rows are dropped. A field that a newly added trajectory lacks (or holds
    with another dtype or row shape) stops being cached. Bounded by `max_bytes`: past it,
    trajectories are not cached and are read from their views.
    """

    def __init__(self, max_bytes: int = WINDOW_CACHE_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.reset(0, 0)

    def reset(self, position: int, base: int) -> None:
        self._covered: tuple[Any, ...] | None = None  # covering()'s last columns, while unchanged
        self.columns: dict[FieldPath, torch.Tensor] = {}
        self.specs: dict[FieldPath, tuple[Any, tuple[int, ...]]] = {}
        self.lo = self.hi = position
        self.base = base
        self.rows = 0
        self.full = False

    def append(self, position: int, base: int, view: FlatView) -> None:
        """Cache trajectory `position` (its first sample is cumulative sample `base`)."""
        import torch

        self._covered = None
        if position != self.hi or (self.full and self.lo == self.hi):
            self.reset(position, base)
        if self.full:
            return
        fields = {p: f for p, f in view.fields.items() if isinstance(f.rows, torch.Tensor)}
        specs = {p: f.spec for p, f in fields.items()}
        if self.lo == self.hi:
            self.specs = specs
            self.columns = {}
        else:
            dropped = [p for p, spec in self.specs.items() if specs.get(p) != spec]
            for path in dropped:
                del self.specs[path]
                self.columns.pop(path, None)
            if dropped and self.columns:
                self.columns = restacked(self.columns, self.specs, self.rows)
        n = view.t * view.b
        if (self.rows + n) * _row_bytes(self.specs.values()) > self.max_bytes:
            self.full = True
            return
        if any(p not in self.columns or self.columns[p].shape[0] < self.rows + n for p in self.specs):
            grown = new_columns(self.specs, max(2 * (self.rows + n), 64))
            for path, column in self.columns.items():
                grown[path][: self.rows] = column[: self.rows]
            self.columns = grown
        for path in self.specs:
            self.columns[path][self.rows : self.rows + n] = flat_rows(view, path)
        self.rows += n
        self.hi += 1

    @property
    def nbytes(self) -> int:
        """Bytes of memory the columns take (their spare rows too)."""
        return sum(c.numel() * c.element_size() for c in self.columns.values())

    def adopt(
        self,
        lo: int,
        hi: int,
        base: int,
        columns: dict[FieldPath, torch.Tensor],
        specs: dict[FieldPath, tuple[Any, tuple[int, ...]]],
        rows: int,
    ) -> None:
        """Cover positions `[lo, hi)` (first sample `base`) with `columns` of `rows` rows
        read for them at once; later adds append to them."""
        self.reset(lo, base)
        self.columns, self.specs = dict(columns), dict(specs)
        self.hi, self.rows = hi, rows

    def trim(self, lo: int, base: int) -> None:
        """The window now starts at position `lo` (cumulative sample `base`): drop dead rows."""
        if lo >= self.hi:
            if self.lo != self.hi or self.full:
                self.reset(lo, base)
            return
        dead = base - self.base
        if lo > self.lo and dead > self.rows - dead:
            self._covered = None
            kept = new_columns({p: self.specs[p] for p in self.columns}, self.rows - dead)
            for path, column in kept.items():
                column.copy_(self.columns[path][dead : self.rows])
            self.columns = kept
            self.rows -= dead
            self.lo, self.base = lo, base

    def covering(self, lo: int, hi: int, window_base: int) -> CachedRows | None:
        """What this cache holds of the window `[lo, hi)` whose first sample is `window_base`."""
        first, stop = max(self.lo, lo), min(self.hi, hi)
        if first >= stop or not self.columns:
            return None
        import torch

        if self._covered is None or self._covered[0] != self.rows:
            columns = {p: c[: self.rows] for p, c in self.columns.items()}
            byte_rows = {
                p: c.reshape(-1).view(torch.uint8).reshape(c.shape[0], -1).numpy()
                for p, c in columns.items()
                if c.numel()
            }
            self._covered = (self.rows, columns, byte_rows, stacks_of(columns))
        _, columns, byte_rows, stacks = self._covered
        return CachedRows(columns, first - lo, stop - lo, window_base - self.base, byte_rows, stacks)
