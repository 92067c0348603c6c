"""The rules on metadata.json, each key checked on its own (`check_metadata`), and rbtool's table
of field schemas it may hold."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rbtool.format.bounded import ABSENT, json_value_problem
from rbtool.format.names import FORMATS, METADATA_FILE
from rbtool.format.problems import Problem, problem, shown
from rbtool.format.schema import (
    DIM_LIMIT,
    FORMAT_VERSION,
    METADATA_KEYS,
    RBTOOL_METADATA_KEYS,
    REQUIRED_METADATA_KEYS,
    SCHEMAS_KEY,
    SEED_RANGE,
    is_count,
)


@dataclass
class Metadata:
    """The metadata values that passed their checks (None where absent or invalid)."""

    trajectory_format: str | None = None
    size: int | None = None
    total_samples: int | None = None
    trajectory_counter: int | None = None
    seed: int | None = None
    has_seed: bool = False  # the key is there with an integer
    format_version: int | None = None
    schemas: dict[str, list[Any]] = field(default_factory=dict)  # rbtool's table of field schemas
    extra: dict[str, Any] = field(default_factory=dict)  # keys rbtool does not interpret
    invalid: set[str] = field(default_factory=set)  # keys present with a value that was refused
    foreign: bool = False  # no rbtool metadata key: another writer wrote last
    readable: bool = False  # the file was a JSON object


def _format_major(value: Any) -> int | None:
    """The major version of a format_version value (an int, or a "M" / "M.m" string), or None."""
    if type(value) is int and value >= 1:
        return value
    if isinstance(value, str) and re.fullmatch(r"[1-9][0-9]{0,8}(\.[0-9]{1,9})?", value):
        return int(value.split(".")[0])
    return None


def _is_schema_field(value: Any) -> bool:
    return (
        type(value) is list
        and len(value) == 4
        and type(value[0]) is list
        and len(value[0]) >= 1
        and all(type(k) is str for k in value[0])
        and type(value[1]) is str
        and type(value[2]) is list
        and all(type(d) is int and 0 <= d < DIM_LIMIT for d in value[2])
        and type(value[3]) is int
        and 0 <= value[3] < DIM_LIMIT
    )


def schema_table(value: Any) -> dict[str, list[Any]] | None:
    """The index's table of field schemas when it is well formed, else None."""
    if type(value) is not dict:
        return None
    for key, fields in value.items():
        if type(key) is not str or type(fields) is not list or not all(map(_is_schema_field, fields)):
            return None
    return value


def check_metadata(meta: Any) -> tuple[Metadata, list[Problem]]:
    """Check each metadata key on its own, so that every bad key is reported."""
    result, found = Metadata(), []

    def bad(message: str, code: str = "metadata_invalid", key: str | None = None) -> None:
        found.append(problem(code, f"{METADATA_FILE}: {message}", file=METADATA_FILE))
        if key is not None:
            result.invalid.add(key)

    if meta is ABSENT:
        return result, found
    if not isinstance(meta, dict):
        bad(f"expected a JSON object, got {type(meta).__name__}")
        return result, found
    result.readable = True
    for key in REQUIRED_METADATA_KEYS:
        if key not in meta:
            bad(f"lacks {key!r}")
    fmt = meta.get("trajectory_format")
    if "trajectory_format" in meta:
        if fmt in FORMATS:
            result.trajectory_format = fmt
        else:
            bad(f"trajectory_format must be 'pt' or 'pkl', got {shown(fmt)}", key="trajectory_format")
    for key in ("size", "total_samples", "trajectory_counter"):
        if key in meta:
            if is_count(meta[key]):
                setattr(result, key, meta[key])
            else:
                bad(f"{key} must be an integer in [0, 2**63), got {shown(meta[key])}", key=key)
    if "seed" in meta:
        seed = meta["seed"]
        if seed is None:
            found.append(
                problem(
                    "seed_null",
                    f'{METADATA_FILE}: "seed": null cannot be loaded by the reference implementation; '
                    "read as no seed (rewriting the checkpoint leaves the key out)",
                    file=METADATA_FILE,
                )
            )
        elif type(seed) is int and SEED_RANGE[0] <= seed < SEED_RANGE[1]:
            result.seed, result.has_seed = seed, True
        else:
            bad(f"seed must be an integer, got {shown(seed)}", key="seed")
    if "format_version" in meta:
        major = _format_major(meta["format_version"])
        if major is None:
            bad(
                f"format_version must be a positive integer, got {shown(meta['format_version'])}",
                key="format_version",
            )
        elif major > FORMAT_VERSION:
            bad(
                f"written in format version {meta['format_version']}, newer than this rbtool reads "
                f"({FORMAT_VERSION}); upgrade rbtool",
                "format_too_new",
            )
        else:
            result.format_version = major
    if SCHEMAS_KEY in meta:
        table = schema_table(meta[SCHEMAS_KEY])
        if table is None:
            found.append(
                problem(
                    "schema_table_invalid",
                    f"{METADATA_FILE}: {SCHEMAS_KEY!r} is malformed; it is ignored",
                    file=METADATA_FILE,
                )
            )
        else:
            result.schemas = table
    result.foreign = not any(key in meta for key in RBTOOL_METADATA_KEYS)
    result.extra = {k: v for k, v in meta.items() if k not in METADATA_KEYS and k not in RBTOOL_METADATA_KEYS}
    for key, value in list(result.extra.items()):
        why = json_value_problem(value)
        if why is not None:
            bad(f"key {shown(key)} {why}: rbtool could not write it back", key=key)
            del result.extra[key]  # what is kept must be writable: a repair drops it
    return result, found
