"""Bounded JSON: every JSON document rbtool reads has a size, nesting and integer limit.

Each reader command, given a checkpoint whose metadata.json or index nests 1,100 or 100,000
deep, holds a string or array past its size limit, or a number beyond 64 bits, exits 1 with
exactly one `Error:` line and no traceback (repair, which rebuilds damaged JSON, may exit 0
with an output verify passes). A memory-limited child process meets a 64 MiB string or a
3 GB index with the same one line, never a crash.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_one_error, make_traj, run
from hypothesis import given, settings
from hypothesis import strategies as st

from rbtool import format as fmt
from rbtool.errors import CheckpointError
from rbtool.format import bounded

RBTOOL = [sys.executable, "-m", "rbtool"]
DEEP = {"deep1100": 1_100, "deep100000": 100_000}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small valid checkpoint of three trajectories (ingested, so rbtool wrote it)."""
    root = tmp_path_factory.mktemp("base")
    src = root / "src"
    src.mkdir()
    for i in range(3):
        torch.save(make_traj(seed=i, model_weights_id=f"w{i}"), src / f"t{i}.pt")
    result = run("ingest", "--buffer", root / "ckpt", *sorted(src.iterdir()))
    assert result.exit_code == 0, result.stderr
    return root / "ckpt"


def _copy(base: Path, dst: Path) -> Path:
    shutil.copytree(base, dst)
    return dst


def _raw(value_text: str, doc: str, directory: Path) -> None:
    """Put a raw JSON value into `doc`: an extra metadata key, or an entry's max_episode_length."""
    path = directory / doc
    text = path.read_text()
    if doc == fmt.METADATA_FILE:
        text = text.rstrip()[:-1] + ', "x": ' + value_text + "}"
    else:
        text = text.replace('"max_episode_length":4', '"max_episode_length":' + value_text, 1)
        assert value_text in text
    path.write_text(text)


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


# attack -> (raw JSON value, environment that makes the document too large where needed)
ATTACKS: dict[str, tuple[Callable[[], str], dict[str, str]]] = {
    "deep1100": (lambda: _deep(1_100), {}),
    "deep100000": (lambda: _deep(100_000), {}),
    "deep_objects": (lambda: '{"a":' * 2_000 + "1" + "}" * 2_000, {}),
    "huge_string": (
        lambda: '"' + "x" * (2 << 20) + '"',
        {fmt.JSON_BYTES_ENV: "1M", fmt.INDEX_BYTES_ENV: "1M"},
    ),
    "huge_array": (
        lambda: "[" + ",".join(["1"] * (1 << 20)) + "]",
        {fmt.JSON_BYTES_ENV: "1M", fmt.INDEX_BYTES_ENV: "1M"},
    ),
    "int_2_64": (lambda: str(2**64), {}),
    "int_below_int64": (lambda: str(-(2**63) - 1), {}),
    "int_4000_digits": (lambda: "9" * 4_000, {}),
    "float_1e400": (lambda: "1e400", {}),
}
READERS: dict[str, Callable[[Path, Path], list[str | Path]]] = {
    "verify": lambda d, out: ["verify", d],
    "verify_deep": lambda d, out: ["verify", d, "--deep"],
    "stats": lambda d, out: ["stats", d],
    "stats_index_only": lambda d, out: ["stats", d, "--index-only"],
    "checkpoint_load": lambda d, out: ["checkpoint", "load", d],
    "diff": lambda d, out: ["diff", d, d],
    "merge": lambda d, out: ["merge", d, "--out", out],
    "shard": lambda d, out: ["shard", d, "--world-size", "2", "--out", out],
    "repair": lambda d, out: ["repair", d, "--out", out],
}


def _traceback_free(result: Any) -> None:
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)


