"""Bounded outputs: summaries with left_out counts, --all, --jsonl, --pretty, and progress on stderr only."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from conftest import FIXTURES, assert_one_error, run
from rich.console import Console

from rbtool.cli import _app, _json, _options, _output, _progress
from rbtool.files.index import Index, write_index
from rbtool.format import trajectory_file_name

BIG = 200_000  # entries of the generated index (written directly, no trajectory file exists)
LIMIT = _options.SUMMARY_ITEMS
AUTOSAVE = FIXTURES / "autosave_pt" / "autosave"


def make_index(directory: Path, ids: list[int], weights: str = "v0") -> Index:
    """An index listing `ids` (T=4, B=2), written to `directory`; no trajectory file is created."""
    directory.mkdir(parents=True, exist_ok=True)
    index = Index(trajectory_format="pt", seed=7)
    for tid in ids:
        index.entries[tid] = {
            "num_samples": 8,
            "trajectory_id": tid,
            "max_episode_length": 4,
            "shape": [4, 2],
            "model_weights_id": weights,
        }
    index.id_list = list(ids)
    index.trajectory_counter = max(ids, default=-1) + 1
    write_index(directory, index)
    return index


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("outputs") / "big"
    make_index(path, list(range(BIG)))
    return path


def output(*args: str | Path, status: int = 0) -> Any:
    result = run(*args)
    assert result.exit_code == status, result.stderr
    return result


# ------------------------------------------------------------------ summaries
def test_stats_summary_of_a_large_index_is_small_and_counts_what_it_leaves_out(big: Path) -> None:
    result = output("stats", big, "--json")
    assert len(result.stdout) < 20_000
    doc = json.loads(result.stdout)
    assert doc["index"]["size"] == BIG
    assert doc["index"]["id_ranges"] == [[0, BIG - 1]] and doc["index"]["id_ranges_left_out"] == 0
    rows = doc["trajectories"]
    assert rows["id"] == list(range(LIMIT)) and rows["left_out"] == BIG - LIMIT
    assert all(len(col) == LIMIT for key, col in rows.items() if key != "left_out")
    assert rows["file"][3] == trajectory_file_name(3, "v0", "pt")
    files = doc["files"]
    assert files["missing"] == BIG and files["missing_ids"] == list(range(LIMIT))
    assert files["missing_ids_left_out"] == BIG - LIMIT
    assert files["missing_id_ranges"] == [[0, BIG - 1]] and files["missing_id_ranges_left_out"] == 0
    assert doc["model_weights"][0]["trajectories"] == BIG and doc["model_weights_left_out"] == 0


def test_verify_summary_of_a_large_index_is_small_and_counts_by_code(big: Path) -> None:
    result = output("verify", big, "--json", status=1)
    assert len(result.stdout) < 20_000
    (ckpt,) = json.loads(result.stdout)["checkpoints"]
    assert len(ckpt["problems"]) == LIMIT and ckpt["problems_left_out"] == BIG - LIMIT
    assert [p["trajectory_id"] for p in ckpt["problems"]] == list(range(LIMIT))
    (missing,) = [c for c in ckpt["by_code"] if c["code"] == "file_missing"]
    assert missing == {
        "code": "file_missing",
        "severity": "error",
        "count": BIG,
        "id_ranges": [[0, BIG - 1]],
        "id_ranges_left_out": 0,
    }


def test_runs_of_ids_are_cut_too_and_say_how_many_runs_are_left_out(tmp_path: Path) -> None:
    ids = list(range(0, 100, 2))  # 50 runs of one id each
    make_index(tmp_path / "c", ids)
    doc = json.loads(output("stats", tmp_path / "c", "--json").stdout)
    assert doc["index"]["id_ranges"] == [[i, i] for i in ids[:LIMIT]]
    assert doc["index"]["id_ranges_left_out"] == len(ids) - LIMIT
    assert doc["files"]["missing_id_ranges_left_out"] == len(ids) - LIMIT
    every = json.loads(output("stats", tmp_path / "c", "--json", "--all").stdout)
    assert every["index"]["id_ranges"] == [[i, i] for i in ids] and every["index"]["id_ranges_left_out"] == 0


def test_checkpoint_load_summarises_the_id_list_and_its_runs(tmp_path: Path) -> None:
    ids = [*range(30), *range(40, 60)]
    make_index(tmp_path / "c", ids)
    for tid in ids:
        (tmp_path / "c" / trajectory_file_name(tid, "v0", "pt")).write_bytes(
            b""
        )  # load only checks they exist
    doc = json.loads(output("checkpoint", "load", tmp_path / "c", "--json").stdout)
    assert doc["size"] == 50 and doc["trajectory_id_list"] == ids[:LIMIT]
    assert doc["trajectory_id_list_left_out"] == 30
    assert doc["trajectory_id_ranges"] == [[0, 29], [40, 59]] and doc["trajectory_id_ranges_left_out"] == 0
    ranks = json.loads(output("checkpoint", "load", tmp_path / "c", "-n", "2", "--json").stdout)["ranks"]
    assert [r["trajectory_id_list_left_out"] for r in ranks] == [5, 5]
    assert ranks[1]["trajectory_id_ranges"] == [[25, 29], [40, 59]]
    every = json.loads(output("checkpoint", "load", tmp_path / "c", "--json", "--all").stdout)
    assert every["trajectory_id_list"] == ids and every["trajectory_id_list_left_out"] == 0

    human = output("checkpoint", "load", tmp_path / "c").stdout
    assert "0-29, 40-59" in human


def test_non_strict_load_of_a_large_index_bounds_the_dropped_ids(big: Path) -> None:
    doc = json.loads(output("checkpoint", "load", big, "--non-strict", "--json").stdout)
    assert doc["size"] == 0 and doc["dropped_missing_ids"] == list(range(LIMIT))
    assert doc["dropped_missing_ids_left_out"] == BIG - LIMIT


def test_the_human_view_names_a_few_runs_and_how_many_ids_remain() -> None:
    ids = list(range(0, 200, 2))
    shown = _output.format_ids(ids, LIMIT)
    assert shown.startswith("0, 2, 4") and shown.endswith(
        f"... {len(ids) - LIMIT} more ids in {len(ids) - LIMIT} runs"
    )
    assert _output.format_ids(ids) == ", ".join(map(str, ids))
    assert _output.format_ids([3, 4, 5, 9]) == "3-5, 9"


# ------------------------------------------------------------------ --all and --jsonl
def test_stats_all_lists_every_trajectory_as_the_library_does(big: Path) -> None:
    from rbtool.ops.stats import collect_stats

    doc = json.loads(output("stats", big, "--json", "--all").stdout)
    library = collect_stats(big)
    assert doc["trajectories"]["left_out"] == 0 and doc["files"]["missing_ids_left_out"] == 0
    for key, column in library["trajectories"].items():
        assert doc["trajectories"][key] == column, key
    assert doc["files"]["missing_ids"] == library["files"]["missing_ids"]


def test_stats_jsonl_is_one_object_per_trajectory_and_complete(big: Path) -> None:
    result = output("stats", big, "--jsonl")
    lines = result.stdout.splitlines()
    assert len(lines) == BIG and result.stdout.endswith("\n")
    first, last = json.loads(lines[0]), json.loads(lines[-1])
    assert set(first) == {
        "path",
        "id",
        "T",
        "B",
        "num_samples",
        "model_weights_id",
        "file",
        "file_bytes",
        "exists",
        "in_window",
        "draw_probability",
    }
    assert (
        first["id"] == 0
        and last["id"] == BIG - 1
        and last["file"] == trajectory_file_name(BIG - 1, "v0", "pt")
    )
    assert last["exists"] is False and last["file_bytes"] == -1
    assert [json.loads(line)["id"] for line in lines[:1000]] == list(range(1000))


def test_stats_jsonl_of_a_real_checkpoint_agrees_with_the_columns() -> None:
    doc = json.loads(output("stats", AUTOSAVE, "--json").stdout)
    rows = [json.loads(line) for line in output("stats", AUTOSAVE, "--jsonl").stdout.splitlines()]
    columns = {key: col for key, col in doc["trajectories"].items() if key != "left_out"}
    assert rows == [
        {"path": str(AUTOSAVE), **dict(zip(columns, values, strict=True))}
        for values in zip(*columns.values(), strict=True)
    ]


def test_a_reader_that_stops_early_ends_the_command_quietly(big: Path) -> None:
    """`rbtool stats --jsonl | head -1`: no error line, and the status of a tool that SIGPIPE
    ended (141)."""
    argv = [sys.executable, "-m", "rbtool", "stats", str(big), "--index-only", "--jsonl"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # far more than a pipe holds is still to come
    stderr = proc.stderr.read()
    assert proc.wait(120) == _app.BROKEN_PIPE_STATUS, stderr
    assert json.loads(first)["id"] == 0
    assert stderr == b""


def test_stdout_closed_tells_a_pipe_nobody_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    read_end, write_end = os.pipe()
    with os.fdopen(write_end, "w") as writer:
        monkeypatch.setattr(sys, "stdout", writer)
        assert not _app.stdout_closed()  # read end open: a pipe in use
        os.close(read_end)
        assert _app.stdout_closed()


def test_verify_jsonl_is_one_object_per_problem_and_complete(big: Path) -> None:
    result = output("verify", big, "--jsonl", status=1)
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    everything = json.loads(output("verify", big, "--json", "--all", status=1).stdout)["checkpoints"][0]
    assert len(rows) == len(everything["problems"]) >= BIG
    assert rows[0] == {"path": str(big), "checkpoint": str(big), **everything["problems"][0]}
    assert [r["trajectory_id"] for r in rows if r["code"] == "file_missing"] == list(range(BIG))
    assert result.stderr.startswith("Error: ")  # the verdict still goes to stderr, exit 1


def test_checkpoint_load_jsonl_lists_each_rank_block() -> None:
    rows = [
        json.loads(x)
        for x in output("checkpoint", "load", AUTOSAVE, "-n", "2", "--jsonl").stdout.splitlines()
    ]
    assert [(r["rank"], r["trajectory_id"]) for r in rows] == [(0, 0), (0, 1), (0, 2), (1, 3), (1, 4)]
    assert rows[0]["file"].startswith("trajectory_0_") and rows[0]["num_samples"] == 8
    full = [json.loads(x) for x in output("checkpoint", "load", AUTOSAVE, "--jsonl").stdout.splitlines()]
    assert [r["rank"] for r in full] == [None] * 5


# ------------------------------------------------------------------ --pretty, usage errors
@pytest.mark.parametrize(
    "args",
    [["stats", str(AUTOSAVE)], ["verify", str(AUTOSAVE)], ["checkpoint", "load", str(AUTOSAVE)], ["version"]],
)
def test_json_is_compact_unless_pretty(args: list[str]) -> None:
    compact = output(*args, "--json").stdout
    pretty = output(*args, "--json", "--pretty").stdout
    assert compact.count("\n") == 1 and compact.endswith("\n") and not compact.startswith("{\n")
    assert pretty.startswith('{\n  "') and pretty.count("\n") >= 3
    assert without_timings(json.loads(pretty)) == without_timings(json.loads(compact))


def without_timings(doc: Any) -> Any:
    """A document without what a second run measures differently."""
    if isinstance(doc, dict):
        return {k: without_timings(v) for k, v in doc.items() if k not in ("seconds", "bytes_per_second")}
    if isinstance(doc, list):
        return [without_timings(v) for v in doc]
    return doc


@pytest.mark.parametrize(
    "args",
    [
        ["stats", str(AUTOSAVE), "--json", "--jsonl"],
        ["stats", str(AUTOSAVE), "--pretty"],
        ["stats", str(AUTOSAVE), "--jsonl", "--sample-draws", "10"],
        ["verify", str(AUTOSAVE), "--jsonl", "--json"],
        ["checkpoint", "load", str(AUTOSAVE), "--pretty", "--jsonl"],
        ["shard", str(AUTOSAVE), "-n", "2", "--out", "/nonexistent/x", "--pretty"],
    ],
)
def test_output_options_that_contradict_are_usage_errors(args: list[str]) -> None:
    result = run(*args)
    assert result.exit_code == 2 and result.stdout == ""


def test_the_streamed_document_is_the_one_orjson_writes(capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    from rbtool.ops.stats import LazyColumn

    n = 3 * 65536 + 5  # several blocks of the writer, and a short last one
    values = np.arange(n, dtype=np.int64)
    probs = np.linspace(0, 1, n)
    doc = {
        "a": {"ids": values, "p": probs, "flags": values % 3 == 0, "names": LazyColumn(n, lambda i: f"t{i}")},
        "rows": [{"x": [1, 2]}, {"y": None}],
        "nan": float("nan"),
        "empty": [],
    }
    _json.print_json(doc)
    plain = {
        "a": {
            "ids": values.tolist(),
            "p": probs.tolist(),
            "flags": (values % 3 == 0).tolist(),
            "names": [f"t{i}" for i in range(n)],
        },
        "rows": [{"x": [1, 2]}, {"y": None}],
        "nan": None,
        "empty": [],
    }
    assert capsysbinary.readouterr().out == orjson.dumps(plain) + b"\n"


# ------------------------------------------------------------------ progress
@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """stderr as a terminal, so that progress bars show (they go wherever sys.stderr goes)."""
    monkeypatch.setattr(_progress, "err", Console(stderr=True, force_terminal=True, width=120))


def test_progress_goes_to_stderr_only(terminal: None, tmp_path: Path) -> None:
    result = output("stats", AUTOSAVE)
    assert "reading trajectories" in result.stderr or "looking at trajectory files" in result.stderr
    assert "eta" in result.stderr and "reading trajectories" not in result.stdout
    deep = output("verify", AUTOSAVE, "--deep", "--jobs", "1")
    assert "loading trajectory files" in deep.stderr and "loading" not in deep.stdout
    saved = output("checkpoint", "save", AUTOSAVE, tmp_path / "s", "--mode", "in-memory")
    assert "trajectory files" in saved.stderr and "trajectory files" not in saved.stdout


def test_sample_names_its_phases_on_stderr(terminal: None, tmp_path: Path) -> None:
    result = output("sample", AUTOSAVE, "--num-chunks", "4", "--out", tmp_path / "b.pt")
    assert "reading the index" in result.stderr and "reading the index" not in result.stdout
    assert output("sample", AUTOSAVE, "--num-chunks", "4", "--json").stderr == ""


def test_no_progress_with_json_or_jsonl_even_at_a_terminal(terminal: None) -> None:
    for extra in ("--json", "--jsonl"):
        result = output("stats", AUTOSAVE, extra)
        assert result.stderr == ""
        assert output("verify", AUTOSAVE, "--deep", "--jobs", "1", extra).stderr == ""


def test_an_advance_reports_phases_with_totals() -> None:
    class Recorder:
        def __init__(self) -> None:
            self.calls: list[Any] = []

        def reset(self, task: Any, **changes: Any) -> None:
            self.calls.append(("start", changes["total"], changes.get("description")))

        def advance(self, task: Any, n: int) -> None:
            self.calls.append(("advance", n))

    recorder = Recorder()
    advance = _progress.Advance(recorder, 0)
    from rbtool.ops.stats import collect_stats

    collect_stats(AUTOSAVE, progress=advance)
    starts = [c for c in recorder.calls if c[0] == "start"]
    assert starts == [("start", 5, "looking at trajectory files"), ("start", 5, "reading trajectories")]
    assert sum(c[1] for c in recorder.calls if c[0] == "advance") == 10


def test_stats_still_refuses_a_file_that_leaves_the_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "c"
    shutil.copytree(AUTOSAVE, ckpt)
    victim = sorted(ckpt.glob("trajectory_2_*.pt"))[0]
    outside = tmp_path / "elsewhere.pt"
    victim.rename(outside)
    victim.symlink_to(outside)
    result = run("stats", ckpt, "--json")
    assert_one_error(result)
    assert "outside the checkpoint" in result.stderr


def test_a_plain_progress_callback_counts_only_files() -> None:
    from rbtool.ops.verify import verify

    seen: list[int] = []
    verify(AUTOSAVE, deep=True, jobs=1, progress=seen.append)
    assert seen == [1] * 5
