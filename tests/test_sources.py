"""rbtool.files.sources: listing trajectory files from files, folders and checkpoints; checking them."""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FIXTURES, make_traj

from rbtool.errors import (
    CheckpointError,
    InvalidTrajectoryError,
    MissingTrajectoryFilesError,
    TrajectoryFileError,
)
from rbtool.files import trajfile
from rbtool.files.index import Index, read_index
from rbtool.files.sources import Item, check_item, collect_items, collect_sources
from rbtool.files.writer import copied_entries, new_entry, write_checkpoint
from rbtool.format import layout


def write_file(path: Path, traj: dict[str, Any]) -> Path:
    path.write_bytes(trajfile.to_bytes(traj, path.suffix[1:]))
    return path


def checkpoint(out: Path, ids: list[int]) -> Path:
    """A checkpoint whose list order is `ids` (not sorted)."""
    trajs = {tid: make_traj(t=2, b=1 + tid % 3, seed=tid, model_weights_id=f"v{tid}") for tid in ids}
    entries = {tid: new_entry(tid, layout.describe(t, "t"), uuid.uuid4().hex) for tid, t in trajs.items()}
    index = Index(entries=entries, id_list=list(ids), trajectory_counter=max(ids) + 1)
    write_checkpoint(out, copied_entries(index), trajs.__getitem__)
    return out


# --------------------------------------------------------------- collect_items
def test_a_checkpoint_gives_its_list_order_with_its_entries(tmp_path: Path) -> None:
    ckpt = checkpoint(tmp_path / "ckpt", [4, 1, 10, 3])
    items = collect_items([ckpt])
    index = read_index(ckpt)
    assert [i.path for i in items] == [ckpt / index.file_name(t) for t in (4, 1, 10, 3)]
    assert [i.entry for i in items] == [index.entries[t] for t in (4, 1, 10, 3)]
    items[0].entry["shape"] = [0]  # type: ignore[index]
    assert read_index(ckpt).entries[4]["shape"] != [0]


def test_a_reference_buffer_directory_gives_its_list_order() -> None:
    source = FIXTURES / "autosave_pt" / "autosave"
    index = read_index(source)
    assert [i.path.name for i in collect_items([source])] == [index.file_name(t) for t in index.id_list]


