"""Errors raised by rbtool; the command line turns a UsageError into exit 2 and any other into exit 1."""


class RbtoolError(Exception):
    """Base class: a problem with the input, a checkpoint, or a request."""


class CheckpointError(RbtoolError):
    """A checkpoint or buffer directory is missing, malformed or inconsistent."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint or source that is missing, or a directory holding none (a FileNotFoundError, as RLinf)."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint's metadata or index is missing, unreadable or inconsistent (repair rebuilds them)."""

    def __init__(self, message: str, directory: str = "") -> None:
        super().__init__(message)
        self.directory = directory


class LooseFilesError(CheckpointError):
    """A folder of loose trajectory files was given where a checkpoint belongs (ingest makes one)."""

    def __init__(self, message: str, directory: str = "") -> None:
        super().__init__(message)
        self.directory = directory


class OutputExistsError(CheckpointError):
    """The output path exists and replacing it was not asked for."""


class MissingTrajectoryFilesError(CheckpointError):
    """The index names trajectory files that do not exist."""

    def __init__(self, message: str, missing_ids: list[int]) -> None:
        super().__init__(message)
        self.missing_ids = missing_ids


class TrajectoryFileError(RbtoolError):
    """A trajectory file is corrupt, truncated or not a trajectory."""


class UnsafePickleError(TrajectoryFileError):
    """A .pkl file reaches for something a trajectory never needs."""


class InvalidTrajectoryError(RbtoolError):
    """A trajectory offered to the buffer is malformed."""


class UsageError(RbtoolError, ValueError):
    """An argument is out of range or contradicts another (a ValueError, as RLinf raises)."""


class EmptyBufferError(RbtoolError, RuntimeError):
    """Sampling was asked of a buffer or window with no samples (a RuntimeError, as RLinf raises)."""


class BufferClosedError(RbtoolError, RuntimeError):
    """The buffer was used after close()."""


class NeedsTrajectoryFilesError(UsageError):
    """The request needs the trajectory files, but reading only the index was asked for."""


class FieldsLeftOutWarning(UserWarning):
    """Sampled batches leave out fields the reference sampler ignores (they can be asked for)."""

    def __init__(self, message: str, fields: list[str]) -> None:
        super().__init__(message)
        self.fields = fields


class DroppedKeysWarning(UserWarning):
    """A replay+demo batch leaves out a key only one of the two batches holds."""


class RankLayoutWarning(UserWarning):
    """A rank directory is loaded in a layout other than the one its shard was written for."""


class FileSystemError(RbtoolError):
    """A file-system operation failed (disk full, read-only, permission, name too long, ...)."""


class DirectoryInUseError(CheckpointError):
    """A directory is held (locked) by a live buffer or another rbtool process."""


class LeftoversRemovedWarning(UserWarning):
    """Staging directories that interrupted rbtool runs left were removed."""


class UnusualLayout(RbtoolError):
    """The file is not laid out the way this reader knows; load it with torch instead."""


class JournalError(RbtoolError):
    """A journal directory that belongs to another pass, or cannot be read or written."""


class UnsafeKeyError(CheckpointError):
    """An object key under a checkpoint's prefix is not one safe name that a checkpoint uses."""


class UntrustedCacheError(FileSystemError):
    """The cache directory, an ancestor of it, or an entry in it is not the user's own."""


class CacheFullError(CheckpointError):
    """A data mirror does not fit the cache beside what other processes are reading."""


class LeRobotFeatureError(UsageError):
    """A LeRobot feature that cannot become a buffer field as it is: it can be dropped, and
    when only its place is the problem (`mappable`), mapped to another field."""

    def __init__(self, message: str, feature: str, *, mappable: bool = False) -> None:
        super().__init__(message)
        self.feature = feature
        self.mappable = mappable
