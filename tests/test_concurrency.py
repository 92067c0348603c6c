"""Concurrent use: two `rbtool ingest` processes into one buffer directory at once (one waits,
nothing collides or is lost), and a buffer sampled in one thread while another adds."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import flat_batch, make_traj

from rbtool import TrajectoryReplayBuffer, ingest
from rbtool.files import trajfile
from rbtool.files.fsutil import DirLock
from rbtool.files.index import read_index
from rbtool.ops.verify import verify_checkpoint


def make_sources(directory: Path, n: int, seed: int, suffix: str = ".pt") -> list[Path]:
    """n small, distinct trajectory files."""
    directory.mkdir(parents=True)
    paths = []
    for i in range(n):
        traj = make_traj(t=2, b=1, seed=seed + i, image=2, model_weights_id=f"w{seed}")
        path = directory / f"s{i:03d}{suffix}"
        if suffix == ".pt":
            torch.save(traj, path)
        else:
            path.write_bytes(trajfile.to_bytes(traj, "pkl"))
        paths.append(path)
    return paths


def spawn(sources: list[Path], buffer: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "rbtool", "ingest", *map(str, sources), "--buffer", str(buffer), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_line(proc: subprocess.Popen[str], prefix: str, timeout: float = 120) -> str:
    """Read stderr until a line starting with `prefix` (the process keeps running)."""
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line.rstrip("\n")
    raise AssertionError(f"no line starting with {prefix!r} on stderr")


def finish(proc: subprocess.Popen[str]) -> tuple[dict, str]:
    out, rest = proc.communicate(timeout=180)
    assert proc.returncode == 0, rest
    return json.loads(out), rest


def assert_holds(buffer: Path, ids: list[int], sources: list[Path]) -> None:
    """Trajectories `ids` of the buffer are exactly the source files, in order."""
    index = read_index(buffer)
    assert len(ids) == len(sources)
    for tid, source in zip(ids, sources, strict=True):
        stored = buffer / index.file_name(tid)
        if stored.suffix == source.suffix:
            assert stored.read_bytes() == source.read_bytes()
        else:
            a, b = trajfile.load(stored), trajfile.load(source)
            assert a.keys() == b.keys() and all(
                torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor)
            )


def assert_consistent(buffer: Path, expected_size: int) -> None:
    index = read_index(buffer)
    assert len(index.id_list) == len(set(index.id_list)) == expected_size
    assert index.trajectory_counter == max(index.id_list) + 1
    report = verify_checkpoint(buffer, deep=True)
    assert report.ok and report.problems == [], [(p.code, p.message) for p in report.problems]


def test_a_second_ingest_waits_and_both_land_whole(tmp_path: Path) -> None:
    first = make_sources(tmp_path / "a", 40, 100)
    second = make_sources(tmp_path / "b", 40, 200, ".pkl")
    buffer = tmp_path / "buffer"
    seed = ingest(make_sources(tmp_path / "seed", 3, 300), buffer)  # an existing buffer with ids 0-2
    assert seed.added_ids == [0, 1, 2]

    # Hold the buffer's lock while both start, so that both must wait, whatever their start-up time.
    lock = DirLock(buffer)
    lock.acquire()
    try:
        procs = [spawn(first, buffer), spawn(second, buffer)]
        messages = [wait_for_line(p, "waiting for ") for p in procs]
    finally:
        lock.release()
    for message in messages:
        assert message.startswith(f"waiting for {buffer} (locked by pid ")

    (doc_a, _), (doc_b, _) = finish(procs[0]), finish(procs[1])
    ids_a, ids_b = doc_a["trajectory_ids"], doc_b["trajectory_ids"]
    assert not set(ids_a) & set(ids_b)
    assert sorted(ids_a + ids_b) == list(range(3, 83))
    # each ingest holds the directory for its whole run: its ids are one contiguous block
    assert ids_a == list(range(ids_a[0], ids_a[0] + 40)) and ids_b == list(range(ids_b[0], ids_b[0] + 40))
    earlier, later = sorted([ids_a, ids_b])
    assert read_index(buffer).id_list == [0, 1, 2, *earlier, *later]
    assert_holds(buffer, ids_a, first)
    assert_holds(buffer, ids_b, second)
    assert_consistent(buffer, 83)


def test_two_ingests_creating_the_same_buffer_at_once(tmp_path: Path) -> None:
    """Neither waits for the test: they race to create the directory and for its lock."""
    first = make_sources(tmp_path / "a", 60, 400)
    second = make_sources(tmp_path / "b", 60, 500)
    buffer = tmp_path / "new" / "buffer"
    procs = [spawn(first, buffer), spawn(second, buffer)]
    (doc_a, err_a), (doc_b, err_b) = finish(procs[0]), finish(procs[1])
    ids_a, ids_b = doc_a["trajectory_ids"], doc_b["trajectory_ids"]
    assert sorted(ids_a + ids_b) == list(range(120))
    assert_holds(buffer, ids_a, first)
    assert_holds(buffer, ids_b, second)
    assert_consistent(buffer, 120)
    # whichever ran second either waited (and said so) or started after the first had finished
    later_stderr, later_ids = (err_b, ids_b) if ids_b[0] > ids_a[0] else (err_a, ids_a)
    assert later_ids[0] == 60
    for line in later_stderr.splitlines():
        assert line.startswith(("waiting for ", "added trajectory ids ")), line


# ---------------------------------------------------------------- sampling while adding
IMAGE = 48  # 6,912-byte image rows: large files, whose image rows are read from the file


def large_checkpoint(path: Path, count: int) -> Path:
    source = TrajectoryReplayBuffer(seed=5, sample_window_size=0)
    source.add_trajectories([make_traj(t=8, b=4, seed=i, image=IMAGE) for i in range(count)])
    source.save_checkpoint(path)
    source.close()
    return path


@pytest.mark.parametrize("map_rows", [False, True], ids=["pread", "map_rows"])
@pytest.mark.parametrize("auto_save", [False, True], ids=["in_memory", "auto_save"])
def test_a_sample_while_another_thread_adds_sees_the_window_before_or_after_the_add(
    tmp_path: Path, auto_save: bool, map_rows: bool
) -> None:
    """Every batch drawn during adds is the one a single thread gets at one of the add boundaries.

    The checkpoint's files leave the window (auto_save off: they are no longer held) while
    batches are drawn from them, added trajectories move from memory to their files (auto_save
    on), and the sampled rows of added trajectories are cached as they are added.
    """
    loaded, window, per_add, adds = 8, 6, 2, 12
    ckpt = large_checkpoint(tmp_path / "ckpt", loaded)
    added = [
        [make_traj(t=8, b=4, seed=100 + per_add * n + j, image=IMAGE) for j in range(per_add)]
        for n in range(adds)
    ]
    auto = str(tmp_path / "auto") if auto_save else ""
    buffer = TrajectoryReplayBuffer(
        seed=9, sample_window_size=window, auto_save=auto_save, auto_save_path=auto, map_rows=map_rows
    )
    buffer.load_checkpoint(ckpt)
    buffer.sample(32)  # the loaded window is opened (and mapped) before the adds begin
    seen: list[tuple[list[int], dict[str, Any]]] = []
    listed: list[list[int]] = []  # window_ids() asked between samples
    failures: list[BaseException] = []
    adding = threading.Event()
    adding.set()

    def sample() -> None:
        try:
            while adding.is_set() or len(seen) < 4:
                draw, batch = buffer.sample_with_draw(96)
                seen.append((list(draw.window_ids), batch))
                listed.append(buffer.window_ids())
        except BaseException as exc:  # reported below, in the test's thread
            failures.append(exc)

    reader = threading.Thread(target=sample)
    reader.start()
    try:
        for trajectories in added:
            buffer.add_trajectories(trajectories)
            time.sleep(0.002)  # let the sampler draw between adds too
    finally:
        adding.clear()
        reader.join()
    buffer.close()
    assert not failures, failures

    # each batch saw the window at one add boundary, and the boundaries only move forward
    boundaries = [loaded + per_add * n for n in range(adds + 1)]
    ends = [ids[-1] + 1 for ids, _ in seen]
    assert ends == sorted(ends)
    for ids in [ids for ids, _ in seen] + listed:
        assert ids[-1] + 1 in boundaries and ids == list(range(ids[-1] + 1 - window, ids[-1] + 1))

    # and is bit for bit the batch one thread draws with the same seed at that boundary
    replay = TrajectoryReplayBuffer(seed=9, sample_window_size=window)
    replay.load_checkpoint(ckpt)
    replay.sample(32)
    done = 0
    for ids, batch in seen:
        while replay.trajectory_counter < ids[-1] + 1:
            replay.add_trajectories(added[done])
            done += 1
        expected, got = flat_batch(replay.sample(96)), flat_batch(batch)
        assert list(expected) == list(got)
        for key in expected:
            assert torch.equal(expected[key], got[key]), key
    replay.close()
