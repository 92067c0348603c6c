"""The checkpoint's file names: the JSON files, trajectory files (`trajectory_<id>_<weights>.<fmt>`)
and the model_weights_id rule they follow, and which names a directory's own files may have."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from rbtool.format.problems import shown
from rbtool.format.schema import is_id_text

METADATA_FILE = "metadata.json"
INDEX_FILE = "trajectory_index.json"
LEGACY_INDEX_FILE = "trajector_index.json"
MERGE_MAP_FILE = "merge_map.json"
FORMATS = ("pt", "pkl")

# A trajectory file's name is `trajectory_<id>_<model_weights_id>.<fmt>`, one path component
# of at most NAME_BYTES. The longest id (2**63 - 1, 19 digits) and the longer format (`.pkl`)
# take 35 bytes and a writer's temporary name (`.<name>.<12 hex>.tmp`) 18 more, so whatever id
# or format a name gets later (merge renumbering, convert) it can still be written.
NAME_BYTES = 255
TEMP_NAME_BYTES = len("..123456789abc.tmp")
WEIGHTS_ID_BYTES = NAME_BYTES - len("trajectory__.pkl") - len(str(2**63 - 1)) - TEMP_NAME_BYTES
TRAJECTORY_FILE_RE = re.compile(r"^trajectory_([0-9]+)_(.*)\.(pt|pkl)$", re.DOTALL)


def weights_id_problem(value: object) -> str | None:
    """Why `value` cannot be a model_weights_id, or None.

    It goes into a file name, so it must keep that name one path component: no `/`, no `\\`
    (a separator where the checkpoint may be read on Windows), no NUL, not `.` or `..`, and
    at most WEIGHTS_ID_BYTES of UTF-8. Spaces, `+`, `:`, `=`, non-ASCII and other characters
    are fine, as RLinf writes them (printing escapes control characters).
    """
    if not isinstance(value, str):
        return f"model_weights_id must be a string, got {shown(value)}"
    why = None
    if value in (".", ".."):
        why = "is a directory name"
    elif "/" in value or "\\" in value:
        why = "holds a path separator ('/' or '\\')"
    elif "\0" in value:
        why = "holds a NUL character"
    else:
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            why = "is not valid Unicode (a lone surrogate)"
        else:
            if size > WEIGHTS_ID_BYTES:
                why = f"is {size} bytes of UTF-8, more than the {WEIGHTS_ID_BYTES} a file name leaves it"
    if why is None:
        return None
    return f"model_weights_id {shown(value)} {why}; it must be one safe path component of a file name"


def check_weights_id(value: object, where: str) -> str:
    """Return `value` if it is a safe model_weights_id (`weights_id_problem`), else raise naming `where`."""
    from rbtool.errors import CheckpointError

    problem = weights_id_problem(value)
    if problem is not None:
        raise CheckpointError(f"{where}: {problem}")
    assert isinstance(value, str)
    return value


def trajectory_file_name(trajectory_id: int, model_weights_id: str, fmt: str) -> str:
    """The file name of a trajectory, as the reference implementation spells it."""
    return trajectory_file_names((trajectory_id,), (model_weights_id,), fmt)[0]


def trajectory_file_names(ids: Iterable[int], model_weights_ids: Iterable[str], fmt: str) -> list[str]:
    """trajectory_file_name of many trajectories at once."""
    return [f"trajectory_{i}_{w}.{fmt}" for i, w in zip(ids, model_weights_ids, strict=True)]


def parse_trajectory_file_name(name: str) -> tuple[int, str, str] | None:
    """(id, model_weights_id, format) parsed from a trajectory file name, or None."""
    match = TRAJECTORY_FILE_RE.match(name)
    if match is None or not is_id_text(match.group(1), leading_zeros=True):
        return None  # an id beyond int64 names no trajectory: the file is a stray
    if weights_id_problem(match.group(2)) is not None:
        return None  # a name no writer makes (`trajectory_0_...pt`): a stray
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
