"""The data part of the statistics: rewards, episodes and versions read from the trajectory files.

A trajectory file on its own is opened memory-mapped and only the fields the statistics need
are touched (rewards, done-like fields, versions), never the observations; the bytes touched
are counted. Small `.pt` files of one structure are read and reduced together instead
(rbtool.ops.stats.segments), to the same numbers. The files are read on worker processes, over
torchrun ranks, resumable from a journal.
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
from rbtool.ops.stats.segments import Segment, SegmentData, cut_segments, read_segment
from rbtool.ops.stats.summary import summarize, value_counts
from rbtool.passes.journal import Journal
from rbtool.passes.pool import CHUNKS_PER_WORKER, Throughput, Timer
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

    Files are read in segments of consecutive files (rbtool.ops.stats.segments: small `.pt`
    files of one structure reduced together) on `jobs` worker processes (rbtool.passes.pool),
    shared among the ranks under torchrun and, one file a task, recorded in `journal` if
    given (rbtool.passes.ranks); the numbers are those of a single process reading file by
    file. Returns (schema rows, data section, per-sample reward scores by id for the draw
    spread: the window's trajectories).
    """
    positions = np.flatnonzero(exists)
    ids = table.ids[positions].tolist()
    paths = [file_of(tid) for tid in ids]
    shapes = list(zip(table.t[positions].tolist(), table.b[positions].tolist(), strict=True))
    weights = None if sizes is None else sizes[positions].tolist()
    segments = cut_segments(paths, shapes, weights, total_jobs(jobs) * CHUNKS_PER_WORKER, journal is not None)
    recorded_hashes: dict[Path, str] = {}  # what a journaled result is bound to, besides the identity
    if journal is not None:
        for tid, path in zip(ids, paths, strict=True):
            digest = index.entries[tid].get("sha256")
            if isinstance(digest, str):
                recorded_hashes[path] = digest
    timer = Timer()
    results = ranked_pass(
        read_segment,
        segments,
        jobs=jobs,
        weights=None if weights is None else _segment_weights(segments, weights),
        progress=progress,
        preload=("torch", "rbtool.ops.stats.data", "rbtool.ops.stats.segments"),
        describe=lambda segment: str(segment.paths[0]),
        journal=journal,
        files=lambda segment: tuple(segment.paths),
        types=(SegmentData, FieldRow, EpisodeTally),
        hashes=lambda segment: tuple(recorded_hashes.get(p) for p in segment.paths),
        units=lambda segment: len(segment.paths),
    )
    seconds = timer.elapsed()
    window = in_window[positions]
    schema_runs: list[tuple[list[FieldRow], int, int]] = []
    at = 0
    for got in results:
        for rows, files in got.fields:
            schema_runs.append((rows, files, int(np.count_nonzero(window[at : at + files]))))
            at += files
    counts = np.array([c for got in results for c in got.reward_counts], dtype=np.int64)
    all_rewards = np.concatenate([got.rewards for got in results]) if results else np.empty(0)
    scores: dict[int, np.ndarray] = {}
    ends = np.cumsum(np.maximum(counts, 0))
    for k in np.flatnonzero(window & (counts >= 0)).tolist():
        scores[ids[k]] = all_rewards[ends[k] - counts[k] : ends[k]]
    tallies = [got.episodes for got in results if got.episodes is not None]
    episode_files = sum(got.episode_files for got in results)
    version_files = sum(got.version_files for got in results)
    bytes_read = sum(got.bytes_read for got in results)
    version_doc: dict[str, Any] | None = None
    nonfinite_versions = 0
    if version_files:
        v = np.concatenate([got.versions for got in results])
        finite = v[np.isfinite(v)]
        nonfinite_versions = int(v.size - finite.size)
        newest = float(finite.max()) if finite.size else math.nan
        staleness = newest - finite
        version_doc = {
            "trajectories": version_files,
            "samples": int(v.size),
            "newest": newest if finite.size else None,
            "values": value_counts(finite, "version"),
            "staleness": value_counts(staleness, "staleness"),
            "staleness_summary": summarize(staleness, bins),
        }
    reward_files = int(np.count_nonzero(counts >= 0))
    data = {
        "trajectories_read": len(paths),
        **Throughput(total_jobs(jobs), bytes_read, seconds).as_json(),
        "pkl_bytes_read": sum(got.pkl_bytes for got in results),
        "rewards": {"trajectories": reward_files, **summarize(all_rewards, bins)} if reward_files else None,
        "episodes": (
            episodes_report(EpisodeTally.combine(tallies), episode_files, bins) if episode_files else None
        ),
        "versions": version_doc,
    }
    data["doctor_hints"] = doctor_hints(data, nonfinite_versions)
    return schema_report(schema_runs), data, scores


def _segment_weights(segments: list[Segment], sizes: list[int]) -> list[int]:
    """Each segment's bytes (the pass starts the heaviest first)."""
    out, at = [], 0
    for segment in segments:
        out.append(sum(sizes[at : at + len(segment.paths)]))
        at += len(segment.paths)
    return out


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
