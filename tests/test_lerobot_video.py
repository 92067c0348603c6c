"""lerobot with video: `export --video` writes LeRobot v3.0 video features, import decodes them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_lerobot import assert_same_checkpoint, build_buffer, build_v30, generated

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
av = pytest.importorskip("av")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rbtool.errors import CheckpointError, UsageError  # noqa: E402
from rbtool.files import trajfile  # noqa: E402
from rbtool.files.dirs import open_view  # noqa: E402
from rbtool.interop.lerobot import export_lerobot, import_lerobot  # noqa: E402

FPS = 10


def smooth_frames(n: int, height: int, width: int, seed: int) -> np.ndarray:
    """uint8 frames `[n, H, W, 3]` a lossy codec keeps close: gradients that move from frame to frame."""
    y, x = np.mgrid[0:height, 0:width]
    frames = []
    for i in range(n):
        shift = (3 * i + 11 * seed) % 60
        r = 20 + x * 150 // max(width - 1, 1) + shift
        g = 20 + y * 150 // max(height - 1, 1) + (2 * shift) % 60
        b = np.full_like(r, 60 + (5 * i + 17 * seed) % 120)
        frames.append(np.stack([r, g, b], axis=-1))
    return np.stack(frames).astype(np.uint8)


def with_camera(
    t: int, b: int, seed: int, height: int = 16, width: int = 16, wrist: int = 4
) -> dict[str, Any]:
    """A generated trajectory whose main camera (and two wrist views) are smooth RGB frames."""
    traj = generated(t=t, b=b, seed=seed)
    main = smooth_frames((t + 1) * b, height, width, seed).reshape(t + 1, b, height, width, 3)
    views = smooth_frames((t + 1) * b * 2, wrist, wrist, seed + 5).reshape(t + 1, b, 2, wrist, wrist, 3)
    main_t, wrist_t = torch.from_numpy(main), torch.from_numpy(views)
    traj["curr_obs"]["main_images"], traj["next_obs"]["main_images"] = main_t[:-1].clone(), main_t[1:].clone()
    traj["curr_obs"]["wrist_images"], traj["next_obs"]["wrist_images"] = (
        wrist_t[:-1].clone(),
        wrist_t[1:].clone(),
    )
    return traj


@pytest.fixture
def camera_buffer(tmp_path: Path) -> Path:
    trajs = [with_camera(4, 2, 0), with_camera(6, 1, 1), with_camera(3, 2, 2)]
    return build_buffer(tmp_path / "cams", trajs)


def decode(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = list(container.decode(stream))
    times = np.array([float(f.pts * f.time_base) for f in frames])
    return times, np.stack([f.to_ndarray(format="rgb24") for f in frames])


def episode_rows(root: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path in sorted((root / "meta/episodes").glob("*/*.parquet")):
        rows.extend(pq.read_table(path).to_pylist())
    return sorted(rows, key=lambda r: r["episode_index"])


def buffer_frames(buffer: Path, field: tuple[str, ...]) -> np.ndarray:
    """The field's rows in export frame order: trajectories in id order, env columns, steps."""
    view = open_view(buffer)
    out = []
    for tid in view.index.id_list:
        value: Any = trajfile.load(view.file_of(tid))
        for key in field:
            value = value[key]
        out.append(value.numpy().swapaxes(0, 1).reshape(-1, *value.shape[2:]))
    return np.concatenate(out)


# ----------------------------------------------------------------------- round trip
def test_a_video_export_imports_back_bit_for_bit(camera_buffer: Path, tmp_path: Path) -> None:
    result = export_lerobot(camera_buffer, tmp_path / "ds", fps=FPS, video=True)
    kinds = {name: spec["dtype"] for name, spec in result.features.items()}
    assert kinds["image"] == kinds["wrist_image-0"] == kinds["wrist_image-1"] == "video"
    assert kinds["gray"] == "image"  # one channel: no yuv420p video, a PNG image feature
    assert result.video_files == 3 and result.columns["image"] == "curr_obs.main_images"
    imported = import_lerobot(tmp_path / "ds", tmp_path / "buf")
    assert imported.mode == "rbtool" and imported.kept_ids
    assert_same_checkpoint(tmp_path / "buf", camera_buffer)  # the sidecar keeps the exact rows


