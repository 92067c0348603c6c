"""The checkpoint's file names: the JSON files, trajectory files (`trajectory_<id>_<weights>.<fmt>`)
and the model_weights_id rule they follow, and which names a directory's own files may have."""

from __future__ import annotations

import os
import re
from pathlib import Path

from rbtool.format.problems import shown
from rbtool.format.schema import is_id_text

METADATA_FILE = "metadata.json"
INDEX_FILE = "trajectory_index.json"
LEGACY_INDEX_FILE = "trajector_index.json"
MERGE_MAP_FILE = "merge_map.json"
FORMATS = ("pt", "pkl")

_SAFE_WEIGHTS_ID = re.compile(r"[A-Za-z0-9._-]*")
TRAJECTORY_FILE_RE = re.compile(r"^trajectory_(\d+)_([A-Za-z0-9._-]*)\.(pt|pkl)$")


def weights_id_problem(value: object) -> str | None:
    """Why `value` cannot be a model_weights_id (it goes into a file name), or None."""
    if not isinstance(value, str):
        return f"model_weights_id must be a string, got {shown(value)}"
    if not _SAFE_WEIGHTS_ID.fullmatch(value) or ".." in value:
        return (
            f"model_weights_id {shown(value)} is not file-name safe "
            "(allowed: letters, digits, '.', '_', '-', and no '..')"
        )
    return None


def check_weights_id(value: object, where: str) -> str:
    """Return `value` if it is a file-name-safe model_weights_id, else raise naming `where`."""
    from rbtool.errors import CheckpointError

    problem = weights_id_problem(value)
    if problem is not None:
        raise CheckpointError(f"{where}: {problem}")
    assert isinstance(value, str)
    return value


def trajectory_file_name(trajectory_id: int, model_weights_id: str, fmt: str) -> str:
    """The file name of a trajectory, as the reference implementation spells it."""
    return f"trajectory_{trajectory_id}_{model_weights_id}.{fmt}"


def parse_trajectory_file_name(name: str) -> tuple[int, str, str] | None:
    """(id, model_weights_id, format) parsed from a trajectory file name, or None."""
    match = TRAJECTORY_FILE_RE.match(name)
    if match is None or not is_id_text(match.group(1), leading_zeros=True):
        return None  # an id beyond int64 names no trajectory: the file is a stray
    return int(match.group(1)), match.group(2), match.group(3)


def escapes(directory: Path, name: str) -> str | None:
    """Where `directory/name` leads when it is a symlink resolving outside `directory`, else None.

    A checkpoint's files must be its own: a link to a file elsewhere (a secret, say) would be
    read, copied into outputs and verified as if it were a trajectory.
    """
    path = directory / name
    if not os.path.islink(path):
        return None
    target = os.path.realpath(path)
    home = os.path.realpath(directory)
    return None if os.path.dirname(target) == home or target.startswith(home + os.sep) else target


def index_path(directory: Path) -> Path:
    """The index file of a directory: the current name, else the legacy misspelt one."""
    path = directory / INDEX_FILE
    if not path.exists() and (directory / LEGACY_INDEX_FILE).exists():
        return directory / LEGACY_INDEX_FILE
    return path


def is_checkpoint_dir(directory: Path) -> bool:
    """True if `directory` holds metadata or an index (so it is meant as a checkpoint)."""
    return (directory / METADATA_FILE).is_file() or index_path(directory).is_file()
