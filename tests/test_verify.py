"""verify: every problem is found and reported with its code, the reference fixtures judged right."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from conftest import FIXTURES, RLINF_DIRS, make_traj, tree_digest

from rbtool.files.index import Index, read_index, write_index
from rbtool.format import check as format_check
from rbtool.ops.verify import PROBLEM_CODES, verify, verify_checkpoint

NOSAVE = [rel for rel in RLINF_DIRS if "nosave_window2" in rel]
CLEAN = [rel for rel in RLINF_DIRS if rel not in NOSAVE]
BASE = "autosave_pt/autosave"  # five trajectories, ids 0-4, pt, RLinf's own entries


# ------------------------------------------------------------------ helpers
def read_json(path: Path) -> Any:
    return orjson.loads(path.read_bytes())


def write_json(path: Path, doc: Any) -> None:
    path.write_bytes(orjson.dumps(doc))


def edit_meta(ckpt: Path, **changes: Any) -> None:
    meta = read_json(ckpt / "metadata.json")
    meta.update(changes)
    write_json(ckpt / "metadata.json", meta)


def edit_index(ckpt: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    doc = read_json(ckpt / "trajectory_index.json")
    fn(doc)
    write_json(ckpt / "trajectory_index.json", doc)


def file_of(ckpt: Path, tid: int) -> Path:
    (path,) = ckpt.glob(f"trajectory_{tid}_*")
    return path


def codes(report: Any) -> Counter[str]:
    return Counter(p.code for p in report.problems)


def save_traj(ckpt: Path, tid: int, traj: dict[str, Any]) -> None:
    """Replace trajectory `tid`'s file contents, keeping its name."""
    import torch

    torch.save(traj, file_of(ckpt, tid))


def like(ckpt: Path, tid: int, **overrides: Any) -> dict[str, Any]:
    """A trajectory shaped like the reference ones, with `tid`'s model_weights_id."""
    weights_id = read_index(ckpt).entries[tid]["model_weights_id"]
    return make_traj(image=16, model_weights_id=weights_id, **overrides)


def drop_from_index(ckpt: Path, tid: int) -> None:
    """Remove an id from list and entries and fix the counts, leaving its file behind."""
    index = read_index(ckpt)
    write_index(ckpt, index.subset([i for i in index.id_list if i != tid]))


# ----------------------------------------------------------- the fixtures
@pytest.mark.parametrize("deep", [False, True], ids=["quick", "deep"])
@pytest.mark.parametrize("rel", CLEAN)
def test_reference_checkpoints_pass(rel: str, deep: bool) -> None:
    result = verify(FIXTURES / rel, deep=deep)
    # RLinf records no sizes or hashes: a quick check says only a deep one proves the files whole
    assert result.ok and result.counts() == {"error": 0, "warning": 0, "notice": 0 if deep else 1}
    assert all(
        [p.code for p in c.problems] == ([] if deep else ["sizes_unrecorded"]) for c in result.checkpoints
    )
    assert [c.size for c in result.checkpoints] == [len(read_index(FIXTURES / rel).id_list)]


@pytest.mark.parametrize("deep", [False, True], ids=["quick", "deep"])
@pytest.mark.parametrize("rel", NOSAVE)
def test_nosave_fixtures_fail_on_their_three_missing_files(rel: str, deep: bool) -> None:
    result = verify(FIXTURES / rel, deep=deep)
    (report,) = result.checkpoints
    assert not result.ok and report.size == 5
    assert [(p.code, p.severity, p.trajectory_id) for p in report.problems] == [
        ("file_missing", "error", 0),
        ("file_missing", "error", 1),
        ("file_missing", "error", 2),
        *([] if deep else [("sizes_unrecorded", "notice", None)]),
    ]
    index = read_index(FIXTURES / rel)
    assert [p.file for p in report.problems][:3] == [index.file_name(i) for i in (0, 1, 2)]


def test_folder_of_ranks_checks_each_rank() -> None:
    result = verify(FIXTURES / "ranks")
    assert [c.path.name for c in result.checkpoints] == ["rank_0", "rank_1"]
    assert [c.size for c in result.checkpoints] == [3, 4] and result.ok


