"""The checkpoint format: file names, the metadata and index schema, and the one validator.

Every reader of a checkpoint's two JSON files goes through `check_json`: the loaders raise
its first error, `rbtool verify` reports all of its problems, `stats` and `repair` use what
it accepted. So a checkpoint that quick verification passes is one every loader accepts,
and one it fails is refused by every loader with the same message.

Decoding: a well-formed index decodes straight into typed structs (types checked in C, a
million entries in about a second) and its values are checked column-wise with numpy. An
index the typed decoder rejects is decoded into plain objects and checked entry by entry,
which names every problem. Both paths apply the same rules (`entry_problems` is the word
on one entry; the column checks accept only what it accepts). Entry keys rbtool does not
know are not read: readers ignore them (docs/format.md). This module never imports torch.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import re
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain, compress
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

if TYPE_CHECKING:
    import numpy as np

METADATA_FILE = "metadata.json"
INDEX_FILE = "trajectory_index.json"
LEGACY_INDEX_FILE = "trajector_index.json"
MERGE_MAP_FILE = "merge_map.json"
FORMATS = ("pt", "pkl")
# The major version of the layout rbtool writes (metadata key `format_version`). A reader
# refuses a newer major version; minor additions only add keys, which readers ignore.
FORMAT_VERSION = 1

# Metadata keys the reference implementation writes (its loader reads the first four).
METADATA_KEYS = ("trajectory_format", "size", "total_samples", "trajectory_counter", "seed")
REQUIRED_METADATA_KEYS = METADATA_KEYS[:4]
# Metadata keys only rbtool writes: when all are absent, another writer wrote last.
RBTOOL_METADATA_KEYS = ("format_version", "field_schemas")
# Entry keys the reference implementation writes, then the optional ones rbtool adds.
ENTRY_KEYS = ("num_samples", "trajectory_id", "max_episode_length", "shape", "model_weights_id")
OPTIONAL_ENTRY_KEYS = ("uuid", "file_bytes", "sha256", "source_sha256", "link", "schema")
# metadata.json may hold rbtool's table of field schemas (an rbtool key, so dropped when
# another writer rewrites the metadata): digest -> [[field path, dtype, per-sample shape, E],
# ...]; an entry's "schema" names one.
SCHEMAS_KEY = "field_schemas"
LINK_KEYS = ("inode", "size", "mtime_ns")  # a hard-linked file's identity when it was linked

INT64_LIMIT = 1 << 63  # every count, id and size is an int in [0, 2**63)
DIM_LIMIT = 1 << 31  # shape dims below this multiply without int64 overflow
SEED_RANGE = (-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed takes

_SAFE_WEIGHTS_ID = re.compile(r"[A-Za-z0-9._-]*")
TRAJECTORY_FILE_RE = re.compile(r"^trajectory_(\d+)_([A-Za-z0-9._-]*)\.(pt|pkl)$")


# ----------------------------------------------------------------------- names
def weights_id_problem(value: object) -> str | None:
    """Why `value` cannot be a model_weights_id (it goes into a file name), or None."""
    if not isinstance(value, str):
        return f"model_weights_id must be a string, got {shown(value)}"
    if not _SAFE_WEIGHTS_ID.fullmatch(value) or ".." in value:
        return (
            f"model_weights_id {shown(value)} is not file-name safe "
            "(allowed: letters, digits, '.', '_', '-', and no '..')"
        )
    return None


def check_weights_id(value: object, where: str) -> str:
    """Return `value` if it is a file-name-safe model_weights_id, else raise naming `where`."""
    from rbtool.errors import CheckpointError

    problem = weights_id_problem(value)
    if problem is not None:
        raise CheckpointError(f"{where}: {problem}")
    assert isinstance(value, str)
    return value


def trajectory_file_name(trajectory_id: int, model_weights_id: str, fmt: str) -> str:
    """The file name of a trajectory, as the reference implementation spells it."""
    return f"trajectory_{trajectory_id}_{model_weights_id}.{fmt}"


def parse_trajectory_file_name(name: str) -> tuple[int, str, str] | None:
    """(id, model_weights_id, format) parsed from a trajectory file name, or None."""
    match = TRAJECTORY_FILE_RE.match(name)
    if match is None or not _is_id_text(match.group(1), leading_zeros=True):
        return None  # an id beyond int64 names no trajectory: the file is a stray
    return int(match.group(1)), match.group(2), match.group(3)


def _is_id_text(text: str, *, leading_zeros: bool = False) -> bool:
    """True if `text` spells an id in [0, 2**63) in ASCII digits (canonically, unless
    `leading_zeros`); never converts a long digit string (Python refuses past 4300 digits)."""
    if not (text.isascii() and text.isdigit()):
        return False
    if leading_zeros:
        text = text.lstrip("0") or "0"
    elif len(text) > 1 and text[0] == "0":
        return False
    return len(text) <= 19 and int(text) < INT64_LIMIT


def escapes(directory: Path, name: str) -> str | None:
    """Where `directory/name` leads when it is a symlink resolving outside `directory`, else None.

    A checkpoint's files must be its own: a link to a file elsewhere (a secret, say) would be
    read, copied into outputs and verified as if it were a trajectory.
    """
    path = directory / name
    if not os.path.islink(path):
        return None
    target = os.path.realpath(path)
    home = os.path.realpath(directory)
    return None if os.path.dirname(target) == home or target.startswith(home + os.sep) else target


def index_path(directory: Path) -> Path:
    """The index file of a directory: the current name, else the legacy misspelt one."""
    path = directory / INDEX_FILE
    if not path.exists() and (directory / LEGACY_INDEX_FILE).exists():
        return directory / LEGACY_INDEX_FILE
    return path


def is_checkpoint_dir(directory: Path) -> bool:
    """True if `directory` holds metadata or an index (so it is meant as a checkpoint)."""
    return (directory / METADATA_FILE).is_file() or index_path(directory).is_file()


# -------------------------------------------------------------------- problems
ERROR, WARNING, NOTICE = "error", "warning", "notice"
SEVERITIES = (ERROR, WARNING, NOTICE)

# Every problem rbtool reports about a checkpoint: code -> (severity, what it means).
# The JSON-level ones come from check_json (an error there is what loaders refuse); the
# file-level ones from rbtool.ops.verify. docs/cli.md documents the same table.
PROBLEM_CODES: dict[str, tuple[str, str]] = {
    "metadata_missing": (ERROR, "metadata.json does not exist"),
    "metadata_unreadable": (ERROR, "metadata.json cannot be read or is not valid JSON"),
    "metadata_invalid": (
        ERROR,
        "metadata.json is not an object, lacks a key, or a key has a wrong type or value",
    ),
    "format_too_new": (ERROR, "metadata.json says a newer major format_version than this rbtool reads"),
    "seed_null": (
        WARNING,
        'metadata.json has "seed": null, which the reference implementation cannot load; rbtool reads '
        "it as no seed, and rewriting the checkpoint leaves the key out",
    ),
    "index_missing": (ERROR, "neither trajectory_index.json nor the legacy trajector_index.json exists"),
    "index_unreadable": (ERROR, "the index file cannot be read or is not valid JSON"),
    "index_invalid": (ERROR, "the index is not an object, or its two keys do not have the right types"),
    "legacy_index_unreadable": (
        WARNING,
        "trajector_index.json exists beside trajectory_index.json but is unreadable (readers use the "
        "current one)",
    ),
    "legacy_index_mismatch": (
        WARNING,
        "trajector_index.json disagrees with trajectory_index.json (readers use the current one)",
    ),
    "entry_invalid": (
        ERROR,
        "an index entry lacks a key or has a wrong id, shape, model_weights_id or optional key",
    ),
    "num_samples_mismatch": (ERROR, "an entry's num_samples is not shape[0] * shape[1]"),
    "duplicate_id": (ERROR, "an id appears more than once in trajectory_id_list"),
    "entry_missing": (ERROR, "trajectory_id_list names an id that has no entry"),
    "entry_unlisted": (WARNING, "an entry's id is not in trajectory_id_list (readers ignore the entry)"),
    "size_mismatch": (ERROR, "metadata size is not the length of trajectory_id_list"),
    "total_samples_mismatch": (ERROR, "metadata total_samples is not the sum of the listed num_samples"),
    "counter_too_low": (ERROR, "metadata trajectory_counter is not above every listed id"),
    "metadata_behind_index": (
        WARNING,
        "metadata.json still describes the index as it was before its last update (an index update "
        "interrupted between its two files); rbtool recounts, the next write or `rbtool repair` fixes it",
    ),
    "file_missing": (ERROR, "a listed trajectory has no file"),
    "rank_missing": (
        ERROR,
        "rank tree: a rank directory that the rank directories' own metadata (world size) records is not "
        "there",
    ),
    "rank_misplaced": (
        ERROR,
        "rank tree: a rank directory's metadata records another rank number than its name (rank_<r>)",
    ),
    "file_outside": (
        ERROR,
        "a listed trajectory's file is a symlink to a file outside the checkpoint (refused, never read)",
    ),
    "duplicate_files": (
        WARNING,
        "a listed trajectory has more than one file (for example a .pt and a .pkl); readers use the one "
        "the index names",
    ),
    "file_name_mismatch": (
        ERROR,
        "a listed trajectory's file has another model_weights_id or format than the index",
    ),
    "file_size_mismatch": (ERROR, "a file's size differs from the file_bytes its entry records"),
    "linked_file_changed": (
        ERROR,
        "a hard-linked file was written in place since it was linked (its inode's size or mtime "
        "changed): every checkpoint that links it changed with it",
    ),
    "file_size_hint": (
        WARNING,
        "a file's size differs from the file_bytes its entry records, but another writer rewrote the "
        "checkpoint after rbtool recorded it, so the record is only a hint",
    ),
    "stray_file": (
        WARNING,
        "a trajectory file the index does not list (id below trajectory_counter), or a .pt/.pkl file "
        "not named like a trajectory; readers ignore it",
    ),
    "sizes_unrecorded": (
        NOTICE,
        "quick: listed files have no recorded size or hash (another writer made them), so only a deep "
        "check, which loads every file, can tell a truncated or altered one",
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
    "hash_hint": (
        WARNING,
        "deep: a file's sha256 differs from its entry's, but another writer rewrote the checkpoint after "
        "rbtool recorded it, so the record is only a hint",
    ),
    "schema_table_invalid": (
        WARNING,
        "metadata.json's table of field schemas (rbtool's own key) is malformed; readers ignore it and "
        "read each file's structure instead",
    ),
    "schema_differs": (
        WARNING,
        "deep: a trajectory's fields, dtypes or trailing shapes differ from the first's",
    ),
}

_SHOWN = 10


def preview(values: Iterable[Any]) -> str:
    """At most ten values, comma separated, with a count when there are more."""
    items = list(values)
    text = ", ".join(map(str, items[:_SHOWN]))
    return text + (f", ... ({len(items)} in all)" if len(items) > _SHOWN else "")


def one_line(text: str) -> str:
    return " ".join(str(text).split())


_SHOWN_REPR: Any = None


def shown(value: Any) -> str:
    """A value for a message: its repr, cut short when long (a file may hold a huge string,
    list or number, and a message is one line)."""
    global _SHOWN_REPR
    if type(value) is int:
        return _int_text(value)
    if _SHOWN_REPR is None:
        import reprlib

        _SHOWN_REPR = reprlib.Repr()
        _SHOWN_REPR.maxstring = _SHOWN_REPR.maxother = 80
        _SHOWN_REPR.maxlist = _SHOWN_REPR.maxdict = 8
        _SHOWN_REPR.maxlevel = 3
        _SHOWN_REPR.maxlong = 40
    return str(_SHOWN_REPR.repr(value))


def _int_text(value: int) -> str:
    """An integer for a message: its digits, shortened when there are many."""
    if value.bit_length() > 256:
        return f"(an integer of about {int(value.bit_length() * 0.30103)} digits)"
    text = str(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} digits)"


@dataclass(slots=True)
class Problem:
    """One thing wrong (or worth knowing) about a checkpoint.

    `file` is the file it concerns (relative to the checkpoint), when there is one;
    `message` says what is wrong and starts with that file's name.
    """

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


def problem(code: str, message: str, *, trajectory_id: int | None = None, file: str | None = None) -> Problem:
    """A Problem with its code's severity; `message` must be one line."""
    return Problem(code, PROBLEM_CODES[code][0], trajectory_id, file, message)


