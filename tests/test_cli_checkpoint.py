"""`rbtool checkpoint save` / `load`: the seed example, auto-save windows, the reference fixtures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    FIXTURES,
    RLINF_DIRS,
    assert_one_error,
    make_traj,
    run,
    run_json,
    staging_left,
    tree_digest,
)

from rbtool import read_index
from rbtool.files import trajfile
from rbtool.format import layout


def samples_of(paths: list[Path]) -> int:
    return sum(layout.describe(trajfile.load(p), str(p)).num_samples for p in paths)


# ------------------------------------------------------------- seed example
@pytest.mark.parametrize("fmt", ["pt", "pkl"])
def test_seed_example_in_memory_window_2(tmp_path: Path, five_files: list[Path], fmt: str) -> None:
    out = tmp_path / "ckpt"
    doc = run_json(
        "checkpoint", "save", *five_files, out, "--mode", "in-memory", "--window", "2", "--format", fmt
    )
    assert doc["mode"] == "in-memory" and doc["out"] == str(out) and doc["window"] == 2
    assert doc["trajectory_id_list"] == [3, 4]
    assert doc["size"] == 2
    assert doc["total_samples"] == samples_of(five_files[3:])
    assert doc["trajectory_counter"] == 5
    assert doc["trajectory_format"] == fmt
    assert set(doc["files"]) == {"reflinked", "linked", "copied", "written", "bytes"}
    assert doc["files"]["written"] == (2 if fmt == "pkl" else 0)

    index = read_index(out)
    assert index.state() == {
        k: doc[k] for k in ("size", "total_samples", "trajectory_counter", "trajectory_id_list")
    }
    names = sorted(
        p.name for p in out.iterdir() if p.name.startswith("trajectory_") and "index" not in p.name
    )
    assert names == [f"trajectory_3_v3.{fmt}", f"trajectory_4_v4.{fmt}"]
    for tid in (3, 4):
        got = dict(layout.iter_tensors(trajfile.load(out / index.file_name(tid))))
        want = dict(layout.iter_tensors(make_traj(seed=tid, model_weights_id=f"v{tid}")))
        assert got.keys() == want.keys()
        for key, tensor in want.items():
            assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key

    for rank, ids in ((0, [3]), (1, [4])):
        loaded = run_json("checkpoint", "load", out, "--world-size", "2", "--rank", str(rank))
        assert loaded["trajectory_id_list"] == ids
        assert loaded["size"] == 1 and loaded["trajectory_counter"] == ids[0] + 1
        assert loaded["world_size"] == 2 and loaded["rank"] == rank and loaded["restored_to"] is None
    full = run_json("checkpoint", "load", out)
    assert full["trajectory_id_list"] == [3, 4] and full["trajectory_counter"] == 5
    assert full["world_size"] is None and full["rank"] is None and full["strict"] is True

    buffer = tmp_path / "buf"
    restored = run_json("checkpoint", "load", out, "--buffer", buffer)
    assert restored["restored_to"] == str(buffer)
    extra = tmp_path / "extra.pt"
    torch.save(make_traj(seed=9, model_weights_id="v9"), extra)
    added = run_json("ingest", extra, "--buffer", buffer)
    assert added["trajectory_ids"] == [5]
    assert read_index(buffer).id_list == [3, 4, 5]
    assert (buffer / f"trajectory_5_v9.{fmt}").is_file()


def test_load_all_ranks_at_once(tmp_path: Path, five_files: list[Path]) -> None:
    out = tmp_path / "ckpt"
    run_json("checkpoint", "save", *five_files, out, "--window", "0")
    doc = run_json("checkpoint", "load", out, "--world-size", "3")
    assert "trajectory_id_list" not in doc
    assert [r["rank"] for r in doc["ranks"]] == [0, 1, 2]
    assert [r["trajectory_id_list"] for r in doc["ranks"]] == [[0, 1], [2, 3], [4]]
    assert [r["trajectory_counter"] for r in doc["ranks"]] == [2, 4, 5]
    result = run("checkpoint", "load", out, "--world-size", "3")
    assert result.exit_code == 0 and "rank 2" in result.stdout


def test_restore_one_rank(tmp_path: Path, five_files: list[Path]) -> None:
    out = tmp_path / "ckpt"
    run_json("checkpoint", "save", *five_files, out, "--window", "0")
    buffer = tmp_path / "buf"
    doc = run_json("checkpoint", "load", out, "--world-size", "2", "--rank", "1", "--buffer", buffer)
    assert doc["trajectory_id_list"] == [3, 4] and doc["restored_to"] == str(buffer)
    assert read_index(buffer).state() == {
        k: doc[k] for k in ("size", "total_samples", "trajectory_counter", "trajectory_id_list")
    }


# ------------------------------------------------------ auto_save on, windows
@pytest.fixture
def autosave_dir(tmp_path: Path, five_files: list[Path]) -> Path:
    buffer = tmp_path / "buf"
    run_json("ingest", *five_files, "--buffer", buffer)
    return buffer


def test_auto_save_window_3(tmp_path: Path, autosave_dir: Path) -> None:
    before = tree_digest(autosave_dir)
    doc = run_json("checkpoint", "save", autosave_dir, tmp_path / "out", "--window", "3")
    assert doc["mode"] == "auto-save"
    assert doc["trajectory_id_list"] == [2, 3, 4]
    assert doc["size"] == 3 and doc["trajectory_counter"] == 5
    full = read_index(autosave_dir)
    assert doc["total_samples"] == sum(full.entries[i]["num_samples"] for i in (2, 3, 4))
    assert full.id_list == [0, 1, 2, 3, 4]
    assert tree_digest(autosave_dir) == before
    saved = read_index(tmp_path / "out")
    assert saved.id_list == [2, 3, 4]
    for tid in saved.id_list:
        name = saved.file_name(tid)
        assert (tmp_path / "out" / name).read_bytes() == (autosave_dir / name).read_bytes()


@pytest.mark.parametrize("window", [0, 10])
def test_auto_save_window_covering_everything(tmp_path: Path, autosave_dir: Path, window: int) -> None:
    doc = run_json(
        "checkpoint", "save", autosave_dir, tmp_path / "out", "--window", str(window), "--mode", "auto-save"
    )
    assert doc["trajectory_id_list"] == [0, 1, 2, 3, 4]
    assert doc["size"] == 5 and doc["total_samples"] == 40 and doc["trajectory_counter"] == 5


def test_auto_mode_picks_in_memory_for_files(
    tmp_path: Path, five_files: list[Path], autosave_dir: Path
) -> None:
    doc = run_json("checkpoint", "save", five_files[0], five_files[1], tmp_path / "a", "--window", "1")
    assert doc["mode"] == "in-memory" and doc["trajectory_id_list"] == [1] and doc["trajectory_counter"] == 2
    # A buffer directory fed as one source of an in-memory save is read in its list order.
    doc = run_json("checkpoint", "save", autosave_dir, tmp_path / "b", "--mode", "in-memory", "--seed", "7")
    assert doc["mode"] == "in-memory" and doc["trajectory_id_list"] == [0, 1, 2, 3, 4]
    assert read_index(tmp_path / "b").seed == 7


def test_out_exists_needs_force(tmp_path: Path, autosave_dir: Path) -> None:
    out = tmp_path / "out"
    run_json("checkpoint", "save", autosave_dir, out, "--window", "1")
    before = tree_digest(out)
    assert_one_error(run("checkpoint", "save", autosave_dir, out, "--window", "2", "--json"))
    assert tree_digest(out) == before
    doc = run_json("checkpoint", "save", autosave_dir, out, "--window", "2", "--force")
    assert doc["trajectory_id_list"] == [3, 4] and read_index(out).id_list == [3, 4]
    # --force never replaces a directory that is not a checkpoint.
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert_one_error(run("checkpoint", "save", autosave_dir, other, "--force"))
    assert (other / "keep.txt").read_text() == "mine" and len(list(other.iterdir())) == 1
    assert staging_left(tmp_path) == []


def test_human_views(tmp_path: Path, autosave_dir: Path) -> None:
    result = run("checkpoint", "save", autosave_dir, tmp_path / "out", "--window", "2")
    assert result.exit_code == 0 and result.stderr == ""
    assert "auto-save" in result.stdout and "3-4" in result.stdout
    result = run("checkpoint", "load", tmp_path / "out", "--world-size", "2", "--rank", "0")
    assert result.exit_code == 0 and "rank 0" in result.stdout and result.stderr == ""


# ------------------------------------------------------- reference fixtures
def expected_of(rel: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{rel}.expected.json").read_text())


@pytest.mark.parametrize("rel", RLINF_DIRS)
def test_reference_fixture_loads(rel: str) -> None:
    expected = expected_of(rel)
    nosave = "nosave_window2" in rel
    view = expected["consistent_view"] if nosave else expected
    flags = ["--non-strict"] if nosave else []
    dropped = expected["consistent_view"]["missing_trajectory_ids"] if nosave else []
    ckpt = FIXTURES / rel

    full = run_json("checkpoint", "load", ckpt, *flags)
    assert {k: full[k] for k in view["full_load"]} == view["full_load"]
    assert full["dropped_missing_ids"] == dropped and full["strict"] is not nosave
    for ws in ("2", "3"):
        together = run_json("checkpoint", "load", ckpt, "--world-size", ws, *flags)
        want_ranks = view["distributed_load"][ws]
        assert [
            {k: r[k] for k in w} for r, w in zip(together["ranks"], want_ranks, strict=True)
        ] == want_ranks
        for rank, want in enumerate(view["distributed_load"][ws]):
            one = run_json("checkpoint", "load", ckpt, "--world-size", ws, "--rank", str(rank), *flags)
            assert {k: one[k] for k in want} == want


@pytest.mark.parametrize("rel", [r for r in RLINF_DIRS if "nosave_window2" in r])
def test_strict_load_of_nosave_names_missing_ids(rel: str, tmp_path: Path) -> None:
    result = run("checkpoint", "load", FIXTURES / rel)
    assert_one_error(result)
    assert "0, 1, 2" in result.stderr
    buffer = tmp_path / "buf"
    assert_one_error(run("checkpoint", "load", FIXTURES / rel, "--buffer", buffer))
    assert not buffer.exists() and staging_left(tmp_path) == []


def test_restore_nosave_fixture_non_strict_continues_ids(rlinf_copy: Any, tmp_path: Path) -> None:
    ckpt = rlinf_copy("nosave_window2_pkl/ckpt")
    before = tree_digest(ckpt)
    buffer = tmp_path / "buf"
    doc = run_json("checkpoint", "load", ckpt, "--non-strict", "--buffer", buffer)
    assert doc["trajectory_id_list"] == [3, 4] and doc["dropped_missing_ids"] == [0, 1, 2]
    assert tree_digest(ckpt) == before
    extra = tmp_path / "extra.pt"
    torch.save(make_traj(seed=11, model_weights_id="w"), extra)
    assert run_json("ingest", extra, "--buffer", buffer)["trajectory_ids"] == [5]
    assert (buffer / "trajectory_5_w.pkl").is_file()


# ----------------------------------------------------------- index-only load
NO_TORCH = """
import runpy, sys
sys.argv = ["rbtool", *sys.argv[1:]]
try:
    runpy.run_module("rbtool", run_name="__main__")
