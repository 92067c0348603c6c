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
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
import os
import re
import shutil
import stat
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from rbtool.errors import CheckpointError, LeRobotFeatureError, RbtoolError, UsageError
from rbtool.files import trajfile
from rbtool.files.dirs import open_checkpoint, open_view
from rbtool.files.fsutil import (
    fsync_dir,
    make_parents,
    new_staging_dir,
    refuse_file_parent,
    write_bytes_atomic,
)
from rbtool.files.index import Index, init_buffer_dir, read_index
from rbtool.files.writer import BufferWriter, WriteReport, new_entry
from rbtool.format import check_weights_id, is_checkpoint_dir, read_json_bytes, read_json_file
from rbtool.format.layout import DONE_LIKE, done_extra_rows, drop_bootstrap_rows, with_stored_defaults
from rbtool.passes import ranks
from rbtool.passes.journal import open_journal

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa
    import torch

CODEBASE_VERSION = "v3.0"
SIDECAR_FILE = "meta/rbtool.json"
SIDECAR_TENSORS = "meta/rbtool/tensors.parquet"
SIDECAR_VERSION = 1
INFO_FILE = "meta/info.json"
STATS_FILE = "meta/stats.json"
TASKS_FILE = "meta/tasks.parquet"
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
DEFAULT_CHUNK_SIZE = 1000
DEFAULT_DATA_FILE_SIZE_MB = 100.0
DEFAULT_VIDEO_FILE_SIZE_MB = 200
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
VIDEO_ENCODER = "libx264"  # H.264: PyAV's FFmpeg has it, and it takes frames of any even size
VIDEO_CODEC = "h264"
VIDEO_PIX_FMT = "yuv420p"
VIDEO_OPTIONS = {"crf": "18", "g": "2", "preset": "veryfast"}
QUANTILES = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}

# Every LeRobot frame carries these; they are not buffer fields.
FRAME_FEATURES = {
    "timestamp": "float32",
    "frame_index": "int64",
    "episode_index": "int64",
    "index": "int64",
    "task_index": "int64",
}
# The per-frame columns that say where a frame came from in the buffer.
RB_TRAJECTORY_ID = "rb.trajectory_id"
RB_ENV = "rb.env"
RB_T = "rb.t"
RB_MODEL_WEIGHTS_ID = "rb.model_weights_id"
RB_FEATURES = {RB_TRAJECTORY_ID: "int64", RB_ENV: "int64", RB_T: "int64", RB_MODEL_WEIGHTS_ID: "string"}

# Buffer fields and the feature names RLinf's own LeRobot writer gives them (its writer has
# no reward: LeRobot's convention `next.reward` is used, which import reads back).
RLINF_NAMES = {
    ("curr_obs", "main_images"): "image",
    ("curr_obs", "wrist_images"): "wrist_image",
    ("curr_obs", "extra_view_images"): "extra_view_image",
    ("curr_obs", "states"): "state",
    ("actions",): "actions",
    ("dones",): "done",
    ("intervene_flags",): "intervene_flag",
    ("rewards",): "next.reward",
}
# Import: LeRobot feature names and the buffer fields they become (besides RLINF_NAMES reversed).
IMPORT_NAMES = {
    "observation.state": ("curr_obs", "states"),
    "action": ("actions",),
    "reward": ("rewards",),
    "next.done": ("dones",),
    "wrist_image": ("curr_obs", "wrist_images"),
}

# torch dtypes Arrow holds as they are, and those kept as their bits (tagged in the sidecar).
_NATIVE = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
)
_IMAGE_NAMES = {path for path, name in RLINF_NAMES.items() if "image" in name}
_MULTI_VIEW = {("curr_obs", "wrist_images"), ("curr_obs", "extra_view_images")}
_AS_BITS = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}
# The dtypes a trajectory file may hold (trajfile.supported_dtypes): nothing else is imported.
_TRAJECTORY_DTYPES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
    "complex64", "complex128",
)  # fmt: skip
_MAX_ARRAY_DIMS = 5  # LeRobot's features go up to Array5D


def _require_arrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise UsageError(
            "LeRobot datasets need pyarrow, which is not installed (pip install 'rbtool[lerobot]')"
        ) from None
    return pyarrow


def _require_av() -> Any:
    try:
        import av
    except ImportError:
        raise UsageError(
            "LeRobot video features need PyAV, which is not installed (pip install 'rbtool[lerobot]')"
        ) from None
    return av


def _require_pil() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise UsageError(
            "LeRobot image features need Pillow, which is not installed (pip install 'rbtool[lerobot]')"
        ) from None
    return Image


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown tensor dtype {name!r}")
    return dtype


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return bytes(flat.view(torch.uint8).numpy().tobytes())


