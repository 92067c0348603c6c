"""Top-k indexer, softmax weights, weighted draws, and the buffer's `strategy="topk"`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FIXTURES, make_traj

from rbtool import TrajectoryReplayBuffer, UsageError
from rbtool.buffer.topk import (
    RewardIndex,
    check_strategy,
    draw_topk,
    softmax_weights,
    trajectory_scores,
    weighted_draw,
)


def pairs(c) -> list[tuple[int, int, float]]:
    return list(zip(c.trajectory_ids.tolist(), c.rows.tolist(), c.scores.tolist(), strict=True))


def hand_index() -> RewardIndex:
    index = RewardIndex()
    index.add([(5, np.array([1.0, 3.0, 3.0, 0.0])), (2, np.array([3.0, 2.0]))])
    index.add([(7, np.array([np.nan, 3.0, -1.0]))])
    return index


def test_top_k_ranks_by_score_then_lower_id_then_lower_row() -> None:
    index = hand_index()
    assert pairs(index.top_k(4)) == [(2, 0, 3.0), (5, 1, 3.0), (5, 2, 3.0), (7, 1, 3.0)]
    assert pairs(index.top_k(6))[4:] == [(2, 1, 2.0), (5, 0, 1.0)]


def test_top_k_larger_than_the_buffer_gives_every_scored_sample_once() -> None:
    index = hand_index()
    ranked = pairs(index.top_k(1000))
    assert len(ranked) == 8  # 9 samples, one NaN reward cannot be ranked
    assert len({(t, r) for t, r, _ in ranked}) == len(ranked)
    assert [s for _, _, s in ranked] == sorted((s for _, _, s in ranked), reverse=True)
    assert (7, 0) not in {(t, r) for t, r, _ in ranked}


def test_top_k_restricted_to_a_window() -> None:
    index = hand_index()
    assert pairs(index.top_k(2, [5, 7])) == [(5, 1, 3.0), (5, 2, 3.0)]
    with pytest.raises(UsageError):
        index.top_k(0)


def test_recency_returns_newest_trajectory_and_row_first() -> None:
    index = hand_index()  # inserted 5, 2, 7
    assert [(t, r) for t, r, _ in pairs(index.recent(4))] == [(7, 2), (7, 1), (7, 0), (2, 1)]
    # An explicit order (a buffer's window) wins over the order the batches came in.
    assert [(t, r) for t, r, _ in pairs(index.recent(3, [7, 2, 5]))] == [(5, 3), (5, 2), (5, 1)]
    assert len(index.recent(100)) == 9


def test_updates_are_applied_per_batch_and_invalidate_the_ranking() -> None:
    index = RewardIndex()
    index.add([(0, np.array([1.0, 2.0]))])
    assert pairs(index.top_k(1)) == [(0, 1, 2.0)]
    index.add([(1, np.array([5.0]))])
    assert index.missing([0, 1, 2]) == [2]
    assert pairs(index.top_k(1)) == [(1, 0, 5.0)]
    index.retain([1])
    assert len(index) == 1 and 0 not in index


@pytest.mark.parametrize(
    "scores",
    [
        [1e308, -1e308, 1e308],
        [-1e308, -1e308],
        [1e308, 1e308, 1e308, 1e308],
        [0.0, 0.0, 0.0],
        [np.inf, 1.0, np.inf],
        [-np.inf, -np.inf],
        [np.nan, 1.0],
        [1e-300, -1e-300, 0.0],
    ],
)
@pytest.mark.parametrize("temperature", [1e-300, 0.5, 1.0, 1e300])
def test_softmax_weights_sum_to_one_without_nan(scores: list[float], temperature: float) -> None:
    w = softmax_weights(np.array(scores), temperature)
    assert not np.isnan(w).any()
    assert (w >= 0).all()
    assert w.sum() == pytest.approx(1.0, abs=1e-12)


def test_softmax_weights_values() -> None:
    assert softmax_weights(np.array([1e308, -1e308, 1e308]), 0.5).tolist() == [0.5, 0.0, 0.5]
    assert softmax_weights(np.array([2.0, 2.0, 2.0, 2.0]), 1.0).tolist() == [0.25] * 4
    w = softmax_weights(np.array([0.0, np.log(3.0)]), 1.0)
    assert w == pytest.approx([0.25, 0.75])
    w = softmax_weights(np.array([0.0, np.log(3.0)]), 2.0)  # temperature flattens: 1 : sqrt(3)
    assert w[1] / w[0] == pytest.approx(np.sqrt(3.0))
    with pytest.raises(UsageError):
        softmax_weights(np.array([1.0]), 0.0)


def test_empirical_draws_follow_the_weights() -> None:
    """Seeded: total variation between observed and expected frequencies < 0.03 over 20000 draws."""
    w = softmax_weights(np.array([3.0, 2.5, 1.0, 0.0, -1.0, 2.0]), 1.0)
    picks = weighted_draw(w, 20000, torch.Generator().manual_seed(7))
    observed = np.bincount(picks.numpy(), minlength=w.size) / 20000
    assert 0.5 * np.abs(observed - w).sum() < 0.03


def test_zero_weights_are_never_drawn() -> None:
    w = np.array([0.0, 0.5, 0.0, 0.5, 0.0, 0.0])
    picks = weighted_draw(w, 5000, torch.Generator().manual_seed(0))
    assert set(picks.tolist()) == {1, 3}


def test_weighted_draw_uses_the_generator_reproducibly() -> None:
    w = softmax_weights(np.arange(10.0), 3.0)
    a = weighted_draw(w, 50, torch.Generator().manual_seed(3))
    b = weighted_draw(w, 50, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    # Same uniforms as torch.rand(float64) + searchsorted(right=True) on the pinned cumulative sum.
    u = torch.rand(50, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    cdf = np.cumsum(w)
    cdf[-1] = 1.0
    assert torch.equal(a, torch.searchsorted(torch.from_numpy(cdf), u, right=True))


def test_draw_topk_maps_candidates_to_window_positions() -> None:
    index = RewardIndex()
    index.add([(10, np.array([0.0, 0.0, 9.0])), (4, np.array([8.0, 0.0]))])
    window = [10, 4]
    draw = draw_topk(window, [3, 2], index.top_k(2, window), 100, 1e-9, torch.Generator().manual_seed(1))
    assert draw.global_indices.numel() == 5  # clamped to the window's samples, like uniform
    assert set(zip(draw.trajectory_ids, draw.local_indices.tolist(), strict=True)) == {(10, 2)}
    assert draw.global_indices.tolist() == [2] * 5


@pytest.mark.parametrize(
    "args",
    [
        ("best", None, 1.0),
        ("topk", None, 1.0),
        ("topk", 0, 1.0),
        ("topk", 2, 0.0),
        ("topk", 2, -1.0),
        ("topk", 2, float("nan")),
        ("uniform", 0, 1.0),
    ],
)
def test_check_strategy_refuses(args: tuple) -> None:
    check_strategy("uniform", None, 1.0)
    check_strategy("topk", 3, 0.1)
    with pytest.raises(UsageError):
        check_strategy(*args)


def test_trajectory_scores_sum_trailing_dims() -> None:
    traj = {"rewards": torch.arange(12, dtype=torch.float32).reshape(2, 3, 2)}
    assert trajectory_scores(traj, 6).tolist() == [1.0, 5.0, 9.0, 13.0, 17.0, 21.0]
    assert np.isnan(trajectory_scores({"prev_logprobs": torch.zeros(2, 3, 7)}, 6)).all()


# ------------------------------------------------------------------ the buffer
def rewarded(seed: int, best: float | None = None, where: tuple[int, int] = (1, 0)) -> dict:
    traj = make_traj(seed=seed)
    traj["rewards"] = torch.zeros(4, 2, 1)
    if best is not None:
        traj["rewards"][where[0], where[1], 0] = best
    return traj


def test_buffer_topk_draws_the_best_sample_and_keeps_the_batch_layout() -> None:
    buffer = TrajectoryReplayBuffer(seed=5, sample_window_size=0)
    buffer.add_trajectories([rewarded(0), rewarded(1, best=7.0, where=(2, 1)), rewarded(2)])
    uniform = buffer.sample(6)
    draw, batch = buffer.sample_with_draw(6, strategy="topk", k=1)
    assert draw.trajectory_ids == [1] * 6 and draw.local_indices.tolist() == [5] * 6
    assert (batch["rewards"] == 7.0).all()
    assert batch.keys() == uniform.keys()
    for key in ("actions", "dones"):
        assert batch[key].shape == uniform[key].shape and batch[key].dtype == uniform[key].dtype
    assert torch.equal(batch["curr_obs"]["states"][0], buffer._view(1).fields[("curr_obs", "states")].rows[5])


def test_buffer_feeds_the_indexer_on_add_after_the_first_topk_call() -> None:
    buffer = TrajectoryReplayBuffer(seed=5, sample_window_size=2)
    buffer.add_trajectories([rewarded(0, best=1.0), rewarded(1, best=2.0)])
    draw, _ = buffer.sample_with_draw(4, strategy="topk", k=1)
    assert draw.trajectory_ids == [1] * 4
    buffer.add_trajectories([rewarded(2, best=9.0, where=(0, 1))])
    assert 2 in buffer._rewards  # fed by the add, not by the next query
    draw, _ = buffer.sample_with_draw(4, strategy="topk", k=1)
    assert draw.trajectory_ids == [2] * 4 and draw.local_indices.tolist() == [1] * 4
    assert 0 not in buffer._rewards  # left the window, forgotten


def test_buffer_topk_after_loading_a_checkpoint_reads_rewards_lazily() -> None:
    rel = FIXTURES / "autosave_pt" / "autosave"
    buffer = TrajectoryReplayBuffer(sample_window_size=3)
    buffer.load_checkpoint(rel)
    assert buffer._rewards is None
    draw, batch = buffer.sample_with_draw(64, strategy="topk", k=3, temperature=0.5)
    best = []
    for tid in buffer.window_ids():
        rewards = torch.load(Path(rel) / buffer._index.file_name(tid), weights_only=True)["rewards"]
        best += [(float(r), tid, row) for row, r in enumerate(rewards.reshape(-1).tolist())]
    best.sort(key=lambda x: (-x[0], x[1], x[2]))
    top3 = {(tid, row) for _, tid, row in best[:3]}
    assert set(zip(draw.trajectory_ids, draw.local_indices.tolist(), strict=True)) <= top3
    assert batch["rewards"].shape == (24, 1)  # 64 chunks clamped to the window's 24 samples


def test_buffer_uniform_is_unchanged_by_the_strategy_keywords() -> None:
    a = TrajectoryReplayBuffer(seed=11, sample_window_size=0)
    b = TrajectoryReplayBuffer(seed=11, sample_window_size=0)
    for buf in (a, b):
        buf.add_trajectories([make_traj(seed=s) for s in range(3)])
    for _ in range(3):
        x, y = a.sample(5), b.sample(5, strategy="uniform", k=None, temperature=1.0)
        assert torch.equal(x["actions"], y["actions"])


def test_buffer_topk_errors() -> None:
    buffer = TrajectoryReplayBuffer()
    with pytest.raises(UsageError):
        buffer.sample(4, strategy="topk", k=0)
    with pytest.raises(UsageError):
        buffer.sample(4, strategy="topk", k=2, temperature=0.0)
    with pytest.raises(UsageError):
        buffer.sample(4, strategy="best")
    with pytest.raises(UsageError):
        buffer.sample(4, strategy="topk")
    buffer.add_trajectories([make_traj(seed=0, rewards=None)])  # shape from prev_logprobs, no rewards
    with pytest.raises(Exception, match="no sample in the window has a reward"):
        buffer.sample(4, strategy="topk", k=2)


def test_topk_reads_rewards_left_in_their_file(tmp_path: Path) -> None:
    """Wide reward rows (B = 600 environments) stay in the file until drawn; top-k reads them."""
    traj = make_traj(t=2, b=600, seed=1)
    traj["rewards"] = torch.zeros(2, 600, 1)
    traj["rewards"][1, 37, 0] = 5.0
    writer = TrajectoryReplayBuffer(auto_save=True, auto_save_path=str(tmp_path / "buf"))
    writer.add_trajectories([traj])
    writer.close()
    buffer = TrajectoryReplayBuffer(sample_window_size=0)
    buffer.load_checkpoint(tmp_path / "buf")
    assert not isinstance(buffer._view(0).fields[("rewards",)].rows, torch.Tensor)
    draw, batch = buffer.sample_with_draw(3, strategy="topk", k=1)
    assert draw.local_indices.tolist() == [600 + 37] * 3
    assert batch["rewards"].reshape(-1).tolist() == [5.0] * 3
