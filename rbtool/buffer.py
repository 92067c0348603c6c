"""TrajectoryReplayBuffer: RLinf's constructor and methods over rbtool's index, files and sampler."""

from __future__ import annotations

import copy
import threading
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rbtool import trajfile
from rbtool.dirs import open_checkpoint
from rbtool.errors import (
    CheckpointError,
    RbtoolError,
    TrajectoryFileError,
    UsageError,
)
from rbtool.fsutil import DirLock, link_or_copy, write_bytes_atomic
from rbtool.index import (
    FORMATS,
    Index,
    init_buffer_dir,
    read_index,
    trajectory_file_name,
    window_of,
    write_index,
)
from rbtool.sampling import (
    Draw,
    FieldPath,
    FlatView,
    Schema,
    draw_uniform,
    gather,
    shared_schema,
    window_cache,
)

if TYPE_CHECKING:
    from rbtool.topk import Candidates, RewardIndex

# Trajectories kept open for sampling (small fields in memory, large rows left in their
# files), least recently used dropped first; file descriptors are bounded separately.
DEFAULT_MAX_OPEN_FILES = 1024


@dataclass
class WindowPlan:
    """What sampling needs of the current window, computed once per window."""

    window: list[int]
    sizes: list[int]
    schema: Schema
    cached: dict[FieldPath, Any]


