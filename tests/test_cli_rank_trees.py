"""A folder of rank_* checkpoints is a checkpoint: stats, verify, sample, shard, checkpoint load/save.

On the reference `ranks/` fixture (colliding ids, renumbered as merge does) and on a generated
tree of 11 ranks (rank_2 before rank_10: numeric order, not text order).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, assert_batches_equal, make_traj, run, run_json, tree_digest

from rbtool import read_index
from rbtool.ops.checkpoint import build_from_files, merge, shard

STATE_KEYS = ("size", "total_samples", "trajectory_counter", "trajectory_id_list")


@pytest.fixture
def eleven(tmp_path: Path) -> Path:
    """11 ranks of one trajectory each, ids unique: the merge lists them 0..10 in rank order."""
    files = tmp_path / "files"
    files.mkdir()
    paths = []
    for i in range(11):
        paths.append(files / f"t{i}.pt")
        torch.save(make_traj(t=1 + i % 3, b=1 + i % 2, seed=i, image=2, model_weights_id=f"w{i}"), paths[-1])
    build_from_files(paths, tmp_path / "whole", window=0)
    tree = tmp_path / "eleven"
    shard(tmp_path / "whole", 11, tree)
    return tree


@pytest.fixture(params=["ranks", "eleven"])
def tree(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Path]:
    """(rank tree, the checkpoint `rbtool merge` makes of it)."""
    path = FIXTURES / "ranks" if request.param == "ranks" else request.getfixturevalue("eleven")
    merged = tmp_path / "merged"
    merge([path], merged)
    return path, merged


def test_the_eleven_ranks_are_read_in_numeric_order(eleven: Path) -> None:
    doc = run_json("checkpoint", "load", eleven)
    assert doc["trajectory_id_list"] == list(range(11))  # text order would put rank_10 third
    stats = run_json("stats", eleven, "--index-only")
    assert stats["rank_dirs"] == [str(eleven / f"rank_{r}") for r in range(11)]
    assert stats["trajectories"]["id"] == list(range(11))
    verified = run_json("verify", eleven)
    assert [c["path"] for c in verified["checkpoints"]] == [str(eleven / f"rank_{r}") for r in range(11)]


def test_checkpoint_load_of_a_tree_is_the_load_of_its_merge(tree: tuple[Path, Path]) -> None:
    path, merged = tree
    before = tree_digest(path)
    assert {k: v for k, v in run_json("checkpoint", "load", path).items() if k in STATE_KEYS} == {
        k: v for k, v in run_json("checkpoint", "load", merged).items() if k in STATE_KEYS
    }
    for n in (1, 2, 3, 4):
        assert (
            run_json("checkpoint", "load", path, "-n", str(n))["ranks"]
            == run_json("checkpoint", "load", merged, "-n", str(n))["ranks"]
        )
        for r in range(n):
            one = run_json("checkpoint", "load", path, "-n", str(n), "--rank", str(r))
            assert (
                one["trajectory_id_list"]
                == run_json("checkpoint", "load", merged, "-n", str(n), "-r", str(r))["trajectory_id_list"]
            )
    assert tree_digest(path) == before


def test_checkpoint_load_restores_a_tree_into_a_buffer(tree: tuple[Path, Path], tmp_path: Path) -> None:
    path, merged = tree
    doc = run_json("checkpoint", "load", path, "-n", "2", "-r", "1", "--buffer", tmp_path / "buf")
    assert doc["restored_to"] == str(tmp_path / "buf")
    assert read_index(tmp_path / "buf").state() == read_index(merged).rank_block(2, 1).state()


def test_checkpoint_save_from_a_tree(tree: tuple[Path, Path], tmp_path: Path) -> None:
    path, merged = tree
    a = run_json("checkpoint", "save", path, tmp_path / "a", "--window", "3")
    b = run_json("checkpoint", "save", merged, tmp_path / "b", "--window", "3")
    assert a["mode"] == "auto-save"
    assert {k: a[k] for k in STATE_KEYS} == {k: b[k] for k in STATE_KEYS}
    ia, ib = read_index(tmp_path / "a"), read_index(tmp_path / "b")
    for i in ia.id_list:
        assert (tmp_path / "a" / ia.file_name(i)).read_bytes() == (
            tmp_path / "b" / ib.file_name(i)
        ).read_bytes()


def test_stats_of_a_tree_is_the_stats_of_its_merge(tree: tuple[Path, Path]) -> None:
    path, merged = tree
    a, b = run_json("stats", path), run_json("stats", merged)
    assert a["rank_dirs"] and b["rank_dirs"] == []
    assert a["renumbered"] == (path.name == "ranks") and b["renumbered"] is False
    for doc in (a, b):  # how long each data pass took is not the data
        for key in ("seconds", "bytes_per_second"):
            doc["data"].pop(key)
    for key in ("index", "window", "schema", "data"):
        assert a[key] == b[key], key
    assert a["trajectories"]["id"] == b["trajectories"]["id"]
    assert run_json("stats", path, "--index-only")["index"] == a["index"]


def test_verify_checks_each_rank(tree: tuple[Path, Path]) -> None:
    path, _ = tree
    doc = run_json("verify", path, "--deep")
    assert doc["ok"] is True


def test_sample_of_a_tree_is_the_sample_of_its_merge(tree: tuple[Path, Path], tmp_path: Path) -> None:
    path, merged = tree
    a = run_json("sample", path, "--num-chunks", "9", "--out", tmp_path / "a.pt")
    b = run_json("sample", merged, "--num-chunks", "9", "--out", tmp_path / "b.pt")
    assert a["draws"] == b["draws"] and a["window_samples"] == b["window_samples"]
    assert_batches_equal(torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt"))


def test_shard_of_a_tree_is_the_shard_of_its_merge(tree: tuple[Path, Path], tmp_path: Path) -> None:
    path, merged = tree
    a = run_json("shard", path, "-n", "3", "--out", tmp_path / "sa")
    b = run_json("shard", merged, "-n", "3", "--out", tmp_path / "sb")
    assert [{k: r[k] for k in STATE_KEYS} for r in a["ranks"]] == [
        {k: r[k] for k in STATE_KEYS} for r in b["ranks"]
    ]


def test_a_folder_without_ranks_is_one_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for args in (
        ["stats", tmp_path / "empty"],
        ["sample", tmp_path / "empty", "--num-chunks", "2"],
        ["checkpoint", "load", tmp_path / "empty"],
        ["shard", tmp_path / "empty", "-n", "2", "--out", tmp_path / "o"],
    ):
        result = run(*args)
        assert result.exit_code == 1 and result.stdout == "", args
        assert result.stderr.startswith("Error: ") and "rank_*" in result.stderr, args


def test_ingest_takes_a_tree_in_its_merged_order(tree: tuple[Path, Path], tmp_path: Path) -> None:
    path, merged = tree
    a = run_json("ingest", path, "--buffer", tmp_path / "a")
    b = run_json("ingest", merged, "--buffer", tmp_path / "b")
    assert a["trajectory_ids"] == b["trajectory_ids"]
    ia, ib = read_index(tmp_path / "a"), read_index(tmp_path / "b")
    for i in ia.id_list:
        assert (tmp_path / "a" / ia.file_name(i)).read_bytes() == (
            tmp_path / "b" / ib.file_name(i)
        ).read_bytes()
