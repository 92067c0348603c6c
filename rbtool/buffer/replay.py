"""TrajectoryReplayBuffer: RLinf's constructor and methods, composed of rbtool's parts.

index (rbtool.files.index: ids, entries, counters) + storage (rbtool.buffer.storage: where each
trajectory's rows are) + samplers (rbtool.buffer.sampling, rbtool.buffer.topk: draws only) + writer
(rbtool.files.writer: the auto-save thread, publish order, directory lock).
"""

from __future__ import annotations

import copy
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rbtool.buffer.batchmem import BatchMemory
from rbtool.buffer.cache import CachedIds
from rbtool.buffer.loading import buffer_index, recorded_signature_of, stage
from rbtool.buffer.sampling import (
    Draw,
    SampleCounts,
    as_num_chunks,
    check_budget,
    check_draw,
    check_num_chunks,
    draw_range,
    effective_window,
)
from rbtool.buffer.storage import (
    FileMap,
    FlatView,
    RawTrajectory,
    RowCache,
    Signature,
    TrajectoryStore,
    WindowSchema,
    default_hold_budget,
    gather,
    hold_window,
)
from rbtool.errors import (
    BufferClosedError,
    CheckpointError,
    EmptyBufferError,
    UsageError,
)
from rbtool.files import trajfile
from rbtool.files.dirs import CheckpointView, check_files, open_view, warn_layout
from rbtool.files.index import DEFAULT_SEED, Index, init_buffer_dir, read_index, window_of, window_start
from rbtool.files.writer import (
    AutoSaveWriter,
    Progress,
    Rules,
    adopt_files,
    record_schema,
    start_phase,
    write_checkpoint,
)
from rbtool.format import FORMATS, trajectory_file_name
from rbtool.format.layout import field_schema

if TYPE_CHECKING:
    from rbtool.buffer.topk import Candidates, RewardIndex

# The largest share of the auto-save writer's time spent rewriting the index (see _publish).
PUBLISH_SHARE = 0.2
# Trajectories kept open for sampling (small fields in memory, large rows left in their
# files), least recently used dropped first; file descriptors are bounded separately.
DEFAULT_MAX_OPEN_FILES = 1024


