"""rbtool.interop.lerobot: export as LeRobot v3.0, import LeRobot v3.0 / v2.1, and import(export(c)) == c."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES, RLINF_DIRS, make_traj, tree_digest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("PIL")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rbtool.errors import CheckpointError, OutputExistsError, UsageError  # noqa: E402
from rbtool.files import trajfile  # noqa: E402
from rbtool.files.dirs import open_view  # noqa: E402
from rbtool.format.layout import drop_bootstrap_rows  # noqa: E402
from rbtool.interop.lerobot import (  # noqa: E402
    LeRobotFeatureError,
    LeRobotSource,
    export_lerobot,
    import_lerobot,
)
from rbtool.ops.ingestion import ingest  # noqa: E402

ALL_FIXTURES = [*RLINF_DIRS, "nested_obs_pt", "pkl_format_switch", "seedless_pt", "ranks"]
HINT_KEYS = ("file_bytes", "sha256", "link")  # describe the file written, not the data


# ----------------------------------------------------------------------- helpers
def assert_same_value(actual: Any, expected: Any, where: str = "") -> None:
    """Same dict keys in the same order, tensors torch.equal with the same dtype, values equal."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), where
        assert list(actual) == list(expected), where
        for key in expected:
            assert_same_value(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert (
            torch.equal(actual.view(torch.uint8), expected.contiguous().view(torch.uint8))
            if (expected.numel() and expected.dim())
            else torch.equal(actual, expected)
        ), where
    elif isinstance(expected, float) and math.isnan(expected):
        assert isinstance(actual, float) and math.isnan(actual), where
    else:
        assert actual == expected and type(actual) is type(expected), where


def assert_same_checkpoint(buffer: Path, source: Path, *, strict: bool = True) -> None:
    """The buffer holds the source's checkpoint: ids, counter, seed, format, metadata, entries, tensors."""
    a = open_view(source, strict=strict)
    b = open_view(buffer)
    assert b.index.id_list == a.index.id_list
    assert b.index.trajectory_counter == a.index.trajectory_counter
    assert b.index.seed == a.index.seed
    assert b.index.trajectory_format == a.index.trajectory_format
    assert b.index.extra_metadata == a.index.extra_metadata
    for tid in a.index.id_list:
        ea = {k: v for k, v in a.index.entries[tid].items() if k not in HINT_KEYS}
        eb = {k: v for k, v in b.index.entries[tid].items() if k not in HINT_KEYS}
        if "uuid" not in ea:  # RLinf writes none; the import assigns one
            eb.pop("uuid")
        assert eb == ea, tid
        expected = trajfile.load(a.file_of(tid))
        if expected.get("model_weights_id") is None:
            expected["model_weights_id"] = ea["model_weights_id"]
        assert_same_value(trajfile.load(b.file_of(tid)), expected, f"trajectory {tid}")


def build_buffer(directory: Path, trajs: list[dict[str, Any]], fmt: str = "pt") -> Path:
    loose = directory.parent / f"{directory.name}-loose"
    loose.mkdir()
    paths = []
    for i, traj in enumerate(trajs):
        path = loose / f"trajectory_{i}_{traj.get('model_weights_id', '')}.pt"
        path.write_bytes(trajfile.to_bytes(traj, "pt"))
        paths.append(path)
    ingest(paths, directory, trajectory_format=fmt)
    return directory


def generated(t: int = 4, b: int = 2, seed: int = 0, **overrides: Any) -> dict[str, Any]:
    """A trajectory with what LeRobot has no place for: epochs of bootstrap rows, 1-D fields,
    dicts nested in obs, bf16, next_obs = curr_obs[t + 1] except at episode ends."""
    g = torch.Generator().manual_seed(seed)
    traj = make_traj(t=t, b=b, seed=seed, extra_rows=2 if t % 2 == 0 else 1)
    states = torch.randn(t + 1, b, 8, generator=g)
    traj["curr_obs"]["states"] = states[:-1].clone()
    nxt = states[1:].clone()
    nxt[t // 2] = torch.randn(b, 8, generator=g)  # a reset inside the trajectory
    traj["next_obs"]["states"] = nxt
    traj["curr_obs"]["task_id"] = torch.arange(b)
    traj["curr_obs"]["cams"] = {"wrist": torch.randn(t, b, 5, generator=g), "empty": {}}
    traj["next_obs"]["cams"] = {"wrist": torch.randn(t, b, 5, generator=g)}
    traj["prev_logprobs"] = torch.randn(t, b, 7, generator=g).to(torch.bfloat16)
    traj["half"] = torch.randn(t, b, 2, generator=g).to(torch.float16)
    traj["grid"] = torch.randint(-5, 5, (t, b, 2, 3), generator=g, dtype=torch.int16)
    traj["scalar_per_step"] = torch.randn(t, b, generator=g)
    traj["deep"] = torch.zeros(t, b, 1, 1, 1, 1, 2)  # 7 dims: more than LeRobot's Array5D
    traj["nothing"] = torch.zeros(t, b, 0)
    traj["z"] = torch.randn(t, b, 3, generator=g, dtype=torch.complex64)  # no Arrow type: kept whole
    traj["info"] = {"note": "hello", "ratio": float("nan"), "tags": ["a", "b"], "flag": True}
    traj["gray"] = torch.randint(0, 255, (t, b, 3, 4, 1), generator=g, dtype=torch.uint8)
    wrist = torch.randint(0, 255, (t + 1, b, 2, 4, 4, 3), generator=g, dtype=torch.uint8)  # two views
    traj["curr_obs"]["wrist_images"], traj["next_obs"]["wrist_images"] = wrist[:-1].clone(), wrist[1:].clone()
    traj.update(overrides)
    return traj


@pytest.fixture
def mixed_buffer(tmp_path: Path) -> Path:
    trajs = [
        generated(t=4, b=2, seed=0),
        generated(t=6, b=3, seed=1, model_weights_id="v2"),
        # A field only this one has, and one whose shape differs from the first trajectory's.
        generated(t=3, b=1, seed=2, only_here=torch.ones(3, 1, 2), actions=torch.zeros(3, 1, 3)),
        generated(t=2, b=2, seed=3, model_weights_id=""),
    ]
    return build_buffer(tmp_path / "mixed", trajs)


# ----------------------------------------------------------------------- round trips
@pytest.mark.parametrize("rel", ALL_FIXTURES)
def test_import_of_export_gives_back_every_fixture(tmp_path: Path, rel: str) -> None:
    source = FIXTURES / rel
    strict = "nosave" not in rel  # RLinf wrote these with files missing (SPEC §9)
    before = tree_digest(source)
    export_lerobot(source, tmp_path / "ds", fps=10, task="pick", strict=strict)
    result = import_lerobot(tmp_path / "ds", tmp_path / "buf")
    assert result.mode == "rbtool" and result.kept_ids
    assert_same_checkpoint(tmp_path / "buf", source, strict=strict)
    assert tree_digest(source) == before


def test_import_of_export_gives_back_generated_buffers(mixed_buffer: Path, tmp_path: Path) -> None:
    result = export_lerobot(mixed_buffer, tmp_path / "ds", fps=20)
    # What has no per-frame place is kept whole in the sidecar.
    assert {"curr_obs.task_id", "nothing", "actions", "z"} <= set(result.sidecar_fields)
    assert "deep" in result.columns.values() and "prev_logprobs" in result.columns.values()
    import_lerobot(tmp_path / "ds", tmp_path / "buf")
    assert_same_checkpoint(tmp_path / "buf", mixed_buffer)


def test_pkl_buffers_come_back_as_pkl(tmp_path: Path) -> None:
    source = build_buffer(tmp_path / "pkl", [make_traj(seed=i) for i in range(2)], fmt="pkl")
    export_lerobot(source, tmp_path / "ds", fps=5)
    import_lerobot(tmp_path / "ds", tmp_path / "buf")
    assert open_view(tmp_path / "buf").index.trajectory_format == "pkl"
    assert_same_checkpoint(tmp_path / "buf", source)


def test_rbtool_written_files_come_back_byte_for_byte(mixed_buffer: Path, tmp_path: Path) -> None:
    export_lerobot(mixed_buffer, tmp_path / "ds", fps=5)
    import_lerobot(tmp_path / "ds", tmp_path / "buf")
    a, b = open_view(mixed_buffer), open_view(tmp_path / "buf")
    for tid in a.index.id_list:
        assert b.file_of(tid).read_bytes() == a.file_of(tid).read_bytes(), tid


def test_into_a_buffer_holding_other_trajectories_the_ids_continue(tmp_path: Path) -> None:
    source = FIXTURES / "autosave_pt/autosave"
    export_lerobot(source, tmp_path / "ds", fps=5)
    ingest([FIXTURES / "nested_obs_pt"], tmp_path / "buf")  # ids 0-3
    second = import_lerobot(tmp_path / "ds", tmp_path / "buf")
    assert not second.kept_ids and second.added_ids == [4, 5, 6, 7, 8]
    view, original = open_view(tmp_path / "buf"), open_view(source)
    assert view.index.trajectory_counter == 9
    for old, new in zip(range(5), second.added_ids, strict=True):
        ea, eb = original.index.entries[old], view.index.entries[new]
        assert eb["uuid"] != ea.get("uuid")
        keep = ("num_samples", "max_episode_length", "shape", "model_weights_id")
        assert {k: eb[k] for k in keep} == {k: ea[k] for k in keep}
        assert_same_value(trajfile.load(view.file_of(new)), trajfile.load(original.file_of(old)))


def test_importing_an_export_twice_adds_it_once(tmp_path: Path) -> None:
    export_lerobot(FIXTURES / "autosave_pt/autosave", tmp_path / "ds", fps=5)
    import_lerobot(tmp_path / "ds", tmp_path / "buf")
    again = import_lerobot(tmp_path / "ds", tmp_path / "buf")
    assert again.skipped == 5 and again.added_ids == []
    assert_same_checkpoint(tmp_path / "buf", FIXTURES / "autosave_pt/autosave")


def test_an_empty_checkpoint_comes_back_empty(tmp_path: Path) -> None:
    from rbtool.files.index import Index, init_buffer_dir

    init_buffer_dir(tmp_path / "empty", Index(seed=7, trajectory_counter=0))
    result = export_lerobot(tmp_path / "empty", tmp_path / "ds", fps=5)
    assert result.episodes == result.frames == 0
    assert import_lerobot(tmp_path / "ds", tmp_path / "buf").kept_ids
    assert_same_checkpoint(tmp_path / "buf", tmp_path / "empty")


def test_a_rank_tree_exports_as_its_merge(tmp_path: Path) -> None:
    export_lerobot(FIXTURES / "ranks", tmp_path / "ds", fps=5)
    import_lerobot(tmp_path / "ds", tmp_path / "buf")
    merged = open_view(FIXTURES / "ranks")
    assert merged.renumbered and open_view(tmp_path / "buf").index.id_list == merged.index.id_list


# ----------------------------------------------------------------------- episodes and layout
def test_episodes_are_env_columns_split_at_done_flags(tmp_path: Path) -> None:
    dones = torch.zeros(5, 2, 1, dtype=torch.bool)  # [T + 1, B, 1], row 0 the bootstrap row
    dones[0] = True  # a bootstrap row never ends an episode
    dones[2, 0] = True  # env 0: t = 1 ends an episode
    dones[4, 1] = True  # env 1: only the last step
    source = build_buffer(tmp_path / "b", [make_traj(t=4, b=2, dones=dones)])
    result = export_lerobot(source, tmp_path / "ds", fps=4)
    episodes = pq.read_table(tmp_path / "ds/meta/episodes/chunk-000/file-000.parquet").to_pylist()
    assert [(e["rb/env"], e["rb/t_start"], e["length"]) for e in episodes] == [
        (0, 0, 2),
        (0, 2, 2),
        (1, 0, 4),
    ]
    assert [(e["dataset_from_index"], e["dataset_to_index"]) for e in episodes] == [(0, 2), (2, 4), (4, 8)]
    data = pq.read_table(tmp_path / "ds/data/chunk-000/file-000.parquet").to_pydict()
    assert data["frame_index"] == [0, 1, 0, 1, 0, 1, 2, 3]
    assert data["episode_index"] == [0, 0, 1, 1, 2, 2, 2, 2]
    assert data["timestamp"] == pytest.approx([f / 4 for f in data["frame_index"]])
    assert data["rb.t"] == [0, 1, 2, 3, 0, 1, 2, 3] and data["rb.env"] == [0] * 4 + [1] * 4
    assert data["done"] == drop_bootstrap_rows(dones, 4).permute(1, 0, 2).reshape(-1).tolist()
    assert result.episodes == 3 and result.frames == 8


def test_the_layout_is_lerobots_v30(mixed_buffer: Path, tmp_path: Path) -> None:
    """What CI can check without LeRobot: the files, columns and types LeRobot's v3.0 docs give."""
    out = tmp_path / "ds"
    export_lerobot(mixed_buffer, out, fps=15, robot_type="franka", task="stack the cubes")
    info = json.loads((out / "meta/info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["fps"] == 15 and info["robot_type"] == "franka"
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["video_path"] is None and info["chunks_size"] == 1000
    assert info["splits"] == {"train": f"0:{info['total_episodes']}"} and info["total_tasks"] == 1
    features = info["features"]
    for name in ("timestamp", "frame_index", "episode_index", "index", "task_index"):
        assert features[name]["shape"] == [1]
    assert features["image"] == {
        "dtype": "image",
        "shape": [4, 4, 3],
        "names": ["height", "width", "channels"],
    }
    assert features["state"]["dtype"] == "float32" and features["state"]["shape"] == [8]
    assert features["prev_logprobs"]["dtype"] == "uint16"  # bf16 as its bits, tagged in the sidecar
    assert all("/" not in name for name in features)
    files = sorted((out / "data").glob("chunk-*/file-*.parquet"))
    table = pa.concat_tables([pq.read_table(f) for f in files])
    assert table.column_names == list(features)
    assert table.num_rows == info["total_frames"]
    hf = json.loads(pq.read_schema(files[0]).metadata[b"huggingface"])["info"]["features"]
    assert hf["image"] == {"_type": "Image"} and hf["state"]["_type"] == "List"
    assert hf["grid"] == {"shape": [2, 3], "dtype": "int16", "_type": "Array2D"}
    assert pa.types.is_fixed_size_list(table.schema.field("state").type)
    assert table.schema.field("image").type == pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    png = table.column("image").chunk(0)[0]["bytes"].as_py()
    assert png.startswith(b"\x89PNG")
    assert table.column("index").to_pylist() == list(range(table.num_rows))
    episodes = pa.concat_tables(
        [pq.read_table(f) for f in sorted((out / "meta/episodes").glob("chunk-*/file-*.parquet"))]
    )
    for column in (
        "episode_index",
        "tasks",
        "length",
        "data/chunk_index",
        "data/file_index",
        "dataset_from_index",
        "dataset_to_index",
        "meta/episodes/chunk_index",
        "meta/episodes/file_index",
        "stats/state/mean",
        "stats/image/q50",
    ):
        assert column in episodes.column_names, column
    assert episodes.column("tasks").to_pylist()[0] == ["stack the cubes"]
    assert sum(episodes.column("length").to_pylist()) == info["total_frames"]
    tasks = pq.read_table(out / "meta/tasks.parquet")
    assert json.loads(tasks.schema.metadata[b"pandas"])["index_columns"] == ["__index_level_0__"]
    assert tasks.to_pylist() == [{"task_index": 0, "__index_level_0__": "stack the cubes"}]
    stats = json.loads((out / "meta/stats.json").read_text())
    assert "rb.model_weights_id" not in stats
    for name, spec in features.items():
        if spec["dtype"] != "string":
            assert set(stats[name]) == {
                "min",
                "max",
                "mean",
                "std",
                "count",
                "q01",
                "q10",
                "q50",
                "q90",
                "q99",
            }
    assert np.array(stats["image"]["mean"]).shape == (3, 1, 1)
    assert stats["index"]["count"] == [info["total_frames"]]
    assert (
        0.0
        <= min(np.array(stats["image"]["min"]).ravel())
        <= max(np.array(stats["image"]["max"]).ravel())
        <= 1.0
    )


def test_data_and_episode_files_roll_over_by_size(mixed_buffer: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    result = export_lerobot(mixed_buffer, out, fps=5, data_file_size_mb=0.004, chunks_size=2)
    assert result.data_files >= 3
    files = sorted(p.relative_to(out).as_posix() for p in (out / "data").rglob("*.parquet"))
    assert files[:3] == [
        "data/chunk-000/file-000.parquet",
        "data/chunk-000/file-001.parquet",
        "data/chunk-001/file-000.parquet",
    ]
    # Every episode's frames are in the file its metadata names, never split.
    source = LeRobotSource(out)
    for episode, frames in source.frames(source.episodes(), ["episode_index"]):
        assert frames.num_rows == episode.length
    import_lerobot(out, tmp_path / "buf")
    assert_same_checkpoint(tmp_path / "buf", mixed_buffer)


def test_images_as_arrays_on_request(tmp_path: Path) -> None:
    source = FIXTURES / "autosave_pt/autosave"
    export_lerobot(source, tmp_path / "ds", fps=5, images=False)
    info = json.loads((tmp_path / "ds/meta/info.json").read_text())
    array = info["features"]["curr_obs.main_images"]  # RLinf's name `image` is for image features
    assert array["dtype"] == "uint8" and array["shape"] == [16, 16, 3] and "image" not in info["features"]
    import_lerobot(tmp_path / "ds", tmp_path / "buf")
    assert_same_checkpoint(tmp_path / "buf", source)


def test_feature_names_can_be_mapped(tmp_path: Path) -> None:
    source = FIXTURES / "autosave_pt/autosave"
    names = {"curr_obs.states": "observation.state", "curr_obs.main_images": "observation.images.main"}
    result = export_lerobot(source, tmp_path / "ds", fps=5, names=names)
    assert result.columns["observation.state"] == "curr_obs.states"
    assert "observation.images.main" in result.features and "state" not in result.features
    import_lerobot(tmp_path / "ds", tmp_path / "buf")
    assert_same_checkpoint(tmp_path / "buf", source)
    with pytest.raises(UsageError, match="no_such"):
        export_lerobot(source, tmp_path / "ds2", fps=5, names={"no_such": "x"})
    with pytest.raises(UsageError, match="taken"):
        export_lerobot(source, tmp_path / "ds3", fps=5, names={"actions": "index"})


# ----------------------------------------------------------------------- refusals
def test_an_existing_output_is_refused_unless_replacing_a_dataset(tmp_path: Path) -> None:
    source = FIXTURES / "autosave_pt/autosave"
    export_lerobot(source, tmp_path / "ds", fps=5)
    with pytest.raises(OutputExistsError):
        export_lerobot(source, tmp_path / "ds", fps=5)
    export_lerobot(source, tmp_path / "ds", fps=7, overwrite=True)
    assert json.loads((tmp_path / "ds/meta/info.json").read_text())["fps"] == 7
    (tmp_path / "other").mkdir()
    (tmp_path / "other/notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not a LeRobot dataset"):
        export_lerobot(source, tmp_path / "other", fps=5, overwrite=True)
    assert (tmp_path / "other/notes.txt").read_text() == "keep me"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_changed_export_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    export_lerobot(FIXTURES / "autosave_pt/autosave", tmp_path / "ds", fps=5)
    path = tmp_path / "ds/data/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    actions = table.column("actions").combine_chunks()
    values = actions.flatten().to_numpy().copy()
    values[3] += 1.0
    changed = pa.FixedSizeListArray.from_arrays(pa.array(values), 7)
    pq.write_table(table.set_column(table.column_names.index("actions"), "actions", changed), path)
    before = tree_digest(tmp_path / "ds")
    with pytest.raises(CheckpointError, match="does not rebuild"):
        import_lerobot(tmp_path / "ds", tmp_path / "new" / "buf")
    assert not (tmp_path / "new").exists()
    assert tree_digest(tmp_path / "ds") == before
    # Read as plain episodes, the changed dataset still imports.
    assert import_lerobot(tmp_path / "ds", tmp_path / "buf", use_sidecar=False).mode == "episodes"


def test_not_a_dataset(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a LeRobot dataset"):
        import_lerobot(FIXTURES / "autosave_pt/autosave", tmp_path / "buf")
    (tmp_path / "v1/meta").mkdir(parents=True)
    (tmp_path / "v1/meta/info.json").write_text('{"codebase_version": "v1.6", "features": {}}')
    with pytest.raises(CheckpointError, match=r"v1\.6"):
        import_lerobot(tmp_path / "v1", tmp_path / "buf")
    with pytest.raises(UsageError, match="fps"):
        export_lerobot(FIXTURES / "autosave_pt/autosave", tmp_path / "ds", fps=0)
    assert not (tmp_path / "buf").exists()


# ----------------------------------------------------------------------- datasets rbtool did not write
def png(frame: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="PNG", optimize=True)  # other filters than rbtool's
    return buffer.getvalue()


def hand_built_frames(lengths: list[int], seed: int = 0) -> list[dict[str, Any]]:
    """Frames of a LeRobot dataset as LeRobot's docs describe one (camera, state, action, reward, done)."""
    rng = np.random.default_rng(seed)
    frames = []
    index = 0
    for episode, n in enumerate(lengths):
        for i in range(n):
            frames.append(
                {
                    "observation.state": rng.standard_normal(3).astype(np.float32),
                    "observation.images.top": rng.integers(0, 256, (6, 5, 3), dtype=np.uint8),
                    "action": rng.standard_normal(2).astype(np.float32),
                    "next.reward": np.float32(i),
                    "next.done": i == n - 1 and episode != 1,
                    "grid": rng.integers(-9, 9, (2, 2)).astype(np.int16),
                    "timestamp": np.float32(i / 10),
                    "frame_index": i,
                    "episode_index": episode,
                    "index": index,
                    "task_index": episode % 2,
                }
            )
            index += 1
    return frames


FEATURES = {
    "observation.state": {"dtype": "float32", "shape": [3], "names": None},
    "observation.images.top": {
        "dtype": "image",
        "shape": [6, 5, 3],
        "names": ["height", "width", "channels"],
    },
    "action": {"dtype": "float32", "shape": [2], "names": None},
    "next.reward": {"dtype": "float32", "shape": [1], "names": None},
    "next.done": {"dtype": "bool", "shape": [1], "names": None},
    "grid": {"dtype": "int16", "shape": [2, 2], "names": None},
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}


def frames_table(frames: list[dict[str, Any]]) -> Any:
    columns: dict[str, Any] = {}
    for name in FEATURES:
        values = [f[name] for f in frames]
        if name == "observation.images.top":
            columns[name] = pa.array([{"bytes": png(v), "path": None} for v in values])
        elif name == "grid":
            columns[name] = pa.array([v.tolist() for v in values], pa.list_(pa.list_(pa.int16())))
        elif isinstance(values[0], np.ndarray):
            columns[name] = pa.FixedSizeListArray.from_arrays(
                pa.array(np.stack(values).ravel()), len(values[0])
            )
        else:
            columns[name] = pa.array(values, pa.from_numpy_dtype(np.dtype(FEATURES[name]["dtype"])))
    return pa.table(columns)


def build_v30(root: Path, lengths: list[int]) -> list[dict[str, Any]]:
    """A LeRobot v3.0 dataset laid out as LeRobot's documentation describes (two data files)."""
    frames = hand_built_frames(lengths)
    (root / "meta/episodes/chunk-000").mkdir(parents=True)
    (root / "data/chunk-000").mkdir(parents=True)
    info = {
        "codebase_version": "v3.0",
        "robot_type": "toy",
        "total_episodes": len(lengths),
        "total_frames": len(frames),
        "total_tasks": 2,
        "chunks_size": 1000,
        "data_files_size_in_mb": 100,
        "video_files_size_in_mb": 200,
        "fps": 10,
        "splits": {"train": f"0:{len(lengths)}"},
        "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
        "video_path": None,
        "features": FEATURES,
    }
    (root / "meta/info.json").write_text(json.dumps(info))
    split = lengths[0]  # episode 0 in file 0, the others in file 1
    pq.write_table(frames_table(frames[:split]), root / "data/chunk-000/file-000.parquet")
    pq.write_table(frames_table(frames[split:]), root / "data/chunk-000/file-001.parquet")
    starts = np.cumsum([0, *lengths])
    episodes = pa.table(
        {
            "episode_index": list(range(len(lengths))),
            "tasks": [[f"task {e % 2}"] for e in range(len(lengths))],
            "length": lengths,
            "data/chunk_index": [0] * len(lengths),
            "data/file_index": [0] + [1] * (len(lengths) - 1),
            "dataset_from_index": starts[:-1].tolist(),
            "dataset_to_index": starts[1:].tolist(),
            "meta/episodes/chunk_index": [0] * len(lengths),
            "meta/episodes/file_index": [0] * len(lengths),
        }
    )
    pq.write_table(episodes, root / "meta/episodes/chunk-000/file-000.parquet")
    tasks = pa.table({"task_index": [0, 1], "task": ["task 0", "task 1"]})
    pq.write_table(tasks, root / "meta/tasks.parquet")
    return frames


def build_v21(root: Path, lengths: list[int]) -> list[dict[str, Any]]:
    """A LeRobot v2.1 dataset: one Parquet file per episode, JSON Lines metadata."""
    frames = hand_built_frames(lengths)
    (root / "meta").mkdir(parents=True)
    info = {
        "codebase_version": "v2.1",
        "robot_type": "toy",
        "total_episodes": len(lengths),
        "total_frames": len(frames),
        "total_tasks": 2,
        "total_chunks": 1,
        "chunks_size": 1000,
        "fps": 10,
        "splits": {"train": f"0:{len(lengths)}"},
        "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
        "video_path": None,
        "features": FEATURES,
    }
    (root / "meta/info.json").write_text(json.dumps(info))
    (root / "data/chunk-000").mkdir(parents=True)
    for e in range(len(lengths)):
        part = [f for f in frames if f["episode_index"] == e]
        pq.write_table(frames_table(part), root / f"data/chunk-000/episode_{e:06d}.parquet")
    (root / "meta/episodes.jsonl").write_text(
        "".join(
            json.dumps({"episode_index": e, "tasks": [f"task {e % 2}"], "length": n}) + "\n"
            for e, n in enumerate(lengths)
        )
    )
    (root / "meta/tasks.jsonl").write_text(
        "".join(json.dumps({"task_index": i, "task": f"task {i}"}) + "\n" for i in range(2))
    )
    return frames


def check_episode_import(
    buffer: Path, frames: list[dict[str, Any]], lengths: list[int], first_id: int = 0
) -> None:
    from rbtool.buffer.replay import TrajectoryReplayBuffer
    from rbtool.ops.verify import verify_checkpoint

    view = open_view(buffer)
    assert view.index.id_list == list(range(first_id, first_id + len(lengths)))
    for tid, (episode, n) in zip(view.index.id_list, enumerate(lengths), strict=True):
        traj = trajfile.load(view.file_of(tid))
        ep = [f for f in frames if f["episode_index"] == episode]
        states = torch.from_numpy(np.stack([f["observation.state"] for f in ep]))
        images = torch.from_numpy(np.stack([f["observation.images.top"] for f in ep]))
        assert torch.equal(traj["curr_obs"]["states"], states[:, None])
        assert torch.equal(traj["next_obs"]["states"][:-1], states[1:, None])
        assert torch.equal(traj["curr_obs"]["main_images"], images[:, None])
        assert torch.equal(traj["next_obs"]["main_images"][-1], images[-1:])
        assert torch.equal(traj["actions"], torch.from_numpy(np.stack([f["action"] for f in ep]))[:, None])
        assert traj["rewards"].shape == (n, 1, 1) and traj["rewards"][:, 0, 0].tolist() == list(range(n))
        assert traj["grid"].dtype == torch.int16 and traj["grid"].shape == (n, 1, 2, 2)
        assert traj["dones"].shape == (n + 1, 1, 1) and traj["dones"].dtype == torch.bool
        assert traj["dones"][1:, 0, 0].tolist() == [False] * (n - 1) + [True]  # ends with the episode
        assert not traj["dones"][0].any()  # the bootstrap row
        assert traj["task"] == f"task {episode % 2}" and traj["max_episode_length"] == n
        assert view.index.entries[tid]["shape"] == [n, 1, 1]
        assert traj["model_weights_id"] == view.index.entries[tid]["model_weights_id"]
    report = verify_checkpoint(buffer, deep=True)
    assert report.ok, report.as_json()
    rb = TrajectoryReplayBuffer(seed=1234, sample_window_size=0, extra_fields=True)
    rb.load_checkpoint(str(buffer))
    batch = rb.sample(8)
    assert batch["curr_obs"]["main_images"].shape == (8, 6, 5, 3) and batch["dones"].shape == (8, 1)
    assert batch["rewards"].shape == (8, 1) and batch["grid"].shape == (8, 2, 2)
    rb.close()


@pytest.mark.parametrize("build", [build_v30, build_v21], ids=["v3.0", "v2.1"])
def test_a_dataset_rbtool_did_not_write_imports_samples_and_verifies(tmp_path: Path, build: Any) -> None:
    lengths = [3, 5, 4]
    frames = build(tmp_path / "ds", lengths)
    before = tree_digest(tmp_path / "ds")
    result = import_lerobot(tmp_path / "ds", tmp_path / "buf")
    assert result.mode == "episodes" and result.episodes == 3 and result.frames == 12
    assert result.fields["observation.images.top"] == "curr_obs.main_images"
    assert result.fields["next.reward"] == "rewards" and result.fields["next.done"] == "dones"
    check_episode_import(tmp_path / "buf", frames, lengths)
    assert open_view(tmp_path / "buf").index.entries[0]["model_weights_id"] == "lerobot-ds"
    assert tree_digest(tmp_path / "ds") == before


def test_episodes_can_be_chosen_mapped_and_dropped(tmp_path: Path) -> None:
    frames = build_v30(tmp_path / "ds", [3, 5, 4])
    result = import_lerobot(
        tmp_path / "ds",
        tmp_path / "buf",
        episodes=[2, 0],
        field_map={"observation.state": "curr_obs.joints"},
        drop=["grid", "next.reward"],
        model_weights_id="demo-1",
    )
    assert result.episodes == 2 and result.dropped == ["next.reward", "grid"]
    view = open_view(tmp_path / "buf")
    first = trajfile.load(view.file_of(0))
    ep2 = [f for f in frames if f["episode_index"] == 2]
    assert torch.equal(
        first["curr_obs"]["joints"][:, 0], torch.from_numpy(np.stack([f["observation.state"] for f in ep2]))
    )
    assert "grid" not in first and not first["rewards"].any()  # rewards are zeros without next.reward
    assert (
        view.index.entries[1]["shape"] == [3, 1, 1] and view.index.entries[0]["model_weights_id"] == "demo-1"
    )
    with pytest.raises(UsageError, match="no episode 7"):
        import_lerobot(tmp_path / "ds", tmp_path / "buf2", episodes=[7])
    with pytest.raises(UsageError, match="no feature"):
        import_lerobot(tmp_path / "ds", tmp_path / "buf2", drop=["nope"])
    assert not (tmp_path / "buf2").exists()


def test_a_feature_that_cannot_be_a_tensor_names_itself(tmp_path: Path) -> None:
    build_v30(tmp_path / "ds", [3, 5, 4])
    info_path = tmp_path / "ds/meta/info.json"
    info = json.loads(info_path.read_text())
    info["features"]["observation.note"] = {"dtype": "string", "shape": [1], "names": None}
    info_path.write_text(json.dumps(info))
    with pytest.raises(LeRobotFeatureError, match=r"observation\.note") as caught:
        import_lerobot(tmp_path / "ds", tmp_path / "buf")
    assert caught.value.feature == "observation.note"
    assert not (tmp_path / "buf").exists()
    result = import_lerobot(tmp_path / "ds", tmp_path / "buf", drop=["observation.note"])
    assert result.fields["observation.images.top"] == "curr_obs.main_images"


def test_importing_into_an_existing_buffer_continues_its_ids(tmp_path: Path) -> None:
    frames = build_v30(tmp_path / "ds", [3, 5, 4])
    buffer = tmp_path / "buf"
    ingest([FIXTURES / "autosave_pt/autosave"], buffer)
    result = import_lerobot(tmp_path / "ds", buffer)
    assert result.added_ids == [5, 6, 7]
    check_episode_import_ids = open_view(buffer).index
    assert check_episode_import_ids.trajectory_counter == 8 and check_episode_import_ids.size == 8
    with pytest.raises(UsageError, match="pkl"):
        import_lerobot(tmp_path / "ds", buffer, trajectory_format="pkl")
    del frames


def test_the_lerobot_paths_alone_import_pyarrow() -> None:
    code = (
        "import sys\n"
        "from rbtool.cli import app\n"
        "calls = (['--help'], ['verify', sys.argv[1]], ['export', '--help'],\n"
        "         ['import', 'lerobot', '--help'])\n"
        "for argv in calls:\n"
        "    try:\n"
        "        app(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('pyarrow' in sys.modules, 'PIL' in sys.modules, file=sys.stderr)\n"
    )
    probe = subprocess.run(
        [sys.executable, "-c", code, str(FIXTURES / "autosave_pt/autosave")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert probe.stderr.strip().splitlines()[-1] == "False False"


def test_channels_first_image_features_import_as_height_width_channels(tmp_path: Path) -> None:
    frames = build_v30(tmp_path / "ds", [2, 3])
    info_path = tmp_path / "ds/meta/info.json"
    info = json.loads(info_path.read_text())
    info["features"]["observation.images.top"].update(shape=[3, 6, 5], names=["channels", "height", "width"])
    info_path.write_text(json.dumps(info))
    import_lerobot(tmp_path / "ds", tmp_path / "buf")
    traj = trajfile.load(open_view(tmp_path / "buf").file_of(1))
    images = np.stack([f["observation.images.top"] for f in frames if f["episode_index"] == 1])
    assert torch.equal(traj["curr_obs"]["main_images"][:, 0], torch.from_numpy(images))


def test_progress_counts_every_trajectory(mixed_buffer: Path, tmp_path: Path) -> None:
    calls: list[int] = []
    export_lerobot(mixed_buffer, tmp_path / "ds", fps=5, progress=calls.append)
    assert sum(calls) == 2 * 4  # planned, then written
    calls.clear()
    import_lerobot(tmp_path / "ds", tmp_path / "buf", progress=calls.append)
    assert sum(calls) == 4


def test_multi_view_uint8_fields_are_arrays_under_their_own_name(tmp_path: Path) -> None:
    traj = make_traj()
    traj["curr_obs"]["main_images"] = torch.zeros(4, 2, 2, 4, 4, 3, dtype=torch.uint8)  # two views
    source = build_buffer(tmp_path / "b", [traj])
    result = export_lerobot(source, tmp_path / "ds", fps=5)
    assert result.features["curr_obs.main_images"] == {"dtype": "uint8", "shape": [2, 4, 4, 3], "names": None}
    assert "image" not in result.features


def test_a_sidecar_missing_its_tensors_is_refused(mixed_buffer: Path, tmp_path: Path) -> None:
    export_lerobot(mixed_buffer, tmp_path / "ds", fps=5)
    (tmp_path / "ds/meta/rbtool/tensors.parquet").unlink()
    with pytest.raises(CheckpointError, match="holds no tensor"):
        import_lerobot(tmp_path / "ds", tmp_path / "buf")
    assert not (tmp_path / "buf").exists()


DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int16,
    torch.uint8,
    torch.bool,
]


def random_tensor(g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


@given(data=st.data())
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_import_of_export_is_the_identity_on_random_buffers(tmp_path: Path, data: Any) -> None:
    """Any T, B, E, dtype and per-sample shape; next_obs the next curr_obs, or not; done flags anywhere."""
    root = Path(tempfile.mkdtemp(dir=tmp_path))  # a fresh directory for every example
    trajs = []
    for n in range(data.draw(st.integers(1, 3))):
        t, b = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 3))
        e = data.draw(st.sampled_from([d for d in range(0, t + 1) if d == 0 or t % d == 0]))
        g = torch.Generator().manual_seed(n)
        traj: dict[str, Any] = {
            "rewards": torch.randn(t, b, 1, generator=g),
            "dones": torch.rand(t + e, b, 1, generator=g) < data.draw(st.sampled_from([0.0, 0.3, 1.0])),
            "curr_obs": {},
            "next_obs": {},
            "model_weights_id": f"p{n}",
        }
        for k in range(data.draw(st.integers(0, 3))):
            dtype = data.draw(st.sampled_from(DTYPES))
            shape = tuple(data.draw(st.lists(st.integers(1, 3), max_size=2)))
            cur = random_tensor(g, (t + 1, b, *shape), dtype)
            traj["curr_obs"][f"o{k}"] = cur[:-1].clone()
            shifted = data.draw(st.booleans())
            traj["next_obs"][f"o{k}"] = (
                cur[1:].clone() if shifted else random_tensor(g, (t, b, *shape), dtype)
            )
        if data.draw(st.booleans()):
            traj["curr_obs"]["image"] = torch.randint(0, 255, (t, b, 3, 2, 3), generator=g, dtype=torch.uint8)
        trajs.append(traj)
    source = build_buffer(root / "buf", trajs)
    export_lerobot(source, root / "ds", fps=5, data_file_size_mb=data.draw(st.sampled_from([0.001, 100.0])))
    import_lerobot(root / "ds", root / "back")
    assert_same_checkpoint(root / "back", source)


def test_rlinf_multi_view_image_features_stack_into_one_field(tmp_path: Path) -> None:
    """RLinf's writer splits wrist_images [N, H, W, C] into wrist_image-0, wrist_image-1, ..."""
    frames = build_v30(tmp_path / "ds", [2, 3])
    rng = np.random.default_rng(5)
    views = {f"wrist_image-{i}": rng.integers(0, 256, (5, 4, 4, 3), dtype=np.uint8) for i in (1, 0)}
    info_path = tmp_path / "ds/meta/info.json"
    info = json.loads(info_path.read_text())
    start = 0
    for path in sorted((tmp_path / "ds/data").glob("*/*.parquet")):
        table = pq.read_table(path)
        for name, images in views.items():
            part = images[start : start + table.num_rows]
            table = table.append_column(name, pa.array([{"bytes": png(v), "path": None} for v in part]))
            info["features"][name] = {
                "dtype": "image",
                "shape": [4, 4, 3],
                "names": ["height", "width", "channel"],
            }
        start += table.num_rows
        pq.write_table(table, path)
    info_path.write_text(json.dumps(info))
    result = import_lerobot(tmp_path / "ds", tmp_path / "buf")
    assert result.fields["wrist_image-0"] == "curr_obs.wrist_images[0]"
    traj = trajfile.load(open_view(tmp_path / "buf").file_of(1))
    stacked = np.stack([views["wrist_image-0"][2:], views["wrist_image-1"][2:]], axis=1)
    assert torch.equal(traj["curr_obs"]["wrist_images"][:, 0], torch.from_numpy(stacked))
    assert traj["next_obs"]["wrist_images"].shape == (3, 1, 2, 4, 4, 3)
    del frames


def test_multi_view_wrist_cameras_export_as_rlinfs_split_image_features(tmp_path: Path) -> None:
    traj = make_traj()
    g = torch.Generator().manual_seed(3)
    wrist = torch.randint(0, 255, (5, 2, 2, 4, 6, 3), generator=g, dtype=torch.uint8)  # two wrist cameras
    traj["curr_obs"]["wrist_images"], traj["next_obs"]["wrist_images"] = wrist[:-1].clone(), wrist[1:].clone()
    source = build_buffer(tmp_path / "b", [traj])
    result = export_lerobot(source, tmp_path / "ds", fps=5)
    for view in (0, 1):
        assert result.features[f"wrist_image-{view}"]["dtype"] == "image"
        assert result.columns[f"wrist_image-{view}"] == f"curr_obs.wrist_images[{view}]"
    import_lerobot(tmp_path / "ds", tmp_path / "buf")
    assert_same_checkpoint(tmp_path / "buf", source)
    # Read as plain episodes, the views stack back into RLinf's one field.
    import_lerobot(tmp_path / "ds", tmp_path / "eps", use_sidecar=False)
    first = trajfile.load(open_view(tmp_path / "eps").file_of(0))
    assert first["curr_obs"]["wrist_images"].shape[2:] == (2, 4, 6, 3)
    assert torch.equal(
        first["curr_obs"]["wrist_images"][:, 0], traj["curr_obs"]["wrist_images"][: len(first["rewards"]), 0]
    )


def test_an_interrupted_import_of_an_export_goes_on_where_it_stopped(tmp_path: Path) -> None:
    source = FIXTURES / "autosave_pt/autosave"
    export_lerobot(source, tmp_path / "ds", fps=5)
    seen: list[int] = []

    def stop_after_three(n: int) -> None:
        seen.append(n)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        import_lerobot(tmp_path / "ds", tmp_path / "buf", batch_size=2, progress=stop_after_three)
    assert open_view(tmp_path / "buf").index.id_list == [0, 1]  # the published batch
    again = import_lerobot(tmp_path / "ds", tmp_path / "buf")
    assert again.kept_ids and again.skipped == 2 and again.added_ids == [2, 3, 4]
    assert_same_checkpoint(tmp_path / "buf", source)
