"""What a buffer's load_checkpoint works out before it changes anything.

`stage`: a checkpoint directory's window held before the load changes the buffer
(auto_save off). `buffer_index`: the index the buffer keeps of a loaded one.

`open_view`'s directory check (the directory listed, every listed name looked for in the
listing: 1.3-1.5 s of a million-file load) tells what the held window's reads show anyway:
each window file opened without following links and read whole, then parsed as its index
entry says. So a load that holds its window reads the index alone, holds the window into a
store of its own, and the buffer takes both at once. When anything stops the hold (a
missing file, a link, a damaged or unusual file, a window over the budget), nothing has
changed and the load runs as before, the directory check first, so every refusal, drop and
warning is what it was. Only a window of every listed trajectory is held first (a load that
keeps fewer, or one rank's block, must still check the files it does not read).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rbtool.buffer.sampling import effective_window
from rbtool.buffer.storage import FileMap, Signature, TrajectoryStore, hold_window, recorded_signature
from rbtool.files.dirs import CheckpointView, open_view
from rbtool.files.index import Index, window_of, window_start
from rbtool.format.bounded import gc_paused


@dataclass
class Staged:
    """A view read without its directory check, and its window held in `store` (None where
    the window could not be held: then `view` is checked as open_view checks it)."""

    view: CheckpointView
    store: TrajectoryStore | None = None
    tids: list[int] = field(default_factory=list)  # the held window, in order
    columns: dict[Any, Any] = field(default_factory=dict)
    specs: dict[Any, Any] = field(default_factory=dict)


def stage(
    path: str | Path,
    rank: tuple[int, int] | None,
    capacity: int,
    sample_window_size: int,
    budget: int,
    new_store: Callable[[], TrajectoryStore],
    recorded_cache: dict[str, Signature],
    extra_fields: bool,
) -> Staged | None:
    """The window of the checkpoint directory `path` held as a load with auto_save off would
    hold it; without a held window (`store` None) where it cannot be, and None where the
    load must run as before (a rank's block, `rank` = (world size, rank), or a rank tree)."""
    if rank is not None or not budget:
        return None
    view = open_view(path, check_files=False)
    if view.is_tree:
        return None
    index = view.index
    unheld = Staged(view)  # the view read here, checked by the caller
    if index.trajectory_format != "pt":
        return unheld
    files = window_of(index.id_list, capacity)  # what the load keeps (SPEC §3, auto_save off)
    n = len(index.id_list)
    want = n - window_start(n, effective_window(sample_window_size))
    tids = files[len(files) - min(want, len(files)) :]
    if not tids or len(tids) != n:  # the check covers every listed file: all must be read
        return unheld
    with gc_paused():  # a million names, and no cycle
        view.names = [dict(zip(files, view.index.file_names(files), strict=True))]
    store = new_store()
    store.set_files(FileMap(files, view.place_of, view.places_of), pin=True, follow=False)
    entries = index.entries
    total = sum(entries[i]["num_samples"] for i in tids)

    def recorded(tid: int) -> Signature | None:
        return recorded_signature_of(index, tid, recorded_cache, extra_fields)

    def record(ids: list[int], signature: Signature, where: Callable[[int], Path | None]) -> None:
        store.note_signatures(ids, signature, recorded if index.schemas else None, where)

    held = hold_window(store, tids, index.shapes, total, budget, record)
    if held is None:
        store.clear()  # its pinned files are let go
        return unheld
    return Staged(view, store, tids, *held)


def buffer_index(index: Index, seed: int | None, copy_entries: bool) -> Index:
    """The index a buffer keeps of a loaded checkpoint's `index` (entries copied when the
    caller may still hold them), with the buffer's seed and no metadata of the checkpoint's."""
    entries = index.entries
    return Index(
        entries={i: dict(entries[i]) for i in index.id_list} if copy_entries else dict(entries),
        id_list=list(index.id_list),
        trajectory_counter=index.trajectory_counter,
        seed=seed,
        trajectory_format=index.trajectory_format,
        schemas=dict(index.schemas),
    )


def recorded_signature_of(
    index: Index, tid: int, cache: dict[str, Signature], extra_fields: bool
) -> Signature | None:
    """The signature the index entry of `tid` records (its schema's, made once per digest
    into `cache`), or None where it records none."""
    digest = index.entries[tid].get("schema")
    if digest is None:
        return None
    found = cache.get(digest)
    if found is None and digest in index.schemas:
        found = cache[digest] = recorded_signature(index.schemas[digest], extra_fields)
    return found
