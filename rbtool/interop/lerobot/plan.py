"""An export's plan (pass 1): each trajectory's entries as the features are decided from them,
its scalar values and its episodes (split where done flags end one), and the place of each
trajectory in the dataset (pass 2's task).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rbtool.files import trajfile
from rbtool.format.layout import (
    done_extra_rows,
    drop_bootstrap_rows,
    episode_ends,
    is_done_like,
    with_stored_defaults,
)
from rbtool.interop.lerobot.features import Registry
from rbtool.interop.lerobot.sidecar import encode_value, trajectory_entries
from rbtool.interop.lerobot.tensors import AS_BITS, NATIVE, dtype_name

if TYPE_CHECKING:
    import numpy as np
    import torch


def _column_ok(tensor: torch.Tensor, path: tuple[str, ...], t: int, b: int) -> int | None:
    """E (extra leading rows) when the tensor can be a per-frame column, else None."""
    if tensor.dim() < 2 or t * b == 0:
        return None
    name = dtype_name(tensor.dtype)
    if name not in NATIVE and name not in AS_BITS:
        return None
    rows, cols = int(tensor.shape[0]), int(tensor.shape[1])
    if any(int(d) == 0 for d in tensor.shape[2:]):
        return None
    if is_done_like(path):
        try:
            return done_extra_rows(rows, t, cols, b)
        except ValueError:
            return None
    return 0 if (rows, cols) == (t, b) else None


def _episode_ends(traj: dict[str, Any], t: int, b: int) -> np.ndarray:
    """[T, B] bool: where a done flag ends an episode (dones, else terminations | truncations)."""
    import numpy as np
    import torch

    def flags(name: str) -> np.ndarray | None:
        value = traj.get(name)
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            return None
        try:
            done_extra_rows(int(value.shape[0]), t, int(value.shape[1]), b)
        except ValueError:
            return None
        rows = drop_bootstrap_rows(value, t).reshape(t, b, -1)
        return (rows != 0).any(dim=2).numpy()

    ends = episode_ends(flags("dones"), flags("terminations"), flags("truncations"))
    return np.zeros((t, b), dtype=bool) if ends is None else ends


def _episode_bounds(ends: np.ndarray, t: int, b: int) -> list[tuple[int, int]]:
    """Episode frame ranges in (b, t) frame order: a new one after every done flag."""
    bounds: list[tuple[int, int]] = []
    for bi in range(b):
        start = 0
        for ti in range(t):
            if ends[ti, bi] or ti == t - 1:
                bounds.append((bi * t + start, bi * t + ti + 1))
                start = ti + 1
    return bounds


@dataclass(frozen=True)
class Probe:
    """Pass 1's task: one trajectory file, with its [T, B]."""

    path: Path
    t: int
    b: int

    def __str__(self) -> str:
        return str(self.path)


def probe(task: Probe) -> tuple[list[dict[str, Any]], list[Any], list[tuple[int, int]]]:
    """A trajectory's entries as the features are decided from them (kind, path, dtype, frame
    shape, extra leading rows), its scalar values and its episode bounds."""
    t, b = task.t, task.b
    traj = with_stored_defaults(trajfile.load(task.path, mmap=True), task.path.name)
    entries: list[dict[str, Any]] = []
    values: list[Any] = []
    for kind, path, value in trajectory_entries(traj):
        if kind != "tensor":
            entries.append({"path": list(path), "kind": kind})
            if kind == "value":
                values.append(encode_value(value))
            continue
        entries.append(
            {
                "path": list(path),
                "kind": "tensor",
                "dtype": dtype_name(value.dtype),
                "shape": [int(d) for d in value.shape[2:]],
                "extra": _column_ok(value, path, t, b),
            }
        )
    return entries, values, _episode_bounds(_episode_ends(traj, t, b), t, b)


def schema_from(entries: list[dict[str, Any]], registry: Registry) -> list[dict[str, Any]]:
    """The trajectory's skeleton (how each entry is stored), its columns taken from `registry`."""
    nodes: list[dict[str, Any]] = []
    columns: dict[tuple[str, ...], dict[str, Any]] = {}
    for entry in entries:
        if entry["kind"] != "tensor":
            nodes.append({"path": entry["path"], "kind": entry["kind"]})
            continue
        path, dtype, shape, extra = (
            tuple(entry["path"]),
            entry["dtype"],
            tuple(entry["shape"]),
            entry["extra"],
        )
        node: dict[str, Any] = {"path": list(path), "dtype": dtype}
        source = columns.get(("curr_obs", *path[1:])) if path[0] == "next_obs" and len(path) > 1 else None
        if extra == 0 and source is not None and (source["dtype"], source["shape"]) == (dtype, list(shape)):
            node.update(kind="derived", source=source["path"], shape=list(shape))
        elif extra is not None and (col := registry.column(path, dtype, shape)) is not None:
            node.update(kind="column", feature=col.feature, shape=list(shape), extra_rows=extra)
            columns[path] = node
        else:
            node.update(kind="tensor")
        nodes.append(node)
    return nodes


@dataclass(frozen=True)
class Write:
    """Pass 2's task: one trajectory, with its place in the plan (first episode and frame number)."""

    tid: int
    path: Path
    t: int
    b: int
    schema: int
    first_episode: int
    first_frame: int

    def __str__(self) -> str:
        return str(self.path)
