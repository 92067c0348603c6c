"""Checkpoints in object storage: fsspec URLs (s3://, gs://, memory:// ...) wherever a directory is taken.

Object stores have no atomic rename, so a remote checkpoint is published by an upload
protocol (docs/format.md, "Checkpoints in object storage"): the checkpoint is built in a
local staging directory, then its trajectory objects are uploaded, then the index and
metadata objects, then a completion marker object last, which records the size and sha256
of every object. A pending note written first tells readers that an upload is under way
or was killed; they refuse such a checkpoint until a rerun completes it.

Readers work on local mirrors: `index_mirror` holds the JSON objects and, for every other
object, a sparse stand-in of its recorded size (what the quick checks read: names and
sizes); `data_mirror` copies every object into a bounded local cache, verified against the
marker. fsspec (and s3fs for s3://) is imported only when a URL is used: local paths never
load it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rbtool.errors import (
    CacheFullError,
    CheckpointError,
    FileSystemError,
    OutputExistsError,
    RbtoolError,
    UnsafeKeyError,
    UntrustedCacheError,
    UsageError,
)
from rbtool.format import INDEX_FILE, LEGACY_INDEX_FILE, MERGE_MAP_FILE, METADATA_FILE, one_line
from rbtool.format.ranknames import is_rank_name
from rbtool.progress import Progress

MARKER = "rbtool-upload-complete.json"  # written last: the upload is whole
PENDING = "rbtool-upload-pending.json"  # written first: an upload is under way (or was killed)
MARKER_FORMAT = "rbtool-upload"
# 2: the marker carries `digest` (of every object's name, size and sha256) and each object's
# ETag as the store reported it after the upload; version 1 markers (neither) are still read.
MARKER_VERSION = 2
_MARKER_VERSIONS = (1, 2)
_CONTROL = (MARKER, PENDING)
_JSON_OBJECTS = (METADATA_FILE, INDEX_FILE, LEGACY_INDEX_FILE, MERGE_MAP_FILE)
_CHUNK = 1 << 20
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
DEFAULT_CACHE_BYTES = 20 << 30


# ------------------------------------------------------------------ URLs and options
def is_url(value: str | os.PathLike[str]) -> bool:
    """True for a URL naming object storage (`scheme://...`); file:// URLs and plain paths are local."""
    return isinstance(value, str) and bool(_URL.match(value)) and not value.lower().startswith("file://")


def local_path(value: str | os.PathLike[str]) -> Path:
    """A local path as given; a file:// URL becomes its path."""
    if isinstance(value, str) and value.lower().startswith("file://"):
        from urllib.parse import unquote, urlsplit

        parts = urlsplit(value)
        if parts.netloc not in ("", "localhost"):
            raise UsageError(f"{value}: a file:// URL names this machine (file:///path)")
        return Path(unquote(parts.path))
    return Path(value)


def parse_storage_options(pairs: Sequence[str] | None) -> dict[str, Any]:
    """`key=value` pairs as fsspec storage options: a value that parses as JSON is that value, else a string.

    A dotted key nests (`client_kwargs.region_name=eu-west-1`).
    """
    options: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            shown = "(hidden: it may hold a secret)" if _SECRET_OPTION.search(pair) else repr(pair)
            raise UsageError(f"storage option {shown}: expected key=value")
        try:
            value: Any = json.loads(text)
        except ValueError:
            value = text
        *outer, last = key.strip().split(".")
        place = options
        for part in outer:
            nested = place.setdefault(part, {})
            if not isinstance(nested, dict):
                raise UsageError(f"storage option {pair!r}: {part} is already set to a value")
            place = nested
        place[last] = value
    return options