# ----------------------------------------------------------------------- layout
def test_the_video_layout_is_lerobots_v30(camera_buffer: Path, tmp_path: Path) -> None:
    root = tmp_path / "ds"
    result = export_lerobot(camera_buffer, root, fps=FPS, video=True)
    info = json.loads((root / "meta/info.json").read_text())
    assert info["video_path"] == "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    spec = info["features"]["image"]
    assert spec["dtype"] == "video" and spec["shape"] == [16, 16, 3]
    assert spec["names"] == ["height", "width", "channels"]
    assert spec["info"] == {
        "video.height": 16,
        "video.width": 16,
        "video.codec": "h264",
        "video.pix_fmt": "yuv420p",
        "video.is_depth_map": False,
        "video.fps": FPS,
        "video.channels": 3,
        "has_audio": False,
    }
    # Video features are in the mp4 files only, not in the Parquet data.
    data = pq.read_table(root / "data/chunk-000/file-000.parquet")
    assert "image" not in data.column_names and "gray" in data.column_names
    hf = json.loads(data.schema.metadata[b"huggingface"])["info"]["features"]
    assert "image" not in hf
    rows = episode_rows(root)
    assert len(rows) == result.episodes
    for name, field in (("image", ("curr_obs", "main_images")), ("wrist_image-1", None)):
        assert {
            f"videos/{name}/{k}" for k in ("chunk_index", "file_index", "from_timestamp", "to_timestamp")
        } <= set(rows[0])
        # Episodes follow each other in the file: from = the previous episode's to, to - from = length / fps.
        expected_from = 0.0
        for row in rows:
            assert (row[f"videos/{name}/chunk_index"], row[f"videos/{name}/file_index"]) == (0, 0)
            assert row[f"videos/{name}/from_timestamp"] == pytest.approx(expected_from)
            expected_from = row[f"videos/{name}/to_timestamp"]
            assert expected_from - row[f"videos/{name}/from_timestamp"] == pytest.approx(row["length"] / FPS)
        video = root / f"videos/{name}/chunk-000/file-000.mp4"
        times, frames = decode(video)
        assert len(frames) == result.frames
        assert times == pytest.approx(np.arange(result.frames) / FPS)
        with av.open(str(video)) as container:
            stream = container.streams.video[0]
            assert stream.codec_context.name == "h264" and stream.codec_context.pix_fmt == "yuv420p"
        if field is not None:
            exact = buffer_frames(camera_buffer, field).astype(np.float64)
            assert np.abs(frames.astype(np.float64) - exact).mean() < 4  # lossy, but close
    stats = json.loads((root / "meta/stats.json").read_text())
    assert np.array(stats["image"]["mean"]).shape == (3, 1, 1)  # per channel, as for image features


def test_video_files_roll_over_by_size_and_import_as_episodes_decodes_them(tmp_path: Path) -> None:
    trajs = [with_camera(8, 1, seed, height=32, width=48) for seed in range(6)]
    source = build_buffer(tmp_path / "cams", trajs)
    root = tmp_path / "ds"
    result = export_lerobot(source, root, fps=FPS, video=True, video_file_size_mb=0.001)
    files = sorted((root / "videos/image").glob("chunk-000/*.mp4"))
    assert len(files) > 1 and result.video_files >= len(files)
    for row in episode_rows(root):
        if row["videos/image/file_index"] > 0 and row["videos/image/from_timestamp"] == 0:
            break
    else:
        raise AssertionError("no episode starts a new video file at timestamp 0")
    imported = import_lerobot(root, tmp_path / "buf", drop=["prev_logprobs"])  # bf16 bits: no episode field
    assert imported.mode == "episodes" and imported.fields["image"] == "curr_obs.main_images"
    got = buffer_frames(tmp_path / "buf", ("curr_obs", "main_images")).astype(np.float64)
    exact = buffer_frames(source, ("curr_obs", "main_images")).astype(np.float64)
    assert got.shape == exact.shape and np.abs(got - exact).mean() < 4
    views = buffer_frames(tmp_path / "buf", ("curr_obs", "wrist_images"))
    assert views.shape == (result.frames, 2, 4, 4, 3)  # the split views stack back


