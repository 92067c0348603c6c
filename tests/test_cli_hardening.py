"""The command line on hostile names and shared directories (SPEC §7, "Printing").

Names come from directory listings, indexes, trajectory files and symlinks that anyone may
have written. Every command shows them with control characters escaped (`\\x1b`), at a
terminal and in a pipe, in its human output and its `Error:` lines, and never reads console
markup from them; `--json` keeps the real name (JSON escapes it itself).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import local_user, make_traj, runner, shared_area

from rbtool.cli import app

# What a terminal acts on: C0 controls but newline, DEL, C1 controls, bidi overrides/isolates.
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")

NAMES = {
    "osc-title": "\x1b]0;pwned\x07",
    "csi-clear": "\x1b[2J\x1b[H",
    "bel": "ring\x07",
    "cr": "ok\rFAKE",
    "backspace": "ab\x08\x08",
    "c1-csi": "x\x9b31m",
    "bidi": "\u202etxt.pt",
    "isolate": "a\u2066b\u2069",
    "del-tab": "d\x7f\tt",
}


def invoke(*args: str | Path, terminal: bool = False) -> tuple[int, str, str]:
    """Run the command line in-process; `terminal`: stdout and stderr treated as an 80-column
    terminal (no colour and no bar, so that any escape in the output would be one a name brought)."""
    env = {"TTY_COMPATIBLE": "1", "COLUMNS": "80"} if terminal else {"TTY_COMPATIBLE": "0"}
    argv = [str(a) for a in args] + (["--color", "never", "--no-progress"] if terminal else [])
    result = runner.invoke(app, argv, env=env)
    return result.exit_code, result.stdout, result.stderr


def assert_escaped(stdout: str, stderr: str) -> None:
    for name, stream in (("stdout", stdout), ("stderr", stderr)):
        found = RAW.search(stream)
        assert found is None, f"raw {found.group()!r} on {name}: {stream!r}"


def trajectories(directory: Path, field: str, n: int = 3) -> list[Path]:
    """n loose .pt trajectory files whose curr_obs holds a field named `field`."""
    directory.mkdir(parents=True)
    paths = []
    for i in range(n):
        traj = make_traj(t=2, b=2, seed=i, model_weights_id=f"w{i}")
        traj["curr_obs"][field] = torch.zeros(2, 2, 3)
        path = directory / f"t{i}.pt"
        torch.save(traj, path)
        paths.append(path)
    return paths


def hostile(tmp_path: Path, name: str) -> dict[str, Path]:
    """A checkpoint and a source folder whose names, field names and stray files hold `name`."""
    from rbtool.ops.ingestion import ingest

    src = tmp_path / f"src-{name}"
    trajectories(src, name)
    (src / f"notes-{name}.txt").write_text("not a trajectory")  # ingest lists it as skipped
    ckpt = tmp_path / f"ck-{name}"
    ingest(sorted(src.glob("*.pt")), ckpt)
    (ckpt / f"stray-{name}.pt").write_bytes(b"stray")  # verify names it
    return {"CK": ckpt, "SRC": src, "OUT": tmp_path / f"out-{name}"}


# Every command that reads or writes a checkpoint, over the hostile checkpoint (CK), its
# sources (SRC) and a fresh output (OUT).
COMMANDS: dict[str, list[str]] = {
    "stats": ["stats", "CK"],
    "stats-index-only": ["stats", "CK", "--index-only"],
    "verify": ["verify", "CK"],
    "verify-deep": ["verify", "--deep", "-j", "1", "CK"],
    "repair-dry-run": ["repair", "CK", "--out", "OUT", "--dry-run"],
    "diff": ["diff", "CK", "CK"],
    "merge": ["merge", "CK", "CK", "--out", "OUT", "--dry-run"],
    "shard-dry-run": ["shard", "CK", "-n", "2", "--out", "OUT", "--dry-run"],
    "checkpoint-load": ["checkpoint", "load", "CK"],
    "checkpoint-save": ["checkpoint", "save", "SRC", "OUT", "--dry-run"],
    "convert": ["convert", "CK", "--out", "OUT", "--format", "pkl", "--dry-run"],
    "ingest": ["ingest", "SRC", "-b", "OUT"],
    "sample": ["sample", "CK", "--num-chunks", "3", "--seed", "1"],
}


def argv_of(command: str, places: dict[str, Path]) -> list[str | Path]:
    return [places.get(a, a) for a in COMMANDS[command]]


@pytest.mark.parametrize("name", list(NAMES.values()), ids=list(NAMES))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_shows_hostile_names_escaped(tmp_path: Path, command: str, name: str) -> None:
    places = hostile(tmp_path, name)
    status, stdout, stderr = invoke(*argv_of(command, places))
    assert status in (0, 1), (stdout, stderr)
    assert_escaped(stdout, stderr)
    assert stdout  # a human view was printed (and escaped)


@pytest.mark.parametrize("name", ["osc-title", "c1-csi", "bidi"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_at_a_terminal_too(tmp_path: Path, command: str, name: str) -> None:
    places = hostile(tmp_path, NAMES[name])
    status, stdout, stderr = invoke(*argv_of(command, places), terminal=True)
    assert status in (0, 1), (stdout, stderr)
    assert_escaped(stdout, stderr)


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        ("stats", "curr_obs.\\x1b]0;pwned\\x07"),
        ("verify", "stray-\\x1b]0;pwned\\x07.pt"),
        ("sample", "\\x07"),
    ],
)
def test_the_escaped_name_is_what_is_shown(tmp_path: Path, command: str, shown: str) -> None:
    places = hostile(tmp_path, NAMES["osc-title"])
    status, stdout, stderr = invoke(*argv_of(command, places))
    assert status == 0, stderr
    assert shown in stdout


@pytest.mark.parametrize("command", ["stats", "verify", "sample", "checkpoint-load", "ingest"])
def test_markup_and_emoji_codes_in_a_name_print_as_they_are(tmp_path: Path, command: str) -> None:
    name = "[bold]B[red]R:smile:"
    places = hostile(tmp_path, name)
    status, stdout, stderr = invoke(*argv_of(command, places), terminal=True)
    assert status == 0, stderr
    assert name in stdout and "\U0001f604" not in stdout


@pytest.mark.parametrize("name", list(NAMES.values()), ids=list(NAMES))
def test_json_keeps_the_real_name(tmp_path: Path, name: str) -> None:
    places = hostile(tmp_path, name)
    status, stdout, _ = invoke("stats", places["CK"], "--json")
    assert status == 0
    doc = json.loads(stdout)
    assert doc["path"] == str(places["CK"])
    assert any(row["field"] == f"curr_obs.{name}" for row in doc["schema"])


# ------------------------------------------------------------------ Error: lines
def _missing(tmp_path: Path, name: str) -> list[str | Path]:
    return ["stats", tmp_path / f"gone-{name}"]


def _symlink_outside(tmp_path: Path, name: str) -> list[str | Path]:
    """A listed file that is a symlink to a file outside, whose target's path holds `name`."""
    places = hostile(tmp_path, "plain")
    outside = tmp_path / f"elsewhere-{name}"
    outside.mkdir()
    listed = next(places["CK"].glob("trajectory_1_*.pt"))
    shutil.move(listed, outside / "t.pt")
    os.symlink(outside / "t.pt", listed)
    return ["checkpoint", "load", places["CK"]]


