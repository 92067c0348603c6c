"""Summaries of a column of numbers as the stats report shows them: moments, histogram, counts."""

from __future__ import annotations

from typing import Any

import numpy as np

DEFAULT_BINS = 16


def _is_integral(values: np.ndarray) -> bool:
    return bool(values.size) and bool(np.all(values == np.round(values)))


def summarize(values: np.ndarray, bins: int = DEFAULT_BINS) -> dict[str, Any]:
    """count, mean, std (population), min, max and a histogram of the finite values.

    Integer-valued data whose range fits in `bins` gets one bin per integer, so an episode
    length histogram reads length by length. Non-finite values are only counted.
    """
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    finite = values[np.isfinite(values)]
    doc: dict[str, Any] = {
        "count": int(finite.size),
        "nonfinite": int(values.size - finite.size),
        "mean": None,
        "std": None,
        "min": None,
        "max": None,
        "histogram": {"edges": [], "counts": []},
    }
    if finite.size == 0:
        return doc
    lo, hi = float(finite.min()), float(finite.max())
    if _is_integral(finite) and hi - lo + 1 <= bins:
        edges = np.arange(lo - 0.5, hi + 1.0, 1.0)
        counts, edges = np.histogram(finite, bins=edges)
    else:
        counts, edges = np.histogram(finite, bins=bins)
    doc.update(
        mean=float(finite.mean()),
        std=float(finite.std()),
        min=lo,
        max=hi,
        histogram={"edges": edges.tolist(), "counts": counts.tolist()},
    )
    return doc


def value_counts(values: np.ndarray, key: str) -> list[dict[str, Any]]:
    """[{key: value, "samples": n}, ...] in ascending order of value."""
    uniq, counts = np.unique(np.asarray(values), return_counts=True)
    return [{key: float(v), "samples": int(c)} for v, c in zip(uniq.tolist(), counts.tolist(), strict=True)]
