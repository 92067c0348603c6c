"""rbtool.ops.ingestion: adding trajectory files to a buffer directory, continuing its ids."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import make_traj, tree_digest

from rbtool.errors import CheckpointError, FileSystemError, TrajectoryFileError, UsageError
from rbtool.files import trajfile
from rbtool.files.dirs import open_checkpoint
from rbtool.files.fsutil import LOCK_FILE, DirLock
from rbtool.files.index import Index, read_index
from rbtool.files.writer import copied_entries, new_entry, write_checkpoint
from rbtool.format import INDEX_FILE, METADATA_FILE, layout
from rbtool.ops.ingestion import ingest


def loose_files(directory: Path, n: int, fmt: str = "pt", start: int = 0) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(start, start + n):
        path = directory / f"src_{i}.{fmt}"
        path.write_bytes(
            trajfile.to_bytes(make_traj(t=2, b=1 + i % 2, seed=i, model_weights_id=f"v{i}"), fmt)
        )
        paths.append(path)
    return paths


def existing_buffer(out: Path, ids: list[int], counter: int, fmt: str = "pt") -> Path:
    trajs = {tid: make_traj(t=2, b=1, seed=100 + tid, model_weights_id="old") for tid in ids}
    entries = {tid: new_entry(tid, layout.describe(t, "t"), uuid.uuid4().hex) for tid, t in trajs.items()}
    index = Index(entries=entries, id_list=list(ids), trajectory_counter=counter, trajectory_format=fmt)
    write_checkpoint(out, copied_entries(index), trajs.__getitem__)
    return out


def assert_valid(directory: Path) -> Index:
    """The directory loads strictly: every listed file exists and holds its entry's [T, B]."""
    _, index = open_checkpoint(directory, strict=True)
    for tid in index.id_list:
        info = layout.describe(trajfile.load(directory / index.file_name(tid)), "t")
        assert list(info.shape[:2]) == index.entries[tid]["shape"][:2]
    return index


def contents(directory: Path) -> dict[str, str]:
    """tree_digest without the lock file (which a locking call leaves behind, empty of data)."""
    return {name: digest for name, digest in tree_digest(directory).items() if name != LOCK_FILE}


def visible(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()} - {LOCK_FILE}


# ------------------------------------------------------------------ ids, files
def test_ids_continue_from_the_trajectory_counter(tmp_path: Path) -> None:
    buffer = existing_buffer(tmp_path / "buf", [4, 1, 3], counter=11)
    sources = loose_files(tmp_path / "loose", 3)
    result = ingest(sources, buffer)
    assert result.added_ids == [11, 12, 13]
    index = assert_valid(buffer)
    assert index.id_list == [4, 1, 3, 11, 12, 13] and index.trajectory_counter == 14
    assert [index.entries[i]["model_weights_id"] for i in (11, 12, 13)] == ["v0", "v1", "v2"]
    assert len({index.entries[i]["uuid"] for i in index.id_list}) == 6
    # same format, loose files: files of the buffer's own (the same bytes), never hard links
    for tid, src in zip((11, 12, 13), sources, strict=True):
        placed = buffer / index.file_name(tid)
        assert os.stat(placed).st_ino != os.stat(src).st_ino and placed.read_bytes() == src.read_bytes()
        assert "link" not in index.entries[tid]
    assert result.report.linked == 0 and result.report.written == 0
    assert result.report.copied + result.report.reflinked == 3


def test_other_formats_are_rewritten_in_the_buffer_s_format(tmp_path: Path) -> None:
    sources = loose_files(tmp_path / "loose", 2, fmt="pkl")
    result = ingest(sources, tmp_path / "buf")
    index = assert_valid(tmp_path / "buf")
    assert index.trajectory_format == "pt" and result.report.written == 2
    for tid, src in zip(index.id_list, sources, strict=True):
        entry = index.entries[tid]
        assert entry["sha256"] == trajfile.sha256_file(tmp_path / "buf" / index.file_name(tid))
        got, want = trajfile.load(tmp_path / "buf" / index.file_name(tid)), trajfile.load(src)
        assert [p for p, _ in layout.iter_tensors(got)] == [p for p, _ in layout.iter_tensors(want)]