# ------------------------------------------------------------------- decoding
@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic collector: decoding a big index makes millions of objects and no cycles."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        # Move the survivors to the oldest generation without traversing them, so that the
        # first collections after re-enabling do not walk millions of young objects.
        gc.freeze()
        gc.unfreeze()
        if enabled:
            gc.enable()


class _Absent:
    """Marks a JSON value that could not be had (missing file, invalid JSON)."""


ABSENT: Any = _Absent()


@functools.cache
def _typed_decoder() -> Any:
    """A msgspec decoder of trajectory_index.json into slotted Entry structs (built on first use)."""
    import msgspec

    def getitem(self: Any, key: str) -> Any:
        return getattr(self, key)

    def get(self: Any, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)

    # One index entry; `entry[key]` and `entry.get(key)` work as on a dict. (defstruct:
    # this module's annotations are strings, which msgspec cannot resolve for a local class.)
    # Ranges are checked by the decoder in C (at no measurable cost); patterns are not
    # (they would double the decode time), so strings are checked column-wise afterwards.
    count = Annotated[int, msgspec.Meta(ge=0, le=INT64_LIMIT - 1)]
    dim = Annotated[int, msgspec.Meta(ge=0, le=DIM_LIMIT - 1)]
    word = Annotated[int, msgspec.Meta(ge=-INT64_LIMIT, le=INT64_LIMIT - 1)]
    entry = msgspec.defstruct(
        "Entry",
        [
            ("num_samples", count),
            ("trajectory_id", count),
            ("max_episode_length", count | None),
            ("shape", Annotated[list[dim], msgspec.Meta(min_length=2)]),  # type: ignore[valid-type]
            ("model_weights_id", str),
            ("uuid", str | None, None),
            ("file_bytes", count | None, None),
            ("sha256", str | None, None),
            ("source_sha256", str | None, None),
            ("link", dict[str, word] | None, None),  # type: ignore[valid-type]
            ("schema", str | None, None),
        ],
        namespace={"__getitem__": getitem, "get": get},
        gc=False,
        omit_defaults=True,
    )
    index_file = msgspec.defstruct(
        "IndexFile",
        # int keys: msgspec accepts only canonical spellings ("3", never "03" or "+3")
        [
            ("trajectory_index", dict[count, entry]),  # type: ignore[valid-type]
            ("trajectory_id_list", list[count]),
        ],
        gc=False,
    )
    return msgspec.json.Decoder(index_file)


