"""The index part of the statistics: the index as numpy columns, which files exist, the window.

It reads only the two JSON files (and, unless index only, looks at the files' sizes), works
column-wise with numpy and never imports torch.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, itemgetter, methodcaller
from pathlib import Path
from typing import Any, overload

import numpy as np

from rbtool.errors import CheckpointError
from rbtool.files.index import Index, window_start
from rbtool.format import IndexCheck, check_json, escapes, not_a_file, trajectory_file_name
from rbtool.progress import Progress

SIZES_STEP = 4096  # file sizes are reported to a progress callback this many at a time


class LazyColumn(Sequence[str]):
    """A column whose items are built on access: a view that reads a few rows (or streams them)
    need not build a million strings first."""

    def __init__(self, size: int, item: Callable[[int], str]) -> None:
        self._size = size
        self._item = item

    def __len__(self) -> int:
        return self._size

    @overload
    def __getitem__(self, pos: int) -> str: ...
    @overload
    def __getitem__(self, pos: slice) -> list[str]: ...
    def __getitem__(self, pos: int | slice) -> str | list[str]:
        if isinstance(pos, slice):
            return list(map(self._item, range(*pos.indices(self._size))))
        if not -self._size <= pos < self._size:
            raise IndexError(pos)
        return self._item(pos % self._size)


@dataclass
class IndexTable:
    """An index as columns in list order; everything after parsing is numpy work."""

    ids: np.ndarray
    t: np.ndarray
    b: np.ndarray
    num_samples: np.ndarray
    model_weights_id: list[str]
    file_bytes: np.ndarray  # -1 where the index does not record it

    def __len__(self) -> int:
        return int(self.ids.size)


def _recorded_bytes(rows: list[dict[str, Any]]) -> np.ndarray:
    """The optional `file_bytes` of each entry; -1 where absent or not a non-negative integer."""
    raw = list(map(methodcaller("get", "file_bytes"), rows))
    try:
        values = np.array(raw, dtype=np.float64)  # None becomes NaN
    except (TypeError, ValueError):
        values = np.array(
            [v if isinstance(v, int) and not isinstance(v, bool) else np.nan for v in raw], dtype=np.float64
        )
    ok = np.isfinite(values) & (values >= 0) & (values == np.floor(values))
    return np.where(ok, values, -1).astype(np.int64)


def index_table(index: Index) -> IndexTable:
    """Columns of `index`, picked out of the parsed entries by C-level maps; no Python loop per entry."""
    n = index.size
    rows = list(map(index.entries.__getitem__, index.id_list))
    shapes = list(map(itemgetter("shape"), rows))
    return IndexTable(
        ids=np.asarray(index.id_list, dtype=np.int64),
        t=np.fromiter(map(itemgetter(0), shapes), dtype=np.int64, count=n),
        b=np.fromiter(map(itemgetter(1), shapes), dtype=np.int64, count=n),
        num_samples=np.fromiter(map(itemgetter("num_samples"), rows), dtype=np.int64, count=n),
        model_weights_id=list(map(itemgetter("model_weights_id"), rows)),
        file_bytes=_recorded_bytes(rows),
    )


@dataclass(frozen=True)
class IndexHeader:
    """The metadata the report shows beside the columns."""

    trajectory_format: str
    seed: int | None
    trajectory_counter: int

    @staticmethod
    def of(index: Index) -> IndexHeader:
        return IndexHeader(index.trajectory_format, index.seed, index.trajectory_counter)


def _checked_table(checked: IndexCheck) -> IndexTable:
    """The columns of an index check_json accepted, in list order, without a dict per entry."""
    assert checked.id_list is not None
    ids = np.asarray(checked.id_list, dtype=np.int64)
    n = ids.size
    cols, values = checked.columns, list(checked.entries.values())
    if cols is not None and np.array_equal(cols.ids, ids):
        # the usual file: entries stored in list order, columns already decoded
        get: Any = attrgetter
        sizes = list(map(get("file_bytes"), values))
        return IndexTable(
            ids=ids,
            t=cols.t,
            b=cols.b,
            num_samples=cols.num_samples,
            model_weights_id=list(map(get("model_weights_id"), values)),
            file_bytes=np.fromiter((-1 if v is None else v for v in sizes), dtype=np.int64, count=n),
        )
    rows = checked.listed_entries()
    get = attrgetter if checked.typed else itemgetter
    shapes = list(map(get("shape"), rows))
    sizes = list(map(get("file_bytes") if checked.typed else methodcaller("get", "file_bytes"), rows))
    return IndexTable(
        ids=ids,
        t=np.fromiter(map(itemgetter(0), shapes), dtype=np.int64, count=n),
        b=np.fromiter(map(itemgetter(1), shapes), dtype=np.int64, count=n),
        num_samples=np.fromiter(map(get("num_samples"), rows), dtype=np.int64, count=n),
        model_weights_id=list(map(get("model_weights_id"), rows)),
        file_bytes=np.fromiter((-1 if v is None else v for v in sizes), dtype=np.int64, count=n),
    )


def read_table(directory: Path) -> tuple[IndexHeader, IndexTable]:
    """Header and columns of a directory's index, read by the one validator (rbtool.format).

    Refuses exactly what the loaders refuse, with the same one-line error.
    """
    checked = check_json(directory)
    checked.raise_first()
    table = _checked_table(checked)
    meta = checked.meta
    counter = max(meta.trajectory_counter or 0, int(table.ids.max()) + 1 if len(table) else 0)
    return IndexHeader(meta.trajectory_format or "pt", meta.seed, counter), table


def window_mask(present: np.ndarray, window: int) -> np.ndarray:
    """The last `window` present trajectories in list order (all when 0 or fewer are present)."""
    positions = np.flatnonzero(present)
    positions = positions[window_start(positions.size, window, "window") :]
    mask = np.zeros(present.size, dtype=bool)
    mask[positions] = True
    return mask


def weights_groups(table: IndexTable, in_window: np.ndarray) -> list[dict[str, Any]]:
    """Trajectories and samples per model_weights_id, in order of first appearance in the list."""
    codes = {name: c for c, name in enumerate(dict.fromkeys(table.model_weights_id))}  # first-seen order
    code = np.fromiter(map(codes.__getitem__, table.model_weights_id), dtype=np.int64, count=len(table))
    k = len(codes)
    trajectories = np.bincount(code, minlength=k)
    samples = np.bincount(code, weights=table.num_samples, minlength=k)
    window_samples = np.bincount(code, weights=np.where(in_window, table.num_samples, 0), minlength=k)
    first = np.full(k, len(table), dtype=np.int64)
    np.minimum.at(first, code, np.arange(len(table)))
    last = np.full(k, -1, dtype=np.int64)
    np.maximum.at(last, code, np.arange(len(table)))
    return [
        {
            "model_weights_id": name,
            "trajectories": int(trajectories[c]),
            "samples": int(samples[c]),
            "window_samples": int(window_samples[c]),
            "first_id": int(table.ids[first[c]]),
            "last_id": int(table.ids[last[c]]),
        }
        for name, c in codes.items()
    ]


# What file_sizes returns for a listed name that is there but no regular file (-1: missing).
NOT_A_FILE = {-2: "a directory", -3: "a FIFO", -4: "a device", -5: "a socket or other special file"}
_NOT_A_FILE_CODE = {what: code for code, what in NOT_A_FILE.items()}


def not_a_file_code(mode: int) -> int:
    """file_sizes' code for what a listed name is when it is not a regular file."""
    return _NOT_A_FILE_CODE[not_a_file(mode)]


