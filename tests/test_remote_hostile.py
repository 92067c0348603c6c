"""Hostile object storage: keys that are paths, two writers at one URL, store errors.

Every case runs against both real S3 servers of tests/conftest.py (moto's and SeaweedFS).
A bucket's keys are someone else's: a key is a name, never a path, so a key such as
`ck/../../home/u/.bashrc` reached through `s3://b/ck` is refused (one line, exit 1) before
rbtool builds any local path from it, and nothing is created or changed outside its cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES, assert_one_error, run, run_json

from rbtool import remote

SRC = FIXTURES / "autosave_pt" / "autosave"
CANARY = "canary"  # a directory beside the cache, with one file in it


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("RBTOOL_CACHE_DIR", str(cache))
    return cache


@pytest.fixture
def bucket(bucket: str) -> str:
    """A place of the test's own: the shared fixture cuts long test names short, so parametrized
    cases could meet under one prefix."""
    return f"{bucket}/{uuid.uuid4().hex[:8]}"


def _fs() -> Any:
    return remote.open_remote("s3://rbtool-tests").fs


def _target(tmp_path: Path) -> str:
    """The canary file's absolute path without its leading slash (what a hostile key appends)."""
    return str((tmp_path / CANARY / "victim").resolve())[1:]


# Hostile names under the checkpoint's prefix; {T} is replaced by the canary's path (no leading /).
HOSTILE = {
    "dotdot": "../" * 30 + "{T}",
    "dotdot-in-rank": "rank_0/" + "../" * 30 + "{T}",
    "absolute": "/{T}",
    "absolute-rank": "rank_0//{T}",
    "dot-segment": "./trajectory_9_w.pt",
    "empty-segment": "rank_0//trajectory_9_w.pt",
    "newline": "trajectory_9_w\n.pt",
    "trailing-newline": "trajectory_9_w.pt\n",
    "control": "trajectory_9_\x01w.pt",
    "escape-sequence": "trajectory_9_\x1b[2Jw.pt",
    "delete-char": "trajectory_9_w\x7f.pt",
    "unknown-name": "notes.txt",
    "backslash": "..\\..\\..\\{T}",
    "too-deep": "rank_0/sub/trajectory_9_w.pt",
    "not-a-rank-dir": "rank_x/metadata.json",
    "under-a-file": "metadata.json/trajectory_9_w.pt",
    "too-long": "trajectory_9_" + "w" * 300 + ".pt",
}

# Every command that reads a URL, with the arguments around it (OUT is a path in tmp_path).
COMMANDS = {
    "stats": ["stats", "URL"],
    "stats-index-only": ["stats", "URL", "--index-only"],
    "verify": ["verify", "URL"],
    "verify-deep": ["verify", "URL", "--deep"],
    "sample": ["sample", "URL", "--num-chunks", "2", "--seed", "1"],
    "shard": ["shard", "URL", "-n", "2", "--out", "OUT"],
    "reshard": ["reshard", "URL", "-n", "2", "--out", "OUT"],
    "merge": ["merge", "URL", "--out", "OUT"],
    "filter": ["filter", "URL", "--out", "OUT", "--last", "2"],
    "convert": ["convert", "URL", "--out", "OUT", "--format", "pkl"],
    "diff": ["diff", "URL", str(SRC)],
    "checkpoint-load": ["checkpoint", "load", "URL"],
    "checkpoint-load-buffer": ["checkpoint", "load", "URL", "--buffer", "OUT"],
    "checkpoint-save": ["checkpoint", "save", "URL", "OUT", "--window", "0"],
    "ingest": ["ingest", "URL", "--buffer", "OUT"],
    "export": ["export", "URL", "OUT", "--to", "lerobot", "--fps", "10"],
}


def _tree(root: Path, skip: Path) -> dict[str, str]:
    """Every path under `root` (not under `skip`) -> what it is (its bytes' sha256 for a file)."""
    out: dict[str, str] = {}
    for parent, dirs, files in os.walk(root):
        here = Path(parent)
        if here == skip or skip in here.parents:
            dirs[:] = []
            continue
        for name in dirs + files:
            path = here / name
            if path == skip:
                continue
            if path.is_symlink():
                out[str(path)] = "link"
            elif path.is_file():
                out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                out[str(path)] = "dir"
    return out


