"""`rbtool verify`: exit status, the JSON report, the human table, and the documentation of every code."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from conftest import FIXTURES, RLINF_DIRS, make_traj, tree_digest
from typer.testing import CliRunner, Result

from rbtool.cli import app
from rbtool.cli.verify import MAX_ROWS
from rbtool.files.index import Index, read_index, write_index
from rbtool.ops.verify import PROBLEM_CODES

runner = CliRunner()
DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
NOSAVE = [rel for rel in RLINF_DIRS if "nosave_window2" in rel]
CLEAN = [rel for rel in RLINF_DIRS if rel not in NOSAVE]


def run(*args: str | Path) -> Result:
    return runner.invoke(app, ["verify", *map(str, args)])


def assert_error_line(result: Result) -> None:
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr


@pytest.mark.parametrize("deep", [[], ["--deep"]], ids=["quick", "deep"])
@pytest.mark.parametrize("rel", CLEAN)
def test_reference_checkpoints_exit_0(rel: str, deep: list[str]) -> None:
    result = run(FIXTURES / rel, *deep, "--json")
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    doc = json.loads(result.stdout)
    assert doc["ok"] is True and doc["deep"] is bool(deep)
    # RLinf records no sizes or hashes: a quick check says only a deep one proves the files whole
    unrecorded = [] if deep else ["sizes_unrecorded"]
    assert doc["counts"] == {"error": 0, "warning": 0, "notice": len(unrecorded)}
    assert all(c["ok"] and [p["code"] for p in c["problems"]] == unrecorded for c in doc["checkpoints"])

    human = run(FIXTURES / rel, *deep)
    assert human.exit_code == 0 and human.stderr == ""
    assert human.stdout.startswith("OK ")
    assert ("no problems" in human.stdout) is bool(deep)


@pytest.mark.parametrize("deep", [[], ["--deep"]], ids=["quick", "deep"])
@pytest.mark.parametrize("rel", NOSAVE)
def test_nosave_fixtures_exit_1_with_their_report(rel: str, deep: list[str]) -> None:
    result = run(FIXTURES / rel, *deep, "--json")
    assert result.exit_code == 1
    assert_error_line(result)
    assert "3 errors: file_missing x3" in result.stderr
    doc = json.loads(result.stdout)
    assert doc["path"] == str(FIXTURES / rel) and doc["ok"] is False
    (ckpt,) = doc["checkpoints"]
    assert ckpt["size"] == 5 and ckpt["ok"] is False
    unrecorded = [] if deep else [("sizes_unrecorded", "notice", None)]
    assert [(p["code"], p["severity"], p["trajectory_id"]) for p in ckpt["problems"]] == [
        *(("file_missing", "error", i) for i in (0, 1, 2)),
        *unrecorded,
    ]
    assert doc["counts"] == {"error": 3, "warning": 0, "notice": len(unrecorded)}

    human = run(FIXTURES / rel, *deep)
    assert human.exit_code == 1
    assert human.stdout.startswith("FAILED ")
    assert human.stdout.count("file_missing") == 3
    assert_error_line(human)


def test_folder_of_ranks_lists_each_checkpoint() -> None:
    result = run(FIXTURES / "ranks", "--json")
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert [Path(c["path"]).name for c in doc["checkpoints"]] == ["rank_0", "rank_1"]
    assert [c["size"] for c in doc["checkpoints"]] == [3, 4]


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_a_path_that_is_no_checkpoint_is_one_error_line(tmp_path: Path, json_flag: list[str]) -> None:
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "missing", tmp_path / "empty"):
        result = run(path, *json_flag)
        assert result.exit_code == 1 and result.stdout == ""
        assert_error_line(result)


def test_usage_errors_exit_2() -> None:
    assert runner.invoke(app, ["verify"]).exit_code == 2
    assert runner.invoke(app, ["verify", str(FIXTURES), "--deeper"]).exit_code == 2


def test_notices_and_warnings_do_not_fail(rlinf_copy: Any) -> None:
    import torch

    ckpt = rlinf_copy("autosave_pt/autosave")
    (first,) = ckpt.glob("trajectory_0_*")
    shutil.copy(first, ckpt / "trajectory_9_late.pt")  # what an interrupted ingest leaves
    (third,) = ckpt.glob("trajectory_3_*")
    entry = read_index(ckpt).entries[3]
    torch.save(make_traj(image=16, model_weights_id=entry["model_weights_id"], extra=torch.ones(4, 2)), third)
    result = run(ckpt, "--deep", "--json")
    assert result.exit_code == 0 and result.stderr == ""
    doc = json.loads(result.stdout)
    assert doc["ok"] is True and doc["counts"] == {"error": 0, "warning": 1, "notice": 1}
    kinds = {(p["code"], p["severity"]) for p in doc["checkpoints"][0]["problems"]}
    assert kinds == {("uncommitted_file", "notice"), ("schema_differs", "warning")}


def test_messages_with_brackets_print_verbatim(rlinf_copy: Any) -> None:
    ckpt = rlinf_copy("autosave_pt/autosave")
    doc = orjson.loads((ckpt / "trajectory_index.json").read_bytes())
    doc["trajectory_index"]["1"].update(shape=[5, 2, 7], num_samples=10)
    (ckpt / "trajectory_index.json").write_bytes(orjson.dumps(doc))
    meta = orjson.loads((ckpt / "metadata.json").read_bytes())
    (ckpt / "metadata.json").write_bytes(orjson.dumps({**meta, "total_samples": 42}))
    result = run(ckpt, "--deep")
    assert result.exit_code == 1
    flat = " ".join(result.stdout.replace("│", " ").split())  # undo the table's wrapping
    assert "shape_mismatch" in flat
    assert "tensors are [T, B] = [4, 2] but the index entry says [5, 2]" in flat


def test_human_view_shows_the_first_rows_and_counts_the_rest(tmp_path: Path) -> None:
    index = Index(trajectory_format="pt")
    n = MAX_ROWS + 7
    for i in range(n):
        index.entries[i] = {
            "num_samples": 2,
            "trajectory_id": i,
            "max_episode_length": 2,
            "shape": [2, 1],
            "model_weights_id": "v",
        }
        index.id_list.append(i)
    index.trajectory_counter = n
    (tmp_path / "c").mkdir()
    write_index(tmp_path / "c", index)
    result = run(tmp_path / "c")
    assert result.exit_code == 1
    assert result.stdout.count("file_missing") == MAX_ROWS + 1  # the rows, then the summary line
    assert "... and 7 more (file_missing x7); --all lists every problem" in result.stdout
    every = run(tmp_path / "c", "--all")
    assert every.stdout.count("file_missing") == n and "more" not in every.stdout
    doc = json.loads(run(tmp_path / "c", "--json").stdout)
    assert len(doc["checkpoints"][0]["problems"]) == 20
    assert doc["checkpoints"][0]["problems_left_out"] == n - 20
    assert doc["checkpoints"][0]["by_code"] == [
        {
            "code": "file_missing",
            "severity": "error",
            "count": n,
            "id_ranges": [[0, n - 1]],
            "id_ranges_left_out": 0,
        }
    ]
    doc = json.loads(run(tmp_path / "c", "--json", "--all").stdout)
    assert len(doc["checkpoints"][0]["problems"]) == n and doc["checkpoints"][0]["problems_left_out"] == 0


def test_verify_never_changes_its_input(rlinf_copy: Any) -> None:
    ckpt = rlinf_copy("nosave_window2_pkl/ckpt")
    before = tree_digest(ckpt)
    run(ckpt, "--deep", "--json")
    assert tree_digest(ckpt) == before


def test_quick_verify_answers_without_importing_torch() -> None:
    code = (
        "import sys\nfrom rbtool.cli import app\n"
        f"sys.argv = ['rbtool', 'verify', {str(FIXTURES / 'ranks')!r}, '--json']\n"
        "try:\n    app()\nexcept SystemExit as exc:\n    assert exc.code in (0, None), exc.code\n"
        "print('torch' in sys.modules, file=sys.stderr)"
    )
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    assert probe.stderr.strip() == "False"
    assert json.loads(probe.stdout)["ok"] is True


def test_docs_list_every_problem_code_and_json_key() -> None:
    text = DOC.read_text()
    assert re.search(r"^## rbtool verify\s*$", text, flags=re.M)
    rows = dict(re.findall(r"^\| `([a-z_]+)` \| (error|warning|notice) \|", text, flags=re.M))
    assert rows == {code: severity for code, (severity, _) in PROBLEM_CODES.items()}
    for key in (
        "path",
        "deep",
        "ok",
        "checkpoints",
        "size",
        "problems",
        "counts",
        "code",
        "severity",
        "trajectory_id",
        "file",
        "message",
    ):
        assert re.search(rf"`([a-z\[\]_]+\.)?{key}`", text), key
