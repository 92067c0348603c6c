"""Window bookkeeping kept from what is added and what leaves: the batches are those a
from-scratch computation over the window gives, whatever the order of adds, loads and
window changes; a sample that fails draws nothing; auto-save publishes are spaced."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_traj

from rbtool import TrajectoryReplayBuffer, read_index
from rbtool.buffer.storage import RowCache
from rbtool.errors import TrajectoryFileError
from rbtool.format.layout import DONE_LIKE, drop_bootstrap_rows


def flat_fields(traj: dict[str, Any]) -> dict[tuple[str, ...], torch.Tensor]:
    """The reference sampler's fields of one trajectory as [T*B, ...] rows."""
    t = traj["rewards"].shape[0]
    out: dict[tuple[str, ...], torch.Tensor] = {}
    for key, value in traj.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            rows = drop_bootstrap_rows(value, t) if key in DONE_LIKE else value
            out[(key,)] = rows.reshape(-1, *rows.shape[2:])
        elif isinstance(value, dict) and key in ("curr_obs", "next_obs", "forward_inputs"):
            for sub, tensor in value.items():
                if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2:
                    out[(key, sub)] = tensor.reshape(-1, *tensor.shape[2:])
    return out


def expected_batch(trajs: dict[int, dict[str, Any]], draw: Any) -> dict[tuple[str, ...], torch.Tensor]:
    """The batch a from-scratch gather gives: shared fields of the window, drawn rows."""
    window = [draw.window_ids[k] for k in range(len(draw.window_ids))]
    flats = {tid: flat_fields(trajs[tid]) for tid in window}
    first = flats[window[0]]
    shared = [
        p
        for p, v in first.items()
        if all(p in f and f[p].dtype == v.dtype and f[p].shape[1:] == v.shape[1:] for f in flats.values())
    ]
    ids, rows = draw.trajectory_ids, draw.local_indices.tolist()
    return {p: torch.stack([flats[tid][p][row] for tid, row in zip(ids, rows, strict=True)]) for p in shared}


def flat_batch(batch: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], torch.Tensor]:
    out: dict[tuple[str, ...], torch.Tensor] = {}
    for key, value in batch.items():
        if isinstance(value, dict):
            out.update(flat_batch(value, (*prefix, key)))
        else:
            out[(*prefix, key)] = value
    return out


