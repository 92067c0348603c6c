"""The data part of the statistics: rewards, episodes and versions read from the trajectory files.

Each trajectory file is opened memory-mapped and only the fields the statistics need are
touched (rewards, done-like fields, versions), never the observations; the bytes touched are
counted. The files are read on worker processes, over torchrun ranks, resumable from a journal.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rbtool.errors import TrajectoryFileError
from rbtool.files.index import Index
from rbtool.ops.stats.episodes import EpisodeTally, episodes_report, find_episodes
from rbtool.ops.stats.index import IndexTable
from rbtool.ops.stats.schema import FieldRow, schema_report
from rbtool.ops.stats.summary import summarize, value_counts
from rbtool.passes.journal import Journal
from rbtool.passes.pool import Throughput, Timer
from rbtool.passes.ranks import ranked_pass, total_jobs
from rbtool.progress import Progress

if TYPE_CHECKING:
    import torch


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
            int(v.shape[0]) - t if (layout.is_done_like(p) and v.dim() >= 2) else 0,
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
    dones = layout.episode_ends(dones, terms, truncs)
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
        preload=("torch", "rbtool.ops.stats.data"),
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
    data["doctor_hints"] = doctor_hints(data, int(v.size - finite.size) if versions else 0)
    window_ids = set(table.ids[in_window].tolist())
    return schema_report(per_fields, window_ids), data, scores


def doctor_hints(data: dict[str, Any], nonfinite_versions: int) -> list[str]:
    """What in the quick statistics hints at trouble in the data, one phrase each: the cue to
    run `rbtool doctor`, which finds the trajectories, fields and steps."""
    hints = []
    rewards = data.get("rewards")
    if rewards is not None and rewards["nonfinite"]:
        hints.append(f"{rewards['nonfinite']} NaN/Inf reward(s)")
    if nonfinite_versions:
        hints.append(f"{nonfinite_versions} NaN/Inf version(s)")
    return hints
