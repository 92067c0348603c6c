"""What the data statistics read from trajectory files: one file alone (read_trajectory), or
consecutive files in segments, a worker each, the small `.pt` files of one structure read and
reduced together.

A buffer of a million one-transition files made `stats` pay a torch.load per file (1.5 ms:
26 minutes). Here a segment's small `.pt` files are read whole, one read each; their headers
come from ptbulk (files of one layout compared with a template, not parsed one by one); the
files of one header and [T, B] in a row have their rewards, done-like fields and versions cut
out of their bytes side by side and reduced at once, as columns of one `[T, files x B]` array.

Every other file (a `.pkl`, a large or unusual `.pt`, one that cannot be opened or whose
header or shape disagrees) goes through read_trajectory alone, so every error is the one
that file gives by itself. A segment's numbers are in file order and equal, bit for bit,
those read_trajectory gives file by file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from rbtool.errors import RbtoolError, TrajectoryFileError
from rbtool.files import ptbulk, ptheader
from rbtool.ops.stats.episodes import EpisodeTally, find_episodes
from rbtool.ops.stats.schema import FieldRow

if TYPE_CHECKING:
    import torch

# A segment holds at most this many files, and this many bytes of them.
SEGMENT_FILES = 1024
SEGMENT_BYTES = 16 << 20
_DONE_FIELDS = ("dones", "terminations", "truncations")


@dataclass
class Segment:
    """Consecutive files of a pass, with the [T, B] the index gives each."""

    paths: list[Path]
    shapes: list[tuple[int, int]]


@dataclass
class SegmentData:
    """What the statistics need from a segment's files, in file order."""

    fields: list[tuple[list[FieldRow], int]] = field(default_factory=list)  # runs: (fields, files)
    rewards: np.ndarray = field(default_factory=lambda: np.empty(0))  # per-sample, files with rewards
    reward_counts: list[int] = field(default_factory=list)  # per file: its rewards, -1 without
    episodes: EpisodeTally | None = None
    episode_files: int = 0  # files with a done-like field
    versions: np.ndarray = field(default_factory=lambda: np.empty(0))
    version_files: int = 0
    bytes_read: int = 0
    pkl_bytes: int = 0

    @property
    def files(self) -> int:
        return len(self.reward_counts)


