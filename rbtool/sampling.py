"""Window sampling: draw global sample ids, map them to (trajectory, row), gather a batch.

The draw follows the reference implementation step by step (randint, bucketize with
right=True) so that a seed, a window and a checkpoint give the same batch bit for bit.
Gathering reads only the drawn rows: a trajectory is never flattened or copied whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rbtool.errors import RbtoolError, UsageError
from rbtool.trajfile import DONE_LIKE, NESTED_ORDER

if TYPE_CHECKING:
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

    rows: torch.Tensor  # the stored tensor reshaped to [(T + E) * B, ...]
    extra: int  # E: leading bootstrap rows of a done-like field (0 otherwise)


class FlatView:
    """A trajectory dict seen as [T*B, ...] per field (SPEC §3 step 5), lazily."""

    def __init__(self, traj: dict[str, Any], t: int, b: int) -> None:
        import torch

        self.t, self.b = t, b
        self.fields: dict[FieldPath, FlatField] = {}

        def walk(d: dict[str, Any], prefix: FieldPath, top: bool) -> None:
            for key, value in _ordered_items(d, top):
                path = (*prefix, key)
                if isinstance(value, dict):
                    walk(value, path, False)
                elif isinstance(value, torch.Tensor) and value.dim() >= 2:
                    extra = int(value.shape[0]) - t if (top and key in DONE_LIKE) else 0
                    if extra < 0 or (extra > 0 and t % extra != 0):
                        raise RbtoolError(
                            f"field {'.'.join(path)!r} has {value.shape[0]} rows, which does not fit T={t}"
                        )
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
    import torch

    if num_chunks < 1:
        raise UsageError(f"num_chunks must be >= 1, got {num_chunks}")
    total = int(sum(num_samples))
    if total == 0:
        raise RbtoolError("cannot sample from an empty buffer (the window holds no samples)")
    num_chunks = min(num_chunks, total)
    ids = torch.randint(0, total, (num_chunks,), generator=generator)
    cum = torch.as_tensor(list(num_samples), dtype=torch.long).cumsum(0)
    positions = torch.bucketize(ids, cum, right=True)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), cum[:-1]])
    return Draw(list(window_ids), ids, positions, ids - starts[positions])


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


def _done_rows(local: torch.Tensor, t: torch.Tensor, b: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """Stored rows of done-like fields for flat rows `local`, per draw (T, B, E vectors)."""
    import torch

    t_idx = local // b
    epoch_len = torch.where(extra > 0, t // extra.clamp(min=1), t + 1)
    shifted = (t_idx + t_idx // epoch_len + 1) * b + local % b
    return torch.where(extra > 0, shifted, local)


def gather(draw: Draw, schema: Schema, view_of: Callable[[int], FlatView]) -> dict[str, Any]:
    """Build the batch: for each drawn trajectory, copy only its drawn rows into the output.

    Draws are grouped by trajectory; each (trajectory, field) pair costs one index_select
    written straight into its slice of the output, then one permutation per field restores
    the draw order.
    """
    import torch

    order = torch.argsort(draw.positions, stable=True)
    local = draw.local_indices[order]
    unique, counts = torch.unique_consecutive(draw.positions[order], return_counts=True)
    views = [view_of(draw.window_ids[k]) for k in unique.tolist()]
    sizes = counts.tolist()
    plain_rows = torch.split(local, sizes)
    per_draw: dict[str, torch.Tensor] = {}
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())

    out: dict[FieldPath, torch.Tensor] = {}
    for path, (dtype, shape) in schema.items():
        fields = [view.fields[path] for view in views]
        rows = plain_rows
        if any(f.extra for f in fields):
            if not per_draw:
                per_draw["t"] = torch.repeat_interleave(torch.tensor([v.t for v in views]), counts)
                per_draw["b"] = torch.repeat_interleave(torch.tensor([v.b for v in views]), counts)
            extra = torch.repeat_interleave(torch.tensor([f.extra for f in fields]), counts)
            rows = torch.split(_done_rows(local, per_draw["t"], per_draw["b"], extra), sizes)
        target = torch.empty((len(order), *shape), dtype=dtype)
        for field, idx, part in zip(fields, rows, torch.split(target, sizes), strict=True):
            torch.index_select(field.rows, 0, idx, out=part)
        out[path] = target.index_select(0, inverse)
    return nest(out)
