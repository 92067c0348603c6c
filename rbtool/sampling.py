"""Window sampling: draw global sample ids, map them to (trajectory, row), gather a batch.

The draw follows the reference implementation step by step (randint, bucketize with
right=True) so that a seed, a window and a checkpoint give the same batch bit for bit.
Gathering reads only the drawn rows: a trajectory is never flattened or copied whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rbtool.errors import RbtoolError, UsageError
from rbtool.layout import DONE_LIKE, NESTED_ORDER, done_extra_rows, done_rows, drop_bootstrap_rows

if TYPE_CHECKING:
    import numpy as np
    import torch

FieldPath = tuple[str, ...]
Schema = dict[FieldPath, tuple[Any, tuple[int, ...]]]  # path -> (dtype, per-sample shape)


def _ordered_items(traj: dict[str, Any], top: bool) -> list[tuple[str, Any]]:
    """Tensors first in dict order, then nested dicts (RLinf's three known ones first)."""
    tensors = [(k, v) for k, v in traj.items() if not isinstance(v, dict)]
    dicts = [(k, v) for k, v in traj.items() if isinstance(v, dict)]
    if top:
        rank = {name: i for i, name in enumerate(NESTED_ORDER)}
        dicts.sort(key=lambda kv: rank.get(kv[0], len(rank)))
    return tensors + dicts


@dataclass
class FlatField:
    """One field of a trajectory seen as rows of [T*B, ...] without a copy."""

    rows: Any  # the stored tensor (or FileRows) reshaped to [(T + E) * B, ...]
    extra: int  # E: leading bootstrap rows of a done-like field (0 otherwise)


class FlatView:
    """A trajectory dict seen as [T*B, ...] per field (SPEC §3 step 5), lazily."""

    def __init__(
        self, traj: dict[str, Any], t: int, b: int, release: Callable[[], None] | None = None
    ) -> None:
        import torch

        from rbtool.trajfile import FileRows

        self.t, self.b = t, b
        # Called after a batch has been gathered: lets a file-backed trajectory close its file.
        self.release = release or (lambda: None)
        self.fields: dict[FieldPath, FlatField] = {}

        def walk(d: dict[str, Any], prefix: FieldPath, top: bool) -> None:
            for key, value in _ordered_items(d, top):
                path = (*prefix, key)
                if isinstance(value, dict):
                    walk(value, path, False)
                elif isinstance(value, (torch.Tensor, FileRows)) and value.dim() >= 2:
                    extra = 0
                    if top and key in DONE_LIKE:
                        try:
                            extra = done_extra_rows(int(value.shape[0]), t, int(value.shape[1]), b)
                        except ValueError as exc:
                            raise RbtoolError(
                                f"field {'.'.join(path)!r} has shape {list(value.shape)}; {exc}"
                            ) from None
                    self.fields[path] = FlatField(value.reshape(-1, *value.shape[2:]), extra)

        walk(traj, (), True)

    def schema(self) -> Schema:
        return {p: (f.rows.dtype, tuple(f.rows.shape[1:])) for p, f in self.fields.items()}


@dataclass
class Draw:
    """The result of drawing sample positions in a window."""

    window_ids: list[int]
    global_indices: torch.Tensor
    positions: torch.Tensor  # index into window_ids, per draw
    local_indices: torch.Tensor

    @property
    def trajectory_ids(self) -> list[int]:
        return [self.window_ids[int(k)] for k in self.positions]


def draw_uniform(
    window_ids: Sequence[int], num_samples: Sequence[int], num_chunks: int, generator: torch.Generator
) -> Draw:
    """SPEC §3 steps 2-4: clamp, randint over the window's total, bucketize to (trajectory, row)."""
    import numpy as np
    import torch

    if num_chunks < 1:
        raise UsageError(f"num_chunks must be >= 1, got {num_chunks}")
    total = int(sum(num_samples))
    if total == 0:
        raise RbtoolError("cannot sample from an empty buffer (the window holds no samples)")
    num_chunks = min(num_chunks, total)
    ids = torch.randint(0, total, (num_chunks,), generator=generator)
    # searchsorted(side="right") is bucketize(right=True); numpy avoids torch's thread pool here.
    cum = np.cumsum(np.asarray(num_samples, dtype=np.int64))
    positions = np.searchsorted(cum, ids.numpy(), side="right")
    starts = cum - np.asarray(num_samples, dtype=np.int64)
    local = ids.numpy() - starts[positions]
    return Draw(list(window_ids), ids, torch.from_numpy(positions), torch.from_numpy(local))


def shared_schema(schemas: Sequence[Schema]) -> Schema:
    """Fields present in every schema with the same dtype and per-sample shape (first's order)."""
    if not schemas:
        return {}
    first, rest = schemas[0], schemas[1:]
    return {p: spec for p, spec in first.items() if all(s.get(p) == spec for s in rest)}


def nest(flat: dict[FieldPath, Any]) -> dict[str, Any]:
    """{('curr_obs', 'states'): x} -> {'curr_obs': {'states': x}}."""
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


# Fields whose rows are held in memory are concatenated over the window when they total
# at most this many bytes: then a batch costs one index_select per field.
WINDOW_CACHE_MAX_BYTES = 512 << 20


def flat_rows(view: FlatView, path: FieldPath) -> torch.Tensor:
    """A held field as [T*B, ...] rows, done-like bootstrap rows dropped (a copy when E > 0)."""
    field = view.fields[path]
    if not field.extra:
        return field.rows
    stored = field.rows.reshape(view.t + field.extra, view.b, *field.rows.shape[1:])
    return drop_bootstrap_rows(stored, view.t).reshape(-1, *field.rows.shape[1:])


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
    per_row = sum(math.prod(schema[p][1]) * schema[p][0].itemsize for p in held)
    if per_row * sum(v.t * v.b for v in views) > WINDOW_CACHE_MAX_BYTES:
        return {}
    return {p: torch.cat([flat_rows(v, p) for v in views]) for p in held}


def gather(
    draw: Draw,
    schema: Schema,
    view_of: Callable[[int], FlatView],
    cached: dict[FieldPath, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Build the batch, copying only the drawn rows.

    Fields in `cached` (see window_cache) cost one index_select each. Other draws are
    grouped by trajectory; each (trajectory, field) pair costs one index_select (or one read
    per row for fields left on disk) written straight into its slice of the output, then one
    permutation per field restores the draw order. The index arithmetic is done in numpy:
    on a few hundred numbers torch's thread pool costs more than the work.
    """
    import numpy as np
    import torch

    cached = cached or {}
    out: dict[FieldPath, torch.Tensor] = {}
    if cached:
        global_rows = draw.global_indices
        for path in schema:
            if path in cached:
                out[path] = cached[path].index_select(0, global_rows)
        if len(out) == len(schema):
            return nest({path: out[path] for path in schema})

    positions = draw.positions.numpy()
    order = np.argsort(positions, kind="stable")
    local = draw.local_indices.numpy()[order]
    unique, starts, counts = np.unique(positions[order], return_index=True, return_counts=True)
    views = [view_of(draw.window_ids[k]) for k in unique.tolist()]
    bounds = list(zip(starts.tolist(), (starts + counts).tolist(), strict=True))
    plain_rows = [torch.from_numpy(local[a:z]) for a, z in bounds]
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    inverse_t = torch.from_numpy(inverse)
    per_draw: dict[str, np.ndarray] = {}

    for path, (dtype, shape) in schema.items():
        if path in out:
            continue
        fields = [view.fields[path] for view in views]
        rows = plain_rows
        if any(f.extra for f in fields):
            if not per_draw:
                per_draw["t"] = np.repeat([v.t for v in views], counts)
                per_draw["b"] = np.repeat([v.b for v in views], counts)
            extra = np.repeat([f.extra for f in fields], counts)
            mapped = done_rows(local, per_draw["t"], per_draw["b"], extra)
            rows = [torch.from_numpy(mapped[a:z]) for a, z in bounds]
        target = torch.empty((order.size, *shape), dtype=dtype)
        if all(isinstance(f.rows, torch.Tensor) for f in fields):
            for field, idx, (a, z) in zip(fields, rows, bounds, strict=True):
                torch.index_select(field.rows, 0, idx, out=target[a:z])
            out[path] = target.index_select(0, inverse_t)
        else:  # rows read from files go straight to their final places
            for field, idx, (a, z) in zip(fields, rows, bounds, strict=True):
                if isinstance(field.rows, torch.Tensor):
                    target.index_copy_(0, torch.from_numpy(order[a:z]), field.rows.index_select(0, idx))
                else:
                    field.rows.take(idx, target, order[a:z])
            out[path] = target
    return nest({path: out[path] for path in schema})