def _plant(url: str, extra: dict[str, bytes], *, marker: bool) -> None:
    """The reference checkpoint at `url`, plus the objects `extra` (name under the prefix -> bytes).

    With `marker`, an rbtool upload whose marker records the extra objects as well (a marker
    written by whoever controls the bucket); without, a plain upload by another tool.
    """
    fs, root = _fs(), url[len("s3://") :]
    if marker:
        assert run("checkpoint", "save", SRC, url, "--window", "0").exit_code == 0
    else:
        for p in SRC.iterdir():
            fs.put_file(str(p), f"{root}/{p.name}")
    for name, data in extra.items():
        try:
            fs.pipe_file(f"{root}/{name}", data)
        except OSError as exc:
            pytest.skip(f"this server does not store the key {name!r} ({exc})")
    if marker:
        doc = json.loads(fs.cat_file(f"{root}/{remote.MARKER}"))
        for name, data in extra.items():
            doc["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        doc.pop("digest", None)  # whoever forges entries leaves the digest out or recomputes it
        if "digest" in json.loads(fs.cat_file(f"{root}/{remote.MARKER}")):
            doc["digest"] = remote.marker_digest(
                {n: remote.Digest(e["size"], e["sha256"]) for n, e in doc["files"].items()}
            )
        fs.pipe_file(f"{root}/{remote.MARKER}", json.dumps(doc).encode())
    listed = {n[len(root) + 1 :] for n in fs.find(root)}
    if not set(extra) <= listed:
        pytest.skip(f"this server stores the keys {sorted(set(extra) - listed)!r} under other names")


def _attack(tmp_path: Path, bucket: str, key: str, argv: list[str], *, marker: bool) -> None:
    canary = tmp_path / CANARY
    canary.mkdir()
    (canary / "victim").write_bytes(b"precious\n")
    name = key.replace("{T}", _target(tmp_path))
    url = f"{bucket}/ck"
    _plant(url, {name: b"\0" * 64}, marker=marker)
    cache = tmp_path / "cache"
    before = _tree(tmp_path, cache)
    out = tmp_path / "out"
    result = run(*[url if a == "URL" else str(out) if a == "OUT" else a for a in argv])
    assert (canary / "victim").read_bytes() == b"precious\n"
    assert sorted(p.name for p in canary.iterdir()) == ["victim"]
    assert _tree(tmp_path, cache) == before  # nothing created or changed outside the cache
    assert not out.exists()
    assert_one_error(result)
    shown = remote.shown_key(name)
    assert "object key" in result.stderr and shown in result.stderr, result.stderr
    for parent, dirs, files in os.walk(cache):  # and the cache holds nothing that leads out of it
        for entry in dirs + files:
            path = Path(parent) / entry
            assert not path.is_symlink(), path
            assert cache.resolve() in path.resolve().parents


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("key", sorted(HOSTILE))
def test_a_hostile_key_of_another_tools_upload_is_refused_and_writes_nothing(
    key: str, command: str, bucket: str, tmp_path: Path
) -> None:
    _attack(tmp_path, bucket, HOSTILE[key], COMMANDS[command], marker=False)


@pytest.mark.parametrize("command", ["stats-index-only", "verify", "verify-deep", "sample", "shard", "diff"])
@pytest.mark.parametrize("key", ["dotdot", "absolute", "empty-segment", "control", "unknown-name"])
def test_a_hostile_key_the_marker_records_is_refused_and_writes_nothing(
    key: str, command: str, bucket: str, tmp_path: Path
) -> None:
    _attack(tmp_path, bucket, HOSTILE[key], COMMANDS[command], marker=True)


@pytest.mark.parametrize(
    "name",
    [
        "metadata.json",
        "trajectory_index.json",
        "trajector_index.json",
        "merge_map.json",
        "trajectory_0_w.pt",
        "trajectory_12_a.b-c_d.pkl",
        "rank_0/metadata.json",
        "rank_10/trajectory_3_w.pt",
        remote.MARKER,
        remote.PENDING,
    ],
)
def test_the_names_a_checkpoint_uses_are_accepted(name: str) -> None:
    assert remote.key_problem(name) is None


@pytest.mark.parametrize("key", sorted(HOSTILE))
def test_every_hostile_name_has_a_problem(key: str) -> None:
    assert remote.key_problem(HOSTILE[key].replace("{T}", "etc/passwd")) is not None


def test_a_key_with_a_nul_is_refused() -> None:
    # no S3 server stores one (the listing is XML), but another fsspec store might
    assert remote.key_problem("trajectory_0_w\x00.pt") is not None
    assert "\\x00" in remote.shown_key("trajectory_0_w\x00.pt")


def test_the_refusal_names_the_key_escaped(bucket: str, tmp_path: Path) -> None:
    url = f"{bucket}/ck"
    _plant(url, {"trajectory_9_\x1b[2Jw.pt": b"x"}, marker=False)
    result = run("stats", url, "--index-only")
    assert_one_error(result)
    assert "\x1b" not in result.stderr and "trajectory_9_\\x1b[2Jw.pt" in result.stderr
    assert result.stderr.startswith(f"Error: {url}: object key ")


@pytest.mark.parametrize("key", ["dotdot", "control", "absolute", "unknown-name"])
def test_a_writer_refuses_a_target_with_a_hostile_key_and_removes_nothing(key: str, bucket: str) -> None:
    """A pending note makes a writer continue an upload; a hostile key there stops it, untouched."""
    url, fs = f"{bucket}/ck", _fs()
    root = url[len("s3://") :]
    name = HOSTILE[key].replace("{T}", "x")
    fs.pipe_file(f"{root}/{remote.PENDING}", b"{}")
    try:
        fs.pipe_file(f"{root}/{name}", b"keep")
    except OSError as exc:
        pytest.skip(f"this server does not store the key {name!r} ({exc})")
    if f"{root}/{name}" not in fs.find(root):
        pytest.skip(f"this server stores the key {name!r} under another name")
    result = run("checkpoint", "save", SRC, url, "--window", "0")
    assert_one_error(result)
    assert "object key" in result.stderr or "not a checkpoint" in result.stderr
    assert fs.cat_file(f"{root}/{name}") == b"keep"
    assert remote.MARKER not in {n[len(root) + 1 :] for n in fs.find(root)}


# ------------------------------------------------------------------ two writers at one URL
def _variant(tmp_path: Path) -> Path:
    """A copy of SRC whose last trajectory file holds other bytes of the same size (a second writer's
    checkpoint with the same names and sizes)."""
    import torch

    out = tmp_path / "variant"
    assert run("checkpoint", "save", SRC, out, "--window", "0").exit_code == 0
    victim = sorted(out.glob("trajectory_*.pt"))[-1]
    data = torch.load(victim, weights_only=True)
    first = next(k for k, v in data.items() if isinstance(v, torch.Tensor) and v.is_floating_point())
    data[first] = data[first] + 1
    size = victim.stat().st_size
    victim.unlink()  # a new file, not the hard link to SRC
    torch.save(data, victim)
    assert victim.stat().st_size == size
    return out


def _copy_objects(src_url: str, dst_url: str, names: list[str]) -> None:
    fs = _fs()
    for name in names:
        fs.pipe_file(f"{dst_url[5:]}/{name}", fs.cat_file(f"{src_url[5:]}/{name}"))


JSON_AND_MARKER = ["metadata.json", "trajectory_index.json", remote.MARKER]
READERS = ["stats-index-only", "verify", "checkpoint-load", "sample", "verify-deep", "stats", "diff", "shard"]


@pytest.mark.parametrize("command", READERS)
def test_objects_of_one_upload_with_the_index_and_marker_of_another_are_refused(
    command: str, bucket: str, tmp_path: Path
) -> None:
    a, b = f"{bucket}/a", f"{bucket}/b"
    assert run("checkpoint", "save", SRC, a, "--window", "0").exit_code == 0
    assert run("checkpoint", "save", _variant(tmp_path), b, "--window", "0").exit_code == 0
    _copy_objects(b, a, JSON_AND_MARKER)  # B's writer finished last, A's trajectory objects stayed
    out = tmp_path / "out"
    result = run(*[a if x == "URL" else str(out) if x == "OUT" else x for x in COMMANDS[command]])
    assert_one_error(result)
    assert "another writer" in result.stderr and "changed since the upload" in result.stderr
    assert not out.exists()


def test_a_quick_verify_of_an_interleaved_upload_fails(bucket: str, tmp_path: Path) -> None:
    a, b = f"{bucket}/a", f"{bucket}/b"
    run_json("checkpoint", "save", SRC, a, "--window", "0")
    run_json("checkpoint", "save", _variant(tmp_path), b, "--window", "0")
    _copy_objects(b, a, JSON_AND_MARKER)
    result = run("verify", a, "--json")
    assert result.exit_code == 1
    assert "another writer" in result.stderr


def test_an_object_the_marker_does_not_record_is_refused(bucket: str) -> None:
    url = f"{bucket}/ck"
    run_json("checkpoint", "save", SRC, url, "--window", "0")
    name = sorted(p.name for p in SRC.glob("trajectory_*.pt"))[0].replace("trajectory_0_", "trajectory_99_")
    _fs().put_file(str(sorted(SRC.glob("trajectory_*.pt"))[0]), f"{url[5:]}/{name}")
    result = run("verify", url)
    assert result.exit_code == 1 and "does not record" in result.stderr and name in result.stderr


@pytest.mark.parametrize("edit", ["size", "sha256", "drop-entry", "add-entry", "digest"])
def test_a_marker_that_does_not_match_its_digest_is_refused(edit: str, bucket: str) -> None:
    url = f"{bucket}/ck"
    run_json("checkpoint", "save", SRC, url, "--window", "0")
    fs, key = _fs(), f"{url[5:]}/{remote.MARKER}"
    doc = json.loads(fs.cat_file(key))
    name = sorted(n for n in doc["files"] if n.endswith(".pt"))[0]
    if edit == "size":
        doc["files"][name]["size"] += 1
    elif edit == "sha256":
        doc["files"][name]["sha256"] = "0" * 64
    elif edit == "drop-entry":
        del doc["files"][name]
    elif edit == "add-entry":
        doc["files"]["trajectory_99_w.pt"] = {"size": 1, "sha256": "0" * 64}
    else:
        doc["digest"] = "0" * 64
    fs.pipe_file(key, json.dumps(doc).encode())
    result = run("verify", url)
    assert result.exit_code == 1 and "digest does not match" in result.stderr


def test_a_marker_of_version_1_is_still_read(bucket: str) -> None:
    url = f"{bucket}/ck"
    run_json("checkpoint", "save", SRC, url, "--window", "0")
    fs, key = _fs(), f"{url[5:]}/{remote.MARKER}"
    doc = json.loads(fs.cat_file(key))
    assert doc["version"] == remote.MARKER_VERSION == 2 and doc["digest"]
    old = {
        "format": doc["format"],
        "version": 1,
        "files": {n: {"size": e["size"], "sha256": e["sha256"]} for n, e in doc["files"].items()},
    }
    fs.pipe_file(key, json.dumps(old).encode())
    assert run_json("verify", url)["ok"] is True
    assert run_json("verify", url, "--deep")["ok"] is True


@pytest.mark.parametrize("round_", range(3))
def test_two_uploads_at_once_leave_one_whole_checkpoint_or_none(
    round_: int, bucket: str, tmp_path: Path
) -> None:
    """Two `checkpoint save --force` to one URL at the same time: whatever quick verify passes is one
    of the two checkpoints whole (deep verify passes, diff finds it equal to its source)."""
    import subprocess
    import sys

    url = f"{bucket}/ck"
    sources = [SRC, _variant(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "rbtool", "checkpoint", "save", str(s), url, "--window", "0", "--force"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for s in sources
    ]
    for proc in procs:
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode in (0, 1), stderr
        if proc.returncode == 1:
            assert len(stderr.splitlines()) == 1 and stderr.startswith("Error: "), stderr
    quick = run("verify", url, "--json")
    if quick.exit_code != 0:
        return  # refused: no mix passes
    assert run_json("verify", url, "--deep")["ok"] is True
    equal = [json.loads(run("diff", s, url, "--deep", "--json").stdout)["equal"] for s in sources]
    assert equal.count(True) == 1


# ------------------------------------------------------------------ store errors are one line
SECRET = "S3cr3t-Option-Value"


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed again: nothing listens there


ERROR_COMMANDS = {
    "stats-index-only": ["stats", "URL", "--index-only"],
    "verify": ["verify", "URL"],
    "verify-deep": ["verify", "URL", "--deep"],
    "sample": ["sample", "URL", "--num-chunks", "2"],
    "shard": ["shard", "URL", "-n", "2", "--out", "OUT"],
    "save-to-url": ["checkpoint", "save", str(SRC), "URL", "--window", "0"],
}
SITUATIONS = ["closed-port", "no-credentials", "unknown-option", "bad-value", "no-bucket", "secret-option"]


@pytest.fixture(scope="module")
def saved(s3_server: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """SRC uploaded once per server: the checkpoint the reading commands would read, were it
    not for the store's error (none of them writes to it)."""
    url = f"s3://rbtool-tests/store-errors-{uuid.uuid4().hex[:8]}/ck"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RBTOOL_CACHE_DIR", str(tmp_path_factory.mktemp("saved-cache")))
        run_json("checkpoint", "save", SRC, url, "--window", "0")
    return url


@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
@pytest.mark.parametrize("command", sorted(ERROR_COMMANDS))
@pytest.mark.parametrize("situation", SITUATIONS)
def test_a_store_error_is_one_line_naming_the_url_without_secrets(
    situation: str,
    command: str,
    verbose: bool,
    bucket: str,
    saved: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import s3fs

    url = f"{bucket}/ck" if command == "save-to-url" else saved
    options: list[str] = []
    status = 1
    if situation in ("closed-port", "secret-option"):
        # botocore retries a refused connection with backoff (about 10 s); the error is the same
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    if situation == "closed-port":
        options = ["--storage-option", f"endpoint_url=http://127.0.0.1:{_closed_port()}"]
    elif situation == "no-credentials":
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        s3fs.S3FileSystem.clear_instance_cache()
    elif situation == "unknown-option":
        options, status = ["--storage-option", f"secret_acess_key={SECRET}"], 2
    elif situation == "bad-value":
        options, status = ["--storage-option", "anon=maybe"], 2
    elif situation == "no-bucket":
        url = f"s3://rbtool-no-such-bucket-{uuid.uuid4().hex[:8]}/ck"
    else:  # a secret given as an option, against an endpoint nobody answers at
        port = _closed_port()
        options = [
            "--storage-option",
            f"secret={SECRET}",
            "--storage-option",
            f"endpoint_url=http://127.0.0.1:{port}",
        ]
    argv = [
        url if a == "URL" else str(tmp_path / "out") if a == "OUT" else a for a in ERROR_COMMANDS[command]
    ]
    result = run(*(["-v"] if verbose else []), *argv, *options)
    s3fs.S3FileSystem.clear_instance_cache()
    lines = result.stderr.splitlines()
    assert result.exit_code == status, result.stderr
    assert result.stdout == "" and lines and lines[-1].startswith("Error: "), result.stderr
    assert verbose or len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert url in lines[-1] and "Error: ?" not in lines[-1]
    assert SECRET not in result.stderr and "rbtool-test-secret" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_redaction_hides_every_secret_option_and_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SESSION_TOKEN", "tok-12345")
    options = {"key": "AKIA123", "secret": "s3cr3t", "client_kwargs": {"aws_secret_access_key": "nested-s"}}
    text = "AKIA123 s3cr3t nested-s tok-12345 https://user:pw123@host/x"
    shown = remote.redact(text, options)
    for secret in ("AKIA123", "s3cr3t", "nested-s", "tok-12345", "pw123"):
        assert secret not in shown
    assert "host/x" in shown


def test_a_malformed_storage_option_does_not_echo_its_secret() -> None:
    result = run("stats", "s3://b/ck", "--storage-option", f"secret{SECRET}")  # the = forgotten
    assert_one_error(result, 2)
    assert SECRET not in result.stderr


@pytest.mark.parametrize("command", ["sample", "checkpoint-load-buffer", "verify-deep", "export"])
def test_an_object_larger_than_the_cache_bound_is_refused_before_it_is_fetched(
    command: str, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _cache: Path
) -> None:
    url = f"{bucket}/ck"
    run_json("checkpoint", "save", SRC, url, "--window", "0")
    largest = max(p.stat().st_size for p in SRC.glob("trajectory_*.pt"))
    monkeypatch.setenv("RBTOOL_CACHE_BYTES", str(largest - 1))
    out = tmp_path / "out"
    result = run(*[url if a == "URL" else str(out) if a == "OUT" else a for a in COMMANDS[command]])
    assert_one_error(result)
    assert "RBTOOL_CACHE_BYTES" in result.stderr and url in result.stderr
    big = [p for p in _cache.rglob("trajectory_*") if p.is_file() and p.stat().st_blocks * 512 >= largest]
    assert big == []  # nothing fetched whole


@pytest.fixture
def full_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A cache on a file system of 48 KiB (a tmpfs mounted for the test: root only)."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=48k,mode=0700", "tmpfs", str(mount)], check=False
    )
    if done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    monkeypatch.setenv("RBTOOL_CACHE_DIR", str(mount / "cache"))
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("command", ["verify-deep", "stats", "diff", "sample", "checkpoint-load-buffer"])
def test_a_full_local_disk_while_fetching_is_one_error_naming_the_url(
    command: str, bucket: str, tmp_path: Path, full_cache: Path
) -> None:
    url = f"{bucket}/ck"
    with pytest.MonkeyPatch.context() as mp:  # the upload stages in a cache with room
        mp.setenv("RBTOOL_CACHE_DIR", str(tmp_path / "cache"))
        run_json("checkpoint", "save", SRC, url, "--window", "0")
    out = tmp_path / "out"
    result = run(*[url if a == "URL" else str(out) if a == "OUT" else a for a in COMMANDS[command]])
    assert_one_error(result)
    assert url in result.stderr and "Error: ?" not in result.stderr
    assert "space" in result.stderr, result.stderr


def test_a_url_is_shown_without_its_password_and_with_its_scheme() -> None:
    assert remote.shown_url("s3://user:pw123@bucket/ck") == "s3://***@bucket/ck"
    assert remote.shown_url("s3://bucket/ck") == "s3://bucket/ck"
