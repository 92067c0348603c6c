"""rbtool.ops.resharding: M rank directories to N, equal to shard(merge(tree), N), by count or by samples."""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from conftest import FIXTURES, make_traj, run, tree_digest
from hypothesis import given, settings
from hypothesis import strategies as st

from rbtool import TrajectoryReplayBuffer, read_index
from rbtool.errors import RankLayoutWarning, UsageError
from rbtool.files.index import balanced_blocks
from rbtool.format import INDEX_FILE, MERGE_MAP_FILE, METADATA_FILE, parse_trajectory_file_name
from rbtool.ops.checkpoint import build_from_files, load_state, merge, shard
from rbtool.ops.resharding import plan, reshard

# Trajectories per rank of the generated trees: uneven, with an empty rank once M >= 4.
RANK_SIZES = [3, 1, 4, 0, 2]


def write_tree(root: Path, m: int, *, colliding: bool) -> Path:
    """A folder of m rank checkpoints: ids from 0 in each (colliding), or one checkpoint sharded."""
    files = root / "files"
    files.mkdir(parents=True)
    paths = []
    for i in range(sum(RANK_SIZES[:m])):
        path = files / f"t{i}.pt"
        torch.save(make_traj(t=1 + i % 3, b=1 + i % 2, seed=i, image=2, model_weights_id=f"w{i % 3}"), path)
        paths.append(path)
    tree = root / "tree"
    if colliding:
        tree.mkdir()
        start = 0
        for r in range(m):
            build_from_files(paths[start : start + RANK_SIZES[r]], tree / f"rank_{r}", window=0)
            start += RANK_SIZES[r]
    else:
        build_from_files(paths, root / "whole", window=0)
        shard(root / "whole", m, tree)
    return tree


def meaning(directory: Path) -> dict[str, Any]:
    """A checkpoint's ids, entries and file bytes (what the equality below is about)."""
    index = read_index(directory)
    return {
        "state": index.state(),
        "entries": {i: index.entries[i] for i in index.id_list},
        "files": {i: (directory / index.file_name(i)).read_bytes() for i in index.id_list},
    }


def buffer_state(path: Path, **load: Any) -> dict[str, Any]:
    buffer = TrajectoryReplayBuffer(seed=7, sample_window_size=0)
    buffer.load_checkpoint(path, **load)
    state: dict[str, Any] = {
        "ids": buffer.trajectory_id_list,
        "size": buffer.size,
        "total_samples": buffer.total_samples,
        "counter": buffer.trajectory_counter,
    }
    if buffer.size:
        state["batch"] = buffer.sample(5)
    buffer.close()
    return state


def assert_same_buffer(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert {k: v for k, v in a.items() if k != "batch"} == {k: v for k, v in b.items() if k != "batch"}
    if "batch" in a:
        from conftest import assert_batches_equal

        assert_batches_equal(a["batch"], b["batch"])


@pytest.mark.parametrize("colliding", [True, False], ids=["colliding-ids", "unique-ids"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5])
def test_reshard_equals_shard_of_merge(tmp_path: Path, m: int, colliding: bool) -> None:
    tree = write_tree(tmp_path, m, colliding=colliding)
    before = tree_digest(tree)
    merged = tmp_path / "merged"
    merge([tree], merged)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RankLayoutWarning)  # the tree holds every rank it was written for
        for n in range(1, m + 4):
            out, expected = tmp_path / f"reshard_{n}", tmp_path / f"shard_{n}"
            result = reshard(tree, n, out)
            shard(merged, n, expected)
            assert sorted(p.name for p in out.iterdir()) == [f"rank_{r}" for r in range(n)]
            for r in range(n):
                got = meaning(out / f"rank_{r}")
                assert got == meaning(expected / f"rank_{r}"), (m, n, r)
                assert got["state"] == result.ranks[r].index.state()
                assert result.ranks[r].bytes == sum(map(len, got["files"].values()))
                # loading the tree by rank r of n is loading the reshard's rank directory
                assert_same_buffer(
                    buffer_state(tree, is_distributed=True, local_rank=r, world_size=n),
                    buffer_state(out / f"rank_{r}"),
                )
    assert tree_digest(tree) == before


