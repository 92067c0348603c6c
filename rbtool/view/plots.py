"""Small plots as PNG bytes: a trajectory's rewards, done flags and actions over t, and the
checkpoint-wide plots of a report (returns, histograms, policy versions, draw spread).

matplotlib draws them on its Agg backend, in memory: no display, no fonts or files fetched.
Every function returns the PNG's bytes; the figure is closed before it returns, so a long
run (a report, a server) does not collect figures.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from rbtool.view.extras import require_pyplot
from rbtool.view.frames import Series

DPI = 100
ACTION_COLUMNS = 4  # action dimensions per row of small plots
COLOR = "#3b6ea5"
SECOND = "#d9822b"


def _png(fig: Any, fit: bool = False) -> bytes:
    plt = require_pyplot()
    if fit:
        fig.subplots_adjust(left=0.13, right=0.97, top=0.9, bottom=0.2)
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=DPI, metadata={"Software": None})
    finally:
        plt.close(fig)
    return buffer.getvalue()


def _style(ax: Any, title: str, integer_x: bool = True, integer_y: bool = False) -> None:
    from matplotlib.ticker import MaxNLocator

    if integer_x:  # steps, ids and counts: no tick between two of them
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if integer_y:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title, fontsize=9, loc="left")
    ax.tick_params(labelsize=7)
    ax.grid(True, linewidth=0.4, alpha=0.5)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def series_plot(series: Series, width_px: int) -> bytes | None:
    """Rewards, done flags and each action dimension of one env column over t, `width_px` wide;
    None when the trajectory has none of them."""
    panels: list[tuple[str, list[float], str]] = []
    if series.rewards is not None:
        panels.append(("reward", series.rewards, "line"))
    if series.dones is not None:
        panels.append(("done", [float(d) for d in series.dones], "step"))
    wide = len(panels)
    if series.actions is not None and series.actions:
        dims = len(series.actions[0])
        panels += [(f"action[{d}]", [row[d] for row in series.actions], "line") for d in range(dims)]
    if not panels:
        return None
    plt = require_pyplot()
    action_rows = -(-(len(panels) - wide) // ACTION_COLUMNS)
    rows = wide + action_rows
    width = max(width_px, 320) / DPI
    height = 1.35 * rows
    fig = plt.figure(figsize=(width, height))
    # fixed margins in inches: a constrained layout costs about a second per figure
    grid = fig.add_gridspec(
        rows,
        ACTION_COLUMNS,
        left=0.45 / width,
        right=1 - 0.15 / width,
        top=1 - 0.3 / height,
        bottom=0.3 / height,
        hspace=0.75,
        wspace=0.35,
    )
    steps = list(range(series.steps))
    for n, (title, values, kind) in enumerate(panels):
        if n < wide:
            ax = fig.add_subplot(grid[n, :])
        else:
            k = n - wide
            ax = fig.add_subplot(grid[wide + k // ACTION_COLUMNS, k % ACTION_COLUMNS])
        if kind == "step":
            ax.bar(steps, values, width=0.6 if len(steps) <= 100 else 1.0, color=SECOND)
            ax.set_ylim(-0.15, 1.15)
            ax.set_yticks([0, 1])
        else:
            ax.plot(steps, values, color=COLOR, linewidth=1, marker="." if len(steps) <= 40 else None)
        for end in series.episode_ends:
            ax.axvline(end, color=SECOND, linewidth=0.6, alpha=0.4)
        _style(ax, title)
    return _png(fig, fit=True)


def line_plot(xs: Sequence[float], ys: Sequence[float], title: str, xlabel: str, ylabel: str) -> bytes:
    """One line over `xs` (markers when there are few points)."""
    plt = require_pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 2.6))
    ax.plot(list(xs), list(ys), color=COLOR, linewidth=1, marker="o" if len(xs) <= 60 else None, markersize=3)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    _style(ax, title)
    return _png(fig, fit=True)


def histogram_plot(edges: Sequence[float], counts: Sequence[int], title: str, xlabel: str) -> bytes:
    """A histogram from its bin edges and counts (as the stats document holds them)."""
    plt = require_pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 2.6))
    widths = [edges[i + 1] - edges[i] for i in range(len(counts))]
    ax.bar(list(edges[:-1]), list(counts), width=widths, align="edge", color=COLOR, edgecolor="white")
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel("count", fontsize=8)
    _style(ax, title, integer_x=False, integer_y=True)
    return _png(fig, fit=True)


def bar_plot(labels: Sequence[str], values: Sequence[float], title: str, xlabel: str, ylabel: str) -> bytes:
    """Bars, one per label."""
    plt = require_pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 2.6))
    ax.bar(range(len(values)), list(values), color=COLOR)
    step = max(1, len(labels) // 12)
    ax.set_xticks(range(0, len(labels), step), [labels[i] for i in range(0, len(labels), step)])
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    _style(ax, title, integer_x=False, integer_y=True)  # the ticks are the labels set above
    return _png(fig, fit=True)


def spread_plot(ids: Sequence[int], observed: Sequence[float], expected: Sequence[float]) -> bytes:
    """Observed against expected shares of draws per trajectory of the window."""
    plt = require_pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 2.6))
    positions = list(range(len(ids)))
    ax.bar(positions, list(observed), color=COLOR, label="observed")
    ax.plot(positions, list(expected), color=SECOND, linewidth=1.2, label="expected")
    step = max(1, len(ids) // 12)
    ax.set_xticks(positions[::step], [str(ids[i]) for i in positions[::step]])
    ax.set_xlabel("trajectory id (window)", fontsize=8)
    ax.set_ylabel("share of draws", fontsize=8)
    ax.legend(fontsize=7, frameon=False, loc="lower right", bbox_to_anchor=(1, 1), ncols=2)
    _style(ax, "draw spread", integer_x=False)
    return _png(fig, fit=True)
