"""Sampling from a remote checkpoint by byte ranges: the zip directory and the drawn rows only.

An IndexMirror stands every trajectory object in as a sparse local file of its recorded
size. Before a batch is gathered, `drawn_rows` fetches into those stand-ins, at the same
offsets, the bytes the local reader will read of each drawn `.pt` file: the tail with the
end-of-central-directory record and the central directory, each record's local header,
`data.pkl` (and `byteorder`, `version`), every sampled field whose rows are small (the
reader holds those whole) and, of the fields whose rows are large, only the drawn rows.
Missing ranges are coalesced and fetched in parallel with `cat_file(path, start, end)`;
a RangeCache remembers which ranges each stand-in holds, so later draws fetch only what is
new. `.pt` files small enough to be read whole, `.pkl` files (no row offsets) and layouts
the header reader leaves to torch are fetched whole, checked against the marker.

A partial read cannot be checked against an object's sha256: what is checked is the
object's size (against the marker, before anything is read), the length of every range
read back, and the zip CRC-32 of every record fetched complete (the `data.pkl` record, the
small-row fields).
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rbtool.errors import CheckpointError, RbtoolError

if TYPE_CHECKING:
    from rbtool.buffer.replay import TrajectoryReplayBuffer
    from rbtool.buffer.sampling import Draw
    from rbtool.files.dirs import CheckpointView
    from rbtool.files.ptheader import ZipRecord
    from rbtool.remote.mirror import IndexMirror

# Missing ranges of one object closer than this are fetched in one request (the gap too).
COALESCE_GAP = 16 << 10
_SMALL_RECORDS = ("data.pkl", "byteorder", "version")
# Of the zip tail (where the end-of-central-directory record is), fetched first.
TAIL_FIRST = 4 << 10
_EOCD_BYTES = 22
_ZIP64_LOCATOR_BYTES = 20
Ranges = list[tuple[int, int]]


def merge(ranges: Sequence[tuple[int, int]], gap: int = 0) -> Ranges:
    """The union of half-open ranges, sorted; ranges less than `gap` apart become one."""
    out: Ranges = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if out and start <= out[-1][1] + gap:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def subtract(wanted: Ranges, present: Ranges) -> Ranges:
    """The parts of the merged ranges `wanted` that the merged ranges `present` do not cover."""
    out: Ranges = []
    j = 0
    for start, end in wanted:
        while j < len(present) and present[j][1] <= start:
            j += 1
        k, at = j, start
        while k < len(present) and present[k][0] < end:
            if present[k][0] > at:
                out.append((at, present[k][0]))
            at = max(at, present[k][1])
            k += 1
        if at < end:
            out.append((at, end))
    return out


class RangeCache:
    """Which byte ranges of each stand-in of an IndexMirror hold the object's bytes; fetches the rest.

    Bounded: the bytes present (whole objects fetched by the mirror not counted) stay under
    `limit` ($RBTOOL_CACHE_BYTES by default); a fetch that would pass it is refused.
    """

    def __init__(self, mirror: IndexMirror, *, limit: int | None = None, jobs: int | None = None) -> None:
        from rbtool.remote.cache import cache_bytes

        self.mirror = mirror
        self.limit = cache_bytes() if limit is None else limit
        self.jobs = jobs or min(16, (os.cpu_count() or 1) * 4)
        self.present: dict[str, Ranges] = {}
        self.bytes_present = 0
        self.requests = 0  # range requests sent to the store
        self._held: dict[str, int] = {}  # object -> bytes of it present
        self._checked: set[tuple[str, int]] = set()  # (object, record data start) whose CRC matched
        self._lock = threading.Lock()

    def missing(self, rel: str, ranges: Sequence[tuple[int, int]]) -> Ranges:
        """What of `ranges` (clipped to the object) is not here yet."""
        size = self.mirror.checkpoint.sizes[rel]
        wanted = merge([(max(0, a), min(size, b)) for a, b in ranges])
        if self.mirror.holds(rel):
            return []
        with self._lock:
            return subtract(wanted, self.present.get(rel, []))

    def ensure(self, wants: Mapping[str, Sequence[tuple[int, int]]]) -> None:
        """Fetch what is missing of `wants` (object -> byte ranges) into the stand-ins, in parallel."""
        jobs = [
            (rel, a, b)
            for rel, ranges in wants.items()
            for a, b in merge(self.missing(rel, ranges), COALESCE_GAP)
        ]
        if not jobs:
            return
        new = sum(b - a for _, a, b in jobs)
        if self.bytes_present + new > self.limit:
            raise CheckpointError(
                f"{self.mirror.checkpoint.remote.url}: the drawn rows need {self.bytes_present + new} bytes "
                f"in the local cache ({self.limit} bytes); raise RBTOOL_CACHE_BYTES"
            )
        if len(jobs) == 1:
            self._get(*jobs[0])
        else:
            with ThreadPoolExecutor(min(self.jobs, len(jobs))) as pool:
                list(pool.map(lambda job: self._get(*job), jobs))

    def _get(self, rel: str, start: int, end: int) -> None:
        from rbtool.remote.urls import store_errors

        remote = self.mirror.checkpoint.remote
        where, options = f"{remote.url}/{rel}", remote.fs.storage_options
        with store_errors(where, f"cannot read bytes {start}-{end}", options):
            data = remote.fs.cat_file(remote.key(rel), start=start, end=end)
        if len(data) != end - start:
            raise CheckpointError(
                f"{remote.url}/{rel}: bytes {start}-{end} read back as {len(data)} bytes "
                "(changed during the read?); rerun"
            )
        try:
            fd = os.open(self.mirror.path / rel, os.O_WRONLY)
            try:
                os.pwrite(fd, data, start)
            finally:
                os.close(fd)
        except OSError as exc:  # the local cache's disk, not the store
            raise CheckpointError(
                f"{remote.url}/{rel}: cannot keep bytes {start}-{end} in the local cache "
                f"({exc.strerror or exc}); free space there (RBTOOL_CACHE_DIR)"
            ) from None
        with self._lock:
            first = rel not in self.present
            ranges = self.present[rel] = merge([*self.present.get(rel, []), (start, end)])
            held = sum(b - a for a, b in ranges)
            self.bytes_present += held - self._held.get(rel, 0)
            self._held[rel] = held
            self.requests += 1
            self.mirror.fetched_bytes += end - start
            if first:
                self.mirror.fetched += 1

    def read(self, rel: str, offset: int, n: int) -> bytes:
        """`n` bytes at `offset` of the object (fewer at its end), fetched first when missing."""
        self.ensure({rel: [(offset, offset + n)]})
        return self.read_present(rel, offset, n)

    def read_present(self, rel: str, offset: int, n: int) -> bytes:
        """`n` bytes at `offset` of the stand-in as it is (zeros where nothing was fetched)."""
        fd = os.open(self.mirror.path / rel, os.O_RDONLY)
        try:
            return os.pread(fd, max(0, min(n, self.mirror.checkpoint.sizes[rel] - offset)), offset)
        finally:
            os.close(fd)

    def check_crc(self, rel: str, start: int, record: ZipRecord) -> None:
        """Check a record whose data (at `start`) is here whole against its zip CRC-32 (once)."""
        if (rel, start) in self._checked:
            return
        fd = os.open(self.mirror.path / rel, os.O_RDONLY)
        try:
            data = os.pread(fd, record.size, start)
        finally:
            os.close(fd)
        if zlib.crc32(data) != record.crc32:
            raise CheckpointError(
                f"{self.mirror.checkpoint.remote.url}/{rel}: zip record {record.name!r:.80} does not match "
                "its CRC-32 (changed during the read?); rerun"
            )
        with self._lock:
            self._checked.add((rel, start))


def _file_ranges(
    cache: RangeCache, rel: str, path: Path, t: int, b: int, rows: Sequence[int], extra_fields: bool
) -> tuple[Ranges, list[tuple[int, ZipRecord]]] | None:
    """The byte ranges the local reader reads of a drawn large `.pt` file for `rows`, and the
    records they hold whole (data start, record); None when the file must be read whole.

    The header's ranges are fetched here (the zip directory, the local headers, data.pkl)."""
    import math

    from rbtool.buffer.storage import ROW_READ_MIN_BYTES, raw_layout
    from rbtool.files.ptheader import (
        LOCAL_HEADER_BYTES,
        UnusualLayout,
        parse_header,
        record_data_start,
        zip_records,
    )

    size = cache.mirror.checkpoint.sizes[rel]

    def read(offset: int, n: int) -> bytes:
        return cache.read(rel, offset, n)

    def read_tail(offset: int, n: int) -> bytes:
        """The zip tail: its last TAIL_FIRST bytes are fetched first; when the end-of-central-
        directory record (and a zip64 locator before it) is in them, the rest of the tail is
        left unfetched: a search from the end finds the same record in zeros as in the object."""
        if offset + n == size and n > TAIL_FIRST:
            last = cache.read(rel, size - TAIL_FIRST, TAIL_FIRST)
            at = last.rfind(b"PK\x05\x06")
            if at >= _ZIP64_LOCATOR_BYTES and TAIL_FIRST - at >= _EOCD_BYTES:
                return cache.read_present(rel, offset, n)
        return read(offset, n)

    try:
        records = zip_records(path, read_tail, size)
        cache.ensure({rel: [(r.header_offset, r.header_offset + LOCAL_HEADER_BYTES) for r in records]})
        starts = {r.name: record_data_start(path, r, read) for r in records}
        small = [r for r in records if r.name.rsplit("/", 1)[-1] in _SMALL_RECORDS]
        cache.ensure({rel: [(starts[r.name], starts[r.name] + r.size) for r in small]})
        for r in small:
            cache.check_crc(rel, starts[r.name], r)
        header = parse_header(path, read_tail, size)
        layout = raw_layout(header, str(path), t, b, extra_fields)
    except UnusualLayout:
        return None
    by_start = {starts[r.name]: r for r in records}
    ranges: Ranges = []
    whole: list[tuple[int, ZipRecord]] = []
    for _, spec, extra in layout:
        row_bytes = math.prod(spec.shape[2:]) * spec.itemsize
        if row_bytes >= ROW_READ_MIN_BYTES and extra == 0:
            first = spec.data_start
            ranges += [(first + row * row_bytes, first + (row + 1) * row_bytes) for row in rows]
        else:
            ranges.append((spec.start, spec.start + spec.nbytes))
            record = by_start.get(spec.start)
            if record is not None and record.size == spec.nbytes:
                whole.append((spec.start, record))
    return ranges, whole


