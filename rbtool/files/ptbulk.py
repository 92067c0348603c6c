"""The headers of many small `.pt` files at once, most of them without parsing their zip.

Files one writer saved from trajectories of one structure are the same byte for byte apart
from a few known places: their tensors' bytes, their records' CRC-32s, the directory name
their records sit under (torch names it after the file), torch's serialization id and the
pickle (whose plain values, such as the model_weights_id, differ). A file of the size of a
file already parsed whole (its template), whose every other byte equals the template's and
whose records all sit under one directory name, has the template's zip layout: its
tensors' records are where the template's are. Its header is then the one its own pickle
gives at those places, which read_header has already built for any earlier file with the
same pickle and layout (headers are shared, never changed) and builds once otherwise. Any
file that differs anywhere else is parsed whole by read_header, so every file gets exactly
the header read_header would give it, or its error.

The comparison runs over every file of one size at once (numpy, eight bytes at a time, on
the buffer the files were read into), and so does the pickle's: a file costs its read.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rbtool.errors import RbtoolError
from rbtool.files import ptheader
from rbtool.files.ptheader import SMALL_FILE_BYTES

_CENTRAL = struct.Struct("<4s12xI8xHHH12x")  # signature, crc32, name, extra, comment lengths
_LOCAL_LENGTHS, _LOCAL_NAME = 26, 30  # where a local header's name and extra lengths are, and its name
_CENTRAL_CRC, _CENTRAL_NAME = 16, 46

# Files of these many bytes at most are read whole and compared with a template.
BULK_FILE_BYTES = SMALL_FILE_BYTES


class Template:
    """What a file must match to have the layout of the file `data` (parsed whole).

    `same`: the byte ranges that must equal the template's: every byte read_header reads
    (the central directory and all after it, each local header's signature and name and
    extra lengths, the byteorder and version records) but those of the directory that vary
    from file to file (CRC-32s, the directory part of names; the pickle is compared apart);
    `names`: where each record's
    name starts in the central directory (`central`), and `dir_len` the length of its
    directory part (which must be one name in a file; read_header reads names only there,
    so the local headers' copies of the names vary freely);
    `pickle`: where data.pkl's bytes are; `places`: its tensor records, as read_header keys
    them; `header`: read_header's header of the file (the header of every file that matches
    and has the same pickle).
    """

    def __init__(self, path: Path, data: bytes, header: dict[str, Any]) -> None:
        import numpy as np

        self.size = len(data)
        self.bytes = np.frombuffer(data, dtype=np.uint8)
        records = ptheader.zip_records(
            path, lambda offset, n: memoryview(data)[offset : offset + n], len(data)
        )
        pickles = [r for r in records if r.name.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise ptheader.UnusualLayout("no single data.pkl record")
        prefix = pickles[0].name[: -len("data.pkl")]
        if not prefix or any(not r.name.startswith(prefix) for r in records):
            raise ptheader.UnusualLayout("records under more than one directory")
        dir_len = len(prefix.encode()) - 1  # the name's directory part, without its "/"
        varies: list[tuple[int, int]] = []  # in the directory: what differs from file to file
        read: list[tuple[int, int]] = []  # what read_header reads, besides the directory
        self.names: list[int] = []
        storages = f"{prefix}data/"
        places = []
        self.pickle = (0, 0)
        for record in records:
            start = ptheader.record_data_start(path, record, lambda o, n: data[o : o + n])
            at = record.header_offset
            read += [(at, at + 4), (at + _LOCAL_LENGTHS, at + _LOCAL_NAME)]  # signature, lengths
            if record.name in (f"{prefix}byteorder", f"{prefix}version"):
                read.append((start, start + record.size))
            if record is pickles[0]:
                self.pickle = (start, start + record.size)  # compared apart (headers_of)
            elif record.name.startswith(storages):
                places.append((record.name[len(storages) :], start, record.size))
        self.places = tuple(places)
        # the central directory's entries: their CRC-32s and names vary too
        at = central = self._central_start(data, len(records))
        for _ in records:
            _, _, name_len, extra_len, comment_len = _CENTRAL.unpack_from(data, at)
            varies.append((at + _CENTRAL_CRC, at + _CENTRAL_CRC + 4))
            varies.append((at + _CENTRAL_NAME, at + _CENTRAL_NAME + dir_len))
            self.names.append(at + _CENTRAL_NAME)
            at += _CENTRAL.size + name_len + extra_len + comment_len
        self.dir_len = dir_len
        self.central = (central, at)
        # the directory, the end records and all after them are read whole (the end record
        # is found searching back from the end); of the rest, only what `read` holds
        self.same = _subtract([*read, (central, self.size)], varies)
        self._mask: Any = None
        self._words: tuple[Any, Any, Any] = (None, None, None)
        self.header = header

    @staticmethod
    def _central_start(data: bytes, count: int) -> int:
        at = data.rfind(b"PK\x05\x06")
        _, _, _, _, _, cd_size, cd_offset = struct.unpack_from("<4sHHHHII", data, at)
        if cd_offset == 0xFFFFFFFF or cd_size == 0xFFFFFFFF:
            raise ptheader.UnusualLayout("a zip64 directory")
        return int(cd_offset)

    def matches(self, rows: Any) -> Any:
        """Which of `rows` (files of this size, one per row of a uint8 array, rows maybe
        strided) have its layout. Compared eight bytes at a time, a few rows at once, over
        the runs of words that hold bytes to compare (not the pickle's, not large tensors')."""
        import numpy as np

        if self._mask is None:
            mask = np.zeros(self.size, dtype=np.uint8)
            for start, stop in self.same:
                mask[start:stop] = 0xFF
            whole = self.size // 8 * 8
            self._mask = mask
            words, word_mask = self.bytes[:whole].view(np.uint64), mask[:whole].view(np.uint64)
            at = np.flatnonzero(word_mask)
            self._words = (at, words[at], word_mask[at])
        at, expected, bits = self._words
        whole = self.size // 8 * 8
        ok = np.ones(rows.shape[0], dtype=bool)
        for lo in range(0, rows.shape[0], _CHUNK_ROWS):  # a chunk's words stay in the cache
            part = rows[lo : lo + _CHUNK_ROWS, :whole].view(np.uint64)
            differ = part.take(at, axis=1)  # the words holding bytes to compare, side by side
            np.bitwise_xor(differ, expected, out=differ)
            differ &= bits
            ok[lo : lo + part.shape[0]] &= ~differ.any(axis=1)
        if whole < self.size:
            tail = np.bitwise_xor(rows[:, whole:], self.bytes[whole:]) & self._mask[whole:]
            ok &= ~tail.any(axis=1)
        if self.dir_len:
            ok &= self._one_directory(rows)
        return ok

    def _one_directory(self, rows: Any) -> Any:
        """Which rows name every record in their central directory under one directory: a
        copy of each row's directory with every name's directory part overwritten by the
        first one's is the same as the row's (the copy is made a few rows at a time, so
        that it stays in the cache)."""
        import numpy as np

        start, stop = self.central
        length = self.dir_len
        first = self.names[0] - start
        others = [at - start for at in self.names[1:]]
        ok = np.empty(rows.shape[0], dtype=bool)
        for lo in range(0, rows.shape[0], _CHUNK_ROWS):
            directories = rows[lo : lo + _CHUNK_ROWS, start:stop]
            copy = np.array(directories)
            name = copy[:, first : first + length].copy()
            for at in others:
                copy[:, at : at + length] = name
            ok[lo : lo + copy.shape[0]] = (copy == directories).all(axis=1)
        return ok


_CHUNK_ROWS = 256


def _subtract(ranges: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The bytes of `ranges` outside `holes`, as sorted disjoint [start, stop) ranges."""
    edges: dict[int, int] = {}
    for start, stop in ranges:
        edges[start] = edges.get(start, 0) + 1
        edges[stop] = edges.get(stop, 0) - 1
    for start, stop in holes:
        edges[start] = edges.get(start, 0) - (1 << 20)
        edges[stop] = edges.get(stop, 0) + (1 << 20)
    out: list[tuple[int, int]] = []
    depth = 0
    opened: int | None = None
    for at in sorted(edges):
        depth += edges[at]
        if depth > 0 and opened is None:
            opened = at
        elif depth <= 0 and opened is not None:
            if at > opened:
                out.append((opened, at))
            opened = None
    return out


