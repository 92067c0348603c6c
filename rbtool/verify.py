"""Check a checkpoint or buffer directory and report every problem found, not just the first.

The quick check reads only the two JSON files and the directory listing (no torch, vectorised
with numpy so a million-entry index stays fast); `deep=True` also loads every listed
trajectory file safely and checks its tensors against the index.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import chain, compress, repeat
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from rbtool.checkpoint import MERGE_MAP_FILE
from rbtool.dirs import checkpoint_dirs
from rbtool.errors import CheckpointError, RbtoolError, UnsafePickleError
from rbtool.index import (
    ENTRY_KEYS,
    FORMATS,
    INDEX_FILE,
    LEGACY_INDEX_FILE,
    METADATA_FILE,
    check_weights_id,
    gc_paused,
    parse_entry,
    parse_metadata,
    parse_trajectory_file_name,
    trajectory_file_name,
)

Progress = Callable[[int], None]

ERROR, WARNING, NOTICE = "error", "warning", "notice"
SEVERITIES = (ERROR, WARNING, NOTICE)

# Every problem verify can report: code -> (severity, what it means). docs/cli_parts/verify.md
# documents the same table.
PROBLEM_CODES: dict[str, tuple[str, str]] = {
    "metadata_missing": (ERROR, "metadata.json does not exist"),
    "metadata_unreadable": (ERROR, "metadata.json cannot be read or is not valid JSON"),
    "metadata_invalid": (
        ERROR,
        "metadata.json is not an object, lacks a key, or a key has a wrong type or value",
    ),
    "index_missing": (ERROR, "neither trajectory_index.json nor the legacy trajector_index.json exists"),
    "index_unreadable": (ERROR, "the index file cannot be read or is not valid JSON"),
    "index_invalid": (ERROR, "the index is not an object, or its two keys do not have the right types"),
    "legacy_index_unreadable": (
        ERROR,
        "trajector_index.json exists beside trajectory_index.json but is unreadable",
    ),
    "legacy_index_mismatch": (ERROR, "trajector_index.json disagrees with trajectory_index.json"),
    "entry_invalid": (ERROR, "an index entry lacks a key or has a wrong id, shape or model_weights_id"),
    "num_samples_mismatch": (ERROR, "an entry's num_samples is not shape[0] * shape[1]"),
    "duplicate_id": (ERROR, "an id appears more than once in trajectory_id_list"),
    "entry_missing": (ERROR, "trajectory_id_list names an id that has no entry"),
    "entry_unlisted": (ERROR, "an entry's id is not in trajectory_id_list"),
    "size_mismatch": (ERROR, "metadata size is not the length of trajectory_id_list"),
    "total_samples_mismatch": (ERROR, "metadata total_samples is not the sum of the listed num_samples"),
    "counter_too_low": (ERROR, "metadata trajectory_counter is not above every listed id"),
    "metadata_behind_index": (
        WARNING,
        "metadata.json still describes the index as it was before its last update (an index update "
        "interrupted between its two files); rbtool recounts, the next write or `rbtool repair` fixes it",
    ),
    "file_missing": (ERROR, "a listed trajectory has no file"),
    "duplicate_files": (ERROR, "a listed trajectory has more than one file (for example a .pt and a .pkl)"),
    "file_name_mismatch": (
        ERROR,
        "a listed trajectory's file has another model_weights_id or format than the index",
    ),
    "file_size_mismatch": (ERROR, "a file's size differs from the file_bytes its entry records"),
    "stray_file": (
        ERROR,
        "a trajectory file the index does not list (id below trajectory_counter), or a .pt/.pkl file "
        "not named like a trajectory",
    ),
    "uncommitted_file": (
        NOTICE,
        "an unlisted trajectory file with id >= trajectory_counter: left by an interrupted writer, "
        "removed by the next ingest",
    ),
    "file_unreadable": (ERROR, "deep: a trajectory file cannot be loaded (corrupt, truncated, not a dict)"),
    "file_unsafe": (ERROR, "deep: a trajectory file holds objects beyond tensors and plain data; not loaded"),
    "trajectory_invalid": (
        ERROR,
        "deep: a trajectory's tensors do not agree on [T, B] or it has no shape field",
    ),
    "done_rows_invalid": (ERROR, "deep: a done-like field's extra rows E do not divide T (or B differs)"),
    "shape_mismatch": (ERROR, "deep: a trajectory's [T, B] differs from its index entry's shape"),
    "field_mismatch": (ERROR, "deep: a file's model_weights_id or max_episode_length differs from its entry"),
    "non_finite": (ERROR, "deep: a float field holds NaN or Inf"),
    "hash_mismatch": (ERROR, "deep: a file's sha256 differs from the one its entry records"),
    "schema_differs": (
        WARNING,
        "deep: a trajectory's fields, dtypes or trailing shapes differ from the first's",
    ),
}

_IGNORED_FILES = {METADATA_FILE, INDEX_FILE, LEGACY_INDEX_FILE, MERGE_MAP_FILE}
_I64_SAFE = 1 << 31  # dims below this multiply without int64 overflow
_SHOWN = 10


def _preview(values: Iterable[Any]) -> str:
    """At most _SHOWN values, comma separated, with an ellipsis when there are more."""
    items = list(values)
    text = ", ".join(map(str, items[:_SHOWN]))
    return text + (f", ... ({len(items)} in all)" if len(items) > _SHOWN else "")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


@dataclass(slots=True)
class Problem:
    """One thing wrong (or worth knowing) about a checkpoint."""

    code: str
    severity: str
    trajectory_id: int | None
    file: str | None
    message: str

    def as_json(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "severity": self.severity,
            "trajectory_id": self.trajectory_id,
            "file": self.file,
            "message": self.message,
        }


@dataclass
class CheckpointReport:
    """The problems of one checkpoint directory; `size` is the index's length when it could be read."""

    path: Path
    size: int | None = None
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(p.severity == ERROR for p in self.problems)

    def add(
        self, code: str, message: str, *, trajectory_id: int | None = None, file: str | None = None
    ) -> None:
        """Record a problem; `message` must be one line (pass exception text through _one_line)."""
        self.problems.append(Problem(code, PROBLEM_CODES[code][0], trajectory_id, file, message))

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(SEVERITIES, 0)
        for problem in self.problems:
            counts[problem.severity] += 1
        return counts

    def as_json(self, *, plain: bool = True) -> dict[str, Any]:
        """JSON-ready dict; with plain=False problems stay Problem objects (orjson writes them as is)."""
        problems: list[Any] = [p.as_json() for p in self.problems] if plain else self.problems
        return {"path": str(self.path), "ok": self.ok, "size": self.size, "problems": problems}


