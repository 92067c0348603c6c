"""The data part of the statistics: rewards, episodes and versions read from the trajectory files.

The files are read in segments of consecutive files (rbtool.ops.stats.segments: a file alone
memory-mapped, touching only the fields the statistics need, never the observations; small
`.pt` files of one structure reduced together, to the same numbers) on worker processes, over
torchrun ranks, resumable from a journal.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from rbtool.files.index import Index
from rbtool.ops.stats.episodes import EpisodeTally, episodes_report
from rbtool.ops.stats.index import IndexTable
from rbtool.ops.stats.schema import FieldRow, schema_report
from rbtool.ops.stats.segments import Segment, SegmentData, cut_segments, read_segment
from rbtool.ops.stats.summary import summarize, value_counts
from rbtool.passes.journal import Journal
from rbtool.passes.pool import CHUNKS_PER_WORKER, Throughput, Timer, streaming
from rbtool.passes.ranks import ranked_pass, total_jobs
from rbtool.progress import Progress


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
    shared among the ranks under torchrun; one file a task when recorded in `journal`
    (rbtool.passes.ranks) or fetched through a remote checkpoint's feed. The numbers are those
    of a single process reading file by file. Returns (schema rows, data section, per-sample
    reward scores by id for the draw spread: the window's trajectories).
    """
    positions = np.flatnonzero(exists)
    ids = table.ids[positions].tolist()
    paths = [file_of(tid) for tid in ids]
    shapes = list(zip(table.t[positions].tolist(), table.b[positions].tolist(), strict=True))
    weights = None if sizes is None else sizes[positions].tolist()
    # a journal records files one by one, and a streamed checkpoint's cache holds a few at a time
    single = journal is not None or streaming()
    segments = cut_segments(paths, shapes, weights, total_jobs(jobs) * CHUNKS_PER_WORKER, single)
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
        preload=("torch", "rbtool.ops.stats.segments"),
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
