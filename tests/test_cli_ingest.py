"""`rbtool ingest`: ids continue, batches are announced on stderr, bad input changes nothing."""

from __future__ import annotations

import importlib
import json
import os
import pickle
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_one_error, make_traj, run, run_json, staging_left, tree_digest

from rbtool import read_index
from rbtool.files import trajfile
from rbtool.files.fsutil import DirLock
from rbtool.format import layout

ADDED_RE = re.compile(r"^added trajectory ids (\d+)(?:-(\d+))?$")


def announced_ids(stderr: str) -> list[int]:
    """Ids named by the `added trajectory ids` lines; every such line must have the exact shape."""
    ids: list[int] = []
    for line in stderr.splitlines():
        if line.startswith("added"):
            match = ADDED_RE.match(line)
            assert match, line
            first = int(match.group(1))
            last = int(match.group(2)) if match.group(2) else first
            assert last > first or match.group(2) is None, line
            ids.extend(range(first, last + 1))
    return ids


def test_ingest_files_assigns_ids_and_reports_json(tmp_path: Path, five_files: list[Path]) -> None:
    buffer = tmp_path / "buf"
    result = run("ingest", *five_files, "--buffer", buffer, "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["buffer"] == str(buffer)
    assert doc["added"] == 5
    assert doc["trajectory_ids"] == [0, 1, 2, 3, 4]
    assert doc["size"] == 5
    assert doc["total_samples"] == 5 * 4 * 2
    assert doc["trajectory_counter"] == 5
    assert doc["trajectory_format"] == "pt"
    sizes = sum(p.stat().st_size for p in five_files)
    assert doc["files"]["linked"] + doc["files"]["copied"] == 5
    assert doc["files"]["written"] == 0 and doc["files"]["bytes"] == sizes
    assert doc["removed_leftovers"] == []
    assert announced_ids(result.stderr) == [0, 1, 2, 3, 4]

    index = read_index(buffer)
    assert index.id_list == [0, 1, 2, 3, 4]
    for tid, src in enumerate(five_files):
        assert (buffer / index.file_name(tid)).read_bytes() == src.read_bytes()
        assert index.entries[tid]["model_weights_id"] == f"v{tid}"


def test_ids_continue_and_single_id_line(tmp_path: Path, five_files: list[Path]) -> None:
    buffer = tmp_path / "buf"
    run_json("ingest", *five_files[:3], "--buffer", buffer)
    result = run("ingest", five_files[3], "--buffer", buffer)
    assert result.exit_code == 0, result.stderr
    assert "added trajectory ids 3" in result.stderr.splitlines()
    assert "ingest into" in result.stdout and "trajectory counter" in result.stdout
    doc = run_json("ingest", five_files[4], five_files[0], "--buffer", buffer)
    assert doc["trajectory_ids"] == [4]  # file 0 is in the buffer already: skipped, counted
    assert doc["duplicates"] == 1 and doc["skipped"] == [
        {"source": str(five_files[0]), "reason": "already in the buffer as id 0"}
    ]
    assert doc["size"] == 5 and doc["trajectory_counter"] == 5
    doc = run_json("ingest", five_files[0], "--buffer", buffer, "--allow-duplicates")
    assert doc["trajectory_ids"] == [5] and doc["duplicates"] == 0
    assert doc["size"] == 6 and doc["trajectory_counter"] == 6


def test_ingest_checkpoint_directory_keeps_its_order(tmp_path: Path, five_files: list[Path]) -> None:
    first = tmp_path / "first"
    run_json("ingest", *reversed(five_files), "--buffer", first)
    second = tmp_path / "second"
    doc = run_json("ingest", five_files[0], first, "--buffer", second, "--allow-duplicates")
    assert doc["trajectory_ids"] == [0, 1, 2, 3, 4, 5]
    index = read_index(second)
    weights = [index.entries[i]["model_weights_id"] for i in index.id_list]
    assert weights == ["v0", "v4", "v3", "v2", "v1", "v0"]
    assert len({index.entries[i]["uuid"] for i in index.id_list}) == 6  # uuids stay unique


def test_ingest_as_pkl_converts_and_keeps_tensors(tmp_path: Path, five_files: list[Path]) -> None:
    buffer = tmp_path / "buf"
    doc = run_json("ingest", *five_files[:2], "--buffer", buffer, "--format", "pkl")
    assert doc["trajectory_format"] == "pkl" and doc["files"]["written"] == 2
    index = read_index(buffer)
    for tid, src in enumerate(five_files[:2]):
        got = dict(layout.iter_tensors(trajfile.load(buffer / index.file_name(tid))))
        want = dict(layout.iter_tensors(trajfile.load(src)))
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
    # An existing pkl buffer keeps its format; asking for another one is a usage error.
    assert_one_error(run("ingest", five_files[2], "--buffer", buffer, "--format", "pt"), status=2)


def test_removes_what_an_interrupted_writer_left(tmp_path: Path, five_files: list[Path]) -> None:
    buffer = tmp_path / "buf"
    run_json("ingest", *five_files[:2], "--buffer", buffer)
    (buffer / ".trajectory_2_v2.pt.0123.tmp").write_bytes(b"partial")
    (buffer / "trajectory_2_v2.pt").write_bytes(b"unlisted")
    doc = run_json("ingest", five_files[2], "--buffer", buffer)
    assert sorted(doc["removed_leftovers"]) == [".trajectory_2_v2.pt.0123.tmp", "trajectory_2_v2.pt"]
    assert doc["trajectory_ids"] == [2]
    assert (buffer / "trajectory_2_v2.pt").read_bytes() == five_files[2].read_bytes()


def test_waits_for_a_locked_directory(tmp_path: Path, five_files: list[Path], monkeypatch: Any) -> None:
    buffer = tmp_path / "buf"
    buffer.mkdir()
    holder = DirLock(buffer)
    holder.acquire()
    waiting = threading.Event()

    class SignallingLock(DirLock):
        """Tells the test when ingest starts waiting, so the holder lets go only then."""

        def __init__(self, directory: Path, **kwargs: Any) -> None:
            on_wait = kwargs.pop("on_wait")

            def signal(who: str) -> None:
                on_wait(who)
                waiting.set()

            super().__init__(directory, on_wait=signal, **kwargs)

    def release_when_waited_on() -> None:
        waiting.wait(timeout=30)
        holder.release()

    monkeypatch.setattr(importlib.import_module("rbtool.files.writer"), "DirLock", SignallingLock)
    releaser = threading.Thread(target=release_when_waited_on)
    releaser.start()
    try:
        result = run("ingest", five_files[0], "--buffer", buffer)
    finally:
        holder.release()
        releaser.join()
    assert result.exit_code == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines.count(f"waiting for {buffer} (locked by pid {os.getpid()})") == 1
    assert announced_ids(result.stderr) == [0]


# ------------------------------------------------------------------ bad input
def truncated(tmp_path: Path, five_files: list[Path]) -> Path:
    path = tmp_path / "bad" / "truncated.pt"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(five_files[0].read_bytes()[:700])
    return path


def unsafe_id(weights_id: str) -> Any:
    def make(tmp_path: Path, five_files: list[Path]) -> Path:
        path = tmp_path / "bad" / "unsafe_id.pt"
        path.parent.mkdir(exist_ok=True)
        torch.save(make_traj(seed=7, model_weights_id=weights_id), path)
        return path

    return make


@pytest.mark.parametrize("make_bad", [truncated, unsafe_id("../evil"), unsafe_id("a/b")])
def test_bad_file_into_new_buffer_leaves_nothing(
    tmp_path: Path, five_files: list[Path], make_bad: Any
) -> None:
    bad = make_bad(tmp_path, five_files)
    before = tree_digest(tmp_path)
    buffer = tmp_path / "new" / "buf"
    result = run("ingest", five_files[0], bad, "--buffer", buffer)
    assert_one_error(result)
    assert str(bad) in result.stderr
    assert not buffer.parent.exists()
    assert tree_digest(tmp_path) == before
    assert not list(tmp_path.rglob("evil*"))


@pytest.mark.parametrize("make_bad", [truncated, unsafe_id("../evil"), unsafe_id("a/b")])
def test_bad_file_into_existing_buffer_changes_nothing(
    tmp_path: Path, five_files: list[Path], make_bad: Any
) -> None:
    buffer = tmp_path / "buf"
    run_json("ingest", *five_files[:2], "--buffer", buffer)
    bad = make_bad(tmp_path, five_files)
    before = tree_digest(tmp_path)
    assert_one_error(run("ingest", five_files[2], bad, "--buffer", buffer, "--json"))
    assert tree_digest(tmp_path) == before
    assert read_index(buffer).id_list == [0, 1]


class RunsCode:
    """Unpickling this would run a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_pickle_that_runs_code_is_refused(tmp_path: Path, five_files: list[Path]) -> None:
    marker = tmp_path / "pwned"
    evil = tmp_path / "bad" / "trajectory_0_x.pkl"
    evil.parent.mkdir()
    traj = make_traj(seed=1, model_weights_id="x")
    traj["rewards"] = RunsCode(marker)
    evil.write_bytes(pickle.dumps(traj))
    buffer = tmp_path / "buf"
    run_json("ingest", five_files[0], "--buffer", buffer, "--format", "pkl")
    before = tree_digest(tmp_path)
    result = run("ingest", evil, "--buffer", buffer)
    assert_one_error(result)
    assert "refused" in result.stderr
    assert not marker.exists()
    assert tree_digest(tmp_path) == before
    assert_one_error(run("ingest", evil, "--buffer", tmp_path / "fresh"))
    assert not marker.exists() and not (tmp_path / "fresh").exists()
    assert staging_left(tmp_path) == []


def test_missing_source_is_an_input_error(tmp_path: Path) -> None:
    result = run("ingest", tmp_path / "nope.pt", "--buffer", tmp_path / "buf")
    assert_one_error(result)
    assert "nope.pt" in result.stderr
    assert not (tmp_path / "buf").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["ingest", "x.pt"],  # no --buffer
        ["ingest", "--buffer", "buf"],  # no source
        ["ingest", "x.pt", "--buffer", "buf", "--format", "npz"],
    ],
)
def test_usage_errors_exit_2(tmp_path: Path, args: list[str], monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    result = run(*args)
    assert result.exit_code == 2, result.stderr
    assert result.stdout == ""
    assert not (tmp_path / "buf").exists()
