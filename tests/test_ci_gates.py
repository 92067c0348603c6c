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
from conftest import FIXTURES, assert_one_error, make_traj, run

from rbtool import TrajectoryReplayBuffer
from rbtool.files.dirs import open_view
from rbtool.format import INDEX_FILE
from rbtool.ops.conversion import convert

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


# ------------------------------------------------------------------ rank trees
def rank_tree(tmp_path: Path, writer: str, n: int) -> Path:
    source = make_source("hashed", tmp_path)
    tree = tmp_path / "tree"
    result = run(writer, source, "-n", n, "--out", tree)
    assert result.exit_code == 0, result.stderr
    return tree


def missing_cases() -> Iterator[Any]:
    for writer, sizes in (("shard", (2, 3, 4)), ("reshard", (3,))):
        for n in sizes:
            for r in range(n):
                for deep in (False, True):
                    yield pytest.param(
                        writer, n, r, deep, id=f"{writer}-{n}-rank_{r}-{'deep' if deep else 'quick'}"
                    )


@pytest.mark.parametrize(("writer", "n", "gone", "deep"), list(missing_cases()))
def test_verify_fails_for_a_rank_the_tree_records_but_lacks(
    tmp_path: Path, writer: str, n: int, gone: int, deep: bool
) -> None:
    tree = rank_tree(tmp_path, writer, n)
    shutil.rmtree(tree / f"rank_{gone}")
    flags = ["--deep"] if deep else []
    result = run("verify", tree, *flags, "--json")
    assert result.exit_code == 1, result.stdout
    doc = json.loads(result.stdout)
    assert doc["ok"] is False
    failed = [c for c in doc["checkpoints"] if not c["ok"]]
    assert [c["path"] for c in failed] == [str(tree / f"rank_{gone}")]
    assert [p["code"] for p in failed[0]["problems"]] == ["rank_missing"]
    assert f"rank_{gone}: missing" in failed[0]["problems"][0]["message"]
    assert f"world size {n}" in failed[0]["problems"][0]["message"]
    assert [Path(c["path"]).name for c in doc["checkpoints"]] == [f"rank_{r}" for r in range(n)]
    human = run("verify", tree, *flags)
    assert human.exit_code == 1
    assert f"FAILED {tree / f'rank_{gone}'} (missing; 1 error)" in " ".join(human.stdout.split())
    assert human.stderr.strip() == f"Error: {tree}: verification failed with 1 error: rank_missing x1"


@pytest.mark.parametrize("deep", [False, True], ids=["quick", "deep"])
def test_verify_names_every_missing_rank(tmp_path: Path, deep: bool) -> None:
    tree = rank_tree(tmp_path, "shard", 4)
    for r in (1, 3):
        shutil.rmtree(tree / f"rank_{r}")
    doc = json.loads(run("verify", tree, *(["--deep"] if deep else []), "--json").stdout)
    codes = {Path(c["path"]).name: [p["code"] for p in c["problems"]] for c in doc["checkpoints"]}
    assert codes == {"rank_0": [], "rank_1": ["rank_missing"], "rank_2": [], "rank_3": ["rank_missing"]}


