"""The sidecar that makes an export reversible (`meta/rbtool.json` and its tensors in
`meta/rbtool/tensors.parquet`): the rows of tensors with no per-frame place, how a
trajectory's entries are walked, recorded and hashed, and the check of a sidecar read back,
as strict as checkpoint JSON.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from rbtool.errors import CheckpointError
from rbtool.interop.lerobot.extras import require_arrow
from rbtool.interop.lerobot.features import view_names
from rbtool.interop.lerobot.limits import ID_LIMIT, check_index, is_int, relative_parts, within_budget
from rbtool.interop.lerobot.tensors import TRAJECTORY_DTYPES, dtype_name, from_raw, np_dtype, raw_bytes

if TYPE_CHECKING:
    import pyarrow as pa
    import torch

SIDECAR_FILE = "meta/rbtool.json"
SIDECAR_TENSORS = "meta/rbtool/tensors.parquet"
SIDECAR_VERSION = 1


def encode_value(value: Any) -> Any:
    """A scalar field as JSON (non-finite floats tagged: JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    return value


def decode_value(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"float"}:
        return float(value["float"])
    if isinstance(value, list):
        return [decode_value(v) for v in value]
    return value


def trajectory_entries(traj: dict[str, Any]) -> Iterator[tuple[str, tuple[str, ...], Any]]:
    """(kind, path, value) for every entry of a trajectory dict, depth first in dict order."""
    import torch

    def walk(d: dict[str, Any], prefix: tuple[str, ...]) -> Iterator[tuple[str, tuple[str, ...], Any]]:
        for key, value in d.items():
            path = (*prefix, key)
            if isinstance(value, dict):
                yield "dict", path, value
                yield from walk(value, path)
            elif isinstance(value, torch.Tensor):
                yield "tensor", path, value
            else:
                yield "value", path, value

    yield from walk(traj, ())


def trajectory_digest(traj: dict[str, Any]) -> str:
    """A hash of a trajectory's content: every entry's path, dtype, shape and bytes, in order."""
    digest = hashlib.sha256()
    for kind, path, value in trajectory_entries(traj):
        digest.update(orjson.dumps([kind, list(path)]))
        if kind == "tensor":
            digest.update(orjson.dumps([dtype_name(value.dtype), list(value.shape)]))
            digest.update(raw_bytes(value))
        elif kind == "value":
            digest.update(orjson.dumps(encode_value(value)))
    return digest.hexdigest()


_BLOB_FIELDS = (
    ("trajectory_id", "int64"),
    ("node", "int32"),
    ("kind", "string"),
    ("t", "list<int64>"),
    ("b", "list<int64>"),
    ("dtype", "string"),
    ("shape", "list<int64>"),
    ("data", "large_binary"),
)


def blob_schema() -> pa.Schema:
    pa = require_arrow()
    types = {
        "int64": pa.int64(),
        "int32": pa.int32(),
        "string": pa.string(),
        "list<int64>": pa.list_(pa.int64()),
        "large_binary": pa.large_binary(),
    }
    return pa.schema([(name, types[kind]) for name, kind in _BLOB_FIELDS])


def blob_row(
    tid: int, node: int, kind: str, tensor: torch.Tensor, ts: list[int], bs: list[int]
) -> dict[str, Any]:
    return {
        "trajectory_id": tid,
        "node": node,
        "kind": kind,
        "t": ts,
        "b": bs,
        "dtype": dtype_name(tensor.dtype),
        "shape": [int(d) for d in tensor.shape],
        "data": raw_bytes(tensor),
    }


def blob_tensor(row: dict[str, Any], where: str = "") -> torch.Tensor:
    """The tensor a sidecar row holds, once its dtype, shape and size are ones a trajectory file holds."""
    return from_raw(row["data"], row["dtype"], row["shape"], where)


_HEX64 = re.compile(r"[0-9a-f]{64}")
_NODE_KINDS = ("dict", "value", "tensor", "column", "derived")
_ITEMSIZE = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "complex64": 8, "complex128": 16}
_MAX_PATH_DEPTH = 32


def _itemsize(dtype: str) -> int:
    return _ITEMSIZE[dtype] if dtype in _ITEMSIZE else np_dtype(dtype).itemsize


