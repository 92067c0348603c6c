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

The modules, bottom up: `urls` (URLs, storage options, secrets redacted, store errors),
`keys` (object names, checked listings), `marker` (the completion marker and digests),
`cache` (the bounded local cache, its trust checks, locks and eviction), `upload` (the
upload protocol), `mirror` (reading against the marker into local mirrors) and `ranges`
(sampling by byte ranges).
"""

from rbtool.errors import CacheFullError
from rbtool.remote.cache import DEFAULT_CACHE_BYTES, Pin, cache_bytes, cache_root, cache_shared
from rbtool.remote.keys import MARKER, PENDING, key_problem, shown_key
from rbtool.remote.marker import MARKER_FORMAT, MARKER_VERSION, Digest, digest_file, marker_digest
from rbtool.remote.mirror import (
    IndexMirror,
    RemoteCheckpoint,
    StreamMirror,
    data_mirror,
    fits_cache,
    index_mirror,
    inspect,
    stream_mirror,
)
from rbtool.remote.upload import Staging, check_target, drop_link_records, upload_dir, writing
from rbtool.remote.urls import (
    Remote,
    is_url,
    local_path,
    open_remote,
    parse_storage_options,
    redact,
    shown_url,
    store_errors,
)

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "MARKER",
    "MARKER_FORMAT",
    "MARKER_VERSION",
    "PENDING",
    "CacheFullError",
    "Digest",
    "IndexMirror",
    "Pin",
    "Remote",
    "RemoteCheckpoint",
    "Staging",
    "StreamMirror",
    "cache_bytes",
    "cache_root",
    "cache_shared",
    "check_target",
    "data_mirror",
    "digest_file",
    "drop_link_records",
    "fits_cache",
    "index_mirror",
    "inspect",
    "is_url",
    "key_problem",
    "local_path",
    "marker_digest",
    "open_remote",
    "parse_storage_options",
    "redact",
    "shown_key",
    "shown_url",
    "store_errors",
    "stream_mirror",
    "upload_dir",
    "writing",
]
