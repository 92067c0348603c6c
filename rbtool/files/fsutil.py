"""File-system primitives: atomic writes, reflinks and hard links, staged directories, directory locks.

Everything rbtool publishes appears whole or not at all: files are written under a hidden
temporary name, fsynced and renamed; directories are built in a hidden staging directory
beside the target and renamed into place.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

from rbtool.errors import (
    CheckpointError,
    DirectoryInUseError,
    FileSystemError,
    LeftoversRemovedWarning,
    OutputExistsError,
    RbtoolError,
)
from rbtool.format.ranknames import is_rank_name

LOCK_FILE = ".rbtool.lock"
STAGING_MARK = ".rbtool-staging-"


def os_error(exc: OSError, path: str | os.PathLike[str]) -> FileSystemError:
    """An OSError as one line naming the path and the reason (what every writer raises)."""
    where = exc.filename if exc.filename is not None else path
    if exc.filename is not None and _work_name_of(str(exc.filename), path):
        where = path  # the output the user gave, not the hidden name it is built under
    reason = exc.strerror or str(exc) or type(exc).__name__
    extra = ""
    if exc.errno == errno.ENOSPC:
        extra = "; nothing was published and the inputs are unchanged"
    elif exc.errno == errno.EROFS:
        extra = "; choose a writable location"
    return FileSystemError(f"{where}: {reason}{extra}")


def _work_name_of(name: str, target: str | os.PathLike[str]) -> bool:
    """True if `name` is a hidden staging directory or temporary file beside `target`."""
    work, own = Path(name), Path(target)
    hidden = work.name.startswith(f".{own.name}.")
    beside = os.path.abspath(work.parent) == os.path.abspath(own.parent)
    return beside and hidden and (STAGING_MARK in work.name or work.name.endswith(".tmp"))


@contextlib.contextmanager
def fs_errors(path: str | os.PathLike[str]) -> Iterator[None]:
    """Turn an OSError raised in the block into a FileSystemError naming `path`."""
    try:
        yield
    except RbtoolError:
        raise
    except OSError as exc:
        raise os_error(exc, path) from None


def fsync_dir(directory: Path) -> None:
    """Make renames and new files in `directory` durable (best effort)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unlink_quietly(path: str | Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def current_umask() -> int:
    """The process's umask, read without changing it (os.umask can only set it)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def write_bytes_atomic(path: Path, data: bytes, *, sync_dir: bool = True) -> None:
    """Write `data` to a hidden temporary file beside `path`, fsync it, then rename it over.

    The file gets the mode a plain open() would give it (0666 less the umask): mkstemp's
    0600 would keep teammates and jobs under another uid from reading a checkpoint.
    """
    with fs_errors(path):
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            os.fchmod(fd, 0o666 & ~current_umask())
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            _unlink_quietly(tmp)
            raise
    if sync_dir:
        fsync_dir(path.parent)


Placement = Literal["reflink", "link", "copy"]

# Linux's FICLONE ioctl (linux/fs.h, _IOW(0x94, 9, int)): a copy-on-write clone of a whole file.
FICLONE = 0x40049409

# Errors by which a clone says that this pair of file systems cannot clone at all (ext4 and
# tmpfs: EOPNOTSUPP; two file systems: EXDEV): the next file between them is not tried.
# Any other failure (EINVAL for one file's layout, ENOSPC, ...) falls back for that file only.
_CLONE_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOTTY, errno.ENOSYS, errno.EXDEV}
# The pairs known to refuse: (st_dev of the source, st_dev of the destination's directory), and
# (source's directory, destination's directory) as named, so that a file between two known
# directories costs no stat to be passed over.
_no_clone: set[tuple[int, int] | tuple[str, str]] = set()


def link_or_copy(src: Path, dst: Path, *, link: bool = True) -> Placement:
    """Place `src` at `dst`: a reflink where the file system can, else a hard link, else a copy.

    A reflink (copy-on-write clone) and a copy are files of their own; a hard link shares
    its bytes with `src`. With `link` False no hard link is made (a reflink still may be).
    Returns which of the three happened. Either way `dst` appears whole (temporary name,
    then rename).
    """
    with fs_errors(dst):
        return _link_or_copy(src, dst, link=link)


def _temporary_beside(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.{os.urandom(6).hex()}.tmp"


def _directories(src: Path, dst: Path) -> tuple[str, str]:
    return os.path.dirname(src), os.path.dirname(dst)


def _clone(src: Path, tmp: Path) -> bool:
    """Make `tmp` a copy-on-write clone of `src`; False (and no `tmp`) where that is impossible."""
    if sys.platform != "linux" or _directories(src, tmp) in _no_clone:
        return False
    key = (os.stat(src).st_dev, os.stat(tmp.parent).st_dev)
    if key in _no_clone:
        _no_clone.add(_directories(src, tmp))
        return False
    src_fd = os.open(src, os.O_RDONLY)
    try:
        dst_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # 0666 less the umask
        try:
            try:
                fcntl.ioctl(dst_fd, FICLONE, src_fd)
            except OSError as exc:
                if exc.errno in _CLONE_UNSUPPORTED:
                    _no_clone.update((key, _directories(src, tmp)))
                _unlink_quietly(tmp)
                return False  # whatever the reason, a hard link or a copy may still work
            os.fsync(dst_fd)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)
    return True


def _copy(src: Path, tmp: Path) -> None:
    try:
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
            fout.flush()
            os.fsync(fout.fileno())
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _link_or_copy(src: Path, dst: Path, *, link: bool = True) -> Placement:
    if link and _directories(src, dst) in _no_clone:
        # no reflink between these directories: a hard link, which appears whole at once (no
        # temporary name, no rename: at a million small files these are a third of the time)
        try:
            os.link(_link_source(src), dst)
            return "link"
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                raise
            # something at `dst` already, or no hard link possible here: as below
    if link and dst.exists() and os.path.samefile(src, dst):
        return "link"  # placed already
    tmp = _temporary_beside(dst)
    how: Placement
    if _clone(src, tmp):
        how = "reflink"
    else:
        how = "copy"
        if link:
            try:
                os.link(_link_source(src), tmp)
                how = "link"
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    raise
        if how == "copy":
            _copy(src, tmp)
    try:
        os.replace(tmp, dst)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return how


def _link_source(src: Path) -> str | Path:
    """What to hard-link for `src`: link(2) links a symlink itself, not its target, and a listed
    file that is a relative link within its checkpoint would dangle in the new directory."""
    return os.path.realpath(src) if os.path.islink(src) else src


def _owner_tag() -> str:
    """Who makes a staging directory: pid@host, so that the next run can tell if it died."""
    return f"{os.getpid()}@{socket.gethostname()}"


_LEFTOVER = re.compile(r"\.rbtool-(?:staging|old)-(\d+)@(.+)-[0-9a-f]{12}$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process, or not ours to signal: alive
        return True
    return True


def remove_dead_leftovers(parent: Path) -> list[str]:
    """Remove the staging and swapped-out directories in `parent` whose process has died.

    Only this host's runs are judged (a pid means nothing on another node of a shared file
    system); live runs and other hosts' runs are left alone. Returns the names removed.
    """
    host = socket.gethostname()
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return []
    for entry in entries:
        found = _LEFTOVER.search(entry.name)
        if found is None or found.group(2) != host or _alive(int(found.group(1))):
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.name)
    return removed


def make_private_dirs(path: Path) -> list[Path]:
    """Make `path` and its missing parents, each 0700 (this user's alone), and return the ones
    made, top first. One that appears meanwhile (another process made it) is not in the list:
    the caller checks it like any directory that was there."""
    missing = []
    for part in (path, *path.parents):
        if os.path.lexists(part):
            break
        missing.append(part)
    made = []
    for part in reversed(missing):
        try:
            os.mkdir(part, 0o700)
        except FileExistsError:
            continue
        made.append(part)
    return made


def make_parents(target: Path) -> None:
    """Create the missing parents of `target` (every writer's rule); a parent that is a file is refused.

    The refusal names the file, so no writer reports mkdir's bare "File exists" for it.
    """
    refuse_file_parent(target)
    with fs_errors(target.parent):
        target.parent.mkdir(parents=True, exist_ok=True)


def refuse_file_parent(target: Path) -> None:
    """Refuse a `target` one of whose existing parents is a file (nothing can be made inside it)."""
    for parent in (target.parent, *target.parent.parents):
        if parent.exists() and not parent.is_dir():
            raise FileSystemError(
                f"{parent}: not a directory (a file), so {target} cannot be made in it; choose another path"
            )
        if parent.exists():
            break


def check_file_target(target: Path, *, overwrite: bool) -> None:
    """The writers' rule for an output file: an existing one only with `overwrite`, and only a file."""
    refuse_file_parent(target)
    if target.is_dir():
        raise FileSystemError(f"{target}: is a directory; give a file name")
    if target.exists() or target.is_symlink():
        if not overwrite:
            raise OutputExistsError(f"{target}: already exists")
        if not target.is_file():
            raise FileSystemError(f"{target}: exists and is not a regular file; refusing to replace it")


def new_staging_dir(target: Path) -> Path:
    """A fresh hidden directory beside `target`, on the same file system, for building it.

    What interrupted runs left beside it is removed first, with a warning naming it.
    """
    with fs_errors(target):
        make_parents(target)
        removed = remove_dead_leftovers(target.parent)
        if removed:
            shown = ", ".join(removed[:5]) + (", ..." if len(removed) > 5 else "")
            what = "directory" if len(removed) == 1 else "directories"
            message = f"{target.parent}: removed {len(removed)} staging {what} that interrupted runs left"
            warnings.warn(LeftoversRemovedWarning(f"{message} ({shown})"), stacklevel=3)
        staging = target.parent / f".{target.name}{STAGING_MARK}{_owner_tag()}-{uuid.uuid4().hex[:12]}"
        staging.mkdir()
    return staging


_CHECKPOINT_FILES = {"metadata.json", "trajectory_index.json", "trajector_index.json"}


def _may_replace(target: Path) -> bool:
    """Replace only an empty directory, a checkpoint, or a folder of rank_<n> checkpoints (a shard)."""
    if not target.is_dir():
        return False
    children = list(target.iterdir())
    names = {p.name for p in children}
    if not names or names & _CHECKPOINT_FILES:
        return True
    return all(
        p.is_dir() and is_rank_name(p.name) and bool({c.name for c in p.iterdir()} & _CHECKPOINT_FILES)
        for p in children
    )


def publish_dir(staging: Path, target: Path, *, overwrite: bool) -> None:
    """Rename a finished staging directory to `target`, atomically.

    With `overwrite`, an existing empty or checkpoint directory is swapped out and removed;
    otherwise an existing target is an error (and the staging directory is removed).
    """
    with fs_errors(target):
        _publish_dir(staging, target, overwrite=overwrite)


def _hold_locks(directories: list[Path]) -> list[DirLock]:
    """Take every directory's lock without waiting, or refuse naming the one that is held."""
    held: list[DirLock] = []
    try:
        for directory in directories:
            lock = DirLock(directory, wait=False, create=False)  # no lock file: nobody holds it
            lock.acquire()
            held.append(lock)
    except BaseException:
        for lock in held:
            lock.release()
        raise
    return held


def _publish_dir(staging: Path, target: Path, *, overwrite: bool) -> None:
    fsync_dir(staging)
    if target.exists() or target.is_symlink():
        if not overwrite:
            shutil.rmtree(staging, ignore_errors=True)
            raise OutputExistsError(f"{target}: already exists")
        if not _may_replace(target):
            shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointError(
                f"{target}: exists and is not a checkpoint directory; refusing to replace it"
            )
        # A directory (or a rank of it) that a live buffer or another rbtool process holds
        # is never replaced: its writer would go on writing into a deleted directory.
        locks = _hold_locks([target, *[p for p in target.iterdir() if p.is_dir() and is_rank_name(p.name)]])
        try:
            old = target.parent / f".{target.name}.rbtool-old-{_owner_tag()}-{uuid.uuid4().hex[:12]}"
            os.rename(target, old)
            os.rename(staging, target)
            fsync_dir(target.parent)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            for lock in locks:
                lock.release()
        return
    os.rename(staging, target)
    fsync_dir(target.parent)


def check_target(target: Path, *, overwrite: bool) -> None:
    """Refuse, without creating anything, what publishing `target` would refuse (a dry run's check).

    The same rules as `new_staging_dir` and `publish_dir`: a parent that is a file, an existing
    target without `overwrite`, and with it a target that is not a checkpoint, an empty
    directory or a folder of rank_* checkpoints.
    """
    refuse_file_parent(target)
    with fs_errors(target):
        if target.exists() or target.is_symlink():
            if not overwrite:
                raise OutputExistsError(f"{target}: already exists")
            if not _may_replace(target):
                raise CheckpointError(
                    f"{target}: exists and is not a checkpoint directory; refusing to replace it"
                )


@contextlib.contextmanager
def staged_dir(target: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Build a directory in a hidden staging directory; publish it only if the block succeeds.

    A file-system error names `target` (and paths inside it), never the staging directory.
    """
    try:
        with _staged_dir(target, overwrite=overwrite) as staging:
            yield staging
    except FileSystemError as exc:
        raise FileSystemError(as_target(str(exc), target)) from None
    except OSError as exc:
        if isinstance(exc, RbtoolError):
            raise
        raise FileSystemError(as_target(str(os_error(exc, target)), target)) from None


@contextlib.contextmanager
def _staged_dir(target: Path, *, overwrite: bool = False) -> Iterator[Path]:
    staging: Path | None = None
    try:
        staging = new_staging_dir(target)
        yield staging
        publish_dir(staging, target, overwrite=overwrite)
    except BaseException:
        if staging is None:  # Ctrl-C between making it and getting its name: find it by owner
            mine = f".{target.name}{STAGING_MARK}{_owner_tag()}-"
            with contextlib.suppress(OSError):
                for entry in os.scandir(target.parent):
                    if entry.name.startswith(mine):
                        shutil.rmtree(entry.path, ignore_errors=True)
        else:
            shutil.rmtree(staging, ignore_errors=True)  # gone once published
        raise


def as_target(message: str, target: Path) -> str:
    """`message` with every path into `target`'s staging directories shown as `target`'s own path."""
    staging = re.escape(str(target.parent / f".{target.name}{STAGING_MARK}")) + r"[^/\s:]*"
    return re.sub(staging, lambda _: str(target), message)


def _share_with_group(fd: int, directory: Path) -> None:
    """Give a file just made in `directory` the mode a plain open() gives (0666 less the umask),
    plus group write and the directory's group when the directory is group-writable and the
    umask lets the group read (a umask of 077 keeps everything, this file too, private)."""
    mode = 0o666 & ~current_umask()
    try:
        info = os.stat(directory)
    except OSError:
        info = None
    if info is not None and info.st_mode & stat.S_IWGRP and mode & stat.S_IRGRP:
        mode |= stat.S_IRGRP | stat.S_IWGRP
        with contextlib.suppress(OSError):  # a setgid directory gave it its group already
            if os.fstat(fd).st_gid != info.st_gid:
                os.fchown(fd, -1, info.st_gid)
    os.fchmod(fd, mode)


class DirLock:
    """An exclusive advisory lock on a buffer directory (fcntl.flock on `.rbtool.lock`).

    `on_wait` is called once, with the lock file's recorded holder, if the lock is busy.
    """

    def __init__(
        self,
        directory: Path,
        *,
        wait: bool = True,
        on_wait: Callable[[str], None] | None = None,
        create: bool = True,
    ):
        self.path = directory / LOCK_FILE
        self.wait = wait
        self.on_wait = on_wait
        self.create = create  # False: a directory without a lock file is not held by anyone
        self._fd: int | None = None

    def acquire(self) -> None:
        with fs_errors(self.path):
            self._acquire()

    def _open(self) -> tuple[int, bool]:
        """The lock file's descriptor (made if `create` and missing), and whether it can be written.

        A lock file made here gets the mode of the directory's other files (0666 less the
        umask) and, in a group-writable directory (a shared buffer, mode 2775), is group
        writable too, with the directory's group, so that another member of the group
        can take it. One it cannot open for writing (made by an older rbtool, 0644) is still
        locked through a read-only descriptor: flock needs no write access.
        """
        if self.create:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                pass
            else:
                _share_with_group(fd, self.path.parent)
                return fd, True
        try:
            return os.open(self.path, os.O_RDWR), True
        except PermissionError:
            return os.open(self.path, os.O_RDONLY), False

    def _acquire(self) -> None:
        try:
            fd, writable = self._open()
        except FileNotFoundError:
            if self.create:
                raise
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = ""
            with contextlib.suppress(OSError):
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            if not self.wait:
                os.close(fd)
                raise DirectoryInUseError(
                    f"{self.path.parent}: in use by another rbtool process ({holder or 'unknown'})"
                ) from None
            if self.on_wait is not None:
                self.on_wait(holder or "another process")
            fcntl.flock(fd, fcntl.LOCK_EX)
        if writable:  # who holds it, for whoever waits
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def file_size(path: Path) -> int:
    """`path`'s size in bytes, 0 when it cannot be read (a pass weighs its files by it)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0
