"""rbtool.files.dirs: which checkpoints a path holds, and opening one strictly or not."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import FIXTURES

from rbtool.errors import CheckpointError, MissingTrajectoryFilesError
from rbtool.files.dirs import checkpoint_dirs, missing_files, open_checkpoint, rank_dirs
from rbtool.format.ranknames import rank_number

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


# ------------------------------------------------------------------ views of rank trees
def test_a_checkpoint_is_its_own_view() -> None:
    from rbtool.files.dirs import open_view

    path = FIXTURES / "ranks" / "rank_1"
    view = open_view(path)
    assert not view.is_tree and not view.renumbered and view.mapping() == []
    assert view.index.id_list == [0, 1, 2, 3]
    assert all(view.file_of(i) == path / view.index.file_name(i) for i in view.index.id_list)


def test_colliding_ranks_are_renumbered_by_old_id_then_rank_order() -> None:
    from rbtool.files.dirs import open_view

    ranks = FIXTURES / "ranks"
    view = open_view(ranks)
    assert view.is_tree and view.renumbered and view.dirs == [ranks / "rank_0", ranks / "rank_1"]
    # rank_0 holds ids 0-2, rank_1 ids 0-3: (0, r0) (0, r1) (1, r0) (1, r1) (2, r0) (2, r1) (3, r1)
    expected = [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (1, 3)]
    assert [view.source_of(i) for i in view.index.id_list] == [
        (ranks / f"rank_{r}", old) for r, old in expected
    ]
    assert view.index.id_list == list(range(7)) and view.index.trajectory_counter == 7
    assert all(view.index.entries[i]["trajectory_id"] == i for i in range(7))
    for new, (r, old) in enumerate(expected):
        assert view.file_of(new).parent == ranks / f"rank_{r}"
        assert view.file_of(new).name.startswith(f"trajectory_{old}_")
    assert [(m["old_id"], m["new_id"]) for m in view.mapping()] == [
        (o, n) for n, (_, o) in enumerate(expected)
    ]


def test_unique_ids_are_kept_in_numeric_rank_order(tmp_path: Path) -> None:
    """rank_2 before rank_10: sorted as text, the list would read 0, 1, 10, 2, ..."""
    from rbtool.files.dirs import open_view
    from rbtool.files.index import read_index
    from rbtool.ops.checkpoint import shard

    source = FIXTURES / "varying_shapes_pt" / "ckpt"
    shard(source, 11, tmp_path / "tree")
    view = open_view(tmp_path / "tree")
    whole = read_index(source)
    assert [d.name for d in view.dirs] == [f"rank_{r}" for r in range(11)]
    assert not view.renumbered and view.index.id_list == whole.id_list
    assert view.index.trajectory_counter == whole.trajectory_counter


def test_non_strict_views_drop_missing_files_per_rank(tmp_path: Path) -> None:
    from rbtool.files.dirs import open_view

    shutil.copytree(NOSAVE, tmp_path / "rank_0")
    shutil.copytree(FIXTURES / "ranks" / "rank_0", tmp_path / "rank_1")
    with pytest.raises(MissingTrajectoryFilesError, match="rank_0"):
        open_view(tmp_path)
    view = open_view(tmp_path, strict=False)
    assert view.dropped == [(tmp_path / "rank_0", i) for i in (0, 1, 2)]
    assert view.index.size == 2 + 3
    assert open_view(tmp_path, check_files=False).index.size == 5 + 3