def varied_traj(rng: random.Random, seed: int, wide: bool = False) -> dict[str, Any]:
    """Trajectories that differ in T, B and in which fields they carry (and their shapes).

    `wide`: image rows of 3 KB and a wide done-like field, which stay on disk in large files.
    """
    t, b = rng.randint(1, 5), rng.randint(1, 3)
    traj = make_traj(t=t, b=b, seed=seed, image=32 if wide else rng.choice([2, 4]))
    if wide:
        traj["terminations"] = torch.randn(t + 1, b, 600)
    if rng.random() < 0.2:
        del traj["prev_values"]
    if rng.random() < 0.2:
        traj["curr_obs"]["states"] = torch.randn(*traj["rewards"].shape[:2], 3)
    return traj


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("auto_save", [False, True])
@pytest.mark.parametrize(
    ("seed", "large_files"), [(0, False), (1, False), (2, False), (3, False), (4, True), (5, True)]
)
def test_batches_equal_a_from_scratch_gather_through_adds_loads_and_window_changes(
    tmp_path: Path, auto_save: bool, seed: int, large_files: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rbtool.buffer.storage import ptfile

    if large_files:  # read as files too large to hold whole: small fields packed, wide ones on disk
        monkeypatch.setattr(ptfile, "SMALL_FILE_BYTES", 0)
    rng = random.Random(seed)
    buffer = TrajectoryReplayBuffer(
        seed=seed,
        sample_window_size=rng.choice([0, 3, 7]),
        auto_save=auto_save,
        auto_save_path=str(tmp_path / "auto") if auto_save else "",
    )
    trajs: dict[int, dict[str, Any]] = {}
    next_seed = 0
    for step in range(40):
        action = rng.random()
        if action < 0.6 or not trajs:
            count = rng.randint(1, 3)
            batch = [varied_traj(rng, seed * 1000 + next_seed + i, large_files) for i in range(count)]
            next_seed += len(batch)
            for tid, traj in zip(buffer.add_trajectories(batch), batch, strict=True):
                trajs[tid] = traj
        elif action < 0.7:
            buffer.sample_window_size = rng.choice([0, 1, 4, 9])
        elif action < 0.78:
            saved = tmp_path / f"saved_{step}"
            buffer.save_checkpoint(saved)
            buffer.load_checkpoint(saved)
        draw, batch = buffer.sample_with_draw(rng.choice([1, 5, 64]))
        assert list(draw.window_ids) == buffer.window_ids()
        want = expected_batch(trajs, draw)
        got = flat_batch(batch)
        assert set(got) == set(want)  # (their order is the reference's: see test_fixtures)
        for path, tensor in want.items():
            assert got[path].dtype == tensor.dtype and torch.equal(got[path], tensor), (step, path)
    buffer.close()


def test_a_sample_that_fails_on_a_damaged_file_draws_nothing(tmp_path: Path) -> None:
    writer = TrajectoryReplayBuffer(sample_window_size=0)
    writer.add_trajectories([make_traj(seed=i) for i in range(6)])
    writer.save_checkpoint(tmp_path / "c")
    buffer = TrajectoryReplayBuffer(sample_window_size=0, hold_rows_budget=0)  # rows read when drawn
    buffer.load_checkpoint(tmp_path / "c")
    buffer.sample(4)  # signatures known, files read
    buffer.clear_cache()
    victim = tmp_path / "c" / read_index(tmp_path / "c").file_name(3)
    data = victim.read_bytes()
    buffer._store.raws.clear()  # as if evicted: the next draw of it reads the file again
    victim.write_bytes(data[: len(data) // 2])
    state = buffer.random_generator.get_state()
    with pytest.raises(TrajectoryFileError, match="trajectory_3_"):
        for _ in range(50):  # until a draw lands in the damaged file
            state = buffer.random_generator.get_state()
            buffer.sample(16)
    assert torch.equal(buffer.random_generator.get_state(), state)


def test_the_row_cache_drops_fields_a_new_trajectory_lacks_and_its_dead_rows() -> None:
    from rbtool.buffer.storage import FlatView

    cache = RowCache()
    trajs = [make_traj(t=2, b=1, seed=i) for i in range(6)]
    del trajs[3]["prev_values"]
    base = 0
    for position, traj in enumerate(trajs):
        cache.append(position, base, FlatView(traj, 2, 1))
        base += 2
    assert ("prev_values",) not in cache.columns and ("actions",) in cache.columns
    assert cache.rows == 12 and (cache.lo, cache.hi) == (0, 6)
    cache.trim(5, 10)  # ten rows dead, two live: dropped
    assert (cache.lo, cache.base, cache.rows) == (5, 10, 2)
    covered = cache.covering(5, 6, 10)
    assert covered is not None and covered.shift == 0
    assert torch.equal(covered.columns[("actions",)], trajs[5]["actions"].reshape(2, 7))


def test_the_row_cache_stops_at_its_budget() -> None:
    from rbtool.buffer.storage import FlatView

    cache = RowCache(max_bytes=4096)
    base = 0
    for position in range(40):
        cache.append(position, base, FlatView(make_traj(t=2, b=1, seed=position), 2, 1))
        base += 2
    assert cache.full and 0 < cache.hi < 40
    assert cache.rows * sum(c[0].numel() * c.element_size() for c in cache.columns.values()) <= 4096


def test_auto_save_publishes_are_spaced_and_a_flush_publishes_everything(tmp_path: Path) -> None:
    buffer = TrajectoryReplayBuffer(sample_window_size=0, auto_save=True, auto_save_path=str(tmp_path / "a"))
    assert buffer._writer is not None
    published: list[int] = []
    publish = buffer._writer.publish

    def counting(index: Any) -> None:
        published.append(index.size)
        time.sleep(0.01)  # a slow file system: each publish costs 10 ms
        publish(index)

    buffer._writer.publish = counting  # type: ignore[method-assign]
    for i in range(60):
        buffer.add_trajectories([make_traj(t=2, b=1, seed=i)])
    buffer.flush()
    assert published[-1] == 60 and read_index(tmp_path / "a").size == 60
    assert published == sorted(published) and len(published) < 60
    buffer.close()


# ------------------------------------------------------------------ recorded schemas
def test_checkpoints_rbtool_writes_record_each_trajectorys_field_schema(tmp_path: Path) -> None:
    import orjson

    from rbtool.format.layout import field_schema, schema_digest

    trajs = [make_traj(seed=i) for i in range(4)]
    del trajs[2]["prev_values"]
    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    buffer.add_trajectories(trajs)
    buffer.save_checkpoint(tmp_path / "c")
    meta = orjson.loads((tmp_path / "c" / "metadata.json").read_bytes())
    index = read_index(tmp_path / "c")
    digests = [index.entries[i]["schema"] for i in index.id_list]
    assert len(set(digests)) == 2 and set(meta["field_schemas"]) == set(digests)
    for tid, traj in zip(index.id_list, trajs, strict=True):
        fields = field_schema(traj, 4)
        assert schema_digest(fields) == index.entries[tid]["schema"]
        assert meta["field_schemas"][index.entries[tid]["schema"]] == fields
    assert ["dones"] in [f[0] for f in fields] and [f[3] for f in fields if f[0] == ["dones"]] == [1]


def test_a_recorded_schema_spares_reading_the_window_s_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rbtool.buffer.storage import ptfile

    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    buffer.add_trajectories([make_traj(t=2, b=1, seed=i) for i in range(300)])
    buffer.save_checkpoint(tmp_path / "c")
    reads: list[Path] = []
    real = ptfile.read_header

    def counting(path: Path, data: bytes | None = None) -> dict[str, Any]:
        reads.append(path)
        return real(path, data)

    monkeypatch.setattr(ptfile, "read_header", counting)
    loaded = TrajectoryReplayBuffer(sample_window_size=0, hold_rows_budget=0)  # rows read when drawn
    loaded.load_checkpoint(tmp_path / "c")
    draw, _ = loaded.sample_with_draw(8)
    assert len(reads) <= len(set(draw.trajectory_ids))  # only files drawn from, never the window

    foreign = tmp_path / "foreign"
    import shutil

    shutil.copytree(tmp_path / "c", foreign)
    meta = foreign / "metadata.json"
    import orjson

    doc = orjson.loads(meta.read_bytes())
    del doc["field_schemas"]  # as another writer leaves it: the file's headers are read instead
    meta.write_bytes(orjson.dumps(doc))
    reads.clear()
    other = TrajectoryReplayBuffer(sample_window_size=0, hold_rows_budget=0)
    other.load_checkpoint(foreign)
    assert flat_batch(other.sample(8)).keys() == flat_batch(loaded.sample(8)).keys()
    assert len(reads) >= 300


def test_a_file_that_disagrees_with_its_recorded_schema_is_named(tmp_path: Path) -> None:
    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    buffer.add_trajectories([make_traj(seed=i) for i in range(3)])
    buffer.save_checkpoint(tmp_path / "c")
    index = read_index(tmp_path / "c")
    changed = make_traj(seed=1)
    changed["curr_obs"]["states"] = torch.zeros(4, 2, 3)  # another row shape, entry unchanged
    torch.save(changed, tmp_path / "c" / index.file_name(1))
    loaded = TrajectoryReplayBuffer(sample_window_size=0)
    loaded.load_checkpoint(tmp_path / "c")
    state = loaded.random_generator.get_state()
    with pytest.raises(TrajectoryFileError, match="differ from the schema its index entry records"):
        for _ in range(40):
            state = loaded.random_generator.get_state()
            loaded.sample(8)
    assert torch.equal(loaded.random_generator.get_state(), state)


def test_ingest_records_the_schema_it_read_from_each_header(tmp_path: Path) -> None:
    from rbtool.format.layout import field_schema, schema_digest
    from rbtool.ops.ingestion import ingest

    sources = []
    for i in range(3):
        path = tmp_path / f"t{i}.pt"
        torch.save(make_traj(seed=i), path)
        sources.append(path)
    ingest(sources, tmp_path / "b")
    index = read_index(tmp_path / "b")
    want = schema_digest(field_schema(make_traj(seed=0), 4))
    assert [index.entries[i]["schema"] for i in index.id_list] == [want] * 3
    assert index.schemas[want] == field_schema(make_traj(seed=0), 4)


def test_the_first_sample_of_a_foreign_checkpoint_reports_the_headers_it_reads(tmp_path: Path) -> None:
    import orjson

    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    buffer.add_trajectories([make_traj(t=2, b=1, seed=i) for i in range(100)])
    buffer.save_checkpoint(tmp_path / "c")
    meta = tmp_path / "c" / "metadata.json"
    doc = orjson.loads(meta.read_bytes())
    del doc["field_schemas"], doc["format_version"]  # as another writer leaves it
    meta.write_bytes(orjson.dumps(doc))

    class Seen:
        def __init__(self) -> None:
            self.phases: list[tuple[int | None, str | None]] = []
            self.done = 0

        def start(self, total: int | None, description: str | None = None) -> None:
            self.phases.append((total, description))

        def __call__(self, n: int = 1) -> None:
            self.done += n

    seen = Seen()
    loaded = TrajectoryReplayBuffer(sample_window_size=0, hold_rows_budget=0)  # rows read when drawn
    loaded.load_checkpoint(tmp_path / "c")
    loaded.sample_with_draw(8, progress=seen)
    assert seen.phases == [(100, "reading the window's trajectory headers")] and seen.done == 100
    assert len(loaded._store.raws) == 100  # read whole for their headers, their bytes kept
    again = Seen()
    loaded.sample_with_draw(8, progress=again)  # known now: nothing read, nothing reported
    assert again.phases == [] and again.done == 0


def test_rows_read_by_threads_are_those_read_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rbtool.buffer.storage import ptfile

    monkeypatch.setattr(ptfile, "SMALL_FILE_BYTES", 0)  # image rows stay in their files
    writer = TrajectoryReplayBuffer(sample_window_size=0)
    writer.add_trajectories([make_traj(t=3, b=2, seed=i, image=32) for i in range(12)])
    writer.save_checkpoint(tmp_path / "c")
    batches = []
    for parallel_min, slow in ((10**9, 1.0), (1, 0.0)):  # in order; then always on threads
        monkeypatch.setattr(ptfile, "READ_PARALLEL_MIN", parallel_min)
        monkeypatch.setattr(ptfile, "READ_SLOW_S", slow)
        buffer = TrajectoryReplayBuffer(seed=7, sample_window_size=0)
        buffer.load_checkpoint(tmp_path / "c")
        batches.append([flat_batch(buffer.sample(200)) for _ in range(3)])
    for ordered, threaded in zip(*batches, strict=True):
        assert ordered.keys() == threaded.keys()
        for path in ordered:
            assert torch.equal(ordered[path], threaded[path]), path
    victim = tmp_path / "c" / read_index(tmp_path / "c").file_name(4)
    victim.write_bytes(victim.read_bytes()[:-20000])  # its image rows cut short
    buffer = TrajectoryReplayBuffer(seed=7, sample_window_size=0)
    buffer.load_checkpoint(tmp_path / "c")
    with pytest.raises(TrajectoryFileError, match="trajectory_4_"):
        buffer.sample(200)


def test_held_bytes_spread_over_many_blocks_give_the_from_scratch_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small files held in blocks of a few files each, the oldest dropped past a budget of ten
    files (blocks emptied and let go, the rest moved) while batches read them in place."""
    trajs = {i: make_traj(t=4, b=2, seed=i, image=4 + i % 2) for i in range(30)}
    writer = TrajectoryReplayBuffer(sample_window_size=0)
    writer.add_trajectories([trajs[i] for i in range(30)])
    writer.save_checkpoint(tmp_path / "c")
    one = max(p.stat().st_size for p in (tmp_path / "c").glob("*.pt"))
    monkeypatch.setattr("rbtool.buffer.storage.held.HELD_BLOCK_BYTES", 3 * one)
    monkeypatch.setattr("rbtool.buffer.storage.store.RAW_CACHE_MAX_BYTES", 10 * one)
    buffer = TrajectoryReplayBuffer(seed=3, sample_window_size=20, hold_rows_budget=0)
    buffer.load_checkpoint(tmp_path / "c")
    held = buffer._store.held
    for n in range(12):
        draw, batch = buffer.sample_with_draw(64)
        got, expected = flat_batch(batch), expected_batch(trajs, draw)
        assert got.keys() == expected.keys()
        for path in expected:
            assert torch.equal(got[path], expected[path]), path
        if n % 3 == 2:  # the window moves on: its front is dropped, and its bytes with it
            added = {len(trajs): make_traj(t=4, b=2, seed=len(trajs), image=4)}
            trajs.update(added)
            buffer.add_trajectories(list(added.values()))
        assert held.reserved <= 2 * buffer._store.raw_bytes + held.block_bytes
    assert len(held.blocks) > 1 and held.moved > 0


def test_a_batch_drawing_from_more_files_than_the_descriptor_cache_keeps_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """auto_save on: files are read by name, through the bounded descriptor cache. A batch whose
    draws reach more large files than it keeps open reads each row from its own file (a
    descriptor closed by the cache, its number maybe reused, is never read)."""
    from rbtool.buffer.storage import ptfile

    monkeypatch.setattr(ptfile, "MAX_OPEN_FDS", 16)
    monkeypatch.setattr(ptfile, "SMALL_FILE_BYTES", 0)  # image rows stay in their files
    trajs = {i: make_traj(t=3, b=2, seed=i, image=32) for i in range(60)}
    writer = TrajectoryReplayBuffer(sample_window_size=0)
    writer.add_trajectories([trajs[i] for i in range(60)])
    writer.save_checkpoint(tmp_path / "c")
    buffer = TrajectoryReplayBuffer(
        seed=3, sample_window_size=0, auto_save=True, auto_save_path=str(tmp_path / "auto")
    )
    buffer.load_checkpoint(tmp_path / "c")
    for _ in range(3):
        draw, batch = buffer.sample_with_draw(300)
        assert len(set(draw.trajectory_ids)) > 16
        got, expected = flat_batch(batch), expected_batch(trajs, draw)
        assert got.keys() == expected.keys()
        for path in expected:
            assert torch.equal(got[path], expected[path]), path
    buffer.close()


def test_small_fields_are_held_side_by_side_and_a_stack_is_exactly_their_bytes() -> None:
    from rbtool.buffer.storage.window import STACK_ROW_BYTES, new_columns, stacks_of

    specs = {
        ("a",): (torch.float32, (7,)),
        ("b",): (torch.int32, (7,)),  # 28 bytes a row, like "a"
        ("c",): (torch.bool, (1,)),
        ("d",): (torch.float32, (1,)),
        ("e",): (torch.uint8, (4,)),  # 4 bytes a row, like "d"
        ("f",): (torch.int64, (3,)),  # alone in its row size
        ("g",): (torch.uint8, (STACK_ROW_BYTES + 1,)),  # too wide to stack
        ("h",): (torch.uint8, (STACK_ROW_BYTES + 1,)),
    }
    columns = new_columns(specs, 10)
    for path, column in columns.items():
        assert column.is_contiguous() and column.shape == (10, *specs[path][1])
        column.copy_(
            torch.randint(0, 2 if column.dtype == torch.bool else 100, column.shape).to(column.dtype)
        )
    stacks = {stack.paths: stack for stack in stacks_of(columns)}
    assert set(stacks) == {(("a",), ("b",)), (("d",), ("e",))}
    for paths, stack in stacks.items():
        assert stack.array.flags.c_contiguous  # numpy's take would copy it otherwise
        for k, path in enumerate(paths):
            expected = columns[path].reshape(10, -1).view(torch.uint8)
            assert torch.equal(stack.rows[k], expected)
            assert (stack.array[k] == expected.numpy()).all()
            assert stack.specs[k] == specs[path]
    # columns that are not evenly spaced in one array, that overlap, or that are separate
    # allocations are never read as one
    whole = torch.zeros(4, 10, 4, dtype=torch.uint8)
    uneven = {("x",): whole[0], ("y",): whole[1], ("z",): whole[3]}
    overlapping = {("x",): whole.view(-1)[:40].view(10, 4), ("y",): whole.view(-1)[4:44].view(10, 4)}
    apart = {("x",): torch.zeros(10, 4, dtype=torch.uint8), ("y",): torch.zeros(10, 4, dtype=torch.uint8)}
    assert stacks_of(uneven) == stacks_of(overlapping) == stacks_of(apart) == []
    evenly = {("x",): whole[0, :6], ("y",): whole[2, :6]}  # two of four, a part of each
    (stack,) = stacks_of(evenly)
    whole[2, :6] = 7
    # reaching to where the next column starts: twenty rows apart, the first six each's own
    assert stack.rows.shape == (2, 20, 4) and stack.array.flags.c_contiguous
    assert torch.equal(stack.rows[1, :6], whole[2, :6]) and torch.equal(stack.rows[0, :6], whole[0, :6])
    assert stacks_of({("x",): whole[1, :6], ("y",): whole[3, :6]}) == []  # y's twenty would pass the end


def test_the_row_cache_keeps_small_fields_side_by_side_through_drops_growth_and_trims() -> None:
    from rbtool.buffer.storage import FlatView
    from rbtool.buffer.storage.window import stacks_of

    cache = RowCache()
    trajs = [make_traj(t=2, b=1, seed=i) for i in range(40)]
    del trajs[3]["prev_values"]  # stacked with rewards and versions: let go, the rest kept together
    base = 0
    for position, traj in enumerate(trajs):
        cache.append(position, base, FlatView(traj, 2, 1))
        base += 2
        if position in (2, 3, 39):
            stacked = {p for stack in stacks_of(cache.columns) for p in stack.paths}
            small = {p for p, c in cache.columns.items() if c[0].numel() * c.element_size() <= 64}
            assert stacked == small - {("forward_inputs", "action_tokens")}  # alone in its row size
    rewards = cache.columns[("rewards",)]
    assert ("prev_values",) not in cache.columns
    assert rewards.untyped_storage().nbytes() == 2 * rewards.numel() * 4  # rewards and versions only
    assert rewards.shape[0] > cache.rows  # spare rows: the stacks reach over them, contiguous
    whole = cache.covering(0, 40, 0)
    assert whole is not None and whole.stacks
    assert all(stack.array.flags.c_contiguous for stack in whole.stacks)
    cache.trim(30, 60)
    assert {p for stack in stacks_of(cache.columns) for p in stack.paths} >= {("rewards",), ("versions",)}
    covered = cache.covering(30, 40, 60)
    assert covered is not None and covered.stacks
    for position in range(30, 40):
        row = 2 * (position - 30)
        assert torch.equal(
            covered.columns[("rewards",)][row : row + 2], trajs[position]["rewards"].reshape(2, 1)
        )
