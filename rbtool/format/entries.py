"""The rules on one index entry: `entry_problems`, the final word with the exact messages, and
the column-wise checks of all entries at once, a fast path that accepts only what it accepts."""

from __future__ import annotations

from itertools import chain, compress
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any

from rbtool.format.bounded import ABSENT, JSON_INT_RANGE
from rbtool.format.names import weights_id_problem
from rbtool.format.problems import shown
from rbtool.format.schema import DIM_LIMIT, ENTRY_KEYS, INT64_LIMIT, OPTIONAL_ENTRY_KEYS, is_count, is_id_text

if TYPE_CHECKING:
    import numpy as np


def entry_problems(key: str, entry: Any) -> list[tuple[str, str]]:
    """Every rule one index entry breaks, as (code, message): the final word on an entry.

    The column checks below are a fast path: they accept only entries this accepts.
    """
    where = f"entry {shown(key)}"
    if not is_id_text(key):
        return [("entry_invalid", f"entry key {shown(key)} is not a canonical non-negative integer id")]
    tid = int(key)
    where = f"entry {tid}"
    if not isinstance(entry, dict):
        return [("entry_invalid", f"{where} is not an object")]
    found = [("entry_invalid", f"{where} lacks {name!r}") for name in ENTRY_KEYS if name not in entry]
    if found:
        return found
    if entry["trajectory_id"] != tid or type(entry["trajectory_id"]) is not int:
        found.append(
            ("entry_invalid", f"{where} has trajectory_id {shown(entry['trajectory_id'])}, expected {tid}")
        )
    shape = entry["shape"]
    shape_ok = (
        type(shape) is list and len(shape) >= 2 and all(type(d) is int and 0 <= d < DIM_LIMIT for d in shape)
    )
    if not shape_ok:
        found.append(("entry_invalid", f"{where} has an invalid shape {shown(shape)} (a list of >= 2 dims)"))
    num = entry["num_samples"]
    if not is_count(num):
        found.append(("entry_invalid", f"{where} has an invalid num_samples {shown(num)}"))
    elif shape_ok and num != shape[0] * shape[1]:
        found.append(
            (
                "num_samples_mismatch",
                f"{where} has num_samples {num} but shape {shape} gives {shape[0] * shape[1]}",
            )
        )
    mel = entry["max_episode_length"]
    if mel is not None and not is_count(mel):
        found.append(("entry_invalid", f"{where} has an invalid max_episode_length {shown(mel)}"))
    why = weights_id_problem(entry["model_weights_id"])
    if why is not None:
        found.append(("entry_invalid", f"{where}: {why}"))
    if entry.get("uuid") is not None and type(entry["uuid"]) is not str:
        found.append(("entry_invalid", f"{where} has a uuid that is not a string: {shown(entry['uuid'])}"))
    if entry.get("file_bytes") is not None and not is_count(entry["file_bytes"]):
        found.append(("entry_invalid", f"{where} has an invalid file_bytes {shown(entry['file_bytes'])}"))
    for key in ("sha256", "source_sha256"):
        if entry.get(key) is not None and type(entry[key]) is not str:
            found.append(("entry_invalid", f"{where} has a {key} that is not a string: {shown(entry[key])}"))
    if entry.get("link") is not None and not _is_link(entry["link"]):
        found.append(("entry_invalid", f"{where} has an invalid link {shown(entry['link'])}"))
    if entry.get("schema") is not None and type(entry["schema"]) is not str:
        found.append(
            ("entry_invalid", f"{where} has a schema that is not a string: {shown(entry['schema'])}")
        )
    return found


def _is_link(value: Any) -> bool:
    """A recorded link identity: an object of integers (inode, size, mtime_ns)."""
    lo, hi = JSON_INT_RANGE
    return type(value) is dict and all(
        type(k) is str and type(v) is int and lo <= v < hi for k, v in value.items()
    )


def normalize_entry(entry: dict[str, Any]) -> dict[str, Any]:
    """A valid entry as loaders hold it: known keys only, optional keys only when set."""
    out = {name: entry[name] for name in ENTRY_KEYS}
    for name in OPTIONAL_ENTRY_KEYS:
        if entry.get(name) is not None:
            out[name] = entry[name]
    return out


