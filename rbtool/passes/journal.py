"""Journals: what lets an interrupted deep pass resume (rbtool.passes.ranks runs the pass).

A journal (`Journal`) is a directory of append-only JSON Lines files, one per process that
ran tasks (`<rank>-<pid>.jsonl`): a header line naming the pass (command, input, options),
then one line per finished file with its key, the identity of each of its files (size,
mtime, inode, ctime, device, and the sha256 the pass computed when the input records one)
and its result. Each line is written whole and fsynced before the task counts as done, so a
crash loses at most the files in flight, and a torn last line is skipped on reading. A
rerun with the same journal takes every recorded result whose files are unchanged and redoes
the rest, on any number of ranks. A journal whose header names another pass is refused.
Results are stored as tagged JSON (dataclasses of the listed types, numpy arrays, tuples,
paths), never as pickles.

A journal never turns damage into OK:

- a result is bound to its files' content: it is taken only while every file's size, mtime,
  inode, device and ctime are the recorded ones. ctime cannot be set back (utime sets mtime
  only), so a rewrite in place that restores size and mtime still changes it; so do a
  chmod or a new hard link, which only costs a reread;
- where the input records a file's sha256, the file is hashed when its result is journaled
  (between two equal identities), and the result is taken only while the recorded hash is
  that one; an entry without a checked hash for such a file is not taken;
- the identity of the file a task reads is taken before and after the task: a file that
  changed meanwhile is not journaled;
- the journal directory and its files must be the current user's own and writable by no
  one else (rbtool makes them 0700 and 0600), and a journal file must be a regular file, not
  a symbolic link: otherwise the whole journal is refused (`JournalError`), since anyone who
  can write it could claim any result.
"""

from __future__ import annotations

import base64
import dataclasses
import errno
import hashlib
import os
import re
import stat
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from rbtool.errors import CheckpointError, JournalError, UsageError
from rbtool.files.fsutil import fsync_dir, make_private_dirs
from rbtool.format import read_json_bytes

JOURNAL_VERSION = 2  # 2: identities with ctime and device, checked hashes


# ------------------------------------------------------------------ results as JSON
def _encode(value: Any, types: dict[str, type]) -> Any:
    import numpy as np

    if value is None or (isinstance(value, (bool, int, float, str)) and not isinstance(value, np.generic)):
        return value
    if isinstance(value, list):
        return [_encode(v, types) for v in value]
    if isinstance(value, tuple):
        return {"t": [_encode(v, types) for v in value]}
    if isinstance(value, dict):
        return {"d": [[_encode(k, types), _encode(v, types)] for k, v in value.items()]}
    if isinstance(value, Path):
        return {"p": str(value)}
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value)  # tobytes() is in C order whatever the strides
        return {
            "a": [array.dtype.str, list(array.shape), base64.b64encode(array.tobytes()).decode()],
            "s": isinstance(value, np.generic),
        }
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        name = type(value).__name__
        if types.get(name) is not type(value):
            raise JournalError(f"a result of type {name} cannot be journaled (not among the pass's types)")
        return {
            "c": name,
            "f": {f.name: _encode(getattr(value, f.name), types) for f in dataclasses.fields(value)},
        }
    raise JournalError(f"a result of type {type(value).__name__} cannot be journaled")


def _decode(value: Any, types: dict[str, type]) -> Any:
    import numpy as np

    if isinstance(value, list):
        return [_decode(v, types) for v in value]
    if not isinstance(value, dict):
        return value
    if "t" in value:
        return tuple(_decode(v, types) for v in value["t"])
    if "d" in value:
        return {_decode(k, types): _decode(v, types) for k, v in value["d"]}
    if "p" in value:
        return Path(value["p"])
    if "a" in value:
        dtype, shape, data = value["a"]
        if np.dtype(dtype).hasobject:
            raise ValueError("object arrays are not journaled")
        array = np.frombuffer(base64.b64decode(data), dtype=np.dtype(dtype)).reshape(shape).copy()
        return array[()] if value.get("s") else array
    if "c" in value:
        cls = types.get(value["c"])
        if cls is None:
            raise ValueError(f"unknown result type {value['c']!r}")
        return cls(**{k: _decode(v, types) for k, v in value["f"].items()})
    raise ValueError("unknown tag")


