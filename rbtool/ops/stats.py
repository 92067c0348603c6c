"""Statistics of a checkpoint or buffer directory: index, schema, data, and how draws spread.

The index part reads only the two JSON files, works column-wise with numpy and never
imports torch. The data part opens each trajectory file memory-mapped and touches only
the fields it needs (rewards, done-like fields, versions), never the observations, and
counts the bytes it touched. Everything is returned as one JSON-ready dict.
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter, itemgetter, methodcaller
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast, overload

import numpy as np

from rbtool.errors import (
    CheckpointError,
    NeedsTrajectoryFilesError,
    RbtoolError,
    TrajectoryFileError,
    UsageError,
)
from rbtool.files.dirs import checkpoint_dirs, open_view
from rbtool.files.index import Index, read_index, window_start
from rbtool.format import IndexCheck, check_json, escapes, not_a_file, trajectory_file_name
from rbtool.passes.journal import Journal, open_journal
from rbtool.passes.pool import Throughput, Timer, check_jobs
from rbtool.passes.ranks import ranked_pass, total_jobs
from rbtool.progress import Progress

if TYPE_CHECKING:
    import torch

DEFAULT_BINS = 16
DEFAULT_SEED = 1234  # the buffer's default seed, used when the checkpoint records none
# Concentration rule: more than this share of the draws ...
CONCENTRATION_DRAW_SHARE = 0.5
# ... landing on fewer than this share of the window's samples.
CONCENTRATION_SAMPLE_SHARE = 0.05
# Episode end causes, as codes in EpisodeTally.ended_by.
TERMINATED, TRUNCATED, OTHER = 0, 1, 2

SIZES_STEP = 4096  # file sizes are reported to a progress callback this many at a time


def start_phase(progress: Progress | None, total: int, description: str) -> None:
    """Tell a progress callback that has a `start(total, description)` method that a counted phase begins."""
    start = getattr(progress, "start", None)
    if start is not None:
        start(total, description)


# ------------------------------------------------------------------ summaries
def _is_integral(values: np.ndarray) -> bool:
    return bool(values.size) and bool(np.all(values == np.round(values)))


def summarize(values: np.ndarray, bins: int = DEFAULT_BINS) -> dict[str, Any]:
    """count, mean, std (population), min, max and a histogram of the finite values.

    Integer-valued data whose range fits in `bins` gets one bin per integer, so an episode
    length histogram reads length by length. Non-finite values are only counted.
    """
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    finite = values[np.isfinite(values)]
    doc: dict[str, Any] = {
        "count": int(finite.size),
        "nonfinite": int(values.size - finite.size),
        "mean": None,
        "std": None,
        "min": None,
        "max": None,
        "histogram": {"edges": [], "counts": []},
    }
    if finite.size == 0:
        return doc
    lo, hi = float(finite.min()), float(finite.max())
    if _is_integral(finite) and hi - lo + 1 <= bins:
        edges = np.arange(lo - 0.5, hi + 1.0, 1.0)
        counts, edges = np.histogram(finite, bins=edges)
    else:
        counts, edges = np.histogram(finite, bins=bins)
    doc.update(
        mean=float(finite.mean()),
        std=float(finite.std()),
        min=lo,
        max=hi,
        histogram={"edges": edges.tolist(), "counts": counts.tolist()},
    )
    return doc


def value_counts(values: np.ndarray, key: str) -> list[dict[str, Any]]:
    """[{key: value, "samples": n}, ...] in ascending order of value."""
    uniq, counts = np.unique(np.asarray(values), return_counts=True)
    return [{key: float(v), "samples": int(c)} for v, c in zip(uniq.tolist(), counts.tolist(), strict=True)]


# ------------------------------------------------------------------ the index
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


# ------------------------------------------------------------------ episodes
@dataclass
class EpisodeTally:
    """Episodes found in [T, B] done masks, one entry per finished episode."""

    lengths: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    returns: np.ndarray = field(default_factory=lambda: np.empty(0, np.float64))  # NaN without rewards
    partial_start: np.ndarray = field(default_factory=lambda: np.empty(0, bool))
    ended_by: np.ndarray = field(default_factory=lambda: np.empty(0, np.int8))
    open: int = 0

    @staticmethod
    def combine(parts: Sequence[EpisodeTally]) -> EpisodeTally:
        if not parts:
            return EpisodeTally()
        return EpisodeTally(
            lengths=np.concatenate([p.lengths for p in parts]),
            returns=np.concatenate([p.returns for p in parts]),
            partial_start=np.concatenate([p.partial_start for p in parts]),
            ended_by=np.concatenate([p.ended_by for p in parts]),
            open=sum(p.open for p in parts),
        )


def find_episodes(
    done: np.ndarray,
    rewards: np.ndarray | None = None,
    terminated: np.ndarray | None = None,
    truncated: np.ndarray | None = None,
) -> EpisodeTally:
    """Episodes per environment column b of `[T, B]` masks whose bootstrap rows are already dropped.

    A row with done set ends an episode at that step; the episode spans the steps since the
    previous done of its column (or since row 0: then it may have begun in an earlier
    trajectory, flagged in `partial_start`). Steps after a column's last done form an open
    episode, counted in `open` and not among the finished ones. Its return is the sum of the
    rewards over its steps. An end counts as terminated when `terminated` is set there, else
    truncated when `truncated` is set, else other.
    """
    done = np.asarray(done, dtype=bool)
    t, b = done.shape
    cols, steps = np.nonzero(done.T)  # ordered by column, then step
    same_col = np.zeros(steps.size, dtype=bool)
    same_col[1:] = cols[1:] == cols[:-1]
    prev = np.full(steps.size, -1, dtype=np.int64)
    prev[1:][same_col[1:]] = steps[:-1][same_col[1:]]
    lengths = steps - prev
    if rewards is None:
        returns = np.full(steps.size, np.nan)
    else:
        csum = np.cumsum(np.asarray(rewards, dtype=np.float64).T, axis=1)  # [B, T]
        before = np.where(prev >= 0, csum[cols, np.maximum(prev, 0)], 0.0)
        returns = csum[cols, steps] - before
    ended_by = np.full(steps.size, OTHER, dtype=np.int8)
    if truncated is not None:
        ended_by[np.asarray(truncated, dtype=bool)[steps, cols]] = TRUNCATED
    if terminated is not None:
        ended_by[np.asarray(terminated, dtype=bool)[steps, cols]] = TERMINATED
    last_done = np.full(b, -1, dtype=np.int64)
    np.maximum.at(last_done, cols, steps)
    open_count = int(np.count_nonzero(last_done < t - 1)) if t else 0
    return EpisodeTally(lengths, returns, prev == -1, ended_by, open_count)


def episodes_report(tally: EpisodeTally, trajectories: int, bins: int) -> dict[str, Any]:
    """Counts by end cause, open episodes, and length and return distributions."""
    return {
        "trajectories": trajectories,
        "finished": int(tally.lengths.size),
        "terminated": int(np.count_nonzero(tally.ended_by == TERMINATED)),
        "truncated": int(np.count_nonzero(tally.ended_by == TRUNCATED)),
        "other": int(np.count_nonzero(tally.ended_by == OTHER)),
        "partial_start": int(np.count_nonzero(tally.partial_start)),
        "open": tally.open,
        "length": summarize(tally.lengths, bins),
        "return": summarize(tally.returns, bins),
    }


# ------------------------------------------------------------------ reading data
@dataclass
class FieldRow:
    """One tensor of one trajectory, from its metadata (no data read)."""

    path: str
    dtype: str
    per_sample_shape: tuple[int, ...] | None  # None for tensors with fewer than 2 dims
    extra_rows: int
    nbytes: int


@dataclass
class TrajectoryData:
    """What the statistics need from one trajectory file."""

    fields: list[FieldRow]
    rewards: np.ndarray | None  # [T, B] per-sample reward, summed over trailing dims
    episodes: EpisodeTally | None  # None without any done-like field
    versions: np.ndarray | None  # [T * B] per-sample version (max over trailing dims)
    bytes_read: int


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _leading(tensor: torch.Tensor, *lead: int) -> torch.Tensor:
    """`tensor` reshaped to `[*lead, rest]`, the trailing dims flattened into one."""
    return tensor.reshape(*lead, math.prod(int(d) for d in tensor.shape) // max(1, math.prod(lead)))


def read_trajectory(path: Path, t: int, b: int) -> TrajectoryData:
    """Read one trajectory's rewards, done-like fields and versions; the rest stays unread.

    `.pt` files are memory-mapped, so only the touched tensors are paged in and counted;
    a `.pkl` file has to be unpickled whole and counts as its file size.
    """
    import torch

    from rbtool.files import trajfile
    from rbtool.format import layout

    traj = trajfile.load(path, mmap=True)
    info = layout.describe(traj, str(path))
    if info.shape[:2] != (t, b):
        raise TrajectoryFileError(
            f"{path}: tensors are [T, B] = {list(info.shape[:2])} but the index says {[t, b]}"
        )
    fields = [
        FieldRow(
            ".".join(p),
            _dtype_name(v),
            tuple(int(d) for d in v.shape[2:]) if v.dim() >= 2 else None,
            int(v.shape[0]) - t if (len(p) == 1 and p[0] in layout.DONE_LIKE and v.dim() >= 2) else 0,
            v.numel() * v.element_size(),
        )
        for p, v in layout.iter_tensors(traj)
    ]
    touched = 0

    def take(name: str) -> torch.Tensor | None:
        nonlocal touched
        value = traj.get(name)
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            return None
        touched += value.numel() * value.element_size()
        return value

    def per_step(name: str) -> np.ndarray | None:
        """A done-like field as a [T, B] bool mask: bootstrap rows dropped, any over trailing dims."""
        value = take(name)
        if value is None:
            return None
        try:
            layout.done_extra_rows(int(value.shape[0]), t, int(value.shape[1]), b)
        except ValueError as exc:
            raise TrajectoryFileError(f"{path}: field {name!r}: {exc}") from None
        mask = _leading(value != 0, int(value.shape[0]), b).any(dim=2).numpy()
        return layout.drop_bootstrap_rows(mask, t)

    raw_rewards = take("rewards")
    rewards = None
    if raw_rewards is not None:
        rewards = _leading(raw_rewards, t, b).to(torch.float64).sum(dim=2).numpy()
    dones, terms, truncs = per_step("dones"), per_step("terminations"), per_step("truncations")
    if dones is None and (terms is not None or truncs is not None):
        dones = np.logical_or(terms if terms is not None else False, truncs if truncs is not None else False)
    episodes = None if dones is None else find_episodes(dones, rewards, terms, truncs)
    raw_versions = take("versions")
    versions = None
    if raw_versions is not None:
        versions = _leading(raw_versions, t * b).to(torch.float64).amax(dim=1).numpy()
    if path.suffix == ".pkl":
        touched = path.stat().st_size
    return TrajectoryData(fields, rewards, episodes, versions, touched)


def _read_task(task: tuple[Path, int, int]) -> TrajectoryData:
    """read_trajectory on a worker process."""
    return read_trajectory(*task)


def schema_report(
    per_trajectory: list[tuple[int, list[FieldRow]]], window_ids: set[int]
) -> list[dict[str, Any]]:
    """One row per (field, dtype, per-sample shape), in order of first appearance.

    `sampled` says whether the field reaches a batch: every window trajectory carries it
    with this dtype and per-sample shape, and it has at least 2 dims.
    """
    rows: dict[tuple[str, str, tuple[int, ...] | None], dict[str, Any]] = {}
    window_count = 0
    for tid, fields in per_trajectory:
        in_window = tid in window_ids
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
            row["trajectories"] += 1
            row["window_trajectories"] += in_window
            row["bytes"] += f.nbytes
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


def data_report(
    file_of: Callable[[int], Path],
    index: Index,
    table: IndexTable,
    exists: np.ndarray,
    in_window: np.ndarray,
    bins: int,
    progress: Progress | None = None,
    jobs: int | None = 1,
    sizes: np.ndarray | None = None,
    journal: Journal | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[int, np.ndarray]]:
    """Schema and data statistics over every trajectory whose file exists.

    Files are read on `jobs` worker processes (rbtool.passes.pool), the largest first when
    `sizes` (from `file_sizes`) are given, shared among the ranks under torchrun and recorded
    in `journal` if given (rbtool.passes.ranks); the numbers are those of a single process.
    Returns (schema rows, data section, per-sample reward scores by id for the draw spread).
    """
    per_fields: list[tuple[int, list[FieldRow]]] = []
    rewards: list[np.ndarray] = []
    scores: dict[int, np.ndarray] = {}
    tallies: list[EpisodeTally] = []
    versions: list[np.ndarray] = []
    bytes_read = 0
    pkl_bytes = 0
    positions = np.flatnonzero(exists).tolist()
    ids = [int(table.ids[pos]) for pos in positions]
    tasks = [
        (file_of(tid), int(table.t[pos]), int(table.b[pos])) for tid, pos in zip(ids, positions, strict=True)
    ]
    recorded_hashes: dict[Path, str] = {}  # what a journaled result is bound to, besides the identity
    if journal is not None:
        for tid, (path, _, _) in zip(ids, tasks, strict=True):
            digest = index.entries[tid].get("sha256")
            if isinstance(digest, str):
                recorded_hashes[path] = digest
    timer = Timer()
    results = ranked_pass(
        _read_task,
        tasks,
        jobs=jobs,
        weights=None if sizes is None else [int(sizes[pos]) for pos in positions],
        progress=progress,
        preload=("torch", "rbtool.ops.stats"),
        describe=lambda task: str(task[0]),
        journal=journal,
        files=lambda task: (task[0],),
        types=(TrajectoryData, FieldRow, EpisodeTally),
        hashes=lambda task: (recorded_hashes.get(task[0]),),
    )
    seconds = timer.elapsed()
    for tid, (path, _, _), got in zip(ids, tasks, results, strict=True):
        per_fields.append((tid, got.fields))
        bytes_read += got.bytes_read
        if path.suffix == ".pkl":
            pkl_bytes += got.bytes_read
        if got.rewards is not None:
            rewards.append(got.rewards.reshape(-1))
            scores[tid] = got.rewards.reshape(-1)
        if got.episodes is not None:
            tallies.append(got.episodes)
        if got.versions is not None:
            versions.append(got.versions)
    all_rewards = np.concatenate(rewards) if rewards else np.empty(0)
    version_doc: dict[str, Any] | None = None
    if versions:
        v = np.concatenate(versions)
        finite = v[np.isfinite(v)]
        newest = float(finite.max()) if finite.size else math.nan
        staleness = newest - finite
        version_doc = {
            "trajectories": len(versions),
            "samples": int(v.size),
            "newest": newest if finite.size else None,
            "values": value_counts(finite, "version"),
            "staleness": value_counts(staleness, "staleness"),
            "staleness_summary": summarize(staleness, bins),
        }
    data = {
        "trajectories_read": len(per_fields),
        **Throughput(total_jobs(jobs), bytes_read, seconds).as_json(),
        "pkl_bytes_read": pkl_bytes,
        "rewards": {"trajectories": len(rewards), **summarize(all_rewards, bins)} if rewards else None,
        "episodes": episodes_report(EpisodeTally.combine(tallies), len(tallies), bins) if tallies else None,
        "versions": version_doc,
    }
    window_ids = set(table.ids[in_window].tolist())
    return schema_report(per_fields, window_ids), data, scores


# ------------------------------------------------------------------ draw spread
@dataclass(frozen=True)
class DrawRequest:
    """Simulate `n` draws from the window with a strategy, as `rbtool sample` would make them."""

    n: int
    strategy: str = "uniform"
    k: int | None = None
    temperature: float = 1.0
    seed: int | None = None  # None: the checkpoint's seed, else DEFAULT_SEED


def _fewest_holding_half(amounts: np.ndarray, total: float) -> int:
    """The fewest items that together hold more than half of `total` (largest first)."""
    if total <= 0 or amounts.size == 0:
        return 0
    cum = np.cumsum(np.sort(amounts)[::-1])
    return int(np.searchsorted(cum, CONCENTRATION_DRAW_SHARE * total, side="right")) + 1


def draws_report(
    window_ids: Sequence[int],
    num_samples: Sequence[int],
    request: DrawRequest,
    seed: int,
    scores: dict[int, np.ndarray] | None = None,
) -> dict[str, Any]:
    """Observed against expected draws per window trajectory, total variation, concentration flag.

    The draws are the samplers' own (rbtool.buffer.sampling, rbtool.buffer.topk), unclamped: the same seed
    gives the same draws as a fresh buffer's first `sample(n)` (before n is clamped to the
    window's samples).
    """
    import torch

    from rbtool.buffer.sampling import draw_uniform
    from rbtool.buffer.topk import RewardIndex, check_strategy, draw_topk, softmax_weights

    check_strategy(request.strategy, request.k, request.temperature)
    if request.n < 1:
        raise UsageError(f"the number of draws must be >= 1, got {request.n}")
    sizes = np.asarray(num_samples, dtype=np.int64)
    total = int(sizes.sum())
    if total == 0:
        raise RbtoolError("the window holds no samples to draw from")
    generator = torch.Generator().manual_seed(seed)
    expected: np.ndarray  # each window trajectory's expected share of the draws
    if request.strategy == "uniform":
        draw = draw_uniform(window_ids, sizes.tolist(), request.n, generator, clamp=False)
        sample_probability = None
        expected = sizes / total
        candidates = total
    else:
        assert request.k is not None
        index = RewardIndex()
        index.add((tid, scores[tid]) for tid in window_ids if scores is not None and tid in scores)
        ranked = index.top_k(request.k, [tid for tid in window_ids if tid in index])
        draw = draw_topk(
            window_ids, sizes.tolist(), ranked, request.n, request.temperature, generator, clamp=False
        )
        # the expected shares, from the same weights the draw used
        sample_probability = softmax_weights(ranked.scores, request.temperature)
        window = np.asarray(window_ids, dtype=np.int64)
        by_id = np.argsort(window, kind="stable")
        cand_pos = by_id[np.searchsorted(window[by_id], ranked.trajectory_ids)]
        expected = np.bincount(cand_pos, weights=sample_probability, minlength=sizes.size)
        candidates = len(ranked)
    global_ids = draw.global_indices.numpy()
    positions = draw.positions.numpy()
    draws = np.bincount(positions, minlength=sizes.size)
    observed = draws / request.n
    per_sample = np.unique(global_ids, return_counts=True)[1]
    threshold = CONCENTRATION_SAMPLE_SHARE * total
    held_obs = _fewest_holding_half(per_sample.astype(np.float64), float(request.n))
    # Uniform: every sample is equally likely, so just over half of them hold half the mass.
    uniform_held = total // 2 + 1
    held_exp = uniform_held if sample_probability is None else _fewest_holding_half(sample_probability, 1.0)
    concentrated = held_exp < threshold or (request.n >= total and held_obs < threshold)
    return {
        "strategy": request.strategy,
        "n": request.n,
        "seed": seed,
        "k": request.k,
        "temperature": request.temperature if request.strategy == "topk" else None,
        "window_samples": total,
        "candidates": candidates,
        "distinct_samples_drawn": int(per_sample.size),
        "trajectories": {
            "id": list(window_ids),
            "draws": draws.tolist(),
            "observed": observed.tolist(),
            "expected": expected.tolist(),
        },
        "total_variation": float(0.5 * np.abs(observed - expected).sum()),
        "concentration": {
            "threshold_samples": threshold,
            "samples_holding_half_of_draws": held_obs,
            "samples_holding_half_of_probability": held_exp,
            "concentrated": bool(concentrated),
        },
    }


# ------------------------------------------------------------------ everything
def collect_stats(
    path: str | Path,
    *,
    window: int = 0,
    index_only: bool = False,
    bins: int = DEFAULT_BINS,
    draws: DrawRequest | None = None,
    progress: Progress | None = None,
    as_json: bool = True,
    read_data: bool = True,
    jobs: int | None = None,
    journal: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """The whole stats document of a checkpoint or buffer directory.

    `as_json=False` gives the per-trajectory columns as numpy arrays and file names as a
    LazyColumn: a view that shows a few rows need not build a million-item list per column.
    `read_data=False` looks at file sizes but opens no trajectory file (`schema` and `data`
    stay None), for a listing of the trajectories alone.

    Missing trajectory files are reported, not refused. With `index_only`, only the JSON
    files are read (no torch import unless draws are asked for), and top-k draws, which
    need rewards, are refused. The data part reads files on `jobs` worker processes
    (default: the cores this process may use), shared among the ranks under torchrun; with
    `journal` (a directory) each file read is recorded there and a rerun takes the recorded
    results of unchanged files (rbtool.passes.ranks).
    """
    if jobs is not None:
        check_jobs(jobs)
    if bins < 1:
        raise UsageError(f"bins must be >= 1, got {bins}")
    if draws is not None and index_only and draws.strategy == "topk":
        raise NeedsTrajectoryFilesError("top-k draws need rewards from the trajectory files")
    directory = Path(path)
    index: Index | None = None
    sizes: np.ndarray | None = None
    dirs = checkpoint_dirs(directory)
    # a rank tree reads as the merge of its ranks (SPEC §4), each file from its own rank
    view = open_view(directory, check_files=False) if dirs != [directory] else None
    if index_only and view is None:
        header, table = read_table(directory)
    else:
        index = read_index(directory) if view is None else view.index
        header, table = IndexHeader.of(index), index_table(index)
    file_of: Callable[[int], Path] = (
        view.file_of if view is not None else (lambda tid: directory / cast(Index, index).file_name(tid))
    )
    if not index_only:
        assert index is not None
        start_phase(progress, index.size, "looking at trajectory files")
        sizes = file_sizes(file_of, index, progress, directory if view is None else None)
    doc: dict[str, Any] = {
        "path": str(directory),
        "rank_dirs": [str(d) for d in dirs] if view is not None else [],
        "renumbered": view is not None and view.renumbered,
        "index_only": index_only,
    }
    report, in_window = index_report(header, table, window, sizes, as_json)
    if view is not None:  # a rank tree's files live in its rank directories
        ids, file_of_id = view.index.id_list, view.file_of
        if as_json:
            report["trajectories"]["file"] = [str(file_of_id(i).relative_to(directory)) for i in ids]
        else:
            report["trajectories"]["file"] = LazyColumn(
                len(ids), lambda pos: str(file_of_id(ids[pos]).relative_to(directory))
            )
    doc.update(report)
    doc["schema"] = doc["data"] = doc["journal"] = None
    scores: dict[int, np.ndarray] | None = None
    if index is not None and sizes is not None and read_data:
        opened = open_journal(journal, {"command": "stats", "input": str(directory.absolute())})
        exists = sizes >= 0
        start_phase(progress, int(exists.sum()), "reading trajectories")
        doc["schema"], doc["data"], scores = data_report(
            file_of,
            index,
            table,
            exists,
            in_window,
            bins,
            progress,
            jobs,
            sizes,
            opened,
        )
        doc["journal"] = None if opened is None else opened.counts()
    doc["draws"] = None
    if draws is not None:
        seed = (
            draws.seed
            if draws.seed is not None
            else (header.seed if header.seed is not None else DEFAULT_SEED)
        )
        doc["draws"] = draws_report(
            table.ids[in_window].tolist(), table.num_samples[in_window].tolist(), draws, seed, scores
        )
    return doc
