"""Against a real LeRobot: LeRobotDataset loads what rbtool exports, and rbtool imports what LeRobot writes.

Opt-in: LeRobot pins its own torch (an 8 GB environment), so these run only when
RBTOOL_LEROBOT_PYTHON names an interpreter with lerobot installed (docs/lerobot.md):

    python3 -m venv /tmp/lerobot-venv && /tmp/lerobot-venv/bin/pip install lerobot
    RBTOOL_LEROBOT_PYTHON=/tmp/lerobot-venv/bin/python .venv/bin/python -m pytest tests/test_lerobot_real.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES

LEROBOT_PYTHON = os.environ.get("RBTOOL_LEROBOT_PYTHON", "")
pytestmark = pytest.mark.skipif(
    not LEROBOT_PYTHON, reason="set RBTOOL_LEROBOT_PYTHON to a python with lerobot installed"
)

pytest.importorskip("pyarrow")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rbtool.files import trajfile  # noqa: E402
from rbtool.files.dirs import open_view  # noqa: E402
from rbtool.format.layout import DONE_LIKE, drop_bootstrap_rows  # noqa: E402
from rbtool.interop.lerobot import export_lerobot, import_lerobot  # noqa: E402

# Runs under LeRobot's interpreter: every frame LeRobotDataset gives, saved as arrays.
READ = """
import sys
import numpy as np
import torch
from lerobot.datasets.lerobot_dataset import LeRobotDataset

root, out = sys.argv[1], sys.argv[2]
ds = LeRobotDataset("local/rbtool-export", root=root)
images = [k for k, f in ds.meta.features.items() if f["dtype"] == "image"]
columns = {}
missing = {}
for i in range(len(ds)):
    item = ds[i]
    for key, value in item.items():
        if value is None:
            missing.setdefault(key, []).append(i)
            continue
        if isinstance(value, torch.Tensor):
            if key in images:  # LeRobot gives float CHW in [0, 1]
                value = (value * 255).round().to(torch.uint8).permute(1, 2, 0)
            value = value.numpy()
        columns.setdefault(key, {})[i] = value
arrays = {}
for key, values in columns.items():
    if key in missing:
        continue
    ordered = [values[i] for i in range(len(ds))]
    arrays[key] = np.array(ordered) if isinstance(ordered[0], str) else np.stack(ordered)
arrays["__missing__"] = np.array(sorted(missing))
np.savez(out, **arrays)
print(len(ds), ds.num_episodes, ds.fps)
"""

# Runs under LeRobot's interpreter: a dataset written by LeRobot's own writer, with the
# feature names RLinf's LeRobot writer uses, and the frames it was given.
WRITE = """
import sys
import numpy as np
from lerobot.datasets.lerobot_dataset import LeRobotDataset

root, out = sys.argv[1], sys.argv[2]
features = {
    "image": {"dtype": "image", "shape": (12, 10, 3), "names": ["height", "width", "channel"]},
    "wrist_image": {"dtype": "image", "shape": (12, 10, 3), "names": ["height", "width", "channel"]},
    "state": {"dtype": "float32", "shape": (8,), "names": ["state"]},
    "actions": {"dtype": "float32", "shape": (7,), "names": ["actions"]},
    "done": {"dtype": "bool", "shape": (1,), "names": ["done"]},
    "is_success": {"dtype": "bool", "shape": (1,), "names": ["is_success"]},
    "intervene_flag": {"dtype": "bool", "shape": (1,), "names": ["intervene_flag"]},
    "next.reward": {"dtype": "float32", "shape": (1,), "names": None},
}
ds = LeRobotDataset.create(
    repo_id="local/made-by-lerobot", fps=10, features=features, root=root, use_videos=False,
    robot_type="franka_panda",
)
rng = np.random.default_rng(0)
saved = {}
for episode, n in enumerate([4, 6, 3]):
    for i in range(n):
        frame = {
            "image": rng.integers(0, 256, (12, 10, 3), dtype=np.uint8),
            "wrist_image": rng.integers(0, 256, (12, 10, 3), dtype=np.uint8),
            "state": rng.standard_normal(8).astype(np.float32),
            "actions": rng.standard_normal(7).astype(np.float32),
            "done": np.array([i == n - 1]),
            "is_success": np.array([episode == 1]),
            "intervene_flag": np.array([i % 2 == 0]),
            "next.reward": np.array([float(i) / n], dtype=np.float32),
        }
        for key, value in frame.items():
            saved.setdefault(key, []).append(value)
        ds.add_frame({**frame, "task": f"task {episode % 2}"})
    ds.save_episode()
