"""Storage: where a trajectory's rows live and how drawn rows are read into a batch.

A trajectory opened for sampling is a FlatView: every sampled field seen as `[T*B, ...]`
rows, held either in memory (tensors) or left in its `.pt` file (FileRows, read with
pread). Both answer `schema()` and `rows(path, idx, out, dest)`. TrajectoryStore keeps
track of where each trajectory of a buffer is (in memory, in a file, pinned by an open
descriptor) and a bounded set of open views; gather() builds a batch from a Draw.
Samplers never read data; this module never draws.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rbtool import trajfile
from rbtool.errors import RbtoolError, TrajectoryFileError
from rbtool.layout import (
    DONE_LIKE,
    NESTED_ORDER,
    SAMPLED_TOP_FIELDS,
    TrajectoryInfo,
    describe,
    done_extra_rows,
    done_rows,
    drop_bootstrap_rows,
)
from rbtool.ptheader import SMALL_FILE_BYTES, TensorSpec, UnusualLayout, read_header

if TYPE_CHECKING:
    import numpy as np
    import torch

    from rbtool.sampling import Draw

FieldPath = tuple[str, ...]
Schema = dict[FieldPath, tuple[Any, tuple[int, ...]]]  # path -> (dtype, per-sample shape)


class Storage(Protocol):
    """What a sampler's draws are read from: one trajectory's fields as flat rows."""

    def schema(self) -> Schema: ...

    def rows(self, path: FieldPath, idx: Any, out: Any, dest: Any) -> None: ...


# Rows at least this large are read from the file on demand; smaller fields are read whole.
ROW_READ_MIN_BYTES = 2048
# File descriptors kept open across batches (least recently used closed first): a quarter
# of the process's limit, at most 1024.
MAX_OPEN_FDS = max(16, min(1024, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4))
_OPEN_FILES: OrderedDict[int, FileTrajectory] = OrderedDict()


class FileRows:
    """A contiguous tensor left in its `.pt` file: rows are read with pread when drawn.

    Memory-mapping would be simpler, but the kernel maps whole page-cache folios (megabytes)
    on each fault, so a sampler touching a few rows of every file ends up with the whole
    checkpoint resident. Reading rows into the output keeps memory at the batch size.
    """

    def __init__(self, owner: FileTrajectory, offset: int, shape: tuple[int, ...], dtype: Any) -> None:
        import torch

        self.owner, self.offset, self.shape, self.dtype = owner, offset, torch.Size(shape), dtype
        self.row_bytes = math.prod(shape[1:]) * dtype.itemsize

    def dim(self) -> int:
        return len(self.shape)

    def reshape(self, *shape: int) -> FileRows:
        """Merge the two leading dims ([T, B, ...] -> [T*B, ...]); the layout is contiguous."""
        return FileRows(self.owner, self.offset, (self.shape[0] * self.shape[1], *self.shape[2:]), self.dtype)

    def take(self, rows: Any, out: Any, dest: Any) -> None:
        """Read stored rows `rows` into rows `dest` of the contiguous tensor `out`."""
        import torch

        size = self.row_bytes
        if size == 0 or not len(rows):
            return
        buffer = memoryview(out.view(torch.uint8).numpy()).cast("B")
        fd, base = self.owner.fd(), self.offset
        for j, row in zip(dest.tolist(), rows.tolist(), strict=True):
            got = os.preadv(fd, [buffer[j * size : (j + 1) * size]], base + row * size)
            if got != size:
                raise TrajectoryFileError(f"{self.owner.path}: truncated (row {row} of a field is cut short)")


class FileTrajectory:
    """A `.pt` trajectory opened for sampling: small fields in memory, large rows left on disk.

    The structure and each tensor's place in the file come from the file's header
    (rbtool.ptheader: no tensor bytes read, no torch.load); a small file is read whole, in
    one read; in a larger one, fields with large rows stay on disk and are read with pread.
    """

    def __init__(
        self, path: Path, pin: PinnedFile | None = None, header: dict[str, Any] | None = None
    ) -> None:
        # A pinned file is read through its open descriptor: the name may be gone or replaced.
        self._pin = pin
        self.path = path
        self._fd: int | None = None
        read_path = pin.read_path if pin is not None else path
        whole: bytes | None = None
        if header is None:
            whole = _read_small(read_path)
            header = read_header(read_path, whole)
        elif _file_size(read_path) <= SMALL_FILE_BYTES:
            whole = _read_small(read_path)
        self.header = header
        self.info = describe(header, str(path), TensorSpec)
        self._whole = memoryview(whole) if whole is not None else None
        self.data = _map_specs(header, self._place)
        self._whole = None
        self.close()

    def fd(self) -> int:
        if self._pin is not None:
            return self._pin.fd
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
            _OPEN_FILES[id(self)] = self
            while len(_OPEN_FILES) > MAX_OPEN_FDS:
                _OPEN_FILES.popitem(last=False)[1].close()
        else:
            _OPEN_FILES.move_to_end(id(self))
        return self._fd

    def _place(self, spec: TensorSpec) -> Any:
        import torch

        dtype = getattr(torch, spec.dtype)
        row_bytes = math.prod(spec.shape[1:]) * spec.itemsize if spec.dim() >= 2 else 0
        if self._whole is None and spec.is_contiguous() and row_bytes >= ROW_READ_MIN_BYTES:
            return FileRows(self, spec.data_start, spec.shape, dtype)
        if self._whole is not None:
            data = bytearray(self._whole[spec.start : spec.start + spec.nbytes])
        else:
            data = bytearray(spec.nbytes)
            if data and os.preadv(self.fd(), [data], spec.start) != len(data):
                raise TrajectoryFileError(f"{self.path}: truncated (a tensor's data is cut short)")
        if len(data) != spec.nbytes:
            raise TrajectoryFileError(f"{self.path}: truncated (a tensor's data is cut short)")
        raw = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        return raw.view(dtype).as_strided(spec.shape, spec.stride, spec.offset)

    def close(self) -> None:
        """Close the file (it is reopened on the next read)."""
        if self._fd is not None:
            _OPEN_FILES.pop(id(self), None)
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _file_size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError as exc:
        raise TrajectoryFileError(f"{path}: cannot read ({exc.strerror})") from None


def _read_small(path: Path) -> bytes | None:
    """A regular file's bytes when it is small enough to read whole; None otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise TrajectoryFileError(f"{path}: file not found") from None
    except OSError as exc:
        raise TrajectoryFileError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TrajectoryFileError(f"{path}: not a regular file")
        if info.st_size > SMALL_FILE_BYTES:
            return None
        data = os.pread(fd, info.st_size, 0)
        if len(data) != info.st_size:
            raise TrajectoryFileError(f"{path}: truncated while it was read")
        return data
    except OSError as exc:
        raise TrajectoryFileError(f"{path}: cannot read ({exc.strerror})") from None
    finally:
        os.close(fd)


