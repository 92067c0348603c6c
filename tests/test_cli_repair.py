"""`rbtool repair`: JSON and human output, exit status, --force, and inputs left unchanged."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES, tree_digest
from typer.testing import CliRunner, Result

from rbtool.cli import app
from rbtool.files.index import read_index

runner = CliRunner()
DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
NOSAVE = ["nosave_window2_pt/ckpt", "nosave_window2_pkl/ckpt"]
TOP_KEYS = {
    "source",
    "out",
    "checkpoints",
    "files",
    "dry_run",
    "jobs",
    "bytes_read",
    "seconds",
    "bytes_per_second",
}
CKPT_KEYS = {
    "source",
    "out",
    "rebuilt_metadata",
    "rebuilt_index",
    "size",
    "total_samples",
    "trajectory_counter",
    "trajectory_id_list",
    "trajectory_id_list_left_out",
    "trajectory_id_ranges",
    "trajectory_id_ranges_left_out",
    "dropped",
    "dropped_left_out",
    "ignored",
    "ignored_left_out",
    "fixed",
    "fixed_left_out",
}


def run(*args: str | Path) -> Result:
    return runner.invoke(app, ["repair", *map(str, args)])


def assert_one_error(result: Result) -> None:
    assert result.exit_code == 1, (result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr


@pytest.mark.parametrize("rel", NOSAVE)
def test_json_report_of_a_nosave_fixture(rlinf_copy: Any, tmp_path: Path, rel: str) -> None:
    src = rlinf_copy(rel)
    before = tree_digest(src)
    out = tmp_path / "fixed"
    result = run(src, "--out", out, "--json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    doc = json.loads(result.stdout)
    assert set(doc) == TOP_KEYS and doc["source"] == str(src) and doc["out"] == str(out)
    (ckpt,) = doc["checkpoints"]
    assert set(ckpt) == CKPT_KEYS
    view = json.loads((FIXTURES / f"{rel}.expected.json").read_text())["consistent_view"]["full_load"]
    assert {k: ckpt[k] for k in view} == view
    assert [d["trajectory_id"] for d in ckpt["dropped"]] == [0, 1, 2]
    assert all(set(d) == {"trajectory_id", "file", "reason"} for d in ckpt["dropped"])
    files = {"reflinked": 0, "linked": 2, "copied": 0, "written": 0, "bytes": doc["files"]["bytes"]}
    assert doc["files"] == files
    assert read_index(out).state() == view
    assert tree_digest(src) == before
    verified = runner.invoke(app, ["verify", str(out), "--deep"])
    assert verified.exit_code == 0, verified.stdout


def test_human_output_names_what_was_dropped(rlinf_copy: Any, tmp_path: Path) -> None:
    src = rlinf_copy(NOSAVE[0])
    result = run(src, "--out", tmp_path / "fixed")
    assert result.exit_code == 0 and result.stderr == ""
    flat = " ".join(result.stdout.replace("│", " ").split())
    assert "kept 2 (3-4)" in flat and "trajectory counter 5" in flat
    assert flat.count("file missing") == 3 and "files: 0 reflinked, 2 linked, 0 copied, 0 written" in flat


def test_rank_folder_gives_one_output_per_rank(tmp_path: Path) -> None:
    result = run(FIXTURES / "ranks", "--out", tmp_path / "r", "--json")
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert [Path(c["out"]).name for c in doc["checkpoints"]] == ["rank_0", "rank_1"]
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["rank_0", "rank_1"]


def test_rebuilt_index_and_metadata_are_reported(rlinf_copy: Any, tmp_path: Path) -> None:
    src = rlinf_copy("autosave_pt/autosave")
    (src / "metadata.json").unlink()
    (src / "trajectory_index.json").write_text("{not json")
    doc = json.loads(run(src, "--out", tmp_path / "o", "--json").stdout)
    (ckpt,) = doc["checkpoints"]
    assert ckpt["rebuilt_metadata"] and ckpt["rebuilt_index"]
    assert ckpt["trajectory_id_list"] == [0, 1, 2, 3, 4] and ckpt["trajectory_counter"] == 5
    assert all(set(f) == {"trajectory_id", "message"} for f in ckpt["fixed"])
    human = run(src, "--out", tmp_path / "h")
    assert "rebuilt metadata, index" in " ".join(human.stdout.replace("│", " ").split())


def test_existing_out_is_an_error_unless_forced(rlinf_copy: Any, tmp_path: Path) -> None:
    src = rlinf_copy(NOSAVE[1])
    out = tmp_path / "o"
    assert run(src, "--out", out).exit_code == 0
    first = tree_digest(out)
    result = run(src, "--out", out)
    assert_one_error(result)
    assert "already exists" in result.stderr and tree_digest(out) == first
    assert run(src, "--out", out, "--force", "--json").exit_code == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_input_errors_exit_1(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for source in (tmp_path / "missing", tmp_path / "empty"):
        for flags in ([], ["--json"]):
            result = run(source, "--out", tmp_path / "o", *flags)
            assert_one_error(result)
            assert not (tmp_path / "o").exists()


def test_usage_errors_exit_2(rlinf_copy: Any) -> None:
    src = rlinf_copy(NOSAVE[0])
    before = tree_digest(src)
    assert run(src).exit_code == 2  # no --out
    assert runner.invoke(app, ["repair"]).exit_code == 2
    for out in (src, src / "inside", src.parent):
        result = run(src, "--out", out)
        assert result.exit_code == 2 and "overlaps" in result.stderr
    assert tree_digest(src) == before


def test_docs_cover_every_json_key() -> None:
    text = DOC.read_text()
    assert re.search(r"^## rbtool repair\s*$", text, flags=re.M)
    for key in (
        TOP_KEYS | CKPT_KEYS | {"trajectory_id", "file", "reason", "message", "reflinked", "linked", "bytes"}
    ):
        assert re.search(rf"`([a-z\[\]_]+\.)?{key}`", text), key


def test_jobs_give_the_same_repair_and_report_the_pass(rlinf_copy: Any, tmp_path: Path) -> None:
    src = rlinf_copy(NOSAVE[0])
    docs = []
    for jobs in ("1", "2"):
        result = run(src, "--out", tmp_path / f"fixed{jobs}", "--jobs", jobs, "--json")
        assert result.exit_code == 0, result.stderr
        doc = json.loads(result.stdout)
        sizes = sum(p.stat().st_size for p in src.glob("trajectory_*_*"))
        assert doc["jobs"] == int(jobs) and doc["bytes_read"] == sizes and doc["bytes_per_second"] > 0
        docs.append(doc["checkpoints"][0]["dropped"])
    assert docs[0] == docs[1]
    human = run(src, "--out", tmp_path / "fixed3", "--jobs", "2")
    assert human.exit_code == 0 and "MB/s, 2 jobs)" in human.stdout
