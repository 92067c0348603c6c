"""rbtool.files.index: the in-memory index, its JSON round trip, and id and rank arithmetic."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
from conftest import FIXTURES
from hypothesis import given
from hypothesis import strategies as st

from rbtool.errors import CheckpointError, UsageError
from rbtool.files.index import (
    Index,
    init_buffer_dir,
    rank_bounds,
    read_index,
    window_of,
    window_start,
    write_index,
)
from rbtool.format import FORMAT_VERSION, LEGACY_INDEX_FILE


def entry(tid: int, t: int = 4, b: int = 2) -> dict[str, object]:
    return {
        "num_samples": t * b,
        "trajectory_id": tid,
        "max_episode_length": t,
        "shape": [t, b, 7],
        "model_weights_id": f"w{tid}",
    }


def index_of(ids: list[int], **kwargs: object) -> Index:
    return Index(
        entries={i: entry(i) for i in ids},
        id_list=list(ids),
        trajectory_counter=max(ids, default=-1) + 1,
        **kwargs,
    )  # type: ignore[arg-type]


@given(st.integers(0, 200), st.integers(1, 20))
def test_rank_blocks_are_contiguous_cover_and_differ_by_at_most_one(n: int, world_size: int) -> None:
    bounds = [rank_bounds(n, world_size, r) for r in range(world_size)]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    sizes = [end - start for start, end in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize(("world_size", "rank"), [(0, 0), (2, 2), (2, -1), (True, 0), (2, 1.0)])
def test_bad_ranks_are_usage_errors(world_size: object, rank: object) -> None:
    with pytest.raises(UsageError):
        rank_bounds(5, world_size, rank)  # type: ignore[arg-type]
    with pytest.raises(ValueError):  # what RLinf's callers catch
        rank_bounds(5, world_size, rank)  # type: ignore[arg-type]


def test_windows() -> None:
    ids = [3, 4, 7, 9]
    assert window_of(ids, 0) == ids and window_of(ids, 9) == ids and window_of(ids, 2) == [7, 9]
    with pytest.raises(UsageError):
        window_of(ids, -1)


def test_the_window_starts_where_its_last_items_begin() -> None:
    assert [window_start(4, w) for w in (0, 1, 3, 4, 9)] == [0, 3, 1, 0, 0]
    assert window_start(0, 0) == window_start(0, 5) == 0
    with pytest.raises(UsageError, match="window size must be >= 0, got -1"):
        window_start(4, -1)
    with pytest.raises(UsageError, match="sample_window_size must be >= 0, got -2"):
        window_start(4, -2, "sample_window_size")


def test_rank_block_counts_and_counter() -> None:
    index = index_of([0, 1, 2, 3, 4], seed=3)
    assert index.rank_block(2, 0).state() == {
        "size": 3,
        "total_samples": 24,
        "trajectory_counter": 3,
        "trajectory_id_list": [0, 1, 2],
    }
    assert index.rank_block(2, 1).trajectory_counter == 5
    assert index.rank_block(7, 6).state()["trajectory_counter"] == 0  # an empty block


def test_write_then_read_keeps_everything(tmp_path: Path) -> None:
    index = index_of([5, 2, 9], seed=77, trajectory_format="pkl", extra_metadata={"note": {"a": [1, 2]}})
    index.entries[2]["uuid"] = "u2"
    index.entries[9]["sha256"] = "ab" * 32
    index.entries[9]["file_bytes"] = 123
    index.trajectory_counter = 12
    write_index(tmp_path, index)
    again = read_index(tmp_path)
    assert again == index
    meta = json.loads((tmp_path / "metadata.json").read_text())
    assert meta == {
        "trajectory_format": "pkl",
        "size": 3,
        "total_samples": 24,
        "trajectory_counter": 12,
        "seed": 77,
        "note": {"a": [1, 2]},
        "format_version": FORMAT_VERSION,
    }


def test_no_seed_means_no_seed_key(tmp_path: Path) -> None:
    write_index(tmp_path, index_of([0], seed=None))
    assert "seed" not in json.loads((tmp_path / "metadata.json").read_text())
    assert read_index(tmp_path).seed is None


def test_the_legacy_index_name_is_read(tmp_path: Path) -> None:
    write_index(tmp_path, index_of([0, 1]))
    (tmp_path / "trajectory_index.json").rename(tmp_path / LEGACY_INDEX_FILE)
    assert read_index(tmp_path).id_list == [0, 1]


def test_read_index_names_the_file_and_the_problem(tmp_path: Path) -> None:
    shutil.copytree(FIXTURES / "autosave_pt" / "autosave", tmp_path / "c")
    (tmp_path / "c" / "metadata.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"c/metadata.json: invalid JSON"):
        read_index(tmp_path / "c")
    with pytest.raises(CheckpointError, match="no such file or directory"):
        read_index(tmp_path / "nope")


def test_init_buffer_dir_creates_a_valid_empty_directory_whole(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    init_buffer_dir(target, Index(seed=5))
    assert read_index(target).state()["size"] == 0 and read_index(target).seed == 5
    assert [p.name for p in target.parent.iterdir()] == ["b"]  # no staging left beside it
    write_index(target, index_of([0]))
    init_buffer_dir(target, Index())  # an existing buffer directory is left as it is
    assert read_index(target).id_list == [0]
