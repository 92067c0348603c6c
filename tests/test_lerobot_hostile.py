"""rbtool import lerobot of datasets made to attack it: it reads nothing outside the dataset,
decodes nothing beyond its memory budget, refuses a bad sidecar, and any failure leaves the
buffer directory exactly as it was."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES, assert_one_error, run, staging_left
from test_lerobot import build_buffer, build_v21, build_v30

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("PIL")

import numpy as np  # noqa: E402

from rbtool.errors import CheckpointError  # noqa: E402
from rbtool.files import trajfile  # noqa: E402
from rbtool.files.dirs import open_view  # noqa: E402
from rbtool.interop.lerobot import MAX_BYTES_ENV, export_lerobot, import_lerobot  # noqa: E402

SOURCE = FIXTURES / "autosave_pt/autosave"
DATA_FILE = "data/chunk-000/file-000.parquet"
EPISODES_FILE = "meta/episodes/chunk-000/file-000.parquet"
# The video export read as plain episodes (its bf16 field, stored as uint16, is no trajectory dtype).
AS_EPISODES = ("--no-sidecar", "--drop", "prev_logprobs")


# ----------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Datasets built once: an rbtool export, a hand-made v3.0 and v2.1 dataset."""
    root = tmp_path_factory.mktemp("bases")
    export_lerobot(SOURCE, root / "export", fps=5)
    build_v30(root / "v30", [3, 5, 4])
    build_v21(root / "v21", [3, 5, 4])
    return {"export": root / "export", "v30": root / "v30", "v21": root / "v21"}


@pytest.fixture(scope="module")
def video_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("av")
    from test_lerobot_video import with_camera

    root = tmp_path_factory.mktemp("video")
    source = build_buffer(root / "cams", [with_camera(4, 2, 0), with_camera(3, 1, 1)])
    export_lerobot(source, root / "ds", fps=10, video=True)
    return root / "ds"


def copy_of(base: Path, tmp_path: Path) -> Path:
    """A copy of a dataset in tmp_path/ds, beside a canary directory it must never read."""
    ds = tmp_path / "ds"
    shutil.copytree(base, ds, symlinks=True)
    canary = tmp_path / "canary"
    canary.mkdir()
    # A valid data file outside the dataset: were it read, the import would succeed.
    shutil.copytree(base / "data", canary / "data", symlinks=True, dirs_exist_ok=True)
    (canary / "secret.txt").write_text("do not read me")
    return ds


def state(path: Path) -> dict[str, Any] | None:
    """Everything under `path` (None: absent). The lock file's holder line is left out."""
    if not path.exists() and not path.is_symlink():
        return None
    out: dict[str, Any] = {}
    for p in sorted(path.rglob("*")):
        rel = str(p.relative_to(path))
        if p.is_file() and not p.is_symlink():
            out[rel] = "lock" if p.name == ".rbtool.lock" else hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir" if p.is_dir() else "other"
    return out


def canary_digest(tmp_path: Path) -> dict[str, Any] | None:
    return state(tmp_path / "canary")


def assert_refused(tmp_path: Path, ds: Path, *extra: str, buffer: Path | None = None) -> str:
    """`import lerobot ds --buffer B` fails with one error, B and the canary as they were."""
    buffer = buffer or tmp_path / "out" / "buf"
    before, canary = state(buffer), canary_digest(tmp_path)
    result = run("import", "lerobot", ds, "--buffer", buffer, *extra)
    assert_one_error(result)
    assert "Traceback" not in result.stderr
    assert state(buffer) == before
    assert canary_digest(tmp_path) == canary
    if not (tmp_path / "out").exists() or before is None:
        assert not (tmp_path / "out").exists()
    else:
        assert staging_left(buffer.parent) == []
    return result.stderr


def edit_json(path: Path, change: Callable[[Any], None]) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def set_info(ds: Path, key: str, value: Any) -> None:
    def change(doc: dict[str, Any]) -> None:
        doc[key] = value

    edit_json(ds / "meta/info.json", change)


def rewrite_parquet(path: Path, change: Callable[[Any], Any]) -> None:
    pq.write_table(change(pq.read_table(path)), path)


def set_column(table: Any, name: str, values: list[Any], type_: Any = None) -> Any:
    return table.set_column(table.column_names.index(name), name, pa.array(values, type_))


# ----------------------------------------------------------------------- path templates
V3_TEMPLATES = {
    "parent": "../canary/data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
    "parent-inside": "data/../../canary/data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
    "absolute": "{root}/canary/data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
    "attribute": "data/chunk-{chunk_index.__class__}/file-{file_index:03d}.parquet",
    "attribute-chain": "data/{chunk_index.__class__.__mro__}.parquet",
    "positional": "data/chunk-{0}/file-{file_index:03d}.parquet",
    "auto-positional": "data/chunk-{}/file-{file_index:03d}.parquet",
    "indexing": "data/chunk-{x[0]}/file-{file_index:03d}.parquet",
    "field-indexing": "data/chunk-{chunk_index[0]}/file-{file_index:03d}.parquet",
    "conversion": "data/chunk-{chunk_index!r}/file-{file_index:03d}.parquet",
    "other-field": "data/chunk-{episode_index:03d}/file-{file_index:03d}.parquet",
    "nested-spec": "data/chunk-{chunk_index:{file_index}}/file-{file_index:03d}.parquet",
    "unbalanced": "data/chunk-{chunk_index:03d/file-{file_index:03d}.parquet",
    "nul": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet\u0000.txt",
    "backslash": "data\\..\\..\\canary\\file-{file_index:03d}.parquet",
    "not-a-string": 7,
    "a-list": ["data", "file.parquet"],
    "huge": "data/" + "a" * 5000 + "{chunk_index}.parquet",
}