def test_json_document_shape() -> None:
    doc = verify(FIXTURES / NOSAVE[0]).as_json()
    assert set(doc) == {"path", "deep", "ok", "checkpoints", "counts", "bytes_read", "seconds",
                        "bytes_per_second", "jobs", "journal"}  # fmt: skip
    assert doc["ok"] is False and doc["counts"] == {"error": 3, "warning": 0, "notice": 1}
    (ckpt,) = doc["checkpoints"]
    assert set(ckpt) == {"path", "ok", "size", "problems"}
    assert all(set(p) == {"code", "severity", "trajectory_id", "file", "message"} for p in ckpt["problems"])
    again = orjson.loads(orjson.dumps(verify(FIXTURES / NOSAVE[0]).as_json(plain=False)))
    assert {**again, "seconds": None} == {**doc, "seconds": None}  # the same document, timing aside


def test_paths_that_are_not_checkpoints_raise(tmp_path: Path) -> None:
    from rbtool.errors import CheckpointError

    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    for path, words in [
        (tmp_path / "nope", "no such file"),
        (tmp_path / "file", "not a directory"),
        (tmp_path / "empty", "neither a checkpoint"),
    ]:
        with pytest.raises(CheckpointError, match=words):
            verify(path)


def test_quick_check_does_not_import_torch() -> None:
    code = (
        "import sys\nfrom rbtool.ops.verify import verify\n"
        f"r = verify({str(FIXTURES / NOSAVE[0])!r})\n"
        "assert not r.ok\nprint('torch' in sys.modules)"
    )
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "False"


def test_verify_leaves_the_directory_unchanged(rlinf_copy: Any) -> None:
    ckpt = rlinf_copy(NOSAVE[0])
    before = tree_digest(ckpt)
    verify(ckpt, deep=True)
    assert tree_digest(ckpt) == before


