"""rbtool.buffer.storage: flat views of in-memory and `.pt`-file trajectories, the fd cache, gather."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import make_traj
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rbtool.buffer import storage
from rbtool.buffer.sampling import draw_uniform
from rbtool.buffer.storage import (
    FileRows,
    FlatView,
    PinnedFile,
    Schema,
    Storage,
    TrajectoryStore,
    gather,
    nest,
    open_trajectory,
    ptfile,
    sampled_items,
    shared_schema,
    window_cache,
)
from rbtool.errors import InvalidTrajectoryError, TrajectoryFileError
from rbtool.files import trajfile
from rbtool.format import layout
from rbtool.format.layout import DONE_LIKE, done_rows

FieldPath = tuple[str, ...]


def eager_flat(traj: dict[str, Any], t: int) -> dict[FieldPath, torch.Tensor]:
    """Every tensor of >= 2 dims as [T*B, ...], done-like bootstrap rows dropped, written plainly."""
    flat: dict[FieldPath, torch.Tensor] = {}
    for path, value in layout.iter_tensors(traj):
        if value.dim() < 2:
            continue
        extra = value.shape[0] - t if len(path) == 1 and path[0] in DONE_LIKE else 0
        if extra:
            epochs = value.reshape(extra, t // extra + 1, *value.shape[1:])
            value = epochs[:, 1:].reshape(t, *value.shape[1:])
        flat[path] = value.reshape(-1, *value.shape[2:])
    return flat


def save_pt(path: Path, traj: dict[str, Any]) -> Path:
    path.write_bytes(trajfile.to_bytes(traj, "pt"))
    return path


@pytest.fixture(autouse=True, scope="module")
def files_read_by_rows() -> Iterator[None]:
    """Files this small are normally read whole: here their wide rows stay on disk, as in large files."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ptfile, "SMALL_FILE_BYTES", 0)
        yield


def wide_traj(t: int, b: int, extra: int, seed: int) -> dict[str, Any]:
    """Image rows (3 KB) and one wide done-like field: both left in the file when opened."""
    g = torch.Generator().manual_seed(seed + 1000)
    return make_traj(
        t=t,
        b=b,
        seed=seed,
        extra_rows=extra,
        image=32,
        terminations=torch.randn(t + extra, b, 600, generator=g),
    )


# ------------------------------------------------------------- FlatView / rows
@pytest.mark.parametrize(("t", "b", "extra"), [(4, 2, 1), (6, 3, 2), (3, 1, 0), (4, 2, 4)])
def test_memory_and_file_views_give_the_same_rows(tmp_path: Path, t: int, b: int, extra: int) -> None:
    traj = wide_traj(t, b, extra, seed=t * 10 + b)
    data, info = open_trajectory(save_pt(tmp_path / "trajectory_0_x.pt", traj))
    assert info.shape[:2] == (t, b)
    in_memory, on_disk = FlatView(traj, t, b), FlatView(data, t, b)
    # the wide fields really are read from the file, the small ones are held
    assert isinstance(on_disk.fields[("curr_obs", "main_images")].rows, FileRows)
    assert isinstance(on_disk.fields[("terminations",)].rows, FileRows)
    assert isinstance(on_disk.fields[("rewards",)].rows, torch.Tensor)
    assert in_memory.schema() == on_disk.schema()
    assert list(in_memory.schema()) == list(on_disk.schema())

    want = eager_flat(traj, t)
    rng = np.random.default_rng(t + b + extra)
    local = rng.integers(0, t * b, size=17)
    dest = rng.permutation(17)
    views: list[Storage] = [in_memory, on_disk]
    for path, (dtype, shape) in in_memory.schema().items():
        e = in_memory.fields[path].extra
        stored = done_rows(local, np.full(17, t), np.full(17, b), np.full(17, e)) if e else local
        expected = torch.empty((17, *shape), dtype=dtype)
        expected[torch.from_numpy(dest)] = want[path][torch.from_numpy(local)]
        for view in views:
            out = torch.empty((17, *shape), dtype=dtype)
            view.rows(path, stored, out, dest)
            assert torch.equal(out, expected), (path, type(view.fields[path].rows))  # type: ignore[attr-defined]