@pytest.mark.parametrize("name", list(V3_TEMPLATES))
def test_a_hostile_data_path_is_refused(bases: dict[str, Path], tmp_path: Path, name: str) -> None:
    ds = copy_of(bases["v30"], tmp_path)
    template = V3_TEMPLATES[name]
    if isinstance(template, str):
        template = template.replace("{root}", str(tmp_path))
    set_info(ds, "data_path", template)
    assert_refused(tmp_path, ds)


FORMAT_SPECS = [
    ">3000000000",
    "03000000000d",
    "0300d",
    "021d",
    ">10",
    "x",
    "#x",
    "e",
    ",d",
    "_d",
    "s",
    "%",
    "+d",
    " d",
    "=5d",
    "c",
]


@pytest.mark.parametrize("spec", FORMAT_SPECS)
def test_an_unbounded_or_unusual_format_spec_is_refused(
    bases: dict[str, Path], tmp_path: Path, spec: str
) -> None:
    ds = copy_of(bases["v30"], tmp_path)
    set_info(ds, "data_path", "data/chunk-{chunk_index:" + spec + "}/file-{file_index:03d}.parquet")
    stderr = assert_refused(tmp_path, ds)
    assert "format" in stderr or "template" in stderr


@pytest.mark.parametrize("spec", ["03d", "3d", "d", "", "020d"])
def test_the_integer_forms_lerobot_uses_are_read(bases: dict[str, Path], tmp_path: Path, spec: str) -> None:
    ds = copy_of(bases["v30"], tmp_path)
    template = "data/chunk-{chunk_index" + (f":{spec}" if spec else "") + "}/file-{file_index:03d}.parquet"
    set_info(ds, "data_path", template)
    directory = format(0, spec)
    if directory != "000":
        os.rename(ds / "data/chunk-000", ds / f"data/chunk-{directory}")
    result = run("import", "lerobot", ds, "--buffer", tmp_path / "buf", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["added"] == 3


V2_TEMPLATES = {
    "parent": "../canary/episode_{episode_index:06d}.parquet",
    "absolute": "{root}/canary/episode_{episode_index:06d}.parquet",
    "attribute": "data/chunk-{episode_chunk:03d}/episode_{episode_index.real}.parquet",
    "indexing": "data/chunk-{episode_chunk[0]}/episode_{episode_index:06d}.parquet",
    "v3-field": "data/chunk-{chunk_index:03d}/episode_{episode_index:06d}.parquet",
    "wide": "data/chunk-{episode_chunk:03d}/episode_{episode_index:999999d}.parquet",
}


@pytest.mark.parametrize("name", list(V2_TEMPLATES))
def test_a_hostile_v2_data_path_is_refused(bases: dict[str, Path], tmp_path: Path, name: str) -> None:
    ds = copy_of(bases["v21"], tmp_path)
    # The canary holds the same episode files: were the template followed, the import would succeed.
    for p in (ds / "data/chunk-000").iterdir():
        shutil.copy(p, tmp_path / "canary" / p.name)
    set_info(ds, "data_path", V2_TEMPLATES[name].replace("{root}", str(tmp_path)))
    assert_refused(tmp_path, ds)


VIDEO_TEMPLATES = {
    "parent": "../canary/{video_key}/file-{file_index:03d}.mp4",
    "absolute": "/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4",
    "attribute": "videos/{video_key.__class__}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4",
    "string-spec": "videos/{video_key:>99999}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4",
    "indexing": "videos/{video_key[0]}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4",
}


@pytest.mark.parametrize("name", list(VIDEO_TEMPLATES))
def test_a_hostile_video_path_is_refused(video_base: Path, tmp_path: Path, name: str) -> None:
    ds = copy_of(video_base, tmp_path)
    shutil.copytree(ds / "videos", tmp_path / "canary" / "videos")
    set_info(ds, "video_path", VIDEO_TEMPLATES[name])
    assert_refused(tmp_path, ds, *AS_EPISODES)


def test_a_video_feature_named_to_climb_out_is_refused(video_base: Path, tmp_path: Path) -> None:
    ds = copy_of(video_base, tmp_path)
    set_info(ds, "video_path", "videos/{video_key}/../../../canary/file-{file_index:03d}.mp4")
    assert_refused(tmp_path, ds, *AS_EPISODES)


# ----------------------------------------------------------------------- symlinks and special files
def _link_data_file_outside(ds: Path, tmp: Path) -> None:
    target = ds / DATA_FILE
    os.replace(target, tmp / "canary" / "moved.parquet")
    target.symlink_to(tmp / "canary" / "moved.parquet")


def _link_data_file_inside(ds: Path, tmp: Path) -> None:
    target = ds / DATA_FILE
    os.replace(target, ds / "meta" / "moved.parquet")
    target.symlink_to("../../meta/moved.parquet")


def _link_data_dir(ds: Path, tmp: Path) -> None:
    shutil.move(str(ds / "data"), str(tmp / "canary" / "moved-data"))
    (ds / "data").symlink_to(tmp / "canary" / "moved-data")


def _link_chunk_dir(ds: Path, tmp: Path) -> None:
    shutil.move(str(ds / "data/chunk-000"), str(tmp / "canary" / "chunk"))
    (ds / "data/chunk-000").symlink_to(tmp / "canary" / "chunk")


def _link_info(ds: Path, tmp: Path) -> None:
    os.replace(ds / "meta/info.json", tmp / "canary" / "info.json")
    (ds / "meta/info.json").symlink_to(tmp / "canary" / "info.json")


def _link_meta(ds: Path, tmp: Path) -> None:
    shutil.move(str(ds / "meta"), str(tmp / "canary" / "meta"))
    (ds / "meta").symlink_to(tmp / "canary" / "meta")


def _link_episodes_chunk(ds: Path, tmp: Path) -> None:
    shutil.move(str(ds / "meta/episodes/chunk-000"), str(tmp / "canary" / "episodes"))
    (ds / "meta/episodes/chunk-000").symlink_to(tmp / "canary" / "episodes")


def _link_episodes_file(ds: Path, tmp: Path) -> None:
    os.replace(ds / EPISODES_FILE, tmp / "canary" / "episodes.parquet")
    (ds / EPISODES_FILE).symlink_to(tmp / "canary" / "episodes.parquet")


def _link_tasks(ds: Path, tmp: Path) -> None:
    os.replace(ds / "meta/tasks.parquet", tmp / "canary" / "tasks.parquet")
    (ds / "meta/tasks.parquet").symlink_to(tmp / "canary" / "tasks.parquet")


def _fifo_data_file(ds: Path, tmp: Path) -> None:
    (ds / DATA_FILE).unlink()
    os.mkfifo(ds / DATA_FILE)


def _dir_as_data_file(ds: Path, tmp: Path) -> None:
    (ds / DATA_FILE).unlink()
    (ds / DATA_FILE).mkdir()


LINKS = {
    "data-file-outside": _link_data_file_outside,
    "data-file-inside": _link_data_file_inside,
    "data-dir": _link_data_dir,
    "chunk-dir": _link_chunk_dir,
    "info": _link_info,
    "meta-dir": _link_meta,
    "episodes-chunk-dir": _link_episodes_chunk,
    "episodes-file": _link_episodes_file,
    "tasks": _link_tasks,
    "fifo-data-file": _fifo_data_file,
    "dir-as-data-file": _dir_as_data_file,
}


@pytest.mark.parametrize("name", list(LINKS))
def test_a_symlink_or_special_file_in_the_dataset_is_refused(
    bases: dict[str, Path], tmp_path: Path, name: str
) -> None:
    ds = copy_of(bases["v30"], tmp_path)
    LINKS[name](ds, tmp_path)
    assert_refused(tmp_path, ds)


@pytest.mark.parametrize("what", ["sidecar", "tensors"])
def test_a_symlinked_sidecar_is_refused(bases: dict[str, Path], tmp_path: Path, what: str) -> None:
    ds = copy_of(bases["export"], tmp_path)
    rel = "meta/rbtool.json" if what == "sidecar" else "meta/rbtool/tensors.parquet"
    os.replace(ds / rel, tmp_path / "canary" / "moved")
    (ds / rel).symlink_to(tmp_path / "canary" / "moved")
    assert_refused(tmp_path, ds)


def test_a_symlinked_video_file_is_refused(video_base: Path, tmp_path: Path) -> None:
    ds = copy_of(video_base, tmp_path)
    video = next((ds / "videos").rglob("*.mp4"))
    os.replace(video, tmp_path / "canary" / "moved.mp4")
    video.symlink_to(tmp_path / "canary" / "moved.mp4")
    assert_refused(tmp_path, ds, *AS_EPISODES)


def test_the_dataset_root_itself_may_be_a_symlink(bases: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to(bases["v30"])
    result = run("import", "lerobot", tmp_path / "link", "--buffer", tmp_path / "buf", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["added"] == 3


# ----------------------------------------------------------------------- episodes
def _episodes(change: Callable[[Any], Any]) -> Callable[[Path], None]:
    def apply(ds: Path) -> None:
        rewrite_parquet(ds / EPISODES_FILE, change)

    return apply


def _v3_column(name: str, values: list[Any], type_: Any = None) -> Callable[[Path], None]:
    return _episodes(lambda t: set_column(t, name, values, type_))


def _v3_duplicate(ds: Path) -> None:
    rewrite_parquet(ds / EPISODES_FILE, lambda t: pa.concat_tables([t, t.slice(1, 1)]))


def _v2_lines(change: Callable[[list[Any]], None]) -> Callable[[Path], None]:
    def apply(ds: Path) -> None:
        path = ds / "meta/episodes.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        change(rows)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    return apply


def _v2_set(row: int, key: str, value: Any) -> Callable[[Path], None]:
    def change(rows: list[Any]) -> None:
        rows[row][key] = value

    return _v2_lines(change)


EPISODE_ATTACKS: dict[str, tuple[str, Callable[[Path], None]]] = {
    "v3-negative-index": ("v30", _v3_column("episode_index", [0, -1, 2])),
    "v3-duplicate-index": ("v30", _v3_column("episode_index", [0, 1, 1])),
    "v3-duplicate-row": ("v30", _v3_duplicate),
    "v3-negative-length": ("v30", _v3_column("length", [3, -5, 4])),
    "v3-float-length": ("v30", _v3_column("length", [3.0, 5.0, 4.0])),
    "v3-string-index": ("v30", _v3_column("episode_index", ["0", "1", "2"])),
    "v3-negative-chunk": ("v30", _v3_column("data/chunk_index", [0, -1, 0])),
    "v3-negative-file": ("v30", _v3_column("data/file_index", [0, -1, 1])),
    "v3-null-file": ("v30", _v3_column("data/file_index", [0, None, 1], pa.int64())),
    "v3-negative-from-index": ("v30", _v3_column("dataset_from_index", [0, -3, 8])),
    "v3-tasks-not-a-list": ("v30", _v3_column("tasks", ["a", "b", "c"])),
    "v2-negative-index": ("v21", _v2_set(1, "episode_index", -1)),
    "v2-duplicate-index": ("v21", _v2_set(2, "episode_index", 1)),
    "v2-huge-index": ("v21", _v2_set(1, "episode_index", 2**70)),
    "v2-negative-length": ("v21", _v2_set(0, "length", -1)),
    "v2-string-length": ("v21", _v2_set(0, "length", "3")),
    "v2-bool-index": ("v21", _v2_set(1, "episode_index", True)),
    "v2-not-an-object": ("v21", _v2_lines(lambda rows: rows.__setitem__(0, [1, 2]))),
    "v2-zero-chunks": ("v21", lambda ds: set_info(ds, "chunks_size", 0)),
    "v2-negative-chunks": ("v21", lambda ds: set_info(ds, "chunks_size", -4)),
}


@pytest.mark.parametrize("name", list(EPISODE_ATTACKS))
def test_bad_episode_metadata_is_refused(bases: dict[str, Path], tmp_path: Path, name: str) -> None:
    base, attack = EPISODE_ATTACKS[name]
    ds = copy_of(bases[base], tmp_path)
    attack(ds)
    assert_refused(tmp_path, ds)


def _tasks_line(line: str) -> Callable[[Path], None]:
    def apply(ds: Path) -> None:
        with open(ds / "meta/tasks.jsonl", "a") as handle:
            handle.write(line + "\n")

    return apply


def _raw_info(text: bytes) -> Callable[[Path], None]:
    def apply(ds: Path) -> None:
        (ds / "meta/info.json").write_bytes(text)

    return apply


INFO_ATTACKS: dict[str, tuple[str, Callable[[Path], None]]] = {
    "features-list": ("v30", lambda ds: set_info(ds, "features", [1, 2])),
    "version-object": ("v30", lambda ds: set_info(ds, "codebase_version", {"v": 3})),
    "total-episodes-string": ("v30", lambda ds: set_info(ds, "total_episodes", "many")),
    "total-episodes-negative": ("v30", lambda ds: set_info(ds, "total_episodes", -1)),
    "info-not-utf8": ("v30", _raw_info(b"\xff\xfe{")),
    "info-deep": ("v30", _raw_info(b"[" * 100000 + b"]" * 100000)),
    "tasks-line-no-index": ("v21", _tasks_line('{"task": "x"}')),
    "tasks-line-negative": ("v21", _tasks_line('{"task_index": -1, "task": "x"}')),
    "tasks-line-list": ("v21", _tasks_line("[1]")),
    "tasks-line-not-json": ("v21", _tasks_line("{")),
}


@pytest.mark.parametrize("name", list(INFO_ATTACKS))
def test_bad_info_and_task_metadata_are_refused(bases: dict[str, Path], tmp_path: Path, name: str) -> None:
    base, attack = INFO_ATTACKS[name]
    ds = copy_of(bases[base], tmp_path)
    attack(ds)
    assert_refused(tmp_path, ds)


# ----------------------------------------------------------------------- declared shapes and budgets
def _feature(name: str, **spec: Any) -> Callable[[Path], None]:
    def apply(ds: Path) -> None:
        def change(doc: dict[str, Any]) -> None:
            doc["features"][name].update(spec)

        edit_json(ds / "meta/info.json", change)

    return apply


def _feature_raw(name: str, value: Any) -> Callable[[Path], None]:
    def apply(ds: Path) -> None:
        def change(doc: dict[str, Any]) -> None:
            doc["features"][name] = value

        edit_json(ds / "meta/info.json", change)

    return apply


SHAPE_ATTACKS = {
    "terabytes": _feature("observation.state", shape=[1 << 20, 1 << 20]),
    "dim-2**31": _feature("observation.state", shape=[1 << 31]),
    "dim-2**70": _feature("observation.state", shape=[2**70]),
    "negative": _feature("observation.state", shape=[-3]),
    "string-dim": _feature("observation.state", shape=["3"]),
    "float-dim": _feature("observation.state", shape=[3.0]),
    "bool-dim": _feature("observation.state", shape=[True]),
    "no-dims": _feature("observation.state", shape=[]),
    "nine-dims": _feature("observation.state", shape=[1] * 9),
    "not-a-list": _feature("observation.state", shape=3),
    "no-dtype": _feature("observation.state", dtype=None),
    "not-an-object": _feature_raw("observation.state", [3]),
    "huge-image": _feature("observation.images.top", shape=[100000, 100000, 3]),
    "huge-frame-index": _feature("frame_index", shape=[1 << 30, 1 << 30]),
}


@pytest.mark.parametrize("name", list(SHAPE_ATTACKS))
def test_a_bad_or_oversized_declared_shape_is_refused(
    bases: dict[str, Path], tmp_path: Path, name: str
) -> None:
    ds = copy_of(bases["v30"], tmp_path)
    SHAPE_ATTACKS[name](ds)
    assert_refused(tmp_path, ds)


def test_an_episode_over_the_budget_is_refused_before_decoding(
    bases: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = copy_of(bases["v30"], tmp_path)
    _feature("observation.images.top", shape=[600, 500, 3])(ds)  # 900 kB a frame, 4.5 MB an episode
    monkeypatch.setenv(MAX_BYTES_ENV, "4M")
    stderr = assert_refused(tmp_path, ds)
    assert MAX_BYTES_ENV in stderr and "episode 1" in stderr


def test_a_budget_that_is_not_a_byte_count_is_a_usage_error(
    bases: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MAX_BYTES_ENV, "lots")
    result = run("import", "lerobot", bases["v30"], "--buffer", tmp_path / "buf")
    assert_one_error(result, 2)
    assert not (tmp_path / "buf").exists()


def _big_grid(ds: Path) -> None:
    """Every frame's `grid` (declared [2, 2]) holds 200000 values: megabytes once decoded."""
    for path in sorted((ds / "data").rglob("*.parquet")):
        table = pq.read_table(path)
        rows = [[[0] * 1000] * 200 for _ in range(table.num_rows)]
        pq.write_table(set_column(table, "grid", rows, pa.list_(pa.list_(pa.int16()))), path)


def _big_episodes(ds: Path) -> None:
    """Each episode row lists 2000 tasks of 1000 characters."""
    rewrite_parquet(ds / EPISODES_FILE, lambda t: set_column(t, "tasks", [["x" * 1000] * 2000] * t.num_rows))


def _big_tasks(ds: Path) -> None:
    pq.write_table(
        pa.table({"task_index": [0, 1], "task": ["x" * 3_000_000, "y"]}), ds / "meta/tasks.parquet"
    )


ROW_GROUP_ATTACKS = {"data": _big_grid, "episodes": _big_episodes, "tasks": _big_tasks}


@pytest.mark.parametrize("name", list(ROW_GROUP_ATTACKS))
def test_parquet_over_the_budget_is_refused_before_decoding(
    bases: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    ds = copy_of(bases["v30"], tmp_path)
    ROW_GROUP_ATTACKS[name](ds)
    monkeypatch.setenv(MAX_BYTES_ENV, "1M")
    stderr = assert_refused(tmp_path, ds)
    assert MAX_BYTES_ENV in stderr


def test_sidecar_tensors_over_the_budget_are_refused(
    bases: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = copy_of(bases["export"], tmp_path)
    path = ds / "meta/rbtool/tensors.parquet"
    table = pq.read_table(path)
    blob = table.column("data").to_pylist()
    blob[0] = b"\0" * 3_000_000
    pq.write_table(set_column(table, "data", blob, table.schema.field("data").type), path)
    monkeypatch.setenv(MAX_BYTES_ENV, "2M")
    assert MAX_BYTES_ENV in assert_refused(tmp_path, ds)


# ----------------------------------------------------------------------- video
def _video_shape(ds: Path) -> None:
    def change(doc: dict[str, Any]) -> None:
        doc["features"]["image"]["shape"] = [32, 32, 3]
        doc["features"]["image"]["info"]["video.height"] = 32

    edit_json(ds / "meta/info.json", change)


def _video_shift(seconds: float) -> Callable[[Path], None]:
    def apply(ds: Path) -> None:
        def change(t: Any) -> Any:
            column = "videos/image/from_timestamp"
            return set_column(t, column, [v + seconds for v in t.column(column).to_pylist()])

        rewrite_parquet(ds / EPISODES_FILE, change)

    return apply


def _video_from(value: Any) -> Callable[[Path], None]:
    def apply(ds: Path) -> None:
        def change(t: Any) -> Any:
            column = "videos/image/from_timestamp"
            return set_column(t, column, [value] * t.num_rows, pa.float64())

        rewrite_parquet(ds / EPISODES_FILE, change)

    return apply


def _video_longer_episode(ds: Path) -> None:
    """The last episode claims twice the frames its video file holds (data rows alike)."""
    frames = pq.read_table(ds / DATA_FILE)
    last = frames.column("episode_index").to_pylist()[-1]
    part = frames.filter(pa.compute.equal(frames.column("episode_index"), last))
    steps = part.num_rows
    more = part.set_column(
        part.column_names.index("frame_index"), "frame_index", pa.array(range(steps, 2 * steps), pa.int64())
    )
    more = more.set_column(
        more.column_names.index("timestamp"),
        "timestamp",
        pa.array([i / 10 for i in range(steps, 2 * steps)], pa.float32()),
    )
    pq.write_table(pa.concat_tables([frames, more]), ds / DATA_FILE)

    def change(t: Any) -> Any:
        lengths = t.column("length").to_pylist()
        lengths[-1] *= 2
        return set_column(t, "length", lengths, pa.int64())

    rewrite_parquet(ds / EPISODES_FILE, change)


def _video_fps(value: Any) -> Callable[[Path], None]:
    def apply(ds: Path) -> None:
        def change(doc: dict[str, Any]) -> None:
            doc["features"]["image"]["info"]["video.fps"] = value

        edit_json(ds / "meta/info.json", change)

    return apply


VIDEO_ATTACKS = {
    "frame-size": _video_shape,
    "far-timestamp": _video_shift(100.0),
    "negative-timestamp": _video_from(-1.0),
    "nan-timestamp": _video_from(float("nan")),
    "more-frames-than-the-video": _video_longer_episode,
    "negative-fps": _video_fps(-10),
    "string-fps": _video_fps("10"),
}


@pytest.mark.parametrize("name", list(VIDEO_ATTACKS))
def test_video_that_disagrees_with_its_metadata_is_refused(
    video_base: Path, tmp_path: Path, name: str
) -> None:
    ds = copy_of(video_base, tmp_path)
    VIDEO_ATTACKS[name](ds)
    assert_refused(tmp_path, ds, *AS_EPISODES)


def test_video_frames_are_decoded_as_episodes_want_them(video_base: Path, tmp_path: Path) -> None:
    """Decoded frame by frame, forward, the frames are those of a whole-file decode."""
    av = pytest.importorskip("av")
    result = import_lerobot(video_base, tmp_path / "buf", use_sidecar=False, drop=["prev_logprobs"])
    view = open_view(tmp_path / "buf")
    path = video_base / "videos/image/chunk-000/file-000.mp4"
    with av.open(str(path)) as container:
        every = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])])
    got = np.concatenate(
        [trajfile.load(view.file_of(t))["curr_obs"]["main_images"][:, 0].numpy() for t in view.index.id_list]
    )
    assert result.frames == len(every) and np.array_equal(got, every)


# ----------------------------------------------------------------------- the sidecar
def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        node: Any = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return change


CKPT = ("checkpoint",)
T0 = ("trajectories", 0)
NODE = ("schemas", 0, 2)  # the `actions` column node
SIDECAR_ATTACKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "version-2": _set(("rbtool_sidecar",), 2),
    "version-0": _set(("rbtool_sidecar",), 0),
    "version-string": _set(("rbtool_sidecar",), "1"),
    "version-bool": _set(("rbtool_sidecar",), True),
    "counter-2**70": _set((*CKPT, "trajectory_counter"), 2**70),
    "counter-2**63": _set((*CKPT, "trajectory_counter"), 2**63),
    "counter-negative": _set((*CKPT, "trajectory_counter"), -1),
    "counter-string": _set((*CKPT, "trajectory_counter"), "5"),
    "counter-float": _set((*CKPT, "trajectory_counter"), 5.0),
    "counter-bool": _set((*CKPT, "trajectory_counter"), True),
    "counter-below-ids": _set((*CKPT, "trajectory_counter"), 2),
    "seed-string": _set((*CKPT, "seed"), "1234"),
    "seed-float": _set((*CKPT, "seed"), 12.5),
    "seed-2**64": _set((*CKPT, "seed"), 2**64),
    "seed-below-int64": _set((*CKPT, "seed"), -(2**63) - 1),
    "seed-list": _set((*CKPT, "seed"), [1]),
    "seed-bool": _set((*CKPT, "seed"), True),
    "format-exe": _set((*CKPT, "trajectory_format"), "exe"),
    "format-upper": _set((*CKPT, "trajectory_format"), "PT"),
    "format-number": _set((*CKPT, "trajectory_format"), 1),
    "ids-duplicate": _set((*CKPT, "trajectory_id_list"), [0, 0, 1, 2, 3]),
    "ids-negative": _set((*CKPT, "trajectory_id_list"), [-1, 1, 2, 3, 4]),
    "ids-2**63": _set((*CKPT, "trajectory_id_list"), [0, 1, 2, 3, 2**63]),
    "ids-string": _set((*CKPT, "trajectory_id_list"), "01234"),
    "ids-other-order": _set((*CKPT, "trajectory_id_list"), [4, 3, 2, 1, 0]),
    "extra-metadata-list": _set((*CKPT, "extra_metadata"), [1, 2]),
    "extra-metadata-string": _set((*CKPT, "extra_metadata"), "seed=1"),
    "checkpoint-list": _set(CKPT, []),
    "trajectories-object": _set(("trajectories",), {}),
    "tid-negative": _set((*T0, "trajectory_id"), -1),
    "tid-2**63": _set((*T0, "trajectory_id"), 2**63),
    "tid-string": _set((*T0, "trajectory_id"), "0"),
    "tid-not-listed": _set((*T0, "trajectory_id"), 99),
    "T-negative": _set((*T0, "T"), -4),
    "T-2**40": _set((*T0, "T"), 2**40),
    "B-string": _set((*T0, "B"), "2"),
    "schema-out-of-range": _set((*T0, "schema"), 5),
    "schema-negative": _set((*T0, "schema"), -1),
    "values-missing": _set((*T0, "values"), []),
    "digest-not-hex": _set((*T0, "digest"), "x" * 64),
    "episodes-past-the-end": _set((*T0, "episodes"), [0, 10**6]),
    "episodes-negative": _set((*T0, "episodes"), [-1, 1]),
    "episodes-string": _set((*T0, "episodes"), "0:4"),
    "entry-num-samples": _set((*T0, "entry", "num_samples"), 999),
    "entry-shape-short": _set((*T0, "entry", "shape"), [4]),
    "entry-shape-other-T": _set((*T0, "entry", "shape"), [5, 2, 7]),
    "entry-shape-trailing": _set((*T0, "entry", "shape"), [4, 2, 9]),
    "entry-weights-id-path": _set((*T0, "entry", "model_weights_id"), "../../escape"),
    "entry-other-id": _set((*T0, "entry", "trajectory_id"), 7),
    "entry-list": _set((*T0, "entry"), [1]),
    "tensors-outside": _set(("tensors",), "../canary/secret.txt"),
    "tensors-absolute": _set(("tensors",), "/etc/passwd"),
    "tensors-number": _set(("tensors",), 5),
    "node-shape-huge": _set((*NODE, "shape"), [2**40]),
    "node-shape-negative": _set((*NODE, "shape"), [-1]),
    "node-dtype-object": _set((*NODE, "dtype"), "object"),
    "node-dtype-dunder": _set((*NODE, "dtype"), "__class__"),
    "node-kind-unknown": _set((*NODE, "kind"), "eval"),
    "node-path-empty": _set((*NODE, "path"), []),
    "node-path-not-strings": _set((*NODE, "path"), [1]),
    "node-path-under-a-tensor": _set((*NODE, "path"), ["rewards", "x"]),
    "node-feature-missing": _set((*NODE, "feature"), "nope"),
    "node-extra-rows-negative": _set((*NODE, "extra_rows"), -1),
    "derived-source-missing": _set(("schemas", 0, 16, "source"), ["curr_obs", "nothing"]),
    "column-path-string": _set(("columns", "actions", "path"), "actions"),
    "column-views-negative": _set(("columns", "actions", "views"), -1),
    "column-video-string": _set(("columns", "actions", "video"), "yes"),
}


@pytest.mark.parametrize("name", list(SIDECAR_ATTACKS))
def test_a_bad_sidecar_is_one_error_and_leaves_no_buffer(
    bases: dict[str, Path], tmp_path: Path, name: str
) -> None:
    ds = copy_of(bases["export"], tmp_path)
    edit_json(ds / "meta/rbtool.json", SIDECAR_ATTACKS[name])
    assert_refused(tmp_path, ds)


@pytest.mark.parametrize("field", ["trajectory_counter", "trajectory_id_list"])
def test_a_counter_past_int64_no_longer_leaves_a_buffer_naming_missing_files(
    bases: dict[str, Path], tmp_path: Path, field: str
) -> None:
    """A counter of 2**70 made the import write an index, then fail on the metadata."""
    ds = copy_of(bases["export"], tmp_path)
    value: Any = 2**70 if field == "trajectory_counter" else [0, 1, 2, 3, 2**70]
    edit_json(ds / "meta/rbtool.json", _set((*CKPT, field), value))
    stderr = assert_refused(tmp_path, ds)
    assert "2**63" in stderr


def _blob(kind: str) -> Callable[[Path], None]:
    def apply(ds: Path) -> None:
        path = ds / "meta/rbtool/tensors.parquet"
        table = pq.read_table(path)
        rows = table.to_pylist()
        if kind == "short-data":
            rows[0]["data"] = rows[0]["data"][:-1] + b"" if rows[0]["data"] else b"x"
        elif kind == "shape":
            rows[0]["shape"] = [10**6, 10**6]
        elif kind == "dtype":
            rows[0]["dtype"] = "manual_seed"
        pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)

    return apply


