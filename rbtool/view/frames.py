"""A checkpoint opened for looking at: its trajectories, their cameras, per-step series and frames.

`open_checkpoint(path, storage_options=None)` opens a checkpoint directory, a rank tree (read
as the merge of its ranks, with the merged ids) or a URL (read through an index mirror: a
trajectory's object is fetched the first time it is read) and returns a `Checkpoint`, a
context manager that never writes into the checkpoint:

- `entries()` -> `list[Entry]`: every trajectory as the index tells it (no file read), those
  whose files are missing left out;
- `entry(tid)` -> `Entry`: one of them (`UsageError` for an id the index does not list,
  `CheckpointError` for one whose file is missing);
- `cameras(tid)` -> `list[Camera]`: the trajectory's image fields (uint8 `[T, B, H, W, C]` or
  `[T, B, C, H, W]`, C = 1 or 3), those under `curr_obs` first;
- `series(tid, env)` -> `Series`: one env column's rewards, done flags and actions per step;
- `frames(tid, env, camera=None, steps=None)` -> numpy uint8 `[n, H, W, C]` (HWC whatever the
  field's layout; `camera` a `Camera.field`, default the first camera; `steps` default all);
- `camera(tid, field=None)` -> `Camera`: one camera by field (default the first), or UsageError;
- `summary(tid)` -> `Summary`: each env column's sum of rewards and the episodes ended in all
  of them (what the viewer's list and the report's returns show).

Reads go through the readers `sample` uses (`buffer.storage.ptfile.open_trajectory`): a `.pt`
file's fields with large rows stay on disk and only the rows asked for are read; a `.pkl`
file is loaded whole by the safe loader. A few opened files are kept (least recently used
dropped), and one lock orders every read, so threads of a server may share one Checkpoint.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from rbtool.errors import CheckpointError, UsageError
from rbtool.format.layout import DONE_LIKE, drop_bootstrap_rows, episode_ends

if TYPE_CHECKING:
    import numpy as np

    from rbtool.files.dirs import CheckpointView
    from rbtool.remote import IndexMirror

# Opened trajectory files kept for the next read (a .pkl one is held whole in memory).
OPEN_FILES = 4
# Nested dicts whose image fields come first, in this order.
CAMERA_ORDER = ("curr_obs", "next_obs")


@dataclass(frozen=True)
class Camera:
    """An image field of a trajectory: its dotted path, layout and frame size."""

    field: str  # dotted path, e.g. "curr_obs.main_images"
    layout: str  # "hwc" or "chw"
    height: int
    width: int
    channels: int  # 1 or 3


@dataclass(frozen=True)
class Entry:
    """One trajectory as the index tells it (no file read)."""

    tid: int
    t: int
    b: int
    num_samples: int
    model_weights_id: str | None
    checkpoint: str  # the checkpoint (rank directory) holding it, as given (under its URL)


@dataclass
class Series:
    """One env column's small per-step fields, read from the trajectory file."""

    steps: int  # T
    rewards: list[float] | None  # per step, summed over trailing dims; None without rewards
    dones: list[bool] | None  # per step: where an episode ended (bootstrap rows dropped)
    actions: list[list[float]] | None  # [T][A], trailing dims flattened
    episode_ends: list[int]  # steps where an episode ended
    ret: float | None  # the sum of rewards


@dataclass(frozen=True)
class Summary:
    """One trajectory at a glance, read from its file."""

    returns: list[float] | None  # each env column's sum of rewards; None without rewards
    episodes: int  # episodes ended, over every env column


def camera_of(name: str, shape: Sequence[int], dtype: Any, t: int, b: int) -> Camera | None:
    """The Camera a field is, from its name, shape and dtype; None when it is no image field."""
    if str(dtype) not in ("torch.uint8", "uint8") or len(shape) != 5 or tuple(shape[:2]) != (t, b):
        return None
    if shape[4] in (1, 3):  # channels last, as RLinf's cameras are
        return Camera(name, "hwc", int(shape[2]), int(shape[3]), int(shape[4]))
    if shape[2] in (1, 3):
        return Camera(name, "chw", int(shape[3]), int(shape[4]), int(shape[2]))
    return None


