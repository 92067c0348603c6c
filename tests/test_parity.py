"""Drop-in parity with RLinf's TrajectoryReplayBuffer, each point checked against its behaviour."""

from __future__ import annotations

import asyncio
import inspect
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


# ----------------------------------------------------------------------------- the package
_ = inspect.Parameter.empty
# rlinf.data.storage.replay's six names as its source declares them: each public method's
# parameters in order, with their defaults (`_`: none)
RLINF_PACKAGE: dict[str, dict[str, list[tuple[str, Any]]]] = {
    "TrajectoryReplayBuffer": {
        "__init__": [
            ("seed", 1234), ("enable_cache", True), ("cache_size", 5), ("sample_window_size", 100),
            ("auto_save", False), ("auto_save_path", ""), ("trajectory_format", "pt"),
        ],
        "add_trajectories": [("trajectories", _)],
        # RLinf's default num_chunks=0 only reaches its `assert num_chunks > 0`; rbtool's has none
        "sample": [("num_chunks", _)],
        "sample_chunks": [("num_chunks", _)],
        "save_checkpoint": [("save_path", _)],
        "load_checkpoint": [
            ("load_path", _), ("is_distributed", False), ("local_rank", 0), ("world_size", 1),
        ],
        "is_ready": [("min_size", _)],
        "is_ready_async": [("min_size", _)],
        "get_stats": [],
        "clear": [],
        "clear_cache": [],
        "close": [("wait", True)],
        "__len__": [],
    },
    "TrajectoryCache": {
        "__init__": [("max_size", 5)],
        "get": [("trajectory_id", _)],
        "put": [("trajectory_id", _), ("trajectory", _)],
        "get_buffer": [],
        "get_slot_length": [],
        "clear": [],
    },
    "PriorityStore": {
        "__init__": [("maxsize", _)],
        "add": [("priority", _), ("data", _)],
        "topn": [("n", _)],
        "remove_below": [("threshold", _)],
        "get_metric": [],
        "__len__": [],
    },
    "ReplayBufferDataset": {
        "__init__": [
            ("replay_buffer", _), ("demo_buffer", _), ("batch_size", _),
            ("min_replay_buffer_size", _), ("min_demo_buffer_size", _),
        ],
        "__iter__": [],
        "close": [],
    },
    "PreloadReplayBufferDataset": {
        "__init__": [
            ("replay_buffer", _), ("demo_buffer", _), ("batch_size", _),
            ("min_replay_buffer_size", _), ("min_demo_buffer_size", _), ("prefetch_size", 5),
        ],
        "__iter__": [],
        "close": [],
    },
    "replay_buffer_collate_fn": {"": [("batch", _)]},
}  # fmt: skip