def test_ingesting_a_checkpoint_follows_its_list_order(tmp_path: Path) -> None:
    source = existing_buffer(tmp_path / "src", [7, 2, 5], counter=8)
    result = ingest([source], tmp_path / "buf", trajectory_format="pkl")
    index = assert_valid(tmp_path / "buf")
    assert result.added_ids == [0, 1, 2] and index.trajectory_format == "pkl"
    src_index = read_index(source)
    for new, old in zip(index.id_list, (7, 2, 5), strict=True):
        # the trajectory keeps its uuid, so a later ingest of the same checkpoint knows it
        assert index.entries[new]["uuid"] == src_index.entries[old]["uuid"]
        assert index.entries[new]["shape"] == src_index.entries[old]["shape"]


# --------------------------------------------------------------------- batches
def test_each_batch_is_published_before_it_is_announced(tmp_path: Path) -> None:
    buffer = tmp_path / "buf"
    seen: list[tuple[list[int], list[int]]] = []

    def on_published(ids: list[int]) -> None:
        seen.append((list(ids), assert_valid(buffer).id_list))

    result = ingest(
        loose_files(tmp_path / "loose", 5),
        buffer,
        batch_size=2,
        batch_seconds=3600,
        on_published=on_published,
    )
    assert seen == [([0, 1], [0, 1]), ([2, 3], [0, 1, 2, 3]), ([4], [0, 1, 2, 3, 4])]
    assert result.added_ids == [0, 1, 2, 3, 4]


def test_every_source_is_checked_before_anything_is_written(tmp_path: Path) -> None:
    buffer = existing_buffer(tmp_path / "buf", [0], counter=1)
    sources = loose_files(tmp_path / "loose", 3)
    sources[2].write_bytes(sources[2].read_bytes()[:200])
    before = contents(buffer)
    checked: list[int] = []
    with pytest.raises(TrajectoryFileError, match=str(sources[2])):
        ingest(sources, buffer, on_checked=checked.append)
    assert checked == [1, 1] and contents(buffer) == before


def vanish_when_checked(sources: list[Path]) -> Callable[[int], None]:
    """An on_checked callback deleting the last source once every source was checked:
    the ingest then fails while placing it, after the earlier ones were placed."""
    checked = [0]

    def on_checked(n: int) -> None:
        checked[0] += n
        if checked[0] == len(sources):
            sources[-1].unlink()

    return on_checked


def test_an_interruption_mid_batch_keeps_the_published_batches(tmp_path: Path) -> None:
    buffer = tmp_path / "buf"
    sources = loose_files(tmp_path / "loose", 4)
    with pytest.raises(FileSystemError, match="No such file or directory"):
        ingest(sources, buffer, batch_size=3, batch_seconds=3600, on_checked=vanish_when_checked(sources))
    index = assert_valid(buffer)
    assert index.id_list == [0, 1, 2]
    assert visible(buffer) == {INDEX_FILE, METADATA_FILE, *(index.file_name(i) for i in index.id_list)}


def test_a_failed_second_batch_removes_its_files(tmp_path: Path) -> None:
    buffer = tmp_path / "buf"
    sources = loose_files(tmp_path / "loose", 4)
    with pytest.raises(FileSystemError, match="No such file or directory"):
        ingest(sources, buffer, batch_size=2, batch_seconds=3600, on_checked=vanish_when_checked(sources))
    index = assert_valid(buffer)
    assert index.id_list == [0, 1]  # id 2 was placed, but its batch never published: removed
    assert visible(buffer) == {INDEX_FILE, METADATA_FILE, *(index.file_name(i) for i in index.id_list)}


