"""Writers under real file-system faults: a full disk, a read-only file system, bad paths.

A small tmpfs is mounted for the disk-full and read-only cases (root only; skipped
otherwise). Every writer must fail with one `Error:` line naming the path and the reason,
leave no staging behind, publish nothing, and leave its input unchanged; the library
raises RbtoolError subclasses, never a bare OSError.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_traj, run, tree_digest

from rbtool import shard
from rbtool.errors import FileSystemError, RbtoolError
from rbtool.files.index import read_index

ROOT = os.geteuid() == 0


@contextlib.contextmanager
def tmpfs(where: Path, size: str = "1m", *, read_only: bool = False) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=False)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four trajectories of about 600 KB each: more than a 1 MiB tmpfs holds."""
    from rbtool import TrajectoryReplayBuffer

    ckpt = tmp_path_factory.mktemp("src") / "ckpt"
    with TrajectoryReplayBuffer(sample_window_size=0) as buffer:
        buffer.add_trajectories([make_traj(seed=i, t=8, b=4, image=48) for i in range(4)])
        buffer.save_checkpoint(ckpt)
    return ckpt


def _loose_files(ckpt: Path, where: Path) -> list[Path]:
    where.mkdir(exist_ok=True)
    paths = []
    for i, name in enumerate(sorted(p.name for p in ckpt.glob("trajectory_*_*.pt"))):
        shutil.copy(ckpt / name, where / f"t{i}.pt")
        paths.append(where / f"t{i}.pt")
    return paths


WRITERS: dict[str, Callable[[Path, Path], list[Any]]] = {
    "shard": lambda src, out: ["shard", src, "--world-size", "2", "--out", out / "shards"],
    "merge": lambda src, out: ["merge", src, "--out", out / "merged"],
    "merge-pkl": lambda src, out: ["merge", src, "--out", out / "merged", "--format", "pkl"],
    "checkpoint-save": lambda src, out: ["checkpoint", "save", src, out / "saved", "--window", "0"],
    "checkpoint-load-buffer": lambda src, out: ["checkpoint", "load", src, "--buffer", out / "buf"],
    "repair": lambda src, out: ["repair", src, "--out", out / "repaired"],
    "ingest": lambda src, out: ["ingest", src, "--buffer", out / "buf"],
}


def _assert_one_line(result: Any, *words: str) -> None:
    assert result.exit_code == 1, (result.stdout, result.stderr, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def _visible(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.skipif(not ROOT, reason="mounting a tmpfs needs root")
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_full_disk_publishes_nothing(tmp_path: Path, big_checkpoint: Path, writer: str) -> None:
    before = tree_digest(big_checkpoint)
    with tmpfs(tmp_path / "small") as out:
        result = run(*WRITERS[writer](big_checkpoint, out))
        _assert_one_line(result, "No space left on device")
        assert _visible(out) in (
            [],
            ["buf"],
            ["buf/.rbtool.lock", "buf/metadata.json", "buf/trajectory_index.json"],
        )
        if (out / "buf").exists() and writer == "ingest":  # a buffer that existed keeps its last index
            assert read_index(out / "buf").size in (0, 1, 2, 3)
    assert tree_digest(big_checkpoint) == before


@pytest.mark.skipif(not ROOT, reason="mounting a tmpfs needs root")
def test_ingest_on_a_full_disk_keeps_every_published_batch(tmp_path: Path, big_checkpoint: Path) -> None:
    loose = _loose_files(big_checkpoint, tmp_path / "loose")
    with tmpfs(tmp_path / "small", size="1500k") as out:
        result = run("ingest", *loose, "--buffer", out / "buf")
        _assert_one_line(result, "No space left on device")
        buffer = out / "buf"
        if buffer.exists():
            index = read_index(buffer)
            assert all((buffer / index.file_name(i)).is_file() for i in index.id_list)
            assert sorted(p.name for p in buffer.iterdir() if p.name.startswith(".trajectory")) == []
        assert run("verify", buffer).exit_code == 0 if buffer.exists() else True


@pytest.mark.skipif(not ROOT, reason="mounting a tmpfs needs root")
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_read_only_file_system_is_one_line(tmp_path: Path, big_checkpoint: Path, writer: str) -> None:
    with tmpfs(tmp_path / "ro", read_only=True) as out:
        result = run(*WRITERS[writer](big_checkpoint, out))
        _assert_one_line(result, "Read-only file system")


@pytest.mark.skipif(not ROOT, reason="mounting a tmpfs needs root")
def test_the_library_raises_its_own_errors(tmp_path: Path, big_checkpoint: Path) -> None:
    with tmpfs(tmp_path / "small") as out:
        with pytest.raises(FileSystemError, match="No space left on device") as caught:
            shard(big_checkpoint, 2, out / "shards")
        assert isinstance(caught.value, RbtoolError) and not isinstance(caught.value, OSError)


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_parent_that_is_a_file(tmp_path: Path, big_checkpoint: Path, writer: str) -> None:
    (tmp_path / "afile").write_text("not a directory")
    result = run(*WRITERS[writer](big_checkpoint, tmp_path / "afile" / "deeper"))
    _assert_one_line(result)
    assert "not a directory" in result.stderr.lower()
    assert (tmp_path / "afile").read_text() == "not a directory"


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_name_too_long(tmp_path: Path, big_checkpoint: Path, writer: str) -> None:
    result = run(*WRITERS[writer](big_checkpoint, tmp_path / ("n" * 300)))
    _assert_one_line(result, "File name too long")
    assert not any(".rbtool-staging-" in p.name for p in tmp_path.iterdir())


def test_a_buffer_that_cannot_be_written_fails_its_background_write(tmp_path: Path) -> None:
    """The auto-save thread's failure comes back as an RbtoolError on the next call."""
    from rbtool import TrajectoryReplayBuffer

    if not ROOT:
        pytest.skip("mounting a tmpfs needs root")
    with tmpfs(tmp_path / "small", size="600k") as out:
        buffer = TrajectoryReplayBuffer(sample_window_size=0, auto_save=True, auto_save_path=str(out / "buf"))
        try:
            buffer.add_trajectories([make_traj(seed=i, t=8, b=4, image=48) for i in range(3)])
            with pytest.raises(RbtoolError, match="No space left on device"):
                buffer.flush()
        finally:
            buffer.close(wait=False)
        index = read_index(out / "buf")
        assert all((out / "buf" / index.file_name(i)).is_file() for i in index.id_list)
    assert torch.zeros(1).sum() == 0
