"""Diff: what differs between two checkpoints (or rank trees, each read as its merge).

Entries are matched by id. Every file's size on disk is compared with the other side's
(files in the same format) and with the `file_bytes` its own entry records. Without `deep`,
files in the same format are then compared by identity (a hard link is equal), by their
recorded hashes where both sides record one (the bytes are not read: counted as
`contents_not_compared`), else by their bytes (hashed on the way where one side records a
hash); files in different formats are counted as unchecked, and A and B are then not called
equal. With `deep`, by content (every tensor's dtype, shape and values, every plain field),
each recorded hash checked against the bytes read, so a checkpoint and its pt -> pkl -> pt
conversion compare equal. The file format, the number of rank directories and the bytes
that encode the same content are layout: reported, never a difference.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rbtool.files import trajfile
from rbtool.files.dirs import CheckpointView, open_view
from rbtool.format.layout import iter_tensors
from rbtool.progress import Progress

# Metadata a load reports, compared on the merged views.
METADATA_KEYS = ("size", "total_samples", "trajectory_counter", "seed")
# How the data is stored: reported under `layout`, never a difference.
LAYOUT_KEYS = ("trajectory_format", "rank_directories")
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
    contents_not_compared: int = 0
    layout: list[dict[str, Any]] = field(default_factory=list)
    schema: dict[str, Any] = field(default_factory=dict)

    @property
    def different(self) -> bool:
        """True when a difference was found (files left unchecked are no difference)."""
        return bool(
            self.metadata
            or self.added
            or self.removed
            or self.changed
            or self.order_changed
            or self.schema.get("added")
            or self.schema.get("removed")
            or self.schema.get("changed")
        )

    @property
    def equal(self) -> bool:
        """No difference found and every file compared (by content, bytes, or recorded hash and size)."""
        return not self.different and not self.files_unchecked

    @property
    def verdict(self) -> str:
        """`equal`, `different`, or `unchecked` (nothing differs, but files in other formats were
        not compared)."""
        return "different" if self.different else "unchecked" if self.files_unchecked else "equal"

    def as_json(self) -> dict[str, Any]:
        return {
            "a": str(self.a.path),
            "b": str(self.b.path),
            "equal": self.equal,
            "verdict": self.verdict,
            "deep": self.deep,
            "metadata": self.metadata,
            "added": self.added,
            "removed": self.removed,
            "changed": self.changed,
            "order_changed": self.order_changed,
            "unchanged": self.unchanged,
            "files_unchecked": self.files_unchecked,
            "contents_not_compared": self.contents_not_compared,
            "layout": self.layout,
            "schema": self.schema,
        }


def _metadata(view: CheckpointView) -> dict[str, Any]:
    index = view.index
    return {
        "trajectory_format": index.trajectory_format,
        "rank_directories": len(view.dirs) if view.is_tree else None,
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


def _read_compare(fa: Path, fb: Path) -> tuple[bool, str, str]:
    """Read both files once: (same bytes, sha256 of A, sha256 of B)."""
    ha, hb = hashlib.sha256(), hashlib.sha256()
    same = True
    with open(fa, "rb") as xa, open(fb, "rb") as xb:
        while True:
            block_a, block_b = xa.read(1 << 20), xb.read(1 << 20)
            if not block_a and not block_b:
                break
            same = same and block_a == block_b
            ha.update(block_a)
            hb.update(block_b)
    return same, ha.hexdigest(), hb.hexdigest()


def _recorded_size_problems(
    ea: dict[str, Any], eb: dict[str, Any], sa: int | None, sb: int | None
) -> list[str]:
    """`A records file_bytes N, M on disk` for each side whose recorded size disagrees with its file."""
    return _record_problems("file_bytes", int, ea, eb, sa, sb, "{side} records file_bytes {r}, {a} on disk")


def _hash_problems(ea: dict[str, Any], eb: dict[str, Any], ha: str | None, hb: str | None) -> list[str]:
    """`B's recorded sha256 ... is not its file's ...` for each side whose recorded hash disagrees."""
    shown = "{side} records sha256 {r:.12}..., its file has {a:.12}..."
    return _record_problems("sha256", str, ea, eb, ha, hb, shown)


def _record_problems(
    key: str, kind: type, ea: dict[str, Any], eb: dict[str, Any], a: Any, b: Any, shown: str
) -> list[str]:
    """`shown` for each side whose entry records `key` (of type `kind`) other than its file's value."""
    found = []
    for side, entry, actual in (("A", ea, a), ("B", eb, b)):
        recorded = entry.get(key)
        if isinstance(recorded, kind) and actual is not None and recorded != actual:
            found.append(shown.format(side=side, r=recorded, a=actual))
    return found


def _load(path: Path, want_hash: bool) -> tuple[dict[str, Any] | None, str | None, str | None]:
    """(the trajectory or None, the sha256 of its bytes when asked, why it could not be read)."""
    from rbtool.errors import RbtoolError

    try:
        if want_hash:
            data = trajfile.read_file_bytes(path)
            return trajfile.load_bytes(data, path), trajfile.sha256_bytes(data), None
        return trajfile.load(path, mmap=True), None, None
    except RbtoolError as exc:
        return None, None, " ".join(str(exc).split())