@pytest.mark.parametrize("attack", sorted(ATTACKS))
@pytest.mark.parametrize("doc", [fmt.METADATA_FILE, fmt.INDEX_FILE])
@pytest.mark.parametrize("reader", sorted(READERS))
def test_every_reader_refuses_hostile_json_in_one_line(
    base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reader: str, doc: str, attack: str
) -> None:
    value, env = ATTACKS[attack]
    directory = _copy(base, tmp_path / "c")
    _raw(value(), doc, directory)
    for key, setting in env.items():
        monkeypatch.setenv(key, setting)
    out = tmp_path / "out"
    result = run(*READERS[reader](directory, out))
    _traceback_free(result)
    if reader == "repair" and result.exit_code == 0:  # rebuilt from the files: verify must pass
        monkeypatch.delenv(fmt.JSON_BYTES_ENV, raising=False)
        monkeypatch.delenv(fmt.INDEX_BYTES_ENV, raising=False)
        assert run("verify", out).exit_code == 0
        return
    if reader.startswith("verify"):  # the report on stdout, the verdict on stderr
        assert result.exit_code == 1, result.stderr
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
        return
    if reader == "diff":  # a diff of a damaged checkpoint with itself is an error, not "equal"
        assert result.exit_code == 1
        assert result.stderr.count("Error: ") == 1, result.stderr
        return
    assert_one_error(result)
    assert not out.exists()


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("trajectory_99999999999999999999_w.pt", "stray"),
        ("trajectory_9223372036854775808_w.pt", "stray"),
        ("trajectory_" + "9" * 230 + "_w.pt", "stray"),
        ("trajectory_00099999999999999999999_w.pt", "stray"),
    ],
)
@pytest.mark.parametrize("reader", ["verify", "stats", "repair", "ingest"])
def test_an_id_beyond_int64_in_a_file_name_is_a_stray(
    base: Path, tmp_path: Path, reader: str, name: str, kind: str
) -> None:
    directory = _copy(base, tmp_path / "c")
    shutil.copy(next(directory.glob("trajectory_0_*.pt")), directory / name)
    if reader == "ingest":
        src = tmp_path / "new.pt"
        torch.save(make_traj(seed=9), src)
        result = run("ingest", "--buffer", directory, src)
    elif reader == "repair":
        result = run("repair", directory, "--out", tmp_path / "out")
    else:
        result = run(reader, directory)
    _traceback_free(result)
    assert result.exit_code == 0, result.stderr
    if reader == "verify":
        assert "stray_file" in result.stdout


def test_parse_trajectory_file_name_refuses_ids_past_int64() -> None:
    assert fmt.parse_trajectory_file_name(f"trajectory_{2**63 - 1}_w.pt") == (2**63 - 1, "w", "pt")
    assert fmt.parse_trajectory_file_name(f"trajectory_{2**63}_w.pt") is None
    assert fmt.parse_trajectory_file_name("trajectory_" + "1" * 5000 + "_w.pt") is None


# ------------------------------------------------------------ the reader itself
@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"[" * 65 + b"]" * 65, "nests deeper than 64"),
        (b"[" * 100_000, "nests deeper than 64"),
        (b'{"a":' * 100 + b"1" + b"}" * 100, "nests deeper than 64"),
        (b"[" + str(2**64).encode() + b"]", "beyond the 64-bit range"),
        (str(-(2**63) - 1).encode(), "beyond the 64-bit range"),
        (b'{"k": ' + b"9" * 1000 + b"}", "beyond the 64-bit range"),
        (b"9" * 5000, "invalid JSON"),
        (b"[1e400]", "invalid JSON"),
        (b"[-1e400]", "invalid JSON"),
        (b"[1,", "invalid JSON"),
        (b'"' + b"x" * 2000 + b'"', "more than the 1000 B"),
    ],
)
def test_read_json_bytes_refuses_in_one_line(data: bytes, words: str) -> None:
    with pytest.raises(CheckpointError) as caught:
        fmt.read_json_bytes(data, "doc.json", max_bytes=1000 if b"x" in data else 10**6)
    message = str(caught.value)
    assert message.startswith("doc.json: ") and words in message and "\n" not in message
    assert len(message) < 400


@pytest.mark.parametrize(
    "data",
    [
        b"[" * 64 + b"]" * 64,
        b'["' + b"[" * 500 + b'"]',
        b'["\\\\", [[]]]',
        b'["\\"[[[[[[", 1]',
        b"18446744073709551615",
    ],
)
def test_read_json_bytes_accepts_what_is_within_bounds(data: bytes) -> None:
    assert fmt.read_json_bytes(data, "doc.json") == json.loads(data)


def _reference_depth(data: bytes) -> int:
    """The nesting a decoder reaches, by a byte-at-a-time state machine (the slow truth)."""
    depth = deepest = 0
    in_string = escaped = False
    for c in data:
        if in_string:
            if escaped:
                escaped = False
            elif c == 92:
                escaped = True
            elif c == 34:
                in_string = False
        elif c == 34:
            in_string = True
        elif c in (91, 123):
            depth += 1
            deepest = max(deepest, depth)
        elif c in (93, 125):
            depth -= 1
    return deepest


