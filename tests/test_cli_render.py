"""`rbtool render`: contact sheets, GIFs and mp4s whose frames are the trajectory's, in step order."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import FIXTURES, assert_one_error, make_traj, run, run_json

from rbtool.ops.checkpoint import build_from_files

PAD = 6  # where a contact sheet's first frame starts (rbtool.view.render.contact_sheet)


def write_ckpt(root: Path, trajs: list[dict[str, Any]], fmt: str = "pt") -> Path:
    files = root / "files"
    files.mkdir(parents=True, exist_ok=True)
    paths = []
    for n, traj in enumerate(trajs):
        paths.append(files / f"t{n}.pt")
        torch.save(traj, paths[-1])
    build_from_files(paths, root / "ckpt", window=0, trajectory_format=fmt)
    return root / "ckpt"


def distinct_frames(t: int, b: int, h: int, w: int, c: int, seed: int = 0) -> torch.Tensor:
    """uint8 [T, B, H, W, C] frames far apart from one another: each step its own base colour."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (t, b, 1, 1, c), generator=g)
    noise = torch.randint(-20, 21, (t, b, h, w, c), generator=g)
    return (base + noise).clamp(0, 255).to(torch.uint8)


def unscaled(image: np.ndarray, h: int, w: int, scale: int, top: int = 0, left: int = 0) -> np.ndarray:
    """The camera frame drawn at (top, left), scale x scale pixels per pixel, read back at block centres."""
    mid = scale // 2
    return image[top + mid : top + h * scale : scale, left + mid : left + w * scale : scale]


def closest(decoded: np.ndarray, source: np.ndarray) -> int:
    """The index of the source frame nearest to `decoded` (mean squared error)."""
    errors = [float(((decoded.astype(float) - s.astype(float)) ** 2).mean()) for s in source]
    return int(np.argmin(errors))


def gif_frames(path: Path) -> list[np.ndarray]:
    from PIL import Image, ImageSequence

    with Image.open(path) as image:
        return [np.asarray(frame.convert("RGB")) for frame in ImageSequence.Iterator(image)]