@pytest.mark.parametrize("n", [1, 2, 3])
def test_shard_is_reshards_count_split(tmp_path: Path, n: int) -> None:
    """shard of a rank tree whose ids collide writes what reshard by count writes, merge maps too."""
    shard(FIXTURES / "ranks", n, tmp_path / "shard")
    reshard(FIXTURES / "ranks", n, tmp_path / "reshard", split="count")
    assert tree_digest(tmp_path / "shard") == tree_digest(tmp_path / "reshard")
    assert all((tmp_path / "shard" / f"rank_{r}" / MERGE_MAP_FILE).is_file() for r in range(n))


def test_reshard_records_the_layout_and_the_mapping(tmp_path: Path) -> None:
    out = tmp_path / "out"
    reshard(FIXTURES / "ranks", 3, out, split="samples")
    mapped = []
    for r in range(3):
        meta = orjson.loads((out / f"rank_{r}" / METADATA_FILE).read_bytes())
        assert meta["shard"] == {
            "rank": r,
            "world_size": 3,
            "split": "samples",
            "source_world_size": 2,
            "source_size": 7,
            "source_total_samples": 56,
            "source_trajectory_counter": 7,
        }
        renumbered = orjson.loads((out / f"rank_{r}" / MERGE_MAP_FILE).read_bytes())["renumbered"]
        assert [m["new_id"] for m in renumbered] == read_index(out / f"rank_{r}").id_list
        mapped += [(m["input"], m["old_id"]) for m in renumbered]
    ranks = FIXTURES / "ranks"
    assert sorted(mapped) == sorted(
        [(str(ranks / "rank_0"), i) for i in range(3)] + [(str(ranks / "rank_1"), i) for i in range(4)]
    )


def test_dry_run_writes_nothing(tmp_path: Path) -> None:
    result = reshard(FIXTURES / "ranks", 2, tmp_path / "out", dry_run=True)
    assert result.dry_run and [p.index.size for p in result.ranks] == [4, 3]
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments_are_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="world_size"):
        reshard(FIXTURES / "ranks", 0, tmp_path / "out")
    with pytest.raises(UsageError, match="split"):
        plan(FIXTURES / "ranks", 2, split="bytes")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ balance by samples
def check_balanced(samples: list[int], world_size: int) -> None:
    blocks = balanced_blocks(samples, world_size)
    assert len(blocks) == world_size
    assert blocks[0][0] == 0 and blocks[-1][1] == len(samples)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(blocks))  # contiguous, list order
    mean = sum(samples) / world_size
    biggest = max(samples, default=0)
    for start, end in blocks:
        assert abs(sum(samples[start:end]) - mean) <= biggest, (samples, world_size, blocks)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 100), max_size=60), st.integers(1, 12))
def test_balanced_blocks_stay_within_the_largest_trajectory_of_the_mean(samples: list[int], n: int) -> None:
    check_balanced(samples, n)


