"""`rbtool convert`: JSON, layout kept, --jobs, --force, errors, inputs left unchanged."""

from __future__ import annotations

from pathlib import Path

from conftest import FIXTURES, assert_one_error, run, run_json, staging_left, tree_digest

from rbtool import read_index

RANKS = FIXTURES / "ranks"
AUTOSAVE = FIXTURES / "autosave_pt" / "autosave"


def test_json_document(tmp_path: Path) -> None:
    before = tree_digest(RANKS)
    out = tmp_path / "out"
    doc = run_json("convert", RANKS, "--out", out, "--format", "pkl", "--jobs", "3")
    assert set(doc) == {
        "source",
        "out",
        "upload",
        "trajectory_format",
        "jobs",
        "bytes_read",
        "seconds",
        "bytes_per_second",
        "checkpoints",
        "dry_run",
        "files",
        "journal",
    }
    assert doc["journal"] is None  # no --journal
    assert doc["trajectory_format"] == "pkl" and doc["jobs"] == 3 and doc["files"]["written"] == 7
    sources = sum(p.stat().st_size for p in RANKS.glob("rank_*/trajectory_*_*.pt"))
    assert doc["bytes_read"] == sources and doc["bytes_per_second"] > 0
    assert [c["path"] for c in doc["checkpoints"]] == [str(out / "rank_0"), str(out / "rank_1")]
    for c in doc["checkpoints"]:
        index = read_index(c["path"])
        assert index.trajectory_format == "pkl" and index.state() == {
            k: c[k] for k in ("size", "total_samples", "trajectory_counter", "trajectory_id_list")
        }
    assert run("verify", out, "--deep").exit_code == 0
    assert tree_digest(RANKS) == before and staging_left(tmp_path) == []


def test_human_view_and_default_jobs(tmp_path: Path) -> None:
    result = run("convert", AUTOSAVE, "--out", tmp_path / "o", "--format", "pkl")
    assert result.exit_code == 0, result.stderr
    assert "converted to pkl" in result.stdout and "5 written" in result.stdout
    assert run_json("convert", AUTOSAVE, "--out", tmp_path / "p", "--format", "pt")["jobs"] >= 1


def test_errors(tmp_path: Path) -> None:
    out = tmp_path / "o"
    assert_one_error(run("convert", tmp_path / "missing", "--out", out, "--format", "pkl"))
    missing = run("convert", FIXTURES / "nosave_window2_pt" / "ckpt", "--out", out, "--format", "pkl")
    assert_one_error(missing)
    assert "--non-strict" in missing.stderr and not out.exists()
    assert run("convert", AUTOSAVE, "--out", out).exit_code == 2
    assert run("convert", AUTOSAVE, "--out", out, "--format", "json").exit_code == 2
    assert run("convert", AUTOSAVE, "--out", out, "--format", "pkl", "--jobs", "0").exit_code == 2
    assert run("convert", AUTOSAVE, "--out", AUTOSAVE / "x", "--format", "pkl").exit_code == 2
    run_json("convert", AUTOSAVE, "--out", out, "--format", "pkl")
    exists = run("convert", AUTOSAVE, "--out", out, "--format", "pkl")
    assert_one_error(exists)
    assert "--force" in exists.stderr
    run_json("convert", AUTOSAVE, "--out", out, "--format", "pt", "--force")
    assert read_index(out).trajectory_format == "pt" and staging_left(tmp_path) == []
