"""LeRobot v3.0's dataset layout: the metadata file names, the path templates of data, episode
and video files, their default sizes, the rule by which files follow one another in chunks,
and the features every frame carries.
"""

from __future__ import annotations

from pathlib import Path

CODEBASE_VERSION = "v3.0"
INFO_FILE = "meta/info.json"
STATS_FILE = "meta/stats.json"
TASKS_FILE = "meta/tasks.parquet"
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
DEFAULT_CHUNK_SIZE = 1000
DEFAULT_DATA_FILE_SIZE_MB = 100.0
DEFAULT_VIDEO_FILE_SIZE_MB = 200
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
# Every LeRobot frame carries these; they are not buffer fields.
FRAME_FEATURES = {
    "timestamp": "float32",
    "frame_index": "int64",
    "episode_index": "int64",
    "index": "int64",
    "task_index": "int64",
}


def next_file(chunk: int, file: int, chunks_size: int) -> tuple[int, int]:
    """The (chunk, file) index after this one: a chunk holds `chunks_size` files."""
    return (chunk + 1, 0) if file == chunks_size - 1 else (chunk, file + 1)


class Rolling:
    """Files under `root` in chunk/file order, the next one begun when the open one is full
    (`limit` bytes; a unit is never split): where the next unit goes, and how many files were
    opened. A subclass opens and closes its kind of file."""

    def __init__(self, root: Path, limit_bytes: float, chunks_size: int) -> None:
        self.root = root
        self.limit = limit_bytes
        self.chunks_size = chunks_size
        self.chunk, self.file = 0, 0
        self.files = 0

    def close_file(self) -> None:
        raise NotImplementedError

    def roll(self) -> None:
        """Close the open file; the next unit goes into the next (chunk, file)."""
        self.close_file()
        self.chunk, self.file = next_file(self.chunk, self.file, self.chunks_size)
