"""Remote checkpoints larger than the cache, and a cache shared by several processes.

Deep passes that read each file once (verify --deep, stats' data pass, convert) fetch their
files in batches ahead of the pass and release each once read, so a checkpoint larger than
RBTOOL_CACHE_BYTES is read with the cache never above it. A reader pins the mirror it uses
(a shared lock per entry): another process's eviction passes it by.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_one_error, forget_etags, make_traj, run, run_json

from rbtool import remote

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("RBTOOL_CACHE_DIR", str(cache))
    return cache


def on_disk(path: Path) -> int:
    """Bytes the files under `path` take on disk (sparse stand-ins of remote objects take none)."""
    total = 0
    for parent, _, names in os.walk(path):  # files and directories come and go while it walks
        for name in names:
            try:
                info = os.lstat(os.path.join(parent, name))
            except OSError:
                continue
            total += min(info.st_size, info.st_blocks * 512)
    return total


@contextmanager
def measured(path: Path) -> Iterator[list[int]]:
    """The largest size `on_disk(path)` had while the block ran, polled from a thread: [peak]."""
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if path.exists():
                peak[0] = max(peak[0], on_disk(path))
            stop.wait(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield peak
    finally:
        stop.set()
        watcher.join()


def build(root: Path, n: int = 24, *, uniform: bool = False) -> Path:
    """A local checkpoint of `n` trajectory files, of unequal sizes (50-200 KB) unless `uniform`."""
    import torch

    loose = root / "loose"
    loose.mkdir()
    for i in range(n):
        t = 8 if uniform else 4 + i % 4 * 4
        traj = make_traj(t=t, b=4, seed=i, image=32, model_weights_id=f"w{i}")
        torch.save(traj, loose / f"t{i}.pt")
    assert run("checkpoint", "save", loose, root / "ckpt", "--window", "0").exit_code == 0
    return root / "ckpt"


def upload(local: Path, url: str) -> int:
    """Upload `local` to `url`; returns the bytes of its trajectory objects."""
    run_json("checkpoint", "save", local, url, "--window", "0")
    return sum(p.stat().st_size for p in local.glob("*.pt"))


def without_timings(doc: Any) -> Any:
    """A report with its paths and timings taken out (they differ between two runs)."""
    if isinstance(doc, dict):
        return {
            k: without_timings(v)
            for k, v in doc.items()
            if k not in ("path", "checkpoint", "seconds", "bytes_per_second")
        }
    if isinstance(doc, list):
        return [without_timings(v) for v in doc]
    return doc


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_deep_passes_stream_a_checkpoint_larger_than_the_cache(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _cache: Path, jobs: str
) -> None:
    local = build(tmp_path)
    url = f"{bucket}/big"
    total = upload(local, url)
    largest = max(p.stat().st_size for p in local.glob("*.pt"))
    bound = max(total // 4, 2 * largest)
    assert bound < total // 2  # well below the checkpoint: the pass must stream
    monkeypatch.setenv("RBTOOL_CACHE_BYTES", str(bound))
    for command in (["verify", "--deep"], ["stats"]):
        want = run_json(*command, local, "--jobs", jobs)
        with measured(_cache) as peak:
            got = run_json(*command, url, "--jobs", jobs)
        assert got.get("path", got.get("checkpoint")) == url or url in str(got)
        assert without_timings(got) == without_timings(want), command
        assert 0 < peak[0] <= bound, (command, peak[0], bound)  # objects were here, never above the bound
        assert not list(_cache.glob("mirror-*"))  # nothing was mirrored whole
        assert on_disk(_cache) == 0  # every fetched object was released
    # a command that needs every object at once keeps the refusal, saying why
    result = run("diff", url, local)
    assert_one_error(result)
    assert "RBTOOL_CACHE_BYTES" in result.stderr and "every object at once" in result.stderr


def test_a_streamed_deep_pass_still_finds_a_damaged_object(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = build(tmp_path, n=8)
    url = f"{bucket}/damaged"
    total = upload(local, url)
    r = remote.open_remote(url)
    victim = sorted(p.name for p in local.glob("*.pt"))[3]
    r.fs.pipe_file(r.key(victim), b"\0" * (local / victim).stat().st_size)
    forget_etags(url)  # (its ETag would tell before anything is read)
    monkeypatch.setenv("RBTOOL_CACHE_BYTES", str(total // 3))
    result = run("verify", url, "--deep", "--json")
    assert result.exit_code == 1 and victim in result.stderr and "sha256" in result.stderr


def test_convert_streams_a_remote_source_to_a_local_out(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _cache: Path
) -> None:
    local = build(tmp_path, n=12)
    url = f"{bucket}/src"
    total = upload(local, url)
    monkeypatch.setenv("RBTOOL_CACHE_BYTES", str(total // 3))
    with measured(_cache) as peak:
        run_json("convert", url, "--out", tmp_path / "from-remote", "--format", "pkl")
    assert 0 < peak[0] <= total // 3
    run_json("convert", local, "--out", tmp_path / "from-local", "--format", "pkl")
    a = run_json("stats", tmp_path / "from-remote")
    b = run_json("stats", tmp_path / "from-local")
    assert without_timings(a) == without_timings(b)
    assert run_json("verify", tmp_path / "from-remote", "--deep")["ok"] is True


def test_a_tiny_cache_names_the_file_that_does_not_fit(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = build(tmp_path, n=4)
    url = f"{bucket}/tiny"
    upload(local, url)
    monkeypatch.setenv("RBTOOL_CACHE_BYTES", "1000")
    result = run("verify", url, "--deep")
    assert_one_error(result)
    assert "RBTOOL_CACHE_BYTES" in result.stderr and ".pt" in result.stderr


# ------------------------------------------------------------------ two processes
_HOLDER = """
import sys
from rbtool import remote
with remote.data_mirror(sys.argv[1]) as path:
    print(path, flush=True)
    sys.stdin.readline()
