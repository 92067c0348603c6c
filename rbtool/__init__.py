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
    from rbtool.buffer.cache import TrajectoryCache
    from rbtool.buffer.dataset import (
        PreloadReplayBufferDataset,
        ReplayBufferDataset,
        replay_buffer_collate_fn,
        seed_workers,
    )
    from rbtool.buffer.priority import PriorityStore
    from rbtool.buffer.replay import TrajectoryReplayBuffer
    from rbtool.files.dirs import CheckpointView, open_view
    from rbtool.files.index import Index, read_index
    from rbtool.ops.checkpoint import (
        build_from_files,
        load_state,
        merge,
        restore,
        save_from_autosave_dir,
        shard,
    )
    from rbtool.ops.compare import diff
    from rbtool.ops.conversion import convert
    from rbtool.ops.doctor import doctor
    from rbtool.ops.filtering import Criteria, filter_checkpoint
    from rbtool.ops.ingestion import ingest
    from rbtool.ops.resharding import reshard

# Public names resolved on first use, so `import rbtool` (and the command line's start-up)
# loads only what a command needs.
_LAZY = {
    "TrajectoryReplayBuffer": "rbtool.buffer.replay",
    "ReplayBufferDataset": "rbtool.buffer.dataset",
    "PreloadReplayBufferDataset": "rbtool.buffer.dataset",
    "replay_buffer_collate_fn": "rbtool.buffer.dataset",
    "seed_workers": "rbtool.buffer.dataset",
    "TrajectoryCache": "rbtool.buffer.cache",
    "PriorityStore": "rbtool.buffer.priority",
    "build_from_files": "rbtool.ops.checkpoint",
    "load_state": "rbtool.ops.checkpoint",
    "merge": "rbtool.ops.checkpoint",
    "restore": "rbtool.ops.checkpoint",
    "save_from_autosave_dir": "rbtool.ops.checkpoint",
    "shard": "rbtool.ops.checkpoint",
    "diff": "rbtool.ops.compare",
    "convert": "rbtool.ops.conversion",
    "doctor": "rbtool.ops.doctor",
    "CheckpointView": "rbtool.files.dirs",
    "open_view": "rbtool.files.dirs",
    "Criteria": "rbtool.ops.filtering",
    "filter_checkpoint": "rbtool.ops.filtering",
    "reshard": "rbtool.ops.resharding",
    "Index": "rbtool.files.index",
    "read_index": "rbtool.files.index",
    "ingest": "rbtool.ops.ingestion",
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
    "PreloadReplayBufferDataset",
    "PriorityStore",
    "RbtoolError",
    "ReplayBufferDataset",
    "TrajectoryCache",
    "TrajectoryFileError",
    "TrajectoryReplayBuffer",
    "UnsafePickleError",
    "UsageError",
    "__version__",
    "build_from_files",
    "convert",
    "diff",
    "doctor",
    "filter_checkpoint",
    "ingest",
    "load_state",
    "merge",
    "open_view",
    "read_index",
    "replay_buffer_collate_fn",
    "reshard",
    "restore",
    "save_from_autosave_dir",
    "seed_workers",
    "shard",
]