@pytest.mark.parametrize("kind", ["short-data", "shape", "dtype"])
def test_a_bad_sidecar_tensor_is_one_error(bases: dict[str, Path], tmp_path: Path, kind: str) -> None:
    ds = copy_of(bases["export"], tmp_path)
    _blob(kind)(ds)
    assert_refused(tmp_path, ds)


# ----------------------------------------------------------------------- the buffer as it was
def _changed_late(ds: Path) -> None:
    """The frames of the last trajectory changed: found only after earlier ones were written."""
    path = ds / DATA_FILE
    table = pq.read_table(path)
    values = table.column("actions").combine_chunks().flatten().to_numpy().copy()
    values[-1] += 1.0
    pq.write_table(
        set_column(
            table,
            "actions",
            pa.FixedSizeListArray.from_arrays(pa.array(values), 7).to_pylist(),
            table.schema.field("actions").type,
        ),
        path,
    )


BUFFERS = ["absent", "absent-parents", "empty-dir", "rbtool-buffer", "rlinf-checkpoint"]


def make_buffer(tmp_path: Path, kind: str) -> Path:
    if kind == "absent":
        return tmp_path / "out" / "buf"
    if kind == "absent-parents":
        return tmp_path / "out" / "a" / "b" / "buf"
    buffer = tmp_path / "out" / "buf"
    if kind == "empty-dir":
        buffer.mkdir(parents=True)
    elif kind == "rbtool-buffer":
        (tmp_path / "out").mkdir()
        from rbtool.ops.ingestion import ingest

        ingest(sorted((FIXTURES / "varying_shapes_pt/ckpt").glob("trajectory_*.pt")), buffer)
    else:
        (tmp_path / "out").mkdir()
        shutil.copytree(FIXTURES / "varying_shapes_pt/ckpt", buffer)
    return buffer