@dataclass
class Remote:
    """A directory in object storage: the filesystem and the path in it (no trailing slash)."""

    url: str
    fs: Any
    root: str

    def key(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def child(self, name: str) -> Remote:
        return Remote(f"{self.url.rstrip('/')}/{name}", self.fs, self.key(name))


def _workers(jobs: int | None) -> int:
    """How many objects move to or from a store at once: `jobs`, else four per CPU, at most 16."""
    return jobs or min(16, (os.cpu_count() or 1) * 4)


def open_remote(url: str, options: dict[str, Any] | None = None) -> Remote:
    """The fsspec filesystem for `url`, with `options` on top of the environment's configuration."""
    try:
        import fsspec
        from fsspec.core import url_to_fs
    except ImportError:
        raise RbtoolError(f"{url}: URLs need fsspec; install rbtool[s3] (pip install 'rbtool[s3]')") from None
    try:
        cls = fsspec.get_filesystem_class(url.split("://", 1)[0].lower())
    except (ImportError, ValueError) as exc:  # the scheme's fsspec package is missing (s3fs, gcsfs, ...)
        hint = "; install rbtool[s3]" if url.lower().startswith(("s3://", "s3a://")) else ""
        raise RbtoolError(f"{shown_url(url)}: {redact(one_line(str(exc)), options)}{hint}") from None
    _check_options(url, cls, options or {})
    try:
        with store_errors(url, "cannot open", options):
            fs, root = url_to_fs(url, **(options or {}))
    except ImportError as exc:
        raise RbtoolError(f"{shown_url(url)}: {redact(one_line(str(exc)), options)}") from None
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{shown_url(url)}: {redact(one_line(str(exc)), options)}") from None
    return Remote(url.rstrip("/"), fs, str(root).rstrip("/"))


# Options every fsspec filesystem takes (fsspec.spec.AbstractFileSystem and its caching).
_COMMON_OPTIONS = {
    "skip_instance_cache",
    "use_listings_cache",
    "listings_expiry_time",
    "max_paths",
    "asynchronous",
    "loop",
}
_SECRET_OPTION = re.compile(r"secret|token|password|key|credential", re.IGNORECASE)
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")


def _check_options(url: str, cls: type, options: dict[str, Any]) -> None:
    """Refuse a storage option the filesystem of `url` does not take, or a value of the wrong kind
    for an option whose default is a boolean or a number (`anon=maybe`)."""
    import inspect as pyinspect

    known: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            params = pyinspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            continue
        for p in params:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self":
                known[p.name] = p.default
    for key, value in options.items():
        shown = f"{key}=***" if _SECRET_OPTION.search(key) else f"{key}={json.dumps(value)}"
        if key not in known and key not in _COMMON_OPTIONS:
            close = sorted(k for k in known if not k.startswith("_"))
            raise UsageError(
                f"{url}: unknown storage option {shown} for {cls.__name__} (it takes: {', '.join(close)})"
            )
        default = known.get(key)
        if isinstance(default, bool) and not isinstance(value, bool):
            raise UsageError(f"{url}: storage option {shown} takes true or false")
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if type(default) in (int, float) and value is not None and not number:
            raise UsageError(f"{url}: storage option {shown} takes a number")


def _secrets(options: dict[str, Any] | None) -> list[str]:
    """The values of options (nested too) and environment variables that hold secrets."""
    found: list[str] = []

    def walk(place: dict[str, Any]) -> None:
        for key, value in place.items():
            if isinstance(value, dict):
                walk(value)
            elif _SECRET_OPTION.search(str(key)) and value not in (None, True, False, ""):
                found.append(str(value))

    walk(options or {})
    found += [os.environ[name] for name in _SECRET_ENV if os.environ.get(name)]
    return sorted({s for s in found if len(s) >= 3}, key=len, reverse=True)


def redact(text: str, options: dict[str, Any] | None = None) -> str:
    """`text` with every secret (values of key/secret/token/password options and of the AWS
    credentials' environment variables, a URL's user:password@) replaced by ***."""
    for secret in _secrets(options):
        text = text.replace(secret, "***")
    return re.sub(r"(://)[^/@\s]+@", r"\1***@", text)


def shown_url(url: str) -> str:
    """A URL as it is printed: without the password or key a user:password@ part holds."""
    return re.sub(r"(://)[^/@\s]+@", r"\1***@", url)


_NO_CREDENTIALS = (
    "no credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), "
    "or give the storage options key and secret"
)


def _store_reason(exc: BaseException) -> str:
    """What a store error says, in one line."""
    name = type(exc).__name__
    text = one_line(str(exc)) or name
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return _NO_CREDENTIALS + f" ({text})"
    if name in _CONNECT_ERRORS:
        return f"cannot connect to the endpoint ({text}); check endpoint_url or AWS_ENDPOINT_URL"
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on the local disk (the cache: RBTOOL_CACHE_DIR)"
    if isinstance(exc, OSError) and exc.strerror:
        text = one_line(exc.strerror)
    if isinstance(exc, FileNotFoundError) and "bucket" in text.lower():
        return f"{text} (no such bucket)"
    return text


_CONNECT_ERRORS = ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError")
_STORE_MODULES = ("botocore", "aiobotocore", "s3fs", "fsspec", "aiohttp", "gcsfs", "google", "adlfs", "azure")


@contextmanager
def store_errors(url: str, doing: str, options: dict[str, Any] | None = None) -> Iterator[None]:
    """Turn what object storage raises in the block (OSError, botocore's and the HTTP client's
    errors) into one CheckpointError naming `url`, secrets redacted; anything else passes."""
    try:
        yield
    except RbtoolError:
        raise
    except Exception as exc:
        module = type(exc).__module__.split(".")[0]
        if not isinstance(exc, OSError) and module not in _STORE_MODULES:
            raise
        reason = redact(f"{doing} ({_store_reason(exc)})", options)
        raise CheckpointError(f"{shown_url(url)}: {reason}") from None


def _listing(remote: Remote) -> dict[str, dict[str, Any]]:
    """Relative name -> info of every object under the remote directory (empty if there is none).

    Every name is checked as one safe name first (`key_problem` without the checkpoint
    vocabulary): a key that is a path (`..`, an empty segment, absolute) or holds a control
    character refuses the whole listing, before any local path is built from it.
    """
    try:
        with store_errors(remote.url, "cannot list", remote.fs.storage_options):
            try:
                remote.fs.invalidate_cache(remote.root)  # what another process (or writer) did since
                found = remote.fs.find(remote.root, detail=True)
            except FileNotFoundError as exc:
                if "bucket" in str(exc).lower():
                    raise
                return {}
    except CheckpointError as exc:
        if "no such bucket" in str(exc):
            raise CheckpointError(f"{remote.url}: the bucket does not exist") from None
        raise
    prefix = remote.root + "/"
    listing = {
        name[len(prefix) :]: info
        for name, info in found.items()
        if name.startswith(prefix) and info.get("type", "file") != "directory"
    }
    _check_names(remote, listing, names=False)
    return listing


# ------------------------------------------------------------------ object names
_NAME_BYTES = 255  # the longest file name a local file system takes


def shown_key(rel: str) -> str:
    """An object name as it is printed: every character that is not printable escaped (\\n, \\x1b)."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in rel)


def key_problem(rel: str, *, names: bool = True) -> str | None:
    """Why the object name `rel` (relative to a checkpoint's prefix) cannot be read, or None.

    A name is never a path: no `..` or `.` segment, no empty segment, not absolute, no NUL
    or other control character, no segment longer than a file name. With `names`, it must
    also be a name a checkpoint uses: the metadata, the index (or its legacy name), the
    merge map, the upload marker or pending note, or a trajectory file as rbtool.format
    names them, here or in a `rank_<r>/` directory.
    """
    from rbtool.format import parse_trajectory_file_name

    if not rel:
        return "is empty"
    if any(not c.isprintable() for c in rel):
        return "holds a control character"
    if rel.startswith("/"):
        return "is absolute (it starts with /)"
    parts = rel.split("/")
    if "" in parts:
        return "has an empty segment (//)"
    if "." in parts or ".." in parts:
        return "has a . or .. segment"
    if any(len(part.encode("utf-8", "surrogatepass")) > _NAME_BYTES for part in parts):
        return f"has a segment longer than {_NAME_BYTES} bytes"
    if not names:
        return None
    if len(parts) == 2 and is_rank_name(parts[0]):
        parts = parts[1:]
    name = parts[-1]
    if len(parts) == 1 and (
        name in _JSON_OBJECTS or name in _CONTROL or parse_trajectory_file_name(name) is not None
    ):
        return None
    return (
        "is not a name a checkpoint uses (metadata.json, trajectory_index.json, "
        "trajectory_<id>_<weights>.<pt|pkl>, ..., here or in rank_<r>/)"
    )


def _check_names(remote: Remote, listing: dict[str, Any], *, names: bool = True) -> None:
    """Refuse a listing holding a key that is no safe name (with `names`, also one a checkpoint
    does not use), naming the first such key in sorted order."""
    for rel in sorted(listing):
        problem = key_problem(rel, names=names)
        if problem is not None:
            raise UnsafeKeyError(
                f"{remote.url}: object key {shown_key(rel)} {problem}; refused, nothing was read"
            )


# ------------------------------------------------------------------ hashes
@dataclass(frozen=True)
class Digest:
    size: int
    sha256: str
    md5: str | None = None
    etag: str | None = None  # as the store reported it after the upload (a marker's record)


def digest_file(path: Path) -> Digest:
    """Size, sha256 and md5 of a local file, read a block at a time."""
    sha, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
    size = 0
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            sha.update(block)
            md5.update(block)
            size += len(block)
    return Digest(size, sha.hexdigest(), md5.hexdigest())


def _remote_sha256(remote: Remote, rel: str) -> str:
    sha = hashlib.sha256()
    with remote.fs.open(remote.key(rel), "rb", block_size=_CHUNK) as f:
        while block := f.read(_CHUNK):
            sha.update(block)
    return sha.hexdigest()


def _etag(info: dict[str, Any]) -> str | None:
    """The ETag a store lists for an object (quotes dropped, lower case), or None if it lists none."""
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"').lower()
    return etag or None


def _etag_md5(info: dict[str, Any]) -> str | None:
    """The md5 an S3-like store reports for a single-part object (its ETag), else None."""
    etag = _etag(info) or ""
    return etag if re.fullmatch(r"[0-9a-f]{32}", etag) else None


def _matches(remote: Remote, rel: str, info: dict[str, Any] | None, want: Digest) -> bool:
    """True if the remote object already holds exactly `want` (size, then md5 ETag or a streamed sha256)."""
    if info is None or int(info.get("size") or 0) != want.size:
        return False
    etag = _etag_md5(info)
    if etag is not None and want.md5 is not None:
        return etag == want.md5
    return _remote_sha256(remote, rel) == want.sha256


# ------------------------------------------------------------------ the marker
def marker_digest(digests: dict[str, Digest]) -> str:
    """The digest a marker records of its objects: sha256 of every name, size and sha256, sorted.

    The index and the metadata are objects like the others, so it covers them too: an index,
    metadata or object set of another upload does not match it.
    """
    rows = [[rel, d.size, d.sha256] for rel, d in sorted(digests.items())]
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def _marker_doc(digests: dict[str, Digest], etags: dict[str, str] | None = None) -> bytes:
    files: dict[str, dict[str, Any]] = {}
    for rel, d in sorted(digests.items()):
        files[rel] = {"size": d.size, "sha256": d.sha256}
        if etags and etags.get(rel):
            files[rel]["etag"] = etags[rel]
    doc = {
        "format": MARKER_FORMAT,
        "version": MARKER_VERSION,
        "digest": marker_digest(digests),
        "files": files,
    }
    return json.dumps(doc, indent=1).encode() + b"\n"


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _read_marker(remote: Remote, rel: str) -> dict[str, Digest]:
    """The objects a completion marker records; refused if it is no marker or its digest does not
    match the objects it lists (a marker edited, or entries of two uploads)."""
    where = f"{remote.url}/{rel}"
    try:
        doc = _bounded_json(remote.fs.cat_file(remote.key(rel)), shown_url(where))
        if doc.get("format") != MARKER_FORMAT or doc.get("version") not in _MARKER_VERSIONS:
            raise ValueError(f"format {doc.get('format')!r} version {doc.get('version')!r}")
        files: dict[str, Digest] = {}
        for name, entry in doc["files"].items():
            size, sha, etag = entry["size"], entry["sha256"], entry.get("etag")
            if type(size) is not int or not 0 <= size < 1 << 63:
                raise ValueError(f"{shown_key(str(name))}: size {size!r}")
            if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
                raise ValueError(f"{shown_key(str(name))}: sha256 {sha!r:.80}")
            if etag is not None and not isinstance(etag, str):
                raise ValueError(f"{shown_key(str(name))}: etag {etag!r:.80}")
            files[str(name)] = Digest(size, sha, etag=etag)
    except OSError as exc:
        reason = redact(_store_reason(exc))
        raise CheckpointError(f"{shown_url(where)}: cannot read the completion marker ({reason})") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        module = type(exc).__module__.split(".")[0]
        if module in _STORE_MODULES:
            raise CheckpointError(f"{shown_url(where)}: cannot read ({redact(_store_reason(exc))})") from None
        raise CheckpointError(f"{where}: not an rbtool completion marker ({exc})") from None
    if doc["version"] >= 2 and doc.get("digest") != marker_digest(files):
        raise CheckpointError(
            f"{where}: the marker's digest does not match the objects it lists (edited, or written by two "
            "uploads at once); refused, upload the checkpoint again"
        )
    return files


def _after_upload(remote: Remote, digests: dict[str, Digest]) -> dict[str, str]:
    """The ETags the store lists for what this upload wrote, refusing what another writer changed.

    Listed once more before the marker goes up: an object missing, of another size, with
    an md5 ETag that is not this upload's bytes, or one this upload did not write means a
    second writer at the same URL; the marker is then not written (the upload stays
    incomplete) and readers keep refusing it until one writer runs again alone.
    """
    listing = _listing(remote)
    extra = sorted(rel for rel in listing if rel not in digests and rel not in _CONTROL)
    changed = [
        rel
        for rel, d in sorted(digests.items())
        if rel not in listing
        or int(listing[rel].get("size") or 0) != d.size
        or (d.md5 is not None and _etag_md5(listing[rel]) not in (None, d.md5))
    ]
    if extra or changed:
        rel = (changed or extra)[0]
        raise CheckpointError(
            f"{remote.url}/{shown_key(rel)}: {'changed' if changed else 'written'} by another writer during "
            "this upload; no marker was written (readers refuse the checkpoint); run one upload at a time"
        )
    return {rel: etag for rel in digests if (etag := _etag(listing[rel])) is not None}


# ------------------------------------------------------------------ writing
def check_target(remote: Remote, *, overwrite: bool) -> None:
    """Refuse to write over a checkpoint (unless `overwrite`), and over objects that are not one at all.

    An incomplete rbtool upload (a pending note, no marker) is always continued.
    """
    listing = _listing(remote)
    if not listing:
        return
    foreign = sorted(rel for rel in listing if key_problem(rel) is not None)
    if foreign:
        # as for a local target, --force replaces only a checkpoint (or an empty place); an
        # incomplete upload among objects no checkpoint holds is not continued (nor are they removed)
        raise CheckpointError(
            f"{remote.url}: holds {len(listing)} objects that are not a checkpoint (such as "
            f"{shown_key(foreign[0])}); choose another URL"
        )
    if PENDING in listing:
        return
    if not overwrite:
        raise OutputExistsError(f"{remote.url}: already holds a checkpoint")


def upload_dir(
    local: Path,
    remote: Remote,
    *,
    overwrite: bool = False,
    jobs: int | None = None,
    progress: Progress | None = None,
) -> dict[str, int]:
    """Publish the local directory `local` at `remote` by the upload protocol; returns counts and bytes.

    Objects already there with the right size and content are kept (a rerun after a kill
    continues where the upload stopped); objects not in `local` are removed before the marker.
    What the store raises is one error naming the URL.
    """
    with store_errors(remote.url, "upload failed; rerun the command to continue", remote.fs.storage_options):
        return _upload(local, remote, overwrite=overwrite, jobs=jobs, progress=progress)


def _upload(
    local: Path, remote: Remote, *, overwrite: bool, jobs: int | None, progress: Progress | None
) -> dict[str, int]:
    from rbtool.files.writer import start_phase

    check_target(remote, overwrite=overwrite)
    files = sorted(
        str(p.relative_to(local)) for p in local.rglob("*") if p.is_file() and p.name not in _CONTROL
    )
    workers = _workers(jobs)
    with ThreadPoolExecutor(workers) as pool:
        digests = dict(zip(files, pool.map(lambda rel: digest_file(local / rel), files), strict=True))
    start_phase(progress, len(files), "uploading")
    listing = _listing(remote)
    if MARKER in listing:  # replacing a complete checkpoint: from now on it is incomplete
        remote.fs.rm_file(remote.key(MARKER))
    if PENDING not in listing:
        remote.fs.pipe_file(remote.key(PENDING), json.dumps({"format": MARKER_FORMAT}).encode() + b"\n")

    def rank(rel: str) -> int:
        name = rel.rsplit("/", 1)[-1]
        return 2 if name == METADATA_FILE else 1 if name in _JSON_OBJECTS else 0

    counts = {"uploaded": 0, "kept": 0, "removed": 0, "bytes": 0}

    def put(rel: str) -> bool:
        try:
            if _matches(remote, rel, listing.get(rel), digests[rel]):
                return False
            remote.fs.put_file(str(local / rel), remote.key(rel))
        except OSError as exc:
            raise CheckpointError(
                f"{remote.url}/{rel}: upload failed ({exc.strerror or exc}); rerun the command to continue"
            ) from None
        return True

    with ThreadPoolExecutor(workers) as pool:
        for phase in (0, 1, 2):  # trajectory objects, then the index, then metadata
            batch = [rel for rel in files if rank(rel) == phase]
            for rel, sent in zip(batch, pool.map(put, batch), strict=True):
                counts["uploaded" if sent else "kept"] += 1
                counts["bytes"] += digests[rel].size if sent else 0
                if progress is not None:
                    progress(1)
    stale = [rel for rel in listing if rel not in digests and rel not in _CONTROL]
    for rel in stale:
        remote.fs.rm_file(remote.key(rel))
    counts["removed"] = len(stale)
    etags = _after_upload(remote, digests)
    remote.fs.pipe_file(remote.key(MARKER), _marker_doc(digests, etags))
    remote.fs.rm_file(remote.key(PENDING))
    return counts


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
    missing = []
    for p in (path, *path.parents):
        if os.path.lexists(p):
            break
        missing.append(p)
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            continue  # made meanwhile, by this user's other run or someone else: checked next
        except OSError as exc:
            raise FileSystemError(f"{p}: cannot make the rbtool cache directory ({exc.strerror})") from None
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
    text = os.environ.get("RBTOOL_CACHE_BYTES")
    if not text:
        return DEFAULT_CACHE_BYTES
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"RBTOOL_CACHE_BYTES={text!r}: expected a number of bytes") from None


@dataclass
class Staging:
    """A local path (not yet created) to build a checkpoint or rank tree in, and its upload."""

    local: Path
    remote: Remote
    overwrite: bool
    jobs: int | None = None
    progress: Progress | None = None
    counts: dict[str, int] | None = None

    def publish(self) -> dict[str, int]:
        """Upload what was built (once); nothing when nothing was built (a dry run)."""
        if self.counts is None:
            self.counts = {"uploaded": 0, "kept": 0, "removed": 0, "bytes": 0}
            if self.local.exists():
                drop_link_records(self.local)
                self.counts = upload_dir(
                    self.local, self.remote, overwrite=self.overwrite, jobs=self.jobs, progress=self.progress
                )
        return self.counts


def drop_link_records(local: Path) -> None:
    """Rewrite the indexes under `local` without `link` records (entries of hard-linked files).

    A link record is a local file's identity (inode, size, mtime): in object storage it names
    nothing, and a copy read back whose inode happened to match would be reported as written
    in place.
    """
    from rbtool.files.index import read_index, write_index

    for metadata in sorted(local.rglob(METADATA_FILE)):
        index = read_index(metadata.parent)
        if any("link" in entry for entry in index.entries.values()):
            for entry in index.entries.values():
                entry.pop("link", None)
            write_index(metadata.parent, index)


@contextmanager
def writing(
    url: str,
    options: dict[str, Any] | None = None,
    *,
    overwrite: bool = False,
    jobs: int | None = None,
    progress: Progress | None = None,
) -> Iterator[Staging]:
    """Build a checkpoint locally and publish it at `url`: at `Staging.publish()`, else when the block ends.

    The target is checked before anything is built; if the block raises, nothing is uploaded.
    """
    remote = open_remote(url, options)
    check_target(remote, overwrite=overwrite)
    with _scratch("upload") as tmp:
        staging = Staging(tmp / "out", remote, overwrite, jobs, progress)
        yield staging
        staging.publish()


# ------------------------------------------------------------------ reading
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


def _bounded_json(data: bytes, what: str) -> Any:
    """A completion marker through rbtool's bounded JSON reader (it grows with the objects
    listed, so it is bounded like an index: by the memory decoding it would take)."""
    from rbtool.format import index_size_problem, read_json_bytes

    why = index_size_problem(len(data))
    if why is not None:
        raise CheckpointError(f"{what}: {why}")
    return read_json_bytes(data, what, max_bytes=len(data))


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
    from rbtool.files.writer import start_phase

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


# ------------------------------------------------------------------ pins and streamed reads
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
