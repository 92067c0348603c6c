"""Sources of trajectories to add: files, folders of files, checkpoint directories.

Shared by building a checkpoint from files and by `ingest`: each source is listed in order
and every file is opened safely and checked before anything is written.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rbtool.errors import CheckpointError, CheckpointNotFoundError
from rbtool.files import trajfile
from rbtool.files.dirs import is_rank_tree, open_checkpoint, open_view, parent_of_checkpoints
from rbtool.files.ptheader import TensorSpec, UnusualLayout, read_header
from rbtool.format import is_checkpoint_dir
from rbtool.format.layout import TrajectoryInfo, describe_stored, field_schema, schema_digest


@dataclass
class Item:
    """One trajectory found in a source: its file, and its index entry when a directory had one."""

    path: Path
    entry: dict[str, Any] | None = None


_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> tuple[Any, ...]:
    """Sort key under which `t2.pt` comes before `t10.pt` (digit runs compare as numbers)."""
    return tuple(int(part) if part.isdigit() else part for part in _DIGITS.split(name))


@dataclass
class Skipped:
    """Something a source held that is not added, and why."""

    path: Path
    reason: str

    def as_json(self) -> dict[str, str]:
        return {"source": str(self.path), "reason": self.reason}


@dataclass
class Collected:
    """The trajectory files of some sources, in order, and what was passed over."""

    items: list[Item] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


def _is_under(path: Path, others: Sequence[Path], folder_real: Path | None = None) -> bool:
    """Whether `path` resolves to one of `others` or inside one (`folder_real`: its folder,
    resolved already, for an entry that is not a symlink)."""
    if not others:
        return False
    if folder_real is not None and not path.is_symlink():
        real = folder_real / path.name
    else:
        real = Path(os.path.realpath(path))
    return any(real == o or o in real.parents for o in others)


def _directory_items(path: Path) -> list[Item] | None:
    """A checkpoint's items in its list order, a rank tree's in its merge's; None for a plain folder."""
    if is_checkpoint_dir(path):
        src_dir, index = open_checkpoint(path, strict=True)
        return [Item(src_dir / index.file_name(i), dict(index.entries[i])) for i in index.id_list]
    if is_rank_tree(path):  # the merge of its ranks, in its merged list order
        view = open_view(path, strict=True)
        return [Item(view.file_of(i), dict(view.index.entries[i])) for i in view.index.id_list]
    return None


def _walk(folder: Path, recursive: bool, exclude: Sequence[Path], found: Collected) -> int:
    """Add a plain folder's trajectory files in natural order; returns how many were found."""
    count = 0
    folder_real = Path(os.path.realpath(folder))
    for entry in sorted(folder.iterdir(), key=lambda p: natural_key(p.name)):
        if entry.name.startswith("."):
            continue  # hidden: a writer's temporary files, locks, staging
        if _is_under(entry, exclude, folder_real):
            found.skipped.append(Skipped(entry, "the destination itself"))
        elif entry.is_dir():
            if not recursive:
                found.skipped.append(Skipped(entry, "a folder (not descended into)"))
                continue
            inner = _directory_items(entry)
            if inner is None:
                count += _walk(entry, recursive, exclude, found)
            else:
                found.items.extend(inner)
                count += len(inner)
        elif entry.suffix in (".pt", ".pkl") and entry.is_file():
            found.items.append(Item(entry))
            count += 1
        else:
            found.skipped.append(Skipped(entry, "not a trajectory file (.pt or .pkl)"))
    return count


