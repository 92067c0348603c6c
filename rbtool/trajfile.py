"""Trajectory files: cleaning trajectory dicts, serializing them, loading them safely, hashes.

torch is imported inside the functions that need tensors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import warnings
from pathlib import Path
from typing import Any

from rbtool.errors import InvalidTrajectoryError, TrajectoryFileError, UnsafePickleError
from rbtool.layout import TrajectoryInfo, describe


def _as_dict(trajectory: Any) -> dict[str, Any]:
    """A trajectory given as a dict, a dataclass or an object with attributes, as a plain dict."""
    if isinstance(trajectory, dict):
        return dict(trajectory)
    if dataclasses.is_dataclass(trajectory) and not isinstance(trajectory, type):
        return {f.name: getattr(trajectory, f.name, None) for f in dataclasses.fields(trajectory)}
    if hasattr(trajectory, "__dict__"):
        return {k: v for k, v in vars(trajectory).items() if not k.startswith("_")}
    raise InvalidTrajectoryError(
        f"a trajectory must be a dict or an object with attributes, got {type(trajectory).__name__}"
    )


def _clean(value: Any, path: str, tensor_type: Any) -> Any:
    """Copy tensors to contiguous CPU clones and drop None, recursing into dicts."""
    if isinstance(value, tensor_type):
        return value.detach().cpu().contiguous().clone()
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidTrajectoryError(f"field {path}: nested keys must be strings, got {key!r}")
            if item is not None:
                out[key] = _clean(item, f"{path}.{key}", tensor_type)
        return out
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)
    raise InvalidTrajectoryError(
        f"field {path!r} holds a {type(value).__name__}; only tensors, dicts of tensors, "
        "numbers and strings can be stored"
    )


def normalize(trajectory: Any, where: str) -> tuple[dict[str, Any], TrajectoryInfo]:
    """The dict that goes into a trajectory file, and its index information."""
    import torch

    raw = _as_dict(trajectory)
    traj: dict[str, Any] = {}
    for key, value in raw.items():
        if value is None:
            continue
        if not isinstance(key, str):
            raise InvalidTrajectoryError(f"{where}: field names must be strings, got {key!r}")
        traj[key] = _clean(value, key, torch.Tensor)
    info = describe(traj, where)
    traj["model_weights_id"] = info.model_weights_id
    if "max_episode_length" not in traj:
        traj["max_episode_length"] = info.shape[0]
        info = dataclasses.replace(info, max_episode_length=info.shape[0])
    return traj, info


def to_bytes(traj: dict[str, Any], fmt: str) -> bytes:
    """Serialize a trajectory dict the way the reference implementation does for `fmt`."""
    if fmt == "pt":
        import torch

        buffer = io.BytesIO()
        torch.save(traj, buffer)
        return buffer.getvalue()
    from rbtool.safepickle import dump_pickle_trajectory

    return dump_pickle_trajectory(traj)


def load_pt_template(path: Path, mmap: bool) -> Any:
    """Whatever a `.pt` file holds, loaded with weights_only (no type check on the result).

    With `mmap=True` nothing is read up front, so storage reads the structure and each
    tensor's place in the file from it. Errors name the file (TrajectoryFileError, or
    UnsafePickleError for objects other than tensors and plain data).
    """
    import pickle

    import torch

    try:
        with warnings.catch_warnings():
            # torch warns about odd files (e.g. a plain pickle named .pt) before it refuses them;
            # the error says enough, and a warning would add lines to a one-line error
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "unpickling failed"
        if "Weights only load failed" in str(exc) or "Unsupported global" in str(exc):
            raise UnsafePickleError(
                f"{path}: refused: the file holds objects other than tensors and plain data ({first})"
            ) from None
        raise TrajectoryFileError(f"{path}: not a readable .pt trajectory ({first})") from None
    except FileNotFoundError:
        raise TrajectoryFileError(f"{path}: file not found") from None
    except Exception as exc:  # torch raises RuntimeError, EOFError, ValueError... on bad bytes
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TrajectoryFileError(f"{path}: not a readable .pt trajectory ({message})") from None


def load(path: str | os.PathLike[str], *, mmap: bool = False, suffix: str | None = None) -> dict[str, Any]:
    """Load a trajectory file safely: `.pt` with weights_only, `.pkl` with a restricted unpickler.

    With `mmap=True`, `.pt` tensors are memory-mapped, so only the rows read are paged in.
    `suffix` gives the format when the name has none (a file read through its descriptor).
    """
    path = Path(path)
    suffix = path.suffix if suffix is None else suffix
    if suffix == ".pt":
        if mmap:
            try:
                obj = load_pt_template(path, mmap=True)
            except TrajectoryFileError:
                obj = load_pt_template(path, mmap=False)  # legacy (non-zip) files cannot be mapped
        else:
            obj = load_pt_template(path, mmap=False)
    elif suffix == ".pkl":
        from rbtool.safepickle import load_pickle_trajectory

        try:
            data = path.read_bytes()
        except OSError as exc:
            raise TrajectoryFileError(f"{path}: cannot read ({exc.strerror})") from None
        obj = load_pickle_trajectory(data, name=str(path))
    else:
        raise TrajectoryFileError(f"{path}: not a trajectory file (expected .pt or .pkl)")
    if not isinstance(obj, dict):
        raise TrajectoryFileError(f"{path}: holds a {type(obj).__name__}, expected a trajectory dict")
    return obj


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
