"""JSON on stdout: one document (compact and written a block at a time, or indented with
--pretty) or JSON Lines, and the long lists of a document cut to a summary unless --all.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from typing import Any

import orjson

from rbtool.cli._options import LocalWrites, Report
from rbtool.cli._output import head, id_ranges, left_out

_CHUNK_ITEMS = 65536  # a long list is serialised this many items at a time
_WRITE_BYTES = 1 << 20  # output is written in blocks of about this size
_NUMPY = orjson.OPT_SERIALIZE_NUMPY


def bound(doc: dict[str, Any], key: str, limit: int | None, *, ranges: str | None = None) -> None:
    """Cut the list `doc[key]` to its first `limit` items and add `<key>_left_out` after it.

    With `ranges`, the ids of the whole list are first added as `ranges` (runs of consecutive
    ids, themselves cut to `limit` runs, with `<ranges>_left_out`). A null list stays null.
    """
    items = doc[key]
    extra: dict[str, Any] = {}
    if items is None:
        extra[f"{key}_left_out"] = None
        if ranges is not None:
            extra[ranges] = extra[f"{ranges}_left_out"] = None
    else:
        extra[f"{key}_left_out"] = left_out(items, limit)
        if ranges is not None:
            runs = id_ranges(items)
            extra[ranges] = head(runs, limit)
            extra[f"{ranges}_left_out"] = left_out(runs, limit)
        doc[key] = head(items, limit)
    insert_after(doc, key, extra)


def insert_after(doc: dict[str, Any], key: str, extra: dict[str, Any]) -> None:
    """Put the keys of `extra` right after `key` in `doc` (in place): new keys beside what they describe."""
    placed: dict[str, Any] = {}
    for k, v in doc.items():
        if k not in extra:
            placed[k] = v
        if k == key:
            placed.update(extra)
    doc.clear()
    doc.update(placed)


def bound_state(state: dict[str, Any], limit: int | None) -> dict[str, Any]:
    """A copy of a checkpoint state for --json: `trajectory_id_list` cut to `limit` ids, with its runs."""
    state = dict(state)
    bound(state, "trajectory_id_list", limit, ranges="trajectory_id_ranges")
    return state


def _is_long(value: Any) -> bool:
    return (
        not isinstance(value, (str, bytes, dict)) and hasattr(value, "__len__") and len(value) > _CHUNK_ITEMS
    )


def _json_chunks(value: Any) -> Iterator[bytes]:
    """Compact JSON of `value` in pieces: long lists (and numpy arrays) a block at a time."""
    if isinstance(value, dict) and any(_is_long(v) or isinstance(v, dict) for v in value.values()):
        yield b"{"
        for i, (key, item) in enumerate(value.items()):
            yield (b"," if i else b"") + orjson.dumps(key) + b":"
            yield from _json_chunks(item)
        yield b"}"
    elif _is_long(value):
        yield b"["
        for start in range(0, len(value), _CHUNK_ITEMS):
            block = value[start : start + _CHUNK_ITEMS]
            if not isinstance(block, list) and not hasattr(block, "dtype"):
                block = list(block)
            yield (b"," if start else b"") + orjson.dumps(block, default=_plain, option=_NUMPY)[1:-1]
        yield b"]"
    elif isinstance(value, list) and any(_is_long(v) or isinstance(v, dict) for v in value):
        yield b"["
        for i, item in enumerate(value):
            yield b"," if i else b""
            yield from _json_chunks(item)
        yield b"]"
    else:
        yield orjson.dumps(value, default=_plain, option=_NUMPY)


def _write_blocks(pieces: Iterable[bytes]) -> None:
    """Write byte pieces to stdout in blocks of about _WRITE_BYTES (as text where stdout has no buffer)."""
    binary = getattr(sys.stdout, "buffer", None)

    def emit(data: bytearray) -> None:
        if binary is None:
            sys.stdout.write(data.decode())
        else:
            binary.write(data)

    sys.stdout.flush()
    pending = bytearray()
    for piece in pieces:
        pending += piece
        if len(pending) >= _WRITE_BYTES:
            emit(pending)
            pending.clear()
    emit(pending)
    if binary is not None:
        binary.flush()
    sys.stdout.flush()


def print_json(doc: Any, pretty: bool = False) -> None:
    """Write one JSON document to stdout: compact and streamed a block at a time, or indented with `pretty`.

    Values may be numpy arrays or lazy columns (sequences that build items on access): a
    complete listing is serialised block by block and never held whole as text. An indented
    document is built whole (it is for reading, and summaries are small).
    """
    if pretty:
        data = orjson.dumps(doc, default=_plain, option=orjson.OPT_INDENT_2 | _NUMPY)
        _write_blocks([data, b"\n"])
    else:
        _write_blocks(chain(_json_chunks(doc), [b"\n"]))


def _plain(value: Any) -> Any:
    """orjson's fallback: a lazy column (a sequence that builds items on access) as a list."""
    if hasattr(value, "__len__") and hasattr(value, "__getitem__"):
        return list(value)
    raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")


def print_jsonl(rows: Iterable[Any]) -> None:
    """Write one compact JSON object per line to stdout, row by row (nothing waits for the last row)."""
    _write_blocks(
        orjson.dumps(row, default=_plain, option=orjson.OPT_APPEND_NEWLINE | _NUMPY) for row in rows
    )


def print_report(
    doc: dict[str, Any], output: Report | LocalWrites, *, each: str | None = None, also: Sequence[str] = ()
) -> None:
    """The --json document of checkpoint states: the trajectory id list cut to the summary unless
    --all (`bound_state`; with `each`, that of every item of `doc[each]`: ranks, checkpoints), and
    the other lists `also`."""
    limit = output.limit
    shown = (
        bound_state(doc, limit) if each is None else {**doc, each: [bound_state(s, limit) for s in doc[each]]}
    )
    for key in also:
        bound(shown, key, limit)
    print_json(shown, output.pretty)