def test_an_interruption_in_on_published_keeps_the_published_batch(tmp_path: Path) -> None:
    buffer = tmp_path / "buf"

    def interrupt(ids: list[int]) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ingest(loose_files(tmp_path / "loose", 4), buffer, batch_size=2, on_published=interrupt)
    assert assert_valid(buffer).id_list == [0, 1]


# -------------------------------------------------------------------- leftovers
def test_leftovers_of_an_interrupted_writer_are_removed(tmp_path: Path) -> None:
    buffer = existing_buffer(tmp_path / "buf", [0, 1], counter=3)
    data = trajfile.to_bytes(make_traj(t=2, b=1), "pt")
    leftovers = ["trajectory_3_w.pt", "trajectory_9_w.pkl", ".trajectory_4_w.pt.k2j3.tmp"]
    kept = ["trajectory_2_w.pt", "notes.txt"]  # below the counter, or not a trajectory: not ours
    for name in leftovers + kept:
        (buffer / name).write_bytes(data)
    result = ingest(loose_files(tmp_path / "loose", 1), buffer)
    assert sorted(result.removed_leftovers) == sorted(leftovers)
    assert result.added_ids == [3]
    index = assert_valid(buffer)
    assert visible(buffer) == {INDEX_FILE, METADATA_FILE, *kept, *(index.file_name(i) for i in index.id_list)}
    assert (buffer / index.file_name(3)).read_bytes() != data


# ---------------------------------------------------------------------- errors
def test_a_format_mismatch_is_a_usage_error_changing_nothing(tmp_path: Path) -> None:
    buffer = existing_buffer(tmp_path / "buf", [0], counter=1, fmt="pt")
    before = contents(buffer)
    with pytest.raises(UsageError, match="holds pt files; cannot ingest as pkl"):
        ingest(loose_files(tmp_path / "loose", 1), buffer, trajectory_format="pkl")
    assert contents(buffer) == before
    with pytest.raises(UsageError, match="format must be 'pt' or 'pkl', got 'npz'"):
        ingest(loose_files(tmp_path / "loose", 1), buffer, trajectory_format="npz")
    result = ingest(loose_files(tmp_path / "loose", 1), buffer, trajectory_format="pt")
    assert result.added_ids == [1]


def test_a_file_as_the_buffer_is_a_usage_error(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(UsageError, match="exists and is not a directory"):
        ingest(loose_files(tmp_path / "loose", 1), target)
    assert target.read_text() == "x"


def test_a_new_nested_directory_is_created_whole(tmp_path: Path) -> None:
    buffer = tmp_path / "a" / "b" / "buf"
    result = ingest(loose_files(tmp_path / "loose", 2), buffer, trajectory_format="pkl")
    index = assert_valid(buffer)
    assert result.added_ids == [0, 1] and index.trajectory_format == "pkl"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "loose"]
    assert [p.name for p in (tmp_path / "a" / "b").iterdir()] == ["buf"]  # no staging left


def test_a_failed_ingest_into_a_new_directory_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such file or directory"):
        ingest([tmp_path / "missing.pt"], tmp_path / "a" / "b" / "buf")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_ingest_keeps_an_existing_empty_directory(tmp_path: Path) -> None:
    buffer = tmp_path / "buf"
    buffer.mkdir()
    with pytest.raises(CheckpointError):
        ingest([tmp_path / "missing.pt"], buffer)
    assert buffer.is_dir()


