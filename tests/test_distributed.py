"""Deep passes over torchrun ranks (rbtool.passes.ranks), and the journals they resume from
(rbtool.passes.journal).

The end-to-end tests start real `torchrun --standalone --nproc_per_node=2` runs (gloo on CPU)
and compare their report with one process's; a rank is lost mid-run by running the command
through tests/lose_rank.py (the rank leaves once it has journaled that many files), and the
rerun from the journal must give the same report.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import FIXTURES, make_traj, run
from hypothesis import given, settings
from hypothesis import strategies as st

from rbtool.errors import JournalError
from rbtool.format import Problem
from rbtool.ops.stats import EpisodeTally, FieldRow, TrajectoryData
from rbtool.passes import ranks
from rbtool.passes.journal import Journal, _decode, _encode, input_journal, open_journal
from rbtool.passes.ranks import home_rank, plan, ranked_pass

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
LOSE_RANK = Path(__file__).with_name("lose_rank.py")  # rbtool, with one rank lost mid-pass
needs_torchrun = pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed")
TIMING_KEYS = ("seconds", "bytes_per_second", "jobs", "journal")  # "journal": how many were reused


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ranks.TORCHRUN_VARS}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


class Single:
    """One process's run of a command (in this process, as without torchrun): status and stdout."""

    def __init__(self, *args: str | Path) -> None:
        result = run(*args)
        self.returncode, self.stdout, self.stderr = result.exit_code, result.stdout, result.stderr


def single(*args: str | Path) -> Single:
    return Single(*args)


def torchrun(*args: str | Path, lose: tuple[int, int] | None = None) -> subprocess.CompletedProcess[str]:
    """The same command on two ranks; with `lose=(rank, n)`, that rank leaves once it has
    journaled n files, as a node lost in the middle of the pass would (tests/lose_rank.py)."""
    entry = ["-m", "rbtool"] if lose is None else [str(LOSE_RANK)]
    extra = {} if lose is None else {"LOSE_RANK": str(lose[0]), "LOSE_AFTER": str(lose[1])}
    argv = [str(TORCHRUN), "--standalone", "--nproc_per_node=2", *entry, *map(str, args)]
    return subprocess.run(argv, capture_output=True, text=True, env=_env(**extra), timeout=180)


def untimed(doc: dict[str, Any], *where: str) -> dict[str, Any]:
    """`doc` without the keys that differ between runs (timings, throughput, worker counts)."""
    for part in [doc, *(doc[w] for w in where)]:
        for key in TIMING_KEYS:
            part.pop(key, None)
    return doc


@pytest.fixture(scope="module")
def ckpt200(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of 200 small trajectories of varied sizes (rbtool's own writer)."""
    from rbtool import TrajectoryReplayBuffer

    path = tmp_path_factory.mktemp("c200") / "ckpt"
    buf = TrajectoryReplayBuffer(seed=7, sample_window_size=0)
    buf.add_trajectories([make_traj(t=2 + i % 3, b=2, seed=i, image=2 + i % 5) for i in range(200)])
    buf.save_checkpoint(path)
    buf.close()
    return path


def journal_lines(directory: Path) -> int:
    return sum(len(p.read_bytes().splitlines()) - 1 for p in directory.glob("*.jsonl"))


# ------------------------------------------------------------------ the plan
@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 10_000), max_size=60),
    st.integers(1, 6),
    st.lists(st.one_of(st.none(), st.integers(0, 7)), max_size=60),
)
def test_the_plan_is_byte_balanced_within_the_largest_file(
    weights: list[int], world: int, homes: list
) -> None:
    homes = (homes + [None] * len(weights))[: len(weights)]
    owner = plan(weights, world, homes)
    assert owner == plan(weights, world, homes)  # deterministic
    assert all(0 <= r < world for r in owner)
    cost = [max(1, w) for w in weights]  # a file counts at least one byte
    loads = [sum(w for w, r in zip(cost, owner, strict=True) if r == k) for k in range(world)]
    assert max(loads) - min(loads) <= max(cost, default=0)


