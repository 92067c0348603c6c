"""The window's rows read whole at load (storage.bulk) and many headers read at once (files.ptbulk).

A held window must give exactly the batches the row readers give, for every layout they
take (RLinf's fixtures, done-like fields with several bootstrap rows, zero-element fields,
.pkl files and memory), and leave to them every file it does not take on. The headers of
files compared with a template must be exactly read_header's, for any damage.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import FIXTURES, RLINF_DIRS, assert_batches_equal, make_traj

from rbtool import TrajectoryReplayBuffer, read_index
from rbtool.errors import RbtoolError, TrajectoryFileError
from rbtool.files import ptbulk, ptheader


def twins(
    ckpt: Path, window: int = 0, seed: int = 5, **kw: Any
) -> tuple[TrajectoryReplayBuffer, TrajectoryReplayBuffer]:
    """The checkpoint loaded twice: its window held in memory, and read row by row when drawn."""
    held = TrajectoryReplayBuffer(seed=seed, sample_window_size=window, **kw)
    drawn = TrajectoryReplayBuffer(seed=seed, sample_window_size=window, hold_rows_budget=0, **kw)
    held.load_checkpoint(ckpt, strict=False)  # RLinf's window-2 saves list files they do not hold
    drawn.load_checkpoint(ckpt, strict=False)
    return held, drawn


def is_held(buffer: TrajectoryReplayBuffer) -> bool:
    lo, hi = buffer._window_range()
    covered = buffer._rows.covering(lo, hi, buffer._counts.start(lo))
    return covered is not None and covered.first == 0 and covered.stop == hi - lo


def write(tmp_path: Path, trajs: list[dict[str, Any]], fmt: str = "pt") -> Path:
    writer = TrajectoryReplayBuffer(sample_window_size=0, trajectory_format=fmt)
    writer.add_trajectories(trajs)
    writer.save_checkpoint(tmp_path / "c")
    return tmp_path / "c"


@pytest.mark.parametrize("directory", RLINF_DIRS)
def test_a_held_window_gives_the_row_readers_batches_on_rlinfs_checkpoints(directory: str) -> None:
    held, drawn = twins(FIXTURES / directory)
    assert is_held(held) == directory.endswith(("pt/autosave", "pt/ckpt", "rank_0", "rank_1"))
    for num_chunks in (1, 5, 64, 300):
        assert_batches_equal(held.sample(num_chunks), drawn.sample(num_chunks))


@pytest.mark.parametrize(
    ("t", "b", "extra", "image"), [(1, 1, 1, 0), (6, 2, 3, 5), (4, 3, 0, 2), (1, 1, 1, 16)]
)
def test_a_held_window_gives_the_row_readers_batches_for_any_layout(
    tmp_path: Path, t: int, b: int, extra: int, image: int
) -> None:
    """One-transition files, three epochs of bootstrap rows, no bootstrap rows, 0x0 images."""
    trajs = [make_traj(t=t, b=b, seed=i, extra_rows=extra, image=image) for i in range(40)]
    held, drawn = twins(write(tmp_path, trajs))
    assert is_held(held)
    for num_chunks in (1, 7, 256):
        assert_batches_equal(held.sample(num_chunks), drawn.sample(num_chunks))


def test_adds_and_a_moving_window_after_a_held_load_give_the_row_readers_batches(tmp_path: Path) -> None:
    ckpt = write(tmp_path, [make_traj(seed=i) for i in range(12)])
    for auto_save in (False, True):
        kw: dict[str, Any] = {"auto_save": auto_save}
        held = TrajectoryReplayBuffer(
            seed=2, sample_window_size=8, **kw, auto_save_path=str(tmp_path / "h") if auto_save else ""
        )
        drawn = TrajectoryReplayBuffer(
            seed=2,
            sample_window_size=8,
            hold_rows_budget=0,
            **kw,
            auto_save_path=str(tmp_path / "d") if auto_save else "",
        )
        for buffer in (held, drawn):
            buffer.load_checkpoint(ckpt)
        assert is_held(held)
        for step in range(6):
            added = [make_traj(seed=100 + step)]
            held.add_trajectories(added)
            drawn.add_trajectories(added)
            assert_batches_equal(held.sample(64), drawn.sample(64))
        assert is_held(held)
        held.close()
        drawn.close()


def test_pkl_files_are_left_to_the_row_readers(tmp_path: Path) -> None:
    held, drawn = twins(write(tmp_path, [make_traj(seed=i) for i in range(5)], fmt="pkl"))
    assert not is_held(held)
    assert_batches_equal(held.sample(32), drawn.sample(32))


def test_a_window_over_the_budget_is_not_held(tmp_path: Path) -> None:
    ckpt = write(tmp_path, [make_traj(seed=i) for i in range(5)])
    small = TrajectoryReplayBuffer(sample_window_size=0, hold_rows_budget=1000)
    small.load_checkpoint(ckpt)
    assert not is_held(small)
    enough = TrajectoryReplayBuffer(sample_window_size=0, hold_rows_budget=1 << 20)
    enough.load_checkpoint(ckpt)
    assert is_held(enough)
    mapped = TrajectoryReplayBuffer(sample_window_size=0, map_rows=True)  # rows read from the map
    mapped.load_checkpoint(ckpt)
    assert not is_held(mapped)
    with pytest.raises(ValueError, match="hold_rows_budget"):
        TrajectoryReplayBuffer(hold_rows_budget=-1)


def test_a_damaged_file_leaves_the_window_to_the_row_readers_which_name_it(tmp_path: Path) -> None:
    ckpt = write(tmp_path, [make_traj(seed=i) for i in range(6)])
    victim = ckpt / read_index(ckpt).file_name(3)
    victim.write_bytes(victim.read_bytes()[:-200])
    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    buffer.load_checkpoint(ckpt)
    assert not is_held(buffer)
    with pytest.raises(TrajectoryFileError, match="trajectory_3_"):
        for _ in range(50):
            buffer.sample(16)


def test_a_file_that_disagrees_with_its_index_shape_is_not_held(tmp_path: Path) -> None:
    ckpt = write(tmp_path, [make_traj(seed=i) for i in range(4)])
    torch.save(make_traj(t=2, seed=9), ckpt / read_index(ckpt).file_name(2))  # [2, 2], index says [4, 2]
    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    buffer.load_checkpoint(ckpt)
    assert not is_held(buffer)
    with pytest.raises(TrajectoryFileError, match="the index says"):
        for _ in range(50):
            buffer.sample(16)


def test_a_held_window_keeps_its_rows_when_a_file_changes_after_the_load(tmp_path: Path) -> None:
    """Held rows are what the files held at load (auto_save off pins files for the same reason)."""
    ckpt = write(tmp_path, [make_traj(seed=i) for i in range(4)])
    held, drawn = twins(ckpt)
    for path in ckpt.glob("*.pt"):  # replaced: the row readers read the files they pinned
        path.unlink()
        torch.save(make_traj(seed=99), path)
    assert_batches_equal(held.sample(64), drawn.sample(64))
    for path in ckpt.glob("*.pt"):  # cut short in place: the row readers would fail on them
        path.write_bytes(b"")
    assert held.sample(16)["actions"].shape == (16, 7)


def test_reading_the_window_is_reported_as_a_phase(tmp_path: Path) -> None:
    ckpt = write(tmp_path, [make_traj(seed=i) for i in range(30)])
    meta = ckpt / "metadata.json"
    import orjson

    doc = orjson.loads(meta.read_bytes())
    del doc["field_schemas"]  # another writer's checkpoint: nothing recorded
    meta.write_bytes(orjson.dumps(doc))
    phases: list[tuple[int | None, str | None]] = []
    done = [0]

    class Seen:
        def start(self, total: int | None, description: str | None = None) -> None:
            phases.append((total, description))

        def __call__(self, n: int = 1) -> None:
            done[0] += n

    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    buffer.load_checkpoint(ckpt)
    assert is_held(buffer)
    buffer.clear_cache()
    buffer._held_generation = None  # read the window again, reporting it
    buffer._rows.reset(0, 0)
    buffer.sample_with_draw(8, progress=Seen())
    assert phases == [(30, "reading the window's trajectories")] and done[0] == 30


# ---------------------------------------------------------------- headers at once


def tiny_files(tmp_path: Path, n: int = 12) -> list[Path]:
    """One-transition files as another writer saves them (file names of two lengths)."""
    paths = []
    for i in range(n):
        path = tmp_path / f"trajectory_{i * 7}_w{i % 3}.pt"
        torch.save(make_traj(t=1, b=1, seed=i, model_weights_id=f"w{i % 3}", image=3), path)
        paths.append(path)
    return paths


def outcome(result: dict[str, Any] | RbtoolError) -> Any:
    return (type(result).__name__, str(result)) if isinstance(result, Exception) else result


def reference(path: Path, data: bytes) -> Any:
    try:
        return outcome(ptheader.read_header(path, data))
    except RbtoolError as exc:
        return outcome(exc)


def test_headers_read_at_once_are_read_headers_and_shared(tmp_path: Path) -> None:
    paths = tiny_files(tmp_path)
    datas = [p.read_bytes() for p in paths]
    headers = ptbulk.read_headers(paths, datas)
    assert [outcome(h) for h in headers] == [reference(p, d) for p, d in zip(paths, datas, strict=True)]
    # shared by the files of one pickle (model_weights_id) and layout (name length)
    assert len({id(h) for h in headers}) <= 6 < len(paths)


def test_headers_of_damaged_files_are_read_headers_verdicts(tmp_path: Path) -> None:
    """Every byte class of a file changed in turn, in a group with sound files of its size:
    the verdict (header or error) is exactly read_header's for each."""
    paths = tiny_files(tmp_path, 6)
    sound = [p.read_bytes() for p in paths]
    rng = random.Random(7)
    size = len(sound[0])
    positions = sorted(set(range(0, size, 3)) | set(range(size - 120, size)))
    for at in positions:
        damaged = bytearray(sound[0])
        damaged[at] ^= 1 << rng.randrange(8)
        group_paths = [paths[0], *paths[1:]]
        group = [bytes(damaged), *sound[1:]]
        got = ptbulk.read_headers(group_paths, group)
        want = [reference(p, d) for p, d in zip(group_paths, group, strict=True)]
        assert [outcome(h) for h in got] == want, at


