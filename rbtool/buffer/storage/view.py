"""The Storage interface, and FlatView: one trajectory's sampled fields seen as `[T*B, ...]` rows.

A FlatView's fields are held in memory (tensors) or left in their `.pt` file (FileRows, read
with pread); both answer `schema()` and `rows(path, idx, out, dest)`. Which fields a batch
holds, in which order, is decided here (sampled_items) for tensors and file headers alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rbtool.buffer.storage.ptfile import FileRows
from rbtool.errors import RbtoolError, TrajectoryFileError
from rbtool.files.ptheader import TensorSpec
from rbtool.format.layout import (
    NESTED_ORDER,
    SAMPLED_TOP_FIELDS,
    TrajectoryInfo,
    done_extra_rows,
    drop_bootstrap_rows,
    is_done_like,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

FieldPath = tuple[str, ...]
Schema = dict[FieldPath, tuple[Any, tuple[int, ...]]]  # path -> (dtype, per-sample shape)


class Storage(Protocol):
    """What a sampler's draws are read from: one trajectory's fields as flat rows."""

    def schema(self) -> Schema: ...

    def rows(self, path: FieldPath, idx: Any, out: Any, dest: Any) -> None: ...


@dataclass
class FlatField:
    """One field of a trajectory seen as rows of [T*B, ...] without a copy."""

    rows: Any  # the stored tensor (or FileRows) reshaped to [(T + E) * B, ...]
    extra: int  # E: leading bootstrap rows of a done-like field (0 otherwise)

    @property
    def spec(self) -> tuple[Any, tuple[int, ...]]:
        """The rows' (dtype, per-sample shape)."""
        return self.rows.dtype, tuple(int(d) for d in self.rows.shape[1:])


def bootstrap_rows(path: FieldPath, shape: Sequence[int], t: int, b: int) -> int:
    """E, the leading bootstrap rows of field `path` stored with `shape` in a [T, B] = [t, b]
    trajectory: 0 unless the field is done-like; RbtoolError when its shape fits no E."""
    if not is_done_like(path):
        return 0
    try:
        return done_extra_rows(int(shape[0]), t, int(shape[1]), b)
    except ValueError as exc:
        raise RbtoolError(f"field {'.'.join(path)!r} has shape {list(shape)}; {exc}") from None


def check_shape(info: TrajectoryInfo, t: int, b: int, where: object) -> None:
    """A trajectory's tensors are [T, B] = [t, b], as its index entry says."""
    if info.shape[:2] != (t, b):
        raise TrajectoryFileError(
            f"{where}: tensors are [T, B] = {list(info.shape[:2])} but the index says {[t, b]}"
        )


def _ordered_items(traj: dict[str, Any], top: bool) -> list[tuple[str, Any]]:
    """Tensors first in dict order, then nested dicts (the reference's three first)."""
    tensors = [(k, v) for k, v in traj.items() if not isinstance(v, dict)]
    dicts = [(k, v) for k, v in traj.items() if isinstance(v, dict)]
    if top:
        rank = {name: i for i, name in enumerate(NESTED_ORDER)}
        dicts.sort(key=lambda kv: rank.get(kv[0], len(rank)))
    return tensors + dicts


def _is_rows(value: Any) -> bool:
    import torch

    return isinstance(value, (torch.Tensor, FileRows, TensorSpec)) and value.dim() >= 2


def sampled_items(
    traj: dict[str, Any], extra_fields: bool
) -> tuple[list[tuple[FieldPath, Any]], list[FieldPath]]:
    """The (path, tensor) pairs a batch holds, in batch order, and the >= 2-dim ones left out.

    By default these are the reference sampler's: its Trajectory's top-level fields in
    declaration order, then the tensors one level inside curr_obs, next_obs, forward_inputs.
    With `extra_fields` every tensor of >= 2 dims, nested dicts flattened per key.
    """
    every: list[tuple[FieldPath, Any]] = []

    def walk(d: dict[str, Any], prefix: FieldPath, top: bool) -> None:
        for key, value in _ordered_items(d, top):
            if isinstance(value, dict):
                walk(value, (*prefix, key), False)
            elif _is_rows(value):
                every.append(((*prefix, key), value))

    walk(traj, (), True)
    if extra_fields:
        return every, []
    chosen: list[tuple[FieldPath, Any]] = [
        ((name,), traj[name]) for name in SAMPLED_TOP_FIELDS if name in traj and _is_rows(traj[name])
    ]
    for group in NESTED_ORDER:
        nested = traj.get(group)
        if isinstance(nested, dict):
            chosen.extend(((group, k), v) for k, v in nested.items() if _is_rows(v))
    taken = {p for p, _ in chosen}
    return chosen, [p for p, _ in every if p not in taken]


class FlatView:
    """A trajectory dict seen as [T*B, ...] per sampled field (SPEC §3 step 5), lazily.

    `left_out` lists the fields of >= 2 dims the batch does not hold (see sampled_items).
    """

    def __init__(self, traj: dict[str, Any], t: int, b: int, *, extra_fields: bool = False) -> None:
        self.t, self.b = t, b
        self.fields: dict[FieldPath, FlatField] = {}
        items, self.left_out = sampled_items(traj, extra_fields)
        for path, value in items:
            extra = bootstrap_rows(path, value.shape, t, b)
            self.fields[path] = FlatField(
                value.reshape(value.shape[0] * value.shape[1], *value.shape[2:]), extra
            )

    def schema(self) -> Schema:
        return {p: f.spec for p, f in self.fields.items()}

    def rows(self, path: FieldPath, idx: Any, out: Any, dest: Any) -> None:
        """Copy stored rows `idx` of field `path` into rows `dest` of the contiguous tensor `out`."""
        import torch

        rows = self.fields[path].rows
        if isinstance(rows, torch.Tensor):
            out.index_copy_(0, torch.as_tensor(dest), rows.index_select(0, torch.as_tensor(idx)))
        else:
            rows.take(idx, out, dest)


def nest(flat: dict[FieldPath, Any]) -> dict[str, Any]:
    """{('curr_obs', 'states'): x} -> {'curr_obs': {'states': x}}."""
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def flat_rows(view: FlatView, path: FieldPath) -> torch.Tensor:
    """A held field as [T*B, ...] rows, done-like bootstrap rows dropped (a copy when E > 0)."""
    field = view.fields[path]
    if not field.extra:
        return field.rows
    stored = field.rows.reshape(view.t + field.extra, view.b, *field.rows.shape[1:])
    kept = drop_bootstrap_rows(stored, view.t)
    return kept.reshape(kept.shape[0] * kept.shape[1], *field.rows.shape[1:])


def view_scores(view: FlatView) -> np.ndarray:
    """Scores of a trajectory already open as a FlatView (reads only its reward rows).

    Rewards with wide rows may still be in their file (read on demand by the sampler);
    they are then read whole, once, into a tensor.
    """
    import numpy as np
    import torch

    from rbtool.buffer.topk import scores_of_rows

    field = view.fields.get(("rewards",))
    if field is None:
        return scores_of_rows(None, view.t * view.b)
    rows = field.rows
    if not isinstance(rows, torch.Tensor):
        every = np.arange(int(rows.shape[0]))
        full = torch.empty(tuple(rows.shape), dtype=rows.dtype)
        rows.take(every, full, every)
        rows = full
    return scores_of_rows(rows, view.t * view.b)