"""


def test_a_mirror_another_process_reads_is_not_evicted(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _cache: Path
) -> None:
    local = build(tmp_path, n=10)
    first, second = f"{bucket}/one", f"{bucket}/two"
    size = upload(local, first)
    upload(local, second)
    monkeypatch.setenv("RBTOOL_CACHE_BYTES", str(size + size // 2))  # room for one mirror, not two
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, first],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        held = Path(holder.stdout.readline().strip())
        assert held.is_dir() and (held / "metadata.json").is_file()
        before = {p.name: p.read_bytes() for p in held.iterdir()}
        want = run_json("stats", local)
        # the data pass of stats cannot evict the pinned mirror: it streams beside it, within the bound
        with measured(_cache) as peak:
            got = run_json("stats", second)
        assert without_timings(got) == without_timings(want)
        assert peak[0] <= size + size // 2
        assert {p.name: p.read_bytes() for p in held.iterdir()} == before  # the reader's copy is whole
        # a command that needs the whole checkpoint says the cache is held by other readers
        result = run("diff", second, local)
        assert_one_error(result)
        assert "other processes" in result.stderr
        assert {p.name: p.read_bytes() for p in held.iterdir()} == before
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        holder.wait(timeout=60)
    assert holder.returncode == 0
    # once the reader is done, its mirror is evicted to make room, as least recently used
    run_json("diff", second, local)
    assert not held.exists()
    assert len(list(_cache.glob("mirror-*"))) == 1


def test_readers_of_one_mirror_share_it(bucket: str, tmp_path: Path, _cache: Path) -> None:
    """A second process reading the same URL while the first holds it takes the same verified copy."""
    local = build(tmp_path, n=4)
    url = f"{bucket}/shared"
    upload(local, url)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holders = [
        subprocess.Popen(
            [sys.executable, "-c", _HOLDER, url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    try:
        paths = []
        for h in holders:
            assert h.stdout is not None
            paths.append(h.stdout.readline().strip())
        assert paths[0] == paths[1] != ""
        assert run_json("verify", paths[0], "--deep")["ok"] is True
    finally:
        for h in holders:
            if h.stdin is not None:
                h.stdin.close()
            h.wait(timeout=60)
    assert [h.returncode for h in holders] == [0, 0]


def test_processes_streaming_at_once_stay_within_the_bound(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _cache: Path
) -> None:
    """Each streaming reader reserves its room under the cache lock: together they stay under the bound."""
    import json

    local = build(tmp_path, n=40, uniform=True)
    urls = [f"{bucket}/{name}" for name in ("one", "two", "three")]
    total = upload(local, urls[0])
    for url in urls[1:]:
        upload(local, url)
    largest = max(p.stat().st_size for p in local.glob("*.pt"))
    bound = 9 * largest  # three readers: half, a quarter, an eighth of it (each at least one file)
    assert bound < total // 4
    monkeypatch.setenv("RBTOOL_CACHE_BYTES", str(bound))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    want = without_timings(run_json("verify", local, "--deep", "--jobs", "1"))
    with measured(_cache) as peak:
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "rbtool", "verify", url, "--deep", "--json", "--jobs", "1"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for url in urls
        ]
        outputs = [p.communicate(timeout=300) for p in procs]
    for proc, (stdout, stderr) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, stderr
        assert without_timings(json.loads(stdout)) == want
    assert 0 < peak[0] <= bound, (peak[0], bound)
    assert on_disk(_cache) == 0


TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed")
def test_ranks_stream_their_shares_within_the_bound(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _cache: Path
) -> None:
    """Under torchrun each rank streams its own share, the node's ranks splitting the free room."""
    import json

    local = build(tmp_path, n=24, uniform=True)
    url = f"{bucket}/ranked"
    total = upload(local, url)
    largest = max(p.stat().st_size for p in local.glob("*.pt"))
    bound = 6 * largest
    assert bound < total // 3
    monkeypatch.setenv("RBTOOL_CACHE_BYTES", str(bound))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    want = without_timings(run_json("verify", local, "--deep", "--jobs", "1"))
    argv = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", "-m", "rbtool"]
    with measured(_cache) as peak:
        done = subprocess.run(
            [*argv, "verify", url, "--deep", "--json", "--jobs", "1"],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
    assert done.returncode == 0, done.stderr
    got = without_timings(json.loads(done.stdout))
    assert got.pop("jobs") == 2 and want.pop("jobs") == 1  # one worker on each of two ranks
    assert got == want
    assert 0 < peak[0] <= bound, (peak[0], bound)
