"""TrajectoryCache: RLinf's FIFO cache of flattened trajectories, its behaviour reproduced
(each expectation here is what RLinf's own class gives for the same calls)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rbtool import TrajectoryCache
from rbtool.buffer.cache import CachedIds


def flat(n: int, base: float = 0.0, **extra: torch.Tensor) -> dict:
    return {
        "rewards": torch.arange(n, dtype=torch.float32).unsqueeze(1) + base,
        "curr_obs": {"states": torch.full((n, 3), base)},
        "note": "kept",
        **extra,
    }


def test_put_and_get_views_of_one_preallocated_buffer() -> None:
    cache = TrajectoryCache(max_size=3)
    assert cache.get(0) is None and cache.get_buffer() is None and cache.get_slot_length() is None
    cache.put(7, flat(4, 10.0))
    assert cache.get_slot_length() == 4
    buffer = cache.get_buffer()
    assert buffer is not None and buffer["rewards"].shape == (12, 1) and buffer["note"] == "kept"
    got = cache.get(7)
    assert got is not None and torch.equal(got["rewards"][:, 0], torch.arange(4.0) + 10)
    assert got["rewards"].data_ptr() == buffer["rewards"].data_ptr()  # a view, not a copy
    assert cache.cache == {7: 0}


def test_slots_are_used_in_turn_and_the_oldest_put_is_evicted() -> None:
    cache = TrajectoryCache(max_size=2)
    for tid in (0, 1):
        cache.put(tid, flat(2, float(tid)))
    cache.get(0)  # reading does not matter: FIFO, not LRU
    cache.put(2, flat(2, 2.0))
    assert cache.cache == {1: 1, 2: 0} and cache.get(0) is None
    cache.put(1, flat(2, 5.0))  # an id already held keeps its slot
    assert cache.cache == {1: 1, 2: 0}
    got = cache.get(1)
    assert got is not None and float(got["curr_obs"]["states"][0, 0]) == 5.0
    cache.put(3, flat(2, 3.0))  # the next slot in turn is 1: id 1 goes, though just rewritten
    assert cache.cache == {2: 0, 3: 1}


def test_a_longer_trajectory_grows_every_slot_keeping_what_they_hold() -> None:
    cache = TrajectoryCache(max_size=2)
    cache.put(0, flat(2, 1.0))
    cache.put(1, flat(5, 2.0))
    assert cache.get_slot_length() == 5
    buffer = cache.get_buffer()
    assert buffer is not None and buffer["rewards"].shape == (10, 1)
    first = cache.get(0)
    assert first is not None and first["rewards"].shape == (2, 1)  # each key its own length
    assert torch.equal(first["rewards"][:, 0], torch.tensor([1.0, 2.0]))
    second = cache.get(1)
    assert second is not None and torch.equal(second["rewards"][:, 0], torch.arange(5.0) + 2)


def test_clear_starts_again_from_slot_zero() -> None:
    cache = TrajectoryCache(max_size=2)
    cache.put(0, flat(2))
    cache.put(1, flat(2))
    cache.clear()
    assert cache.cache == {} and cache.get_buffer() is None and cache.get_slot_length() is None
    cache.put(9, flat(3))
    assert cache.cache == {9: 0} and cache.get_slot_length() == 3


@pytest.mark.parametrize("trajectory", [{"note": "x"}, {"rewards": torch.zeros(2, 1), "curr_obs": {}}])
def test_a_trajectory_or_dict_without_a_tensor_is_a_value_error(trajectory: dict) -> None:
    with pytest.raises(ValueError, match="no tensor fields"):
        TrajectoryCache(2).put(0, trajectory)


def test_max_size_zero_fails_as_rlinfs_does() -> None:
    with pytest.raises(ZeroDivisionError):
        TrajectoryCache(0).put(0, flat(2))


def test_default_size_is_five() -> None:
    assert TrajectoryCache().max_size == 5


def test_cached_ids_count_what_such_a_cache_holds() -> None:
    ids = CachedIds(3)
    ids.put(range(5))
    assert len(ids) == 3
    ids.reset([10, 11])
    assert len(ids) == 2
    ids.put([11, 12, 13])
    assert len(ids) == 3
    ids.reset()
    assert len(ids) == 0
    none = CachedIds(0)
    none.put(range(4))
    none.reset(range(4))
    assert len(none) == 0


# ------------------------------------------------------------------- RLinf's own class, recorded
def recorded() -> dict[str, Any]:
    """Calls RLinf's own classes ran, and what they returned (fixtures/rlinf/replay_classes)."""
    import json

    from conftest import FIXTURES

    path = FIXTURES / "replay_classes" / "replay_classes.expected.json"
    record: dict[str, Any] = json.loads(path.read_text())
    return record


def decode(encoded: dict[str, Any]) -> Any:
    if "tensor" in encoded:
        dtype = getattr(torch, encoded["tensor"])
        return torch.tensor(encoded["values"], dtype=dtype).reshape(encoded["shape"])
    if "dict" in encoded:
        return {key: decode(value) for key, value in encoded["dict"].items()}
    return encoded["value"]


def recorded_input(spec: dict[str, Any]) -> dict[str, Any]:
    """The trajectory record.py put for `spec` (its cache_input)."""
    base, n = float(spec["base"]), spec["lengths"]
    return {
        "rewards": torch.arange(n["rewards"], dtype=torch.float32).unsqueeze(1) + 100 * base,
        "curr_obs": {"states": torch.full((n["states"], spec["width"]), base)},
        "dones": torch.tensor(spec["dones"], dtype=torch.bool).unsqueeze(1),
        "note": f"put {spec['base']}",
    }


def same(actual: Any, expected: Any, where: str) -> None:
    assert type(actual) is type(expected), where
    if isinstance(expected, dict):
        assert list(actual) == list(expected), where
        for key in expected:
            same(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), where
    else:
        assert actual == expected, where


def shapes(buffer: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in buffer.items():
        if isinstance(value, torch.Tensor):
            out[key] = list(value.shape)
        else:
            out[key] = shapes(value) if isinstance(value, dict) else value
    return out


@pytest.mark.parametrize("sequence", recorded()["trajectory_cache"], ids=lambda s: f"seed{s['seed']}")
def test_rlinfs_recorded_call_sequences_give_the_same_slots_views_and_values(
    sequence: dict[str, Any],
) -> None:
    cache = TrajectoryCache(sequence["max_size"])
    for n, step in enumerate(sequence["steps"]):
        where = f"step {n} ({step['op']})"
        if step["op"] == "put":
            cache.put(step["id"], recorded_input(step["trajectory"]))
        elif step["op"] == "get":
            got = cache.get(step["id"])
            if step["result"] is None:
                assert got is None, where
            else:
                same(got, decode(step["result"]), where)
        else:
            cache.clear()
        assert sorted([tid, slot] for tid, slot in cache.cache.items()) == step["cache"], where
        assert cache.get_slot_length() == step["slot_length"], where
        buffer = cache.get_buffer()
        assert (None if buffer is None else shapes(buffer)) == step["buffer_shapes"], where
