"""TrajectoryStore: where each trajectory of a buffer is, and what sampling knows of it.

A trajectory is in memory, in a file (maybe pinned open by a descriptor), opened as a
FlatView (a bounded set, least recently used dropped first), or held as bytes (small files,
RawTrajectory, bounded); its signature comes from memory, the index's record, its file's
header or the file opened, whichever is known first.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Iterator, MutableMapping, Sequence
from pathlib import Path
from typing import Any

from rbtool.buffer.rowmap import RowMap
from rbtool.buffer.rowmap import available as rowmap_available
from rbtool.buffer.storage.held import HeldBlocks, HeldLayout, RawTrajectory
from rbtool.buffer.storage.ptfile import (
    PinnedFile,
    close_open_files,
    file_header,
    name_to_read,
    open_trajectory,
    read_small,
)
from rbtool.buffer.storage.view import FlatView, Schema, check_shape
from rbtool.buffer.storage.window import Signature, signature_of, view_signature
from rbtool.errors import RbtoolError, TrajectoryFileError
from rbtool.files import trajfile
from rbtool.files.ptheader import UnusualLayout, iter_specs
from rbtool.progress import Progress

# Small files held as bytes for sampling, least recently used dropped first beyond this.
RAW_CACHE_MAX_BYTES = 384 << 20


class FileMap(MutableMapping[int, Path]):
    """Where each trajectory's file is. The files of a loaded checkpoint are named from
    `place(id)` ((directory, file name)) when asked for: building a million Paths up front
    takes seconds, and a held window never asks for most of them. Files set later are kept
    as given."""

    def __init__(
        self,
        named: Iterable[int] = (),
        place: Callable[[int], tuple[Path, str]] | None = None,
        place_many: Callable[[Sequence[int]], list[tuple[Path, str]]] | None = None,
    ) -> None:
        self._paths: dict[int, Path] = {}
        self._named: dict[int, None] = dict.fromkeys(named)
        self._place = place
        self._place_many = place_many  # place() of many named ids at once

    @classmethod
    def of(cls, paths: dict[int, Path]) -> FileMap:
        files = cls()
        files._paths = dict(paths)
        return files

    def place(self, tid: int) -> tuple[Path, str]:
        """(directory, file name) of a trajectory's file; KeyError when it has none."""
        path = self._paths.get(tid)
        if path is not None:
            return path.parent, path.name
        if tid in self._named and self._place is not None:
            return self._place(tid)
        raise KeyError(tid)

    def places(self, tids: Sequence[int], skip: Container[int] = ()) -> list[tuple[Path, str]]:
        """place() of each id, those of a loaded checkpoint at once when its view can name
        them so; an id in `skip` gets (None, "") (a trajectory held in memory)."""
        if not self._paths and not skip and self._place_many is not None:
            return self._place_many(tids)
        return [self.place(t) if t not in skip else (None, "") for t in tids]  # type: ignore[misc]

    def __getitem__(self, tid: int) -> Path:
        path = self._paths.get(tid)
        if path is not None:
            return path
        directory, name = self.place(tid)
        return directory / name

    def __setitem__(self, tid: int, path: Path) -> None:
        self._named.pop(tid, None)
        self._paths[tid] = path

    def __delitem__(self, tid: int) -> None:
        if self._paths.pop(tid, None) is None and self._named.pop(tid, 0) is not None:
            raise KeyError(tid)

    def __contains__(self, tid: object) -> bool:
        return tid in self._paths or tid in self._named

    def __iter__(self) -> Iterator[int]:
        yield from self._paths
        yield from self._named

    def __len__(self) -> int:
        return len(self._paths) + len(self._named)


