"""Directory-level operations: save, build, restore, shard and merge (SPEC §4)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import orjson
import pytest
from conftest import FIXTURES, make_traj, tree_digest
from hypothesis import given
from hypothesis import strategies as st

from rbtool import CheckpointError, TrajectoryReplayBuffer, read_index
from rbtool.files.index import rank_bounds
from rbtool.ops.checkpoint import (
    MERGE_MAP_FILE,
    build_from_files,
    merge,
    restore,
    save_from_autosave_dir,
    shard,
)


def small_checkpoint(path: Path, n: int) -> Path:
    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    for i in range(n):
        buffer.add_trajectories(
            [make_traj(t=2 + i % 3, b=1 + i % 2, seed=i, image=2, model_weights_id=f"m{i % 2}")]
        )
    buffer.save_checkpoint(path)
    return path


def contents(path: Path) -> tuple[dict, dict[str, str]]:
    """A checkpoint's meaning: its load state and entries, and the bytes of each trajectory file."""
    index = read_index(path)
    files = {
        name: digest
        for name, digest in tree_digest(path).items()
        if name.startswith("trajectory_") and not name.endswith(".json")
    }
    assert sorted(files) == sorted(index.file_name(i) for i in index.id_list)
    return {
        "state": index.state(),
        # a hard link's recorded identity says how the file got there, not what it holds
        "entries": {i: {k: v for k, v in e.items() if k != "link"} for i, e in index.entries.items()},
        "seed": index.seed,
        "format": index.trajectory_format,
    }, files


@given(n=st.integers(0, 1000), world=st.integers(1, 64))
def test_rank_bounds_are_contiguous_and_cover(n: int, world: int) -> None:
    blocks = [rank_bounds(n, world, r) for r in range(world)]
    assert blocks[0][0] == 0 and blocks[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(blocks))
    sizes = [e - s for s, e in blocks]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_shard_properties_and_merge_round_trip(tmp_path: Path, n: int) -> None:
    source = small_checkpoint(tmp_path / "src", n)
    before = tree_digest(source)
    src_index = read_index(source)
    for world in range(1, n + 3):
        out = tmp_path / f"shards{world}"
        shards, report = shard(source, world, out)
        assert report.linked + report.copied == n
        seen: list[int] = []
        for rank, part in enumerate(shards):
            loaded = TrajectoryReplayBuffer(sample_window_size=0)
            loaded.load_checkpoint(out / f"rank_{rank}")
            reference = TrajectoryReplayBuffer(sample_window_size=0)
            reference.load_checkpoint(source, is_distributed=True, local_rank=rank, world_size=world)
            assert loaded.trajectory_id_list == reference.trajectory_id_list == part.id_list
            assert (loaded.size, loaded.total_samples, loaded.trajectory_counter) == (
                reference.size,
                reference.total_samples,
                reference.trajectory_counter,
            )
            written = read_index(out / f"rank_{rank}").entries
            assert all("link" in e for e in written.values())  # every file was hard-linked
            assert {i: {k: v for k, v in e.items() if k != "link"} for i, e in written.items()} == {
                i: src_index.entries[i] for i in part.id_list
            }
            seen.extend(part.id_list)
        assert seen == src_index.id_list  # disjoint, covering, order kept
        assert shard(source, world, tmp_path / f"again{world}")[0] == shards  # deterministic
        merged = merge([out], tmp_path / f"merged{world}")
        assert not merged.renumbered
        assert contents(tmp_path / f"merged{world}") == contents(source)
    assert tree_digest(source) == before


def test_merge_round_trip_keeps_a_counter_above_the_ids(tmp_path: Path) -> None:
    source = small_checkpoint(tmp_path / "src", 4)
    index = read_index(source)
    meta = orjson.loads((source / "metadata.json").read_bytes())
    meta["trajectory_counter"] = 10
    (source / "metadata.json").write_bytes(orjson.dumps(meta))
    shard(source, 3, tmp_path / "s")
    merge([tmp_path / "s"], tmp_path / "m")
    assert read_index(tmp_path / "m").trajectory_counter == 10
    assert read_index(tmp_path / "m").id_list == index.id_list


