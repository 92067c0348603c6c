"""rbtool.files.fsutil: atomic writes, link-or-copy, staged directories, publishing, directory locks."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from rbtool.errors import CheckpointError, FileSystemError, OutputExistsError
from rbtool.files import fsutil
from rbtool.files.fsutil import (
    LOCK_FILE,
    STAGING_MARK,
    DirLock,
    link_or_copy,
    new_staging_dir,
    publish_dir,
    staged_dir,
    write_bytes_atomic,
)


def names(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


def make_checkpoint(directory: Path, marker: str = "old") -> Path:
    directory.mkdir(parents=True)
    (directory / "metadata.json").write_text("{}")
    (directory / "trajectory_index.json").write_text("{}")
    (directory / "trajectory_0_.pt").write_text(marker)
    return directory


# --------------------------------------------------------- write_bytes_atomic
def test_write_bytes_atomic_writes_and_replaces_leaving_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "metadata.json"
    write_bytes_atomic(path, b"first")
    write_bytes_atomic(path, b"second", sync_dir=False)
    assert path.read_bytes() == b"second"
    assert names(tmp_path) == {"metadata.json"}


def test_write_bytes_atomic_failure_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "trajectory_index.json"
    path.write_bytes(b"old")
    with pytest.raises(TypeError):
        write_bytes_atomic(path, "not bytes")  # type: ignore[arg-type]
    assert path.read_bytes() == b"old"
    assert names(tmp_path) == {"trajectory_index.json"}


def test_write_bytes_atomic_replaces_a_symlink_not_its_target(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    link = tmp_path / "metadata.json"
    link.symlink_to(target)
    write_bytes_atomic(link, b"new")
    assert not link.is_symlink() and link.read_bytes() == b"new"
    assert target.read_bytes() == b"keep"


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_write_bytes_atomic_respects_the_umask(tmp_path: Path, umask_022: None) -> None:
    path = tmp_path / "metadata.json"
    write_bytes_atomic(path, b"{}")
    assert path.stat().st_mode & 0o777 == 0o644
    os.umask(0o027)
    write_bytes_atomic(path, b"{}")
    assert path.stat().st_mode & 0o777 == 0o640


def test_staging_dirs_respect_the_umask(tmp_path: Path, umask_022: None) -> None:
    assert new_staging_dir(tmp_path / "out").stat().st_mode & 0o777 == 0o755


# ---------------------------------------------------------------- link_or_copy
def test_link_or_copy_links_on_the_same_file_system(tmp_path: Path) -> None:
    src = tmp_path / "src.pt"
    src.write_bytes(b"data")
    dst = tmp_path / "out" / "dst.pt"
    dst.parent.mkdir()
    assert link_or_copy(src, dst) == "link"
    assert os.path.samefile(src, dst) and dst.read_bytes() == b"data"
    assert names(dst.parent) == {"dst.pt"}
    # placing it again is a no-op that still reports a link
    assert link_or_copy(src, dst) == "link"


def test_link_or_copy_replaces_another_file_at_the_destination(tmp_path: Path) -> None:
    src, dst = tmp_path / "src.pt", tmp_path / "dst.pt"
    src.write_bytes(b"new")
    dst.write_bytes(b"old")
    assert link_or_copy(src, dst) == "link"
    assert os.path.samefile(src, dst) and dst.read_bytes() == b"new"


@pytest.fixture
def other_file_system(tmp_path: Path) -> Iterator[Path]:
    """A directory on another file system than tmp_path (hard links across it fail)."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second file system to copy across")
    directory = Path(shm / f"rbtool-test-{os.getpid()}-{tmp_path.name}")
    directory.mkdir()
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_link_or_copy_copies_across_file_systems(tmp_path: Path, other_file_system: Path) -> None:
    src = tmp_path / "src.pt"
    src.write_bytes(os.urandom(3 << 20))
    dst = other_file_system / "dst.pt"
    assert link_or_copy(src, dst) == "copy"
    assert not os.path.samefile(src, dst) and dst.read_bytes() == src.read_bytes()
    assert names(other_file_system) == {"dst.pt"}


