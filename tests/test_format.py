"""rbtool.format: one validator of metadata and index; every reader agrees with it.

The central property: for any content of the two JSON files, `check_json` finds an error
exactly when `read_index` (every loader), `stats --index-only` and quick `verify` refuse,
with the same first message; and what it accepts can be written back and read again.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES

from rbtool import format as fmt
from rbtool.errors import CheckpointError
from rbtool.files.index import Index, read_index, write_index
from rbtool.format import ERROR, PROBLEM_CODES, check_json, entry_problems
from rbtool.format import check as format_check
from rbtool.ops.stats import read_table
from rbtool.ops.verify import verify_checkpoint

BASE = FIXTURES / "autosave_pt" / "autosave"  # five RLinf trajectories, ids 0-4
FILE_CODES = {"file_missing", "file_name_mismatch", "file_size_mismatch", "stray_file", "duplicate_files"}


def base_docs() -> tuple[dict[str, Any], dict[str, Any]]:
    meta = json.loads((BASE / "metadata.json").read_text())
    index = json.loads((BASE / "trajectory_index.json").read_text())
    return meta, index


def write_docs(directory: Path, meta: Any, index: Any, *, raw_index: str | None = None) -> Path:
    """The fixture's files under `directory`, with the JSON given (json module: any int size)."""
    if not directory.exists():
        shutil.copytree(BASE, directory)
    (directory / "metadata.json").write_text(json.dumps(meta))
    (directory / "trajectory_index.json").write_text(
        raw_index if raw_index is not None else json.dumps(index)
    )
    return directory


