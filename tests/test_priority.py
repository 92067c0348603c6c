"""PriorityStore: RLinf's store of the highest-priority trajectories, its behaviour reproduced
(each expectation here is what RLinf's own class gives), and where RLinf's breaks, sane."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from rbtool import PriorityStore


@dataclass
class Traj:
    name: str
    versions: torch.Tensor | None = None


def filled(maxsize: int, *priorities: tuple[float, float]) -> tuple[PriorityStore[Traj], list[Traj]]:
    store: PriorityStore[Traj] = PriorityStore(maxsize)
    items = [Traj(f"t{i}", torch.full((2, 2), p[0])) for i, p in enumerate(priorities)]
    for p, item in zip(priorities, items, strict=True):
        assert store.add(p, item)
    return store, items


def test_topn_is_highest_first_and_the_oldest_is_last_among_equals() -> None:
    store, (a, b, c, d) = filled(4, (1.0, 1.0), (2.0, 0.0), (1.0, 1.0), (1.0, 3.0))
    assert len(store) == 4
    assert store.topn(4) == [b, d, c, a]
    assert store.topn(2) == [b, d]
    assert store.topn(10) == [b, d, c, a]


def test_a_full_store_refuses_lower_evicts_its_lowest_and_oldest_on_a_tie() -> None:
    store, (_a, b) = filled(2, (1.0, 0.0), (1.0, 0.0))
    low = Traj("low")
    assert store.add((0.5, 9.0), low) is False  # below the lowest: refused
    tie = Traj("tie")
    assert store.add((1.0, 0.0), tie) is True  # equal to the lowest: kept, the oldest goes
    assert store.topn(2) == [tie, b]
    assert store.get_metric()["discarded_unused"] == 2  # `low` and `a`, never handed out


def test_discarded_unused_counts_only_items_never_handed_out() -> None:
    store, (_a, _b, c) = filled(3, (1.0, 0.0), (2.0, 0.0), (3.0, 0.0))
    assert store.topn(1) == [c]
    store.remove_below(4.0)  # all three go; c was used
    assert len(store) == 0
    assert store.get_metric() == {"discarded_unused": 2}


def test_remove_below_reads_the_first_element_of_the_priority() -> None:
    store, (_a, b, c) = filled(5, (1.0, 9.0), (2.0, 0.0), (2.0, 5.0))
    store.remove_below(2.0)
    assert store.topn(5) == [c, b]


def test_get_metric_gives_each_rounded_version_its_share() -> None:
    store: PriorityStore[object] = PriorityStore(4)
    store.add((1.0, 1.0), Traj("x", torch.tensor([[0.9, 1.2], [2.0, 1.0]])))
    store.add((2.0, 2.0), {"versions": torch.tensor([2, 2])})  # dict trajectories too
    store.add((3.0, 3.0), Traj("none"))
    metric = store.get_metric()
    assert metric == {1: {"ratio": 0.5}, 2: {"ratio": 0.5}, "discarded_unused": 0}
    assert list(metric) == [1, 2, "discarded_unused"]


def test_maxsize_zero_keeps_nothing_where_rlinfs_raises() -> None:
    for maxsize in (0, -1):
        store: PriorityStore[str] = PriorityStore(maxsize)
        assert store.add((1.0, 1.0), "x") is False
        assert len(store) == 0 and store.get_metric() == {"discarded_unused": 1}


def test_topn_zero_is_empty_and_a_negative_n_an_error() -> None:
    store, _ = filled(3, (1.0, 0.0), (2.0, 0.0))
    assert store.topn(0) == []  # RLinf's items[-0:] would hand out (and mark used) every item
    with pytest.raises(ValueError, match="n >= 0"):
        store.topn(-1)
    store.remove_below(5.0)
    assert store.get_metric()["discarded_unused"] == 2


# ------------------------------------------------------------------- RLinf's own class, recorded
def recorded_sequences() -> list[dict[str, Any]]:
    """Calls RLinf's own PriorityStore ran, and what it returned (fixtures/rlinf/replay_classes)."""
    import json

    from conftest import FIXTURES

    path = FIXTURES / "replay_classes" / "replay_classes.expected.json"
    sequences: list[dict[str, Any]] = json.loads(path.read_text())["priority_store"]
    return sequences


def versions_of(encoded: dict[str, Any] | None) -> torch.Tensor | None:
    if encoded is None:
        return None
    return torch.tensor(encoded["values"], dtype=getattr(torch, encoded["tensor"])).reshape(encoded["shape"])


@pytest.mark.parametrize("sequence", recorded_sequences(), ids=lambda s: f"seed{s['seed']}")
def test_rlinfs_recorded_call_sequences_give_its_returns_and_metrics(sequence: dict[str, Any]) -> None:
    store: PriorityStore[Traj] = PriorityStore(sequence["maxsize"])
    for n, step in enumerate(sequence["steps"]):
        where = f"step {n} ({step['op']})"
        if step["op"] == "add":
            item = Traj(step["name"], versions_of(step["versions"]))
            assert store.add(tuple(step["priority"]), item) is step["result"], where
        elif step["op"] == "topn":
            assert [item.name for item in store.topn(step["n"])] == step["result"], where
        elif step["op"] == "remove_below":
            store.remove_below(step["threshold"])
        elif step["op"] == "get_metric":
            assert [[key, value] for key, value in store.get_metric().items()] == step["result"], where
        assert len(store) == step["len"], where
