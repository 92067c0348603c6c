"""Metadata and trajectory index: read, validate and write them; id and rank arithmetic.

This module never imports torch: index-only commands stay fast.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from rbtool.errors import CheckpointError, UsageError
from rbtool.fsutil import write_bytes_atomic

if TYPE_CHECKING:
    import numpy as np

METADATA_FILE = "metadata.json"
INDEX_FILE = "trajectory_index.json"
LEGACY_INDEX_FILE = "trajector_index.json"
FORMATS = ("pt", "pkl")
FORMAT_VERSION = 1

# Keys the reference implementation writes into each entry; rbtool adds the optional ones.
ENTRY_KEYS = ("num_samples", "trajectory_id", "max_episode_length", "shape", "model_weights_id")
OPTIONAL_ENTRY_KEYS = ("uuid", "file_bytes", "sha256")

_SAFE_WEIGHTS_ID = re.compile(r"[A-Za-z0-9._-]*")
TRAJECTORY_FILE_RE = re.compile(r"^trajectory_(\d+)_([A-Za-z0-9._-]*)\.(pt|pkl)$")


def check_weights_id(value: object, where: str) -> str:
    """Return `value` if it is a file-name-safe model_weights_id, else raise naming `where`."""
    if not isinstance(value, str):
        raise CheckpointError(f"{where}: model_weights_id must be a string, got {value!r}")
    if not _SAFE_WEIGHTS_ID.fullmatch(value) or ".." in value:
        raise CheckpointError(
            f"{where}: model_weights_id {value!r} is not file-name safe "
            "(allowed: letters, digits, '.', '_', '-', and no '..')"
        )
    return value


def trajectory_file_name(trajectory_id: int, model_weights_id: str, fmt: str) -> str:
    """The file name of a trajectory, as the reference implementation spells it."""
    return f"trajectory_{trajectory_id}_{model_weights_id}.{fmt}"


def parse_trajectory_file_name(name: str) -> tuple[int, str, str] | None:
    """(id, model_weights_id, format) parsed from a trajectory file name, or None."""
    match = TRAJECTORY_FILE_RE.match(name)
    if match is None:
        return None
    return int(match.group(1)), match.group(2), match.group(3)


def rank_bounds(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous block when n items are split over world_size ranks.

    The first `n % world_size` ranks take one item more.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"world_size must be an integer >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise UsageError(f"rank must be in [0, {world_size}), got {rank!r}")
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def window_of(id_list: Sequence[int], window_size: int) -> list[int]:
    """The last `window_size` ids of the list; all of them when 0 or the list is shorter."""
    if window_size < 0:
        raise UsageError(f"window size must be >= 0, got {window_size}")
    if window_size == 0 or window_size >= len(id_list):
        return list(id_list)
    return list(id_list[len(id_list) - window_size :])


@dataclass
class Index:
    """A checkpoint's metadata and trajectory index, held in memory.

    `entries` maps id to the entry as stored in JSON; `id_list` is the insertion order.
    `extra_metadata` keeps metadata keys rbtool does not interpret, so they survive a rewrite.
    """

    entries: dict[int, dict[str, Any]] = field(default_factory=dict)
    id_list: list[int] = field(default_factory=list)
    trajectory_counter: int = 0
    seed: int | None = 1234
    trajectory_format: str = "pt"
    extra_metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.id_list)

    @property
    def total_samples(self) -> int:
        entries = self.entries
        return sum(entries[i]["num_samples"] for i in self.id_list)

    def file_name(self, trajectory_id: int) -> str:
        entry = self.entries[trajectory_id]
        return trajectory_file_name(trajectory_id, entry["model_weights_id"], self.trajectory_format)

    def next_counter(self) -> int:
        """The smallest counter that keeps ids unique: above every listed id."""
        return max(self.id_list, default=-1) + 1

    def subset(self, ids: Iterable[int], trajectory_counter: int | None = None) -> Index:
        """A new index listing only `ids` (in the given order)."""
        ids = list(ids)
        counter = self.trajectory_counter if trajectory_counter is None else trajectory_counter
        return Index(
            entries={i: self.entries[i] for i in ids},
            id_list=ids,
            trajectory_counter=counter,
            seed=self.seed,
            trajectory_format=self.trajectory_format,
            extra_metadata=dict(self.extra_metadata),
        )

    def rank_block(self, world_size: int, rank: int) -> Index:
        """What a distributed load by `rank` keeps: its block, counter = block's max id + 1."""
        start, end = rank_bounds(len(self.id_list), world_size, rank)
        ids = self.id_list[start:end]
        return self.subset(ids, trajectory_counter=max(ids, default=-1) + 1)

    def state(self) -> dict[str, Any]:
        """The four numbers a load reports, as a JSON-ready dict."""
        return {
            "size": self.size,
            "total_samples": self.total_samples,
            "trajectory_counter": self.trajectory_counter,
            "trajectory_id_list": list(self.id_list),
        }

    def metadata_json(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "trajectory_format": self.trajectory_format,
            "size": self.size,
            "total_samples": self.total_samples,
            "trajectory_counter": self.trajectory_counter,
            "seed": self.seed,
        }
        for key, value in self.extra_metadata.items():
            meta.setdefault(key, value)
        meta["format_version"] = FORMAT_VERSION
        return meta

    def index_json(self) -> dict[str, Any]:
        return {
            "trajectory_index": {str(i): self.entries[i] for i in self.id_list},
            "trajectory_id_list": list(self.id_list),
        }


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from None


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


