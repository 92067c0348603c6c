"""Sources of trajectories to add: files, folders of files, checkpoint directories.

Shared by building a checkpoint from files and by `ingest`: each source is listed in order
and every file is opened safely and checked before anything is written.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rbtool import trajfile
from rbtool.dirs import is_rank_tree, open_checkpoint, open_view
from rbtool.errors import CheckpointError
from rbtool.format import is_checkpoint_dir, parse_trajectory_file_name
from rbtool.layout import TrajectoryInfo, describe_stored


@dataclass
class Item:
    """One trajectory found in a source: its file, and its index entry when a directory had one."""

    path: Path
    entry: dict[str, Any] | None = None


def collect_items(sources: Sequence[str | os.PathLike[str]]) -> list[Item]:
    """Trajectory files named by `sources`, in order.

    A checkpoint or buffer directory gives its list order, a folder of rank_* checkpoints
    the list order of their merge; any other directory gives its
    `.pt`/`.pkl` files by trajectory id (then name); a file gives itself.
    """
    items: list[Item] = []
    for source in sources:
        path = Path(source)
        if path.is_dir():
            if is_checkpoint_dir(path):
                src_dir, index = open_checkpoint(path, strict=True)
                items.extend(
                    Item(src_dir / index.file_name(i), dict(index.entries[i])) for i in index.id_list
                )
            elif is_rank_tree(path):  # the merge of its ranks, in its merged list order
                view = open_view(path, strict=True)
                items.extend(Item(view.file_of(i), dict(view.index.entries[i])) for i in view.index.id_list)
            else:
                files = [
                    p for p in path.iterdir() if p.suffix in (".pt", ".pkl") and not p.name.startswith(".")
                ]

                def order(p: Path) -> tuple[int, str]:
                    parsed = parse_trajectory_file_name(p.name)
                    return (parsed[0] if parsed else -1, p.name)

                items.extend(Item(p) for p in sorted(files, key=order))
                if not files:
                    raise CheckpointError(f"{path}: holds no trajectory files (.pt or .pkl)")
        elif path.is_file():
            if path.suffix not in (".pt", ".pkl"):
                raise CheckpointError(f"{path}: not a trajectory file (expected .pt or .pkl)")
            items.append(Item(path))
        else:
            raise CheckpointError(f"{path}: no such file or directory")
    return items


@dataclass
class Checked:
    """A trajectory file that was opened and checked, ready to be added under a new id."""

    path: Path
    info: TrajectoryInfo
    sha256: str | None = None
    uuid: str | None = None


def check_item(item: Item) -> Checked:
    """Open a trajectory file safely and check its tensors (memory-mapped for `.pt`)."""
    traj = trajfile.load(item.path, mmap=True)
    info = describe_stored(traj, item.path.name, str(item.path))
    if info.max_episode_length is None and "max_episode_length" not in traj:
        mel = item.entry.get("max_episode_length") if item.entry else None
        info = TrajectoryInfo(info.shape, mel if mel is not None else info.shape[0], info.model_weights_id)
    if item.entry is not None and list(item.entry["shape"][:2]) != list(info.shape[:2]):
        raise CheckpointError(
            f"{item.path}: tensors are [T, B] = {list(info.shape[:2])} but its index entry says "
            f"{list(item.entry['shape'][:2])}"
        )
    sha = None
    if item.entry is not None and item.entry.get("file_bytes") == item.path.stat().st_size:
        sha = item.entry.get("sha256")
    return Checked(item.path, info, sha)
