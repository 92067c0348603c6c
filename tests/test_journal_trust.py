"""A journal never turns damage into OK (rbtool.passes.journal, SPEC §7).

A journaled result is bound to its file's content: size, mtime, inode, device and ctime (which
no user can set back), and, where the index records a sha256, the hash the pass computed when
it journaled the file. A journal directory or file that another user owns or that group or
others can write, a journal file that is a symbolic link or not a regular file, is refused.

Every tampering case runs a pass with a journal over intact files, damages one of them so
that size and mtime stay the recorded ones, reruns with the journal and requires the report
a fresh run (no journal) gives over the damaged files, with every other file taken from the
journal. The attacker of the trust cases is a real second local user (`rbtool-other`, made
with useradd; those tests are skipped when not running as root).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from conftest import OTHER_USER, as_other, assert_one_error, local_user, make_traj, run, shared_area

from rbtool.passes import ranks
from rbtool.passes.journal import file_identity

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
LOSE_RANK = Path(__file__).with_name("lose_rank.py")  # rbtool, with one rank lost mid-pass
OTHER = OTHER_USER
FILES = 6
DAMAGED = 2  # the position (in id order) of the file the tampering cases damage
UNTIMED = ("seconds", "bytes_per_second", "jobs", "journal")


# ------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def hashed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint rbtool wrote: its entries record file_bytes and sha256."""
    from rbtool import TrajectoryReplayBuffer

    path = tmp_path_factory.mktemp("hashed") / "ckpt"
    buf = TrajectoryReplayBuffer(seed=3, sample_window_size=0)
    buf.add_trajectories([make_traj(t=24, b=2, seed=i, image=6) for i in range(FILES)])
    buf.save_checkpoint(path)
    buf.close()
    return path