def _load_json(path: Path) -> Any:
    data = _read_bytes(path)
    with gc_paused():
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise CheckpointError(f"{path}: invalid JSON ({exc})") from None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def index_path(directory: Path) -> Path:
    """The index file of a directory: the current name, else the legacy misspelt one."""
    path = directory / INDEX_FILE
    if not path.exists() and (directory / LEGACY_INDEX_FILE).exists():
        return directory / LEGACY_INDEX_FILE
    return path


def is_checkpoint_dir(directory: Path) -> bool:
    """True if `directory` holds metadata or an index (so it is meant as a checkpoint)."""
    return (directory / METADATA_FILE).is_file() or index_path(directory).is_file()


def parse_metadata(meta: Any, where: Path) -> dict[str, Any]:
    """Validate metadata.json contents; returns the dict."""
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where}: expected a JSON object, got {type(meta).__name__}")
    fmt = meta.get("trajectory_format", "pt")
    if fmt not in FORMATS:
        raise CheckpointError(f"{where}: trajectory_format must be 'pt' or 'pkl', got {fmt!r}")
    for key in ("size", "total_samples", "trajectory_counter"):
        if key in meta and not (_is_int(meta[key]) and meta[key] >= 0):
            raise CheckpointError(f"{where}: {key} must be a non-negative integer, got {meta[key]!r}")
    seed = meta.get("seed")
    if seed is not None and not _is_int(seed):
        raise CheckpointError(f"{where}: seed must be an integer or null, got {seed!r}")
    return meta


def parse_entry(key: str, entry: Any, where: Path) -> tuple[int, dict[str, Any]]:
    """Validate one index entry; returns (id, entry)."""
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: entry {key!r} is not an object")
    try:
        tid = int(key)
    except ValueError:
        raise CheckpointError(f"{where}: entry key {key!r} is not an integer id") from None
    if tid < 0 or str(tid) != key:
        raise CheckpointError(f"{where}: entry key {key!r} is not a canonical non-negative id")
    for name in ENTRY_KEYS:
        if name not in entry:
            raise CheckpointError(f"{where}: entry {tid} lacks {name!r}")
    if entry["trajectory_id"] != tid:
        raise CheckpointError(
            f"{where}: entry {tid} has trajectory_id {entry['trajectory_id']!r}, expected {tid}"
        )
    shape = entry["shape"]
    if not (isinstance(shape, list) and len(shape) >= 2 and all(_is_int(d) and d >= 0 for d in shape)):
        raise CheckpointError(f"{where}: entry {tid} has an invalid shape {shape!r}")
    num = entry["num_samples"]
    if not (_is_int(num) and num >= 0):
        raise CheckpointError(f"{where}: entry {tid} has an invalid num_samples {num!r}")
    if num != shape[0] * shape[1]:
        raise CheckpointError(
            f"{where}: entry {tid} has num_samples {num} but shape {shape} gives {shape[0] * shape[1]}"
        )
    mel = entry["max_episode_length"]
    if mel is not None and not _is_int(mel):
        raise CheckpointError(f"{where}: entry {tid} has an invalid max_episode_length {mel!r}")
    check_weights_id(entry["model_weights_id"], f"{where}: entry {tid}")
    return tid, entry