def decode_json(data: bytes) -> Any:
    """Plain JSON to Python objects (the one untyped decoder: the same numbers everywhere)."""
    import msgspec

    with gc_paused():
        return msgspec.json.decode(data)


@functools.cache
def _loose_decoder() -> Any:
    """A decoder of trajectory_index.json that reads the known keys of entries as any JSON value.

    The exact path needs every value as written (to name what is wrong with it) but, like the
    typed path, must not read keys rbtool does not know: both paths then accept and refuse
    the same files. Absent keys stay msgspec.UNSET.
    """
    import msgspec

    unset = msgspec.UNSET

    def get(self: Any, key: str, default: Any = None) -> Any:
        value = getattr(self, key, unset)
        return default if value is unset else value

    fields = [(name, Any, unset) for name in (*ENTRY_KEYS, *OPTIONAL_ENTRY_KEYS)]
    entry = msgspec.defstruct("LooseEntry", fields, namespace={"__getitem__": get, "get": get}, gc=False)
    value = entry | list | str | int | float | bool | None
    index_file = msgspec.defstruct(
        "LooseIndexFile",
        [
            ("trajectory_index", dict[str, value] | list | str | int | float | bool | None, msgspec.UNSET),  # type: ignore[valid-type]
            ("trajectory_id_list", Any, msgspec.UNSET),
        ],
        gc=False,
    )
    return msgspec.json.Decoder(index_file)


def _decode_loose(data: bytes) -> dict[str, Any]:
    """trajectory_index.json with entries as LooseEntry structs (known keys only).

    Raises msgspec.DecodeError when the text is not JSON or not an object at the top.
    """
    import msgspec

    unset = msgspec.UNSET
    with gc_paused():
        raw = _loose_decoder().decode(data)
    out: dict[str, Any] = {}
    if raw.trajectory_index is not unset:
        out["trajectory_index"] = raw.trajectory_index
    if raw.trajectory_id_list is not unset:
        out["trajectory_id_list"] = raw.trajectory_id_list
    return out


def _decode_typed(data: bytes) -> tuple[dict[int, Any], list[int]] | None:
    """(trajectory_index, trajectory_id_list) when the index has the expected types, else None."""
    import msgspec

    try:
        with gc_paused():
            raw = _typed_decoder().decode(data)
    except msgspec.DecodeError:
        return None
    return raw.trajectory_index, raw.trajectory_id_list


def _is_schema_field(value: Any) -> bool:
    return (
        type(value) is list
        and len(value) == 4
        and type(value[0]) is list
        and len(value[0]) >= 1
        and all(type(k) is str for k in value[0])
        and type(value[1]) is str
        and type(value[2]) is list
        and all(type(d) is int and 0 <= d < DIM_LIMIT for d in value[2])
        and type(value[3]) is int
        and 0 <= value[3] < DIM_LIMIT
    )


def schema_table(value: Any) -> dict[str, list[Any]] | None:
    """The index's table of field schemas when it is well formed, else None."""
    if type(value) is not dict:
        return None
    for key, fields in value.items():
        if type(key) is not str or type(fields) is not list or not all(map(_is_schema_field, fields)):
            return None
    return value


def _json_error(exc: Exception) -> str:
    return one_line(str(exc)).removeprefix("JSON is malformed: ")


# ------------------------------------------------------------ one entry, exactly
def _is_count(value: object) -> bool:
    """A plain int in [0, 2**63)."""
    return type(value) is int and 0 <= value < INT64_LIMIT


def entry_problems(key: str, entry: Any) -> list[tuple[str, str]]:
    """Every rule one index entry breaks, as (code, message): the final word on an entry.

    The column checks below are a fast path: they accept only entries this accepts.
    """
    where = f"entry {shown(key)}"
    if not _is_id_text(key):
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
    if not _is_count(num):
        found.append(("entry_invalid", f"{where} has an invalid num_samples {shown(num)}"))
    elif shape_ok and num != shape[0] * shape[1]:
        found.append(
            (
                "num_samples_mismatch",
                f"{where} has num_samples {num} but shape {shape} gives {shape[0] * shape[1]}",
            )
        )
    mel = entry["max_episode_length"]
    if mel is not None and not _is_count(mel):
        found.append(("entry_invalid", f"{where} has an invalid max_episode_length {shown(mel)}"))
    why = weights_id_problem(entry["model_weights_id"])
    if why is not None:
        found.append(("entry_invalid", f"{where}: {why}"))
    if entry.get("uuid") is not None and type(entry["uuid"]) is not str:
        found.append(("entry_invalid", f"{where} has a uuid that is not a string: {shown(entry['uuid'])}"))
    if entry.get("file_bytes") is not None and not _is_count(entry["file_bytes"]):
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
def _int_column(values: list[Any]) -> tuple[np.ndarray, np.ndarray]:
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
    ok = np.fromiter((_is_count(v) for v in values), dtype=bool, count=n)
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
    return np.fromiter((v is None or _is_count(v) for v in values), dtype=bool, count=n)


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
        flat_values, flat_ok = _int_column(list(chain.from_iterable(chosen)))
        flat_ok &= flat_values < DIM_LIMIT
        seg = lens[where]
        starts = np.concatenate(([0], np.cumsum(seg)[:-1]))
        ok[where] = np.logical_and.reduceat(flat_ok, starts)
        t[where] = flat_values[starts]
        b[where] = flat_values[starts + 1]
    return t, b, ok