@pytest.fixture(scope="module")
def unhashed(hashed: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same checkpoint as another writer (RLinf) leaves it: no sha256 in its entries."""
    path = tmp_path_factory.mktemp("unhashed") / "ckpt"
    shutil.copytree(hashed, path)
    index = path / "trajectory_index.json"
    doc = json.loads(index.read_text())
    for entry in doc["trajectory_index"].values():
        entry.pop("sha256", None)
    index.write_text(json.dumps(doc))
    return path


def copy_of(source: Path, where: Path) -> Path:
    target = where / "ckpt"
    shutil.copytree(source, target)
    return target


def trajectory_files(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("trajectory_*_*.p*"), key=lambda p: int(p.name.split("_")[1]))


def garbled(data: bytes) -> bytes:
    """`data` with its first 4 KiB overwritten (a .pt no longer loads), the same size."""
    return bytes(b ^ 0x5A for b in data[:4096]) + data[4096:]


# ------------------------------------------------------------------ ways to damage a file
def in_place(path: Path) -> None:
    """A 4 KiB rewrite in place, the mtime set back: same size, mtime, inode."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.write(garbled(path.read_bytes())[:4096])
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def truncate_regrow(path: Path) -> None:
    """Truncated to nothing and written again to the same size, the mtime set back."""
    st, data = path.stat(), path.read_bytes()
    with open(path, "r+b") as f:
        f.truncate(0)
        f.write(garbled(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def replaced(path: Path) -> None:
    """Removed and made again under the same name, size and mtime (often on the same inode)."""
    st, data = path.stat(), path.read_bytes()
    path.unlink()
    path.write_bytes(garbled(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def link_swap(path: Path) -> None:
    """A damaged copy elsewhere, given the same mtime, hard-linked over the name."""
    st, data = path.stat(), path.read_bytes()
    elsewhere = path.parent.parent / f"elsewhere-{path.name}"
    elsewhere.write_bytes(garbled(data))
    os.utime(elsewhere, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.link(elsewhere, path.with_name(".swap"))
    os.replace(path.with_name(".swap"), path)


def chmod_only(path: Path) -> None:
    """No damage: a chmod moves the ctime, so the file is read again (and found intact)."""
    path.chmod(0o600)


TAMPERING: dict[str, Callable[[Path], None]] = {
    "in_place": in_place,
    "truncate_regrow": truncate_regrow,
    "replaced": replaced,
    "link_swap": link_swap,
    "chmod_only": chmod_only,
}


# ------------------------------------------------------------------ the passes
class Outcome:
    """A run's exit status and --json document with what differs between runs left out."""

    def __init__(self, args: list[Any]) -> None:
        result = run(*args, "--json")
        self.exit_code, self.stderr = result.exit_code, result.stderr
        self.doc: dict[str, Any] | None = json.loads(result.stdout) if result.stdout.strip() else None
        self.journal = None if self.doc is None else self.doc.get("journal")
        if self.doc is not None:
            for part in (self.doc, self.doc.get("data") or {}):
                for key in UNTIMED:
                    part.pop(key, None)

    def same_as(self, other: Outcome) -> bool:
        return (self.exit_code, self.doc, self.stderr) == (other.exit_code, other.doc, other.stderr)


def verify_pass(ckpt: Path, journal: Path | None) -> Outcome:
    return Outcome(["verify", ckpt, "--deep", "--jobs", "1", *journaled(journal)])


def stats_pass(ckpt: Path, journal: Path | None) -> Outcome:
    return Outcome(["stats", ckpt, "--jobs", "1", *journaled(journal)])


def journaled(journal: Path | None) -> list[Any]:
    return [] if journal is None else ["--journal", journal]


def first_run(name: str, ckpt: Path, journal: Path) -> None:
    """The journaled run over intact files (convert: one stopped after every file but the last,
    since a finished convert publishes its staging directory and has nothing left to resume)."""
    if name == "convert":
        env = {k: v for k, v in os.environ.items() if k not in ranks.TORCHRUN_VARS}
        env |= {"PYTHONPATH": str(ROOT), "LOSE_RANK": "0", "LOSE_AFTER": str(FILES - 1)}
        argv = [sys.executable, LOSE_RANK, *rerun_args("convert", ckpt, journal)]
        done = subprocess.run([str(a) for a in argv], env=env, timeout=120)
        assert done.returncode == 17  # left as a lost process would, FILES - 1 files journaled
        return
    outcome = PASSES[name](ckpt, journal)
    assert outcome.exit_code == 0, outcome.stderr
    assert outcome.journal == {"reused": 0, "files": FILES}


def convert_pass(ckpt: Path, journal: Path | None) -> Outcome:
    out = ckpt.parent / ("out" if journal is not None else "fresh")
    outcome = Outcome(["convert", ckpt, "--out", out, "--format", "pkl", "--jobs", "1", *journaled(journal)])
    if outcome.doc is not None:
        outcome.doc.pop("out")
        for c in outcome.doc["checkpoints"]:
            c.pop("path")
    if out.exists():  # what was written holds the source's content now, file by file
        same = run("diff", ckpt, out, "--deep")
        outcome.doc = {**(outcome.doc or {}), "same_content": same.exit_code == 0}
        assert same.exit_code == 0, same.stdout
        shutil.rmtree(out)
    return outcome


PASSES: dict[str, Callable[[Path, Path | None], Outcome]] = {
    "verify": verify_pass,
    "stats": stats_pass,
    "convert": convert_pass,
}


# ------------------------------------------------------------------ tampering, one process
@pytest.mark.parametrize("recorded", ["hashed", "unhashed"])
@pytest.mark.parametrize("pass_name", list(PASSES))
@pytest.mark.parametrize("kind", list(TAMPERING))
def test_a_file_changed_since_it_was_journaled_is_read_again(
    kind: str, pass_name: str, recorded: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    ckpt = copy_of(request.getfixturevalue(recorded), tmp_path)
    journal = tmp_path / "journal"
    first_run(pass_name, ckpt, journal)
    TAMPERING[kind](trajectory_files(ckpt)[DAMAGED])
    again = PASSES[pass_name](ckpt, journal)
    fresh = PASSES[pass_name](ckpt, None)
    assert again.same_as(fresh), (again.stderr, fresh.stderr)
    if kind != "chmod_only":  # damage: what the fresh run says is a failure
        assert fresh.exit_code == 1
    if again.exit_code == 0:  # the report says what came from the journal: all but the changed file
        expected = FILES - 1 if pass_name != "convert" else FILES - 2  # convert: its last file was never done
        assert again.journal == {"reused": expected, "files": FILES}


@pytest.mark.parametrize("pass_name", ["verify", "stats"])
def test_an_unchanged_checkpoint_is_taken_whole_from_the_journal(
    pass_name: str, hashed: Path, tmp_path: Path
) -> None:
    ckpt = copy_of(hashed, tmp_path)
    first_run(pass_name, ckpt, tmp_path / "journal")
    again = PASSES[pass_name](ckpt, tmp_path / "journal")
    assert again.exit_code == 0 and again.journal == {"reused": FILES, "files": FILES}
    assert again.same_as(PASSES[pass_name](ckpt, None))
    deep = ["--deep"] if pass_name == "verify" else []
    human = run(pass_name, ckpt, *deep, "--journal", tmp_path / "journal")
    assert f"{FILES} of {FILES} files from the journal" in human.stdout
    plain = run(pass_name, ckpt, *deep, "--jobs", "1")
    assert "from the journal" not in plain.stdout  # the line is printed only with a journal


# ------------------------------------------------------------------ forged lines
def journal_rows(journal: Path) -> tuple[Path, bytes, list[dict[str, Any]]]:
    [path] = journal.glob("*.jsonl")
    head, *lines = path.read_bytes().splitlines()
    return path, head, [orjson.loads(line) for line in lines]


def write_rows(path: Path, head: bytes, rows: list[dict[str, Any]]) -> None:
    path.write_bytes(b"\n".join([head, *(orjson.dumps(r) for r in rows)]) + b"\n")


def forge(journal: Path, target: Path, how: Callable[[list[Any]], list[Any]]) -> None:
    """Rewrite the identity of `target`'s line (its result, OK, kept) with `how(identity now)`."""
    path, head, rows = journal_rows(journal)
    now = file_identity(target)
    assert now is not None
    for row in rows:
        if row["key"].startswith(f"{os.path.abspath(target)}#"):
            row["identity"] = [how([*now, row["identity"][0][-1]])]
    write_rows(path, head, rows)


FORGERIES: dict[str, Callable[[list[Any]], list[Any]]] = {
    # an entry that never hashed the file (the pass of another version, or a hand-made line)
    "hash_not_checked": lambda ident: [*ident[:5], None],
    "hash_of_other_bytes": lambda ident: [*ident[:5], "0" * 64],
    "old_ctime": lambda ident: [ident[0], ident[1], ident[2], ident[3] - 1, ident[4], ident[5]],
    "other_device": lambda ident: [*ident[:4], ident[4] + 1, ident[5]],
    "other_inode": lambda ident: [ident[0], ident[1], ident[2] + 1, *ident[3:]],
    "identity_without_ctime": lambda ident: ident[:3],
}


@pytest.mark.parametrize("pass_name", ["verify", "stats"])
@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_a_line_claiming_a_result_for_another_identity_is_ignored(
    forgery: str, pass_name: str, hashed: Path, tmp_path: Path
) -> None:
    ckpt = copy_of(hashed, tmp_path)
    journal = tmp_path / "journal"
    first_run(pass_name, ckpt, journal)
    target = trajectory_files(ckpt)[DAMAGED]
    in_place(target)
    forge(journal, target, FORGERIES[forgery])
    again = PASSES[pass_name](ckpt, journal)
    assert again.exit_code == 1 and again.same_as(PASSES[pass_name](ckpt, None))


def test_a_journal_of_an_older_version_is_ignored(hashed: Path, tmp_path: Path) -> None:
    ckpt = copy_of(hashed, tmp_path)
    journal = tmp_path / "journal"
    first_run("verify", ckpt, journal)
    path, head, rows = journal_rows(journal)
    old = orjson.loads(head) | {"rbtool_journal": 1}
    write_rows(path, orjson.dumps(old), [r | {"identity": [i[:3] for i in r["identity"]]} for r in rows])
    in_place(trajectory_files(ckpt)[DAMAGED])
    again = verify_pass(ckpt, journal)
    assert again.exit_code == 1 and again.same_as(verify_pass(ckpt, None))


# ------------------------------------------------------------------ the journal's own files
@pytest.mark.parametrize("pass_name", list(PASSES))
def test_the_journal_is_made_private(pass_name: str, hashed: Path, tmp_path: Path) -> None:
    ckpt = copy_of(hashed, tmp_path)
    journal = tmp_path / "deeper" / "journal"
    old = os.umask(0)  # a permissive umask changes nothing
    try:
        first_run(pass_name, ckpt, journal)
    finally:
        os.umask(old)
    assert stat.S_IMODE(journal.stat().st_mode) == 0o700
    assert stat.S_IMODE(journal.parent.stat().st_mode) == 0o700  # made here too
    files = list(journal.glob("*.jsonl"))
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)


def planted_journal(pass_name: str, ckpt: Path, journal: Path) -> None:
    """A journal over the intact checkpoint, then the damage, and its line forged to match."""
    first_run(pass_name, ckpt, journal)
    target = trajectory_files(ckpt)[DAMAGED]
    in_place(target)
    forge(journal, target, lambda ident: [*ident[:5], ident[5]])  # the damaged file's identity now


def refused(result: Any, directory: Path) -> None:
    assert_one_error(result)
    assert str(directory) in result.stderr


@pytest.mark.parametrize("pass_name", list(PASSES))
@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777, 0o1777])
def test_a_journal_directory_others_can_write_is_refused(
    mode: int, pass_name: str, hashed: Path, tmp_path: Path
) -> None:
    ckpt = copy_of(hashed, tmp_path)
    journal = tmp_path / "journal"
    planted_journal(pass_name, ckpt, journal)
    journal.chmod(mode)
    result = run(*rerun_args(pass_name, ckpt, journal))
    refused(result, journal)
    assert "written by group or others" in result.stderr


def rerun_args(pass_name: str, ckpt: Path, journal: Path) -> list[Any]:
    extra = {"verify": ["--deep"], "stats": [], "convert": ["--out", ckpt.parent / "out", "--format", "pkl"]}
    return [pass_name, ckpt, *extra[pass_name], "--jobs", "1", "--journal", journal]


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666])
def test_a_journal_file_others_can_write_is_refused(mode: int, hashed: Path, tmp_path: Path) -> None:
    ckpt = copy_of(hashed, tmp_path)
    journal = tmp_path / "journal"
    planted_journal("verify", ckpt, journal)
    next(journal.glob("*.jsonl")).chmod(mode)
    refused(run(*rerun_args("verify", ckpt, journal)), journal)


def as_symlink(journal: Path) -> None:
    path = next(journal.glob("*.jsonl"))
    private = journal.parent / "private.jsonl"
    path.rename(private)
    path.symlink_to(private)


def as_directory(journal: Path) -> None:
    (journal / "0-1-dir.jsonl").mkdir()


def as_fifo(journal: Path) -> None:
    os.mkfifo(journal / "0-1-fifo.jsonl", 0o600)


@pytest.mark.parametrize("pass_name", ["verify", "stats"])
@pytest.mark.parametrize("plant", [as_symlink, as_directory, as_fifo], ids=["symlink", "directory", "fifo"])
def test_a_journal_file_that_is_no_regular_file_is_refused(
    plant: Callable[[Path], None], pass_name: str, hashed: Path, tmp_path: Path
) -> None:
    ckpt = copy_of(hashed, tmp_path)
    journal = tmp_path / "journal"
    planted_journal(pass_name, ckpt, journal)
    plant(journal)
    result = run(*rerun_args(pass_name, ckpt, journal))
    refused(result, journal)
    assert "symbolic link" in result.stderr or "not a regular file" in result.stderr


# ------------------------------------------------------------------ another user
@pytest.fixture(scope="session")
def other() -> int:
    """The uid of a second local user, made with useradd if it is not there yet (needs root)."""
    return local_user(OTHER)


@pytest.fixture
def area() -> Iterator[Path]:
    """A directory under /tmp the other user can write in (pytest's tmp_path is root's alone)."""
    with shared_area("rbtool-journal-", 0o1777) as path:
        yield path


def forged_copy(pass_name: str, hashed: Path, area: Path) -> tuple[Path, Path]:
    """A victim's checkpoint with one damaged file, and a forged journal (claiming it OK) in a
    place of the victim's own that the other user reads."""
    ckpt = copy_of(hashed, area)
    forged = area / "forged"
    planted_journal(pass_name, ckpt, forged)
    forged.chmod(0o755)
    for p in forged.iterdir():
        p.chmod(0o644)
    return ckpt, forged


@pytest.mark.parametrize("pass_name", list(PASSES))
def test_a_journal_directory_another_user_planted_is_refused(
    pass_name: str, other: int, hashed: Path, area: Path
) -> None:
    ckpt, forged = forged_copy(pass_name, hashed, area)
    planted = area / "journal"  # where the victim will point --journal: the other user made it first
    as_other("cp", "-r", forged, planted)
    assert planted.stat().st_uid == other
    result = run(*rerun_args(pass_name, ckpt, planted))
    refused(result, planted)
    assert "belongs to another user" in result.stderr


def test_a_journal_file_another_user_planted_in_a_shared_directory_is_refused(
    other: int, hashed: Path, area: Path
) -> None:
    ckpt, forged = forged_copy("verify", hashed, area)
    shared = area / "journal"
    shared.mkdir(mode=0o700)
    shared.chmod(0o777)  # the victim's own directory, writable by everyone
    as_other("cp", next(forged.glob("*.jsonl")), shared / "0-1-planted.jsonl")
    result = run(*rerun_args("verify", ckpt, shared))
    refused(result, shared)


def test_a_journal_file_of_another_user_in_a_private_directory_is_refused(
    other: int, hashed: Path, area: Path
) -> None:
    ckpt, forged = forged_copy("stats", hashed, area)
    mine = area / "journal"
    mine.mkdir(mode=0o700)
    planted = mine / "0-1-planted.jsonl"
    as_other("cp", next(forged.glob("*.jsonl")), area / "theirs.jsonl")
    shutil.move(area / "theirs.jsonl", planted)  # moved in (root may), still the other user's
    assert planted.stat().st_uid == other
    result = run(*rerun_args("stats", ckpt, mine))
    refused(result, mine)
    assert "belongs to another user" in result.stderr


def test_a_journal_link_to_another_users_directory_is_refused(other: int, hashed: Path, area: Path) -> None:
    ckpt, forged = forged_copy("verify", hashed, area)
    theirs = area / "theirs"
    as_other("cp", "-r", forged, theirs)
    link = area / "journal"
    as_other("ln", "-s", theirs, link)
    result = run(*rerun_args("verify", ckpt, link))
    refused(result, link)


def stats_process(ckpt: Path, journal: Path) -> dict[str, Any]:
    """`rbtool stats CKPT --journal DIR --json` in a process of its own (its own journal file)."""
    argv = [
        sys.executable,
        "-m",
        "rbtool",
        "stats",
        str(ckpt),
        "--jobs",
        "1",
        "--journal",
        str(journal),
        "--json",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_newer_result_counts_whichever_journal_file_holds_it(unhashed: Path, tmp_path: Path) -> None:
    """A file read again by a later process has two results, in two journal files; the one whose
    identity is the file's now counts, even when the older one's journal file is read last (the
    files are named by rank and process id, so their order is the pids' order)."""
    ckpt, journal = copy_of(unhashed, tmp_path), tmp_path / "journal"
    assert stats_process(ckpt, journal)["journal"] == {"reused": 0, "files": FILES}
    [older] = journal.glob("*.jsonl")
    chmod_only(trajectory_files(ckpt)[0])
    assert stats_process(ckpt, journal)["journal"] == {"reused": FILES - 1, "files": FILES}
    older.rename(journal / "0-99999999999-last.jsonl")  # the older results are now read last
    assert len(list(journal.glob("*.jsonl"))) == 2
    assert stats_process(ckpt, journal)["journal"] == {"reused": FILES, "files": FILES}


# ------------------------------------------------------------------ torchrun
needs_torchrun = pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed")


def torchrun(*args: str | Path) -> subprocess.CompletedProcess[str]:
    argv = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", "-m", "rbtool", *map(str, args)]
    env = {k: v for k, v in os.environ.items() if k not in ranks.TORCHRUN_VARS}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=240)


@needs_torchrun
def test_verify_over_two_ranks_sees_a_rewrite_in_place_after_a_journaled_run(
    hashed: Path, tmp_path: Path
) -> None:
    ckpt, journal = copy_of(hashed, tmp_path), tmp_path / "journal"
    first = torchrun("verify", ckpt, "--deep", "--journal", journal, "--json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["journal"] == {"reused": 0, "files": FILES}
    assert len(list(journal.glob("*.jsonl"))) == 2  # one per rank
    in_place(trajectory_files(ckpt)[DAMAGED])
    again = torchrun("verify", ckpt, "--deep", "--journal", journal, "--json")
    assert again.returncode == 1
    doc = json.loads(again.stdout)
    assert doc["journal"] == {"reused": FILES - 1, "files": FILES}
    codes = [p["code"] for c in doc["checkpoints"] for p in c["problems"]]
    assert codes and set(codes) <= {"file_unreadable", "hash_mismatch"}


@needs_torchrun
def test_stats_over_two_ranks_rereads_a_file_truncated_and_regrown_after_a_journaled_run(
    unhashed: Path, tmp_path: Path
) -> None:
    ckpt, journal = copy_of(unhashed, tmp_path), tmp_path / "journal"
    first = stats_pass(ckpt, journal)  # one process; the rerun on two ranks takes its journal
    assert first.exit_code == 0 and first.journal == {"reused": 0, "files": FILES}
    target = trajectory_files(ckpt)[DAMAGED]
    chmod_only(trajectory_files(ckpt)[0])  # intact, but its ctime moved: read again
    truncate_regrow(target)
    again = torchrun("stats", ckpt, "--journal", journal)
    assert again.returncode == 1 and again.stdout == ""
    lines = again.stderr.strip().splitlines()
    assert any(line.startswith("Error: ") and target.name in line for line in lines), again.stderr
    target.write_bytes(garbled(target.read_bytes()))  # the original bytes back: a good file again
    good = torchrun("stats", ckpt, "--journal", journal)
    assert good.returncode == 0, good.stderr
    # only the regrown file is read again: the chmodded one was journaled anew by the failed run
    assert f"{FILES - 1} of {FILES} files from the journal" in good.stdout