def test_flat_view_reports_done_like_extra_rows() -> None:
    traj = make_traj(t=6, b=2, extra_rows=3)
    view = FlatView(traj, 6, 2)
    assert {p: f.extra for p, f in view.fields.items() if f.extra} == {(n,): 3 for n in DONE_LIKE}
    assert view.fields[("dones",)].rows.shape[0] == (6 + 3) * 2
    assert view.schema()[("dones",)] == (torch.bool, (1,))


def test_sampled_items_keeps_the_reference_fields_unless_asked_for_all() -> None:
    traj = make_traj(
        t=2,
        b=1,
        task_ids=torch.arange(1),  # 1-dim: never sampled
        big=torch.zeros(2, 1, 3),
        curr_obs={"states": torch.zeros(2, 1, 8), "deep": {"x": torch.zeros(2, 1, 1)}},
        aux={"y": torch.zeros(2, 1, 1)},
    )
    chosen, left_out = sampled_items(traj, extra_fields=False)
    paths = [p for p, _ in chosen]
    top = [(n,) for n in layout.SAMPLED_TOP_FIELDS if n in traj]
    assert len(top) == 8 and paths[: len(top)] == top  # declaration order, not the dict's
    assert ("curr_obs", "states") in paths and ("forward_inputs", "action_tokens") in paths
    assert set(left_out) == {("big",), ("curr_obs", "deep", "x"), ("aux", "y")}
    every, none_left = sampled_items(traj, extra_fields=True)
    assert none_left == []
    assert {p for p, _ in every} == set(paths) | set(left_out)
    assert ("task_ids",) not in {p for p, _ in every}


def test_flat_view_left_out_and_schema_follow_extra_fields() -> None:
    traj = make_traj(t=2, b=1, big=torch.zeros(2, 1, 3))
    assert FlatView(traj, 2, 1).left_out == [("big",)]
    assert ("big",) not in FlatView(traj, 2, 1).schema()
    assert FlatView(traj, 2, 1, extra_fields=True).schema()[("big",)] == (torch.float32, (3,))


def test_a_file_truncated_after_opening_is_named_when_its_rows_are_read(tmp_path: Path) -> None:
    path = save_pt(tmp_path / "trajectory_0_x.pt", wide_traj(4, 2, 1, seed=1))
    data, _ = open_trajectory(path)
    view = FlatView(data, 4, 2)
    os.truncate(path, 2000)
    out = torch.empty((1, 32, 32, 3), dtype=torch.uint8)
    with pytest.raises(TrajectoryFileError, match=rf"^{re.escape(str(path))}: truncated"):
        view.rows(("curr_obs", "main_images"), np.array([7]), out, np.array([0]))


def test_open_trajectory_refuses_what_is_not_a_trajectory(tmp_path: Path) -> None:
    bad = tmp_path / "trajectory_0_x.pt"
    torch.save({"actions": torch.zeros(2, 2)}, bad)
    with pytest.raises(InvalidTrajectoryError, match="cannot determine the trajectory shape"):
        open_trajectory(bad)
    tensor = tmp_path / "trajectory_1_x.pt"
    torch.save(torch.zeros(3), tensor)
    with pytest.raises(TrajectoryFileError, match="expected a trajectory dict"):
        open_trajectory(tensor)


@pytest.mark.parametrize("fmt", ["pt", "pkl"])
def test_open_trajectory_of_both_formats_gives_the_stored_tensors(tmp_path: Path, fmt: str) -> None:
    traj = wide_traj(4, 2, 2, seed=3)
    path = tmp_path / f"trajectory_0_x.{fmt}"
    path.write_bytes(trajfile.to_bytes(traj, fmt))
    data, info = open_trajectory(path)
    assert info == layout.describe(traj, "t")
    view = FlatView(data, 4, 2, extra_fields=True)
    want = eager_flat(traj, 4)
    for p, (dtype, shape) in view.schema().items():
        e = view.fields[p].extra
        local = np.arange(8)
        stored = done_rows(local, np.full(8, 4), np.full(8, 2), np.full(8, e)) if e else local
        out = torch.empty((8, *shape), dtype=dtype)
        view.rows(p, stored, out, local)
        assert torch.equal(out, want[p]), p