def test_link_or_copy_of_a_missing_source_raises_and_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileSystemError, match="No such file or directory"):
        link_or_copy(tmp_path / "gone.pt", tmp_path / "dst.pt")
    assert names(tmp_path) == set()


# ------------------------------------------------------------------ staged_dir
def test_staged_dir_builds_beside_the_target_and_publishes_on_success(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "ckpt"
    with staged_dir(target) as staging:
        assert staging.parent == target.parent and STAGING_MARK in staging.name
        assert staging.name.startswith(".")
        assert not target.exists()
        (staging / "metadata.json").write_text("{}")
    assert names(target) == {"metadata.json"}
    assert names(target.parent) == {"ckpt"}


def test_staged_dir_publishes_nothing_when_the_block_fails(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    with pytest.raises(KeyboardInterrupt), staged_dir(target) as staging:
        (staging / "metadata.json").write_text("{}")
        raise KeyboardInterrupt
    assert names(tmp_path) == set()


def test_staged_dir_does_not_replace_without_overwrite(tmp_path: Path) -> None:
    target = make_checkpoint(tmp_path / "ckpt")
    with pytest.raises(OutputExistsError) as caught, staged_dir(target) as staging:
        (staging / "trajectory_0_.pt").write_text("new")
    assert str(caught.value) == f"{target}: already exists"
    assert (target / "trajectory_0_.pt").read_text() == "old"
    assert names(tmp_path) == {"ckpt"}


def test_staged_dir_with_overwrite_swaps_a_checkpoint_out(tmp_path: Path) -> None:
    target = make_checkpoint(tmp_path / "ckpt")
    with staged_dir(target, overwrite=True) as staging:
        (staging / "metadata.json").write_text('{"new": 1}')
    assert names(target) == {"metadata.json"}
    assert names(tmp_path) == {"ckpt"}


# ----------------------------------------------------------------- publish_dir
def staging_with_file(target: Path) -> Path:
    staging = new_staging_dir(target)
    (staging / "metadata.json").write_text("new")
    return staging


@pytest.mark.parametrize("kind", ["empty", "checkpoint", "legacy_index", "shard_folder"])
def test_publish_dir_replaces_checkpoint_like_targets(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "out"
    if kind == "empty":
        target.mkdir()
    elif kind == "checkpoint":
        make_checkpoint(target)
    elif kind == "legacy_index":
        target.mkdir()
        (target / "trajector_index.json").write_text("{}")
    else:
        make_checkpoint(target / "rank_0")
        make_checkpoint(target / "rank_12")
    publish_dir(staging_with_file(target), target, overwrite=True)
    assert names(target) == {"metadata.json"} and (target / "metadata.json").read_text() == "new"
    assert names(tmp_path) == {"out"}


@pytest.mark.parametrize("kind", ["plain_folder", "rank_folder_with_extra", "empty_rank", "file"])
def test_publish_dir_refuses_to_replace_other_things(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "out"
    if kind == "plain_folder":
        target.mkdir()
        (target / "thesis.tex").write_text("precious")
    elif kind == "rank_folder_with_extra":
        make_checkpoint(target / "rank_0")
        (target / "notes.txt").write_text("precious")
    elif kind == "empty_rank":
        (target / "rank_0").mkdir(parents=True)
    else:
        target.write_text("precious")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with pytest.raises(
        CheckpointError, match="is not a checkpoint directory; refusing to replace it"
    ) as caught:
        publish_dir(staging_with_file(target), target, overwrite=True)
    assert not isinstance(caught.value, OutputExistsError)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_publish_dir_without_overwrite_refuses_any_existing_target(tmp_path: Path) -> None:
    for target in (tmp_path / "empty", tmp_path / "link"):
        if target.name == "empty":
            target.mkdir()
        else:
            target.symlink_to(tmp_path / "nowhere")  # a dangling symlink exists too
        with pytest.raises(OutputExistsError, match="already exists"):
            publish_dir(staging_with_file(target), target, overwrite=False)
    assert names(tmp_path) == {"empty", "link"}


# --------------------------------------------------------------------- DirLock
def test_dir_lock_is_exclusive_and_names_its_holder(tmp_path: Path) -> None:
    with DirLock(tmp_path):
        assert (tmp_path / LOCK_FILE).read_text() == f"pid {os.getpid()}"
        with pytest.raises(CheckpointError) as caught:
            DirLock(tmp_path, wait=False).acquire()
        assert str(caught.value) == f"{tmp_path}: in use by another rbtool process (pid {os.getpid()})"
    # released: a second lock is granted at once
    with DirLock(tmp_path, wait=False):
        pass


def test_dir_lock_waits_calling_on_wait_once_with_the_holder(tmp_path: Path) -> None:
    first = DirLock(tmp_path)
    first.acquire()
    waiting = threading.Event()
    holders: list[str] = []
    acquired = threading.Event()

    def on_wait(holder: str) -> None:
        holders.append(holder)
        waiting.set()

    second = DirLock(tmp_path, on_wait=on_wait)

    def take() -> None:
        second.acquire()
        acquired.set()

    thread = threading.Thread(target=take)
    thread.start()
    try:
        assert waiting.wait(10)
        assert not acquired.is_set()
    finally:
        first.release()
    thread.join(10)
    assert acquired.is_set() and holders == [f"pid {os.getpid()}"]
    with pytest.raises(CheckpointError):
        DirLock(tmp_path, wait=False).acquire()
    second.release()


def test_dir_lock_release_is_idempotent(tmp_path: Path) -> None:
    lock = DirLock(tmp_path)
    lock.acquire()
    lock.release()
    lock.release()
    with DirLock(tmp_path, wait=False):
        pass


# ---------------------------------------------------------------- leftovers of dead runs
def test_staging_of_a_dead_run_is_removed_by_the_next_writer(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys
    import warnings

    from rbtool.errors import LeftoversRemovedWarning

    target = tmp_path / "ckpt"
    code = "import os; print(os.getpid())"
    dead = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    pid = int(dead.stdout)  # that process has exited
    host = socket.gethostname()
    left = tmp_path / f".ckpt.rbtool-staging-{pid}@{host}-0123456789ab"
    left.mkdir()
    (left / "trajectory_0_x.pt").write_bytes(b"partial")
    live = tmp_path / f".ckpt.rbtool-staging-{os.getpid()}@{host}-0123456789ab"  # this run's own
    live.mkdir()
    elsewhere = tmp_path / f".ckpt.rbtool-old-{pid}@another-node-0123456789ab"  # a pid on another host
    elsewhere.mkdir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with staged_dir(target) as staging:
            (staging / "metadata.json").write_text("{}")
    assert not left.exists() and live.exists() and elsewhere.exists() and target.is_dir()
    (warning,) = [w for w in caught if issubclass(w.category, LeftoversRemovedWarning)]
    assert "removed 1 staging directory that interrupted runs left" in str(warning.message)
    assert left.name in str(warning.message)


def test_ctrl_c_right_after_the_staging_directory_is_made_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt between making the staging directory and entering the block (where
    a real SIGINT can land) still removes it."""
    made = fsutil.new_staging_dir

    def interrupted(target: Path) -> Path:
        made(target)
        raise KeyboardInterrupt

    monkeypatch.setattr(fsutil, "new_staging_dir", interrupted)
    with pytest.raises(KeyboardInterrupt), fsutil.staged_dir(tmp_path / "out"):
        pass
    assert list(tmp_path.iterdir()) == []
