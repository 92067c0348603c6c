"""The checkpoint reader behind render, report and view: entries, cameras, series and frames."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import FIXTURES, make_traj, tree_digest

from rbtool.errors import UsageError
from rbtool.ops.checkpoint import build_from_files
from rbtool.view.frames import Camera, Series, open_checkpoint


def write_ckpt(root: Path, trajs: list[dict[str, Any]], fmt: str = "pt") -> Path:
    """A checkpoint of `trajs` (ids 0..n-1) at root/ckpt."""
    files = root / "files"
    files.mkdir(parents=True, exist_ok=True)
    paths = []
    for n, traj in enumerate(trajs):
        path = files / f"t{n}.pt"
        torch.save(traj, path)
        paths.append(path)
    out = root / "ckpt"
    build_from_files(paths, out, window=0, trajectory_format=fmt)
    return out


def test_entries_cameras_and_frames_of_a_fixture() -> None:
    ckpt = FIXTURES / "nested_obs_pt"
    with open_checkpoint(ckpt) as opened:
        entries = opened.entries()
        assert [e.tid for e in entries] == [0, 1, 2, 3]
        assert (entries[0].t, entries[0].b, entries[0].num_samples) == (4, 2, 8)
        assert entries[0].model_weights_id == "87a64d8e-0f54-5c7c-a19d-0b3753cad97c"
        assert entries[0].checkpoint == str(ckpt)
        cams = opened.cameras(1)
        assert cams == [
            Camera("curr_obs.main_images", "hwc", 16, 16, 3),
            Camera("next_obs.main_images", "hwc", 16, 16, 3),
        ]
        from rbtool.files import trajfile

        stored = trajfile.load(opened.view.file_of(1))["curr_obs"]["main_images"].numpy()
        frames = opened.frames(1, 1)
        assert frames.shape == (4, 16, 16, 3) and frames.dtype == np.uint8
        np.testing.assert_array_equal(frames, stored[:, 1])
        np.testing.assert_array_equal(opened.frames(1, 0, steps=[3, 0]), stored[[3, 0], 0])
        nxt = trajfile.load(opened.view.file_of(1))["next_obs"]["main_images"].numpy()
        np.testing.assert_array_equal(opened.frames(1, 0, "next_obs.main_images", [2]), nxt[[2], 0])


def test_series_follows_the_layout_rules(tmp_path: Path) -> None:
    traj = make_traj(t=6, b=3, seed=4, extra_rows=2)
    ckpt = write_ckpt(tmp_path, [traj])
    with open_checkpoint(ckpt) as opened:
        series = opened.series(0, 2)
    assert isinstance(series, Series) and series.steps == 6
    rewards = traj["rewards"][:, 2].sum(dim=-1)
    assert series.rewards == pytest.approx(rewards.tolist())
    assert series.ret == pytest.approx(float(rewards.sum()))
    np.testing.assert_allclose(np.array(series.actions), traj["actions"][:, 2].numpy(), rtol=1e-6)
    # dones [T + E, B]: E = 2 epochs of 1 + T/E rows, the first of each a bootstrap row
    dones = traj["dones"][:, 2, 0].reshape(2, 4)[:, 1:].reshape(6)
    assert series.dones == dones.tolist()
    assert series.episode_ends == [i for i in range(6) if bool(dones[i])]


def test_without_dones_episodes_end_at_terminations_or_truncations(tmp_path: Path) -> None:
    traj = make_traj(t=4, b=1, seed=2, extra_rows=0)
    del traj["dones"]
    traj["terminations"] = torch.tensor([[[False]], [[True]], [[False]], [[False]]])
    traj["truncations"] = torch.tensor([[[False]], [[False]], [[False]], [[True]]])
    with open_checkpoint(write_ckpt(tmp_path, [traj])) as opened:
        assert opened.series(0, 0).episode_ends == [1, 3]


def test_large_files_read_only_the_rows_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A .pt file past the small-file size keeps its image rows on disk: frames preads them."""
    from rbtool.buffer.storage import ptfile

    traj = make_traj(t=6, b=2, seed=1, image=96)
    ckpt = write_ckpt(tmp_path, [traj])
    read: list[int] = []
    original = ptfile.FileRows.take

    def counting(self: Any, rows: Any, out: Any, dest: Any) -> None:
        read.append(len(rows))
        original(self, rows, out, dest)

    monkeypatch.setattr(ptfile.FileRows, "take", counting)
    with open_checkpoint(ckpt) as opened:
        frames = opened.frames(0, 1, steps=[5, 2])
    assert read == [2]
    np.testing.assert_array_equal(frames, traj["curr_obs"]["main_images"][[5, 2], 1].numpy())


