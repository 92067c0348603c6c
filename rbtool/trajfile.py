"""Trajectory files: validation of trajectory dicts, safe loading, atomic writing, linking.

torch is imported inside the functions that need tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import math
import os
import resource
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

from rbtool.errors import InvalidTrajectoryError, TrajectoryFileError, UnsafePickleError

# Re-exported for modules that still import them from here; layout owns them.
from rbtool.layout import DONE_LIKE as DONE_LIKE
from rbtool.layout import NESTED_ORDER as NESTED_ORDER
from rbtool.layout import SCALAR_FIELDS as SCALAR_FIELDS
from rbtool.layout import TrajectoryInfo as TrajectoryInfo
from rbtool.layout import describe as describe
from rbtool.layout import iter_tensors as iter_tensors


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


def _load_pt(path: Path, mmap: bool) -> Any:
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


def load(path: str | os.PathLike[str], *, mmap: bool = False) -> dict[str, Any]:
    """Load a trajectory file safely: `.pt` with weights_only, `.pkl` with a restricted unpickler.

    With `mmap=True`, `.pt` tensors are memory-mapped, so only the rows read are paged in.
    """
    path = Path(path)
    if path.suffix == ".pt":
        if mmap:
            try:
                obj = _load_pt(path, mmap=True)
            except TrajectoryFileError:
                obj = _load_pt(path, mmap=False)  # legacy (non-zip) files cannot be mapped
        else:
            obj = _load_pt(path, mmap=False)
    elif path.suffix == ".pkl":
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


# Rows at least this large are read from the file on demand; smaller fields are read whole.
ROW_READ_MIN_BYTES = 2048
# File descriptors kept open across batches (least recently used closed first): a quarter
# of the process's limit, at most 1024.
MAX_OPEN_FDS = max(16, min(1024, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4))
_OPEN_FILES: OrderedDict[int, FileTrajectory] = OrderedDict()


class FileRows:
    """A contiguous tensor left in its `.pt` file: rows are read with pread when drawn.

    Memory-mapping would be simpler, but the kernel maps whole page-cache folios (megabytes)
    on each fault, so a sampler touching a few rows of every file ends up with the whole
    checkpoint resident. Reading rows into the output keeps memory at the batch size.
    """

    def __init__(self, owner: FileTrajectory, offset: int, shape: tuple[int, ...], dtype: Any) -> None:
        import torch

        self.owner, self.offset, self.shape, self.dtype = owner, offset, torch.Size(shape), dtype
        self.row_bytes = math.prod(shape[1:]) * dtype.itemsize

    def dim(self) -> int:
        return len(self.shape)

    def reshape(self, *shape: int) -> FileRows:
        """Merge the two leading dims ([T, B, ...] -> [T*B, ...]); the layout is contiguous."""
        return FileRows(self.owner, self.offset, (self.shape[0] * self.shape[1], *self.shape[2:]), self.dtype)

    def take(self, rows: Any, out: Any, dest: Any) -> None:
        """Read stored rows `rows` into rows `dest` of the contiguous tensor `out`."""
        import torch

        size = self.row_bytes
        if size == 0 or not len(rows):
            return
        buffer = memoryview(out.view(torch.uint8).numpy()).cast("B")
        fd, base = self.owner.fd(), self.offset
        for j, row in zip(dest.tolist(), rows.tolist(), strict=True):
            got = os.preadv(fd, [buffer[j * size : (j + 1) * size]], base + row * size)
            if got != size:
                raise TrajectoryFileError(f"{self.owner.path}: truncated (row {row} of a field is cut short)")


class FileTrajectory:
    """A `.pt` trajectory opened for sampling: small fields in memory, large rows left on disk.

    The structure and each storage's place in the file come from torch's own loader
    (`weights_only=True`, memory-mapped, no data read); the bytes are then read with pread.
    """

    def __init__(self, path: Path) -> None:
        import torch

        template = _load_pt(path, mmap=True)
        if not isinstance(template, dict):
            raise TrajectoryFileError(
                f"{path}: holds a {type(template).__name__}, expected a trajectory dict"
            )
        self.info = describe(template, str(path))
        reader = torch._C.PyTorchFileReader(str(path))
        records = sorted(
            reader.get_record_offset(name)  # type: ignore[attr-defined]
            for name in reader.get_all_records()
            if name.startswith("data/")
        )
        storages = sorted(
            {
                t.untyped_storage().data_ptr()
                for _, t in iter_tensors(template)
                if t.untyped_storage().nbytes()
            }
        )
        bases = {address - offset for address, offset in zip(storages, records, strict=False)}
        if len(storages) != len(records) or len(bases) > 1:
            raise TrajectoryFileError(f"{path}: unexpected .pt layout (storages do not match records)")
        self._base = bases.pop() if bases else 0
        self.path = path
        self._fd: int | None = None
        self.data = _map_tensors(template, self._place)
        self.close()

    def fd(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
            _OPEN_FILES[id(self)] = self
            while len(_OPEN_FILES) > MAX_OPEN_FDS:
                _OPEN_FILES.popitem(last=False)[1].close()
        else:
            _OPEN_FILES.move_to_end(id(self))
        return self._fd

    def _place(self, t: Any) -> Any:
        import torch

        storage = t.untyped_storage()
        start = storage.data_ptr() - self._base
        row_bytes = math.prod(t.shape[1:]) * t.element_size() if t.dim() >= 2 else 0
        if t.is_contiguous() and row_bytes >= ROW_READ_MIN_BYTES:
            return FileRows(self, start + t.storage_offset() * t.element_size(), tuple(t.shape), t.dtype)
        data = bytearray(storage.nbytes())
        if data and os.preadv(self.fd(), [data], start) != len(data):
            raise TrajectoryFileError(f"{self.path}: truncated (a tensor's data is cut short)")
        raw = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        return raw.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())

    def close(self) -> None:
        """Close the file (it is reopened on the next read)."""
        if self._fd is not None:
            _OPEN_FILES.pop(id(self), None)
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _map_tensors(value: Any, fn: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value