def test_a_loose_folder_gives_files_in_natural_order(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir()
    traj = make_traj(t=2, b=1)
    names = [
        "trajectory_10_a.pt",
        "trajectory_2_b.pkl",
        "zeta.pt",
        "trajectory_2_a.pt",
        "alpha.pkl",
        ".trajectory_1_x.pt.123.tmp",  # a writer's temporary: never a source
        ".hidden.pt",
        "notes.txt",
    ]
    for name in names:
        (loose / name).write_bytes(trajfile.to_bytes(traj, "pt"))
    (loose / "t10.pt").write_bytes(trajfile.to_bytes(traj, "pt"))
    (loose / "t2.pt").write_bytes(trajfile.to_bytes(traj, "pt"))
    (loose / "sub").mkdir()
    (loose / "sub" / "t1.pt").write_bytes(trajfile.to_bytes(traj, "pt"))
    found = collect_sources([loose])
    assert [i.path.name for i in found.items] == [
        "alpha.pkl",
        "t2.pt",  # t2 before t10: digits compare as numbers
        "t10.pt",
        "trajectory_2_a.pt",
        "trajectory_2_b.pkl",
        "trajectory_10_a.pt",
        "zeta.pt",
    ]
    assert all(i.entry is None for i in found.items)
    assert [(s.path.name, s.reason) for s in found.skipped] == [
        ("notes.txt", "not a trajectory file (.pt or .pkl)"),
        ("sub", "a folder (not descended into)"),
    ]
    deep = collect_sources([loose], recursive=True)
    walked = [str(i.path.relative_to(loose)) for i in deep.items]
    assert walked[:4] == ["alpha.pkl", "sub/t1.pt", "t2.pt", "t10.pt"]  # a subfolder in its place
    assert [s.path.name for s in deep.skipped] == ["notes.txt"]


def test_a_checkpoint_inside_a_walked_folder_keeps_its_list_order(tmp_path: Path) -> None:
    import shutil

    from conftest import FIXTURES

    root = tmp_path / "root"
    shutil.copytree(FIXTURES / "ranks" / "rank_1", root / "ckpt")
    (root / "z.pt").write_bytes(trajfile.to_bytes(make_traj(t=2, b=1), "pt"))
    found = collect_sources([root], recursive=True)
    assert [i.entry["trajectory_id"] for i in found.items if i.entry] == [0, 1, 2, 3]
    assert found.items[-1].path.name == "z.pt"
    excluded = collect_sources([root], recursive=True, exclude=[(root / "ckpt").resolve()])
    assert [i.path.name for i in excluded.items] == ["z.pt"]
    assert [s.reason for s in excluded.skipped] == ["the destination itself"]


def test_sources_are_concatenated_in_the_order_given(tmp_path: Path) -> None:
    ckpt = checkpoint(tmp_path / "ckpt", [1, 0])
    single = write_file(tmp_path / "single.pkl", make_traj(t=2, b=1))
    items = collect_items([single, ckpt, str(single)])
    index = read_index(ckpt)
    assert [i.path for i in items] == [single, ckpt / index.file_name(1), ckpt / index.file_name(0), single]
    assert [i.entry is None for i in items] == [True, False, False, True]


def test_a_missing_path_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as caught:
        collect_items([tmp_path / "nope"])
    assert str(caught.value) == f"{tmp_path / 'nope'}: no such file or directory"


def test_a_file_that_is_not_a_trajectory_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "traj.npz"
    path.write_bytes(b"x")
    with pytest.raises(CheckpointError) as caught:
        collect_items([path])
    assert str(caught.value) == f"{path}: not a trajectory file (expected .pt or .pkl)"


@pytest.mark.parametrize("contents", [[], ["readme.txt"], [".hidden.pt"]])
def test_a_folder_without_trajectory_files_is_an_error(tmp_path: Path, contents: list[str]) -> None:
    folder = tmp_path / "empty"
    folder.mkdir()
    for name in contents:
        (folder / name).write_text("x")
    with pytest.raises(CheckpointError) as caught:
        collect_items([folder])
    assert str(caught.value) == f"{folder}: holds no trajectory files (.pt or .pkl)"


def test_a_checkpoint_missing_files_is_refused_naming_them(rlinf_copy: Any) -> None:
    ckpt = rlinf_copy("nosave_window2_pt/ckpt")  # RLinf lists five, writes two
    with pytest.raises(MissingTrajectoryFilesError) as caught:
        collect_items([ckpt])
    assert caught.value.missing_ids == [0, 1, 2]


# ------------------------------------------------------------------ check_item
def test_check_item_takes_model_weights_id_from_the_file_name(tmp_path: Path) -> None:
    traj = make_traj(t=3, b=2)
    del traj["model_weights_id"]
    checked = check_item(Item(write_file(tmp_path / "trajectory_7_v9.pt", traj)))
    assert checked.info.model_weights_id == "v9"
    assert checked.info.shape == (3, 2, 7) and checked.sha256 is None
    # a name without one gives the empty id; an id in the file wins over the name
    assert check_item(Item(write_file(tmp_path / "loose.pt", traj))).info.model_weights_id == ""
    named = write_file(tmp_path / "trajectory_8_v9.pkl", make_traj(t=3, b=2, model_weights_id="inside"))
    assert check_item(Item(named)).info.model_weights_id == "inside"


def test_check_item_max_episode_length_from_file_entry_or_t(tmp_path: Path) -> None:
    traj = make_traj(t=3, b=2)
    del traj["max_episode_length"]
    path = write_file(tmp_path / "trajectory_0_x.pt", traj)
    assert check_item(Item(path)).info.max_episode_length == 3
    entry = {"shape": [3, 2, 7], "max_episode_length": 50}
    assert check_item(Item(path, entry)).info.max_episode_length == 50
    stored = write_file(tmp_path / "trajectory_1_x.pt", make_traj(t=3, b=2, max_episode_length=9))
    assert check_item(Item(stored, entry)).info.max_episode_length == 9


def test_check_item_checks_t_and_b_against_the_entry(tmp_path: Path) -> None:
    path = write_file(tmp_path / "trajectory_0_x.pt", make_traj(t=4, b=2))
    assert check_item(Item(path, {"shape": [4, 2, 99]})).info.shape == (4, 2, 7)  # trailing dims are free
    with pytest.raises(CheckpointError) as caught:
        check_item(Item(path, {"shape": [4, 3, 7]}))
    assert str(caught.value) == (f"{path}: tensors are [T, B] = [4, 2] but its index entry says [4, 3]")


def test_check_item_carries_the_hash_only_for_the_recorded_size(tmp_path: Path) -> None:
    path = write_file(tmp_path / "trajectory_0_x.pt", make_traj())
    size = path.stat().st_size
    entry = {"shape": [4, 2, 7], "file_bytes": size, "sha256": "ab" * 32}
    assert check_item(Item(path, entry)).sha256 == "ab" * 32
    assert check_item(Item(path, {**entry, "file_bytes": size + 1})).sha256 is None


def test_check_item_refuses_bad_files_naming_them(tmp_path: Path) -> None:
    truncated = tmp_path / "trajectory_0_x.pt"
    truncated.write_bytes(trajfile.to_bytes(make_traj(), "pt")[:100])
    with pytest.raises(TrajectoryFileError, match=f"^{re.escape(str(truncated))}: "):
        check_item(Item(truncated))
    shapeless = tmp_path / "trajectory_1_x.pkl"
    shapeless.write_bytes(trajfile.to_bytes({"actions": torch.zeros(2, 2)}, "pkl"))
    with pytest.raises(
        InvalidTrajectoryError, match=f"^{re.escape(str(shapeless))}: cannot determine the trajectory shape"
    ):
        check_item(Item(shapeless))