def test_the_plan_keeps_files_on_their_rank_when_the_balance_allows() -> None:
    # a rank tree of 2 ranks, 10 files each, of similar sizes: every file stays home
    weights = [1000 + (i * 37) % 50 for i in range(20)]
    homes = [0] * 10 + [1] * 10
    assert plan(weights, 2, homes) == homes
    # all on rank 0's disk: balance wins, half of the bytes go to rank 1 anyway
    owner = plan([100] * 10, 2, [0] * 10)
    assert owner.count(0) == owner.count(1) == 5


def test_files_of_no_weight_are_spread_by_count() -> None:
    assert sorted(plan([0] * 9, 3)) == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_home_rank_is_the_nearest_rank_directory() -> None:
    assert home_rank(Path("run/rank_3/trajectory_0_.pt")) == 3
    assert home_rank(Path("rank_1/sub/rank_12/x.pt")) == 12
    assert home_rank(Path("ckpt/trajectory_0_.pt")) is None
    assert home_rank(Path("rank_x/t.pt")) is None


def test_the_torchrun_environment() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert ranks.from_env(env) is None  # no rendezvous address: not torchrun
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert ranks.from_env(env) == ranks.World(1, 4, 1, 2)
    assert ranks.rank_jobs(3, ranks.World(1, 4, 1, 2)) == 3
    assert ranks.rank_jobs(None, ranks.World(0, 4, 0, 4)) >= 1
    with pytest.raises(ranks.UsageError):
        ranks.from_env(env | {"RANK": "4"})


# ------------------------------------------------------------------ journals
def test_results_round_trip_through_the_journal_encoding() -> None:
    types = {t.__name__: t for t in (TrajectoryData, FieldRow, EpisodeTally, Problem)}
    data = TrajectoryData(
        [FieldRow("actions", "float32", (7,), 0, 224), FieldRow("ids", "int64", None, 0, 8)],
        np.array([[0.1, -2.5], [np.nan, np.inf]]),
        EpisodeTally(np.array([3], np.int64), np.array([1.5]), np.array([True]), np.array([1], np.int8), 2),
        None,
        4096,
    )
    value = (
        [Problem("file_corrupt", "error", 3, "t.pt", "t.pt: bad")],
        {"a": "float32"},
        12,
        np.float64(0.5),
    )
    for original in (data, value):
        back = _decode(orjson_round(_encode(original, types)), types)
        assert repr(back) == repr(original)
    assert back[3].dtype == np.float64
    with pytest.raises(JournalError):
        _encode(object(), types)


def orjson_round(doc: Any) -> Any:
    import orjson

    return orjson.loads(orjson.dumps(doc))


CALLS: list[int] = []


def _square(task: tuple[str, int]) -> int:
    CALLS.append(task[1])
    if os.environ.get("RBTOOL_TEST_FAIL_AT") == str(task[1]):
        raise ranks.RbtoolError(f"{task[0]}: failed on purpose")
    return task[1] ** 2


def test_a_journaled_pass_resumes_and_redoes_changed_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = []
    for i in range(6):
        f = tmp_path / f"f{i}"
        f.write_bytes(b"x" * (i + 1))
        files.append(f)
    tasks = [(str(f), i) for i, f in enumerate(files)]
    journal = open_journal(tmp_path / "j", {"command": "test", "input": "x"})
    assert journal is not None

    def go() -> list[int]:
        return ranked_pass(_square, tasks, jobs=1, journal=journal, files=lambda t: (Path(t[0]),))

    CALLS.clear()
    monkeypatch.setenv("RBTOOL_TEST_FAIL_AT", "3")
    with pytest.raises(ranks.RbtoolError, match="f3: failed on purpose"):
        go()
    assert CALLS == [0, 1, 2, 3]  # one process: tasks in list order
    assert journal_lines(tmp_path / "j") == 3  # the failed task is not recorded
    monkeypatch.delenv("RBTOOL_TEST_FAIL_AT")
    CALLS.clear()
    assert go() == [i * i for i in range(6)]
    assert CALLS == [3, 4, 5]
    files[1].write_bytes(b"changed")  # another size: redone
    CALLS.clear()
    assert go() == [i * i for i in range(6)]
    assert CALLS == [1]


