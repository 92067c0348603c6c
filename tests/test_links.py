"""Links never alias silently: reflinks first, hard links with their identity, `--copy`, `--link`.

Every command that writes trajectory files from existing ones places them by a reflink where
the file system can, else a hard link (its entry records the inode's identity), else a copy;
`--copy` makes no hard link; `ingest` copies loose files unless `--link`. The reflink cases run
on a small btrfs or XFS image mounted on a loop device (root only; skipped otherwise).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FIXTURES, assert_one_error, make_traj, run, run_json, tree_digest

from rbtool.errors import FileSystemError
from rbtool.files import fsutil
from rbtool.files.dirs import checkpoint_dirs
from rbtool.files.fsutil import FICLONE, link_or_copy
from rbtool.files.index import read_index
from rbtool.files.writer import WriteReport, place_trajectory
from rbtool.ops.ingestion import ingest
from rbtool.ops.verify import verify_checkpoint

CKPT = "autosave_pt/autosave"  # five .pt trajectories
N = 5


def can_reflink(directory: Path) -> bool:
    """Whether FICLONE works inside `directory` (tried directly, not through rbtool)."""
    src, dst = directory / ".probe-src", directory / ".probe-dst"
    src.write_bytes(b"probe")
    try:
        with open(src, "rb") as fin, open(dst, "wb") as fout:
            fcntl.ioctl(fout.fileno(), FICLONE, fin.fileno())
        return True
    except OSError:
        return False
    finally:
        src.unlink(missing_ok=True)
        dst.unlink(missing_ok=True)


def inodes(directory: Path) -> set[int]:
    return {p.stat().st_ino for p in directory.rglob("*.pt")}


def placed_files(out: Path) -> list[tuple[Path, dict[str, Any]]]:
    """(file, entry) of every trajectory listed by the checkpoint(s) at `out`."""
    found = []
    for directory in checkpoint_dirs(out):
        index = read_index(directory)
        found += [(directory / index.file_name(i), index.entries[i]) for i in index.id_list]
    return found


def assert_independent(out: Path, source: Path) -> None:
    """Every file at `out` is a file of its own: another inode than any source file, no `link`."""
    files = placed_files(out)
    assert len(files) == N
    for path, entry in files:
        assert path.stat().st_ino not in inodes(source) and path.stat().st_nlink == 1, path
        assert "link" not in entry, path


def assert_linked(out: Path, source: Path) -> None:
    """Every file at `out` is a hard link of a source file, and its entry records that inode."""
    files = placed_files(out)
    assert len(files) == N
    for path, entry in files:
        st = path.stat()
        assert st.st_ino in inodes(source) and st.st_nlink > 1, path
        assert entry["link"] == {"inode": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


@pytest.fixture
def ckpt(rlinf_copy: Callable[[str], Path]) -> Path:
    return rlinf_copy(CKPT)


@pytest.fixture
def no_reflinks(tmp_path: Path) -> None:
    if can_reflink(tmp_path):
        pytest.skip(f"{tmp_path} supports reflinks, so nothing here falls back to hard links")


# ------------------------------------------------ every command that places files
# (arguments, the JSON's `files` key or None when the command prints none)
COMMANDS: dict[str, tuple[list[str], str | None]] = {
    "ingest": (["ingest", "CKPT", "--buffer", "OUT"], "files"),
    "checkpoint save (auto-save)": (["checkpoint", "save", "CKPT", "OUT", "--window", "0"], "files"),
    "checkpoint save (in-memory)": (
        ["checkpoint", "save", "CKPT", "OUT", "--window", "0", "--mode", "in-memory"],
        "files",
    ),
    "checkpoint load --buffer": (["checkpoint", "load", "CKPT", "--buffer", "OUT"], None),
    "shard": (["shard", "CKPT", "--world-size", "2", "--out", "OUT"], "files"),
    "merge": (["merge", "CKPT", "--out", "OUT"], "files"),
    "reshard": (["reshard", "CKPT", "--world-size", "3", "--out", "OUT"], "files"),
    "filter": (["filter", "CKPT", "--out", "OUT", "--min-id", "0"], "files"),
    "convert": (["convert", "CKPT", "--out", "OUT", "--format", "pt"], "files"),
    "repair": (["repair", "CKPT", "--out", "OUT"], "files"),
}


def command_args(name: str, ckpt: Path, out: Path) -> list[str]:
    return [str(ckpt) if a == "CKPT" else str(out) if a == "OUT" else a for a in COMMANDS[name][0]]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_copy_gives_files_of_their_own(ckpt: Path, tmp_path: Path, no_reflinks: None, name: str) -> None:
    before = tree_digest(ckpt)
    out = tmp_path / "out"
    doc = run_json(*command_args(name, ckpt, out), "--copy")
    assert_independent(out, ckpt)
    key = COMMANDS[name][1]
    if key is not None:
        assert doc[key]["copied"] == N and doc[key]["linked"] == doc[key]["reflinked"] == 0
    for directory in checkpoint_dirs(out):
        assert verify_checkpoint(directory).ok
    assert tree_digest(ckpt) == before
    # a write in place into a source file no longer reaches the output
    path, _ = placed_files(out)[0]
    kept = path.read_bytes()
    with open(ckpt / path.name, "r+b") as handle:
        handle.write(b"\0" * 16)
    assert path.read_bytes() == kept


@pytest.mark.parametrize("name", list(COMMANDS))
def test_checkpoint_sources_are_still_linked_by_default(
    ckpt: Path, tmp_path: Path, no_reflinks: None, name: str
) -> None:
    before = tree_digest(ckpt)
    out = tmp_path / "out"
    doc = run_json(*command_args(name, ckpt, out))
    assert_linked(out, ckpt)
    key = COMMANDS[name][1]
    if key is not None:
        assert doc[key]["linked"] == N and doc[key]["copied"] == doc[key]["reflinked"] == 0
    assert tree_digest(ckpt) == before


def doc_sections() -> dict[str, str]:
    """docs/cli.md's text under each `## rbtool X` / `### rbtool X Y` heading, by command."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    parts = re.split(r"^#{2,3} rbtool (.+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_every_command_that_places_files_has_copy() -> None:
    """The same option, from one alias, on each of them, and documented for each."""
    from typer.main import get_command

    from rbtool.cli import app

    root: Any = get_command(app)
    sections = doc_sections()
    helps = set()
    for words in {tuple(name.split(" (")[0].split()[:2]) for name in COMMANDS}:
        command = root.commands[words[0]]
        if len(words) == 2:
            command = command.commands[words[1]]
        (option,) = [p for p in command.params if "--copy" in p.opts]
        helps.add(option.help)
        assert "| `--copy` |" in sections[" ".join(words)], words
    assert len(helps) == 1  # one alias: CopyOpt