class TrajectoryReplayBuffer:
    """A trajectory-level replay buffer with RLinf's API and checkpoint layout.

    Trajectories are `[T, B, ...]` dicts (or objects with those attributes); sampling draws
    `(t, b)` rows uniformly from the last `sample_window_size` trajectories. Batches hold
    the fields RLinf's sampler keeps; `extra_fields=True` samples every tensor of >= 2 dims.

    `load_checkpoint` reads the window's files once and holds their sampled rows in memory,
    one column per field, when they fit `hold_rows_budget` bytes (default a quarter of
    physical memory; 0 holds none): a batch is then one gather per field, and the rows are
    those the files held at load. Otherwise, and for `.pkl` or unusual files, drawn rows are
    read from the files when drawn.

    `map_rows=True` gathers large rows (>= 2 KiB, e.g. images) of `.pt` files from the files
    mapped side by side in one address range, one index_select per field per batch, instead
    of one pread per drawn row: faster, but the mapped file pages count in the resident set
    (up to the window's large rows; `map_rows_budget` bytes drops them past that, at the cost
    of faulting them in again) and a file truncated while mapped faults the process (SIGBUS).
    Linux only; elsewhere the setting reads with pread.
    """

    def __init__(
        self,
        seed: int | None = DEFAULT_SEED,
        enable_cache: bool = True,
        cache_size: int = 5,
        sample_window_size: int = 100,
        auto_save: bool = False,
        auto_save_path: str = "",
        trajectory_format: str = "pt",
        *,
        max_open_files: int = DEFAULT_MAX_OPEN_FILES,
        extra_fields: bool = False,
        map_rows: bool = False,
        map_rows_budget: int | None = None,
        hold_rows_budget: int | None = None,
    ) -> None:
        import torch

        if trajectory_format not in FORMATS:
            raise UsageError(f"trajectory_format must be 'pt' or 'pkl', got {trajectory_format!r}")
        window = effective_window(sample_window_size)  # negative: every trajectory, as 0
        if auto_save and not auto_save_path:
            raise UsageError("auto_save=True needs an auto_save_path")
        self.seed = seed
        self.enable_cache = enable_cache
        self.cache_size = cache_size
        self.sample_window_size = sample_window_size
        # auto_save off: how many trajectories are held (the last ones added or loaded). As in
        # RLinf, whose cache is this size, it is the constructor's window for the buffer's life.
        self._capacity = window
        # the ids RLinf's cache would hold, for get_stats() (auto_save off: what is held)
        self._cached = CachedIds(window if not auto_save else cache_size if enable_cache else 0)
        self.auto_save = auto_save
        self.auto_save_path = Path(auto_save_path) if auto_save else None
        self.trajectory_format = trajectory_format
        self.extra_fields = bool(extra_fields)
        self.max_open_files = max(1, max_open_files, cache_size if enable_cache else 0)

        # `_lock` guards the maps the auto-save writer thread changes too (the index's entries,
        # where each trajectory is); `_window_lock` orders what changes the window (adds and
        # the evictions they cause, load, clear) against whole samples, so that a sample sees
        # the window before an add or after it, never the trajectories of a window it did not
        # draw from. The writer thread never takes `_window_lock`: always taken before `_lock`.
        self._lock = threading.RLock()
        self._window_lock = threading.RLock()
        self._index = Index(seed=seed, trajectory_format=trajectory_format)
        check_budget("map_rows_budget", map_rows_budget)
        self.map_rows = bool(map_rows)
        self.map_rows_budget = map_rows_budget
        check_budget("hold_rows_budget", hold_rows_budget)
        if hold_rows_budget is None:  # mapped rows are read from the files, as asked
            hold_rows_budget = 0 if self.map_rows else default_hold_budget()
        self.hold_rows_budget = int(hold_rows_budget)
        self._store = self._new_store()
        self._writer: AutoSaveWriter | None = None
        # auto-save publishing: the last id count queued, when and how long the last took
        self._publish_upto = 0
        self._last_publish = 0.0
        self._publish_cost = 0.0
        self._publish_now = threading.Event()
        self._closed = False
        # notified whenever the size may have changed (add, load, clear, close): wait_until_ready
        self._size_changed = threading.Condition(threading.Lock())
        self._unloaded_size = 0
        self._warned_left_out = False
        # Window bookkeeping, updated from what is added and what leaves the window (never
        # recomputed over the window on each add): cumulative sample counts along the id
        # list, the window's signatures (its shared fields), the added trajectories' rows.
        # A new generation (load, clear) starts them again.
        self._generation = object()
        self._recorded: dict[str, Signature] = {}  # signatures of the index's recorded schemas
        self._counts = SampleCounts()
        self._window_schema = WindowSchema()
        self._rows = RowCache(self.hold_rows_budget)
        self._held_generation: object = None  # the generation whose window was last read whole
        # the memory of sampled batches' large fields, reused once no batch refers to it
        self._batch_memory = BatchMemory()
        # Reward scores for top-k sampling; created by the first top-k call, then fed per add.
        self._rewards: RewardIndex | None = None

        self.random_generator = torch.Generator()
        if seed is None:
            self.random_generator.seed()
        else:
            self.random_generator.manual_seed(int(seed))

        if self.auto_save_path is not None:
            init_buffer_dir(self.auto_save_path, self._index)
            self._writer = AutoSaveWriter(self.auto_save_path)
            # A directory that already holds a buffer must be resumed with load_checkpoint()
            # before anything is added, or new ids would collide with the files in it.
            self._unloaded_size = read_index(self.auto_save_path).size

    # ----------------------------------------------------------------- state
    @property
    def size(self) -> int:
        return self._index.size

    def __len__(self) -> int:
        return self._index.size

    @property
    def total_samples(self) -> int:
        return self._index.total_samples

    @property
    def trajectory_id_list(self) -> list[int]:
        return list(self._index.id_list)

    @property
    def trajectory_counter(self) -> int:
        return self._index.trajectory_counter

    def window_ids(self) -> list[int]:
        """Ids of the current sampling window (SPEC §3 step 1).

        With auto_save off only held trajectories can be sampled: after the window shrank
        and grew again, the window is the last `sample_window_size` of those still held.
        """
        with self._lock:  # not half-way through an add in another thread
            lo, hi = self._window_range()
            return self._index.id_list[lo:hi]

    def _window_range(self) -> tuple[int, int]:
        """The window as positions `[lo, hi)` of the id list.

        With auto_save off, what is held is a run at the end of the list (adds append,
        eviction drops the front), so the window is the end of that run.
        """
        ids = self._index.id_list
        n = len(ids)
        want = n - window_start(n, effective_window(self.sample_window_size))
        if self.auto_save:
            return n - want, n
        held = len(self._store.memory) + len(self._store.files)
        lo = n - min(want, held)
        if lo == n or (self._store.holds(ids[lo]) and self._store.holds(ids[-1])):
            return lo, n
        raise CheckpointError("the buffer's held trajectories are not the end of its id list")

    def get_stats(self) -> dict[str, int]:
        """RLinf's statistics: `num_trajectories`, `total_samples`, `cache_size`, all numbers.

        `cache_size` is what RLinf reports: with auto_save off the trajectories held, with it
        on the trajectories its cache of `cache_size` would hold (the last added or loaded
        since the last load, clear or clear_cache; 0 with enable_cache=False).
        """
        held = len(self._store.memory) + len(self._store.files)
        cached = len(self._cached) if self.auto_save else held
        return {"num_trajectories": self.size, "total_samples": self.total_samples, "cache_size": cached}

    def info(self) -> dict[str, Any]:
        """rbtool's own facts about the buffer (window, memory, files, format, seed)."""
        window = self.window_ids()
        return {
            "size": self.size,
            "total_samples": self.total_samples,
            "trajectory_counter": self.trajectory_counter,
            "sample_window_size": self.sample_window_size,
            "window_size": len(window),
            "window_samples": sum(self._index.entries[i]["num_samples"] for i in window),
            "in_memory": len(self._store.memory),
            "open_files": len(self._store.views),
            "held_rows_bytes": self._rows.nbytes,
            "auto_save": self.auto_save,
            "trajectory_format": self.trajectory_format,
            "seed": self.seed,
            "extra_fields": self.extra_fields,
        }

    def is_ready(self, min_size: int) -> bool:
        """True when the buffer holds at least `min_size` trajectories (RLinf's meaning)."""
        return self.size >= min_size

    async def is_ready_async(self, min_size: int) -> bool:
        """is_ready() for async callers."""
        return self.is_ready(min_size)

    def wait_until_ready(self, min_size: int, timeout: float | None = None) -> bool:
        """Block until is_ready(min_size), the buffer is closed, or `timeout` seconds passed.

        Returns is_ready(min_size). The wait sleeps on a condition that adds, loads, clear()
        and close() notify, so a waiter costs no CPU and wakes as soon as an add makes it ready.
        """
        with self._size_changed:
            self._size_changed.wait_for(lambda: self._closed or self.is_ready(min_size), timeout)
        return self.is_ready(min_size)

    def _notify_size_changed(self) -> None:
        with self._size_changed:
            self._size_changed.notify_all()

    # ---------------------------------------------------------------- adding
    def _check_open(self) -> None:
        if self._closed:
            raise BufferClosedError("the buffer is closed")

    def _check_resumed(self) -> None:
        if self._unloaded_size:
            raise CheckpointError(
                f"{self.auto_save_path}: already holds a buffer with {self._unloaded_size} trajectories; "
                "call load_checkpoint() on it to resume, or use a new auto_save_path"
            )

    def add_trajectories(self, trajectories: list[Any]) -> list[int]:
        """Add trajectories; all are validated before any is added. Returns their new ids."""
        self._check_open()
        self._check_resumed()
        if self._writer is not None and self._writer.failed():
            self._writer.flush()
        prepared = [trajfile.normalize(t, f"trajectory #{n}") for n, t in enumerate(trajectories)]
        ids: list[int] = []
        with self._window_lock, self._lock:
            position = len(self._index.id_list)
            self._counts.extend(info.num_samples for _, info in prepared)
            for traj, info in prepared:
                tid = self._index.trajectory_counter
                self._index.trajectory_counter += 1
                self._index.entries[tid] = {
                    "num_samples": info.num_samples,
                    "trajectory_id": tid,
                    "max_episode_length": info.max_episode_length,
                    "shape": list(info.shape),
                    "model_weights_id": info.model_weights_id,
                    "uuid": uuid.uuid4().hex,
                }
                record_schema(self._index, self._index.entries[tid], field_schema(traj, info.shape[0]))
                self._index.id_list.append(tid)
                self._store.put(tid, traj)
                ids.append(tid)
                self._cached.put((tid,))
                t, b = info.shape[:2]
                self._rows.append(
                    position,
                    self._counts.start(position),
                    FlatView(traj, t, b, extra_fields=self.extra_fields),
                )
                position += 1
            if self._rewards is not None:
                from rbtool.buffer.topk import trajectory_scores

                added = zip(ids, prepared, strict=True)
                self._rewards.add((tid, trajectory_scores(t, info.num_samples)) for tid, (t, info) in added)
            if self._writer is not None:
                for tid in ids:
                    self._writer.submit(lambda tid=tid: self._write_one(tid))  # type: ignore[misc]
                upto, counter = len(self._index.id_list), self._index.trajectory_counter
                self._publish_upto = upto
                self._writer.submit(lambda: self._publish(upto, counter))
            else:
                self._evict_outside_window()
        self._notify_size_changed()
        return ids

    def _evict_outside_window(self) -> None:
        """auto_save off: hold only the last `_capacity` trajectories (RLinf's cache size).

        What is held is a run at the end of the id list: only its front can leave.
        """
        ids = self._index.id_list
        n = len(ids)
        held = len(self._store.memory) + len(self._store.files)
        keep_from = n - min(self._capacity or n, n)
        for position in range(n - held, keep_from):
            self._store.drop(ids[position])

    def _write_one(self, tid: int) -> None:
        """Writer thread: write one trajectory file and record its size and hash."""
        assert self._writer is not None
        with self._lock:
            traj = self._store.memory[tid]
            entry = self._index.entries[tid]
            name = trajectory_file_name(tid, entry["model_weights_id"], self.trajectory_format)
        data = trajfile.to_bytes(traj, self.trajectory_format)
        path = self._writer.write_file(name, data)
        with self._lock:
            entry["file_bytes"] = len(data)
            entry["sha256"] = trajfile.sha256_bytes(data)
            self._store.written(tid, path)

    def _publish(self, upto: int, counter: int) -> None:
        """Writer thread: publish the index of the first `upto` ids, whose files are all written.

        Rewriting the index costs O(size), so publishes are spaced: a publish waits until
        at most PUBLISH_SHARE of the writer's time has gone to publishing, and is skipped
        when a later one (listing more) is queued behind it. flush() ends the wait.
        """
        assert self._writer is not None
        if upto < self._publish_upto:
            return
        wait = self._last_publish + self._publish_cost / PUBLISH_SHARE - time.monotonic()
        if wait > 0 and not self._publish_now.wait(wait) and upto < self._publish_upto:
            return
        start = time.monotonic()
        with self._lock:
            # entries of ids up to `upto` no longer change (their files are written): shared
            snapshot = Index(
                entries=self._index.entries,
                id_list=self._index.id_list[:upto],
                trajectory_counter=counter,
                seed=self._index.seed,
                trajectory_format=self._index.trajectory_format,
                extra_metadata=dict(self._index.extra_metadata),
                schemas=dict(self._index.schemas),
            )
        self._writer.publish(snapshot)
        self._last_publish = time.monotonic()
        self._publish_cost = self._last_publish - start

    def flush(self) -> None:
        """Wait until every background write is complete; re-raise the first that failed."""
        if self._writer is not None:
            self._publish_now.set()
            try:
                self._writer.flush()
            finally:
                self._publish_now.clear()

    # -------------------------------------------------------------- sampling
    def _shape(self, tid: int) -> tuple[int, int]:
        """[T, B] of a trajectory, as its index entry records it."""
        shape = self._index.entries[tid]["shape"]
        return shape[0], shape[1]

    def _shapes(self, tids: Sequence[int]) -> list[tuple[int, int]]:
        return self._index.shapes(tids)

    def _raws(self, tids: list[int]) -> list[RawTrajectory | None]:
        return self._store.raw_many(tids, self._shape)

    def _view(self, tid: int) -> FlatView:
        return self._store.view(tid, *self._shape(tid))

    def _recorded_signature(self, tid: int) -> Signature | None:
        """The signature the index entry of a trajectory on disk records, if it records one."""
        if tid in self._store.memory:
            return None
        return recorded_signature_of(self._index, tid, self._recorded, self.extra_fields)

    def _signature_at(self, position: int) -> Signature:
        tid = self._index.id_list[position]
        return self._store.signature(tid, *self._shape(tid), self._recorded_signature(tid))

    def _hold_window_rows(self, progress: Progress | None = None) -> None:
        """Read the window's sampled rows into memory at once, when they fit the budget
        (see storage.bulk); otherwise drawn rows are read from their files, as before."""
        self._held_generation = self._generation
        lo, hi = self._window_range()
        if hi <= lo or not self.hold_rows_budget:
            return
        base = self._counts.start(lo)
        covered = self._rows.covering(lo, hi, base)
        if covered is not None and covered.first == 0 and covered.stop == hi - lo:
            return
        tids = self._index.id_list[lo:hi]
        total = self._counts.start(hi) - base
        start_phase(progress, len(tids), "reading the window's trajectories")
        held = hold_window(
            self._store, tids, self._shapes, total, self.hold_rows_budget, self._file_signatures, progress
        )
        if held is not None:
            columns, specs = held
            self._rows.adopt(lo, hi, base, columns, specs, total)

    def read_rows_when_drawn(self) -> None:
        """Hold no rows from now on: drawn rows are read from the files when drawn (as with
        `hold_rows_budget=0`), and rows held so far are let go. For files that are filled as
        they are drawn (the stand-ins of `rbtool.remote.ranges.RangeReads`), whose unfetched
        bytes must never be read as data."""
        with self._window_lock:
            self.hold_rows_budget = 0
            self._rows = RowCache(0)
            end = len(self._index.id_list)
            self._rows.reset(end, self._counts.start(end))

    def _file_signatures(
        self, tids: list[int], signature: Signature, where: Callable[[int], Path | None]
    ) -> None:
        """Trajectories' signature as their files (or memory) show it, read for the window's rows."""
        recorded = self._recorded_signature if self._index.schemas else None
        self._store.note_signatures(tids, signature, recorded, where)

    def _left_window(self, position: int) -> None:
        self._store.forget(self._index.id_list[position])

    def _track_window(self, lo: int, hi: int, progress: Progress | None = None) -> None:
        """Bring the window's signatures up to date (new ones read from headers, a few at once)."""
        if self._window_schema.generation is not self._generation or lo < self._window_schema.lo:
            start = lo
        else:
            start = max(lo, self._window_schema.hi)
        entries, recorded, known = self._index.entries, self._index.schemas, self._store.signatures
        unknown = [
            tid
            for tid in self._index.id_list[start:hi]
            if tid not in known and entries[tid].get("schema") not in recorded
        ]
        if len(unknown) > 64:
            start_phase(progress, len(unknown), "reading the window's trajectory headers")
            shapes = [(tid, *self._shape(tid)) for tid in unknown]
            self._store.read_headers(shapes, progress)
        self._window_schema.track(
            self._generation, lo, hi, self._signature_at, self._left_window, self._signatures_in
        )

    def _signatures_in(self, start: int, stop: int) -> list[Signature]:
        return self._store.signatures_of(self._index.id_list[start:stop], start, self._signature_at)

    def sample(
        self, num_chunks: int, strategy: str = "uniform", k: int | None = None, temperature: float = 1.0
    ) -> dict[str, Any]:
        """Draw `num_chunks` rows from the window; a dict of `[num_chunks, ...]` tensors.

        `strategy="uniform"` (the default) draws every sample of the window alike;
        `strategy="topk"` draws among the window's `k` highest-reward samples with weights
        softmax(reward / temperature) (SPEC §6).
        """
        return self.sample_with_draw(num_chunks, strategy, k, temperature)[1]

    def sample_chunks(self, num_chunks: int) -> dict[str, Any]:
        """RLinf's name for a uniform sample(); as RLinf's, 0 chunks is an empty dict."""
        self._check_open()
        if not as_num_chunks(num_chunks):
            if not self._index.total_samples:
                raise EmptyBufferError("cannot sample from an empty buffer")
            return {}
        return self.sample(num_chunks)

    def sample_with_draw(
        self,
        num_chunks: int,
        strategy: str = "uniform",
        k: int | None = None,
        temperature: float = 1.0,
        *,
        progress: Progress | None = None,
        before_gather: Callable[[Draw], None] | None = None,
    ) -> tuple[Draw, dict[str, Any]]:
        """`sample()`, also returning the Draw: which trajectory and row each batch row came from.

        Everything that can fail is checked before a random number is drawn. `progress` is
        told of the files read for the window's fields (the first sample of a checkpoint
        another writer made reads each file's header), as writers report their files.
        A sample waits for an add in another thread to finish (and an add for a sample), so
        it draws from and reads one window; samples in several threads run one at a time.
        `before_gather(draw)` is called once the rows are drawn and before any is read (a
        reader of remote objects fetches the drawn trajectories' files there).
        """
        from rbtool.buffer.topk import check_strategy

        self._check_open()
        check_strategy(strategy, k, temperature)
        num_chunks = as_num_chunks(num_chunks)  # numpy integers and 0-d tensors too
        check_num_chunks(num_chunks)
        with self._window_lock:
            return self._sample_with_draw(num_chunks, strategy, k, temperature, progress, before_gather)

    def _sample_with_draw(
        self,
        num_chunks: int,
        strategy: str,
        k: int | None,
        temperature: float,
        progress: Progress | None,
        before_gather: Callable[[Draw], None] | None,
    ) -> tuple[Draw, dict[str, Any]]:
        from rbtool.buffer.topk import draw_topk

        self._check_open()
        if not self._index.id_list:
            raise EmptyBufferError("cannot sample from an empty buffer")
        if self._held_generation is not self._generation:
            self._hold_window_rows(progress)
        lo, hi = self._window_range()
        self._track_window(lo, hi, progress)
        schema, left_out = self._window_schema.shared()
        ids = self._index.id_list
        # a call that fails draws nothing (SPEC §3 step 3): the stream is put back
        state = self.random_generator.get_state()
        try:
            if strategy == "topk":
                assert k is not None
                window = ids[lo:hi]
                sizes = [self._index.entries[i]["num_samples"] for i in window]
                check_draw(sizes, num_chunks)
                candidates = self._topk_candidates(window, k)
                draw = draw_topk(window, sizes, candidates, num_chunks, temperature, self.random_generator)
            else:
                draw = draw_range(ids, self._counts, lo, hi, num_chunks, self.random_generator)
            if left_out and not self._warned_left_out:
                self._warned_left_out = True
                warnings.warn(
                    f"sampled batches leave out {', '.join(left_out)} (the reference sampler ignores "
                    "them); construct the buffer with extra_fields=True to sample them",
                    stacklevel=3,
                )
            if before_gather is not None:
                before_gather(draw)
            base = self._counts.start(lo)
            self._rows.trim(lo, base)
            cached = self._rows.covering(lo, hi, base)
            memory = self._batch_memory
            batch = gather(draw, schema, self._view, cached, self._raws, self._store.rowmap, memory)
        except BaseException:
            self.random_generator.set_state(state)
            raise
        return draw, batch

    def _topk_candidates(self, window: list[int], k: int) -> Candidates:
        """The window's top-k samples by reward; scores of loaded trajectories are read lazily."""
        from rbtool.buffer.storage import view_scores
        from rbtool.buffer.topk import RewardIndex

        if self._rewards is None:
            self._rewards = RewardIndex()
        self._rewards.fill(window, lambda tid: view_scores(self._view(tid)))
        if len(self._rewards) > len(window):
            self._rewards.retain(window)
        return self._rewards.top_k(k, window)

    def clear_cache(self) -> None:
        """Finish background writes and drop every opened trajectory view and file descriptor.

        What the buffer holds is kept (with auto_save off the held window is the data
        itself, not a cache); views are reopened on the next sample.
        """
        self.flush()
        with self._window_lock:
            self._store.clear_views()
            self._batch_memory.clear()
            self._cached.reset()

    def _new_generation(self) -> None:
        """The id list was replaced: window bookkeeping (reward scores too) starts again from it."""
        entries = self._index.entries
        self._generation = object()
        self._counts = SampleCounts(entries[i]["num_samples"] for i in self._index.id_list)
        self._window_schema = WindowSchema()
        end = len(self._index.id_list)
        self._rows.reset(end, self._counts.start(end))
        self._rewards = None

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_path: str | Path) -> None:
        """Write the sampling window's trajectories and an index counting only them.

        The checkpoint is built beside `save_path` and renamed into place when complete.
        The running buffer is not changed, and keeps reading what it holds even when
        `save_path` is the directory it was loaded from.
        """
        self._check_open()
        target = Path(save_path)
        if self.auto_save_path is not None and target.resolve() == self.auto_save_path.resolve():
            raise UsageError(f"{target}: is this buffer's auto-save directory; save the checkpoint elsewhere")
        self.flush()
        with self._lock:
            ids = self.window_ids()
            index = self._index.subset(ids)
            index.entries = {i: copy.deepcopy(index.entries[i]) for i in ids}
        sources = {tid: self._store.source(tid) for tid in ids}
        write_checkpoint(target, index, sources.__getitem__, Rules(overwrite=True))

    def load_checkpoint(
        self,
        load_path: str | Path | CheckpointView,
        is_distributed: bool = False,
        local_rank: int = 0,
        world_size: int = 1,
        *,
        strict: bool = True,
    ) -> None:
        """Replace the buffer's contents with a checkpoint (whole, or one rank's block).

        The buffer takes the checkpoint's trajectory_format, and its seed when it has one
        (re-seeding the generator); without a seed the generator's stream continues.
        Trajectory files are read when first sampled. With auto_save off the window's files
        are kept open, so deleting or replacing `load_path` later does not break sampling
        or saving; with auto_save on they are linked (or copied) into the auto-save
        directory, which stays a valid checkpoint. `load_path` may also be a view already
        opened with rbtool.files.dirs.open_view: then exactly that index is loaded.
        """
        self._check_open()
        self.flush()
        if is_distributed:
            Index().rank_block(world_size, local_rank)  # validates world_size and rank
        # an already-open view (what a caller has looked at) is loaded as it is (reading the
        # directory again could meet a newer index); a directory's window is held first
        staged = None
        if not isinstance(load_path, CheckpointView) and self.auto_save_path is None:
            rank = (world_size, local_rank) if is_distributed else None
            staged = stage(load_path, rank, self._capacity, self.sample_window_size, self.hold_rows_budget,
                           self._new_store, self._recorded, self.extra_fields)  # fmt: skip
        if staged is not None and staged.store is None:  # not held: the index read, checked as before
            view, staged = check_files(staged.view, strict), None
        elif staged is not None:
            view = staged.view
        else:
            view = load_path if isinstance(load_path, CheckpointView) else open_view(load_path, strict=strict)
        warn_layout(view, world_size if is_distributed else None)
        index = view.index
        if is_distributed:
            index = index.rank_block(world_size, local_rank)
        with self._window_lock, self._lock:
            if index.seed is not None:
                self.seed = index.seed
                self.random_generator.manual_seed(int(index.seed))
            self.trajectory_format = index.trajectory_format
            # the entries of a view opened here are the buffer's own; a caller's are copied
            own = not isinstance(load_path, CheckpointView) and len(index.entries) == len(index.id_list)
            new = buffer_index(index, self.seed, copy_entries=not own)
            if self.auto_save_path is not None:
                sources = {i: view.file_of(i) for i in index.id_list}
                old = self._store.files.values()
                files = adopt_files(self._writer, self.auto_save_path, new, sources, old)  # type: ignore[arg-type]
                self._store.set_files(FileMap.of(files), pin=False)
            elif staged is not None and staged.store is not None:
                self._store.clear()
                self._store = staged.store
            else:
                kept = window_of(new.id_list, self._capacity)
                self._store.set_files(FileMap(kept, view.place_of, view.places_of), pin=True)
            self._cached.reset(new.id_list)
            self._index = new
            self._unloaded_size = 0
            self._new_generation()
            if staged is not None:
                lo, hi = self._window_range()
                if new.id_list[lo:hi] == staged.tids:  # as it must be; else read again below
                    base, end, self._held_generation = (
                        self._counts.start(lo),
                        self._counts.start(hi),
                        self._generation,
                    )
                    self._rows.adopt(lo, hi, base, staged.columns, staged.specs, end - base)
        with self._window_lock:  # files are read without the writer thread's lock
            self._hold_window_rows()
        self._notify_size_changed()

    def _new_store(self) -> TrajectoryStore:
        budget, lock = self.map_rows_budget, self._lock
        return TrajectoryStore(max_open=self.max_open_files, extra_fields=self.extra_fields, lock=lock,
                               row_map=self.map_rows, row_map_budget=budget)  # fmt: skip

    # -------------------------------------------------------------- lifecycle
    def clear(self) -> None:
        """Forget every trajectory; with auto_save on, empty the auto-save directory's index too."""
        self._check_open()
        self.flush()
        with self._window_lock, self._lock:
            own = self._writer is not None and self.auto_save_path is not None
            old_files = list(self._store.files.values()) if own else []
            self._index = Index(seed=self.seed, trajectory_format=self.trajectory_format)
            self._store.clear()
            self._cached.reset()
            self._unloaded_size = 0
            self._new_generation()
            if self._writer is not None and self.auto_save_path is not None:
                self._writer.publish(self._index)
                for path in old_files:
                    if path.parent == self.auto_save_path:
                        path.unlink(missing_ok=True)
        self._notify_size_changed()

    def close(self, wait: bool = True) -> None:
        """Finish background writes (unless wait=False) and release the auto-save directory."""
        if self._closed:
            return
        try:
            if wait:
                self.flush()
        finally:
            with self._window_lock:  # a sample under way finishes reading first
                self._closed = True
                if self._writer is not None:
                    self._publish_now.set()
                    self._writer.close(wait=wait)
                self._store.clear()
                self._batch_memory.clear()
            self._notify_size_changed()

    def __enter__(self) -> TrajectoryReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed and self._writer is not None:
                self._writer.close(wait=True)
        except Exception:
            pass
