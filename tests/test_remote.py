"""Checkpoints in object storage: every command against a real S3 server (moto's) on 127.0.0.1.

The upload protocol (docs/format.md): trajectory objects, then index and metadata, then the
completion marker last; readers refuse an rbtool upload without its marker; a rerun of a
killed upload completes it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    FIXTURES,
    assert_one_error,
    at_terminal,
    forget_etags,
    make_traj,
    run,
    run_json,
    screen,
    sigint_default,
)

from rbtool import remote


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("RBTOOL_CACHE_DIR", str(cache))
    return cache


def s3(bucket_url: str) -> Any:
    return remote.open_remote(bucket_url).fs


def keys(url: str) -> set[str]:
    r = remote.open_remote(url)
    return {name[len(r.root) + 1 :] for name in r.fs.find(r.root)}


def save_to(url: str, source: Path = FIXTURES / "autosave_pt" / "autosave") -> dict[str, Any]:
    return run_json("checkpoint", "save", source, url, "--window", "0")


# ------------------------------------------------------------------ URLs and options
def test_urls_and_local_paths() -> None:
    assert remote.is_url("s3://b/x") and remote.is_url("memory://x") and remote.is_url("gs://b")
    assert not remote.is_url("file:///tmp/x") and not remote.is_url("/tmp/x") and not remote.is_url("x")
    assert remote.local_path("file:///tmp/a%20b") == Path("/tmp/a b")


def test_storage_options_parse_json_where_they_can() -> None:
    got = remote.parse_storage_options(
        ["anon=false", "endpoint_url=http://h:1", "client_kwargs.region_name=x"]
    )
    assert got == {"anon": False, "endpoint_url": "http://h:1", "client_kwargs": {"region_name": "x"}}
    with pytest.raises(Exception, match="key=value"):
        remote.parse_storage_options(["novalue"])


def test_storage_option_endpoint_reaches_the_server(
    bucket: str, s3_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    url, option = f"{bucket}/ckpt", f"endpoint_url={s3_server}"
    doc = run_json(
        "checkpoint", "save", FIXTURES / "autosave_pt" / "autosave", url, "--storage-option", option
    )
    assert doc["out"] == url
    r = remote.open_remote(url, {"endpoint_url": s3_server})
    assert r.fs.exists(r.key(remote.MARKER))
    assert run_json("verify", url, "--deep", "--storage-option", option)["ok"] is True


# ------------------------------------------------------------------ writing
def test_save_uploads_objects_then_marker_and_it_verifies(bucket: str) -> None:
    url = f"{bucket}/ckpt"
    doc = save_to(url)
    assert doc["out"] == url
    names = keys(url)
    assert remote.MARKER in names and remote.PENDING not in names
    assert {"metadata.json", "trajectory_index.json"} <= names
    marker = json.loads(s3(bucket).cat_file(f"{bucket[5:]}/ckpt/{remote.MARKER}"))
    assert marker["format"] == "rbtool-upload" and set(marker["files"]) == names - {remote.MARKER}
    local = FIXTURES / "autosave_pt" / "autosave"
    for name, entry in marker["files"].items():
        if name.startswith("trajectory_") and name.endswith(".pt"):
            assert entry["size"] == (local / name).stat().st_size
    # hard-linked files' link records (local inodes) are not uploaded
    index = json.loads(s3(bucket).cat_file(f"{bucket[5:]}/ckpt/trajectory_index.json"))
    assert index["trajectory_index"] and not any("link" in e for e in index["trajectory_index"].values())
    assert run_json("verify", url)["ok"] is True
    assert run_json("verify", url, "--deep")["ok"] is True


def test_existing_complete_checkpoint_needs_force(bucket: str) -> None:
    url = f"{bucket}/ckpt"
    save_to(url)
    assert_one_error(run("checkpoint", "save", FIXTURES / "autosave_pt" / "autosave", url))
    doc = run_json("checkpoint", "save", FIXTURES / "varying_shapes_pt" / "autosave", url, "--force")
    assert doc["out"] == url
    # objects of the replaced checkpoint are gone; the marker lists exactly what is there
    local = {p.name for p in (FIXTURES / "varying_shapes_pt" / "autosave").glob("trajectory_*.pt")}
    assert {n for n in keys(url) if n.endswith(".pt")} == local


def test_objects_that_are_not_a_checkpoint_are_never_replaced(bucket: str) -> None:
    s3(bucket).pipe_file(f"{bucket[5:]}/other/notes.txt", b"x")
    src = FIXTURES / "autosave_pt" / "autosave"
    for force in ([], ["--force"]):
        result = run("checkpoint", "save", src, f"{bucket}/other", *force)
        assert_one_error(result)
        assert "not a checkpoint" in result.stderr
    assert keys(f"{bucket}/other") == {"notes.txt"}


def test_a_checkpoint_another_tool_uploaded_is_replaced_only_with_force(bucket: str) -> None:
    fs = s3(bucket)
    for p in (FIXTURES / "ranks" / "rank_0").iterdir():
        fs.put_file(str(p), f"{bucket[5:]}/plain/rank_0/{p.name}")
    src = FIXTURES / "autosave_pt" / "autosave"
    result = run("checkpoint", "save", src, f"{bucket}/plain")
    assert_one_error(result)
    assert "--force" in result.stderr  # the hint of the option that answers it
    doc = run_json("checkpoint", "save", src, f"{bucket}/plain", "--force")
    assert doc["upload"]["removed"] == len(list((FIXTURES / "ranks" / "rank_0").iterdir()))
    assert not any(n.startswith("rank_0/") for n in keys(f"{bucket}/plain"))


def test_shard_reshard_merge_filter_convert_to_and_from_urls(bucket: str, tmp_path: Path) -> None:
    src = FIXTURES / "autosave_pt" / "autosave"
    local = run_json("shard", src, "-n", "2", "--out", tmp_path / "local_shards")
    shards = run_json("shard", src, "-n", "2", "--out", f"{bucket}/shards")
    assert shards["out"] == f"{bucket}/shards"
    assert [r["trajectory_id_list"] for r in shards["ranks"]] == [
        r["trajectory_id_list"] for r in local["ranks"]
    ]
    assert shards["ranks"][1]["path"] == f"{bucket}/shards/rank_1"
    # a rank directory of an uploaded tree is covered by the tree's marker
    assert run_json("verify", f"{bucket}/shards/rank_1", "--deep")["ok"] is True

    stats = run_json("stats", f"{bucket}/shards")
    assert stats["rank_dirs"] == [f"{bucket}/shards/rank_0", f"{bucket}/shards/rank_1"]
    re3 = run_json("reshard", f"{bucket}/shards", "-n", "3", "--out", f"{bucket}/re3")
    assert re3["source"] == f"{bucket}/shards" and len(re3["ranks"]) == 3
    merged = run_json("merge", f"{bucket}/re3", "--out", f"{bucket}/merged")
    assert merged["inputs"][0] == f"{bucket}/re3/rank_0"
    assert run_json("diff", src, f"{bucket}/merged")["equal"] is True

    kept = run_json("filter", f"{bucket}/merged", "--out", f"{bucket}/last2", "--last", "2")
    assert kept["size"] == 2
    converted = run_json("convert", f"{bucket}/last2", "--out", f"{bucket}/pkl", "--format", "pkl")
    assert converted["trajectory_format"] == "pkl"
    assert run_json("verify", f"{bucket}/pkl", "--deep")["ok"] is True
    back = run_json("convert", f"{bucket}/pkl", "--out", tmp_path / "back", "--format", "pt")
    assert back["source"] == f"{bucket}/pkl"
    assert run_json("diff", f"{bucket}/last2", tmp_path / "back", "--deep")["equal"] is True


def test_dry_runs_upload_nothing(bucket: str) -> None:
    url = f"{bucket}/dry"
    run_json("reshard", FIXTURES / "ranks", "-n", "3", "--out", url, "--dry-run")
    run_json("filter", FIXTURES / "ranks", "--out", url, "--last", "1", "--dry-run")
    assert keys(url) == set()


def test_every_writer_dry_runs_to_a_url_as_it_would_write_it(bucket: str) -> None:
    """A dry run checks the URL as the real run would, names it, and uploads nothing."""
    src, url = FIXTURES / "autosave_pt" / "autosave", f"{bucket}/dry"
    runs = [
        ["checkpoint", "save", src, url, "--window", "0"],
        ["shard", src, "-n", "2", "--out", url],
        ["merge", FIXTURES / "ranks", "--out", url],
        ["convert", src, "--out", url, "--format", "pkl"],
    ]
    for argv in runs:
        doc = run_json(*argv, "--dry-run")
        assert doc["dry_run"] is True and doc["out"] == url and doc["files"] is None
        human = run(*argv, "--dry-run")
        assert human.exit_code == 0, human.stderr
        assert human.stdout.splitlines()[-1].startswith(f"dry run: would write {url} (")
    assert keys(url) == set()
    save_to(url)
    before = keys(url)
    for argv in runs:  # a checkpoint is there now: refused without --force, as a real run is
        result = run(*argv, "--dry-run")
        assert_one_error(result)
        assert "already holds a checkpoint" in result.stderr
        assert run(*argv, "--dry-run", "--force").exit_code == 0
    assert keys(url) == before


def test_a_dry_run_from_a_url_reads_only_its_json_objects(bucket: str) -> None:
    url = f"{bucket}/ckpt"
    save_to(url)
    fs, root = s3(bucket), f"{bucket[5:]}/ckpt"
    local = FIXTURES / "autosave_pt" / "autosave"
    for name in keys(url):  # every trajectory object unreadable (same size): a dry run cannot notice
        if name.endswith(".pt"):
            fs.pipe_file(f"{root}/{name}", b"\0" * (local / name).stat().st_size)
    forget_etags(url)  # (their ETags would tell: tests/test_remote_hostile.py)
    for argv in (["shard", url, "-n", "2"], ["merge", url], ["convert", url, "--format", "pkl"]):
        doc = run_json(*argv, "--out", f"{bucket}/out", "--dry-run")
        assert doc["dry_run"] is True and doc["upload"] == {
            "uploaded": 0,
            "kept": 0,
            "removed": 0,
            "bytes": 0,
        }
    assert run("shard", url, "-n", "2", "--out", f"{bucket}/out").exit_code == 1  # the real run does


def test_the_human_view_of_a_remote_write_says_what_was_uploaded(bucket: str, tmp_path: Path) -> None:
    src, url = FIXTURES / "autosave_pt" / "autosave", f"{bucket}/shards"
    result = run("shard", src, "-n", "2", "--out", url)
    assert result.exit_code == 0, result.stderr
    assert f"into {url}" in result.stdout
    marker = json.loads(s3(bucket).cat_file(f"{bucket[5:]}/shards/{remote.MARKER}"))["files"]
    uploaded = _iec(sum(entry["size"] for entry in marker.values()))
    assert result.stdout.splitlines()[-1] == (
        f"upload: {len(marker)} objects uploaded ({uploaded}), 0 kept, 0 removed"
    )
    local = run("shard", src, "-n", "2", "--out", tmp_path / "local")
    assert local.exit_code == 0 and "upload:" not in local.stdout


def _iec(n: int) -> str:
    from rbtool.cli._output import size

    return size(n)


def test_verify_and_stats_take_several_paths_urls_among_them(bucket: str) -> None:
    src, url = FIXTURES / "autosave_pt" / "autosave", f"{bucket}/ckpt"
    save_to(url)
    doc = run_json("verify", src, url)
    assert doc["ok"] is True and [d["path"] for d in doc["paths"]] == [str(src), url]
    stats = run_json("stats", url, src, "--index-only")
    assert [d["path"] for d in stats["paths"]] == [url, str(src)]
    missing = run("stats", url, f"{bucket}/none", "--index-only", "--json")
    assert missing.exit_code == 1
    got = json.loads(missing.stdout)
    assert got["ok"] is False and got["paths"][0]["path"] == url and "error" in got["paths"][1]
    human = run("verify", url, src)
    assert human.exit_code == 0 and f"OK {url}" in human.stdout


def test_remote_sample_says_what_it_fetched(bucket: str) -> None:
    url = f"{bucket}/ckpt"
    save_to(url)
    doc = run_json("sample", url, "--num-chunks", "2", "--seed", "5")
    result = run("sample", url, "--num-chunks", "2", "--seed", "5")
    assert result.exit_code == 0, result.stderr
    fetched = doc["fetched"]
    assert f"fetched {fetched['objects']} object" in result.stdout and _iec(fetched["bytes"]) in result.stdout


# ------------------------------------------------------------------ reading
def test_index_only_commands_read_only_the_json_objects(bucket: str) -> None:
    url = f"{bucket}/ckpt"
    save_to(url)
    local = FIXTURES / "autosave_pt" / "autosave"
    # corrupt every trajectory object (same size): index-only commands cannot notice, data commands do
    fs, root = s3(bucket), f"{bucket[5:]}/ckpt"
    for name in keys(url):
        if name.endswith(".pt"):
            fs.pipe_file(f"{root}/{name}", b"\0" * (local / name).stat().st_size)
    forget_etags(url)  # (their ETags would tell: tests/test_remote_hostile.py)
    assert run_json("stats", url, "--index-only")["path"] == url
    assert run_json("checkpoint", "load", url, "-n", "2")["checkpoint"] == url
    assert run_json("verify", url)["ok"] is True
    result = run("verify", url, "--deep", "--json")
    assert result.exit_code == 1 and "sha256" in result.stderr


def test_data_commands_match_local_results(bucket: str) -> None:
    src = FIXTURES / "autosave_pt" / "autosave"
    url = f"{bucket}/ckpt"
    save_to(url)
    local_stats, remote_stats = run_json("stats", src), run_json("stats", url)
    assert remote_stats["path"] == url
    for doc in (local_stats, remote_stats):
        doc.pop("path")
        for timing in ("seconds", "bytes_per_second"):
            doc["data"].pop(timing, None)
    assert remote_stats == local_stats
    a = run_json("sample", src, "--num-chunks", "5", "--seed", "3")
    b = run_json("sample", url, "--num-chunks", "5", "--seed", "3")
    assert b["path"] == url and a["draws"] == b["draws"] and a["fields"] == b["fields"]
    # a second read uses the verified copies in the cache
    assert run_json("sample", url, "--num-chunks", "5", "--seed", "3")["draws"] == a["draws"]


def test_the_cache_is_bounded(bucket: str, monkeypatch: pytest.MonkeyPatch, _cache: Path) -> None:
    first, second = f"{bucket}/one", f"{bucket}/two"
    save_to(first)
    save_to(second)
    size = sum(remote.inspect(first).sizes.values())
    monkeypatch.setenv("RBTOOL_CACHE_BYTES", str(size + size // 2))
    run_json("stats", first)
    run_json("stats", second)
    assert len(list(_cache.glob("mirror-*"))) == 1  # the first was removed to fit the second
    monkeypatch.setenv("RBTOOL_CACHE_BYTES", str(size // 2))
    # diff needs every object at once (stats streams its pass: tests/test_remote_stream.py)
    result = run("diff", first, second)
    assert_one_error(result)
    assert "RBTOOL_CACHE_BYTES" in result.stderr


def test_a_missing_or_resized_object_is_refused(bucket: str) -> None:
    url = f"{bucket}/ckpt"
    save_to(url)
    fs, root = s3(bucket), f"{bucket[5:]}/ckpt"
    victim = sorted(n for n in keys(url) if n.endswith(".pt"))[0]
    fs.pipe_file(f"{root}/{victim}", b"short")
    result = run("stats", url, "--index-only")
    assert_one_error(result)
    assert victim in result.stderr


def test_a_checkpoint_another_tool_uploaded_is_read_without_a_marker(bucket: str) -> None:
    src = FIXTURES / "autosave_pt" / "autosave"
    fs = s3(bucket)
    for p in src.iterdir():
        fs.put_file(str(p), f"{bucket[5:]}/plain/{p.name}")
    assert run_json("verify", f"{bucket}/plain", "--deep")["ok"] is True
    assert run_json("stats", f"{bucket}/plain", "--index-only")["path"] == f"{bucket}/plain"


def test_no_such_remote_checkpoint(bucket: str) -> None:
    assert_one_error(run("stats", f"{bucket}/nothing", "--index-only"))


def test_ingest_refuses_a_remote_buffer(bucket: str, five_files: list[Path]) -> None:
    result = run("ingest", *five_files, "--buffer", f"{bucket}/buf")
    assert_one_error(result, 2)
    assert "checkpoint save" in result.stderr


# ------------------------------------------------------------------ a killed upload
def _big_checkpoint(root: Path, n: int = 30) -> Path:
    """A local checkpoint large enough that an upload is still under way when it is killed."""
    import torch

    loose = root / "loose"
    loose.mkdir()
    for i in range(n):
        torch.save(make_traj(t=8, b=4, seed=i, image=64, model_weights_id=f"w{i}"), loose / f"t{i}.pt")
    assert run("checkpoint", "save", loose, root / "ckpt", "--window", "0").exit_code == 0
    return root / "ckpt"


def test_a_killed_upload_is_refused_then_a_rerun_completes_it(
    bucket: str, tmp_path: Path, _cache: Path
) -> None:
    ckpt = _big_checkpoint(tmp_path)
    url = f"{bucket}/killed"
    argv = ["checkpoint", "save", str(ckpt), url, "--window", "0", "--json"]
    # `rbtool checkpoint save` in a subprocess whose uploads stop for good after the third
    # object is up (each put still goes to the server): the kill lands mid-upload, before the
    # index, the metadata and the marker.
    code = (
        "import runpy, sys, threading\n"
        "import s3fs\n"
        "put, done, lock = s3fs.S3FileSystem.put_file, [0], threading.Lock()\n"
        "def stalled(self, *a, **k):\n"
        "    put(self, *a, **k)\n"
        "    with lock:\n"
        "        done[0] += 1\n"
        "        if done[0] == 3:\n"
        "            print('three up', flush=True)\n"
        "    if done[0] >= 3:\n"
        "        threading.Event().wait()\n"
        "s3fs.S3FileSystem.put_file = stalled\n"
        f"sys.argv = ['rbtool', *{argv!r}]\n"
        "runpy.run_module('rbtool', run_name='__main__')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "three up\n"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    names = keys(url)
    assert remote.PENDING in names and remote.MARKER not in names
    assert "metadata.json" not in names
    up_before = {n for n in names if n.endswith(".pt")}
    assert len(up_before) >= 3
    for command in (
        ["stats", url, "--index-only"],
        ["checkpoint", "load", url],
        ["sample", url, "--num-chunks", "2"],
    ):
        result = run(*command)
        assert_one_error(result)
        assert "incomplete upload" in result.stderr and "rerun the command" in result.stderr
    verify = run("verify", url)
    assert verify.exit_code == 1 and "incomplete upload" in verify.stderr

    # the same command again, without --force: it continues the upload
    doc = run_json(*argv[:-1])
    total = len(list(ckpt.iterdir()))
    assert doc["upload"]["kept"] >= len(up_before)
    assert doc["upload"]["uploaded"] + doc["upload"]["kept"] == total
    assert remote.PENDING not in keys(url)
    assert run_json("verify", url, "--deep")["ok"] is True
    assert run_json("diff", ckpt, url)["equal"] is True
    assert not list(_cache.rglob("*rbtool-staging*"))  # the killed run's staging is gone too


def test_ctrl_c_mid_upload_says_what_readers_see_then_a_rerun_completes_it(
    bucket: str, tmp_path: Path, _cache: Path
) -> None:
    ckpt = _big_checkpoint(tmp_path)
    url = f"{bucket}/interrupted"
    argv = ["checkpoint", "save", str(ckpt), url, "--window", "0"]
    # Each put after the third is slowed, so SIGINT lands while trajectory objects go up.
    code = (
        "import runpy, sys, threading, time\n"
        "import s3fs\n"
        "put, done, lock = s3fs.S3FileSystem.put_file, [0], threading.Lock()\n"
        "def slowed(self, *a, **k):\n"
        "    put(self, *a, **k)\n"
        "    with lock:\n"
        "        done[0] += 1\n"
        "        if done[0] == 3:\n"
        "            print('three up', flush=True)\n"
        "    if done[0] >= 3:\n"
        "        time.sleep(0.05)\n"
        "s3fs.S3FileSystem.put_file = slowed\n"
        f"sys.argv = ['rbtool', *{argv!r}]\n"
        "runpy.run_module('rbtool', run_name='__main__')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=sigint_default,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "three up\n"
    os.kill(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert stderr.splitlines()[-1] == (
        f"interrupted: {url} holds no new checkpoint unless its upload had finished; readers refuse "
        "a cut-short upload, and running the command again completes it"
    )
    names = keys(url)
    assert remote.PENDING in names and remote.MARKER not in names
    assert "incomplete upload" in run("verify", url).stderr
    assert not list(_cache.rglob("*rbtool-staging*"))  # the interrupted run removed its staging
    doc = run_json(*argv)
    assert doc["upload"]["kept"] >= 3
    assert run_json("diff", ckpt, url)["equal"] is True


def test_a_failed_command_uploads_nothing(bucket: str, tmp_path: Path) -> None:
    result = run("shard", tmp_path / "missing", "-n", "2", "--out", f"{bucket}/x")
    assert_one_error(result)
    assert keys(f"{bucket}/x") == set()


def test_export_reads_a_remote_checkpoint(bucket: str, tmp_path: Path) -> None:
    src = FIXTURES / "autosave_pt" / "autosave"
    url = f"{bucket}/ckpt"
    save_to(url)
    local = run_json("export", src, tmp_path / "a", "--to", "lerobot", "--fps", "10")
    got = run_json("export", url, tmp_path / "b", "--to", "lerobot", "--fps", "10")
    assert got["source"] == url
    assert (got["episodes"], got["frames"], got["features"]) == (
        local["episodes"],
        local["frames"],
        local["features"],
    )


def test_sample_fetches_only_the_drawn_trajectories(bucket: str, tmp_path: Path) -> None:
    import torch
    from conftest import assert_batches_equal

    ckpt = _big_checkpoint(tmp_path)
    url = f"{bucket}/big"
    run_json("checkpoint", "save", ckpt, url, "--window", "0")
    args = ["--num-chunks", "3", "--seed", "11"]
    local = run_json("sample", ckpt, *args, "--out", tmp_path / "a.pt")
    got = run_json("sample", url, *args, "--out", tmp_path / "b.pt")
    assert local["fetched"] is None
    assert got["draws"] == local["draws"] and got["fields"] == local["fields"]
    drawn = set(got["draws"]["trajectory_id"])
    assert got["fetched"]["objects"] == len(drawn) < 30
    assert_batches_equal(torch.load(tmp_path / "b.pt"), torch.load(tmp_path / "a.pt"))
    # top-k reads the window's rewards: every object is fetched
    topk = run_json("sample", url, "--num-chunks", "3", "--strategy", "topk", "--k", "5")
    assert topk["fetched"]["objects"] == 30


def test_remote_sources_of_save_ingest_and_load(bucket: str, tmp_path: Path, five_files: list[Path]) -> None:
    src = FIXTURES / "autosave_pt" / "autosave"
    url = f"{bucket}/buf"
    save_to(url)
    local = run_json("checkpoint", "save", src, tmp_path / "a", "--window", "2")
    got = run_json("checkpoint", "save", url, tmp_path / "b", "--window", "2")
    assert (got["mode"], got["trajectory_id_list"]) == (local["mode"], local["trajectory_id_list"])
    added = run_json("ingest", url, "--buffer", tmp_path / "buffer")
    assert added["added"] == len(remote.inspect(url).sizes) - 2  # every trajectory object
    again = run_json("ingest", url, "--buffer", tmp_path / "buffer")  # each one already there
    assert again["added"] == 0 and len(again["skipped"]) == added["added"]
    assert all(s["source"].startswith(f"{url}/trajectory_") for s in again["skipped"])  # not the cache
    human = run("ingest", url, "--buffer", tmp_path / "buffer")
    assert f"skipped {url}/trajectory_" in human.stdout and str(remote.cache_root()) not in human.stdout
    restored = run_json("checkpoint", "load", url, "--buffer", tmp_path / "restored")
    assert restored["checkpoint"] == url and restored["restored_to"] == str(tmp_path / "restored")
    assert run_json("verify", tmp_path / "restored", "--deep")["ok"] is True


@pytest.mark.parametrize("command", ["stats", "verify"])
def test_a_report_of_a_url_at_a_terminal_leaves_no_fetching_bar_behind(
    command: str, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"{bucket}/ckpt"
    save_to(url)
    monkeypatch.setenv("RBTOOL_CACHE_DIR", str(tmp_path / "cache"))  # fetched in the run shown
    argv = [command, url, *(["--deep"] if command == "verify" else [])]
    status, shown = at_terminal(argv, tmp_path)
    lines = screen(shown)
    assert status == 0 and "fetching" in shown
    assert not [line for line in lines if "eta" in line or "\u2501" in line], lines
    assert lines[0].startswith(("OK ", url[:30])), lines[:3]


def test_cached_copies_are_reused_until_changed(bucket: str, tmp_path: Path) -> None:
    url = f"{bucket}/ckpt"
    save_to(url)
    calls: list[int] = []
    with remote.data_mirror(url, progress=calls.append):
        pass
    first = len(calls)
    assert first == len(remote.inspect(url).sizes)
    with remote.data_mirror(url, progress=calls.append):
        pass
    assert len(calls) == first  # nothing fetched again
    # an output is a copy of its own, never linked to the cache: writing it in place leaves
    # the cached copy as it was, and nothing is fetched again
    run_json("shard", url, "-n", "1", "--out", tmp_path / "shards")
    victim = sorted((tmp_path / "shards" / "rank_0").glob("trajectory_*.pt"))[0]
    assert victim.stat().st_nlink == 1
    with open(victim, "r+b") as f:
        f.write(b"\0" * 16)
    assert run_json("verify", url, "--deep")["ok"] is True
    with remote.data_mirror(url, progress=calls.append):
        pass
    assert len(calls) == first


def test_a_replacement_that_fails_midway_leaves_nothing_that_verifies(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import s3fs

    url = f"{bucket}/ckpt"
    save_to(url)
    put, done = s3fs.S3FileSystem.put_file, [0]

    def failing(self: Any, *args: Any, **kwargs: Any) -> Any:
        done[0] += 1
        if done[0] > 2:
            raise OSError(28, "No space left on device")  # the store fails after two objects
        return put(self, *args, **kwargs)

    # filesystems made from now on upload through `failing` (cached ones kept their methods)
    monkeypatch.setattr(s3fs.S3FileSystem, "put_file", failing)
    s3fs.S3FileSystem.clear_instance_cache()
    result = run("checkpoint", "save", FIXTURES / "varying_shapes_pt" / "autosave", url, "--force")
    assert_one_error(result)
    assert "upload failed (No space left on device); rerun the command" in result.stderr
    monkeypatch.setattr(s3fs.S3FileSystem, "put_file", put)
    s3fs.S3FileSystem.clear_instance_cache()
    assert remote.MARKER not in keys(url)  # the old checkpoint's marker went first
    verify = run("verify", url)
    assert verify.exit_code == 1 and "incomplete upload" in verify.stderr
    assert run_json("checkpoint", "save", FIXTURES / "varying_shapes_pt" / "autosave", url)["upload"]
    assert run_json("verify", url, "--deep")["ok"] is True


@pytest.mark.parametrize(
    "argv",
    [
        ["repair", "RANKS", "--out", "s3://b/x"],
        ["repair", "s3://b/x", "--out", "out"],
        ["sample", "RANKS", "--num-chunks", "2", "--out", "s3://b/x.pt"],
        ["checkpoint", "load", "RANKS", "--buffer", "s3://b/buf"],
        ["export", "RANKS", "s3://b/ds", "--to", "lerobot", "--fps", "10"],
        ["import", "lerobot", "s3://b/ds", "--buffer", "buf"],
    ],
    ids=["repair-out", "repair-in", "sample-out", "load-buffer", "export-out", "import-in"],
)
def test_paths_without_a_remote_form_refuse_urls(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A URL there is a usage error, never a local directory named `s3:`."""
    monkeypatch.chdir(tmp_path)
    result = run(*[str(FIXTURES / "ranks") if a == "RANKS" else a for a in argv])
    assert result.exit_code == 2 and "takes a local path, not a URL" in result.stderr
    assert not (tmp_path / "s3:").exists()
