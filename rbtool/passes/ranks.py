"""Deep passes over ranks (torchrun), and journals that let an interrupted pass resume.

Under `torchrun` (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT
in the environment), `ranked_pass` is `rbtool.passes.pool.run_pass` spread over the ranks:

- rank 0 makes the plan (which rank reads which file) from the file sizes and sends it to
  every rank, so every rank works from the same plan: byte-balanced (the bytes of any two
  ranks differ by at most the largest file), and local where it can be, since a file under a
  `rank_<r>` directory goes to rank r when that keeps the balance (`plan`);
- each rank runs its share on its own share of the node's cores (`--jobs` default: the
  cores this process may use divided by LOCAL_WORLD_SIZE);
- the results are gathered over torch.distributed (gloo, CPU) to every rank in task order,
  so every rank builds the report a single process would have built and leaves with the
  same exit status; only rank 0 prints it (the command line silences the others' stdout);
- when tasks raise, every rank raises the error of the first failing task in list order.

Without torchrun, `ranked_pass` is `run_pass`, plus the journal when one is given.

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
import contextlib
import dataclasses
import errno
import hashlib
import heapq
import os
import pickle
import re
import stat
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import orjson

from rbtool.errors import CheckpointError, JournalError, RbtoolError, UsageError
from rbtool.files.fsutil import fsync_dir
from rbtool.format import read_json_bytes
from rbtool.format.ranknames import home_rank
from rbtool.passes.pool import check_jobs, default_jobs, keep_freed_memory, run_pass
from rbtool.progress import Progress

T = TypeVar("T")
R = TypeVar("R")

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
JOURNAL_VERSION = 2  # 2: identities with ctime and device, checked hashes
# test-only: a rank whose number is RBTOOL_TEST_EXIT_RANK leaves (os._exit) once it has
# journaled RBTOOL_TEST_EXIT_AFTER files, as a node lost in the middle of a pass would
_EXIT_RANK, _EXIT_AFTER = "RBTOOL_TEST_EXIT_RANK", "RBTOOL_TEST_EXIT_AFTER"


# ------------------------------------------------------------------ the world
@dataclass(frozen=True)
class World:
    """This process's place among the ranks torchrun started."""

    rank: int
    size: int
    local_rank: int
    local_size: int

    @property
    def leader(self) -> bool:
        return self.rank == 0


_SINGLE = World(0, 1, 0, 1)
_group_ready = False


def from_env(environ: Any = None) -> World | None:
    """The torchrun world this process runs in, or None when it was not started by torchrun."""
    env = os.environ if environ is None else environ
    if not all(env.get(name) for name in TORCHRUN_VARS):
        return None
    try:
        rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank, local_size = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    except ValueError:
        raise UsageError(
            "RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE must be integers (as torchrun sets them)"
        ) from None
    if size < 1 or not 0 <= rank < size or local_size < 1 or not 0 <= local_rank < local_size:
        raise UsageError(
            f"rank {rank} of world size {size} (local {local_rank} of {local_size}) is out of range"
        )
    return World(rank, size, local_rank, local_size)


def current() -> World:
    """The torchrun world, or a world of one rank; the process group is set up on first use."""
    world = from_env()
    if world is None:
        return _SINGLE
    _init_group()
    return world


def _init_group() -> None:
    global _group_ready
    if _group_ready:
        return
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")  # env:// from torchrun's variables; CPU only
    _group_ready = True


def finish() -> None:
    """At the end of a command: wait for every rank, then leave the process group (if one was joined)."""
    global _group_ready
    if not _group_ready:
        return
    import torch.distributed as dist

    _group_ready = False
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # another rank is gone: torchrun is ending the run anyway
        pass