def test_a_rerun_from_another_directory_finds_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "sub").mkdir()
    for i in range(3):
        (tmp_path / f"f{i}").write_bytes(b"y" * (i + 1))
    journal = open_journal(tmp_path / "j", {"command": "test"})

    def go(prefix: str) -> list[int]:
        tasks = [(Path(f"{prefix}f{i}"), i) for i in range(3)]
        return ranked_pass(_square, tasks, jobs=1, journal=journal, files=lambda t: (t[0],))

    monkeypatch.chdir(tmp_path)
    CALLS.clear()
    assert go("") == [0, 1, 4] and CALLS == [0, 1, 2]
    monkeypatch.chdir(tmp_path / "sub")
    CALLS.clear()
    assert go("../") == [0, 1, 4] and CALLS == []  # the same files, named from elsewhere


def test_a_result_that_does_not_decode_is_done_again(tmp_path: Path) -> None:
    (tmp_path / "f0").write_bytes(b"z")
    journal = open_journal(tmp_path / "j", {"command": "test"})
    tasks = [(tmp_path / "f0", 0), (tmp_path / "f0", 1)]

    def go() -> list[int]:
        return ranked_pass(_square, tasks, jobs=1, journal=journal, files=lambda t: (t[0],))

    assert go() == [0, 1]
    [path] = (tmp_path / "j").glob("*.jsonl")
    lines = path.read_bytes().splitlines()
    lines[2] = lines[2].replace(b'"result":1', b'"result":{"c":"Unknown","f":{}}')
    path.write_bytes(b"\n".join(lines) + b"\n")
    CALLS.clear()
    assert go() == [0, 1] and CALLS == [1]


def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    journal = Journal(tmp_path, {"command": "test"})
    done = b'{"key":"a","identity":[],"result":1}\n'
    (tmp_path / "0-1-aa.jsonl").write_bytes(journal.header() + done + b'{"key":"b","ident')
    assert journal.load() == {"a": [([], 1)]}


def test_a_journal_of_another_pass_is_refused(tmp_path: Path) -> None:
    (tmp_path / "0-1-aa.jsonl").write_bytes(Journal(tmp_path, {"command": "stats", "input": "/a"}).header())
    with pytest.raises(JournalError, match="belongs to another pass"):
        Journal(tmp_path, {"command": "verify deep", "input": "/a"}).load()
    (tmp_path / "0-1-aa.jsonl").write_bytes(b"not json\n")
    with pytest.raises(JournalError, match="not an rbtool journal"):
        Journal(tmp_path, {"command": "stats", "input": "/a"}).load()


def test_the_command_line_refuses_a_foreign_journal(tmp_path: Path) -> None:
    ckpt = FIXTURES / "autosave_pt" / "autosave"
    first = run("stats", ckpt, "--journal", tmp_path / "j", "--json", "--jobs", "1")
    assert first.exit_code == 0, first.stderr
    again = run("stats", ckpt, "--journal", tmp_path / "j", "--json", "--jobs", "1")
    assert json.loads(again.stdout)["data"]["rewards"] == json.loads(first.stdout)["data"]["rewards"]
    other = run("verify", ckpt, "--deep", "--journal", tmp_path / "j", "--json")
    assert other.exit_code == 1 and other.stdout == ""
    assert other.stderr.startswith("Error: ") and "belongs to another pass" in other.stderr
    usage = run("verify", ckpt, "--journal", tmp_path / "k")
    assert usage.exit_code == 2 and not (tmp_path / "k").exists()
    inside = run("stats", ckpt, "--journal", ckpt / "journal", "--json")
    assert inside.exit_code == 2 and "never written into its input" in inside.stderr
    assert not (ckpt / "journal").exists()


def test_writers_refuse_to_run_over_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = run("shard", FIXTURES / "ranks", "--world-size", "2", "--out", tmp_path / "out")
    assert (
        result.exit_code == 2 and result.stdout == "" and "does not run over torchrun ranks" in result.stderr
    )
    assert not (tmp_path / "out").exists()


def test_writers_refuse_to_run_over_ranks_with_dry_run_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = run("shard", FIXTURES / "ranks", "--world-size", "2", "--out", tmp_path / "out", "--dry-run")
    assert result.exit_code == 2 and "does not run over torchrun ranks" in result.stderr