@pytest.mark.parametrize("kind", BUFFERS)
@pytest.mark.parametrize("failure", ["late-digest", "sidecar-counter", "episodes-late"])
def test_any_failure_leaves_the_buffer_exactly_as_it_was(
    bases: dict[str, Path], tmp_path: Path, kind: str, failure: str
) -> None:
    buffer = make_buffer(tmp_path, kind)
    if failure == "episodes-late":
        ds = copy_of(bases["v30"], tmp_path)
        # The last episode's frames do not decode: found after earlier episodes were written.
        path = ds / "data/chunk-000/file-001.parquet"
        table = pq.read_table(path)
        images = table.column("observation.images.top").to_pylist()
        images[-1] = {"bytes": b"not a png", "path": None}
        pq.write_table(
            set_column(
                table, "observation.images.top", images, table.schema.field("observation.images.top").type
            ),
            path,
        )
    else:
        ds = copy_of(bases["export"], tmp_path)
        if failure == "late-digest":
            _changed_late(ds)
        else:
            edit_json(ds / "meta/rbtool.json", _set((*CKPT, "trajectory_counter"), 2**70))
    before = state(buffer)
    with pytest.raises(CheckpointError):
        import_lerobot(ds, buffer, batch_size=1)  # every trajectory published as it comes
    assert state(buffer) == before
    assert staging_left(buffer.parent if buffer.parent.exists() else tmp_path) == []
    if before is None:
        assert not (tmp_path / "out").exists()
    assert_refused(tmp_path, ds, buffer=buffer)


