"""Memory for sampled batches, recycled from earlier batches once nothing refers to it.

A batch of 256 rows of two 12 KiB image fields is 6 MiB of new memory per sample(). glibc's
malloc serves blocks that large from fresh mappings, or from the top of the heap, which it
gives back to the system when it is freed; either way the batch's first write to each page
faults (about 670 faults, 1-2 ms, per 6 MiB batch on a 2-core VM), in some processes and not
in others, depending on what the process allocated before. So a large field's memory is
taken from a few arrays of earlier batches that no tensor refers to any more: a tensor made
by `torch.from_numpy` keeps its array alive, and so does every view of it, `.numpy()` of it
and a storage moved to shared memory until it moves. In steady state a batch is written into
pages already faulted in.

Each field path keeps its last KEEP arrays (a training loop holds the previous batch while
it samples the next); fields of MIN_BYTES or less, and of more than MAX_BYTES, are plain
allocations, and the arrays kept total at most KEEP_BYTES (free ones of other fields are let go
to make room). Such a tensor's storage is not
resizable (`resize_` raises), like any tensor made from a numpy array.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MIN_BYTES = 64 << 10
MAX_BYTES = 64 << 20
KEEP = 3
KEEP_BYTES = 256 << 20
ALIGN = 64


def _refs(ring: deque[Any], i: int) -> int:
    """References to the array `ring[i]`, counted the same way wherever it is asked."""
    return sys.getrefcount(ring[i])


def _only_the_ring() -> int:
    """What _refs gives for an array that only its ring refers to (the ring's reference and
    the call's own; measured, not assumed, as interpreters count borrowed references apart)."""
    import numpy as np

    return _refs(deque([np.empty(1, dtype=np.uint8)]), 0)


@functools.lru_cache(maxsize=64)
def numpy_dtype(dtype: torch.dtype) -> Any:
    """The numpy dtype of a torch dtype, or None when numpy has none (bfloat16, float8...).
    A tensor made by viewing a numpy array costs one torch call where torch's own
    view and reshape cost two more (each several microseconds when the caches are cold)."""
    import torch

    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        return None


class BatchMemory:
    """Tensors for batch fields, each field's memory reused once no tensor refers to it."""

    def __init__(self) -> None:
        self._rings: dict[Any, deque[Any]] = {}
        self._kept = 0  # bytes of the arrays in the rings
        self._lock = threading.Lock()
        self._free_refs = _only_the_ring()

    def empty(self, key: Any, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor for the field `key` of a batch."""
        import math

        import torch

        nbytes = math.prod(shape) * dtype.itemsize
        if not MIN_BYTES < nbytes <= MAX_BYTES:
            return torch.empty(shape, dtype=dtype)
        kind = numpy_dtype(dtype)
        shape = tuple(shape)
        with self._lock:
            array = self._take(key, nbytes, shape, kind)
        if kind is None:  # a dtype numpy lacks: the ring holds bytes, viewed by torch
            return torch.from_numpy(array).view(dtype).reshape(shape)
        return torch.from_numpy(array)

    def _take(self, key: Any, nbytes: int, shape: tuple[int, ...], kind: Any) -> Any:
        """A free array of the ring of `key` shaped `shape` of numpy dtype `kind` (bytes when
        None), or a new one. The ring holds the very array the tensor is made from: a numpy
        view of it would refer to the array it was cut from, not to it, and its reference
        count would not tell a batch still held."""
        import numpy as np

        want = ((nbytes,), np.dtype(np.uint8)) if kind is None else (shape, kind)
        ring = self._rings.setdefault(key, deque())
        for i in range(len(ring)):
            if (ring[i].shape, ring[i].dtype) == want and _refs(ring, i) == self._free_refs:
                return ring[i]
        whole = np.empty(nbytes + ALIGN - 1, dtype=np.uint8)
        skip = -whole.ctypes.data % ALIGN
        array = whole[skip : skip + nbytes]
        if kind is not None:
            array = array.view(kind).reshape(shape)
        if len(ring) == KEEP:
            self._kept -= ring.popleft().nbytes  # the oldest: its batch is someone's to keep
        if self._kept + nbytes > KEEP_BYTES:
            self._make_room(nbytes)
        if self._kept + nbytes <= KEEP_BYTES:
            ring.append(array)
            self._kept += nbytes
        return array

    def _make_room(self, nbytes: int) -> None:
        """Forget free arrays of any field (one no longer sampled, say) until `nbytes` more fit."""
        for ring in self._rings.values():
            i = 0
            while i < len(ring) and self._kept + nbytes > KEEP_BYTES:
                if _refs(ring, i) == self._free_refs:
                    self._kept -= ring[i].nbytes
                    del ring[i]
                else:
                    i += 1

    @property
    def kept_bytes(self) -> int:
        """Bytes of the arrays kept for reuse (held by batches or free)."""
        return self._kept

    def clear(self) -> None:
        """Forget every kept array (batches that hold one keep it)."""
        with self._lock:
            self._rings.clear()
            self._kept = 0