@dataclass
class VerifyReport:
    """The result of verifying a path: one report per checkpoint directory found there."""

    path: Path
    deep: bool
    checkpoints: list[CheckpointReport]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checkpoints)

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(SEVERITIES, 0)
        for report in self.checkpoints:
            for key, value in report.counts().items():
                counts[key] += value
        return counts

    def as_json(self, *, plain: bool = True) -> dict[str, Any]:
        """The JSON document `rbtool verify --json` prints (see CheckpointReport.as_json for `plain`)."""
        return {
            "path": str(self.path),
            "deep": self.deep,
            "ok": self.ok,
            "checkpoints": [c.as_json(plain=plain) for c in self.checkpoints],
            "counts": self.counts(),
        }


# --------------------------------------------------------------------- JSON reading
_ABSENT = object()


def _read_bytes(path: Path, report: CheckpointReport, missing: str, unreadable: str) -> bytes | None:
    """The bytes of `path`, or None after reporting why they could not be read."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        report.add(missing, f"{path.name} does not exist", file=path.name)
    except OSError as exc:
        report.add(unreadable, _one_line(f"{path.name}: cannot read ({exc.strerror})"), file=path.name)
    return None


def _parse_json(data: bytes, name: str, report: CheckpointReport, unreadable: str) -> Any:
    """Parsed JSON, or _ABSENT after reporting that it is not valid JSON."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        report.add(unreadable, _one_line(f"{name}: invalid JSON ({exc})"), file=name)
        return _ABSENT


def _read_json(path: Path, report: CheckpointReport, missing: str, unreadable: str) -> Any:
    """The parsed JSON of `path`, or _ABSENT after reporting why it could not be had."""
    data = _read_bytes(path, report, missing, unreadable)
    return _ABSENT if data is None else _parse_json(data, path.name, report, unreadable)


# A well-formed index decodes straight into typed structs: types are checked in C, keys rbtool
# does not need (uuid) are skipped, and only value checks are left for numpy. Anything the
# typed decoder rejects goes through the general path, which reports every problem.
_DECODERS: dict[bool, Any] = {}
try:
    import msgspec
except ImportError:  # pragma: no cover - without msgspec the general path does all the work
    pass
else:

    class _TypedEntry(msgspec.Struct, gc=False):
        """The entry keys quick verification reads; `entry[key]` and `entry.get` work as on a dict."""

        num_samples: int
        trajectory_id: int
        max_episode_length: int | None
        shape: list[int]
        model_weights_id: str
        file_bytes: int | None = None

        def __getitem__(self, key: str) -> Any:
            return getattr(self, key)

        def get(self, key: str, default: Any = None) -> Any:
            return getattr(self, key, default)

    class _TypedEntryWithHash(_TypedEntry, gc=False):
        """Deep verification also compares content hashes."""

        sha256: str | None = None

    class _TypedIndex(msgspec.Struct, gc=False):
        trajectory_index: dict[str, _TypedEntry]
        trajectory_id_list: list[int]

    class _TypedIndexWithHash(msgspec.Struct, gc=False):
        trajectory_index: dict[str, _TypedEntryWithHash]
        trajectory_id_list: list[int]

    _DECODERS[False] = msgspec.json.Decoder(_TypedIndex)
    _DECODERS[True] = msgspec.json.Decoder(_TypedIndexWithHash)


