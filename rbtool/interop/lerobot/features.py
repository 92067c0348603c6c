"""Buffer fields as LeRobot features and back: the names RLinf's writer gives them, the
per-frame `rb.*` columns, `Column` (a field stored as one or more per-frame features, with its
LeRobot and Hugging Face specs), the registry that decides each field's feature from the first
trajectory that has it, the `NAME=VALUE` mappings that rename them, the (height, width,
channels) of an image feature, and the buffer field a feature of any dataset becomes on import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rbtool.errors import CheckpointError, UsageError
from rbtool.interop.lerobot.layout import FRAME_FEATURES
from rbtool.interop.lerobot.tensors import AS_BITS, to_numpy
from rbtool.interop.lerobot.video import VIDEO_CODEC, VIDEO_PIX_FMT

if TYPE_CHECKING:
    import numpy as np
    import torch

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
_IMAGE_NAMES = {path for path, name in RLINF_NAMES.items() if "image" in name}
_MULTI_VIEW = {("curr_obs", "wrist_images"), ("curr_obs", "extra_view_images")}
_MAX_ARRAY_DIMS = 5  # LeRobot's features go up to Array5D


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
        return AS_BITS.get(self.dtype, self.dtype)

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
        return view_names(self.feature, self.views)

    def specs(self, fps: int = 0) -> dict[str, dict[str, Any]]:
        return {name: self.spec(fps) for name in self.names()}

    def fields(self) -> dict[str, str]:
        """Feature name -> the buffer field (`path[i]` for view i) it holds."""
        return view_fields(self.feature, self.path, self.views)

    def in_frame_order(self, tensor: torch.Tensor, t: int, b: int) -> np.ndarray:
        """The field's `[T, B, ...]` rows as per-frame values `[T * B, *frame_shape]`, one env column
        after another (the export's frame order)."""
        rows = to_numpy(tensor).reshape(t, b, *self.frame_shape)
        return rows.swapaxes(0, 1).reshape(t * b, *self.frame_shape)

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


def hf_feature(spec: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face `datasets` feature of a LeRobot feature (what LeRobot's own files record)."""
    dtype, shape = spec["dtype"], list(spec["shape"])
    if dtype == "image":
        return {"_type": "Image"}
    if shape == [1]:
        return {"dtype": dtype, "_type": "Value"}
    if len(shape) == 1:
        return {"feature": {"dtype": dtype, "_type": "Value"}, "length": shape[0], "_type": "List"}
    return {"shape": shape, "dtype": dtype, "_type": f"Array{len(shape)}D"}


def field_name(path: Sequence[str]) -> str:
    return ".".join(path)


def view_names(feature: str, views: int) -> list[str]:
    """The LeRobot features a field is stored as: `feature`, or `feature-<i>` for each of its views."""
    return [f"{feature}-{i}" for i in range(views)] if views else [feature]


def view_fields(feature: str, path: Sequence[str], views: int) -> dict[str, str]:
    """Feature name -> the buffer field (`path[i]` for view i) it holds."""
    dotted = field_name(path)
    if not views:
        return {feature: dotted}
    return {name: f"{dotted}[{i}]" for i, name in enumerate(view_names(feature, views))}


class Registry:
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
        dotted = field_name(path)
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


def hwc_of(spec: dict[str, Any]) -> tuple[int, int, int]:
    """(height, width, channels) of an image or video feature (its names say the order)."""
    shape = [int(d) for d in spec.get("shape") or []]
    if len(shape) != 3:
        raise CheckpointError(f"an image feature of shape {shape}; rbtool reads [H, W, C] or [C, H, W]")
    names = spec.get("names") or []
    if names and str(names[0]).startswith("channel"):
        return shape[1], shape[2], shape[0]
    return shape[0], shape[1], shape[2]


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
