"""The completion marker an upload writes last: the size, sha256 and ETag of every object and a
digest over them all; read back, it is refused when it is no marker or its digest does not match.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rbtool.errors import CheckpointError
from rbtool.remote.keys import shown_key
from rbtool.remote.urls import _STORE_MODULES, Remote, _store_reason, redact, shown_url

MARKER_FORMAT = "rbtool-upload"
# 2: the marker carries `digest` (of every object's name, size and sha256) and each object's
# ETag as the store reported it after the upload; version 1 markers (neither) are still read.
MARKER_VERSION = 2
_MARKER_VERSIONS = (1, 2)
_CHUNK = 1 << 20


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


def _etag(info: dict[str, Any]) -> str | None:
    """The ETag a store lists for an object (quotes dropped, lower case), or None if it lists none."""
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"').lower()
    return etag or None


def _etag_md5(info: dict[str, Any]) -> str | None:
    """The md5 an S3-like store reports for a single-part object (its ETag), else None."""
    etag = _etag(info) or ""
    return etag if re.fullmatch(r"[0-9a-f]{32}", etag) else None


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


def _bounded_json(data: bytes, what: str) -> Any:
    """A completion marker through rbtool's bounded JSON reader (it grows with the objects
    listed, so it is bounded like an index: by the memory decoding it would take)."""
    from rbtool.format import index_size_problem, read_json_bytes

    why = index_size_problem(len(data))
    if why is not None:
        raise CheckpointError(f"{what}: {why}")
    return read_json_bytes(data, what, max_bytes=len(data))
