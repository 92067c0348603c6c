"""Storage: where a trajectory's rows live and how drawn rows are read into a batch.

A trajectory opened for sampling is a FlatView (`view`): every sampled field seen as
`[T*B, ...]` rows, held either in memory (tensors) or left in its `.pt` file (FileRows, read
with pread: `ptfile`, with the descriptor cache and pinned files). TrajectoryStore (`store`)
keeps track of where each trajectory of a buffer is and a bounded set of open views; what
sampling knows of a window without its data is in `window`; `.pt` files held as bytes in
`held`; gather() (`gathering`) builds a batch from a Draw. Samplers never read data; storage
never draws. The tuning constants are read from the module that defines them.
"""

from rbtool.buffer.storage.bulk import default_hold_budget, hold_window
from rbtool.buffer.storage.gathering import gather
from rbtool.buffer.storage.held import (
    HELD_BLOCK_BYTES,
    HeldBlock,
    HeldBlocks,
    RawLayout,
    RawTrajectory,
    header_extent,
    overlapping_rows,
    raw_layout,
)
from rbtool.buffer.storage.ptfile import (
    MAX_OPEN_FDS,
    MAX_PINNED,
    READ_PARALLEL_MIN,
    READ_PROBE,
    READ_SLOW_S,
    READ_THREADS,
    ROW_READ_MIN_BYTES,
    FileHandle,
    FileRows,
    FileTrajectory,
    PinnedFile,
    open_trajectory,
    read_rows,
)
from rbtool.buffer.storage.store import RAW_CACHE_MAX_BYTES, FileMap, TrajectoryStore
from rbtool.buffer.storage.view import (
    FieldPath,
    FlatField,
    FlatView,
    Schema,
    Storage,
    flat_rows,
    nest,
    sampled_items,
    view_scores,
)
from rbtool.buffer.storage.window import (
    WINDOW_CACHE_MAX_BYTES,
    CachedRows,
    RowCache,
    Signature,
    WindowSchema,
    recorded_signature,
    shared_schema,
    signature_of,
    view_signature,
    window_cache,
)

__all__ = [
    "HELD_BLOCK_BYTES",
    "MAX_OPEN_FDS",
    "MAX_PINNED",
    "RAW_CACHE_MAX_BYTES",
    "READ_PARALLEL_MIN",
    "READ_PROBE",
    "READ_SLOW_S",
    "READ_THREADS",
    "ROW_READ_MIN_BYTES",
    "WINDOW_CACHE_MAX_BYTES",
    "CachedRows",
    "FieldPath",
    "FileHandle",
    "FileRows",
    "FileTrajectory",
    "FlatField",
    "FlatView",
    "HeldBlock",
    "HeldBlocks",
    "PinnedFile",
    "RawLayout",
    "RawTrajectory",
    "RowCache",
    "Schema",
    "Signature",
    "Storage",
    "FileMap",
    "TrajectoryStore",
    "WindowSchema",
    "default_hold_budget",
    "flat_rows",
    "gather",
    "header_extent",
    "hold_window",
    "nest",
    "open_trajectory",
    "overlapping_rows",
    "raw_layout",
    "read_rows",
    "recorded_signature",
    "sampled_items",
    "shared_schema",
    "signature_of",
    "view_scores",
    "view_signature",
    "window_cache",
]