def _map_specs(value: Any, fn: Any) -> Any:
    if isinstance(value, TensorSpec):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_specs(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_specs(v, fn) for v in value]
    return value


def _fd_budget() -> int:
    return max(16, min(1024, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4))


# Files pinned open so that a loaded checkpoint can be deleted or replaced (rotation)
# while the buffer still reads it; beyond this many, files are read by name.
MAX_PINNED = _fd_budget()
_PINNED_COUNT = [0]
_PIN_LOCK = threading.Lock()


class PinnedFile:
    """An open descriptor on a loaded trajectory file: its data stays readable after the
    name is deleted or replaced, as long as the buffer lists it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        info = os.fstat(self.fd)
        self._identity = (info.st_dev, info.st_ino)
        with _PIN_LOCK:
            _PINNED_COUNT[0] += 1

    @classmethod
    def try_open(cls, path: Path) -> PinnedFile | None:
        """Pin `path` if the budget allows and the file opens; None otherwise (read by name)."""
        if _PINNED_COUNT[0] >= MAX_PINNED:
            return None
        try:
            return cls(path)
        except OSError:
            return None

    @property
    def read_path(self) -> Path:
        """A name that opens this descriptor's file (Linux /proc, else /dev/fd)."""
        proc = Path(f"/proc/self/fd/{self.fd}")
        return proc if proc.parent.is_dir() else Path(f"/dev/fd/{self.fd}")

    def current_path(self) -> Path | None:
        """The original name if it still names this file, else None."""
        try:
            info = os.stat(self.path)
        except OSError:
            return None
        return self.path if (info.st_dev, info.st_ino) == self._identity else None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            with _PIN_LOCK:
                _PINNED_COUNT[0] -= 1

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


