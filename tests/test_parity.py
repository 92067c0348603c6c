"""Drop-in parity with RLinf's TrajectoryReplayBuffer, each point checked against its behaviour."""

from __future__ import annotations

import asyncio
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import FIXTURES, assert_batches_equal, make_traj

from rbtool import TrajectoryReplayBuffer, read_index
from rbtool.ops.checkpoint import merge, shard


def expected(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.expected.json").read_text())


def reference_batch(name: str) -> dict[str, Any]:
    return torch.load(FIXTURES / name, weights_only=True)


def copy_fixture(name: str, dst: Path) -> Path:
    shutil.copytree(FIXTURES / name, dst)
    return dst


def metadata(path: Path) -> dict[str, Any]:
    return json.loads((path / "metadata.json").read_text())


def paths_of(batch: dict[str, Any], prefix: str = "") -> list[str]:
    out: list[str] = []
    for key, value in batch.items():
        if isinstance(value, dict):
            out.extend(paths_of(value, f"{prefix}{key}."))
        else:
            out.append(f"{prefix}{key}")
    return out


# ----------------------------------------------------------------------------- seed
def test_a_buffer_without_seed_writes_no_seed_key(tmp_path: Path) -> None:
    buffer = TrajectoryReplayBuffer(seed=None, sample_window_size=0)
    buffer.add_trajectories([make_traj(seed=1), make_traj(seed=2)])
    buffer.save_checkpoint(tmp_path / "c")
    assert "seed" not in metadata(tmp_path / "c")


def test_shard_and_merge_of_a_seedless_checkpoint_write_no_seed_key(tmp_path: Path) -> None:
    assert "seed" not in metadata(FIXTURES / "seedless_pt")
    shard(FIXTURES / "seedless_pt", 2, tmp_path / "s")
    merge([tmp_path / "s"], tmp_path / "m")
    for path in (tmp_path / "s" / "rank_0", tmp_path / "s" / "rank_1", tmp_path / "m"):
        assert "seed" not in metadata(path)


def test_loading_without_seed_continues_the_stream() -> None:
    seq = expected("seedless_pt")["sample_sequence"]
    buffer = TrajectoryReplayBuffer(seed=seq["seed"], sample_window_size=seq["sample_window_size"])
    for step in seq["steps"]:
        if step["call"] == "load_checkpoint":
            buffer.load_checkpoint(FIXTURES / "seedless_pt")
            continue
        draw, batch = buffer.sample_with_draw(step["num_chunks"])
        assert draw.global_indices.tolist() == step["global_indices"]
        assert draw.trajectory_ids == step["trajectory_ids"]
        assert_batches_equal(batch, reference_batch(step["batch_file"]))


def test_loading_with_seed_reseeds(tmp_path: Path) -> None:
    ckpt = FIXTURES / "autosave_pt" / "autosave"
    buffer = TrajectoryReplayBuffer(seed=7, sample_window_size=0)
    buffer.load_checkpoint(ckpt)
    first = buffer.sample(8)
    buffer.load_checkpoint(ckpt)
    assert_batches_equal(buffer.sample(8), first)


# ----------------------------------------------------------------------------- batch keys
def test_batch_keys_are_the_references() -> None:
    exp = expected("nested_obs_pt")
    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    buffer.load_checkpoint(FIXTURES / "nested_obs_pt")
    with pytest.warns(UserWarning, match="extra_fields=True") as caught:
        batch = buffer.sample(8)
    assert paths_of(batch) == exp["batch_keys"]
    message = str(caught[0].message)
    assert "curr_obs.cams.wrist" in message and "next_obs.cams.wrist" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        buffer.sample(8)


def test_extra_fields_samples_what_the_reference_ignores() -> None:
    buffer = TrajectoryReplayBuffer(sample_window_size=0, extra_fields=True)
    buffer.load_checkpoint(FIXTURES / "nested_obs_pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        keys = paths_of(buffer.sample(8))
    assert {"curr_obs.cams.wrist", "next_obs.cams.wrist"} <= set(keys)
    assert "curr_obs.task_id" not in keys  # 1-dim: never a [T*B] field
    assert set(expected("nested_obs_pt")["batch_keys"]) <= set(keys)


def test_top_level_fields_outside_the_reference_are_left_out() -> None:
    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    buffer.add_trajectories([make_traj(seed=1, big=torch.zeros(4, 2, 3))])
    with pytest.warns(UserWarning, match="big"):
        batch = buffer.sample(4)
    assert "big" not in batch and "rewards" in batch


# ----------------------------------------------------------------------------- API names
def test_get_stats_has_the_reference_keys_all_numbers() -> None:
    buffer = TrajectoryReplayBuffer(sample_window_size=2)
    buffer.add_trajectories([make_traj(seed=i) for i in range(3)])
    stats = buffer.get_stats()
    assert list(stats) == ["num_trajectories", "total_samples", "cache_size"]
    assert stats == {"num_trajectories": 3, "total_samples": 24, "cache_size": 2}
    assert all(isinstance(v, int) for v in stats.values())
    assert np.isfinite([np.mean(v) for v in stats.values()]).all()
    assert buffer.info()["trajectory_format"] == "pt"


def test_is_ready_sample_chunks_and_clear_cache() -> None:
    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    assert not buffer.is_ready(1) and buffer.is_ready(0)
    buffer.add_trajectories([make_traj(seed=1), make_traj(seed=2)])
    assert buffer.is_ready(2) and not buffer.is_ready(3)
    assert asyncio.run(buffer.is_ready_async(2)) is True
    state = buffer.random_generator.get_state()
    a = buffer.sample_chunks(6)
    buffer.random_generator.set_state(state)
    buffer.clear_cache()
    assert_batches_equal(buffer.sample(6), a)


def test_errors_are_the_builtin_types_rlinf_raises(tmp_path: Path) -> None:
    buffer = TrajectoryReplayBuffer()
    with pytest.raises(RuntimeError, match="empty"):
        buffer.sample(4)
    with pytest.raises(ValueError):
        buffer.load_checkpoint(FIXTURES / "seedless_pt", is_distributed=True, local_rank=2, world_size=2)
    with pytest.raises(ValueError):
        buffer.load_checkpoint(FIXTURES / "seedless_pt", is_distributed=True, local_rank=0, world_size=0)
    buffer.add_trajectories([make_traj()])
    with pytest.raises(ValueError):
        buffer.sample(0)


# ----------------------------------------------------------------------------- format
def test_trajectory_format_follows_the_checkpoint(tmp_path: Path) -> None:
    exp = expected("pkl_format_switch")
    ckpt = FIXTURES / "pkl_format_switch"
    buffer = TrajectoryReplayBuffer(sample_window_size=3, trajectory_format="pt")
    buffer.load_checkpoint(ckpt)
    assert buffer.trajectory_format == exp["trajectory_format_after_load"]["full_load"]
    for world_size, formats in exp["trajectory_format_after_load"]["distributed_load"].items():
        for rank, fmt in enumerate(formats):
            ranked = TrajectoryReplayBuffer(trajectory_format="pt")
            ranked.load_checkpoint(ckpt, is_distributed=True, local_rank=rank, world_size=int(world_size))
            assert ranked.trajectory_format == fmt
    buffer.save_checkpoint(tmp_path / "out")
    saved = exp["save_checkpoint_after_load"]
    assert metadata(tmp_path / "out")["trajectory_format"] == saved["metadata_trajectory_format"]
    names = sorted(
        p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("trajectory_") and p.suffix
    )
    assert [n for n in names if n != "trajectory_index.json"] == saved["trajectory_files"]


def test_auto_save_after_loading_writes_the_checkpoints_format(tmp_path: Path) -> None:
    exp = expected("pkl_format_switch")["auto_save_after_load"]
    auto = tmp_path / "auto"
    buffer = TrajectoryReplayBuffer(sample_window_size=0, auto_save=True, auto_save_path=str(auto))
    buffer.load_checkpoint(FIXTURES / "pkl_format_switch")
    (tid,) = buffer.add_trajectories([make_traj(seed=8100, model_weights_id="v7")])
    buffer.close()
    assert tid == exp["added_trajectory_id"]
    assert metadata(auto)["trajectory_format"] == exp["metadata_trajectory_format"]
    assert (auto / read_index(auto).file_name(tid)).suffix == ".pkl"


# ----------------------------------------------------------------------------- window changes
def test_window_shrinks_and_grows_without_breaking(tmp_path: Path) -> None:
    buffer = TrajectoryReplayBuffer(sample_window_size=3)
    buffer.add_trajectories([make_traj(seed=i) for i in range(5)])
    buffer.sample(4)
    buffer.sample_window_size = 1
    buffer.add_trajectories([make_traj(seed=9)])
    assert buffer.window_ids() == [5]
    buffer.sample(4)
    buffer.sample_window_size = 3  # ids 3 and 4 were let go when the window was 1
    assert buffer.window_ids() == [5]
    buffer.sample(4)
    buffer.save_checkpoint(tmp_path / "c")
    assert read_index(tmp_path / "c").id_list == [5]
    buffer.add_trajectories([make_traj(seed=10), make_traj(seed=11)])
    assert buffer.window_ids() == [5, 6, 7]
    buffer.sample(4)
    buffer.save_checkpoint(tmp_path / "c")
    assert read_index(tmp_path / "c").id_list == [5, 6, 7]


def test_a_failed_sample_draws_nothing() -> None:
    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    buffer.add_trajectories([make_traj(seed=1)])
    state = buffer.random_generator.get_state()
    for bad in (0, -3):
        with pytest.raises(ValueError):
            buffer.sample(bad)
    with pytest.raises(ValueError):
        buffer.sample(4, strategy="topk")  # no k
    assert torch.equal(buffer.random_generator.get_state(), state)


# ----------------------------------------------------------------------------- the loaded directory
def test_saving_into_the_loaded_directory_keeps_every_listed_file(tmp_path: Path) -> None:
    ckpt = copy_fixture("seedless_pt", tmp_path / "ckpt")
    buffer = TrajectoryReplayBuffer(seed=1234, sample_window_size=0)
    buffer.load_checkpoint(ckpt)
    before = buffer.sample(8)
    buffer.save_checkpoint(ckpt)
    index = read_index(ckpt)
    assert index.id_list == buffer.trajectory_id_list
    assert all((ckpt / index.file_name(i)).is_file() for i in index.id_list)
    buffer.save_checkpoint(ckpt)  # again, now over its own output
    assert all((ckpt / index.file_name(i)).is_file() for i in index.id_list)
    assert_batches_equal(before, reference_batch("seedless_pt.sample8_w0.pt"))
    buffer.sample(5)


@pytest.mark.parametrize("how", ["delete", "replace"])
def test_rotating_the_loaded_checkpoint_away_keeps_sampling_and_saving(tmp_path: Path, how: str) -> None:
    ckpt = copy_fixture("pkl_format_switch", tmp_path / "ckpt")
    buffer = TrajectoryReplayBuffer(seed=1234, sample_window_size=0)
    buffer.load_checkpoint(ckpt)
    shutil.rmtree(ckpt)
    if how == "replace":
        copy_fixture("seedless_pt", ckpt)
    batch = buffer.sample(8)
    assert_batches_equal(batch, reference_batch("pkl_format_switch.sample8_w0.pt"))
    buffer.save_checkpoint(tmp_path / "out")
    again = TrajectoryReplayBuffer(seed=1234, sample_window_size=0)
    again.load_checkpoint(tmp_path / "out")
    assert again.trajectory_id_list == [0, 1, 2]
    assert_batches_equal(again.sample(8), batch)


def test_saving_into_the_auto_save_directory_is_refused(tmp_path: Path) -> None:
    auto = tmp_path / "auto"
    buffer = TrajectoryReplayBuffer(sample_window_size=1, auto_save=True, auto_save_path=str(auto))
    buffer.add_trajectories([make_traj(seed=1), make_traj(seed=2)])
    with pytest.raises(ValueError, match="auto-save directory"):
        buffer.save_checkpoint(auto)
    buffer.close()
    assert read_index(auto).id_list == [0, 1]
