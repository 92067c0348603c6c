"""RLinf's training datasets over replay buffers: infinite iterables of ready-made batches.

`ReplayBufferDataset` yields `replay.sample(batch_size)`, or, with a demo buffer,
`torch.cat` along dim 0 of `replay.sample(batch_size // 2)` and `demo.sample(batch_size // 2)`
over the keys both batches hold (RLinf's `concat_batch`; nested dicts too). The same seeds
give RLinf's batches. `PreloadReplayBufferDataset` samples the same sequence on a background
thread, `prefetch_size` batches ahead. `replay_buffer_collate_fn` unwraps the one-item list
a `DataLoader(batch_size=1)` builds.

Where RLinf is wrong, this is not: a dataset waiting for a buffer to be ready sleeps (on the
buffer's `wait_until_ready` when it has one, else polling with backoff) instead of spinning a
core; `close()` stops a waiting iterator and the prefetch thread within a second and raises
only when sampling failed; an error in the prefetch thread reaches the consumer on its next
`next()`. `seed_workers` gives each DataLoader worker and rank its own deterministic seed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import queue
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils.data import IterableDataset

from rbtool.errors import DroppedKeysWarning, UsageError

Batch = dict[str, Any]

# How long one wait lasts before a waiter looks at its stop flag again: close() takes at most
# about this long to be seen (the buffer's condition wakes a waiter at once on an add).
STOP_CHECK = 0.1
# A buffer without wait_until_ready (RLinf's) is polled: the first sleep, doubled up to the last.
POLL_FIRST = 0.001
POLL_MAX = STOP_CHECK
# How long close() waits for the prefetch thread to end.
JOIN_TIMEOUT = 1.0


class SampleSource(Protocol):
    """What a dataset needs of a buffer: rbtool's TrajectoryReplayBuffer, or RLinf's."""

    def sample(self, num_chunks: int) -> Batch: ...

    def is_ready(self, min_size: int) -> bool: ...


def concat_batch(
    first: Mapping[str, Any], second: Mapping[str, Any], dropped: Callable[[str, str], None]
) -> Batch:
    """RLinf's concat_batch: `torch.cat` of both batches' tensors along dim 0, over `first`'s keys
    (in its order) that `second` holds too, nested dicts likewise.

    Every key left out (missing on either side) is told to `dropped(path, side)` once per
    batch; the caller decides how often to warn. A key that is a tensor on one side and a
    dict on the other is an error (RLinf fails there too, less clearly).
    """
    return _concat(first, second, "", dropped)


def _concat(
    first: Mapping[str, Any], second: Mapping[str, Any], prefix: str, dropped: Callable[[str, str], None]
) -> Batch:
    batch: Batch = {}
    for key, value in first.items():
        path = prefix + key
        if not isinstance(value, (torch.Tensor, dict)):
            continue  # RLinf's sampler puts nothing else in a batch; concat_batch skips it
        if key not in second:
            dropped(path, "demo")
            continue
        other = second[key]
        if isinstance(value, torch.Tensor) != isinstance(other, torch.Tensor):
            kinds = {True: "a tensor", False: "a dict"}
            raise UsageError(
                f"batch key {path!r} is {kinds[isinstance(value, torch.Tensor)]} in the replay batch "
                f"and {kinds[isinstance(other, torch.Tensor)]} in the demo batch"
            )
        if isinstance(value, torch.Tensor):
            batch[key] = torch.cat([value, other], dim=0)
        else:
            batch[key] = _concat(value, other, f"{path}.", dropped)
    for key, other in second.items():
        if key not in first and isinstance(other, (torch.Tensor, dict)):
            dropped(prefix + key, "replay")
    return batch


def derive_seed(base_seed: int, rank: int = 0, worker_id: int = 0, stream: int = 0) -> int:
    """A seed in [0, 2**63) for one (rank, DataLoader worker, buffer) from a base seed.

    The same arguments give the same seed in every process; any two that differ give
    unrelated ones (a hash, not `base + rank`, so rank 1 worker 0 and rank 0 worker 1 differ).
    `stream` tells the replay buffer (0) and the demo buffer (1) apart.
    """
    given = {"base_seed": base_seed, "rank": rank, "worker_id": worker_id, "stream": stream}
    for name, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UsageError(f"{name} must be an int >= 0, got {value!r}")
    text = f"rbtool-dataset:{base_seed}:{rank}:{worker_id}:{stream}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


@dataclass
class _Sampler:
    """One batch at a time from the buffers, once they are ready; shared with the prefetch thread.

    Holds no reference to the dataset, so a dataset dropped by its caller is collected (and
    closed) even while its prefetch thread runs.
    """

    replay_buffer: SampleSource
    demo_buffer: SampleSource | None
    batch_size: int
    min_replay_buffer_size: int
    min_demo_buffer_size: int
    stop: threading.Event = field(default_factory=threading.Event)
    warned: set[str] = field(default_factory=set)

    def ready(self) -> bool:
        if not self.replay_buffer.is_ready(self.min_replay_buffer_size):
            return False
        return self.demo_buffer is None or self.demo_buffer.is_ready(self.min_demo_buffer_size)

    def wait_ready(self) -> bool:
        """Sleep until both buffers are ready (True) or stop is set (False); never spin."""
        pause = POLL_FIRST
        while not self.stop.is_set():
            if self.ready():
                return True
            waiting, needed = self.replay_buffer, self.min_replay_buffer_size
            if waiting.is_ready(needed) and self.demo_buffer is not None:
                waiting, needed = self.demo_buffer, self.min_demo_buffer_size
            wait_until_ready = getattr(waiting, "wait_until_ready", None)
            if wait_until_ready is not None:
                wait_until_ready(needed, timeout=STOP_CHECK)
            else:
                self.stop.wait(pause)
                pause = min(pause * 2, POLL_MAX)
        return False

    def sample(self) -> Batch:
        if self.demo_buffer is None:
            return self.replay_buffer.sample(self.batch_size)
        replay = self.replay_buffer.sample(self.batch_size // 2)
        demo = self.demo_buffer.sample(self.batch_size // 2)
        return concat_batch(replay, demo, self._dropped)

    def _dropped(self, path: str, side: str) -> None:
        if path in self.warned:
            return
        self.warned.add(path)
        other = "replay" if side == "demo" else "demo"
        warnings.warn(
            DroppedKeysWarning(
                f"batch key {path!r} is in the {other} batch but not in the {side} batch; "
                "it is left out of the batches (warned once per key)"
            ),
            stacklevel=2,
        )

    def batches(self) -> Iterator[Batch]:
        while self.wait_ready():
            yield self.sample()


def _read_through(name: str) -> Any:
    """A read-only attribute of a dataset that is its sampler's `name`."""
    return property(lambda dataset: getattr(dataset._sampler, name), doc=f"RLinf's `{name}` (read-only).")


