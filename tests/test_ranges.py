"""Remote sampling by byte ranges (rbtool.remote.ranges), against the real S3 servers of conftest.

A uniform sample of a remote checkpoint fetches the zip directory, data.pkl, the small-row
fields and the drawn rows of each drawn `.pt` file into its sparse stand-in; the batch is the
local batch bit for bit, and ranges already fetched are not fetched again.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_batches_equal, assert_one_error, forget_etags, make_traj, run, run_json

from rbtool import remote
from rbtool.remote.ranges import merge, subtract


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("RBTOOL_CACHE_DIR", str(cache))
    return cache


def _covered(ranges: list[tuple[int, int]], size: int) -> list[bool]:
    bits = [False] * size
    for a, b in ranges:
        for i in range(max(0, a), min(size, b)):
            bits[i] = True
    return bits


def test_merge_and_subtract_agree_with_byte_sets() -> None:
    rng = random.Random(7)
    for _ in range(300):
        wanted = [(a, a + rng.randint(0, 9)) for a in (rng.randint(0, 60) for _ in range(rng.randint(0, 6)))]
        present = [(a, a + rng.randint(0, 9)) for a in (rng.randint(0, 60) for _ in range(rng.randint(0, 6)))]
        merged, held = merge(wanted), merge(present)
        assert _covered(merged, 80) == _covered(wanted, 80)
        assert all(a < b for a, b in merged) and all(x[1] < y[0] for x, y in itertools.pairwise(merged))
        missing = subtract(merged, held)
        want_bits, held_bits = _covered(wanted, 80), _covered(present, 80)
        assert _covered(missing, 80) == [w and not h for w, h in zip(want_bits, held_bits, strict=True)]
        assert merge(missing) == missing
    assert merge([(0, 4), (10, 12)], gap=6) == [(0, 12)]
    assert merge([(0, 4), (10, 12)], gap=5) == [(0, 4), (10, 12)]


def _large_checkpoint(root: Path, n: int = 12, fmt: str = "pt", depth: bool = True) -> Path:
    """A checkpoint of files far larger than what a few drawn rows need (64x64 images per row)."""
    import torch

    loose = root / "loose"
    loose.mkdir()
    for i in range(n):
        # `depth` is no field of RLinf's Trajectory: sampled with --all-fields only
        extra = (
            {"depth": torch.rand(8, 4, 32, 32, generator=torch.Generator().manual_seed(i))} if depth else {}
        )
        traj = make_traj(t=8, b=4, seed=i, image=64, model_weights_id=f"w{i}", **extra)
        torch.save(traj, loose / f"t{i}.pt")
    out = root / "ckpt"
    assert run("checkpoint", "save", loose, out, "--window", "0").exit_code == 0
    if fmt == "pkl":
        assert run("convert", out, "--out", root / "pkl", "--format", "pkl").exit_code == 0
        return root / "pkl"
    return out


def _object_sizes(url: str) -> dict[str, int]:
    return remote.inspect(url).sizes


def test_sample_reads_only_the_ranges_it_needs_bit_for_bit(bucket: str, tmp_path: Path) -> None:
    import torch

    ckpt = _large_checkpoint(tmp_path)
    url = f"{bucket}/large"
    run_json("checkpoint", "save", ckpt, url, "--window", "0")
    args = ["--num-chunks", "4", "--seed", "21"]
    local = run_json("sample", ckpt, *args, "--out", tmp_path / "a.pt")
    got = run_json("sample", url, *args, "--out", tmp_path / "b.pt")
    assert got["draws"] == local["draws"] and got["fields"] == local["fields"]
    assert_batches_equal(torch.load(tmp_path / "b.pt"), torch.load(tmp_path / "a.pt"))
    drawn = set(got["draws"]["trajectory_id"])
    names = {int(p.name.split("_")[1]): p.name for p in ckpt.glob("trajectory_*.pt")}
    sizes = _object_sizes(url)
    drawn_bytes = sum(sizes[names[t]] for t in drawn)
    assert got["fetched"]["objects"] == len(drawn)
    # the zip tail, directory, data.pkl, small-row fields and the drawn image rows: a small part
    assert 0 < got["fetched"]["bytes"] < drawn_bytes // 10
    # --all-fields samples the fields left out by default: their ranges are fetched as well
    wide = ["--num-chunks", "5", "--seed", "8", "--all-fields"]
    assert "depth" not in {f["field"] for f in local["fields"]}
    wide_local = run_json("sample", ckpt, *wide, "--out", tmp_path / "c.pt")
    assert "depth" in {f["field"] for f in wide_local["fields"]}
    wide_got = run_json("sample", url, *wide, "--out", tmp_path / "d.pt")
    assert wide_got["draws"] == wide_local["draws"] and wide_got["fetched"]["bytes"] > 0
    assert_batches_equal(torch.load(tmp_path / "d.pt"), torch.load(tmp_path / "c.pt"))
    # the human view says the same
    human = run("sample", url, *args)
    assert human.exit_code == 0, human.stderr
    assert f"fetched {len(drawn)} object" in human.stdout


def test_a_second_sample_reuses_the_ranges_fetched(bucket: str, tmp_path: Path) -> None:
    from rbtool.buffer.replay import TrajectoryReplayBuffer
    from rbtool.files.dirs import open_view
    from rbtool.remote.ranges import RangeCache, drawn_rows

    ckpt = _large_checkpoint(tmp_path)
    url = f"{bucket}/large"
    run_json("checkpoint", "save", ckpt, url, "--window", "0")
    expected = TrajectoryReplayBuffer(seed=3, sample_window_size=0)
    expected.load_checkpoint(ckpt)
    with remote.index_mirror(url) as mirror:
        view = open_view(mirror.path)
        buffer = TrajectoryReplayBuffer(seed=3, sample_window_size=0)
        buffer.load_checkpoint(view)
        cache = RangeCache(mirror)
        hook = drawn_rows(mirror, view, cache=cache)

        def both(n: int) -> tuple[Any, int]:
            _, batch = buffer.sample_with_draw(n, before_gather=hook)
            assert_batches_equal(batch, expected.sample(n))
            return batch, mirror.fetched_bytes

        _, first = both(6)
        assert first > 0 and cache.bytes_present == first
        # the same draws again (both generators reset): nothing is fetched
        for b in (buffer, expected):
            b.random_generator.manual_seed(99)
        _, again = both(6)
        requests_again = cache.requests
        for b in (buffer, expected):
            b.random_generator.manual_seed(99)
        _, same = both(6)
        assert same == again and cache.requests == requests_again
        # new draws from files whose headers are here fetch only their rows
        before = cache.requests
        _, more = both(64)
        assert more > same and cache.requests > before
        assert cache.bytes_present <= sum(mirror.checkpoint.sizes.values())


def test_pkl_trajectories_are_fetched_whole(bucket: str, tmp_path: Path) -> None:
    ckpt = _large_checkpoint(tmp_path, n=6, fmt="pkl")
    url = f"{bucket}/pkl"
    run_json("checkpoint", "save", ckpt, url, "--window", "0")
    args = ["--num-chunks", "3", "--seed", "4"]
    local = run_json("sample", ckpt, *args)
    got = run_json("sample", url, *args)
    assert got["draws"] == local["draws"]
    sizes = _object_sizes(url)
    names = {int(p.name.split("_")[1]): p.name for p in ckpt.glob("trajectory_*.pkl")}
    drawn = set(got["draws"]["trajectory_id"])
    assert got["fetched"] == {"objects": len(drawn), "bytes": sum(sizes[names[t]] for t in drawn)}


def test_a_changed_record_is_caught_by_its_crc(bucket: str, tmp_path: Path) -> None:
    ckpt = _large_checkpoint(tmp_path, n=3, depth=False)
    url = f"{bucket}/large"
    run_json("checkpoint", "save", ckpt, url, "--window", "0")
    r = remote.open_remote(url)
    for path in ckpt.glob("trajectory_*.pt"):
        data = bytearray(path.read_bytes())
        at = data.index(b"data.pkl")  # the data.pkl record's local header name; its data follows
        data[at + 200] ^= 0xFF
        r.fs.pipe_file(r.key(path.name), bytes(data))  # same size: the marker's sizes still match
    forget_etags(url)  # (their ETags would tell before anything is read)
    result = run("sample", url, "--num-chunks", "2", "--seed", "1")
    assert_one_error(result)
    assert "CRC-32" in result.stderr


def test_the_ranges_fetched_stay_within_the_cache_bound(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = _large_checkpoint(tmp_path, n=3, depth=False)
    url = f"{bucket}/large"
    run_json("checkpoint", "save", ckpt, url, "--window", "0")
    monkeypatch.setenv("RBTOOL_CACHE_BYTES", "4096")
    result = run("sample", url, "--num-chunks", "2", "--seed", "1")
    assert_one_error(result)
    assert "RBTOOL_CACHE_BYTES" in result.stderr
