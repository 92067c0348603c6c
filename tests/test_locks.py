"""Locks are honoured everywhere: --force never replaces a directory a writer holds.

A live buffer (auto_save on) holds its directory's lock; so does an `ingest` while it
runs. Every command that may replace an output refuses to replace one that is held,
says who holds it, and leaves it as it was.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES, make_traj, run, tree_digest

from rbtool import TrajectoryReplayBuffer
from rbtool.errors import DirectoryInUseError
from rbtool.files.index import read_index

SOURCE = FIXTURES / "autosave_pt" / "autosave"

REPLACERS: dict[str, Callable[[Path], list[Any]]] = {
    "checkpoint-load-buffer": lambda held: ["checkpoint", "load", SOURCE, "--buffer", held, "--force"],
    "checkpoint-save": lambda held: ["checkpoint", "save", SOURCE, held, "--force"],
    "merge": lambda held: ["merge", SOURCE, "--out", held, "--force"],
    "repair": lambda held: ["repair", SOURCE, "--out", held, "--force"],
}


@pytest.fixture
def live_buffer(tmp_path: Path) -> Any:
    """A buffer with auto_save on, holding tmp_path/live, with two trajectories written."""
    buffer = TrajectoryReplayBuffer(
        sample_window_size=0, auto_save=True, auto_save_path=str(tmp_path / "live")
    )
    buffer.add_trajectories([make_traj(seed=0), make_traj(seed=1)])
    buffer.flush()
    yield buffer
    buffer.close()


@pytest.mark.parametrize("command", sorted(REPLACERS))
def test_force_never_replaces_a_live_buffer(tmp_path: Path, live_buffer: Any, command: str) -> None:
    held = tmp_path / "live"
    before = tree_digest(held)
    result = run(*REPLACERS[command](held))
    assert result.exit_code == 1, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("Error: ") and "in use by another rbtool process (pid " in line
    assert tree_digest(held) == before
    assert not any(".rbtool-staging-" in p.name or ".rbtool-old-" in p.name for p in tmp_path.iterdir())
    live_buffer.add_trajectories([make_traj(seed=2)])  # the buffer goes on writing where it was
    live_buffer.flush()
    assert read_index(held).id_list == [0, 1, 2]


def test_force_never_replaces_a_shard_output_with_a_live_rank(tmp_path: Path) -> None:
    out = tmp_path / "shards"
    assert run("shard", SOURCE, "--world-size", "2", "--out", out).exit_code == 0
    buffer = TrajectoryReplayBuffer(sample_window_size=0, auto_save=True, auto_save_path=str(out / "rank_1"))
    try:
        buffer.load_checkpoint(out / "rank_1")  # a training rank resumed its own directory
        before = tree_digest(out)
        result = run("shard", SOURCE, "--world-size", "3", "--out", out, "--force")
        assert result.exit_code == 1 and "rank_1: in use by another rbtool process" in result.stderr
        assert tree_digest(out) == before
    finally:
        buffer.close()
    assert run("shard", SOURCE, "--world-size", "3", "--out", out, "--force").exit_code == 0
    assert sorted(p.name for p in out.iterdir()) == ["rank_0", "rank_1", "rank_2"]


def test_a_lock_held_by_another_process_is_named(tmp_path: Path) -> None:
    held = tmp_path / "held"
    assert run("checkpoint", "load", SOURCE, "--buffer", held).exit_code == 0
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, time
                from pathlib import Path
                from rbtool.files.fsutil import DirLock
                with DirLock(Path({str(held)!r}), wait=False):
                    print("held", flush=True)
                    sys.stdin.read()
                """
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        result = run("checkpoint", "load", SOURCE, "--buffer", held, "--force")
        assert result.exit_code == 1 and f"(pid {holder.pid})" in result.stderr
    finally:
        holder.communicate("")
    assert run("checkpoint", "load", SOURCE, "--buffer", held, "--force").exit_code == 0


def test_the_library_raises_directory_in_use(tmp_path: Path, live_buffer: Any) -> None:
    from rbtool import restore

    with pytest.raises(DirectoryInUseError, match="in use by another rbtool process"):
        restore(SOURCE, tmp_path / "live", overwrite=True)


def test_sample_reads_a_live_buffer_consistently(tmp_path: Path) -> None:
    """A buffer that keeps adding while `rbtool sample` reads it: one consistent index per run."""
    import threading

    buffer = TrajectoryReplayBuffer(
        sample_window_size=0, auto_save=True, auto_save_path=str(tmp_path / "live")
    )
    buffer.add_trajectories([make_traj(seed=0)])
    buffer.flush()
    stop = threading.Event()

    def keep_adding() -> None:
        seed = 1
        while not stop.is_set():
            buffer.add_trajectories([make_traj(seed=seed)])
            buffer.flush()
            seed += 1

    writer = threading.Thread(target=keep_adding)
    writer.start()
    try:
        for _ in range(8):
            result = run("sample", tmp_path / "live", "--num-chunks", "16", "--json")
            assert result.exit_code == 0, result.stderr
    finally:
        stop.set()
        writer.join()
        buffer.close()
