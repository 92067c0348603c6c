"""Reading a remote checkpoint: its listing checked against the completion marker (`inspect`), then
read through local mirrors.

`index_mirror` holds the JSON objects and, for every other object, a sparse stand-in of its
recorded size (what the quick checks read: names and sizes); `data_mirror` copies every object
into the bounded local cache, verified against the marker; `stream_mirror` fetches a pass's
objects in batches ahead of it and releases them after it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rbtool.errors import CacheFullError, CheckpointError, RbtoolError, UntrustedCacheError
from rbtool.progress import Progress
from rbtool.remote.cache import (
    _RESERVED,
    Pin,
    _allocated,
    _cache_lock,
    _chmod_dir,
    _create_private,
    _discard,
    _make_dirs,
    _make_room,
    _own_file,
    _private_dir,
    _scratch,
    _tree,
    _write_private,
    cache_bytes,
    cache_root,
)
from rbtool.remote.keys import _CONTROL, _JSON_OBJECTS, MARKER, PENDING, _check_names, _listing, shown_key
from rbtool.remote.marker import _CHUNK, Digest, _etag, _read_marker, digest_file
from rbtool.remote.urls import Remote, _workers, open_remote, store_errors


@dataclass
class RemoteCheckpoint:
    """What a reader found at a URL: its objects with sizes and (for rbtool uploads) sha256."""

    remote: Remote
    objects: dict[str, Digest | None]  # relative name -> recorded digest (None: size only, from the store)
    sizes: dict[str, int]
    complete: bool  # an rbtool upload with its marker (False: written by another tool)


def inspect(url: str, options: dict[str, Any] | None = None) -> RemoteCheckpoint:
    """List a remote checkpoint and check it against its completion marker.

    Refuses an rbtool upload without its marker (killed or under way) and objects that are
    missing or of another size than the marker records. A rank directory inside an uploaded
    rank tree is covered by the tree's marker (in its parent). What the store raises is one
    error naming the URL.
    """
    with store_errors(url, "cannot read", options):
        return _inspect(url, options)


def _inspect(url: str, options: dict[str, Any] | None) -> RemoteCheckpoint:
    remote = open_remote(url, options)
    listing = _listing(remote)
    if not listing:
        raise CheckpointError(f"{url}: no such checkpoint (no objects under it)")
    _check_names(remote, listing)
    parent_prefix = ""
    marker_of: tuple[Remote, str] | None = None
    pending = PENDING in listing
    if MARKER in listing:
        marker_of = (remote, MARKER)
    elif not pending and "/" in remote.root:
        parent = Remote(url.rsplit("/", 1)[0], remote.fs, remote.root.rsplit("/", 1)[0])
        name = remote.root.rsplit("/", 1)[1]
        if remote.fs.exists(parent.key(MARKER)):
            marker_of, parent_prefix = (parent, MARKER), name + "/"
        elif remote.fs.exists(parent.key(PENDING)):
            pending = True
    if marker_of is None and pending:
        raise CheckpointError(
            f"{url}: incomplete upload (no {MARKER}): the command that wrote it was interrupted or is "
            "still running; rerun the command"
        )
    sizes = {rel: int(info.get("size") or 0) for rel, info in listing.items() if rel not in _CONTROL}
    if marker_of is None:
        return RemoteCheckpoint(remote, dict.fromkeys(sizes), sizes, complete=False)
    recorded = _read_marker(*marker_of)
    if parent_prefix:
        recorded = {
            rel[len(parent_prefix) :]: d for rel, d in recorded.items() if rel.startswith(parent_prefix)
        }
    wrong = [rel for rel, d in recorded.items() if sizes.get(rel) != d.size]
    if wrong:
        shown = ", ".join(wrong[:5]) + (" ..." if len(wrong) > 5 else "")
        raise CheckpointError(
            f"{url}: {len(wrong)} object(s) missing or of another size than {MARKER} records ({shown})"
        )
    # what the marker does not record, or an object the store lists under another ETag than
    # the one it had after the upload, is another writer's: a mix of two uploads
    extra = sorted(set(sizes) - set(recorded))
    changed = [
        rel
        for rel, d in sorted(recorded.items())
        if d.etag is not None and (etag := _etag(listing[rel])) is not None and etag != d.etag
    ]
    if extra or changed:
        names = changed or extra
        shown = ", ".join(shown_key(rel) for rel in names[:5]) + (" ..." if len(names) > 5 else "")
        what = "changed since the upload (another ETag)" if changed else f"that {MARKER} does not record"
        raise CheckpointError(
            f"{url}: {len(names)} object(s) {what} ({shown}): another writer wrote here after the upload "
            "(or at the same time); refused, upload the checkpoint again"
        )
    return RemoteCheckpoint(remote, dict(recorded), {rel: d.size for rel, d in recorded.items()}, True)


def _fetch(ckpt: RemoteCheckpoint, rel: str, dst: Path, *, in_place: bool = False) -> None:
    """Copy one object to `dst` (streamed, through a temporary name), checked against its record.

    `in_place` writes the checked bytes into the existing file `dst` (same inode), so that a
    reader that already holds it open (a loaded buffer pins its files) reads them.
    """
    _make_dirs(dst.parent)
    _private_dir(dst.parent)  # in the cache: the user's own directory, not a link to elsewhere
    tmp = dst.with_name(f".{dst.name}.part-{os.getpid()}")
    try:
        os.close(_create_private(tmp))  # 0600; the store's bytes are written into it
        with store_errors(f"{ckpt.remote.url}/{rel}", "cannot fetch", ckpt.remote.fs.storage_options):
            ckpt.remote.fs.get_file(ckpt.remote.key(rel), str(tmp))
        got = digest_file(tmp)
        want = ckpt.objects[rel]
        if got.size != ckpt.sizes[rel] or (want is not None and got.sha256 != want.sha256):
            raise CheckpointError(
                f"{ckpt.remote.url}/{rel}: the object read back does not match its recorded size and "
                "sha256 (changed during the read?); rerun"
            )
        if in_place:
            fd = os.open(dst, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # never written through a link
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
                os.close(fd)
                raise UntrustedCacheError(f"{dst}: a stand-in in the rbtool cache is not a file of its own")
            keeping = store_errors(f"{ckpt.remote.url}/{rel}", "cannot keep it in the local cache")
            with keeping, open(tmp, "rb") as src, open(fd, "r+b") as f:
                shutil.copyfileobj(src, f, _CHUNK)
        else:
            os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


@dataclass
class IndexMirror:
    """A local copy of a remote checkpoint's JSON objects; every other object stands in by name and size.

    The stand-ins are sparse files of the recorded size that hold no data: what the quick
    checks read (names and sizes) is right, and `fetch` replaces stand-ins by the objects
    (verified) before anything reads their bytes.
    """

    path: Path
    checkpoint: RemoteCheckpoint
    jobs: int | None = None
    fetched: int = 0  # objects fetched beyond the JSON ones
    fetched_bytes: int = 0
    _done: set[str] = field(init=False, default_factory=set)  # objects that are here, not stood in for

    def fetch(self, paths: Sequence[Path] | None = None) -> None:
        """Replace the stand-ins of `paths` (under `self.path`; None: every object) by the objects."""
        done = self._done
        if paths is None:
            names = list(self.checkpoint.sizes)
        else:
            names = [p.relative_to(self.path).as_posix() for p in paths]
        todo = sorted({rel for rel in names if rel not in done})
        limit = cache_bytes()
        for rel in todo:  # the size the listing and marker give, checked before anything is fetched
            size = self.checkpoint.sizes[rel]
            if size > limit:
                raise CheckpointError(
                    f"{self.checkpoint.remote.url}/{rel}: {size} bytes do not fit the local cache "
                    f"({limit} bytes); raise RBTOOL_CACHE_BYTES"
                )
        if sum(self.checkpoint.sizes[rel] for rel in todo) + self.fetched_bytes > limit:
            raise CheckpointError(
                f"{self.checkpoint.remote.url}: the objects to fetch take more than the local cache "
                f"({limit} bytes); raise RBTOOL_CACHE_BYTES"
            )

        def get(rel: str) -> None:
            _fetch(self.checkpoint, rel, self.path / rel, in_place=True)

        with ThreadPoolExecutor(_workers(self.jobs)) as pool:
            list(pool.map(get, todo))
        done.update(todo)
        self.fetched += len(todo)
        self.fetched_bytes += sum(self.checkpoint.sizes[rel] for rel in todo)

    def release(self, paths: Sequence[Path]) -> None:
        """Stand in again for the fetched objects of `paths`: their bytes dropped (a sparse file of
        the recorded size again) and no longer counted against the cache, so a reader that moves
        from trajectory to trajectory for hours (the web viewer) stays within the bound."""
        for path in paths:
            rel = path.relative_to(self.path).as_posix()
            if rel not in self._done or rel.rsplit("/", 1)[-1] in _JSON_OBJECTS:
                continue
            size = self.checkpoint.sizes[rel]
            os.truncate(path, 0)
            os.truncate(path, size)
            self._done.discard(rel)
            self.fetched_bytes -= size

    def holds(self, rel: str) -> bool:
        """True once the object `rel` is here whole (a JSON object, or fetched), not stood in for."""
        return rel in self._done

    def __post_init__(self) -> None:
        self._done.update(rel for rel in self.checkpoint.sizes if rel.rsplit("/", 1)[-1] in _JSON_OBJECTS)


@contextmanager
def index_mirror(url: str, options: dict[str, Any] | None = None) -> Iterator[IndexMirror]:
    """A temporary IndexMirror of `url`, removed on exit.

    For the commands that read only the index and the listing (names and sizes), nothing
    but the JSON objects (and the marker) is read from the store; `sample` fetches, of the
    trajectories it draws, only the byte ranges its reads need (`rbtool.remote.ranges`; small and
    `.pkl` files whole), and nothing else.
    """
    cache_root()  # an untrusted cache is refused before the store is asked anything
    ckpt = inspect(url, options)
    with _scratch("index") as tmp:
        root = _private_dir(tmp / "ckpt")
        for rel, size in ckpt.sizes.items():
            dst = root / rel
            if rel.rsplit("/", 1)[-1] in _JSON_OBJECTS:
                _fetch(ckpt, rel, dst)
            else:
                _standin(dst, size)
        yield IndexMirror(root, ckpt)


def _standin(dst: Path, size: int) -> None:
    """A sparse file of `size` bytes at `dst` (0600, its directories 0700) that holds no data yet."""
    _make_dirs(dst.parent)
    _private_dir(dst.parent)
    fd = _create_private(dst)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


_STATE = ".rbtool-mirror.json"  # in a mirror: its URL and the digests it was fetched for; never trusted


@contextmanager
def data_mirror(
    url: str,
    options: dict[str, Any] | None = None,
    *,
    jobs: int | None = None,
    progress: Progress | None = None,
) -> Iterator[Path]:
    """A local copy of every object at `url` in the bounded cache ($RBTOOL_CACHE_DIR, $RBTOOL_CACHE_BYTES).

    Objects are copied streamed and in parallel, each checked against the marker's size and
    sha256. A copy already in the cache is reused only if it is a regular file of the user's
    own with no other link, and its sha256 (hashed here, or earlier in this process while
    its size, inode, mtime and ctime stay the same) is the one the marker records now;
    nothing in the cache vouches for it (`.rbtool-mirror.json` is never trusted). The objects
    of an upload without a marker are fetched again every time. Least recently used mirrors
    of other URLs are removed to stay under the bound.
    """
    root = cache_root()
    ckpt = inspect(url, options)
    mirror = root / ("mirror-" + hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:24])
    limit = cache_bytes()
    needed = sum(ckpt.sizes.values())
    if needed > limit:
        raise CheckpointError(
            f"{url}: {needed} bytes do not fit the local cache ({limit} bytes), and this command needs every "
            "object at once; raise RBTOOL_CACHE_BYTES"
        )
    pin = Pin(mirror)
    try:
        pin.share()
        ckpt_dir = _update_mirror(ckpt, mirror, pin, url, limit, jobs, progress)
        yield ckpt_dir
    finally:
        pin.close()


# (device, inode, size, mtime_ns, ctime_ns) of a cached file -> the sha256 this process hashed it to
_HASHED: dict[tuple[int, int, int, int, int], str] = {}


def _cached_sha256(path: Path, info: os.stat_result) -> str | None:
    """The sha256 of the cached file `path` (lstat `info`), hashed once per process and identity;
    None if it changed while it was read."""
    key = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
    known = _HASHED.get(key)
    if known is not None:
        return known
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        sha = hashlib.sha256()
        while block := os.read(fd, _CHUNK):
            sha.update(block)
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if (after.st_dev, after.st_ino, after.st_size, after.st_mtime_ns, after.st_ctime_ns) != key:
        return None
    _HASHED[key] = sha.hexdigest()
    return _HASHED[key]


def _update_mirror(
    ckpt: RemoteCheckpoint,
    mirror: Path,
    pin: Pin,
    url: str,
    limit: int,
    jobs: int | None,
    progress: Progress | None,
) -> Path:
    """Bring `mirror` up to date with `ckpt`, under the exclusive lock if anything changes; returns its
    checkpoint directory, with `pin` held shared."""
    from rbtool.progress import start_phase

    root = mirror.parent
    workers = _workers(jobs)
    data = mirror / "ckpt"

    def plan() -> tuple[list[str], list[Path]]:
        """The objects to fetch, and what to remove: anything in the entry that is not a verified
        copy of an object, its directories, or the entry's own small files."""
        try:
            top = os.lstat(mirror)
        except FileNotFoundError:
            return list(ckpt.sizes), []
        if not stat.S_ISDIR(top.st_mode) or top.st_uid != os.geteuid():
            return list(ckpt.sizes), [mirror]  # a link, a file, another user's directory: never used
        if stat.S_IMODE(top.st_mode) != 0o700:
            _chmod_dir(mirror)
        wanted_dirs = {data, *(p for rel in ckpt.sizes for p in (data / rel).parents if data in p.parents)}
        stale: list[Path] = []
        candidates: list[tuple[str, Path, os.stat_result]] = []
        for path, info in _tree(mirror):
            if stat.S_ISDIR(info.st_mode):
                if path not in wanted_dirs or info.st_uid != os.geteuid():
                    stale.append(path)
                elif stat.S_IMODE(info.st_mode) != 0o700:
                    _chmod_dir(path)
                continue
            if path.parent == mirror and path.name in (_STATE, _RESERVED) and stat.S_ISREG(info.st_mode):
                if stat.S_IMODE(info.st_mode) != 0o600:
                    os.chmod(path, 0o600)
                continue  # rewritten (never through a link) before they are read again
            rel = path.relative_to(data).as_posix() if data in path.parents else None
            want = ckpt.objects.get(rel) if rel is not None else None
            if rel is None or want is None or not _own_file(info) or info.st_size != want.size:
                stale.append(path)  # a link, a hard link, no object, an upload without a marker: fetched anew
            else:
                candidates.append((rel, path, info))
        with ThreadPoolExecutor(workers) as pool:
            hashes = list(pool.map(lambda c: _cached_sha256(c[1], c[2]), candidates))
        fresh = set()
        for (rel, path, info), got in zip(candidates, hashes, strict=True):
            want = ckpt.objects[rel]
            if want is not None and got == want.sha256:
                fresh.add(rel)
                if stat.S_IMODE(info.st_mode) != 0o600:  # a copy an earlier version made 0644
                    os.chmod(path, 0o600)
            else:
                stale.append(path)
        return [rel for rel in ckpt.sizes if rel not in fresh], stale

    todo, stale = plan()
    if not todo and not stale:
        os.utime(mirror)
        return data
    pin.exclusive()  # other readers of this mirror finish first
    todo, stale = plan()
    start_phase(progress, len(todo), f"fetching {url}")
    needed = sum(ckpt.sizes.values())
    with _cache_lock(root):
        used = _make_room(root, mirror, needed, limit)
        if used + needed > limit:
            raise CacheFullError(
                f"{url}: its {needed} bytes do not fit beside the {used} bytes other processes are "
                f"reading in the local cache ({limit} bytes); retry once they are done, or raise "
                "RBTOOL_CACHE_BYTES"
            )
        for path in stale:
            _discard(path)
        _private_dir(mirror)
        _private_dir(data)
        _write_private(mirror / _RESERVED, str(needed).encode())

    def get(rel: str) -> None:
        _fetch(ckpt, rel, data / rel)
        if progress is not None:
            progress(1)

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(get, todo))
    files = {rel: d.sha256 for rel, d in ckpt.objects.items() if d is not None}
    _write_private(mirror / _STATE, json.dumps({"url": url, "files": files}).encode())
    os.utime(mirror)
    pin.share()
    return data


