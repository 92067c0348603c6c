"""A feature's per-frame values as Arrow columns and back: numeric values of any shape as
(nested) lists, images as PNG structs, and the columns of any dataset decoded to numpy.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rbtool.errors import CheckpointError, RbtoolError
from rbtool.interop.lerobot.extras import require_arrow, require_pil
from rbtool.interop.lerobot.features import hwc_of
from rbtool.interop.lerobot.tensors import np_dtype

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa


def arrow_type(spec: dict[str, Any]) -> pa.DataType:
    pa = require_arrow()
    dtype, shape = spec["dtype"], list(spec["shape"])
    if dtype == "image":
        return pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    value = pa.string() if dtype == "string" else pa.from_numpy_dtype(np_dtype(dtype))
    if shape == [1]:
        return value
    if len(shape) == 1:
        return pa.list_(value, shape[0])
    for _ in shape:
        value = pa.list_(value)
    return value


def column_array(values: np.ndarray, spec: dict[str, Any]) -> pa.Array:
    """Per-frame values `[n, *shape]` as an Arrow column of the feature's type."""
    import numpy as np

    pa = require_arrow()
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


def image_array(frames: np.ndarray) -> pa.Array:
    """uint8 frames `[n, H, W, C]` as LeRobot image structs (PNG bytes, lossless)."""
    pa = require_arrow()
    image = require_pil()
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

    image = require_pil()
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


def column_numpy(column: Any, spec: dict[str, Any], feature: str) -> np.ndarray:
    """An Arrow column (any list nesting) as numpy `[n, *shape]` of the feature's dtype."""
    import numpy as np

    pa = require_arrow()
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    shape = [int(s) for s in spec["shape"]]
    n = len(column)
    if column.null_count:
        raise CheckpointError(f"feature {feature!r}: {column.null_count} frame(s) have no value")
    if spec["dtype"] == "image":
        return _decode_images(column, shape, feature, spec.get("names"))
    if spec["dtype"] == "video":  # decoded by LeRobotSource.frames: flat uint8 per frame
        return np.asarray(column.flatten().to_numpy()).reshape(n, *hwc_of(spec))
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
    return np.asarray(values).astype(np_dtype(spec["dtype"]), copy=False).reshape(n, *shape)