def read_headers(
    paths: Sequence[Path], datas: Sequence[bytes], templates: dict[int, Template | None] | None = None
) -> list[dict[str, Any] | RbtoolError]:
    """The header of each file (`datas[i]`: all of `paths[i]`'s bytes), or its error.

    Exactly what read_header(path, data) returns or raises (UnusualLayout included), file
    by file; files of one size are compared with a template instead of being parsed (see
    headers_of). `templates` (by file size) keeps the templates for later calls over the
    same files' kind.
    """
    import numpy as np

    out: list[dict[str, Any] | RbtoolError | None] = [None] * len(paths)
    by_size: dict[int, list[int]] = {}
    for k, data in enumerate(datas):
        by_size.setdefault(len(data), []).append(k)
    known = {} if templates is None else templates
    for size, ks in by_size.items():
        if (len(ks) == 1 and templates is None) or not size:
            for k in ks:
                out[k] = _parse(paths[k], datas[k])
            continue
        rows = np.frombuffer(b"".join([datas[k] for k in ks]), dtype=np.uint8).reshape(len(ks), size)
        for k, header in zip(ks, headers_of(rows, _naming(paths, ks), known), strict=True):
            out[k] = header
    return out  # type: ignore[return-value]


def _naming(paths: Sequence[Path], ks: list[int]) -> Callable[[int], Path]:
    return lambda j: paths[ks[j]]


