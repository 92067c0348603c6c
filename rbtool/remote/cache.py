"""The local cache of remote checkpoints ($RBTOOL_CACHE_DIR, at most $RBTOOL_CACHE_BYTES bytes).

It is the user's own: the cache directory and its ancestors are checked before it is used, its
directories and files are made private and never written or followed through a link. An entry
is locked (`Pin`) while a process reads it; the least recently used mirrors no process reads are
evicted to stay under the bound.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from rbtool.errors import FileSystemError, UntrustedCacheError, UsageError
from rbtool.files.fsutil import make_private_dirs

DEFAULT_CACHE_BYTES = 20 << 30


def cache_root() -> Path:
    """Where mirrors and staging directories live: $RBTOOL_CACHE_DIR, else ~/.cache/rbtool/remote.

    The cache is the user's own (docs/format.md, "The local cache"): its missing directories
    are made 0700, and a cache directory that is a symbolic link, that another user owns, or
    that group or others can write is refused, as is an ancestor through which another user
    could swap it. With $RBTOOL_CACHE_SHARED=1 the directory may be shared (sticky, or a
    setgid group directory); this user's entries then live in its private `user-<uid>`.
    """
    configured = os.environ.get("RBTOOL_CACHE_DIR")
    base = Path(os.path.abspath(configured)) if configured else Path.home() / ".cache" / "rbtool" / "remote"
    shared = cache_shared()
    _check_ancestors(base, shared)
    _make_dirs(base)
    _check_cache_dir(base, shared)
    if not shared:
        return base
    own = base / f"user-{os.geteuid()}"
    _private_dir(own, discard=False)  # another user's entry in its place is refused, never removed
    _check_cache_dir(own, False)
    return own


def cache_shared() -> bool:
    """True if $RBTOOL_CACHE_SHARED says the cache directory is shared by several users on purpose."""
    text = os.environ.get("RBTOOL_CACHE_SHARED", "").strip().lower()
    if text in ("", "0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise UsageError(f"RBTOOL_CACHE_SHARED={text!r}: expected 1 (a shared cache directory) or 0")


_SHARED_FIX = "or, for a cache shared on purpose, make it sticky (chmod +t) and set RBTOOL_CACHE_SHARED=1"


def _dir_problem(info: os.stat_result, shared: bool, *, ancestor: bool) -> str | None:
    """What makes a directory unfit to hold the cache (None: nothing): who owns it, who can write it.

    The cache directory must be the user's and writable by nobody else; an ancestor the
    user's or root's, writable by others only when sticky (they cannot rename what is not
    theirs). Shared, any owner will do, and others may write a sticky directory or, for its
    group only, a setgid one.
    """
    if stat.S_ISLNK(info.st_mode):
        return "a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "not a directory"
    mode = info.st_mode
    sticky, setgid = mode & stat.S_ISVTX, mode & stat.S_ISGID
    group_w, other_w = mode & 0o020, mode & 0o002
    if shared:
        if other_w and not sticky:
            return "writable by others and not sticky"
        if group_w and not (sticky or setgid):
            return "writable by its group and neither sticky nor setgid"
        return None
    if info.st_uid != os.geteuid() and (not ancestor or info.st_uid != 0):
        return f"owned by uid {info.st_uid}"
    if ancestor and sticky:
        return None
    if other_w:
        return "writable by others"
    if group_w:
        return "writable by its group"
    return None


def _check_ancestors(base: Path, shared: bool) -> None:
    """Refuse a cache whose existing ancestors another user could rename or replace it through.

    Each one is checked as it is named (a symbolic link must be the user's or root's) and
    as it resolves.
    """
    real = Path(os.path.realpath(base.parent))
    for chain in (reversed(base.parents), reversed((real, *real.parents))):
        for path in chain:
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                break  # this one and those below it are made, the user's own
            except OSError as exc:
                raise UntrustedCacheError(
                    f"{path}: cannot check this ancestor of the rbtool cache ({exc.strerror})"
                ) from None
            if stat.S_ISLNK(info.st_mode):
                if info.st_uid not in (0, os.geteuid()):
                    raise UntrustedCacheError(
                        f"{path}: an ancestor of the rbtool cache {base} is a symbolic link owned by uid "
                        f"{info.st_uid}; set RBTOOL_CACHE_DIR to a directory of your own"
                    )
                continue  # where it leads is checked as the real path
            problem = _dir_problem(info, shared, ancestor=True)
            if problem is not None:
                raise UntrustedCacheError(
                    f"{path}: an ancestor of the rbtool cache {base} is {problem}, so another user could "
                    "swap the cache; set RBTOOL_CACHE_DIR to a directory of your own"
                )


def _check_cache_dir(path: Path, shared: bool) -> None:
    """Refuse a cache directory that is a symbolic link, or another user's, or that others can write."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise UntrustedCacheError(f"{path}: cannot check the rbtool cache ({exc.strerror})") from None
    problem = _dir_problem(info, shared, ancestor=False)
    if problem is None:
        return
    if problem == "a symbolic link":
        fix = "set RBTOOL_CACHE_DIR to a real directory of your own (links are never followed)"
    elif problem.startswith("owned by"):
        fix = f"set RBTOOL_CACHE_DIR to a directory of your own (uid {os.geteuid()}), {_SHARED_FIX}"
    elif problem == "not a directory":
        fix = "set RBTOOL_CACHE_DIR to a directory"
    elif shared:
        fix = f"chmod +t {path} (or a setgid group directory: chmod g+s,o-w)"
    else:
        fix = f"chmod go-w {path} (or chmod 700), {_SHARED_FIX}"
    raise UntrustedCacheError(f"{path}: the rbtool cache directory is {problem}; {fix}")


