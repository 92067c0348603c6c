"""model_weights_ids RLinf writes (spaces, `+`, `:`, `=`, non-ASCII) are accepted on every
path; only what could make a file name leave its directory is refused, and names are printed
escaped."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import assert_one_error, make_traj, run, run_json

from rbtool import TrajectoryReplayBuffer, read_index
from rbtool.errors import InvalidTrajectoryError
from rbtool.format.names import (
    WEIGHTS_ID_BYTES,
    parse_trajectory_file_name,
    trajectory_file_name,
    weights_id_problem,
)

ACCEPTED = [
    "",
    "87a64d8e-0f54-5c7c-a19d-0b3753cad97c",
    "policy v1+run:3",
    "ckpt=7,step=9",
    "naïve",
    "策略_v2",
    "a..b",
    "...",
    ".hidden",
    "x.pt",
    "3_4",
    "tab\there",
    "[bold]markup",
    "é" * (WEIGHTS_ID_BYTES // 2),  # 202 bytes of UTF-8
]
REFUSED = {
    ".": "directory name",
    "..": "directory name",
    "../evil": "path separator",
    "a/b": "path separator",
    "/abs": "path separator",
    "a\\..\\b": "path separator",
    "nul\x00byte": "NUL",
    "\ud800": "not valid Unicode",
    "é" * (WEIGHTS_ID_BYTES // 2) + "a": "203 bytes",
    "x" * 300: "300 bytes",
}
# what a terminal would act on: escape sequences, C0/C1 controls, bidi overrides
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


@pytest.mark.parametrize("mwid", ACCEPTED)
def test_one_safe_path_component_is_accepted_and_round_trips_through_its_file_name(mwid: str) -> None:
    assert weights_id_problem(mwid) is None
    for tid in (0, 17, 2**63 - 1):
        for fmt in ("pt", "pkl"):
            name = trajectory_file_name(tid, mwid, fmt)
            assert "/" not in name and len(name.encode()) <= 255 - 18  # its temporary name fits too
            assert parse_trajectory_file_name(name) == (tid, mwid, fmt)


@pytest.mark.parametrize("mwid", list(REFUSED))
def test_what_could_leave_the_directory_is_refused_saying_why(mwid: str) -> None:
    problem = weights_id_problem(mwid)
    assert problem is not None and REFUSED[mwid] in problem
    with pytest.raises(InvalidTrajectoryError, match="model_weights_id"):
        TrajectoryReplayBuffer().add_trajectories([make_traj(model_weights_id=mwid)])


def test_names_no_writer_makes_are_strays() -> None:
    assert parse_trajectory_file_name("trajectory_0_...pt") is None  # model_weights_id ".."
    assert parse_trajectory_file_name("trajectory_0_..pkl") is None  # "."
    assert parse_trajectory_file_name("trajectory_x_a.pt") is None
    assert parse_trajectory_file_name("trajectory_1_a b.pt") == (1, "a b", "pt")


IDS = ["policy v1+run:3", "ckpt=7,step=9", "naïve"]


def rlinf_checkpoint(path: Path) -> Path:
    """A checkpoint laid out as RLinf writes it, with ids rbtool refused before 0.3."""
    path.mkdir()
    entries = {}
    for tid, mwid in enumerate(IDS):
        traj = make_traj(seed=tid, model_weights_id=mwid)
        torch.save(traj, path / f"trajectory_{tid}_{mwid}.pt")  # RLinf's name, spelled as RLinf does
        entries[str(tid)] = {
            "num_samples": 8,
            "trajectory_id": tid,
            "max_episode_length": 4,
            "shape": [4, 2, 7],
            "model_weights_id": mwid,
        }
    index = {"trajectory_index": entries, "trajectory_id_list": list(range(len(IDS)))}
    (path / "trajectory_index.json").write_text(json.dumps(index))
    meta = {"trajectory_format": "pt", "size": 3, "total_samples": 24, "trajectory_counter": 3, "seed": 1234}
    (path / "metadata.json").write_text(json.dumps(meta))
    return path


def test_a_checkpoint_rlinf_wrote_with_such_ids_loads_samples_and_saves(tmp_path: Path) -> None:
    ckpt = rlinf_checkpoint(tmp_path / "ckpt")
    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    buffer.load_checkpoint(ckpt)
    assert [buffer._index.entries[i]["model_weights_id"] for i in buffer.trajectory_id_list] == IDS
    batch = buffer.sample(8)
    buffer.save_checkpoint(tmp_path / "out")
    again = TrajectoryReplayBuffer(sample_window_size=0)
    again.load_checkpoint(tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").glob("trajectory_*_*.pt")) == sorted(
        f"trajectory_{i}_{m}.pt" for i, m in enumerate(IDS)
    )
    assert again.sample(8).keys() == batch.keys()


def test_auto_save_writes_such_ids_and_reads_them_back(tmp_path: Path) -> None:
    auto = tmp_path / "auto"
    with TrajectoryReplayBuffer(sample_window_size=0, auto_save=True, auto_save_path=str(auto)) as buffer:
        buffer.add_trajectories([make_traj(seed=i, model_weights_id=m) for i, m in enumerate(IDS)])
    index = read_index(auto)
    assert all((auto / index.file_name(i)).is_file() for i in index.id_list)
    assert [index.entries[i]["model_weights_id"] for i in index.id_list] == IDS


def test_the_command_line_reads_writes_and_prints_them(tmp_path: Path) -> None:
    ckpt = rlinf_checkpoint(tmp_path / "ckpt")
    assert run_json("verify", ckpt)["ok"] is True
    stats = run_json("stats", ckpt)
    assert "policy v1+run:3" in json.dumps(stats, ensure_ascii=False)
    run_json("ingest", ckpt, "--buffer", tmp_path / "buf")
    assert [e["model_weights_id"] for e in read_index(tmp_path / "buf").entries.values()] == IDS
    run_json("shard", ckpt, "--world-size", "2", "--out", tmp_path / "ranks")
    run_json("merge", tmp_path / "ranks", "--out", tmp_path / "merged")
    assert run_json("verify", tmp_path / "merged")["ok"] is True
    run_json("convert", ckpt, "--out", tmp_path / "pkl", "--format", "pkl")
    assert run_json("verify", tmp_path / "pkl")["ok"] is True


def test_a_hostile_id_is_printed_escaped_never_read_as_markup(tmp_path: Path) -> None:
    hostile = "[red]x\x1b]0;pwned\x07\u202eevil"
    src = tmp_path / "t.pt"
    torch.save(make_traj(seed=1, model_weights_id=hostile), src)
    result = run("ingest", src, "--buffer", tmp_path / "buf")
    assert result.exit_code == 0, result.stderr
    for args in (
        ["stats", tmp_path / "buf"],
        ["verify", tmp_path / "buf"],
        ["checkpoint", "load", tmp_path / "buf"],
    ):
        shown = run(*args)
        assert shown.exit_code == 0, shown.stderr
        assert RAW.search(shown.stdout) is None and RAW.search(shown.stderr) is None
    text = run("stats", tmp_path / "buf").stdout
    assert "[red]x" in text and "\\x1b]0;pwned\\x07" in text


def test_ingest_refuses_an_index_naming_a_path_and_writes_nothing(tmp_path: Path) -> None:
    ckpt = rlinf_checkpoint(tmp_path / "ckpt")
    doc = json.loads((ckpt / "trajectory_index.json").read_text())
    doc["trajectory_index"]["1"]["model_weights_id"] = "../../escape"
    (ckpt / "trajectory_index.json").write_text(json.dumps(doc))
    result = run("ingest", ckpt, "--buffer", tmp_path / "buf")
    assert_one_error(result)
    assert "path separator" in result.stderr
    assert not (tmp_path / "buf").exists() and not (tmp_path / "escape").exists()


def test_such_ids_round_trip_through_object_storage(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RBTOOL_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = rlinf_checkpoint(tmp_path / "ckpt")
    url = f"{bucket}/ckpt"
    run_json("checkpoint", "save", ckpt, url, "--window", "0")
    assert run_json("verify", url)["ok"] is True
    run_json("checkpoint", "save", url, tmp_path / "back", "--window", "0")
    back = read_index(tmp_path / "back")
    assert [back.entries[i]["model_weights_id"] for i in back.id_list] == IDS
    assert all((tmp_path / "back" / back.file_name(i)).is_file() for i in back.id_list)


def test_object_storage_refuses_an_id_with_a_control_character_saying_why(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RBTOOL_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "t.pt"
    torch.save(make_traj(seed=1, model_weights_id="bell\x07"), src)
    run_json("ingest", src, "--buffer", tmp_path / "buf")
    result = run("checkpoint", "save", tmp_path / "buf", f"{bucket}/ckpt", "--window", "0")
    assert_one_error(result)
    assert "control character" in result.stderr and "\\x07" in result.stderr, result.stderr
    assert "nothing was uploaded" in result.stderr
    from rbtool import remote

    r = remote.open_remote(f"{bucket}/ckpt")
    assert not r.fs.exists(r.root) or r.fs.find(r.root) == []


def test_a_lerobot_export_and_import_keep_such_ids(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    pytest.importorskip("PIL")
    from rbtool.interop.lerobot import export_lerobot, import_lerobot

    ckpt = rlinf_checkpoint(tmp_path / "ckpt")
    export_lerobot(ckpt, tmp_path / "ds", fps=10)
    import_lerobot(tmp_path / "ds", tmp_path / "back")
    back = read_index(tmp_path / "back")
    assert [back.entries[i]["model_weights_id"] for i in back.id_list] == IDS
    import_lerobot(tmp_path / "ds", tmp_path / "plain", use_sidecar=False, model_weights_id="demo v1+ds:2")
    plain = read_index(tmp_path / "plain")
    assert {e["model_weights_id"] for e in plain.entries.values()} == {"demo v1+ds:2"}
    with pytest.raises(Exception, match="path separator"):
        import_lerobot(tmp_path / "ds", tmp_path / "bad", use_sidecar=False, model_weights_id="a/b")
    assert not (tmp_path / "bad").exists()
