"""Diff: what differs between two checkpoints (or rank trees, each read as its merge).

Entries are matched by id. Without `deep`, files in the same format are compared by identity
(a hard link is equal), by their recorded hashes where both sides record one, else by size
and then bytes; files in different formats are counted as unchecked;
with `deep`, by content (every tensor's dtype, shape and values, every plain field), so
a checkpoint and its pt -> pkl -> pt conversion compare equal.
"""

from __future__ import annotations

import filecmp
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rbtool import trajfile
from rbtool.dirs import CheckpointView, open_view
from rbtool.layout import iter_tensors

Progress = Callable[[int], None]

# Metadata a load reports, compared on the merged views.
METADATA_KEYS = ("trajectory_format", "size", "total_samples", "trajectory_counter", "seed")
# Entry keys compared between entries of the same id (uuid only when both record one:
# RLinf's entries have none). file_bytes and sha256 are facts about files, compared as files.
ENTRY_KEYS = ("trajectory_id", "num_samples", "shape", "max_episode_length", "model_weights_id")


@dataclass
class Diff:
    """Differences between A and B; `equal` when there are none."""

    a: CheckpointView
    b: CheckpointView
    deep: bool
    metadata: list[dict[str, Any]] = field(default_factory=list)
    added: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    changed: list[dict[str, Any]] = field(default_factory=list)
    order_changed: bool = False
    unchanged: int = 0
    files_unchecked: int = 0
    schema: dict[str, Any] = field(default_factory=dict)

    @property
    def equal(self) -> bool:
        return not (
            self.metadata
            or self.added
            or self.removed
            or self.changed
            or self.order_changed
            or self.schema.get("added")
            or self.schema.get("removed")
            or self.schema.get("changed")
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "a": str(self.a.path),
            "b": str(self.b.path),
            "equal": self.equal,
            "deep": self.deep,
            "metadata": self.metadata,
            "added": self.added,
            "removed": self.removed,
            "changed": self.changed,
            "order_changed": self.order_changed,
            "unchanged": self.unchanged,
            "files_unchecked": self.files_unchecked,
            "schema": self.schema,
        }


def _metadata(view: CheckpointView) -> dict[str, Any]:
    index = view.index
    return {
        "trajectory_format": index.trajectory_format,
        "size": index.size,
        "total_samples": index.total_samples,
        "trajectory_counter": index.trajectory_counter,
        "seed": index.seed,
    }


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _same_tensor(x: Any, y: Any) -> bool:
    import torch

    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if x.is_floating_point() or x.is_complex():
        return bool(torch.equal(x, y) or torch.allclose(x, y, rtol=0.0, atol=0.0, equal_nan=True))
    return bool(torch.equal(x, y))


def content_difference(x: dict[str, Any], y: dict[str, Any], prefix: str = "") -> str | None:
    """The first field where two trajectory dicts differ (None when they hold the same data)."""
    import torch

    if list(x) != list(y) and set(x) != set(y):
        extra = sorted(set(x) ^ set(y))
        return f"{prefix}{extra[0]}: present on one side only"
    for key in x:
        a, b = x[key], y[key]
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            found = content_difference(a, b, f"{name}.")
            if found:
                return found
        elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if not _same_tensor(a, b):
                if a.dtype != b.dtype:
                    return f"{name}: dtype {a.dtype} vs {b.dtype}"
                if a.shape != b.shape:
                    return f"{name}: shape {list(a.shape)} vs {list(b.shape)}"
                return f"{name}: values differ"
        elif type(a) is not type(b) or a != b:
            return f"{name}: {a!r} vs {b!r}"
    return None


def schema_of(traj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Field path -> dtype and per-sample shape (after [T, B]) of a trajectory's tensors."""
    return {
        ".".join(path): {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape[2:])}
        for path, t in iter_tensors(traj)
    }