def _make_dirs(path: Path) -> None:
    """Make the missing directories of `path`, each 0700 whatever the umask."""
    try:
        made = make_private_dirs(path)
    except OSError as exc:
        raise FileSystemError(
            f"{exc.filename}: cannot make the rbtool cache directory ({exc.strerror})"
        ) from None
    for p in made:
        _chmod_dir(p)


def _chmod_dir(path: Path, mode: int = 0o700) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _private_dir(path: Path, *, discard: bool = True) -> Path:
    """`path` as a directory of the cache: the user's, 0700, made if missing.

    What stands in its place and is no directory (a symbolic link, a file) is removed, never
    followed (with `discard` False it is refused); a directory of another user is refused.
    """
    for _ in range(5):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise FileSystemError(f"{path}: cannot make this cache directory ({exc.strerror})") from None
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue  # removed meanwhile (evicted): make it again
        if stat.S_ISDIR(info.st_mode):
            break
        if not discard:
            raise UntrustedCacheError(
                f"{path}: in the rbtool cache, but a symbolic link or a file, not this user's directory; "
                "remove it (it is never followed)"
            )
        _discard(path)
    else:
        raise UntrustedCacheError(f"{path}: cannot make this directory of the rbtool cache")
    if info.st_uid != os.geteuid():
        raise UntrustedCacheError(
            f"{path}: in the rbtool cache, but owned by uid {info.st_uid}; remove it, or set "
            "RBTOOL_CACHE_DIR to a directory of your own"
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        _chmod_dir(path)
    return path


def _discard(path: Path) -> None:
    """Remove a cache entry without following a symbolic link: a link or a file is unlinked, a
    directory removed with what it holds (links inside it are removed, not followed)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(path, ignore_errors=True)  # fd-based on Linux: never leaves the tree
    else:
        with suppress(FileNotFoundError):
            os.unlink(path)


def _create_private(path: Path) -> int:
    """A new file at `path`, 0600 whatever the umask, opened for writing; something at `path` is
    replaced (a link is unlinked, not followed)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        _discard(path)
        fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def _write_private(path: Path, data: bytes) -> None:
    """Write a small file of the cache whole: a new 0600 file renamed over `path` (never written
    through a link that stands there)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    fd = _create_private(tmp)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _read_private(path: Path, limit: int) -> bytes | None:
    """The bytes of a regular file of the cache (at most `limit`), or None: missing, a link, not a file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, limit)
    finally:
        os.close(fd)


@contextmanager
def _scratch(name: str) -> Iterator[Path]:
    """A fresh directory in the cache (0700), removed afterwards; those killed runs left are removed first."""
    from rbtool.files.fsutil import new_staging_dir

    path = new_staging_dir(cache_root() / name)
    try:
        _chmod_dir(path)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def cache_bytes() -> int:
    """The most bytes the cache holds: $RBTOOL_CACHE_BYTES (default 20 GiB)."""
    from rbtool.format.bounded import env_bytes

    return env_bytes("RBTOOL_CACHE_BYTES", DEFAULT_CACHE_BYTES)


_RESERVED = ".rbtool-reserved"  # in a cache entry: the bytes it may grow to


def _held(entry: Path) -> int:
    """What a cache entry counts for: its allocated bytes, or the room it reserved if that is more."""
    try:
        reserved = int(_read_private(entry / _RESERVED, 64) or b"0")
    except ValueError:
        reserved = 0
    return max(reserved, _allocated(entry))


def _entries(root: Path) -> list[tuple[Path, os.stat_result]]:
    """The directories directly in the cache (links and files among them are never followed)."""
    return [(path, info) for path, info in _scan(root) if stat.S_ISDIR(info.st_mode)]


