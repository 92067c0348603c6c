"""How draws spread over the window: observed against expected draws per trajectory, concentration."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rbtool.errors import RbtoolError, UsageError

# Concentration rule: more than this share of the draws ...
CONCENTRATION_DRAW_SHARE = 0.5
# ... landing on fewer than this share of the window's samples.
CONCENTRATION_SAMPLE_SHARE = 0.05


@dataclass(frozen=True)
class DrawRequest:
    """Simulate `n` draws from the window with a strategy, as `rbtool sample` would make them."""

    n: int
    strategy: str = "uniform"
    k: int | None = None
    temperature: float = 1.0
    seed: int | None = None  # None: the checkpoint's seed, else DEFAULT_SEED


def _fewest_holding_half(amounts: np.ndarray, total: float) -> int:
    """The fewest items that together hold more than half of `total` (largest first)."""
    if total <= 0 or amounts.size == 0:
        return 0
    cum = np.cumsum(np.sort(amounts)[::-1])
    return int(np.searchsorted(cum, CONCENTRATION_DRAW_SHARE * total, side="right")) + 1


def draws_report(
    window_ids: Sequence[int],
    num_samples: Sequence[int],
    request: DrawRequest,
    seed: int,
    scores: dict[int, np.ndarray] | None = None,
) -> dict[str, Any]:
    """Observed against expected draws per window trajectory, total variation, concentration flag.

    The draws are the samplers' own (rbtool.buffer.sampling, rbtool.buffer.topk), unclamped: the same seed
    gives the same draws as a fresh buffer's first `sample(n)` (before n is clamped to the
    window's samples).
    """
    import torch

    from rbtool.buffer.sampling import draw_uniform
    from rbtool.buffer.topk import RewardIndex, check_strategy, draw_topk, softmax_weights

    check_strategy(request.strategy, request.k, request.temperature)
    if request.n < 1:
        raise UsageError(f"the number of draws must be >= 1, got {request.n}")
    sizes = np.asarray(num_samples, dtype=np.int64)
    total = int(sizes.sum())
    if total == 0:
        raise RbtoolError("the window holds no samples to draw from")
    generator = torch.Generator().manual_seed(seed)
    expected: np.ndarray  # each window trajectory's expected share of the draws
    if request.strategy == "uniform":
        draw = draw_uniform(window_ids, sizes.tolist(), request.n, generator, clamp=False)
        sample_probability = None
        expected = sizes / total
        candidates = total
    else:
        assert request.k is not None
        index = RewardIndex()
        index.add((tid, scores[tid]) for tid in window_ids if scores is not None and tid in scores)
        ranked = index.top_k(request.k, [tid for tid in window_ids if tid in index])
        draw = draw_topk(
            window_ids, sizes.tolist(), ranked, request.n, request.temperature, generator, clamp=False
        )
        # the expected shares, from the same weights the draw used
        sample_probability = softmax_weights(ranked.scores, request.temperature)
        window = np.asarray(window_ids, dtype=np.int64)
        by_id = np.argsort(window, kind="stable")
        cand_pos = by_id[np.searchsorted(window[by_id], ranked.trajectory_ids)]
        expected = np.bincount(cand_pos, weights=sample_probability, minlength=sizes.size)
        candidates = len(ranked)
    global_ids = draw.global_indices.numpy()
    positions = draw.positions.numpy()
    draws = np.bincount(positions, minlength=sizes.size)
    observed = draws / request.n
    per_sample = np.unique(global_ids, return_counts=True)[1]
    threshold = CONCENTRATION_SAMPLE_SHARE * total
    held_obs = _fewest_holding_half(per_sample.astype(np.float64), float(request.n))
    # Uniform: every sample is equally likely, so just over half of them hold half the mass.
    uniform_held = total // 2 + 1
    held_exp = uniform_held if sample_probability is None else _fewest_holding_half(sample_probability, 1.0)
    concentrated = held_exp < threshold or (request.n >= total and held_obs < threshold)
    return {
        "strategy": request.strategy,
        "n": request.n,
        "seed": seed,
        "k": request.k,
        "temperature": request.temperature if request.strategy == "topk" else None,
        "window_samples": total,
        "candidates": candidates,
        "distinct_samples_drawn": int(per_sample.size),
        "trajectories": {
            "id": list(window_ids),
            "draws": draws.tolist(),
            "observed": observed.tolist(),
            "expected": expected.tolist(),
        },
        "total_variation": float(0.5 * np.abs(observed - expected).sum()),
        "concentration": {
            "threshold_samples": threshold,
            "samples_holding_half_of_draws": held_obs,
            "samples_holding_half_of_probability": held_exp,
            "concentrated": bool(concentrated),
        },
    }
