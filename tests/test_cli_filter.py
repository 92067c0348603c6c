"""`rbtool filter`: criteria, --dry-run, JSON, errors, inputs left unchanged."""

from __future__ import annotations

from pathlib import Path

from conftest import FIXTURES, assert_one_error, run, run_json, staging_left, tree_digest

from rbtool import read_index

RANKS = FIXTURES / "ranks"
AUTOSAVE = FIXTURES / "autosave_pt" / "autosave"
TOP_KEYS = {
    "source",
    "out",
    "upload",
    "dry_run",
    "criteria",
    "size",
    "total_samples",
    "trajectory_counter",
    "trajectory_id_list",
    "trajectory_id_list_left_out",
    "trajectory_id_ranges",
    "trajectory_id_ranges_left_out",
    "source_size",
    "dropped_ids",
    "dropped_ids_left_out",
    "renumbered",
    "files",
}


def test_json_document_and_output(tmp_path: Path) -> None:
    before = tree_digest(AUTOSAVE)
    out = tmp_path / "out"
    doc = run_json(
        "filter", AUTOSAVE, "--out", out, "--model-weights-id", "87a64d8e-0f54-5c7c-a19d-0b3753cad97c",
        "--model-weights-id", "3db5df6d-a5c9-59e4-913c-8aa0093702c2",
    )  # fmt: skip
    assert set(doc) == TOP_KEYS and doc["dry_run"] is False and doc["source_size"] == 5
    assert doc["trajectory_id_list"] == [0, 2] and doc["dropped_ids"] == [1, 3, 4]
    assert doc["criteria"]["model_weights_id"] == [
        "87a64d8e-0f54-5c7c-a19d-0b3753cad97c",
        "3db5df6d-a5c9-59e4-913c-8aa0093702c2",
    ]
    assert read_index(out).state() == {
        k: doc[k] for k in ("size", "total_samples", "trajectory_counter", "trajectory_id_list")
    }
    assert doc["trajectory_counter"] == 5 and doc["files"]["written"] == 0
    assert run("verify", out, "--deep").exit_code == 0
    assert tree_digest(AUTOSAVE) == before


def test_dry_run_lists_and_writes_nothing(tmp_path: Path) -> None:
    doc = run_json("filter", RANKS, "--out", tmp_path / "o", "--max-staleness", "0", "--dry-run")
    assert doc["dry_run"] is True and doc["files"] is None and doc["renumbered"] is True
    assert doc["criteria"]["max_staleness"] == 0
    human = run("filter", RANKS, "--out", tmp_path / "o", "--min-id", "2", "--max-id", "3", "--dry-run")
    assert human.exit_code == 0 and "would keep" in human.stdout and "; nothing written" in human.stdout
    assert list(tmp_path.iterdir()) == []


def test_last_and_min_samples(tmp_path: Path) -> None:
    ckpt = FIXTURES / "varying_shapes_pt" / "ckpt"  # samples 3, 8, 5, 6, 4, 10
    doc = run_json("filter", ckpt, "--out", tmp_path / "a", "--min-samples", "5", "--last", "2")
    assert doc["trajectory_id_list"] == [3, 5]


def test_filter_then_diff_lists_the_dropped(tmp_path: Path) -> None:
    doc = run_json("filter", RANKS, "--out", tmp_path / "f", "--min-version", "1")
    result = run("diff", RANKS, tmp_path / "f", "--json")
    assert result.exit_code == 1
    import json

    d = json.loads(result.stdout)
    assert d["removed"] == doc["dropped_ids"] and d["added"] == [] and d["changed"] == []


def test_errors(tmp_path: Path) -> None:
    out = tmp_path / "o"
    assert_one_error(run("filter", tmp_path / "missing", "--out", out))
    assert_one_error(run("filter", AUTOSAVE, "--out", out, "--min-id", "3", "--max-id", "1"), status=2)
    assert run("filter", AUTOSAVE, "--out", out, "--last", "-1").exit_code == 2
    assert run("filter", AUTOSAVE).exit_code == 2
    assert run("filter", AUTOSAVE, "--out", AUTOSAVE / "x").exit_code == 2
    missing = run("filter", FIXTURES / "nosave_window2_pt" / "ckpt", "--out", out)
    assert_one_error(missing)
    assert "--non-strict" in missing.stderr and not out.exists()
    run_json("filter", AUTOSAVE, "--out", out)
    exists = run("filter", AUTOSAVE, "--out", out)
    assert_one_error(exists)
    assert "--force" in exists.stderr
    assert run_json("filter", AUTOSAVE, "--out", out, "--force", "--last", "1")["trajectory_id_list"] == [4]
    assert staging_left(tmp_path) == []