@pytest.mark.parametrize("deep", [False, True], ids=["quick", "deep"])
def test_verify_fails_for_a_renamed_rank(tmp_path: Path, deep: bool) -> None:
    tree = rank_tree(tmp_path, "shard", 3)
    shutil.rmtree(tree / "rank_1")
    (tree / "rank_2").rename(tree / "rank_1")  # two directories, numbered 0 and 1, as if complete
    result = run("verify", tree, *(["--deep"] if deep else []), "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    codes = {Path(c["path"]).name: [p["code"] for p in c["problems"]] for c in doc["checkpoints"]}
    # rank_1 holds rank 2: rank 1's trajectories are what is missing
    assert codes == {"rank_0": [], "rank_1": ["rank_misplaced", "rank_missing"]}


@pytest.mark.parametrize("deep", [False, True], ids=["quick", "deep"])
def test_a_complete_tree_and_ranks_without_records_still_pass(tmp_path: Path, deep: bool) -> None:
    flags = ["--deep"] if deep else []
    assert run("verify", rank_tree(tmp_path, "shard", 3), *flags).exit_code == 0
    assert run("verify", FIXTURES / "ranks", *flags).exit_code == 0  # the reference's: nothing recorded


# ------------------------------------------------------------------ a rank split again
def shard_tree(tmp_path: Path, n: int) -> Path:
    tree = tmp_path / "tree"
    assert run("shard", make_source("hashed", tmp_path), "-n", n, "--out", tree).exit_code == 0
    return tree


@pytest.mark.parametrize(("n", "r"), [(n, r) for n in (2, 3, 4) for r in range(n)])
@pytest.mark.parametrize("view", ["human", "json"])
def test_loading_a_rank_by_its_own_world_size_warns(tmp_path: Path, n: int, r: int, view: str) -> None:
    tree = shard_tree(tmp_path, n)
    json_flag = ["--json"] if view == "json" else []
    result = run("checkpoint", "load", tree / f"rank_{r}", "--world-size", n, "--rank", r, *json_flag)
    assert result.exit_code == 0, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Warning: "), result.stderr
    assert f"is already rank {r} of world size {n}" in lines[0]
    size = len(orjson.loads((tree / f"rank_{r}" / INDEX_FILE).read_bytes())["trajectory_id_list"])
    assert f"of its {size})" in lines[0] and "not rank" in lines[0]
    every = run("checkpoint", "load", tree / f"rank_{r}", "--world-size", n, *json_flag)
    assert every.exit_code == 0 and f"is already rank {r} of world size {n}" in every.stderr


def test_a_rank_loaded_whole_or_a_checkpoint_split_gives_no_such_warning(tmp_path: Path) -> None:
    tree = shard_tree(tmp_path, 3)
    assert run("checkpoint", "load", tree / "rank_1").stderr == ""
    assert run("checkpoint", "load", tree, "-n", 3, "-r", 1).stderr == ""
    assert run("checkpoint", "load", tmp_path / "hashed", "-n", 3, "-r", 1).stderr == ""
    other = run("checkpoint", "load", tree / "rank_1", "-n", 2, "-r", 1)
    assert "written as rank 1 of world size 3" in other.stderr  # another world size: its own warning


# ------------------------------------------------------------------ options in the user's words
OPTION_ERRORS = [
    (["-n", "2", "-r", "5"], "--rank 5 is out of range for --world-size 2; give 0 to 1"),
    (["--world-size", "2", "--rank", "2"], "--rank 2 is out of range for --world-size 2; give 0 to 1"),
    (["-n", "1", "-r", "1"], "--rank 1 is out of range for --world-size 1; give 0"),
    (["-n", "3", "-r", "99", "--buffer", "BUF"], "--rank 99 is out of range for --world-size 3; give 0 to 2"),
    (["-r", "1"], "--rank 1 needs --world-size"),
    (["--rank", "0", "--buffer", "BUF"], "--rank 0 needs --world-size"),
    (["-n", "2", "--buffer", "BUF"], "--buffer restores one rank's block of --world-size 2: give --rank too"),
]


@pytest.mark.parametrize(("args", "message"), OPTION_ERRORS, ids=[" ".join(a) for a, _ in OPTION_ERRORS])
def test_rank_option_errors_name_the_options(tmp_path: Path, args: list[str], message: str) -> None:
    source = make_source("hashed", tmp_path)
    given = [str(tmp_path / "buf") if a == "BUF" else a for a in args]
    result = run("checkpoint", "load", source, *given)
    assert_one_error(result, 2)
    assert result.stderr.strip() == f"Error: {message}" or message in result.stderr, result.stderr
    for word in ("world_size", "rank must", "give both"):
        assert word not in result.stderr
    assert not (tmp_path / "buf").exists()


TYPER_RANGES = [
    (["checkpoint", "load", "SRC", "-n", "0"], "'--world-size' / '-n': 0 is too small; give 1 or more"),
    (
        ["checkpoint", "load", "SRC", "-n", "2", "-r", "-1"],
        "'--rank' / '-r': -1 is too small; give 0 or more",
    ),
    (["shard", "SRC", "-n", "0", "--out", "OUT"], "'--world-size' / '-n': 0 is too small"),
    (["reshard", "SRC", "-n", "0", "--out", "OUT"], "'--world-size' / '-n': 0 is too small"),
    (["sample", "SRC", "--num-chunks", "0"], "'--num-chunks': 0 is too small"),
    (["stats", "SRC", "--bins", "0"], "'--bins': 0 is too small"),
    (["filter", "SRC", "--last", "-1", "--out", "OUT"], "'--last': -1 is too small"),
]


@pytest.mark.parametrize(
    ("args", "message"), TYPER_RANGES, ids=[" ".join(a[:1] + a[2:4]) for a, _ in TYPER_RANGES]
)
def test_option_range_errors_name_the_option(tmp_path: Path, args: list[str], message: str) -> None:
    source = make_source("hashed", tmp_path)
    given = [str(source) if a == "SRC" else str(tmp_path / "out") if a == "OUT" else a for a in args]
    result = run(*given)
    assert result.exit_code == 2 and message in result.stderr, result.stderr
    assert "world_size" not in result.stderr and "num_chunks" not in result.stderr


# ------------------------------------------------------------------ a read-only output
@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    """A directory on a read-only file system (a small tmpfs mounted ro; permission bits do not stop
    root); skipped where nothing can be mounted."""
    place = tmp_path / "ro"
    place.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(place)], capture_output=True, text=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {made.stderr.strip()}")
    try:
        yield place
    finally:
        subprocess.run(["umount", str(place)], check=False)