class ReplayBufferDataset(IterableDataset[Batch]):
    """An infinite iterable of batches sampled from a replay buffer, and a demo buffer if given.

    Each batch is `replay_buffer.sample(batch_size)`; with `demo_buffer`, half from each
    (`batch_size // 2` rows apiece) concatenated over the keys both hold. Iteration waits,
    asleep, until the replay buffer holds `min_replay_buffer_size` trajectories and the demo
    buffer `min_demo_buffer_size`. `close()` ends every iterator (a waiting one within
    STOP_CHECK seconds); the dataset keeps its buffers (RLinf's deletes its references, so an
    iterator in another thread fails mid-sample), and they go with the dataset. `**kwargs` are
    accepted and ignored, as RLinf does.
    """

    def __init__(
        self,
        replay_buffer: SampleSource,
        demo_buffer: SampleSource | None,
        batch_size: int,
        min_replay_buffer_size: int,
        min_demo_buffer_size: int,
        **kwargs: Any,
    ) -> None:
        self._sampler = _Sampler(
            replay_buffer, demo_buffer, batch_size, min_replay_buffer_size, min_demo_buffer_size
        )

    # RLinf's attributes, read through to what the iterators use
    replay_buffer = _read_through("replay_buffer")
    demo_buffer = _read_through("demo_buffer")
    batch_size = _read_through("batch_size")
    min_replay_buffer_size = _read_through("min_replay_buffer_size")
    min_demo_buffer_size = _read_through("min_demo_buffer_size")

    @property
    def closed(self) -> bool:
        return self._sampler.stop.is_set()

    def __iter__(self) -> Iterator[Batch]:
        # the iterator holds the dataset: `for b in ReplayBufferDataset(...)` is not ended by
        # the dataset's finalizer while it runs
        yield from self._sampler.batches()

    def reseed(self, base_seed: int, rank: int = 0, worker_id: int = 0) -> None:
        """Seed the buffers' generators for one rank and DataLoader worker (see derive_seed).

        The replay and demo buffers get different seeds. In a DataLoader worker this seeds the
        worker's own copy of the buffers; `seed_workers` calls it there.
        """
        buffers = [self._sampler.replay_buffer, self._sampler.demo_buffer]
        for stream, buffer in enumerate(buffers):
            if buffer is None:
                continue
            generator = getattr(buffer, "random_generator", None)
            if not isinstance(generator, torch.Generator):
                raise UsageError(f"{type(buffer).__name__} has no random_generator to seed")
            generator.manual_seed(derive_seed(base_seed, rank, worker_id, stream))

    def close(self) -> None:
        """End every iterator of this dataset; a waiting one wakes within STOP_CHECK seconds."""
        self._sampler.stop.set()

    def __del__(self) -> None:
        sampler = getattr(self, "_sampler", None)
        if sampler is not None:
            sampler.stop.set()


