"""Checkpoint directories on disk: find the checkpoints at a path, open one for reading.

A path is one checkpoint (or buffer directory), or a folder of `rank_<r>` checkpoints taken
in numeric rank order (`rank_2` before `rank_10`). Readers see either through a
`CheckpointView`: the merged index and where each trajectory's file is. This module never
imports torch.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rbtool.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    LooseFilesError,
    MissingTrajectoryFilesError,
    RankLayoutWarning,
)
from rbtool.files.index import Index, read_index
from rbtool.format import escapes, is_checkpoint_dir, parse_trajectory_file_name
from rbtool.format.ranknames import rank_number


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
        raise CheckpointNotFoundError(f"{root}: no such file or directory")
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory; give a checkpoint or buffer directory")
    if is_checkpoint_dir(root) or has_trajectory_files(root):
        return [root]
    ranks = rank_dirs(root)
    if not ranks:
        loose = folder_of_loose_files(root)
        if loose is not None:
            raise LooseFilesError(loose, str(root))
        parent = parent_of_checkpoints(root)
        if parent is not None:
            raise CheckpointError(parent)
        # nothing here: RLinf's load raises FileNotFoundError ("Metadata not found") for this too
        raise CheckpointNotFoundError(
            f"{root}: neither a checkpoint (no metadata.json, trajectory_index.json or trajectory "
            "files) nor a folder of rank_* checkpoints"
        )
    return ranks


def parent_of_checkpoints(root: Path) -> str | None:
    """When `root` is no checkpoint but holds checkpoints that are not rank_* directories (a parent
    of several runs), the message that names them and the path to give; else None."""
    try:
        with os.scandir(root) as it:
            children = sorted(e.name for e in it if e.is_dir() and not e.name.startswith("."))
    except OSError:
        children = []
    held = [name for name in children if is_checkpoint_dir(root / name)]
    if held:
        shown = ", ".join(held[:5]) + (f", ... ({len(held)} in all)" if len(held) > 5 else "")
        return (
            f"{root}: not a checkpoint but a folder holding {len(held)} checkpoint "
            f"{'directory' if len(held) == 1 else 'directories'} ({shown}), not named rank_*; "
            f"give one of them, e.g. {root / held[0]}"
        )
    return None


def folder_of_loose_files(root: Path) -> str | None:
    """When `root` is no checkpoint but holds loose .pt/.pkl files (and no checkpoint), the
    message that names them; else None."""
    try:
        with os.scandir(root) as it:
            loose = sorted(e.name for e in it if e.is_file() and e.name.endswith((".pt", ".pkl")))
    except OSError:
        return None
    if not loose or parent_of_checkpoints(root) is not None:
        return None
    shown = ", ".join(loose[:3]) + (f", ... ({len(loose)} in all)" if len(loose) > 3 else "")
    return (
        f"{root}: not a checkpoint but a folder of {len(loose)} loose trajectory "
        f"{'file' if len(loose) == 1 else 'files'} ({shown})"
    )


def is_rank_tree(path: str | os.PathLike[str]) -> bool:
    """True if `path` is a folder of rank_* checkpoints rather than a checkpoint itself."""
    root = Path(path)
    return (
        root.is_dir()
        and not is_checkpoint_dir(root)
        and not has_trajectory_files(root)
        and any(is_checkpoint_dir(d) for d in rank_dirs(root))
    )


def missing_files(directory: Path, index: Index) -> list[int]:
    """Ids whose trajectory files are not in `directory` (as regular files, symlinks followed).

    One directory listing instead of a stat per id: a million-entry index is checked in
    a fraction of a second.
    """
    return _missing(directory, index)[0]


def _missing(directory: Path, index: Index) -> tuple[list[int], list[str]]:
    """missing_files, and the file name of each listed id (in id_list order)."""
    try:
        with os.scandir(directory) as it:
            entries = [e for e in it if e.is_file()]
    except OSError:
        entries = []
    present = {e.name for e in entries}
    names = index.file_names(index.id_list)
    links = {e.name for e in entries if e.is_symlink()}
    listed = links.intersection(names) if links else set()
    outside = [(n, t) for n in sorted(listed) if (t := escapes(directory, n)) is not None]
    if outside:
        shown = ", ".join(f"{n} -> {t}" for n, t in outside[:5])
        raise CheckpointError(
            f"{directory}: {len(outside)} listed file(s) are symlinks to files outside the checkpoint "
            f"({shown}); refused"
        )
    if present.issuperset(names):
        return [], names
    missing = [i for i, n in zip(index.id_list, names, strict=True) if n not in present]
    return missing, names


def open_checkpoint(path: str | os.PathLike[str], *, strict: bool = True) -> tuple[Path, Index]:
    """Read a checkpoint's index; refuse (strict) or drop (non-strict) ids whose files are missing."""
    directory, index, _ = _open_checkpoint(Path(path), strict)
    return directory, index


def _open_checkpoint(directory: Path, strict: bool) -> tuple[Path, Index, list[int]]:
    """open_checkpoint, also returning the ids a non-strict open dropped."""
    directory, index, missing, _ = _open_named(directory, strict)
    return directory, index, missing


