"""rbtool.buffer.batchmem: a batch's large fields reuse the memory of earlier batches nobody holds.

A batch, or any view, numpy array or shared-memory copy of one of its fields, must never be
written over by a later sample; memory is reused only once nothing refers to it; and what is
kept for reuse stays bounded however many batches a caller keeps.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import flat_batch, make_traj

from rbtool import TrajectoryReplayBuffer
from rbtool.buffer import batchmem, rowmap
from rbtool.buffer.batchmem import BatchMemory
from rbtool.buffer.storage import gathering

IMAGE = 48  # 6,912-byte rows: 256 of them are 1.7 MiB, past batchmem.MIN_BYTES
DRAWS = 256


def copies(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in flat_batch(batch).items()}


def large(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in flat_batch(batch).items() if v.numel() * v.element_size() > batchmem.MIN_BYTES}


def assert_unchanged(batch: dict[str, Any], saved: dict[str, torch.Tensor]) -> None:
    now = flat_batch(batch)
    assert list(now) == list(saved)
    for key, value in saved.items():
        assert torch.equal(now[key], value), key


SETTINGS = ["in memory", "default", "map_rows"]


@pytest.fixture(params=SETTINGS)
def buffer(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    trajs = [make_traj(t=8, b=4, seed=i, image=IMAGE, extra_rows=1) for i in range(12)]
    if request.param == "in memory":
        buf = TrajectoryReplayBuffer(seed=3, sample_window_size=0)
        buf.add_trajectories(trajs)
    else:
        if request.param == "map_rows" and not rowmap.available():
            pytest.skip("the row map needs Linux (mremap)")
        source = TrajectoryReplayBuffer(seed=5, sample_window_size=0)
        source.add_trajectories(trajs)
        source.save_checkpoint(tmp_path / "ckpt")
        source.close()
        buf = TrajectoryReplayBuffer(seed=3, sample_window_size=0, map_rows=request.param == "map_rows")
        buf.load_checkpoint(tmp_path / "ckpt")
    yield buf
    buf.close()


def test_a_held_batch_is_never_written_over(buffer: TrajectoryReplayBuffer) -> None:
    first = buffer.sample(DRAWS)
    assert large(first), "the test needs fields past MIN_BYTES"
    saved = copies(first)
    for _ in range(2 * batchmem.KEEP + 2):
        buffer.sample(DRAWS)
    assert_unchanged(first, saved)


def test_views_numpy_and_shared_copies_hold_the_memory(buffer: TrajectoryReplayBuffer) -> None:
    batch = buffer.sample(DRAWS)
    name, field = next(iter(large(batch).items()))
    view = field[3:9]
    array = field[10:12].numpy()
    shared = flat_batch(buffer.sample(DRAWS))[name].share_memory_()
    saved = (view.clone(), array.copy(), shared.clone())
    del batch, field
    for _ in range(2 * batchmem.KEEP + 2):
        buffer.sample(DRAWS)
    assert torch.equal(view, saved[0])
    assert (array == saved[1]).all()
    assert torch.equal(shared, saved[2])


def test_memory_is_reused_once_nothing_refers_to_it(buffer: TrajectoryReplayBuffer) -> None:
    batch = buffer.sample(DRAWS)
    pointers = {k: v.data_ptr() for k, v in large(batch).items()}
    del batch
    again = large(buffer.sample(DRAWS))
    assert {k: v.data_ptr() for k, v in again.items()} == pointers
    # while `again` is held, the next batch is written elsewhere
    other = large(buffer.sample(DRAWS))
    assert all(other[k].data_ptr() != again[k].data_ptr() for k in again)


def test_same_batches_as_without_reuse(
    buffer: TrajectoryReplayBuffer, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = buffer.random_generator.get_state()
    reused = [copies(buffer.sample(DRAWS)) for _ in range(6)]
    buffer.random_generator.set_state(state)
    monkeypatch.setattr(batchmem, "MIN_BYTES", 1 << 62)  # every field a plain allocation
    plain = [copies(buffer.sample(DRAWS)) for _ in range(6)]
    for a, b in zip(reused, plain, strict=True):
        assert list(a) == list(b)
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_fields_do_not_share_memory(buffer: TrajectoryReplayBuffer) -> None:
    batch = flat_batch(buffer.sample(DRAWS))
    for value in large(batch).values():
        assert value.untyped_storage().nbytes() == value.numel() * value.element_size()
    # small fields held side by side may come out of one array, of at most STACK_BATCH_BYTES
    for value in batch.values():
        assert value.is_contiguous()
        assert value.untyped_storage().nbytes() <= max(
            gathering.STACK_BATCH_BYTES, value.numel() * value.element_size()
        )
    field = next(iter(large(buffer.sample(DRAWS)).values()))
    saved = io.BytesIO()
    torch.save(field[:1], saved)
    assert len(saved.getvalue()) < field.numel() * field.element_size() + 4096  # one field, not the batch
    assert torch.equal(pickle.loads(pickle.dumps(field)), field)


def test_what_is_kept_stays_bounded(buffer: TrajectoryReplayBuffer) -> None:
    held = [buffer.sample(DRAWS) for _ in range(20)]  # a caller that keeps every batch
    per_batch = sum(v.numel() * v.element_size() for v in large(held[0]).values())
    assert 0 < buffer._batch_memory.kept_bytes <= batchmem.KEEP * per_batch
    held.clear()
    buffer.clear_cache()
    assert buffer._batch_memory.kept_bytes == 0


def test_sizes_outside_the_range_are_plain_allocations() -> None:
    memory = BatchMemory()
    small = memory.empty("a", (16, 4), torch.float32)
    small.resize_(32, 4)  # torch's own allocation: resizable
    big = memory.empty("b", (batchmem.MAX_BYTES // 4 + 1,), torch.float32)
    big.resize_(8)
    assert memory.kept_bytes == 0
    kept = memory.empty("c", (batchmem.MIN_BYTES,), torch.int16)
    assert kept.dtype == torch.int16 and kept.shape == (batchmem.MIN_BYTES,)
    assert kept.data_ptr() % batchmem.ALIGN == 0
    assert memory.kept_bytes == 2 * batchmem.MIN_BYTES


def test_the_total_kept_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batchmem, "KEEP_BYTES", 3 * batchmem.MIN_BYTES)
    memory = BatchMemory()
    shape = (batchmem.MIN_BYTES + 64,)
    tensors = [memory.empty(k, shape, torch.uint8) for k in "abcdef"]
    assert memory.kept_bytes == 2 * (batchmem.MIN_BYTES + 64)
    del tensors
    again = memory.empty("a", shape, torch.uint8)
    assert memory.kept_bytes == 2 * (batchmem.MIN_BYTES + 64)
    assert again.numel() == shape[0]


def test_room_is_made_from_free_arrays_of_other_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batchmem, "KEEP_BYTES", 2 * batchmem.MIN_BYTES + 128)
    memory = BatchMemory()
    shape = (batchmem.MIN_BYTES + 64,)
    held = memory.empty("a", shape, torch.uint8)
    memory.empty("b", shape, torch.uint8)  # dropped at once: its array is free
    new = memory.empty("c", shape, torch.uint8)  # b's free array makes room; a's is held
    assert memory.kept_bytes == 2 * shape[0]
    assert [len(memory._rings[k]) for k in "abc"] == [1, 0, 1]
    assert memory._rings["c"][0].ctypes.data == new.data_ptr()
    assert memory._rings["a"][0].ctypes.data == held.data_ptr()


KEEPERS = {
    "a view": lambda t: t[3:],
    "a byte view": lambda t: t.view(torch.uint8),
    "its storage": lambda t: t.untyped_storage(),
    "numpy": lambda t: t.numpy(),
}


@pytest.mark.parametrize("keeper", list(KEEPERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.bfloat16])
def test_memory_of_any_dtype_is_reused_only_once_nothing_refers_to_it(
    dtype: torch.dtype, keeper: str
) -> None:
    """The ring holds the array a tensor is made from, typed where numpy has the dtype:
    whatever refers to the tensor's memory keeps the array from being handed out again."""
    if keeper == "numpy" and dtype == torch.bfloat16:
        pytest.skip("numpy has no bfloat16")
    memory = BatchMemory()
    shape = (256, batchmem.MIN_BYTES // 256 + 8)
    first = memory.empty("f", shape, dtype)
    assert first.dtype == dtype and first.shape == shape and first.is_contiguous()
    address = first.data_ptr()
    del first
    again = memory.empty("f", shape, dtype)
    assert again.data_ptr() == address  # free: reused
    held = KEEPERS[keeper](again)
    del again
    other = memory.empty("f", shape, dtype)
    assert other.data_ptr() != address  # still referred to: not handed out
    del other, held
    assert memory.empty("f", shape, dtype).data_ptr() == address  # nothing refers to it any more
    reshaped = memory.empty("f", (shape[0] * 2, shape[1] // 2), dtype)
    assert reshaped.shape == (shape[0] * 2, shape[1] // 2) and reshaped.dtype == dtype
