"""Object names in a remote checkpoint: the upload's own objects, the names a checkpoint uses, and
listings whose every key is checked to be a name, never a path, before a local path is built from it.
"""

from __future__ import annotations

from typing import Any

from rbtool.errors import CheckpointError, UnsafeKeyError
from rbtool.format import INDEX_FILE, LEGACY_INDEX_FILE, MERGE_MAP_FILE, METADATA_FILE
from rbtool.format.ranknames import is_rank_name
from rbtool.remote.urls import Remote, store_errors

MARKER = "rbtool-upload-complete.json"  # written last: the upload is whole
PENDING = "rbtool-upload-pending.json"  # written first: an upload is under way (or was killed)
_CONTROL = (MARKER, PENDING)
_JSON_OBJECTS = (METADATA_FILE, INDEX_FILE, LEGACY_INDEX_FILE, MERGE_MAP_FILE)


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