# ------------------------------------------------------------------------ lock
def test_ingest_waits_for_the_directory_s_lock(tmp_path: Path) -> None:
    buffer = existing_buffer(tmp_path / "buf", [0], counter=1)
    sources = loose_files(tmp_path / "loose", 2)
    holders: list[str] = []
    waiting = threading.Event()
    outcome: dict[str, Any] = {}

    def on_wait(holder: str) -> None:
        holders.append(holder)
        waiting.set()

    def run() -> None:
        outcome["result"] = ingest(sources, buffer, on_wait=on_wait)

    with DirLock(buffer):
        thread = threading.Thread(target=run)
        thread.start()
        assert waiting.wait(10)
        assert read_index(buffer).id_list == [0]  # nothing added while the lock is held
    thread.join(30)
    assert holders == [f"pid {os.getpid()}"]
    assert outcome["result"].added_ids == [1, 2]


# ------------------------------------------------------------------ idempotency
def test_running_an_interrupted_ingest_again_adds_only_what_is_missing(tmp_path: Path) -> None:
    files = loose_files(tmp_path / "loose", 6)
    buffer = tmp_path / "buf"
    with pytest.raises(KeyboardInterrupt):

        def stop_after_first_batch(ids: list[int]) -> None:
            raise KeyboardInterrupt

        ingest(files, buffer, batch_size=2, batch_seconds=1e9, on_published=stop_after_first_batch)
    assert assert_valid(buffer).id_list == [0, 1]
    again = ingest(files, buffer)
    assert again.added_ids == [2, 3, 4, 5] and again.duplicates == 2
    assert [(s.path, s.reason) for s in again.skipped] == [
        (files[0], "already in the buffer as id 0"),
        (files[1], "already in the buffer as id 1"),
    ]
    index = assert_valid(buffer)
    for tid, src in zip(index.id_list, files, strict=True):
        assert index.entries[tid]["sha256"] == trajfile.sha256_file(src)
    assert ingest(files, buffer).added_ids == []  # a third run adds nothing


def test_a_rewritten_source_is_still_recognised(tmp_path: Path) -> None:
    """pkl files ingested into a pt buffer are rewritten; their source hash is remembered."""
    files = loose_files(tmp_path / "loose", 3, fmt="pkl")
    buffer = tmp_path / "buf"
    first = ingest(files, buffer, trajectory_format="pt")
    assert first.report.written == 3
    index = read_index(buffer)
    assert all(
        index.entries[i]["source_sha256"] == trajfile.sha256_file(f)
        for i, f in zip(index.id_list, files, strict=True)
    )
    assert ingest(files, buffer).duplicates == 3


def test_a_checkpoint_ingested_twice_is_recognised_by_uuid(tmp_path: Path) -> None:
    source = existing_buffer(tmp_path / "src", [0, 1, 2], counter=3)
    buffer = tmp_path / "buf"
    ingest([source], buffer, trajectory_format="pkl")  # rewritten: another hash, same uuids
    second = ingest([source], buffer)
    assert second.added_ids == [] and second.duplicates == 3
    forced = ingest([source], buffer, allow_duplicates=True)
    assert forced.added_ids == [3, 4, 5]
    uuids = [read_index(buffer).entries[i]["uuid"] for i in range(6)]
    assert len(set(uuids)) == 6  # duplicates get fresh uuids


def test_the_buffer_is_never_its_own_source(tmp_path: Path) -> None:
    buffer = tmp_path / "buf"
    ingest(loose_files(tmp_path / "loose", 2), buffer)
    before = tree_digest(buffer)
    for source in (buffer, buffer / read_index(buffer).file_name(0), Path(str(buffer) + "/.")):
        with pytest.raises(UsageError, match="cannot be its own source"):
            ingest([source], buffer)
    assert tree_digest(buffer) == before


def test_a_recursive_walk_passes_over_the_buffer_inside_it(tmp_path: Path) -> None:
    root = tmp_path / "root"
    files = loose_files(root / "a", 2) + loose_files(root / "b", 1, start=2)
    buffer = root / "buf"
    shallow = ingest([root / "a"], buffer)
    assert shallow.added_ids == [0, 1]
    walked = ingest([root], buffer, recursive=True)
    assert walked.added_ids == [2] and walked.duplicates == 2
    assert "the destination itself" in {s.reason for s in walked.skipped}
    assert read_index(buffer).size == len(files)