def test_load_copy_needs_buffer(ckpt: Path) -> None:
    result = run("checkpoint", "load", ckpt, "--copy")
    assert result.exit_code == 2 and result.stdout == ""
    assert "--buffer" in result.stderr


# --------------------------------------------------------------------- ingest
def loose_files(directory: Path, n: int = 3) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = directory / f"t{i}.pt"
        torch.save(make_traj(seed=i, model_weights_id=f"v{i}"), path)
        paths.append(path)
    return paths


def test_ingest_copies_loose_files_by_default(tmp_path: Path, no_reflinks: None) -> None:
    files = loose_files(tmp_path / "loose")
    doc = run_json("ingest", *files, "--buffer", tmp_path / "buf")
    assert doc["files"] == {**doc["files"], "copied": 3, "linked": 0, "reflinked": 0, "written": 0}
    index = read_index(tmp_path / "buf")
    for tid, src in zip(index.id_list, files, strict=True):
        placed = tmp_path / "buf" / index.file_name(tid)
        assert placed.stat().st_ino != src.stat().st_ino and placed.read_bytes() == src.read_bytes()
        assert "link" not in index.entries[tid] and index.entries[tid]["sha256"]
    # the writer of the loose files saves them again in place: the buffer keeps its bytes
    kept = {p.name: p.read_bytes() for p in (tmp_path / "buf").glob("trajectory_*.pt")}
    for i, src in enumerate(files):
        torch.save(make_traj(seed=100 + i), src)
    assert {p.name: p.read_bytes() for p in (tmp_path / "buf").glob("trajectory_*.pt")} == kept
    assert verify_checkpoint(tmp_path / "buf").ok


def test_ingest_of_a_folder_of_loose_files_copies_too(tmp_path: Path, no_reflinks: None) -> None:
    loose_files(tmp_path / "loose")
    doc = run_json("ingest", tmp_path / "loose", "--buffer", tmp_path / "buf")
    assert doc["files"]["copied"] == 3 and doc["files"]["linked"] == 0


