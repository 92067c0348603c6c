"""Statistics of a checkpoint or buffer directory: index, schema, data, and how draws spread.

The index part (`index`) reads only the two JSON files, works column-wise with numpy and
never imports torch. The data part (`data`) opens each trajectory file memory-mapped and
touches only the fields it needs (rewards, done-like fields, versions), never the
observations, and counts the bytes it touched; the schema (`schema`) and the episodes
(`episodes`) come from the same read. `draws` simulates draws from the window with the
samplers' own code. `collect_stats` (`collect`) returns everything as one JSON-ready dict.
"""

from rbtool.ops.stats.collect import DEFAULT_SEED, collect_stats
from rbtool.ops.stats.data import data_report
from rbtool.ops.stats.draws import (
    CONCENTRATION_DRAW_SHARE,
    CONCENTRATION_SAMPLE_SHARE,
    DrawRequest,
    draws_report,
)
from rbtool.ops.stats.episodes import (
    OTHER,
    TERMINATED,
    TRUNCATED,
    EpisodeTally,
    episodes_report,
    find_episodes,
)
from rbtool.ops.stats.index import (
    NOT_A_FILE,
    SIZES_STEP,
    IndexHeader,
    IndexTable,
    LazyColumn,
    file_sizes,
    index_report,
    index_table,
    not_a_file_code,
    read_table,
    weights_groups,
    window_mask,
)
from rbtool.ops.stats.schema import FieldRow, schema_report
from rbtool.ops.stats.segments import TrajectoryData, read_trajectory
from rbtool.ops.stats.summary import DEFAULT_BINS, summarize, value_counts

__all__ = [
    "CONCENTRATION_DRAW_SHARE",
    "CONCENTRATION_SAMPLE_SHARE",
    "DEFAULT_BINS",
    "DEFAULT_SEED",
    "NOT_A_FILE",
    "OTHER",
    "SIZES_STEP",
    "TERMINATED",
    "TRUNCATED",
    "DrawRequest",
    "EpisodeTally",
    "FieldRow",
    "IndexHeader",
    "IndexTable",
    "LazyColumn",
    "TrajectoryData",
    "collect_stats",
    "data_report",
    "draws_report",
    "episodes_report",
    "file_sizes",
    "find_episodes",
    "index_report",
    "index_table",
    "not_a_file_code",
    "read_table",
    "read_trajectory",
    "schema_report",
    "summarize",
    "value_counts",
    "weights_groups",
    "window_mask",
]