# ------------------------------------------------------------ every code
class Evil:
    """Unpickling this runs a shell command that creates a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        import os

        return (os.system, (f"touch {self.marker}",))


def save_evil(path: Path, marker: Path) -> None:
    """A .pt file (torch's zip format) whose pickle reaches for os.system."""
    import torch

    torch.save({"rewards": Evil(marker)}, path)


def scenario_cases() -> dict[str, Callable[[Path], None]]:
    """code -> a change to a copy of the base checkpoint that must produce that code."""

    def legacy_mismatch(c: Path) -> None:
        doc = read_json(c / "trajectory_index.json")
        doc["trajectory_id_list"] = doc["trajectory_id_list"][::-1]
        write_json(c / "trajector_index.json", doc)

    def behind(c: Path) -> None:
        # what an index update interrupted before metadata.json was rewritten leaves
        meta = (c / "metadata.json").read_bytes()
        index = read_index(c)
        src = file_of(c, 4)
        shutil.copy(src, c / src.name.replace("trajectory_4_", "trajectory_5_"))
        index.entries[5] = {**index.entries[4], "trajectory_id": 5}
        index.id_list.append(5)
        index.trajectory_counter = 6
        write_index(c, index)
        (c / "metadata.json").write_bytes(meta)

    def changed_in_place(c: Path) -> None:
        # rbtool linked the file (and recorded its inode's identity); then it was rewritten in place
        edit_meta(c, format_version=1)
        path = file_of(c, 2)
        st = path.stat()
        link = {"inode": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        edit_index(c, lambda d: d["trajectory_index"]["2"].update(link=link, file_bytes=st.st_size))
        with open(path, "r+b") as handle:  # same bytes, same size: only the identity tells
            data = handle.read()
            handle.seek(0)
            handle.write(data)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))

    def wrong_shape_entry(c: Path) -> None:
        def fn(d: dict[str, Any]) -> None:
            d["trajectory_index"]["1"].update(shape=[5, 2, 7], num_samples=10)

        edit_index(c, fn)
        edit_meta(c, total_samples=42)

    return {
        "metadata_missing": lambda c: (c / "metadata.json").unlink(),
        "metadata_unreadable": lambda c: (c / "metadata.json").write_text("{"),
        "metadata_invalid": lambda c: edit_meta(c, trajectory_format="npz"),
        "index_missing": lambda c: (c / "trajectory_index.json").unlink(),
        "index_unreadable": lambda c: (c / "trajectory_index.json").write_bytes(b"\x00garbage"),
        "index_invalid": lambda c: edit_index(c, lambda d: d.update(trajectory_index=[])),
        "legacy_index_unreadable": lambda c: (c / "trajector_index.json").write_text("[1"),
        "legacy_index_mismatch": legacy_mismatch,
        "entry_invalid": lambda c: edit_index(c, lambda d: d["trajectory_index"]["2"].update(shape=[4])),
        "num_samples_mismatch": lambda c: edit_index(
            c, lambda d: d["trajectory_index"]["2"].update(num_samples=9)
        ),
        "duplicate_id": lambda c: (
            edit_index(c, lambda d: d["trajectory_id_list"].insert(0, 3)),
            edit_meta(c, size=6, total_samples=48),
        ),
        "entry_missing": lambda c: edit_index(c, lambda d: d["trajectory_index"].pop("3")),
        "entry_unlisted": lambda c: (
            edit_index(c, lambda d: d["trajectory_id_list"].remove(3)),
            edit_meta(c, size=4, total_samples=32),
        ),
        "schema_table_invalid": lambda c: edit_meta(c, field_schemas={"ab": [["x"]]}),
        "size_mismatch": lambda c: edit_meta(c, size=7),
        "total_samples_mismatch": lambda c: edit_meta(c, total_samples=41),
        "counter_too_low": lambda c: edit_meta(c, trajectory_counter=3),
        "metadata_behind_index": behind,
        "file_missing": lambda c: file_of(c, 2).unlink(),
        "file_outside": lambda c: (
            shutil.move(file_of(c, 2), c.parent / "elsewhere.pt"),
            (c / (c.parent / "elsewhere.pt").name).unlink(missing_ok=True),
            (c / read_index(c).file_name(2)).symlink_to(c.parent / "elsewhere.pt"),
        ),
        "duplicate_files": lambda c: shutil.copy(file_of(c, 2), file_of(c, 2).with_suffix(".pkl")),
        "file_name_mismatch": lambda c: file_of(c, 2).rename(c / "trajectory_2_other.pt"),
        "file_size_mismatch": lambda c: (
            edit_meta(c, format_version=1),  # written by rbtool: its records are proof
            edit_index(c, lambda d: d["trajectory_index"]["2"].update(file_bytes=12)),
        ),
        "linked_file_changed": changed_in_place,
        "file_size_hint": lambda c: edit_index(  # RLinf wrote last: the record is a hint
            c, lambda d: d["trajectory_index"]["2"].update(file_bytes=12)
        ),
        "stray_file": lambda c: drop_from_index(c, 2),
        "uncommitted_file": lambda c: shutil.copy(file_of(c, 1), c / "trajectory_9_late.pt"),
        "file_unreadable": lambda c: file_of(c, 1).write_bytes(file_of(c, 1).read_bytes()[:100]),
        "file_unsafe": lambda c: save_evil(file_of(c, 1), c / "MARK"),
        "trajectory_invalid": lambda c: save_traj(c, 1, {"actions": make_traj()["actions"]}),
        "done_rows_invalid": lambda c: save_traj(c, 1, like(c, 1, extra_rows=3)),
        "shape_mismatch": wrong_shape_entry,
        "field_mismatch": lambda c: save_traj(c, 1, make_traj(model_weights_id="someone-else")),
        "non_finite": lambda c: save_traj(c, 1, like(c, 1, rewards=make_traj()["rewards"] / 0)),
        "hash_mismatch": lambda c: (
            edit_meta(c, format_version=1),
            edit_index(c, lambda d: d["trajectory_index"]["2"].update(sha256="0" * 64)),
        ),
        "hash_hint": lambda c: edit_index(c, lambda d: d["trajectory_index"]["2"].update(sha256="0" * 64)),
        "seed_null": lambda c: edit_meta(c, seed=None),
        "sizes_unrecorded": lambda c: None,  # RLinf's files as they are: no sizes, no hashes
        "format_too_new": lambda c: edit_meta(c, format_version=2),
        "schema_differs": lambda c: save_traj(c, 3, like(c, 3, extra=make_traj()["actions"])),
    }


# Problems of a rank tree as a whole (tests/test_ci_gates.py makes each of them).
TREE_CODES = {"rank_missing", "rank_misplaced"}


def test_every_problem_code_has_a_scenario() -> None:
    assert set(scenario_cases()) == set(PROBLEM_CODES) - TREE_CODES