def test_ingest_link_links_loose_files_and_verify_sees_a_rewrite(tmp_path: Path, no_reflinks: None) -> None:
    files = loose_files(tmp_path / "loose")
    doc = run_json("ingest", *files, "--buffer", tmp_path / "buf", "--link")
    assert doc["files"]["linked"] == 3 and doc["files"]["copied"] == 0
    index = read_index(tmp_path / "buf")
    for tid, src in zip(index.id_list, files, strict=True):
        assert (tmp_path / "buf" / index.file_name(tid)).stat().st_ino == src.stat().st_ino
        assert index.entries[tid]["link"]["inode"] == src.stat().st_ino
    assert verify_checkpoint(tmp_path / "buf").ok
    torch.save(make_traj(seed=100, t=6), files[1])  # in place, through the other name
    report = verify_checkpoint(tmp_path / "buf")
    assert not report.ok and "linked_file_changed" in {p.code for p in report.problems}


def test_ingest_link_and_copy_together_is_a_usage_error(tmp_path: Path) -> None:
    files = loose_files(tmp_path / "loose")
    before = tree_digest(tmp_path / "loose")
    result = run("ingest", *files, "--buffer", tmp_path / "buf", "--link", "--copy")
    assert_one_error(result, status=2)
    assert "--link" in result.stderr and "--copy" in result.stderr
    assert not (tmp_path / "buf").exists() and tree_digest(tmp_path / "loose") == before


def test_ingest_mixes_linked_checkpoint_files_and_copied_loose_ones(
    ckpt: Path, tmp_path: Path, no_reflinks: None
) -> None:
    files = loose_files(tmp_path / "loose", 2)
    result = ingest([files[0], ckpt, files[1]], tmp_path / "buf")
    assert (result.report.linked, result.report.copied, result.report.reflinked) == (N, 2, 0)
    index = read_index(tmp_path / "buf")
    linked = [tid for tid in index.id_list if "link" in index.entries[tid]]
    assert linked == index.id_list[1 : 1 + N]  # the checkpoint's, in their place in the order
    for how, counts in ((True, (N + 2, 0)), (False, (0, N + 2))):
        report = ingest([files[0], ckpt, files[1]], tmp_path / f"buf-{how}", link=how).report
        assert (report.linked, report.copied) == counts


def test_recursive_ingest_links_a_checkpoint_met_in_a_folder(
    ckpt: Path, tmp_path: Path, no_reflinks: None
) -> None:
    folder = tmp_path / "runs"
    loose_files(folder, 2)
    shutil.copytree(ckpt, folder / "ckpt")
    doc = run_json("ingest", folder, "--recursive", "--buffer", tmp_path / "buf")
    assert doc["files"]["linked"] == N and doc["files"]["copied"] == 2