def _decode_typed(data: bytes, with_hash: bool) -> tuple[dict[str, Any], list[int]] | None:
    """(trajectory_index, trajectory_id_list) when the index has the expected types, else None."""
    decoder = _DECODERS.get(with_hash)
    if decoder is None:
        return None
    try:
        raw = decoder.decode(data)
    except msgspec.DecodeError:
        return None
    return raw.trajectory_index, raw.trajectory_id_list


@dataclass
class _Metadata:
    """The metadata values that passed their checks (None where absent or invalid)."""

    fmt: str | None = None
    size: int | None = None
    total_samples: int | None = None
    trajectory_counter: int | None = None


def _check_metadata(directory: Path, report: CheckpointReport) -> _Metadata:
    """Check each metadata key on its own, so that every bad key is reported."""
    meta = _read_json(directory / METADATA_FILE, report, "metadata_missing", "metadata_unreadable")
    result = _Metadata()
    if meta is _ABSENT:
        return result
    if not isinstance(meta, dict):
        report.add(
            "metadata_invalid",
            f"{METADATA_FILE}: expected a JSON object, got {type(meta).__name__}",
            file=METADATA_FILE,
        )
        return result
    values: dict[str, Any] = {}
    for key in ("trajectory_format", "size", "total_samples", "trajectory_counter", "seed"):
        if key not in meta:
            if key != "seed":  # RLinf's loader reads the other four unconditionally
                report.add("metadata_invalid", f"{METADATA_FILE}: lacks {key!r}", file=METADATA_FILE)
            continue
        try:
            parse_metadata({key: meta[key]}, Path(METADATA_FILE))
        except CheckpointError as exc:
            report.add("metadata_invalid", _one_line(str(exc)), file=METADATA_FILE)
            continue
        values[key] = meta[key]
    result.fmt = values.get("trajectory_format")
    result.size = values.get("size")
    result.total_samples = values.get("total_samples")
    result.trajectory_counter = values.get("trajectory_counter")
    return result