class TrajectoryReplayBuffer:
    """A trajectory-level replay buffer with RLinf's API and checkpoint layout.

    Trajectories are `[T, B, ...]` dicts (or objects with those attributes); sampling draws
    `(t, b)` rows uniformly from the last `sample_window_size` trajectories.
    """

    def __init__(
        self,
        seed: int | None = 1234,
        enable_cache: bool = True,
        cache_size: int = 5,
        sample_window_size: int = 100,
        auto_save: bool = False,
        auto_save_path: str = "",
        trajectory_format: str = "pt",
        *,
        max_open_files: int = DEFAULT_MAX_OPEN_FILES,
    ) -> None:
        import torch

        if trajectory_format not in FORMATS:
            raise UsageError(f"trajectory_format must be 'pt' or 'pkl', got {trajectory_format!r}")
        if sample_window_size < 0:
            raise UsageError(f"sample_window_size must be >= 0, got {sample_window_size}")
        if auto_save and not auto_save_path:
            raise UsageError("auto_save=True needs an auto_save_path")
        self.seed = seed
        self.enable_cache = enable_cache
        self.cache_size = cache_size
        self.sample_window_size = int(sample_window_size)
        self.auto_save = auto_save
        self.auto_save_path = Path(auto_save_path) if auto_save else None
        self.trajectory_format = trajectory_format
        self.max_open_files = max(1, max_open_files, cache_size if enable_cache else 0)

        self._lock = threading.RLock()
        self._index = Index(seed=seed, trajectory_format=trajectory_format)
        self._memory: dict[int, dict[str, Any]] = {}  # trajectories held in memory
        self._files: dict[int, Path] = {}  # where each trajectory's file is
        self._views: OrderedDict[int, FlatView] = OrderedDict()  # bounded LRU of open views
        self._schemas: dict[int, Schema] = {}
        self._writer: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []
        self._closed = False
        self._dir_lock: DirLock | None = None
        self._unloaded_size = 0
        # Bumped whenever the id list changes; keys the cached window plan.
        self._index_version = 0
        self._window_cache: tuple[tuple[int, int], WindowPlan] | None = None
        # Reward scores for top-k sampling; created by the first top-k call, then fed per add.
        self._rewards: RewardIndex | None = None

        self.random_generator = torch.Generator()
        self._seed_generator(seed)

        if self.auto_save_path is not None:
            init_buffer_dir(self.auto_save_path, self._index)
            self._dir_lock = DirLock(self.auto_save_path, wait=False)
            self._dir_lock.acquire()
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rbtool-writer")
            # A directory that already holds a buffer must be resumed with load_checkpoint()
            # before anything is added, or new ids would collide with the files in it.
            self._unloaded_size = read_index(self.auto_save_path).size

    # ----------------------------------------------------------------- state
    def _seed_generator(self, seed: int | None) -> None:
        if seed is None:
            self.random_generator.seed()
        else:
            self.random_generator.manual_seed(int(seed))

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
        """Ids of the current sampling window (SPEC §3 step 1)."""
        return window_of(self._index.id_list, self.sample_window_size)

    def get_stats(self) -> dict[str, Any]:
        window = self.window_ids()
        return {
            "size": self.size,
            "total_samples": self.total_samples,
            "trajectory_counter": self.trajectory_counter,
            "sample_window_size": self.sample_window_size,
            "window_size": len(window),
            "window_samples": sum(self._index.entries[i]["num_samples"] for i in window),
            "in_memory": len(self._memory),
            "open_files": len(self._views),
            "auto_save": self.auto_save,
            "trajectory_format": self.trajectory_format,
            "seed": self.seed,
        }

    # ---------------------------------------------------------------- adding
    def _check_open(self) -> None:
        if self._closed:
            raise RbtoolError("the buffer is closed")

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
        self._raise_writer_error()
        prepared = [trajfile.normalize(t, f"trajectory #{n}") for n, t in enumerate(trajectories)]
        ids: list[int] = []
        with self._lock:
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
                self._index.id_list.append(tid)
                self._memory[tid] = traj
                ids.append(tid)
            self._index_version += 1
            if self._rewards is not None:
                from rbtool.topk import trajectory_scores

                added = zip(ids, prepared, strict=True)
                self._rewards.add((tid, trajectory_scores(t, info.num_samples)) for tid, (t, info) in added)
            if self.auto_save:
                assert self._writer is not None
                for tid in ids:
                    self._pending.append(self._writer.submit(self._write_one, tid))
                snapshot = self._index.subset(self._index.id_list)
                self._pending.append(self._writer.submit(self._publish, snapshot))
            else:
                self._evict_outside_window()
        return ids

    def _evict_outside_window(self) -> None:
        """auto_save off: hold only the sampling window's trajectories."""
        keep = set(self.window_ids())
        for tid in [t for t in self._memory if t not in keep]:
            del self._memory[tid]
            self._views.pop(tid, None)

    def _write_one(self, tid: int) -> None:
        """Writer thread: write one trajectory file atomically and record its size and hash."""
        assert self.auto_save_path is not None
        with self._lock:
            traj = self._memory[tid]
            entry = self._index.entries[tid]
            name = trajectory_file_name(tid, entry["model_weights_id"], self.trajectory_format)
        data = trajfile.to_bytes(traj, self.trajectory_format)
        path = self.auto_save_path / name
        write_bytes_atomic(path, data, sync_dir=False)
        with self._lock:
            entry["file_bytes"] = len(data)
            entry["sha256"] = trajfile.sha256_bytes(data)
            self._files[tid] = path
            self._memory.pop(tid, None)

    def _publish(self, snapshot: Index) -> None:
        """Writer thread: publish an index whose files were all written before this job ran."""
        assert self.auto_save_path is not None
        with self._lock:
            snapshot.entries = {
                i: dict(self._index.entries.get(i, snapshot.entries[i])) for i in snapshot.id_list
            }
        write_index(self.auto_save_path, snapshot)

    def flush(self) -> None:
        """Wait until every background write is complete; re-raise the first that failed."""
        pending, self._pending = self._pending, []
        errors = []
        for fut in pending:
            try:
                fut.result()
            except BaseException as exc:  # collected and re-raised below
                errors.append(exc)
        if errors:
            raise RbtoolError(f"a background write to {self.auto_save_path} failed: {errors[0]}") from errors[
                0
            ]

    def _raise_writer_error(self) -> None:
        if any(f.done() and f.exception() is not None for f in self._pending):
            self.flush()

    # -------------------------------------------------------------- sampling
    def _view(self, tid: int) -> FlatView:
        view = self._views.get(tid)
        if view is not None:
            self._views.move_to_end(tid)
            return view
        entry = self._index.entries[tid]
        t, b = entry["shape"][0], entry["shape"][1]
        with self._lock:
            traj = self._memory.get(tid)
            path = self._files.get(tid)
        release = None
        if traj is None:
            if path is None:
                raise RbtoolError(f"trajectory {tid} is neither in memory nor on disk")
            traj, release, info = self._open_file(path)
            if info.shape[:2] != (t, b):
                raise TrajectoryFileError(
                    f"{path}: tensors are [T, B] = {list(info.shape[:2])} but the index says {[t, b]}"
                )
        try:
            view = FlatView(traj, t, b, release)
        except RbtoolError as exc:
            raise TrajectoryFileError(f"{path or f'trajectory {tid}'}: {exc}") from None
        self._views[tid] = view
        while len(self._views) > self.max_open_files:
            self._views.popitem(last=False)
        return view

    @staticmethod
    def _open_file(path: Path) -> tuple[dict[str, Any], Any, trajfile.TrajectoryInfo]:
        """A trajectory file's fields (large rows left on disk where possible), a close hook, its info."""
        if path.suffix == ".pt":
            try:
                opened = trajfile.FileTrajectory(path)
                return opened.data, None, opened.info
            except (OSError, ValueError, RuntimeError):
                pass  # unusual .pt layouts: torch's own loader decides (and names any problem)
        traj = trajfile.load(path, mmap=True)
        return traj, None, trajfile.describe(traj, str(path))

    def _schema(self, tid: int) -> Schema:
        schema = self._schemas.get(tid)
        if schema is None:
            schema = self._schemas[tid] = self._view(tid).schema()
        return schema

    def _window_plan(self) -> WindowPlan:
        """The window's ids, sample counts, shared schema and in-memory field cache.

        Cached until the id list or the window size changes.
        """
        window = self.window_ids()
        key = (self._index_version, self.sample_window_size)
        if self._window_cache is not None and self._window_cache[0] == key:
            return self._window_cache[1]
        entries = self._index.entries
        schema = shared_schema([self._schema(i) for i in window])
        plan = WindowPlan(
            window,
            [entries[i]["num_samples"] for i in window],
            schema,
            window_cache(window, schema, self._view),
        )
        self._window_cache = (key, plan)
        return plan

    def sample(
        self, num_chunks: int, strategy: str = "uniform", k: int | None = None, temperature: float = 1.0
    ) -> dict[str, Any]:
        """Draw `num_chunks` rows from the window; a dict of `[num_chunks, ...]` tensors.

        `strategy="uniform"` (the default) draws every sample of the window alike;
        `strategy="topk"` draws among the window's `k` highest-reward samples with weights
        softmax(reward / temperature) (SPEC §6).
        """
        return self.sample_with_draw(num_chunks, strategy, k, temperature)[1]

    def sample_with_draw(
        self, num_chunks: int, strategy: str = "uniform", k: int | None = None, temperature: float = 1.0
    ) -> tuple[Draw, dict[str, Any]]:
        """`sample()`, also returning the Draw: which trajectory and row each batch row came from."""
        from rbtool.topk import check_strategy, draw_topk

        self._check_open()
        check_strategy(strategy, k, temperature)
        if not self._index.id_list:
            raise RbtoolError("cannot sample from an empty buffer")
        plan = self._window_plan()
        window, sizes = plan.window, plan.sizes
        if strategy == "topk":
            assert k is not None
            candidates = self._topk_candidates(window, k)
            draw = draw_topk(window, sizes, candidates, num_chunks, temperature, self.random_generator)
        else:
            draw = draw_uniform(window, sizes, num_chunks, self.random_generator)
        return draw, self._gather(draw, plan)

    def _gather(self, draw: Draw, plan: WindowPlan) -> dict[str, Any]:
        """Gather a batch, then let every file it read drop the pages it touched."""
        touched: list[FlatView] = []

        def view_of(tid: int) -> FlatView:
            view = self._view(tid)
            touched.append(view)
            return view

        try:
            return gather(draw, plan.schema, view_of, plan.cached)
        finally:
            for view in touched:
                view.release()

    def _topk_candidates(self, window: list[int], k: int) -> Candidates:
        """The window's top-k samples by reward; scores of loaded trajectories are read lazily."""
        from rbtool.topk import RewardIndex, view_scores

        if self._rewards is None:
            self._rewards = RewardIndex()
        self._rewards.fill(window, lambda tid: view_scores(self._view(tid)))
        if len(self._rewards) > len(window):
            self._rewards.retain(window)
        return self._rewards.top_k(k, window)

    # ------------------------------------------------------------ checkpoints
    def _held_ids(self) -> list[int]:
        """What a checkpoint of this buffer holds: the sampling window, in insertion order."""
        return self.window_ids()

    def save_checkpoint(self, save_path: str | Path) -> None:
        """Write the sampling window's trajectories and an index counting only them.

        The checkpoint is built beside `save_path` and renamed into place when complete.
        The running buffer is not changed.
        """
        from rbtool.checkpoint import write_checkpoint

        self._check_open()
        self.flush()
        with self._lock:
            ids = self._held_ids()
            index = self._index.subset(ids)
            index.entries = {i: copy.deepcopy(index.entries[i]) for i in ids}
            sources: dict[int, Path | dict[str, Any]] = {}
            for tid in ids:
                held = self._memory.get(tid)
                sources[tid] = held if held is not None else self._files[tid]
        write_checkpoint(Path(save_path), index, sources.__getitem__, overwrite=True)

    def load_checkpoint(
        self,
        load_path: str | Path,
        is_distributed: bool = False,
        local_rank: int = 0,
        world_size: int = 1,
        *,
        strict: bool = True,
    ) -> None:
        """Replace the buffer's contents with a checkpoint (whole, or one rank's block).

        Trajectory files are read when first sampled. With auto_save on, the kept files are
        linked (or copied) into the auto-save directory, which stays a valid checkpoint.
        """
        self._check_open()
        self.flush()
        if is_distributed:
            Index().rank_block(world_size, local_rank)  # validates world_size and rank
        directory, index = open_checkpoint(load_path, strict=strict)
        if is_distributed:
            index = index.rank_block(world_size, local_rank)
        files = {i: directory / index.file_name(i) for i in index.id_list}
        with self._lock:
            if index.seed is not None:
                self.seed = index.seed
            self._seed_generator(self.seed)
            new = Index(
                entries={i: dict(index.entries[i]) for i in index.id_list},
                id_list=list(index.id_list),
                trajectory_counter=index.trajectory_counter,
                seed=self.seed,
                trajectory_format=self.trajectory_format,
            )
            if self.auto_save_path is not None:
                files = self._adopt_files(new, files)
            self._index = new
            self._files = files
            self._memory.clear()
            self._views.clear()
            self._schemas.clear()
            self._unloaded_size = 0
            self._index_version += 1
            self._rewards = None

    def _adopt_files(self, new: Index, files: dict[int, Path]) -> dict[int, Path]:
        """auto_save on: bring the loaded files into the auto-save directory and publish its index."""
        assert self.auto_save_path is not None
        target_dir = self.auto_save_path
        placed: dict[int, Path] = {}
        for tid, src in files.items():
            dst = target_dir / new.file_name(tid)
            if src.suffix == dst.suffix:
                link_or_copy(src, dst)
            else:
                data = trajfile.to_bytes(trajfile.load(src), self.trajectory_format)
                write_bytes_atomic(dst, data, sync_dir=False)
                new.entries[tid]["file_bytes"] = len(data)
                new.entries[tid]["sha256"] = trajfile.sha256_bytes(data)
            placed[tid] = dst
        write_index(target_dir, new)
        keep = set(placed.values())
        for path in self._files.values():
            if path.parent == target_dir and path not in keep:
                path.unlink(missing_ok=True)
        return placed

    # -------------------------------------------------------------- lifecycle
    def clear(self) -> None:
        """Forget every trajectory; with auto_save on, empty the auto-save directory's index too."""
        self._check_open()
        self.flush()
        with self._lock:
            old_files = list(self._files.values())
            self._index = Index(seed=self.seed, trajectory_format=self.trajectory_format)
            self._memory.clear()
            self._files.clear()
            self._views.clear()
            self._schemas.clear()
            self._unloaded_size = 0
            self._index_version += 1
            self._rewards = None
            if self.auto_save_path is not None:
                write_index(self.auto_save_path, self._index)
                for path in old_files:
                    if path.parent == self.auto_save_path:
                        path.unlink(missing_ok=True)

    def close(self, wait: bool = True) -> None:
        """Finish background writes (unless wait=False) and release the auto-save directory."""
        if self._closed:
            return
        try:
            if wait:
                self.flush()
        finally:
            self._closed = True
            if self._writer is not None:
                self._writer.shutdown(wait=wait)
            if self._dir_lock is not None:
                self._dir_lock.release()
            self._views.clear()

    def __enter__(self) -> TrajectoryReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed and self._writer is not None:
                self._writer.shutdown(wait=True)
        except Exception:
            pass
