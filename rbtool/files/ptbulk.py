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

The comparison runs over every file of one size at once (numpy, a few slices per record),
so a file costs its read and a dictionary lookup of its pickle.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rbtool.errors import RbtoolError
from rbtool.files import ptheader
from rbtool.files.ptheader import SMALL_FILE_BYTES

_LOCAL = struct.Struct("<4s10xI8xHH")  # signature, crc32, name length, extra length
_CENTRAL = struct.Struct("<4s12xI8xHHH12x")  # signature, crc32, name, extra, comment lengths
_LOCAL_CRC, _LOCAL_NAME = 14, 30
_FLAGS, _DESCRIPTOR = 6, 0x08  # a local header's flags; bit 3: a data descriptor follows the data
_CENTRAL_CRC, _CENTRAL_NAME = 16, 46

# Files of these many bytes at most are read whole and compared with a template.
BULK_FILE_BYTES = SMALL_FILE_BYTES


class Template:
    """What a file must match to have the layout of the file `data` (parsed whole).

    `same`: the byte ranges that must equal the template's; `names`: where each record's
    name starts and the length of its directory part (which must be one name in a file);
    `pickle`: where data.pkl's bytes are; `places`: its tensor records, as read_header keys
    them.
    """

    def __init__(self, path: Path, data: bytes) -> None:
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
        varies: list[tuple[int, int]] = []
        self.names: list[int] = []
        storages = f"{prefix}data/"
        places = []
        self.pickle = (0, 0)
        for record in records:
            start = ptheader.record_data_start(path, record, lambda o, n: data[o : o + n])
            at = record.header_offset
            varies.append((at + _LOCAL_CRC, at + _LOCAL_CRC + 4))
            if data[at + _FLAGS] & _DESCRIPTOR:  # the CRC-32 follows the data, maybe signed
                end = start + record.size
                crc = end + 4 if data[end : end + 4] == b"PK\x07\x08" else end
                varies.append((crc, crc + 4))
            varies.append((at + _LOCAL_NAME, at + _LOCAL_NAME + dir_len))
            self.names.append(at + _LOCAL_NAME)
            if record is pickles[0]:
                self.pickle = (start, start + record.size)
                varies.append(self.pickle)
            elif record.name.startswith(storages) or record.name == f"{prefix}.data/serialization_id":
                varies.append((start, start + record.size))
                if record.name.startswith(storages):
                    places.append((record.name[len(storages) :], start, record.size))
        self.places = tuple(places)
        # the central directory's entries: their CRC-32s and names vary too
        at = self._central_start(data, len(records))
        for _ in records:
            _, _, name_len, extra_len, comment_len = _CENTRAL.unpack_from(data, at)
            varies.append((at + _CENTRAL_CRC, at + _CENTRAL_CRC + 4))
            varies.append((at + _CENTRAL_NAME, at + _CENTRAL_NAME + dir_len))
            self.names.append(at + _CENTRAL_NAME)
            at += _CENTRAL.size + name_len + extra_len + comment_len
        self.dir_len = dir_len
        self.same = _complement(varies, self.size)
        self._mask: Any = None

    @staticmethod
    def _central_start(data: bytes, count: int) -> int:
        at = data.rfind(b"PK\x05\x06")
        _, _, _, _, _, cd_size, cd_offset = struct.unpack_from("<4sHHHHII", data, at)
        if cd_offset == 0xFFFFFFFF or cd_size == 0xFFFFFFFF:
            raise ptheader.UnusualLayout("a zip64 directory")
        return int(cd_offset)

    def matches(self, rows: Any) -> Any:
        """Which of `rows` (files of this size, one per row of a uint8 array) have its layout."""
        import numpy as np

        if self._mask is None:
            mask = np.zeros(self.size, dtype=np.uint8)
            for start, stop in self.same:
                mask[start:stop] = 0xFF
            self._mask = mask
        ok = np.empty(rows.shape[0], dtype=bool)
        for lo in range(0, rows.shape[0], _CHUNK_ROWS):  # a chunk's bytes stay in the cache
            part = rows[lo : lo + _CHUNK_ROWS]
            differ = np.bitwise_xor(part, self.bytes)
            differ &= self._mask
            ok[lo : lo + part.shape[0]] = ~differ.any(axis=1)
        if self.dir_len:
            first = rows[:, self.names[0] : self.names[0] + self.dir_len]
            for at in self.names[1:]:
                ok &= (rows[:, at : at + self.dir_len] == first).all(axis=1)
        return ok


_CHUNK_ROWS = 128


def _complement(ranges: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The parts of `[0, size)` outside `ranges`."""
    out, at = [], 0
    for start, stop in sorted(ranges):
        if start > at:
            out.append((at, start))
        at = max(at, stop)
    if at < size:
        out.append((at, size))
    return out


def read_headers(
    paths: Sequence[Path], datas: Sequence[bytes], templates: dict[int, Template | None] | None = None
) -> list[dict[str, Any] | RbtoolError]:
    """The header of each file (`datas[i]`: all of `paths[i]`'s bytes), or its error.

    Exactly what read_header(path, data) returns or raises (UnusualLayout included), file
    by file; files of one layout are compared with a template instead of being parsed.
    `templates` (by file size) keeps the templates for later calls over the same files'
    kind: a file that does not match its size's template is parsed whole all the same.
    """
    import numpy as np

    out: list[dict[str, Any] | RbtoolError | None] = [None] * len(paths)
    by_size: dict[int, list[int]] = {}
    for k, data in enumerate(datas):
        by_size.setdefault(len(data), []).append(k)
    known = {} if templates is None else templates
    for size, ks in by_size.items():
        template = known.get(size)
        if template is None and size not in known and (len(ks) > 1 or templates is not None) and size:
            template = known[size] = _template(paths[ks[0]], datas[ks[0]])
        if template is None:
            for k in ks:
                out[k] = _parse(paths[k], datas[k])
            continue
        rows = np.frombuffer(b"".join([datas[k] for k in ks]), dtype=np.uint8).reshape(len(ks), size)
        matched = template.matches(rows)
        start, stop = template.pickle
        for k, same in zip(ks, matched.tolist(), strict=True):
            header = ptheader.known_header(datas[k][start:stop], template.places) if same else None
            out[k] = header if header is not None else _parse(paths[k], datas[k])
    return out  # type: ignore[return-value]


def _template(path: Path, data: bytes) -> Template | None:
    try:
        ptheader.read_header(path, data)  # a template is a file read_header accepts
        return Template(path, data)
    except (RbtoolError, struct.error, ValueError):
        return None


def _parse(path: Path, data: bytes) -> dict[str, Any] | RbtoolError:
    try:
        return ptheader.read_header(path, data)
    except RbtoolError as exc:
        return exc