def _weights_id_in_index(tmp_path: Path, name: str) -> list[str | Path]:
    """An index whose model_weights_id holds `name`."""
    places = hostile(tmp_path, "plain")
    index = places["CK"] / "trajectory_index.json"
    doc = json.loads(index.read_text())
    doc["trajectory_index"]["0"]["model_weights_id"] = name
    index.write_text(json.dumps(doc))
    return ["sample", places["CK"], "--num-chunks", "2"]


def _bad_source(tmp_path: Path, name: str) -> list[str | Path]:
    """A source file that is no trajectory, in a folder whose name holds `name`."""
    src = tmp_path / f"in-{name}"
    src.mkdir()
    (src / "t0.pt").write_bytes(b"not a zip")
    return ["ingest", src / "t0.pt", "-b", tmp_path / "buf"]


ERRORS = {
    "missing-path": _missing,
    "symlink-target": _symlink_outside,
    "weights-id": _weights_id_in_index,
    "bad-source": _bad_source,
}


@pytest.mark.parametrize("name", ["osc-title", "bel", "cr", "c1-csi", "bidi"])
@pytest.mark.parametrize("case", list(ERRORS))
def test_error_lines_show_names_escaped(tmp_path: Path, case: str, name: str) -> None:
    argv = ERRORS[case](tmp_path, NAMES[name])
    status, stdout, stderr = invoke(*argv)
    assert status == 1 and stdout == "", (stdout, stderr)
    assert_escaped(stdout, stderr)
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), stderr


def test_a_usage_error_quoting_a_value_is_escaped(tmp_path: Path) -> None:
    status, stdout, stderr = invoke("sample", tmp_path, "--num-chunks", "\x1b]0;pwned\x07")
    assert status == 2
    assert_escaped(stdout, stderr)
    assert "\\x1b]0;pwned\\x07" in stderr


def test_progress_descriptions_are_plain_text() -> None:
    """A progress bar names inputs: what its description column draws is escaped, never markup."""
    from rbtool.cli import _progress

    with _progress.progress_bar("fetching [bold]x\x1b]0;t\x07", 1, True) as advance:
        progress = advance._progress
        column, task = progress.columns[0], progress.tasks[0]
        assert column.render(task).plain == "fetching [bold]x\\x1b]0;t\\x07"
        advance.start(1, "reading [red]y\x9b2J")
        assert column.render(progress.tasks[0]).plain == "reading [red]y\\x9b2J"
        advance.phase(0, "\u202eevil")
        assert column.render(progress.tasks[0]).plain == "\\u202eevil"