def drawn_rows(
    mirror: IndexMirror, view: CheckpointView, *, extra_fields: bool = False, cache: RangeCache | None = None
) -> Callable[[Draw], None]:
    """A `before_gather` for a buffer loaded from `mirror`: fetches the byte ranges each draw reads.

    Uniform draws from a checkpoint whose index records every schema read nothing before the
    draw, so this is all that is fetched. Pass one `cache` to several buffers of a mirror to share it.
    """
    from rbtool.files.ptheader import SMALL_FILE_BYTES

    ranges_cache = cache or RangeCache(mirror)

    def before_gather(draw: Draw) -> None:
        rows: dict[int, list[int]] = {}
        for tid, row in zip(draw.trajectory_ids, draw.local_indices.tolist(), strict=True):
            rows.setdefault(tid, []).append(int(row))
        whole: list[Path] = []
        partial: list[tuple[str, Path, int, int, list[int]]] = []
        for tid, drawn in rows.items():
            path = view.file_of(tid)
            rel = path.relative_to(mirror.path).as_posix()
            if mirror.holds(rel):
                continue
            if path.suffix != ".pt" or mirror.checkpoint.sizes[rel] <= SMALL_FILE_BYTES:
                whole.append(path)
                continue
            t, b = view.index.entries[tid]["shape"][:2]
            partial.append((rel, path, t, b, sorted(set(drawn))))

        def plan(item: tuple[str, Path, int, int, list[int]]) -> Any:
            rel, path, t, b, drawn = item
            try:
                return _file_ranges(ranges_cache, rel, path, t, b, drawn, extra_fields)
            except CheckpointError:
                raise
            except RbtoolError:
                return None  # a damaged header: the whole object is fetched and its reader reports it

        with ThreadPoolExecutor(max(1, min(ranges_cache.jobs, len(partial)))) as pool:
            plans = list(pool.map(plan, partial))
        wants: dict[str, Ranges] = {}
        checks: list[tuple[str, int, ZipRecord]] = []
        for (rel, path, *_), got in zip(partial, plans, strict=True):
            if got is None:
                whole.append(path)
                continue
            wants[rel] = got[0]
            checks += [(rel, start, record) for start, record in got[1]]
        if whole:
            mirror.fetch(whole)
        ranges_cache.ensure(wants)
        for rel, start, record in checks:
            if not mirror.holds(rel):
                ranges_cache.check_crc(rel, start, record)

    return before_gather


