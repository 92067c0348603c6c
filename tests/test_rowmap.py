"""rbtool.buffer.rowmap: files mapped side by side in one range, and sampling with map_rows=True.

Batches drawn through the row map must be bit-identical to those the default (pread) path
gives, whatever the window does: files mapped as they are drawn, released as they leave
the window, moved when the range fills up, and their pages dropped past a budget.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import flat_batch, make_traj

from rbtool import TrajectoryReplayBuffer
from rbtool.buffer import rowmap
from rbtool.buffer.rowmap import RowMap
from rbtool.errors import TrajectoryFileError, UsageError
from rbtool.files.ptheader import SMALL_FILE_BYTES

pytestmark = pytest.mark.skipif(not rowmap.available(), reason="the row map needs Linux (mremap)")

IMAGE = 48  # 6,912-byte rows: large rows, left in the file by the default path


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    fa, fb = flat_batch(a), flat_batch(b)
    assert list(fa) == list(fb)
    for key in fa:
        assert fa[key].dtype == fb[key].dtype and fa[key].shape == fb[key].shape, key
        assert torch.equal(fa[key], fb[key]), key


def make_checkpoint(path: Path, count: int, *, t: int = 8, b: int = 4, extra_rows: int = 1) -> Path:
    """A checkpoint of `count` trajectories whose files are large (image rows stay on disk)."""
    source = TrajectoryReplayBuffer(seed=5, sample_window_size=0)
    trajs = [make_traj(t=t, b=b, seed=i, image=IMAGE, extra_rows=extra_rows) for i in range(count)]
    source.add_trajectories(trajs)
    source.save_checkpoint(path)
    source.close()
    assert all(p.stat().st_size > SMALL_FILE_BYTES for p in path.glob("*.pt"))
    return path


def pair(ckpt: Path, window: int = 0, **mapped: Any) -> tuple[TrajectoryReplayBuffer, TrajectoryReplayBuffer]:
    """The same checkpoint loaded twice: read with pread (default) and through the row map."""
    plain = TrajectoryReplayBuffer(seed=11, sample_window_size=window)
    fast = TrajectoryReplayBuffer(seed=11, sample_window_size=window, map_rows=True, **mapped)
    plain.load_checkpoint(ckpt)
    fast.load_checkpoint(ckpt)
    return plain, fast


def the_map(buffer: TrajectoryReplayBuffer) -> RowMap:
    mapped = buffer._store.rowmap
    assert mapped is not None
    return mapped


def test_batches_are_those_of_the_pread_path(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", 6, extra_rows=2)
    plain, fast = pair(ckpt)
    for num_chunks in (1, 7, 64, 500):
        assert_same(plain.sample(num_chunks), fast.sample(num_chunks))
    assert len(the_map(fast)) == 6  # every drawn file mapped once, none twice
    assert the_map(fast).budget is None and the_map(fast).drops == 0
    plain.close()
    fast.close()
    assert len(the_map(fast)) == 0 and the_map(fast).reserved == 0


def test_every_field_read_through_the_map_matches_the_files(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", 3)
    plain, fast = pair(ckpt)
    batch = fast.sample(96)
    assert_same(plain.sample(96), batch)
    other = TrajectoryReplayBuffer(seed=3, sample_window_size=0, map_rows=True)
    other.load_checkpoint(ckpt)
    d, again = other.sample_with_draw(40)
    trajs = [make_traj(t=8, b=4, seed=i, image=IMAGE) for i in range(3)]
    images = flat_batch(again)["curr_obs.main_images"]
    for row, (tid, local) in enumerate(zip(d.trajectory_ids, d.local_indices.tolist(), strict=True)):
        source = trajs[tid]["curr_obs"]["main_images"].reshape(-1, IMAGE, IMAGE, 3)
        assert torch.equal(images[row], source[local])


def test_files_leaving_the_window_are_unmapped_and_new_ones_mapped(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", 5)
    plain, fast = pair(ckpt, window=3)
    assert_same(plain.sample(200), fast.sample(200))
    assert sorted(the_map(fast).slots) == [2, 3, 4]
    # auto_save off: an add evicts the front of the held window, and its file is unmapped
    added = [make_traj(t=8, b=4, seed=40 + i, image=IMAGE) for i in range(2)]
    plain.add_trajectories(added)
    fast.add_trajectories(added)
    assert_same(plain.sample(200), fast.sample(200))  # file 4 from the map, the added from memory
    assert sorted(the_map(fast).slots) == [4]  # unmapped when the next batch began
    assert the_map(fast).live == the_map(fast).slots[4][1]


def test_files_evicted_by_another_thread_while_batches_are_read(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", 8)
    fast = TrajectoryReplayBuffer(seed=4, sample_window_size=6, map_rows=True)
    fast.load_checkpoint(ckpt)
    fast.sample(64)
    failures: list[BaseException] = []
    batches: list[dict[str, Any]] = []

    def sample() -> None:
        # a sample is ordered against a concurrent add: every one draws from and reads one
        # window, and no batch reads a file unmapped (or no longer held) under it
        for _ in range(30):
            try:
                batches.append(fast.sample(128))
            except BaseException as exc:  # reported below, in the test's thread
                failures.append(exc)

    reader = threading.Thread(target=sample)
    reader.start()
    for i in range(6):  # each add evicts one mapped file from the front of the window
        fast.add_trajectories([make_traj(t=8, b=4, seed=80 + i, image=IMAGE)])
    reader.join()
    assert not failures, failures
    assert batches and all(flat_batch(b)["curr_obs.main_images"].shape[0] == 128 for b in batches)
    fast.sample(16)
    held = set(fast._store.files)
    assert set(the_map(fast).slots) <= held


def test_a_window_that_shrinks_and_grows_again_reads_the_same_rows(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", 6)
    plain = TrajectoryReplayBuffer(
        seed=2, sample_window_size=0, auto_save=True, auto_save_path=str(tmp_path / "a")
    )
    fast = TrajectoryReplayBuffer(
        seed=2, sample_window_size=0, auto_save=True, auto_save_path=str(tmp_path / "b"), map_rows=True
    )
    plain.load_checkpoint(ckpt)
    fast.load_checkpoint(ckpt)
    for size in (0, 2, 5, 1, 0):
        plain.sample_window_size = fast.sample_window_size = size
        assert_same(plain.sample(150), fast.sample(150))
    assert len(the_map(fast)) == 6
    # adds (written to files by the auto-save writer) beside mapped files
    added = [make_traj(t=8, b=4, seed=60 + i, image=IMAGE) for i in range(2)]
    plain.add_trajectories(added)
    fast.add_trajectories(added)
    plain.flush()
    fast.flush()
    for size in (0, 3):
        plain.sample_window_size = fast.sample_window_size = size
        assert_same(plain.sample(300), fast.sample(300))
    plain.close()
    fast.close()


def test_a_full_range_moves_the_mappings_and_batches_stay_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rowmap, "FIRST_RESERVE", rowmap.PAGE)  # every new file overflows the range
    ckpt = make_checkpoint(tmp_path / "ckpt", 6)
    plain, fast = pair(ckpt)
    for _ in range(4):
        assert_same(plain.sample(300), fast.sample(300))
    mapped = the_map(fast)
    assert mapped.moves >= 2 and len(mapped) == 6  # reserved for 2 files, then for 6
    assert mapped.reserved >= mapped.live and mapped.end <= mapped.reserved


def test_a_budget_drops_the_mapped_pages_and_batches_stay_the_same(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", 4)
    plain, fast = pair(ckpt, map_rows_budget=0)
    for _ in range(5):
        assert_same(plain.sample(256), fast.sample(256))
    assert the_map(fast).drops >= 1  # every batch maps file pages in: over a budget of 0 bytes


def test_a_file_shorter_than_its_header_falls_back_to_pread_and_is_named(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", 2)
    fast = TrajectoryReplayBuffer(seed=1, sample_window_size=0, map_rows=True)
    fast.load_checkpoint(ckpt)
    path = sorted(ckpt.glob("trajectory_1_*.pt"))[0]
    assert fast._store.header(1) is not None  # its structure is known before it is cut short
    os.truncate(path, path.stat().st_size - 4000)  # the last image rows are cut short
    with pytest.raises(TrajectoryFileError, match="truncated"):
        for _ in range(20):
            fast.sample(64)
    assert 1 not in the_map(fast).slots


def test_the_budget_must_be_a_number_of_bytes() -> None:
    with pytest.raises(UsageError, match="map_rows_budget"):
        TrajectoryReplayBuffer(map_rows=True, map_rows_budget=-1)
    buffer = TrajectoryReplayBuffer(map_rows=True, map_rows_budget=1 << 20)
    assert buffer.map_rows and buffer.map_rows_budget == 1 << 20


def test_rowmap_maps_releases_and_moves_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rowmap, "FIRST_RESERVE", 4 * rowmap.PAGE)
    rng = np.random.default_rng(0)
    contents = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in (5000, 64, 3 * rowmap.PAGE)]
    files = []
    for k, data in enumerate(contents):
        path = tmp_path / f"f{k}"
        path.write_bytes(data)
        files.append(path)
    mapped = RowMap()

    def read(key: int, start: int, length: int) -> bytes:
        offset = mapped.slots[key][0]
        view, index = mapped.rows(length, np.array([offset + start], dtype=np.int64))
        return view.index_select(0, torch.from_numpy(index)).numpy().tobytes()

    fds = [os.open(path, os.O_RDONLY) for path in files]
    try:
        for key in (0, 1):
            mapped.offset(key, fds[key], len(contents[key]))
        assert mapped.moves == 1 and mapped.slots[1][0] == 2 * rowmap.PAGE  # slots are whole pages
        mapped.release(0)
        assert 0 in mapped.slots  # released when the next gather settles the map
        mapped.settle()
        assert 0 not in mapped.slots and mapped.live == rowmap.PAGE
        assert read(1, 0, 64) == contents[1]
        mapped.offset(2, fds[2], len(contents[2]))  # no room left: the live mappings move
        assert mapped.moves == 2 and list(mapped.slots) == [1, 2] and mapped.slots[1][0] == 0
        assert read(1, 0, 64) == contents[1]
        assert read(2, 128, 4096) == contents[2][128 : 128 + 4096]
        assert mapped.offset(2, fds[2], len(contents[2])) == mapped.slots[2][0]  # mapped once
    finally:
        for fd in fds:
            os.close(fd)
    # the mappings outlive their descriptors
    assert read(2, 0, 64) == contents[2][:64]
    mapped.close()
    assert mapped.reserved == 0 and not mapped.slots