def _make_room(root: Path, keep: Path, needed: int, limit: int) -> int:
    """Remove least recently used mirrors (never `keep`) until `keep` can hold `needed` bytes under `limit`.

    Everything else in the cache counts (mirrors, other readers' streamed objects and
    reservations, staging directories); a mirror another process reads (holds its lock,
    `Pin`) is not removed. Returns the bytes the rest of the cache holds afterwards. Callers
    hold the cache lock (`_cache_lock`) until they have reserved what they take. Entries are
    looked at without following links: a link in the cache counts nothing and leads nowhere.
    """
    entries = [(p, info) for p, info in _entries(root) if p != keep and p.name != ".locks"]
    mirrors = [(p, info) for p, info in entries if p.name.startswith("mirror-")]
    used = sum(_held(p) for p, _ in entries)
    for old, _ in sorted(mirrors, key=lambda item: item[1].st_mtime):
        if used + needed <= limit:
            break
        size = _held(old)
        if _try_evict(old):
            used -= size
    return used


@contextmanager
def _cache_lock(root: Path) -> Iterator[None]:
    """The cache-wide lock under which a process measures the room and reserves its share."""
    pin = Pin(root / ".cache")
    try:
        pin.exclusive()
        yield
    finally:
        pin.close()


def _own_file(info: os.stat_result) -> bool:
    """A regular file of the user's with no other name (no link to elsewhere, no file an output shares)."""
    return stat.S_ISREG(info.st_mode) and info.st_nlink == 1 and info.st_uid == os.geteuid()


def _scan(directory: Path) -> Iterator[tuple[Path, os.stat_result]]:
    """The entries directly in `directory`, each with its lstat (a link is never followed); what
    cannot be read (removed meanwhile) is left out."""
    try:
        scan = list(os.scandir(directory))
    except OSError:
        return
    for item in scan:
        try:
            info = item.stat(follow_symlinks=False)
        except OSError:
            continue
        yield Path(item.path), info


def _tree(top: Path) -> Iterator[tuple[Path, os.stat_result]]:
    """Every entry below the directory `top`, with its lstat; a link or a file is never descended into."""
    pending = [top]
    while pending:
        for path, info in _scan(pending.pop()):
            yield path, info
            if stat.S_ISDIR(info.st_mode):
                pending.append(path)


def _lock_path(entry: Path) -> Path:
    """The lock file of a cache entry, in the cache's `.locks` directory (never removed: a removed
    lock file could be locked by one process while another creates a new one under the same name)."""
    return _private_dir(entry.parent / ".locks") / entry.name


def _open_lock(entry: Path) -> int:
    """Open (make, 0600) the lock file of a cache entry, never through a link.

    Something in its place that is not a lock file rbtool made (a symbolic link, a hard link,
    a FIFO, another user's file) is removed and a lock file made instead.
    """
    path = _lock_path(entry)
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    for _ in range(5):
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            info = None
        if info is not None and not _own_file(info):
            _discard(path)
            continue
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a link appeared meanwhile
                continue
            raise FileSystemError(f"{path}: cannot open this rbtool cache lock ({exc.strerror})") from None
        info = os.fstat(fd)
        if _own_file(info):
            if stat.S_IMODE(info.st_mode) != 0o600:
                os.fchmod(fd, 0o600)
            return fd
        os.close(fd)
    raise UntrustedCacheError(f"{path}: not a lock file of the rbtool cache and it comes back; remove it")


class Pin:
    """The lock of a cache entry: held shared while a process reads the entry, exclusive to change it.

    An flock on the entry's file in the cache's `.locks` directory. Eviction
    (`_make_room`) removes an entry only under its exclusive lock, taken without waiting, so
    an entry another process reads is skipped. Closing the pin releases the lock.
    """

    def __init__(self, entry: Path) -> None:
        self.fd = _open_lock(entry)

    def share(self) -> None:
        import fcntl

        fcntl.flock(self.fd, fcntl.LOCK_SH)

    def exclusive(self) -> None:
        import fcntl

        fcntl.flock(self.fd, fcntl.LOCK_UN)  # a shared lock is let go first: two upgraders would deadlock
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _try_evict(entry: Path) -> bool:
    """Remove `entry` if no other process holds its lock; False (and nothing removed) if one does."""
    import fcntl

    fd = _open_lock(entry)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        _discard(entry)  # a link is unlinked, never followed; a directory removed without leaving it
        return True
    finally:
        os.close(fd)


def _allocated(path: Path) -> int:
    """Bytes the files under `path` take on disk (a sparse stand-in takes none).

    Other processes add and remove files meanwhile: what vanishes while it is walked counts nothing.
    """
    if not os.path.isdir(path) or os.path.islink(path):
        return 0  # a link in the cache leads nowhere
    return sum(
        min(info.st_size, info.st_blocks * 512)
        for _, info in _tree(path)
        if not stat.S_ISDIR(info.st_mode) and not stat.S_ISLNK(info.st_mode)
    )