def test_each_input_has_its_own_journal_directory(tmp_path: Path) -> None:
    a, b = input_journal(tmp_path, "x/ckpt"), input_journal(tmp_path, "y/ckpt")
    assert a is not None and b is not None and a != b and a.parent == b.parent == tmp_path
    assert a.name.startswith("ckpt-") and re.fullmatch(r"ckpt-[0-9a-f]{12}", b.name)
    assert input_journal(tmp_path, Path("x/ckpt").absolute()) == a  # by absolute path
    assert input_journal(None, "x/ckpt") is None
    assert re.fullmatch(r"a_b-[0-9a-f]{12}", input_journal(tmp_path, "a b").name)  # type: ignore[union-attr]


def test_several_paths_keep_their_journals_apart(ckpt200: Path, tmp_path: Path) -> None:
    other = FIXTURES / "autosave_pt" / "autosave"
    journal = tmp_path / "j"
    first = run("stats", ckpt200, other, "--journal", journal, "--json", "--jobs", "1")
    assert first.exit_code == 0, first.stderr
    subdirs = sorted(p for p in journal.iterdir())
    assert subdirs == sorted(input_journal(journal, p) for p in (ckpt200, other))
    assert journal_lines(input_journal(journal, ckpt200)) == 200  # type: ignore[arg-type]
    recorded = sum(journal_lines(d) for d in subdirs)
    # the same paths in the other order resume both: nothing is read again, the same numbers
    again = run("stats", other, ckpt200, "--journal", journal, "--json", "--jobs", "1")
    assert again.exit_code == 0, again.stderr
    assert sorted(journal.iterdir()) == subdirs and sum(journal_lines(d) for d in subdirs) == recorded
    docs = [json.loads(x.stdout)["paths"] for x in (first, again)]
    assert [untimed(d, "data") for d in docs[1]] == [untimed(d, "data") for d in reversed(docs[0])]
    # a verify of the same paths into the same DIR is another pass: refused, by its first path
    other_pass = run("verify", ckpt200, other, "--deep", "--journal", journal, "--json")
    assert other_pass.exit_code == 1 and "belongs to another pass" in other_pass.stderr
    assert json.loads(other_pass.stdout)["ok"] is False
    quick = run("verify", ckpt200, other, "--journal", tmp_path / "k")
    assert quick.exit_code == 2 and not (tmp_path / "k").exists()