class TrajectoryStore:
    """Where each trajectory of a buffer is: in memory, in a file (maybe pinned open).

    Opened trajectories are kept as FlatViews, least recently used dropped first beyond
    `max_open`. Methods that change the maps take `lock` (shared with the writer thread).
    """

    def __init__(
        self,
        *,
        max_open: int,
        extra_fields: bool,
        lock: threading.RLock,
        row_map: bool = False,
        row_map_budget: int | None = None,
    ) -> None:
        self.max_open = max_open
        self.extra_fields = extra_fields
        self.lock = lock
        self.memory: dict[int, dict[str, Any]] = {}
        self.files = FileMap()
        self.follow_links = True  # see set_files
        self.pins: dict[int, PinnedFile] = {}
        self.views: OrderedDict[int, FlatView] = OrderedDict()
        # what sampling knows of each trajectory without its data: its signature, and the
        # header of its file (so that reopening a view reads no structure again)
        self.signatures: dict[int, Signature] = {}
        self.headers: dict[int, dict[str, Any]] = {}
        self._interned: dict[Signature, Signature] = {}
        self.recorded: set[int] = set()  # ids whose signature came from the index's record
        self._signature_keys: dict[tuple[Any, ...], Signature] = {}
        self._by_header: dict[int, tuple[dict[str, Any], Signature]] = {}
        # (header id, t, b) -> how files of that header are held as bytes
        self._raw_layouts: dict[tuple[int, int, int], HeldLayout] = {}
        # small files held as bytes (RawTrajectory), and the ids known not to be held so
        self.raws: OrderedDict[int, RawTrajectory] = OrderedDict()
        self._raw_lock = threading.Lock()  # the held bytes are filled by several readers at once
        self.raw_bytes = 0
        self.held = HeldBlocks()
        self.not_raw: set[int] = set()
        # large rows of held files, mapped side by side (None: read with pread)
        self.rowmap: RowMap | None = None
        if row_map and rowmap_available():
            self.rowmap = RowMap(row_map_budget)

    def holds(self, tid: int) -> bool:
        return tid in self.memory or tid in self.files

    def __len__(self) -> int:
        return len(self.files) + sum(1 for tid in self.memory if tid not in self.files)

    def put(self, tid: int, traj: dict[str, Any]) -> None:
        with self.lock:
            self.memory[tid] = traj

    def set_files(self, files: FileMap, *, pin: bool, follow: bool = True) -> None:
        """Replace everything held by these files (pinned open when `pin`, as many as the
        descriptor budget allows, the first ones first). `follow=False`: the files are opened
        (pinned and read whole for the window) without following symbolic links, so that a
        read that succeeds shows the name is a file of the directory itself."""
        with self.lock:
            self.clear()
            self.files = files
            self.follow_links = follow
            if pin:
                for tid in files:
                    if PinnedFile.budget_spent():
                        break
                    opened = PinnedFile.try_open(files[tid], follow)
                    if opened is not None:
                        self.pins[tid] = opened

    def drop(self, tid: int) -> None:
        with self.lock:
            self.memory.pop(tid, None)
            self.files.pop(tid, None)
            self.views.pop(tid, None)
            self.forget(tid)
            self._drop_raw(tid)
            if self.rowmap is not None:
                self.rowmap.release(tid)
            pinned = self.pins.pop(tid, None)
            if pinned is not None:
                pinned.close()

    def clear_views(self) -> None:
        """Drop every open view (the data stays where it is; views reopen on demand)."""
        with self.lock:
            self.views.clear()
            close_open_files()

    def clear(self) -> None:
        with self.lock:
            self.memory.clear()
            self.files.clear()
            self.views.clear()
            self.signatures.clear()
            self.recorded.clear()
            self.headers.clear()
            with self._raw_lock:
                self.raws.clear()
                self.held.clear()
                self.raw_bytes = 0
            self.not_raw.clear()
            if self.rowmap is not None:
                # a gather may still be reading the old map: it is unmapped when let go
                self.rowmap = RowMap(self.rowmap.budget)
            for pinned in self.pins.values():
                pinned.close()
            self.pins.clear()

    def source(self, tid: int) -> Path | dict[str, Any]:
        """What a checkpoint writer copies for `tid`: its file when that name still holds it."""
        with self.lock:
            held = self.memory.get(tid)
            if held is not None:
                return held
            path = self.files[tid]
            pinned = self.pins.get(tid)
        if pinned is None or pinned.current_path() is not None:
            return path
        return trajfile.load(pinned.read_path, suffix=path.suffix)

    def view(self, tid: int, t: int, b: int) -> FlatView:
        view = self.views.get(tid)
        if view is not None:
            self.views.move_to_end(tid)
            return view
        with self.lock:
            traj = self.memory.get(tid)
            path = self.files.get(tid)
            pinned = self.pins.get(tid)
        if traj is None:
            if path is None:
                raise RbtoolError(f"trajectory {tid} is neither in memory nor on disk")
            traj, info = open_trajectory(path, pinned, self.headers.get(tid))
            check_shape(info, t, b, path)
        try:
            view = FlatView(traj, t, b, extra_fields=self.extra_fields)
        except RbtoolError as exc:
            raise TrajectoryFileError(f"{path or f'trajectory {tid}'}: {exc}") from None
        self.check_recorded(tid, view_signature(view), path)
        self.views[tid] = view
        while len(self.views) > self.max_open:
            self.views.popitem(last=False)
        return view

    def header(self, tid: int) -> dict[str, Any] | None:
        """The header of a held `.pt` file (read once, then kept); None when it has none to read."""
        header = self.headers.get(tid)
        if header is not None:
            return header
        with self.lock:
            path = self.files.get(tid)
            pinned = self.pins.get(tid)
        if path is None or path.suffix != ".pt" or tid in self.memory:
            return None
        try:
            header = file_header(path, pinned)
        except UnusualLayout:
            return None
        self.headers[tid] = header
        return header

    def _drop_raw(self, tid: int) -> None:
        with self._raw_lock:
            raw = self.raws.pop(tid, None)
            if raw is not None:
                self._unhold(raw)
            self.not_raw.discard(tid)

    def _unhold(self, raw: RawTrajectory) -> None:
        """`raw` left the held bytes (called with the lock for held bytes taken)."""
        self.raw_bytes -= raw.data.size
        self.held.free(raw)

    def written(self, tid: int, path: Path) -> None:
        """A held trajectory's file is complete: read it from there and free the memory."""
        with self.lock:
            self.files[tid] = path
            self.memory.pop(tid, None)
            self.not_raw.discard(tid)

    def raw_many(
        self, tids: list[int], shape_of: Callable[[int], tuple[int, int]]
    ) -> list[RawTrajectory | None]:
        """raw() of each id (a batch's drawn files: the held ones under one lock)."""
        with self._raw_lock:
            found = [self.raws.get(tid) for tid in tids]
            for tid, raw in zip(tids, found, strict=True):
                if raw is not None:
                    self.raws.move_to_end(tid)
        for j, raw in enumerate(found):
            if raw is None:
                found[j] = self.raw(tids[j], *shape_of(tids[j]))
        return found

    def raw(self, tid: int, t: int, b: int) -> RawTrajectory | None:
        """The trajectory as bytes (see RawTrajectory), or None (in memory, unusual, .pkl)."""
        with self._raw_lock:
            raw = self.raws.get(tid)
            if raw is not None:
                self.raws.move_to_end(tid)
                return raw
        if tid in self.not_raw:
            return None
        with self.lock:
            path = self.files.get(tid)
            pinned = self.pins.get(tid)
            if path is None or tid in self.memory or path.suffix != ".pt":
                # noted under the lock: written() (the writer thread) clears the note when
                # the trajectory's file is complete, and must not be overtaken by it
                self.not_raw.add(tid)
                return None
        read_path = name_to_read(path, pinned)
        try:
            data = read_small(read_path)
            header = self.headers.get(tid) or file_header(path, pinned, data)
            # headers are shared by files of one structure: so is what is derived from them
            known = self._raw_layouts.get((id(header), t, b))
            if known is None or known.header is not header:
                if len(self._raw_layouts) >= 4096:
                    self._raw_layouts.clear()
                known = HeldLayout(header, str(path), t, b, self.extra_fields)
                self._raw_layouts[(id(header), t, b)] = known
            self.check_recorded(tid, self.header_signature(header), path)
            raw = known.hold(data, path) if data is not None else known.hold_large(tid, path, pinned)
        except UnusualLayout:
            self.not_raw.add(tid)
            return None
        except RbtoolError as exc:
            message = str(exc).replace(str(read_path), str(path))
            if not message.startswith(str(path)):
                message = f"{path}: {message}"
            raise TrajectoryFileError(message) from None
        with self._raw_lock:
            self.headers.setdefault(tid, header)
            held = self.raws.get(tid)
            if held is not None:  # another reader held it first
                return held
            self.held.put(raw)
            self.raws[tid] = raw
            self.raw_bytes += raw.data.size
            while self.raw_bytes > RAW_CACHE_MAX_BYTES and len(self.raws) > 1:
                self._unhold(self.raws.popitem(last=False)[1])
        return raw

    def read_headers(
        self, trajectories: Sequence[tuple[int, int, int]], progress: Progress | None = None
    ) -> None:
        """Read the headers of many held files (tid, T, B) at once, on a few threads.

        A small file is read whole for its header: its bytes are kept too (raw()), so the
        draws that follow find them held. Files without a readable header are left for
        signature() to open, and to report.
        """
        from concurrent.futures import ThreadPoolExecutor

        def read(part: Sequence[tuple[int, int, int]]) -> None:
            for tid, t, b in part:
                with contextlib.suppress(RbtoolError):
                    if self.raw(tid, t, b) is None:
                        self.header(tid)
                if progress is not None:
                    progress(1)

        tids = list(trajectories)
        workers = min(8, 2 * (os.cpu_count() or 1))
        step = -(-len(tids) // workers)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(read, [tids[i : i + step] for i in range(0, len(tids), step)]))

    def intern(self, signature: Signature) -> Signature:
        return self._interned.setdefault(signature, signature)

    def signature(self, tid: int, t: int, b: int, recorded: Signature | None = None) -> Signature:
        """What a batch takes from trajectory `tid` (fields, dtypes, row shapes; fields left out).

        From the first of: what is known already, `recorded` (the index's schema), the
        trajectory in memory, its file's header, the trajectory opened.
        """
        known = self.signatures.get(tid)
        if known is not None:
            return known
        if recorded is not None:
            self.recorded.add(tid)  # checked against the file when it is opened
        else:
            with self.lock:
                traj = self.memory.get(tid)
            if traj is not None:
                recorded = signature_of(traj, self.extra_fields)
            else:
                header = self.header(tid)
                if header is not None:
                    recorded = self.header_signature(header)
                else:
                    view = self.view(tid, t, b)
                    recorded = view_signature(view)
        signature = self.signatures[tid] = self.intern(recorded)
        return signature

    def signatures_of(
        self, tids: Sequence[int], first: int, signature_at: Callable[[int], Signature]
    ) -> list[Signature]:
        """The signatures of the trajectories at window positions `first, first + 1, ...`:
        the known ones looked up at once, the others from `signature_at(position)`."""
        found = list(map(self.signatures.get, tids))
        for k, known in enumerate(found):
            if known is None:
                found[k] = signature_at(first + k)
        return found  # type: ignore[return-value]

    def note_signatures(
        self,
        tids: list[int],
        signature: Signature,
        recorded: Callable[[int], Signature | None] | None,
        where: Callable[[int], Path | None],
    ) -> None:
        """Trajectories' signature as their files (or memory) show it: noted, unless one is
        known already or `recorded(tid)` (its index entry's) is another (then that file is
        left to the row readers, which report the difference when it is drawn). `where(k)`:
        the path of `tids[k]`'s file, named in the error."""
        signature = self.intern(signature)
        known = self.signatures
        if recorded is not None or not known.keys().isdisjoint(tids):  # else nothing to compare
            for k, tid in enumerate(tids):
                seen = known.get(tid)
                other = recorded(tid) if recorded is not None else None
                if (seen is not None and seen is not signature) or (
                    other is not None and self.intern(other) is not signature
                ):
                    raise TrajectoryFileError(
                        f"{where(k) or f'trajectory {tid}'}: its fields differ from its index entry"
                    )
        known.update(dict.fromkeys(tids, signature))

    def header_signature(self, header: dict[str, Any]) -> Signature:
        """signature_of(header), computed once per distinct structure (headers are shared)."""
        known = self._by_header.get(id(header))
        if known is not None and known[0] is header:
            return known[1]
        key = tuple((p, v.dtype, len(v.shape), v.shape[2:]) for p, v in iter_specs(header))
        signature = self._signature_keys.get(key)
        if signature is None:
            signature = self._signature_keys[key] = signature_of(header, self.extra_fields)
        if len(self._by_header) >= 4096:
            self._by_header.clear()
        self._by_header[id(header)] = (header, signature)
        return signature

    def forget(self, tid: int) -> None:
        """Drop what is known of a trajectory that left the window (its data stays held)."""
        self.signatures.pop(tid, None)
        self.recorded.discard(tid)
        self.headers.pop(tid, None)

    def check_recorded(self, tid: int, actual: Signature, path: Path | None) -> None:
        """A trajectory whose signature came from its index entry must hold those fields."""
        if tid in self.recorded and self.intern(actual) is not self.signatures.get(tid):
            raise TrajectoryFileError(
                f"{path or f'trajectory {tid}'}: its fields differ from the schema its index entry "
                "records; rbtool repair rewrites the index from the files"
            )

    def schema(self, tid: int, t: int, b: int) -> Schema:
        return dict(self.signature(tid, t, b)[0])