@dataclass
class FlatField:
    """One field of a trajectory seen as rows of [T*B, ...] without a copy."""

    rows: Any  # the stored tensor (or FileRows) reshaped to [(T + E) * B, ...]
    extra: int  # E: leading bootstrap rows of a done-like field (0 otherwise)


def _ordered_items(traj: dict[str, Any], top: bool) -> list[tuple[str, Any]]:
    """Tensors first in dict order, then nested dicts (the reference's three first)."""
    tensors = [(k, v) for k, v in traj.items() if not isinstance(v, dict)]
    dicts = [(k, v) for k, v in traj.items() if isinstance(v, dict)]
    if top:
        rank = {name: i for i, name in enumerate(NESTED_ORDER)}
        dicts.sort(key=lambda kv: rank.get(kv[0], len(rank)))
    return tensors + dicts


def _is_rows(value: Any) -> bool:
    import torch

    return isinstance(value, (torch.Tensor, FileRows)) and value.dim() >= 2


def sampled_items(
    traj: dict[str, Any], extra_fields: bool
) -> tuple[list[tuple[FieldPath, Any]], list[FieldPath]]:
    """The (path, tensor) pairs a batch holds, in batch order, and the >= 2-dim ones left out.

    By default these are the reference sampler's: its Trajectory's top-level fields in
    declaration order, then the tensors one level inside curr_obs, next_obs, forward_inputs.
    With `extra_fields` every tensor of >= 2 dims, nested dicts flattened per key.
    """
    every: list[tuple[FieldPath, Any]] = []

    def walk(d: dict[str, Any], prefix: FieldPath, top: bool) -> None:
        for key, value in _ordered_items(d, top):
            if isinstance(value, dict):
                walk(value, (*prefix, key), False)
            elif _is_rows(value):
                every.append(((*prefix, key), value))

    walk(traj, (), True)
    if extra_fields:
        return every, []
    chosen: list[tuple[FieldPath, Any]] = [
        ((name,), traj[name]) for name in SAMPLED_TOP_FIELDS if name in traj and _is_rows(traj[name])
    ]
    for group in NESTED_ORDER:
        nested = traj.get(group)
        if isinstance(nested, dict):
            chosen.extend(((group, k), v) for k, v in nested.items() if _is_rows(v))
    taken = {p for p, _ in chosen}
    return chosen, [p for p, _ in every if p not in taken]


