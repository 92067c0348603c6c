"""Rank directories' names: `rank_<r>`, built and read here only.

A name is a rank's when it is `rank_` and ASCII digits whose value fits an int64 (leading
zeros allowed, as for trajectory ids); anything else (`rank_x`, `rank_-1`, `rank_٣`) is not a
rank directory, wherever it is met: a local tree, an object listing, a journal's file paths.
"""

from __future__ import annotations

from pathlib import PurePath

PREFIX = "rank_"
_INT64_DIGITS = 19


def rank_dir_name(rank: int) -> str:
    """The directory name of rank `rank`."""
    return f"{PREFIX}{rank}"


def rank_number(name: str) -> int | None:
    """r for a directory named `rank_<r>`, else None."""
    digits = name[len(PREFIX) :]
    if not (name.startswith(PREFIX) and digits.isascii() and digits.isdigit()):
        return None
    if len(digits.lstrip("0")) > _INT64_DIGITS:
        return None
    number = int(digits)
    return number if number < 1 << 63 else None  # beyond int64: no rank (as a file id would be)


def is_rank_name(name: str) -> bool:
    """True if `name` is a rank directory's name."""
    return rank_number(name) is not None


def home_rank(path: PurePath) -> int | None:
    """The rank whose directory holds `path` (the nearest `rank_<r>` parent), or None."""
    for parent in path.parents:
        number = rank_number(parent.name)
        if number is not None:
            return number
    return None