@pytest.mark.parametrize("where", ["after-a-file-is-placed", "after-a-batch-is-published"])
def test_an_interrupt_leaves_the_files_the_index_lists_and_no_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Ctrl-C lands between two steps of ingest: the buffer is what its index says, file for file."""
    from rbtool.files.writer import BufferWriter

    sources = loose_files(tmp_path / "src", 10)
    buffer = existing_buffer(tmp_path / "buffer", [0, 1], 2)
    calls = {"place": 0, "publish": 0}
    place, publish = BufferWriter.place, BufferWriter.publish

    def placing(self: BufferWriter, *args: Any, **kwargs: Any) -> Any:
        done = place(self, *args, **kwargs)
        calls["place"] += 1
        if where == "after-a-file-is-placed" and calls["place"] == 7:
            raise KeyboardInterrupt  # the file is placed; its id is not yet in the index
        return done

    def publishing(self: BufferWriter, *args: Any, **kwargs: Any) -> Any:
        done = publish(self, *args, **kwargs)
        calls["publish"] += 1
        if where == "after-a-batch-is-published" and calls["publish"] == 2:
            raise KeyboardInterrupt  # the index lists the batch; ingest has not yet moved on
        return done

    monkeypatch.setattr(BufferWriter, "place", placing)
    monkeypatch.setattr(BufferWriter, "publish", publishing)
    with pytest.raises(KeyboardInterrupt):
        ingest(sources, buffer, batch_size=3)
    index = assert_valid(buffer)
    assert index.id_list == list(range(8))  # two batches of 3 published after ids 0, 1
    listed = {index.file_name(i) for i in index.id_list}
    assert {p.name for p in buffer.glob("trajectory_*_*")} == listed


def test_a_batch_holds_at_least_a_fraction_of_the_buffer(tmp_path: Path) -> None:
    """Publishing writes the whole index: into a large buffer, batches grow with it."""
    buffer = tmp_path / "buf"
    ingest(loose_files(tmp_path / "first", 16), buffer, batch_size=64)
    seen: list[list[int]] = []
    more = loose_files(tmp_path / "more", 9, start=16)
    ingest(more, buffer, batch_size=1, batch_seconds=3600, on_published=seen.append)
    # a batch is published once it is an eighth of the list it joins: 3 of 19, 3 of 22; the rest at the end
    assert seen == [[16, 17, 18], [19, 20, 21], [22, 23, 24]]
    assert assert_valid(buffer).id_list == list(range(25))


def test_sources_are_checked_a_batch_at_a_time_and_fail_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small `.pt` sources get their headers together (none parsed alone), and the first
    source that fails is the one named, whatever is read after it."""
    import rbtool.files.sources as sources_module
    import rbtool.ops.ingestion as ingestion

    monkeypatch.setattr(ingestion, "CHECK_BATCH", 4)
    alone: list[Path] = []
    real = sources_module.read_header
    monkeypatch.setattr(
        sources_module, "read_header", lambda path, data=None: alone.append(path) or real(path, data)
    )
    files = [p for i in range(10) for p in loose_files(tmp_path / "loose", 1, start=2 * i)]  # one size
    ingest(files, tmp_path / "buf")
    assert alone == [] and assert_valid(tmp_path / "buf").id_list == list(range(10))
    broken = [p for i in range(10) for p in loose_files(tmp_path / "again", 1, start=2 * i + 40)]
    broken[5].write_bytes(broken[5].read_bytes()[:300])
    broken[7].write_bytes(b"PK" * 100)
    with pytest.raises(TrajectoryFileError) as caught:
        ingest(broken, tmp_path / "other")
    with pytest.raises(TrajectoryFileError) as one:
        sources_module.check_item(sources_module.Item(broken[5]))
    assert str(caught.value) == str(one.value)