class FlatView:
    """A trajectory dict seen as [T*B, ...] per sampled field (SPEC §3 step 5), lazily.

    `left_out` lists the fields of >= 2 dims the batch does not hold (see sampled_items).
    """

    def __init__(self, traj: dict[str, Any], t: int, b: int, *, extra_fields: bool = False) -> None:
        self.t, self.b = t, b
        self.fields: dict[FieldPath, FlatField] = {}
        items, self.left_out = sampled_items(traj, extra_fields)
        for path, value in items:
            extra = 0
            if len(path) == 1 and path[0] in DONE_LIKE:
                try:
                    extra = done_extra_rows(int(value.shape[0]), t, int(value.shape[1]), b)
                except ValueError as exc:
                    raise RbtoolError(
                        f"field {'.'.join(path)!r} has shape {list(value.shape)}; {exc}"
                    ) from None
            self.fields[path] = FlatField(value.reshape(-1, *value.shape[2:]), extra)

    def schema(self) -> Schema:
        return {p: (f.rows.dtype, tuple(f.rows.shape[1:])) for p, f in self.fields.items()}

    def rows(self, path: FieldPath, idx: Any, out: Any, dest: Any) -> None:
        """Copy stored rows `idx` of field `path` into rows `dest` of the contiguous tensor `out`."""
        import torch

        rows = self.fields[path].rows
        if isinstance(rows, torch.Tensor):
            out.index_copy_(0, torch.as_tensor(dest), rows.index_select(0, torch.as_tensor(idx)))
        else:
            rows.take(idx, out, dest)


def open_trajectory(path: Path, pin: PinnedFile | None = None) -> tuple[dict[str, Any], TrajectoryInfo]:
    """A trajectory file's fields (large `.pt` rows left on disk where possible) and its info.

    Errors name the file, also when it is read through its pinned descriptor.
    """
    try:
        return _open_trajectory(path, pin)
    except TrajectoryFileError as exc:
        if pin is None:
            raise
        raise type(exc)(str(exc).replace(str(pin.read_path), str(path))) from None


def _open_trajectory(path: Path, pin: PinnedFile | None) -> tuple[dict[str, Any], TrajectoryInfo]:
    if path.suffix == ".pt":
        try:
            opened = FileTrajectory(path, pin)
            return opened.data, opened.info
        except UnusualLayout:
            pass  # layouts the header reader does not know: torch's own loader decides
    read_path = pin.read_path if pin is not None else path
    traj = trajfile.load(read_path, mmap=True, suffix=path.suffix)
    return traj, describe(traj, str(path))


