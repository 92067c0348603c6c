"""Trajectory files: cleaning trajectory dicts, serializing them, loading them safely, hashes.

Loading is safe in three steps: the file must be a regular file (never a FIFO or device)
whose zip records are stored as they are (no compression to inflate); `.pt` files load with
`weights_only=True`, `.pkl` files with rbtool.files.safepickle's restricted unpickler; and then
every value is checked before anyone uses it (`check_loaded`): string keys, bounded nesting,
no cycles, ints in int64, and tensors that are dense strided CPU tensors of a supported
dtype whose storage holds every element of their view, with no stride-0 or overlapping
dims. torch older than 2.10 is refused before any file is read (known weights_only bypasses).

torch is imported inside the functions that need tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import os
import pickle
import stat
import struct
import warnings
from pathlib import Path
from typing import Any

from rbtool.errors import InvalidTrajectoryError, RbtoolError, TrajectoryFileError, UnsafePickleError
from rbtool.format.content import checked_content, view_problem
from rbtool.format.layout import TrajectoryInfo, describe


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
    from rbtool.files.safepickle import dump_pickle_trajectory

    return dump_pickle_trajectory(traj)


# The oldest torch whose weights_only loading has no known bypass (CVE-2025-32434 was fixed
# in 2.6.0, CVE-2026-24747 in 2.10.0).
MIN_TORCH = (2, 10)


@functools.cache
def require_torch() -> Any:
    """torch, once it is known to be recent enough to load untrusted files."""
    import re

    import torch

    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if found is None or (int(found.group(1)), int(found.group(2))) < MIN_TORCH:
        raise RbtoolError(
            f"torch {torch.__version__} is older than {MIN_TORCH[0]}.{MIN_TORCH[1]}, whose weights_only "
            "loading has known bypasses (CVE-2025-32434, CVE-2026-24747); upgrade torch before reading "
            "trajectory files"
        )
    return torch


@functools.cache
def supported_dtypes() -> frozenset[Any]:
    """The tensor dtypes a trajectory may hold."""
    torch = require_torch()
    names = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
             "float64", "complex64", "complex128")  # fmt: skip
    return frozenset(getattr(torch, n) for n in names)


def _tensor_problem(t: Any) -> str | None:
    """Why a loaded tensor must not be used, or None."""
    torch = require_torch()
    if type(t) is not torch.Tensor:
        return f"is a {type(t).__name__}, not a plain tensor"
    if t.layout != torch.strided:
        return f"has layout {t.layout} (only dense strided tensors)"
    if t.device.type != "cpu":
        return f"is on {t.device} (only CPU tensors)"
    if t.is_quantized or getattr(t, "is_nested", False):
        return "is a quantized or nested tensor"
    if t.dtype not in supported_dtypes():
        return f"has dtype {t.dtype}, which trajectories do not use"
    size, stride = tuple(t.shape), tuple(t.stride())
    if any(d < 0 for d in size) or any(s < 0 for s in stride):
        return "has a negative size or stride"
    if t.numel() == 0:
        return None
    held = t.untyped_storage().nbytes() // t.element_size()
    return view_problem(size, stride, t.storage_offset(), held)


def check_loaded(obj: Any, name: str) -> None:
    """Refuse a loaded trajectory whose contents are unsafe or unusable, naming the field.

    Raises TrajectoryFileError (one line) for non-string keys, nesting deeper than MAX_DEPTH,
    cycles, ints outside int64, values of other types (the rules of rbtool.format.content),
    and any tensor _tensor_problem refuses.
    """
    torch = require_torch()

    def is_tensor(value: Any) -> bool:
        return isinstance(value, torch.Tensor)

    def tensor(where: str, value: Any) -> Any:
        problem = _tensor_problem(value)
        if problem is not None:
            raise TrajectoryFileError(f"{where} {problem}")
        return value

    checked_content(obj, name, is_tensor, tensor)


def _open_regular(path: Path) -> None:
    """Refuse a path that is not a regular file (a FIFO would hang a reader, a device never end)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise TrajectoryFileError(f"{path}: no such file or directory") from None
    except OSError as exc:
        raise TrajectoryFileError(f"{path}: cannot read ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise TrajectoryFileError(f"{path}: not a regular file")


def _check_zip_records(path: Path, data: bytes | None = None, *, mapped: bool = False) -> None:
    """A `.pt` zip's records must be stored uncompressed and fit in the file (no zip bombs),
    and its pickle must hold no BUILD instruction. `data`: the file's bytes, when read already.
    `mapped`: the load will be memory-mapped, so every storage's declared size is checked
    against its record here (a mapped load does not)."""
    import zipfile

    source: Any = path if data is None else io.BytesIO(data)
    size = os.stat(path).st_size if data is None else len(data)
    try:
        with zipfile.ZipFile(source) as archive:
            records = archive.infolist()
            names = [r.filename for r in records]
            if len(set(names)) != len(names):  # which of the two a reader takes is up to the reader
                twice = next(n for n in names if names.count(n) > 1)
                raise TrajectoryFileError(f"{path}: zip record {twice!r:.80} appears twice")
            total = 0
            for record in records:
                if record.compress_type != zipfile.ZIP_STORED or record.compress_size != record.file_size:
                    raise TrajectoryFileError(f"{path}: zip record {record.filename!r:.80} is compressed")
                total += record.file_size
            if total > size:
                raise TrajectoryFileError(f"{path}: zip records claim more bytes than the file holds")
            pickles = [r for r in records if r.filename.endswith("/data.pkl") or r.filename == "data.pkl"]
            try:
                pickled = [archive.read(r) for r in pickles]
            except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
                damage = pt_damage(path, data) or f"not a readable .pt trajectory ({exc})"
                raise TrajectoryFileError(f"{path}: {damage}") from None
    except (zipfile.BadZipFile, OSError, ValueError):
        return  # not a zip (a legacy .pt) or unreadable: torch's loader names the problem
    from rbtool.files.safepickle import refuse_opcodes

    sizes = {r.filename: r.file_size for r in records}
    for record, data_pkl in zip(pickles, pickled, strict=True):
        refuse_opcodes(data_pkl, str(path))  # a BUILD would bypass the size checks
        if not mapped:
            continue
        # torch checks a storage's size against its record only when it reads the record;
        # a memory-mapped load slices the file, so a storage may claim the bytes after it
        prefix = record.filename[: -len("data.pkl")]
        for key, nbytes in _declared_storages(data_pkl):
            held = sizes.get(f"{prefix}data/{key}")
            if held is not None and held != nbytes:
                raise TrajectoryFileError(
                    f"{path}: storage {key!r:.40} declares {nbytes} bytes but its zip record holds {held}"
                )


class _StandIn:
    """What every global of a scanned data.pkl becomes: takes any arguments and items, runs nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _StandIn:
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, item: Any) -> None:
        pass

    def extend(self, items: Any) -> None:
        pass

    def add(self, item: Any) -> None:
        pass


@functools.lru_cache(maxsize=256)
def _stand_in_type(qualified: str) -> type:
    return type(qualified, (_StandIn,), {"qualified": qualified})


class _StorageScan(pickle.Unpickler):
    """Reads a .pt's data.pkl only for its storages' persistent ids; no global is ever resolved."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.pids: list[Any] = []

    def find_class(self, module: str, name: str) -> Any:
        return _stand_in_type(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        self.pids.append(pid)
        return _StandIn()


def _declared_storages(data_pkl: bytes) -> list[tuple[str, int]]:
    """(record key, bytes) of every storage a data.pkl declares: ('storage', type, key, location, numel).

    What the scan cannot read is left to torch's loader, which refuses it with its own words.
    """
    scan = _StorageScan(data_pkl)
    try:
        scan.load()
    except Exception:
        return []
    declared = []
    for pid in scan.pids:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            continue
        kind, key, numel = getattr(pid[1], "qualified", ""), pid[2], pid[4]
        if type(key) not in (str, int, float, bool) or type(numel) is not int:
            continue
        if not kind.startswith("torch."):
            continue
        key = f"{key}"  # torch names the record f"data/{key}" whatever the key's type
        itemsize = _storage_itemsize(kind[len("torch.") :])
        if itemsize is not None:
            declared.append((key, numel * itemsize))
    return declared


@functools.cache
def _storage_itemsize(name: str) -> int | None:
    """Bytes per element of a pickled storage type (legacy names such as FloatStorage), or None."""
    torch = require_torch()
    if name == "UntypedStorage":
        return 1
    try:  # the map torch's weights-only loader uses
        return int(torch._utils._element_size(torch.storage._get_dtype_from_pickle_storage_type(name)))
    except (KeyError, RuntimeError):
        return None


_ZIP_HEAD = b"PK\x03\x04"  # a zip's first local record: what torch.save writes
_ZIP_END = b"PK\x05\x06"  # the end-of-central-directory record, in the last 64 KiB + 22 bytes
_ZIP_END_SPAN = 65536 + 22
_PICKLE_PROTO = 0x80  # torch.save's legacy (non-zip) format starts with a pickle PROTO opcode


def pt_damage(path: Path, data: bytes | None = None) -> str | None:
    """What is wrong with a `.pt` file that torch could not load, in plain words (None: no diagnosis).

    `empty`, `truncated` (a zip cut before its end record or its directory) and `not a zip`
    (neither torch.save's zip nor its legacy pickle) are told apart from the file's first and
    last bytes; torch's own messages for these ("[Errno 22] Invalid argument", "negative seek
    value", "failed finding central directory") say none of it.
    """
    try:
        if data is None:
            with open(path, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                head = handle.read(4)
                handle.seek(max(0, size - _ZIP_END_SPAN))
                tail = handle.read()
        else:
            size, head, tail = len(data), data[:4], data[-_ZIP_END_SPAN:]
    except OSError:
        return None
    if size == 0:
        return "empty (0 bytes); the file was never written or was cut to nothing"
    if head != _ZIP_HEAD:
        if head[:1] == bytes([_PICKLE_PROTO]):
            return None  # a legacy .pt: torch's message stands
        return f"not a zip ({size} bytes starting {head!r}); a .pt trajectory is the zip torch.save writes"
    at = tail.rfind(_ZIP_END)
    if at < 0 or len(tail) - at < 22:
        return f"truncated ({size} bytes): the zip ends before its end record"
    cd_size, cd_offset = struct.unpack_from("<II", tail, at + 12)
    if cd_offset + cd_size > size:
        return f"truncated ({size} bytes): the zip's directory lies past the end of the file"
    return None


def _torch_load(path: Path, source: Any, mmap: bool) -> Any:
    """torch.load with weights_only, its failures as one-line errors naming `path`."""
    import pickle

    torch = require_torch()
    data = source.getvalue() if isinstance(source, io.BytesIO) else None
    try:
        with warnings.catch_warnings():
            # torch warns about odd files (e.g. a plain pickle named .pt) before it refuses them;
            # the error says enough, and a warning would add lines to a one-line error
            warnings.simplefilter("ignore")
            return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "unpickling failed"
        damage = pt_damage(path, data)
        if damage is not None:
            raise TrajectoryFileError(f"{path}: {damage}") from None
        if "Weights only load failed" in str(exc) or "Unsupported global" in str(exc):
            raise UnsafePickleError(
                f"{path}: refused: the file holds objects other than tensors and plain data ({first})"
            ) from None
        raise TrajectoryFileError(f"{path}: not a readable .pt trajectory ({first})") from None
    except FileNotFoundError:
        raise TrajectoryFileError(f"{path}: no such file or directory") from None
    except Exception as exc:  # torch raises RuntimeError, EOFError, ValueError... on bad bytes
        damage = pt_damage(path, data)
        if damage is not None:
            raise TrajectoryFileError(f"{path}: {damage}") from None
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TrajectoryFileError(f"{path}: not a readable .pt trajectory ({message})") from None


_READ_CAP = 0x7FFFF000  # the most one read() returns on Linux


def read_file_bytes(path: Path) -> bytes:
    """A regular file's bytes, read once (a deep check hashes and loads the same bytes): one open,
    one fstat (a FIFO or device refused without blocking), reads until the end."""
    from rbtool.files.ptheader import open_regular

    fd, size = open_regular(path)
    try:
        first = os.read(fd, size + 1)
        if len(first) <= size < _READ_CAP:  # a short read of a regular file is its end
            return first
        parts = [first]
        while block := os.read(fd, 1 << 26):
            parts.append(block)
        return b"".join(parts)
    except OSError as exc:
        raise TrajectoryFileError(f"{path}: cannot read ({exc.strerror})") from None
    finally:
        os.close(fd)


def load_bytes(data: bytes, path: Path, *, suffix: str | None = None) -> dict[str, Any]:
    """A trajectory from bytes already read from `path`, with every check load() makes."""
    suffix = path.suffix if suffix is None else suffix
    require_torch()
    if suffix == ".pt":
        _check_zip_records(path, data)
        obj = _torch_load(path, io.BytesIO(data), mmap=False)
    elif suffix == ".pkl":
        from rbtool.files.safepickle import load_pickle_trajectory

        obj = load_pickle_trajectory(data, name=str(path))
    else:
        raise TrajectoryFileError(f"{path}: not a trajectory file (expected .pt or .pkl)")
    check_loaded(obj, str(path))
    if not isinstance(obj, dict):
        raise TrajectoryFileError(f"{path}: holds a {type(obj).__name__}, expected a trajectory dict")
    return obj


def load_bytes_quick(data: bytes, path: Path) -> dict[str, Any]:
    """load_bytes' trajectory, built from the file's header where rbtool.files.ptheader reads it
    (a small `.pt` file: its checks are load()'s, and no torch.load, a tenth of the cost of a
    tiny file); any other file, or any problem, is load_bytes' to load or name."""
    from rbtool.files.ptheader import SMALL_FILE_BYTES, TensorSpec, map_specs, read_header

    if path.suffix != ".pt" or len(data) > SMALL_FILE_BYTES:
        return load_bytes(data, path)
    try:
        header = read_header(path, data)
    except RbtoolError:  # UnusualLayout too: torch's loader decides, and names the problem
        return load_bytes(data, path)
    torch = require_torch()
    whole = bytearray(data)  # one writable copy the tensors share

    def tensor(spec: TensorSpec) -> Any:
        dtype = getattr(torch, spec.dtype)
        if not spec.nbytes:
            return torch.empty(0, dtype=dtype).as_strided(spec.shape, spec.stride, spec.offset)
        raw = torch.frombuffer(whole, dtype=torch.uint8, count=spec.nbytes, offset=spec.start)
        return raw.view(dtype).as_strided(spec.shape, spec.stride, spec.offset)

    try:
        return map_specs(header, tensor)  # type: ignore[no-any-return]
    except RuntimeError:  # a record torch cannot view as its dtype (say, misaligned)
        return load_bytes(data, path)


def load_pt_template(path: Path, mmap: bool) -> Any:
    """Whatever a `.pt` file holds, loaded with weights_only (no type check on the result).

    With `mmap=True` nothing is read up front, so storage reads the structure and each
    tensor's place in the file from it. Errors name the file (TrajectoryFileError, or
    UnsafePickleError for objects other than tensors and plain data).
    """
    require_torch()
    _open_regular(path)
    _check_zip_records(path, mapped=mmap)
    obj = _torch_load(path, path, mmap=mmap)
    check_loaded(obj, str(path))
    return obj


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
        from rbtool.files.safepickle import load_pickle_trajectory

        require_torch()
        _open_regular(path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise TrajectoryFileError(f"{path}: cannot read ({exc.strerror})") from None
        obj = load_pickle_trajectory(data, name=str(path))
        check_loaded(obj, str(path))
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
