"""doctor's checks over a segment of consecutive trajectory files at once (a worker's task).

A tiny trajectory's checks are a few dozen small torch calls: about 420 us a file here, five
minutes for a million one-transition files. Here a segment's `.pt` files are read whole, one
read each, their headers come from rbtool.files.ptbulk (files of one size compared with a
template, not parsed one by one), and the files of one layout in a row (the same tensors in
the same places; plain values such as model_weights_id may differ) are checked together,
each field cut out of their bytes as one `[files, ...]` array, without torch:

- the `index`, `done-flags`, `policy` and `rewards` findings, the `episodes` note on env
  columns that never end, and the traits the buffer-wide checks need (fingerprint, newest
  version, unpaired observations) are worked out for every file and made as check_file makes
  them;
- the other checks only look for anything to report (a NaN or Inf, a frozen or blank env
  column, a broken or shifted observation pairing, a run of steps longer than
  max_episode_length); a file where one finds something is checked alone by check_file, and
  gets all of its findings from there.

Every other file goes through check_file alone: a `.pkl`, a `.pt` file that cannot be read or
whose header read_header refuses, and the files of a run whose layout the arrays cannot hold
as check_file's tensors do (a dtype numpy lacks, an empty, non-contiguous or misaligned
field, done flags of another width, a model_weights_id taken from the file's name). So each
file's Result is exactly the one check_file gives it (tests/test_doctor_batch.py compares).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rbtool.errors import RbtoolError
from rbtool.files import ptbulk, ptheader
from rbtool.ops.doctor.trajectory import (
    NO_VERSIONS_ID,
    Options,
    Result,
    Task,
    check_file,
    done_extra,
    done_flags_finding,
    index_findings,
    is_image,
    never_ending_finding,
    newest_version,
    policy_finding,
    rewards_finding,
    weights_id_of_bytes,
)

# A segment holds at most this many files; its files are read this many bytes at a time.
SEGMENT_FILES = 1024
SEGMENT_BYTES = 16 << 20
READ_LIMIT = 1 << 30  # a larger file goes to check_file, which reads it in parts


@dataclass(frozen=True)
class Segment:
    """Consecutive listed files of one checkpoint directory, checked by one worker: their
    names, ids and index entries (the keys check_file compares), without a Path a file."""

    directory: Path
    names: tuple[str, ...]
    tids: tuple[int, ...]
    entries: tuple[dict[str, Any] | None, ...]
    options: Options

    def paths(self) -> list[Path]:
        return [self.directory / name for name in self.names]

    def tasks(self) -> list[Task]:
        zipped = zip(self.paths(), self.tids, self.entries, strict=True)
        return [Task(path, tid, entry, self.options) for path, tid, entry in zipped]


@dataclass
class SegmentResult:
    results: list[Result] = field(default_factory=list)  # one a file, in order


def cut_segments(
    directory: Path,
    listed: Sequence[tuple[str, int, dict[str, Any] | None]],
    options: Options,
    most: int,
) -> list[Segment]:
    """The (name, id, entry) of `directory`'s listed files, in segments of at most `most`."""
    out = []
    for k in range(0, len(listed), most):
        names, tids, entries = zip(*listed[k : k + most], strict=True)
        out.append(Segment(directory, names, tids, entries, options))
    return out