class TrajectoryStore:
    """Where each trajectory of a buffer is: in memory, in a file (maybe pinned open).

    Opened trajectories are kept as FlatViews, least recently used dropped first beyond
    `max_open`. Methods that change the maps take `lock` (shared with the writer thread).
    """

    def __init__(self, *, max_open: int, extra_fields: bool, lock: threading.RLock) -> None:
        self.max_open = max_open
        self.extra_fields = extra_fields
        self.lock = lock
        self.memory: dict[int, dict[str, Any]] = {}
        self.files: dict[int, Path] = {}
        self.pins: dict[int, PinnedFile] = {}
        self.views: OrderedDict[int, FlatView] = OrderedDict()
        self.schemas: dict[int, Schema] = {}
        self.left_out: dict[int, list[FieldPath]] = {}

    def holds(self, tid: int) -> bool:
        return tid in self.memory or tid in self.files

    def __len__(self) -> int:
        return len(self.memory.keys() | self.files.keys())

    def put(self, tid: int, traj: dict[str, Any]) -> None:
        with self.lock:
            self.memory[tid] = traj

    def written(self, tid: int, path: Path) -> None:
        """A held trajectory's file is complete: read it from there and free the memory."""
        with self.lock:
            self.files[tid] = path
            self.memory.pop(tid, None)

    def set_files(self, files: dict[int, Path], *, pin: bool) -> None:
        """Replace everything held by these files (pinned open when `pin`)."""
        with self.lock:
            self.clear()
            self.files = dict(files)
            if pin:
                for tid, path in files.items():
                    opened = PinnedFile.try_open(path)
                    if opened is not None:
                        self.pins[tid] = opened

    def drop(self, tid: int) -> None:
        with self.lock:
            self.memory.pop(tid, None)
            self.files.pop(tid, None)
            self.views.pop(tid, None)
            self.schemas.pop(tid, None)
            self.left_out.pop(tid, None)
            pinned = self.pins.pop(tid, None)
            if pinned is not None:
                pinned.close()

    def clear_views(self) -> None:
        """Drop every open view (the data stays where it is; views reopen on demand)."""
        with self.lock:
            self.views.clear()
            for opened in list(_OPEN_FILES.values()):
                opened.close()

    def clear(self) -> None:
        with self.lock:
            self.memory.clear()
            self.files.clear()
            self.views.clear()
            self.schemas.clear()
            self.left_out.clear()
            for pinned in self.pins.values():
                pinned.close()
            self.pins.clear()

    def source(self, tid: int) -> Path | dict[str, Any]:
        """What a checkpoint writer copies for `tid`: its file when that name still holds it."""
        with self.lock:
            held = self.memory.get(tid)
            if held is not None:
                return held
            path = self.files[tid]
            pinned = self.pins.get(tid)
        if pinned is None or pinned.current_path() is not None:
            return path
        return trajfile.load(pinned.read_path, suffix=path.suffix)

    def view(self, tid: int, t: int, b: int) -> FlatView:
        view = self.views.get(tid)
        if view is not None:
            self.views.move_to_end(tid)
            return view
        with self.lock:
            traj = self.memory.get(tid)
            path = self.files.get(tid)
            pinned = self.pins.get(tid)
        if traj is None:
            if path is None:
                raise RbtoolError(f"trajectory {tid} is neither in memory nor on disk")
            traj, info = open_trajectory(path, pinned)
            if info.shape[:2] != (t, b):
                raise TrajectoryFileError(
                    f"{path}: tensors are [T, B] = {list(info.shape[:2])} but the index says {[t, b]}"
                )
        try:
            view = FlatView(traj, t, b, extra_fields=self.extra_fields)
        except RbtoolError as exc:
            raise TrajectoryFileError(f"{path or f'trajectory {tid}'}: {exc}") from None
        self.views[tid] = view
        while len(self.views) > self.max_open:
            self.views.popitem(last=False)
        return view

    def schema(self, tid: int, t: int, b: int) -> Schema:
        schema = self.schemas.get(tid)
        if schema is None:
            view = self.view(tid, t, b)
            schema = self.schemas[tid] = view.schema()
            self.left_out[tid] = view.left_out
        return schema


def shared_schema(schemas: Sequence[Schema]) -> Schema:
    """Fields present in every schema with the same dtype and per-sample shape (first's order)."""
    if not schemas:
        return {}
    first, rest = schemas[0], schemas[1:]
    return {p: spec for p, spec in first.items() if all(s.get(p) == spec for s in rest)}


def nest(flat: dict[FieldPath, Any]) -> dict[str, Any]:
    """{('curr_obs', 'states'): x} -> {'curr_obs': {'states': x}}."""
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


# Fields whose rows are held in memory are concatenated over the window when they total
# at most this many bytes: then a batch costs one index_select per field.
WINDOW_CACHE_MAX_BYTES = 512 << 20


def flat_rows(view: FlatView, path: FieldPath) -> torch.Tensor:
    """A held field as [T*B, ...] rows, done-like bootstrap rows dropped (a copy when E > 0)."""
    field = view.fields[path]
    if not field.extra:
        return field.rows
    stored = field.rows.reshape(view.t + field.extra, view.b, *field.rows.shape[1:])
    return drop_bootstrap_rows(stored, view.t).reshape(-1, *field.rows.shape[1:])