def test_merging_the_reference_ranks_renumbers_ids(tmp_path: Path) -> None:
    r0, r1 = FIXTURES / "ranks/rank_0", FIXTURES / "ranks/rank_1"
    result = merge([r0, r1], tmp_path / "m")
    assert result.renumbered
    index = read_index(tmp_path / "m")
    assert index.id_list == list(range(7)) and index.trajectory_counter == 7 and index.total_samples == 56
    pairs = [(m["old_id"], Path(m["input"]).name, m["new_id"]) for m in result.mapping]
    assert pairs == [
        (0, "rank_0", 0),
        (0, "rank_1", 1),
        (1, "rank_0", 2),
        (1, "rank_1", 3),
        (2, "rank_0", 4),
        (2, "rank_1", 5),
        (3, "rank_1", 6),
    ]
    recorded = json.loads((tmp_path / "m" / MERGE_MAP_FILE).read_text())["renumbered"]
    assert recorded == result.mapping
    for m in result.mapping:
        src_index = read_index(m["input"])
        src_file = Path(m["input"]) / src_index.file_name(m["old_id"])
        assert (tmp_path / "m" / index.file_name(m["new_id"])).read_bytes() == src_file.read_bytes()
        assert index.entries[m["new_id"]]["trajectory_id"] == m["new_id"]


def test_merge_of_a_rank_folder_and_format_conversion(tmp_path: Path) -> None:
    import torch

    from rbtool.files import trajfile

    merge([FIXTURES / "ranks"], tmp_path / "pt")
    merge([FIXTURES / "ranks"], tmp_path / "pkl", trajectory_format="pkl")
    a, b = read_index(tmp_path / "pt"), read_index(tmp_path / "pkl")
    assert a.state() == b.state() and b.trajectory_format == "pkl"
    for tid in a.id_list:
        x = trajfile.load(tmp_path / "pt" / a.file_name(tid))
        y = trajfile.load(tmp_path / "pkl" / b.file_name(tid))
        assert torch.equal(x["actions"], y["actions"]) and torch.equal(x["dones"], y["dones"])


def test_outputs_are_never_half_written(tmp_path: Path) -> None:
    source = small_checkpoint(tmp_path / "src", 3)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already exists"):
        shard(source, 2, tmp_path / "taken")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        shard(source, 2, tmp_path / "taken", overwrite=True)
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if "staging" in p.name]


def test_save_from_autosave_dir_and_build_from_files(tmp_path: Path, five_files: list[Path]) -> None:
    index, report = build_from_files(five_files, tmp_path / "mem", window=2)
    assert index.state() == {
        "size": 2,
        "total_samples": 16,
        "trajectory_counter": 5,
        "trajectory_id_list": [3, 4],
    }
    assert report.linked == 0 and report.copied + report.reflinked == 2  # loose files: copied, as by ingest
    buffer = TrajectoryReplayBuffer(
        sample_window_size=3, auto_save=True, auto_save_path=str(tmp_path / "auto")
    )
    import torch

    buffer.add_trajectories([torch.load(p, weights_only=True) for p in five_files])
    buffer.close()
    saved, _ = save_from_autosave_dir(tmp_path / "auto", tmp_path / "ckpt", window=3)
    assert saved.id_list == [2, 3, 4] and read_index(tmp_path / "auto").size == 5


def test_restore_then_continue_ids(tmp_path: Path, five_files: list[Path]) -> None:
    from rbtool import ingest

    build_from_files(five_files, tmp_path / "mem", window=2)
    restored, _ = restore(tmp_path / "mem", tmp_path / "buf")
    assert restored.id_list == [3, 4]
    result = ingest([five_files[0]], tmp_path / "buf")
    assert result.added_ids == [5]
    part, _ = restore(tmp_path / "mem", tmp_path / "rank1", world_size=2, rank=1)
    assert part.state() == {"size": 1, "total_samples": 8, "trajectory_counter": 5, "trajectory_id_list": [4]}