def mp4_frames(path: Path) -> list[np.ndarray]:
    import av

    with av.open(str(path)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


@pytest.fixture
def camera_ckpt(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    frames = distinct_frames(7, 3, 12, 10, 3)
    traj = make_traj(t=7, b=3, seed=1)
    traj["curr_obs"]["main_images"] = frames
    return write_ckpt(tmp_path, [make_traj(t=4, b=3, seed=0), traj]), frames


@pytest.mark.parametrize("suffix", [".gif", ".mp4"])
def test_animation_holds_every_step_in_order(
    camera_ckpt: tuple[Path, torch.Tensor], tmp_path: Path, suffix: str
) -> None:
    ckpt, frames = camera_ckpt
    out = tmp_path / f"t1{suffix}"
    doc = run_json("render", ckpt, "--id", "1", "--env", "2", "--out", out)
    assert doc["frames"] == 7 and doc["steps"] == list(range(7)) and doc["kind"] == suffix[1:]
    assert doc["camera"] == "curr_obs.main_images" and doc["bytes"] == out.stat().st_size
    decoded = gif_frames(out) if suffix == ".gif" else mp4_frames(out)
    assert len(decoded) == 7
    source = frames[:, 2].numpy()
    for step, image in enumerate(decoded):
        assert closest(unscaled(image, 12, 10, doc["scale"]), source) == step
    if suffix == ".gif":  # a palette of the frame's few colours: the pixels come back nearly as they were
        drawn = unscaled(decoded[3], 12, 10, doc["scale"]).astype(int)
        assert np.abs(drawn - source[3].astype(int)).mean() < 4


def test_a_frozen_camera_still_gives_one_frame_per_step(tmp_path: Path) -> None:
    traj = make_traj(t=5, b=1, seed=2)
    traj["curr_obs"]["main_images"] = torch.zeros(5, 1, 8, 8, 3, dtype=torch.uint8)
    ckpt = write_ckpt(tmp_path, [traj])
    run_json("render", ckpt, "--id", "0", "--out", tmp_path / "z.gif")
    assert len(gif_frames(tmp_path / "z.gif")) == 5


def test_contact_sheet_of_chw_and_one_channel_cameras(tmp_path: Path) -> None:
    chw = distinct_frames(5, 2, 9, 8, 3, seed=2).permute(0, 1, 4, 2, 3).contiguous()  # [T, B, 3, 9, 8]
    gray = distinct_frames(5, 2, 6, 7, 1, seed=3)
    traj = make_traj(t=5, b=2, seed=3)
    traj["curr_obs"] = {"rgb": chw}
    traj["next_obs"] = {"states": torch.zeros(5, 2, 3)}
    traj["depth"] = gray
    ckpt = write_ckpt(tmp_path, [traj], fmt="pkl")
    from PIL import Image

    doc = run_json("render", ckpt, "--id", "0", "--env", "1", "--out", tmp_path / "rgb.png")
    assert doc["camera"] == "curr_obs.rgb" and doc["frames"] == 5 and doc["plots"] is True
    sheet = np.asarray(Image.open(tmp_path / "rgb.png").convert("RGB"))
    expected = chw[0, 1].permute(1, 2, 0).numpy()
    np.testing.assert_array_equal(unscaled(sheet, 9, 8, doc["scale"], PAD, PAD), expected)

    doc = run_json("render", ckpt, "--id", "0", "--camera", "depth", "--out", tmp_path / "d.gif")
    assert doc["camera"] == "depth" and doc["frames"] == 5
    decoded = gif_frames(tmp_path / "d.gif")
    drawn = unscaled(decoded[4], 6, 7, doc["scale"])
    assert (drawn[..., 0] == drawn[..., 1]).all()  # grey stays grey
    assert [closest(unscaled(f, 6, 7, doc["scale"])[..., :1], gray[:, 0].numpy()) for f in decoded] == list(
        range(5)
    )


def test_a_sheet_of_many_steps_shows_evenly_spaced_frames(tmp_path: Path) -> None:
    ckpt = write_ckpt(tmp_path, [make_traj(t=30, b=1, seed=5)])
    doc = run_json("render", ckpt, "--id", "0", "--frames", "4", "--out", tmp_path / "s.png")
    assert doc["steps"] == [0, 10, 19, 29] and doc["frames"] == 4


def test_without_an_image_field_the_png_is_the_plots_alone(tmp_path: Path) -> None:
    bare = make_traj(t=6, b=2, seed=4)
    del bare["curr_obs"], bare["next_obs"]
    ckpt = write_ckpt(tmp_path, [bare])
    doc = run_json("render", ckpt, "--id", "0", "--out", tmp_path / "p.png")
    assert doc["camera"] is None and doc["frames"] == 0 and doc["plots"] is True
    from PIL import Image

    assert Image.open(tmp_path / "p.png").size == (doc["width"], doc["height"])
    for suffix in (".gif", ".mp4"):
        result = run("render", ckpt, "--id", "0", "--out", tmp_path / f"p{suffix}")
        assert_one_error(result, 2)
        assert "no image field" in result.stderr
        assert not (tmp_path / f"p{suffix}").exists()


def test_errors_are_one_line_and_write_nothing(
    camera_ckpt: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    ckpt, _ = camera_ckpt
    out = tmp_path / "x.png"
    for args, words in [
        (["--id", "9"], "no trajectory with id 9"),
        (["--id", "1", "--env", "3"], "3 env column"),
        (["--id", "1", "--camera", "wrist"], "no camera 'wrist' (cameras: curr_obs.main_images"),
    ]:
        result = run("render", ckpt, *args, "--out", out)
        assert_one_error(result, 2)
        assert words in result.stderr
    result = run("render", ckpt, "--id", "1", "--out", tmp_path / "x.jpg")
    assert result.exit_code == 2 and "must end in .png, .gif or .mp4" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "files"]
    inside = run("render", ckpt, "--id", "1", "--out", ckpt / "x.png")
    assert inside.exit_code == 2 and "overlaps the input" in inside.stderr

    out.write_bytes(b"keep")
    result = run("render", ckpt, "--id", "1", "--out", out)
    assert_one_error(result, 1)
    assert "--force" in result.stderr and out.read_bytes() == b"keep"
    assert run_json("render", ckpt, "--id", "1", "--out", out, "--force")["bytes"] == out.stat().st_size
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_a_missing_extra_names_it(
    camera_ckpt: tuple[Path, torch.Tensor], tmp_path: Path, monkeypatch: Any
) -> None:
    ckpt, _ = camera_ckpt
    monkeypatch.setitem(sys.modules, "av", None)  # import av fails
    result = run("render", ckpt, "--id", "1", "--out", tmp_path / "x.mp4")
    assert_one_error(result, 2)
    assert "pip install 'rbtool[view]'" in result.stderr and not (tmp_path / "x.mp4").exists()


def test_the_human_view_says_what_was_written(camera_ckpt: tuple[Path, torch.Tensor], tmp_path: Path) -> None:
    ckpt, _ = camera_ckpt
    result = run("render", ckpt, "--id", "1", "--out", tmp_path / "x.png")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith(f"wrote {tmp_path / 'x.png'} (")
    assert "contact sheet, 7 frames of curr_obs.main_images and plots, trajectory 1 env 0" in result.stdout


def test_a_rank_tree_renders_by_merged_id(tmp_path: Path) -> None:
    from PIL import Image

    from rbtool.files import trajfile

    doc = run_json("render", FIXTURES / "ranks", "--id", "6", "--env", "1", "--out", tmp_path / "r.png")
    stored = trajfile.load(next((FIXTURES / "ranks" / "rank_1").glob("trajectory_3_*.pt")))
    frames = stored["curr_obs"]["main_images"][:, 1].numpy()
    sheet = np.asarray(Image.open(tmp_path / "r.png").convert("RGB"))
    assert doc["frames"] == frames.shape[0]
    np.testing.assert_array_equal(unscaled(sheet, 16, 16, doc["scale"], PAD, PAD), frames[0])


@pytest.mark.parametrize("fixture", ["nested_obs_pt", "pkl_format_switch", "varying_shapes_pt/ckpt"])
def test_rlinf_fixtures_render_their_main_images(fixture: str, tmp_path: Path) -> None:
    from rbtool.files.index import read_index

    index = read_index(FIXTURES / fixture)
    last = index.id_list[-1]
    t = index.entries[last]["shape"][0]
    doc = run_json("render", FIXTURES / fixture, "--id", str(last), "--out", tmp_path / "x.gif")
    assert doc["camera"] == "curr_obs.main_images" and doc["frames"] == t
    assert len(gif_frames(tmp_path / "x.gif")) == t


def test_a_url_renders_as_its_local_copy(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RBTOOL_CACHE_DIR", str(tmp_path / "cache"))
    url = f"{bucket}/ckpt"
    run_json("checkpoint", "save", FIXTURES / "nested_obs_pt", url, "--window", "0")
    remote = run_json("render", url, "--id", "2", "--out", tmp_path / "remote.gif")
    local = run_json("render", FIXTURES / "nested_obs_pt", "--id", "2", "--out", tmp_path / "local.gif")
    assert remote["path"] == url and remote["frames"] == local["frames"] == 4
    assert (tmp_path / "remote.gif").read_bytes() == (tmp_path / "local.gif").read_bytes()
    result = run("render", url, "--id", "9", "--out", tmp_path / "none.png")
    assert_one_error(result, 2)
    assert url in result.stderr
    assert (
        json.loads(run("render", url, "--id", "0", "--out", tmp_path / "a.png", "--json").stdout)["frames"]
        == 4
    )


def test_the_png_decodes_with_its_declared_size(
    camera_ckpt: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    from PIL import Image

    ckpt, _ = camera_ckpt
    doc = run_json("render", ckpt, "--id", "0", "--out", tmp_path / "a.png")
    image = Image.open(io.BytesIO((tmp_path / "a.png").read_bytes()))
    assert image.format == "PNG" and image.size == (doc["width"], doc["height"])