def headers_of(
    rows: Any, where: Callable[[int], Path], templates: dict[int, Template | None]
) -> list[dict[str, Any] | RbtoolError]:
    """read_header's verdict on each of `rows` (a uint8 array of files of one size, one a
    row; rows may be strided, as files read side by side into one buffer are): compared
    with the template of their size (made from the first row when there is none yet), and
    parsed whole only where they differ from it. `where(k)`: the path of row k's file,
    named in errors."""
    import numpy as np

    count, size = rows.shape
    if size not in templates and size:
        templates[size] = _template(where(0), rows[0].tobytes())
    template = templates.get(size)
    if template is None:
        return [_parse(where(k), rows[k].tobytes()) for k in range(count)]
    matched = template.matches(rows)
    start, stop = template.pickle
    pickles = rows[:, start:stop]
    out: list[dict[str, Any] | RbtoolError] = [template.header] * count
    pending = np.flatnonzero(matched)
    if pending.size:
        ours = template.bytes[start:stop]
        groups, first = _same_pickles(pickles if pending.size == count else pickles[pending])
        by_group: list[dict[str, Any] | None] = []
        for k in pending[first].tolist():  # one file of each pickle: its header, once
            pickled = pickles[k]
            if np.array_equal(pickled, ours):
                by_group.append(template.header)
                continue
            known = ptheader.known_header(pickled.tobytes(), template.places)
            parsed = known if known is not None else _parse(where(k), rows[k].tobytes())
            by_group.append(None if isinstance(parsed, RbtoolError) else parsed)
        for k, group in zip(pending.tolist(), groups.tolist(), strict=True):
            header = by_group[group]
            # a file of a pickle read_header refuses: its own verdict
            out[k] = header if header is not None else _parse(where(k), rows[k].tobytes())
    for k in np.flatnonzero(~matched).tolist():
        out[k] = _parse(where(k), rows[k].tobytes())
    return out


def _same_pickles(pickles: Any) -> tuple[Any, Any]:
    """The rows of `pickles` (a uint8 array, one file's data.pkl a row) grouped by their
    bytes: (each row's group, the first row of each group). Rows that are equal where any
    two differ are equal: the bytes where some row differs from the first are found (a few
    rows at a time, in the cache), and the rows grouped by those bytes alone (a file's
    pickles differ in a few names and numbers, not in their structure)."""
    import numpy as np

    count, length = pickles.shape
    if not count:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    varies = np.zeros(length, dtype=bool)
    for lo in range(0, count, _CHUNK_ROWS):
        varies |= (pickles[lo : lo + _CHUNK_ROWS] != pickles[0]).any(axis=0)
    columns = np.flatnonzero(varies)
    if not columns.size:
        return np.zeros(count, dtype=np.int64), np.zeros(1, dtype=np.int64)
    keys = np.ascontiguousarray(pickles[:, columns]).view(np.dtype((np.void, columns.size)))
    _, first, groups = np.unique(keys.reshape(count), return_index=True, return_inverse=True)
    return groups.reshape(-1).astype(np.int64), first


def _template(path: Path, data: bytes) -> Template | None:
    try:
        header = ptheader.read_header(path, data)  # a template is a file read_header accepts
        return Template(path, data, header)
    except (RbtoolError, struct.error, ValueError):
        return None


def _parse(path: Path, data: bytes) -> dict[str, Any] | RbtoolError:
    try:
        return ptheader.read_header(path, data)
    except RbtoolError as exc:
        return exc
