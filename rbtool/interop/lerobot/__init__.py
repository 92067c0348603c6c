"""LeRobot datasets: export a checkpoint as a LeRobot v3.0 dataset, import one into a buffer.

Export writes one LeRobot episode per (trajectory, env column) segment, split where the
done flags end an episode, with LeRobot's layout (`meta/info.json`, `meta/stats.json`,
`meta/tasks.parquet`, `meta/episodes/chunk-*/file-*.parquet`, `data/chunk-*/file-*.parquet`,
files rolled over by size). Per-frame `rb.*` columns and a sidecar (`meta/rbtool.json` plus
`meta/rbtool/tensors.parquet`: bootstrap rows of done-like fields, `next_obs` rows that are
not the next frame's `curr_obs`, fields with no per-frame place, the original index and
metadata) make the export reversible: importing it gives back the same checkpoint.

Import reads any LeRobot v3.0 or v2.x dataset (one trajectory per episode, B = 1) or, when
the sidecar is there, rebuilds the exported trajectories exactly. Ids continue as `ingest`
assigns them; into a new or empty buffer directory an rbtool export keeps its own ids.

pyarrow (Parquet) and Pillow (PNG) are imported inside the functions that need them: they
are the optional extra `rbtool[lerobot]`.

The modules, bottom up: `extras` (those imports), `layout` (LeRobot's file names),
`limits` (the memory budget and bounds a dataset is held to), `tensors`, `video`,
`features` (buffer fields as features), `columns` (their values as Arrow), `stats`,
`sidecar`, `results`; the export in `plan` (pass 1), `render` (pass 2's rows), `parts`
(rows between ranks), `assembly` (the files) and `export`; the import in `reader` (a dataset
read safely), `rebuild` (an rbtool export), `episodes` (any dataset) and `importer`.
"""

from rbtool.errors import LeRobotFeatureError
from rbtool.interop.lerobot.export import export_lerobot
from rbtool.interop.lerobot.features import parse_field_map
from rbtool.interop.lerobot.importer import count_units, import_lerobot
from rbtool.interop.lerobot.layout import CODEBASE_VERSION
from rbtool.interop.lerobot.limits import MAX_BYTES_ENV
from rbtool.interop.lerobot.reader import LeRobotSource

__all__ = [
    "CODEBASE_VERSION",
    "MAX_BYTES_ENV",
    "LeRobotFeatureError",
    "LeRobotSource",
    "count_units",
    "export_lerobot",
    "import_lerobot",
    "parse_field_map",
]
