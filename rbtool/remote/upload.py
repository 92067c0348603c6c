"""Publishing a checkpoint in object storage by the upload protocol (docs/format.md, "Checkpoints in
object storage").

Object stores have no atomic rename: the checkpoint is built in a local staging directory, then
its trajectory objects are uploaded, then the index and metadata objects, then the completion
marker last. A pending note written first tells readers that an upload is under way or was
killed. Objects already there with the right size and content are kept, so a rerun after a kill
continues where the upload stopped.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rbtool.errors import CheckpointError, OutputExistsError, UnsafeKeyError
from rbtool.format import METADATA_FILE
from rbtool.progress import Progress
from rbtool.remote.cache import _scratch
from rbtool.remote.keys import _CONTROL, _JSON_OBJECTS, MARKER, PENDING, _listing, key_problem, shown_key
from rbtool.remote.marker import _CHUNK, MARKER_FORMAT, Digest, _etag, _etag_md5, _marker_doc, digest_file
from rbtool.remote.urls import Remote, _workers, open_remote, store_errors


def _remote_sha256(remote: Remote, rel: str) -> str:
    sha = hashlib.sha256()
    with remote.fs.open(remote.key(rel), "rb", block_size=_CHUNK) as f:
        while block := f.read(_CHUNK):
            sha.update(block)
    return sha.hexdigest()


def _matches(remote: Remote, rel: str, info: dict[str, Any] | None, want: Digest) -> bool:
    """True if the remote object already holds exactly `want` (size, then md5 ETag or a streamed sha256)."""
    if info is None or int(info.get("size") or 0) != want.size:
        return False
    etag = _etag_md5(info)
    if etag is not None and want.md5 is not None:
        return etag == want.md5
    return _remote_sha256(remote, rel) == want.sha256


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
    from rbtool.progress import start_phase

    files = sorted(
        str(p.relative_to(local)) for p in local.rglob("*") if p.is_file() and p.name not in _CONTROL
    )
    for rel in files:  # what a reader would refuse is not uploaded at all
        problem = key_problem(rel)
        if problem is not None:
            raise UnsafeKeyError(f"{remote.url}: object key {shown_key(rel)} {problem}; nothing was uploaded")
    check_target(remote, overwrite=overwrite)
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
