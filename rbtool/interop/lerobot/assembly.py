"""An export's files, from each trajectory's rows in trajectory order (one process, rank 0):
the Parquet data rolled over by size, the videos, the episode metadata with its statistics,
`meta/stats.json`, `meta/tasks.parquet`, `meta/info.json` and the sidecar.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from rbtool.files.fsutil import write_bytes_atomic
from rbtool.files.index import Index
from rbtool.interop.lerobot.extras import require_arrow
from rbtool.interop.lerobot.features import Column
from rbtool.interop.lerobot.layout import (
    CODEBASE_VERSION,
    DATA_PATH,
    EPISODES_PATH,
    INFO_FILE,
    STATS_FILE,
    TASKS_FILE,
    VIDEO_PATH,
    Rolling,
    next_file,
)
from rbtool.interop.lerobot.plan import Write
from rbtool.interop.lerobot.results import ExportResult
from rbtool.interop.lerobot.sidecar import (
    SIDECAR_FILE,
    SIDECAR_TENSORS,
    SIDECAR_VERSION,
    blob_schema,
    blob_tensor,
)
from rbtool.interop.lerobot.stats import QUANTILES, aggregate, stats_json
from rbtool.interop.lerobot.video import RollingVideo, video_columns

if TYPE_CHECKING:
    import numpy as np


def _json(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)


class _RollingParquet(Rolling):
    """Parquet files `template` in chunk/file order, a new one when the size limit would be crossed.

    Units (episodes) are never split across files; rows are buffered into row groups.
    """

    def __init__(self, root: Path, template: str, limit_bytes: float, chunks_size: int) -> None:
        super().__init__(root, limit_bytes, chunks_size)
        self.template = template
        self.writer: Any = None
        self.sink: Any = None
        self.schema: Any = None
        self.pending: list[Any] = []
        self.pending_bytes = 0
        self.file_rows = 0
        self.bytes = 0

    def _open(self) -> None:
        pa = require_arrow()
        import pyarrow.parquet as pq

        path = self.root / self.template.format(chunk_index=self.chunk, file_index=self.file)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.sink = pa.OSFile(str(path), "wb")
        self.writer = pq.ParquetWriter(self.sink, self.schema, compression="snappy")
        self.files += 1

    def _flush(self) -> None:
        if not self.pending:
            return
        pa = require_arrow()
        if self.writer is None:
            self._open()
        self.writer.write_table(pa.concat_tables(self.pending))
        self.pending, self.pending_bytes = [], 0

    def _size(self) -> int:
        return (self.sink.tell() if self.sink is not None else 0) + self.pending_bytes

    def close_file(self) -> None:
        self._flush()
        if self.writer is not None:
            self.writer.close()
            self.bytes += self.sink.tell()
            self.sink.close()
            self.writer = self.sink = None

    def add(self, table: Any, est_bytes: int) -> tuple[int, int]:
        """Append one unit's rows; returns the (chunk, file) it went into."""
        if self.schema is None:
            self.schema = table.schema
        if self.file_rows and self._size() + est_bytes >= self.limit:
            self.roll()
            self.file_rows = 0
        self.pending.append(table)
        self.pending_bytes += est_bytes
        self.file_rows += table.num_rows
        if self.pending_bytes >= 8 << 20 or sum(p.num_rows for p in self.pending) >= 10000:
            self._flush()
        return self.chunk, self.file

    def close(self) -> None:
        self.close_file()


