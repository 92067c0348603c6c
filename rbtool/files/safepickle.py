"""Restricted reading and plain writing of RLinf trajectory `.pkl` files.

RLinf writes each trajectory with a plain ``pickle.dump(dict)``; unpickling such a
file with ``pickle.load`` can run arbitrary code, so this module reads it with an
unpickler that admits only the few globals a dict of CPU tensors needs.
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
from collections import OrderedDict
from typing import Any

from rbtool.errors import RbtoolError, TrajectoryFileError, UnsafePickleError
from rbtool.format.content import view_elements

__all__ = ["dump_pickle_trajectory", "load_pickle_trajectory", "refuse_opcodes"]

_ALLOWED = "only tensors, dicts, lists, numbers and strings are allowed"

# `torch.load` would treat a storage blob starting with this as a zip archive.
_ZIP_MAGIC = b"PK\x03\x04"

# Globals a pickled dict of plain CPU tensors refers to (torch 2.x). torch also emits
# `_rebuild_tensor_v3` (plus a `torch.<dtype>` global) for uint16/32/64 and float8
# tensors, but plain pickle.load cannot read those back either, so they are refused.
_REBUILD_TENSOR = ("torch._utils", "_rebuild_tensor_v2")
_ORDERED_DICT = ("collections", "OrderedDict")
_LOAD_FROM_BYTES = ("torch.storage", "_load_from_bytes")

# Weights-only loader complaints that mean damaged bytes rather than a refusal.
_CORRUPT_MARKERS = ("Unsupported operand", "String is too long")

_MAX_DIMS = 64
_MAX_SHOWN = 120


def _shown(text: str) -> str:
    """Render untrusted text on one short, printable line."""
    if not text.isprintable():
        text = text.encode("unicode_escape").decode("ascii")
    return text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN] + "..."


def _refused(name: str, what: str) -> UnsafePickleError:
    """Build the error for a refused global or construct."""
    return UnsafePickleError(f"{name}: refused to unpickle {what} ({_ALLOWED})")


def _corrupt(name: str, detail: str) -> TrajectoryFileError:
    """Build the error for data that is not a readable trajectory pickle."""
    return TrajectoryFileError(f"{name}: not a valid trajectory pickle ({_shown(detail)})")


def _first_line(exc: BaseException) -> str:
    """Return the exception type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _weights_only_error(name: str, exc: pickle.UnpicklingError) -> TrajectoryFileError:
    """Turn torch's weights-only refusal into our error, naming the global if any."""
    message = str(exc)
    match = re.search(r"GLOBAL\s+(\S+)", message)
    if match:
        return _refused(name, f"global '{_shown(match.group(1).rstrip('.,;:'))}'")
    tail = message.rsplit("WeightsUnpickler error:", 1)[-1].split("\n\n", 1)[-1]
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    reason = lines[0] if lines else "rejected by torch's weights-only loader"
    if "Weights only load failed" not in message or any(marker in reason for marker in _CORRUPT_MARKERS):
        return _corrupt(name, f"tensor storage: {reason}")
    return _refused(name, f"a tensor storage ({_shown(reason)})")


class _TrajectoryUnpickler(pickle.Unpickler):
    """Unpickler that admits only tensors, OrderedDict and the builtin containers."""

    def __init__(self, data: bytes, name: str) -> None:
        super().__init__(io.BytesIO(data))
        self._name = name

    def find_class(self, module: str, name: str) -> Any:
        """Map the three admitted globals to our checked versions; refuse anything else."""
        if (module, name) == _REBUILD_TENSOR:
            return self._rebuild_tensor
        if (module, name) == _LOAD_FROM_BYTES:
            return self._load_storage
        if (module, name) == _ORDERED_DICT:
            return OrderedDict
        raise _refused(self._name, f"global '{_shown(f'{module}.{name}')}'")

    def persistent_load(self, pid: Any) -> Any:
        """Refuse persistent ids: a trajectory pickle never contains one."""
        raise _refused(self._name, f"persistent id {_shown(repr(pid))}")

    def _load_storage(self, blob: Any) -> Any:
        """Load one tensor storage blob (torch's legacy format) with weights_only=True."""
        import torch

        if not isinstance(blob, bytes):
            raise _corrupt(self._name, "tensor storage is not a bytes blob")
        if blob.startswith(_ZIP_MAGIC):
            # torch emits only the legacy format here; keep its zip reader out of reach
            raise _corrupt(self._name, "tensor storage is a zip archive, not legacy")
        try:
            with warnings.catch_warnings():
                # damaged blobs make torch warn before it fails; the error says enough
                warnings.simplefilter("ignore")
                storage = torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu", mmap=False)
        except pickle.UnpicklingError as exc:
            raise _weights_only_error(self._name, exc) from None
        if type(storage) is not torch.storage.TypedStorage:
            raise _corrupt(self._name, f"tensor storage blob holds a {type(storage).__name__}")
        return storage

    def _rebuild_tensor(self, *args: Any) -> Any:
        """Check the arguments of `_rebuild_tensor_v2`, then let torch build the tensor."""
        import torch

        problem = _check_rebuild_args(args)
        if problem:
            raise _corrupt(self._name, f"bad tensor: {problem}")
        storage, offset, size, stride, requires_grad = args[:5]
        return torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, OrderedDict())