def test_balance_samples_on_trajectories_of_1_to_100_samples(tmp_path: Path) -> None:
    # T*B from 1 to 100: (T, B) pairs giving 1, 2, ..., 100 samples in a shuffled order
    sizes = [1, 100, 7, 64, 3, 99, 50, 2, 81, 12, 36, 5, 90, 20, 10, 45, 72, 4, 60, 30]
    shapes = [(s, 1) if s % 2 else (s // 2, 2) for s in sizes]
    files = tmp_path / "files"
    files.mkdir()
    paths = []
    for i, (t, b) in enumerate(shapes):
        path = files / f"t{i}.pt"
        torch.save(make_traj(t=t, b=b, seed=i, image=1), path)
        paths.append(path)
    ckpt = tmp_path / "ckpt"
    build_from_files(paths, ckpt, window=0)
    for n in (1, 2, 3, 4, 6, 7):
        out = tmp_path / f"bal_{n}"
        result = reshard(ckpt, n, out, split="samples")
        totals = [read_index(out / f"rank_{r}").total_samples for r in range(n)]
        assert totals == [p.index.total_samples for p in result.ranks]
        assert all(abs(t - sum(sizes) / n) <= max(sizes) for t in totals), (n, totals)
        ids = [i for r in range(n) for i in read_index(out / f"rank_{r}").id_list]
        assert ids == list(range(len(sizes)))  # list order kept
        check_balanced(sizes, n)


# ------------------------------------------------------------------ the reference layout
def assert_reference_layout(rank_dir: Path) -> None:
    """What RLinf's buffer needs to load a directory (SPEC §2)."""
    meta = orjson.loads((rank_dir / METADATA_FILE).read_bytes())
    assert meta["trajectory_format"] == "pt"
    for key in ("size", "total_samples", "trajectory_counter", "seed"):
        assert isinstance(meta[key], int) and not isinstance(meta[key], bool), key
    raw = orjson.loads((rank_dir / INDEX_FILE).read_bytes())
    ids = raw["trajectory_id_list"]
    assert meta["size"] == len(ids) and set(raw["trajectory_index"]) == {str(i) for i in ids}
    assert meta["total_samples"] == sum(raw["trajectory_index"][str(i)]["num_samples"] for i in ids)
    assert meta["trajectory_counter"] == max(ids, default=-1) + 1
    names = sorted(p.name for p in rank_dir.iterdir() if p.suffix == ".pt")
    expected = sorted(f"trajectory_{i}_{raw['trajectory_index'][str(i)]['model_weights_id']}.pt" for i in ids)
    assert names == expected
    assert all(parse_trajectory_file_name(n) for n in names)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_reference_ranks_resharded_load_in_the_reference_layout(tmp_path: Path, n: int) -> None:
    out = tmp_path / "out"
    reshard(FIXTURES / "ranks", n, out)
    whole = buffer_state(FIXTURES / "ranks")
    ids: list[int] = []
    for r in range(n):
        rank_dir = out / f"rank_{r}"
        assert_reference_layout(rank_dir)
        state = buffer_state(rank_dir)
        assert state["ids"] == read_index(rank_dir).id_list
        ids += state["ids"]
    assert ids == whole["ids"] == list(range(7))
    result = run("verify", out, "--deep")
    assert result.exit_code == 0, result.stdout + result.stderr


# ------------------------------------------------------------------ layout warnings
def test_loading_a_rank_with_another_world_size_warns(tmp_path: Path) -> None:
    out = tmp_path / "out"
    reshard(FIXTURES / "ranks", 2, out)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RankLayoutWarning)
        load_state(out / "rank_1")  # a full load of its own directory
        load_state(out, world_size=3, rank=2)  # the whole tree, over any world size
    with pytest.warns(RankLayoutWarning, match="already rank 1 of world size 2.*by world size 2"):
        load_state(out / "rank_1", world_size=2, rank=0)  # split again by its own world size
    with pytest.warns(RankLayoutWarning, match="rank 1 of world size 2.*world size 3"):
        load_state(out / "rank_1", world_size=3, rank=0)
    buffer = TrajectoryReplayBuffer()
    with pytest.warns(RankLayoutWarning, match="world size 4"):
        buffer.load_checkpoint(out / "rank_0", is_distributed=True, local_rank=1, world_size=4)
    buffer.close()


def test_a_tree_missing_a_rank_warns(tmp_path: Path) -> None:
    out = tmp_path / "out"
    reshard(FIXTURES / "ranks", 3, out)
    import shutil

    shutil.rmtree(out / "rank_2")
    with pytest.warns(RankLayoutWarning, match="2 rank directories.*world size 3"):
        load_state(out)


def test_an_auto_save_buffer_resumes_one_rank_of_a_tree(tmp_path: Path) -> None:
    """auto_save on: the rank's trajectories are linked into the auto-save directory, merged ids kept."""
    reshard(FIXTURES / "ranks", 3, tmp_path / "r3")
    buffer = TrajectoryReplayBuffer(
        sample_window_size=0, auto_save=True, auto_save_path=str(tmp_path / "auto")
    )
    buffer.load_checkpoint(FIXTURES / "ranks", is_distributed=True, local_rank=1, world_size=3)
    assert buffer.trajectory_id_list == [3, 4] and buffer.trajectory_counter == 5
    buffer.add_trajectories([make_traj(t=4, b=2, image=2)])
    assert buffer.trajectory_id_list == [3, 4, 5]
    buffer.save_checkpoint(tmp_path / "saved")
    buffer.close()
    saved, rank = read_index(tmp_path / "saved"), read_index(tmp_path / "r3" / "rank_1")
    for i in rank.id_list:
        got = (tmp_path / "saved" / saved.file_name(i)).read_bytes()
        assert got == (tmp_path / "r3" / "rank_1" / rank.file_name(i)).read_bytes()
    assert read_index(tmp_path / "auto").id_list == [3, 4, 5]
