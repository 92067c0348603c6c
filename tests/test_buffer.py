"""TrajectoryReplayBuffer: the SPEC §3 examples, both auto_save modes, and RLinf's known failures."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import orjson
import pytest
from conftest import assert_batches_equal, make_traj

from rbtool import (
    InvalidTrajectoryError,
    RbtoolError,
    TrajectoryReplayBuffer,
    UsageError,
    read_index,
)
from rbtool.files import trajfile


def files_of(directory: Path) -> list[str]:
    return sorted(
        p.name
        for p in directory.iterdir()
        if p.name.startswith("trajectory_") and p.suffix in (".pt", ".pkl")
    )


def add_five(buffer: TrajectoryReplayBuffer) -> list[dict[str, Any]]:
    trajs = [make_traj(seed=i, model_weights_id=f"w{i}") for i in range(5)]
    for traj in trajs:
        buffer.add_trajectories([traj])
    return trajs


@pytest.mark.parametrize("fmt", ["pt", "pkl"])
def test_auto_save_off_window_2_saves_ids_3_and_4(tmp_path: Path, fmt: str) -> None:
    buffer = TrajectoryReplayBuffer(sample_window_size=2, trajectory_format=fmt)
    trajs = add_five(buffer)
    buffer.save_checkpoint(tmp_path / "ckpt")
    index = read_index(tmp_path / "ckpt")
    assert index.id_list == [3, 4]
    assert index.size == 2
    assert index.total_samples == 16
    assert index.trajectory_counter == 5
    assert files_of(tmp_path / "ckpt") == [f"trajectory_3_w3.{fmt}", f"trajectory_4_w4.{fmt}"]
    # The files hold exactly what was added, done-like extra rows included.
    saved = trajfile.load(tmp_path / "ckpt" / f"trajectory_3_w3.{fmt}")
    assert saved["dones"].shape[0] == 5
    assert_batches_equal(
        {k: v for k, v in saved.items() if k not in ("max_episode_length", "model_weights_id")},
        {k: v for k, v in trajs[3].items() if k not in ("max_episode_length", "model_weights_id")},
    )

    for rank, ids in [(0, [3]), (1, [4])]:
        part = TrajectoryReplayBuffer(sample_window_size=2)
        part.load_checkpoint(tmp_path / "ckpt", is_distributed=True, local_rank=rank, world_size=2)
        assert part.trajectory_id_list == ids
        assert part.size == 1 and part.total_samples == 8
        assert part.trajectory_counter == ids[0] + 1

    resumed = TrajectoryReplayBuffer(sample_window_size=2, trajectory_format=fmt)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.trajectory_counter == 5
    assert resumed.add_trajectories([make_traj(seed=9)]) == [5]
    assert resumed.trajectory_id_list == [3, 4, 5]


def test_pt_and_pkl_save_the_same_data(tmp_path: Path) -> None:
    loaded = {}
    for fmt in ("pt", "pkl"):
        buffer = TrajectoryReplayBuffer(sample_window_size=2, trajectory_format=fmt)
        add_five(buffer)
        buffer.save_checkpoint(tmp_path / fmt)
        index = read_index(tmp_path / fmt)
        loaded[fmt] = (
            index.state(),
            [trajfile.load(tmp_path / fmt / index.file_name(i)) for i in index.id_list],
        )
        again = TrajectoryReplayBuffer(sample_window_size=0)
        again.load_checkpoint(tmp_path / fmt)
        loaded[fmt + "-batch"] = again.sample(16)
    assert loaded["pt"][0] == loaded["pkl"][0]
    for a, b in zip(loaded["pt"][1], loaded["pkl"][1], strict=True):
        assert_batches_equal(a_only_tensors(a), a_only_tensors(b))
    assert_batches_equal(loaded["pt-batch"], loaded["pkl-batch"])


def a_only_tensors(traj: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in traj.items() if k not in ("max_episode_length", "model_weights_id")}


def test_auto_save_on_window_3_copies_the_window(tmp_path: Path) -> None:
    auto = tmp_path / "auto"
    buffer = TrajectoryReplayBuffer(sample_window_size=3, auto_save=True, auto_save_path=str(auto))
    add_five(buffer)
    buffer.save_checkpoint(tmp_path / "ckpt")
    assert read_index(tmp_path / "ckpt").state() == {
        "size": 3,
        "total_samples": 24,
        "trajectory_counter": 5,
        "trajectory_id_list": [2, 3, 4],
    }
    assert len(files_of(tmp_path / "ckpt")) == 3
    buffer.flush()
    assert read_index(auto).id_list == [0, 1, 2, 3, 4]
    assert len(files_of(auto)) == 5
    buffer.close()


@pytest.mark.parametrize("window", [0, 5, 50])
@pytest.mark.parametrize("auto_save", [False, True])
def test_window_zero_or_longer_keeps_everything(tmp_path: Path, window: int, auto_save: bool) -> None:
    buffer = TrajectoryReplayBuffer(
        sample_window_size=window, auto_save=auto_save, auto_save_path=str(tmp_path / "auto")
    )
    add_five(buffer)
    buffer.save_checkpoint(tmp_path / "ckpt")
    assert read_index(tmp_path / "ckpt").id_list == [0, 1, 2, 3, 4]
    buffer.close()


@pytest.mark.parametrize("auto_save", [False, True])
def test_saving_leaves_the_running_buffer_unchanged(tmp_path: Path, auto_save: bool) -> None:
    def build(path: str) -> TrajectoryReplayBuffer:
        buffer = TrajectoryReplayBuffer(sample_window_size=3, auto_save=auto_save, auto_save_path=path)
        add_five(buffer)
        buffer.sample(4)
        return buffer

    saver, twin = build(str(tmp_path / "a")), build(str(tmp_path / "b"))
    before = (saver.trajectory_id_list, saver.size, saver.total_samples, saver.trajectory_counter)
    saver.save_checkpoint(tmp_path / "ckpt")
    assert (saver.trajectory_id_list, saver.size, saver.total_samples, saver.trajectory_counter) == before
    assert_batches_equal(saver.sample(32), twin.sample(32))
    assert saver.add_trajectories([make_traj(seed=7)]) == twin.add_trajectories([make_traj(seed=7)]) == [5]
    saver.close()
    twin.close()


def test_saving_right_after_adding_gives_complete_files(tmp_path: Path) -> None:
    buffer = TrajectoryReplayBuffer(
        sample_window_size=0, auto_save=True, auto_save_path=str(tmp_path / "auto")
    )
    trajs = [make_traj(seed=i, image=64, t=8, b=4) for i in range(6)]
    buffer.add_trajectories(trajs)
    buffer.save_checkpoint(tmp_path / "ckpt")  # no flush, no wait
    index = read_index(tmp_path / "ckpt")
    assert index.id_list == list(range(6))
    for tid, traj in zip(index.id_list, trajs, strict=True):
        path = tmp_path / "ckpt" / index.file_name(tid)
        assert index.entries[tid]["file_bytes"] == path.stat().st_size
        assert index.entries[tid]["sha256"] == trajfile.sha256_file(path)
        assert_batches_equal(a_only_tensors(trajfile.load(path)), a_only_tensors(traj))
    buffer.close()


def test_auto_save_directory_never_names_a_missing_file(tmp_path: Path) -> None:
    auto = tmp_path / "auto"
    buffer = TrajectoryReplayBuffer(sample_window_size=0, auto_save=True, auto_save_path=str(auto))
    for i in range(8):
        buffer.add_trajectories([make_traj(seed=i, image=48)])
        if (auto / "trajectory_index.json").exists():
            index = read_index(auto)
            for tid in index.id_list:
                assert (auto / index.file_name(tid)).stat().st_size == index.entries[tid]["file_bytes"]
    buffer.close()
    assert read_index(auto).id_list == list(range(8))
    assert not [p for p in auto.iterdir() if p.name.endswith(".tmp")]


def test_sampling_right_after_adding_with_auto_save(tmp_path: Path) -> None:
    buffer = TrajectoryReplayBuffer(sample_window_size=0, auto_save=True, auto_save_path=str(tmp_path / "a"))
    buffer.add_trajectories([make_traj(seed=1)])
    batch = buffer.sample(8)
    assert batch["actions"].shape == (8, 7)
    buffer.close()


def test_resumed_auto_save_buffer_saves_the_loaded_trajectories(tmp_path: Path) -> None:
    """RLinf skipped every trajectory that came from the checkpoint when saving again."""
    first = TrajectoryReplayBuffer(sample_window_size=0, auto_save=True, auto_save_path=str(tmp_path / "a"))
    add_five(first)
    first.save_checkpoint(tmp_path / "ckpt")
    first.close()
    second = TrajectoryReplayBuffer(sample_window_size=0, auto_save=True, auto_save_path=str(tmp_path / "b"))
    second.load_checkpoint(tmp_path / "ckpt")
    second.add_trajectories([make_traj(seed=11)])
    second.save_checkpoint(tmp_path / "ckpt2")
    assert read_index(tmp_path / "ckpt2").id_list == [0, 1, 2, 3, 4, 5]
    assert len(files_of(tmp_path / "ckpt2")) == 6
    assert read_index(tmp_path / "b").id_list == [0, 1, 2, 3, 4, 5]
    second.close()


def test_resuming_an_auto_save_directory_in_place(tmp_path: Path) -> None:
    auto = str(tmp_path / "a")
    first = TrajectoryReplayBuffer(sample_window_size=0, auto_save=True, auto_save_path=auto)
    add_five(first)
    first.close()
    second = TrajectoryReplayBuffer(sample_window_size=0, auto_save=True, auto_save_path=auto)
    with pytest.raises(RbtoolError, match="load_checkpoint"):
        second.add_trajectories([make_traj()])
    second.load_checkpoint(auto)
    assert second.add_trajectories([make_traj()]) == [5]
    second.close()
    assert read_index(auto).id_list == [0, 1, 2, 3, 4, 5]


def test_a_busy_auto_save_directory_is_refused(tmp_path: Path) -> None:
    auto = str(tmp_path / "a")
    first = TrajectoryReplayBuffer(auto_save=True, auto_save_path=auto)
    with pytest.raises(RbtoolError, match="in use"):
        TrajectoryReplayBuffer(auto_save=True, auto_save_path=auto)
    first.close()


def test_loading_resets_the_sampling_window(tmp_path: Path) -> None:
    """RLinf kept sampling the old window after a load into a buffer that had sampled."""
    other = TrajectoryReplayBuffer(sample_window_size=0)
    other.add_trajectories([make_traj(seed=50 + i, model_weights_id="other") for i in range(3)])
    other.save_checkpoint(tmp_path / "other")

    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    add_five(buffer)
    buffer.sample(8)
    buffer.load_checkpoint(tmp_path / "other")
    fresh = TrajectoryReplayBuffer(sample_window_size=0)
    fresh.load_checkpoint(tmp_path / "other")
    assert_batches_equal(buffer.sample(20), fresh.sample(20))


def test_load_reseeds_from_the_checkpoint(tmp_path: Path) -> None:
    a = TrajectoryReplayBuffer(seed=7, sample_window_size=0)
    add_five(a)
    a.save_checkpoint(tmp_path / "ckpt")
    b = TrajectoryReplayBuffer(seed=99, sample_window_size=0)
    b.load_checkpoint(tmp_path / "ckpt")
    assert b.seed == 7
    c = TrajectoryReplayBuffer(seed=7, sample_window_size=0)
    c.load_checkpoint(tmp_path / "ckpt")
    assert_batches_equal(b.sample(10), c.sample(10))


def test_rejects_trajectory_without_shape_and_adds_nothing() -> None:
    buffer = TrajectoryReplayBuffer()
    bad = make_traj()
    del bad["prev_logprobs"], bad["rewards"]
    with pytest.raises(InvalidTrajectoryError, match=r"trajectory #1.*prev_logprobs"):
        buffer.add_trajectories([make_traj(), bad])
    assert buffer.size == 0 and buffer.trajectory_counter == 0


@pytest.mark.parametrize("mwid", ["a/b", "../evil", "..", ".", "a\\b", "nul\x00"])
def test_rejects_unsafe_model_weights_id(mwid: str) -> None:
    buffer = TrajectoryReplayBuffer()
    with pytest.raises(InvalidTrajectoryError, match="model_weights_id"):
        buffer.add_trajectories([make_traj(model_weights_id=mwid)])
    assert buffer.size == 0


def test_rejects_mismatched_leading_dims() -> None:
    import torch

    buffer = TrajectoryReplayBuffer()
    with pytest.raises(InvalidTrajectoryError, match="actions"):
        buffer.add_trajectories([make_traj(actions=torch.zeros(3, 2, 7))])
    with pytest.raises(InvalidTrajectoryError, match="dones"):
        buffer.add_trajectories([make_traj(dones=torch.zeros(7, 2, 1, dtype=torch.bool))])  # E=3 ∤ T=4
    assert buffer.size == 0


def test_empty_model_weights_id_and_one_dim_fields(tmp_path: Path) -> None:
    import torch

    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    buffer.add_trajectories([make_traj(model_weights_id="", task_ids=torch.arange(2))])
    buffer.save_checkpoint(tmp_path / "c")
    assert files_of(tmp_path / "c") == ["trajectory_0_.pt"]
    assert torch.equal(trajfile.load(tmp_path / "c" / "trajectory_0_.pt")["task_ids"], torch.arange(2))
    assert "task_ids" not in buffer.sample(4)


def test_differing_trajectories_share_fields_in_batches() -> None:
    import torch

    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    first = make_traj(t=3, b=1, seed=1)
    second = make_traj(t=5, b=2, seed=2, extra_rows=5, advantages=torch.zeros(5, 2, 1))
    second["curr_obs"]["states"] = torch.zeros(5, 2, 9)  # a different per-sample shape
    buffer.add_trajectories([first, second])
    batch = buffer.sample(12)
    assert "advantages" not in batch
    assert "states" not in batch["curr_obs"] and "main_images" in batch["curr_obs"]
    assert batch["dones"].shape == (12, 1)


def test_objects_with_attributes_are_accepted(tmp_path: Path) -> None:
    @dataclasses.dataclass
    class Trajectory:
        max_episode_length: int
        model_weights_id: str
        rewards: Any = None
        prev_logprobs: Any = None
        dones: Any = None
        curr_obs: Any = None

    t = make_traj()
    obj = Trajectory(4, "m1", t["rewards"], t["prev_logprobs"], t["dones"], t["curr_obs"])
    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    assert buffer.add_trajectories([obj]) == [0]
    assert set(buffer.sample(3)) == {"rewards", "dones", "prev_logprobs", "curr_obs"}


def test_sampling_errors() -> None:
    buffer = TrajectoryReplayBuffer()
    with pytest.raises(RbtoolError, match="empty"):
        buffer.sample(4)
    buffer.add_trajectories([make_traj()])
    with pytest.raises(UsageError):
        buffer.sample(0)
    assert buffer.sample(1000)["actions"].shape[0] == 8  # clamped to the window's samples


def test_distributed_load_rejects_bad_rank(tmp_path: Path) -> None:
    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    add_five(buffer)
    buffer.save_checkpoint(tmp_path / "c")
    for rank, world in [(2, 2), (-1, 2), (0, 0)]:
        with pytest.raises(UsageError):
            buffer.load_checkpoint(tmp_path / "c", is_distributed=True, local_rank=rank, world_size=world)
    assert buffer.size == 5


def test_checkpoint_keeps_the_reference_layout(tmp_path: Path) -> None:
    """File names, JSON keys and value types as SPEC §2, so RLinf can load what rbtool writes."""
    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    add_five(buffer)
    buffer.save_checkpoint(tmp_path / "c")
    meta = orjson.loads((tmp_path / "c" / "metadata.json").read_bytes())
    for key, kind in [
        ("trajectory_format", str),
        ("size", int),
        ("total_samples", int),
        ("trajectory_counter", int),
        ("seed", int),
    ]:
        assert type(meta[key]) is kind
    raw = orjson.loads((tmp_path / "c" / "trajectory_index.json").read_bytes())
    assert list(raw) == ["trajectory_index", "trajectory_id_list"]
    assert raw["trajectory_id_list"] == [0, 1, 2, 3, 4]
    for key, entry in raw["trajectory_index"].items():
        assert key == str(entry["trajectory_id"])
        assert list(entry)[:5] == [
            "num_samples",
            "trajectory_id",
            "max_episode_length",
            "shape",
            "model_weights_id",
        ]
        assert (
            isinstance(entry["shape"], list) and entry["num_samples"] == entry["shape"][0] * entry["shape"][1]
        )
        name = f"trajectory_{key}_{entry['model_weights_id']}.pt"
        import torch

        data = torch.load(tmp_path / "c" / name, weights_only=True)  # what RLinf does, minus mmap
        assert data["model_weights_id"] == entry["model_weights_id"]


def test_clear_and_close(tmp_path: Path) -> None:
    auto = tmp_path / "a"
    buffer = TrajectoryReplayBuffer(sample_window_size=0, auto_save=True, auto_save_path=str(auto))
    add_five(buffer)
    buffer.clear()
    assert len(buffer) == 0 and buffer.trajectory_counter == 0
    assert read_index(auto).size == 0 and files_of(auto) == []
    buffer.close()
    with pytest.raises(RbtoolError, match="closed"):
        buffer.add_trajectories([make_traj()])
    info = TrajectoryReplayBuffer().info()
    assert info["size"] == 0 and info["auto_save"] is False