def collect_sources(
    sources: Sequence[str | os.PathLike[str]], *, recursive: bool = False, exclude: Sequence[Path] = ()
) -> Collected:
    """Trajectory files named by `sources`, in order, and what was skipped.

    A checkpoint or buffer directory gives its list order, a folder of rank_* checkpoints
    the list order of their merge; any other folder gives its `.pt`/`.pkl` files in natural
    order (`t2` before `t10`), and with `recursive` its subfolders' in place (a checkpoint
    among them in its list order); a file gives itself. Entries under `exclude` (resolved
    paths) are skipped.
    """
    found = Collected()
    for source in sources:
        path = Path(source)
        if path.is_dir():
            inner = _directory_items(path)
            if inner is not None:
                found.items.extend(inner)
            elif _walk(path, recursive, exclude, found) == 0:
                raise CheckpointError(
                    parent_of_checkpoints(path) or f"{path}: holds no trajectory files (.pt or .pkl)"
                )
        elif path.is_file():
            if path.suffix not in (".pt", ".pkl"):
                raise CheckpointError(f"{path}: not a trajectory file (expected .pt or .pkl)")
            found.items.append(Item(path))
        else:
            raise CheckpointNotFoundError(f"{path}: no such file or directory")
    return found


def collect_items(sources: Sequence[str | os.PathLike[str]]) -> list[Item]:
    """The trajectory files of `sources`, in order (see collect_sources)."""
    return collect_sources(sources).items


@dataclass
class Checked:
    """A trajectory file that was opened and checked, ready to be added under a new id."""

    path: Path
    info: TrajectoryInfo
    sha256: str | None = None
    uuid: str | None = None
    schema: list[list[Any]] | None = None  # layout.field_schema of its contents
    schema_digest: str | None = None  # layout.schema_digest of `schema`


def check_item(item: Item, data: bytes | None = None, header: Any = None) -> Checked:
    """Open a trajectory file safely and check its tensors.

    A `.pt` file is checked from its header (rbtool.files.ptheader: structure and every tensor's
    declared place, no tensor data loaded), unless its layout is one only torch's loader
    reads; `.pkl` files are loaded. `data`: the file's bytes, when read already; `header`:
    read_header's verdict on them (the header, or the error it raises), when known already.
    """
    traj: dict[str, Any] | None = None
    kind: type | None = None
    if item.path.suffix == ".pt":
        try:
            if isinstance(header, Exception):
                raise header
            traj, kind = header if header is not None else read_header(item.path, data), TensorSpec
        except UnusualLayout:
            traj = None
    if traj is None:
        traj = trajfile.load(item.path, mmap=True)
    info, schema, digest = _facts(traj, item.path, kind)
    if info.max_episode_length is None and "max_episode_length" not in traj:
        mel = item.entry.get("max_episode_length") if item.entry else None
        info = TrajectoryInfo(info.shape, mel if mel is not None else info.shape[0], info.model_weights_id)
    if item.entry is not None and list(item.entry["shape"][:2]) != list(info.shape[:2]):
        raise CheckpointError(
            f"{item.path}: tensors are [T, B] = {list(info.shape[:2])} but its index entry says "
            f"{list(item.entry['shape'][:2])}"
        )
    sha = None
    if item.entry is not None:
        size = len(data) if data is not None else item.path.stat().st_size  # the bytes checked
        sha = item.entry.get("sha256") if item.entry.get("file_bytes") == size else None
    return Checked(item.path, info, sha, schema=schema, schema_digest=digest)


# Headers are shared by the files of one structure (rbtool.files.ptheader): what they say about the
# trajectory is worked out once per header, when it does not depend on the file's name.
_FACTS: dict[int, tuple[dict[str, Any], TrajectoryInfo, list[list[Any]], str]] = {}


def _facts(
    traj: dict[str, Any], path: Path, kind: type | None
) -> tuple[TrajectoryInfo, list[list[Any]], str]:
    """describe_stored, field_schema and its schema_digest of a trajectory (or of a shared
    header, once)."""
    shared = kind is TensorSpec and traj.get("model_weights_id") is not None
    known = _FACTS.get(id(traj)) if shared else None
    if known is not None and known[0] is traj:
        return known[1], known[2], known[3]
    info = describe_stored(traj, path.name, str(path), kind)
    schema = field_schema(traj, info.shape[0], kind)
    digest = schema_digest(schema)
    if shared:
        if len(_FACTS) >= 4096:
            _FACTS.clear()
        _FACTS[id(traj)] = (traj, info, schema, digest)
    return info, schema, digest
