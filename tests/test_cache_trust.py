"""The local cache of remote checkpoints belongs to its user (SPEC §7, "Object storage").

A cache directory another user owns, or that group or others can write (or an ancestor of it
that others could swap), is refused unless RBTOOL_CACHE_SHARED=1 says it is shared (then it
must be sticky, or a setgid group directory, and this user's entries live in a private
`user-<uid>` directory inside it). Nothing in the cache is followed through a symbolic link,
and a cached object is reused only when its sha256 is the one the remote completion marker
records, whatever `.rbtool-mirror.json` claims.

The attacker is a real second local user (`rbtool-other`, made with useradd; the tests that
need it are skipped when not running as root); the victim's canary files must never be
deleted or changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FIXTURES, OTHER_USER, as_other, assert_one_error, local_user, run, run_json, shared_area

from rbtool import remote

OTHER = OTHER_USER
SOURCE = FIXTURES / "autosave_pt" / "autosave"
CANARY = b"the victim's own file\n"


# ------------------------------------------------------------------ the second user, the victim
@pytest.fixture(scope="session")
def other() -> int:
    """The uid of a second local user, made with useradd if it is not there yet (needs root)."""
    return local_user(OTHER)


@pytest.fixture
def area() -> Iterator[Path]:
    """A directory under /tmp that the other user can reach (pytest's tmp_path is root's alone)."""
    with shared_area("rbtool-trust-", 0o755) as path:
        yield path


@pytest.fixture
def victim(area: Path) -> Path:
    """The victim's own files, which the attacker points links at: `canary`, `ckpt/canary`."""
    home = area / "victim"
    (home / "ckpt").mkdir(parents=True)
    (home / "canary").write_bytes(CANARY)
    (home / "ckpt" / "canary").write_bytes(CANARY)
    return home