# ---------------------------------------------------- fsutil on a file system without reflinks
def test_without_reflinks_a_hard_link_is_the_fallback(tmp_path: Path, no_reflinks: None) -> None:
    src = tmp_path / "src.pt"
    src.write_bytes(os.urandom(1 << 16))
    assert link_or_copy(src, tmp_path / "a.pt") == "link"
    assert os.path.samefile(src, tmp_path / "a.pt")
    assert link_or_copy(src, tmp_path / "b.pt", link=False) == "copy"
    assert (
        not os.path.samefile(src, tmp_path / "b.pt") and (tmp_path / "b.pt").read_bytes() == src.read_bytes()
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt", "b.pt", "src.pt"]  # no temporaries


def test_a_copy_replaces_a_hard_link_already_in_place(tmp_path: Path, no_reflinks: None) -> None:
    src, dst = tmp_path / "src.pt", tmp_path / "dst.pt"
    src.write_bytes(b"data")
    os.link(src, dst)
    assert link_or_copy(src, dst, link=False) == "copy"
    assert not os.path.samefile(src, dst) and dst.read_bytes() == b"data"


def test_a_failed_clone_falls_back_and_an_unsupported_pair_is_not_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def refuse(fd: int, request: int, arg: int) -> int:
        calls.append(request)
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(fsutil.fcntl, "ioctl", refuse)
    monkeypatch.setattr(fsutil, "_no_clone", set())
    src = tmp_path / "src.pt"
    src.write_bytes(b"data")
    assert link_or_copy(src, tmp_path / "a.pt") == "link"
    assert link_or_copy(src, tmp_path / "b.pt", link=False) == "copy"
    assert calls == [FICLONE]  # the second file was not tried: the pair cannot clone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt", "b.pt", "src.pt"]


def test_between_directories_that_cannot_clone_a_file_is_linked_straight_to_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a pair of directories refuses clones, a hard link is made at the file's own name
    (no temporary, no rename), with every case the temporary path had kept."""
    monkeypatch.setattr(fsutil, "_no_clone", set())
    made: list[str] = []
    real_link = os.link

    def recording_link(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        made.append(os.path.basename(dst))
        real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(fsutil.os, "link", recording_link)
    src_dir, out = tmp_path / "src", tmp_path / "out"
    src_dir.mkdir()
    out.mkdir()
    first, second = src_dir / "1.pt", src_dir / "2.pt"
    first.write_bytes(b"one")
    second.write_bytes(b"two")

    def refuse(fd: int, request: int, arg: int) -> int:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(fsutil.fcntl, "ioctl", refuse)
    assert link_or_copy(first, out / "1.pt") == "link"  # the first pair: tried, refused, linked
    assert made[-1].startswith(".1.pt.") and made[-1].endswith(".tmp")
    assert link_or_copy(second, out / "2.pt") == "link"
    assert made[-1] == "2.pt" and os.path.samefile(second, out / "2.pt")
    # placed already: still a link, nothing changed
    assert link_or_copy(second, out / "2.pt") == "link" and os.path.samefile(second, out / "2.pt")
    # another file at the name is replaced
    (out / "3.pt").write_bytes(b"old")
    assert link_or_copy(second, out / "3.pt") == "link"
    assert os.path.samefile(second, out / "3.pt")
    # a source that is a link is placed as its target
    (src_dir / "4.pt").symlink_to("1.pt")
    assert link_or_copy(src_dir / "4.pt", out / "4.pt") == "link"
    assert not (out / "4.pt").is_symlink() and os.path.samefile(first, out / "4.pt")
    with pytest.raises(FileSystemError, match="No such file or directory"):
        link_or_copy(src_dir / "gone.pt", out / "5.pt")
    # a link someone planted at the name is replaced, and what it points to is left alone
    elsewhere = tmp_path / "secret"
    elsewhere.write_bytes(b"keep")
    (out / "7.pt").symlink_to(elsewhere)
    assert link_or_copy(second, out / "7.pt") == "link"
    assert not (out / "7.pt").is_symlink() and os.path.samefile(second, out / "7.pt")
    assert elsewhere.read_bytes() == b"keep"
    (out / "7.pt").unlink()
    # with links refused the pair still copies, and nothing but the placed names is left
    assert link_or_copy(first, out / "6.pt", link=False) == "copy"
    assert not os.path.samefile(first, out / "6.pt")
    assert sorted(p.name for p in out.iterdir()) == ["1.pt", "2.pt", "3.pt", "4.pt", "6.pt"]


def test_a_clone_failing_for_one_file_is_tried_again_for_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def fail(fd: int, request: int, arg: int) -> int:
        calls.append(request)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(fsutil.fcntl, "ioctl", fail)
    monkeypatch.setattr(fsutil, "_no_clone", set())
    src = tmp_path / "src.pt"
    src.write_bytes(b"data")
    assert link_or_copy(src, tmp_path / "a.pt") == "link"
    assert link_or_copy(src, tmp_path / "b.pt") == "link"
    assert calls == [FICLONE, FICLONE]


# ------------------------------------------------------------------- reflinks
ROOT = os.geteuid() == 0


def _mkfs(kind: str, image: Path) -> list[str] | None:
    """The mkfs command for a reflink-capable file system of `kind`, or None if it is missing."""
    tool = shutil.which(f"mkfs.{kind}")
    if tool is None:
        return None
    if kind == "btrfs":
        return [tool, "-q", str(image)]
    return [tool, "-q", "-m", "reflink=1", str(image)]


@contextlib.contextmanager
def loop_mount(kind: str, where: Path) -> Iterator[Path | None]:
    """A fresh, sparse `kind` image mounted on a loop device at `where`; None if that fails."""
    image = where.with_suffix(".img")
    command = _mkfs(kind, image)
    if command is None:
        yield None
        return
    with open(image, "wb") as handle:
        handle.truncate((256 if kind == "btrfs" else 320) << 20)  # sparse: XFS needs >= 300 MB
    where.mkdir()
    made = subprocess.run(command, capture_output=True, check=False)
    mounted = made.returncode == 0 and (
        subprocess.run(
            ["mount", "-o", "loop", str(image), str(where)], capture_output=True, check=False
        ).returncode
        == 0
    )
    try:
        yield where if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", str(where)], capture_output=True, check=False)
        image.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def reflink_fs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A directory on a file system with reflinks: a loop-mounted btrfs, else XFS (root only)."""
    if not ROOT:
        pytest.skip("mounting a loop device needs root")
    base = tmp_path_factory.mktemp("reflink")
    for kind in ("btrfs", "xfs"):
        with loop_mount(kind, base / kind) as mounted:
            if mounted is not None and can_reflink(mounted):
                yield mounted
                return
    pytest.skip("no reflink-capable file system could be made here (mkfs.btrfs/mkfs.xfs, loop mounting)")


@pytest.fixture
def on_reflink_fs(reflink_fs: Path) -> Iterator[Path]:
    """A fresh directory on the reflink file system, with a copy of the reference checkpoint."""
    work = Path(tempfile.mkdtemp(dir=reflink_fs))
    shutil.copytree(FIXTURES / CKPT, work / "ckpt")
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_a_reflink_is_a_file_of_its_own(on_reflink_fs: Path) -> None:
    src = on_reflink_fs / "src.pt"
    src.write_bytes(os.urandom(1 << 20))
    data = src.read_bytes()
    for link in (True, False):
        dst = on_reflink_fs / f"dst-{link}.pt"
        assert link_or_copy(src, dst, link=link) == "reflink"
        assert not os.path.samefile(src, dst) and dst.read_bytes() == data
    with open(src, "r+b") as handle:  # in place
        handle.write(b"\xff" * 4096)
    assert (on_reflink_fs / "dst-True.pt").read_bytes() == data
    assert sorted(p.name for p in on_reflink_fs.iterdir()) == [
        "ckpt",
        "dst-False.pt",
        "dst-True.pt",
        "src.pt",
    ]


def test_place_trajectory_records_no_link_for_a_reflink(on_reflink_fs: Path) -> None:
    src = next((on_reflink_fs / "ckpt").glob("trajectory_0_*.pt"))
    entry: dict[str, Any] = {"file_bytes": src.stat().st_size, "link": {"inode": 1, "size": 1, "mtime_ns": 1}}
    report = WriteReport()
    place_trajectory(src, on_reflink_fs / src.name, entry, report)
    assert report == WriteReport(reflinked=1, bytes=src.stat().st_size)
    assert entry == {"file_bytes": src.stat().st_size}


@pytest.mark.parametrize("copy", [False, True])
@pytest.mark.parametrize("name", ["shard", "merge", "checkpoint save (auto-save)", "ingest"])
def test_commands_reflink_where_they_can(on_reflink_fs: Path, name: str, copy: bool) -> None:
    ckpt, out = on_reflink_fs / "ckpt", on_reflink_fs / "out"
    doc = run_json(*command_args(name, ckpt, out), *(["--copy"] if copy else []))
    assert doc["files"]["reflinked"] == N and doc["files"]["linked"] == doc["files"]["copied"] == 0
    assert_independent(out, ckpt)
    for directory in checkpoint_dirs(out):
        assert verify_checkpoint(directory).ok


def test_ingest_reflinks_loose_files_and_the_buffer_keeps_its_bytes(on_reflink_fs: Path) -> None:
    files = loose_files(on_reflink_fs / "loose")
    buffer = on_reflink_fs / "buf"
    result = run("ingest", *files, "--buffer", buffer, "--json")
    assert result.exit_code == 0, result.stderr
    files_doc = json.loads(result.stdout)["files"]
    assert files_doc["reflinked"] == 3 and files_doc["copied"] == files_doc["linked"] == 0
    kept = {p.name: p.read_bytes() for p in buffer.glob("trajectory_*.pt")}
    for i, src in enumerate(files):
        torch.save(make_traj(seed=100 + i), src)
    assert {p.name: p.read_bytes() for p in buffer.glob("trajectory_*.pt")} == kept
    assert verify_checkpoint(buffer).ok