# ------------------------------------------------------------------ fd cache
FD_SCRIPT = textwrap.dedent(
    """
    import os, resource, sys
    from pathlib import Path
    resource.setrlimit(resource.RLIMIT_NOFILE, (80, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    import numpy as np, torch
    from rbtool.buffer.storage import ptfile
    from rbtool.files import trajfile
    from rbtool.buffer.storage import FlatView, open_trajectory
    ptfile.SMALL_FILE_BYTES = 0  # as in large files: wide rows stay on disk

    root = Path(sys.argv[1])
    bound = ptfile.MAX_OPEN_FDS
    assert bound == 20, bound  # a quarter of the soft limit
    img = torch.arange(2 * 4096.0).reshape(2, 1, 4096)
    traj = {"rewards": torch.zeros(2, 1, 1), "curr_obs": {"img": img}}
    views = []
    for i in range(3 * bound):
        path = root / f"trajectory_{i}_.pt"
        path.write_bytes(trajfile.to_bytes(traj, "pt"))
        views.append(FlatView(open_trajectory(path)[0], 2, 1))

    def open_here():
        count = 0
        for n in os.listdir("/proc/self/fd"):
            try:
                count += os.readlink(f"/proc/self/fd/{n}").startswith(str(root))
            except FileNotFoundError:  # the descriptor listdir itself used
                pass
        return count

    out = torch.empty((1, 4096))
    peak = 0
    for round_ in range(2):  # the second round reopens what the first closed
        for view in views:
            view.rows(("curr_obs", "img"), np.array([1]), out, np.array([0]))
            assert out[0, 0].item() == 4096.0
            peak = max(peak, open_here())
    print(peak, bound)
    """
)