def file_sizes(
    file_of: Callable[[int], Path],
    index: Index,
    progress: Progress | None = None,
    directory: Path | None = None,
) -> np.ndarray:
    """Size of each listed trajectory file in list order; -1 where it is missing, and where the name
    is there but not a regular file the NOT_A_FILE code of what it is (a directory, a FIFO, ...).

    With `directory` (every file of the index lives there), the directory is listed once
    and only the files it holds are looked at: a million-entry index whose files are
    elsewhere costs one listing, not a million failed lookups.
    """

    def checked(path: Path, st: os.stat_result) -> int:
        if stat.S_ISLNK(st.st_mode):
            target = escapes(path.parent, path.name)
            if target is not None:  # never read, never counted as the checkpoint's
                raise CheckpointError(f"{path}: a symlink to {target}, outside the checkpoint; refused")
            st = os.stat(path)
        return st.st_size if stat.S_ISREG(st.st_mode) else not_a_file_code(st.st_mode)

    def size(path: Path) -> int:
        try:
            return checked(path, os.lstat(path))
        except OSError:
            return -1

    sizer: Callable[[int], int] = lambda tid: size(file_of(tid))  # noqa: E731
    if directory is not None:
        try:
            with os.scandir(directory) as it:
                listing = {entry.name: entry for entry in it}
        except OSError:
            listing = {}
        if not any(name.endswith((".pt", ".pkl")) for name in listing):  # no trajectory file here at all
            if progress is not None:
                progress(index.size)
            return np.full(index.size, -1, dtype=np.int64)

        def listed_size(tid: int) -> int:
            entry = listing.get(index.file_name(tid))
            if entry is None:
                return -1
            try:
                return checked(Path(entry.path), entry.stat(follow_symlinks=False))
            except OSError:
                return -1

        sizer = listed_size
    ids = index.id_list
    if progress is None:
        return np.fromiter(map(sizer, ids), dtype=np.int64, count=len(ids))
    parts = []
    for start in range(0, len(ids), SIZES_STEP):
        block = ids[start : start + SIZES_STEP]
        parts.append(np.fromiter(map(sizer, block), dtype=np.int64, count=len(block)))
        progress(len(block))
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def index_report(
    header: IndexHeader, table: IndexTable, window: int, sizes: np.ndarray | None, as_json: bool = True
) -> tuple[dict[str, Any], np.ndarray]:
    """The index, files, window and per-trajectory parts of the stats document, and the window mask.

    `sizes` (from `file_sizes`) is None when files were not looked at (index only): the
    window is then taken over the whole index and file sizes come from the index where it
    records them; otherwise the window is taken over the trajectories whose files exist,
    as a non-strict load keeps them.
    """
    n = len(table)
    exists = None if sizes is None else sizes >= 0
    present = np.ones(n, dtype=bool) if exists is None else exists
    in_window = window_mask(present, window)
    window_samples = int(table.num_samples[in_window].sum())
    probability = (
        np.where(in_window, table.num_samples / window_samples, 0.0) if window_samples else np.zeros(n)
    )
    window_ids = table.ids[in_window]
    fmt = header.trajectory_format
    files: dict[str, Any] = {
        "checked": exists is not None,
        "present": None,
        "missing": None,
        "missing_ids": None,
        "not_files": None,
    }
    if exists is None or sizes is None:
        file_bytes = table.file_bytes
    else:
        missing_ids = table.ids[sizes == -1]
        odd = np.flatnonzero(sizes < -1)
        files.update(
            present=int(exists.sum()),
            missing=int(missing_ids.size),
            missing_ids=missing_ids.tolist(),
            not_files=[
                {"trajectory_id": int(table.ids[pos]), "is": NOT_A_FILE[int(sizes[pos])]} for pos in odd
            ],
        )
        file_bytes = sizes
    known = file_bytes >= 0
    files["bytes"] = int(file_bytes[known].sum()) if known.any() else None
    files["bytes_known_for"] = int(known.sum())
    in_window_probs = probability[in_window]

    def column(values: np.ndarray) -> Any:
        # The human view reads a few rows: it keeps numpy columns instead of a million-item list.
        return values.tolist() if as_json else values

    return {
        "index": {
            "trajectory_format": fmt,
            "seed": header.seed,
            "size": n,
            "total_samples": int(table.num_samples.sum()),
            "trajectory_counter": header.trajectory_counter,
            "id_min": int(table.ids.min()) if n else None,
            "id_max": int(table.ids.max()) if n else None,
            "model_weights_ids": len(set(table.model_weights_id)),
        },
        "files": files,
        "window": {
            "requested": window,
            "trajectories": int(in_window.sum()),
            "samples": window_samples,
            "first_id": int(window_ids[0]) if window_ids.size else None,
            "last_id": int(window_ids[-1]) if window_ids.size else None,
            "probability_min": float(in_window_probs.min()) if in_window_probs.size else None,
            "probability_max": float(in_window_probs.max()) if in_window_probs.size else None,
        },
        "trajectories": {
            "id": column(table.ids),
            "T": column(table.t),
            "B": column(table.b),
            "num_samples": column(table.num_samples),
            "model_weights_id": table.model_weights_id,
            "file": list(map(trajectory_file_name, table.ids.tolist(), table.model_weights_id, repeat(fmt)))
            if as_json
            else LazyColumn(
                n, lambda pos: trajectory_file_name(int(table.ids[pos]), table.model_weights_id[pos], fmt)
            ),
            "file_bytes": column(np.where(known, file_bytes, -1)),
            "exists": None if exists is None else column(exists),
            "in_window": column(in_window),
            "draw_probability": column(probability),
        },
        "model_weights": weights_groups(table, in_window),
    }, in_window
