"""Deep passes on all cores: one function applied to many files, on worker processes.

A deep pass (`verify --deep`, the data part of `stats`, `repair`'s checks, conversions)
does the same work for every trajectory file, and most of that work holds the GIL
(unpickling, torch's record reads and CRC checks, Python walks over the loaded values), so
threads do not make it faster: worker processes do.

`run_pass(func, tasks, jobs=N)` returns `[func(t) for t in tasks]`, with these guarantees:

- results come back in task order, whatever the timing, so a report built from them is
  the one a single process builds;
- when tasks raise, the error raised is the one of the first task in list order, as in a
  single process (later tasks are not waited for once it is known);
- big files start first (tasks are handed out largest `weights` first), so a few big
  files at the end of the list do not leave one worker running alone;
- tasks are handed out in chunks (up to CHUNK_TASKS tasks weighing up to CHUNK_WEIGHT together,
  a heavier task alone), one round trip to a worker per chunk instead of per task, which is most
  of the cost of a small file; at most two chunks per worker are handed out at a time, and a
  worker holds one task's file at a time, so memory stays bounded whatever the number of tasks;
- `progress(1)` is called in the calling process as each task completes (`progress(units(task))`
  with `units`, for tasks of several files each);
- Ctrl-C (or any error) stops the workers at once; a worker that dies (killed, out of
  memory) is a one-line RbtoolError, never a hang;
- `jobs=1`, or a single task, runs in the calling process: no worker is started;
- inside `feeding(feed)` (a remote checkpoint larger than the cache, rbtool.remote's
  StreamMirror), the files `files(task)` names are fetched in batches ahead of the tasks,
  as many as fit the feed's budget, and released as each task completes.

`func` must be a module-level function and tasks and results must pickle. Workers are
forked when that is safe (Linux, no other Python thread running: a fork copies no thread,
so a lock another thread held would stay held in the child); otherwise they come from a
fork server (or are spawned where there is none), which imports `preload` once up front:
about 1.5 s more when `preload` holds torch (e.g. at a terminal, where a progress bar is
drawn by a thread). As with any multiprocessing program, a main script that runs a pass
while other threads run needs the `if __name__ == "__main__":` guard (the fork server's
workers import the main module), or `jobs=1`.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from rbtool.errors import RbtoolError, UsageError
from rbtool.files.fsutil import current_umask
from rbtool.progress import Progress

T = TypeVar("T")
R = TypeVar("R")

IN_FLIGHT_PER_WORKER = 2  # chunks of tasks handed to the pool per worker at any time
CHUNK_TASKS = 64  # the most tasks a worker is handed at once
CHUNK_WEIGHT = 4 << 20  # ... and the most weight (bytes of files), unless one task weighs more
CHUNKS_PER_WORKER = 8  # a pass is cut in at least this many chunks per worker, so the last ones end together


def default_jobs() -> int:
    """Workers for a deep pass: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on every platform
        return max(1, os.cpu_count() or 1)


def check_jobs(jobs: object) -> int:
    """`jobs` as a worker count (None: default_jobs()); anything but an integer >= 1 is a UsageError."""
    if jobs is None:
        return default_jobs()
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise UsageError(f"jobs must be an integer >= 1, got {jobs!r}")
    return jobs


@dataclass
class Throughput:
    """What a deep pass read and how fast, as its report gives it in JSON."""

    jobs: int
    bytes_read: int = 0
    seconds: float = 0.0

    @property
    def bytes_per_second(self) -> int | None:
        return round(self.bytes_read / self.seconds) if self.seconds > 0 else None

    def as_json(self) -> dict[str, Any]:
        return {
            "jobs": self.jobs,
            "bytes_read": self.bytes_read,
            "seconds": round(self.seconds, 6),
            "bytes_per_second": self.bytes_per_second,
        }


# (begin, end) in perf_counter() seconds of each pool's start in this process: its worker
# processes made and their imports done, before the pool's first task
_STARTUPS: list[tuple[float, float]] = []


