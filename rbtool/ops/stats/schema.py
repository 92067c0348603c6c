"""The schema part of the statistics: which fields the trajectories carry, and which reach a batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class FieldRow:
    """One tensor of one trajectory, from its metadata (no data read)."""

    path: str
    dtype: str
    per_sample_shape: tuple[int, ...] | None  # None for tensors with fewer than 2 dims
    extra_rows: int
    nbytes: int


def schema_report(runs: list[tuple[list[FieldRow], int, int]]) -> list[dict[str, Any]]:
    """One row per (field, dtype, per-sample shape), in order of first appearance, from runs of
    consecutive trajectories with the same fields: (fields, trajectories, of which in the window).

    `sampled` says whether the field reaches a batch: every window trajectory carries it
    with this dtype and per-sample shape, and it has at least 2 dims.
    """
    rows: dict[tuple[str, str, tuple[int, ...] | None], dict[str, Any]] = {}
    window_count = 0
    for fields, trajectories, in_window in runs:
        window_count += in_window
        for f in fields:
            key = (f.path, f.dtype, f.per_sample_shape)
            row = rows.setdefault(
                key,
                {
                    "field": f.path,
                    "dtype": f.dtype,
                    "per_sample_shape": None if f.per_sample_shape is None else list(f.per_sample_shape),
                    "extra_rows": set(),
                    "trajectories": 0,
                    "window_trajectories": 0,
                    "bytes": 0,
                },
            )
            row["extra_rows"].add(f.extra_rows)
            row["trajectories"] += trajectories
            row["window_trajectories"] += in_window
            row["bytes"] += f.nbytes * trajectories
    out = []
    for row in rows.values():
        row["extra_rows"] = sorted(row["extra_rows"])
        row["sampled"] = (
            row["per_sample_shape"] is not None
            and window_count > 0
            and row["window_trajectories"] == window_count
        )
        out.append(row)
    return out