# ------------------------------------------------------------------ columns
def int_column(values: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """(int64 values, mask of plain ints in [0, 2**63)); invalid values become 0."""
    import numpy as np

    n = len(values)
    if n and set(map(type, values)) == {int}:
        try:
            arr = np.array(values, dtype=np.int64)
        except OverflowError:
            pass
        else:
            return arr, arr >= 0
    ok = np.fromiter((is_count(v) for v in values), dtype=bool, count=n)
    arr = np.fromiter((v if good else 0 for v, good in zip(values, ok, strict=True)), dtype=np.int64, count=n)
    return arr, ok


def _optional_count_mask(values: list[Any]) -> np.ndarray:
    """Mask of values that are None or a plain int in [0, 2**63)."""
    import numpy as np

    n = len(values)
    present = [v for v in values if v is not None]
    if not present:
        return np.ones(n, dtype=bool)
    if set(map(type, present)) == {int} and min(present) >= 0 and max(present) < INT64_LIMIT:
        return np.ones(n, dtype=bool)
    return np.fromiter((v is None or is_count(v) for v in values), dtype=bool, count=n)


def _shape_columns(shapes: list[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(T, B, mask of shapes that are lists of >= 2 ints in [0, 2**31))."""
    import numpy as np

    n = len(shapes)
    if set(map(type, shapes)) <= {list}:
        lens = np.fromiter(map(len, shapes), dtype=np.int64, count=n)
    else:
        lens = np.fromiter((len(s) if type(s) is list else 0 for s in shapes), dtype=np.int64, count=n)
    t = np.zeros(n, dtype=np.int64)
    b = np.zeros(n, dtype=np.int64)
    ok = lens >= 2
    if n and ok.all() and lens.min() == lens.max():
        k = int(lens[0])
        flat = list(chain.from_iterable(shapes))
        if set(map(type, flat)) == {int}:
            try:
                dims = np.array(flat, dtype=np.int64).reshape(-1, k)
            except OverflowError:
                pass
            else:
                in_range = np.asarray(((dims >= 0) & (dims < DIM_LIMIT)).all(axis=1))
                return dims[:, 0].copy(), dims[:, 1].copy(), in_range
    where = np.flatnonzero(ok)
    if where.size:
        chosen = shapes if where.size == n else list(compress(shapes, ok))
        flat_values, flat_ok = int_column(list(chain.from_iterable(chosen)))
        flat_ok &= flat_values < DIM_LIMIT
        seg = lens[where]
        starts = np.concatenate(([0], np.cumsum(seg)[:-1]))
        ok[where] = np.logical_and.reduceat(flat_ok, starts)
        t[where] = flat_values[starts]
        b[where] = flat_values[starts + 1]
    return t, b, ok


def weights_id_mask(values: list[Any]) -> np.ndarray:
    """Mask of file-name-safe model_weights_id strings (each distinct value checked once)."""
    import numpy as np

    n = len(values)
    all_str = set(map(type, values)) <= {str}
    is_str = np.ones(n, dtype=bool) if all_str else np.fromiter((type(v) is str for v in values), bool, n)
    bad = {v for v in set(values if all_str else compress(values, is_str)) if weights_id_problem(v)}
    if bad:
        is_str &= np.fromiter((v not in bad if type(v) is str else False for v in values), bool, n)
    return is_str


def _optional_str_mask(values: list[Any]) -> np.ndarray:
    """Mask of values that are None or a string."""
    import numpy as np

    n = len(values)
    if set(map(type, values)) <= {str, type(None)}:
        return np.ones(n, dtype=bool)
    return np.fromiter((v is None or type(v) is str for v in values), dtype=bool, count=n)


def _key_column(keys: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask of canonical non-negative decimal keys below 2**63)."""
    import numpy as np

    try:
        as_ints = list(map(int, keys))
        if list(map(str, as_ints)) == keys:
            return int_column(as_ints)
    except ValueError:
        pass
    ok = np.fromiter(map(is_id_text, keys), dtype=bool, count=len(keys))
    ids = np.fromiter((int(k) if good else -1 for k, good in zip(keys, ok, strict=True)), np.int64, len(keys))
    return ids, ok


def _column(rows: list[Any], name: str, default: Any = ABSENT) -> list[Any]:
    """The value of `name` in every row; `default` where a row lacks it or is not an object.

    Rows are dicts, or the decoders' structs (absent keys UNSET, or None for optional keys).
    """
    import msgspec

    kinds = set(map(type, rows))
    if len(kinds) == 1 and issubclass(next(iter(kinds)), msgspec.Struct):
        values = list(map(attrgetter(name), rows))
        if values.count(msgspec.UNSET):
            values = [default if v is msgspec.UNSET else v for v in values]
        return values
    if kinds <= {dict}:
        try:
            return list(map(itemgetter(name), rows))
        except KeyError:
            pass
    return [
        plain(row).get(name, default) if isinstance(row, (dict, msgspec.Struct)) else default for row in rows
    ]


def plain(row: Any) -> Any:
    """A row as entry_problems reads it: structs become dicts of the keys they hold."""
    import msgspec

    if not isinstance(row, msgspec.Struct):
        return row
    unset = msgspec.UNSET
    return {n: v for n in row.__struct_fields__ if (v := getattr(row, n)) is not unset}


def entry_mask(keys: list[str], values: list[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Column-wise check of every entry: (ids, num_samples, mask of entries that pass).

    Conservative: an entry the mask rejects is re-checked with entry_problems, which has the
    last word and the exact message.
    """
    import numpy as np

    rows = values
    ids, ok = _key_column(keys)
    tids, tid_ok = int_column(_column(rows, "trajectory_id"))
    ok &= tid_ok & (tids == ids)
    t, b, shape_ok = _shape_columns(_column(rows, "shape"))
    nums, num_ok = int_column(_column(rows, "num_samples"))
    ok &= shape_ok & num_ok & (nums == t * b)
    ok &= _optional_count_mask(_column(rows, "max_episode_length"))
    ok &= weights_id_mask(_column(rows, "model_weights_id"))
    ok &= _optional_str_mask(_column(rows, "uuid", None))
    ok &= _optional_count_mask(_column(rows, "file_bytes", None))
    ok &= _optional_str_mask(_column(rows, "sha256", None))
    ok &= _optional_str_mask(_column(rows, "source_sha256", None))
    ok &= _optional_str_mask(_column(rows, "schema", None))
    links = _column(rows, "link", None)
    if any(v is not None for v in links):
        ok &= np.fromiter((v is None or _is_link(v) for v in links), dtype=bool, count=len(links))
    return ids, nums, ok