class Timer:
    """Seconds since it was made, less the time worker processes took to start meanwhile.

    A pass's throughput is what its reading costs: a pool's start (forking or spawning the
    workers, importing torch in them) is paid once a pass, whatever it reads, and would make
    a small checkpoint look slow (95 KiB "read in 1.57 s").
    """

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        now = time.perf_counter()
        starting = sum(end - begin for begin, end in _STARTUPS if begin >= self.started)
        return max(0.0, now - self.started - starting)


def keep_freed_memory() -> None:
    """Let this process's malloc keep freed blocks of up to 32 MiB for the next file.

    A worker reads file after file of similar sizes; by default glibc serves blocks above
    a few MiB with fresh mmaps and trims freed heap, so every file's bytes and tensors fault
    their pages in anew (about an eighth of a deep check's CPU time). Workers do this, and so
    does a torchrun rank that runs its share itself (rbtool.passes.ranks).
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 32 << 20)
    mallopt(m_trim_threshold, 256 << 20)


def _worker_init(umask: int) -> None:
    """Ctrl-C is the calling process's to handle (it stops the workers); one thread of torch each;
    the caller's umask (a fork server keeps the one it started under, which the caller may have
    changed since), so what workers write gets the modes the caller's own writes get."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.umask(umask)
    keep_freed_memory()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def _started(begin: float) -> None:
    """Record a pass's start-up (its modules imported, its workers up) as lasting until now."""
    _STARTUPS.append((begin, time.perf_counter()))
    del _STARTUPS[:-64]  # a long-lived process keeps only the latest


def _ready(_: int) -> None:
    """A worker's first task: it is up, its start-up imports done."""


def _run_chunk(func: Callable[[T], R], tasks: Sequence[T]) -> list[tuple[bool, Any]]:
    """`func` on each task of a chunk, in a worker: (True, result) or (False, the error) for each."""
    outcomes: list[tuple[bool, Any]] = []
    for task in tasks:
        try:
            outcomes.append((True, func(task)))
        except Exception as exc:
            outcomes.append((False, exc))
    return outcomes


def _chunks(order: Sequence[int], weights: Sequence[int] | None, workers: int) -> list[list[int]]:
    """`order` cut into consecutive chunks (see the module docstring)."""
    most = max(1, min(CHUNK_TASKS, len(order) // (workers * CHUNKS_PER_WORKER)))
    chunks: list[list[int]] = []
    current: list[int] = []
    weight = 0
    for position in order:
        heavy = weights[position] if weights is not None else 0
        if current and (len(current) >= most or weight + heavy > CHUNK_WEIGHT):
            chunks.append(current)
            current, weight = [], 0
        current.append(position)
        weight += heavy
    if current:
        chunks.append(current)
    return chunks


def _context(preload: Sequence[str]) -> Any:
    """fork when nothing else runs in this process, else a fork server importing `preload`, else spawn."""
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and sys.platform.startswith("linux") and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    if "forkserver" in methods:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["rbtool.passes.pool", *preload])
        return context
    return multiprocessing.get_context("spawn")


def _stop(pool: ProcessPoolExecutor) -> None:
    """Cancel what has not started and end the workers now, without waiting for their tasks.

    (The executor has no public way to end its workers before Python 3.14's terminate_workers:
    its process table and manager thread are read before shutdown() lets go of them.)
    """
    manager = getattr(pool, "_executor_manager_thread", None)
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5)
    if manager is not None:
        manager.join(timeout=5)  # it closes the queues (and their feeder threads) once the workers are gone


class Feed(Protocol):
    """Where a pass's files come from when they are not all here (rbtool.remote.StreamMirror)."""

    budget: int  # the most bytes of fetched files held at once
    held: int  # bytes fetched and not yet released

    def served(self, paths: Sequence[Path]) -> list[str]: ...
    def size(self, names: Sequence[str]) -> int: ...
    def fetch(self, names: Sequence[str]) -> None: ...
    def release(self, names: Sequence[str]) -> None: ...
    def too_big(self, names: Sequence[str]) -> BaseException: ...


_feed: Feed | None = None


def streaming() -> bool:
    """Whether a pass started now fetches its tasks' files through a feed (inside `feeding`):
    then a task's files must fit the feed's budget with the others in flight."""
    return _feed is not None