# ------------------------------------------------------------------ identities
def file_identity(path: Path) -> list[int] | None:
    """What tells a file apart from a changed one: size, mtime (ns), inode, ctime (ns) and
    device; None if it is gone. ctime changes with every write, chmod or link and cannot be
    set back, so a rewrite that restores size and mtime still shows."""
    try:
        st = path.stat()
    except OSError:
        return None
    return _identity_of(st)


def _identity_of(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns, st.st_dev]


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:
        return None


def _unchanged(before: os.stat_result, after: os.stat_result | None) -> bool:
    """`after` is the file `before` was, unwritten: a ctime that moved is only allowed with a
    link count that moved too (the pass itself linked the file, as convert does)."""
    if after is None:
        return False
    same = (before.st_size, before.st_mtime_ns, before.st_ino, before.st_dev) == (
        after.st_size,
        after.st_mtime_ns,
        after.st_ino,
        after.st_dev,
    )
    return same and (before.st_ctime_ns == after.st_ctime_ns or before.st_nlink != after.st_nlink)


def _sha256_of(path: Path) -> str | None:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()


def _settled(
    files: Sequence[Path], hashes: Sequence[str | None], before: os.stat_result | None
) -> list[Any] | None:
    """The identities to journal for a task's `files` once it is done, each `[*file_identity, sha256]`
    (the sha256 computed here, between two equal identities, for a file whose input records
    one; else None), None for a gone file; None when the file the task read changed during the
    task or a file changed while it was hashed."""
    if before is not None and not _unchanged(before, _stat(files[0])):
        return None
    identities: list[Any] = []
    for i, path in enumerate(files):
        first = _stat(path)
        if first is None:
            identities.append(None)
            continue
        digest = None
        if i < len(hashes) and hashes[i] is not None:
            digest = _sha256_of(path)
            last = _stat(path)
            if digest is None or last is None or _identity_of(last) != _identity_of(first):
                return None
        identities.append([*_identity_of(first), digest])
    return identities


def _expected(path: Path, recorded: str | None) -> list[Any] | None:
    """What a journal entry must hold for `path` to be taken: its identity now and the hash the
    input records (a result whose file was not hashed, or hashed to another value, is not)."""
    identity = file_identity(path)
    return None if identity is None else [*identity, recorded]


