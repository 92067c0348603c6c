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
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES, assert_one_error, run, run_json

from rbtool import remote

OTHER = "rbtool-other"
SOURCE = FIXTURES / "autosave_pt" / "autosave"
CANARY = b"the victim's own file\n"


# ------------------------------------------------------------------ the second user, the victim
@pytest.fixture(scope="session")
def other() -> int:
    """The uid of a second local user, made with useradd if it is not there yet (needs root)."""
    if os.geteuid() != 0:
        pytest.skip("a second local user can only be made as root")
    try:
        return pwd.getpwnam(OTHER).pw_uid
    except KeyError:
        pass
    made = subprocess.run(
        ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER], capture_output=True, text=True
    )
    try:
        return pwd.getpwnam(OTHER).pw_uid  # made here, or by a test running beside this one
    except KeyError:
        pytest.fail(f"useradd {OTHER} failed: {made.stderr}")


def as_other(*argv: str | Path) -> None:
    """Run a command as the other user (what an attacker on the same machine can do)."""
    subprocess.run(["runuser", "-u", OTHER, "--", *map(str, argv)], check=True, capture_output=True)


@pytest.fixture
def area() -> Iterator[Path]:
    """A directory under /tmp that the other user can reach (pytest's tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="rbtool-trust-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


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
        str(p.relative_to(home)): p.read_bytes() for p in sorted(home.rglob("*")) if p.is_file() and not p.is_symlink()
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