# ------------------------------------------------------------------ entry columns
def _int_column(values: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """(int64 values, mask of plain non-negative ints below 2**63); invalid values become 0."""
    n = len(values)
    if n and set(map(type, values)) == {int}:
        try:
            arr = np.array(values, dtype=np.int64)
        except OverflowError:
            pass
        else:
            return arr, arr >= 0
    ok = np.fromiter((type(v) is int and 0 <= v < 1 << 63 for v in values), dtype=bool, count=n)
    arr = np.fromiter((v if good else 0 for v, good in zip(values, ok, strict=True)), dtype=np.int64, count=n)
    return arr, ok


def _key_column(keys: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask of canonical non-negative decimal keys that fit in int64)."""
    try:
        as_ints = list(map(int, keys))
        if list(map(str, as_ints)) == keys:
            ids, ok = _int_column(as_ints)
            return ids, ok
    except ValueError:
        pass
    ok = np.fromiter(
        (k.isascii() and k.isdigit() and len(k) < 19 and (len(k) == 1 or k[0] != "0") for k in keys),
        dtype=bool,
        count=len(keys),
    )
    ids = np.fromiter((int(k) if good else -1 for k, good in zip(keys, ok, strict=True)), np.int64, len(keys))
    return ids, ok


def _shape_columns(shapes: list[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(T, B, mask of shapes that are lists of >= 2 small non-negative ints)."""
    n = len(shapes)
    if set(map(type, shapes)) <= {list}:
        lens = np.fromiter(map(len, shapes), dtype=np.int64, count=n)
    else:
        lens = np.fromiter((len(s) if type(s) is list else 0 for s in shapes), dtype=np.int64, count=n)
    ok = lens >= 2
    t = np.zeros(n, dtype=np.int64)
    b = np.zeros(n, dtype=np.int64)
    where = np.flatnonzero(ok)
    if where.size:
        chosen = shapes if where.size == n else list(compress(shapes, ok))
        flat, flat_ok = _int_column(list(chain.from_iterable(chosen)))
        flat_ok &= flat < _I64_SAFE
        seg = lens[where]
        starts = np.concatenate(([0], np.cumsum(seg)[:-1]))
        ok[where] = np.logical_and.reduceat(flat_ok, starts)
        t[where] = flat[starts]
        b[where] = flat[starts + 1]
    return t, b, ok


def _typed_shape_columns(shapes: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """_shape_columns for lists known to hold only ints: one 2-D conversion when ndim is uniform."""
    lens = np.fromiter(map(len, shapes), dtype=np.int64, count=len(shapes))
    if not lens.size or lens.min() != lens.max() or lens[0] < 2:
        return _shape_columns(shapes)
    k = int(lens[0])
    dims = np.fromiter(chain.from_iterable(shapes), dtype=np.int64, count=k * len(shapes)).reshape(-1, k)
    ok = ((dims >= 0) & (dims < _I64_SAFE)).all(axis=1)
    return dims[:, 0], dims[:, 1], np.asarray(ok)


def _optional_int_mask(values: list[Any]) -> np.ndarray:
    """Mask of values that are None or a plain int (max_episode_length)."""
    if set(map(type, values)) <= {int, type(None)}:
        return np.ones(len(values), dtype=bool)
    return np.fromiter((v is None or type(v) is int for v in values), bool, len(values))


def _weights_id_mask(values: list[Any]) -> np.ndarray:
    """Mask of file-name-safe model_weights_id strings (each distinct value checked once)."""
    n = len(values)
    all_str = set(map(type, values)) <= {str}
    is_str = np.ones(n, dtype=bool) if all_str else np.fromiter((type(v) is str for v in values), bool, n)
    bad: set[str] = set()
    for value in set(values if all_str else compress(values, is_str)):
        try:
            check_weights_id(value, "")
        except CheckpointError:
            bad.add(value)
    if bad:
        is_str &= np.fromiter((v not in bad if type(v) is str else False for v in values), bool, n)
    return is_str


def _column(rows: list[dict[str, Any]], name: str) -> list[Any]:
    """The value of `name` in every row; _ABSENT where a row lacks it."""
    try:
        return list(map(itemgetter(name), rows))
    except KeyError:
        return [row.get(name, _ABSENT) for row in rows]


def _plausible_entries(keys: list[str], values: list[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Vectorised pre-check of every entry: (ids, num_samples, mask of entries that look valid).

    The mask is conservative: an entry it rejects is re-checked one by one with parse_entry,
    which has the last word and the exact message.
    """
    rows = values if set(map(type, values)) <= {dict} else [v if type(v) is dict else {} for v in values]
    ids, ok = _key_column(keys)
    tids, tid_ok = _int_column(_column(rows, "trajectory_id"))
    ok &= tid_ok & (tids == ids)
    t, b, shape_ok = _shape_columns(_column(rows, "shape"))
    nums, num_ok = _int_column(_column(rows, "num_samples"))
    ok &= shape_ok & num_ok & (nums == t * b)
    ok &= _optional_int_mask(_column(rows, "max_episode_length"))
    ok &= _weights_id_mask(_column(rows, "model_weights_id"))
    return ids, nums, ok


def _entry_problem(key: str, entry: Any, report: CheckpointReport) -> bool:
    """Check one entry exactly; report it and return False when it is invalid."""
    try:
        parse_entry(key, entry, Path(INDEX_FILE))
    except CheckpointError as exc:
        tid = int(key) if key.isascii() and key.isdigit() else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        num = entry.get("num_samples") if isinstance(entry, dict) else None
        mismatch = (
            isinstance(shape, list)
            and len(shape) >= 2
            and all(type(d) is int and d >= 0 for d in shape)
            and type(num) is int
            and num >= 0
            and num != shape[0] * shape[1]
        )
        report.add(
            "num_samples_mismatch" if mismatch else "entry_invalid", _one_line(str(exc)), trajectory_id=tid
        )
        return False
    return True


# ------------------------------------------------------------------ the checker
@dataclass
class _Listing:
    """The trajectory files of a directory, by id."""

    by_id: dict[int, list[str]] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    badly_named: list[str] = field(default_factory=list)


def _list_files(directory: Path) -> _Listing:
    """Visible trajectory files (and .pt/.pkl files not named like one); hidden names are ignored."""
    listing = _Listing()
    with os.scandir(directory) as it:
        for entry in it:
            name = entry.name
            if name.startswith(".") or name in _IGNORED_FILES:
                continue
            parsed = parse_trajectory_file_name(name)
            if parsed is None:
                if name.endswith((".pt", ".pkl")) and entry.is_file():
                    listing.badly_named.append(name)
                continue
            if not entry.is_file():
                continue
            listing.by_id.setdefault(parsed[0], []).append(name)
    return listing


class _Checker:
    """Checks one checkpoint directory, adding problems to its report."""

    def __init__(self, directory: Path, report: CheckpointReport, *, deep: bool = False) -> None:
        self.directory = directory
        self.report = report
        self.deep = deep
        self._weights_id_of: Callable[[Any], str] = itemgetter("model_weights_id")
        self.meta = _Metadata()
        self.table: dict[str, Any] | None = None  # raw trajectory_index object, when it is one
        self.id_list: list[int] | None = None  # integer ids of trajectory_id_list, when it is a list
        self.raw_list_len = 0
        self.entries: dict[int, dict[str, Any]] = {}  # valid entries by id
        self.entries_ok = False  # every listed id has a valid entry
        self._invalid_ids: set[int] = set()  # ids whose entries are invalid
        self._entry_ids = np.zeros(0, dtype=np.int64)
        self._entry_nums = np.zeros(0, dtype=np.int64)
        self._listed_nums = np.zeros(0, dtype=np.int64)
        self.listing = _Listing()

    # -------------------------------------------------------------- quick
    def run_quick(self) -> None:
        self.meta = _check_metadata(self.directory, self.report)
        self._check_index()
        self._check_legacy()
        self._check_counts()
        self.listing = _list_files(self.directory)
        self._check_files()

    def _check_index(self) -> None:
        report = self.report
        has_current = (self.directory / INDEX_FILE).is_file()
        name = (
            INDEX_FILE
            if has_current or not (self.directory / LEGACY_INDEX_FILE).is_file()
            else LEGACY_INDEX_FILE
        )
        data = _read_bytes(self.directory / name, report, "index_missing", "index_unreadable")
        if data is None:
            return
        legacy_too = name == INDEX_FILE and (self.directory / LEGACY_INDEX_FILE).is_file()
        typed = None if legacy_too else _decode_typed(data, self.deep)
        if typed is not None and self._accept_typed(*typed):
            return
        raw = _parse_json(data, name, report, "index_unreadable")
        del data
        if raw is _ABSENT:
            return
        if not isinstance(raw, dict):
            report.add(
                "index_invalid", f"{name}: expected a JSON object, got {type(raw).__name__}", file=name
            )
            return
        table = raw.get("trajectory_index")
        if isinstance(table, dict):
            self.table = table
        else:
            report.add("index_invalid", f"{name}: 'trajectory_index' must be an object", file=name)
        raw_list = raw.get("trajectory_id_list")
        if not isinstance(raw_list, list):
            report.add(
                "index_invalid", f"{name}: 'trajectory_id_list' must be a list of integer ids", file=name
            )
        else:
            self.raw_list_len = len(raw_list)
            _, good = _int_column(raw_list)
            if not good.all():
                bad = [raw_list[i] for i in np.flatnonzero(~good)]
                report.add(
                    "index_invalid",
                    f"{name}: 'trajectory_id_list' holds values that are not non-negative integer ids: "
                    f"{_preview(repr(v) for v in bad)}",
                    file=name,
                )
            self.id_list = list(compress(raw_list, good))
            self.report.size = self.raw_list_len
        if self.table is not None:
            self._check_entries(self.table)
        if self.id_list is not None:
            self._check_list(self.id_list)

    def _accept_typed(self, table: dict[str, Any], id_list: list[int]) -> bool:
        """Take a typed-decoded index if every entry and id passes the value checks."""
        keys, values = list(table), list(table.values())
        n = len(values)
        tid_list = list(map(attrgetter("trajectory_id"), values))
        if list(map(str, tid_list)) != keys:  # every key must be its entry's id, spelt canonically
            return False
        try:
            ids = np.array(tid_list, dtype=np.int64)
            nums = np.fromiter(map(attrgetter("num_samples"), values), dtype=np.int64, count=n)
            t, b, shape_ok = _typed_shape_columns(list(map(attrgetter("shape"), values)))
        except OverflowError:
            return False
        _, listed_ok = _int_column(id_list)
        ok = (ids >= 0) & shape_ok & (nums >= 0) & (nums == t * b)
        ok &= _weights_id_mask(list(map(attrgetter("model_weights_id"), values)))
        if not (ok.all() and listed_ok.all()):
            return False
        self.table = table
        self._weights_id_of = attrgetter("model_weights_id")
        self.entries = dict(zip(tid_list, values, strict=True))
        self._entry_ids, self._entry_nums = ids, nums
        self.id_list = id_list
        self.raw_list_len = len(id_list)
        self.report.size = len(id_list)
        self._check_list(id_list)
        return True

    def _check_entries(self, table: dict[str, Any]) -> None:
        keys, values = list(table), list(table.values())
        ids, nums, ok = _plausible_entries(keys, values)
        for pos in np.flatnonzero(~ok):
            ok[pos] = _entry_problem(keys[pos], values[pos], self.report)
            if not ok[pos] and ids[pos] >= 0:
                self._invalid_ids.add(int(ids[pos]))
        self.entries = dict(zip(ids[ok].tolist(), compress(values, ok), strict=True))
        self._entry_ids = ids[ok]
        self._entry_nums = nums[ok]

    def _check_list(self, id_list: list[int]) -> None:
        report = self.report
        listed = np.asarray(id_list, dtype=np.int64)
        ordered = np.sort(listed)
        repeated = ordered[1:][ordered[1:] == ordered[:-1]]
        for tid in dict.fromkeys(repeated.tolist()):
            report.add(
                "duplicate_id", f"id {tid} appears more than once in trajectory_id_list", trajectory_id=tid
            )
        if self.table is None:
            return
        has_entry = np.isin(listed, self._entry_ids)
        for tid in dict.fromkeys(listed[~has_entry].tolist()):
            if tid not in self._invalid_ids:  # an invalid entry was reported already
                report.add(
                    "entry_missing",
                    f"trajectory_id_list names id {tid}, which has no entry",
                    trajectory_id=tid,
                )
        for tid in self._entry_ids[~np.isin(self._entry_ids, listed)].tolist():
            report.add(
                "entry_unlisted",
                f"the index has an entry for id {tid}, which trajectory_id_list omits",
                trajectory_id=tid,
            )
        self.entries_ok = bool(has_entry.all())
        if self.entries_ok:
            order = np.argsort(self._entry_ids)
            pos = np.searchsorted(self._entry_ids[order], listed)
            self._listed_nums = self._entry_nums[order][pos]

    def _check_legacy(self) -> None:
        legacy = self.directory / LEGACY_INDEX_FILE
        if not ((self.directory / INDEX_FILE).is_file() and legacy.is_file()):
            return
        raw = _read_json(legacy, self.report, "legacy_index_unreadable", "legacy_index_unreadable")
        if raw is _ABSENT:
            return
        table = raw.get("trajectory_index") if isinstance(raw, dict) else None
        id_list = raw.get("trajectory_id_list") if isinstance(raw, dict) else None
        if not isinstance(table, dict) or not isinstance(id_list, list):
            self.report.add(
                "legacy_index_unreadable",
                f"{LEGACY_INDEX_FILE}: not an index (needs 'trajectory_index' and 'trajectory_id_list')",
                file=LEGACY_INDEX_FILE,
            )
            return
        if self.table is None or self.id_list is None:
            return
        if id_list != self.id_list:
            self.report.add(
                "legacy_index_mismatch",
                f"{LEGACY_INDEX_FILE} lists {len(id_list)} ids, {INDEX_FILE} lists {len(self.id_list)}, "
                "or in another order; delete the stale one",
                file=LEGACY_INDEX_FILE,
            )
            return
        differing = [
            k
            for k, e in self.table.items()
            if not isinstance(table.get(k), dict)
            or not isinstance(e, dict)
            or any(table[k].get(x) != e.get(x) for x in ENTRY_KEYS)
        ]
        differing += [k for k in table if k not in self.table]
        if differing:
            self.report.add(
                "legacy_index_mismatch",
                f"{LEGACY_INDEX_FILE} disagrees with {INDEX_FILE} on entries {_preview(differing)}; "
                "delete the stale one",
                file=LEGACY_INDEX_FILE,
            )

    def _check_counts(self) -> None:
        """size, total_samples and trajectory_counter against the index."""
        meta, report = self.meta, self.report
        if self.id_list is None:
            return
        n = self.raw_list_len
        ids = self.id_list
        total = int(self._listed_nums.sum()) if self.entries_ok else None
        if meta.size is not None and meta.size < n and self._metadata_lags(meta, total):
            report.add(
                "metadata_behind_index",
                f"{METADATA_FILE} counts the first {meta.size} of the {n} listed trajectories "
                f"(trajectory_counter {meta.trajectory_counter}): an index update was interrupted before "
                "metadata.json was rewritten; rbtool recounts on read, and the next write or `rbtool repair` "
                "brings it up to date",
                file=METADATA_FILE,
            )
            return
        if meta.size is not None and meta.size != n:
            report.add(
                "size_mismatch",
                f"{METADATA_FILE} says size {meta.size} but the index lists {n} ids",
                file=METADATA_FILE,
            )
        if meta.total_samples is not None and total is not None and meta.total_samples != total:
            report.add(
                "total_samples_mismatch",
                f"{METADATA_FILE} says total_samples {meta.total_samples} but the listed entries sum to "
                f"{total}",
                file=METADATA_FILE,
            )
        if meta.trajectory_counter is not None and ids and meta.trajectory_counter <= max(ids):
            report.add(
                "counter_too_low",
                f"{METADATA_FILE} says trajectory_counter {meta.trajectory_counter} but the index lists id "
                f"{max(ids)}; new ids would collide",
                file=METADATA_FILE,
            )

    def _metadata_lags(self, meta: _Metadata, total: int | None) -> bool:
        """True if metadata describes exactly a prefix of the list: an interrupted two-file publish."""
        assert self.id_list is not None and meta.size is not None
        if total is None or meta.total_samples is None or meta.trajectory_counter is None:
            return False
        if self.raw_list_len != len(self.id_list):
            return False
        old, new = self.id_list[: meta.size], self.id_list[meta.size :]
        old_total = int(self._listed_nums[: meta.size].sum())
        return (
            old_total == meta.total_samples
            and meta.trajectory_counter > max(old, default=-1)
            and meta.trajectory_counter <= min(new)
        )

    def _check_files(self) -> None:
        report, listing = self.report, self.listing
        fmt = self.meta.fmt
        for name in sorted(listing.badly_named):
            report.add(
                "stray_file",
                f"{name}: a .pt/.pkl file not named trajectory_<id>_<model_weights_id>.<fmt>",
                file=name,
            )
        if self.id_list is None or self.table is None:
            return  # without a readable index, no file can be called missing or stray
        listed = dict.fromkeys(self.id_list)
        counter = max([self.meta.trajectory_counter or 0, max(listed, default=-1) + 1])
        unique = np.fromiter(listed, dtype=np.int64, count=len(listed))
        present = np.isin(unique, np.fromiter(listing.by_id, dtype=np.int64, count=len(listing.by_id)))
        missing = unique[~present].tolist()
        entries = self.entries
        if fmt in FORMATS and (self.entries_ok or entries.keys() >= set(missing)):
            # the bulk case (an index whose files are elsewhere) built list-wise: no per-id calls
            weights = list(map(self._weights_id_of, map(entries.__getitem__, missing)))
            names = [f"trajectory_{t}_{w}.{fmt}" for t, w in zip(missing, weights, strict=True)]
            messages = [
                f"{n}: listed trajectory {t} has no file" for n, t in zip(names, missing, strict=True)
            ]
            report.problems.extend(
                map(Problem, repeat("file_missing"), repeat(ERROR), missing, names, messages)
            )
        else:
            for tid in missing:
                expected = self._expected_name(tid, entries.get(tid), fmt)
                report.add(
                    "file_missing",
                    f"{expected or f'trajectory_{tid}_*'}: listed trajectory {tid} has no file",
                    trajectory_id=tid,
                    file=expected,
                )
        for tid in unique[present].tolist():
            entry = entries.get(tid)
            names = listing.by_id[tid]
            expected = self._expected_name(tid, entry, fmt)
            if len(names) > 1:
                report.add(
                    "duplicate_files",
                    f"trajectory {tid} has {len(names)} files: {', '.join(sorted(names))}; keep only "
                    f"{expected or 'one'}",
                    trajectory_id=tid,
                    file=expected,
                )
            elif expected is not None and names[0] != expected:
                report.add(
                    "file_name_mismatch",
                    f"{names[0]}: the index expects {expected} for trajectory {tid}",
                    trajectory_id=tid,
                    file=names[0],
                )
            elif entry is not None:
                self._check_size(tid, names[0], entry)
        for tid in sorted(listing.by_id.keys() - listed):
            for name in sorted(listing.by_id[tid]):
                if tid >= counter:
                    report.add(
                        "uncommitted_file",
                        f"{name}: not listed, id {tid} >= trajectory_counter {counter}: left by an "
                        "interrupted writer; the next ingest removes it",
                        trajectory_id=tid,
                        file=name,
                    )
                else:
                    report.add(
                        "stray_file",
                        f"{name}: a trajectory file the index does not list (id {tid} < trajectory_counter "
                        f"{counter})",
                        trajectory_id=tid,
                        file=name,
                    )

    @staticmethod
    def _expected_name(tid: int, entry: dict[str, Any] | None, fmt: str | None) -> str | None:
        if entry is None or fmt not in FORMATS:
            return None
        return trajectory_file_name(tid, entry["model_weights_id"], fmt)

    def _check_size(self, tid: int, name: str, entry: dict[str, Any]) -> None:
        recorded = entry.get("file_bytes")
        if recorded is None:
            return
        try:
            actual = (self.directory / name).stat().st_size
        except OSError:
            return
        if recorded != actual:
            self.report.add(
                "file_size_mismatch",
                f"{name}: {actual} bytes but its entry records file_bytes {recorded!r} "
                "(truncated or replaced?)",
                trajectory_id=tid,
                file=name,
            )

    # --------------------------------------------------------------- deep
    def run_deep(self, progress: Progress | None) -> None:
        """Load every file of a listed trajectory and check its tensors against the index."""
        if self.id_list is None:
            return
        schemas: list[tuple[int, str, dict[str, str]]] = []
        for tid in dict.fromkeys(self.id_list):
            for name in sorted(self.listing.by_id.get(tid, [])):
                schema = _deep_check_file(self.directory / name, tid, self.entries.get(tid), self.report)
                if schema is not None:
                    schemas.append((tid, name, schema))
                if progress is not None:
                    progress(1)
        _compare_schemas(schemas, self.report)


# -------------------------------------------------------------------- deep checks
def _schema_of(traj: dict[str, Any]) -> dict[str, str]:
    """Field path -> 'dtype[trailing dims]' ('dtype(1-dim)' for per-env vectors)."""
    from rbtool.trajfile import iter_tensors

    out = {}
    for path, tensor in iter_tensors(traj):
        dtype = str(tensor.dtype).removeprefix("torch.")
        trailing = "(1-dim)" if tensor.dim() < 2 else str(list(tensor.shape[2:]))
        out[".".join(path)] = f"{dtype}{trailing}"
    return out


def _deep_check_file(
    path: Path, tid: int, entry: dict[str, Any] | None, report: CheckpointReport
) -> dict[str, str] | None:
    """Load one file and check it; returns its schema when it could be read."""
    import torch

    from rbtool import trajfile
    from rbtool.errors import InvalidTrajectoryError

    name = path.name
    try:
        traj = trajfile.load(path)
    except UnsafePickleError as exc:
        report.add("file_unsafe", _one_line(str(exc)), trajectory_id=tid, file=name)
        return None
    except RbtoolError as exc:
        report.add("file_unreadable", _one_line(str(exc)), trajectory_id=tid, file=name)
        return None
    if traj.get("model_weights_id") is None:
        parsed = parse_trajectory_file_name(name)
        traj = {**traj, "model_weights_id": parsed[1] if parsed else ""}
    plain = {k: v for k, v in traj.items() if k not in trajfile.DONE_LIKE}
    try:
        info = trajfile.describe(plain, name)
    except InvalidTrajectoryError as exc:
        report.add("trajectory_invalid", _one_line(str(exc)), trajectory_id=tid, file=name)
        info = None
    if info is not None:
        t, b = info.shape[0], info.shape[1]
        for key in trajfile.DONE_LIKE:
            value = traj.get(key)
            if not isinstance(value, torch.Tensor) or value.dim() < 2:
                continue
            extra = int(value.shape[0]) - t
            if int(value.shape[1]) != b or extra < 0 or (extra > 0 and t % extra):
                report.add(
                    "done_rows_invalid",
                    f"{name}: field {key!r} has shape {list(value.shape)}; a done-like field must start with "
                    f"[T + E, B] = [{t} + E, {b}] where E divides T={t}",
                    trajectory_id=tid,
                    file=name,
                )
        if entry is not None:
            _compare_entry(name, tid, info, traj, entry, report)
    for field_path, tensor in trajfile.iter_tensors(traj):
        if tensor.is_floating_point() or tensor.is_complex():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                report.add(
                    "non_finite",
                    f"{name}: field {'.'.join(field_path)!r} holds {bad} NaN/Inf value(s)",
                    trajectory_id=tid,
                    file=name,
                )
    recorded = entry.get("sha256") if entry is not None else None
    if isinstance(recorded, str):
        actual = trajfile.sha256_file(path)
        if actual != recorded:
            report.add(
                "hash_mismatch",
                f"{name}: sha256 {actual[:16]}... differs from the recorded {recorded[:16]}...",
                trajectory_id=tid,
                file=name,
            )
    return _schema_of(traj)


def _compare_entry(
    name: str, tid: int, info: Any, traj: dict[str, Any], entry: dict[str, Any], report: CheckpointReport
) -> None:
    if list(info.shape[:2]) != list(entry["shape"][:2]):
        report.add(
            "shape_mismatch",
            f"{name}: tensors are [T, B] = {list(info.shape[:2])} but the index entry says "
            f"{list(entry['shape'][:2])}",
            trajectory_id=tid,
            file=name,
        )
    if info.model_weights_id != entry["model_weights_id"]:
        report.add(
            "field_mismatch",
            f"{name}: model_weights_id {info.model_weights_id!r} but the index entry says "
            f"{entry['model_weights_id']!r}",
            trajectory_id=tid,
            file=name,
        )
    mel = traj.get("max_episode_length")
    if type(mel) is int and type(entry["max_episode_length"]) is int and mel != entry["max_episode_length"]:
        report.add(
            "field_mismatch",
            f"{name}: max_episode_length {mel} but the index entry says {entry['max_episode_length']}",
            trajectory_id=tid,
            file=name,
        )


def _compare_schemas(schemas: list[tuple[int, str, dict[str, str]]], report: CheckpointReport) -> None:
    """One warning per trajectory whose schema differs from the first readable one's."""
    if not schemas:
        return
    ref_id, _, ref = schemas[0]
    for tid, name, schema in schemas[1:]:
        if schema == ref:
            continue
        diffs = [f"lacks {p}" for p in ref if p not in schema]
        diffs += [f"has extra {p} {schema[p]}" for p in schema if p not in ref]
        diffs += [f"{p} is {schema[p]} (not {ref[p]})" for p in ref if p in schema and schema[p] != ref[p]]
        report.add(
            "schema_differs",
            f"{name}: fields differ from trajectory {ref_id}'s: {_preview(diffs)}",
            trajectory_id=tid,
            file=name,
        )


# ------------------------------------------------------------------------ entry points
def verify_checkpoint(
    directory: str | os.PathLike[str], *, deep: bool = False, progress: Progress | None = None
) -> CheckpointReport:
    """Check one checkpoint or buffer directory and return every problem found."""
    path = Path(directory)
    report = CheckpointReport(path)
    checker = _Checker(path, report, deep=deep)
    with gc_paused():
        checker.run_quick()
    if deep:
        checker.run_deep(progress)
    return report


def verify(
    path: str | os.PathLike[str], *, deep: bool = False, progress: Progress | None = None
) -> VerifyReport:
    """Check a checkpoint, a buffer directory, or each checkpoint of a folder of rank_* directories."""
    root = Path(path)
    reports = [verify_checkpoint(d, deep=deep, progress=progress) for d in checkpoint_dirs(root)]
    return VerifyReport(root, deep, reports)


__all__ = [
    "PROBLEM_CODES",
    "CheckpointReport",
    "Problem",
    "VerifyReport",
    "verify",
    "verify_checkpoint",
]
