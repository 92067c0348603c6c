"""Outputs written from a remote checkpoint are the user's files, not the cache's.

The cache is private (0700 directories, 0600 files) and each reused copy is hashed against
the completion marker. An output that hard-linked a cached copy would share its inode: the
output's files would carry the cache's 0600 mode instead of the umask's, and a later write to
the output would change the cache behind the marker's back. So every writer reading a URL
copies (or reflinks) the cached files.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from conftest import FIXTURES, run

SOURCE = FIXTURES / "autosave_pt" / "autosave"


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("RBTOOL_CACHE_DIR", str(cache))
    return cache


def _commands(url: str, out: Path) -> dict[str, list[str]]:
    return {
        "checkpoint load --buffer": ["checkpoint", "load", url, "--buffer", str(out)],
        "shard": ["shard", url, "--world-size", "2", "--out", str(out)],
        "reshard": ["reshard", url, "--world-size", "2", "--out", str(out)],
        "merge": ["merge", url, "--out", str(out)],
        "filter": ["filter", url, "--out", str(out), "--min-samples", "0"],
        "convert": ["convert", url, "--out", str(out), "--format", "pt"],
        "checkpoint save": ["checkpoint", "save", url, str(out), "--window", "0"],
    }


@pytest.fixture(scope="module")
def mirrored(s3_server: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """SOURCE uploaded once per server, and a cache holding its verified mirror, which an output
    could link: (url, cache)."""
    import uuid

    url, cache = f"s3://rbtool-tests/outputs-{uuid.uuid4().hex[:8]}/ck", tmp_path_factory.mktemp("mirror")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RBTOOL_CACHE_DIR", str(cache))
        assert run("checkpoint", "save", SOURCE, url, "--window", "0").exit_code == 0
        assert run("verify", "--deep", url).exit_code == 0
    return url, cache


@pytest.mark.parametrize("umask", [0o022, 0o002])
@pytest.mark.parametrize("command", sorted(_commands("", Path())))
def test_an_output_from_a_url_holds_its_own_files_with_the_umask_mode(
    mirrored: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str, umask: int
) -> None:
    url, _cache = mirrored
    monkeypatch.setenv("RBTOOL_CACHE_DIR", str(_cache))
    out = tmp_path / "out"
    # The command under the umask (rbtool reads the process's umask at each write; forked
    # workers take it from the process that forks them, as any program's children do).
    saved = os.umask(umask)
    try:
        result = run(*_commands(url, out)[command])
    finally:
        os.umask(saved)
    assert result.exit_code == 0, result.stderr
    cached = {(s.st_dev, s.st_ino) for s in (p.lstat() for p in _cache.rglob("*")) if stat.S_ISREG(s.st_mode)}
    files = [p for p in out.rglob("*.pt") if p.is_file()]
    assert files
    for path in files:
        info = path.lstat()
        assert (info.st_dev, info.st_ino) not in cached, f"{path} is a cached copy"
        assert stat.S_IMODE(info.st_mode) == 0o666 & ~umask, f"{path}: {oct(info.st_mode)}"