def _json_ints_problem(value: Any) -> str | None:
    """An integer beyond 64 bits anywhere in a decoded value (walked without recursion)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif is_int(item) and not -(1 << 63) <= item < (1 << 64):
            return f"holds the integer {str(item)[:30]}, beyond the 64-bit range"
    return None


def check_sidecar(
    sidecar: dict[str, Any],
    root: Path,
    features: dict[str, dict[str, Any]],
    count_episodes: Callable[[], int],
) -> None:
    """Refuse a sidecar that is not one rbtool export writes, as strictly as checkpoint JSON:
    ids and counters in [0, 2**63), the seed an integer torch takes, the format `pt` or `pkl`,
    entries valid index entries agreeing with the trajectory's [T, B], node paths and shapes
    well formed, every trajectory within the memory budget, episodes and features that exist
    (those of the dataset at `root`: its `features`, and `count_episodes()` episodes)."""
    from rbtool.format import SEED_RANGE, entry_problems

    where = root / SIDECAR_FILE

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: {what}")

    def index_value(value: Any, what: str, limit: int = ID_LIMIT) -> int:
        return check_index(value, what, where, limit)

    def str_path(value: Any, what: str) -> tuple[str, ...]:
        if (
            not isinstance(value, list)
            or not 1 <= len(value) <= _MAX_PATH_DEPTH
            or not all(isinstance(k, str) and k for k in value)
        ):
            raise bad(f"{what} {str(value)[:80]} is not a field path (a list of names)")
        return tuple(value)

    def shape_of(value: Any, what: str) -> list[int]:
        if not isinstance(value, list) or len(value) > _MAX_PATH_DEPTH:
            raise bad(f"{what} {str(value)[:80]} is not a shape")
        return [index_value(d, f"{what} dim", 1 << 31) for d in value]

    def dtype_of(value: Any, what: str) -> str:
        if not isinstance(value, str) or value not in TRAJECTORY_DTYPES:
            raise bad(f"{what} {str(value)[:40]!r} is not a dtype trajectory files hold")
        return value

    why = _json_ints_problem(sidecar)
    if why is not None:
        raise bad(why)
    ckpt, columns, schemas, records = (
        sidecar.get(k) for k in ("checkpoint", "columns", "schemas", "trajectories")
    )
    if not isinstance(ckpt, dict) or not isinstance(columns, dict):
        raise bad("incomplete sidecar (no checkpoint or columns object)")
    if not isinstance(schemas, list) or not isinstance(records, list):
        raise bad("incomplete sidecar (no schemas or trajectories list)")
    tensors = sidecar.get("tensors")
    if tensors is not None:
        relative_parts(root, tensors, "the sidecar's tensors")
    # ---- the checkpoint
    ids = ckpt.get("trajectory_id_list")
    if not isinstance(ids, list):
        raise bad("checkpoint.trajectory_id_list is not a list")
    ids = [index_value(i, "checkpoint.trajectory_id_list holds the id") for i in ids]
    if len(set(ids)) != len(ids):
        raise bad("checkpoint.trajectory_id_list lists an id twice")
    counter = index_value(ckpt.get("trajectory_counter", 0), "checkpoint.trajectory_counter")
    if ids and counter <= max(ids):
        raise bad(f"checkpoint.trajectory_counter {counter} is not past the largest id {max(ids)}")
    seed = ckpt.get("seed")
    if seed is not None and (not is_int(seed) or not SEED_RANGE[0] <= seed < SEED_RANGE[1]):
        raise bad(f"checkpoint.seed {repr(seed)[:40]} is not an integer in [-2**63, 2**64)")
    fmt = ckpt.get("trajectory_format")
    if fmt is not None and fmt not in ("pt", "pkl"):
        raise bad(f"checkpoint.trajectory_format {str(fmt)[:40]!r} is not 'pt' or 'pkl'")
    extra = ckpt.get("extra_metadata")
    if extra is not None and not isinstance(extra, dict):
        raise bad("checkpoint.extra_metadata is not an object")
    # ---- columns and schemas
    for name, column in columns.items():
        if not isinstance(column, dict):
            raise bad(f"column {name!r} is not an object")
        str_path(column.get("path"), f"column {name!r} path")
        views = index_value(column.get("views") or 0, f"column {name!r} views", 1 << 16)
        if not isinstance(column.get("video", False), bool):
            raise bad(f"column {name!r} video is not true or false")
        if not column.get("video"):
            for stored in view_names(name, views):
                if stored not in features:
                    raise bad(f"column {name!r} is stored as feature {stored!r}, which meta/info.json lacks")
    sizes: list[tuple[int, int]] = []  # per schema: (bytes per sample of its per-frame nodes, values)
    for s, nodes in enumerate(schemas):
        if not isinstance(nodes, list):
            raise bad(f"schema {s} is not a list")
        seen: set[tuple[str, ...]] = set()
        dicts: set[tuple[str, ...]] = {()}
        per_sample = values = 0
        for i, node in enumerate(nodes):
            what = f"schema {s} node {i}"
            if not isinstance(node, dict) or node.get("kind") not in _NODE_KINDS:
                raise bad(f"{what} is not an object of a known kind")
            path = str_path(node.get("path"), f"{what} path")
            if path in seen or path[:-1] not in dicts:
                raise bad(f"{what} path {'.'.join(path)} is repeated or not inside a dict node before it")
            seen.add(path)
            kind = node["kind"]
            if kind == "dict":
                dicts.add(path)
            elif kind == "value":
                values += 1
            elif kind in ("column", "derived"):
                dtype = dtype_of(node.get("dtype"), f"{what} dtype")
                shape = shape_of(node.get("shape"), f"{what} shape")
                per_sample += math.prod(shape) * _itemsize(dtype)
                if kind == "column":
                    feature = node.get("feature")
                    if not isinstance(feature, str) or (feature not in columns and feature not in features):
                        raise bad(f"{what} names feature {str(feature)[:80]!r}, which the dataset lacks")
                    index_value(node.get("extra_rows") or 0, f"{what} extra_rows", 1 << 31)
                else:
                    source = str_path(node.get("source"), f"{what} source")
                    if source not in seen or source == path:
                        raise bad(f"{what} is derived from {'.'.join(source)}, not a field before it")
        sizes.append((per_sample, values))
    # ---- trajectories
    episodes = count_episodes()
    mine: set[int] = set()
    for r, record in enumerate(records):
        what = f"trajectory {r}"
        if not isinstance(record, dict):
            raise bad(f"{what} is not an object")
        tid = index_value(record.get("trajectory_id"), f"{what} trajectory_id")
        what = f"trajectory {tid}"
        if tid in mine:
            raise bad(f"trajectory id {tid} is listed twice")
        mine.add(tid)
        t = index_value(record.get("T"), f"{what} T", 1 << 31)
        b = index_value(record.get("B"), f"{what} B", 1 << 31)
        schema = index_value(record.get("schema"), f"{what} schema", len(schemas))
        per_sample, values = sizes[schema]
        within_budget(t * b * per_sample, f"{where}: {what} ({t} x {b} samples)")
        if not isinstance(record.get("values", []), list) or len(record.get("values", [])) != values:
            raise bad(f"{what} has not the {values} values its schema names")
        if not isinstance(record.get("digest"), str) or not _HEX64.fullmatch(record["digest"]):
            raise bad(f"{what} digest is not a sha256")
        span = record.get("episodes", [0, 0])
        if not isinstance(span, list) or len(span) != 2:
            raise bad(f"{what} episodes is not [first, count]")
        first = index_value(span[0], f"{what} first episode")
        count = index_value(span[1], f"{what} episode count")
        if first + count > episodes:
            raise bad(f"{what} names episodes {first}-{first + count - 1}; the dataset has {episodes}")
        entry = record.get("entry")
        found = entry_problems(str(tid), entry)
        if found:
            raise bad(f"{what}: {found[0][1]}")
        assert isinstance(entry, dict)
        if entry["shape"][:2] != [t, b]:
            raise bad(f"{what}: entry shape {entry['shape']} does not start with its [T, B] = [{t}, {b}]")
        if tid >= counter:
            raise bad(f"{what}: id not below checkpoint.trajectory_counter {counter}")
    if [int(r["trajectory_id"]) for r in records] != ids:
        raise bad("the trajectories are not those of checkpoint.trajectory_id_list, in its order")