_FAILED = object()  # put on the queue by a failing prefetch thread, to wake a waiting consumer


@dataclass
class _Prefetch:
    """The prefetch thread's side: a bounded queue of batches and the error that stopped it."""

    sampler: _Sampler
    batches: queue.Queue[Any]
    error: BaseException | None = None
    reported: bool = False  # the error was raised to the consumer already

    def run(self) -> None:
        stop = self.sampler.stop
        try:
            for batch in self.sampler.batches():
                while not stop.is_set():
                    try:
                        self.batches.put(batch, timeout=STOP_CHECK)
                        break
                    except queue.Full:
                        continue
        except BaseException as error:
            self.error = error
            stop.set()
            # a full queue means the consumer is not waiting: it finds the error on its next next()
            with contextlib.suppress(queue.Full):
                self.batches.put_nowait(_FAILED)

    def failure(self) -> RuntimeError:
        self.reported = True
        failure = RuntimeError(f"Sampling thread failed: {type(self.error).__name__}: {self.error}")
        failure.__cause__ = self.error
        return failure


class PreloadReplayBufferDataset(ReplayBufferDataset):
    """ReplayBufferDataset whose batches are sampled ahead on a background thread.

    The thread starts with the first iteration and keeps up to `prefetch_size` batches
    queued; the batches are the plain dataset's, in the same order. An error in the thread
    is raised by the consumer's next `next()` as RuntimeError("Sampling thread failed: ...")
    chained to it. `close()` stops the thread (joined within JOIN_TIMEOUT seconds) and raises
    that error only if sampling failed and the consumer has not seen it yet.
    """

    def __init__(
        self,
        replay_buffer: SampleSource,
        demo_buffer: SampleSource | None,
        batch_size: int,
        min_replay_buffer_size: int,
        min_demo_buffer_size: int,
        prefetch_size: int = 5,
    ) -> None:
        if isinstance(prefetch_size, bool) or not isinstance(prefetch_size, int) or prefetch_size <= 0:
            raise UsageError(f"prefetch_size must be an int > 0, got {prefetch_size!r}")
        super().__init__(replay_buffer, demo_buffer, batch_size, min_replay_buffer_size, min_demo_buffer_size)
        self.prefetch_size = prefetch_size
        self._prefetch = _Prefetch(self._sampler, queue.Queue(maxsize=prefetch_size))
        self.sample_thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    @property
    def preload_queue(self) -> queue.Queue[Any]:
        """RLinf's name for the queue of prefetched batches."""
        return self._prefetch.batches

    def __iter__(self) -> Iterator[Batch]:
        # a generator: the thread starts on the first next(), as with RLinf's
        with self._start_lock:
            if self.sample_thread is None and not self.closed:
                self.sample_thread = threading.Thread(
                    target=self._prefetch.run, name="rbtool-prefetch", daemon=True
                )
                self.sample_thread.start()
        yield from _consume(self._prefetch)

    def close(self) -> None:
        """Stop the prefetch thread; raise RuntimeError from the sampling error if there was one."""
        prefetch = self._prefetch
        prefetch.sampler.stop.set()
        thread = self.sample_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(JOIN_TIMEOUT)
            if thread.is_alive():
                warnings.warn(
                    f"the prefetch thread is still sampling {JOIN_TIMEOUT} s after close(); "
                    "it ends after its current sample",
                    RuntimeWarning,
                    stacklevel=2,
                )
        _drain(prefetch.batches)
        if prefetch.error is not None and not prefetch.reported:
            raise prefetch.failure()

    def __del__(self) -> None:
        prefetch = getattr(self, "_prefetch", None)
        if prefetch is not None:
            prefetch.sampler.stop.set()  # the thread ends on its own; nothing raised from a finalizer


