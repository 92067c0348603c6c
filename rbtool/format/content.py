"""The rules on what a trajectory file holds once loaded, for both of its readers.

rbtool.files.trajfile checks what torch's loader or the restricted unpickler returned,
rbtool.files.ptheader the structure it read from a `.pt` header; both apply these rules:
string keys, nesting at most MAX_DEPTH deep, no cycles, ints in int64, no values beyond
tensors, strings, floats, bools, None, dicts, lists and tuples, and tensor views that lie
inside their storage with no stride-0 or overlapping dims. No torch import: what a tensor
is, and the rest of its checks, are the reader's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from rbtool.errors import TrajectoryFileError
from rbtool.format.schema import INT64_LIMIT

MAX_DEPTH = 32  # nesting of dicts (and lists) in a trajectory
INT64_RANGE = (-INT64_LIMIT, INT64_LIMIT)


def checked_content(
    value: Any, name: str, is_tensor: Callable[[Any], bool], tensor: Callable[[str, Any], Any]
) -> Any:
    """`value` with its dicts copied, its lists and tuples copied as lists, and each item
    `is_tensor` takes replaced by `tensor(where, item)`: everything else checked on the way.

    Raises TrajectoryFileError (one line, naming `name` and the field) for non-string keys,
    nesting deeper than MAX_DEPTH, cycles, ints outside int64 and values of other types;
    `tensor` raises for a tensor it refuses.
    """

    def walk(item: Any, path: str, depth: int, ancestors: frozenset[int]) -> Any:
        where = f"{name}: field {path!r}" if path else name
        if type(item) in (str, float, bool) or item is None:
            return item
        if type(item) is int:
            if not INT64_RANGE[0] <= item < INT64_RANGE[1]:
                raise TrajectoryFileError(f"{where} holds an integer outside int64")
            return item
        if is_tensor(item):  # after the plain values, which no reader's tensor is
            return tensor(where, item)
        if not isinstance(item, (dict, list, tuple)):
            raise TrajectoryFileError(f"{where} holds a {type(item).__name__}")
        if id(item) in ancestors:
            raise TrajectoryFileError(f"{where} contains itself (a cycle)")
        if depth >= MAX_DEPTH:
            raise TrajectoryFileError(f"{where} nests deeper than {MAX_DEPTH} levels")
        inner = ancestors | {id(item)}
        if isinstance(item, dict):
            out: dict[str, Any] = {}
            for key, sub in item.items():
                if type(key) is not str:
                    raise TrajectoryFileError(f"{where} has a key that is not a string: {key!r:.60}")
                out[key] = walk(sub, f"{path}.{key}" if path else key, depth + 1, inner)
            return out
        return [walk(sub, f"{path}[{i}]", depth + 1, inner) for i, sub in enumerate(item)]

    return walk(value, "", 0, frozenset())


def view_elements(offset: int, size: Sequence[int], stride: Sequence[int]) -> int:
    """How many storage elements a non-empty view reaches: up to and including its last one."""
    return offset + 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True))


def view_problem(size: Sequence[int], stride: Sequence[int], offset: int, held: int) -> str | None:
    """Why a view of a storage of `held` elements must not be used, or None.

    Its sizes, strides and offset are non-negative (the caller's check, worded its own way).
    """
    if math.prod(size) == 0:
        return None
    needed = view_elements(offset, size, stride)
    if needed > held:
        return f"views {needed} elements but its storage holds {held}"
    extent = 1  # dims ordered by stride: each must step past everything the smaller ones cover
    for s, n in sorted((s, n) for n, s in zip(size, stride, strict=True) if n > 1):
        if s < extent:
            return "has a stride-0 or overlapping dim (an expanded view)"
        extent = s * n
    return None
