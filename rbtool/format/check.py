"""The one validator of metadata.json and trajectory_index.json: `check_json`.

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

import functools
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import compress
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rbtool.format.bounded import (
    ABSENT,
    decode_bounded,
    decode_json,
    gc_paused,
    human_bytes,
    index_size_problem,
    json_depth_problem,
    json_error,
    json_size_problem,
    max_json_bytes,
)
from rbtool.format.decode import decode_loose, decode_typed
from rbtool.format.entries import (
    entry_mask,
    entry_problems,
    int_column,
    normalize_entry,
    plain,
    weights_id_mask,
)
from rbtool.format.metadata import Metadata, check_metadata
from rbtool.format.names import INDEX_FILE, LEGACY_INDEX_FILE, METADATA_FILE, escapes, index_path
from rbtool.format.problems import ERROR, Problem, one_line, preview, problem
from rbtool.format.schema import ENTRY_KEYS

if TYPE_CHECKING:
    import numpy as np


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
        try:
            # an index of rbtool's keys only nests four deep (decode_typed): its nesting
            # needs no scan; any other document is scanned before it is decoded
            typed = decode_typed(data, strict=True)
            if typed is None:
                why = json_depth_problem(data)
                if why is not None:
                    self.add("index_unreadable", why)
                    return
                typed = decode_typed(data)
            self._decode(data, typed)
        except MemoryError:
            self.add("index_unreadable", f"{human_bytes(len(data))} of JSON ran out of memory while decoding")

    def _decode(self, data: bytes, typed: tuple[dict[int, Any], list[int]] | None) -> None:
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
            raw = decode_loose(data)
        except msgspec.DecodeError:
            try:  # not an object at the top, or not JSON: say which
                raw = decode_json(data)
            except msgspec.DecodeError as exc:
                self.add("index_unreadable", f"invalid JSON ({json_error(exc)})")
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
        if not weights_id_mask(list(map(attrgetter("model_weights_id"), values))).all():
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
            _, good = int_column(raw_list)
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
        ids, nums, ok = entry_mask(keys, values)
        for pos in map(int, (~ok).nonzero()[0]):
            broken = entry_problems(keys[pos], plain(values[pos]))
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


def check_json(directory: str | os.PathLike[str]) -> IndexCheck:
    """Read and check a directory's metadata and index: the one validator of both files.

    Never raises for what the files hold: every problem is in the result (`raise_first`
    turns the first error into the loaders' CheckpointError).
    """
    from rbtool.errors import CheckpointError, CheckpointNotFoundError

    path = Path(directory)
    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory; give a checkpoint or buffer directory")
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