def window_cache(
    window_ids: Sequence[int], schema: Schema, view_of: Callable[[int], FlatView]
) -> dict[FieldPath, torch.Tensor]:
    """The window's in-memory fields, each concatenated into one [window samples, ...] tensor.

    Row `g` of each is the window's global sample `g`, so a draw's ids index it directly.
    Fields left on disk in any trajectory, and windows over the byte budget, are left out.
    """
    import torch

    views = [view_of(tid) for tid in window_ids]
    held = [p for p in schema if all(isinstance(v.fields[p].rows, torch.Tensor) for v in views)]
    per_row = sum(math.prod(schema[p][1]) * schema[p][0].itemsize for p in held)
    if per_row * sum(v.t * v.b for v in views) > WINDOW_CACHE_MAX_BYTES:
        return {}
    return {p: torch.cat([flat_rows(v, p) for v in views]) for p in held}


def gather(
    draw: Draw,
    schema: Schema,
    view_of: Callable[[int], FlatView],
    cached: dict[FieldPath, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Build the batch, copying only the drawn rows.

    Fields in `cached` (see window_cache) cost one index_select each. Other draws are
    grouped by trajectory; each (trajectory, field) pair costs one index_select (or one read
    per row for fields left on disk) written straight into its slice of the output, then one
    permutation per field restores the draw order. The index arithmetic is done in numpy:
    on a few hundred numbers torch's thread pool costs more than the work.
    """
    import numpy as np
    import torch

    cached = cached or {}
    out: dict[FieldPath, torch.Tensor] = {}
    if cached:
        global_rows = draw.global_indices
        for path in schema:
            if path in cached:
                out[path] = cached[path].index_select(0, global_rows)
        if len(out) == len(schema):
            return nest({path: out[path] for path in schema})

    positions = draw.positions.numpy()
    order = np.argsort(positions, kind="stable")
    local = draw.local_indices.numpy()[order]
    unique, starts, counts = np.unique(positions[order], return_index=True, return_counts=True)
    views = [view_of(draw.window_ids[k]) for k in unique.tolist()]
    bounds = list(zip(starts.tolist(), (starts + counts).tolist(), strict=True))
    plain_rows = [torch.from_numpy(local[a:z]) for a, z in bounds]
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    inverse_t = torch.from_numpy(inverse)
    per_draw: dict[str, np.ndarray] = {}

    for path, (dtype, shape) in schema.items():
        if path in out:
            continue
        fields = [view.fields[path] for view in views]
        rows = plain_rows
        if any(f.extra for f in fields):
            if not per_draw:
                per_draw["t"] = np.repeat([v.t for v in views], counts)
                per_draw["b"] = np.repeat([v.b for v in views], counts)
            extra = np.repeat([f.extra for f in fields], counts)
            mapped = done_rows(local, per_draw["t"], per_draw["b"], extra)
            rows = [torch.from_numpy(mapped[a:z]) for a, z in bounds]
        target = torch.empty((order.size, *shape), dtype=dtype)
        if all(isinstance(f.rows, torch.Tensor) for f in fields):
            for field, idx, (a, z) in zip(fields, rows, bounds, strict=True):
                torch.index_select(field.rows, 0, idx, out=target[a:z])
            out[path] = target.index_select(0, inverse_t)
        else:  # rows read from files go straight to their final places
            for view, idx, (a, z) in zip(views, rows, bounds, strict=True):
                view.rows(path, idx, target, order[a:z])
            out[path] = target
    return nest({path: out[path] for path in schema})


def view_scores(view: FlatView) -> np.ndarray:
    """Scores of a trajectory already open as a FlatView (reads only its reward rows).

    Rewards with wide rows may still be in their file (read on demand by the sampler);
    they are then read whole, once, into a tensor.
    """
    import numpy as np
    import torch

    from rbtool.topk import scores_of_rows

    field = view.fields.get(("rewards",))
    if field is None:
        return scores_of_rows(None, view.t * view.b)
    rows = field.rows
    if not isinstance(rows, torch.Tensor):
        every = np.arange(int(rows.shape[0]))
        full = torch.empty(tuple(rows.shape), dtype=rows.dtype)
        rows.take(every, full, every)
        rows = full
    return scores_of_rows(rows, view.t * view.b)