@contextmanager
def feeding(feed: Feed) -> Iterator[Feed]:
    """Passes run inside the block fetch their files from `feed` ahead of their tasks."""
    global _feed
    previous, _feed = _feed, feed
    try:
        yield feed
    finally:
        _feed = previous


class _Window:
    """The tasks whose files are fetched: taken in `order`, as many ahead as the feed's budget allows."""

    def __init__(self, feed: Feed, names: Callable[[int], list[str]], order: Sequence[int], ahead: int):
        self.feed = feed
        self.names_of = names
        self.queue = deque(order)
        self.ready: deque[int] = deque()
        self.names: dict[int, list[str]] = {}
        self.ahead = ahead

    def fill(self) -> None:
        """Fetch the files of the next tasks (one batch) while they fit beside what is held."""
        batch: list[int] = []
        wanted: set[str] = set()
        while self.queue and len(self.ready) + len(batch) < self.ahead:
            position = self.queue[0]
            got = self.names_of(position)
            need = self.feed.size(sorted(wanted | set(got)))
            if self.feed.held + need > self.feed.budget:
                if self.feed.held == 0 and not batch:
                    raise self.feed.too_big(got)
                break
            self.queue.popleft()
            batch.append(position)
            wanted.update(got)
            self.names[position] = got
        if batch:
            self.feed.fetch(sorted(wanted))
            self.ready.extend(batch)

    def next(self) -> int | None:
        """The next task whose files are here (fetching a batch if none is), or None when all were taken."""
        if not self.ready:
            self.fill()
        return self.ready.popleft() if self.ready else None

    def done(self, position: int) -> None:
        """Release the files of a finished task (those another task still needs stay)."""
        names = self.names.pop(position, [])
        still = {n for ns in self.names.values() for n in ns}
        self.feed.release([n for n in names if n not in still])

    def close(self) -> None:
        for position in list(self.names):
            self.done(position)


def run_pass(
    func: Callable[[T], R],
    tasks: Sequence[T],
    *,
    jobs: int,
    weights: Sequence[int] | None = None,
    progress: Progress | None = None,
    preload: Sequence[str] = (),
    describe: Callable[[T], str] = str,
    files: Callable[[T], Sequence[Path]] | None = None,
    units: Callable[[T], int] | None = None,
) -> list[R]:
    """`[func(t) for t in tasks]` on `jobs` worker processes (see the module docstring).

    `weights` (e.g. each task's file size) decide the order tasks start in, largest first;
    `preload` names the modules `func` needs, imported before any worker starts so forked
    workers inherit them; `describe(task)` names a task in the error a dead worker raises;
    `files(task)` names the files a task reads (fetched first inside `feeding`).
    """
    jobs = check_jobs(jobs)
    if weights is not None and len(weights) != len(tasks):
        raise UsageError(f"{len(weights)} weights for {len(tasks)} tasks")
    if progress is not None and units is not None:
        progress = _Units(progress, [units(task) for task in tasks])
    workers = min(jobs, len(tasks))
    feed = _feed if files is not None else None
    if feed is not None and tasks:
        assert files is not None
        order = list(range(len(tasks)))
        if workers > 1 and weights is not None:
            order.sort(key=lambda i: -weights[i])
        window = _Window(
            feed, lambda i: feed.served(files(tasks[i])), order, max(1, workers) * IN_FLIGHT_PER_WORKER * 2
        )
        try:
            return _run(func, tasks, workers, weights, progress, preload, describe, window)
        finally:
            window.close()
    return _run(func, tasks, workers, weights, progress, preload, describe, None)


class _Units:
    """A progress callback and the units (files) each task holds."""

    def __init__(self, progress: Progress, units: list[int]) -> None:
        self.progress, self.units = progress, units

    def __call__(self, n: int) -> None:
        self.progress(n)


def _tick(progress: Progress, positions: list[int]) -> None:
    """Tell `progress` the tasks at `positions` are done: one each, or their units."""
    if isinstance(progress, _Units):
        progress(sum(progress.units[p] for p in positions))
    else:
        progress(len(positions))


