"""Checkpoint directories on disk: find the checkpoints at a path, open one for reading.

A path is one checkpoint (or buffer directory), or a folder of `rank_<r>` checkpoints taken
in numeric rank order (`rank_2` before `rank_10`). This module never imports torch.
"""

from __future__ import annotations

import os
from pathlib import Path

from rbtool.errors import CheckpointError, MissingTrajectoryFilesError
from rbtool.format import is_checkpoint_dir, parse_trajectory_file_name
from rbtool.index import Index, read_index


def rank_number(name: str) -> int | None:
    """r for a directory named `rank_<r>`, else None."""
    if name.startswith("rank_") and name[5:].isascii() and name[5:].isdigit():
        return int(name[5:])
    return None


def rank_dirs(directory: Path) -> list[Path]:
    """The `rank_<r>` subdirectories of `directory`, in numeric rank order."""
    ranks = [p for p in directory.iterdir() if rank_number(p.name) is not None and p.is_dir()]
    return sorted(ranks, key=lambda p: rank_number(p.name) or 0)


def has_trajectory_files(directory: Path) -> bool:
    """True if `directory` holds at least one visible file named like a trajectory."""
    with os.scandir(directory) as it:
        return any(not e.name.startswith(".") and parse_trajectory_file_name(e.name) for e in it)


def checkpoint_dirs(path: str | os.PathLike[str]) -> list[Path]:
    """The checkpoints at `path`: itself if it is one, else its rank_* children in rank order."""
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"{root}: no such file or directory")
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory; give a checkpoint or buffer directory")
    if is_checkpoint_dir(root) or has_trajectory_files(root):
        return [root]
    ranks = rank_dirs(root)
    if not ranks:
        raise CheckpointError(
            f"{root}: neither a checkpoint (no metadata.json, trajectory_index.json or trajectory files) "
            "nor a folder of rank_* checkpoints"
        )
    return ranks


def missing_files(directory: Path, index: Index) -> list[int]:
    """Ids whose trajectory files are not in `directory`."""
    return [i for i in index.id_list if not (directory / index.file_name(i)).is_file()]


def open_checkpoint(path: str | os.PathLike[str], *, strict: bool = True) -> tuple[Path, Index]:
    """Read a checkpoint's index; refuse (strict) or drop (non-strict) ids whose files are missing."""
    directory = Path(path)
    index = read_index(directory)
    missing = missing_files(directory, index)
    if missing:
        if strict:
            shown = ", ".join(map(str, missing[:20])) + (" ..." if len(missing) > 20 else "")
            raise MissingTrajectoryFilesError(
                f"{directory}: the index names {len(missing)} trajectory file(s) that do not exist "
                f"(ids {shown})",
                missing,
            )
        gone = set(missing)
        index = index.subset([i for i in index.id_list if i not in gone])
    return directory, index