def test_a_failure_after_published_batches_says_they_were_removed(tmp_path: Path) -> None:
    """70 one-frame episodes, the last one's image unreadable: found after ids 0-63 were published."""
    build_v30(tmp_path / "ds", [1] * 70)
    path = tmp_path / "ds/data/chunk-000/file-001.parquet"
    table = pq.read_table(path)
    images = table.column("observation.images.top").to_pylist()
    images[-1] = {"bytes": b"not a png", "path": None}
    kind = table.schema.field("observation.images.top").type
    pq.write_table(set_column(table, "observation.images.top", images, kind), path)
    result = run("import", "lerobot", tmp_path / "ds", "--buffer", tmp_path / "out/buf")
    assert result.exit_code == 1 and result.stdout == "" and "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert lines[:-1] == ["added trajectory ids 0-63"]
    assert lines[-1].startswith("Error: ") and "(0-63) were removed, the buffer is as it was" in lines[-1]
    assert not (tmp_path / "out").exists()


def test_an_interrupted_import_still_keeps_its_published_batches(
    bases: dict[str, Path], tmp_path: Path
) -> None:
    """Ctrl-C is no failure of the dataset: what was published stays, and a rerun goes on."""
    seen: list[int] = []

    def stop(n: int) -> None:
        seen.append(n)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        import_lerobot(bases["export"], tmp_path / "buf", batch_size=2, progress=stop)
    assert open_view(tmp_path / "buf").index.id_list == [0, 1]
    assert import_lerobot(bases["export"], tmp_path / "buf").skipped == 2


def test_a_dry_run_of_a_bad_dataset_creates_nothing(bases: dict[str, Path], tmp_path: Path) -> None:
    ds = copy_of(bases["v30"], tmp_path)
    set_info(ds, "data_path", V3_TEMPLATES["parent"])
    assert_refused(tmp_path, ds, "--dry-run")
