"""rbtool.dirs: which checkpoints a path holds, and opening one strictly or not."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import FIXTURES

from rbtool.dirs import checkpoint_dirs, missing_files, open_checkpoint, rank_dirs, rank_number
from rbtool.errors import CheckpointError, MissingTrajectoryFilesError

NOSAVE = FIXTURES / "nosave_window2_pt" / "ckpt"


def test_rank_numbers() -> None:
    names = ("rank_0", "rank_12", "rank_", "rank_x", "rank_-1", "rank_\uff11")  # the last: a full-width 1
    assert [rank_number(n) for n in names] == [0, 12, None, None, None, None]


def test_rank_directories_are_in_numeric_order(tmp_path: Path) -> None:
    for r in (10, 2, 0, 1):
        shutil.copytree(FIXTURES / "ranks" / "rank_0", tmp_path / f"rank_{r}")
    (tmp_path / "rank_notes").mkdir()
    (tmp_path / "rank_3").write_text("a file, not a rank")
    assert [p.name for p in rank_dirs(tmp_path)] == ["rank_0", "rank_1", "rank_2", "rank_10"]
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["rank_0", "rank_1", "rank_2", "rank_10"]


def test_a_checkpoint_is_itself() -> None:
    assert checkpoint_dirs(FIXTURES / "ranks" / "rank_1") == [FIXTURES / "ranks" / "rank_1"]


@pytest.mark.parametrize(
    ("make", "words"),
    [("missing", "no such file"), ("file", "not a directory"), ("empty", "neither a checkpoint")],
)
def test_paths_that_hold_no_checkpoint(tmp_path: Path, make: str, words: str) -> None:
    path = tmp_path / make
    if make == "file":
        path.write_text("x")
    elif make == "empty":
        path.mkdir()
    with pytest.raises(CheckpointError, match=words):
        checkpoint_dirs(path)


def test_strict_open_lists_the_missing_ids() -> None:
    with pytest.raises(MissingTrajectoryFilesError, match=r"ids 0, 1, 2\)$") as caught:
        open_checkpoint(NOSAVE)
    assert caught.value.missing_ids == [0, 1, 2]
    assert "--" not in str(caught.value)  # the command line adds its own option


def test_non_strict_open_keeps_what_exists() -> None:
    directory, index = open_checkpoint(NOSAVE, strict=False)
    assert directory == NOSAVE and index.id_list == [3, 4] and index.size == 2 and index.total_samples == 16
    assert index.trajectory_counter == 5
    assert missing_files(NOSAVE, index) == []