def rank_jobs(jobs: int | None, world: World) -> int:
    """Workers for this rank: `jobs` if given, else this node's cores shared among its ranks."""
    if jobs is not None:
        return check_jobs(jobs)
    return max(1, default_jobs() // world.local_size)


def total_jobs(jobs: int | None) -> int:
    """The workers a pass runs on, over every rank (what its report gives as `jobs`)."""
    world = current()
    return rank_jobs(jobs, world) * world.size


def _all_gather(obj: Any, world: World) -> list[Any]:
    if world.size == 1:
        return [obj]
    import torch.distributed as dist

    gathered: list[Any] = [None] * world.size
    dist.all_gather_object(gathered, obj)
    return gathered


def _broadcast(obj: Any, world: World) -> Any:
    if world.size == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(world: World) -> None:
    if world.size > 1:
        import torch.distributed as dist

        dist.barrier()


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it survives a pickle round trip (to be sent to the other ranks), else its message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RbtoolError(str(exc))


def on_leader(world: World, action: Callable[[], None]) -> None:
    """Run `action` on rank 0 only; every rank raises the error it raised (the same exit status)."""
    error: BaseException | None = None
    if world.leader:
        try:
            action()
        except Exception as exc:
            error = exc
    error = _broadcast(None if error is None else _portable(error), world)
    if error is not None:
        raise error


# ------------------------------------------------------------------ the plan
def plan(weights: Sequence[int], world_size: int, homes: Sequence[int | None] | None = None) -> list[int]:
    """The rank of each task: byte-balanced, deterministic, and local where the balance allows.

    A task counts as its weight, at least 1 (files that are linked, not read, still spread by
    count). Tasks with a home rank (`homes[i]`, e.g. the r of a `rank_<r>` directory) start
    there; the others go, largest first, to the least loaded rank; then, while the most and
    the least loaded ranks differ by more than the largest task, the most loaded hands its
    largest task to the least loaded. So the loads of any two ranks end within the largest
    task of each other, and as few tasks as that needs leave their home. Ties: lowest rank,
    earliest task.
    """
    if world_size < 1:
        raise UsageError(f"world size must be >= 1, got {world_size}")
    if homes is not None and len(homes) != len(weights):
        raise UsageError(f"{len(homes)} home ranks for {len(weights)} tasks")
    cost = [max(1, int(w)) for w in weights]
    biggest = max(cost, default=0)
    loads = [0] * world_size
    owner = [-1] * len(cost)
    for i in range(len(cost)):
        home = None if homes is None else homes[i]
        if home is not None and 0 <= home < world_size:
            owner[i] = home
            loads[home] += cost[i]
    for i in sorted((i for i in range(len(cost)) if owner[i] < 0), key=lambda i: (-cost[i], i)):
        least = min(range(world_size), key=lambda r: (loads[r], r))
        owner[i] = least
        loads[least] += cost[i]
    held: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]  # (-cost, task): largest first
    for i, r in enumerate(owner):
        heapq.heappush(held[r], (-cost[i], i))
    while True:
        most = max(range(world_size), key=lambda r: (loads[r], -r))
        least = min(range(world_size), key=lambda r: (loads[r], r))
        if loads[most] - loads[least] <= biggest:
            return owner
        negative, i = heapq.heappop(held[most])  # cost <= biggest < the gap: both move toward the mean
        owner[i] = least
        loads[most] += negative
        loads[least] -= negative
        heapq.heappush(held[least], (negative, i))


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


# ------------------------------------------------------------------ journals
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

    def writer(self, rank: int) -> _JournalWriter:
        return _JournalWriter(self, rank)


def _describe(identity: Any) -> str:
    if not isinstance(identity, dict):
        return str(identity)
    shown = {k: v for k, v in identity.items() if k != "rbtool_journal"}
    return ", ".join(f"{k} {v}" for k, v in shown.items())


class _JournalWriter:
    """Appends one fsynced line per finished file to this process's own journal file.

    It pickles (it goes to worker processes with each task); the open file lives in the
    process (`_OPEN`), so every task a process runs appends to the same file.
    """

    def __init__(self, journal: Journal, rank: int) -> None:
        self.journal = journal
        self.rank = rank

    def record(self, line: bytes) -> None:
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
            _OPEN[slot] = [fd, 0]
        held = _OPEN[slot]
        try:
            _write_all(held[0], line)
            os.fsync(held[0])
        except OSError as exc:
            raise JournalError(
                f"{self.journal.directory}: cannot write the journal: {exc.strerror or exc}"
            ) from None
        held[1] += 1
        if os.environ.get(_EXIT_RANK) == str(self.rank) and held[1] >= int(os.environ.get(_EXIT_AFTER, "1")):
            os._exit(17)


_OPEN: dict[tuple[str, int, int], list[int]] = {}  # (journal, rank, pid) -> [fd, lines written]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _make_private_dir(path: Path) -> None:
    """`path` and the missing directories above it, each made 0700 (this user's alone)."""
    missing = []
    for part in (path, *path.parents):
        if os.path.lexists(part):
            break
        missing.append(part)
    for part in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile: checked like any existing one
            os.mkdir(part, 0o700)


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
        _make_private_dir(path)
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


