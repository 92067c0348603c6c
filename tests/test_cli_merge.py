"""`rbtool merge`: shard then merge is the identity; colliding ranks are renumbered with a mapping."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_one_error, make_traj, run, run_json, staging_left, tree_digest

from rbtool import read_index
from rbtool.files import trajfile
from rbtool.format import ENTRY_KEYS, layout
from rbtool.ops.checkpoint import MERGE_MAP_FILE


def trajectory_bytes(directory: Path) -> dict[str, bytes]:
    index = read_index(directory)
    return {index.file_name(i): (directory / index.file_name(i)).read_bytes() for i in index.id_list}


def without_link(entries: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {tid: {k: v for k, v in e.items() if k != "link"} for tid, e in entries.items()}


@pytest.fixture
def rbtool_buffer(tmp_path: Path) -> Path:
    """A buffer directory written by rbtool: seven trajectories of varying shapes."""
    loose = tmp_path / "loose"
    loose.mkdir()
    files = []
    for i in range(7):
        path = loose / f"t{i}.pt"
        torch.save(make_traj(t=2 + i % 3, b=1 + i % 2, seed=i, image=2, model_weights_id=f"m{i % 2}"), path)
        files.append(path)
    buffer = tmp_path / "buf"
    run_json("ingest", *files, "--buffer", buffer)
    return buffer


@pytest.mark.parametrize("world_size", [1, 2, 3, 7, 9])
def test_shard_then_merge_reproduces_the_source(tmp_path: Path, rbtool_buffer: Path, world_size: int) -> None:
    before = tree_digest(rbtool_buffer)
    shards = tmp_path / "shards"
    run_json("shard", rbtool_buffer, "--world-size", str(world_size), "--out", shards)
    out = tmp_path / "merged"
    doc = run_json("merge", shards, "--out", out)
    assert doc["inputs"] == [str(shards / f"rank_{r}") for r in range(world_size)]
    assert doc["out"] == str(out) and doc["renumbered"] is False and doc["mapping_file"] is None
    source, merged = read_index(rbtool_buffer), read_index(out)
    assert {
        k: doc[k] for k in ("size", "total_samples", "trajectory_counter", "trajectory_id_list")
    } == source.state()
    assert merged.state() == source.state()
    # the same entries; `link` describes how a file was placed (the buffer's are copies of loose
    # files, the merged ones hard links of them), not the trajectory
    assert without_link(merged.entries) == without_link(source.entries)
    for tid, entry in merged.entries.items():
        if "link" in entry:
            assert entry["link"]["inode"] == (rbtool_buffer / source.file_name(tid)).stat().st_ino
    assert merged.trajectory_format == source.trajectory_format == doc["trajectory_format"]
    assert trajectory_bytes(out) == trajectory_bytes(rbtool_buffer)
    assert not (out / MERGE_MAP_FILE).exists()
    assert tree_digest(rbtool_buffer) == before


def test_merge_rank_dirs_given_one_by_one(rlinf_copy: Any, tmp_path: Path) -> None:
    ckpt = rlinf_copy("varying_shapes_pt/ckpt")
    shards = tmp_path / "shards"
    run_json("shard", ckpt, "--world-size", "3", "--out", shards)
    out = tmp_path / "merged"
    doc = run_json("merge", *(shards / f"rank_{r}" for r in range(3)), "--out", out)
    source, merged = read_index(ckpt), read_index(out)
    assert doc["trajectory_id_list"] == source.id_list and merged.state() == source.state()
    for tid in source.id_list:
        assert {k: merged.entries[tid][k] for k in ENTRY_KEYS} == {
            k: source.entries[tid][k] for k in ENTRY_KEYS
        }
    assert trajectory_bytes(out) == trajectory_bytes(ckpt)


def test_colliding_ranks_are_renumbered(rlinf_copy: Any, tmp_path: Path) -> None:
    rank_0, rank_1 = rlinf_copy("ranks/rank_0"), rlinf_copy("ranks/rank_1")
    before = tree_digest(tmp_path / "fx")
    out = tmp_path / "merged"
    doc = run_json("merge", rank_0, rank_1, "--out", out)
    assert doc["renumbered"] is True
    assert doc["mapping_file"] == str(out / MERGE_MAP_FILE)
    assert doc["trajectory_id_list"] == list(range(7))
    assert doc["size"] == 7 and doc["trajectory_counter"] == 7 and doc["total_samples"] == 56
    # (original id, input order): r0/0, r1/0, r0/1, r1/1, r0/2, r1/2, r1/3.
    order = [(rank_0, 0), (rank_1, 0), (rank_0, 1), (rank_1, 1), (rank_0, 2), (rank_1, 2), (rank_1, 3)]
    mapping = json.loads((out / MERGE_MAP_FILE).read_text())["renumbered"]
    assert [(m["input"], m["old_id"], m["new_id"]) for m in mapping] == [
        (str(d), old, new) for new, (d, old) in enumerate(order)
    ]
    merged = read_index(out)
    for new, (directory, old) in enumerate(order):
        src = read_index(directory)
        want = {k: src.entries[old][k] for k in ENTRY_KEYS if k != "trajectory_id"}
        assert {k: merged.entries[new][k] for k in ENTRY_KEYS if k != "trajectory_id"} == want
        assert merged.entries[new]["trajectory_id"] == new
        assert (out / merged.file_name(new)).read_bytes() == (directory / src.file_name(old)).read_bytes()
    assert tree_digest(tmp_path / "fx") == before
    result = run("merge", rank_0, rank_1, "--out", tmp_path / "again")
    assert result.exit_code == 0 and "renumbered" in result.stdout and "0-6" in result.stdout


def test_merge_converts_format(tmp_path: Path, rbtool_buffer: Path) -> None:
    out = tmp_path / "merged"
    doc = run_json("merge", rbtool_buffer, "--out", out, "--format", "pkl")
    assert doc["trajectory_format"] == "pkl" and doc["files"]["written"] == 7
    source, merged = read_index(rbtool_buffer), read_index(out)
    assert merged.id_list == source.id_list
    for tid in source.id_list:
        got = dict(layout.iter_tensors(trajfile.load(out / merged.file_name(tid))))
        want = dict(layout.iter_tensors(trajfile.load(rbtool_buffer / source.file_name(tid))))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_non_strict_merge_keeps_what_exists(rlinf_copy: Any, tmp_path: Path) -> None:
    ckpt = rlinf_copy("nosave_window2_pt/ckpt")
    assert_one_error(run("merge", ckpt, "--out", tmp_path / "strict"))
    doc = run_json("merge", ckpt, "--out", tmp_path / "m", "--non-strict")
    assert doc["trajectory_id_list"] == [3, 4] and doc["trajectory_counter"] == 5


def test_out_exists_needs_force(tmp_path: Path, rbtool_buffer: Path) -> None:
    out = tmp_path / "merged"
    run_json("merge", rbtool_buffer, "--out", out)
    before = tree_digest(out)
    assert_one_error(run("merge", rbtool_buffer, "--out", out))
    assert tree_digest(out) == before
    assert run_json("merge", rbtool_buffer, "--out", out, "--force")["size"] == 7
    assert staging_left(tmp_path) == []


# ------------------------------------------------------------------ bad input
def test_invalid_metadata_json(rlinf_copy: Any, tmp_path: Path) -> None:
    rank_0, rank_1 = rlinf_copy("ranks/rank_0"), rlinf_copy("ranks/rank_1")
    (rank_1 / "metadata.json").write_text("[1, 2")
    before = tree_digest(tmp_path / "fx")
    result = run("merge", rank_0, rank_1, "--out", tmp_path / "m", "--json")
    assert_one_error(result)
    assert "metadata.json" in result.stderr
    assert not (tmp_path / "m").exists() and staging_left(tmp_path) == []
    assert tree_digest(tmp_path / "fx") == before


def test_input_that_is_not_a_checkpoint(tmp_path: Path, rbtool_buffer: Path) -> None:
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("not a checkpoint")
    result = run("merge", rbtool_buffer, stray, "--out", tmp_path / "m")
    assert_one_error(result)
    assert "stray" in result.stderr
    assert_one_error(run("merge", tmp_path / "absent", "--out", tmp_path / "m"))
    assert not (tmp_path / "m").exists() and staging_left(tmp_path) == []


@pytest.mark.parametrize(
    "args",
    [
        ["merge", "IN"],  # no --out
        ["merge", "--out", "OUT"],  # no input
        ["merge", "IN", "--out", "OUT", "--format", "npz"],
        ["merge", "IN", "--out", "IN", "--force"],
        ["merge", "IN", "--out", "IN/inner"],
    ],
)
def test_usage_errors_exit_2(tmp_path: Path, rbtool_buffer: Path, args: list[str]) -> None:
    before = tree_digest(tmp_path)
    result = run(*[a.replace("IN", str(rbtool_buffer)).replace("OUT", str(tmp_path / "m")) for a in args])
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    assert tree_digest(tmp_path) == before and not (tmp_path / "m").exists()