# ------------------------------------------------------------------ mutations
def _entry(index: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    table = index["trajectory_index"]
    return table[rng.choice(sorted(table))]  # type: ignore[no-any-return]


NASTY_VALUES: list[Any] = [
    None,
    True,
    False,
    -1,
    0,
    7,
    2**31,
    2**63 - 1,
    2**63,
    2**64,
    10**30,
    1.5,
    4.0,
    "4",
    "",
    "../x",
    "a/b",
    "ok-id_1.2",
    [],
    [4],
    [4, 2],
    [4, 2, 7],
    [4, -2, 7],
    [4, 2**31],
    [4, True],
    {},
    {"a": 1},
]
ENTRY_FIELDS = ["num_samples", "trajectory_id", "max_episode_length", "shape", "model_weights_id"]
OPTIONAL_FIELDS = ["uuid", "file_bytes", "sha256", "someone_elses_key"]
META_FIELDS = ["trajectory_format", "size", "total_samples", "trajectory_counter", "seed", "format_version"]


def mutate(rng: random.Random, meta: dict[str, Any], index: dict[str, Any]) -> str | None:
    """Change the documents in place in one random way; may return a raw index text instead."""
    kind = rng.randrange(12)
    table, id_list = index.get("trajectory_index"), index.get("trajectory_id_list")
    if not (isinstance(table, dict) and table and isinstance(id_list, list) and id_list):
        kind = 3  # an earlier change broke the index's shape: change metadata only
    if kind in (0, 1, 2) and not all(isinstance(e, dict) for e in table.values()):  # type: ignore[union-attr]
        kind = 3
    if kind == 0:
        _entry(index, rng)[rng.choice(ENTRY_FIELDS)] = rng.choice(NASTY_VALUES)
    elif kind == 1:
        _entry(index, rng)[rng.choice(OPTIONAL_FIELDS)] = rng.choice(NASTY_VALUES)
    elif kind == 2:
        del _entry(index, rng)[rng.choice(ENTRY_FIELDS)]
    elif kind == 3:
        meta[rng.choice(META_FIELDS)] = rng.choice([*NASTY_VALUES, "pt", "pkl", "npz", "2", "1.3", 5, 40])
    elif kind == 4:
        meta.pop(rng.choice(META_FIELDS), None)
    elif kind == 5:
        key = rng.choice(sorted(table))
        table[rng.choice(["0" + key, "+" + key, "-" + key, key + ".0", " " + key, str(2**63), "x"])] = (
            table.pop(key)
        )
    elif kind == 6:
        id_list.insert(rng.randrange(len(id_list) + 1), rng.choice([*id_list, 9, -1, True, 2**64, "1"]))
    elif kind == 7:
        id_list.pop(rng.randrange(len(id_list)))
    elif kind == 8:
        table.pop(rng.choice(sorted(table)))
    elif kind == 9:
        # numbers JSON can spell but no decoder may accept silently
        text = json.dumps(index)
        key = rng.choice(sorted(table))
        entry = json.dumps(table[key])
        bad = rng.choice(['"uuid": 1e400', '"file_bytes": 1e999', '"uuid": -1e400', '"x": 1e400'])
        return text.replace(entry, entry[:-1] + ", " + bad + "}", 1)
    elif kind == 10:
        meta["someone_elses_key"] = rng.choice([1, 10**30, {"a": [1, 2]}, None])
    else:
        index[rng.choice(["trajectory_index", "trajectory_id_list"])] = rng.choice(NASTY_VALUES)
    return None


def readers_agree(directory: Path) -> tuple[bool, str | None]:
    """Check the agreement property at `directory`; returns (accepted, first error message)."""
    checked = check_json(directory)
    first = checked.first_error()
    expected = None if first is None else f"{directory}/{first.message}"
    loaders: list[Callable[[Path], Any]] = [read_index, read_table]
    for load in loaders:
        if expected is None:
            load(directory)
        else:
            with pytest.raises(CheckpointError) as caught:
                load(directory)
            assert str(caught.value) == expected, load
    report = verify_checkpoint(directory)
    json_errors = [p for p in report.problems if p.severity == ERROR and p.code not in FILE_CODES]
    assert [p.message for p in json_errors] == [p.message for p in checked.problems if p.severity == ERROR]
    for problem in checked.problems:
        assert problem.code in PROBLEM_CODES and "\n" not in problem.message
    return first is None, expected


def test_seeded_mutations_are_judged_alike_by_every_reader(tmp_path: Path) -> None:
    rng = random.Random(20261201)
    accepted = refused = 0
    for case in range(300):
        meta, index = base_docs()
        raw = None
        for _ in range(rng.choice([1, 1, 2, 3])):
            raw = mutate(rng, meta, index) or raw
        directory = write_docs(tmp_path / f"c{case}", meta, index, raw_index=raw)
        ok, _ = readers_agree(directory)
        if ok:
            accepted += 1
            # what is accepted can be written back and means the same when read again
            index_read = read_index(directory)
            out = tmp_path / f"w{case}"
            out.mkdir()
            write_index(out, index_read)
            again = read_index(out)
            assert again.state() == index_read.state() and again.entries == index_read.entries
            assert again.seed == index_read.seed
        else:
            refused += 1
        shutil.rmtree(directory)
    assert accepted > 30 and refused > 150  # both sides of the property were exercised


def test_typed_and_exact_paths_report_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The typed decoder is an optimisation only: with it disabled the problems are identical."""
    rng = random.Random(7)
    cases = []
    for case in range(120):
        meta, index = base_docs()
        raw = mutate(rng, meta, index)
        cases.append(write_docs(tmp_path / f"c{case}", meta, index, raw_index=raw))
    fast = [[(p.code, p.message) for p in check_json(d).problems] for d in cases]
    monkeypatch.setattr(format_check, "decode_typed", lambda data, strict=False: None)
    slow = [[(p.code, p.message) for p in check_json(d).problems] for d in cases]
    assert fast == slow


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda m, i: i["trajectory_index"]["2"].update(max_episode_length=2**64), "max_episode_length"),
        (lambda m, i: i["trajectory_index"]["2"].update(num_samples=2**64), "num_samples"),
        (lambda m, i: i["trajectory_index"]["2"].update(uuid=7), "uuid"),
        (lambda m, i: i["trajectory_index"]["2"].update(file_bytes=-1), "file_bytes"),
        (lambda m, i: i["trajectory_index"]["2"].update(shape=[4, 2**31]), "shape"),
        (lambda m, i: i["trajectory_index"].update({"03": i["trajectory_index"].pop("3")}), "'03'"),
        (lambda m, i: m.update(size=2**64), "size"),
        (lambda m, i: m.update(format_version=2), "upgrade rbtool"),
        (lambda m, i: m.pop("trajectory_counter"), "lacks 'trajectory_counter'"),
        (lambda m, i: m.update(size=4), "size 4"),
    ],
)
def test_what_one_reader_refuses_every_reader_refuses(tmp_path: Path, change: Any, words: str) -> None:
    meta, index = base_docs()
    change(meta, index)
    directory = write_docs(tmp_path / "c", meta, index)
    ok, message = readers_agree(directory)
    assert not ok and message is not None and words in message


def test_an_out_of_range_number_anywhere_is_refused_by_all(tmp_path: Path) -> None:
    meta, index = base_docs()
    text = json.dumps(index).replace('"trajectory_id": 2,', '"trajectory_id": 2, "uuid": 1e400,', 1)
    directory = write_docs(tmp_path / "c", meta, index, raw_index=text)
    ok, message = readers_agree(directory)
    assert not ok and message is not None and "invalid JSON" in message


def test_unknown_keys_are_not_read(tmp_path: Path) -> None:
    """Keys rbtool does not know are ignored, whatever they hold, and not carried forward."""
    meta, index = base_docs()
    index["trajectory_index"]["1"]["someone_elses_key"] = {"deep": [1, 2, 3]}
    directory = write_docs(tmp_path / "c", meta, index)
    assert readers_agree(directory)[0]
    assert "someone_elses_key" not in read_index(directory).entries[1]


def test_null_seed_is_read_as_no_seed_and_never_written(tmp_path: Path) -> None:
    meta, index = base_docs()
    meta["seed"] = None
    directory = write_docs(tmp_path / "c", meta, index)
    checked = check_json(directory)
    assert checked.ok and [p.code for p in checked.problems] == ["seed_null"]
    read = read_index(directory)
    assert read.seed is None
    out = tmp_path / "out"
    out.mkdir()
    write_index(out, read)
    assert "seed" not in json.loads((out / "metadata.json").read_text())
    assert check_json(out).problems == []


def test_metadata_written_by_rbtool_is_not_foreign(tmp_path: Path) -> None:
    assert check_json(BASE).meta.foreign  # RLinf wrote it: five keys, no format_version
    out = tmp_path / "out"
    out.mkdir()
    write_index(out, read_index(BASE))
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["format_version"] == fmt.FORMAT_VERSION and not check_json(out).meta.foreign


def test_an_interrupted_publish_is_read_by_recounting(tmp_path: Path) -> None:
    """metadata.json one update behind its index (rbtool's own crash window) stays loadable."""
    directory = tmp_path / "c"
    shutil.copytree(BASE, directory)
    index = read_index(directory)
    old_meta = (directory / "metadata.json").read_bytes()
    index.entries[5] = {**index.entries[4], "trajectory_id": 5}
    index.id_list.append(5)
    index.trajectory_counter = 6
    write_index(directory, index)
    (directory / "metadata.json").write_bytes(old_meta)
    checked = check_json(directory)
    assert checked.ok and [p.code for p in checked.problems] == ["metadata_behind_index"]
    again = read_index(directory)
    assert (again.size, again.trajectory_counter) == (6, 6)


@pytest.mark.parametrize(
    ("key", "entry", "codes"),
    [
        (
            "0",
            {
                "num_samples": 8,
                "trajectory_id": 0,
                "max_episode_length": 4,
                "shape": [4, 2],
                "model_weights_id": "w",
            },
            [],
        ),
        (
            "0",
            {
                "num_samples": 9,
                "trajectory_id": 0,
                "max_episode_length": 4,
                "shape": [4, 2],
                "model_weights_id": "w",
            },
            ["num_samples_mismatch"],
        ),
        ("00", {}, ["entry_invalid"]),
        ("0", [], ["entry_invalid"]),
        ("0", {"num_samples": 8}, ["entry_invalid"] * 4),
        (
            "1",
            {
                "num_samples": True,
                "trajectory_id": 1.0,
                "max_episode_length": -1,
                "shape": "4x2",
                "model_weights_id": "..",
                "uuid": 3,
                "file_bytes": "9",
                "sha256": 1,
            },
            ["entry_invalid"] * 8,
        ),
    ],
)
def test_entry_problems_names_every_broken_rule(key: str, entry: Any, codes: list[str]) -> None:
    assert [code for code, _ in entry_problems(key, entry)] == codes


def test_reference_fixtures_pass_the_validator() -> None:
    for directory in [
        FIXTURES / "autosave_pt/autosave",
        FIXTURES / "ranks/rank_0",
        FIXTURES / "seedless_pt",
        FIXTURES / "nested_obs_pt",
        FIXTURES / "pkl_format_switch",
        FIXTURES / "nosave_window2_pkl/ckpt",
    ]:
        checked = check_json(directory)
        assert checked.ok and checked.typed and checked.problems == [], directory


def test_index_file_rejects_a_wrong_top_level_shape(tmp_path: Path) -> None:
    meta, _ = base_docs()
    for raw in [
        "[]",
        '{"trajectory_index": [], "trajectory_id_list": []}',
        '{"trajectory_index": {}}',
        "nul",
    ]:
        directory = write_docs(tmp_path / "c", meta, None, raw_index=raw)
        checked = check_json(directory)
        assert not checked.ok and checked.first_error() is not None
        assert checked.first_error().code in ("index_invalid", "index_unreadable")  # type: ignore[union-attr]
        readers_agree(directory)


def test_an_empty_index_is_a_valid_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    write_index(out, Index(seed=None))
    checked = check_json(out)
    assert checked.ok and checked.id_list == [] and read_index(out).size == 0