# ------------------------------------------------------------------ shared buffers
GROUP, USER_A, USER_B = "rbtool-share", "rbtool-share-a", "rbtool-share-b"

# Runs the command line as another user: the interpreter (whose own files are root's alone)
# first runs the same command as root on a scratch copy, so that everything it imports is
# loaded, then takes the user's uid, gid, groups and umask and runs the real command.
AS_USER = """
import os, sys
from rbtool.cli import app

def run(argv):
    try:
        app(argv)
    except SystemExit as exc:
        return exc.code or 0
    return 0

uid, gid, umask, scratch, buffer, *argv = sys.argv[1:]
run([scratch if a == "@BUFFER@" else a for a in argv] + ["-q"])
os.setgroups([int(gid)])
os.setgid(int(gid))
os.setuid(int(uid))
assert os.getuid() == int(uid) and os.geteuid() == int(uid)
os.umask(int(umask, 8))
sys.exit(run([buffer if a == "@BUFFER@" else a for a in argv]))
"""


@pytest.fixture(scope="module")
def share() -> tuple[int, int, int]:
    """(uid of A, uid of B, gid of their group), made with groupadd/useradd (needs root)."""
    import grp

    a, b = local_user(USER_A, GROUP), local_user(USER_B, GROUP)
    return a, b, grp.getgrnam(GROUP).gr_gid


@pytest.fixture
def area() -> Iterator[Path]:
    """A directory under /tmp that the users can reach (pytest's tmp_path is root's alone)."""
    with shared_area("rbtool-share-", 0o755) as path:
        yield path


def ingest_as(uid: int, gid: int, umask: str, sources: Path, buffer: Path, scratch: Path) -> tuple[int, str]:
    import subprocess
    import sys

    import rbtool

    argv = [str(uid), str(gid), umask, str(scratch), str(buffer), "ingest", str(sources), "-b", "@BUFFER@"]
    done = subprocess.run(
        [sys.executable, "-c", AS_USER, *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(rbtool.__file__).parents[1])},
        timeout=300,
    )
    return done.returncode, done.stderr


def loose(directory: Path, n: int, seed: int) -> Path:
    directory.mkdir()
    for i in range(n):
        torch.save(
            make_traj(t=2, b=1, seed=seed + i, model_weights_id=f"w{seed + i}"), directory / f"t{i}.pt"
        )
    return directory


@pytest.mark.parametrize("legacy_lock", [False, True], ids=["new", "lock-from-0.2"])
@pytest.mark.parametrize("umask", ["022", "002", "027"])
def test_a_group_shares_a_setgid_buffer(
    share: tuple[int, int, int], area: Path, umask: str, legacy_lock: bool
) -> None:
    """User A ingests into a 2775 buffer of their group, then user B does: ids continue."""
    from rbtool.files.fsutil import LOCK_FILE
    from rbtool.files.index import read_index

    uid_a, uid_b, gid = share
    first, second = loose(area / "src1", 3, 0), loose(area / "src2", 2, 10)
    buffer = area / "buffer"
    buffer.mkdir()
    os.chown(buffer, uid_a, gid)
    buffer.chmod(0o2775)
    if legacy_lock:  # what rbtool 0.2 made: 0644, its creator's alone to write
        (buffer / LOCK_FILE).write_bytes(b"")
        os.chown(buffer / LOCK_FILE, uid_a, gid)
        (buffer / LOCK_FILE).chmod(0o644)
    status, stderr = ingest_as(uid_a, gid, umask, first, buffer, area / "scratch-a")
    assert status == 0, stderr
    lock = (buffer / LOCK_FILE).stat()
    assert lock.st_gid == gid
    if not legacy_lock:
        assert lock.st_mode & 0o060 == 0o060  # group-writable like the directory, whatever the umask
    status, stderr = ingest_as(uid_b, gid, umask, second, buffer, area / "scratch-b")
    assert status == 0, stderr
    index = read_index(buffer)
    assert index.id_list == [0, 1, 2, 3, 4] and index.trajectory_counter == 5


