"""Trajectory tensors as bytes and as numpy: the dtypes Arrow holds as they are, those kept as
their bits, and the dtypes trajectory files hold (nothing else is imported).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rbtool.errors import CheckpointError
from rbtool.interop.lerobot.limits import is_int

if TYPE_CHECKING:
    import numpy as np
    import torch

# torch dtypes Arrow holds as they are, and those kept as their bits (tagged in the sidecar).
NATIVE = (
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
AS_BITS = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}
# The dtypes a trajectory file may hold (trajfile.supported_dtypes): nothing else is imported.
TRAJECTORY_DTYPES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
    "complex64", "complex128",
)  # fmt: skip


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown tensor dtype {name!r}")
    return dtype


def raw_bytes(tensor: torch.Tensor) -> bytes:
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return bytes(flat.view(torch.uint8).numpy().tobytes())


def from_raw(data: bytes, dtype: str, shape: Sequence[int], where: str = "") -> torch.Tensor:
    import torch

    where = f"{where}: " if where else ""
    if dtype not in TRAJECTORY_DTYPES:
        raise CheckpointError(
            f"a stored tensor of dtype {str(dtype)[:40]!r}, which trajectory files do not hold"
        )
    tdtype = _torch_dtype(dtype)
    if not isinstance(shape, (list, tuple)) or not all(is_int(d) and 0 <= d < (1 << 31) for d in shape):
        raise CheckpointError(f"{where}a stored tensor of shape {str(shape)[:80]}, not a shape")
    if not isinstance(data, bytes) or len(data) != math.prod(shape) * tdtype.itemsize:
        size = len(data) if isinstance(data, bytes) else "no"
        raise CheckpointError(f"{where}a stored {dtype} tensor of shape {list(shape)} has {size} bytes")
    if math.prod(shape) == 0:
        return torch.empty(tuple(shape), dtype=tdtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(tdtype).reshape(tuple(shape)).clone()


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A tensor as numpy, dtypes Arrow lacks as their bits."""
    name = dtype_name(tensor.dtype)
    if name in AS_BITS:
        return tensor.contiguous().view(_torch_dtype(AS_BITS[name])).numpy()
    return tensor.contiguous().numpy()


def from_numpy(array: np.ndarray, dtype: str) -> torch.Tensor:
    import numpy as np
    import torch

    if dtype in AS_BITS:
        return torch.from_numpy(np.ascontiguousarray(array.astype(AS_BITS[dtype], copy=False))).view(
            _torch_dtype(dtype)
        )
    return torch.from_numpy(np.ascontiguousarray(array.astype(dtype, copy=False)))


def np_dtype(name: str) -> Any:
    import numpy as np

    return np.dtype(name)