def _run(
    func: Callable[[T], R],
    tasks: Sequence[T],
    workers: int,
    weights: Sequence[int] | None,
    progress: Progress | None,
    preload: Sequence[str],
    describe: Callable[[T], str],
    window: _Window | None,
) -> list[R]:
    """run_pass on `workers` processes, the tasks' files fetched through `window` if there is one."""
    begin = time.perf_counter()
    for name in preload:
        importlib.import_module(name)
    if workers <= 1:
        _started(begin)
    if workers <= 1 and window is not None:
        by_position: dict[int, R] = {}
        while (position := window.next()) is not None:
            by_position[position] = func(tasks[position])
            window.done(position)
            if progress is not None:
                _tick(progress, [position])
        return [by_position[i] for i in range(len(tasks))]
    if workers <= 1:
        results = []
        for position, task in enumerate(tasks):
            results.append(func(task))
            if progress is not None:
                _tick(progress, [position])
        return results
    order = list(range(len(tasks)))
    if weights is not None:
        order.sort(key=lambda i: -weights[i])  # stable: equal weights keep list order
    results_by_position: dict[int, R] = {}
    first_error: tuple[int, BaseException] | None = None
    finished = bytearray(len(tasks))  # 1 where a task has completed (with a result or an error)
    lowest_unfinished = 0
    pending: dict[Future[list[tuple[bool, Any]]], list[int]] = {}
    # with a window, tasks go one at a time, as their files arrive
    queue = iter(_chunks(order, weights, workers) if window is None else [])
    pool = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=_context(preload),
        initializer=_worker_init,
        initargs=(current_umask(),),
    )
    try:
        for up in [pool.submit(_ready, i) for i in range(workers)]:  # every worker up before the
            up.result()  # clock counts the pass
    except BaseException:
        _stop(pool)
        raise
    _started(begin)

    def taken() -> Iterator[list[int]]:
        """The next chunks to submit; with a window, single tasks whose files are here now (it may
        run dry while the tasks in flight hold the budget, and be called again once they are done)."""
        if window is None:
            yield from queue
            return
        while (position := window.next()) is not None:
            yield [position]

    def submit_next() -> None:
        for chunk in taken():
            if first_error is not None:
                dropped = [p for p in chunk if p > first_error[0]]
                for position in dropped:  # their results would not be used: an earlier task failed
                    if window is not None:
                        window.done(position)
                chunk = [p for p in chunk if p <= first_error[0]]
                if not chunk:
                    continue
            pending[pool.submit(_run_chunk, func, [tasks[p] for p in chunk])] = chunk
            return

    try:
        for _ in range(workers * IN_FLIGHT_PER_WORKER):
            submit_next()
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                chunk = pending.pop(future)
                error = future.exception()
                if isinstance(error, BrokenProcessPool):
                    pending[future] = chunk
                    raise error
                outcomes = future.result() if error is None else [(False, error)] * len(chunk)
                for position, (ok, value) in zip(chunk, outcomes, strict=True):
                    if not ok:
                        if first_error is None or position < first_error[0]:
                            first_error = (position, value)
                    else:
                        results_by_position[position] = value
                    finished[position] = 1
                    if window is not None:
                        window.done(position)
                if progress is not None:
                    _tick(progress, chunk)
                submit_next()
            if window is not None:
                window.fill()  # the next batch, while the workers read the tasks in flight
            while lowest_unfinished < len(tasks) and finished[lowest_unfinished]:
                lowest_unfinished += 1
            if first_error is not None and lowest_unfinished >= first_error[0]:
                break  # every task before the failed one is done: its error is the pass's
    except BrokenProcessPool:
        _stop(pool)
        lost = min((p for chunk in pending.values() for p in chunk), default=0)  # one in flight killed it
        raise RbtoolError(
            f"{describe(tasks[lost])}: a worker process of the pass died (killed, or out of memory?) "
            "while working on it or on another file in flight"
        ) from None
    except BaseException:
        _stop(pool)
        raise
    if first_error is not None:
        _stop(pool)
        raise first_error[1]
    pool.shutdown(wait=True)
    return [results_by_position[i] for i in range(len(tasks))]


__all__ = [
    "Feed",
    "Throughput",
    "Timer",
    "check_jobs",
    "default_jobs",
    "feeding",
    "keep_freed_memory",
    "run_pass",
]