class Assembly:
    """The dataset's files, from each trajectory's rows in trajectory order (one process, rank 0)."""

    def __init__(
        self,
        out: Path,
        overwrite: bool,
        columns: list[Column],
        features: dict[str, dict[str, Any]],
        video_names: list[str],
        task: str,
        fps: int,
        robot_type: str | None,
        data_file_size_mb: float,
        video_file_size_mb: float,
        chunks_size: int,
        source: str | os.PathLike[str],
        index: Index,
        schemas: list[list[dict[str, Any]]],
        records: list[dict[str, Any]],
        bounds_of: list[list[tuple[int, int]]],
    ) -> None:
        self.out, self.overwrite, self.columns, self.features = out, overwrite, columns, features
        self.video_names, self.task, self.fps, self.robot_type = video_names, task, fps, robot_type
        self.data_file_size_mb, self.video_file_size_mb = data_file_size_mb, video_file_size_mb
        self.chunks_size, self.source, self.index = chunks_size, source, index
        self.schemas, self.records, self.bounds_of = schemas, records, bounds_of
        self.episodes: list[dict[str, Any]] = []
        self.episode_stats: list[dict[str, dict[str, Any]]] = []
        self.sidecar_fields: set[str] = set()
        self.pending_blobs: list[Any] = []

    def open(self, staging: Path) -> None:
        import pyarrow.parquet as pq

        self.staging = staging
        self.data = _RollingParquet(staging, DATA_PATH, self.data_file_size_mb * (1 << 20), self.chunks_size)
        self.videos = {
            name: RollingVideo(staging, name, self.fps, self.video_file_size_mb * (1 << 20), self.chunks_size)
            for name in self.video_names
        }
        blobs_path = staging / SIDECAR_TENSORS
        blobs_path.parent.mkdir(parents=True, exist_ok=True)
        self.blob_writer = pq.ParquetWriter(str(blobs_path), blob_schema(), compression="zstd")

    def _flush_blobs(self, force: bool = False) -> None:
        pa = require_arrow()
        if sum(t.num_rows for t in self.pending_blobs) >= (1 if force else 256):
            self.blob_writer.write_table(pa.concat_tables(self.pending_blobs).combine_chunks())
            self.pending_blobs = []

    def _video_frames(self, nodes: list[dict[str, Any]], blobs: Any, t: int, b: int) -> dict[str, Any]:
        """The exact frames of the trajectory's video columns (kept in its sidecar rows), in frame order."""
        import pyarrow.compute as pc

        frames: dict[str, Any] = {}
        by_path = {c.path: c for c in self.columns}
        for row in blobs.filter(pc.equal(blobs.column("kind"), "frames")).to_pylist():
            col = by_path[tuple(nodes[row["node"]]["path"])]
            frames[col.feature] = col.in_frame_order(blob_tensor(row), t, b)
        return frames

    def add(self, position: int, job: Write, meta: dict[str, Any], table: Any, blobs: Any) -> None:
        import numpy as np

        record = self.records[position]
        t, b, tid = job.t, job.b, job.tid
        nodes = self.schemas[job.schema]
        record["digest"] = meta["digest"]
        record["entry"] = self.index.entries[tid]
        self.sidecar_fields.update(meta["sidecar_fields"])
        if blobs.num_rows:
            self.pending_blobs.append(blobs)
        self._flush_blobs()
        video_frames = self._video_frames(nodes, blobs, t, b) if self.videos else {}
        bounds = self.bounds_of[position]
        per_row = meta["per_row"]
        for k, (lo, hi) in enumerate(bounds):
            chunk, file = self.data.add(table.slice(lo, hi - lo), int(per_row * (hi - lo)))
            placed: dict[str, Any] = {}
            for col in self.columns:
                if not col.video:
                    continue
                if col.feature in video_frames:
                    for name, frames in col.split(video_frames[col.feature][lo:hi]).items():
                        placed.update(video_columns(name, self.videos[name].add(frames)))
                else:  # a trajectory without this field: black frames keep the video's timeline
                    for name in col.names():
                        blank = np.zeros((hi - lo, *col.feature_shape), dtype=np.uint8)
                        placed.update(video_columns(name, self.videos[name].add(blank)))
            self.episode_stats.append(meta["stats"][k])
            self.episodes.append(
                {
                    "episode_index": job.first_episode + k,
                    "tasks": [self.task],
                    "length": hi - lo,
                    "data/chunk_index": chunk,
                    "data/file_index": file,
                    "dataset_from_index": job.first_frame + lo,
                    "dataset_to_index": job.first_frame + hi,
                    **placed,
                    "rb/trajectory_id": tid,
                    "rb/env": lo // t,
                    "rb/t_start": lo % t,
                }
            )
        record["episodes"] = [job.first_episode, len(bounds)]

    def finish(self, result: ExportResult) -> None:
        """Close the data files and write the metadata: episodes, stats, tasks, info, sidecar."""
        staging, features, index = self.staging, self.features, self.index
        self.data.close()
        for writer in self.videos.values():
            writer.close_file()
        self._flush_blobs(force=True)
        self.blob_writer.close()
        stat_names = [name for name, spec in features.items() if spec["dtype"] != "string"]
        totals: dict[str, dict[str, np.ndarray]] = {}
        for name in stat_names:
            parts = [s[name] for s in self.episode_stats if name in s]
            if parts:
                totals[name] = aggregate(parts)
        result.episode_files = _write_episodes(
            staging, self.episodes, self.episode_stats, stat_names, self.data_file_size_mb, self.chunks_size
        )
        write_bytes_atomic(
            staging / STATS_FILE, _json({k: stats_json(v) for k, v in totals.items()}), sync_dir=False
        )
        _write_tasks(staging, [self.task])
        count = len(self.episodes)
        info = {
            "codebase_version": CODEBASE_VERSION,
            "robot_type": self.robot_type,
            "total_episodes": count,
            "total_frames": sum(r["T"] * r["B"] for r in self.records),
            "total_tasks": 1,
            "chunks_size": self.chunks_size,
            "data_files_size_in_mb": _mb(self.data_file_size_mb),
            "video_files_size_in_mb": _mb(self.video_file_size_mb),
            "fps": self.fps,
            "splits": {"train": f"0:{count}"},
            "data_path": DATA_PATH,
            "video_path": VIDEO_PATH if self.video_names else None,
            "features": features,
        }
        write_bytes_atomic(staging / INFO_FILE, _json(info), sync_dir=False)
        sidecar = {
            "rbtool_sidecar": SIDECAR_VERSION,
            "source": str(self.source),
            "checkpoint": {
                "trajectory_id_list": list(index.id_list),
                "trajectory_counter": index.trajectory_counter,
                "seed": index.seed,
                "trajectory_format": index.trajectory_format,
                "extra_metadata": index.extra_metadata,
            },
            "columns": {
                c.feature: {
                    "path": list(c.path),
                    "dtype": c.dtype,
                    "stored_as": c.stored,
                    "shape": list(c.shape),
                    "views": c.views,
                    "video": c.video,
                }
                for c in self.columns
            },
            "schemas": self.schemas,
            "trajectories": self.records,
            "tensors": SIDECAR_TENSORS,
        }
        write_bytes_atomic(staging / SIDECAR_FILE, _json(sidecar), sync_dir=False)
        result.data_files = self.data.files
        result.video_files = sum(writer.files for writer in self.videos.values())
        result.bytes = tree_bytes(staging)
        result.sidecar_fields = sorted(self.sidecar_fields)