def test_headers_of_files_under_two_directory_names_are_read_headers_verdicts(tmp_path: Path) -> None:
    paths = tiny_files(tmp_path, 4)
    datas = [p.read_bytes() for p in paths]
    prefix = paths[1].stem.encode()
    mixed = bytearray(datas[1])
    first = mixed.find(prefix)  # one record moved under another directory of the same length
    last = mixed.rfind(prefix)
    mixed[last : last + 1] = b"X" if mixed[last : last + 1] != b"X" else b"Y"
    assert first != last
    group = [datas[0], bytes(mixed), *datas[2:]]
    got = ptbulk.read_headers(paths, group)
    assert [outcome(h) for h in got] == [reference(p, d) for p, d in zip(paths, group, strict=True)]


def test_truncated_and_padded_files_get_read_headers_verdicts(tmp_path: Path) -> None:
    paths = tiny_files(tmp_path, 4)
    datas = [p.read_bytes() for p in paths]
    for variant in (datas[0][:-1], datas[0] + b"\0", datas[0][: len(datas[0]) // 2], b""):
        group = [variant, *datas[1:]]
        got = ptbulk.read_headers(paths, group)
        assert [outcome(h) for h in got] == [reference(p, d) for p, d in zip(paths, group, strict=True)]


def test_a_held_window_of_files_in_a_copied_directory(tmp_path: Path) -> None:
    """Files named after another directory's stems (a copy renamed) still hold their rows."""
    ckpt = write(tmp_path, [make_traj(t=1, b=1, seed=i) for i in range(20)])
    moved = tmp_path / "moved"
    shutil.copytree(ckpt, moved)
    held, drawn = twins(moved)
    assert is_held(held)
    assert_batches_equal(held.sample(100), drawn.sample(100))


def test_files_with_holes_and_range_read_buffers_hold_nothing(tmp_path: Path) -> None:
    """A file with holes (the sparse stand-ins a remote checkpoint's byte ranges are fetched
    into) is not read whole, and a buffer sampled by byte ranges holds no rows at all."""
    ckpt = write(tmp_path, [make_traj(seed=i, image=160) for i in range(3)])  # files > 256 KiB
    victim = ckpt / read_index(ckpt).file_name(1)
    data = victim.read_bytes()
    assert len(data) > ptbulk.BULK_FILE_BYTES
    victim.unlink()
    image = ptheader.read_header(victim, data)["curr_obs"]["main_images"]
    with victim.open("wb") as f:  # the same bytes with a 64 KiB hole of zeros in an image field
        middle = -(-image.data_start // 4096) * 4096 + 4096
        f.write(data[:middle])
        f.seek(middle + 65536)
        f.write(data[middle + 65536 :])
    assert victim.stat().st_blocks * 512 < victim.stat().st_size
    held, drawn = twins(ckpt)
    assert not is_held(held)
    assert_batches_equal(held.sample(32), drawn.sample(32))
    whole = TrajectoryReplayBuffer(sample_window_size=0)
    whole.load_checkpoint(write(tmp_path / "other", [make_traj(seed=i) for i in range(3)]))
    assert is_held(whole)
    whole.read_rows_when_drawn()
    assert not is_held(whole) and whole.hold_rows_budget == 0 and whole.info()["held_rows_bytes"] == 0
    whole.sample(8)


def many_pickles(tmp_path: Path) -> tuple[list[Path], list[bytes]]:
    """19 files of one size, 12 distinct pickles (model_weights_ids of one length)."""
    paths = []
    for i in range(19):
        path = tmp_path / f"trajectory_{i:02d}_w.pt"
        torch.save(make_traj(t=1, b=1, seed=i, model_weights_id=f"w{i % 12:02d}"), path)
        paths.append(path)
    datas = [p.read_bytes() for p in paths]
    assert len({len(d) for d in datas}) == 1
    return paths, datas


def test_headers_of_many_pickles_in_one_group_are_read_headers_verdicts(tmp_path: Path) -> None:
    """Files grouped by their pickles: one header read a pickle, the same verdicts."""
    paths, datas = many_pickles(tmp_path)
    got = ptbulk.read_headers(paths, datas, {})
    assert [outcome(h) for h in got] == [reference(p, d) for p, d in zip(paths, datas, strict=True)]
    assert len({id(h) for h in got}) == 12


def test_pickles_are_grouped_by_every_byte_that_differs(tmp_path: Path) -> None:
    """Rows are grouped by the bytes where any row differs from the first: equal rows, and
    only equal rows, share a group, whatever the differences (one byte, many, at the ends)."""
    rng = np.random.default_rng(7)
    base = rng.integers(0, 256, 97, dtype=np.uint8)
    rows = np.tile(base, (600, 1))
    kinds = rng.integers(0, 6, 600)
    rows[kinds == 1, 0] ^= 1  # the first byte
    rows[kinds == 2, 96] ^= 0x80  # the last byte
    rows[kinds == 3, 40:60] = 7  # a run
    rows[kinds == 4, 0] ^= 1  # two places at once: not kind 1's row
    rows[kinds == 4, 96] ^= 0x80
    rows[kinds == 5] = rng.integers(0, 256, (int((kinds == 5).sum()), 97), dtype=np.uint8)  # all differ
    strided = np.zeros((600, 104), dtype=np.uint8)
    strided[:, :97] = rows
    for pickles in (rows, strided[:, :97]):  # rows side by side in one buffer, as loads read them
        groups, first = ptbulk._same_pickles(pickles)
        assert groups.min() >= 0 and sorted(set(groups.tolist())) == list(range(len(first)))
        for i in range(0, 600, 7):
            for j in range(0, 600, 11):
                assert (groups[i] == groups[j]) == bool((rows[i] == rows[j]).all())
        assert all(groups[f] == g for g, f in enumerate(first.tolist()))
    groups, first = ptbulk._same_pickles(np.tile(base, (5, 1)))
    assert groups.tolist() == [0] * 5 and first.tolist() == [0]
    paths, datas = many_pickles(tmp_path)
    got = ptbulk.read_headers(paths, datas, {})
    assert [outcome(h) for h in got] == [reference(p, d) for p, d in zip(paths, datas, strict=True)]


def test_a_record_named_under_another_directory_only_in_its_local_header_is_read_as_read_header_reads_it(
    tmp_path: Path,
) -> None:
    """read_header reads names from the central directory only: a local header's copy of a
    name may differ, and the verdict is still read_header's (the file's header)."""
    paths = tiny_files(tmp_path, 4)
    datas = [p.read_bytes() for p in paths]
    prefix = paths[1].stem.encode()
    changed = bytearray(datas[1])
    first = changed.find(prefix)  # the first local header's name
    changed[first] ^= 1
    group = [datas[0], bytes(changed), *datas[2:]]
    got = ptbulk.read_headers(paths, group, {})
    assert [outcome(h) for h in got] == [reference(p, d) for p, d in zip(paths, group, strict=True)]
    assert not isinstance(got[1], Exception)


def test_a_held_window_across_chunks_of_mixed_sizes_and_a_large_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files of several sizes (ids of one to three digits, two weights ids), one file larger
    than those read side by side, and chunks of a few files: the batches of the row readers."""
    from rbtool.buffer.storage import bulk

    monkeypatch.setattr(bulk, "CHUNK_FILES", 7)
    trajs = [
        make_traj(t=1, b=1, seed=i, model_weights_id="a" if i < 60 else "b", image=3) for i in range(130)
    ]
    ckpt = write(tmp_path, trajs)
    big = ckpt / read_index(ckpt).file_name(77)
    padded = dict(trajs[77])
    padded["padding"] = torch.zeros(bulk.STACK_FILE_BYTES)  # a left-out field makes the file large
    torch.save(padded, big)
    assert big.stat().st_size > bulk.STACK_FILE_BYTES
    held, drawn = twins(ckpt)
    assert is_held(held)
    for num_chunks in (1, 9, 300):
        assert_batches_equal(held.sample(num_chunks), drawn.sample(num_chunks))


def test_a_file_map_names_files_when_asked(tmp_path: Path) -> None:
    from rbtool.buffer.storage import FileMap

    asked: list[int] = []

    def place(tid: int) -> tuple[Path, str]:
        asked.append(tid)
        return tmp_path, f"f{tid}.pt"

    files = FileMap(range(5), place)
    assert len(files) == 5 and 3 in files and 9 not in files and asked == []
    assert files[3] == tmp_path / "f3.pt" and files.place(4) == (tmp_path, "f4.pt")
    files[3] = tmp_path / "other.pt"
    assert files[3] == tmp_path / "other.pt" and files.place(3) == (tmp_path, "other.pt")
    del files[0]
    files[7] = tmp_path / "seven.pt"
    assert list(files) == [3, 7, 1, 2, 4] and len(files) == 5 and 0 not in files
    with pytest.raises(KeyError):
        del files[0]
    with pytest.raises(KeyError):
        files.place(0)
    assert files.get(0) is None and asked == [3, 4]


# ---------------------------------------------------------------- helper processes


@pytest.fixture
def helpers_for_small_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Helper processes read windows of a few files, in segments of 5 files, through small
    buffers (each holds a few files, so reports split across segments and buffers are reused)."""
    from rbtool.buffer.storage import bulk, helpread

    monkeypatch.setattr(helpread, "MIN_FILES", 8)
    monkeypatch.setattr(bulk, "SEGMENT_FILES", 5)
    monkeypatch.setattr(bulk, "CHUNK_BYTES", bulk.STACK_FILE_BYTES + 4 * 8192)
    monkeypatch.setattr("rbtool.buffer.storage.ptfile.MAX_PINNED", 3)


def uses_helpers(buffer: TrajectoryReplayBuffer) -> bool:
    from rbtool.buffer.storage import bulk

    lo, hi = buffer._window_range()
    reader = bulk._open_reader(buffer._store, buffer._index.id_list[lo:hi])
    try:
        return isinstance(reader, bulk._Joined)
    finally:
        reader.stop()


@pytest.mark.usefixtures("helpers_for_small_windows")
def test_helper_processes_hold_the_row_readers_batches(tmp_path: Path) -> None:
    """Files of several sizes, a pinned prefix read here, one file too large to be read side
    by side and read here in its place: the batches of the row readers."""
    from rbtool.buffer.storage import bulk

    trajs = [
        make_traj(t=1, b=1, seed=i, model_weights_id="a" if i < 23 else "bb", image=3) for i in range(57)
    ]
    ckpt = write(tmp_path, trajs)
    big = ckpt / read_index(ckpt).file_name(31)
    padded = dict(trajs[31])
    padded["padding"] = torch.zeros(bulk.STACK_FILE_BYTES)
    torch.save(padded, big)
    held, drawn = twins(ckpt)
    assert is_held(held) and uses_helpers(held)
    for num_chunks in (1, 9, 300):
        assert_batches_equal(held.sample(num_chunks), drawn.sample(num_chunks))


@pytest.mark.usefixtures("helpers_for_small_windows")
def test_a_file_a_helper_cannot_read_leaves_the_window_to_the_row_readers(tmp_path: Path) -> None:
    from rbtool.files.dirs import open_view

    ckpt = write(tmp_path, [make_traj(t=1, b=1, seed=i) for i in range(30)])
    view = open_view(ckpt)  # then a file is replaced by a directory: its read fails
    victim = ckpt / view.index.file_name(20)
    victim.unlink()
    victim.mkdir()
    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    buffer.load_checkpoint(view)
    assert not is_held(buffer) and uses_helpers(buffer)
    with pytest.raises(TrajectoryFileError, match="trajectory_20_"):
        for _ in range(50):
            buffer.sample(16)


# ---------------------------------------------------------------- held before the load


def pinned_count() -> int:
    from rbtool.buffer.storage import ptfile

    return ptfile._PINNED_COUNT[0]


def test_a_link_out_of_the_checkpoint_is_refused_and_leaves_the_buffer_as_it_was(tmp_path: Path) -> None:
    """The window is held before the directory check only through no link: a file that is a
    link makes the load check the directory first, as before, which refuses a link out."""
    from rbtool.errors import CheckpointError

    ckpt = write(tmp_path, [make_traj(seed=i) for i in range(6)])
    secret = tmp_path / "secret.pt"
    victim = ckpt / read_index(ckpt).file_name(4)
    victim.rename(secret)
    victim.symlink_to(secret)
    buffer = TrajectoryReplayBuffer(sample_window_size=0, seed=1)
    buffer.load_checkpoint(write(tmp_path / "first", [make_traj(seed=50 + i) for i in range(3)]))
    pins = pinned_count()
    with pytest.raises(CheckpointError, match="symlinks to files outside"):
        buffer.load_checkpoint(ckpt)
    assert pinned_count() == pins and buffer.trajectory_id_list == [0, 1, 2] and is_held(buffer)
    assert buffer.sample(8)["actions"].shape == (8, 7)


def test_a_link_within_the_checkpoint_loads_as_before(tmp_path: Path) -> None:
    ckpt = write(tmp_path, [make_traj(seed=i) for i in range(6)])
    victim = ckpt / read_index(ckpt).file_name(2)
    inside = ckpt / "kept.bin"
    victim.rename(inside)
    victim.symlink_to(inside.name)
    held, drawn = twins(ckpt)
    assert is_held(held)
    assert_batches_equal(held.sample(64), drawn.sample(64))


@pytest.mark.parametrize("strict", [True, False])
def test_a_missing_file_is_refused_or_dropped_as_before(tmp_path: Path, strict: bool) -> None:
    from rbtool.errors import MissingTrajectoryFilesError

    ckpt = write(tmp_path, [make_traj(seed=i) for i in range(6)])
    (ckpt / read_index(ckpt).file_name(3)).unlink()
    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    pins = pinned_count()
    if strict:
        with pytest.raises(MissingTrajectoryFilesError, match="ids 3"):
            buffer.load_checkpoint(ckpt)
        assert buffer.size == 0 and pinned_count() == pins
    else:
        buffer.load_checkpoint(ckpt, strict=False)
        assert buffer.trajectory_id_list == [0, 1, 2, 4, 5] and is_held(buffer)


def test_a_held_load_does_not_list_the_directory_and_a_failed_hold_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rbtool.files import dirs

    listed: list[Path] = []
    real = dirs._missing

    def counting(directory: Path, index: Any) -> Any:
        listed.append(directory)
        return real(directory, index)

    reads: list[Path] = []
    real_read = dirs.read_index

    def reading(directory: Any) -> Any:
        reads.append(directory)
        return real_read(directory)

    monkeypatch.setattr(dirs, "_missing", counting)
    monkeypatch.setattr(dirs, "read_index", reading)
    ckpt = write(tmp_path, [make_traj(seed=i) for i in range(6)])
    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    buffer.load_checkpoint(ckpt)
    assert is_held(buffer) and listed == [] and len(reads) == 1
    (ckpt / read_index(ckpt).file_name(5)).write_bytes(b"not a zip")
    buffer.load_checkpoint(ckpt)
    assert not is_held(buffer) and listed == [ckpt] and len(reads) == 2  # the index read once


def test_bytes_read_header_never_reads_may_differ_and_the_rest_may_not(tmp_path: Path) -> None:
    """A file differing from the template only where read_header reads nothing (a local
    header's time, a record's padding) has its layout; one differing in a byte read_header
    reads (a local header's extra length, the directory) is parsed whole, with its verdict."""
    paths, datas = many_pickles(tmp_path)
    template = ptbulk._template(paths[0], datas[0])
    assert template is not None
    first_local = 0  # torch.save's first record's local header opens the file
    padding = first_local + 30 + int.from_bytes(datas[0][26:28], "little") + 4  # inside its extra field
    central = template.central[0]
    group = [datas[0]]
    for at in (first_local + 10, padding, first_local + 28, central + 20, len(datas[0]) - 5):
        changed = bytearray(datas[1])
        changed[at] ^= 0x40
        group.append(bytes(changed))
    rows = np.frombuffer(b"".join(group), dtype=np.uint8).reshape(len(group), -1)
    assert template.matches(rows).tolist() == [True, True, True, False, False, False]
    names = [paths[0]] + [paths[1]] * (len(group) - 1)
    got = ptbulk.read_headers(names, group, {})
    assert [outcome(h) for h in got] == [reference(p, d) for p, d in zip(names, group, strict=True)]


def test_a_held_window_keeps_small_fields_side_by_side_and_lets_a_dropped_one_go(tmp_path: Path) -> None:
    """Fields of one small row size are one array (a batch takes them with one copy); a field
    one trajectory lacks is dropped from the window and its rows let go."""
    from rbtool.buffer.storage.window import stacks_of

    trajs = [make_traj(t=3, b=2, seed=i, extra_rows=3) for i in range(30)]
    del trajs[17]["prev_values"]
    held, drawn = twins(write(tmp_path, trajs))
    assert is_held(held)
    columns = held._rows.columns
    assert ("prev_values",) not in columns
    stacked = {stack.paths for stack in stacks_of(columns)}
    assert (("rewards",), ("versions",)) in stacked
    assert columns[("rewards",)].untyped_storage().nbytes() == 2 * 4 * 30 * 6  # two fields, 180 rows
    for num_chunks in (1, 9, 256):
        batch, expected = held.sample(num_chunks), drawn.sample(num_chunks)
        assert_batches_equal(batch, expected)
        # the small fields of one row size came out of one copy, side by side
        assert batch["versions"].data_ptr() - batch["rewards"].data_ptr() == 4 * batch["rewards"].shape[0]


def test_a_large_batch_takes_big_stacks_field_by_field_and_small_ones_at_once(tmp_path: Path) -> None:
    """Past STACK_BATCH_BYTES a stack's fields are gathered one by one, each into memory of
    its own; smaller stacks of the same batch still come out of one copy."""
    from rbtool.buffer.storage import gathering

    trajs = [make_traj(t=8, b=4, seed=i, image=2) for i in range(100)]
    held, drawn = twins(write(tmp_path, trajs))
    assert is_held(held)
    batch, expected = held.sample(3000), drawn.sample(3000)
    assert_batches_equal(batch, expected)
    actions, logprobs = batch["actions"], batch["prev_logprobs"]  # 28-byte rows: 168 KB together
    assert 2 * actions.numel() * 4 > gathering.STACK_BATCH_BYTES
    assert actions.untyped_storage().nbytes() == actions.numel() * 4
    # not side by side in one array (as one copy of their stack would put them)
    assert logprobs.data_ptr() - actions.data_ptr() != actions.numel() * 4
    flags = batch["terminations"], batch["truncations"]  # 1-byte rows: 6 KB together
    assert flags[1].data_ptr() - flags[0].data_ptr() == 3000  # side by side, one copy


_ADVISED = """
import re, sys
from pathlib import Path
import torch
from rbtool.buffer.storage import bulk

def advised(address):
    text = Path("/proc/self/smaps").read_text()
    for block in re.split(r"\\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        lo, hi = (int(x, 16) for x in block.split(" ", 1)[0].split("-"))
        if lo <= address < hi:
            flags = re.search(r"^VmFlags:(.*)$", block, re.M)
            return flags is not None and " hg" in flags.group(1)
    raise AssertionError("no mapping holds the address")

columns = bulk.Columns(4096, 1 << 40)
columns.begin({
    ("image",): (torch.uint8, (64, 64, 3)),  # 12 KiB rows
    ("state",): (torch.float32, (1024,)),  # a page a row, 16 MiB in all
    ("a",): (torch.float32, (4,)),
    ("b",): (torch.float32, (4,)),
})
columns.stop()
image, state, a = (columns.columns[(k,)] for k in ("image", "state", "a"))
middle = image.data_ptr() + image.numel() // 2 // bulk._HUGE_PAGE * bulk._HUGE_PAGE
print(advised(middle), advised(state.data_ptr() + state.numel() * 2), advised(a.data_ptr()))
"""


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux's smaps")
def test_only_columns_of_rows_larger_than_a_page_are_advised_to_huge_pages() -> None:
    # a fresh process: memory another test had advised keeps its advice when it is reused
    done = subprocess.run([sys.executable, "-c", _ADVISED], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True", "False", "False"], done.stderr


def test_a_helper_chunk_names_its_own_files_only() -> None:
    from rbtool.buffer.storage.helpread import _Places

    names = [f"trajectory_{k}_w.pt" for k in range(10)]
    places = _Places(Path("/ckpt"), names, 4, 3)
    assert len(places) == 3
    assert list(places) == [(Path("/ckpt"), names[k]) for k in (4, 5, 6)]
    assert places[1:] == [(Path("/ckpt"), names[5]), (Path("/ckpt"), names[6])]
    for outside in (-1, 3, 4):
        with pytest.raises(IndexError):
            places[outside]