_TOKEN = st.one_of(
    st.sampled_from([b"[", b"]", b"{", b"}", b"1", b",", b":"]),
    st.lists(
        st.sampled_from([b"a", b"[", b"{", b"]", b"}", b"\\\\", b'\\"', b"\\n", b"\\u005b"]), max_size=6
    ).map(lambda parts: b'"' + b"".join(parts) + b'"'),
)


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(_TOKEN, max_size=40), chunk=st.sampled_from([1, 2, 3, 7, 1 << 22]))
def test_the_depth_scan_counts_what_a_decoder_reaches(tokens: list[bytes], chunk: int) -> None:
    data = b"".join(tokens)
    old = bounded._SCAN_CHUNK
    bounded._SCAN_CHUNK = chunk
    try:
        deepest = _reference_depth(data)
        assert (fmt.json_depth_problem(data, 3) is None) == (deepest <= 3)
    finally:
        bounded._SCAN_CHUNK = old


_PLAIN_TOKEN = st.one_of(  # mostly strings without brackets, as documents hold them
    st.sampled_from([b"[", b"]", b"{", b"}", b"[]", b"{}", b"1", b",", b'""', b'"ab"']),
    st.lists(st.sampled_from([b"a", b"[", b"}", b"\\\\", b'\\"']), max_size=3).map(
        lambda parts: b'"' + b"".join(parts) + b'"'
    ),
)


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(_PLAIN_TOKEN, max_size=60), max_depth=st.integers(0, 9))
def test_the_depth_scan_agrees_with_a_decoder_at_every_limit(tokens: list[bytes], max_depth: int) -> None:
    data = b"".join(tokens)
    assert (fmt.json_depth_problem(data, max_depth) is None) == (_reference_depth(data) <= max_depth)


@pytest.mark.parametrize("depth", [1, 2, 3, 4, 5, 63, 64, 65, 200])
def test_nests_of_either_bracket_at_and_past_the_limit(depth: int) -> None:
    mixed = b"".join(b"[{"[k % 2 : k % 2 + 1] for k in range(depth))
    closing = bytes(reversed(mixed.translate(bytes.maketrans(b"[{", b"]}"))))
    for data in (mixed + closing, b"[" * depth + b"]" * depth, b'{"a": ' * depth + b"1" + b"}" * depth):
        expected = depth <= bounded.MAX_JSON_DEPTH
        assert (fmt.json_depth_problem(data) is None) == expected, data[:20]


def test_brackets_in_strings_never_close_a_nest() -> None:
    data = b'[{"}]"' * 3  # six deep: each string's brackets are text
    assert _reference_depth(data) == 6
    assert fmt.json_depth_problem(data, 4) is not None
    assert fmt.json_depth_problem(data, 6) is None


# --------------------------------------------------- memory: child processes
def _limited(limit: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return apply


def _child(
    args: list[str], limit: int, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RBTOOL, *args],
        preexec_fn=_limited(limit),
        capture_output=True,
        text=True,
        env={**os.environ, "RBTOOL_NO_PROGRESS": "1", **(env or {})},
        timeout=300,
    )


def _assert_child_one_error(proc: subprocess.CompletedProcess[str], words: str) -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and words in lines[0], proc.stderr[-2000:]


@pytest.mark.parametrize("command", [["verify"], ["stats", "--index-only"], ["checkpoint", "load"]])
def test_a_64_mib_string_in_metadata_under_1_gib_is_one_error(
    base: Path, tmp_path: Path, command: list[str]
) -> None:
    directory = _copy(base, tmp_path / "c")
    meta = json.loads((directory / fmt.METADATA_FILE).read_text())
    meta["note"] = "x" * (64 << 20)
    (directory / fmt.METADATA_FILE).write_text(json.dumps(meta))
    proc = _child([*command, str(directory), *(["--json"] if command == ["verify"] else [])], 1 << 30)
    if command == ["verify"]:
        assert proc.returncode == 1 and proc.stderr.count("Error: ") == 1, proc.stderr[-2000:]
        assert "more than the 16.0 MiB" in proc.stdout
    else:
        _assert_child_one_error(proc, "more than the 16.0 MiB")


@pytest.mark.parametrize("command", [["stats", "--index-only"], ["checkpoint", "load"], ["verify"]])
def test_a_3_gb_index_is_refused_with_the_memory_it_would_take(
    base: Path, tmp_path: Path, command: list[str]
) -> None:
    """A ten-million-entry index (~3 GB; a sparse file here: the size is refused before a byte is read)."""
    directory = _copy(base, tmp_path / "c")
    with open(directory / fmt.INDEX_FILE, "r+b") as handle:
        handle.truncate(3_000_000_000)
    proc = _child([*command, str(directory), *(["--json"] if command == ["verify"] else [])], 2 << 30)
    words = "of memory to decode, more than the"
    if command == ["verify"]:
        assert proc.returncode == 1 and proc.stderr.count("Error: ") == 1, proc.stderr[-2000:]
        assert words in proc.stdout and "14.0 GiB" in proc.stdout
    else:
        _assert_child_one_error(proc, words)
        assert "2.8 GiB of JSON would take about 14.0 GiB" in proc.stderr