# ----------------------------------------------------------------------- a dataset rbtool did not write
def add_video_feature(root: Path, lengths: list[int], codec: str = "libx264") -> np.ndarray:
    """Give a hand-built v3.0 dataset a video feature `observation.images.side` as LeRobot lays one out."""
    frames = smooth_frames(sum(lengths), 16, 24, seed=3)
    target = root / "videos/observation.images.side/chunk-000/file-000.mp4"
    target.parent.mkdir(parents=True)
    with av.open(str(target), "w") as container:
        stream = container.add_stream(codec, rate=FPS)
        stream.width, stream.height, stream.pix_fmt = 24, 16, "yuv420p"
        for i, frame in enumerate(frames):
            picture = av.VideoFrame.from_ndarray(frame, format="rgb24")
            picture.pts = i
            for packet in stream.encode(picture):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    info_path = root / "meta/info.json"
    info = json.loads(info_path.read_text())
    info["video_path"] = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    info["features"]["observation.images.side"] = {
        "dtype": "video",
        "shape": [16, 24, 3],
        "names": ["height", "width", "channels"],
        "info": {"video.fps": FPS, "video.codec": "h264", "video.pix_fmt": "yuv420p"},
    }
    info_path.write_text(json.dumps(info))
    path = root / "meta/episodes/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    starts = np.cumsum([0, *lengths]) / FPS
    table = table.append_column("videos/observation.images.side/chunk_index", pa.array([0] * len(lengths)))
    table = table.append_column("videos/observation.images.side/file_index", pa.array([0] * len(lengths)))
    table = table.append_column("videos/observation.images.side/from_timestamp", pa.array(starts[:-1]))
    table = table.append_column("videos/observation.images.side/to_timestamp", pa.array(starts[1:]))
    pq.write_table(table, path)
    return frames


def test_a_hand_built_dataset_with_a_video_feature_imports(tmp_path: Path) -> None:
    lengths = [3, 5, 4]
    build_v30(tmp_path / "ds", lengths)
    frames = add_video_feature(tmp_path / "ds", lengths)
    result = import_lerobot(tmp_path / "ds", tmp_path / "buf")
    assert result.mode == "episodes" and result.fields["observation.images.side"] == "curr_obs.side"
    assert result.fields["observation.images.top"] == "curr_obs.top"  # two cameras: each its own name
    view = open_view(tmp_path / "buf")
    starts = np.cumsum([0, *lengths])
    for tid, n in zip(view.index.id_list, lengths, strict=True):
        traj = trajfile.load(view.file_of(tid))
        side = traj["curr_obs"]["side"]
        assert side.dtype == torch.uint8 and side.shape == (n, 1, 16, 24, 3)
        exact = frames[starts[tid] : starts[tid + 1]].astype(np.float64)
        assert np.abs(side[:, 0].numpy().astype(np.float64) - exact).mean() < 4
        assert torch.equal(traj["next_obs"]["side"][:-1], side[1:])
    dropped = import_lerobot(tmp_path / "ds", tmp_path / "b2", drop=["observation.images.side"])
    assert "observation.images.side" not in dropped.fields


# ----------------------------------------------------------------------- errors
def test_video_errors_are_one_line(camera_buffer: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="video needs images"):
        export_lerobot(camera_buffer, tmp_path / "ds", fps=FPS, video=True, images=False)
    with pytest.raises(UsageError, match="video file size"):
        export_lerobot(camera_buffer, tmp_path / "ds", fps=FPS, video=True, video_file_size_mb=0)
    assert not (tmp_path / "ds").exists()
    lengths = [3, 2]
    build_v30(tmp_path / "hand", lengths)
    add_video_feature(tmp_path / "hand", lengths)
    (tmp_path / "hand/videos/observation.images.side/chunk-000/file-000.mp4").unlink()
    with pytest.raises(CheckpointError, match=r"file-000\.mp4: missing") as caught:
        import_lerobot(tmp_path / "hand", tmp_path / "buf")
    assert "\n" not in str(caught.value)
    (tmp_path / "hand/videos/observation.images.side/chunk-000/file-000.mp4").write_bytes(b"not a video")
    with pytest.raises(CheckpointError, match="not a readable video") as caught:
        import_lerobot(tmp_path / "hand", tmp_path / "buf")
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "buf").exists()
