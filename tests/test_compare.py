"""rbtool.ops.compare: what differs between two checkpoints, by hash, size or content."""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson
import pytest
import torch
from conftest import FIXTURES, make_traj, tree_digest

from rbtool.files.dirs import open_view
from rbtool.format import INDEX_FILE, METADATA_FILE
from rbtool.ops.checkpoint import build_from_files, shard
from rbtool.ops.compare import content_difference, diff
from rbtool.ops.conversion import convert
from rbtool.ops.resharding import reshard

AUTOSAVE = FIXTURES / "autosave_pt" / "autosave"


@pytest.mark.parametrize(
    "rel", ["autosave_pt/autosave", "varying_shapes_pt/ckpt", "nested_obs_pt", "pkl_format_switch", "ranks"]
)
def test_a_pt_pkl_pt_round_trip_is_equal_by_content(tmp_path: Path, rel: str) -> None:
    source = FIXTURES / rel
    before = tree_digest(source)
    fmt = open_view(source, check_files=False).index.trajectory_format
    other = "pt" if fmt == "pkl" else "pkl"
    convert(source, tmp_path / "there", other)
    convert(tmp_path / "there", tmp_path / "back", fmt)
    d = diff(source, tmp_path / "back", deep=True)
    assert d.equal, d.as_json()
    assert d.unchanged == open_view(source).index.size
    # the other format differs only in layout, and its files cannot be compared without reading them
    there = diff(source, tmp_path / "there")
    assert there.metadata == [] and there.changed == [] and there.verdict == "unchecked"
    assert [item["key"] for item in there.layout] == ["trajectory_format"] and not there.equal
    assert there.files_unchecked == there.unchanged > 0
    deep = diff(source, tmp_path / "there", deep=True)
    assert deep.equal and deep.layout == there.layout
    assert tree_digest(source) == before


def test_a_checkpoint_equals_itself_and_its_reshard() -> None:
    assert diff(AUTOSAVE, AUTOSAVE).equal and diff(AUTOSAVE, AUTOSAVE, deep=True).equal


def test_a_tree_equals_its_reshard(tmp_path: Path) -> None:
    for n in (1, 3):
        reshard(FIXTURES / "ranks", n, tmp_path / f"r{n}")
        assert diff(FIXTURES / "ranks", tmp_path / f"r{n}").equal
        assert diff(tmp_path / f"r{n}", FIXTURES / "ranks", deep=True).equal
    shard(AUTOSAVE, 2, tmp_path / "s")
    assert diff(AUTOSAVE, tmp_path / "s", deep=True).equal


def write(tmp_path: Path, name: str, trajs: list[dict]) -> Path:
    files = tmp_path / f"{name}_files"
    files.mkdir()
    paths = []
    for i, traj in enumerate(trajs):
        paths.append(files / f"t{i}.pt")
        torch.save(traj, paths[-1])
    build_from_files(paths, tmp_path / name, window=0)
    return tmp_path / name


def test_changed_entries_files_and_schema(tmp_path: Path) -> None:
    base = [make_traj(t=2, b=1, seed=i, image=1) for i in range(4)]
    a = write(tmp_path, "a", base)
    changed = [dict(t) for t in base]
    changed[1] = dict(base[1], rewards=base[1]["rewards"] + 1)  # same shape, other values
    changed[2] = make_traj(t=3, b=1, seed=2, image=1)  # another shape
    changed[3] = dict(base[3], extra=torch.zeros(2, 1, 5))  # a new field
    b = write(tmp_path, "b", changed)
    shallow = diff(a, b)
    # each build gives its trajectories fresh uuids: identity differs, data of id 0 does not
    assert [c["trajectory_id"] for c in shallow.changed] == [0, 1, 2, 3]
    by_id = {c["trajectory_id"]: c for c in shallow.changed}
    assert by_id[0]["fields"] == ["uuid"] and by_id[0]["file"] is None
    assert by_id[2]["fields"] == ["num_samples", "shape", "max_episode_length", "uuid"]
    assert by_id[1]["file"] == "bytes" and by_id[1]["fields"] == ["uuid"]  # same size, no hash recorded
    assert shallow.unchanged == 0 and not shallow.equal
    convert(a, tmp_path / "a_pkl", "pkl")  # rewritten files get their hashes recorded
    convert(b, tmp_path / "b_pkl", "pkl")
    hashed = {c["trajectory_id"]: c["file"] for c in diff(tmp_path / "a_pkl", tmp_path / "b_pkl").changed}
    assert hashed[1] == "sha256"
    deep = diff(a, b, deep=True)
    by_id = {c["trajectory_id"]: c for c in deep.changed}
    assert by_id[1]["file"] == "content" and by_id[1]["detail"] == "rewards: values differ"
    assert by_id[3]["detail"] == "extra: present on one side only"
    assert deep.schema["compared"] == "every trajectory"
    assert deep.schema["added"] == [{"field": "extra", "dtype": "float32", "shape": [5]}]


def test_added_removed_order_and_metadata(tmp_path: Path) -> None:
    a = tmp_path / "a"
    shutil.copytree(AUTOSAVE, a)
    b = tmp_path / "b"
    shutil.copytree(AUTOSAVE, b)
    index = orjson.loads((b / INDEX_FILE).read_bytes())
    index["trajectory_id_list"] = [1, 0, 2, 3]
    del index["trajectory_index"]["4"]
    (b / INDEX_FILE).write_bytes(orjson.dumps(index))
    meta = orjson.loads((b / METADATA_FILE).read_bytes())
    meta.update(size=4, total_samples=32, seed=99)
    (b / METADATA_FILE).write_bytes(orjson.dumps(meta))
    d = diff(a, b)
    assert d.removed == [4] and d.added == [] and d.order_changed
    assert {m["key"]: (m["a"], m["b"]) for m in d.metadata} == {
        "size": (5, 4),
        "total_samples": (40, 32),
        "seed": (1234, 99),
    }
    back = diff(b, a)
    assert back.added == [4] and back.removed == []


def test_content_difference_names_the_first_field() -> None:
    x = make_traj(t=2, b=1, image=1)
    assert content_difference(x, dict(x)) is None
    y = dict(x, curr_obs=dict(x["curr_obs"], states=x["curr_obs"]["states"].double()))
    assert content_difference(x, y) == "curr_obs.states: dtype torch.float32 vs torch.float64"
    nan = dict(x, rewards=torch.full((2, 1, 1), float("nan")))
    assert content_difference(nan, dict(nan)) is None  # NaN equals NaN here: the same bytes
    assert content_difference(x, dict(x, model_weights_id="other")) is not None