def _weights_id_mask(values: list[Any]) -> np.ndarray:
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
            return _int_column(as_ints)
    except ValueError:
        pass
    ok = np.fromiter(map(_is_id_text, keys), dtype=bool, count=len(keys))
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
        _plain(row).get(name, default) if isinstance(row, (dict, msgspec.Struct)) else default for row in rows
    ]


def _plain(row: Any) -> Any:
    """A row as entry_problems reads it: structs become dicts of the keys they hold."""
    import msgspec

    if not isinstance(row, msgspec.Struct):
        return row
    unset = msgspec.UNSET
    return {n: v for n in row.__struct_fields__ if (v := getattr(row, n)) is not unset}


def _entry_mask(keys: list[str], values: list[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Column-wise check of every entry: (ids, num_samples, mask of entries that pass).

    Conservative: an entry the mask rejects is re-checked with entry_problems, which has the
    last word and the exact message.
    """
    import numpy as np

    rows = values
    ids, ok = _key_column(keys)
    tids, tid_ok = _int_column(_column(rows, "trajectory_id"))
    ok &= tid_ok & (tids == ids)
    t, b, shape_ok = _shape_columns(_column(rows, "shape"))
    nums, num_ok = _int_column(_column(rows, "num_samples"))
    ok &= shape_ok & num_ok & (nums == t * b)
    ok &= _optional_count_mask(_column(rows, "max_episode_length"))
    ok &= _weights_id_mask(_column(rows, "model_weights_id"))
    ok &= _optional_str_mask(_column(rows, "uuid", None))
    ok &= _optional_count_mask(_column(rows, "file_bytes", None))
    ok &= _optional_str_mask(_column(rows, "sha256", None))
    ok &= _optional_str_mask(_column(rows, "source_sha256", None))
    ok &= _optional_str_mask(_column(rows, "schema", None))
    links = _column(rows, "link", None)
    if any(v is not None for v in links):
        ok &= np.fromiter((v is None or _is_link(v) for v in links), dtype=bool, count=len(links))
    return ids, nums, ok


# ------------------------------------------------------------------- metadata
@dataclass
class Metadata:
    """The metadata values that passed their checks (None where absent or invalid)."""

    trajectory_format: str | None = None
    size: int | None = None
    total_samples: int | None = None
    trajectory_counter: int | None = None
    seed: int | None = None
    has_seed: bool = False  # the key is there with an integer
    format_version: int | None = None
    schemas: dict[str, list[Any]] = field(default_factory=dict)  # rbtool's table of field schemas
    extra: dict[str, Any] = field(default_factory=dict)  # keys rbtool does not interpret
    invalid: set[str] = field(default_factory=set)  # keys present with a value that was refused
    foreign: bool = False  # no rbtool metadata key: another writer wrote last
    readable: bool = False  # the file was a JSON object


def _format_major(value: Any) -> int | None:
    """The major version of a format_version value (an int, or a "M" / "M.m" string), or None."""
    if type(value) is int and value >= 1:
        return value
    if isinstance(value, str) and re.fullmatch(r"[1-9][0-9]{0,8}(\.[0-9]{1,9})?", value):
        return int(value.split(".")[0])
    return None


def check_metadata(meta: Any) -> tuple[Metadata, list[Problem]]:
    """Check each metadata key on its own, so that every bad key is reported."""
    result, found = Metadata(), []

    def bad(message: str, code: str = "metadata_invalid", key: str | None = None) -> None:
        found.append(problem(code, f"{METADATA_FILE}: {message}", file=METADATA_FILE))
        if key is not None:
            result.invalid.add(key)

    if meta is ABSENT:
        return result, found
    if not isinstance(meta, dict):
        bad(f"expected a JSON object, got {type(meta).__name__}")
        return result, found
    result.readable = True
    for key in REQUIRED_METADATA_KEYS:
        if key not in meta:
            bad(f"lacks {key!r}")
    fmt = meta.get("trajectory_format")
    if "trajectory_format" in meta:
        if fmt in FORMATS:
            result.trajectory_format = fmt
        else:
            bad(f"trajectory_format must be 'pt' or 'pkl', got {shown(fmt)}", key="trajectory_format")
    for key in ("size", "total_samples", "trajectory_counter"):
        if key in meta:
            if _is_count(meta[key]):
                setattr(result, key, meta[key])
            else:
                bad(f"{key} must be an integer in [0, 2**63), got {shown(meta[key])}", key=key)
    if "seed" in meta:
        seed = meta["seed"]
        if seed is None:
            found.append(
                problem(
                    "seed_null",
                    f'{METADATA_FILE}: "seed": null cannot be loaded by the reference implementation; '
                    "read as no seed (rewriting the checkpoint leaves the key out)",
                    file=METADATA_FILE,
                )
            )
        elif type(seed) is int and SEED_RANGE[0] <= seed < SEED_RANGE[1]:
            result.seed, result.has_seed = seed, True
        else:
            bad(f"seed must be an integer, got {shown(seed)}", key="seed")
    if "format_version" in meta:
        major = _format_major(meta["format_version"])
        if major is None:
            bad(
                f"format_version must be a positive integer, got {shown(meta['format_version'])}",
                key="format_version",
            )
        elif major > FORMAT_VERSION:
            bad(
                f"written in format version {meta['format_version']}, newer than this rbtool reads "
                f"({FORMAT_VERSION}); upgrade rbtool",
                "format_too_new",
            )
        else:
            result.format_version = major
    if SCHEMAS_KEY in meta:
        table = schema_table(meta[SCHEMAS_KEY])
        if table is None:
            found.append(
                problem(
                    "schema_table_invalid",
                    f"{METADATA_FILE}: {SCHEMAS_KEY!r} is malformed; it is ignored",
                    file=METADATA_FILE,
                )
            )
        else:
            result.schemas = table
    result.foreign = not any(key in meta for key in RBTOOL_METADATA_KEYS)
    result.extra = {k: v for k, v in meta.items() if k not in METADATA_KEYS and k not in RBTOOL_METADATA_KEYS}
    for key, value in list(result.extra.items()):
        why = json_value_problem(value)
        if why is not None:
            bad(f"key {shown(key)} {why}: rbtool could not write it back", key=key)
            del result.extra[key]  # what is kept must be writable: a repair drops it
    return result, found


# ------------------------------------------------------------- bounded JSON
# Every JSON document rbtool reads may come from someone else, so each is bounded before it
# is decoded: its size (a document larger than its limit is refused before a byte is parsed,
# and an index by the memory decoding it would take), its nesting (counted by a flat scan of
# the bytes, never by recursion: the decoders recurse and would raise RecursionError or, past
# the C stack, crash) and its integers (64-bit: what the writers can write back).
MAX_JSON_DEPTH = 64  # rbtool's own documents nest 5 deep at most; LeRobot's a few more
MAX_JSON_BYTES = 16 << 20  # metadata, markers, sidecars, info.json, one journal line
JSON_BYTES_ENV = "RBTOOL_MAX_JSON_BYTES"
INDEX_BYTES_ENV = "RBTOOL_MAX_INDEX_BYTES"
# Memory the decoded index takes per byte of JSON, measured on rbtool-written indexes (about
# 300 bytes an entry): the typed decode and the entry dicts loaders build from it, together.
INDEX_MEMORY_PER_BYTE = 5
JSON_INT_RANGE = (-(1 << 63), 1 << 64)  # int64 and uint64 (what orjson writes back)
_SCAN_CHUNK = 1 << 22


def _env_bytes(name: str, default: int) -> int:
    """A byte count from the environment (plain digits, optionally with a K/M/G suffix)."""
    from rbtool.errors import UsageError

    text = os.environ.get(name, "").strip()
    if not text:
        return default
    match = re.fullmatch(r"([0-9]{1,15})([KMG]i?B?|B)?", text, flags=re.IGNORECASE)
    if match is None:
        raise UsageError(f"{name}={text!r} is not a byte count (for example 1048576, 64M or 2G)")
    scale = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[(match.group(2) or "")[:1].upper()]
    return int(match.group(1)) * scale


def max_json_bytes() -> int:
    """The size limit of a small JSON document (RBTOOL_MAX_JSON_BYTES, default 16 MiB)."""
    return _env_bytes(JSON_BYTES_ENV, MAX_JSON_BYTES)


def human_bytes(n: float) -> str:
    """A byte count the way messages print it: 512 B, 3.2 MiB, 7.1 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _proc_kib(path: str, key: bytes) -> int | None:
    """A `Key:  N kB` line of a /proc file, in bytes, or None."""
    with contextlib.suppress(OSError, ValueError, IndexError), open(path, "rb") as handle:
        for line in handle:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return None


def available_memory() -> int | None:
    """Bytes this process may still allocate: the least of free memory (MemAvailable), the
    room left under its address-space limit (RLIMIT_AS) and under its cgroup's limit; None
    when none of them can be read."""
    import resource

    bounds: list[int] = []
    free = _proc_kib("/proc/meminfo", b"MemAvailable:")
    if free is not None:
        bounds.append(free)
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        bounds.append(max(soft - (_proc_kib("/proc/self/status", b"VmSize:") or 0), 0))
    with contextlib.suppress(OSError, ValueError):
        cg = Path("/sys/fs/cgroup")
        top = cg / "memory.max"
        if top.is_file():
            text = top.read_text().strip()
            if text != "max":
                bounds.append(max(int(text) - int((cg / "memory.current").read_text()), 0))
    return min(bounds) if bounds else None


def index_size_problem(size: int) -> str | None:
    """Why an index file of `size` bytes is not decoded (the memory it would take), or None.

    RBTOOL_MAX_INDEX_BYTES, when set, is the largest index file read; otherwise the memory
    decoding would take (INDEX_MEMORY_PER_BYTE per byte) must fit in what is available.
    """
    need = size * INDEX_MEMORY_PER_BYTE
    if os.environ.get(INDEX_BYTES_ENV, "").strip():
        limit = _env_bytes(INDEX_BYTES_ENV, 0)
        if size <= limit:
            return None
        return (
            f"{human_bytes(size)} of JSON would take about {human_bytes(need)} of memory to decode, "
            f"more than {INDEX_BYTES_ENV}={limit} ({human_bytes(limit)} of JSON) allows"
        )
    room = available_memory()
    if room is None or need <= room:
        return None
    return (
        f"{human_bytes(size)} of JSON would take about {human_bytes(need)} of memory to decode, "
        f"more than the {human_bytes(room)} available; free memory or set {INDEX_BYTES_ENV} to the "
        "largest index to read"
    )


def json_size_problem(size: int, max_bytes: int) -> str | None:
    """Why a document of `size` bytes is over its limit `max_bytes`, or None."""
    if size <= max_bytes:
        return None
    return (
        f"{human_bytes(size)}, more than the {human_bytes(max_bytes)} a document of its kind may hold "
        f"(decoding it would take about {human_bytes(size * INDEX_MEMORY_PER_BYTE)} of memory; "
        f"{JSON_BYTES_ENV} raises the limit)"
    )


def json_depth_problem(data: bytes | bytearray | memoryview, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """Why `data` nests deeper than `max_depth`, or None: a flat scan of its bytes.

    Escaped backslashes, then escaped quotes, are dropped (left to right, as a decoder pairs
    them), then everything but quotes and brackets; what is left is counted with numpy: `[`
    and `{` against `]` and `}` where no string is open. For valid JSON the count is the
    nesting; for invalid JSON it is at least the nesting a decoder reaches before it stops at
    the first error (everything before the first backslash outside a string is counted
    exactly). About 0.2 s for a 64 MiB index, no recursion, memory a fraction of the input.
    """
    import numpy as np

    text = bytes(data) if not isinstance(data, bytes) else data
    if b"\\" in text:
        text = text.replace(b"\\\\", b"")
    if b"\\" in text:
        text = text.replace(b'\\"', b"")
    marks = np.frombuffer(text.translate(None, _NOT_MARKS), dtype=np.uint8)
    del text
    depth = 0  # nesting before the chunk
    in_string = 0  # 1 while a string is open at the chunk's start
    for start in range(0, marks.size, _SCAN_CHUNK):
        chunk = marks[start : start + _SCAN_CHUNK]
        quote = chunk == 34
        parity = (np.cumsum(quote, dtype=np.int32) + in_string) & 1
        step = ((chunk == 91) | (chunk == 123)).astype(np.int32) * 2 - 1
        step[quote | parity.astype(bool)] = 0  # a quote, or a bracket inside a string
        running = np.cumsum(step, dtype=np.int32)  # a chunk is below 2**31 marks
        if int(running.max()) + depth > max_depth:
            return f"nests deeper than {max_depth} levels"
        depth, in_string = int(running[-1]) + depth, int(parity[-1])
    return None


_NOT_MARKS = bytes(sorted(set(range(256)) - set(b'"[]{}')))


def json_value_problem(value: Any) -> str | None:
    """Why a decoded document holds an integer beyond 64 bits, or None (walked without recursion)."""
    lo, hi = JSON_INT_RANGE
    stack = [value]
    pop, push = stack.pop, stack.extend
    while stack:
        item = pop()
        kind = type(item)
        if kind is dict:
            push(item.values())
        elif kind is list:
            push(item)
        elif kind is int:
            if not lo <= item < hi:
                return f"holds the integer {_int_text(item)}, beyond the 64-bit range [-2**63, 2**64)"
        elif kind is not str and kind is not float and kind is not bool and item is not None:
            names = getattr(item, "__struct_fields__", ())  # a decoder's struct
            push(getattr(item, n) for n in names)
    return None


def decode_bounded(
    data: bytes | bytearray | memoryview,
    *,
    max_depth: int = MAX_JSON_DEPTH,
    decoder: Any = None,
    check_ints: bool = True,
) -> tuple[Any, str | None]:
    """(value, None) for a document within its depth and integer limits, else (ABSENT, why).

    The size limit is the caller's (it is checked before the bytes are read). `decoder` is
    a msgspec Decoder to use instead of plain JSON. `check_ints=False` leaves the integers to
    a caller that checks every value it reads against a schema (and reads no other).
    """
    import msgspec

    why = json_depth_problem(data, max_depth)
    if why is not None:
        return ABSENT, why
    try:
        with gc_paused():
            value = msgspec.json.decode(data) if decoder is None else decoder.decode(data)
    except msgspec.DecodeError as exc:
        return ABSENT, f"invalid JSON ({_json_error(exc)})"
    except RecursionError:  # pragma: no cover - the depth scan comes first
        return ABSENT, f"nests deeper than {max_depth} levels"
    except MemoryError:
        return ABSENT, f"{human_bytes(len(data))} of JSON ran out of memory while decoding"
    if check_ints:
        why = json_value_problem(value)
        if why is not None:
            return ABSENT, why
    return value, None


def read_json_bytes(
    data: bytes | bytearray | memoryview,
    what: str,
    *,
    max_bytes: int | None = None,
    max_depth: int = MAX_JSON_DEPTH,
    error: type[Exception] | None = None,
) -> Any:
    """The value of the JSON document `data`, or one error naming `what` (a file, a key, a line).

    Refuses, before decoding, a document over `max_bytes` (default: RBTOOL_MAX_JSON_BYTES) or
    nesting deeper than `max_depth`, then any integer beyond 64 bits and any invalid JSON.
    Never RecursionError, MemoryError or a crash: every refusal is `error` (CheckpointError).
    """
    if error is None:
        from rbtool.errors import CheckpointError

        error = CheckpointError
    limit = max_json_bytes() if max_bytes is None else max_bytes
    why = json_size_problem(len(data), limit)
    if why is None:
        value, why = decode_bounded(data, max_depth=max_depth)
        if why is None:
            return value
    raise error(one_line(f"{what}: {why}"))


def read_json_file(
    path: str | os.PathLike[str],
    what: str | None = None,
    *,
    max_bytes: int | None = None,
    max_depth: int = MAX_JSON_DEPTH,
    error: type[Exception] | None = None,
) -> Any:
    """The value of the JSON file `path`, read through read_json_bytes: its size is checked
    before a byte is read, and only a regular file is read (never a FIFO or a device)."""
    if error is None:
        from rbtool.errors import CheckpointError

        error = CheckpointError
    name = str(path) if what is None else what
    limit = max_json_bytes() if max_bytes is None else max_bytes
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise error(one_line(f"{name}: cannot read ({exc.strerror})")) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{name}: {not_a_file(info.st_mode)}, not a regular file")
        why = json_size_problem(info.st_size, limit)
        if why is not None:
            raise error(one_line(f"{name}: {why}"))
        with os.fdopen(os.dup(fd), "rb") as handle:
            data = handle.read(limit + 1)
    except OSError as exc:
        raise error(one_line(f"{name}: cannot read ({exc.strerror})")) from None
    finally:
        os.close(fd)
    return read_json_bytes(data, name, max_bytes=limit, max_depth=max_depth, error=error)


# ---------------------------------------------------------------------- reading
def read_file(
    path: Path,
    missing: str,
    unreadable: str,
    found: list[Problem],
    too_big: Callable[[int], str | None] | None = None,
) -> bytes | None:
    """The bytes of `path`, or None after recording why they could not be read.

    `too_big(size)` says why a file of that size is not read (default: over the limit of a
    small JSON document); it is asked before a byte is read.
    """
    name = path.name
    outside = escapes(path.parent, name)
    if outside is not None:
        found.append(
            problem(unreadable, f"{name}: a symlink to {outside}, outside the checkpoint", file=name)
        )
        return None
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; anything but a regular file
        # (a FIFO, a device such as /dev/zero) is refused before a byte is read
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        found.append(problem(missing, f"{name}: no such file or directory", file=name))
        return None
    except OSError as exc:
        found.append(problem(unreadable, one_line(f"{name}: cannot read ({exc.strerror})"), file=name))
        return None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            found.append(problem(unreadable, f"{name}: is a directory, not a file", file=name))
            return None
        if not stat.S_ISREG(info.st_mode):
            found.append(problem(unreadable, f"{name}: not a regular file", file=name))
            return None
        limit = too_big or functools.partial(json_size_problem, max_bytes=max_json_bytes())
        why = limit(info.st_size)
        if why is not None:
            found.append(problem(unreadable, one_line(f"{name}: {why}"), file=name))
            return None
        with os.fdopen(os.dup(fd), "rb") as handle:
            data = handle.read(info.st_size + 1)  # bounded by what the file says it holds
        why = limit(len(data))  # it grew since
        if why is not None:
            found.append(problem(unreadable, one_line(f"{name}: {why}"), file=name))
            return None
        return data
    except MemoryError:
        found.append(
            problem(unreadable, f"{name}: {human_bytes(info.st_size)} do not fit in memory", file=name)
        )
        return None
    except OSError as exc:
        found.append(problem(unreadable, one_line(f"{name}: cannot read ({exc.strerror})"), file=name))
        return None
    finally:
        os.close(fd)


def parse_json_file(path: Path, missing: str, unreadable: str, found: list[Problem]) -> Any:
    """The parsed JSON of `path`, or ABSENT after recording why it could not be had."""
    data = read_file(path, missing, unreadable, found)
    if data is None:
        return ABSENT
    # the integers are the schema's to check (check_metadata names the key holding one)
    value, why = decode_bounded(data, check_ints=False)
    if why is not None:
        found.append(problem(unreadable, one_line(f"{path.name}: {why}"), file=path.name))
    return value


@dataclass
class EntryColumns:
    """Columns of the valid entries in the index file's order (ids, num_samples, T, B)."""

    ids: np.ndarray
    num_samples: np.ndarray
    t: np.ndarray
    b: np.ndarray


@dataclass
class IndexCheck:
    """What `check_json` made of a directory's metadata and index, and every problem found.

    `entries` holds the valid entries by id (Entry structs on the fast path, else dicts);
    `id_list` the valid ids of trajectory_id_list in order (None if it was unreadable).
    When `ok`, every listed id has a valid entry and the counts agree.
    """

    directory: Path
    index_file: str
    meta: Metadata
    problems: list[Problem] = field(default_factory=list)
    entries: dict[int, Any] = field(default_factory=dict)
    id_list: list[int] | None = None
    raw_list_len: int = 0
    index_readable: bool = False  # trajectory_index was an object
    entries_ok: bool = False  # every listed id has a valid entry
    typed: bool = False  # entries are Entry structs (the fast path)
    invalid_ids: set[int] = field(default_factory=set)
    columns: EntryColumns | None = None  # the fast path's columns, in the file's entry order

    @property
    def ok(self) -> bool:
        return not any(p.severity == ERROR for p in self.problems)

    def first_error(self) -> Problem | None:
        return next((p for p in self.problems if p.severity == ERROR), None)

    def raise_first(self) -> None:
        """Raise the first error as a DamagedCheckpointError naming the directory (what loaders do)."""
        from rbtool.errors import DamagedCheckpointError

        first = self.first_error()
        if first is not None:
            raise DamagedCheckpointError(f"{self.directory}{os.sep}{first.message}", str(self.directory))

    def listed_entries(self) -> list[Any]:
        """The entry of each listed id, in list order (needs entries_ok)."""
        assert self.id_list is not None and self.entries_ok
        return list(map(self.entries.__getitem__, self.id_list))

    def entry_dicts(self) -> dict[int, dict[str, Any]]:
        """The valid entries as plain dicts (known keys only), as loaders hold them."""
        if not self.typed:
            return {tid: normalize_entry(e) for tid, e in self.entries.items()}
        import msgspec

        ids = list(self.entries)
        with gc_paused():
            return dict(zip(ids, msgspec.to_builtins(list(self.entries.values())), strict=True))


class _IndexChecker:
    """The checks of one directory's index file against the rules and the metadata."""

    def __init__(self, result: IndexCheck) -> None:
        self.result = result
        self.found = result.problems
        self.name = result.index_file
        import numpy as np

        self._entry_ids = np.zeros(0, dtype=np.int64)
        self._entry_nums = np.zeros(0, dtype=np.int64)
        self.listed_nums = np.zeros(0, dtype=np.int64)

    def add(self, code: str, message: str, trajectory_id: int | None = None) -> None:
        self.found.append(
            problem(code, f"{self.name}: {message}", trajectory_id=trajectory_id, file=self.name)
        )

    def run(self, data: bytes) -> None:
        why = json_depth_problem(data)
        if why is not None:
            self.add("index_unreadable", why)
            return
        try:
            self._decode(data)
        except MemoryError:
            self.add("index_unreadable", f"{human_bytes(len(data))} of JSON ran out of memory while decoding")

    def _decode(self, data: bytes) -> None:
        typed = _decode_typed(data)
        if typed is not None:
            table, id_list = typed
            if self._accept_typed(table, id_list):
                return
            # well typed but some value is wrong: the exact path over the same structs
            self._check_general(
                {"trajectory_index": {str(k): e for k, e in table.items()}, "trajectory_id_list": id_list}
            )
            return
        import msgspec

        try:
            raw = _decode_loose(data)
        except msgspec.DecodeError:
            try:  # not an object at the top, or not JSON: say which
                raw = decode_json(data)
            except msgspec.DecodeError as exc:
                self.add("index_unreadable", f"invalid JSON ({_json_error(exc)})")
                return
        del data
        self._check_general(raw)

    def _accept_typed(self, table: dict[int, Any], id_list: list[int]) -> bool:
        """Take a typed-decoded index if every entry passes the checks the decoder leaves over.

        The decoder has checked every type and range; left are the key spelling, num_samples
        against the shape, and the strings (file-name-safe weights ids, sha256 digests).
        """
        import numpy as np

        values = list(table.values())
        n = len(values)
        ids = np.fromiter(table, dtype=np.int64, count=n)
        if not np.array_equal(ids, np.fromiter(map(attrgetter("trajectory_id"), values), np.int64, n)):
            return False  # every key must be its entry's id
        shapes = list(map(attrgetter("shape"), values))
        t = np.fromiter(map(itemgetter(0), shapes), dtype=np.int64, count=n)
        b = np.fromiter(map(itemgetter(1), shapes), dtype=np.int64, count=n)
        nums = np.fromiter(map(attrgetter("num_samples"), values), dtype=np.int64, count=n)
        if not np.array_equal(nums, t * b):
            return False
        if not _weights_id_mask(list(map(attrgetter("model_weights_id"), values))).all():
            return False
        result = self.result
        result.index_readable = result.typed = True
        result.entries = table
        self._entry_ids, self._entry_nums = ids, nums
        result.columns = EntryColumns(self._entry_ids, nums, t, b)
        result.id_list = id_list
        result.raw_list_len = len(id_list)
        self._check_list(id_list)
        return True

    def _check_general(self, raw: Any) -> None:
        import numpy as np

        if not isinstance(raw, dict):
            self.add("index_invalid", f"expected a JSON object, got {type(raw).__name__}")
            return
        result = self.result
        table = raw.get("trajectory_index")
        if not isinstance(table, dict):
            self.add("index_invalid", "'trajectory_index' must be an object")
        raw_list = raw.get("trajectory_id_list")
        if not isinstance(raw_list, list):
            self.add("index_invalid", "'trajectory_id_list' must be a list of integer ids")
        else:
            result.raw_list_len = len(raw_list)
            _, good = _int_column(raw_list)
            if not good.all():
                bad = [raw_list[i] for i in np.flatnonzero(~good)]
                self.add(
                    "index_invalid",
                    "'trajectory_id_list' holds values that are not integer ids in [0, 2**63): "
                    f"{preview(repr(v) for v in bad)}",
                )
            result.id_list = list(compress(raw_list, good))
        if isinstance(table, dict):
            result.index_readable = True
            self._check_entries(table)
        if result.id_list is not None:
            self._check_list(result.id_list)

    def _check_entries(self, table: dict[str, Any]) -> None:
        keys, values = list(table), list(table.values())
        ids, nums, ok = _entry_mask(keys, values)
        for pos in map(int, (~ok).nonzero()[0]):
            broken = entry_problems(keys[pos], _plain(values[pos]))
            ok[pos] = not broken
            tid = int(ids[pos]) if ids[pos] >= 0 else None
            for code, message in broken:
                self.add(code, message, trajectory_id=tid)
            if broken and tid is not None:
                self.result.invalid_ids.add(tid)
        self.result.entries = dict(zip(ids[ok].tolist(), compress(values, ok), strict=True))
        self._entry_ids = ids[ok]
        self._entry_nums = nums[ok]

    def _check_list(self, id_list: list[int]) -> None:
        import numpy as np

        result = self.result
        listed = np.asarray(id_list, dtype=np.int64)
        ordered = np.sort(listed)
        repeated = ordered[1:][ordered[1:] == ordered[:-1]]
        for tid in dict.fromkeys(repeated.tolist()):
            self.add("duplicate_id", f"id {tid} appears more than once in trajectory_id_list", tid)
        if not result.index_readable:
            return
        has_entry = np.isin(listed, self._entry_ids)
        for tid in dict.fromkeys(listed[~has_entry].tolist()):
            if tid not in result.invalid_ids:  # an invalid entry was reported already
                self.add("entry_missing", f"trajectory_id_list names id {tid}, which has no entry", tid)
        for tid in self._entry_ids[~np.isin(self._entry_ids, listed)].tolist():
            self.add("entry_unlisted", f"the entry for id {tid} is not in trajectory_id_list", tid)
        result.entries_ok = bool(has_entry.all())
        if result.entries_ok and listed.size:
            order = np.argsort(self._entry_ids)
            pos = np.searchsorted(self._entry_ids[order], listed)
            self.listed_nums = self._entry_nums[order][pos]

    def check_counts(self) -> None:
        """size, total_samples and trajectory_counter against the index."""
        result, meta = self.result, self.result.meta
        ids = result.id_list
        if ids is None:
            return
        n = result.raw_list_len
        total = int(self.listed_nums.sum()) if result.entries_ok else None

        def meta_problem(code: str, message: str) -> None:
            self.found.append(problem(code, f"{METADATA_FILE}: {message}", file=METADATA_FILE))

        if meta.size is not None and meta.size < n and self._metadata_lags(total):
            meta_problem(
                "metadata_behind_index",
                f"counts the first {meta.size} of the {n} listed trajectories (trajectory_counter "
                f"{meta.trajectory_counter}): an index update was interrupted before metadata.json was "
                "rewritten; rbtool recounts on read, and the next write or `rbtool repair` brings it up to "
                "date",
            )
            return
        if meta.size is not None and meta.size != n:
            meta_problem("size_mismatch", f"says size {meta.size} but the index lists {n} ids")
        if meta.total_samples is not None and total is not None and meta.total_samples != total:
            meta_problem(
                "total_samples_mismatch",
                f"says total_samples {meta.total_samples} but the listed entries sum to {total}",
            )
        if meta.trajectory_counter is not None and ids and meta.trajectory_counter <= max(ids):
            meta_problem(
                "counter_too_low",
                f"says trajectory_counter {meta.trajectory_counter} but the index lists id {max(ids)}; "
                "new ids would collide",
            )

    def _metadata_lags(self, total: int | None) -> bool:
        """True if metadata describes exactly a prefix of the list: an interrupted two-file publish."""
        result, meta = self.result, self.result.meta
        assert result.id_list is not None and meta.size is not None
        if total is None or meta.total_samples is None or meta.trajectory_counter is None:
            return False
        if result.raw_list_len != len(result.id_list):
            return False
        old, new = result.id_list[: meta.size], result.id_list[meta.size :]
        old_total = int(self.listed_nums[: meta.size].sum())
        return (
            old_total == meta.total_samples
            and meta.trajectory_counter > max(old, default=-1)
            and meta.trajectory_counter <= min(new)
        )


def _check_legacy(result: IndexCheck) -> None:
    """A stale legacy index beside the current one: readers ignore it, verification warns."""
    directory = result.directory
    legacy = directory / LEGACY_INDEX_FILE
    if result.index_file != INDEX_FILE or not legacy.is_file():
        return
    found: list[Problem] = []
    raw = parse_json_file(legacy, "legacy_index_unreadable", "legacy_index_unreadable", found)
    result.problems.extend(found)
    if raw is ABSENT:
        return
    table = raw.get("trajectory_index") if isinstance(raw, dict) else None
    id_list = raw.get("trajectory_id_list") if isinstance(raw, dict) else None
    if not isinstance(table, dict) or not isinstance(id_list, list):
        result.problems.append(
            problem(
                "legacy_index_unreadable",
                f"{LEGACY_INDEX_FILE}: not an index (needs 'trajectory_index' and 'trajectory_id_list')",
                file=LEGACY_INDEX_FILE,
            )
        )
        return
    if not result.entries_ok or result.id_list is None:
        return
    if id_list != result.id_list:
        result.problems.append(
            problem(
                "legacy_index_mismatch",
                f"{LEGACY_INDEX_FILE}: lists {len(id_list)} ids, {INDEX_FILE} lists {len(result.id_list)}, "
                "or in another order; delete the stale one",
                file=LEGACY_INDEX_FILE,
            )
        )
        return
    current = result.entries
    differing = [
        k
        for k, e in table.items()
        if not (k.isdigit() and int(k) in current and isinstance(e, dict))
        or any(current[int(k)][x] != e.get(x) for x in ENTRY_KEYS)
    ]
    differing += [str(k) for k in current if str(k) not in table]
    if differing:
        result.problems.append(
            problem(
                "legacy_index_mismatch",
                f"{LEGACY_INDEX_FILE}: disagrees with {INDEX_FILE} on entries {preview(differing)}; "
                "delete the stale one",
                file=LEGACY_INDEX_FILE,
            )
        )


def not_a_file(mode: int) -> str:
    """What a name that is no regular file is, from its st_mode: `a directory`, `a FIFO`, ..."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a socket or other special file"


def check_json(directory: str | os.PathLike[str]) -> IndexCheck:
    """Read and check a directory's metadata and index: the one validator of both files.

    Never raises for what the files hold: every problem is in the result (`raise_first`
    turns the first error into the loaders' CheckpointError).
    """
    from rbtool.errors import CheckpointError

    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(
            f"{path}: not a directory; give a checkpoint or buffer directory"
            if path.exists()
            else f"{path}: no such file or directory"
        )
    found: list[Problem] = []
    raw_meta = parse_json_file(path / METADATA_FILE, "metadata_missing", "metadata_unreadable", found)
    meta, meta_problems = check_metadata(raw_meta)
    found += meta_problems
    idx = index_path(path)
    result = IndexCheck(path, idx.name, meta, found)
    data = read_file(idx, "index_missing", "index_unreadable", found, index_size_problem)
    if data is not None:
        checker = _IndexChecker(result)
        checker.run(data)
        del data
        checker.check_counts()
        _check_legacy(result)
    return result


__all__ = [
    "ENTRY_KEYS",
    "ERROR",
    "FORMATS",
    "FORMAT_VERSION",
    "INDEX_FILE",
    "LEGACY_INDEX_FILE",
    "MERGE_MAP_FILE",
    "METADATA_FILE",
    "NOTICE",
    "PROBLEM_CODES",
    "WARNING",
    "IndexCheck",
    "Metadata",
    "Problem",
    "check_json",
    "check_weights_id",
    "entry_problems",
    "parse_trajectory_file_name",
    "trajectory_file_name",
]
