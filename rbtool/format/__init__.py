"""The checkpoint format: what may be in a checkpoint directory, and the one validator of its JSON.

`names` (file names), `schema` (keys, FORMAT_VERSION, ranges), `problems` (every problem
code), `bounded` (bounded JSON), `decode` (the index decoders), `entries` and `metadata`
(the rules on each file), `check` (`check_json`), `content` (the rules on what a
trajectory file holds once loaded), `layout` (a trajectory's fields), `ranknames` (rank
directories). Importing it imports neither torch nor numpy.
"""

from rbtool.format.bounded import (
    INDEX_BYTES_ENV,
    INDEX_MEMORY_PER_BYTE,
    JSON_BYTES_ENV,
    gc_paused,
    index_size_problem,
    json_depth_problem,
    not_a_file,
    read_json_bytes,
    read_json_file,
)
from rbtool.format.check import IndexCheck, check_json
from rbtool.format.entries import entry_problems
from rbtool.format.metadata import Metadata
from rbtool.format.names import (
    FORMATS,
    INDEX_FILE,
    LEGACY_INDEX_FILE,
    MERGE_MAP_FILE,
    METADATA_FILE,
    check_weights_id,
    escapes,
    is_checkpoint_dir,
    parse_trajectory_file_name,
    trajectory_file_name,
    trajectory_file_names,
)
from rbtool.format.problems import (
    ERROR,
    NOTICE,
    PROBLEM_CODES,
    SEVERITIES,
    WARNING,
    Problem,
    one_line,
    preview,
    problem,
)
from rbtool.format.schema import ENTRY_KEYS, FORMAT_VERSION, INT64_LIMIT, SCHEMAS_KEY, SEED_RANGE

__all__ = [
    "ENTRY_KEYS",
    "ERROR",
    "FORMATS",
    "FORMAT_VERSION",
    "INDEX_BYTES_ENV",
    "INDEX_FILE",
    "INDEX_MEMORY_PER_BYTE",
    "INT64_LIMIT",
    "JSON_BYTES_ENV",
    "LEGACY_INDEX_FILE",
    "MERGE_MAP_FILE",
    "METADATA_FILE",
    "NOTICE",
    "PROBLEM_CODES",
    "SCHEMAS_KEY",
    "SEED_RANGE",
    "SEVERITIES",
    "WARNING",
    "IndexCheck",
    "Metadata",
    "Problem",
    "check_json",
    "check_weights_id",
    "entry_problems",
    "escapes",
    "gc_paused",
    "index_size_problem",
    "is_checkpoint_dir",
    "json_depth_problem",
    "not_a_file",
    "one_line",
    "parse_trajectory_file_name",
    "preview",
    "problem",
    "read_json_bytes",
    "read_json_file",
    "trajectory_file_name",
    "trajectory_file_names",
]