def test_the_index_limit_setting_refuses_a_larger_index(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    size = (base / fmt.INDEX_FILE).stat().st_size
    monkeypatch.setenv(fmt.INDEX_BYTES_ENV, str(size - 1))
    result = run("stats", base, "--index-only")
    assert_one_error(result)
    assert f"{fmt.INDEX_BYTES_ENV}={size - 1}" in result.stderr
    monkeypatch.setenv(fmt.INDEX_BYTES_ENV, str(size))
    assert run("stats", base, "--index-only").exit_code == 0


def test_a_bad_limit_setting_is_a_usage_error(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fmt.INDEX_BYTES_ENV, "lots")
    result = run("stats", base, "--index-only")
    assert result.exit_code == 2 and "RBTOOL_MAX_INDEX_BYTES='lots'" in result.stderr


_MEASURE = """
import resource, sys
from rbtool.files.index import read_index
def rss():
    return int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0]) * 1024
def hwm():
    return int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) * 1024
read_index(sys.argv[2])  # a one-entry index first: the modules a read imports are not the index's
before = rss()
index = read_index(sys.argv[1])
print(hwm() - before)
"""


def test_the_memory_estimate_holds_for_a_realistic_index(tmp_path: Path) -> None:
    """The decoded index (typed decode, then the entry dicts a load holds) fits in the estimate."""
    import hashlib
    import uuid

    import orjson

    n = 60_000
    entries = {
        str(i): {
            "num_samples": 16,
            "trajectory_id": i,
            "max_episode_length": 8,
            "shape": [8, 2],
            "model_weights_id": str(uuid.UUID(int=i)),
            "uuid": uuid.UUID(int=i + 1).hex,
            "file_bytes": 123_456 + i,
            "sha256": hashlib.sha256(str(i).encode()).hexdigest(),
        }
        for i in range(n)
    }
    for name, count in (("big", n), ("one", 1)):
        directory = tmp_path / name
        directory.mkdir()
        index = {
            "trajectory_index": dict(list(entries.items())[:count]),
            "trajectory_id_list": list(range(count)),
        }
        data = orjson.dumps(index)
        (directory / fmt.INDEX_FILE).write_bytes(data)
        meta = {
            "trajectory_format": "pt",
            "size": count,
            "total_samples": 16 * count,
            "trajectory_counter": count,
        }
        (directory / fmt.METADATA_FILE).write_bytes(orjson.dumps(meta))
    data = (tmp_path / "big" / fmt.INDEX_FILE).read_bytes()
    argv = [sys.executable, "-c", _MEASURE, str(tmp_path / "big"), str(tmp_path / "one")]
    proc = subprocess.run(argv, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    used = int(proc.stdout)
    estimate = len(data) * fmt.INDEX_MEMORY_PER_BYTE
    assert used <= estimate, (used, estimate)
    assert estimate <= 4 * used, (used, estimate)  # not so cautious it refuses what fits


# ------------------------------------------------------ ids and counters
def test_ingest_refuses_to_push_the_counter_past_int64(base: Path, tmp_path: Path) -> None:
    directory = _copy(base, tmp_path / "c")
    meta = json.loads((directory / fmt.METADATA_FILE).read_text())
    meta["trajectory_counter"] = 2**63 - 2
    (directory / fmt.METADATA_FILE).write_text(json.dumps(meta))
    src = tmp_path / "n.pt"
    torch.save(make_traj(seed=7), src)
    assert run("ingest", "--buffer", directory, src, "--allow-duplicates").exit_code == 0
    assert run("verify", directory).exit_code == 0
    result = run("ingest", "--buffer", directory, src, "--allow-duplicates")
    assert_one_error(result)
    assert "stay below 2**63 - 1" in result.stderr
    assert run("verify", directory).exit_code == 0


@settings(max_examples=12, deadline=None)
@given(
    counter=st.sampled_from([0, 2**31, 2**62, 2**63 - 4, 2**63 - 3, 2**63 - 2, 2**63 - 1]),
    count=st.integers(1, 3),
    writer=st.sampled_from(["ingest", "merge", "shard", "filter", "convert", "repair", "reshard"]),
)
def test_no_writer_exits_0_after_writing_what_verify_refuses(
    base: Path, tmp_path_factory: pytest.TempPathFactory, counter: int, count: int, writer: str
) -> None:
    root = tmp_path_factory.mktemp("w")
    directory = _copy(base, root / "c")
    meta = json.loads((directory / fmt.METADATA_FILE).read_text())
    meta["trajectory_counter"] = max(counter, meta["trajectory_counter"])
    (directory / fmt.METADATA_FILE).write_text(json.dumps(meta))
    out = root / "out"
    if writer == "ingest":
        srcs = []
        for i in range(count):
            srcs.append(root / f"s{i}.pt")
            torch.save(make_traj(seed=random.Random(i).randrange(100)), srcs[-1])
        result = run("ingest", "--buffer", directory, *srcs, "--allow-duplicates")
        out = directory
    elif writer == "merge":
        result = run("merge", directory, directory, "--out", out)
    elif writer == "shard":
        result = run("shard", directory, "--world-size", str(count), "--out", out)
    elif writer == "reshard":
        result = run("reshard", directory, "--world-size", str(count), "--out", out)
    elif writer == "filter":
        result = run("filter", directory, "--last", str(count), "--out", out)
    elif writer == "convert":
        result = run("convert", directory, "--format", "pkl", "--out", out)
    else:
        result = run("repair", directory, "--out", out)
    _traceback_free(result)
    if result.exit_code == 0:
        verdict = run("verify", out)
        assert verdict.exit_code == 0, (writer, counter, verdict.stdout, verdict.stderr)
    else:
        assert result.exit_code in (1, 2)


# ------------------------------------------------- the index: nesting under the typed decode
def _index_with(tmp_path: Path, entry_extra: bytes) -> Path:
    """A one-trajectory index whose entry holds `entry_extra` (raw JSON) as an unknown key."""
    directory = tmp_path / "ckpt"
    directory.mkdir(parents=True)
    meta = {"trajectory_format": "pt", "size": 1, "total_samples": 2, "trajectory_counter": 1, "seed": 1}
    (directory / "metadata.json").write_text(json.dumps(meta))
    entry = (
        b'{"num_samples": 2, "trajectory_id": 0, "max_episode_length": 2, "shape": [2, 1], '
        b'"model_weights_id": "w"'
    )
    if entry_extra:
        entry += b', "extra": ' + entry_extra
    (directory / "trajectory_index.json").write_bytes(
        b'{"trajectory_index": {"0": ' + entry + b'}}, "trajectory_id_list": [0]}'
    )
    return directory


@pytest.mark.parametrize(
    ("extra", "refused"),
    [
        (b"", False),
        (b"[" * 10 + b"]" * 10, False),  # an unknown key is read past
        (b"[" * 61 + b"]" * 61, False),  # 64 deep with the three around it
        (b"[" * 62 + b"]" * 62, True),  # 65 deep
        (b'{"a":' * 5000 + b"1" + b"}" * 5000, True),
    ],
)
def test_an_index_nesting_past_the_limit_under_an_unknown_key_is_refused(
    tmp_path: Path, extra: bytes, refused: bool
) -> None:
    checked = fmt.check_json(_index_with(tmp_path, extra))
    problems = [p for p in checked.problems if p.code == "index_unreadable"]
    assert bool(problems) == refused, checked.problems
    if refused:
        assert "nests deeper than 64 levels" in problems[0].message


def test_a_nest_where_a_number_belongs_is_refused_by_its_nesting(tmp_path: Path) -> None:
    directory = _index_with(tmp_path, b"")
    text = (directory / "trajectory_index.json").read_bytes()
    (directory / "trajectory_index.json").write_bytes(text.replace(b"[2, 1]", b"[" * 3000 + b"]" * 3000))
    problems = fmt.check_json(directory).problems
    assert any(p.code == "index_unreadable" and "nests deeper than 64" in p.message for p in problems)


def test_an_index_of_known_keys_only_is_not_scanned_for_its_nesting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rbtool.format import check

    def refuse(*args: Any) -> str:
        raise AssertionError("scanned")

    monkeypatch.setattr(check, "json_depth_problem", refuse)
    checked = fmt.check_json(_index_with(tmp_path, b""))
    assert checked.typed and not checked.problems
    with pytest.raises(AssertionError, match="scanned"):
        fmt.check_json(_index_with(tmp_path / "b", b"[1]"))
