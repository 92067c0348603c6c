"""LeRobot's per-feature statistics (`meta/stats.json` and each episode's `stats/*` columns):
min, max, mean, std, count and quantiles per episode, aggregated over the dataset as LeRobot
aggregates them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np


QUANTILES = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}


def frame_stats(values: np.ndarray, image: bool) -> dict[str, np.ndarray]:
    """LeRobot's per-feature statistics of frames `[n, ...]` (images per channel, in [0, 1])."""
    import numpy as np

    if image:
        # Images: per channel over frames and pixels, subsampled as LeRobot does for speed.
        step = max(1, values.shape[0] // 100)
        sub = values[::step]
        stride = max(1, max(sub.shape[1], sub.shape[2]) // 150)
        sub = sub[:, ::stride, ::stride].astype(np.float64) / 255.0
        data = sub.transpose(3, 0, 1, 2).reshape(sub.shape[3], -1).T
        # Exact min, max, mean and std over every pixel, a few frames at a time (a float copy
        # of a whole episode of camera frames would not fit in memory).
        channels = values.shape[3]
        total = np.zeros(channels)
        squares = np.zeros(channels)
        for start in range(0, values.shape[0], 16):
            block = values[start : start + 16].reshape(-1, channels).astype(np.float64)
            total += block.sum(axis=0)
            squares += (block * block).sum(axis=0)
        count = max(1, values.shape[0] * values.shape[1] * values.shape[2])
        mean = total / count
        out = {
            "min": values.min(axis=(0, 1, 2)) / 255.0,
            "max": values.max(axis=(0, 1, 2)) / 255.0,
            "mean": mean / 255.0,
            "std": np.sqrt(np.maximum(squares / count - mean * mean, 0.0)) / 255.0,
        }
        out.update(_quantiles(data))
        shaped = {k: v.reshape(-1, 1, 1) for k, v in out.items()}
        shaped["count"] = np.array([values.shape[0]])
        return shaped
    data = values.astype(np.float64)
    out = {
        "min": values.min(axis=0),
        "max": values.max(axis=0),
        "mean": data.mean(axis=0),
        "std": data.std(axis=0),
        "count": np.array([values.shape[0]]),
    }
    out.update(_quantiles(data))
    return out


def _quantiles(data: np.ndarray) -> dict[str, np.ndarray]:
    """QUANTILES along axis 0 as numpy's default (linear) method gives them, from one sort.

    One sort for all five (np.quantile partitions once per quantile): an export computes
    them for every feature of every episode.
    """
    import numpy as np

    ordered = np.sort(data, axis=0)
    n = ordered.shape[0]
    out = {}
    for key, q in QUANTILES.items():
        h = (n - 1) * q
        lo = math.floor(h)
        hi = min(lo + 1, n - 1)
        out[key] = ordered[lo] + (h - lo) * (ordered[hi] - ordered[lo])
    return out


def aggregate(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Dataset statistics from per-episode ones (LeRobot's rule: pooled mean and variance,
    count-weighted quantiles)."""
    import numpy as np

    counts = np.array([float(p["count"][0]) for p in parts])
    total = counts.sum()
    weights = counts / total

    def wsum(values: list[np.ndarray]) -> np.ndarray:
        total = np.zeros_like(values[0], dtype=np.float64)
        for w, value in zip(weights, values, strict=True):
            total = total + w * value.astype(np.float64)
        return total

    mean = wsum([p["mean"] for p in parts])
    var = wsum([p["std"].astype(np.float64) ** 2 + (p["mean"] - mean) ** 2 for p in parts])
    out = {
        "min": np.min(np.stack([p["min"] for p in parts]), axis=0),
        "max": np.max(np.stack([p["max"] for p in parts]), axis=0),
        "mean": mean,
        "std": np.sqrt(var),
        "count": np.array([int(total)]),
    }
    for key in QUANTILES:
        out[key] = wsum([p[key] for p in parts])
    return out


def stats_json(stats: dict[str, np.ndarray]) -> dict[str, Any]:
    return {k: v.tolist() for k, v in stats.items()}