@pytest.mark.parametrize("code", sorted(scenario_cases()))
def test_each_problem_code_is_reported(rlinf_copy: Any, code: str) -> None:
    ckpt = rlinf_copy(BASE)
    scenario_cases()[code](ckpt)
    deep = code.startswith(
        ("file_un", "trajectory_", "done_", "shape_", "field_", "non_", "hash_", "schema_")
    )
    report = verify_checkpoint(ckpt, deep=deep)
    found = codes(report)
    assert code in found, [p.message for p in report.problems]
    severity = PROBLEM_CODES[code][0]
    assert report.ok is not any(p.severity == "error" for p in report.problems)
    if severity != "error":
        assert report.ok, [(p.code, p.message) for p in report.problems]
    for problem in report.problems:
        assert "\n" not in problem.message and problem.message
    if code == "file_unsafe":
        assert not (ckpt / "MARK").exists()


def test_scenarios_report_nothing_else_where_nothing_else_is_wrong(rlinf_copy: Any) -> None:
    """The plain scenarios produce exactly their own code (no cascade of follow-on problems)."""
    exact = {
        "metadata_invalid": 1,
        "size_mismatch": 1,
        "total_samples_mismatch": 1,
        "counter_too_low": 1,
        "file_missing": 1,
        "duplicate_files": 1,
        "file_name_mismatch": 1,
        "file_size_mismatch": 1,
        "file_size_hint": 1,
        "seed_null": 1,
        "format_too_new": 1,
        "stray_file": 1,
        "uncommitted_file": 1,
        "duplicate_id": 1,
        "metadata_behind_index": 1,
        "legacy_index_mismatch": 1,
        "num_samples_mismatch": 1,
    }
    for code, n in exact.items():
        ckpt = rlinf_copy(BASE)
        scenario_cases()[code](ckpt)
        report = verify_checkpoint(ckpt)
        found = codes(report)
        found.pop("sizes_unrecorded", None)  # the base is RLinf's: it records no sizes
        assert found == Counter({code: n}), (code, [p.message for p in report.problems])
        shutil.rmtree(ckpt)


def test_metadata_behind_index_does_not_fail_but_lag_elsewhere_does(rlinf_copy: Any) -> None:
    ckpt = rlinf_copy(BASE)
    scenario_cases()["metadata_behind_index"](ckpt)
    assert verify_checkpoint(ckpt).ok
    edit_meta(ckpt, total_samples=33)  # no longer the first `size` entries' sum
    report = verify_checkpoint(ckpt)
    assert not report.ok and {"size_mismatch", "total_samples_mismatch", "counter_too_low"} <= set(
        codes(report)
    )


def test_hidden_files_and_merge_map_are_ignored(rlinf_copy: Any) -> None:
    ckpt = rlinf_copy(BASE)
    (ckpt / ".rbtool.lock").write_text("pid 1")
    shutil.copy(file_of(ckpt, 0), ckpt / ".trajectory_7_x.pt.abc.tmp")
    (ckpt / ".out.rbtool-staging-123").mkdir()
    shutil.copy(file_of(ckpt, 0), ckpt / ".out.rbtool-staging-123" / "trajectory_0_x.pt")
    (ckpt / "merge_map.json").write_text("{}")
    (ckpt / "notes.txt").write_text("not a trajectory")
    report = verify_checkpoint(ckpt, deep=True)
    assert report.problems == [] and report.ok


def test_every_bad_entry_and_every_missing_file_is_reported(rlinf_copy: Any) -> None:
    ckpt = rlinf_copy(BASE)

    def fn(d: dict[str, Any]) -> None:
        d["trajectory_index"]["0"]["shape"] = "4x2"
        d["trajectory_index"]["1"]["model_weights_id"] = "../../etc"
        d["trajectory_index"]["2"]["trajectory_id"] = 7
        d["trajectory_id_list"].append("x")

    edit_index(ckpt, fn)
    file_of(ckpt, 3).unlink()
    file_of(ckpt, 4).unlink()
    report = verify_checkpoint(ckpt)
    found = codes(report)
    assert found["entry_invalid"] == 3 and found["file_missing"] == 2 and found["index_invalid"] == 1
    assert sorted(p.trajectory_id for p in report.problems if p.code == "entry_invalid") == [0, 1, 2]


