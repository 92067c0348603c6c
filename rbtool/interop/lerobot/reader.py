"""Reading a LeRobot dataset (v3.0, or v2.x with one Parquet file per episode): its metadata,
tasks, episodes and frames (Parquet columns and decoded videos), nothing read outside its
root, every declared size checked against the memory budget before decoding.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rbtool.errors import CheckpointError, RbtoolError
from rbtool.format import read_json_bytes, read_json_file
from rbtool.interop.lerobot.extras import require_arrow
from rbtool.interop.lerobot.features import hwc_of
from rbtool.interop.lerobot.layout import DATA_PATH, DEFAULT_CHUNK_SIZE, INFO_FILE, TASKS_FILE, VIDEO_PATH
from rbtool.interop.lerobot.limits import (
    MAX_BYTES_ENV,
    check_index,
    fill_template,
    human_bytes,
    is_int,
    max_bytes,
    relative_parts,
    within_budget,
)
from rbtool.interop.lerobot.sidecar import SIDECAR_FILE, SIDECAR_TENSORS, SIDECAR_VERSION, check_sidecar
from rbtool.interop.lerobot.tensors import NATIVE, np_dtype
from rbtool.interop.lerobot.video import VideoReader

_MAX_FEATURE_DIMS = 8


@dataclass
class Episode:
    index: int
    length: int
    tasks: list[str]
    file: Path
    start: int | None = None  # first global frame index (v3.0)
    videos: dict[str, tuple[int, int, float]] = field(default_factory=dict)  # feature -> chunk, file, from


class LeRobotSource:
    """A LeRobot dataset on disk (v3.0, or v2.x with one Parquet file per episode).

    Nothing outside `root` is read: every file it names (path templates filled in, the
    sidecar's tensors) must be a regular file under the root reached through no symlink.
    Declared shapes, Parquet sizes and video frames are checked against `max_bytes()` before
    anything is decoded.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            if not self.root.exists():
                raise CheckpointError(f"{self.root}: no such file or directory")
            raise CheckpointError(f"{self.root}: not a LeRobot dataset (not a directory)")
        info_path = self.root / INFO_FILE
        if not self._exists(INFO_FILE):
            raise CheckpointError(f"{self.root}: not a LeRobot dataset (no {INFO_FILE})")
        info_path = self._file(INFO_FILE, "the dataset's info")
        self.info = read_json_file(info_path)  # bounded: size, nesting, 64-bit integers
        if not isinstance(self.info, dict) or not isinstance(self.info.get("features"), dict):
            raise CheckpointError(f"{info_path}: has no 'features' object")
        self.version = str(self.info.get("codebase_version", ""))[:40]
        if not re.fullmatch(r"v[23]\.\d+", self.version):
            raise CheckpointError(
                f"{info_path}: codebase_version {self.version!r}; rbtool reads LeRobot v2.x and v3.0 datasets"
            )
        self.features: dict[str, dict[str, Any]] = self.info["features"]
        self.frame_bytes: dict[str, int] = {}
        for name, spec in self.features.items():
            self.frame_bytes[name] = _check_feature(name, spec, info_path)
        for key in ("total_episodes", "chunks_size"):
            value = self.info.get(key)
            if value is not None:
                check_index(value, key, info_path)
        if self.info.get("chunks_size") == 0:
            raise CheckpointError(f"{info_path}: chunks_size 0; a chunk holds at least one file")
        self._sidecar: dict[str, Any] | None = None
        self._episodes: list[Episode] | None = None
        self._tasks: list[str] | None = None

    @property
    def v3(self) -> bool:
        return self.version.startswith("v3")

    # ------------------------------------------------------------------ paths
    def _walk(self, rel: Any, what: str) -> tuple[Path, os.stat_result | None]:
        """root / rel, each component checked: no symlink, directories on the way (None: missing)."""
        parts = relative_parts(self.root, rel, what)
        path = self.root
        info: os.stat_result | None = None
        for i, part in enumerate(parts):
            path = path / part
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                return path, None
            except OSError as exc:
                raise CheckpointError(f"{path}: cannot read ({exc.strerror}; {what})") from None
            if stat.S_ISLNK(info.st_mode):
                raise CheckpointError(
                    f"{path}: a symlink ({what}); rbtool reads no symlink inside a LeRobot dataset"
                )
            if i < len(parts) - 1 and not stat.S_ISDIR(info.st_mode):
                return path / os.path.join(*parts[i + 1 :]), None
        return path, info

    def _exists(self, rel: str) -> bool:
        return self._walk(rel, rel)[1] is not None

    def _file(self, rel: Any, what: str) -> Path:
        """The regular file root / rel inside the dataset (reached through no symlink)."""
        path, info = self._walk(rel, what)
        if info is None:
            raise CheckpointError(f"{path}: missing ({what})")
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{path}: not a regular file ({what})")
        return path

    def _template(self, key: str, default: str, values: dict[str, Any]) -> str:
        template = self.info.get(key) or default
        return fill_template(template, values, key, self.root / INFO_FILE)

    # ------------------------------------------------------------------ sidecar, tasks
    def sidecar(self) -> dict[str, Any] | None:
        """The rbtool sidecar, when rbtool wrote this dataset (validated: see check_sidecar)."""
        if self._sidecar is None and self._exists(SIDECAR_FILE):
            path = self._file(SIDECAR_FILE, "the rbtool sidecar")
            self._sidecar = read_json_file(path)  # bounded like checkpoint JSON
            version = self._sidecar.get("rbtool_sidecar") if isinstance(self._sidecar, dict) else None
            if not is_int(version) or not 1 <= version <= SIDECAR_VERSION:
                raise CheckpointError(
                    f"{path}: sidecar version {str(version)[:40]!r} is not one rbtool reads"
                )
            check_sidecar(self._sidecar, self.root, self.features, lambda: len(self.episodes()))
        return self._sidecar

    def tensors_file(self, sidecar: dict[str, Any]) -> Path | None:
        """The sidecar's tensors file (None when it is not there)."""
        rel = sidecar.get("tensors") or SIDECAR_TENSORS
        if not self._exists(rel) and relative_parts(self.root, rel, "the sidecar's tensors"):
            return None
        path = self._file(rel, "the sidecar's tensors")
        self._parquet_budget(path, None, "the sidecar's tensors", per_row_group=True)
        return path

    def tasks(self) -> list[str]:
        if self._tasks is None:
            self._tasks = self._read_tasks()
        return self._tasks

    def _read_tasks(self) -> list[str]:
        if self.v3:
            if not self._exists(TASKS_FILE):
                return []
            path = self._file(TASKS_FILE, "the task list")
            table = self._read_parquet(path, None, "the task list")
            names = [n for n in table.column_names if n != "task_index"]
            text = "task" if "task" in names else (names[0] if names else None)
            if text is None or "task_index" not in table.column_names:
                raise CheckpointError(f"{path}: no task and task_index columns")
            rows: Iterator[tuple[Any, Any]] = zip(
                table.column("task_index").to_pylist(), table.column(text).to_pylist(), strict=True
            )
        else:
            path = self.root / "meta" / "tasks.jsonl"
            rows = ((r["task_index"], r["task"]) for r in self._jsonl("meta/tasks.jsonl"))
        pairs = []
        try:
            for index, task in rows:
                pairs.append((check_index(index, "task_index", path), str(task)))
        except (KeyError, TypeError):
            raise CheckpointError(f"{path}: a line lacks task_index or task") from None
        return [task for _, task in sorted(pairs)]

    def _jsonl(self, rel: str) -> list[dict[str, Any]]:
        path = self._file(rel, rel)
        self._within_file(path, rel)
        return _jsonl(path)

    def _within_file(self, path: Path, what: str) -> None:
        within_budget(path.stat().st_size * 8, f"{path}")

    def _parquet_budget(
        self, path: Path, columns: Sequence[str] | None, what: str, *, per_row_group: bool = False
    ) -> int:
        """The rows of a Parquet file, once the columns read (None: all) fit the memory budget as
        its metadata declares them (their uncompressed size, the whole file or each row group)."""
        import pyarrow.parquet as pq

        pa = require_arrow()
        try:
            meta = pq.ParquetFile(str(path)).metadata
        except (OSError, pa.ArrowInvalid) as exc:
            raise CheckpointError(f"{path}: not a readable Parquet file ({exc})") from None
        names = None if columns is None else set(columns)

        def wanted(column_path: str) -> bool:
            if names is None:
                return True
            head = column_path
            while True:
                if head in names:
                    return True
                if "." not in head:
                    return False
                head = head.rsplit(".", 1)[0]

        total = 0
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            size = sum(
                max(group.column(c).total_uncompressed_size, 0)
                for c in range(group.num_columns)
                if wanted(group.column(c).path_in_schema)
            )
            if per_row_group:
                within_budget(size, f"{path}: row group {g} ({what})")
            total += size
        if not per_row_group:
            within_budget(total, f"{path} ({what}, {meta.num_row_groups} row group(s))")
        return int(meta.num_rows)

    def _read_parquet(self, path: Path, columns: list[str] | None, what: str) -> Any:
        """A Parquet file's columns (None: all), within the budget as declared and as decoded:
        read a batch at a time, the decoded bytes counted (dictionary pages can expand far
        beyond the sizes a file declares)."""
        import pyarrow.parquet as pq

        pa = require_arrow()
        self._parquet_budget(path, columns, what)
        limit = max_bytes()
        try:
            handle = pq.ParquetFile(str(path))
            batches = []
            total = 0
            for batch in handle.iter_batches(batch_size=256, columns=columns):
                total += batch.nbytes
                if total > limit:
                    raise CheckpointError(
                        f"{path} ({what}) decodes to more than the {human_bytes(limit)} "
                        f"{MAX_BYTES_ENV} allows"
                    )
                batches.append(batch)
            if not batches:
                empty = handle.schema_arrow.empty_table()
                return empty if columns is None else empty.select(columns)
            return pa.Table.from_batches(batches)
        except (OSError, pa.ArrowInvalid) as exc:
            raise CheckpointError(f"{path}: not a readable Parquet file ({exc})") from None

    # ------------------------------------------------------------------ episodes
    def episodes(self) -> list[Episode]:
        if self._episodes is None:
            self._episodes = self._read_episodes()
            seen: set[int] = set()
            for episode in self._episodes:
                if episode.index in seen:
                    raise CheckpointError(f"{self.root}: episode {episode.index} is listed twice")
                seen.add(episode.index)
        return self._episodes

    def _episode_files(self) -> list[Path]:
        """meta/episodes/chunk-*/file-*.parquet (no symlink followed)."""
        top, info = self._walk("meta/episodes", "the episode metadata")
        if info is None or not stat.S_ISDIR(info.st_mode):
            return []
        files = []
        for chunk in sorted(os.listdir(top)):
            rel = f"meta/episodes/{chunk}"
            path, cinfo = self._walk(rel, "the episode metadata")
            if cinfo is None or not stat.S_ISDIR(cinfo.st_mode):
                continue
            for name in sorted(os.listdir(path)):
                if name.endswith(".parquet"):
                    files.append(self._file(f"{rel}/{name}", "the episode metadata"))
        return files

    def _read_episodes(self) -> list[Episode]:
        if self.v3:
            import pyarrow.parquet as pq

            files = self._episode_files()
            if not files and not self.info.get("total_episodes"):
                return []  # an empty dataset, as LeRobot leaves one before its first episode
            if not files:
                raise CheckpointError(f"{self.root}: no meta/episodes/chunk-*/file-*.parquet")
            out = []
            wanted = [
                "episode_index",
                "length",
                "tasks",
                "data/chunk_index",
                "data/file_index",
                "dataset_from_index",
            ]
            video_names = [n for n, s in self.features.items() if s.get("dtype") == "video"]
            for name in video_names:
                wanted += [f"videos/{name}/{key}" for key in ("chunk_index", "file_index", "from_timestamp")]
            data_files: dict[tuple[int, int], Path] = {}
            for path in files:
                try:
                    columns = [c for c in wanted if c in pq.read_schema(str(path)).names]
                except (OSError, ValueError) as exc:
                    raise CheckpointError(f"{path}: not a readable Parquet file ({exc})") from None
                table = self._read_parquet(path, columns, "episode metadata")
                for row in table.to_pylist():
                    try:
                        where = (
                            check_index(row["data/chunk_index"], "data/chunk_index", path),
                            check_index(row["data/file_index"], "data/file_index", path),
                        )
                        if where not in data_files:
                            rel = self._template(
                                "data_path", DATA_PATH, {"chunk_index": where[0], "file_index": where[1]}
                            )
                            data_files[where] = self._walk(rel, "a data file")[0]
                        videos = {}
                        for name in video_names:
                            start = row[f"videos/{name}/from_timestamp"]
                            if not isinstance(start, (int, float)) or not math.isfinite(start) or start < 0:
                                raise CheckpointError(
                                    f"{path}: videos/{name}/from_timestamp {start!r} is not a time"
                                )
                            videos[name] = (
                                check_index(row[f"videos/{name}/chunk_index"], "a video chunk_index", path),
                                check_index(row[f"videos/{name}/file_index"], "a video file_index", path),
                                float(start),
                            )
                        begin = row.get("dataset_from_index")
                        out.append(
                            Episode(
                                check_index(row["episode_index"], "episode_index", path),
                                check_index(row["length"], "an episode length", path),
                                _task_list(row.get("tasks"), path),
                                data_files[where],
                                None if begin is None else check_index(begin, "dataset_from_index", path),
                                videos,
                            )
                        )
                    except (KeyError, TypeError, ValueError) as exc:
                        if isinstance(exc, RbtoolError):
                            raise
                        raise CheckpointError(f"{path}: an episode row lacks {exc}") from None
            return sorted(out, key=lambda e: e.index)
        chunks = int(self.info.get("chunks_size") or DEFAULT_CHUNK_SIZE)
        default = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
        out = []
        path = self.root / "meta" / "episodes.jsonl"
        for row in self._jsonl("meta/episodes.jsonl"):
            try:
                ep = check_index(row["episode_index"], "episode_index", path)
                length = check_index(row["length"], "an episode length", path)
                tasks = _task_list(row.get("tasks"), path)
            except (KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(f"{path}: an episode line lacks {exc}") from None
            rel = self._template("data_path", default, {"episode_chunk": ep // chunks, "episode_index": ep})
            out.append(Episode(ep, length, tasks, self._walk(rel, "a data file")[0]))
        return sorted(out, key=lambda e: e.index)

    def check(self, episodes: Sequence[Episode], columns: Sequence[str]) -> None:
        """Everything `frames` would refuse before decoding, refused now (before a buffer is touched):
        each data file a regular file inside the dataset whose read fits the budget, each
        episode's decoded frames within it, each video file inside the dataset."""
        per_frame = self._bytes_per_frame(columns)
        files: set[Path] = set()
        for episode in episodes:
            self._within_episode_budget(episode, per_frame)
            if episode.file not in files:
                files.add(episode.file)
                self._data_file(episode)
            for name in columns:
                if self.features.get(name, {}).get("dtype") == "video" and name in episode.videos:
                    self._file(self._video_rel(name, episode), f"video of feature {name!r}")

    def _bytes_per_frame(self, columns: Sequence[str]) -> int:
        """The bytes one frame of `columns` takes decoded, as meta/info.json declares them."""
        return sum(self.frame_bytes.get(c, 0) for c in dict.fromkeys(columns))

    def _within_episode_budget(self, episode: Episode, per_frame: int) -> None:
        within_budget(
            episode.length * per_frame, f"{self.root}: episode {episode.index} ({episode.length} frames)"
        )

    def _data_file(self, episode: Episode) -> Path:
        rel = episode.file.relative_to(self.root).as_posix()
        path = self._file(rel, f"episode {episode.index}")
        return path

    def _video_rel(self, name: str, episode: Episode) -> str:
        chunk, file, _ = episode.videos[name]
        return self._template(
            "video_path", VIDEO_PATH, {"video_key": name, "chunk_index": chunk, "file_index": file}
        )

    def frames(self, episodes: Sequence[Episode], columns: Sequence[str]) -> Iterator[tuple[Episode, Any]]:
        """(episode, its frames as an Arrow table in frame order) for each episode, reading each file once."""
        import numpy as np
        import pyarrow.parquet as pq

        pa = require_arrow()
        video = [c for c in columns if self.features.get(c, {}).get("dtype") == "video"]
        per_frame = self._bytes_per_frame(columns)
        columns = [c for c in columns if c not in video]
        if video:
            columns = [*columns, "timestamp"]
        cached: tuple[Path, Any, Any] | None = None
        readers: dict[str, VideoReader] = {}
        try:
            for episode in episodes:
                self._within_episode_budget(episode, per_frame)
                if cached is None or cached[0] != episode.file:
                    cached = None
                    path = self._data_file(episode)
                    try:
                        names = pq.read_schema(str(path)).names
                        wanted = [
                            c for c in dict.fromkeys([*columns, "episode_index", "frame_index"]) if c in names
                        ]
                        table = self._read_parquet(path, wanted, f"episode {episode.index}'s data")
                    except (OSError, pa.ArrowInvalid) as exc:
                        raise CheckpointError(f"{path}: not a readable Parquet file ({exc})") from None
                    ep_col = (
                        table.column("episode_index").to_numpy()
                        if "episode_index" in table.column_names
                        else np.full(table.num_rows, episode.index)
                    )
                    cached = (episode.file, table, ep_col)
                _, table, ep_col = cached
                rows = np.nonzero(ep_col == episode.index)[0]
                if len(rows) and rows[-1] - rows[0] + 1 == len(rows):
                    part = table.slice(int(rows[0]), len(rows))  # the usual case: no copy
                else:
                    part = table.take(pa.array(rows))
                if "frame_index" in part.column_names and part.num_rows > 1:
                    steps = part.column("frame_index").to_numpy()
                    if (np.diff(steps) < 0).any():
                        part = part.take(pa.array(np.argsort(steps, kind="stable")))
                if part.num_rows != episode.length:
                    raise CheckpointError(
                        f"{episode.file}: episode {episode.index} has {part.num_rows} frames; "
                        f"its metadata says {episode.length}"
                    )
                for name in video:
                    part = part.append_column(name, self._video_frames(name, episode, part, readers))
                yield episode, part
        finally:
            for reader in readers.values():
                reader.close()

    def _video_frames(self, name: str, episode: Episode, part: Any, readers: dict[str, VideoReader]) -> Any:
        """The episode's frames of a video feature, decoded one at a time, as a column of flat uint8 lists."""
        import numpy as np

        pa = require_arrow()
        spec = self.features[name]
        if not self.v3 or name not in episode.videos:
            where = "v2.x video" if not self.v3 else "episode metadata with no video columns"
            raise CheckpointError(f"{self.root}: feature {name!r}: rbtool does not read {where}")
        start = episode.videos[name][2]
        path = self._file(self._video_rel(name, episode), f"video of feature {name!r}")
        fps = (spec.get("info") or {}).get("video.fps") or self.info.get("fps") or 1
        if not isinstance(fps, (int, float)) or isinstance(fps, bool) or not math.isfinite(fps) or fps <= 0:
            raise CheckpointError(
                f"{self.root / INFO_FILE}: feature {name!r}: fps {str(fps)[:40]!r} is not a rate"
            )
        fps = float(fps)
        if "timestamp" in part.column_names:
            wanted = start + part.column("timestamp").to_numpy().astype(np.float64)
        else:
            wanted = start + part.column("frame_index").to_numpy() / fps
        if not np.isfinite(wanted).all():
            raise CheckpointError(
                f"{episode.file}: episode {episode.index} has a timestamp that is not finite"
            )
        reader = readers.get(name)
        if reader is None or reader.path != path:
            if reader is not None:
                reader.close()
            reader = readers[name] = VideoReader(path, name, hwc_of(spec))
        times, rows = reader.nearest(wanted)
        if len(wanted) and (off := float(np.abs(times - wanted).max())) > 0.5 / fps:
            raise CheckpointError(
                f"{path}: episode {episode.index} wants a frame {off:.3f} s from any the video holds"
            )
        flat = pa.array(np.ascontiguousarray(rows).reshape(-1))
        return pa.FixedSizeListArray.from_arrays(flat, math.prod(rows.shape[1:]))


def _task_list(value: Any, where: Path) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise CheckpointError(f"{where}: an episode's tasks {str(value)[:40]!r} are not a list")
    return [str(v) for v in value]


def _check_feature(name: Any, spec: Any, where: Path) -> int:
    """The bytes one frame of a feature takes, once its spec is one rbtool reads."""
    if not isinstance(spec, dict):
        raise CheckpointError(f"{where}: feature {str(name)[:80]!r} is not an object")
    dtype, shape = spec.get("dtype"), spec.get("shape")
    if not isinstance(dtype, str):
        raise CheckpointError(f"{where}: feature {name!r} has no dtype")
    if (
        not isinstance(shape, list)
        or not 1 <= len(shape) <= _MAX_FEATURE_DIMS
        or not all(is_int(d) and 0 <= d < (1 << 31) for d in shape)
    ):
        raise CheckpointError(
            f"{where}: feature {name!r} has shape {str(shape)[:80]}; a shape is 1 to {_MAX_FEATURE_DIMS} "
            "dims, each in [0, 2**31)"
        )
    if dtype in ("image", "video"):
        itemsize = 1
    elif dtype in NATIVE:
        itemsize = np_dtype(dtype).itemsize
    else:
        itemsize = 8
    need = math.prod(shape) * itemsize
    within_budget(need, f"{where}: one frame of feature {name!r} (shape {shape})")
    return need


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    rows = []
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if line.strip():
            rows.append(read_json_bytes(line, f"{path}: line {number}"))  # bounded per line
            if not isinstance(rows[-1], dict):
                raise CheckpointError(f"{path}: line {number} is not a JSON object")
    return rows
