"""What metadata.json and an index entry hold: the format version, the keys, and the ranges
their numbers take (counts and ids, shape dims, the seed)."""

from __future__ import annotations

# The major version of the layout rbtool writes (metadata key `format_version`). A reader
# refuses a newer major version; minor additions only add keys, which readers ignore.
FORMAT_VERSION = 1

# Metadata keys the reference implementation writes (its loader reads the first four).
METADATA_KEYS = ("trajectory_format", "size", "total_samples", "trajectory_counter", "seed")
REQUIRED_METADATA_KEYS = METADATA_KEYS[:4]
# Metadata keys only rbtool writes: when all are absent, another writer wrote last.
RBTOOL_METADATA_KEYS = ("format_version", "field_schemas")
# Entry keys the reference implementation writes, then the optional ones rbtool adds.
ENTRY_KEYS = ("num_samples", "trajectory_id", "max_episode_length", "shape", "model_weights_id")
OPTIONAL_ENTRY_KEYS = ("uuid", "file_bytes", "sha256", "source_sha256", "link", "schema")
# metadata.json may hold rbtool's table of field schemas (an rbtool key, so dropped when
# another writer rewrites the metadata): digest -> [[field path, dtype, per-sample shape, E],
# ...]; an entry's "schema" names one.
SCHEMAS_KEY = "field_schemas"
LINK_KEYS = ("inode", "size", "mtime_ns")  # a hard-linked file's identity when it was linked

INT64_LIMIT = 1 << 63  # every count, id and size is an int in [0, 2**63)
DIM_LIMIT = 1 << 31  # shape dims below this multiply without int64 overflow
SEED_RANGE = (-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed takes


def is_count(value: object) -> bool:
    """A plain int in [0, 2**63)."""
    return type(value) is int and 0 <= value < INT64_LIMIT


def is_id_text(text: str, *, leading_zeros: bool = False) -> bool:
    """True if `text` spells an id in [0, 2**63) in ASCII digits (canonically, unless
    `leading_zeros`); never converts a long digit string (Python refuses past 4300 digits)."""
    if not (text.isascii() and text.isdigit()):
        return False
    if leading_zeros:
        text = text.lstrip("0") or "0"
    elif len(text) > 1 and text[0] == "0":
        return False
    return len(text) <= 19 and int(text) < INT64_LIMIT
