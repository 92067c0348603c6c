"""Video features: the H.264 mp4 files an export writes (episodes one after another in each
file, rolled over by size), and the frames an import decodes from any dataset's videos.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rbtool.errors import CheckpointError
from rbtool.interop.lerobot.extras import require_av
from rbtool.interop.lerobot.layout import VIDEO_PATH, Rolling

if TYPE_CHECKING:
    import numpy as np

VIDEO_ENCODER = "libx264"  # H.264: PyAV's FFmpeg has it, and it takes frames of any even size
VIDEO_CODEC = "h264"
VIDEO_PIX_FMT = "yuv420p"
VIDEO_OPTIONS = {"crf": "18", "g": "2", "preset": "veryfast"}


class RollingVideo(Rolling):
    """One video feature's mp4 files, episodes one after another in each, as LeRobot lays them out.

    A file takes episodes until it has reached the size limit, then the next file starts;
    an episode is never split. Frame k of a file has timestamp k / fps.
    """

    def __init__(self, root: Path, feature: str, fps: int, limit_bytes: float, chunks_size: int) -> None:
        super().__init__(root, limit_bytes, chunks_size)
        self.feature = feature
        self.fps = fps
        self.container: Any = None
        self.stream: Any = None
        self.path: Path | None = None
        self.frames = 0  # frames in the open file
        self.muxed = 0  # bytes of the packets written to it (the encoder may still hold a few frames)

    def _open(self, height: int, width: int) -> None:
        av = require_av()
        self.path = self.root / VIDEO_PATH.format(
            video_key=self.feature, chunk_index=self.chunk, file_index=self.file
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.container = av.open(str(self.path), "w")
        self.stream = self.container.add_stream(VIDEO_ENCODER, rate=self.fps)
        self.stream.width, self.stream.height = width, height
        self.stream.pix_fmt = VIDEO_PIX_FMT
        self.stream.options = dict(VIDEO_OPTIONS)
        self.files += 1

    def close_file(self) -> None:
        if self.container is not None:
            for packet in self.stream.encode():
                self.container.mux(packet)
            self.container.close()
            self.container = self.stream = None

    def add(self, frames: np.ndarray) -> tuple[int, int, float, float]:
        """Append one episode's uint8 frames `[n, H, W, 3]`: (chunk, file, from_timestamp, to_timestamp)."""
        av = require_av()
        if self.container is not None and self.muxed >= self.limit:
            self.roll()
            self.frames = self.muxed = 0
        if self.container is None:
            self._open(int(frames.shape[1]), int(frames.shape[2]))
        start = self.frames
        for frame in frames:
            picture = av.VideoFrame.from_ndarray(frame, format="rgb24")
            picture.pts = self.frames
            for packet in self.stream.encode(picture):
                self.muxed += packet.size
                self.container.mux(packet)
            self.frames += 1
        return self.chunk, self.file, start / self.fps, self.frames / self.fps


def video_columns(name: str, where: tuple[int, int, float, float]) -> dict[str, Any]:
    """An episode's `videos/<feature>/...` metadata columns, as LeRobot names them."""
    keys = ("chunk_index", "file_index", "from_timestamp", "to_timestamp")
    return {f"videos/{name}/{key}": value for key, value in zip(keys, where, strict=True)}


class VideoReader:
    """One video file decoded frame by frame, forward: only the frames an episode wants are kept."""

    def __init__(self, path: Path, feature: str, hwc: tuple[int, int, int]) -> None:
        self.path, self.feature, self.hwc = path, feature, hwc
        self._container: Any = None
        self._frames: Iterator[Any] | None = None
        self._held: tuple[float, Any] | None = None  # the last frame decoded, not yet passed
        self._decoded = 0
        self._declared = 0

    def _open(self) -> None:
        av = require_av()
        self.close()
        try:
            self._container = av.open(str(self.path))
            stream = self._container.streams.video[0]
            height, width = int(stream.codec_context.height), int(stream.codec_context.width)
            self._declared = int(stream.frames or 0)
            self._frames = self._container.decode(stream)
        except (av.error.FFmpegError, IndexError) as exc:
            self.close()
            raise CheckpointError(f"{self.path}: not a readable video ({exc})") from None
        if (height, width) != self.hwc[:2]:
            self.close()
            raise CheckpointError(
                f"{self.path}: frames of {height}x{width}; meta/info.json says {self.hwc[0]}x{self.hwc[1]} "
                f"(feature {self.feature!r})"
            )
        self._held = None
        self._decoded = 0

    def close(self) -> None:
        if self._container is not None:
            with contextlib.suppress(Exception):
                self._container.close()
        self._container = self._frames = None

    def _next(self) -> tuple[float, Any] | None:
        av = require_av()
        assert self._frames is not None
        try:
            frame = next(self._frames, None)
        except (av.error.FFmpegError, ValueError) as exc:
            raise CheckpointError(f"{self.path}: not a readable video ({exc})") from None
        if frame is None:
            return None
        self._decoded += 1
        if self._declared and self._decoded > self._declared:
            raise CheckpointError(f"{self.path}: decodes more frames than the {self._declared} it declares")
        if (frame.height, frame.width) != self.hwc[:2]:
            raise CheckpointError(
                f"{self.path}: a frame of {frame.height}x{frame.width}; meta/info.json says "
                f"{self.hwc[0]}x{self.hwc[1]} (feature {self.feature!r})"
            )
        time = float(frame.pts * frame.time_base) if frame.pts is not None else float(self._decoded - 1)
        channels = self.hwc[2]
        if channels == 1:
            array = frame.to_ndarray(format="gray")[..., None]
        else:
            array = frame.to_ndarray(format="rgba" if channels == 4 else "rgb24")
        return time, array

    def nearest(self, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(time, frame) of the frame nearest each wanted time (ties: the earlier frame)."""
        import numpy as np

        n = len(wanted)
        times = np.zeros(n)
        rows = np.zeros((n, *self.hwc), dtype=np.uint8)
        if not n:
            return times, rows
        order = np.argsort(wanted, kind="stable")
        if self._container is None or self._held is None or float(wanted[order[0]]) < self._held[0]:
            self._open()
            self._held = self._next()
            if self._held is None:
                raise CheckpointError(f"{self.path}: holds no frames")
        i = 0
        while i < n:
            following = self._next()
            held_time, held = self._held
            if following is not None and following[0] < held_time:
                raise CheckpointError(f"{self.path}: frame times go backwards ({following[0]:.3f} s)")
            middle = math.inf if following is None else (held_time + following[0]) / 2
            while i < n and float(wanted[order[i]]) <= middle:
                times[order[i]] = held_time
                rows[order[i]] = held
                i += 1
            if following is None:
                break
            self._held = following
        return times, rows