def test_schema_differences_are_listed(rlinf_copy: Any) -> None:
    ckpt = rlinf_copy(BASE)
    traj = like(ckpt, 3, extra=make_traj()["actions"])
    del traj["prev_values"]
    traj["actions"] = traj["actions"].double()
    save_traj(ckpt, 3, traj)
    report = verify_checkpoint(ckpt, deep=True)
    (problem,) = report.problems
    assert problem.code == "schema_differs" and problem.severity == "warning" and problem.trajectory_id == 3
    for words in ("lacks prev_values", "has extra extra", "actions is float64[7] (not float32[7])"):
        assert words in problem.message
    assert report.ok


def test_varying_t_and_b_are_not_schema_differences() -> None:
    report = verify_checkpoint(FIXTURES / "varying_shapes_pt/ckpt", deep=True)
    assert report.problems == []


def test_typed_and_general_paths_agree(rlinf_copy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast typed decode is an optimisation only: the general path finds the same problems."""
    ckpt = rlinf_copy(BASE)
    index = read_index(ckpt)
    big = Index(seed=1, trajectory_format="pt")
    for i in range(2000):
        big.entries[i] = {**index.entries[i % 5], "trajectory_id": i, "file_bytes": 10}
        big.id_list.append(i)
    big.trajectory_counter = 2000
    write_index(ckpt, big)
    fast = verify_checkpoint(ckpt)
    monkeypatch.setattr(format_check, "decode_typed", lambda data, strict=False: None)
    slow = verify_checkpoint(ckpt)
    assert fast.problems == slow.problems
    assert codes(fast) == Counter({"file_missing": 1995, "file_size_mismatch": 5})


@pytest.mark.parametrize("jobs", [1, 2, 5])
def test_deep_pass_reports_alike_on_any_number_of_threads(rlinf_copy: Any, jobs: int) -> None:
    """Problems come in list order whatever the threads' timing; each file is read once."""
    ckpt = rlinf_copy(BASE)
    file_of(ckpt, 1).write_bytes(file_of(ckpt, 1).read_bytes()[:100])  # unreadable
    save_traj(ckpt, 3, like(ckpt, 3, rewards=make_traj()["rewards"] / 0))  # non-finite
    one = verify(ckpt, deep=True, jobs=1)
    many = verify(ckpt, deep=True, jobs=jobs)
    assert [p.as_json() for c in many.checkpoints for p in c.problems] == [
        p.as_json() for c in one.checkpoints for p in c.problems
    ]
    sizes = sum(p.stat().st_size for p in ckpt.glob("trajectory_*_*.pt"))
    assert many.bytes_read == one.bytes_read == sizes and many.jobs == jobs
    doc = many.as_json()
    assert doc["bytes_per_second"] > 0 and doc["bytes_read"] == sizes
    assert verify(ckpt).as_json()["bytes_per_second"] is None  # quick: nothing read


def test_jobs_must_be_positive() -> None:
    from rbtool.errors import UsageError

    with pytest.raises(UsageError, match="jobs must be an integer >= 1"):
        verify(FIXTURES / BASE, deep=True, jobs=0)


def test_a_source_rewritten_in_place_shows_in_every_checkpoint_linking_it(tmp_path: Path) -> None:
    """shard links files; RLinf-style `torch.save(path)` onto the source changes both names."""
    import torch

    from rbtool import TrajectoryReplayBuffer, shard

    src = tmp_path / "src"
    with TrajectoryReplayBuffer(sample_window_size=0) as buffer:
        buffer.add_trajectories([make_traj(seed=i) for i in range(4)])
        buffer.save_checkpoint(src)
    shard(src, 2, tmp_path / "shards")
    assert verify(tmp_path / "shards").ok
    rank_1 = tmp_path / "shards" / "rank_1"
    linked = next(rank_1.glob("trajectory_3_*.pt"))
    assert linked.stat().st_nlink > 1 and "link" in read_index(rank_1).entries[3]
    original = src / linked.name
    torch.save(make_traj(seed=99), original)  # in place: same inode, so the shard's file changed too
    report = verify_checkpoint(rank_1)
    errors = {p.code for p in report.problems if p.severity == "error"}
    assert not report.ok and "linked_file_changed" in errors