def _from_raw(data: bytes, dtype: str, shape: Sequence[int], where: str = "") -> torch.Tensor:
    import torch

    where = f"{where}: " if where else ""
    if dtype not in _TRAJECTORY_DTYPES:
        raise CheckpointError(
            f"a stored tensor of dtype {str(dtype)[:40]!r}, which trajectory files do not hold"
        )
    tdtype = _torch_dtype(dtype)
    if not isinstance(shape, (list, tuple)) or not all(_is_int(d) and 0 <= d < (1 << 31) for d in shape):
        raise CheckpointError(f"{where}a stored tensor of shape {str(shape)[:80]}, not a shape")
    if not isinstance(data, bytes) or len(data) != math.prod(shape) * tdtype.itemsize:
        size = len(data) if isinstance(data, bytes) else "no"
        raise CheckpointError(f"{where}a stored {dtype} tensor of shape {list(shape)} has {size} bytes")
    if math.prod(shape) == 0:
        return torch.empty(tuple(shape), dtype=tdtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(tdtype).reshape(tuple(shape)).clone()


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A tensor as numpy, dtypes Arrow lacks as their bits."""
    name = _dtype_name(tensor.dtype)
    if name in _AS_BITS:
        return tensor.contiguous().view(_torch_dtype(_AS_BITS[name])).numpy()
    return tensor.contiguous().numpy()


def _from_numpy(array: np.ndarray, dtype: str) -> torch.Tensor:
    import numpy as np
    import torch

    if dtype in _AS_BITS:
        return torch.from_numpy(np.ascontiguousarray(array.astype(_AS_BITS[dtype], copy=False))).view(
            _torch_dtype(dtype)
        )
    return torch.from_numpy(np.ascontiguousarray(array.astype(dtype, copy=False)))


def _json(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)


def _encode_value(value: Any) -> Any:
    """A scalar field as JSON (non-finite floats tagged: JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    if isinstance(value, list):
        return [_encode_value(v) for v in value]
    return value


def _decode_value(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"float"}:
        return float(value["float"])
    if isinstance(value, list):
        return [_decode_value(v) for v in value]
    return value


# ====================================================================== features
@dataclass
class Column:
    """A buffer field stored as a per-frame LeRobot feature."""

    feature: str
    path: tuple[str, ...]
    dtype: str  # torch dtype name of the field
    shape: tuple[int, ...]  # per-sample shape in the trajectory
    image: bool
    views: int = 0  # > 0: a multi-view [N, H, W, C] field, one image feature `<feature>-<i>` per view
    video: bool = False  # an image field stored as a video feature (mp4 files, not in the Parquet data)

    @property
    def stored(self) -> str:
        """The dtype of the column's values (bits for dtypes Arrow lacks)."""
        return _AS_BITS.get(self.dtype, self.dtype)

    @property
    def feature_shape(self) -> tuple[int, ...]:
        if self.image:
            return self.shape[1:] if self.views else self.shape
        if len(self.shape) > _MAX_ARRAY_DIMS:
            return (math.prod(self.shape),)
        return self.shape or (1,)

    @property
    def frame_shape(self) -> tuple[int, ...]:
        """The shape of one frame's values (all views of a multi-view field)."""
        return (self.views, *self.feature_shape) if self.views else self.feature_shape

    def spec(self, fps: int = 0) -> dict[str, Any]:
        if self.video:
            height, width, channels = self.feature_shape
            return {
                "dtype": "video",
                "shape": list(self.feature_shape),
                "names": ["height", "width", "channels"],
                "info": {
                    "video.height": height,
                    "video.width": width,
                    "video.codec": VIDEO_CODEC,
                    "video.pix_fmt": VIDEO_PIX_FMT,
                    "video.is_depth_map": False,
                    "video.fps": fps,
                    "video.channels": channels,
                    "has_audio": False,
                },
            }
        if self.image:
            return {
                "dtype": "image",
                "shape": list(self.feature_shape),
                "names": ["height", "width", "channels"],
            }
        return {"dtype": self.stored, "shape": list(self.feature_shape), "names": None}

    def names(self) -> list[str]:
        """The LeRobot features this field is stored as (one per view for a multi-view field)."""
        return [f"{self.feature}-{i}" for i in range(self.views)] if self.views else [self.feature]

    def specs(self, fps: int = 0) -> dict[str, dict[str, Any]]:
        return {name: self.spec(fps) for name in self.names()}

    def fields(self) -> dict[str, str]:
        """Feature name -> the buffer field (`path[i]` for view i) it holds."""
        dotted = _field_name(self.path)
        if not self.views:
            return {self.feature: dotted}
        return {name: f"{dotted}[{i}]" for i, name in enumerate(self.names())}

    def split(self, frames: np.ndarray) -> dict[str, np.ndarray]:
        """Per-frame values `[n, *shape]` as the values of each feature."""
        if not self.views:
            return {self.feature: frames}
        return {name: frames[:, i] for i, name in enumerate(self.names())}


def _is_image(dtype: str, shape: tuple[int, ...]) -> bool:
    return dtype == "uint8" and len(shape) == 3 and shape[2] in (1, 3, 4) and shape[0] > 0 and shape[1] > 0


def _is_video(dtype: str, shape: tuple[int, ...]) -> bool:
    """An image that a yuv420p video holds: RGB, even height and width."""
    return _is_image(dtype, shape) and shape[2] == 3 and shape[0] % 2 == 0 and shape[1] % 2 == 0


def _hf_feature(spec: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face `datasets` feature of a LeRobot feature (what LeRobot's own files record)."""
    dtype, shape = spec["dtype"], list(spec["shape"])
    if dtype == "image":
        return {"_type": "Image"}
    if shape == [1]:
        return {"dtype": dtype, "_type": "Value"}
    if len(shape) == 1:
        return {"feature": {"dtype": dtype, "_type": "Value"}, "length": shape[0], "_type": "List"}
    return {"shape": shape, "dtype": dtype, "_type": f"Array{len(shape)}D"}


def _arrow_type(spec: dict[str, Any]) -> pa.DataType:
    pa = _require_arrow()
    dtype, shape = spec["dtype"], list(spec["shape"])
    if dtype == "image":
        return pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    value = pa.string() if dtype == "string" else pa.from_numpy_dtype(_np_dtype(dtype))
    if shape == [1]:
        return value
    if len(shape) == 1:
        return pa.list_(value, shape[0])
    for _ in shape:
        value = pa.list_(value)
    return value


def _np_dtype(name: str) -> Any:
    import numpy as np

    return np.dtype(name)


def _column_array(values: np.ndarray, spec: dict[str, Any]) -> pa.Array:
    """Per-frame values `[n, *shape]` as an Arrow column of the feature's type."""
    import numpy as np

    pa = _require_arrow()
    shape = list(spec["shape"])
    n = values.shape[0]
    flat = pa.array(np.ascontiguousarray(values).reshape(-1))
    if shape == [1]:
        return flat
    if len(shape) == 1:
        return pa.FixedSizeListArray.from_arrays(flat, shape[0])
    array = flat
    # Innermost lists first: level k holds n * prod(shape[:k]) lists of shape[k] values each.
    for level in range(len(shape) - 1, -1, -1):
        count = n * math.prod(shape[:level])
        offsets = pa.array(np.arange(count + 1, dtype=np.int64) * shape[level], pa.int32())
        array = pa.ListArray.from_arrays(offsets, array)
    return array


def _image_array(frames: np.ndarray) -> pa.Array:
    """uint8 frames `[n, H, W, C]` as LeRobot image structs (PNG bytes, lossless)."""
    pa = _require_arrow()
    image = _require_pil()
    pngs = []
    for frame in frames:
        picture = image.fromarray(frame[..., 0] if frame.shape[2] == 1 else frame)
        buffer = io.BytesIO()
        picture.save(buffer, format="PNG")
        pngs.append(buffer.getvalue())
    return pa.StructArray.from_arrays(
        [pa.array(pngs, pa.binary()), pa.nulls(len(pngs), pa.string())], names=["bytes", "path"]
    )


def _decode_images(
    column: pa.Array, shape: Sequence[int], feature: str, spec_names: Sequence[str] | None = None
) -> np.ndarray:
    """LeRobot image structs (PNG or any format Pillow reads) as uint8 `[n, H, W, C]`."""
    import numpy as np

    image = _require_pil()
    names = spec_names or []
    channels_first = bool(names) and str(names[0]).startswith("channel")
    channels = int(shape[0] if channels_first else shape[-1]) if len(shape) == 3 else 3
    mode = {1: "L", 3: "RGB", 4: "RGBA"}.get(channels, "RGB")
    if len(shape) == 3:
        height, width = (int(shape[1]), int(shape[2])) if channels_first else (int(shape[0]), int(shape[1]))
    out = []
    for value in column.to_pylist():
        if value is None or value.get("bytes") is None:
            raise CheckpointError(f"feature {feature!r}: a frame has no image bytes")
        try:
            with image.open(io.BytesIO(value["bytes"])) as picture:
                # the size a picture claims is checked before its pixels are decoded
                if len(shape) == 3 and picture.size != (width, height):
                    raise CheckpointError(
                        f"feature {feature!r}: an image of {picture.size[1]}x{picture.size[0]}; "
                        f"meta/info.json says {height}x{width}"
                    )
                if picture.mode != mode:
                    picture = picture.convert(mode)
                array = np.asarray(picture, dtype=np.uint8)
        except RbtoolError:
            raise
        except (OSError, ValueError, SyntaxError, image.DecompressionBombError) as exc:
            why = type(exc).__name__ if "BytesIO" in str(exc) else str(exc)[:200]
            raise CheckpointError(f"feature {feature!r}: a frame is not a readable image ({why})") from None
        out.append(array[..., None] if array.ndim == 2 else array)
    if not out:
        dims = [int(d) for d in shape]
        hwc = (*dims[1:], dims[0]) if channels_first and len(dims) == 3 else tuple(dims)
        return np.zeros((0, *hwc), dtype=np.uint8)
    return np.stack(out)


def _column_numpy(column: Any, spec: dict[str, Any], feature: str) -> np.ndarray:
    """An Arrow column (any list nesting) as numpy `[n, *shape]` of the feature's dtype."""
    import numpy as np

    pa = _require_arrow()
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    shape = [int(s) for s in spec["shape"]]
    n = len(column)
    if column.null_count:
        raise CheckpointError(f"feature {feature!r}: {column.null_count} frame(s) have no value")
    if spec["dtype"] == "image":
        return _decode_images(column, shape, feature, spec.get("names"))
    if spec["dtype"] == "video":  # decoded by LeRobotSource.frames: flat uint8 per frame
        return np.asarray(column.flatten().to_numpy()).reshape(n, *_hwc(spec))
    array = column
    while (
        pa.types.is_list(array.type)
        or pa.types.is_large_list(array.type)
        or pa.types.is_fixed_size_list(array.type)
    ):
        array = array.flatten()
    values = array.to_numpy(zero_copy_only=False)
    per = math.prod(shape) if shape else 1
    if values.size != n * per:
        raise CheckpointError(
            f"feature {feature!r}: {values.size} values for {n} frames of shape {shape}; "
            "the data does not match meta/info.json"
        )
    return np.asarray(values).astype(_np_dtype(spec["dtype"]), copy=False).reshape(n, *shape)


# ====================================================================== stats
def _stats(values: np.ndarray, image: bool) -> dict[str, np.ndarray]:
    """LeRobot's per-feature statistics of frames `[n, ...]` (images per channel, in [0, 1])."""
    import numpy as np

    if image:
        # Images: per channel over frames and pixels, subsampled as LeRobot does for speed.
        step = max(1, values.shape[0] // 100)
        sub = values[::step]
        stride = max(1, max(sub.shape[1], sub.shape[2]) // 150)
        sub = sub[:, ::stride, ::stride].astype(np.float64) / 255.0
        data = sub.transpose(3, 0, 1, 2).reshape(sub.shape[3], -1).T
        # Exact min, max, mean and std over every pixel, a few frames at a time (a float copy
        # of a whole episode of camera frames would not fit in memory).
        channels = values.shape[3]
        total = np.zeros(channels)
        squares = np.zeros(channels)
        for start in range(0, values.shape[0], 16):
            block = values[start : start + 16].reshape(-1, channels).astype(np.float64)
            total += block.sum(axis=0)
            squares += (block * block).sum(axis=0)
        count = max(1, values.shape[0] * values.shape[1] * values.shape[2])
        mean = total / count
        out = {
            "min": values.min(axis=(0, 1, 2)) / 255.0,
            "max": values.max(axis=(0, 1, 2)) / 255.0,
            "mean": mean / 255.0,
            "std": np.sqrt(np.maximum(squares / count - mean * mean, 0.0)) / 255.0,
        }
        out.update(_quantiles(data))
        shaped = {k: v.reshape(-1, 1, 1) for k, v in out.items()}
        shaped["count"] = np.array([values.shape[0]])
        return shaped
    data = values.astype(np.float64)
    out = {
        "min": values.min(axis=0),
        "max": values.max(axis=0),
        "mean": data.mean(axis=0),
        "std": data.std(axis=0),
        "count": np.array([values.shape[0]]),
    }
    out.update(_quantiles(data))
    return out


def _quantiles(data: np.ndarray) -> dict[str, np.ndarray]:
    """QUANTILES along axis 0 as numpy's default (linear) method gives them, from one sort.

    One sort for all five (np.quantile partitions once per quantile): an export computes
    them for every feature of every episode.
    """
    import numpy as np

    ordered = np.sort(data, axis=0)
    n = ordered.shape[0]
    out = {}
    for key, q in QUANTILES.items():
        h = (n - 1) * q
        lo = math.floor(h)
        hi = min(lo + 1, n - 1)
        out[key] = ordered[lo] + (h - lo) * (ordered[hi] - ordered[lo])
    return out


def _aggregate(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Dataset statistics from per-episode ones (LeRobot's rule: pooled mean and variance,
    count-weighted quantiles)."""
    import numpy as np

    counts = np.array([float(p["count"][0]) for p in parts])
    total = counts.sum()
    weights = counts / total

    def wsum(values: list[np.ndarray]) -> np.ndarray:
        total = np.zeros_like(values[0], dtype=np.float64)
        for w, value in zip(weights, values, strict=True):
            total = total + w * value.astype(np.float64)
        return total

    mean = wsum([p["mean"] for p in parts])
    var = wsum([p["std"].astype(np.float64) ** 2 + (p["mean"] - mean) ** 2 for p in parts])
    out = {
        "min": np.min(np.stack([p["min"] for p in parts]), axis=0),
        "max": np.max(np.stack([p["max"] for p in parts]), axis=0),
        "mean": mean,
        "std": np.sqrt(var),
        "count": np.array([int(total)]),
    }
    for key in QUANTILES:
        out[key] = wsum([p[key] for p in parts])
    return out


def _stats_json(stats: dict[str, np.ndarray]) -> dict[str, Any]:
    return {k: v.tolist() for k, v in stats.items()}


# ====================================================================== export
@dataclass
class ExportResult:
    """What an export wrote."""

    out: Path
    source: Path
    trajectories: int = 0
    episodes: int = 0
    frames: int = 0
    features: dict[str, dict[str, Any]] = field(default_factory=dict)
    columns: dict[str, str] = field(default_factory=dict)  # feature -> buffer field
    sidecar_fields: list[str] = field(default_factory=list)  # fields kept whole in the sidecar
    data_files: int = 0
    video_files: int = 0
    episode_files: int = 0
    bytes: int = 0
    journal: dict[str, int] | None = None  # a resumable export: trajectories, and those from the journal


def _field_name(path: Sequence[str]) -> str:
    return ".".join(path)


def _entries(traj: dict[str, Any]) -> Iterator[tuple[str, tuple[str, ...], Any]]:
    """(kind, path, value) for every entry of a trajectory dict, depth first in dict order."""
    import torch

    def walk(d: dict[str, Any], prefix: tuple[str, ...]) -> Iterator[tuple[str, tuple[str, ...], Any]]:
        for key, value in d.items():
            path = (*prefix, key)
            if isinstance(value, dict):
                yield "dict", path, value
                yield from walk(value, path)
            elif isinstance(value, torch.Tensor):
                yield "tensor", path, value
            else:
                yield "value", path, value

    yield from walk(traj, ())


class _Registry:
    """Feature names and specs, decided by the first trajectory that has each field."""

    def __init__(self, names: dict[str, str], images: bool, video: bool = False) -> None:
        self.names = names
        self.images = images
        self.video = video
        self.columns: dict[tuple[str, ...], Column] = {}
        self.taken = set(FRAME_FEATURES) | set(RB_FEATURES)
        self.used_names: set[str] = set()

    def column(self, path: tuple[str, ...], dtype: str, shape: tuple[int, ...]) -> Column | None:
        """The column for this field, or None when an earlier trajectory gave it another spec."""
        dotted = _field_name(path)
        image = self.images and _is_image(dtype, shape)
        # RLinf's writer stores several wrist / extra-view cameras as `wrist_image-0`, `-1`, ...
        views = (
            shape[0]
            if self.images
            and path in _MULTI_VIEW
            and len(shape) == 4
            and shape[0] > 0
            and _is_image(dtype, shape[1:])
            else 0
        )
        image = image or views > 0
        video = self.video and image and _is_video(dtype, shape[1:] if views else shape)
        known = self.columns.get(path)
        if known is not None:
            same = (known.dtype, known.shape, known.image, known.views, known.video) == (
                dtype,
                shape,
                image,
                views,
                video,
            )
            return known if same else None
        name = self.names.get(dotted)
        if name is not None:
            self.used_names.add(dotted)
            if name in self.taken:
                raise UsageError(f"feature name {name!r} for {dotted} is already taken")
        else:
            named = RLINF_NAMES.get(path, dotted)
            if path in _IMAGE_NAMES and not image:  # RLinf's image names are for images only
                named = dotted
            base = named.replace("/", "_")
            name, n = base, 1
            while any(v in self.taken for v in Column(name, path, dtype, shape, image, views, video).names()):
                n += 1
                name = f"{base}_{n}"
        col = Column(name, path, dtype, shape, image, views, video)
        if any(v in self.taken for v in col.names()):
            raise UsageError(f"feature name {name!r} for {dotted} is already taken")
        self.taken.update(col.names())
        self.columns[path] = col
        return col


def _column_ok(tensor: torch.Tensor, path: tuple[str, ...], t: int, b: int) -> int | None:
    """E (extra leading rows) when the tensor can be a per-frame column, else None."""
    if tensor.dim() < 2 or t * b == 0:
        return None
    name = _dtype_name(tensor.dtype)
    if name not in _NATIVE and name not in _AS_BITS:
        return None
    rows, cols = int(tensor.shape[0]), int(tensor.shape[1])
    if any(int(d) == 0 for d in tensor.shape[2:]):
        return None
    if len(path) == 1 and path[0] in DONE_LIKE:
        try:
            return done_extra_rows(rows, t, cols, b)
        except ValueError:
            return None
    return 0 if (rows, cols) == (t, b) else None


def _episode_ends(traj: dict[str, Any], t: int, b: int) -> np.ndarray:
    """[T, B] bool: where a done flag ends an episode (dones, else terminations | truncations)."""
    import numpy as np
    import torch

    def flags(name: str) -> np.ndarray | None:
        value = traj.get(name)
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            return None
        try:
            done_extra_rows(int(value.shape[0]), t, int(value.shape[1]), b)
        except ValueError:
            return None
        rows = drop_bootstrap_rows(value, t).reshape(t, b, -1)
        return (rows != 0).any(dim=2).numpy()

    ends = flags("dones")
    if ends is None:
        term, trunc = flags("terminations"), flags("truncations")
        present = [f for f in (term, trunc) if f is not None]
        ends = np.logical_or.reduce(present) if present else np.zeros((t, b), dtype=bool)
    return ends


def _episode_bounds(ends: np.ndarray, t: int, b: int) -> list[tuple[int, int]]:
    """Episode frame ranges in (b, t) frame order: a new one after every done flag."""
    bounds: list[tuple[int, int]] = []
    for bi in range(b):
        start = 0
        for ti in range(t):
            if ends[ti, bi] or ti == t - 1:
                bounds.append((bi * t + start, bi * t + ti + 1))
                start = ti + 1
    return bounds


def _digest(traj: dict[str, Any]) -> str:
    """A hash of a trajectory's content: every entry's path, dtype, shape and bytes, in order."""
    digest = hashlib.sha256()
    for kind, path, value in _entries(traj):
        digest.update(orjson.dumps([kind, list(path)]))
        if kind == "tensor":
            digest.update(orjson.dumps([_dtype_name(value.dtype), list(value.shape)]))
            digest.update(_raw_bytes(value))
        elif kind == "value":
            digest.update(orjson.dumps(_encode_value(value)))
    return digest.hexdigest()


class _RollingParquet:
    """Parquet files `template` in chunk/file order, a new one when the size limit would be crossed.

    Units (episodes) are never split across files; rows are buffered into row groups.
    """

    def __init__(self, root: Path, template: str, limit_bytes: float, chunks_size: int) -> None:
        self.root = root
        self.template = template
        self.limit = limit_bytes
        self.chunks_size = chunks_size
        self.chunk, self.file = 0, 0
        self.writer: Any = None
        self.sink: Any = None
        self.schema: Any = None
        self.pending: list[Any] = []
        self.pending_bytes = 0
        self.file_rows = 0
        self.files = 0
        self.bytes = 0

    def _open(self) -> None:
        pa = _require_arrow()
        import pyarrow.parquet as pq

        path = self.root / self.template.format(chunk_index=self.chunk, file_index=self.file)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.sink = pa.OSFile(str(path), "wb")
        self.writer = pq.ParquetWriter(self.sink, self.schema, compression="snappy")
        self.files += 1

    def _flush(self) -> None:
        if not self.pending:
            return
        pa = _require_arrow()
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
            self.close_file()
            if self.file == self.chunks_size - 1:
                self.chunk, self.file = self.chunk + 1, 0
            else:
                self.file += 1
            self.file_rows = 0
        self.pending.append(table)
        self.pending_bytes += est_bytes
        self.file_rows += table.num_rows
        if self.pending_bytes >= 8 << 20 or sum(p.num_rows for p in self.pending) >= 10000:
            self._flush()
        return self.chunk, self.file

    def close(self) -> None:
        self.close_file()


class _RollingVideo:
    """One video feature's mp4 files, episodes one after another in each, as LeRobot lays them out.

    A file takes episodes until it has reached the size limit, then the next file starts;
    an episode is never split. Frame k of a file has timestamp k / fps.
    """

    def __init__(self, root: Path, feature: str, fps: int, limit_bytes: float, chunks_size: int) -> None:
        self.root = root
        self.feature = feature
        self.fps = fps
        self.limit = limit_bytes
        self.chunks_size = chunks_size
        self.chunk, self.file = 0, 0
        self.container: Any = None
        self.stream: Any = None
        self.path: Path | None = None
        self.frames = 0  # frames in the open file
        self.muxed = 0  # bytes of the packets written to it (the encoder may still hold a few frames)
        self.files = 0

    def _open(self, height: int, width: int) -> None:
        av = _require_av()
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
        av = _require_av()
        if self.container is not None and self.muxed >= self.limit:
            self.close_file()
            self.chunk, self.file = (
                (self.chunk + 1, 0)
                if self.file == self.chunks_size - 1
                else (
                    self.chunk,
                    self.file + 1,
                )
            )
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


def _video_columns(name: str, where: tuple[int, int, float, float]) -> dict[str, Any]:
    """An episode's `videos/<feature>/...` metadata columns, as LeRobot names them."""
    keys = ("chunk_index", "file_index", "from_timestamp", "to_timestamp")
    return {f"videos/{name}/{key}": value for key, value in zip(keys, where, strict=True)}


def _check_dataset_target(out: Path, overwrite: bool) -> None:
    """Refuse, creating nothing, what publishing a dataset at `out` would refuse (a dry run's check)."""
    from rbtool.errors import OutputExistsError

    refuse_file_parent(out)
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise OutputExistsError(f"{out}: already exists")
        if not out.is_dir() or not (not any(out.iterdir()) or (out / INFO_FILE).is_file()):
            raise CheckpointError(f"{out}: exists and is not a LeRobot dataset; refusing to replace it")


def _publish_dataset(staging: Path, out: Path, overwrite: bool) -> None:
    """Rename a finished dataset into place; replace only an empty directory or an earlier dataset."""
    from rbtool.errors import OutputExistsError

    fsync_dir(staging)
    if out.exists() or out.is_symlink():
        if not overwrite:
            shutil.rmtree(staging, ignore_errors=True)
            raise OutputExistsError(f"{out}: already exists")
        if not out.is_dir() or not (not any(out.iterdir()) or (out / INFO_FILE).is_file()):
            shutil.rmtree(staging, ignore_errors=True)
            raise CheckpointError(f"{out}: exists and is not a LeRobot dataset; refusing to replace it")
        old = out.parent / f".{out.name}.rbtool-old-{uuid.uuid4().hex[:12]}"
        os.rename(out, old)
        os.rename(staging, out)
        fsync_dir(out.parent)
        shutil.rmtree(old, ignore_errors=True)
        return
    os.rename(staging, out)
    fsync_dir(out.parent)


def parse_field_map(pairs: Sequence[str], what: str) -> dict[str, str]:
    """`NAME=VALUE` pairs as a dict (each NAME once)."""
    mapping: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name or not value:
            raise UsageError(f"{what} mapping {pair!r} is not NAME=VALUE")
        if name in mapping:
            raise UsageError(f"{what} mapping names {name!r} twice")
        mapping[name] = value
    return mapping


def export_lerobot(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    fps: int,
    robot_type: str | None = None,
    task: str = "",
    names: dict[str, str] | None = None,
    images: bool = True,
    video: bool = False,
    strict: bool = True,
    data_file_size_mb: float = DEFAULT_DATA_FILE_SIZE_MB,
    video_file_size_mb: float = DEFAULT_VIDEO_FILE_SIZE_MB,
    chunks_size: int = DEFAULT_CHUNK_SIZE,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
    dry_run: bool = False,
    journal: str | os.PathLike[str] | None = None,
) -> ExportResult:
    """Write the checkpoint, buffer directory or rank tree at `source` as a LeRobot v3.0 dataset.

    `names` maps buffer fields (dotted paths such as `curr_obs.states`) to feature names;
    unmapped fields take RLinf's names (`image`, `state`, `actions`, `done`, ...) or their
    dotted path. uint8 `[H, W, C]` fields become PNG image features unless `images` is
    False. With `video`, RGB image fields of even height and width are `video` features
    instead (H.264 mp4 files, lossy); the sidecar keeps their exact rows, so that an import
    of the export is still bit for bit. `progress(1)` is called twice per trajectory
    (planning, then writing). With `dry_run` only the planning pass runs (every trajectory
    read, features, episodes and frames counted), `out` is checked as publishing would check
    it, and nothing is written (no file counts, no bytes).

    Under torchrun (rbtool.passes.ranks) both passes run over the ranks: each rank reads its share's
    structure, every rank decides the same features and episode numbers from the gathered
    results, each rank renders its share's rows into `.OUT.rbtool-resume-staging` beside `out`
    (journaled in `journal`, default `.OUT.rbtool-resume-journal`, removed once published), and
    rank 0 writes the files from them in trajectory order: the bytes one process writes. With
    `journal` in one process the same resumable path runs. A failed run leaves `out` untouched.
    """
    pa = _require_arrow()
    if video and not images:
        raise UsageError("video needs images: video features are image fields")
    if images:
        _require_pil()
    if video:
        _require_av()
    if not video_file_size_mb > 0:
        raise UsageError(f"the video file size limit must be positive, got {video_file_size_mb!r}")
    if isinstance(fps, bool) or not isinstance(fps, int) or fps < 1:
        raise UsageError(f"fps must be a positive integer, got {fps!r}")
    if not data_file_size_mb > 0:
        raise UsageError(f"the data file size limit must be positive, got {data_file_size_mb!r}")
    if chunks_size < 1:
        raise UsageError(f"chunks size must be >= 1, got {chunks_size}")
    for name in (names or {}).values():
        if "/" in name:
            raise UsageError(f"feature name {name!r} contains '/', which LeRobot does not allow")
    out = Path(out)
    view = open_view(source, strict=strict)
    index = view.index
    ids = list(index.id_list)
    registry = _Registry(dict(names or {}), images, video)

    # Pass 1: each trajectory's skeleton and episodes (memory-mapped, nothing copied), over
    # the ranks; the features are then decided from them in trajectory order, the same on
    # every rank, which fixes the plan: schemas, episode numbers and frame offsets.
    world = ranks.current()
    if (world.size > 1 or journal is not None) and not dry_run:
        _check_dataset_target(out, overwrite)  # refused before any rank reads, as publishing would
    probes = ranks.ranked_pass(
        _probe,
        [_Probe(view.file_of(tid), *(int(d) for d in index.entries[tid]["shape"][:2])) for tid in ids],
        jobs=1,
        weights=[_file_size(view.file_of(tid)) for tid in ids],
        progress=progress,
    )
    schemas: list[list[dict[str, Any]]] = []
    schema_ids: dict[bytes, int] = {}
    records: list[dict[str, Any]] = []
    bounds_of: list[list[tuple[int, int]]] = []
    for tid, (entries, values, bounds) in zip(ids, probes, strict=True):
        t, b = (int(d) for d in index.entries[tid]["shape"][:2])
        nodes = _schema_from(entries, registry)
        key = orjson.dumps(nodes)
        sid = schema_ids.setdefault(key, len(schemas))
        if sid == len(schemas):
            schemas.append(nodes)
        records.append({"trajectory_id": tid, "T": t, "B": b, "schema": sid, "values": values})
        if dry_run:
            records[-1]["episodes"] = len(bounds)
        bounds_of.append([(int(lo), int(hi)) for lo, hi in bounds])
    unused = sorted(set(registry.names) - registry.used_names)
    if unused:
        raise UsageError(
            f"feature mapping names {', '.join(unused)}, which no trajectory has as a per-frame field"
        )

    columns = list(registry.columns.values())
    features: dict[str, dict[str, Any]] = {name: spec for c in columns for name, spec in c.specs(fps).items()}
    for name, dtype in RB_FEATURES.items():
        features[name] = {"dtype": dtype, "shape": [1], "names": None}
    for name, dtype in FRAME_FEATURES.items():
        features[name] = {"dtype": dtype, "shape": [1], "names": None}
    # Video features live in their mp4 files, not in the Parquet data (as LeRobot writes them).
    in_data = {name: spec for name, spec in features.items() if spec["dtype"] != "video"}
    video_names = [name for name, spec in features.items() if spec["dtype"] == "video"]
    schema = pa.schema(
        [pa.field(name, _arrow_type(spec)) for name, spec in in_data.items()],
        metadata={
            "huggingface": orjson.dumps(
                {"info": {"features": {n: _hf_feature(s) for n, s in in_data.items()}}}
            )
        },
    )

    result = ExportResult(out=out, source=Path(source), trajectories=len(ids))
    result.columns = {name: f for c in columns for name, f in c.fields().items()}
    result.features = features
    result.episodes = sum(len(bounds) for bounds in bounds_of)
    result.frames = sum(r["T"] * r["B"] for r in records)
    if dry_run:
        _check_dataset_target(out, overwrite)
        return result
    tasks: list[_Write] = []
    first_episode = first_frame = 0
    for tid, record, bounds in zip(ids, records, bounds_of, strict=True):
        tasks.append(
            _Write(
                tid, view.file_of(tid), record["T"], record["B"], record["schema"], first_episode, first_frame
            )
        )
        first_episode += len(bounds)
        first_frame += record["T"] * record["B"]
    render = _Render(
        schemas, registry.columns, columns, features, list(in_data), schema, fps, task, bounds_of
    )
    assembly = _Assembly(
        out, overwrite, columns, features, video_names, task, fps, robot_type, data_file_size_mb,
        video_file_size_mb, chunks_size, source, index, schemas, records, bounds_of,
    )  # fmt: skip
    if world.size == 1 and journal is None:
        staging = new_staging_dir(out)
        try:
            assembly.open(staging)
            for position, job in enumerate(tasks):
                meta, data_table, blob_table = render(job, position)
                assembly.add(position, job, meta, data_table, blob_table)
                if progress is not None:
                    progress(1)
            assembly.finish(result)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _publish_dataset(staging, out, overwrite)
        return result

    # Over ranks (or resumable): every rank writes the rows of its share of the trajectories
    # into a fixed staging directory beside `out`, journaling each; rank 0 then lays them out
    # in the plan's files in trajectory order (the bytes one process writes) and publishes.
    staging, journal_dir = _resume_dirs(out, None if journal is None else Path(journal))
    parts = staging / PARTS_DIR
    identity = {
        "command": "export lerobot",
        "input": str(Path(source).absolute()),
        "out": str(out.absolute()),
        "fps": fps,
        "robot_type": robot_type,
        "task": task,
        "names": sorted((names or {}).items()),
        "images": images,
        "video": video,
        "data_file_size_mb": data_file_size_mb,
        "video_file_size_mb": video_file_size_mb,
        "chunks_size": chunks_size,
    }
    ranks.on_leader(world, lambda: parts.mkdir(parents=True, exist_ok=True))
    resumed = open_journal(journal_dir, identity)
    metas = ranks.ranked_pass(
        _RenderPart(render, parts),
        [_Part(i, job) for i, job in enumerate(tasks)],
        jobs=1,
        weights=[_file_size(job.path) for job in tasks],
        progress=progress,
        journal=resumed,
        files=lambda part: (part.job.path, *_part_files(parts, part.job.tid)),
        hashes=lambda part: (_recorded_sha256(index.entries[part.job.tid]), None, None),
    )
    result.journal = None if resumed is None else resumed.counts()

    def assemble() -> None:
        for stale in staging.iterdir():  # what an interrupted assembly left
            if stale.name != PARTS_DIR:
                shutil.rmtree(stale) if stale.is_dir() and not stale.is_symlink() else stale.unlink()
        assembly.open(staging)
        for position, (job, meta) in enumerate(zip(tasks, metas, strict=True)):
            data_path, blob_path = _part_files(parts, job.tid)
            assembly.add(position, job, meta, _read_ipc(data_path), _read_ipc(blob_path))
        assembly.finish(result)
        shutil.rmtree(parts)
        result.bytes = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file())
        _publish_dataset(staging, out, overwrite)
        if journal is None:
            shutil.rmtree(journal_dir, ignore_errors=True)

    ranks.on_leader(world, assemble)
    return result


# ------------------------------------------------------------------ export: plan, rows, files
PARTS_DIR = ".rbtool-parts"  # in the staging directory of an export over ranks: each trajectory's rows
_BLOB_FIELDS = (
    ("trajectory_id", "int64"),
    ("node", "int32"),
    ("kind", "string"),
    ("t", "list<int64>"),
    ("b", "list<int64>"),
    ("dtype", "string"),
    ("shape", "list<int64>"),
    ("data", "large_binary"),
)


def _blob_schema() -> pa.Schema:
    pa = _require_arrow()
    types = {
        "int64": pa.int64(),
        "int32": pa.int32(),
        "string": pa.string(),
        "list<int64>": pa.list_(pa.int64()),
        "large_binary": pa.large_binary(),
    }
    return pa.schema([(name, types[kind]) for name, kind in _BLOB_FIELDS])


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _recorded_sha256(entry: dict[str, Any]) -> str | None:
    recorded = entry.get("sha256")
    return recorded if isinstance(recorded, str) else None


def _resume_dirs(out: Path, journal: Path | None) -> tuple[Path, Path]:
    """Where an export over ranks builds `out` (a fixed hidden directory beside it) and journals."""
    staging = out.parent / f".{out.name}.rbtool-resume-staging"
    return staging, journal if journal is not None else out.parent / f".{out.name}.rbtool-resume-journal"


def _part_files(parts: Path, tid: int) -> tuple[Path, Path]:
    return parts / f"{tid}.data.arrow", parts / f"{tid}.blobs.arrow"


def _read_ipc(path: Path) -> Any:
    pa = _require_arrow()
    try:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_file(source).read_all()
    except (OSError, pa.ArrowInvalid) as exc:
        raise CheckpointError(f"{path}: cannot read the rows a rank wrote: {exc}") from None


def _write_ipc(path: Path, table: Any) -> None:
    """`table` as one Arrow IPC batch at `path`, whole or not at all."""
    pa = _require_arrow()
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table.combine_chunks())
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class _Probe:
    """Pass 1's task: one trajectory file, with its [T, B]."""

    path: Path
    t: int
    b: int

    def __str__(self) -> str:
        return str(self.path)


def _probe(task: _Probe) -> tuple[list[dict[str, Any]], list[Any], list[tuple[int, int]]]:
    """A trajectory's entries as the features are decided from them (kind, path, dtype, frame
    shape, extra leading rows), its scalar values and its episode bounds."""
    t, b = task.t, task.b
    traj = with_stored_defaults(trajfile.load(task.path, mmap=True), task.path.name)
    entries: list[dict[str, Any]] = []
    values: list[Any] = []
    for kind, path, value in _entries(traj):
        if kind != "tensor":
            entries.append({"path": list(path), "kind": kind})
            if kind == "value":
                values.append(_encode_value(value))
            continue
        entries.append(
            {
                "path": list(path),
                "kind": "tensor",
                "dtype": _dtype_name(value.dtype),
                "shape": [int(d) for d in value.shape[2:]],
                "extra": _column_ok(value, path, t, b),
            }
        )
    return entries, values, _episode_bounds(_episode_ends(traj, t, b), t, b)


def _schema_from(entries: list[dict[str, Any]], registry: _Registry) -> list[dict[str, Any]]:
    """The trajectory's skeleton (how each entry is stored), its columns taken from `registry`."""
    nodes: list[dict[str, Any]] = []
    columns: dict[tuple[str, ...], dict[str, Any]] = {}
    for entry in entries:
        if entry["kind"] != "tensor":
            nodes.append({"path": entry["path"], "kind": entry["kind"]})
            continue
        path, dtype, shape, extra = (
            tuple(entry["path"]),
            entry["dtype"],
            tuple(entry["shape"]),
            entry["extra"],
        )
        node: dict[str, Any] = {"path": list(path), "dtype": dtype}
        source = columns.get(("curr_obs", *path[1:])) if path[0] == "next_obs" and len(path) > 1 else None
        if extra == 0 and source is not None and (source["dtype"], source["shape"]) == (dtype, list(shape)):
            node.update(kind="derived", source=source["path"], shape=list(shape))
        elif extra is not None and (col := registry.column(path, dtype, shape)) is not None:
            node.update(kind="column", feature=col.feature, shape=list(shape), extra_rows=extra)
            columns[path] = node
        else:
            node.update(kind="tensor")
        nodes.append(node)
    return nodes


@dataclass(frozen=True)
class _Write:
    """Pass 2's task: one trajectory, with its place in the plan (first episode and frame number)."""

    tid: int
    path: Path
    t: int
    b: int
    schema: int
    first_episode: int
    first_frame: int

    def __str__(self) -> str:
        return str(self.path)


class _Render:
    """A trajectory's rows: its data table, its sidecar rows, its episodes' statistics."""

    def __init__(
        self,
        schemas: list[list[dict[str, Any]]],
        by_path: dict[tuple[str, ...], Column],
        columns: list[Column],
        features: dict[str, dict[str, Any]],
        in_data: list[str],
        schema: Any,
        fps: int,
        task: str,
        bounds_of: list[list[tuple[int, int]]],
    ) -> None:
        self.schemas, self.by_path, self.columns = schemas, by_path, columns
        self.features, self.in_data, self.schema = features, in_data, schema
        self.fps, self.task, self.bounds_of = fps, task, bounds_of

    def __call__(self, job: _Write, position: int) -> tuple[dict[str, Any], Any, Any]:
        import numpy as np

        pa = _require_arrow()
        tid, t, b, fps = job.tid, job.t, job.b, self.fps
        nodes = self.schemas[job.schema]
        traj = with_stored_defaults(trajfile.load(job.path, mmap=True), job.path.name)
        digest = _digest(traj)
        mwid = str(traj.get("model_weights_id") or "")
        tensors = {p: v for kind, p, v in _entries(traj) if kind == "tensor"}
        n = t * b
        blob_rows: list[dict[str, Any]] = []
        sidecar_fields: list[str] = []
        frame_cols: dict[str, np.ndarray] = {}
        for i, node in enumerate(nodes):
            kind = node.get("kind")
            npath = tuple(node["path"])
            if kind == "column":
                tensor = tensors[npath]
                if node["extra_rows"]:
                    e = node["extra_rows"]
                    starts = [k * (1 + t // e) for k in range(e)]
                    blob_rows.append(_blob(tid, i, "bootstrap", tensor[starts], [], []))
                    tensor = drop_bootstrap_rows(tensor, t)
                col = self.by_path[npath]
                if col.video:  # the exact rows: the video is lossy
                    blob_rows.append(_blob(tid, i, "frames", tensor, [], []))
                arr = _to_numpy(tensor).reshape(t, b, *col.frame_shape)
                frame_cols[col.feature] = arr.swapaxes(0, 1).reshape(n, *col.frame_shape)
            elif kind == "derived":
                nxt, cur = tensors[npath], tensors[tuple(node["source"])]
                same = _rows_equal(nxt[:-1], cur[1:])
                pos = [(ti, bi) for ti in range(t) for bi in range(b) if ti == t - 1 or not same[ti, bi]]
                rows = nxt[[p[0] for p in pos], [p[1] for p in pos]]
                blob_rows.append(_blob(tid, i, "next_obs", rows, [p[0] for p in pos], [p[1] for p in pos]))
            elif kind == "tensor":
                blob_rows.append(_blob(tid, i, "tensor", tensors[npath], [], []))
                sidecar_fields.append(_field_name(npath))

        bounds = self.bounds_of[position]
        env = np.repeat(np.arange(b, dtype=np.int64), t)
        step = np.tile(np.arange(t, dtype=np.int64), b)
        frame_index = np.zeros(n, dtype=np.int64)
        episode_index = np.zeros(n, dtype=np.int64)
        for k, (lo, hi) in enumerate(bounds):
            frame_index[lo:hi] = np.arange(hi - lo)
            episode_index[lo:hi] = job.first_episode + k
        arrays: dict[str, Any] = {}
        for col in self.columns:
            if col.video:
                continue
            if col.feature in frame_cols:
                for name, frames in col.split(frame_cols[col.feature]).items():
                    spec = self.features[name]
                    arrays[name] = _image_array(frames) if col.image else _column_array(frames, spec)
            else:
                for name, spec in col.specs().items():
                    arrays[name] = pa.nulls(n, _arrow_type(spec))
        numeric: dict[str, np.ndarray] = {
            RB_TRAJECTORY_ID: np.full(n, tid, dtype=np.int64),
            RB_ENV: env,
            RB_T: step,
            "timestamp": (frame_index / fps).astype(np.float32),
            "frame_index": frame_index,
            "episode_index": episode_index,
            "index": np.arange(job.first_frame, job.first_frame + n, dtype=np.int64),
            "task_index": np.zeros(n, dtype=np.int64),
        }
        for name, values in numeric.items():
            arrays[name] = pa.array(values)
        arrays[RB_MODEL_WEIGHTS_ID] = pa.array([mwid] * n, pa.string())
        table = pa.Table.from_arrays([arrays[name] for name in self.in_data], schema=self.schema)
        stats: list[dict[str, dict[str, np.ndarray]]] = []
        for lo, hi in bounds:
            episode: dict[str, dict[str, np.ndarray]] = {}
            for col in self.columns:
                if col.feature in frame_cols:
                    for name, frames in col.split(frame_cols[col.feature][lo:hi]).items():
                        episode[name] = _stats(frames, col.image)
            for name, series in numeric.items():
                episode[name] = _stats(series[lo:hi].reshape(-1, 1), False)
            stats.append(episode)
        meta = {
            "digest": digest,
            "sidecar_fields": sidecar_fields,
            "per_row": table.nbytes / max(n, 1),
            "stats": stats,
        }
        return meta, table, pa.Table.from_pylist(blob_rows, schema=_blob_schema())


@dataclass(frozen=True)
class _Part:
    """A trajectory's rows as a rank writes them (pass 2 over ranks): its position and task."""

    position: int
    job: _Write

    def __str__(self) -> str:
        return str(self.job.path)


class _RenderPart:
    """`_Render` on a rank: the tables go to the part files, the rest back to every rank."""

    def __init__(self, render: _Render, parts: Path) -> None:
        self.render, self.parts = render, parts

    def __call__(self, part: _Part) -> dict[str, Any]:
        meta, data_table, blob_table = self.render(part.job, part.position)
        data_path, blob_path = _part_files(self.parts, part.job.tid)
        _write_ipc(data_path, data_table)
        _write_ipc(blob_path, blob_table)
        return meta


class _Assembly:
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
            name: _RollingVideo(
                staging, name, self.fps, self.video_file_size_mb * (1 << 20), self.chunks_size
            )
            for name in self.video_names
        }
        blobs_path = staging / SIDECAR_TENSORS
        blobs_path.parent.mkdir(parents=True, exist_ok=True)
        self.blob_writer = pq.ParquetWriter(str(blobs_path), _blob_schema(), compression="zstd")

    def _flush_blobs(self, force: bool = False) -> None:
        pa = _require_arrow()
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
            arr = _to_numpy(_from_raw(row["data"], row["dtype"], row["shape"])).reshape(
                t, b, *col.frame_shape
            )
            frames[col.feature] = arr.swapaxes(0, 1).reshape(t * b, *col.frame_shape)
        return frames

    def add(self, position: int, job: _Write, meta: dict[str, Any], table: Any, blobs: Any) -> None:
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
                        placed.update(_video_columns(name, self.videos[name].add(frames)))
                else:  # a trajectory without this field: black frames keep the video's timeline
                    for name in col.names():
                        blank = np.zeros((hi - lo, *col.feature_shape), dtype=np.uint8)
                        placed.update(_video_columns(name, self.videos[name].add(blank)))
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
                totals[name] = _aggregate(parts)
        result.episode_files = _write_episodes(
            staging, self.episodes, self.episode_stats, stat_names, self.data_file_size_mb, self.chunks_size
        )
        write_bytes_atomic(
            staging / STATS_FILE, _json({k: _stats_json(v) for k, v in totals.items()}), sync_dir=False
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
        result.bytes = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file())
        result.sidecar_fields = sorted(self.sidecar_fields)


def _mb(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def _rows_equal(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """[T-1, B] bool: rows of `a` and `b` equal bit for bit."""
    import numpy as np
    import torch

    lead = (int(a.shape[0]), int(a.shape[1]))
    if a.numel() == 0:
        return np.ones(lead, dtype=bool)
    bits_a = a.contiguous().reshape(*lead, -1).view(torch.uint8)
    bits_b = b.contiguous().reshape(*lead, -1).view(torch.uint8)
    return (bits_a == bits_b).all(dim=2).numpy()


def _blob(
    tid: int, node: int, kind: str, tensor: torch.Tensor, ts: list[int], bs: list[int]
) -> dict[str, Any]:
    return {
        "trajectory_id": tid,
        "node": node,
        "kind": kind,
        "t": ts,
        "b": bs,
        "dtype": _dtype_name(tensor.dtype),
        "shape": [int(d) for d in tensor.shape],
        "data": _raw_bytes(tensor),
    }


def _write_episodes(
    root: Path,
    episodes: list[dict[str, Any]],
    stats: list[dict[str, dict[str, np.ndarray]]],
    stat_names: list[str],
    limit_mb: float,
    chunks_size: int,
) -> int:
    pa = _require_arrow()
    rows = []
    for episode, ep_stats in zip(episodes, stats, strict=True):
        row = dict(episode)
        for name in stat_names:
            for key in ("min", "max", "mean", "std", "count", *QUANTILES):
                value = ep_stats.get(name, {}).get(key)
                row[f"stats/{name}/{key}"] = None if value is None else value.tolist()
        rows.append(row)
    writer = _RollingParquet(root, EPISODES_PATH, limit_mb * (1 << 20), chunks_size)
    if not rows:
        return 0
    table = pa.Table.from_pylist(rows)
    per_row = table.nbytes / len(rows)
    # Where each episode's metadata row goes is known only as rows are placed: place them
    # first, then write each file's rows with its own chunk and file index columns.
    placed: list[tuple[int, int]] = []
    size, chunk, file = 0.0, 0, 0
    for _ in rows:
        if size and size + per_row >= writer.limit:
            chunk, file = (chunk + 1, 0) if file == chunks_size - 1 else (chunk, file + 1)
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
    pa = _require_arrow()
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


# ====================================================================== reading datasets
# Every dataset may come from someone else: what it names is read only inside its root, and
# what it declares is checked against a memory budget before anything is decoded.
MAX_BYTES_ENV = "RBTOOL_LEROBOT_MAX_BYTES"
DEFAULT_MAX_BYTES = 4 << 30  # what one decoded file or episode may take
_MAX_FEATURE_DIMS = 8
_MAX_TEMPLATE_CHARS = 512
_MAX_TEMPLATE_WIDTH = 20  # `:03d`, `:06d`: LeRobot's widths; an int64 has 19 digits
_TEMPLATE_SPEC = re.compile(r"(0?)([0-9]{0,2})d?")
_ID_LIMIT = 1 << 63  # ids and counters are int64, as in a checkpoint
_HEX64 = re.compile(r"[0-9a-f]{64}")


def max_bytes() -> int:
    """The memory budget of a LeRobot import (RBTOOL_LEROBOT_MAX_BYTES, default 4 GiB)."""
    text = os.environ.get(MAX_BYTES_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_BYTES
    match = re.fullmatch(r"([0-9]{1,15})([KMG]i?B?|B)?", text, flags=re.IGNORECASE)
    if match is None:
        raise UsageError(f"{MAX_BYTES_ENV}={text!r} is not a byte count (for example 1048576, 512M or 8G)")
    scale = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[(match.group(2) or "")[:1].upper()]
    return int(match.group(1)) * scale


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _within_budget(need: int, what: str) -> None:
    """Refuse, before decoding, what would take more memory than the budget."""
    limit = max_bytes()
    if need > limit:
        raise CheckpointError(
            f"{what} would take {_human(need)} of memory to decode, more than the {_human(limit)} "
            f"{MAX_BYTES_ENV} allows"
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fill_template(template: Any, values: dict[str, Any], key: str, where: Path) -> str:
    """A path template of meta/info.json filled in: only the named fields, no attribute access
    or indexing, no conversion, and integer format specs of bounded width (`:03d`)."""
    import string

    shown = repr(template)[:80]
    if not isinstance(template, str) or not template or len(template) > _MAX_TEMPLATE_CHARS:
        raise CheckpointError(f"{where}: {key} {shown} is not a path template")
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise CheckpointError(f"{where}: {key} {shown} is not a path template ({exc})") from None
    out = []
    for literal, name, spec, conversion in parts:
        out.append(literal)
        if name is None:
            continue
        if name not in values:
            raise CheckpointError(
                f"{where}: {key} {shown} names {{{name}}}; a LeRobot path template names only "
                + ", ".join(f"{{{n}}}" for n in values)
            )
        if conversion is not None:
            raise CheckpointError(f"{where}: {key} {shown} converts {{{name}!{conversion}}}; refused")
        value = values[name]
        if isinstance(value, str):
            if spec:
                raise CheckpointError(f"{where}: {key} {shown} formats {{{name}}} with :{spec[:20]}; refused")
            out.append(value)
            continue
        spec = spec or ""
        match = _TEMPLATE_SPEC.fullmatch(spec)
        if match is None or int(match.group(2) or 0) > _MAX_TEMPLATE_WIDTH:
            raise CheckpointError(
                f"{where}: {key} {shown} formats {{{name}}} with :{spec[:20]}; only integer forms such "
                f"as :03d (width at most {_MAX_TEMPLATE_WIDTH}) are read"
            )
        out.append(format(value, spec or ""))
    return "".join(out)


def _bound(limit: int) -> str:
    return f"2**{limit.bit_length() - 1}" if limit > 1024 and limit & (limit - 1) == 0 else str(limit)


def _check_index(value: Any, what: str, where: Path, limit: int = _ID_LIMIT) -> int:
    """A non-negative int64 (an episode, chunk, file or frame index; a length)."""
    if not _is_int(value) or not 0 <= value < limit:
        raise CheckpointError(f"{where}: {what} {repr(value)[:40]} is not an integer in [0, {_bound(limit)})")
    return int(value)


@dataclass
class _Episode:
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
                _check_index(value, key, info_path)
        if self.info.get("chunks_size") == 0:
            raise CheckpointError(f"{info_path}: chunks_size 0; a chunk holds at least one file")
        self._sidecar: dict[str, Any] | None = None
        self._episodes: list[_Episode] | None = None
        self._tasks: list[str] | None = None

    @property
    def v3(self) -> bool:
        return self.version.startswith("v3")

    # ------------------------------------------------------------------ paths
    def _parts(self, rel: Any, what: str) -> tuple[str, ...]:
        from pathlib import PurePosixPath

        if not isinstance(rel, str) or not rel or "\0" in rel or "\\" in rel:
            raise CheckpointError(f"{self.root}: {what} {str(rel)[:80]!r} is not a path inside the dataset")
        pure = PurePosixPath(rel)
        if pure.is_absolute() or ".." in pure.parts or not pure.parts:
            raise CheckpointError(f"{self.root}: {what} {rel[:200]!r} is outside the dataset; refused")
        return pure.parts

    def _walk(self, rel: Any, what: str) -> tuple[Path, os.stat_result | None]:
        """root / rel, each component checked: no symlink, directories on the way (None: missing)."""
        parts = self._parts(rel, what)
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
        return _fill_template(template, values, key, self.root / INFO_FILE)

    # ------------------------------------------------------------------ sidecar, tasks
    def sidecar(self) -> dict[str, Any] | None:
        """The rbtool sidecar, when rbtool wrote this dataset (validated: see _check_sidecar)."""
        if self._sidecar is None and self._exists(SIDECAR_FILE):
            path = self._file(SIDECAR_FILE, "the rbtool sidecar")
            self._sidecar = read_json_file(path)  # bounded like checkpoint JSON
            version = self._sidecar.get("rbtool_sidecar") if isinstance(self._sidecar, dict) else None
            if (
                not isinstance(version, int)
                or isinstance(version, bool)
                or not 1 <= version <= SIDECAR_VERSION
            ):
                raise CheckpointError(
                    f"{path}: sidecar version {str(version)[:40]!r} is not one rbtool reads"
                )
            _check_sidecar(self._sidecar, self)
        return self._sidecar

    def tensors_file(self, sidecar: dict[str, Any]) -> Path | None:
        """The sidecar's tensors file (None when it is not there)."""
        rel = sidecar.get("tensors") or SIDECAR_TENSORS
        if not self._exists(rel) and self._parts(rel, "the sidecar's tensors"):
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
                pairs.append((_check_index(index, "task_index", path), str(task)))
        except (KeyError, TypeError):
            raise CheckpointError(f"{path}: a line lacks task_index or task") from None
        return [task for _, task in sorted(pairs)]

    def _jsonl(self, rel: str) -> list[dict[str, Any]]:
        path = self._file(rel, rel)
        self._within_file(path, rel)
        return _jsonl(path)

    def _within_file(self, path: Path, what: str) -> None:
        _within_budget(path.stat().st_size * 8, f"{path}")

    def _parquet_budget(
        self, path: Path, columns: Sequence[str] | None, what: str, *, per_row_group: bool = False
    ) -> int:
        """The rows of a Parquet file, once the columns read (None: all) fit the memory budget as
        its metadata declares them (their uncompressed size, the whole file or each row group)."""
        import pyarrow.parquet as pq

        pa = _require_arrow()
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
                _within_budget(size, f"{path}: row group {g} ({what})")
            total += size
        if not per_row_group:
            _within_budget(total, f"{path} ({what}, {meta.num_row_groups} row group(s))")
        return int(meta.num_rows)

    def _read_parquet(self, path: Path, columns: list[str] | None, what: str) -> Any:
        """A Parquet file's columns (None: all), within the budget as declared and as decoded:
        read a batch at a time, the decoded bytes counted (dictionary pages can expand far
        beyond the sizes a file declares)."""
        import pyarrow.parquet as pq

        pa = _require_arrow()
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
                        f"{path} ({what}) decodes to more than the {_human(limit)} {MAX_BYTES_ENV} allows"
                    )
                batches.append(batch)
            if not batches:
                empty = handle.schema_arrow.empty_table()
                return empty if columns is None else empty.select(columns)
            return pa.Table.from_batches(batches)
        except (OSError, pa.ArrowInvalid) as exc:
            raise CheckpointError(f"{path}: not a readable Parquet file ({exc})") from None

    # ------------------------------------------------------------------ episodes
    def episodes(self) -> list[_Episode]:
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

    def _read_episodes(self) -> list[_Episode]:
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
                            _check_index(row["data/chunk_index"], "data/chunk_index", path),
                            _check_index(row["data/file_index"], "data/file_index", path),
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
                                _check_index(row[f"videos/{name}/chunk_index"], "a video chunk_index", path),
                                _check_index(row[f"videos/{name}/file_index"], "a video file_index", path),
                                float(start),
                            )
                        begin = row.get("dataset_from_index")
                        out.append(
                            _Episode(
                                _check_index(row["episode_index"], "episode_index", path),
                                _check_index(row["length"], "an episode length", path),
                                _task_list(row.get("tasks"), path),
                                data_files[where],
                                None if begin is None else _check_index(begin, "dataset_from_index", path),
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
                ep = _check_index(row["episode_index"], "episode_index", path)
                length = _check_index(row["length"], "an episode length", path)
                tasks = _task_list(row.get("tasks"), path)
            except (KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(f"{path}: an episode line lacks {exc}") from None
            rel = self._template("data_path", default, {"episode_chunk": ep // chunks, "episode_index": ep})
            out.append(_Episode(ep, length, tasks, self._walk(rel, "a data file")[0]))
        return sorted(out, key=lambda e: e.index)

    def check(self, episodes: Sequence[_Episode], columns: Sequence[str]) -> None:
        """Everything `frames` would refuse before decoding, refused now (before a buffer is touched):
        each data file a regular file inside the dataset whose read fits the budget, each
        episode's decoded frames within it, each video file inside the dataset."""
        per_frame = sum(self.frame_bytes.get(c, 0) for c in dict.fromkeys(columns))
        files: set[Path] = set()
        for episode in episodes:
            _within_budget(
                episode.length * per_frame, f"{self.root}: episode {episode.index} ({episode.length} frames)"
            )
            if episode.file not in files:
                files.add(episode.file)
                self._data_file(episode)
            for name in columns:
                if self.features.get(name, {}).get("dtype") == "video" and name in episode.videos:
                    self._file(self._video_rel(name, episode), f"video of feature {name!r}")

    def _data_file(self, episode: _Episode) -> Path:
        rel = episode.file.relative_to(self.root).as_posix()
        path = self._file(rel, f"episode {episode.index}")
        return path

    def _video_rel(self, name: str, episode: _Episode) -> str:
        chunk, file, _ = episode.videos[name]
        return self._template(
            "video_path", VIDEO_PATH, {"video_key": name, "chunk_index": chunk, "file_index": file}
        )

    def frames(self, episodes: Sequence[_Episode], columns: Sequence[str]) -> Iterator[tuple[_Episode, Any]]:
        """(episode, its frames as an Arrow table in frame order) for each episode, reading each file once."""
        import numpy as np
        import pyarrow.parquet as pq

        pa = _require_arrow()
        video = [c for c in columns if self.features.get(c, {}).get("dtype") == "video"]
        per_frame = sum(self.frame_bytes.get(c, 0) for c in dict.fromkeys(columns))
        columns = [c for c in columns if c not in video]
        if video:
            columns = [*columns, "timestamp"]
        cached: tuple[Path, Any, Any] | None = None
        readers: dict[str, _VideoReader] = {}
        try:
            for episode in episodes:
                _within_budget(
                    episode.length * per_frame,
                    f"{self.root}: episode {episode.index} ({episode.length} frames)",
                )
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

    def _video_frames(self, name: str, episode: _Episode, part: Any, readers: dict[str, _VideoReader]) -> Any:
        """The episode's frames of a video feature, decoded one at a time, as a column of flat uint8 lists."""
        import numpy as np

        pa = _require_arrow()
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
            reader = readers[name] = _VideoReader(path, name, _hwc(spec))
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
        or not all(_is_int(d) and 0 <= d < (1 << 31) for d in shape)
    ):
        raise CheckpointError(
            f"{where}: feature {name!r} has shape {str(shape)[:80]}; a shape is 1 to {_MAX_FEATURE_DIMS} "
            "dims, each in [0, 2**31)"
        )
    if dtype in ("image", "video"):
        itemsize = 1
    elif dtype in _NATIVE:
        itemsize = _np_dtype(dtype).itemsize
    else:
        itemsize = 8
    need = math.prod(shape) * itemsize
    _within_budget(need, f"{where}: one frame of feature {name!r} (shape {shape})")
    return need


class _VideoReader:
    """One video file decoded frame by frame, forward: only the frames an episode wants are kept."""

    def __init__(self, path: Path, feature: str, hwc: tuple[int, int, int]) -> None:
        self.path, self.feature, self.hwc = path, feature, hwc
        self._container: Any = None
        self._frames: Iterator[Any] | None = None
        self._held: tuple[float, Any] | None = None  # the last frame decoded, not yet passed
        self._decoded = 0
        self._declared = 0

    def _open(self) -> None:
        av = _require_av()
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
        av = _require_av()
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


_NODE_KINDS = ("dict", "value", "tensor", "column", "derived")
_ITEMSIZE = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "complex64": 8, "complex128": 16}
_MAX_PATH_DEPTH = 32


def _itemsize(dtype: str) -> int:
    return _ITEMSIZE[dtype] if dtype in _ITEMSIZE else _np_dtype(dtype).itemsize


def _json_ints_problem(value: Any) -> str | None:
    """An integer beyond 64 bits anywhere in a decoded value (walked without recursion)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif _is_int(item) and not -(1 << 63) <= item < (1 << 64):
            return f"holds the integer {str(item)[:30]}, beyond the 64-bit range"
    return None


def _check_sidecar(sidecar: dict[str, Any], dataset: LeRobotSource) -> None:
    """Refuse a sidecar that is not one rbtool export writes, as strictly as checkpoint JSON:
    ids and counters in [0, 2**63), the seed an integer torch takes, the format `pt` or `pkl`,
    entries valid index entries agreeing with the trajectory's [T, B], node paths and shapes
    well formed, every trajectory within the memory budget, episodes and features that exist."""
    from rbtool.format import SEED_RANGE, entry_problems

    where = dataset.root / SIDECAR_FILE

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: {what}")

    def index_value(value: Any, what: str, limit: int = _ID_LIMIT) -> int:
        if not _is_int(value) or not 0 <= value < limit:
            raise bad(f"{what} {repr(value)[:40]} is not an integer in [0, {_bound(limit)})")
        return int(value)

    def str_path(value: Any, what: str) -> tuple[str, ...]:
        if (
            not isinstance(value, list)
            or not 1 <= len(value) <= _MAX_PATH_DEPTH
            or not all(isinstance(k, str) and k for k in value)
        ):
            raise bad(f"{what} {str(value)[:80]} is not a field path (a list of names)")
        return tuple(value)

    def shape_of(value: Any, what: str) -> list[int]:
        if not isinstance(value, list) or len(value) > _MAX_PATH_DEPTH:
            raise bad(f"{what} {str(value)[:80]} is not a shape")
        return [index_value(d, f"{what} dim", 1 << 31) for d in value]

    def dtype_of(value: Any, what: str) -> str:
        if not isinstance(value, str) or value not in _TRAJECTORY_DTYPES:
            raise bad(f"{what} {str(value)[:40]!r} is not a dtype trajectory files hold")
        return value

    why = _json_ints_problem(sidecar)
    if why is not None:
        raise bad(why)
    ckpt, columns, schemas, records = (
        sidecar.get(k) for k in ("checkpoint", "columns", "schemas", "trajectories")
    )
    if not isinstance(ckpt, dict) or not isinstance(columns, dict):
        raise bad("incomplete sidecar (no checkpoint or columns object)")
    if not isinstance(schemas, list) or not isinstance(records, list):
        raise bad("incomplete sidecar (no schemas or trajectories list)")
    tensors = sidecar.get("tensors")
    if tensors is not None:
        dataset._parts(tensors, "the sidecar's tensors")
    # ---- the checkpoint
    ids = ckpt.get("trajectory_id_list")
    if not isinstance(ids, list):
        raise bad("checkpoint.trajectory_id_list is not a list")
    ids = [index_value(i, "checkpoint.trajectory_id_list holds the id") for i in ids]
    if len(set(ids)) != len(ids):
        raise bad("checkpoint.trajectory_id_list lists an id twice")
    counter = index_value(ckpt.get("trajectory_counter", 0), "checkpoint.trajectory_counter")
    if ids and counter <= max(ids):
        raise bad(f"checkpoint.trajectory_counter {counter} is not past the largest id {max(ids)}")
    seed = ckpt.get("seed")
    if seed is not None and (not _is_int(seed) or not SEED_RANGE[0] <= seed < SEED_RANGE[1]):
        raise bad(f"checkpoint.seed {repr(seed)[:40]} is not an integer in [-2**63, 2**64)")
    fmt = ckpt.get("trajectory_format")
    if fmt is not None and fmt not in ("pt", "pkl"):
        raise bad(f"checkpoint.trajectory_format {str(fmt)[:40]!r} is not 'pt' or 'pkl'")
    extra = ckpt.get("extra_metadata")
    if extra is not None and not isinstance(extra, dict):
        raise bad("checkpoint.extra_metadata is not an object")
    # ---- columns and schemas
    features = dataset.features
    for name, column in columns.items():
        if not isinstance(column, dict):
            raise bad(f"column {name!r} is not an object")
        str_path(column.get("path"), f"column {name!r} path")
        views = index_value(column.get("views") or 0, f"column {name!r} views", 1 << 16)
        if not isinstance(column.get("video", False), bool):
            raise bad(f"column {name!r} video is not true or false")
        if not column.get("video"):
            for stored in [f"{name}-{v}" for v in range(views)] if views else [name]:
                if stored not in features:
                    raise bad(f"column {name!r} is stored as feature {stored!r}, which meta/info.json lacks")
    sizes: list[tuple[int, int]] = []  # per schema: (bytes per sample of its per-frame nodes, values)
    for s, nodes in enumerate(schemas):
        if not isinstance(nodes, list):
            raise bad(f"schema {s} is not a list")
        seen: set[tuple[str, ...]] = set()
        dicts: set[tuple[str, ...]] = {()}
        per_sample = values = 0
        for i, node in enumerate(nodes):
            what = f"schema {s} node {i}"
            if not isinstance(node, dict) or node.get("kind") not in _NODE_KINDS:
                raise bad(f"{what} is not an object of a known kind")
            path = str_path(node.get("path"), f"{what} path")
            if path in seen or path[:-1] not in dicts:
                raise bad(f"{what} path {'.'.join(path)} is repeated or not inside a dict node before it")
            seen.add(path)
            kind = node["kind"]
            if kind == "dict":
                dicts.add(path)
            elif kind == "value":
                values += 1
            elif kind in ("column", "derived"):
                dtype = dtype_of(node.get("dtype"), f"{what} dtype")
                shape = shape_of(node.get("shape"), f"{what} shape")
                per_sample += math.prod(shape) * _itemsize(dtype)
                if kind == "column":
                    feature = node.get("feature")
                    if not isinstance(feature, str) or (feature not in columns and feature not in features):
                        raise bad(f"{what} names feature {str(feature)[:80]!r}, which the dataset lacks")
                    index_value(node.get("extra_rows") or 0, f"{what} extra_rows", 1 << 31)
                else:
                    source = str_path(node.get("source"), f"{what} source")
                    if source not in seen or source == path:
                        raise bad(f"{what} is derived from {'.'.join(source)}, not a field before it")
        sizes.append((per_sample, values))
    # ---- trajectories
    episodes = len(dataset.episodes())
    mine: set[int] = set()
    for r, record in enumerate(records):
        what = f"trajectory {r}"
        if not isinstance(record, dict):
            raise bad(f"{what} is not an object")
        tid = index_value(record.get("trajectory_id"), f"{what} trajectory_id")
        what = f"trajectory {tid}"
        if tid in mine:
            raise bad(f"trajectory id {tid} is listed twice")
        mine.add(tid)
        t = index_value(record.get("T"), f"{what} T", 1 << 31)
        b = index_value(record.get("B"), f"{what} B", 1 << 31)
        schema = index_value(record.get("schema"), f"{what} schema", len(schemas))
        per_sample, values = sizes[schema]
        _within_budget(t * b * per_sample, f"{where}: {what} ({t} x {b} samples)")
        if not isinstance(record.get("values", []), list) or len(record.get("values", [])) != values:
            raise bad(f"{what} has not the {values} values its schema names")
        if not isinstance(record.get("digest"), str) or not _HEX64.fullmatch(record["digest"]):
            raise bad(f"{what} digest is not a sha256")
        span = record.get("episodes", [0, 0])
        if not isinstance(span, list) or len(span) != 2:
            raise bad(f"{what} episodes is not [first, count]")
        first = index_value(span[0], f"{what} first episode")
        count = index_value(span[1], f"{what} episode count")
        if first + count > episodes:
            raise bad(f"{what} names episodes {first}-{first + count - 1}; the dataset has {episodes}")
        entry = record.get("entry")
        found = entry_problems(str(tid), entry)
        if found:
            raise bad(f"{what}: {found[0][1]}")
        assert isinstance(entry, dict)
        if entry["shape"][:2] != [t, b]:
            raise bad(f"{what}: entry shape {entry['shape']} does not start with its [T, B] = [{t}, {b}]")
        if tid >= counter:
            raise bad(f"{what}: id not below checkpoint.trajectory_counter {counter}")
    if [int(r["trajectory_id"]) for r in records] != ids:
        raise bad("the trajectories are not those of checkpoint.trajectory_id_list, in its order")


def _hwc(spec: dict[str, Any]) -> tuple[int, int, int]:
    """(height, width, channels) of an image or video feature (its names say the order)."""
    shape = [int(d) for d in spec.get("shape") or []]
    if len(shape) != 3:
        raise CheckpointError(f"an image feature of shape {shape}; rbtool reads [H, W, C] or [C, H, W]")
    names = spec.get("names") or []
    if names and str(names[0]).startswith("channel"):
        return shape[1], shape[2], shape[0]
    return shape[0], shape[1], shape[2]


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


# ====================================================================== import
@dataclass
class ImportResult:
    """What an import added."""

    buffer: Path
    dataset: Path
    codebase_version: str
    mode: str  # "rbtool" (rebuilt from the sidecar) or "episodes" (one trajectory per episode)
    added_ids: list[int] = field(default_factory=list)
    index: Index = field(default_factory=Index)
    report: WriteReport = field(default_factory=WriteReport)
    episodes: int = 0
    frames: int = 0
    fields: dict[str, str] = field(default_factory=dict)  # feature -> buffer field
    dropped: list[str] = field(default_factory=list)
    kept_ids: bool = False
    skipped: int = 0  # trajectories an interrupted import of the same export had already added


def _safe_id(text: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "dataset"
    return re.sub(r"\.{2,}", ".", cleaned)


def default_field(name: str, spec: dict[str, Any], cameras: list[str]) -> tuple[str, ...] | None:
    """The buffer field a LeRobot feature becomes by default (None: not buffer data)."""
    if name in FRAME_FEATURES or name in RB_FEATURES:
        return None
    reverse = {v: k for k, v in RLINF_NAMES.items()}
    if name in reverse:
        return reverse[name]
    if name in IMPORT_NAMES:
        return IMPORT_NAMES[name]
    if name.startswith("observation.images."):
        if len(cameras) == 1:
            return ("curr_obs", "main_images")
        return ("curr_obs", name.removeprefix("observation.images.").replace(".", "_"))
    if name.startswith("observation."):
        return ("curr_obs", name.removeprefix("observation.").replace(".", "_"))
    return (name.replace(".", "_"),)


def count_units(
    source: str | os.PathLike[str], *, episodes: Sequence[int] | None = None, use_sidecar: bool = True
) -> int:
    """How many trajectories an import of `source` writes (for a progress total)."""
    dataset = LeRobotSource(source)
    sidecar = dataset.sidecar() if use_sidecar and episodes is None else None
    if sidecar is not None:
        return len(sidecar.get("trajectories", []))
    if episodes is not None:
        return len(episodes)
    return int(dataset.info.get("total_episodes") or 0)


@contextlib.contextmanager
def _target(
    directory: Path, trajectory_format: str | None, on_wait: Callable[[str], None] | None
) -> Iterator[tuple[BufferWriter, Index, bool]]:
    """The buffer directory, created if needed and locked: (writer, its index, whether it is new).

    A directory this call created is removed again if the call fails (interrupted, only if
    nothing was published).
    """
    if trajectory_format is not None and trajectory_format not in ("pt", "pkl"):
        raise UsageError(f"format must be 'pt' or 'pkl', got {trajectory_format!r}")
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"{directory}: exists and is not a directory; choose a directory path")
    created = None
    for path in (directory, *directory.parents):
        if path.exists():
            break
        created = path
    try:
        make_parents(directory)
        init_buffer_dir(directory, Index(trajectory_format=trajectory_format or "pt"))
        with BufferWriter(directory, wait=True, on_wait=on_wait) as writer:
            _, index = open_checkpoint(directory, strict=True)
            yield writer, index, created is not None
    except Exception:
        if created is not None:  # a failed import leaves nothing of what it created
            shutil.rmtree(created, ignore_errors=True)
        raise
    except BaseException:
        if created is not None:
            with contextlib.suppress(RbtoolError, OSError):
                if not read_index(directory).id_list:
                    shutil.rmtree(created, ignore_errors=True)
        raise


class _NoWriter:
    """What a dry-run import writes through: nothing."""

    def place(self, *args: Any, **kwargs: Any) -> None:
        pass

    def publish(self, index: Index) -> None:
        pass


@contextlib.contextmanager
def _dry_target(directory: Path, trajectory_format: str | None) -> Iterator[tuple[Any, Index, bool]]:
    """_target without creating, locking or writing anything: (a writer that writes nothing, index, new)."""
    if trajectory_format is not None and trajectory_format not in ("pt", "pkl"):
        raise UsageError(f"format must be 'pt' or 'pkl', got {trajectory_format!r}")
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"{directory}: exists and is not a directory; choose a directory path")
    refuse_file_parent(directory)
    if is_checkpoint_dir(directory):
        _, index = open_checkpoint(directory, strict=True)
        yield _NoWriter(), index, False
    else:
        yield _NoWriter(), Index(trajectory_format=trajectory_format or "pt"), not directory.exists()


def import_lerobot(
    source: str | os.PathLike[str],
    buffer_dir: str | os.PathLike[str],
    *,
    episodes: Sequence[int] | None = None,
    field_map: dict[str, str] | None = None,
    drop: Sequence[str] = (),
    use_sidecar: bool = True,
    model_weights_id: str | None = None,
    trajectory_format: str | None = None,
    batch_size: int = 64,
    on_wait: Callable[[str], None] | None = None,
    progress: Callable[[int], None] | None = None,
    on_published: Callable[[list[int]], None] | None = None,
    dry_run: bool = False,
) -> ImportResult:
    """Add the episodes of the LeRobot dataset at `source` to the buffer directory `buffer_dir`.

    A dataset rbtool exported (it has the sidecar) is rebuilt trajectory by trajectory, every
    tensor as it was; into a new or empty buffer directory it keeps its ids, counter, seed
    and metadata. Any other dataset, or a selection of `episodes`, or `use_sidecar=False`,
    gives one trajectory per episode with B = 1 (see docs/lerobot.md for the fields).
    `field_map` maps feature names to dotted buffer fields; `drop` leaves features out.
    With `dry_run` every episode is read and given its id as a real import would, but nothing
    is created, locked or written (`on_published` is not called).
    """
    _require_arrow()
    dataset = LeRobotSource(source)
    directory = Path(buffer_dir)
    sidecar = dataset.sidecar() if use_sidecar and episodes is None and not field_map and not drop else None
    if model_weights_id is not None:
        check_weights_id(model_weights_id, "model_weights_id")
    result = ImportResult(directory, dataset.root, dataset.version, "rbtool" if sidecar else "episodes")
    # Everything the dataset can be refused for before decoding is refused here, before the
    # buffer directory is created, locked or written.
    if sidecar is not None:
        items = _rebuild(dataset, sidecar)
        for name, c in sidecar["columns"].items():
            dotted = ".".join(c["path"])
            views = int(c.get("views") or 0)
            if views:
                result.fields.update({f"{name}-{v}": f"{dotted}[{v}]" for v in range(views)})
            else:
                result.fields[name] = dotted
    else:
        items = _episodes_as_trajectories(dataset, episodes, field_map or {}, drop, model_weights_id, result)
    before = None if dry_run else _BufferState.capture(directory)
    target = (
        _dry_target(directory, trajectory_format)
        if dry_run
        else _target(directory, trajectory_format, on_wait)
    )
    with target as (writer, index, is_new):
        result.index = index
        batch: list[int] = []
        try:
            _import_items(
                items,
                sidecar,
                directory,
                writer,
                index,
                is_new,
                trajectory_format,
                batch,
                result,
                progress=progress,
                on_published=on_published,
                dry_run=dry_run,
                batch_size=batch_size,
            )
        except Exception:
            # A bad dataset found while decoding: the buffer goes back to what it was.
            if before is not None:
                before.restore(directory, [*result.added_ids, *batch], index)
            result.added_ids.clear()
            raise
        except BaseException:
            # Interrupted (Ctrl-C): the published batches stay, and a rerun goes on from them;
            # files of the unpublished batch are not in the on-disk index: remove them.
            for tid in batch:
                (directory / index.file_name(tid)).unlink(missing_ok=True)
            raise
    if sidecar:
        result.episodes = sum(int(r.get("episodes", [0, 0])[1]) for r in sidecar["trajectories"])
    return result


class _BufferState:
    """What a buffer directory held before an import: its index, metadata and lock file, so a
    failed import puts them back (and removes what it created) as they were."""

    NAMES = ("trajectory_index.json", "trajector_index.json", "metadata.json", ".rbtool.lock")

    def __init__(self, existed: bool, files: dict[str, bytes | None]) -> None:
        self.existed = existed
        self.files = files

    @classmethod
    def capture(cls, directory: Path) -> _BufferState:
        files: dict[str, bytes | None] = {}
        existed = directory.is_dir() and not directory.is_symlink()
        for name in cls.NAMES:
            path = directory / name
            try:
                files[name] = (
                    path.read_bytes() if existed and path.is_file() and not path.is_symlink() else None
                )
            except OSError:
                files[name] = None
        return cls(existed, files)

    def restore(self, directory: Path, added: Sequence[int], index: Index) -> None:
        """Remove the files of `added`, then put the index and metadata back (or remove them)."""
        if not self.existed:
            return  # _target removes the directory it created
        with contextlib.suppress(OSError):
            for tid in added:
                (directory / index.file_name(tid)).unlink(missing_ok=True)
            for name, data in self.files.items():
                path = directory / name
                if name == ".rbtool.lock":
                    if data is None:
                        path.unlink(missing_ok=True)  # it is held: no one else can be writing
                    continue
                if data is None:
                    path.unlink(missing_ok=True)
                elif not path.is_file() or path.read_bytes() != data:
                    write_bytes_atomic(path, data)


def _import_items(
    items: Iterator[tuple[dict[str, Any], dict[str, Any] | None, int]],
    sidecar: dict[str, Any] | None,
    directory: Path,
    writer: Any,
    index: Index,
    is_new: bool,
    trajectory_format: str | None,
    batch: list[int],
    result: ImportResult,
    *,
    progress: Callable[[int], None] | None,
    on_published: Callable[[list[int]], None] | None,
    dry_run: bool,
    batch_size: int,
) -> None:
    """Write the trajectories of `items` into the buffer, publishing every `batch_size`."""
    if trajectory_format is not None and not is_new and trajectory_format != index.trajectory_format:
        raise UsageError(
            f"{directory}: holds {index.trajectory_format} files; cannot import as {trajectory_format}"
        )
    counter = 0
    resumed: set[int] = set()
    if sidecar is not None:
        # Into a buffer that never assigned an id, the export comes back as it was; into
        # one an interrupted import of it left (its first ids, same entries), it goes on.
        ckpt = sidecar["checkpoint"]
        resumed = _resumed_ids(directory, index, sidecar)
        if (not index.id_list and index.trajectory_counter == 0) or resumed:
            index.seed = ckpt.get("seed")
            index.extra_metadata = dict(ckpt.get("extra_metadata") or {})
            if is_new and trajectory_format is None:
                index.trajectory_format = ckpt.get("trajectory_format") or "pt"
            result.kept_ids = True
            counter = int(ckpt.get("trajectory_counter") or 0)

    def publish() -> None:
        writer.publish(index)
        result.added_ids.extend(batch)
        if on_published is not None and batch and not dry_run:
            on_published(list(batch))
        batch.clear()

    for traj, entry, frames in items:
        if result.kept_ids and entry is not None and int(entry["trajectory_id"]) in resumed:
            result.skipped += 1
            if progress is not None:
                progress(1)
            continue
        if entry is not None:
            # An exported trajectory: its entry comes back (sizes, hashes and a link's
            # identity describe a file, and are the new file's).
            tid = int(entry["trajectory_id"]) if result.kept_ids else index.trajectory_counter
            new = {k: v for k, v in entry.items() if k not in ("file_bytes", "sha256", "link")}
            new["trajectory_id"] = tid
            if not result.kept_ids or not new.get("uuid"):
                new["uuid"] = uuid.uuid4().hex
        else:
            tid = index.trajectory_counter
            traj, info = trajfile.normalize(traj, f"{result.dataset}: episode as trajectory {tid}")
            new = new_entry(tid, info, uuid.uuid4().hex)
        if tid >= _ID_LIMIT - 1:
            raise CheckpointError(f"{directory}: trajectory id {tid} would pass 2**63 - 1")
        if tid in index.entries:
            raise CheckpointError(f"{directory}: already lists trajectory id {tid}")
        index.entries[tid] = new
        writer.place(traj, index.file_name(tid), new, result.report)
        index.id_list.append(tid)
        index.trajectory_counter = max(index.trajectory_counter, tid + 1)
        batch.append(tid)
        result.frames += frames
        if progress is not None:
            progress(1)
        if len(batch) >= batch_size:
            publish()
    index.trajectory_counter = max(index.trajectory_counter, counter)
    if batch or result.kept_ids:
        publish()


def _resumed_ids(directory: Path, index: Index, sidecar: dict[str, Any]) -> set[int]:
    """The ids an interrupted import of this export left in `index` (empty if it is not one).

    Such a buffer lists a prefix of the export's ids, each with the exported entry (sizes,
    hashes and uuids aside) and the exported content (its digest), and the export's seed.
    """
    ckpt = sidecar.get("checkpoint") or {}
    ids = list(ckpt.get("trajectory_id_list") or [])
    done = index.id_list
    if not done or done != ids[: len(done)] or index.seed != ckpt.get("seed"):
        return set()
    records = {int(r["trajectory_id"]): r for r in sidecar.get("trajectories", [])}
    hints = ("uuid", "file_bytes", "sha256", "link")
    for tid in done:
        mine = {k: v for k, v in index.entries[tid].items() if k not in hints}
        theirs = {k: v for k, v in (records.get(tid, {}).get("entry") or {}).items() if k not in hints}
        if mine != theirs:
            return set()
    for tid in done:  # entries alike: the contents decide
        name = index.file_name(tid)
        if _digest(with_stored_defaults(trajfile.load(directory / name, mmap=True), name)) != records[
            tid
        ].get("digest"):
            return set()
    return set(done)


def _rebuild(
    dataset: LeRobotSource, sidecar: dict[str, Any]
) -> Iterator[tuple[dict[str, Any], dict[str, Any] | None, int]]:
    """The exported trajectories, rebuilt from their frames and the sidecar, checked against their digests."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    try:
        schemas = sidecar["schemas"]
        records = sidecar["trajectories"]
        columns = sidecar["columns"]
    except (KeyError, TypeError):
        raise CheckpointError(f"{dataset.root / SIDECAR_FILE}: incomplete sidecar") from None
    tensors = dataset.tensors_file(sidecar)
    blob_path = tensors or dataset.root / SIDECAR_TENSORS

    def blob_rows() -> Iterator[dict[str, Any]]:
        if tensors is not None:
            pa = _require_arrow()
            try:
                for batch in pq.ParquetFile(str(tensors)).iter_batches(batch_size=64):
                    _within_budget(batch.nbytes, f"{tensors}: 64 rows")
                    yield from batch.to_pylist()
            except (OSError, pa.ArrowInvalid) as exc:
                raise CheckpointError(f"{tensors}: not a readable Parquet file ({exc})") from None

    # The sidecar's tensors are in trajectory order: read them along, one trajectory at a time.
    stream = blob_rows()
    pending = next(stream, None)
    all_episodes = dataset.episodes()
    features = dataset.features

    def stored_as(base: str) -> list[str]:
        views = int(columns[base].get("views") or 0)
        return [f"{base}-{v}" for v in range(views)] if views else [base]

    # Video features are not decoded: the sidecar holds their exact rows.
    in_video = {base for base in columns if columns[base].get("video")}
    names = [
        *(name for base in columns if base not in in_video for name in stored_as(base)),
        RB_TRAJECTORY_ID,
        RB_ENV,
        RB_T,
    ]
    pending_box = [pending]

    def build(record: dict[str, Any]) -> tuple[dict[str, Any], int]:
        pending = pending_box[0]
        tid, t, b = int(record["trajectory_id"]), int(record["T"]), int(record["B"])
        nodes = schemas[int(record["schema"])]
        first, count = record.get("episodes", [0, 0])
        parts = [part for _, part in dataset.frames(all_episodes[first : first + count], names)]
        frames = sum(p.num_rows for p in parts)
        if frames != t * b:
            raise CheckpointError(
                f"{dataset.root}: trajectory {tid} has {frames} frames; the sidecar says {t} x {b}"
            )
        rows: dict[str, np.ndarray] = {}
        if parts:
            import pyarrow as pa

            table = pa.concat_tables(parts)
            tt = table.column(RB_T).to_numpy()
            bb = table.column(RB_ENV).to_numpy()
        mine: list[dict[str, Any]] = []
        while pending is not None and int(pending["trajectory_id"]) == tid:
            mine.append(pending)
            pending = next(stream, None)

        def need(rows: dict[int, dict[str, Any]], node: int, tid: int = tid) -> dict[str, Any]:
            if node not in rows:
                raise CheckpointError(f"{blob_path}: holds no tensor {node} of trajectory {tid}")
            return rows[node]

        own = {int(r["node"]): r for r in mine if r["kind"] not in ("next_obs", "frames")}
        exact = {int(r["node"]): r for r in mine if r["kind"] == "frames"}
        nxt = {int(r["node"]): r for r in mine if r["kind"] == "next_obs"}
        traj: dict[str, Any] = {}
        values = iter(record.get("values", []))
        built: dict[tuple[str, ...], torch.Tensor] = {}
        for i, node in enumerate(nodes):
            # Interned keys: equal keys are one string object, as in a loaded file, so the
            # pickle torch.save writes memoizes them alike and the file comes back byte for byte.
            path = tuple(sys.intern(key) for key in node["path"])
            parent = traj
            for key in path[:-1]:
                parent = parent[key]
            kind = node["kind"]
            if kind == "dict":
                parent[path[-1]] = {}
                continue
            if kind == "value":
                parent[path[-1]] = _decode_value(next(values))
                continue
            if kind == "tensor":
                blob = need(own, i)
                tensor = _from_raw(
                    blob["data"], blob["dtype"], blob["shape"], f"{blob_path}: trajectory {tid}"
                )
            elif kind == "column" and node["feature"] in in_video:
                blob = need(exact, i)
                tensor = _from_raw(
                    blob["data"], blob["dtype"], blob["shape"], f"{blob_path}: trajectory {tid}"
                )
            elif kind == "column":
                feature = node["feature"]
                stored = stored_as(feature) if feature in columns else [feature]
                arr = None
                if parts:
                    per_view = [_column_numpy(table.column(name), features[name], name) for name in stored]
                    arr = (
                        np.stack(per_view, axis=1) if len(stored) > 1 or stored[0] != feature else per_view[0]
                    )
                shape = tuple(node["shape"])
                dtype = node["dtype"]
                out = np.zeros((t, b, *shape), dtype=_np_dtype(_AS_BITS.get(dtype, dtype)))
                if arr is not None:
                    out[tt, bb] = arr.reshape(len(tt), *shape)
                tensor = _from_numpy(out, dtype).reshape(t, b, *shape)
                extra = int(node.get("extra_rows") or 0)
                if extra:
                    boot = need(own, i)
                    boot_rows = _from_raw(
                        boot["data"], boot["dtype"], boot["shape"], f"{blob_path}: trajectory {tid}"
                    )
                    per = t // extra
                    pieces = []
                    for e in range(extra):
                        pieces.append(boot_rows[e : e + 1])
                        pieces.append(tensor[e * per : (e + 1) * per])
                    tensor = torch.cat(pieces)
                rows[feature] = out
            else:  # derived next_obs
                src = built[tuple(node["source"])]
                tensor = torch.empty_like(src)
                if t > 1:
                    tensor[:-1] = src[1:]
                blob = need(nxt, i)
                fixes = _from_raw(
                    blob["data"], blob["dtype"], blob["shape"], f"{blob_path}: trajectory {tid}"
                )
                if blob["t"]:
                    tensor[list(blob["t"]), list(blob["b"])] = fixes
            built[path] = tensor
            parent[path[-1]] = tensor
        if _digest(traj) != record.get("digest"):
            raise CheckpointError(
                f"{dataset.root}: trajectory {tid} does not rebuild to what was exported (its frames or "
                "the sidecar were changed)"
            )
        pending_box[0] = pending
        check_entry(record, traj)
        return traj, frames

    def check_entry(record: dict[str, Any], traj: dict[str, Any]) -> None:
        """The sidecar's entry agrees with the trajectory rebuilt (its digest is the sidecar's own)."""
        from rbtool.format.layout import describe

        entry, tid = record["entry"], record["trajectory_id"]
        try:
            info = describe(traj, f"{dataset.root}: trajectory {tid}")
        except RbtoolError as exc:
            raise CheckpointError(str(exc)) from None
        if list(entry["shape"]) != list(info.shape) or entry["num_samples"] != info.num_samples:
            raise CheckpointError(
                f"{dataset.root / SIDECAR_FILE}: trajectory {tid}: entry shape {entry['shape']} and "
                f"num_samples {entry['num_samples']}; the trajectory rebuilt has {list(info.shape)}"
            )

    def iterate() -> Iterator[tuple[dict[str, Any], dict[str, Any] | None, int]]:
        for record in records:
            yield rebuilt(record)

    def rebuilt(record: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None, int]:
        try:
            traj, frames = build(record)
        except RbtoolError:
            raise
        except (
            KeyError,
            TypeError,
            ValueError,
            IndexError,
            RuntimeError,
            AttributeError,
            OverflowError,
            StopIteration,
        ) as exc:
            raise CheckpointError(
                f"{dataset.root / SIDECAR_FILE}: trajectory {record.get('trajectory_id')} cannot be rebuilt "
                f"({type(exc).__name__}: {str(exc)[:200]})"
            ) from None
        return traj, record["entry"], frames

    dataset.check(all_episodes, names)
    return iterate()


def _column(table: Any, name: str, episode: _Episode) -> Any:
    if name not in table.column_names:
        raise CheckpointError(f"{episode.file}: has no column {name!r} named in meta/info.json")
    return table.column(name)


def _episodes_as_trajectories(
    dataset: LeRobotSource,
    selected: Sequence[int] | None,
    field_map: dict[str, str],
    drop: Sequence[str],
    model_weights_id: str | None,
    result: ImportResult,
) -> Iterator[tuple[dict[str, Any], dict[str, Any] | None, int]]:
    """One trajectory per episode (B = 1): observations as curr_obs / next_obs of consecutive frames."""
    import numpy as np
    import torch

    features = dataset.features
    for name in [*field_map, *drop]:
        if name not in features:
            raise UsageError(f"{dataset.root}: has no feature {name!r}")
    cameras = [
        n
        for n, s in features.items()
        if s.get("dtype") in ("image", "video") and n.startswith("observation.images.")
    ]
    mapping: dict[str, tuple[str, ...]] = {}
    # RLinf's writer splits a multi-view camera field [N, H, W, C] into image features
    # `wrist_image-0`, `wrist_image-1`, ...: they are stacked back into one field.
    views: dict[tuple[str, ...], list[tuple[int, str]]] = {}
    for name, spec in features.items():
        if name in drop:
            result.dropped.append(name)
            continue
        split = re.fullmatch(r"(wrist_image|extra_view_image)-(\d+)", name)
        if split and name not in field_map and spec.get("dtype") in ("image", "video"):
            views.setdefault(("curr_obs", f"{split.group(1)}s"), []).append((int(split.group(2)), name))
            continue
        target = (
            tuple(field_map[name].split(".")) if name in field_map else default_field(name, spec, cameras)
        )
        if target is None:
            continue
        dtype = spec.get("dtype")
        if dtype == "string" or dtype not in (*_NATIVE, "image", "video"):
            raise LeRobotFeatureError(
                f"feature {name!r} has dtype {dtype!r}, which is not a tensor dtype", name
            )
        if dtype not in (*_TRAJECTORY_DTYPES, "image", "video"):
            raise LeRobotFeatureError(
                f"feature {name!r} has dtype {dtype!r}, which trajectory files do not hold", name
            )
        for other, taken in mapping.items():
            shorter = min(len(taken), len(target))
            if taken[:shorter] == target[:shorter]:
                where = "as" if taken == target else "inside or around the field of"
                raise LeRobotFeatureError(
                    f"feature {name!r} would become {'.'.join(target)}, {where} feature {other!r}",
                    name,
                    mappable=True,
                )
        mapping[name] = target
    for target, group in views.items():
        group.sort()
        if target in mapping.values():
            other = next(n for n, t in mapping.items() if t == target)
            raise LeRobotFeatureError(
                f"feature {other!r} would become {'.'.join(target)}, as the views {group[0][1]}... do",
                other,
                mappable=True,
            )
    result.fields = {name: ".".join(target) for name, target in mapping.items()}
    for target, group in views.items():
        result.fields.update({name: f"{'.'.join(target)}[{i}]" for i, (_, name) in enumerate(group)})
    episodes = dataset.episodes()
    if selected is not None:
        by_index = {e.index: e for e in episodes}
        missing = [i for i in selected if i not in by_index]
        if missing:
            raise UsageError(f"{dataset.root}: has no episode {missing[0]} (episodes 0-{len(episodes) - 1})")
        episodes = [by_index[i] for i in selected]
    mwid = model_weights_id if model_weights_id is not None else f"lerobot-{_safe_id(dataset.root.name)}"
    tasks = dataset.tasks()
    read = [*mapping, *(name for group in views.values() for _, name in group), "task_index"]
    dataset.check(episodes, read)

    def iterate() -> Iterator[tuple[dict[str, Any], dict[str, Any] | None, int]]:
        for episode, table in dataset.frames(episodes, read):
            try:
                yield one(episode, table)
            except CheckpointError as exc:
                if str(exc).startswith(str(dataset.root)):
                    raise
                raise CheckpointError(f"{episode.file}: episode {episode.index}: {exc}") from None

    def one(episode: _Episode, table: Any) -> tuple[dict[str, Any], dict[str, Any] | None, int]:
        t = table.num_rows
        fields: dict[tuple[str, ...], torch.Tensor] = {}
        for name, target in mapping.items():
            arr = _column_numpy(_column(table, name, episode), features[name], name)
            tensor = torch.from_numpy(np.array(arr)).reshape(t, 1, *arr.shape[1:])
            if target[0] in DONE_LIKE and len(target) == 1:
                flags = tensor if tensor.dtype == torch.bool else tensor != 0
                tensor = torch.cat([torch.zeros((1, *flags.shape[1:]), dtype=torch.bool), flags])
            fields[target] = tensor
        for target, group in views.items():
            frames = [_column_numpy(_column(table, name, episode), features[name], name) for _, name in group]
            fields[target] = torch.from_numpy(np.stack(frames, axis=1)).reshape(
                t, 1, len(group), *frames[0].shape[1:]
            )
        if ("rewards",) not in fields:
            fields[("rewards",)] = torch.zeros(t, 1, 1, dtype=torch.float32)
        dones = fields.get(("dones",))
        if dones is None:
            dones = torch.zeros(t + 1, 1, 1, dtype=torch.bool)
        if t:
            dones = dones.clone()
            dones[-1] = True
        fields[("dones",)] = dones
        for path in [p for p in fields if p[0] == "curr_obs"]:
            cur = fields[path]
            fields[("next_obs", *path[1:])] = torch.cat([cur[1:], cur[-1:]]) if t else cur.clone()
        traj: dict[str, Any] = {"max_episode_length": t, "model_weights_id": mwid}
        order = ["actions", "intervene_flags", "rewards", "terminations", "truncations", "dones"]
        ranked = sorted(
            fields,
            key=lambda p: (
                order.index(p[0]) if p[0] in order else len(order),
                p[0] in ("curr_obs", "next_obs"),
            ),
        )
        for path in ranked:
            parent = traj
            for key in path[:-1]:
                parent = parent.setdefault(key, {})
                if not isinstance(parent, dict):
                    raise UsageError(f"buffer field {'.'.join(path)} would be inside a tensor field")
            parent[path[-1]] = fields[path]
        task_ids = table.column("task_index").to_pylist() if "task_index" in table.column_names else []
        if task_ids and task_ids[0] is not None and 0 <= int(task_ids[0]) < len(tasks):
            traj["task"] = tasks[int(task_ids[0])]
        elif episode.tasks:
            traj["task"] = episode.tasks[0]
        result.episodes += 1
        return traj, None, t

    return iterate()