def _leaves(data: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in data.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        elif hasattr(value, "shape") and hasattr(value, "dtype"):
            yield f"{prefix}{key}", value


def _camera_rank(camera: Camera) -> int:
    head = camera.field.split(".", 1)[0]
    return CAMERA_ORDER.index(head) if head in CAMERA_ORDER and "." in camera.field else len(CAMERA_ORDER)


def read_rows(value: Any, rows: Sequence[int]) -> np.ndarray:
    """Rows `rows` of a `[N, B, ...]` field flattened to `[N*B, ...]`, as numpy: a field left in its
    file (`FileRows`) reads only those rows, a tensor is indexed."""
    import numpy as np
    import torch

    from rbtool.buffer.storage.ptfile import FileRows

    shape = tuple(int(d) for d in value.shape)
    flat = (shape[0] * shape[1], *shape[2:])
    if isinstance(value, FileRows):
        out = torch.empty((len(rows), *flat[1:]), dtype=value.dtype)
        value.reshape(*flat).take(np.asarray(rows, dtype=np.int64), out, np.arange(len(rows)))
        return out.numpy()
    index = torch.as_tensor(list(rows), dtype=torch.long)
    return value.reshape(flat).index_select(0, index).numpy()  # type: ignore[no-any-return]


class Checkpoint:
    """A checkpoint opened read-only for looking at (see the module docstring)."""

    def __init__(self, view: CheckpointView, mirror: IndexMirror | None, url: str | None, stack: ExitStack):
        self.view = view
        self.path = url or str(view.path)
        self._mirror = mirror
        self._url = url
        self._stack = stack
        self._lock = threading.RLock()
        self._open: OrderedDict[int, tuple[dict[str, Any], tuple[int, int]]] = OrderedDict()
        self._entries = [self._entry(i) for i in view.index.id_list]
        # listed ids whose files are missing (RLinf writes such checkpoints with auto_save off)
        self._missing = set() if view.is_tree else set(view.dropped_ids())
        self._by_id = {e.tid: e for e in self._entries}

    # ------------------------------------------------------------ the index
    def _shown(self, path: Path) -> str:
        if self._mirror is None or self._url is None:
            return str(path)
        rel = path.relative_to(self._mirror.path).as_posix()
        return self._url if rel == "." else f"{self._url}/{rel}"

    def _entry(self, tid: int) -> Entry:
        raw = self.view.index.entries[tid]
        shape = raw.get("shape") or [0, 0]
        t, b = (int(shape[0]), int(shape[1])) if len(shape) >= 2 else (0, 0)
        weights = raw.get("model_weights_id")
        directory, _ = self.view.source_of(tid)
        return Entry(
            tid,
            t,
            b,
            int(raw.get("num_samples", t * b)),
            weights if isinstance(weights, str) else None,
            self._shown(directory),
        )

    def entries(self) -> list[Entry]:
        """Every trajectory the index lists whose file exists, in index order."""
        return list(self._entries)

    def entry(self, tid: int) -> Entry:
        """The trajectory `tid`: UsageError when the index does not list it, CheckpointError when
        it lists it but its file is missing."""
        found = self._by_id.get(tid)
        if found is None and tid in self._missing:
            raise CheckpointError(f"{self.path}: trajectory {tid} is listed, but its file is missing")
        if found is None:
            ids = self.view.index.id_list
            listed = f"ids {ids[0]}..{ids[-1]}" if ids else "no trajectories"
            raise UsageError(f"{self.path}: no trajectory with id {tid} ({listed})")
        return found

    # ------------------------------------------------------------ the files
    def _data(self, tid: int) -> tuple[dict[str, Any], tuple[int, int]]:
        """The opened file of `tid` and its [T, B] (the caller holds the lock)."""
        self.entry(tid)
        opened = self._open.get(tid)
        if opened is not None:
            self._open.move_to_end(tid)
            return opened
        from rbtool.buffer.storage.ptfile import open_trajectory

        path = self.view.file_of(tid)
        if self._mirror is not None:
            self._mirror.fetch([path])
        data, info = open_trajectory(path)
        opened = (data, (int(info.shape[0]), int(info.shape[1])))
        self._open[tid] = opened
        while len(self._open) > OPEN_FILES:
            gone, _ = self._open.popitem(last=False)
            if self._mirror is not None:  # a URL's object fetched for it is dropped with it
                self._mirror.release([self.view.file_of(gone)])
        return opened

    def _env(self, tid: int, env: int, b: int) -> None:
        if not 0 <= env < b:
            raise UsageError(
                f"{self.path}: trajectory {tid} has {b} env column(s) (0..{b - 1}); no env {env}"
            )

    def cameras(self, tid: int) -> list[Camera]:
        """The image fields of trajectory `tid`, those under `curr_obs` first."""
        with self._lock:
            data, (t, b) = self._data(tid)
            found = [
                cam
                for name, value in _leaves(data)
                if (cam := camera_of(name, tuple(value.shape), value.dtype, t, b)) is not None
            ]
        return sorted(found, key=_camera_rank)

    def camera(self, tid: int, field: str | None = None) -> Camera:
        """The camera `field` of trajectory `tid` (default: its first); UsageError when it has none
        or no image field of that name."""
        cams = self.cameras(tid)
        if not cams:
            raise UsageError(f"{self.path}: trajectory {tid} has no image field (uint8 [T, B, H, W, C])")
        if field is None:
            return cams[0]
        for cam in cams:
            if cam.field == field:
                return cam
        shown = ", ".join(c.field for c in cams)
        raise UsageError(f"{self.path}: trajectory {tid} has no camera {field!r} (cameras: {shown})")

    def frames(
        self, tid: int, env: int, camera: str | None = None, steps: Sequence[int] | None = None
    ) -> np.ndarray:
        """Frames of env column `env` at `steps` (default all) as uint8 [n, H, W, C], C 1 or 3."""
        import numpy as np

        cam = self.camera(tid, camera)
        with self._lock:
            data, (t, b) = self._data(tid)
            self._env(tid, env, b)
            chosen = list(range(t)) if steps is None else [int(s) for s in steps]
            bad = [s for s in chosen if not 0 <= s < t]
            if bad:
                raise UsageError(
                    f"{self.path}: trajectory {tid} has {t} steps (0..{t - 1}); no step {bad[0]}"
                )
            value: Any = data
            for key in cam.field.split("."):
                value = value[key]
            pixels = read_rows(value, [s * b + env for s in chosen])
        if cam.layout == "chw":
            pixels = pixels.transpose(0, 2, 3, 1)
        return np.ascontiguousarray(pixels, dtype=np.uint8)

    def _small_fields(
        self, data: dict[str, Any], t: int, b: int, envs: list[int]
    ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
        """Rewards and actions `[T, n, k]` (float64) and episode ends `[T, n]` (bool, bootstrap
        rows dropped) of env columns `envs`, each None when the trajectory lacks it (caller locks)."""
        import numpy as np

        def column(name: str) -> np.ndarray | None:
            value = data.get(name)
            if (
                value is None
                or isinstance(value, dict)
                or not hasattr(value, "shape")
                or len(value.shape) < 2
            ):
                return None
            rows = int(value.shape[0])
            got = read_rows(value, [r * b + e for r in range(rows) for e in envs])
            return got.reshape(rows, len(envs), -1).astype(np.float64)

        flags: dict[str, np.ndarray] = {}
        for name in DONE_LIKE:
            got = column(name)
            if got is not None:
                flags[name] = np.asarray(drop_bootstrap_rows(got, t).any(axis=2))
        ends = episode_ends(flags.get("dones"), flags.get("terminations"), flags.get("truncations"))
        return column("rewards"), column("actions"), ends

    def series(self, tid: int, env: int) -> Series:
        """Rewards, done flags and actions of env column `env` of trajectory `tid`, per step."""
        import numpy as np

        with self._lock:
            data, (t, b) = self._data(tid)
            self._env(tid, env, b)
            rewards, actions, ends = self._small_fields(data, t, b, [env])
        reward_list = [float(v) for v in rewards[:, 0].sum(axis=1)] if rewards is not None else None
        return Series(
            steps=t,
            rewards=reward_list,
            dones=[bool(v) for v in ends[:, 0]] if ends is not None else None,
            actions=actions[:, 0].tolist() if actions is not None else None,
            episode_ends=[int(i) for i in np.flatnonzero(ends[:, 0])] if ends is not None else [],
            ret=float(sum(reward_list)) if reward_list is not None else None,
        )

    def summary(self, tid: int) -> Summary:
        """Each env column's sum of rewards and the episodes ended, of trajectory `tid`, read
        from its rewards and done flags once for every column."""
        with self._lock:
            data, (t, b) = self._data(tid)
            rewards, _, ends = self._small_fields(data, t, b, list(range(b)))
        returns = [float(v) for v in rewards.sum(axis=(0, 2))] if rewards is not None else None
        return Summary(returns, int(ends.sum()) if ends is not None else 0)

    # ------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Drop the opened files and, for a URL, the local mirror."""
        with self._lock:
            self._open.clear()
            self._stack.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def open_checkpoint(
    path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> Checkpoint:
    """Open a checkpoint directory, rank tree or URL read-only (see the module docstring).

    `storage_options` are fsspec's options for a URL (ignored for a local path).
    """
    from rbtool import remote
    from rbtool.files.dirs import open_view

    given = os.fspath(path)
    stack = ExitStack()
    try:
        if remote.is_url(given):
            mirror = stack.enter_context(remote.index_mirror(given, storage_options or {}))
            view = open_view(mirror.path, strict=False)
            return Checkpoint(view, mirror, given.rstrip("/"), stack)
        view = open_view(remote.local_path(given), strict=False)
        return Checkpoint(view, None, None, stack)
    except BaseException:
        stack.close()
        raise