# ------------------------------------------------------------------ the pass
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


@dataclass(frozen=True)
class _Job(Generic[T]):
    """One task as a rank's worker sees it: the task, its journal key, the files that identify it
    (the one it reads first) and the sha256 the input records for each (None: none recorded)."""

    task: T
    key: str
    files: tuple[Path, ...]
    position: int
    hashes: tuple[str | None, ...] = ()

    def __str__(self) -> str:
        return str(self.task)


class _TaskFailed(Exception):
    """The error of the task at `position` (so that the ranks can agree on the first one)."""

    def __init__(self, position: int, error: BaseException) -> None:
        super().__init__(position, error)
        self.position = position
        self.error = error


class _Journaled(Generic[T, R]):
    """`func` on a job, recording its result in the journal once it is done (in the worker process)."""

    def __init__(self, func: Callable[[T], R], writer: _JournalWriter | None, types: dict[str, type]):
        self.func = func
        self.writer = writer
        self.types = types

    def __call__(self, job: _Job[T]) -> R:
        before = _stat(job.files[0]) if self.writer is not None and job.files else None
        try:
            result = self.func(job.task)
        except Exception as exc:
            raise _TaskFailed(job.position, exc) from None
        if self.writer is not None:
            identity = _settled(job, before)
            if identity is not None:  # else the file changed while it was read: not journaled
                row = {"key": job.key, "identity": identity, "result": _encode(result, self.types)}
                self.writer.record(orjson.dumps(row) + b"\n")
        return result


def _settled(job: _Job[Any], before: os.stat_result | None) -> list[Any] | None:
    """The identities to journal for `job`'s files once it is done, each `[*file_identity, sha256]`
    (the sha256 computed here, between two equal identities, for a file whose input records
    one; else None), None for a gone file; None when the file the task read changed during the
    task or a file changed while it was hashed."""
    if before is not None and not _unchanged(before, _stat(job.files[0])):
        return None
    identities: list[Any] = []
    for i, path in enumerate(job.files):
        first = _stat(path)
        if first is None:
            identities.append(None)
            continue
        digest = None
        if i < len(job.hashes) and job.hashes[i] is not None:
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


def ranked_pass(
    func: Callable[[T], R],
    tasks: Sequence[T],
    *,
    jobs: int | None,
    weights: Sequence[int] | None = None,
    progress: Progress | None = None,
    preload: Sequence[str] = (),
    describe: Callable[[T], str] = str,
    journal: Journal | None = None,
    files: Callable[[T], Sequence[Path]] | None = None,
    types: Sequence[type] = (),
    hashes: Callable[[T], Sequence[str | None]] | None = None,
) -> list[R]:
    """`[func(t) for t in tasks]` over the torchrun ranks (or this process), resuming from `journal`.

    `files(task)` names the files whose identity must not have changed for a journaled result
    to be taken, the one the task reads first (default: none; every recorded result is
    taken); `hashes(task)` the sha256 the input records for each of them (None where it
    records none): such a file is hashed when its result is journaled, and the result is
    taken only while that hash is the recorded one. `types` are the dataclasses a result may
    hold (to journal it). Returns every result, in task order, on every rank; `journal.files`
    and `journal.reused` then count the tasks and those taken from the journal.
    """
    world = current()
    if world.size == 1 and journal is None:
        return run_pass(
            func,
            tasks,
            jobs=rank_jobs(jobs, world),
            weights=weights,
            progress=progress,
            preload=preload,
            describe=describe,
            files=files,
        )
    if weights is not None and len(weights) != len(tasks):
        raise UsageError(f"{len(weights)} weights for {len(tasks)} tasks")
    by_name = {t.__name__: t for t in types}
    named = [
        _Job(
            t,
            _key(t, describe, files),
            tuple(files(t)) if files is not None else (),
            i,
            tuple(hashes(t)) if hashes is not None else (),
        )
        for i, t in enumerate(tasks)
    ]
    sizes = [int(w) for w in weights] if weights is not None else [0] * len(tasks)

    # rank 0 reads the journal and makes the plan; every rank gets the same one
    decided: tuple[list[int], dict[int, Any]] | BaseException | None = None
    if world.leader:
        try:
            decided = _decide(named, sizes, world.size, journal, by_name)
        except Exception as exc:
            decided = _portable(exc)
    decided = _broadcast(decided, world)
    if isinstance(decided, BaseException):
        raise decided
    assert decided is not None
    owner, recorded = decided
    if journal is not None:
        journal.files += len(tasks)
        journal.reused += len(recorded)
        barrier(world)  # every rank has the plan before any writes into the journal

    mine = [i for i, r in enumerate(owner) if r == world.rank]
    workers = rank_jobs(jobs, world)
    if world.size > 1 and workers == 1:
        keep_freed_memory()  # this rank reads its files itself, as a worker would
    if progress is not None and world.leader and recorded:
        progress(len(recorded))
    writer = journal.writer(world.rank) if journal is not None else None
    outcome: tuple[list[int], list[Any] | None, tuple[int, BaseException] | None]
    try:
        results = run_pass(
            _Journaled(func, writer, by_name),
            [named[i] for i in mine],
            jobs=workers,
            weights=[sizes[i] for i in mine],
            progress=progress,
            preload=preload,
            describe=lambda job: describe(job.task),
            files=None if files is None else lambda job: job.files,
        )
        outcome = (mine, results, None)
    except _TaskFailed as failed:  # the first failing task of this rank's share, in list order
        outcome = (mine, None, (failed.position, _portable(failed.error)))
    except Exception as exc:  # a worker died: blame this rank's first task, as run_pass names it
        outcome = (mine, None, (mine[0] if mine else len(tasks), _portable(exc)))
    gathered = _all_gather(outcome, world)
    errors = [e for _, _, e in gathered if e is not None]
    if errors:
        raise min(errors, key=lambda e: e[0])[1]
    merged: list[Any] = [None] * len(tasks)
    for i, result in recorded.items():
        merged[i] = result
    for positions, results, _ in gathered:
        for i, result in zip(positions, results, strict=True):
            merged[i] = result
    return merged