@pytest.mark.parametrize(("mode", "umask"), [(0o755, "022"), (0o2775, "077")], ids=["dir-0755", "umask-077"])
def test_a_buffer_the_group_may_not_share_is_one_error(
    share: tuple[int, int, int], area: Path, mode: int, umask: str
) -> None:
    """A directory the group cannot write, or files A's umask keeps private: B gets one error."""
    uid_a, uid_b, gid = share
    buffer = area / "buffer"
    buffer.mkdir()
    os.chown(buffer, uid_a, gid)
    buffer.chmod(mode)
    status, stderr = ingest_as(uid_a, gid, umask, loose(area / "src1", 1, 0), buffer, area / "scratch-a")
    assert status == 0, stderr
    assert (buffer / ".rbtool.lock").stat().st_mode & 0o020 == 0  # not shared: the umask's mode
    status, stderr = ingest_as(uid_b, gid, umask, loose(area / "src2", 1, 5), buffer, area / "scratch-b")
    assert status == 1
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "ermission denied" in lines[0], stderr


# ------------------------------------------------------------------ smaller defects
def test_convert_without_format_is_one_line(tmp_path: Path) -> None:
    places = hostile(tmp_path, "plain")
    status, stdout, stderr = invoke("convert", places["CK"], "--out", places["OUT"])
    assert status == 2 and stdout == ""
    assert stderr.splitlines() == ["Error: --format is required: give pt or pkl (or set RBTOOL_FORMAT)"]
    assert not places["OUT"].exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["stats", "SRC"],
        ["stats", "SRC", "--index-only"],
        ["verify", "SRC"],
        ["sample", "SRC", "--num-chunks", "2"],
        ["shard", "SRC", "-n", "2", "--out", "OUT"],
        ["checkpoint", "load", "SRC"],
    ],
    ids=["stats", "stats-index-only", "verify", "sample", "shard", "checkpoint-load"],
)
def test_a_folder_of_loose_files_is_named_with_the_command_that_ingests_it(
    tmp_path: Path, argv: list[str]
) -> None:
    src = tmp_path / "trajs"
    trajectories(src, "extra", n=5)
    status, stdout, stderr = invoke(*[{"SRC": src, "OUT": tmp_path / "out"}.get(a, a) for a in argv])
    assert status == 1 and stdout == "", (stdout, stderr)
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert "5 loose trajectory files (t0.pt, t1.pt, t2.pt, ... (5 in all))" in lines[0]
    assert f"rbtool ingest {src} --buffer DIR" in lines[0]


@pytest.mark.parametrize("k", [17, 100, 10**6])
def test_sample_says_when_k_is_more_than_the_window_holds(tmp_path: Path, k: int) -> None:
    places = hostile(tmp_path, "plain")  # 3 trajectories of 2x2: 12 samples
    argv = ["sample", places["CK"], "--num-chunks", "4", "--strategy", "topk", "--k", str(k), "--seed", "1"]
    status, stdout, stderr = invoke(*argv, "--json")
    assert status == 0, stderr
    doc = json.loads(stdout)
    assert doc["k"] == k and doc["k_used"] == 12
    assert stderr == f"--k {k} is more than the window's 12 samples: top-k draws among all 12 (k 12)\n"
    status, _, stderr = invoke("sample", places["CK"], "--num-chunks", "4", "--strategy", "topk", "--k", "12")
    assert status == 0 and "--k" not in stderr  # a K the window holds: nothing to say


@pytest.mark.parametrize(
    ("flags", "loose_linked", "checkpoint_linked"),
    [([], False, True), (["--link"], True, True), (["--copy"], False, False)],
    ids=["default", "link", "copy"],
)
def test_an_in_memory_save_places_files_as_ingest_does(
    tmp_path: Path, flags: list[str], loose_linked: bool, checkpoint_linked: bool
) -> None:
    """Loose files are copied (a write in place to the source must not change the save) unless
    --link; a checkpoint's files are linked unless --copy."""
    places = hostile(tmp_path, "plain")
    loose_file = places["SRC"] / "t0.pt"
    out = tmp_path / "saved"
    status, _, stderr = invoke(
        "checkpoint", "save", places["CK"], loose_file, out, "--mode", "in-memory", "--window", "0", *flags
    )
    assert status == 0, stderr
    saved = sorted(out.glob("trajectory_*.pt"), key=lambda p: int(p.name.split("_")[1]))
    sources = [*sorted(places["CK"].glob("trajectory_*.pt")), loose_file]
    assert len(saved) == 4
    for i, (source, copy) in enumerate(zip(sources, saved, strict=True)):
        linked = loose_linked if i == 3 else checkpoint_linked
        assert os.path.samefile(source, copy) == linked, (i, flags)
    original = saved[3].read_bytes()
    loose_file.write_bytes(b"rewritten in place")  # the writer of a loose file writes it again
    assert (saved[3].read_bytes() == original) != loose_linked


def test_an_in_memory_save_refuses_link_with_copy(tmp_path: Path) -> None:
    places = hostile(tmp_path, "plain")
    status, stdout, stderr = invoke("checkpoint", "save", places["SRC"], tmp_path / "o", "--link", "--copy")
    assert status == 2 and stdout == "" and len(stderr.splitlines()) == 1