ds.finalize()
np.savez(out, **{k: np.stack(v) for k, v in saved.items()})
print("ok")
"""


WIDENED = {(np.dtype("float16"), np.dtype("float32"))}


def lerobot(script: str, *args: Path) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1"}
    proc = subprocess.run(
        [LEROBOT_PYTHON, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def expected_row(traj: dict[str, Any], field: str, t: int, b: int, steps: int) -> np.ndarray:
    """The row of `field` (a dotted path, `path[i]` for view i of a multi-view field) at (t, b)."""
    dotted, _, view = field.partition("[")
    path = tuple(dotted.split("."))
    value: Any = traj
    for key in path:
        value = value[key]
    if len(path) == 1 and path[0] in DONE_LIKE:
        value = drop_bootstrap_rows(value, steps)
    row = value[t, b] if not view else value[t, b, int(view.rstrip("]"))]
    if row.dtype == torch.bfloat16:
        row = row.view(torch.uint16)
    return np.asarray(row.numpy())


def check_frames(
    source: Path, out: Path, tmp_path: Path, *, task: str, fps: int, columns: dict[str, str]
) -> None:
    """Every frame LeRobot reads equals the buffer's row it came from."""
    frames_file = tmp_path / "frames.npz"
    total, episodes, read_fps = lerobot(READ, out, frames_file).split()
    frames = np.load(frames_file, allow_pickle=False)
    view = open_view(source)
    assert int(total) == view.index.total_samples and int(read_fps) == fps
    assert int(episodes) == len(set(frames["episode_index"].tolist()))
    assert (frames["timestamp"] == (frames["frame_index"] / fps).astype(np.float32)).all()
    assert (frames["task"] == task).all()
    missing = set(frames["__missing__"].tolist())
    cache: dict[int, dict[str, Any]] = {}
    for i in range(int(total)):
        tid, b, t = (int(frames[k][i]) for k in ("rb.trajectory_id", "rb.env", "rb.t"))
        if tid not in cache:
            cache[tid] = trajfile.load(view.file_of(tid))
        traj = cache[tid]
        steps = view.index.entries[tid]["shape"][0]
        assert str(frames["rb.model_weights_id"][i]) == view.index.entries[tid]["model_weights_id"]
        for feature, field in columns.items():
            if feature in missing:
                continue
            want = expected_row(traj, field, t, b, steps)
            got = frames[feature][i]
            # Same dtype, except where LeRobot's conversion through Python numbers widens it
            # (exactly): integers (and bf16 bits) to int64, float16 to float32.
            widened = (want.dtype.kind in "iu" and got.dtype == np.int64) or (
                want.dtype,
                got.dtype,
            ) in WIDENED
            assert got.dtype == want.dtype or widened, (feature, got.dtype, want.dtype)
            assert np.array_equal(got.reshape(want.shape), want.astype(got.dtype)), (feature, i)


@pytest.mark.parametrize("rel", ["autosave_pt/autosave", "nested_obs_pt", "varying_shapes_pt/ckpt"])
def test_lerobot_loads_the_export_and_its_frames_equal_the_buffer_rows(tmp_path: Path, rel: str) -> None:
    source = FIXTURES / rel
    result = export_lerobot(source, tmp_path / "ds", fps=10, task="pick up the cube", robot_type="franka")
    check_frames(source, tmp_path / "ds", tmp_path, task="pick up the cube", fps=10, columns=result.columns)