def _first_schema(view: CheckpointView, ids: list[int]) -> dict[str, dict[str, Any]] | None:
    """The schema of the first listed trajectory (None when its file cannot be read)."""
    if not ids:
        return {}
    traj, _, why = _load(view.file_of(ids[0]), False)
    return None if why is not None or traj is None else schema_of(traj)


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
    result.layout = [{"key": k, "a": ma[k], "b": mb[k]} for k in LAYOUT_KEYS if ma[k] != mb[k]]
    ia, ib = va.index, vb.index
    in_a, in_b = set(ia.id_list), set(ib.id_list)
    result.removed = [i for i in ia.id_list if i not in in_b]
    result.added = [i for i in ib.id_list if i not in in_a]
    common = [i for i in ia.id_list if i in in_b]
    result.order_changed = common != [i for i in ib.id_list if i in in_a]
    schemas_a: list[dict[str, dict[str, Any]]] = []
    schemas_b: list[dict[str, dict[str, Any]]] = []
    other_bytes = 0  # deep: files in the same format, same content, other bytes (layout)
    for tid in common:
        ea, eb = ia.entries[tid], ib.entries[tid]
        keys = [k for k in ENTRY_KEYS if ea.get(k) != eb.get(k)]
        if "uuid" in ea and "uuid" in eb and ea["uuid"] != eb["uuid"]:
            keys.append("uuid")
        fa, fb = va.file_of(tid), vb.file_of(tid)
        sa, sb = _size(fa), _size(fb)
        same_format = fa.suffix == fb.suffix
        file_diff: str | None = None
        details = _recorded_size_problems(ea, eb, sa, sb)  # a record that disagrees with its file
        if details:
            file_diff = "file_bytes"
        if deep:
            ta, ha, why_a = _load(fa, isinstance(ea.get("sha256"), str))
            tb, hb, why_b = _load(fb, isinstance(eb.get("sha256"), str))
            hashes = _hash_problems(ea, eb, ha, hb)
            if why_a or why_b:
                file_diff = "unreadable"
                details = [f"A: {why_a}" if why_a else f"B: {why_b}", *details]
            elif hashes:
                file_diff = "sha256"
                details += hashes
            else:
                assert ta is not None and tb is not None
                schemas_a.append(schema_of(ta))
                schemas_b.append(schema_of(tb))
                found = content_difference(ta, tb)
                if found:
                    file_diff = file_diff or "content"
                    details.insert(0, found)
                elif same_format and sa != sb and not file_diff:
                    other_bytes += 1
        elif not same_format:
            result.files_unchecked += 1
        elif sa != sb:
            file_diff = "file_bytes"
            details.insert(0, f"{sa} vs {sb} bytes")
        elif file_diff or _same_file(fa, fb):
            pass  # a record that disagrees with the file, or one file under two names: nothing to read
        elif isinstance(ea.get("sha256"), str) and isinstance(eb.get("sha256"), str):
            if ea["sha256"] != eb["sha256"]:
                file_diff = "sha256"
            else:
                result.contents_not_compared += 1  # equal recorded hashes, sizes checked, bytes not read
        else:  # no pair of hashes to trust: compare the bytes (and the one recorded hash)
            same, ha, hb = _read_compare(fa, fb)
            hashes = _hash_problems(ea, eb, ha, hb)
            if hashes:
                file_diff = "sha256"
                details += hashes
            elif not same:
                file_diff = "bytes"
        if keys or file_diff:
            result.changed.append(
                {
                    "trajectory_id": tid,
                    "fields": keys,
                    "file": file_diff,
                    "detail": "; ".join(details) or None,
                }
            )
        else:
            result.unchanged += 1
        if progress is not None:
            progress(1)
    if other_bytes:
        result.layout.append({"key": "file_bytes", "a": None, "b": None, "files": other_bytes})
    schema_a: dict[str, dict[str, Any]] | None
    schema_b: dict[str, dict[str, Any]] | None
    if deep:
        for view, ids, schemas in ((va, result.removed, schemas_a), (vb, result.added, schemas_b)):
            for i in ids:
                traj, _, _why = _load(view.file_of(i), False)
                if traj is not None:
                    schemas.append(schema_of(traj))
        compared = "every trajectory"
        schema_a, schema_b = _schema_union(schemas_a), _schema_union(schemas_b)
    else:
        compared = "first trajectory"
        schema_a, schema_b = _first_schema(va, ia.id_list), _first_schema(vb, ib.id_list)
    if schema_a is None or schema_b is None:
        side = "A" if schema_a is None else "B"
        result.schema = {
            "compared": f"none ({side}'s first trajectory file cannot be read)",
            "added": [],
            "removed": [],
            "changed": [],
        }
        tid = (ia if side == "A" else ib).id_list[0]
        if not any(c["trajectory_id"] == tid for c in result.changed) and tid in in_a and tid in in_b:
            result.unchanged -= 1
            result.changed.append(
                {
                    "trajectory_id": tid,
                    "fields": [],
                    "file": "unreadable",
                    "detail": f"{side}'s file cannot be read",
                }
            )
    else:
        result.schema = {"compared": compared, **compare_schemas(schema_a, schema_b)}
    return result


__all__ = [
    "ENTRY_KEYS",
    "LAYOUT_KEYS",
    "METADATA_KEYS",
    "Diff",
    "compare_schemas",
    "content_difference",
    "diff",
    "schema_of",
]