class StreamMirror:
    """An IndexMirror whose objects are fetched in batches ahead of a pass and released after it.

    For the passes that read each file once (verify --deep, stats' data pass, convert) over
    a checkpoint larger than the cache: `rbtool.passes.pool.run_pass` calls `fetch` for the files
    of the next tasks while their bytes fit `budget` (the cache bound less what the rest of
    the cache holds), and `release` for a task's files once it is done, which puts the
    sparse stand-in back. At most `budget` bytes of objects are here at any time.
    """

    def __init__(self, mirror: IndexMirror, budget: int, jobs: int | None = None) -> None:
        self.mirror = mirror
        self.budget = budget
        self.jobs = jobs
        self.held = 0  # bytes of fetched objects not yet released
        self.peak = 0  # the most bytes held at once
        self.fetched = 0
        self.fetched_bytes = 0
        self._here: set[str] = set()

    @property
    def path(self) -> Path:
        return self.mirror.path

    def _rel(self, path: Path) -> str | None:
        """The object name of `path`, or None if it is not one of the mirror's streamed objects."""
        try:
            rel = Path(path).relative_to(self.path).as_posix()
        except ValueError:
            return None
        if rel not in self.mirror.checkpoint.sizes or rel.rsplit("/", 1)[-1] in _JSON_OBJECTS:
            return None
        return rel

    def served(self, paths: Sequence[Path]) -> list[str]:
        """The objects among `paths` this mirror fetches and releases (others are read as they are)."""
        return sorted({rel for p in paths if (rel := self._rel(p)) is not None})

    def size(self, rels: Sequence[str]) -> int:
        return sum(self.mirror.checkpoint.sizes[rel] for rel in rels if rel not in self._here)

    def too_big(self, rels: Sequence[str]) -> RbtoolError:
        """The error for a task whose files alone do not fit the budget."""
        url = self.mirror.checkpoint.remote.url
        return CheckpointError(
            f"{url}/{rels[0]}: {self.size(rels)} bytes do not fit the {self.budget} bytes of the local "
            "cache that are free (RBTOOL_CACHE_BYTES, less what other readers hold); raise RBTOOL_CACHE_BYTES"
        )

    def fetch(self, rels: Sequence[str]) -> None:
        """Fetch the objects `rels` (in parallel, each verified against its record)."""
        todo = sorted({rel for rel in rels if rel not in self._here})
        if not todo:
            return
        need = self.size(todo)

        def get(rel: str) -> None:
            _fetch(self.mirror.checkpoint, rel, self.path / rel)

        self.held += need
        self.peak = max(self.peak, self.held)
        with ThreadPoolExecutor(min(len(todo), _workers(self.jobs))) as pool:
            list(pool.map(get, todo))
        self._here.update(todo)
        self.fetched += len(todo)
        self.fetched_bytes += need

    def release(self, rels: Sequence[str]) -> None:
        """Put the stand-ins of `rels` back (a new file: an output may hard-link the fetched one)."""
        for rel in rels:
            if rel not in self._here:
                continue
            dst = self.path / rel
            tmp = dst.with_name(f".{dst.name}.standin-{os.getpid()}")
            _standin(tmp, self.mirror.checkpoint.sizes[rel])
            os.replace(tmp, dst)
            self._here.discard(rel)
            self.held -= self.mirror.checkpoint.sizes[rel]


