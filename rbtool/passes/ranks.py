"""Deep passes over ranks (torchrun), resumable from a journal (rbtool.passes.journal).

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

Without torchrun, `ranked_pass` is `run_pass`, plus the journal when one is given. With a
journal, rank 0 takes from it every result whose files are unchanged, the plan covers the
rest, and each process records the files it finished in its own journal file.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from rbtool.errors import RbtoolError, UsageError
from rbtool.files.fsutil import file_size
from rbtool.format.ranknames import home_rank
from rbtool.passes.journal import Journal, JournalWriter, job_key
from rbtool.passes.pool import check_jobs, default_jobs, keep_freed_memory, run_pass
from rbtool.progress import Progress

T = TypeVar("T")
R = TypeVar("R")

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


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


# ------------------------------------------------------------------ the pass
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

    def __init__(self, func: Callable[[T], R], writer: JournalWriter | None):
        self.func = func
        self.writer = writer

    def __call__(self, job: _Job[T]) -> R:
        before = self.writer.watch(job.files) if self.writer is not None else None
        try:
            result = self.func(job.task)
        except Exception as exc:
            raise _TaskFailed(job.position, exc) from None
        if self.writer is not None:
            self.writer.record(job.key, job.files, job.hashes, before, result)
        return result


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
    units: Callable[[T], int] | None = None,
) -> list[R]:
    """`[func(t) for t in tasks]` over the torchrun ranks (or this process), resuming from `journal`.

    `files(task)` names the files whose identity must not have changed for a journaled result
    to be taken, the one the task reads first (default: none; every recorded result is
    taken); `hashes(task)` the sha256 the input records for each of them (None where it
    records none): such a file is hashed when its result is journaled, and the result is
    taken only while that hash is the recorded one. `types` are the dataclasses a result may
    hold (to journal it). `units(task)`: what a task counts for in `progress` (default 1).
    Returns every result, in task order, on every rank; `journal.files` and `journal.reused`
    then count the tasks and those taken from the journal.
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
            units=units,
        )
    if weights is not None and len(weights) != len(tasks):
        raise UsageError(f"{len(weights)} weights for {len(tasks)} tasks")
    by_name = {t.__name__: t for t in types}
    named = [
        _Job(
            t,
            job_key(t, describe, files),
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
        progress(len(recorded) if units is None else sum(units(tasks[i]) for i in recorded))
    writer = journal.writer(world.rank, by_name) if journal is not None else None
    outcome: tuple[list[int], list[Any] | None, tuple[int, BaseException] | None]
    try:
        results = run_pass(
            _Journaled(func, writer),
            [named[i] for i in mine],
            jobs=workers,
            weights=[sizes[i] for i in mine],
            progress=progress,
            preload=preload,
            describe=lambda job: describe(job.task),
            files=None if files is None else lambda job: job.files,
            units=None if units is None else lambda job: units(job.task),
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


def _decide(
    named: list[_Job[Any]],
    sizes: list[int],
    world_size: int,
    journal: Journal | None,
    types: dict[str, type],
) -> tuple[list[int], dict[int, Any]]:
    """Which rank runs each task (-1: done, from the journal) and the journaled results by position
    (those `Journal.recorded` takes)."""
    recorded: dict[int, Any] = {}
    if journal is not None:
        recorded = journal.recorded([(job.key, job.files, job.hashes) for job in named], types)
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
    "World",
    "barrier",
    "current",
    "finish",
    "from_env",
    "home_rank",
    "on_leader",
    "plan",
    "rank_jobs",
    "total_jobs",
    "ranked_pass",
    "silenced_stdout",
]


@dataclass(frozen=True)
class FileTask:
    """One trajectory file of a pass over a checkpoint's files (it pickles: it is sent to a
    worker process); a pass adds what its function needs."""

    path: Path
    tid: int
    entry: dict[str, Any] | None

    def __str__(self) -> str:
        return str(self.path)


FT = TypeVar("FT", bound=FileTask)


def file_pass(
    func: Callable[[FT], R],
    tasks: Sequence[FT],
    jobs: int | None,
    progress: Progress | None,
    journal: Journal | None,
    *,
    preload: Sequence[str],
    types: Sequence[type],
    hashes: Callable[[FT], Sequence[str | None]] | None = None,
) -> list[R]:
    """`ranked_pass` over trajectory files (`jobs`, `progress`, `journal` and the rest as there):
    tasks weighed by their files' sizes, and a journaled result taken only while its task's
    file is unchanged."""
    return ranked_pass(
        func,
        tasks,
        jobs=jobs,
        weights=[file_size(t.path) for t in tasks],
        progress=progress,
        preload=preload,
        journal=journal,
        files=lambda t: (t.path,),
        types=types,
        hashes=hashes,
    )
