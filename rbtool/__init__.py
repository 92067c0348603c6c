"""rbtool: build, inspect, shard, merge and check trajectory replay-buffer checkpoints.

The on-disk layout is the one RLinf's `TrajectoryReplayBuffer` writes. Importing rbtool
does not import torch; the functions that handle tensors import it when called.
"""

from typing import TYPE_CHECKING, Any

from rbtool.errors import (
    CheckpointError,
    InvalidTrajectoryError,
    MissingTrajectoryFilesError,
    RbtoolError,
    TrajectoryFileError,
    UnsafePickleError,
    UsageError,
)

if TYPE_CHECKING:
    from rbtool.buffer import TrajectoryReplayBuffer
    from rbtool.checkpoint import build_from_files, load_state, merge, restore, save_from_autosave_dir, shard
    from rbtool.compare import diff
    from rbtool.conversion import convert
    from rbtool.dirs import CheckpointView, open_view
    from rbtool.filtering import Criteria, filter_checkpoint
    from rbtool.index import Index, read_index
    from rbtool.ingestion import ingest
    from rbtool.resharding import reshard

# Public names resolved on first use, so `import rbtool` (and the command line's start-up)
# loads only what a command needs.
_LAZY = {
    "TrajectoryReplayBuffer": "rbtool.buffer",
    "build_from_files": "rbtool.checkpoint",
    "load_state": "rbtool.checkpoint",
    "merge": "rbtool.checkpoint",
    "restore": "rbtool.checkpoint",
    "save_from_autosave_dir": "rbtool.checkpoint",
    "shard": "rbtool.checkpoint",
    "diff": "rbtool.compare",
    "convert": "rbtool.conversion",
    "CheckpointView": "rbtool.dirs",
    "open_view": "rbtool.dirs",
    "Criteria": "rbtool.filtering",
    "filter_checkpoint": "rbtool.filtering",
    "reshard": "rbtool.resharding",
    "Index": "rbtool.index",
    "read_index": "rbtool.index",
    "ingest": "rbtool.ingestion",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rbtool' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__version__ = "0.2.0"

__all__ = [
    "CheckpointError",
    "CheckpointView",
    "Criteria",
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
    "convert",
    "diff",
    "filter_checkpoint",
    "ingest",
    "load_state",
    "merge",
    "open_view",
    "read_index",
    "reshard",
    "restore",
    "save_from_autosave_dir",
    "shard",
]
