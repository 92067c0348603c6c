"""`rbtool reshard`: a plan, --dry-run, --balance, --force, errors, and inputs left unchanged."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import FIXTURES, assert_one_error, run, run_json, staging_left, tree_digest

from rbtool import read_index

RANKS = FIXTURES / "ranks"
RANK_KEYS = {
    "rank",
    "path",
    "size",
    "total_samples",
    "trajectory_counter",
    "trajectory_id_list",
    "trajectory_id_list_left_out",
    "trajectory_id_ranges",
    "trajectory_id_ranges_left_out",
    "bytes",
}


def test_json_document(tmp_path: Path) -> None:
    before = tree_digest(RANKS)
    out = tmp_path / "out"
    doc = run_json("reshard", RANKS, "--world-size", "3", "--out", out)
    assert set(doc) == {
        "source",
        "source_dirs",
        "renumbered",
        "out",
        "upload",
        "world_size",
        "balance",
        "dry_run",
        "ranks",
        "files",
    }
    assert doc["source_dirs"] == [str(RANKS / "rank_0"), str(RANKS / "rank_1")]
    assert doc["renumbered"] is True and doc["balance"] == "count" and doc["dry_run"] is False
    assert doc["upload"] is None  # a local OUT
    assert [r["trajectory_id_list"] for r in doc["ranks"]] == [[0, 1, 2], [3, 4], [5, 6]]
    for r in doc["ranks"]:
        assert set(r) == RANK_KEYS and r["path"] == str(out / f"rank_{r['rank']}")
        index = read_index(out / f"rank_{r['rank']}")
        assert index.state() == {
            k: r[k] for k in ("size", "total_samples", "trajectory_counter", "trajectory_id_list")
        }
        assert r["bytes"] == sum(
            (out / f"rank_{r['rank']}" / index.file_name(i)).stat().st_size for i in index.id_list
        )
    assert doc["files"]["linked"] + doc["files"]["copied"] == 7 and doc["files"]["written"] == 0
    assert tree_digest(RANKS) == before and staging_left(tmp_path) == []


def test_human_view_shows_the_plan(tmp_path: Path) -> None:
    result = run("reshard", RANKS, "-n", "2", "--out", tmp_path / "out", "--balance", "samples")
    assert result.exit_code == 0, result.stderr
    assert "rank_0" in result.stdout and "rank_1" in result.stdout and "samples" in result.stdout
    assert "merge_map.json" in result.stdout and "files:" in result.stdout


def test_dry_run_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    doc = run_json("reshard", RANKS, "-n", "4", "--out", out, "--dry-run")
    assert doc["dry_run"] is True and doc["files"] is None
    assert [r["size"] for r in doc["ranks"]] == [2, 2, 2, 1]
    assert list(tmp_path.iterdir()) == []
    human = run("reshard", RANKS, "-n", "4", "--out", out, "--dry-run")
    assert human.exit_code == 0 and "; nothing written" in human.stdout
    assert list(tmp_path.iterdir()) == []


def test_balance_samples(tmp_path: Path) -> None:
    ckpt = FIXTURES / "varying_shapes_pt" / "ckpt"  # samples 3, 8, 5, 6, 4, 10
    doc = run_json("reshard", ckpt, "-n", "4", "--out", tmp_path / "o", "--balance", "samples")
    assert doc["balance"] == "samples"
    assert [r["total_samples"] for r in doc["ranks"]] == [11, 5, 10, 10]  # mean 9
    assert [i for r in doc["ranks"] for i in r["trajectory_id_list"]] == read_index(ckpt).id_list
    count = run_json("reshard", ckpt, "-n", "4", "--out", tmp_path / "c")
    assert [r["total_samples"] for r in count["ranks"]] == [11, 11, 4, 10]  # 2, 2, 1, 1 trajectories


def test_force_replaces_an_earlier_output_only(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_json("reshard", RANKS, "-n", "2", "--out", out)
    result = run("reshard", RANKS, "-n", "3", "--out", out)
    assert_one_error(result)
    assert "already exists" in result.stderr and "--force" in result.stderr
    doc = run_json("reshard", RANKS, "-n", "3", "--out", out, "--force")
    assert sorted(p.name for p in out.iterdir()) == ["rank_0", "rank_1", "rank_2"] and doc["world_size"] == 3
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    assert_one_error(run("reshard", RANKS, "-n", "2", "--out", other, "--force"))
    assert (other / "notes.txt").read_text() == "keep me" and staging_left(tmp_path) == []


def test_errors(tmp_path: Path) -> None:
    assert_one_error(run("reshard", tmp_path / "missing", "-n", "2", "--out", tmp_path / "o"))
    (tmp_path / "empty").mkdir()
    assert_one_error(run("reshard", tmp_path / "empty", "-n", "2", "--out", tmp_path / "o"))
    missing = run("reshard", FIXTURES / "nosave_window2_pt" / "ckpt", "-n", "2", "--out", tmp_path / "o")
    assert_one_error(missing)
    assert "--non-strict" in missing.stderr
    assert not (tmp_path / "o").exists()
    assert run("reshard", RANKS, "-n", "0", "--out", tmp_path / "o").exit_code == 2
    assert run("reshard", RANKS, "-n", "2").exit_code == 2
    assert run("reshard", RANKS, "-n", "2", "--out", RANKS / "rank_0" / "x").exit_code == 2
    assert run("reshard", RANKS, "-n", "2", "--out", tmp_path / "o", "--balance", "bytes").exit_code == 2
    assert staging_left(tmp_path) == [] and not (tmp_path / "o").exists()


def test_checkpoint_load_warns_about_another_world_size(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_json("reshard", RANKS, "-n", "2", "--out", out)
    same = run("checkpoint", "load", out / "rank_0", "-n", "2", "--rank", "0", "--json")
    warned = same.stderr.splitlines()
    assert same.exit_code == 0 and len(warned) == 1 and "is already rank 0 of world size 2" in warned[0]
    other = run("checkpoint", "load", out / "rank_0", "-n", "3", "--rank", "0", "--json")
    assert other.exit_code == 0 and json.loads(other.stdout)["world_size"] == 3
    lines = other.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Warning: ") and "world size 2" in lines[0]
