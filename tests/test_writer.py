"""rbtool.files.writer: placing trajectory files, publishing directories, the auto-save thread."""

from __future__ import annotations

import functools
import os
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_traj, staging_left

from rbtool.errors import CheckpointError, OutputExistsError, RbtoolError
from rbtool.files import trajfile
from rbtool.files.fsutil import DirLock
from rbtool.files.index import Index, read_index
from rbtool.files.writer import (
    AutoSaveWriter,
    BufferWriter,
    Rules,
    Source,
    WriteReport,
    copied_entries,
    fill_dir,
    new_entry,
    place_trajectory,
    write_checkpoint,
)
from rbtool.format import INDEX_FILE, METADATA_FILE, layout


def assert_same_tensors(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    got, want = dict(layout.iter_tensors(actual)), dict(layout.iter_tensors(expected))
    assert list(got) == list(want)
    for path, tensor in want.items():
        assert got[path].dtype == tensor.dtype and torch.equal(got[path], tensor), path


def index_of(trajs: dict[int, dict[str, Any]], fmt: str = "pt", counter: int | None = None) -> Index:
    entries = {
        tid: new_entry(tid, layout.describe(traj, f"#{tid}"), uuid.uuid4().hex) for tid, traj in trajs.items()
    }
    return Index(
        entries=entries,
        id_list=list(trajs),
        trajectory_counter=max(trajs, default=-1) + 1 if counter is None else counter,
        trajectory_format=fmt,
    )


def write_file(path: Path, traj: dict[str, Any]) -> Path:
    path.write_bytes(trajfile.to_bytes(traj, path.suffix[1:]))
    return path


# ------------------------------------------------------------------- new_entry
def test_new_entry_records_what_the_index_holds() -> None:
    traj = make_traj(t=5, b=3, model_weights_id="v7")
    entry = new_entry(4, layout.describe(traj, "t"), "ab" * 16)
    assert entry == {
        "num_samples": 15,
        "trajectory_id": 4,
        "max_episode_length": 5,
        "shape": [5, 3, 7],
        "model_weights_id": "v7",
        "uuid": "ab" * 16,
    }


def test_copied_entries_can_change_without_touching_the_original() -> None:
    index = index_of({0: make_traj(seed=0), 3: make_traj(seed=3)})
    copy = copied_entries(index)
    copy.entries[3]["sha256"] = "x"
    copy.id_list.append(9)
    assert "sha256" not in index.entries[3] and index.id_list == [0, 3]
    assert copy.entries[0] == index.entries[0] and copy.trajectory_counter == index.trajectory_counter


# ------------------------------------------------------------ place_trajectory
def test_same_format_files_are_linked(tmp_path: Path) -> None:
    src = write_file(tmp_path / "src.pt", make_traj(seed=1))
    dst = tmp_path / "out" / "trajectory_0_x.pt"
    dst.parent.mkdir()
    entry: dict[str, Any] = {"sha256": trajfile.sha256_file(src), "file_bytes": src.stat().st_size}
    report = WriteReport()
    place_trajectory(src, dst, entry, report)
    assert os.stat(src).st_ino == os.stat(dst).st_ino
    assert report == WriteReport(linked=1, bytes=src.stat().st_size)
    # the recorded hash is of this very file: kept; the link records the inode's identity
    st = dst.stat()
    assert entry == {
        "sha256": trajfile.sha256_file(src),
        "file_bytes": st.st_size,
        "link": {"inode": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns},
    }


def test_a_hash_recorded_for_another_size_is_dropped(tmp_path: Path) -> None:
    src = write_file(tmp_path / "src.pkl", make_traj(seed=2))
    entry: dict[str, Any] = {"sha256": "0" * 64, "file_bytes": 1}
    place_trajectory(src, tmp_path / "trajectory_0_x.pkl", entry, WriteReport())
    entry.pop("link")
    assert entry == {"file_bytes": src.stat().st_size}


@pytest.mark.parametrize(("src_fmt", "dst_fmt"), [("pt", "pkl"), ("pkl", "pt")])
def test_other_formats_are_rewritten_with_their_hash(tmp_path: Path, src_fmt: str, dst_fmt: str) -> None:
    traj = make_traj(seed=3)
    src = write_file(tmp_path / f"src.{src_fmt}", traj)
    dst = tmp_path / f"trajectory_0_x.{dst_fmt}"
    entry: dict[str, Any] = {"sha256": "stale", "file_bytes": 5}
    report = WriteReport()
    place_trajectory(src, dst, entry, report)
    size = dst.stat().st_size
    assert entry == {"sha256": trajfile.sha256_file(dst), "file_bytes": size}
    assert report == WriteReport(written=1, bytes=size)
    assert os.stat(src).st_ino != os.stat(dst).st_ino
    assert_same_tensors(trajfile.load(dst), traj)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([src.name, dst.name])  # no temporaries


@pytest.mark.parametrize("fmt", ["pt", "pkl"])
def test_a_dict_is_serialized(tmp_path: Path, fmt: str) -> None:
    traj = make_traj(seed=4)
    dst = tmp_path / f"trajectory_0_x.{fmt}"
    entry: dict[str, Any] = {}
    report = WriteReport()
    place_trajectory(traj, dst, entry, report)
    assert dst.read_bytes() == trajfile.to_bytes(traj, fmt)
    assert entry["sha256"] == trajfile.sha256_file(dst) and report.written == 1


def test_write_report_adds_up_and_serializes() -> None:
    total = WriteReport(linked=1, bytes=10)
    total.add(WriteReport(reflinked=4, copied=2, written=3, bytes=5))
    assert total.as_json() == {"reflinked": 4, "linked": 1, "copied": 2, "written": 3, "bytes": 15}


# -------------------------------------------------------------------- fill_dir
def test_fill_dir_publishes_exactly_the_listed_entries(tmp_path: Path) -> None:
    trajs = {i: make_traj(t=2 + i, b=1 + i % 2, seed=i, model_weights_id=f"v{i}") for i in range(5)}
    full = index_of(trajs, counter=11)
    full.seed = 77
    index = copied_entries(full.subset([4, 1, 3]))
    loose = {tid: write_file(tmp_path / f"loose_{tid}.pt", traj) for tid, traj in trajs.items()}
    done: list[int] = []
    out = tmp_path / "out"
    out.mkdir()
    report = fill_dir(out, index, loose.__getitem__, done.append)
    assert done == [1, 1, 1] and report.linked == 3
    assert {p.name for p in out.iterdir()} == {
        INDEX_FILE,
        METADATA_FILE,
        "trajectory_4_v4.pt",
        "trajectory_1_v1.pt",
        "trajectory_3_v3.pt",
    }
    back = read_index(out)
    assert back.id_list == [4, 1, 3] and back.trajectory_counter == 11 and back.seed == 77
    assert back.entries == index.entries
    assert back.total_samples == sum(
        trajs[i]["rewards"].shape[0] * trajs[i]["rewards"].shape[1] for i in (4, 1, 3)
    )
    for tid in back.id_list:
        assert back.entries[tid]["file_bytes"] == (out / back.file_name(tid)).stat().st_size


# ------------------------------------------------------------ write_checkpoint
def test_write_checkpoint_publishes_a_loadable_checkpoint(tmp_path: Path) -> None:
    trajs = {i: make_traj(seed=i, model_weights_id=f"v{i}") for i in range(3)}
    index = index_of(trajs, fmt="pkl")
    out = tmp_path / "nested" / "ckpt"
    report = write_checkpoint(out, copied_entries(index), trajs.__getitem__)
    assert report.written == 3 and staging_left(out.parent) == []
    back = read_index(out)
    assert back.id_list == [0, 1, 2] and back.trajectory_format == "pkl"
    for tid, traj in trajs.items():
        assert_same_tensors(trajfile.load(out / back.file_name(tid)), traj)


def test_a_failing_source_leaves_no_target_and_no_staging(tmp_path: Path) -> None:
    trajs = {i: make_traj(seed=i) for i in range(4)}
    asked: list[int] = []

    def source_of(tid: int) -> Source:
        asked.append(tid)
        if tid == 2:
            raise CheckpointError("trajectory 2 is gone")
        return trajs[tid]

    out = tmp_path / "ckpt"
    with pytest.raises(CheckpointError, match="trajectory 2 is gone"):
        write_checkpoint(out, index_of(trajs), source_of)
    assert asked == [0, 1, 2]
    assert list(tmp_path.iterdir()) == []


def test_write_checkpoint_replaces_only_when_asked(tmp_path: Path) -> None:
    trajs = {0: make_traj(seed=0)}
    out = tmp_path / "ckpt"
    write_checkpoint(out, index_of(trajs), trajs.__getitem__)
    before = (out / METADATA_FILE).read_bytes()
    with pytest.raises(OutputExistsError):
        write_checkpoint(out, index_of({5: make_traj(seed=5)}), {5: make_traj(seed=5)}.__getitem__)
    assert (out / METADATA_FILE).read_bytes() == before and staging_left(tmp_path) == []
    write_checkpoint(
        out, index_of({5: make_traj(seed=5)}), {5: make_traj(seed=5)}.__getitem__, Rules(overwrite=True)
    )
    assert read_index(out).id_list == [5] and staging_left(tmp_path) == []
    assert len(list(out.glob("trajectory_*.pt"))) == 1


# -------------------------------------------------------------- AutoSaveWriter
def submit_write(writer: AutoSaveWriter, name: str, data: bytes) -> None:
    writer.submit(functools.partial(writer.write_file, name, data))


def submit_publish(writer: AutoSaveWriter, index: Index) -> None:
    writer.submit(functools.partial(writer.publish, index))


@pytest.fixture
def writer(tmp_path: Path) -> Any:
    directory = tmp_path / "buffer"
    directory.mkdir()
    opened = AutoSaveWriter(directory)
    yield opened
    opened.close()


def test_jobs_run_in_order_files_before_the_index_naming_them(writer: AutoSaveWriter) -> None:
    directory = writer.directory
    trajs = {i: make_traj(seed=i, model_weights_id="w") for i in range(4)}
    seen: list[tuple[int, bool, list[int]]] = []

    def observe(tid: int) -> None:
        listed = read_index(directory).id_list if (directory / METADATA_FILE).exists() else []
        seen.append((tid, (directory / f"trajectory_{tid}_w.pt").is_file(), listed))

    for tid, traj in trajs.items():
        data = trajfile.to_bytes(traj, "pt")
        submit_write(writer, f"trajectory_{tid}_w.pt", data)
        writer.submit(functools.partial(observe, tid))
        submit_publish(writer, index_of({i: trajs[i] for i in range(tid + 1)}))
    writer.flush()
    # each file was complete while the published index still listed only the earlier ones
    assert seen == [(tid, True, list(range(tid))) for tid in trajs]
    assert read_index(directory).id_list == [0, 1, 2, 3]


def test_a_reader_never_meets_an_index_naming_a_missing_file(writer: AutoSaveWriter) -> None:
    directory = writer.directory
    finished = threading.Event()
    problems: list[str] = []
    reads = [0]

    def reader() -> None:
        while not finished.is_set():
            if not (directory / METADATA_FILE).exists():
                continue
            index = read_index(directory)
            reads[0] += 1
            for tid in index.id_list:
                path = directory / index.file_name(tid)
                if not path.is_file() or path.stat().st_size != index.entries[tid]["file_bytes"]:
                    problems.append(f"{path} listed before it was complete")

    thread = threading.Thread(target=reader)
    thread.start()
    trajs: dict[int, dict[str, Any]] = {}
    sizes: dict[int, int] = {}
    for tid in range(30):
        trajs[tid] = make_traj(t=2, b=1, seed=tid, image=16, model_weights_id="w")
        data = trajfile.to_bytes(trajs[tid], "pt")
        sizes[tid] = len(data)
        snapshot = index_of(dict(trajs))
        for i, size in sizes.items():
            snapshot.entries[i]["file_bytes"] = size
        submit_write(writer, f"trajectory_{tid}_w.pt", data)
        submit_publish(writer, snapshot)
    writer.flush()
    finished.set()
    thread.join(30)
    assert problems == [] and reads[0] > 0
    assert read_index(directory).id_list == list(range(30))


def test_flush_re_raises_a_background_failure_and_nothing_runs_after_it(writer: AutoSaveWriter) -> None:
    ran = threading.Event()

    def fail() -> None:
        raise OSError(28, "No space left on device")

    writer.submit(fail)
    writer.submit(ran.set)  # e.g. the publish of an index naming the file that failed
    with pytest.raises(
        RbtoolError, match=r"a background write to .*buffer failed: .*No space left"
    ) as caught:
        writer.flush()
    assert isinstance(caught.value.__cause__, OSError)
    assert not ran.is_set()  # an index published now would name a missing file
    submit_write(writer, "x.bin", b"ok")
    with pytest.raises(RbtoolError, match="an earlier background write failed"):
        writer.flush()
    assert not (writer.directory / "x.bin").exists()


def test_the_directory_is_locked_while_a_writer_is_open(tmp_path: Path) -> None:
    directory = tmp_path / "buffer"
    directory.mkdir()
    first = AutoSaveWriter(directory)
    try:
        with pytest.raises(CheckpointError) as caught:
            AutoSaveWriter(directory)
        assert str(caught.value) == f"{directory}: in use by another rbtool process (pid {os.getpid()})"
        with pytest.raises(CheckpointError):
            DirLock(directory, wait=False).acquire()
    finally:
        first.close()
    second = AutoSaveWriter(directory)  # released by close
    second.close()


def test_a_buffer_writer_places_then_publishes_and_waits_for_the_lock(tmp_path: Path) -> None:
    """ingest's writer: the same lock and publish order as the auto-save thread, synchronously."""
    directory = tmp_path / "buffer"
    directory.mkdir()
    src = tmp_path / "t.pt"
    torch.save(make_traj(), src)
    holder = AutoSaveWriter(directory)
    told: list[str] = []
    got: list[BufferWriter] = []
    waiting = threading.Event()

    def open_writer() -> None:
        got.append(BufferWriter(directory, wait=True, on_wait=lambda who: (told.append(who), waiting.set())))

    opener = threading.Thread(target=open_writer)
    opener.start()
    assert waiting.wait(timeout=30)
    assert not got  # still waiting while the other writer holds the directory
    holder.close()
    opener.join(timeout=30)
    assert told == [f"pid {os.getpid()}"]
    with got[0] as writer:
        index = Index(trajectory_format="pt")
        entry = new_entry(0, layout.describe(make_traj(), "t"), uuid.uuid4().hex)
        index.entries[0], index.id_list, index.trajectory_counter = entry, [0], 1
        report = WriteReport()
        placed = writer.place(src, index.file_name(0), entry, report)
        assert placed.is_file() and report.linked == 1 and not (directory / INDEX_FILE).exists()
        writer.publish(index)
    assert read_index(directory).id_list == [0] and entry["file_bytes"] == src.stat().st_size
    with DirLock(directory, wait=False):  # released on leaving the block
        pass


def test_close_waits_for_pending_jobs(tmp_path: Path) -> None:
    directory = tmp_path / "buffer"
    directory.mkdir()
    gate = threading.Event()
    writer = AutoSaveWriter(directory)
    writer.submit(functools.partial(gate.wait, 10))
    submit_write(writer, "last.bin", b"1")
    assert not (directory / "last.bin").exists()
    gate.set()
    writer.close()
    assert (directory / "last.bin").read_bytes() == b"1"
    with DirLock(directory, wait=False):
        pass