def untouched(home: Path) -> dict[str, bytes]:
    """Every file under the victim's directory and its bytes (links not followed)."""
    return {
        str(p.relative_to(home)): p.read_bytes()
        for p in sorted(home.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


VICTIM_FILES = {"canary": CANARY, "ckpt/canary": CANARY}


# ------------------------------------------------------------------ the checkpoints
@pytest.fixture(scope="module")
def uploaded(s3_server: str) -> str:
    """One checkpoint uploaded by rbtool to the server, read (never changed) by the tests."""
    url = f"s3://rbtool-tests/cache-trust-{hashlib.sha256(s3_server.encode()).hexdigest()[:8]}/ckpt"
    try:
        remote.inspect(url)
    except Exception:
        run_json("checkpoint", "save", SOURCE, url, "--window", "0")
    return url


def mirror_name(url: str) -> str:
    """The cache entry of `url`'s data mirror (its name is public: a hash of the URL)."""
    return "mirror-" + hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:24]


# the commands that use the cache; OUT is replaced by a fresh output path
COMMANDS: dict[str, list[str]] = {
    "verify-deep": ["verify", "URL", "--deep"],
    "stats": ["stats", "URL"],
    "sample": ["sample", "URL", "--num-chunks", "3", "--seed", "1"],
    "load-buffer": ["checkpoint", "load", "URL", "--buffer", "OUT"],
    "convert": ["convert", "URL", "--out", "OUT", "--format", "pkl"],
    "shard": ["shard", "URL", "-n", "2", "--out", "OUT"],
}
DATA_COMMANDS = [name for name in COMMANDS if name != "sample"]  # those that keep a data mirror


def command(name: str, url: str, out: Path) -> list[str]:
    return [url if a == "URL" else str(out) if a == "OUT" else a for a in COMMANDS[name]]


@pytest.fixture
def cache_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("RBTOOL_CACHE_SHARED", raising=False)
    return monkeypatch


# ------------------------------------------------------------------ the attack, as it was
PLANTS = ["entry-ckpt-symlink", "entry-symlink", "locks-symlink", "state-symlink", "reserved-symlink"]


def plant_as_other(kind: str, cache: Path, url: str, victim: Path) -> None:
    """What another user plants in a cache directory they can write, before the victim reads `url`."""
    entry = cache / mirror_name(url)
    if kind == "entry-symlink":
        as_other("ln", "-s", victim, entry)
    elif kind == "locks-symlink":
        as_other("ln", "-s", victim, cache / ".locks")
    else:
        as_other("mkdir", "-m", "777", entry)
        target = {
            "entry-ckpt-symlink": (victim, entry / "ckpt"),
            "state-symlink": (victim / "canary", entry / ".rbtool-mirror.json"),
            "reserved-symlink": (victim / "canary", entry / ".rbtool-reserved"),
        }[kind]
        as_other("ln", "-s", *target)


@pytest.mark.parametrize("cmd", list(COMMANDS))
@pytest.mark.parametrize("kind", PLANTS)
def test_a_cache_others_can_write_is_refused_and_their_links_never_followed(
    kind: str, cmd: str, other: int, area: Path, victim: Path, uploaded: str, cache_env: pytest.MonkeyPatch
) -> None:
    """A world-writable (sticky) cache, as a /tmp cache is: another user plants links to the
    victim's files where the victim's entries and locks will be. Before, `verify --deep`
    deleted the victim's files through them, and lock and state files were written there."""
    cache = area / "cache"
    cache.mkdir()
    cache.chmod(0o1777)
    cache_env.setenv("RBTOOL_CACHE_DIR", str(cache))
    plant_as_other(kind, cache, uploaded, victim)
    result = run(*command(cmd, uploaded, area / "out"))
    assert untouched(victim) == VICTIM_FILES
    assert_one_error(result)
    assert f"{cache}:" in result.stderr and "writable by others" in result.stderr


# ------------------------------------------------------------------ the cache directory itself
def _owned_by_other(area: Path, other: int, env: pytest.MonkeyPatch) -> tuple[Path, str]:
    cache = area / "cache"
    cache.mkdir(mode=0o700)
    os.chown(cache, other, -1)
    return cache, f"{cache}: the rbtool cache directory is owned by uid {other}"


def _group_writable(area: Path, other: int, env: pytest.MonkeyPatch) -> tuple[Path, str]:
    cache = area / "cache"
    cache.mkdir()
    cache.chmod(0o770)
    return cache, f"{cache}: the rbtool cache directory is writable by its group"


def _world_writable(area: Path, other: int, env: pytest.MonkeyPatch) -> tuple[Path, str]:
    cache = area / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    return cache, f"{cache}: the rbtool cache directory is writable by others"


def _ancestor_of_other(area: Path, other: int, env: pytest.MonkeyPatch) -> tuple[Path, str]:
    parent = area / "theirs"
    parent.mkdir(mode=0o755)
    (parent / "cache").mkdir(mode=0o700)  # the victim's own, in a directory the other user can rename it in
    os.chown(parent, other, -1)
    return (
        parent / "cache",
        f"{parent}: an ancestor of the rbtool cache {parent / 'cache'} is owned by uid {other}",
    )


def _ancestor_of_other_cache_missing(area: Path, other: int, env: pytest.MonkeyPatch) -> tuple[Path, str]:
    parent = area / "theirs"
    parent.mkdir(mode=0o755)
    os.chown(parent, other, -1)
    return (
        parent / "a" / "cache",
        f"{parent}: an ancestor of the rbtool cache {parent}/a/cache is owned by uid",
    )


def _ancestor_world_writable(area: Path, other: int, env: pytest.MonkeyPatch) -> tuple[Path, str]:
    parent = area / "open"
    parent.mkdir()
    parent.chmod(0o777)  # not sticky: anyone can rename the cache away and put theirs in its place
    (parent / "cache").mkdir(mode=0o700)
    return (
        parent / "cache",
        f"{parent}: an ancestor of the rbtool cache {parent / 'cache'} is writable by others",
    )


def _ancestor_group_writable(area: Path, other: int, env: pytest.MonkeyPatch) -> tuple[Path, str]:
    parent = area / "team"
    parent.mkdir()
    parent.chmod(0o775)
    return (
        parent / "cache",
        f"{parent}: an ancestor of the rbtool cache {parent / 'cache'} is writable by its group",
    )


def _symlinked_root(area: Path, other: int, env: pytest.MonkeyPatch) -> tuple[Path, str]:
    private = area / "private"
    private.mkdir(mode=0o700)
    (area / "cache").symlink_to(private)
    return area / "cache", f"{area / 'cache'}: the rbtool cache directory is a symbolic link"


def _symlinked_root_of_other(area: Path, other: int, env: pytest.MonkeyPatch) -> tuple[Path, str]:
    sticky = area / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    as_other("ln", "-s", area / "victim", sticky / "cache")  # where the victim will point RBTOOL_CACHE_DIR
    return sticky / "cache", f"{sticky / 'cache'}: the rbtool cache directory is a symbolic link"


def _ancestor_link_of_other(area: Path, other: int, env: pytest.MonkeyPatch) -> tuple[Path, str]:
    sticky = area / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    private = area / "private"
    (private / "cache").mkdir(parents=True, mode=0o700)
    as_other("ln", "-s", private, sticky / "link")
    return sticky / "link" / "cache", f"{sticky / 'link'}: an ancestor of the rbtool cache"


def _default_under_other(area: Path, other: int, env: pytest.MonkeyPatch) -> tuple[None, str]:
    home = area / "home"
    (home / ".cache").mkdir(parents=True, mode=0o755)
    os.chown(home / ".cache", other, -1)
    env.setenv("HOME", str(home))
    return (
        None,
        f"{home / '.cache'}: an ancestor of the rbtool cache {home}/.cache/rbtool/remote is owned by uid",
    )


def _a_file(area: Path, other: int, env: pytest.MonkeyPatch) -> tuple[Path, str]:
    (area / "cache").write_bytes(b"")
    return area / "cache", f"{area / 'cache'}: the rbtool cache directory is not a directory"


UNTRUSTED = {
    "owned-by-other": _owned_by_other,
    "group-writable": _group_writable,
    "world-writable": _world_writable,
    "ancestor-of-other": _ancestor_of_other,
    "ancestor-of-other-cache-missing": _ancestor_of_other_cache_missing,
    "ancestor-world-writable": _ancestor_world_writable,
    "ancestor-group-writable": _ancestor_group_writable,
    "symlinked-root": _symlinked_root,
    "symlinked-root-of-other": _symlinked_root_of_other,
    "ancestor-link-of-other": _ancestor_link_of_other,
    "default-under-other": _default_under_other,
    "a-file": _a_file,
}


@pytest.mark.parametrize("cmd", list(COMMANDS))
@pytest.mark.parametrize("case", list(UNTRUSTED))
def test_a_cache_directory_that_is_not_the_users_own_is_refused(
    case: str, cmd: str, other: int, area: Path, victim: Path, uploaded: str, cache_env: pytest.MonkeyPatch
) -> None:
    """One `Error:` line naming the directory and what is wrong with it; nothing is written there."""
    cache, message = UNTRUSTED[case](area, other, cache_env)
    if cache is None:
        cache_env.delenv("RBTOOL_CACHE_DIR", raising=False)
    else:
        cache_env.setenv("RBTOOL_CACHE_DIR", str(cache))
    before = sorted(str(p) for p in area.rglob("*"))
    result = run(*command(cmd, uploaded, area / "out"))
    assert_one_error(result)
    assert message in result.stderr, result.stderr
    assert "RBTOOL_CACHE" in result.stderr or "chmod" in result.stderr  # how to fix it
    assert sorted(str(p) for p in area.rglob("*")) == before  # no entry, lock or output made anywhere
    assert untouched(victim) == VICTIM_FILES


def test_a_bad_shared_setting_is_a_usage_error(
    uploaded: str, area: Path, cache_env: pytest.MonkeyPatch
) -> None:
    cache_env.setenv("RBTOOL_CACHE_DIR", str(area / "cache"))
    cache_env.setenv("RBTOOL_CACHE_SHARED", "perhaps")
    result = run("verify", uploaded, "--deep")
    assert_one_error(result, 2)
    assert "RBTOOL_CACHE_SHARED='perhaps'" in result.stderr


# ------------------------------------------------------------------ a cache shared on purpose
def shared_cache(area: Path, env: pytest.MonkeyPatch, mode: int = 0o1777) -> Path:
    cache = area / "shared"
    cache.mkdir()
    cache.chmod(mode)
    env.setenv("RBTOOL_CACHE_DIR", str(cache))
    env.setenv("RBTOOL_CACHE_SHARED", "1")
    return cache


def assert_mirror_matches_marker(cache: Path, url: str) -> None:
    """The data mirror of `url` holds exactly the objects the marker records (hashed here)."""
    mirror = cache / mirror_name(url) / "ckpt"
    recorded = remote.inspect(url).objects
    for rel, digest in recorded.items():
        path = mirror / rel
        assert not path.is_symlink() and path.is_file(), rel  # (an output may hard-link it)
        assert digest is not None and hashlib.sha256(path.read_bytes()).hexdigest() == digest.sha256, rel


SHARED_COMMANDS = ["verify-deep", "load-buffer", "shard"]


@pytest.mark.parametrize("cmd", SHARED_COMMANDS)
@pytest.mark.parametrize("kind", PLANTS)
def test_a_shared_sticky_cache_keeps_each_users_entries_private(
    kind: str, cmd: str, other: int, area: Path, victim: Path, uploaded: str, cache_env: pytest.MonkeyPatch
) -> None:
    """RBTOOL_CACHE_SHARED=1 and a sticky directory: what another user plants beside the victim's
    entries is never used; the victim's live in its own 0700 `user-<uid>` directory."""
    cache = shared_cache(area, cache_env)
    plant_as_other(kind, cache, uploaded, victim)
    run_json(*command(cmd, uploaded, area / "out"))
    assert untouched(victim) == VICTIM_FILES
    own = cache / f"user-{os.geteuid()}"
    assert stat.S_IMODE(own.lstat().st_mode) == 0o700 and not own.is_symlink()
    assert_mirror_matches_marker(own, uploaded)


@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_a_shared_cache_that_is_not_sticky_is_refused(
    cmd: str, other: int, area: Path, victim: Path, uploaded: str, cache_env: pytest.MonkeyPatch
) -> None:
    cache = shared_cache(area, cache_env, 0o777)
    result = run(*command(cmd, uploaded, area / "out"))
    assert_one_error(result)
    assert f"{cache}: the rbtool cache directory is writable by others and not sticky" in result.stderr
    assert list(cache.iterdir()) == []


def test_a_shared_setgid_group_directory_is_accepted(
    other: int, area: Path, victim: Path, uploaded: str, cache_env: pytest.MonkeyPatch
) -> None:
    cache = shared_cache(area, cache_env, 0o2770)
    os.chown(cache, other, pwd.getpwnam(OTHER).pw_gid)
    cache.chmod(0o2770)  # chown clears the setgid bit
    assert run_json("verify", uploaded, "--deep")["ok"] is True
    assert_mirror_matches_marker(cache / f"user-{os.geteuid()}", uploaded)
    # the same group directory without the setgid bit is refused
    cache.chmod(0o770)
    result = run("verify", uploaded, "--deep")
    assert_one_error(result)
    assert "writable by its group and neither sticky nor setgid" in result.stderr


@pytest.mark.parametrize("cmd", ["verify-deep", "load-buffer", "sample"])
@pytest.mark.parametrize("how", ["symlink", "their-directory"])
def test_another_users_entry_in_place_of_the_users_own_is_refused(
    how: str, cmd: str, other: int, area: Path, victim: Path, uploaded: str, cache_env: pytest.MonkeyPatch
) -> None:
    """In a shared sticky cache, another user makes `user-<victim's uid>` first: a link to the
    victim's files, or a directory of theirs holding a planted mirror. Neither is used."""
    cache = shared_cache(area, cache_env)
    own = cache / f"user-{os.geteuid()}"
    if how == "symlink":
        as_other("ln", "-s", victim, own)
    else:
        as_other("mkdir", "-m", "777", own)
        as_other("mkdir", "-m", "777", own / mirror_name(uploaded))
        as_other("ln", "-s", victim, own / mirror_name(uploaded) / "ckpt")
    result = run(*command(cmd, uploaded, area / "out"))
    assert_one_error(result)
    assert f"{own}:" in result.stderr
    assert untouched(victim) == VICTIM_FILES


# ------------------------------------------------------------------ inside the user's own cache
def _first_object(mirror: Path) -> Path:
    return sorted((mirror / "ckpt").glob("trajectory_*.pt"))[0]


def _forge_state(mirror: Path, url: str, path: Path) -> None:
    """Make `.rbtool-mirror.json` claim that `path`, as it is now, is the copy the marker records."""
    state = json.loads((mirror / ".rbtool-mirror.json").read_text())
    rel = path.relative_to(mirror / "ckpt").as_posix()
    info, digest = path.stat(), remote.inspect(url).objects[rel]
    assert digest is not None
    state["files"][rel] = {"sha256": digest.sha256, "identity": [info.st_size, info.st_ino, info.st_mtime_ns]}
    (mirror / ".rbtool-mirror.json").write_text(json.dumps(state))


def _other_bytes(path: Path) -> bytes:
    """The bytes of `path` with some in the middle changed: another content of the same size."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(255 - b for b in data[middle : middle + 64])
    return bytes(data)


def _t_entry_symlink(mirror: Path, url: str, victim: Path) -> None:
    shutil.rmtree(mirror)
    mirror.symlink_to(victim)


def _t_ckpt_symlink(mirror: Path, url: str, victim: Path) -> None:
    shutil.rmtree(mirror / "ckpt")
    (mirror / "ckpt").symlink_to(victim)


def _t_file_symlink(mirror: Path, url: str, victim: Path) -> None:
    pt = _first_object(mirror)
    pt.unlink()
    pt.symlink_to(victim / "canary")


def _t_subdir_symlink(mirror: Path, url: str, victim: Path) -> None:
    (mirror / "ckpt" / "rank_9").symlink_to(victim)


def _t_stale_hard_link(mirror: Path, url: str, victim: Path) -> None:
    os.link(victim / "canary", mirror / "ckpt" / "extra.pt")


def _t_lock_symlink(mirror: Path, url: str, victim: Path) -> None:
    lock = mirror.parent / ".locks" / mirror.name
    lock.unlink()
    lock.symlink_to(victim / "canary")


def _t_locks_dir_symlink(mirror: Path, url: str, victim: Path) -> None:
    shutil.rmtree(mirror.parent / ".locks")
    (mirror.parent / ".locks").symlink_to(victim)


def _t_cache_lock_symlink(mirror: Path, url: str, victim: Path) -> None:
    lock = mirror.parent / ".locks" / ".cache"
    lock.unlink()
    lock.symlink_to(victim / "canary")
    _first_object(mirror).unlink()  # so that the mirror is brought up to date, under the cache lock


def _t_state_symlink(mirror: Path, url: str, victim: Path) -> None:
    (mirror / ".rbtool-mirror.json").unlink()
    (mirror / ".rbtool-mirror.json").symlink_to(victim / "canary")


def _t_reserved_symlink(mirror: Path, url: str, victim: Path) -> None:
    (mirror / ".rbtool-reserved").unlink()
    (mirror / ".rbtool-reserved").symlink_to(victim / "canary")
    _first_object(mirror).unlink()  # so that the mirror is brought up to date, and its reservation written


def _t_forged_state(mirror: Path, url: str, victim: Path) -> None:
    pt = _first_object(mirror)
    tmp = pt.with_name("forged")
    tmp.write_bytes(_other_bytes(pt))
    os.replace(tmp, pt)
    _forge_state(mirror, url, pt)


def _t_hard_link_forged(mirror: Path, url: str, victim: Path) -> None:
    pt = _first_object(mirror)
    (victim / "doc.pt").write_bytes(_other_bytes(pt))  # the victim's own file, of the same size
    pt.unlink()
    os.link(victim / "doc.pt", pt)
    _forge_state(mirror, url, pt)


def _t_same_size(mirror: Path, url: str, victim: Path) -> None:
    pt = _first_object(mirror)
    pt.write_bytes(_other_bytes(pt))


def _t_fifo_object(mirror: Path, url: str, victim: Path) -> None:
    pt = _first_object(mirror)
    pt.unlink()
    os.mkfifo(pt)


TAMPER = {
    "entry-symlink": _t_entry_symlink,
    "ckpt-symlink": _t_ckpt_symlink,
    "file-symlink": _t_file_symlink,
    "subdir-symlink": _t_subdir_symlink,
    "stale-hard-link": _t_stale_hard_link,
    "lock-symlink": _t_lock_symlink,
    "locks-dir-symlink": _t_locks_dir_symlink,
    "cache-lock-symlink": _t_cache_lock_symlink,
    "state-symlink": _t_state_symlink,
    "reserved-symlink": _t_reserved_symlink,
    "forged-state": _t_forged_state,
    "hard-link-forged": _t_hard_link_forged,
    "same-size": _t_same_size,
    "fifo-object": _t_fifo_object,
}


def assert_outputs_are_the_source(cmd: str, out: Path) -> None:
    """What `checkpoint load --buffer` and `shard` wrote holds the uploaded bytes, not the cache's."""
    if cmd not in ("load-buffer", "shard"):
        return
    written = sorted(out.rglob("trajectory_*.pt"))
    assert written
    for path in written:
        assert path.read_bytes() == (SOURCE / path.name).read_bytes(), path


@pytest.mark.parametrize("cmd", DATA_COMMANDS)
@pytest.mark.parametrize("case", list(TAMPER))
def test_what_is_found_in_the_cache_is_never_followed_nor_trusted(
    case: str, cmd: str, area: Path, victim: Path, uploaded: str, cache_env: pytest.MonkeyPatch
) -> None:
    """A mirror made by an earlier run, then changed behind rbtool's back: links to the victim's
    files where an entry, a lock or a file will be, a forged `.rbtool-mirror.json` vouching for
    other bytes, a hard link, a FIFO. The command reads what the marker records, and the victim's
    files stay as they were."""
    cache = area / "cache"
    cache_env.setenv("RBTOOL_CACHE_DIR", str(cache))
    with remote.data_mirror(uploaded):
        pass
    mirror = cache / mirror_name(uploaded)
    TAMPER[case](mirror, uploaded, victim)
    mine = untouched(victim)
    run_json(*command(cmd, uploaded, area / "out"))
    assert untouched(victim) == mine and {**mine, **VICTIM_FILES} == mine
    assert not mirror.is_symlink() and not (mirror / "ckpt").is_symlink()
    assert_mirror_matches_marker(cache, uploaded)
    assert_outputs_are_the_source(cmd, area / "out")
    for lock in (cache / ".locks").iterdir():
        assert not lock.is_symlink() and lock.is_file()


def test_a_forged_state_cannot_make_a_restored_buffer_hold_other_bytes(
    area: Path, uploaded: str, cache_env: pytest.MonkeyPatch
) -> None:
    """The attack in full: the copy replaced by other bytes of the same size and the state file
    made to vouch for it. `checkpoint load --buffer` restores what the store holds."""
    cache_env.setenv("RBTOOL_CACHE_DIR", str(area / "cache"))
    run_json("checkpoint", "load", uploaded, "--buffer", area / "first")
    mirror = area / "cache" / mirror_name(uploaded)
    _t_forged_state(mirror, uploaded, area)
    run_json("checkpoint", "load", uploaded, "--buffer", area / "second")
    assert_outputs_are_the_source("load-buffer", area / "second")


@pytest.mark.parametrize("cmd", ["verify-deep", "load-buffer"])
def test_an_upload_without_a_marker_is_fetched_anew(
    cmd: str, area: Path, bucket: str, cache_env: pytest.MonkeyPatch
) -> None:
    """Another tool's upload records no hashes: nothing cached for it is reused."""
    fs = remote.open_remote(bucket).fs
    for p in SOURCE.iterdir():
        fs.put_file(str(p), f"{bucket[5:]}/plain/{p.name}")
    url = f"{bucket}/plain"
    cache_env.setenv("RBTOOL_CACHE_DIR", str(area / "cache"))
    with remote.data_mirror(url):
        pass
    pt = _first_object(area / "cache" / mirror_name(url))
    pt.write_bytes(_other_bytes(pt))
    run_json(*command(cmd, url, area / "out"))
    assert pt.read_bytes() == (SOURCE / pt.name).read_bytes()
    assert_outputs_are_the_source(cmd, area / "out")


# ------------------------------------------------------------------ modes
@pytest.mark.parametrize("cmd", list(COMMANDS))
@pytest.mark.parametrize("umask", [0o000, 0o022, 0o777], ids=["umask000", "umask022", "umask777"])
def test_the_cache_is_made_private_whatever_the_umask(
    umask: int, cmd: str, area: Path, uploaded: str, cache_env: pytest.MonkeyPatch
) -> None:
    cache = area / "new" / "cache"
    cache_env.setenv("RBTOOL_CACHE_DIR", str(cache))
    saved = os.umask(umask)
    try:
        result = run(*command(cmd, uploaded, area / "out"))
    finally:
        os.umask(saved)
    assert result.exit_code == 0, result.stderr
    for path in (area / "new", cache):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    for path in cache.rglob("*"):
        mode = stat.S_IMODE(path.lstat().st_mode)
        assert not path.is_symlink()
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))


@pytest.mark.parametrize("cmd", DATA_COMMANDS)
def test_a_cache_an_earlier_version_left_open_to_reading_is_made_private(
    cmd: str, area: Path, uploaded: str, cache_env: pytest.MonkeyPatch
) -> None:
    """Directories 0755 and copies 0644 (what the umask gave before): reused, and made 0700 and 0600."""
    cache = area / "cache"
    cache.mkdir(mode=0o700)
    cache_env.setenv("RBTOOL_CACHE_DIR", str(cache))
    with remote.data_mirror(uploaded):
        pass
    for path in cache.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    run_json(*command(cmd, uploaded, area / "out"))
    mirror = cache / mirror_name(uploaded)
    for path in [mirror, *mirror.rglob("*"), cache / ".locks", cache / ".locks" / mirror.name]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