def test_convert_dry_run_journals_nothing(ckpt200: Path, tmp_path: Path) -> None:
    out, journal = tmp_path / "out", tmp_path / "journal"
    result = run("convert", ckpt200, "--out", out, "--format", "pkl", "--journal", journal, "--dry-run")
    assert result.exit_code == 0, result.stderr
    assert "nothing written" in result.stdout
    assert sorted(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ torchrun, end to end
@needs_torchrun
def test_several_paths_over_two_ranks_one_plan_and_one_journal_each(ckpt200: Path, tmp_path: Path) -> None:
    paths = [ckpt200, FIXTURES / "ranks"]
    one = single("verify", *paths, "--deep", "--json")
    two = torchrun("verify", *paths, "--deep", "--json", "--journal", tmp_path)
    assert one.returncode == two.returncode == 0, two.stderr[-2000:]
    docs = [json.loads(x.stdout) for x in (one, two)]
    assert docs[0]["ok"] and docs[1]["ok"]
    assert [untimed(d) for d in docs[1]["paths"]] == [untimed(d) for d in docs[0]["paths"]]
    assert sorted(tmp_path.iterdir()) == sorted(input_journal(tmp_path, p) for p in paths)
    for path in paths:
        own = input_journal(tmp_path, path)
        assert own is not None
        logs = sorted(own.glob("*.jsonl"))
        assert {p.name.split("-")[0] for p in logs} == {"0", "1"}  # both ranks read from each input
        for log in logs:
            header, *rows = log.read_text().splitlines()
            assert json.loads(header)["input"] == str(path.absolute())
            keys = [json.loads(row)["key"] for row in rows]
            assert all(key.startswith(str(path.absolute()) + os.sep) for key in keys), keys
            if path.name == "ranks":  # this path's own plan keeps each rank directory home
                assert all(f"/rank_{log.name.split('-')[0]}/" in key for key in keys), keys
    assert journal_lines(input_journal(tmp_path, ckpt200)) == 200  # type: ignore[arg-type]


@needs_torchrun
@pytest.mark.parametrize(("rel", "status"), [("ranks", 0), ("nosave_window2_pkl/ckpt", 1)])
def test_verify_deep_over_two_ranks_is_one_process_report(rel: str, status: int, tmp_path: Path) -> None:
    # RLinf's auto_save-off checkpoint lists files it never wrote: verification fails alike
    one = single("verify", FIXTURES / rel, "--deep", "--json")
    two = torchrun("verify", FIXTURES / rel, "--deep", "--json", "--journal", tmp_path)
    assert one.returncode == status and two.returncode == status, two.stderr[-2000:]
    assert untimed(json.loads(two.stdout)) == untimed(json.loads(one.stdout))
    if rel == "ranks":  # locality: each rank read its own rank directory (the journal says who read what)
        for path in tmp_path.glob("*.jsonl"):
            rank = path.name.split("-")[0]
            keys = [json.loads(line)["key"] for line in path.read_text().splitlines()[1:]]
            assert keys and all(f"/rank_{rank}/" in key for key in keys), (path.name, keys)


@needs_torchrun
@pytest.mark.parametrize(("rel", "status"), [("fixtures", 0), ("ckpt200", 1)])
def test_doctor_over_two_ranks_is_one_process_report(
    rel: str, status: int, ckpt200: Path, tmp_path: Path
) -> None:
    # the reference's rank tree is clean; ckpt200's random trajectories have findings at error level
    path = FIXTURES / "ranks" if rel == "fixtures" else ckpt200
    one = single("doctor", path, "--json", "--fail-on", "warning")
    two = torchrun("doctor", path, "--json", "--fail-on", "warning", "--journal", tmp_path)
    assert one.returncode == status and two.returncode == status, two.stderr[-2000:]
    assert untimed(json.loads(two.stdout)) == untimed(json.loads(one.stdout))


@needs_torchrun
def test_the_human_view_over_two_ranks_is_printed_once() -> None:
    path = FIXTURES / "autosave_pt" / "autosave"
    one, two = single("stats", path), torchrun("stats", path)
    assert one.returncode == two.returncode == 0, two.stderr[-2000:]

    def lines(text: str) -> list[str]:  # timings and rates differ from run to run
        return [re.sub(r"[\d.]+ (s|MB/s)\b", r"_ \1", line) for line in text.splitlines()]

    assert lines(two.stdout) == lines(one.stdout)
    assert two.stdout.count(str(path)) == one.stdout.count(str(path))


@needs_torchrun
def test_a_damaged_checkpoint_fails_alike_on_two_ranks(ckpt200: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "ckpt"
    shutil.copytree(ckpt200, damaged)
    victim = sorted(damaged.glob("trajectory_1[0-9]_*.pt"))[3]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 16] = b"\xff" * 16  # same size: only a deep pass sees it
    victim.write_bytes(data)
    one, two = single("verify", damaged, "--deep", "--json"), torchrun("verify", damaged, "--deep", "--json")
    assert one.returncode == two.returncode == 1
    errors = [line for line in two.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 2  # each rank says it, and both exit 1
    doc = untimed(json.loads(two.stdout))
    assert doc == untimed(json.loads(one.stdout))
    assert "hash_mismatch" in {c["code"] for c in doc["checkpoints"][0]["by_code"]}


@needs_torchrun
def test_stats_resumes_from_the_journal_after_a_lost_rank(ckpt200: Path, tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    one = single("stats", ckpt200, "--json")
    lost = torchrun(
        "stats", ckpt200, "--json", "--jobs", "1", "--journal", journal, lose=(1, 40),
    )  # fmt: skip
    assert lost.returncode != 0 and lost.stdout == ""
    recorded = journal_lines(journal)
    assert 40 <= recorded < 200
    again = torchrun("stats", ckpt200, "--json", "--journal", journal)
    assert again.returncode == 0, again.stderr[-2000:]
    assert journal_lines(journal) == 200  # only what was missing was read again
    assert untimed(json.loads(again.stdout), "data") == untimed(json.loads(one.stdout), "data")


@needs_torchrun
def test_verify_resumes_from_the_journal_after_a_lost_rank(ckpt200: Path, tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    one = single("verify", ckpt200, "--deep", "--json")
    lost = torchrun(
        "verify", ckpt200, "--deep", "--json", "--jobs", "1", "--journal", journal, lose=(0, 25),
    )  # fmt: skip
    assert lost.returncode != 0 and lost.stdout == ""
    assert 25 <= journal_lines(journal) < 200
    again = single("verify", ckpt200, "--deep", "--json", "--journal", journal)  # resumed on one process
    assert again.returncode == 0, again.stderr[-2000:]
    assert journal_lines(journal) == 200
    assert untimed(json.loads(again.stdout)) == untimed(json.loads(one.stdout))


@needs_torchrun
def test_convert_over_two_ranks_resumes_and_publishes_once(ckpt200: Path, tmp_path: Path) -> None:
    one_out, out = tmp_path / "one", tmp_path / "two"
    one = single("convert", ckpt200, "--out", one_out, "--format", "pkl", "--json")
    assert one.returncode == 0, one.stderr
    lost = torchrun(
        "convert", ckpt200, "--out", out, "--format", "pkl", "--json", "--jobs", "1", lose=(1, 30),
    )  # fmt: skip
    assert lost.returncode != 0 and lost.stdout == ""
    assert not out.exists()  # nothing half-written where OUT goes
    staging, journal = tmp_path / ".two.rbtool-resume-staging", tmp_path / ".two.rbtool-resume-journal"
    assert staging.is_dir() and 30 <= journal_lines(journal) < 200
    again = torchrun("convert", ckpt200, "--out", out, "--format", "pkl", "--json")
    assert again.returncode == 0, again.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]  # staging published, journal gone

    # .pkl bytes are not reproducible (torch's pickled storage names its memory address), so the
    # bytes written are checked against the files themselves, and the indexes without hashes
    def comparable(doc: dict[str, Any], out: Path) -> dict[str, Any]:
        untimed(doc).pop("out")
        for c in doc["checkpoints"]:
            c.pop("path")
        assert doc["files"].pop("bytes") == sum(p.stat().st_size for p in out.glob("trajectory_*.pkl"))
        return doc

    assert comparable(json.loads(again.stdout), out) == comparable(json.loads(one.stdout), one_out)
    a, b = (json.loads((d / "trajectory_index.json").read_text()) for d in (one_out, out))
    for doc in (a, b):
        for entry in doc["trajectory_index"].values():
            entry.pop("sha256")
    assert a == b
    assert json.loads((out / "metadata.json").read_text()) == json.loads(
        (one_out / "metadata.json").read_text()
    )
    check = single("verify", out, "--deep", "--json")
    assert check.returncode == 0 and json.loads(check.stdout)["ok"]


def test_convert_with_a_journal_resumes_after_a_bad_file(ckpt200: Path, tmp_path: Path) -> None:
    source, out, journal = tmp_path / "in", tmp_path / "out", tmp_path / "journal"
    shutil.copytree(ckpt200, source)
    tid = json.loads((source / "trajectory_index.json").read_text())["trajectory_id_list"][50]
    bad = next(source.glob(f"trajectory_{tid}_*.pt"))
    good = bad.read_bytes()
    bad.write_bytes(good[: len(good) // 2])
    failed = run("convert", source, "--out", out, "--format", "pkl", "--jobs", "1", "--journal", journal)
    assert failed.exit_code == 1 and failed.stderr.startswith("Error: ") and bad.name in failed.stderr
    assert not out.exists() and journal_lines(journal) == 50  # the files before the bad one
    bad.write_bytes(good)
    done = run(
        "convert", source, "--out", out, "--format", "pkl", "--jobs", "1", "--journal", journal, "--json"
    )
    assert done.exit_code == 0, done.stderr
    assert journal_lines(journal) == 200  # the 50 were not converted again
    assert json.loads(done.stdout)["files"]["written"] == 200
    assert not (tmp_path / ".out.rbtool-resume-staging").exists()
    check = run("verify", out, "--deep", "--json")
    assert check.exit_code == 0 and json.loads(check.stdout)["ok"]


# ------------------------------------------------------------------ export --to lerobot over ranks
@pytest.fixture(scope="module")
def ckpt40(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 trajectories of varied lengths with RGB images (even sizes, so --video takes them)."""
    from rbtool import TrajectoryReplayBuffer

    path = tmp_path_factory.mktemp("c40") / "ckpt"
    buf = TrajectoryReplayBuffer(seed=3, sample_window_size=0)
    buf.add_trajectories([make_traj(t=2 + i % 4, b=2, seed=i, image=4 + 2 * (i % 2)) for i in range(40)])
    buf.save_checkpoint(path)
    buf.close()
    return path


EXPORT = ("--to", "lerobot", "--fps", "10", "--data-file-size-mb", "0.02", "--json")


def same_files(a: Path, b: Path) -> list[Path]:
    """The files of two trees, asserted equal byte for byte; returns their relative paths."""
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for rel in files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    return files


def exported(doc: dict[str, Any]) -> dict[str, Any]:
    doc.pop("out")
    doc.pop("journal")  # how many trajectories came from a journal, if one was used
    return doc


@needs_torchrun
@pytest.mark.parametrize("video", [False, True])
def test_export_over_two_ranks_writes_the_dataset_one_process_writes(
    ckpt40: Path, video: bool, tmp_path: Path
) -> None:
    opts = (*EXPORT, *(("--video",) if video else ()))
    one = single("export", ckpt40, tmp_path / "one", *opts)
    two = torchrun("export", ckpt40, tmp_path / "two", *opts)
    assert one.returncode == two.returncode == 0, two.stderr[-2000:]
    doc = json.loads(one.stdout)
    assert exported(json.loads(two.stdout)) == exported(doc)
    assert doc["data_files"] > 1 and doc["episodes"] > 40 and (doc["video_files"] > 0) == video
    files = same_files(tmp_path / "one", tmp_path / "two")
    assert any(p.suffix == ".mp4" for p in files) == video
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]  # no staging, no journal left


@needs_torchrun
def test_export_over_two_ranks_resumes_from_its_journal(ckpt40: Path, tmp_path: Path) -> None:
    one = single("export", ckpt40, tmp_path / "one", *EXPORT)
    assert one.returncode == 0, one.stderr
    out = tmp_path / "two"
    lost = torchrun("export", ckpt40, out, *EXPORT, lose=(1, 5))
    assert lost.returncode != 0 and lost.stdout == ""
    assert not out.exists()  # nothing half-written where OUT goes
    staging, journal = tmp_path / ".two.rbtool-resume-staging", tmp_path / ".two.rbtool-resume-journal"
    assert staging.is_dir() and 5 <= journal_lines(journal) < 40
    again = torchrun("export", ckpt40, out, *EXPORT)
    assert again.returncode == 0, again.stderr[-2000:]
    assert exported(json.loads(again.stdout)) == exported(json.loads(one.stdout))
    same_files(tmp_path / "one", out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]


def test_export_with_a_journal_in_one_process_writes_the_same_dataset(ckpt40: Path, tmp_path: Path) -> None:
    plain = run("export", ckpt40, tmp_path / "plain", *EXPORT)
    journaled = run("export", ckpt40, tmp_path / "journaled", *EXPORT, "--journal", tmp_path / "journal")
    assert plain.exit_code == journaled.exit_code == 0, journaled.stderr
    assert exported(json.loads(journaled.stdout)) == exported(json.loads(plain.stdout))
    same_files(tmp_path / "plain", tmp_path / "journaled")
    assert journal_lines(tmp_path / "journal") == 40  # kept: it was given
    assert sorted(p.name for p in tmp_path.iterdir()) == ["journal", "journaled", "plain"]


@needs_torchrun
def test_export_over_two_ranks_fails_alike_on_a_damaged_file(ckpt40: Path, tmp_path: Path) -> None:
    source, out = tmp_path / "in", tmp_path / "out"
    shutil.copytree(ckpt40, source)
    damaged = sorted(source.glob("trajectory_*"))[-1]
    damaged.write_bytes(damaged.read_bytes()[:100])
    failed = torchrun("export", source, out, *EXPORT)
    assert failed.returncode != 0 and failed.stdout == ""
    assert f"Error: {damaged}" in failed.stderr
    assert not out.exists() and not (tmp_path / ".out.rbtool-resume-staging" / "data").exists()