def _entries_look_valid(table: dict[str, Any]) -> bool:
    """A vectorised check that every entry is well formed; False sends the caller to the slow path.

    The slow path (parse_entry per entry) finds and names the first bad entry.
    """
    import numpy as np

    values = list(table.values())
    if not values:
        return True
    if set(map(type, values)) != {dict}:
        return False
    try:
        columns = {key: [e[key] for e in values] for key in ENTRY_KEYS}
    except KeyError:
        return False
    for key in ("num_samples", "trajectory_id"):
        if set(map(type, columns[key])) != {int}:
            return False
    if not set(map(type, columns["max_episode_length"])) <= {int, type(None)}:
        return False
    if set(map(type, columns["model_weights_id"])) != {str}:
        return False
    shapes = columns["shape"]
    if set(map(type, shapes)) != {list} or min(map(len, shapes)) < 2:
        return False
    if {type(d) for s in shapes for d in s} != {int}:
        return False
    try:
        keys = np.fromiter(map(int, table.keys()), dtype=np.int64, count=len(values))
        ids = np.fromiter(columns["trajectory_id"], dtype=np.int64, count=len(values))
        nums = np.fromiter(columns["num_samples"], dtype=np.int64, count=len(values))
        t = np.fromiter((s[0] for s in shapes), dtype=np.int64, count=len(values))
        b = np.fromiter((s[1] for s in shapes), dtype=np.int64, count=len(values))
    except (ValueError, OverflowError):
        return False
    canonical = all(key == str(k) for key, k in zip(table.keys(), keys.tolist(), strict=True))
    if not canonical or (keys < 0).any() or (keys != ids).any() or (nums < 0).any():
        return False
    if (t < 0).any() or (b < 0).any() or (nums != t * b).any():
        return False
    return all(_SAFE_WEIGHTS_ID.fullmatch(m) and ".." not in m for m in set(columns["model_weights_id"]))


def parse_index(raw: Any, where: Path) -> tuple[dict[int, dict[str, Any]], list[int]]:
    """Validate trajectory_index.json contents; returns (entries, id_list)."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    table = raw.get("trajectory_index")
    id_list = raw.get("trajectory_id_list")
    if not isinstance(table, dict):
        raise CheckpointError(f"{where}: 'trajectory_index' must be an object")
    if not isinstance(id_list, list) or set(map(type, id_list)) - {int}:
        raise CheckpointError(f"{where}: 'trajectory_id_list' must be a list of integer ids")
    if _entries_look_valid(table):
        entries = dict(zip(map(int, table.keys()), table.values(), strict=True))
    else:
        entries = dict(parse_entry(key, entry, where) for key, entry in table.items())
    if len(set(id_list)) != len(id_list):
        seen: set[int] = set()
        dupes = sorted({i for i in id_list if i in seen or seen.add(i)})  # type: ignore[func-returns-value]
        raise CheckpointError(f"{where}: trajectory_id_list repeats ids {dupes[:20]}")
    missing = [i for i in id_list if i not in entries]
    if missing:
        raise CheckpointError(f"{where}: trajectory_id_list names ids without an entry: {missing[:20]}")
    return entries, id_list


def _metadata_and_index_path(directory: Path) -> tuple[dict[str, Any], Path]:
    """A directory's validated metadata, and the path of its index file (current or legacy)."""
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    meta_path = directory / METADATA_FILE
    return parse_metadata(_load_json(meta_path), meta_path), index_path(directory)


def read_index(directory: str | os.PathLike[str]) -> Index:
    """Read and validate a checkpoint or buffer directory's metadata and index.

    `size` and `total_samples` are recounted from the index rather than trusted;
    `trajectory_counter` is raised above every listed id if metadata says less.
    """
    meta, idx_path = _metadata_and_index_path(Path(directory))
    entries, id_list = parse_index(_load_json(idx_path), idx_path)
    known = {"trajectory_format", "size", "total_samples", "trajectory_counter", "seed", "format_version"}
    index = Index(
        entries=entries,
        id_list=id_list,
        trajectory_counter=0,
        seed=meta.get("seed"),
        trajectory_format=meta.get("trajectory_format", "pt"),
        extra_metadata={k: v for k, v in meta.items() if k not in known},
    )
    index.trajectory_counter = max(meta.get("trajectory_counter", 0), index.next_counter())
    return index


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj)


def write_index(directory: str | os.PathLike[str], index: Index) -> None:
    """Publish index then metadata, each atomically; files they name must already be complete."""
    directory = Path(directory)
    write_bytes_atomic(directory / INDEX_FILE, dumps(index.index_json()), sync_dir=False)
    write_bytes_atomic(directory / METADATA_FILE, dumps(index.metadata_json()))


# --------------------------------------------------------------------------- columns
# Reading a million-entry index as Python dicts costs seconds; decoding into slotted structs
# validates types in C and leaves columns that numpy can check and summarise at once.


@functools.cache
def _index_decoder() -> Any:
    """A msgspec decoder for trajectory_index.json into slotted structs (built on first use)."""
    import msgspec

    entry = msgspec.defstruct(
        "Entry",
        [
            ("num_samples", int),
            ("trajectory_id", int),
            ("max_episode_length", int | None),
            ("shape", list[int]),
            ("model_weights_id", str),
            # uuid is not declared: msgspec skips it without building a string per entry
            ("file_bytes", int | None, None),
            ("sha256", str | None, None),
        ],
        gc=False,
    )
    index_file = msgspec.defstruct(
        "IndexFile",
        [("trajectory_index", dict[str, entry]), ("trajectory_id_list", list[int])],  # type: ignore[valid-type]
        gc=False,
    )
    return msgspec.json.Decoder(index_file)