def segment_files(count: int, parts: int, single: bool) -> int:
    """Files a segment: `count` files cut into at least `parts` segments where there are that many
    (so every worker has some to the end), at most SEGMENT_FILES; one with `single` (a journal
    records files one by one)."""
    return 1 if single else max(1, min(SEGMENT_FILES, -(-count // max(1, parts))))


def check_segment(segment: Segment) -> SegmentResult:
    """check_file's Result of each of the segment's files (on a worker process), read and
    checked SEGMENT_BYTES at a time."""
    tasks = segment.tasks()
    templates: dict[int, ptbulk.Template | None] = {}
    out: list[Result] = []
    while len(out) < len(tasks):
        datas: list[bytes | None] = []
        held = 0
        while len(out) + len(datas) < len(tasks) and held < SEGMENT_BYTES:
            data = _read_pt(tasks[len(out) + len(datas)])
            datas.append(data)
            held += len(data or b"")
        out += _check_read(tasks[len(out) : len(out) + len(datas)], datas, templates)
    return SegmentResult(out)


def _check_read(
    tasks: Sequence[Task], datas: list[bytes | None], templates: dict[int, ptbulk.Template | None]
) -> list[Result]:
    """The Results of `tasks`, whose `.pt` files' bytes are `datas` (None for the others)."""
    import numpy as np

    results: list[Result | None] = [None] * len(tasks)
    layouts: dict[int, Any] = {}
    k = 0
    while k < len(tasks):
        data = datas[k]
        if data is None:
            k += 1
            continue
        stop = k + 1
        while stop < len(tasks) and (other := datas[stop]) is not None and len(other) == len(data):
            stop += 1
        joined = data if stop == k + 1 else b"".join(datas[k:stop])  # type: ignore[arg-type]
        rows = np.frombuffer(joined, dtype=np.uint8).reshape(stop - k, len(data))
        headers = ptbulk.headers_of(rows, lambda j, k=k: tasks[k + j].path, templates)  # type: ignore[misc]
        keys = [_layout(header, layouts) for header in headers]
        j = 0
        while j < len(headers):
            end = j + 1
            while end < len(headers) and keys[end] == keys[j]:
                end += 1
            if keys[j] is not None:
                got = _Run(tasks[k + j : k + end], rows[j:end], headers[j:end]).check()  # type: ignore[arg-type]
                if got is not None:
                    results[k + j : k + end] = got
            j = end
        k = stop
    return [check_file(t) if r is None else r for r, t in zip(results, tasks, strict=True)]


def _layout(header: dict[str, Any] | RbtoolError, known: dict[int, Any]) -> Any:
    """What files checked together share: every tensor's path and place, and the kind of every
    other value (the values themselves, such as model_weights_id, may differ file by file);
    None for a file read_header refuses. Made once per header (`known`, by identity)."""
    if isinstance(header, Exception):
        return None
    key = known.get(id(header))
    if key is None:

        def kind(value: Any) -> Any:
            if isinstance(value, ptheader.TensorSpec):
                return value
            if isinstance(value, dict):
                return tuple((k, kind(v)) for k, v in value.items())
            return type(value).__name__

        key = known[id(header)] = kind(header)
    return key


def _read_pt(task: Task) -> bytes | None:
    """A `.pt` file's bytes (one read), or None: check_file takes it alone."""
    if task.path.suffix != ".pt":
        return None
    try:
        return ptheader.read_small(task.path, READ_LIMIT) or None
    except RbtoolError:  # named by check_file, as it names it alone
        return None


class _Alone(Exception):
    """The run's files are checked one by one."""


class _Run:
    """Files of one layout in a row (`rows`: their bytes, a file a row; `headers`: each file's,
    whose tensors are the first one's and whose other values may differ)."""

    def __init__(self, tasks: Sequence[Task], rows: Any, headers: Sequence[dict[str, Any]]) -> None:
        self.tasks, self.rows, self.headers, self.header = tasks, rows, headers, headers[0]
        self.count = len(tasks)
        self.options = tasks[0].options
        self.arrays: dict[str, Any] = {}  # each field's values in every file, [files, *shape]
        self.plan: list[tuple[str, Any, Any]] = []  # (path, spec, numpy dtype) in header order
        self.specs: dict[str, Any] = {}
        self.unpaired: Any = None  # files whose observations were not recorded as transitions
        self.ended: Any = None  # which env columns of each file end an episode, [files, B]
        self.out: Any = None  # rewards outside the range, [files, *shape]

    def on(self, check: str) -> bool:
        return check in self.options.checks

    def check(self) -> list[Result | None] | None:
        """Each file's Result, None for a file check_file must check alone; None for all when
        the run cannot be checked together."""
        try:
            return self._check()
        except (_Alone, ValueError, TypeError, IndexError):  # anything unforeseen: one by one
            return None

    def _check(self) -> list[Result | None]:
        import numpy as np

        from rbtool.format import layout

        header = self.header
        infos = self._describe()
        alone = np.array([info is None for info in infos])  # files check_file must look at
        if alone.all():
            raise _Alone
        t, b = next(info.shape for info in infos if info is not None)[:2]
        self._cut()
        specs = self.specs = {path: spec for path, spec, _ in self.plan}
        if self.on("non-finite"):
            for path, _, dtype in self.plan:
                if dtype.kind in "fc":
                    alone |= ~np.isfinite(self._flat(path)).all(1)

        def columned(path: str) -> bool:
            return self._columned(specs[path], t, b)

        if self.on("frozen") and t >= 2:
            for path in self.options.frozen_fields:
                if path in specs and columned(path):
                    flat = self.arrays[path].reshape(self.count, t, b, -1)
                    alone |= (flat == flat[:, :1]).all(-1).all(1).any(1)
        if self.on("blank-camera"):
            for path, spec, _ in self.plan:
                if columned(path) and is_image(path, spec):
                    flat = self.arrays[path].reshape(self.count, t, b, -1)
                    if t >= 2:
                        alone |= (flat[:, 1] == flat[:, 0]).all(-1).any(1)
                    else:
                        alone |= (flat[:, 0] == flat[:, 0, :, :1]).all(-1).any(1)
        present = {k: specs[k] for k in layout.DONE_LIKE if k in specs and len(specs[k].shape) >= 2}
        if any(spec.shape[1] != b for spec in present.values()):
            raise _Alone
        bad = None
        if self.on("done-flags") and len(present) == 3:
            if len({spec.shape for spec in present.values()}) != 1:
                raise _Alone
            dones, terms, truncs = (self.arrays[k].astype(bool) for k in layout.DONE_LIKE)
            bad = dones != (terms | truncs)
        ends, extra = self._ends(present, t, b)
        if ends is not None:
            if self.on("pairing") and t >= 2:
                found, self.unpaired = self._pairing(ends.any(-1), t // extra if extra else t, t, b)
                alone |= found
            if self.on("episodes"):
                long, self.ended = self._episodes(ends, [h.get("max_episode_length") for h in self.headers])
                alone |= long
        limits = self.options.reward_range
        reward = specs.get("rewards")
        if self.on("rewards") and limits is not None and reward is not None and len(reward.shape) >= 2:
            rewards = self.arrays["rewards"]
            if rewards.dtype.kind not in "fiu":
                raise _Alone
            self.out = (rewards < limits[0]) | (rewards > limits[1])
        versions = header.get("versions")
        if "versions" in header and "versions" not in specs:
            raise _Alone  # not a tensor: check_file says what it makes of it
        if versions is not None and self.arrays["versions"].dtype.kind == "c":
            raise _Alone
        return self._results(alone, bad, infos)

    def _describe(self) -> list[Any]:
        """check_file's TrajectoryInfo of each file, None where describe refuses it or its
        model_weights_id comes from its name (made once per header)."""
        from rbtool.format import layout

        made: dict[int, Any] = {}
        out = []
        for task, header in zip(self.tasks, self.headers, strict=True):
            info = made.get(id(header), False)
            if info is False:
                info = None
                if header.get("model_weights_id") is not None:
                    plain = {k: v for k, v in header.items() if k not in layout.DONE_LIKE}
                    with contextlib.suppress(RbtoolError):  # check_file names what describe refuses
                        info = layout.describe(plain, str(task.path), ptheader.TensorSpec)
                made[id(header)] = info
            out.append(info)
        return out

    def _cut(self) -> None:
        """Every field's values as `[files, *shape]` arrays of check_file's dtypes."""
        import numpy as np

        from rbtool.format import layout

        for path, spec in layout.iter_tensors(self.header, kind=ptheader.TensorSpec):
            try:
                dtype = np.dtype(spec.dtype)
            except TypeError:
                raise _Alone from None  # bfloat16: numpy does not have it
            name = ".".join(path)
            if dtype.name != spec.dtype or name in self.arrays:
                raise _Alone  # torch's name for it is not numpy's; a path named twice
            nbytes = spec.numel() * spec.itemsize
            start = spec.data_start
            aligned = not (spec.start % spec.itemsize or spec.nbytes % spec.itemsize)
            if not (nbytes and spec.is_contiguous() and aligned and dtype.itemsize == spec.itemsize):
                raise _Alone  # an empty field, or one load_bytes_quick leaves to torch.load
            raw = self.rows[:, start : start + nbytes]
            if self.count > 1:  # a field of its own, aligned and in the cache (one file's is a view)
                raw = raw.copy()
            self.arrays[name] = raw.view(dtype).reshape(self.count, *spec.shape)
            self.plan.append((name, spec, dtype))

    @staticmethod
    def _columned(spec: Any, t: int, b: int) -> bool:
        """A field laid out [T, B, ...] (not a per-env vector, not a done-like field)."""
        return spec.dim() >= 2 and spec.shape[0] == t and spec.shape[1] == b

    def _flat(self, path: str) -> Any:
        return self.arrays[path].reshape(self.count, -1)

    def _ends(self, present: dict[str, Any], t: int, b: int) -> tuple[Any, int]:
        """Episode ends `[files, T, B, K]` as check_file's _ends finds them, or None, and E."""
        import numpy as np

        from rbtool.format import layout

        extra = done_extra(present, t, b)
        if extra is None:
            return None, 0
        flags: dict[str, Any] = {}
        for key in present:  # each file's rows without the bootstrap ones, files first
            steps = layout.drop_bootstrap_rows(np.moveaxis(self.arrays[key], 0, 1), t)
            flags[key] = np.moveaxis(steps, 0, 1).astype(bool).reshape(self.count, t, b, -1)
        if not flags or len({a.shape for a in flags.values()}) != 1:
            return None, 0
        ends = layout.episode_ends(flags.get("dones"), flags.get("terminations"), flags.get("truncations"))
        return ends, extra

    def _pairing(self, ends: Any, epoch_len: int, t: int, b: int) -> tuple[Any, Any]:
        """(files where the pairing check finds something, files it calls unpaired), as
        check_file's pairing: a step t is compared where no episode ended at t (`ends`
        `[files, T, B]`) and t + 1 starts no epoch. Where next_obs[t] equals curr_obs[t + 1] at
        some compared step, a step where a field's pair differs is a finding; where it does at
        none, observations paired one step off are a finding, and otherwise the trajectory
        was not recorded as transitions (unpaired)."""
        import numpy as np

        from rbtool.format import layout

        none = np.zeros(self.count, dtype=bool)
        curr, nxt = self.header.get("curr_obs"), self.header.get("next_obs")
        if not isinstance(curr, dict) or not isinstance(nxt, dict):
            return none, none
        kind = ptheader.TensorSpec
        currs = {".".join(p): ".".join(("curr_obs", *p)) for p, _ in layout.iter_tensors(curr, kind=kind)}
        pairs = []  # (next_obs, curr_obs) of each field both hold alike, [files, T, B, -1]
        for p, spec in layout.iter_tensors(nxt, kind=kind):
            c_name = currs.get(".".join(p))
            if c_name is None:
                continue
            c_spec = self.specs[c_name]
            columned = self._columned(spec, t, b) and self._columned(c_spec, t, b)
            if columned and spec.shape == c_spec.shape:
                n_name = ".".join(("next_obs", *p))
                pairs.append(tuple(self.arrays[k].reshape(self.count, t, b, -1) for k in (n_name, c_name)))
        if not pairs:
            return none, none
        rows = np.arange(t - 1)
        compared = ~ends[:, :-1] & ~((rows + 1) % epoch_len == 0).reshape(1, -1, 1)  # [files, T - 1, B]

        def equal(shift_n: slice, shift_c: slice) -> list[Any]:
            """Where each field's next_obs[shift_n] equals its curr_obs[shift_c] (NaN equal to NaN)."""
            out = []
            for n, c in pairs:
                a, z = n[:, shift_n], c[:, shift_c]
                same = a == z
                if a.dtype.kind == "f":
                    same |= np.isnan(a) & np.isnan(z)
                out.append(same.all(-1))
            return out

        fields = equal(slice(None, -1), slice(1, None))
        broken = np.zeros(self.count, dtype=bool)  # a field's pair differs at a compared step
        for same in fields:
            broken |= (compared & ~same).any((1, 2))
        looked = compared.any((1, 2))
        paired = (np.logical_and.reduce(fields) & compared).any((1, 2))
        off = np.zeros(self.count, dtype=bool)  # paired one step off: check_file's finding
        ahead = compared[:, :-1] & compared[:, 1:]
        shifts = ((compared, slice(None, -1), slice(None, -1)), (ahead, slice(None, -2), slice(2, None)))
        for where, shift_n, shift_c in shifts:
            held = np.logical_and.reduce(equal(shift_n, shift_c)) & where
            off |= 2 * held.sum((1, 2)) > where.sum((1, 2))  # (never where nothing is compared)
        found = looked & ((paired & broken) | (~paired & off))
        return found, looked & ~paired & ~off

    def _episodes(self, ends: Any, mels: list[Any]) -> tuple[Any, Any]:
        """(files where an episode may run past max_episode_length, `mels` for each file: that
        many steps in a row without an end, followed by another step; which env columns of
        each file end, `[files, B]`)."""
        import numpy as np

        count, _, b, _ = ends.shape
        steps = ends.transpose(0, 2, 1, 3).reshape(count, b, -1)  # each column's steps in time order
        ended = steps.any(2)
        found = np.zeros(count, dtype=bool)
        limit = np.array([m if type(m) is int and m > 0 else -1 for m in mels])
        if steps.shape[2] > 1 and (limit >= 0).any():
            at = np.arange(steps.shape[2])
            last = np.maximum.accumulate(np.where(steps, at, -1), axis=2)
            longest = (at - last)[:, :, :-1].max(axis=(1, 2))  # steps without an end, before another
            found |= (limit > 0) & (longest >= limit)
        return found, ended

    def _results(self, alone: Any, bad: Any, infos: list[Any]) -> list[Result | None]:
        import numpy as np

        header = self.header
        versions = self.arrays.get("versions") if "versions" in header else None
        ids: dict[bytes, str] = {b"": NO_VERSIONS_ID}
        newest = versions.reshape(self.count, -1).max(1).tolist() if versions is not None else None
        if bad is not None:
            bad_cells = bad.reshape(*bad.shape[:3], -1).any(-1)  # [files, rows, B]
            counts = bad.reshape(self.count, -1).sum(1).tolist()
            has_bad = bad_cells.any((1, 2)).tolist()
        if self.ended is not None:
            ended_any, ended_all = self.ended.any(1).tolist(), self.ended.all(1).tolist()
        limits = self.options.reward_range
        if self.out is not None:
            outside = self.out
            out_cells = outside.reshape(*outside.shape[:3], -1).any(-1)  # [files, T, B]
            out_count = outside.reshape(self.count, -1).sum(1).tolist()
            rewards = self.arrays["rewards"].reshape(self.count, -1)
            reward_min, reward_max = rewards.min(1).tolist(), rewards.max(1).tolist()
        duplicates = self.on("duplicates")
        prints = [  # the fingerprint's parts, in path order: what it hashes and where the bytes are
            (f"{path}|torch.{dtype.name}|{list(s.shape)}|".encode(), s.data_start, s.numel() * s.itemsize)
            for path, s, dtype in sorted(self.plan, key=lambda part: part[0])
        ]
        rows = self.rows
        out: list[Result | None] = []
        for n, task in enumerate(self.tasks):
            if alone[n]:
                out.append(None)
                continue
            result = Result(size=rows.shape[1])
            result.traits.unpaired = self.unpaired is not None and bool(self.unpaired[n])
            found = result.findings
            own, info = self.headers[n], infos[n]
            if self.on("index"):
                mel = own.get("max_episode_length")
                found += index_findings(task, info.shape, info.model_weights_id, mel)
            if bad is not None and has_bad[n]:
                envs = np.flatnonzero(bad_cells[n].any(0)).tolist()
                steps = np.flatnonzero(bad_cells[n].any(1)).tolist()
                found.append(done_flags_finding(task, int(counts[n]), envs, steps))
            if self.ended is not None and ended_any[n] and not ended_all[n]:
                found.append(never_ending_finding(task, np.flatnonzero(~self.ended[n]).tolist()))
            if self.out is not None and out_count[n]:
                where = out_cells[n]
                envs, steps = np.flatnonzero(where.any(0)).tolist(), np.flatnonzero(where.any(1)).tolist()
                span = (float(reward_min[n]), float(reward_max[n]))
                found.append(rewards_finding(task, int(out_count[n]), limits, span, envs, steps))  # type: ignore[arg-type]
            if self.on("policy"):
                key = b"" if versions is None else versions[n].tobytes()
                expected = ids.get(key)
                if expected is None:
                    expected = ids[key] = weights_id_of_bytes(key)
                actual = own.get("model_weights_id")
                if actual != expected:
                    found.append(policy_finding(task, actual, expected, versions is not None))
                if newest is not None:
                    result.traits.newest_version = newest_version(float(newest[n]))
            if duplicates:
                digest = hashlib.sha256()
                row = rows[n]
                for prefix, start, nbytes in prints:
                    digest.update(prefix)
                    digest.update(row[start : start + nbytes])
                result.traits.fingerprint = digest.hexdigest()
            out.append(result)
        return out