def test_the_fd_cache_stays_within_its_bound(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", FD_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    peak, bound = map(int, proc.stdout.split())
    assert peak == bound  # full use of the cache, never beyond it


# --------------------------------------------------------------- TrajectoryStore
def test_store_holds_memory_then_files(tmp_path: Path) -> None:
    store = TrajectoryStore(max_open=2, extra_fields=False, lock=threading.RLock())
    traj = make_traj(t=3, b=2, seed=1)
    store.put(7, traj)
    assert store.holds(7) and len(store) == 1 and store.source(7) is traj
    path = save_pt(tmp_path / "trajectory_7_x.pt", traj)
    store.written(7, path)
    assert store.memory == {} and store.source(7) == path and len(store) == 1
    assert store.schema(7, 3, 2) == FlatView(traj, 3, 2).schema()
    store.drop(7)
    assert not store.holds(7) and len(store) == 0


def test_store_keeps_at_most_max_open_views(tmp_path: Path) -> None:
    store = TrajectoryStore(max_open=2, extra_fields=False, lock=threading.RLock())
    for i in range(4):
        store.put(i, make_traj(t=2, b=1, seed=i))
    first = store.view(0, 2, 1)
    store.view(1, 2, 1)
    assert store.view(0, 2, 1) is first  # recently used: kept
    store.view(2, 2, 1)
    assert list(store.views) == [0, 2]


def test_store_refuses_a_file_whose_shape_differs_from_the_index(tmp_path: Path) -> None:
    store = TrajectoryStore(max_open=2, extra_fields=False, lock=threading.RLock())
    path = save_pt(tmp_path / "trajectory_0_x.pt", make_traj(t=3, b=2))
    store.set_files({0: path}, pin=False)
    with pytest.raises(TrajectoryFileError, match=r"\[T, B\] = \[3, 2\] but the index says \[4, 2\]"):
        store.view(0, 4, 2)


def test_pinned_files_survive_deletion_and_replacement(tmp_path: Path) -> None:
    traj = wide_traj(4, 2, 1, seed=2)
    path = save_pt(tmp_path / "trajectory_0_x.pt", traj)
    store = TrajectoryStore(max_open=4, extra_fields=False, lock=threading.RLock())
    store.set_files({0: path}, pin=True)
    pin = store.pins[0]
    assert pin.current_path() == path and store.source(0) == path
    # rotation: the name now holds another file
    path.unlink()
    save_pt(path, make_traj(t=2, b=1, seed=9))
    assert pin.current_path() is None
    held = store.source(0)
    assert isinstance(held, dict) and torch.equal(held["rewards"], traj["rewards"])
    view = store.view(0, 4, 2)
    out = torch.empty((8, 32, 32, 3), dtype=torch.uint8)
    view.rows(("curr_obs", "main_images"), np.arange(8), out, np.arange(8))
    assert torch.equal(out, traj["curr_obs"]["main_images"].reshape(8, 32, 32, 3))
    store.clear()
    assert pin.fd == -1


def test_errors_read_through_a_pin_name_the_original_file(tmp_path: Path) -> None:
    path = tmp_path / "trajectory_0_x.pt"
    data = trajfile.to_bytes(make_traj(), "pt")
    path.write_bytes(data[: len(data) // 2])
    pin = PinnedFile(path)
    try:
        with pytest.raises(TrajectoryFileError) as caught:
            open_trajectory(path, pin)
        assert str(caught.value).startswith(f"{path}: ") and "/proc/" not in str(caught.value)
    finally:
        pin.close()


# -------------------------------------------------------- shared_schema, nest
def test_shared_schema_keeps_fields_common_in_dtype_and_shape() -> None:
    f32, i64 = torch.float32, torch.int64
    a: Schema = {("x",): (f32, (3,)), ("y",): (f32, (1,)), ("o", "s"): (i64, ()), ("z",): (f32, (2,))}
    b: Schema = {("z",): (f32, (2,)), ("x",): (f32, (3,)), ("y",): (i64, (1,)), ("o", "s"): (i64, ())}
    c: Schema = {("x",): (f32, (3,)), ("o", "s"): (i64, ()), ("z",): (f32, (2, 1))}
    assert list(shared_schema([a, b])) == [("x",), ("o", "s"), ("z",)]  # the first's order
    assert shared_schema([a, b, c]) == {("x",): (f32, (3,)), ("o", "s"): (i64, ())}
    assert shared_schema([a]) == a
    assert shared_schema([]) == {}


def test_nest_builds_nested_dicts_in_order() -> None:
    flat = {("a",): 1, ("obs", "s"): 2, ("b",): 3, ("obs", "img"): 4, ("x", "y", "z"): 5}
    nested = nest(flat)
    assert nested == {"a": 1, "obs": {"s": 2, "img": 4}, "b": 3, "x": {"y": {"z": 5}}}
    assert list(nested) == ["a", "obs", "b", "x"] and list(nested["obs"]) == ["s", "img"]
    assert nest({}) == {}


# ------------------------------------------------------------------- gather
SHAPES = [(1, 1, 0), (2, 3, 1), (2, 1, 2), (3, 2, 0), (4, 2, 1), (4, 1, 4), (6, 2, 3), (5, 3, 0)]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shapes=st.lists(st.sampled_from(SHAPES), min_size=1, max_size=4),
    on_disk=st.lists(st.booleans(), min_size=4, max_size=4),
    extra_fields=st.booleans(),
    num_chunks=st.integers(1, 60),
    seed=st.integers(0, 2**31 - 1),
)
def test_gather_equals_an_eager_gather(
    shapes: list[tuple[int, int, int]], on_disk: list[bool], extra_fields: bool, num_chunks: int, seed: int
) -> None:
    trajs = []
    for i, (t, b, e) in enumerate(shapes):
        traj = wide_traj(t, b, e, seed=seed % 1000 + i)
        traj["prev_values"] = torch.randn(t, b, 1 + i % 2)  # differs: left out when shapes differ
        if i % 2:
            traj["big"] = torch.randn(t, b, 700)  # only in some
        trajs.append(traj)
    window_ids = [10 * (i + 1) + i % 3 for i in range(len(trajs))]
    with tempfile.TemporaryDirectory() as tmp:
        views: dict[int, FlatView] = {}
        for tid, traj, disk in zip(window_ids, trajs, on_disk, strict=False):
            t, b = traj["rewards"].shape[:2]
            data = open_trajectory(save_pt(Path(tmp) / f"trajectory_{tid}_x.pt", traj))[0] if disk else traj
            views[tid] = FlatView(data, t, b, extra_fields=extra_fields)
        schema = shared_schema([views[tid].schema() for tid in window_ids])
        draw = draw_uniform(
            window_ids,
            [v.t * v.b for v in views.values()],
            num_chunks,
            torch.Generator().manual_seed(seed),
        )
        flats = [eager_flat(traj, traj["rewards"].shape[0]) for traj in trajs]
        want = {p: torch.cat([f[p] for f in flats])[draw.global_indices] for p in schema}

        got = gather(draw, schema, views.__getitem__)
        cache = window_cache(window_ids, schema, views.__getitem__)
        cached = gather(draw, schema, views.__getitem__, cache)
    assert ("big",) not in schema  # some trajectories lack it
    assert (("prev_values",) in schema) == (len(trajs) == 1)  # trailing shapes differ otherwise
    for batch in (got, cached):
        assert paths_of(batch) == list(schema)  # exactly the schema's fields, in its order
        for p, (dtype, shape) in schema.items():
            value = batch_at(batch, p)
            assert value.dtype == dtype and tuple(value.shape) == (draw.global_indices.numel(), *shape)
            assert torch.equal(value, want[p]), p
    if any(on_disk[: len(trajs)]):
        assert not set(cache) & WIDE  # rows left in a file are never concatenated
    else:
        assert set(cache) == set(schema)


WIDE = {("curr_obs", "main_images"), ("next_obs", "main_images"), ("terminations",), ("big",)}


def paths_of(batch: dict[str, Any], prefix: FieldPath = ()) -> list[FieldPath]:
    out: list[FieldPath] = []
    for key, value in batch.items():
        out.extend(paths_of(value, (*prefix, key)) if isinstance(value, dict) else [(*prefix, key)])
    return out


def batch_at(batch: dict[str, Any], path: FieldPath) -> Any:
    node: Any = batch
    for key in path:
        node = node[key]
    return node


def test_window_cache_concatenates_held_fields_in_window_order() -> None:
    trajs = {5: make_traj(t=2, b=2, seed=1, extra_rows=2), 3: make_traj(t=3, b=1, seed=2)}
    views = {tid: FlatView(traj, *traj["rewards"].shape[:2]) for tid, traj in trajs.items()}
    schema = shared_schema([v.schema() for v in views.values()])
    cache = window_cache([3, 5], schema, views.__getitem__)
    assert set(cache) == set(schema)
    for p in schema:
        want = torch.cat([eager_flat(trajs[3], 3)[p], eager_flat(trajs[5], 2)[p]])
        assert torch.equal(cache[p], want), p


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 900), st.booleans()), min_size=1, max_size=60))
def test_held_blocks_keep_every_held_byte_and_at_most_twice_the_live_bytes(
    steps: list[tuple[int, bool]],
) -> None:
    """Bytes put, some freed as others come: the held (and the freed) raws read their own
    bytes, wherever their block moved them, and the blocks stay within their bound."""
    held = storage.HeldBlocks(block_bytes=1000)
    rng = np.random.default_rng(len(steps))
    live: list[tuple[storage.RawTrajectory, bytes]] = []
    freed: list[tuple[storage.RawTrajectory, bytes]] = []
    for size, free_one in steps:
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        raw = storage.RawTrajectory(data, 1, 1, {})
        held.put(raw)
        live.append((raw, data))
        if free_one and len(live) > 1:
            gone = live.pop(int(rng.integers(0, len(live))))
            held.free(gone[0])
            freed.append(gone)
        for raw, data in live + freed:
            assert raw.data.tobytes() == data
        for raw, data in live:
            if not data:  # nothing to read in place
                assert raw.block is None
                continue
            assert raw.block is not None and raw.block in held.blocks
            assert raw.block.buf[raw.at : raw.at + len(raw.data)].tobytes() == raw.data.tobytes()
        live_bytes = sum(len(data) for _, data in live)
        assert sum(block.live for block in held.blocks) == live_bytes
        assert held.reserved <= 2 * live_bytes + 1000