WRITERS = {
    "shard": lambda src, out: ["shard", src, "-n", "2", "--out", out],
    "reshard": lambda src, out: ["reshard", src, "-n", "2", "--out", out],
    "convert": lambda src, out: ["convert", src, "--out", out, "--format", "pkl"],
    "filter": lambda src, out: ["filter", src, "--last", "2", "--out", out],
    "merge": lambda src, out: ["merge", src, src, "--out", out],
    "checkpoint save": lambda src, out: ["checkpoint", "save", src, out],
    "checkpoint load --buffer": lambda src, out: ["checkpoint", "load", src, "--buffer", out],
    "repair": lambda src, out: ["repair", src, "--out", out],
    "ingest": lambda src, out: ["ingest", *sorted(str(f) for f in Path(src).glob("*.pt")), "--buffer", out],
    "export": lambda src, out: ["export", src, out, "--to", "lerobot", "--fps", "10"],
    "sample --out": lambda src, out: ["sample", src, "--num-chunks", "2", "--out", out],
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
@pytest.mark.parametrize("nested", [False, True], ids=["out", "out-in-a-new-folder"])
def test_a_read_only_output_is_named_as_given(
    tmp_path: Path, read_only: Path, writer: str, nested: bool
) -> None:
    source = make_source("hashed", tmp_path)
    out = read_only / "new" / "shards" if nested else read_only / "shards"
    result = run(*WRITERS[writer](str(source), str(out)))
    assert_one_error(result)
    assert ".rbtool-staging-" not in result.stderr, result.stderr
    shown = out.parent if nested else out  # a missing parent is the first thing that cannot be made
    assert result.stderr.startswith(f"Error: {shown}: Read-only file system"), result.stderr


# ------------------------------------------------------------------ renumbered ids are said
def colliding_tree(tmp_path: Path, n: int) -> Path:
    """n rank directories holding the same ids (each a copy of one checkpoint): the merge renumbers."""
    source = make_source("hashed", tmp_path)
    tree = tmp_path / "colliding"
    for r in range(n):
        shutil.copytree(source, tree / f"rank_{r}")
    return tree


TREES = ["reference", "copies-2", "copies-3"]


def a_tree(tmp_path: Path, kind: str) -> tuple[Path, int]:
    if kind == "reference":
        return FIXTURES / "ranks", 6
    n = int(kind.split("-")[1])
    return colliding_tree(
        tmp_path, n
    ), 5 * n - 1  # by (old id, rank order): only id 0 of rank 0 keeps its number


@pytest.mark.parametrize("kind", TREES)
@pytest.mark.parametrize("view", ["human", "json"])
def test_checkpoint_load_says_ids_were_renumbered(tmp_path: Path, kind: str, view: str) -> None:
    tree, changed = a_tree(tmp_path, kind)
    if view == "json":
        result = run("checkpoint", "load", tree, "--json")
        doc = json.loads(result.stdout)
        assert result.exit_code == 0 and doc["renumbered"] is True and doc["renumbered_ids"] == changed
    else:
        result = run("checkpoint", "load", tree)
        assert result.exit_code == 0
        assert "ids renumbered: the rank directories' ids collide" in " ".join(result.stdout.split())
        assert f"{changed} ids changed" in result.stdout


@pytest.mark.parametrize("kind", TREES)
@pytest.mark.parametrize("view", ["human", "json"])
def test_stats_says_ids_were_renumbered(tmp_path: Path, kind: str, view: str) -> None:
    tree, _ = a_tree(tmp_path, kind)
    if view == "json":
        result = run("stats", tree, "--json")
        assert result.exit_code == 0 and json.loads(result.stdout)["renumbered"] is True
    else:
        result = run("stats", tree)
        assert result.exit_code == 0
        assert "ids renumbered: the rank directories' ids collide" in " ".join(result.stdout.split())


@pytest.mark.parametrize("command", [["checkpoint", "load"], ["stats"]], ids=["load", "stats"])
def test_a_tree_without_collisions_says_nothing_of_renumbering(tmp_path: Path, command: list[str]) -> None:
    tree = shard_tree(tmp_path, 3)
    result = run(*command, tree)
    assert result.exit_code == 0 and "renumbered" not in result.stdout
    doc = json.loads(run(*command, tree, "--json").stdout)
    assert doc["renumbered"] is False


TOPK_WITHOUT_K = {
    "sample": ["sample", "SRC", "--num-chunks", "4", "--strategy", "topk"],
    "stats": ["stats", "SRC", "--sample-draws", "10", "--strategy", "topk"],
}


@pytest.mark.parametrize("command", sorted(TOPK_WITHOUT_K))
def test_topk_without_k_names_the_options(tmp_path: Path, command: str) -> None:
    source = make_source("hashed", tmp_path)
    result = run(*[str(source) if a == "SRC" else a for a in TOPK_WITHOUT_K[command]])
    assert_one_error(result, 2)
    assert result.stderr.startswith("Error: --strategy topk needs --k K"), result.stderr
    assert "strategy 'topk' needs k" not in result.stderr
