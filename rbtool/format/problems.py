"""Every problem rbtool reports about a checkpoint: its code, severity and meaning, and how
values are worded in its one-line message."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

ERROR, WARNING, NOTICE = "error", "warning", "notice"
SEVERITIES = (ERROR, WARNING, NOTICE)

# Every problem rbtool reports about a checkpoint: code -> (severity, what it means).
# The JSON-level ones come from check_json (an error there is what loaders refuse); the
# file-level ones from rbtool.ops.verify. docs/cli.md documents the same table.
PROBLEM_CODES: dict[str, tuple[str, str]] = {
    "metadata_missing": (ERROR, "metadata.json does not exist"),
    "metadata_unreadable": (ERROR, "metadata.json cannot be read or is not valid JSON"),
    "metadata_invalid": (
        ERROR,
        "metadata.json is not an object, lacks a key, or a key has a wrong type or value",
    ),
    "format_too_new": (ERROR, "metadata.json says a newer major format_version than this rbtool reads"),
    "seed_null": (
        WARNING,
        'metadata.json has "seed": null, which the reference implementation cannot load; rbtool reads '
        "it as no seed, and rewriting the checkpoint leaves the key out",
    ),
    "index_missing": (ERROR, "neither trajectory_index.json nor the legacy trajector_index.json exists"),
    "index_unreadable": (ERROR, "the index file cannot be read or is not valid JSON"),
    "index_invalid": (ERROR, "the index is not an object, or its two keys do not have the right types"),
    "legacy_index_unreadable": (
        WARNING,
        "trajector_index.json exists beside trajectory_index.json but is unreadable (readers use the "
        "current one)",
    ),
    "legacy_index_mismatch": (
        WARNING,
        "trajector_index.json disagrees with trajectory_index.json (readers use the current one)",
    ),
    "entry_invalid": (
        ERROR,
        "an index entry lacks a key or has a wrong id, shape, model_weights_id or optional key",
    ),
    "num_samples_mismatch": (ERROR, "an entry's num_samples is not shape[0] * shape[1]"),
    "duplicate_id": (ERROR, "an id appears more than once in trajectory_id_list"),
    "entry_missing": (ERROR, "trajectory_id_list names an id that has no entry"),
    "entry_unlisted": (WARNING, "an entry's id is not in trajectory_id_list (readers ignore the entry)"),
    "size_mismatch": (ERROR, "metadata size is not the length of trajectory_id_list"),
    "total_samples_mismatch": (ERROR, "metadata total_samples is not the sum of the listed num_samples"),
    "counter_too_low": (ERROR, "metadata trajectory_counter is not above every listed id"),
    "metadata_behind_index": (
        WARNING,
        "metadata.json still describes the index as it was before its last update (an index update "
        "interrupted between its two files); rbtool recounts, the next write or `rbtool repair` fixes it",
    ),
    "file_missing": (ERROR, "a listed trajectory has no file"),
    "rank_missing": (
        ERROR,
        "rank tree: a rank directory that the rank directories' own metadata (world size) records is not "
        "there",
    ),
    "rank_misplaced": (
        ERROR,
        "rank tree: a rank directory's metadata records another rank number than its name (rank_<r>)",
    ),
    "file_outside": (
        ERROR,
        "a listed trajectory's file is a symlink to a file outside the checkpoint (refused, never read)",
    ),
    "duplicate_files": (
        WARNING,
        "a listed trajectory has more than one file (for example a .pt and a .pkl); readers use the one "
        "the index names",
    ),
    "file_name_mismatch": (
        ERROR,
        "a listed trajectory's file has another model_weights_id or format than the index",
    ),
    "file_size_mismatch": (ERROR, "a file's size differs from the file_bytes its entry records"),
    "linked_file_changed": (
        ERROR,
        "a hard-linked file was written in place since it was linked (its inode's size or mtime "
        "changed): every checkpoint that links it changed with it",
    ),
    "file_size_hint": (
        WARNING,
        "a file's size differs from the file_bytes its entry records, but another writer rewrote the "
        "checkpoint after rbtool recorded it, so the record is only a hint",
    ),
    "stray_file": (
        WARNING,
        "a trajectory file the index does not list (id below trajectory_counter), or a .pt/.pkl file "
        "not named like a trajectory; readers ignore it",
    ),
    "sizes_unrecorded": (
        NOTICE,
        "quick: listed files have no recorded size or hash (another writer made them), so only a deep "
        "check, which loads every file, can tell a truncated or altered one",
    ),
    "uncommitted_file": (
        NOTICE,
        "an unlisted trajectory file with id >= trajectory_counter: left by an interrupted writer, "
        "removed by the next ingest",
    ),
    "file_unreadable": (ERROR, "deep: a trajectory file cannot be loaded (corrupt, truncated, not a dict)"),
    "file_unsafe": (ERROR, "deep: a trajectory file holds objects beyond tensors and plain data; not loaded"),
    "trajectory_invalid": (
        ERROR,
        "deep: a trajectory's tensors do not agree on [T, B] or it has no shape field",
    ),
    "done_rows_invalid": (ERROR, "deep: a done-like field's extra rows E do not divide T (or B differs)"),
    "shape_mismatch": (ERROR, "deep: a trajectory's [T, B] differs from its index entry's shape"),
    "field_mismatch": (ERROR, "deep: a file's model_weights_id or max_episode_length differs from its entry"),
    "non_finite": (ERROR, "deep: a float field holds NaN or Inf"),
    "hash_mismatch": (ERROR, "deep: a file's sha256 differs from the one its entry records"),
    "hash_hint": (
        WARNING,
        "deep: a file's sha256 differs from its entry's, but another writer rewrote the checkpoint after "
        "rbtool recorded it, so the record is only a hint",
    ),
    "schema_table_invalid": (
        WARNING,
        "metadata.json's table of field schemas (rbtool's own key) is malformed; readers ignore it and "
        "read each file's structure instead",
    ),
    "schema_differs": (
        WARNING,
        "deep: a trajectory's fields, dtypes or trailing shapes differ from the first's",
    ),
}

_SHOWN = 10


def preview(values: Iterable[Any]) -> str:
    """At most ten values, comma separated, with a count when there are more."""
    items = list(values)
    text = ", ".join(map(str, items[:_SHOWN]))
    return text + (f", ... ({len(items)} in all)" if len(items) > _SHOWN else "")


def one_line(text: str) -> str:
    return " ".join(str(text).split())


_SHOWN_REPR: Any = None


def shown(value: Any) -> str:
    """A value for a message: its repr, cut short when long (a file may hold a huge string,
    list or number, and a message is one line)."""
    global _SHOWN_REPR
    if type(value) is int:
        return int_text(value)
    if _SHOWN_REPR is None:
        import reprlib

        _SHOWN_REPR = reprlib.Repr()
        _SHOWN_REPR.maxstring = _SHOWN_REPR.maxother = 80
        _SHOWN_REPR.maxlist = _SHOWN_REPR.maxdict = 8
        _SHOWN_REPR.maxlevel = 3
        _SHOWN_REPR.maxlong = 40
    return str(_SHOWN_REPR.repr(value))


def int_text(value: int) -> str:
    """An integer for a message: its digits, shortened when there are many."""
    if value.bit_length() > 256:
        return f"(an integer of about {int(value.bit_length() * 0.30103)} digits)"
    text = str(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} digits)"


@dataclass(slots=True)
class Problem:
    """One thing wrong (or worth knowing) about a checkpoint.

    `file` is the file it concerns (relative to the checkpoint), when there is one;
    `message` says what is wrong and starts with that file's name.
    """

    code: str
    severity: str
    trajectory_id: int | None
    file: str | None
    message: str

    def as_json(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "severity": self.severity,
            "trajectory_id": self.trajectory_id,
            "file": self.file,
            "message": self.message,
        }


def problem(code: str, message: str, *, trajectory_id: int | None = None, file: str | None = None) -> Problem:
    """A Problem with its code's severity; `message` must be one line."""
    return Problem(code, PROBLEM_CODES[code][0], trajectory_id, file, message)