# ------------------------------------------------------------------ journals
def _refuse_foreign(st: os.stat_result, path: Path, what: str) -> None:
    """A journal directory or file must be this user's own and writable by no one else."""
    if st.st_uid != os.geteuid():
        raise JournalError(
            f"{path}: the journal {what} belongs to another user (uid {st.st_uid}), who could have "
            "written any result into it; use a journal directory of your own"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise JournalError(
            f"{path}: the journal {what} can be written by group or others (mode "
            f"{stat.S_IMODE(st.st_mode):04o}), who could have written any result into it; make it "
            "private (chmod go-w) or use another journal directory"
        )


@dataclass
class Journal:
    """Where a pass records its finished files: `directory`, for the pass named by `identity`.

    After a pass, `files` counts its tasks and `reused` those whose result came from the journal.
    """

    directory: Path
    identity: dict[str, Any]
    reused: int = field(default=0, compare=False)
    files: int = field(default=0, compare=False)

    def header(self) -> bytes:
        return orjson.dumps({"rbtool_journal": JOURNAL_VERSION, **self.identity}) + b"\n"

    def counts(self) -> dict[str, int]:
        """What a report says of the journal: `{"reused": ..., "files": ...}`."""
        return {"reused": self.reused, "files": self.files}

    def _contents(self) -> list[tuple[Path, bytes]]:
        """Each journal file's path and bytes, read through the directory checked as private."""
        try:
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise JournalError(f"{self.directory}: cannot read the journal: {exc.strerror or exc}") from None
        try:
            _refuse_foreign(os.fstat(fd), self.directory, "directory")
            found = []
            for name in sorted(n for n in os.listdir(fd) if n.endswith(".jsonl")):
                path = self.directory / name
                try:
                    f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
                except OSError as exc:
                    if exc.errno == errno.ELOOP:
                        raise JournalError(
                            f"{self.directory}: the journal file {name} is a symbolic link; a journal "
                            "file is read only as a regular file of the directory"
                        ) from None
                    raise JournalError(f"{path}: cannot read the journal: {exc.strerror or exc}") from None
                try:
                    st = os.fstat(f)
                    if not stat.S_ISREG(st.st_mode):
                        raise JournalError(f"{self.directory}: the journal file {name} is not a regular file")
                    _refuse_foreign(st, path, "file")
                    with os.fdopen(f, "rb", closefd=False) as handle:
                        found.append((path, handle.read()))
                except OSError as exc:
                    raise JournalError(f"{path}: cannot read the journal: {exc.strerror or exc}") from None
                finally:
                    os.close(f)
            return found
        except OSError as exc:
            raise JournalError(f"{self.directory}: cannot read the journal: {exc.strerror or exc}") from None
        finally:
            os.close(fd)

    def load(self) -> dict[str, list[tuple[Any, Any]]]:
        """Every recorded file, by key: each (identity then, encoded result) recorded for it, in
        every journal file (a file read again by a later pass has several; the one whose identity
        is the file's now counts, whichever journal file holds it). Refuses foreign journals, and
        journals that others could have written; files of an older journal version (whose
        identities lack ctime and hashes) are left out, so their files are read again."""
        done: dict[str, list[tuple[Any, Any]]] = {}
        mine = orjson.loads(self.header())
        for path, data in self._contents():
            lines = data.split(b"\n")
            if lines == [b""]:
                continue  # made, never written to
            try:
                head = read_json_bytes(lines[0], f"{path}: line 1")
            except CheckpointError:
                head = None
            if (
                isinstance(head, dict)
                and head.get("rbtool_journal") != JOURNAL_VERSION
                and {k: v for k, v in head.items() if k != "rbtool_journal"} == self.identity
            ):
                continue  # this pass, by an older rbtool: nothing in it is taken
            if head != mine:
                theirs = head if isinstance(head, dict) else "not an rbtool journal"
                raise JournalError(
                    f"{path}: this journal belongs to another pass ({_describe(theirs)}), not to this one "
                    f"({_describe(mine)}); use another journal directory, or remove this one"
                )
            for line in lines[1:]:
                try:
                    row = read_json_bytes(line, str(path))  # bounded: nesting, size, 64-bit ints
                    done.setdefault(row["key"], []).append((row["identity"], row["result"]))
                except (CheckpointError, KeyError, TypeError):
                    continue  # a torn last line (a crash mid-write) or an empty one
        return done

    def recorded(
        self, jobs: Sequence[tuple[str, Sequence[Path], Sequence[str | None]]], types: dict[str, type]
    ) -> dict[int, Any]:
        """The journaled result of each job `(key, files, recorded sha256 of each file)` that can be
        taken, by position in `jobs`; `types` are the dataclasses a result may hold.

        A recorded result is taken only while each of its files has the recorded identity (and,
        where the input records a sha256, was hashed to it when journaled); one that does not
        decode (a line damaged in some other way than torn) is not taken: its file is done again.
        """
        recorded: dict[int, Any] = {}
        done = self.load()
        for i, (key, files, hashes) in enumerate(jobs):
            entries = done.get(key)
            if not entries:
                continue
            wanted = [_expected(p, hashes[k] if k < len(hashes) else None) for k, p in enumerate(files)]
            for identity, result in entries:
                if identity != wanted:
                    continue
                try:
                    recorded[i] = _decode(result, types)
                    break
                except (ValueError, TypeError, KeyError, IndexError, AttributeError):
                    continue
        return recorded

    def writer(self, rank: int, types: dict[str, type]) -> JournalWriter:
        """What records rank `rank`'s finished tasks, whose results may hold the dataclasses `types`."""
        return JournalWriter(self, rank, types)


def _describe(identity: Any) -> str:
    if not isinstance(identity, dict):
        return str(identity)
    shown = {k: v for k, v in identity.items() if k != "rbtool_journal"}
    return ", ".join(f"{k} {v}" for k, v in shown.items())


class JournalWriter:
    """Appends one fsynced line per finished file to this process's own journal file.

    It pickles (it goes to worker processes with each task); the open file lives in the
    process (`_OPEN`), so every task a process runs appends to the same file.
    """

    def __init__(self, journal: Journal, rank: int, types: dict[str, type]) -> None:
        self.journal = journal
        self.rank = rank
        self.types = types

    @staticmethod
    def watch(files: Sequence[Path]) -> os.stat_result | None:
        """The state of the file a task reads first, taken before the task (see `record`)."""
        return _stat(files[0]) if files else None

    def record(
        self,
        key: str,
        files: Sequence[Path],
        hashes: Sequence[str | None],
        before: os.stat_result | None,
        result: Any,
    ) -> None:
        """Journal `result` under `key`, bound to the identity of `files` (and the sha256 of those
        with a recorded one); `before` is what `watch` saw before the task."""
        identity = _settled(files, hashes, before)
        if identity is not None:  # else the file changed while it was read: not journaled
            row = {"key": key, "identity": identity, "result": _encode(result, self.types)}
            self._append(orjson.dumps(row) + b"\n")

    def _append(self, line: bytes) -> None:
        slot = (str(self.journal.directory), self.rank, os.getpid())
        if slot not in _OPEN:
            name = f"{self.rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
            path = self.journal.directory / name
            try:
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW
                fd = os.open(path, flags, 0o600)
                _write_all(fd, self.journal.header())
                os.fsync(fd)
                fsync_dir(self.journal.directory)
            except OSError as exc:
                raise JournalError(f"{path}: cannot write the journal: {exc.strerror or exc}") from None
            _OPEN[slot] = fd
        try:
            _write_all(_OPEN[slot], line)
            os.fsync(_OPEN[slot])
        except OSError as exc:
            raise JournalError(
                f"{self.journal.directory}: cannot write the journal: {exc.strerror or exc}"
            ) from None


_OPEN: dict[tuple[str, int, int], int] = {}  # (journal, rank, pid) -> the open journal file


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def open_journal(directory: str | os.PathLike[str] | None, identity: dict[str, Any]) -> Journal | None:
    """The journal in `directory` (made 0700 if needed) for the pass `identity`, or None without a
    directory. A directory another user owns, or that group or others can write, is refused."""
    if directory is None:
        return None
    path = Path(directory)
    source = identity.get("input")
    if source is not None and path.absolute().resolve().is_relative_to(Path(source).resolve()):
        raise UsageError(
            f"{path}: a journal is never written into its input {source}; choose another directory"
        )
    try:
        make_private_dirs(path)
        info = path.stat()
    except OSError as exc:
        raise JournalError(f"{path}: cannot make the journal directory: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise JournalError(f"{path}: not a directory, so it cannot hold a journal")
    _refuse_foreign(info, path, "directory")
    return Journal(path, identity)


def journal_note(counts: dict[str, int], noun: str = "files") -> str:
    """The report's line on a journal: `12 of 40 files from the journal`."""
    return f"{counts['reused']} of {counts['files']} {noun} from the journal"


def input_journal(directory: str | os.PathLike[str] | None, source: str | os.PathLike[str]) -> Path | None:
    """The journal of one input among several given one journal directory: its own subdirectory
    `<input name>-<digest of its absolute path>`, so the journals of different inputs stay apart
    and a rerun over the same inputs, in any order, finds each one's own."""
    if directory is None:
        return None
    absolute = os.path.abspath(source)
    digest = hashlib.sha256(absolute.encode()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9._-]", "_", Path(absolute).name) or "root"
    return Path(directory) / f"{name}-{digest}"


# ------------------------------------------------------------------ keys
def task_key(name: str, identity: Any) -> str:
    """A task's journal key: its name and a digest of everything it carries (a changed entry is redone)."""
    return f"{name}#{hashlib.sha256(repr(identity).encode()).hexdigest()[:20]}"


def _absolute(value: Any) -> Any:
    """`value` with every path in it (dataclass fields, tuples, lists) made absolute, for keys
    that do not depend on the working directory."""
    if isinstance(value, Path):
        return os.path.abspath(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_absolute(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, *(_absolute(getattr(value, f.name)) for f in dataclasses.fields(value)))
    return value


def job_key(task: Any, describe: Callable[[Any], str], files: Callable[[Any], Sequence[Path]] | None) -> str:
    """The journal key of `task`: its first file's absolute path (else its name), and a digest of
    the task with its paths absolute, so that a rerun from another directory finds its files."""
    named = list(files(task)) if files is not None else []
    return task_key(os.path.abspath(named[0]) if named else describe(task), _absolute(task))


__all__ = [
    "JOURNAL_VERSION",
    "Journal",
    "JournalWriter",
    "file_identity",
    "input_journal",
    "job_key",
    "journal_note",
    "open_journal",
    "task_key",
]