def _is_int(value: Any) -> bool:
    """True for a non-negative int that is not a bool."""
    return type(value) is int and value >= 0


def _check_rebuild_args(args: tuple[Any, ...]) -> str:
    """Return what is wrong with `_rebuild_tensor_v2` arguments, or "" if they are fine."""
    import torch

    if len(args) not in (6, 7):
        return f"expected 6 or 7 arguments, got {len(args)}"
    storage, offset, size, stride, requires_grad, hooks = args[:6]
    if type(storage) is not torch.storage.TypedStorage:
        return f"storage is a {type(storage).__name__}"
    if not _is_int(offset):
        return "storage offset is not a non-negative int"
    if not isinstance(size, tuple) or not isinstance(stride, tuple):
        return "size and stride must be tuples"
    if len(size) != len(stride) or len(size) > _MAX_DIMS:
        return "size and stride disagree in length"
    if not all(_is_int(v) for v in size + stride):
        return "size and stride must be non-negative ints"
    if type(requires_grad) is not bool:
        return "requires_grad is not a bool"
    if not isinstance(hooks, dict) or hooks:
        return "backward hooks are not an empty dict"
    if len(args) == 7 and args[6]:
        return "tensor metadata is not supported"
    if all(size):
        itemsize = torch._utils._element_size(storage.dtype)
        available = storage._untyped_storage.nbytes() // itemsize
        needed = view_elements(offset, size, stride)
        if needed > available:
            return f"view needs {needed} elements but its storage holds {available}"
    return ""


def _check_contents(obj: Any, name: str) -> None:
    """Refuse anything in the result that is not a container, scalar, string or tensor."""
    import torch

    leaves = (str, bytes, bytearray, int, float, type(None))
    containers = (dict, list, tuple, set, frozenset)
    seen: set[int] = set()
    stack = [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, leaves):
            continue
        if type(item) is torch.Tensor:
            if item._backward_hooks:
                raise _corrupt(name, "a tensor carries backward hooks")
            continue
        if type(item) in containers or isinstance(item, dict):
            if isinstance(item, dict):
                stack.extend(item.keys())
                stack.extend(item.values())
            else:
                stack.extend(item)
            continue
        raise _corrupt(name, f"unexpected {type(item).__name__} in trajectory")


# Opcodes a pickled dict of tensors never holds. BUILD would call a tensor's __setstate__,
# whose `set_` re-points it at any storage with any size, skipping _rebuild_tensor's checks.
# (INST and OBJ name their class through find_class, which refuses it by name.)
_REFUSED_OPCODES = {"BUILD": "a BUILD (setstate) instruction"}


def refuse_opcodes(data: bytes, name: str) -> None:
    """Scan the pickle's instructions (none runs) and refuse the ones a trajectory never needs."""
    import pickletools

    try:
        for opcode, _, _ in pickletools.genops(data):
            what = _REFUSED_OPCODES.get(opcode.name)
            if what is not None:
                raise _refused(name, what)
            if opcode.name == "STOP":
                return
    except ValueError as exc:  # what the scan cannot read is not run either
        raise _corrupt(name, f"unreadable pickle instructions: {exc}") from None


def load_pickle_trajectory(data: bytes, *, name: str) -> dict:
    """Unpickle a trajectory dict without running code; `name` labels error messages.

    Raises UnsafePickleError for any global beyond tensors, TrajectoryFileError for bad data.
    """
    try:
        refuse_opcodes(data, name)
        result = _TrajectoryUnpickler(data, name).load()
        if not isinstance(result, dict):
            raise _corrupt(name, f"top level is a {type(result).__name__}, not a dict")
        _check_contents(result, name)
    except RbtoolError:
        raise
    except Exception as exc:  # every failure on bad bytes becomes one clean error
        raise _corrupt(name, _first_line(exc)) from None
    return result


def dump_pickle_trajectory(obj: dict) -> bytes:
    """Pickle a trajectory dict exactly as RLinf does (plain pickle, protocol 4)."""
    return pickle.dumps(obj, protocol=4)
