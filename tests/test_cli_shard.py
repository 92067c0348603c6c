"""`rbtool shard`: one checkpoint per rank, each equal to that rank's distributed load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES, RLINF_DIRS, assert_one_error, run, run_json, staging_left, tree_digest

from rbtool import read_index
from rbtool.format import ENTRY_KEYS

STATE_KEYS = ("size", "total_samples", "trajectory_counter", "trajectory_id_list")


@pytest.mark.parametrize("rel", RLINF_DIRS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_shards_equal_distributed_loads(rlinf_copy: Any, tmp_path: Path, rel: str, world_size: int) -> None:
    ckpt = rlinf_copy(rel)
    before = tree_digest(ckpt)
    expected = json.loads((FIXTURES / f"{rel}.expected.json").read_text())
    nosave = "nosave_window2" in rel
    view = expected["consistent_view"] if nosave else expected
    out = tmp_path / "shards"
    doc = run_json(
        "shard", ckpt, "--world-size", str(world_size), "--out", out, *(["--non-strict"] if nosave else [])
    )

    assert doc["source"] == str(ckpt) and doc["out"] == str(out) and doc["world_size"] == world_size
    assert (
        set(doc["files"]) == {"reflinked", "linked", "copied", "written", "bytes"}
        and doc["files"]["written"] == 0
    )
    assert [r["rank"] for r in doc["ranks"]] == list(range(world_size))
    assert sorted(p.name for p in out.iterdir()) == [f"rank_{r}" for r in range(world_size)]
    source = read_index(ckpt)
    for rank, want in enumerate(view["distributed_load"][str(world_size)]):
        record = doc["ranks"][rank]
        assert record["path"] == str(out / f"rank_{rank}")
        assert {k: record[k] for k in STATE_KEYS} == want
        part = read_index(out / f"rank_{rank}")
        assert part.state() == want
        for tid in part.id_list:
            assert {k: part.entries[tid][k] for k in ENTRY_KEYS} == {
                k: source.entries[tid][k] for k in ENTRY_KEYS
            }
            name = part.file_name(tid)
            assert (out / f"rank_{rank}" / name).read_bytes() == (ckpt / name).read_bytes()
        # Each rank, loaded whole, is the source's distributed load for that rank.
        assert {
            k: v for k, v in run_json("checkpoint", "load", out / f"rank_{rank}").items() if k in STATE_KEYS
        } == want
    assert tree_digest(ckpt) == before


def test_more_ranks_than_trajectories(rlinf_copy: Any, tmp_path: Path) -> None:
    ckpt = rlinf_copy("ranks/rank_0")
    doc = run_json("shard", ckpt, "-n", "5", "--out", tmp_path / "s")
    assert [r["trajectory_id_list"] for r in doc["ranks"]] == [[0], [1], [2], [], []]
    assert [r["trajectory_counter"] for r in doc["ranks"]] == [1, 2, 3, 0, 0]
    assert read_index(tmp_path / "s" / "rank_4").size == 0


def test_human_view(rlinf_copy: Any, tmp_path: Path) -> None:
    ckpt = rlinf_copy("autosave_pt/autosave")
    result = run("shard", ckpt, "--world-size", "2", "--out", tmp_path / "s")
    assert result.exit_code == 0 and result.stderr == ""
    assert "rank_0" in result.stdout and "rank_1" in result.stdout and "3-4" in result.stdout


def test_out_exists_needs_force(rlinf_copy: Any, tmp_path: Path) -> None:
    ckpt = rlinf_copy("autosave_pt/autosave")
    out = tmp_path / "s"
    run_json("shard", ckpt, "--world-size", "2", "--out", out)
    before = tree_digest(out)
    assert_one_error(run("shard", ckpt, "--world-size", "3", "--out", out))
    assert tree_digest(out) == before
    assert not (out / "rank_2").exists()
    doc = run_json("shard", ckpt, "--world-size", "3", "--out", out, "--force")
    assert len(doc["ranks"]) == 3 and (out / "rank_2").is_dir()
    # A folder holding anything besides rank_<n> checkpoints is never replaced.
    (out / "notes.txt").write_text("mine")
    before = tree_digest(out)
    assert_one_error(run("shard", ckpt, "--world-size", "2", "--out", out, "--force"))
    assert tree_digest(out) == before
    assert staging_left(tmp_path) == []


def test_shard_does_not_import_torch(rlinf_copy: Any, tmp_path: Path) -> None:
    ckpt = rlinf_copy("varying_shapes_pt/ckpt")
    code = (
        "import runpy, sys\n"
        "sys.argv = ['rbtool', *sys.argv[1:]]\n"
        "try:\n    runpy.run_module('rbtool', run_name='__main__')\n"
        "except SystemExit as exc:\n    if exc.code:\n        raise\n"
        "if 'torch' in sys.modules:\n    sys.exit('torch was imported')\n"
    )
    args = ["shard", str(ckpt), "--world-size", "4", "--out", str(tmp_path / "s"), "--json"]
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [r["size"] for r in json.loads(proc.stdout)["ranks"]] == [2, 2, 1, 1]


# ------------------------------------------------------------------ bad input
def test_invalid_metadata_json(rlinf_copy: Any, tmp_path: Path) -> None:
    ckpt = rlinf_copy("autosave_pt/autosave")
    (ckpt / "metadata.json").write_bytes(b"\x00not json")
    before = tree_digest(ckpt)
    result = run("shard", ckpt, "--world-size", "2", "--out", tmp_path / "s", "--json")
    assert_one_error(result)
    assert "metadata.json" in result.stderr and "invalid JSON" in result.stderr
    assert not (tmp_path / "s").exists() and staging_left(tmp_path) == []
    assert tree_digest(ckpt) == before


def test_index_naming_a_missing_file(rlinf_copy: Any, tmp_path: Path) -> None:
    ckpt = rlinf_copy("nosave_window2_pt/ckpt")
    before = tree_digest(ckpt)
    result = run("shard", ckpt, "--world-size", "2", "--out", tmp_path / "s")
    assert_one_error(result)
    assert "0, 1, 2" in result.stderr
    assert not (tmp_path / "s").exists() and staging_left(tmp_path) == []
    assert tree_digest(ckpt) == before


def test_not_a_checkpoint(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_error(run("shard", empty, "--world-size", "2", "--out", tmp_path / "s"))
    assert_one_error(run("shard", tmp_path / "absent", "--world-size", "2", "--out", tmp_path / "s"))
    assert not (tmp_path / "s").exists() and staging_left(tmp_path) == []


@pytest.mark.parametrize(
    "args",
    [
        ["shard", "CKPT", "--out", "OUT"],  # no --world-size
        ["shard", "CKPT", "--world-size", "0", "--out", "OUT"],
        ["shard", "CKPT", "--world-size", "two", "--out", "OUT"],
        ["shard", "CKPT", "--world-size", "2"],  # no --out
        ["shard", "--world-size", "2", "--out", "OUT"],  # no CKPT
        ["shard", "CKPT", "--world-size", "2", "--out", "CKPT", "--force"],
        ["shard", "CKPT", "--world-size", "2", "--out", "CKPT/shards"],
    ],
)
def test_usage_errors_exit_2(rlinf_copy: Any, tmp_path: Path, args: list[str]) -> None:
    ckpt = rlinf_copy("autosave_pt/autosave")
    before = tree_digest(tmp_path)
    result = run(*[a.replace("CKPT", str(ckpt)).replace("OUT", str(tmp_path / "s")) for a in args])
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    assert tree_digest(tmp_path) == before and not (tmp_path / "s").exists()