def test_chw_one_channel_and_no_cameras(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    chw = torch.randint(0, 255, (5, 2, 3, 8, 10), generator=g, dtype=torch.uint8)
    gray = torch.randint(0, 255, (5, 2, 6, 7, 1), generator=g, dtype=torch.uint8)
    with_cams = make_traj(t=5, b=2, seed=3)
    with_cams["curr_obs"] = {"rgb": chw}
    with_cams["next_obs"] = {"states": torch.zeros(5, 2, 3)}
    with_cams["depth"] = gray
    bare = make_traj(t=5, b=2, seed=4)
    del bare["curr_obs"], bare["next_obs"]
    ckpt = write_ckpt(tmp_path, [with_cams, bare], fmt="pkl")
    with open_checkpoint(ckpt) as opened:
        assert opened.cameras(0) == [Camera("curr_obs.rgb", "chw", 8, 10, 3), Camera("depth", "hwc", 6, 7, 1)]
        np.testing.assert_array_equal(opened.frames(0, 1), chw[:, 1].permute(0, 2, 3, 1).numpy())
        np.testing.assert_array_equal(opened.frames(0, 0, "depth", [4]), gray[[4], 0].numpy())
        assert opened.cameras(1) == []
        with pytest.raises(UsageError, match="no image field"):
            opened.frames(1, 0)
        with pytest.raises(UsageError, match=r"no camera 'nope'.*curr_obs\.rgb, depth"):
            opened.frames(0, 0, "nope")
        with pytest.raises(UsageError, match="no trajectory with id 7"):
            opened.entry(7)
        with pytest.raises(UsageError, match="2 env column"):
            opened.series(0, 2)
        with pytest.raises(UsageError, match="no step 5"):
            opened.frames(0, 0, steps=[5])


def test_rank_tree_reads_as_its_merge() -> None:
    tree = FIXTURES / "ranks"
    with open_checkpoint(tree) as opened:
        entries = opened.entries()
        # colliding ids (0..2 in both ranks) are renumbered 0..6 by (old id, rank order)
        assert [e.tid for e in entries] == list(range(7))
        assert {e.checkpoint for e in entries} == {str(tree / "rank_0"), str(tree / "rank_1")}
        last = entries[-1]  # old id 3 exists only in rank_1
        assert last.checkpoint == str(tree / "rank_1")
        from rbtool.files import trajfile

        stored = trajfile.load(tree / "rank_1" / opened.view.indexes[1].file_name(3))
        np.testing.assert_array_equal(
            opened.frames(last.tid, 1), stored["curr_obs"]["main_images"][:, 1].numpy()
        )
        cam = opened.cameras(last.tid)[0]
        assert opened.frames(last.tid, 0).shape == (last.t, cam.height, cam.width, cam.channels)


def test_threads_share_one_checkpoint_and_nothing_is_written(tmp_path: Path) -> None:
    trajs = [make_traj(t=4, b=2, seed=s, image=8) for s in range(6)]
    ckpt = write_ckpt(tmp_path, trajs)
    before = tree_digest(ckpt)
    errors: list[BaseException] = []
    with open_checkpoint(ckpt) as opened:

        def work(k: int) -> None:
            try:
                for n in range(12):
                    tid = (k + n) % 6
                    got = opened.frames(tid, n % 2)
                    expected = trajs[tid]["curr_obs"]["main_images"][:, n % 2].numpy()
                    np.testing.assert_array_equal(got, expected)
                    opened.series(tid, 0)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(opened._open) <= 4  # the opened files stay bounded
    assert errors == []
    assert tree_digest(ckpt) == before


def test_listed_ids_without_files_are_left_out_and_named() -> None:
    """RLinf's buffer with auto_save off saves an index that lists trajectories it never wrote."""
    from rbtool.errors import CheckpointError

    with open_checkpoint(FIXTURES / "nosave_window2_pt" / "ckpt") as opened:
        assert [e.tid for e in opened.entries()] == [3, 4]
        assert opened.frames(4, 0).shape[0] == opened.entry(4).t
        with pytest.raises(CheckpointError, match="trajectory 1 is listed, but its file is missing"):
            opened.entry(1)


def test_a_url_read_trajectory_after_trajectory_stays_within_the_cache(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A viewer moving through a remote checkpoint keeps only the objects of its open files: the
    ones it moved on from are dropped, so a cache of five files reads ten trajectories twice over."""
    from conftest import run_json

    from rbtool.view.frames import OPEN_FILES

    monkeypatch.setenv("RBTOOL_CACHE_DIR", str(tmp_path / "cache"))
    local = write_ckpt(tmp_path, [make_traj(t=5, b=2, seed=i, image=16) for i in range(10)])
    url = f"{bucket}/ckpt"
    run_json("checkpoint", "save", local, url, "--window", "0")
    largest = max(p.stat().st_size for p in local.glob("trajectory_*"))
    monkeypatch.setenv("RBTOOL_CACHE_BYTES", str((OPEN_FILES + 1) * largest))
    with open_checkpoint(url) as remote, open_checkpoint(local) as here:
        for tid in [*range(10), *range(10)]:
            assert np.array_equal(remote.frames(tid, 1), here.frames(tid, 1))
            assert remote._mirror is not None and remote._mirror.fetched_bytes <= OPEN_FILES * largest