def _open_named(
    directory: Path, strict: bool, index: Index | None = None
) -> tuple[Path, Index, list[int], dict[int, str]]:
    """_open_checkpoint, also returning each kept id's file name (`index`: the directory's,
    read already)."""
    index = read_index(directory) if index is None else index
    missing, names = _missing(directory, index)
    named = dict(zip(index.id_list, names, strict=True))
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
        for i in gone:
            named.pop(i, None)
    return directory, index, missing, named


# ------------------------------------------------------------------ views
# What readers say of a view whose inputs' ids collided (SPEC §4's merge rule).
RENUMBERED_NOTE = (
    "ids renumbered: the rank directories' ids collide, so their merge numbers every trajectory "
    "from 0 by (old id, rank order)"
)


@dataclass
class CheckpointView:
    """A checkpoint as readers see it: one directory, or the merge of a folder of rank_* ones.

    `index` is the merged index (SPEC §4: unique ids kept and lists concatenated in rank
    order; colliding ids renumbered from 0 by (old id, rank order)). A trajectory's file is
    `file_of(id)`: for a rank tree the files live in several directories, under their old ids.
    """

    path: Path
    index: Index
    dirs: list[Path]
    indexes: list[Index]
    # id -> (input number, old id); None when the view is one directory with its own ids
    origin: dict[int, tuple[int, int]] | None = None
    renumbered: bool = False
    dropped: list[tuple[Path, int]] = field(default_factory=list)
    # each input's file names by its own ids, where they were worked out already
    names: list[dict[int, str] | None] = field(default_factory=list)

    @property
    def is_tree(self) -> bool:
        """True when the view reads more than the one directory it was given."""
        return len(self.dirs) != 1 or self.dirs[0] != self.path

    def file_of(self, trajectory_id: int) -> Path:
        """The file holding trajectory `trajectory_id` (an id of the merged index)."""
        directory, name = self.place_of(trajectory_id)
        return directory / name

    def place_of(self, trajectory_id: int) -> tuple[Path, str]:
        """file_of as (directory, file name), without building a Path (a million ids are
        named in a fraction of a second)."""
        n, old = (0, trajectory_id) if self.origin is None else self.origin[trajectory_id]
        names = self.names[n] if n < len(self.names) else None
        name = names.get(old) if names is not None else None
        return self.dirs[n], name if name is not None else self.indexes[n].file_name(old)

    def places_of(self, trajectory_ids: Sequence[int]) -> list[tuple[Path, str]]:
        """place_of of each id; the names worked out at the open are looked up at once."""
        names = self.names[0] if self.origin is None and self.names else None
        if names is None:
            return [self.place_of(i) for i in trajectory_ids]
        try:
            found = list(map(names.__getitem__, trajectory_ids))
        except KeyError:
            return [self.place_of(i) for i in trajectory_ids]
        directory = self.dirs[0]
        return [(directory, name) for name in found]

    def source_of(self, trajectory_id: int) -> tuple[Path, int]:
        """(checkpoint directory, id in that directory) of a merged id."""
        if self.origin is None:
            return self.dirs[0], trajectory_id
        n, old = self.origin[trajectory_id]
        return self.dirs[n], old

    def mapping(self) -> list[dict[str, Any]]:
        """Old id to new id per input, when ids were renumbered (else empty)."""
        if not self.renumbered or self.origin is None:
            return []
        return [
            {"input": str(self.dirs[n]), "old_id": old, "new_id": new}
            for new, (n, old) in ((i, self.origin[i]) for i in self.index.id_list)
        ]

    def merge_map(self) -> dict[int, dict[str, Any]] | None:
        """`mapping()` by new id when ids were renumbered, else None: what writers record."""
        mapping = self.mapping()
        return {m["new_id"]: m for m in mapping} if mapping else None

    def renumbered_ids(self) -> int:
        """How many merged ids differ from the id their trajectory has in its own directory."""
        if not self.renumbered or self.origin is None:
            return 0
        return sum(1 for new, (_, old) in self.origin.items() if new != old)

    def dropped_ids(self) -> list[int]:
        """Ids left out for missing files (ids of the directory that listed them)."""
        return [i for _, i in self.dropped]


