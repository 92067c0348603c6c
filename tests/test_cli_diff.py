"""`rbtool diff`: exit 0 when equal, 1 when not (a CI gate), JSON keys, human view, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import orjson
from conftest import FIXTURES, assert_one_error, run, run_json, tree_digest

from rbtool.format import METADATA_FILE

RANKS = FIXTURES / "ranks"
AUTOSAVE = FIXTURES / "autosave_pt" / "autosave"
TOP_KEYS = {
    "a",
    "b",
    "equal",
    "verdict",
    "deep",
    "metadata",
    "added",
    "removed",
    "changed",
    "added_left_out",
    "removed_left_out",
    "changed_left_out",
    "order_changed",
    "unchanged",
    "files_unchecked",
    "contents_not_compared",
    "layout",
    "schema",
}


def test_a_reshard_changes_nothing(tmp_path: Path) -> None:
    before = tree_digest(RANKS)
    run_json("reshard", RANKS, "-n", "3", "--out", tmp_path / "r")
    doc = run_json("diff", RANKS, tmp_path / "r")
    assert set(doc) == TOP_KEYS and doc["equal"] is True and doc["unchanged"] == 7
    assert run_json("diff", RANKS, tmp_path / "r", "--deep")["deep"] is True
    human = run("diff", RANKS, tmp_path / "r")
    assert human.exit_code == 0 and human.stdout.startswith("equal") and human.stderr == ""
    assert tree_digest(RANKS) == before


def test_differences_exit_1_with_a_report(tmp_path: Path) -> None:
    b = tmp_path / "b"
    shutil.copytree(AUTOSAVE, b)
    meta = orjson.loads((b / METADATA_FILE).read_bytes())
    meta["seed"] = 7
    (b / METADATA_FILE).write_bytes(orjson.dumps(meta))
    result = run("diff", AUTOSAVE, b, "--json")
    assert result.exit_code == 1 and result.stderr == ""
    doc = json.loads(result.stdout)
    assert doc["equal"] is False and doc["metadata"] == [{"key": "seed", "a": 1234, "b": 7}]
    human = run("diff", AUTOSAVE, b)
    assert human.exit_code == 1 and "differ" in human.stdout and "seed" in human.stdout


def test_other_formats_are_compared_only_by_content(tmp_path: Path) -> None:
    run_json("convert", AUTOSAVE, "--out", tmp_path / "pkl", "--format", "pkl")
    shallow = run("diff", AUTOSAVE, tmp_path / "pkl")
    assert shallow.exit_code == 1  # its files were not compared: not shown equal
    assert shallow.stderr.startswith("Warning: 5 files are") and "--deep" in shallow.stderr
    run_json("convert", tmp_path / "pkl", "--out", tmp_path / "pt", "--format", "pt")
    assert run_json("diff", AUTOSAVE, tmp_path / "pt", "--deep")["equal"] is True


def test_errors(tmp_path: Path) -> None:
    assert_one_error(run("diff", AUTOSAVE, tmp_path / "missing"))
    missing = run("diff", AUTOSAVE, FIXTURES / "nosave_window2_pt" / "ckpt")
    assert_one_error(missing)
    assert "--non-strict" in missing.stderr
    assert run("diff", AUTOSAVE).exit_code == 2