def _schema_union(schemas: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {}
    for schema in schemas:
        for name, spec in schema.items():
            merged.setdefault(name, spec)
    return merged


def compare_schemas(a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Fields only in A (removed), only in B (added), and in both with another dtype or shape."""
    return {
        "added": [{"field": k, **b[k]} for k in b if k not in a],
        "removed": [{"field": k, **a[k]} for k in a if k not in b],
        "changed": [{"field": k, "a": a[k], "b": b[k]} for k in a if k in b and a[k] != b[k]],
    }


def diff(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    deep: bool = False,
    strict: bool = True,
    progress: Progress | None = None,
) -> Diff:
    """Compare two checkpoints or rank trees; neither is changed."""
    va, vb = open_view(a, strict=strict), open_view(b, strict=strict)
    result = Diff(va, vb, deep)
    ma, mb = _metadata(va), _metadata(vb)
    result.metadata = [{"key": k, "a": ma[k], "b": mb[k]} for k in METADATA_KEYS if ma[k] != mb[k]]
    ia, ib = va.index, vb.index
    in_a, in_b = set(ia.id_list), set(ib.id_list)
    result.removed = [i for i in ia.id_list if i not in in_b]
    result.added = [i for i in ib.id_list if i not in in_a]
    common = [i for i in ia.id_list if i in in_b]
    result.order_changed = common != [i for i in ib.id_list if i in in_a]
    schemas_a: list[dict[str, dict[str, Any]]] = []
    schemas_b: list[dict[str, dict[str, Any]]] = []
    for tid in common:
        ea, eb = ia.entries[tid], ib.entries[tid]
        keys = [k for k in ENTRY_KEYS if ea.get(k) != eb.get(k)]
        if "uuid" in ea and "uuid" in eb and ea["uuid"] != eb["uuid"]:
            keys.append("uuid")
        fa, fb = va.file_of(tid), vb.file_of(tid)
        file_diff: str | None = None
        detail: str | None = None
        if deep:
            ta, tb = trajfile.load(fa, mmap=True), trajfile.load(fb, mmap=True)
            schemas_a.append(schema_of(ta))
            schemas_b.append(schema_of(tb))
            detail = content_difference(ta, tb)
            file_diff = "content" if detail else None
        elif fa.suffix != fb.suffix:
            result.files_unchecked += 1
        elif _same_file(fa, fb):
            pass  # one file under two names (a link): nothing to read
        elif ea.get("sha256") and eb.get("sha256"):
            if ea["sha256"] != eb["sha256"]:
                file_diff = "sha256"
        elif _size(fa) != _size(fb):
            file_diff = "file_bytes"
            detail = f"{_size(fa)} vs {_size(fb)} bytes"
        elif not filecmp.cmp(fa, fb, shallow=False):  # no hash to trust: compare the bytes
            file_diff = "bytes"
        if keys or file_diff:
            result.changed.append({"trajectory_id": tid, "fields": keys, "file": file_diff, "detail": detail})
        else:
            result.unchanged += 1
        if progress is not None:
            progress(1)
    if deep:
        schemas_a += [schema_of(trajfile.load(va.file_of(i), mmap=True)) for i in result.removed]
        schemas_b += [schema_of(trajfile.load(vb.file_of(i), mmap=True)) for i in result.added]
        compared = "every trajectory"
    else:
        schemas_a = [schema_of(trajfile.load(va.file_of(ia.id_list[0]), mmap=True))] if ia.id_list else []
        schemas_b = [schema_of(trajfile.load(vb.file_of(ib.id_list[0]), mmap=True))] if ib.id_list else []
        compared = "first trajectory"
    result.schema = {
        "compared": compared,
        **compare_schemas(_schema_union(schemas_a), _schema_union(schemas_b)),
    }
    return result


__all__ = [
    "ENTRY_KEYS",
    "METADATA_KEYS",
    "Diff",
    "compare_schemas",
    "content_difference",
    "diff",
    "schema_of",
]