def test_lerobot_loads_a_generated_export_rolled_over_into_several_files(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from test_lerobot import build_buffer, generated

    trajs = [generated(t=4, b=2, seed=0), generated(t=6, b=3, seed=1, model_weights_id="v2")]
    source = build_buffer(tmp_path / "mixed", trajs)
    result = export_lerobot(source, tmp_path / "ds", fps=30, task="", data_file_size_mb=0.004, chunks_size=2)
    assert result.data_files >= 2
    check_frames(source, tmp_path / "ds", tmp_path, task="", fps=30, columns=result.columns)


def test_rbtool_imports_samples_and_verifies_what_lerobot_wrote(tmp_path: Path) -> None:
    from rbtool.buffer.replay import TrajectoryReplayBuffer
    from rbtool.ops.verify import verify_checkpoint

    lerobot(WRITE, tmp_path / "made", tmp_path / "frames.npz")
    frames = np.load(tmp_path / "frames.npz", allow_pickle=False)
    result = import_lerobot(tmp_path / "made", tmp_path / "buf")
    assert result.mode == "episodes" and result.episodes == 3 and result.frames == 13
    assert result.fields["image"] == "curr_obs.main_images" and result.fields["state"] == "curr_obs.states"
    assert result.fields["done"] == "dones" and result.fields["intervene_flag"] == "intervene_flags"
    view = open_view(tmp_path / "buf")
    start = 0
    for tid, n in zip(view.index.id_list, [4, 6, 3], strict=True):
        traj = trajfile.load(view.file_of(tid))
        rows = slice(start, start + n)
        assert torch.equal(traj["curr_obs"]["main_images"][:, 0], torch.from_numpy(frames["image"][rows]))
        assert torch.equal(
            traj["curr_obs"]["wrist_images"][:, 0], torch.from_numpy(frames["wrist_image"][rows])
        )
        assert torch.equal(traj["curr_obs"]["states"][:, 0], torch.from_numpy(frames["state"][rows]))
        assert torch.equal(traj["next_obs"]["states"][:-1, 0], torch.from_numpy(frames["state"][rows][1:]))
        assert torch.equal(traj["actions"][:, 0], torch.from_numpy(frames["actions"][rows]))
        assert torch.equal(traj["rewards"][:, 0], torch.from_numpy(frames["next.reward"][rows]))
        assert torch.equal(traj["dones"][1:, 0], torch.from_numpy(frames["done"][rows]))
        assert torch.equal(traj["intervene_flags"][:, 0], torch.from_numpy(frames["intervene_flag"][rows]))
        assert torch.equal(traj["is_success"][:, 0], torch.from_numpy(frames["is_success"][rows]))
        assert traj["task"] == f"task {tid % 2}"
        start += n
    report = verify_checkpoint(tmp_path / "buf", deep=True)
    assert report.ok, report.as_json()
    rb = TrajectoryReplayBuffer(seed=1234, sample_window_size=0, extra_fields=True)
    rb.load_checkpoint(str(tmp_path / "buf"))
    batch = rb.sample(8)
    assert batch["curr_obs"]["main_images"].shape == (8, 12, 10, 3) and batch["actions"].shape == (8, 7)
    assert batch["is_success"].shape == (8, 1)
    rb.close()
    # And back: the imported buffer exports to a dataset LeRobot loads, frame for frame.
    again = export_lerobot(tmp_path / "buf", tmp_path / "again", fps=10, task="t")
    check_frames(tmp_path / "buf", tmp_path / "again", tmp_path, task="t", fps=10, columns=again.columns)


# Runs under LeRobot's interpreter: the frames of every video feature, decoded by LeRobot with PyAV.
READ_VIDEO = """
import sys
import numpy as np
from lerobot.datasets.lerobot_dataset import LeRobotDataset

root, out = sys.argv[1], sys.argv[2]
ds = LeRobotDataset("local/rbtool-video", root=root, video_backend="pyav")
arrays = {key: [] for key in ds.meta.video_keys}
index = []
for i in range(len(ds)):
    item = ds[i]
    index.append([int(item[k]) for k in ("rb.trajectory_id", "rb.env", "rb.t")])
    for key in arrays:  # LeRobot gives float CHW in [0, 1]
        arrays[key].append((item[key] * 255).round().clamp(0, 255).byte().permute(1, 2, 0).numpy())
np.savez(out, __index__=np.array(index), **{k: np.stack(v) for k, v in arrays.items()})
print(len(ds), ds.num_episodes, ",".join(ds.meta.video_keys))
"""

# Runs under LeRobot's interpreter: a video dataset written by LeRobot's own writer (its
# default encoder), and the frames it was given.
WRITE_VIDEO = """
import sys
import numpy as np
from lerobot.datasets.lerobot_dataset import LeRobotDataset

root, out = sys.argv[1], sys.argv[2]
features = {
    "observation.images.top": {
        "dtype": "video", "shape": (64, 64, 3), "names": ["height", "width", "channels"]
    },
    "observation.state": {"dtype": "float32", "shape": (2,), "names": None},
}
ds = LeRobotDataset.create(
    repo_id="local/video-by-lerobot", fps=10, features=features, root=root, use_videos=True
)
y, x = np.mgrid[0:64, 0:64]
saved = []
for episode, n in enumerate([5, 7]):
    for i in range(n):
        k = len(saved)
        channels = [20 + 2 * x + k, 20 + 2 * y + 2 * k, np.full_like(x, 60 + 3 * k)]
        image = np.stack(channels, -1).astype(np.uint8)
        saved.append(image)
        ds.add_frame({"observation.images.top": image, "observation.state": np.array([k, i], np.float32),
                      "task": "look"})
    ds.save_episode()
ds.finalize()
np.save(out, np.stack(saved))
print(ds.meta.features["observation.images.top"]["info"]["video.codec"])
"""


def test_lerobot_loads_a_video_export_and_its_frames_are_close_to_the_buffer_rows(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from test_lerobot import build_buffer
    from test_lerobot_video import with_camera

    source = build_buffer(
        tmp_path / "cams", [with_camera(6, 2, 0, 32, 32, 16), with_camera(5, 1, 1, 32, 32, 16)]
    )
    result = export_lerobot(source, tmp_path / "ds", fps=10, task="look", video=True)
    total, _, keys = lerobot(READ_VIDEO, tmp_path / "ds", tmp_path / "frames.npz").split()
    assert int(total) == result.frames and set(keys.split(",")) == {"image", "wrist_image-0", "wrist_image-1"}
    frames = np.load(tmp_path / "frames.npz", allow_pickle=False)
    view = open_view(source)
    cache: dict[int, dict[str, Any]] = {}
    for feature in keys.split(","):
        errors = []
        for i, (tid, b, t) in enumerate(frames["__index__"].tolist()):
            if tid not in cache:
                cache[tid] = trajfile.load(view.file_of(tid))
            want = expected_row(
                cache[tid], result.columns[feature], t, b, view.index.entries[tid]["shape"][0]
            )
            errors.append(np.abs(frames[feature][i].astype(np.float64) - want).mean())
        assert float(np.mean(errors)) < 4, (feature, float(np.mean(errors)))


def test_rbtool_imports_the_video_lerobot_wrote(tmp_path: Path) -> None:
    codec = lerobot(WRITE_VIDEO, tmp_path / "made", tmp_path / "frames.npy").split()[-1]
    saved = np.load(tmp_path / "frames.npy")
    result = import_lerobot(tmp_path / "made", tmp_path / "buf")
    assert result.fields["observation.images.top"] == "curr_obs.main_images"
    view = open_view(tmp_path / "buf")
    start = 0
    for tid, n in zip(view.index.id_list, [5, 7], strict=True):
        images = trajfile.load(view.file_of(tid))["curr_obs"]["main_images"][:, 0].numpy()
        assert images.shape == (n, 64, 64, 3)
        error = np.abs(images.astype(np.float64) - saved[start : start + n]).mean()
        assert error < 4, (codec, error)
        start += n