def _key(task: Any, describe: Callable[[Any], str], files: Callable[[Any], Sequence[Path]] | None) -> str:
    """The journal key of `task`: its first file's absolute path (else its name), and a digest of
    the task with its paths absolute, so that a rerun from another directory finds its files."""
    named = list(files(task)) if files is not None else []
    return task_key(os.path.abspath(named[0]) if named else describe(task), _absolute(task))


def _decide(
    named: list[_Job[Any]],
    sizes: list[int],
    world_size: int,
    journal: Journal | None,
    types: dict[str, type],
) -> tuple[list[int], dict[int, Any]]:
    """Which rank runs each task (-1: done, from the journal) and the journaled results by position.

    A recorded result is taken only while each of its files has the recorded identity (and,
    where the input records a sha256, was hashed to it when journaled); one that does not
    decode (a line damaged in some other way than torn) is not taken: its file is done again.
    """
    recorded: dict[int, Any] = {}
    if journal is not None:
        done = journal.load()
        for i, job in enumerate(named):
            entries = done.get(job.key)
            if not entries:
                continue
            wanted = [
                _expected(p, job.hashes[k] if k < len(job.hashes) else None) for k, p in enumerate(job.files)
            ]
            for identity, result in entries:
                if identity != wanted:
                    continue
                try:
                    recorded[i] = _decode(result, types)
                    break
                except (ValueError, TypeError, KeyError, IndexError, AttributeError):
                    continue
    todo = [i for i in range(len(named)) if i not in recorded]
    homes = [_home(named[i].files) for i in todo]
    ranks = plan([sizes[i] for i in todo], world_size, homes)
    owner = [-1] * len(named)
    for i, r in zip(todo, ranks, strict=True):
        owner[i] = r
    return owner, recorded


def _home(files: tuple[Path, ...]) -> int | None:
    return home_rank(files[0]) if files else None


@contextlib.contextmanager
def silenced_stdout(world: World | None) -> Iterator[None]:
    """Ranks other than 0 print nothing on stdout (their reports are rank 0's)."""
    if world is None or world.leader:
        yield
        return
    import sys

    saved = sys.stdout
    with open(os.devnull, "w") as sink:
        sys.stdout = sink
        try:
            yield
        finally:
            sys.stdout = saved


__all__ = [
    "Journal",
    "JournalError",
    "World",
    "barrier",
    "current",
    "file_identity",
    "finish",
    "from_env",
    "home_rank",
    "input_journal",
    "journal_note",
    "on_leader",
    "open_journal",
    "plan",
    "rank_jobs",
    "total_jobs",
    "ranked_pass",
    "silenced_stdout",
]