class RangeReads:
    """A buffer loaded from an IndexMirror, sampled by byte ranges: what a training dataset samples from.

    `sample(n)` is the buffer's uniform sample with `drawn_rows` fetching what each draw
    reads, so `ReplayBufferDataset(RangeReads(buffer, mirror, view), ...)` trains from a remote
    checkpoint fetching only the drawn rows. When the index does not record every schema the
    window's headers are read before the first draw, so then every object is fetched up front
    (as `sample` does). Readiness, waiting and the generator are the buffer's.
    """

    def __init__(
        self,
        buffer: TrajectoryReplayBuffer,
        mirror: IndexMirror,
        view: CheckpointView,
        *,
        cache: RangeCache | None = None,
    ) -> None:
        self.buffer = buffer
        buffer.read_rows_when_drawn()  # a stand-in's unfetched bytes are not data
        index = view.index
        if not all(e.get("schema") in index.schemas for e in index.entries.values()):
            mirror.fetch()
        self._before_gather = drawn_rows(mirror, view, extra_fields=buffer.extra_fields, cache=cache)

    @property
    def random_generator(self) -> Any:
        return self.buffer.random_generator

    def sample(self, num_chunks: int) -> dict[str, Any]:
        return self.buffer.sample_with_draw(num_chunks, before_gather=self._before_gather)[1]

    def is_ready(self, min_size: int) -> bool:
        return self.buffer.is_ready(min_size)

    def wait_until_ready(self, min_size: int, timeout: float | None = None) -> bool:
        return self.buffer.wait_until_ready(min_size, timeout)
