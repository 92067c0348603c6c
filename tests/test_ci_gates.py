"""The verdicts CI jobs gate on: diff never says equal for a damaged file it did not read, a rank
tree missing a rank fails verify, format is layout, and errors speak the command line's words."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from conftest import FIXTURES, make_traj, run

from rbtool import TrajectoryReplayBuffer
from rbtool.conversion import convert
from rbtool.dirs import open_view
from rbtool.format import INDEX_FILE

# ------------------------------------------------------------------ sources
# Three kinds of checkpoint: one rbtool saved (sizes and hashes recorded), one rbtool linked
# (sizes recorded, no hashes), and the reference implementation's (nothing recorded).
SOURCES = ["hashed", "sized", "rlinf"]


def make_source(kind: str, where: Path) -> Path:
    out = where / kind
    if kind == "hashed":
        buffer = TrajectoryReplayBuffer(sample_window_size=0)
        buffer.add_trajectories([make_traj(seed=i) for i in range(5)])
        buffer.save_checkpoint(str(out))
        buffer.close()
        return out
    private = where / f"{kind}_source"  # tests damage files in place: never a link to the fixtures
    shutil.copytree(FIXTURES / "autosave_pt" / "autosave", private)
    for p in [private, *private.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    if kind == "sized":
        convert(private, out, "pt")  # linked files, their sizes recorded
        return out
    return private


def file_of(ckpt: Path, tid: int) -> Path:
    (path,) = ckpt.glob(f"trajectory_{tid}_*")
    return path


def edit_entry(ckpt: Path, tid: int, **changes: Any) -> None:
    doc = orjson.loads((ckpt / INDEX_FILE).read_bytes())
    doc["trajectory_index"][str(tid)].update(changes)
    (ckpt / INDEX_FILE).write_bytes(orjson.dumps(doc))


def entry(ckpt: Path, tid: int) -> dict[str, Any]:
    return orjson.loads((ckpt / INDEX_FILE).read_bytes())["trajectory_index"][str(tid)]


def copy_of(a: Path, where: Path) -> Path:
    b = where / "b"
    shutil.copytree(a, b)  # real copies: no file shared with A
    return b


DAMAGED = 2  # not the first trajectory: a shallow diff reads the first one's schema


def truncate(a: Path, b: Path) -> None:
    path = file_of(b, DAMAGED)
    os.truncate(path, path.stat().st_size - 10)


def append(a: Path, b: Path) -> None:
    with open(file_of(b, DAMAGED), "ab") as handle:
        handle.write(b"\0" * 16)


def flip(a: Path, b: Path) -> None:  # same size, one byte in the middle changed
    path = file_of(b, DAMAGED)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def zeros(a: Path, b: Path) -> None:  # same size, nothing left
    path = file_of(b, DAMAGED)
    path.write_bytes(b"\0" * path.stat().st_size)


def swapped(a: Path, b: Path) -> None:  # another trajectory's bytes under this one's name
    target = file_of(b, DAMAGED)
    target.write_bytes(file_of(b, DAMAGED + 1).read_bytes())


def recorded_hash(a: Path, b: Path) -> None:  # B's index records another sha256 than its file's
    edit_entry(b, DAMAGED, sha256="0" * 64)


def recorded_size(a: Path, b: Path) -> None:  # B's index records another size than its file's
    edit_entry(b, DAMAGED, file_bytes=file_of(b, DAMAGED).stat().st_size + 1)


def both_truncated(a: Path, b: Path) -> None:  # the same damage on both sides: the records tell
    truncate(a, b)
    truncate(a, a)


def linked_truncated(a: Path, b: Path) -> None:  # one file under two names, damaged in place
    shared = file_of(b, DAMAGED)
    shared.unlink()
    os.link(file_of(a, DAMAGED), shared)
    truncate(a, a)


DAMAGE: dict[str, Callable[[Path, Path], None]] = {
    f.__name__: f
    for f in (
        truncate,
        append,
        flip,
        zeros,
        swapped,
        recorded_hash,
        recorded_size,
        both_truncated,
        linked_truncated,
    )
}
# damage only a record can tell: for a checkpoint without records, A and B hold the same bytes
NEEDS_RECORDS = {"both_truncated", "linked_truncated"}
# same size, bytes changed, B's entry still records the old sha256: a quick diff does not read
# those bytes, and says so
NOT_READ_QUICKLY = {"flip", "zeros", "swapped"}


def damage_cases() -> Iterator[Any]:
    for kind in SOURCES:
        for name in DAMAGE:
            if name in NEEDS_RECORDS and kind == "rlinf":
                continue
            for deep in (False, True):
                yield pytest.param(kind, name, deep, id=f"{kind}-{name}-{'deep' if deep else 'quick'}")


@pytest.mark.parametrize(("kind", "damage", "deep"), list(damage_cases()))
def test_diff_is_never_equal_for_damage_it_could_see(
    tmp_path: Path, kind: str, damage: str, deep: bool
) -> None:
    a = make_source(kind, tmp_path)
    b = copy_of(a, tmp_path)
    DAMAGE[damage](a, b)
    flags = ["--deep"] if deep else []
    result = run("diff", a, b, *flags, "--json")
    doc = json.loads(result.stdout)
    human = run("diff", a, b, *flags)
    if not deep and kind == "hashed" and damage in NOT_READ_QUICKLY:
        # equal recorded hashes and sizes: the bytes were not read, and the output says so
        assert result.exit_code == 0 and doc["equal"] is True, doc
        assert doc["contents_not_compared"] == 5 - 0 and doc["verdict"] == "equal"
        assert (
            "contents not compared: 5 files (equal recorded hashes, sizes checked); --deep compares them"
            in (human.stdout)
        )
        return
    if deep and kind == "rlinf" and damage == "append":
        # bytes after the zip's end hold no content, and nothing records the size: by content the
        # files are equal, and the other bytes are reported as layout
        assert (
            result.exit_code == 0 and {"key": "file_bytes", "a": None, "b": None, "files": 1} in doc["layout"]
        )
        assert "1 file in the same format holds the same content in other bytes" in human.stdout
        return
    assert result.exit_code == 1, (doc, result.stderr)
    assert doc["equal"] is False and doc["verdict"] == "different"
    changed = {c["trajectory_id"]: c for c in doc["changed"]}
    assert DAMAGED in changed and changed[DAMAGED]["file"] is not None, doc["changed"]
    assert human.exit_code == 1 and human.stdout.startswith("differ"), human.stdout
    assert f"changed {DAMAGED}" in human.stdout


@pytest.mark.parametrize("kind", SOURCES)
@pytest.mark.parametrize("deep", [False, True], ids=["quick", "deep"])
def test_an_undamaged_copy_is_equal_and_says_what_it_did_not_read(
    tmp_path: Path, kind: str, deep: bool
) -> None:
    a = make_source(kind, tmp_path)
    b = copy_of(a, tmp_path)
    flags = ["--deep"] if deep else []
    result = run("diff", a, b, *flags, "--json")
    doc = json.loads(result.stdout)
    assert result.exit_code == 0 and doc["equal"] is True and doc["layout"] == [], doc
    hashed_quick = kind == "hashed" and not deep
    assert doc["contents_not_compared"] == (5 if hashed_quick else 0)
    human = run("diff", a, b, *flags)
    assert human.exit_code == 0 and human.stdout.startswith("equal")
    assert ("contents not compared" in human.stdout) is hashed_quick


def test_a_recorded_size_is_checked_even_on_a_hard_link(tmp_path: Path) -> None:
    a = make_source("hashed", tmp_path)
    b = tmp_path / "linked"
    subprocess.run(["cp", "-al", str(a), str(b)], check=True)
    assert run("diff", a, b).exit_code == 0
    truncate(a, a)  # both names see it
    result = run("diff", a, b, "--json")
    doc = json.loads(result.stdout)
    assert result.exit_code == 1 and doc["changed"][0]["file"] == "file_bytes"
    assert "A records file_bytes" in doc["changed"][0]["detail"]


# ------------------------------------------------------------------ format is layout
LAYOUT_FIXTURES = [
    "autosave_pt/autosave",
    "varying_shapes_pt/ckpt",
    "nested_obs_pt",
    "pkl_format_switch",
    "seedless_pt",
    "ranks",
]


@pytest.mark.parametrize("rel", LAYOUT_FIXTURES)
@pytest.mark.parametrize("view", ["human", "json"])
def test_a_conversion_differs_only_in_layout(tmp_path: Path, rel: str, view: str) -> None:
    source = FIXTURES / rel
    own = open_view(source, check_files=False).index.trajectory_format
    fmt = "pt" if own == "pkl" else "pkl"
    other = tmp_path / "other"
    assert run("convert", source, "--out", other, "--format", fmt).exit_code == 0
    if view == "json":
        result = run("diff", source, other, "--deep", "--json")
        assert result.exit_code == 0, result.stdout
        doc = json.loads(result.stdout)
        assert doc["equal"] is True and doc["metadata"] == [] and doc["changed"] == []
        layout = {item["key"]: (item["a"], item["b"]) for item in doc["layout"]}
        assert layout["trajectory_format"] == (own, fmt)
        quick = run("diff", source, other, "--json")
        assert quick.exit_code == 1 and json.loads(quick.stdout)["verdict"] == "unchecked"
    else:
        result = run("diff", source, other, "--deep")
        assert result.exit_code == 0 and result.stdout.startswith("equal (by content)"), result.stdout
        assert "layout (not a difference): trajectory_format" in result.stdout
        quick = run("diff", source, other)
        assert quick.exit_code == 1 and quick.stdout.startswith("not shown equal")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_checkpoint_against_its_shards_is_layout(tmp_path: Path, n: int) -> None:
    source = FIXTURES / "autosave_pt" / "autosave"
    assert run("shard", source, "-n", n, "--out", tmp_path / "s").exit_code == 0
    result = run("diff", source, tmp_path / "s", "--json")
    doc = json.loads(result.stdout)
    assert result.exit_code == 0 and doc["layout"] == [{"key": "rank_directories", "a": None, "b": n}]
    human = run("diff", source, tmp_path / "s")
    assert human.exit_code == 0 and "layout (not a difference): one directory vs" in human.stdout