def tree_bytes(root: Path) -> int:
    """The bytes of the files under `root` (what an export reports it wrote)."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _mb(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def _write_episodes(
    root: Path,
    episodes: list[dict[str, Any]],
    stats: list[dict[str, dict[str, np.ndarray]]],
    stat_names: list[str],
    limit_mb: float,
    chunks_size: int,
) -> int:
    pa = require_arrow()
    rows = []
    for episode, ep_stats in zip(episodes, stats, strict=True):
        row = dict(episode)
        for name in stat_names:
            for key in ("min", "max", "mean", "std", "count", *QUANTILES):
                value = ep_stats.get(name, {}).get(key)
                row[f"stats/{name}/{key}"] = None if value is None else value.tolist()
        rows.append(row)
    if not rows:
        return 0
    table = pa.Table.from_pylist(rows)
    per_row = table.nbytes / len(rows)
    limit = limit_mb * (1 << 20)
    # Where each episode's metadata row goes is known only as rows are placed: place them
    # first, then write each file's rows with its own chunk and file index columns.
    placed: list[tuple[int, int]] = []
    size, chunk, file = 0.0, 0, 0
    for _ in rows:
        if size and size + per_row >= limit:
            chunk, file = next_file(chunk, file, chunks_size)
            size = 0.0
        placed.append((chunk, file))
        size += per_row
    table = table.append_column("meta/episodes/chunk_index", pa.array([c for c, _ in placed], pa.int64()))
    table = table.append_column("meta/episodes/file_index", pa.array([f for _, f in placed], pa.int64()))
    import pyarrow.parquet as pq

    files = 0
    start = 0
    while start < len(placed):
        end = start
        while end < len(placed) and placed[end] == placed[start]:
            end += 1
        target = root / EPISODES_PATH.format(chunk_index=placed[start][0], file_index=placed[start][1])
        target.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table.slice(start, end - start), str(target), compression="snappy")
        files += 1
        start = end
    return files


def _write_tasks(root: Path, tasks: list[str]) -> None:
    """meta/tasks.parquet as LeRobot writes it: a pandas frame indexed by the task text."""
    pa = require_arrow()
    import pyarrow.parquet as pq

    pandas_meta = {
        "index_columns": ["__index_level_0__"],
        "column_indexes": [
            {
                "name": None,
                "field_name": None,
                "pandas_type": "unicode",
                "numpy_type": "object",
                "metadata": {"encoding": "UTF-8"},
            }
        ],
        "columns": [
            {
                "name": "task_index",
                "field_name": "task_index",
                "pandas_type": "int64",
                "numpy_type": "int64",
                "metadata": None,
            },
            {
                "name": None,
                "field_name": "__index_level_0__",
                "pandas_type": "unicode",
                "numpy_type": "object",
                "metadata": None,
            },
        ],
        "attributes": {},
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "2.2.0",
    }
    table = pa.table(
        {
            "task_index": pa.array(range(len(tasks)), pa.int64()),
            "__index_level_0__": pa.array(tasks, pa.string()),
        }
    ).replace_schema_metadata({"pandas": orjson.dumps(pandas_meta)})
    pq.write_table(table, str(root / TASKS_FILE))
