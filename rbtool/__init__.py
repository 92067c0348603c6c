"""rbtool: build, inspect, shard, merge and check trajectory replay-buffer checkpoints.

The on-disk layout is the one RLinf's `TrajectoryReplayBuffer` writes. Importing rbtool
does not import torch; the functions that handle tensors import it when called.
"""

from rbtool.buffer import TrajectoryReplayBuffer
from rbtool.checkpoint import build_from_files, load_state, merge, restore, save_from_autosave_dir, shard
from rbtool.errors import (
    CheckpointError,
    InvalidTrajectoryError,
    MissingTrajectoryFilesError,
    RbtoolError,
    TrajectoryFileError,
    UnsafePickleError,
    UsageError,
)
from rbtool.index import Index, read_index
from rbtool.ingest import ingest

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "Index",
    "InvalidTrajectoryError",
    "MissingTrajectoryFilesError",
    "RbtoolError",
    "TrajectoryFileError",
    "TrajectoryReplayBuffer",
    "UnsafePickleError",
    "UsageError",
    "__version__",
    "build_from_files",
    "ingest",
    "load_state",
    "merge",
    "read_index",
    "restore",
    "save_from_autosave_dir",
    "shard",
]