@dataclass
class TrajectoryData:
    """What the statistics need from one trajectory file."""

    fields: list[FieldRow]
    rewards: np.ndarray | None  # [T, B] per-sample reward, summed over trailing dims
    episodes: EpisodeTally | None  # None without any done-like field
    versions: np.ndarray | None  # [T * B] per-sample version (max over trailing dims)
    bytes_read: int


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _leading(tensor: torch.Tensor, *lead: int) -> torch.Tensor:
    """`tensor` reshaped to `[*lead, rest]`, the trailing dims flattened into one."""
    return tensor.reshape(*lead, math.prod(int(d) for d in tensor.shape) // max(1, math.prod(lead)))


def read_trajectory(path: Path, t: int, b: int) -> TrajectoryData:
    """Read one trajectory's rewards, done-like fields and versions; the rest stays unread.

    `.pt` files are memory-mapped, so only the touched tensors are paged in and counted;
    a `.pkl` file has to be unpickled whole and counts as its file size.
    """
    import torch

    from rbtool.files import trajfile
    from rbtool.format import layout

    traj = trajfile.load(path, mmap=True)
    info = layout.describe(traj, str(path))
    if info.shape[:2] != (t, b):
        raise TrajectoryFileError(
            f"{path}: tensors are [T, B] = {list(info.shape[:2])} but the index says {[t, b]}"
        )
    fields = [
        FieldRow(
            ".".join(p),
            _dtype_name(v),
            tuple(int(d) for d in v.shape[2:]) if v.dim() >= 2 else None,
            int(v.shape[0]) - t if (layout.is_done_like(p) and v.dim() >= 2) else 0,
            v.numel() * v.element_size(),
        )
        for p, v in layout.iter_tensors(traj)
    ]
    touched = 0

    def take(name: str) -> torch.Tensor | None:
        nonlocal touched
        value = traj.get(name)
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            return None
        touched += value.numel() * value.element_size()
        return value

    def per_step(name: str) -> np.ndarray | None:
        """A done-like field as a [T, B] bool mask: bootstrap rows dropped, any over trailing dims."""
        value = take(name)
        if value is None:
            return None
        try:
            layout.done_extra_rows(int(value.shape[0]), t, int(value.shape[1]), b)
        except ValueError as exc:
            raise TrajectoryFileError(f"{path}: field {name!r}: {exc}") from None
        mask = _leading(value != 0, int(value.shape[0]), b).any(dim=2).numpy()
        return layout.drop_bootstrap_rows(mask, t)

    raw_rewards = take("rewards")
    rewards = None
    if raw_rewards is not None:
        rewards = _leading(raw_rewards, t, b).to(torch.float64).sum(dim=2).numpy()
    dones, terms, truncs = per_step("dones"), per_step("terminations"), per_step("truncations")
    dones = layout.episode_ends(dones, terms, truncs)
    episodes = None if dones is None else find_episodes(dones, rewards, terms, truncs)
    raw_versions = take("versions")
    versions = None
    if raw_versions is not None:
        versions = _leading(raw_versions, t * b).to(torch.float64).amax(dim=1).numpy()
    if path.suffix == ".pkl":
        touched = path.stat().st_size
    return TrajectoryData(fields, rewards, episodes, versions, touched)


def cut_segments(
    paths: list[Path], shapes: list[tuple[int, int]], sizes: list[int] | None, parts: int, single: bool
) -> list[Segment]:
    """`paths` cut into consecutive segments: at least `parts` of them where there are that many
    files (so every worker has some to the end), one file each with `single` (a journal records
    files one by one)."""
    most = 1 if single else max(1, min(SEGMENT_FILES, -(-len(paths) // max(1, parts))))
    out: list[Segment] = []
    start = weight = 0
    for k in range(len(paths)):
        size = sizes[k] if sizes is not None else 0
        if k > start and (k - start >= most or weight + size > SEGMENT_BYTES):
            out.append(Segment(paths[start:k], shapes[start:k]))
            start, weight = k, 0
        weight += size
    if start < len(paths):
        out.append(Segment(paths[start:], shapes[start:]))
    return out


class _Fallback(Exception):
    """These files are read one by one."""


class _Parts:
    """A segment's results as they come, joined into a SegmentData at the end."""

    def __init__(self) -> None:
        self.data = SegmentData()
        self.rewards: list[np.ndarray] = []
        self.tallies: list[EpisodeTally] = []
        self.versions: list[np.ndarray] = []

    def fields(self, rows: list[FieldRow], files: int) -> None:
        runs = self.data.fields
        if runs and runs[-1][0] == rows:
            runs[-1] = (runs[-1][0], runs[-1][1] + files)
        else:
            runs.append((rows, files))

    def one(self, path: Path, got: Any) -> None:
        """read_trajectory's result for one file."""
        self.fields(got.fields, 1)
        self.data.bytes_read += got.bytes_read
        if path.suffix == ".pkl":
            self.data.pkl_bytes += got.bytes_read
        if got.rewards is not None:
            self.rewards.append(got.rewards.reshape(-1))
        self.data.reward_counts.append(-1 if got.rewards is None else int(got.rewards.size))
        if got.episodes is not None:
            self.tallies.append(got.episodes)
            self.data.episode_files += 1
        if got.versions is not None:
            self.versions.append(got.versions)
            self.data.version_files += 1

    def done(self) -> SegmentData:
        data = self.data
        data.rewards = np.concatenate(self.rewards) if self.rewards else np.empty(0)
        data.episodes = EpisodeTally.combine(self.tallies) if self.tallies else None
        data.versions = np.concatenate(self.versions) if self.versions else np.empty(0)
        return data


def read_segment(segment: Segment) -> SegmentData:
    """The statistics' data of a segment's files (on a worker process)."""
    parts = _Parts()
    paths, shapes = segment.paths, segment.shapes
    datas = [_read_small(path) for path in paths]
    sizes = [-1 if data is None else len(data) for data in datas]
    templates: dict[int, ptbulk.Template | None] = {}
    k = 0
    while k < len(paths):
        if sizes[k] < 0:
            parts.one(paths[k], read_trajectory(paths[k], *shapes[k]))
            k += 1
            continue
        stop = k + 1
        while stop < len(paths) and sizes[stop] == sizes[k]:
            stop += 1
        joined = b"".join(cast("list[bytes]", datas[k:stop]))
        rows = np.frombuffer(joined, dtype=np.uint8).reshape(stop - k, sizes[k])
        _of_one_size(parts, rows, paths[k:stop], shapes[k:stop], templates)
        k = stop
    return parts.done()


def _of_one_size(
    parts: _Parts,
    rows: Any,
    paths: list[Path],
    shapes: list[tuple[int, int]],
    templates: dict[int, ptbulk.Template | None],
) -> None:
    """Files of one size (`rows`), a run of one header and [T, B] at a time."""
    headers = ptbulk.headers_of(rows, paths.__getitem__, templates)
    j = 0
    while j < len(headers):
        end = j + 1
        while end < len(headers) and headers[end] is headers[j] and shapes[end] == shapes[j]:
            end += 1
        header = headers[j]
        try:
            if isinstance(header, Exception):
                raise _Fallback
            _reduce(parts, rows[j:end], header, *shapes[j], str(paths[j]))
        except (_Fallback, RbtoolError):
            for at in range(j, end):
                parts.one(paths[at], read_trajectory(paths[at], *shapes[at]))
        j = end


def _read_small(path: Path) -> bytes | None:
    """A small `.pt` file's bytes (one read), or None: read_trajectory takes it alone."""
    if path.suffix != ".pt":
        return None
    try:
        return ptheader.read_small(path) or None
    except RbtoolError:  # named by read_trajectory, as it names it alone
        return None


def _reduce(parts: _Parts, rows: Any, header: dict[str, Any], t: int, b: int, where: str) -> None:
    """read_trajectory over `rows` (files of one header, [T, B] = [t, b]), all at once."""
    import torch

    from rbtool.files.ptheader import TensorSpec, iter_specs
    from rbtool.format import layout

    if layout.describe(header, where, TensorSpec).shape[:2] != (t, b):
        raise _Fallback
    count = rows.shape[0]
    fields = [
        FieldRow(
            ".".join(p),
            spec.dtype,
            tuple(spec.shape[2:]) if spec.dim() >= 2 else None,
            spec.shape[0] - t if (layout.is_done_like(p) and spec.dim() >= 2) else 0,
            spec.numel() * spec.itemsize,
        )
        for p, spec in iter_specs(header)
    ]
    touched = 0

    def take(name: str) -> torch.Tensor | None:
        """The field's values in every file, `[files, *shape]`."""
        nonlocal touched
        spec = header.get(name)
        if not isinstance(spec, TensorSpec) or spec.dim() < 2:
            return None
        if not spec.is_contiguous() or not spec.numel():
            raise _Fallback
        touched += spec.numel() * spec.itemsize
        start = spec.data_start
        raw = rows[:, start : start + spec.numel() * spec.itemsize].copy()  # strides of its own
        return torch.from_numpy(raw).view(getattr(torch, spec.dtype)).reshape(count, *spec.shape)

    def leading(value: torch.Tensor, *lead: int) -> torch.Tensor:
        """[files, *lead, rest], as read_trajectory's `_leading` cuts each file."""
        rest = math.prod(value.shape[1:]) // max(1, math.prod(lead))
        return value.reshape(count, *lead, rest)

    def per_step(name: str) -> np.ndarray | None:
        value = take(name)
        if value is None:
            return None
        rows0 = int(value.shape[1])
        try:
            extra = layout.done_extra_rows(rows0, t, int(value.shape[2]), b)
        except ValueError:
            raise _Fallback from None
        mask = leading(value != 0, rows0, b).any(dim=3).numpy()
        if extra:
            mask = mask.reshape(count, extra, rows0 // extra, b)[:, :, 1:].reshape(count, t, b)
        return mask  # type: ignore[no-any-return]

    raw_rewards = take("rewards")
    rewards = None
    if raw_rewards is not None:
        rewards = leading(raw_rewards, t, b).to(torch.float64).sum(dim=3).numpy()
    dones, terms, truncs = (per_step(name) for name in _DONE_FIELDS)
    ends = layout.episode_ends(dones, terms, truncs)
    raw_versions = take("versions")
    versions = None
    if raw_versions is not None:
        versions = leading(raw_versions, t * b).to(torch.float64).amax(dim=2).numpy()

    def columns(value: np.ndarray | None) -> np.ndarray | None:
        """[files, T, B] -> [T, files x B]: each file's env columns side by side."""
        return None if value is None else value.transpose(1, 0, 2).reshape(t, count * b)

    tally = None
    if ends is not None:
        tally = find_episodes(columns(ends), columns(rewards), columns(terms), columns(truncs))  # type: ignore[arg-type]
    parts.fields(fields, count)
    parts.data.bytes_read += touched * count
    if rewards is not None:
        parts.rewards.append(rewards.reshape(-1))
    parts.data.reward_counts.extend([-1 if rewards is None else t * b] * count)
    if tally is not None:
        parts.tallies.append(tally)
        parts.data.episode_files += count
    if versions is not None:
        parts.versions.append(versions.reshape(-1))
        parts.data.version_files += count