def _consume(prefetch: _Prefetch) -> Iterator[Batch]:
    stop = prefetch.sampler.stop
    while True:
        if prefetch.error is not None:
            raise prefetch.failure()
        if stop.is_set():
            return
        try:
            item = prefetch.batches.get(timeout=STOP_CHECK)
        except queue.Empty:
            continue
        if item is _FAILED:
            continue  # the error is raised at the top of the loop
        yield item


def _drain(batches: queue.Queue[Any]) -> None:
    while True:
        try:
            batches.get_nowait()
        except queue.Empty:
            return


def replay_buffer_collate_fn(batch: list[Batch]) -> Batch:
    """DataLoader's collate_fn for these datasets: each item is a whole batch; unwrap the list of one."""
    return batch[0]


def seed_workers(base_seed: int, rank: int = 0) -> Callable[[int], None]:
    """A DataLoader `worker_init_fn` that reseeds each worker's copy of the dataset's buffers.

    Worker `w` of rank `rank` seeds with `derive_seed(base_seed, rank, w)` (through the
    dataset's `reseed`), so every worker of every rank draws its own stream, the same in
    every run. Without workers (`num_workers=0`) call `dataset.reseed(base_seed, rank)`: the
    same stream as worker 0.
    """
    derive_seed(base_seed, rank)  # checks both now, not in the workers
    return functools.partial(_seed_worker, base_seed, rank)


def _seed_worker(base_seed: int, rank: int, worker_id: int) -> None:
    info = torch.utils.data.get_worker_info()
    if info is None:
        raise UsageError("seed_workers() is a DataLoader worker_init_fn; call dataset.reseed() instead")
    dataset = info.dataset
    if not isinstance(dataset, ReplayBufferDataset):
        raise UsageError(f"seed_workers() reseeds a ReplayBufferDataset, not {type(dataset).__name__}")
    dataset.reseed(base_seed, rank, worker_id)


__all__ = [
    "PreloadReplayBufferDataset",
    "ReplayBufferDataset",
    "concat_batch",
    "derive_seed",
    "replay_buffer_collate_fn",
    "seed_workers",
]