@pytest.mark.parametrize("name", list(RLINF_PACKAGE))
def test_rbtool_exports_rlinfs_replay_package_with_its_arguments_and_type_hints(name: str) -> None:
    import rbtool

    assert name in rbtool.__all__
    exported = getattr(rbtool, name)
    for method, params in RLINF_PACKAGE[name].items():
        func = getattr(exported, method) if method else exported
        where = f"{name}.{method}" if method else name
        signature = inspect.signature(func)
        positional = [
            p
            for p in signature.parameters.values()
            if p.name != "self" and p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        ]
        # RLinf's arguments come first, in its order and with its defaults; rbtool may add after
        assert [(p.name, p.default) for p in positional[: len(params)]] == params, where
        assert all(p.default is not _ for p in positional[len(params) :]), where
        # annotated (some name types imported for checkers only, so they are not evaluated here)
        unhinted = [p.name for p in signature.parameters.values() if p.name != "self" and p.annotation is _]
        assert not unhinted and signature.return_annotation is not _, (where, unhinted)
    if name == "ReplayBufferDataset":
        from torch.utils.data import IterableDataset

        assert issubclass(exported, IterableDataset)
        assert "kwargs" in inspect.signature(exported).parameters  # RLinf's **kwargs, ignored


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
def test_a_window_shrunk_and_grown_holds_what_rlinfs_cache_holds(tmp_path: Path) -> None:
    """RLinf's cache keeps its construction-time size; so does what rbtool holds (SPEC §3)."""
    buffer = TrajectoryReplayBuffer(sample_window_size=3)
    buffer.add_trajectories([make_traj(seed=i) for i in range(3)])
    buffer.sample_window_size = 1
    buffer.add_trajectories([make_traj(seed=3)])
    assert buffer.window_ids() == [3]
    assert buffer.get_stats()["cache_size"] == 3  # RLinf's cache still holds 1, 2, 3 (rbtool said 1)
    buffer.sample_window_size = 3
    assert buffer.window_ids() == [1, 2, 3]
    assert buffer.get_stats()["cache_size"] == 3
    state = buffer.random_generator.get_state()
    draw, _ = buffer.sample_with_draw(8)
    g = torch.Generator()
    g.set_state(state)
    assert draw.global_indices.tolist() == torch.randint(0, 24, (8,), generator=g).tolist()
    assert draw.trajectory_ids == [[1, 2, 3][i // 8] for i in draw.global_indices.tolist()]
    buffer.save_checkpoint(tmp_path / "c")
    assert read_index(tmp_path / "c").id_list == [1, 2, 3]
    assert len(list((tmp_path / "c").glob("trajectory_*_*.pt"))) == 3
    buffer.sample_window_size = 10  # beyond what is held: the held trajectories
    assert buffer.window_ids() == [1, 2, 3]
    buffer.sample(4)
    buffer.add_trajectories([make_traj(seed=4), make_traj(seed=5)])
    assert buffer.window_ids() == [3, 4, 5]
    buffer.save_checkpoint(tmp_path / "c")
    assert read_index(tmp_path / "c").id_list == [3, 4, 5]


def test_a_loaded_buffer_holds_the_last_of_its_constructors_window(tmp_path: Path) -> None:
    buffer = TrajectoryReplayBuffer(sample_window_size=2)
    buffer.sample_window_size = 3
    buffer.load_checkpoint(FIXTURES / "seedless_pt")  # ids 0-3
    assert buffer.window_ids() == [2, 3] and buffer.get_stats()["cache_size"] == 2
    buffer.save_checkpoint(tmp_path / "c")
    assert read_index(tmp_path / "c").id_list == [2, 3]


def test_a_window_at_run_time_is_read_as_rlinf_reads_it() -> None:
    """`max(0, int(window))`: -1 (any negative) samples the whole buffer, 2.0 acts as 2."""
    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    buffer.add_trajectories([make_traj(seed=i) for i in range(4)])
    cases = [(-1, [0, 1, 2, 3]), (2.0, [2, 3]), (2.9, [2, 3]), (np.int64(3), [1, 2, 3]), (-7, [0, 1, 2, 3])]
    for window, ids in cases:
        buffer.sample_window_size = window
        assert buffer.window_ids() == ids, window
        draw, _ = buffer.sample_with_draw(5)
        assert set(draw.trajectory_ids) <= set(ids)
    state = buffer.random_generator.get_state()
    for bad in (float("nan"), "3", None, True):
        buffer.sample_window_size = bad
        with pytest.raises(ValueError, match="sample_window_size must be a number"):
            buffer.sample(2)
    assert torch.equal(buffer.random_generator.get_state(), state)


@pytest.mark.parametrize("auto_save", [False, True])
def test_a_negative_window_in_the_constructor_means_every_trajectory(tmp_path: Path, auto_save: bool) -> None:
    path = str(tmp_path / "a")
    buffer = TrajectoryReplayBuffer(sample_window_size=-1, auto_save=auto_save, auto_save_path=path)
    buffer.add_trajectories([make_traj(seed=i) for i in range(5)])
    assert buffer.window_ids() == [0, 1, 2, 3, 4]
    buffer.save_checkpoint(tmp_path / "c")
    assert read_index(tmp_path / "c").id_list == [0, 1, 2, 3, 4]
    buffer.close()


# ----------------------------------------------------------------------------- num_chunks
NUM_CHUNKS = [np.int64(5), np.int32(5), torch.tensor(5), torch.tensor(5, dtype=torch.int32)]


@pytest.mark.parametrize("num_chunks", NUM_CHUNKS)
def test_num_chunks_as_numpy_integers_or_a_0d_tensor_works_as_an_int(num_chunks: Any) -> None:
    buffers = [TrajectoryReplayBuffer(sample_window_size=0) for _ in range(2)]
    for buffer in buffers:
        buffer.add_trajectories([make_traj(seed=1), make_traj(seed=2)])
    assert_batches_equal(buffers[0].sample(num_chunks), buffers[1].sample(5))
    assert_batches_equal(buffers[0].sample_chunks(num_chunks), buffers[1].sample_chunks(5))


def test_sample_chunks_of_zero_is_empty_and_draws_nothing() -> None:
    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    with pytest.raises(RuntimeError, match="empty"):
        buffer.sample_chunks(0)  # RLinf checks for an empty buffer first
    buffer.add_trajectories([make_traj(seed=1)])
    state = buffer.random_generator.get_state()
    assert buffer.sample_chunks(0) == {} and buffer.sample_chunks(np.int64(0)) == {}
    with pytest.raises(ValueError):
        buffer.sample(0)  # RLinf asserts num_chunks > 0
    for bad in (-1, True, 2.0, torch.tensor([2]), torch.tensor(2.0), "2"):
        with pytest.raises(ValueError, match="num_chunks"):
            buffer.sample_chunks(bad)
    assert torch.equal(buffer.random_generator.get_state(), state)


# ----------------------------------------------------------------------------- get_stats
def test_cache_size_is_what_rlinfs_cache_holds(tmp_path: Path) -> None:
    auto = TrajectoryReplayBuffer(sample_window_size=0, auto_save=True, auto_save_path=str(tmp_path / "a"))
    auto.add_trajectories([make_traj(seed=i) for i in range(2)])
    assert auto.get_stats()["cache_size"] == 2
    auto.add_trajectories([make_traj(seed=i) for i in range(2, 7)])
    assert auto.get_stats()["cache_size"] == 5  # cache_size's default
    auto.clear_cache()
    assert auto.get_stats()["cache_size"] == 0
    auto.save_checkpoint(tmp_path / "c")
    auto.load_checkpoint(FIXTURES / "seedless_pt")
    assert auto.get_stats()["cache_size"] == 4
    auto.clear()
    assert auto.get_stats()["cache_size"] == 0
    auto.close()
    off = TrajectoryReplayBuffer(enable_cache=False, auto_save=True, auto_save_path=str(tmp_path / "b"))
    off.add_trajectories([make_traj(seed=1)])
    assert off.get_stats()["cache_size"] == 0
    off.close()
    small = TrajectoryReplayBuffer(cache_size=3, auto_save=True, auto_save_path=str(tmp_path / "d"))
    small.load_checkpoint(tmp_path / "c")
    assert small.get_stats()["cache_size"] == 3
    small.close()


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
def test_loading_a_missing_directory_is_a_file_not_found_error(tmp_path: Path) -> None:
    from rbtool.errors import CheckpointError

    with pytest.raises(FileNotFoundError, match="no such file or directory") as caught:
        TrajectoryReplayBuffer().load_checkpoint(tmp_path / "nowhere")
    assert isinstance(caught.value, CheckpointError)
    for rank in (None, 1):  # the distributed load too, and a str path as RLinf's callers pass
        load = {} if rank is None else {"is_distributed": True, "local_rank": rank, "world_size": 2}
        with pytest.raises(FileNotFoundError, match="no such file or directory"):
            TrajectoryReplayBuffer().load_checkpoint(str(tmp_path / "nowhere"), **load)
    # a directory that exists but holds nothing yet (RLinf: FileNotFoundError, "Metadata not found")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither a checkpoint") as caught:
        TrajectoryReplayBuffer().load_checkpoint(tmp_path / "empty")
    assert isinstance(caught.value, CheckpointError)


def test_saving_over_the_loaded_directory_with_a_window_keeps_what_the_buffer_holds(tmp_path: Path) -> None:
    """auto_save off, window 2: the save writes the two held trajectories over the directory
    they are read from; index and files agree, and sampling goes on from the held data."""
    ckpt = copy_fixture("seedless_pt", tmp_path / "ckpt")
    twin_dir = copy_fixture("seedless_pt", tmp_path / "twin")
    buffer, twin = (TrajectoryReplayBuffer(seed=1234, sample_window_size=2) for _ in range(2))
    buffer.load_checkpoint(ckpt)
    twin.load_checkpoint(twin_dir)
    assert_batches_equal(buffer.sample(6), twin.sample(6))
    for _ in range(2):  # the second time over its own output
        buffer.save_checkpoint(ckpt)
        index = read_index(ckpt)
        assert index.id_list == [2, 3] and index.size == 2 and index.trajectory_counter == 4
        assert sorted(p.name for p in ckpt.iterdir() if p.suffix == ".pt") == sorted(
            index.file_name(i) for i in index.id_list
        )
        assert metadata(ckpt)["total_samples"] == sum(index.entries[i]["num_samples"] for i in index.id_list)
        for tid in index.id_list:  # each file holds what was loaded, every field (SPEC §3 Saving)
            name = index.file_name(tid)
            saved, loaded = (torch.load(d / name, weights_only=True) for d in (ckpt, twin_dir))
            assert saved.keys() == loaded.keys()
            tensors = [k for k, v in loaded.items() if isinstance(v, (torch.Tensor, dict))]
            assert_batches_equal({k: saved[k] for k in tensors}, {k: loaded[k] for k in tensors})
            assert all(saved[k] == loaded[k] for k in loaded if k not in tensors)
        assert_batches_equal(buffer.sample(7), twin.sample(7))
    again = TrajectoryReplayBuffer(seed=1234, sample_window_size=2)
    again.load_checkpoint(ckpt)
    fresh = TrajectoryReplayBuffer(seed=1234, sample_window_size=2)
    fresh.load_checkpoint(FIXTURES / "seedless_pt")
    assert_batches_equal(again.sample(8), fresh.sample(8))


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