def fits_cache(url: str, options: dict[str, Any] | None = None) -> bool:
    """True if every object at `url` fits the cache bound (a data mirror is possible)."""
    return sum(inspect(url, options).sizes.values()) <= cache_bytes()


@contextmanager
def stream_mirror(url: str, options: dict[str, Any] | None = None) -> Iterator[StreamMirror]:
    """A StreamMirror of `url`: the index mirror, pinned while it is read, and a budget in the cache.

    Mirrors of other URLs that no process reads are removed (least recently used first) as
    far as they are in the way. The pass reserves half the room that is free (at least its
    largest object; the rest is left for another reader), recorded in the entry so that
    other processes count it.
    """
    root = cache_root()
    limit = cache_bytes()
    with index_mirror(url, options) as mirror:
        entry = mirror.path.parent  # a scratch directory of this process: never evicted
        sizes = mirror.checkpoint.sizes
        objects = [size for rel, size in sizes.items() if rel.rsplit("/", 1)[-1] not in _JSON_OBJECTS]
        largest = max(objects, default=0)
        with _cache_lock(root):
            others = _make_room(root, entry, min(sum(objects), limit), limit)
            here = _allocated(entry)  # the JSON objects
            free = max(0, limit - others - here) // _local_ranks()
            # half the free room (at least the largest object), so that another reader can stream too
            budget = min(free, max(largest, free // 2), sum(objects))
            _write_private(entry / _RESERVED, str(budget + here).encode())
        yield StreamMirror(mirror, budget)


def _local_ranks() -> int:
    """The torchrun ranks on this node (1 without torchrun): they share the cache, and its room."""
    from rbtool.passes.ranks import from_env

    world = from_env()
    return world.local_size if world is not None else 1