except SystemExit as exc:
    if exc.code:
        raise
if "torch" in sys.modules:
    sys.exit("torch was imported")
"""


def run_without_torch(*args: str | Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", NO_TORCH, *map(str, args), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_load_and_restore_do_not_import_torch(rlinf_copy: Any, tmp_path: Path) -> None:
    ckpt = rlinf_copy("nosave_window2_pt/ckpt")
    doc = run_without_torch("checkpoint", "load", ckpt, "--non-strict", "--world-size", "2")
    assert [r["trajectory_id_list"] for r in doc["ranks"]] == [[3], [4]]
    doc = run_without_torch("checkpoint", "load", ckpt, "--non-strict", "--buffer", tmp_path / "buf")
    assert doc["restored_to"] == str(tmp_path / "buf") and read_index(tmp_path / "buf").id_list == [3, 4]


# ------------------------------------------------------------------ bad input
def test_invalid_metadata_json(rlinf_copy: Any, tmp_path: Path) -> None:
    ckpt = rlinf_copy("autosave_pt/autosave")
    (ckpt / "metadata.json").write_text('{"size": 5,')
    before = tree_digest(ckpt)
    result = run("checkpoint", "load", ckpt, "--json")
    assert_one_error(result)
    assert "metadata.json" in result.stderr
    assert_one_error(run("checkpoint", "load", ckpt, "--buffer", tmp_path / "buf"))
    assert_one_error(run("checkpoint", "save", ckpt, tmp_path / "out", "--window", "2"))
    assert not (tmp_path / "buf").exists() and not (tmp_path / "out").exists()
    assert staging_left(tmp_path) == []
    assert tree_digest(ckpt) == before


def test_index_naming_a_missing_file(rlinf_copy: Any, tmp_path: Path) -> None:
    ckpt = rlinf_copy("autosave_pt/autosave")
    next(ckpt.glob("trajectory_2_*.pt")).unlink()
    before = tree_digest(ckpt)
    result = run("checkpoint", "load", ckpt)
    assert_one_error(result)
    assert "ids 2" in result.stderr
    out = tmp_path / "out"
    assert_one_error(run("checkpoint", "save", ckpt, out, "--window", "0"))
    assert_one_error(run("checkpoint", "save", ckpt, out, "--mode", "in-memory"))
    assert not out.exists() and staging_left(tmp_path) == [] and staging_left(ckpt.parent) == []
    assert tree_digest(ckpt) == before
    # The window of an auto-save buffer may leave the missing file out; non-strict load drops it.
    assert run_json("checkpoint", "load", ckpt, "--non-strict")["dropped_missing_ids"] == [2]


def test_bad_trajectory_file_in_memory_save(tmp_path: Path, five_files: list[Path]) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(five_files[0].read_bytes()[:600])
    out = tmp_path / "out"
    assert_one_error(run("checkpoint", "save", five_files[0], bad, out, "--json"))
    assert not out.exists() and staging_left(tmp_path) == []


@pytest.mark.parametrize(
    "args",
    [
        ["checkpoint", "load", "CKPT", "--rank", "0"],
        ["checkpoint", "load", "CKPT", "--world-size", "2", "--rank", "2"],
        ["checkpoint", "load", "CKPT", "--world-size", "0"],
        ["checkpoint", "load", "CKPT", "--world-size", "2", "--buffer", "BUF"],
        ["checkpoint", "load", "CKPT", "--buffer", "CKPT/inner"],
        ["checkpoint", "save", "CKPT"],
        ["checkpoint", "save", "CKPT", "OUT", "--window", "-1"],
        ["checkpoint", "save", "CKPT", "OUT", "--mode", "sideways"],
        ["checkpoint", "save", "CKPT", "OUT", "--format", "npz"],
        ["checkpoint", "save", "CKPT", "OUT", "--format", "pkl"],  # auto-save keeps the buffer's format
        ["checkpoint", "save", "CKPT", "OUT", "--seed", "3"],  # seed is for in-memory saves
        ["checkpoint", "save", "CKPT", "CKPT", "--force"],
        ["checkpoint", "save", "CKPT", "CKPT/inner"],
    ],
)
def test_usage_errors_exit_2(rlinf_copy: Any, tmp_path: Path, args: list[str]) -> None:
    ckpt = rlinf_copy("autosave_pt/autosave")
    before = tree_digest(tmp_path)
    subst = {"CKPT": str(ckpt), "OUT": str(tmp_path / "out"), "BUF": str(tmp_path / "buf")}
    result = run(*[subst.get(a, a.replace("CKPT", str(ckpt))) for a in args])
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    assert tree_digest(tmp_path) == before
    assert not (tmp_path / "out").exists() and not (tmp_path / "buf").exists()
