"""The decoders of trajectory_index.json: typed (into slotted Entry structs, types and ranges
checked in C) and loose (known entry keys as any JSON value, for the exact checks)."""

from __future__ import annotations

import functools
from typing import Annotated, Any

from rbtool.format.bounded import gc_paused
from rbtool.format.schema import DIM_LIMIT, ENTRY_KEYS, INT64_LIMIT, OPTIONAL_ENTRY_KEYS


@functools.cache
def _typed_decoder(strict: bool = False) -> Any:
    """A msgspec decoder of trajectory_index.json into slotted Entry structs (built on first
    use); `strict`, one that refuses any key rbtool does not know."""
    import msgspec

    def getitem(self: Any, key: str) -> Any:
        return getattr(self, key)

    def get(self: Any, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)

    # One index entry; `entry[key]` and `entry.get(key)` work as on a dict. (defstruct:
    # this module's annotations are strings, which msgspec cannot resolve for a local class.)
    # Ranges are checked by the decoder in C (at no measurable cost); patterns are not
    # (they would double the decode time), so strings are checked column-wise afterwards.
    count = Annotated[int, msgspec.Meta(ge=0, le=INT64_LIMIT - 1)]
    dim = Annotated[int, msgspec.Meta(ge=0, le=DIM_LIMIT - 1)]
    word = Annotated[int, msgspec.Meta(ge=-INT64_LIMIT, le=INT64_LIMIT - 1)]
    entry = msgspec.defstruct(
        "Entry",
        [
            ("num_samples", count),
            ("trajectory_id", count),
            ("max_episode_length", count | None),
            ("shape", Annotated[list[dim], msgspec.Meta(min_length=2)]),  # type: ignore[valid-type]
            ("model_weights_id", str),
            ("uuid", str | None, None),
            ("file_bytes", count | None, None),
            ("sha256", str | None, None),
            ("source_sha256", str | None, None),
            ("link", dict[str, word] | None, None),  # type: ignore[valid-type]
            ("schema", str | None, None),
        ],
        namespace={"__getitem__": getitem, "get": get},
        gc=False,
        omit_defaults=True,
        forbid_unknown_fields=strict,
    )
    index_file = msgspec.defstruct(
        "IndexFile",
        # int keys: msgspec accepts only canonical spellings ("3", never "03" or "+3")
        [
            ("trajectory_index", dict[count, entry]),  # type: ignore[valid-type]
            ("trajectory_id_list", list[count]),
        ],
        gc=False,
        forbid_unknown_fields=strict,
    )
    return msgspec.json.Decoder(index_file)


@functools.cache
def _loose_decoder() -> Any:
    """A decoder of trajectory_index.json that reads the known keys of entries as any JSON value.

    The exact path needs every value as written (to name what is wrong with it) but, like the
    typed path, must not read keys rbtool does not know: both paths then accept and refuse
    the same files. Absent keys stay msgspec.UNSET.
    """
    import msgspec

    unset = msgspec.UNSET

    def get(self: Any, key: str, default: Any = None) -> Any:
        value = getattr(self, key, unset)
        return default if value is unset else value

    fields = [(name, Any, unset) for name in (*ENTRY_KEYS, *OPTIONAL_ENTRY_KEYS)]
    entry = msgspec.defstruct("LooseEntry", fields, namespace={"__getitem__": get, "get": get}, gc=False)
    value = entry | list | str | int | float | bool | None
    index_file = msgspec.defstruct(
        "LooseIndexFile",
        [
            ("trajectory_index", dict[str, value] | list | str | int | float | bool | None, msgspec.UNSET),  # type: ignore[valid-type]
            ("trajectory_id_list", Any, msgspec.UNSET),
        ],
        gc=False,
    )
    return msgspec.json.Decoder(index_file)


def decode_loose(data: bytes) -> dict[str, Any]:
    """trajectory_index.json with entries as LooseEntry structs (known keys only).

    Raises msgspec.DecodeError when the text is not JSON or not an object at the top.
    """
    import msgspec

    unset = msgspec.UNSET
    with gc_paused():
        raw = _loose_decoder().decode(data)
    out: dict[str, Any] = {}
    if raw.trajectory_index is not unset:
        out["trajectory_index"] = raw.trajectory_index
    if raw.trajectory_id_list is not unset:
        out["trajectory_id_list"] = raw.trajectory_id_list
    return out


def decode_typed(data: bytes, strict: bool = False) -> tuple[dict[int, Any], list[int]] | None:
    """(trajectory_index, trajectory_id_list) when the index has the expected types, else None;
    `strict`: and holds no key rbtool does not know.

    A document the strict decoder takes is described whole by the schema, so it nests four
    deep at most: its decoding never follows a nest further than that (an unknown key is
    refused by name, before its value is read; a nest where a number belongs, at its first
    bracket)."""
    import msgspec

    try:
        with gc_paused():
            raw = _typed_decoder(strict).decode(data)
    except (msgspec.DecodeError, RecursionError):
        return None
    return raw.trajectory_index, raw.trajectory_id_list