@dataclass
class IndexColumns:
    """An index as numpy columns, one row per entry of `trajectory_index` (in file order).

    `keys` are the entry keys as ints; `shape_t`/`shape_b` the first two dims and `shape_len`
    the number of dims; `max_episode_length` and `file_bytes` are -1 where absent.
    """

    keys: np.ndarray
    trajectory_id: np.ndarray
    num_samples: np.ndarray
    shape_t: np.ndarray
    shape_b: np.ndarray
    shape_len: np.ndarray
    max_episode_length: np.ndarray
    file_bytes: np.ndarray
    has_sha256: np.ndarray
    model_weights_id: list[str]
    id_list: np.ndarray
    metadata: dict[str, Any]
    index_file: Path

    def __len__(self) -> int:
        return len(self.keys)


def read_columns(directory: str | os.PathLike[str]) -> IndexColumns:
    """Read metadata and index as columns, checking JSON types but not cross-entry consistency.

    Raises CheckpointError (one line, naming the file) for unreadable JSON or wrong types;
    everything else (sums, duplicates, shapes) is left to the caller to check with numpy.
    """
    import msgspec
    import numpy as np

    meta, idx_path = _metadata_and_index_path(Path(directory))
    data = _read_bytes(idx_path)
    with gc_paused():
        try:
            raw = _index_decoder().decode(data)
        except msgspec.DecodeError as exc:
            raise CheckpointError(f"{idx_path}: invalid index ({exc})") from None
    table = raw.trajectory_index
    n = len(table)
    values = list(table.values())
    try:
        keys = np.fromiter(map(int, table.keys()), dtype=np.int64, count=n)
    except (ValueError, OverflowError):
        bad = next(k for k in table if not k.lstrip("-").isdigit() or not -(2**63) <= int(k) < 2**63)
        raise CheckpointError(f"{idx_path}: entry key {bad!r} is not an integer id in range") from None

    def column(values_iter: Iterable[int]) -> np.ndarray:
        try:
            return np.fromiter(values_iter, dtype=np.int64, count=n)
        except OverflowError:
            raise CheckpointError(f"{idx_path}: an integer in the index is out of range") from None

    def optional(name: str) -> np.ndarray:
        """A column whose JSON value may be null: -1 there."""
        items = list(map(attrgetter(name), values))
        if None not in items:
            return column(items)
        return column(-1 if v is None else v for v in items)

    try:
        id_list = np.asarray(raw.trajectory_id_list, dtype=np.int64)
    except OverflowError:
        raise CheckpointError(f"{idx_path}: trajectory_id_list holds an id out of range") from None
    # map(attrgetter) and itemgetter keep the per-entry work in C: a million entries in ~0.1 s.
    shapes = list(map(attrgetter("shape"), values))
    shape_len = column(map(len, shapes))
    if n and shape_len.min() >= 2:
        shape_t, shape_b = column(map(itemgetter(0), shapes)), column(map(itemgetter(1), shapes))
    else:
        shape_t = column(s[0] if s else -1 for s in shapes)
        shape_b = column(s[1] if len(s) > 1 else -1 for s in shapes)
    return IndexColumns(
        keys=keys,
        trajectory_id=column(map(attrgetter("trajectory_id"), values)),
        num_samples=column(map(attrgetter("num_samples"), values)),
        shape_t=shape_t,
        shape_b=shape_b,
        shape_len=shape_len,
        max_episode_length=optional("max_episode_length"),
        file_bytes=optional("file_bytes"),
        has_sha256=np.fromiter(map(bool, map(attrgetter("sha256"), values)), dtype=bool, count=n),
        model_weights_id=list(map(attrgetter("model_weights_id"), values)),
        id_list=id_list,
        metadata=meta,
        index_file=idx_path,
    )


def init_buffer_dir(directory: Path, index: Index) -> None:
    """Make `directory` a valid (empty) buffer directory before anything is written into it.

    A new directory is built beside its final name and renamed into place, so no reader ever
    sees an index without metadata. If another process creates it meanwhile, theirs is kept.
    """
    import shutil

    from rbtool.fsutil import new_staging_dir

    if not directory.exists():
        staging = new_staging_dir(directory)
        try:
            write_index(staging, index)
            os.rename(staging, directory)
        except OSError:
            if not directory.is_dir():
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    if not is_checkpoint_dir(directory):
        write_index(directory, index)