def shard_counter(index: Index) -> int:
    """The source counter a shard recorded (0 when it records none)."""
    info = index.extra_metadata.get("shard")
    value = info.get("source_trajectory_counter", 0) if isinstance(info, dict) else 0
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def merge_indexes(dirs: Sequence[Path], indexes: Sequence[Index], path: Path | None = None) -> CheckpointView:
    """The view of several checkpoints merged by SPEC §4's rule, in the order given."""
    if not indexes:
        raise CheckpointError("no checkpoint to read")
    root = Path(path) if path is not None else dirs[0]
    first = indexes[0]
    if len(indexes) == 1 and root == dirs[0]:
        return CheckpointView(root, first, list(dirs), list(indexes))
    all_ids = [i for idx in indexes for i in idx.id_list]
    renumber = len(set(all_ids)) != len(all_ids)
    merged = Index(seed=first.seed, trajectory_format=first.trajectory_format)
    for idx in indexes:  # recorded field schemas are named by digest: the union serves all
        merged.schemas.update(idx.schemas)
    origin: dict[int, tuple[int, int]] = {}
    if renumber:
        order = sorted((i, n) for n, idx in enumerate(indexes) for i in idx.id_list)
        for new_id, (old_id, n) in enumerate(order):
            entry = dict(indexes[n].entries[old_id])
            entry["trajectory_id"] = new_id
            merged.entries[new_id] = entry
            merged.id_list.append(new_id)
            origin[new_id] = (n, old_id)
        merged.trajectory_counter = len(order)
    else:
        counter = 0
        for n, idx in enumerate(indexes):
            for i in idx.id_list:
                merged.entries[i] = dict(idx.entries[i])
                merged.id_list.append(i)
                origin[i] = (n, i)
            counter = max(counter, idx.trajectory_counter, shard_counter(idx))
        merged.trajectory_counter = max(counter, merged.next_counter())
    return CheckpointView(root, merged, list(dirs), list(indexes), origin, renumber)


def open_view(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    strict: bool = True,
    check_files: bool = True,
) -> CheckpointView:
    """Open a checkpoint, a rank tree, or several of either (merged in the order given).

    `strict` refuses ids whose files are missing; non-strict drops them before merging.
    `check_files=False` reads only the JSON files (nothing is dropped or refused for files).
    """
    given = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    if not given:
        raise CheckpointError("no checkpoint to read")
    dirs = [d for p in given for d in checkpoint_dirs(p)]
    indexes: list[Index] = []
    dropped: list[tuple[Path, int]] = []
    names: list[dict[int, str] | None] = []
    for d in dirs:
        if check_files:
            _, idx, missing, named = _open_named(d, strict)  # the index read once, missing ids kept
            dropped.extend((d, i) for i in missing)
            names.append(named)
        else:
            idx = read_index(d)
            names.append(None)
        indexes.append(idx)
    root = Path(given[0]) if len(given) == 1 else dirs[0].parent
    view = merge_indexes(dirs, indexes, root)
    view.dropped = dropped
    view.names = names
    return view


def check_files(view: CheckpointView, strict: bool) -> CheckpointView:
    """A one-directory view opened with `check_files=False`, as open_view opens it with the
    check (the same refusal, or the same ids dropped), its index not read again."""
    assert not view.is_tree and view.origin is None
    directory, index, missing, named = _open_named(view.dirs[0], strict, view.index)
    checked = CheckpointView(view.path, index, [directory], [index])
    checked.dropped, checked.names = [(directory, i) for i in missing], [named]
    return checked


def warn_layout(view: CheckpointView, world_size: int | None, rank: int | None = None) -> None:
    """Warn when a rank layout recorded by a shard does not match how it is being loaded.

    A rank tree whose ranks were written for another number of ranks (one is missing, or
    they come from different shards), and a rank directory loaded distributed over a world
    size other than the one it was written for.
    """
    infos = [idx.extra_metadata.get("shard") for idx in view.indexes]
    layouts = [(i.get("rank"), i.get("world_size")) if isinstance(i, dict) else None for i in infos]
    if view.is_tree:
        sizes = {ws for lay in layouts if lay is not None for _, ws in [lay]}
        numbers = [rank_number(d.name) for d in view.dirs]
        recorded = [lay[0] if lay is not None else None for lay in layouts]
        if sizes and (
            len(sizes) > 1
            or sizes != {len(view.dirs)}
            or any(r is not None and n is not None and r != n for r, n in zip(recorded, numbers, strict=True))
        ):
            shown = ", ".join(str(s) for s in sorted(sizes, key=str))
            warnings.warn(
                RankLayoutWarning(
                    f"{view.path}: holds {len(view.dirs)} rank directories, but they were written "
                    f"for world size {shown}; some ranks may be missing or come from another shard"
                ),
                stacklevel=3,
            )
        return
    layout = layouts[0]
    if world_size is not None and layout is not None and layout[1] == world_size:
        part = "rank blocks" if rank is None else f"rank {rank}'s block"
        got = (
            ""
            if rank is None
            else f" ({view.index.rank_block(world_size, rank).size} of its {view.index.size})"
        )
        warnings.warn(
            RankLayoutWarning(
                f"{view.path}: is already rank {layout[0]} of world size {layout[1]}; splitting it again "
                f"by world size {world_size} yields {part} of this one rank's trajectories{got}, not rank "
                f"{layout[0] if rank is None else rank} of the checkpoint it was sharded from"
            ),
            stacklevel=3,
        )
    elif world_size is not None and layout is not None and layout[1] != world_size:
        warnings.warn(
            RankLayoutWarning(
                f"{view.path}: was written as rank {layout[0]} of world size {layout[1]}, "
                f"but is being loaded with world size {world_size}"
            ),
            stacklevel=3,
        )
