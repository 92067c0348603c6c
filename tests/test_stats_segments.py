"""Statistics read in segments: small `.pt` files of one structure reduced together give, bit
for bit, what read_trajectory gives file by file, and every error is the one the file alone gives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import make_traj

import rbtool.ops.stats.segments as stats_data
from rbtool.errors import RbtoolError
from rbtool.files import trajfile
from rbtool.ops.stats.segments import Segment, SegmentData, _Parts, cut_segments, read_segment

WEIGHTS_ID = "87a64d8e-0f54-5c7c-a19d-0b3753cad97c"


def one_by_one(segment: Segment) -> SegmentData:
    parts = _Parts()
    for path, shape in zip(segment.paths, segment.shapes, strict=True):
        parts.one(path, stats_data.read_trajectory(path, *shape))
    return parts.done()


def assert_same(got: SegmentData, expected: SegmentData) -> None:
    assert got.fields == expected.fields
    assert got.reward_counts == expected.reward_counts
    np.testing.assert_array_equal(got.rewards, expected.rewards)
    np.testing.assert_array_equal(got.versions, expected.versions)
    assert (got.episode_files, got.version_files) == (expected.episode_files, expected.version_files)
    assert (got.bytes_read, got.pkl_bytes) == (expected.bytes_read, expected.pkl_bytes)
    if expected.episodes is None:
        assert got.episodes is None
        return
    assert got.episodes is not None
    for name in ("lengths", "returns", "partial_start", "ended_by"):
        np.testing.assert_array_equal(getattr(got.episodes, name), getattr(expected.episodes, name))
    assert got.episodes.open == expected.episodes.open


def write(directory: Path, tid: int, traj: dict[str, Any], fmt: str = "pt") -> Path:
    path = directory / f"trajectory_{tid}_{WEIGHTS_ID}.{fmt}"
    if fmt == "pt":
        torch.save(traj, path)
    else:
        path.write_bytes(trajfile.to_bytes(traj, fmt))
    return path


def varied(seed: int, t: int = 4, b: int = 3) -> dict[str, Any]:
    """Bootstrap rows, rewards over a trailing dim of 3 (summed), a NaN, versions over 2."""
    g = torch.Generator().manual_seed(seed)
    traj = make_traj(t=t, b=b, seed=seed, extra_rows=2)
    traj["rewards"] = torch.randn(t, b, 3, generator=g)
    if seed % 4 == 1:
        traj["rewards"][1, 0, 2] = float("nan")
    traj["versions"] = torch.randint(0, 5, (t, b, 2), generator=g).float()
    return traj


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The files read_trajectory reads alone."""
    alone: list[Path] = []
    real = stats_data.read_trajectory

    def read(path: Path, t: int, b: int) -> Any:
        alone.append(path)
        return real(path, t, b)

    monkeypatch.setattr(stats_data, "read_trajectory", read)
    return alone


def test_files_of_one_structure_are_reduced_together_to_the_same_numbers(
    tmp_path: Path, counting: list[Path]
) -> None:
    paths = [write(tmp_path, tid, varied(tid)) for tid in range(10, 40)]
    segment = Segment(paths, [(4, 3)] * len(paths))
    got = read_segment(segment)
    assert counting == []  # nothing read alone: the files went together
    expected = one_by_one(segment)
    assert_same(got, expected)
    assert len(got.fields) == 1 and got.fields[0][1] == 30
    assert got.episodes is not None and got.episodes.lengths.size > 0
    assert np.isnan(got.rewards).sum() == np.isnan(expected.rewards).sum() > 0


def test_a_mixed_segment_reads_the_odd_files_alone(tmp_path: Path, counting: list[Path]) -> None:
    paths = [write(tmp_path, tid, varied(tid)) for tid in range(10, 20)]
    paths.insert(3, write(tmp_path, 90, varied(90), fmt="pkl"))
    paths.insert(6, write(tmp_path, 91, varied(91, t=6)))  # another size: a run of its own
    no_dones = {k: v for k, v in varied(92).items() if k not in ("dones", "terminations", "truncations")}
    paths.append(write(tmp_path, 92, no_dones))
    shapes = [(6, 3) if "_91_" in p.name else (4, 3) for p in paths]
    segment = Segment(paths, shapes)
    got = read_segment(segment)
    assert counting == [paths[3]]  # only the pickle
    counting.clear()
    assert_same(got, one_by_one(segment))
    assert got.episode_files == len(paths) - 1


@pytest.mark.parametrize("damage", ["truncated", "shape"])
def test_a_damaged_file_gives_the_error_it_gives_alone(tmp_path: Path, damage: str) -> None:
    paths = [write(tmp_path, tid, varied(tid)) for tid in range(10, 20)]
    shapes = [(4, 3)] * len(paths)
    if damage == "truncated":
        paths[5].write_bytes(paths[5].read_bytes()[:-40])
    else:
        shapes[5] = (2, 3)  # the index says another [T, B]
    with pytest.raises(RbtoolError) as alone:
        stats_data.read_trajectory(paths[5], *shapes[5])
    with pytest.raises(RbtoolError) as together:
        read_segment(Segment(paths, shapes))
    assert str(together.value) == str(alone.value)
    assert type(together.value) is type(alone.value)


def test_segments_are_consecutive_and_bounded() -> None:
    paths = [Path(f"t{k}.pt") for k in range(100)]
    shapes = [(1, 1)] * 100
    parts = cut_segments(paths, shapes, [10] * 100, 8, single=False)
    assert [p for s in parts for p in s.paths] == paths and len(parts) >= 8
    assert max(len(s.paths) for s in parts) == 13
    assert all(len(s.paths) == 1 for s in cut_segments(paths, shapes, None, 8, single=True))
    heavy = cut_segments(paths, shapes, [9 << 20] * 100, 1, single=False)
    assert all(len(s.paths) == 1 for s in heavy)  # 16 MiB a segment at most (one heavier file alone)
