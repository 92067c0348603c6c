"""Uniform window sampler: draw global sample ids and map them to (trajectory, row).

The draw follows the reference implementation step by step (randint, bucketize with
right=True) so that a seed, a window and a checkpoint give the same batch bit for bit.
A sampler only computes draws; reading the drawn rows is the storage's job
(rbtool.storage.gather).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rbtool.errors import EmptyBufferError, UsageError

if TYPE_CHECKING:
    import torch


@dataclass
class Draw:
    """The result of drawing sample positions in a window."""

    window_ids: list[int]
    global_indices: torch.Tensor
    positions: torch.Tensor  # index into window_ids, per draw
    local_indices: torch.Tensor

    @property
    def trajectory_ids(self) -> list[int]:
        return [self.window_ids[int(k)] for k in self.positions]


def check_draw(num_samples: Sequence[int], num_chunks: int) -> int:
    """Validate a request before anything is drawn; returns the window's total samples."""
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise UsageError(f"num_chunks must be an integer >= 1, got {num_chunks!r}")
    total = int(sum(num_samples))
    if total == 0:
        raise EmptyBufferError("cannot sample from an empty buffer (the window holds no samples)")
    return total


def draw_uniform(
    window_ids: Sequence[int],
    num_samples: Sequence[int],
    num_chunks: int,
    generator: torch.Generator,
    *,
    clamp: bool = True,
) -> Draw:
    """SPEC §3 steps 2-4: clamp, randint over the window's total, bucketize to (trajectory, row).

    With `clamp=False` exactly `num_chunks` ids are drawn even when the window holds fewer
    samples (for studying how draws spread; the buffer always clamps).
    """
    import numpy as np
    import torch

    total = check_draw(num_samples, num_chunks)
    if clamp:
        num_chunks = min(num_chunks, total)
    ids = torch.randint(0, total, (num_chunks,), generator=generator)
    # searchsorted(side="right") is bucketize(right=True); numpy avoids torch's thread pool here.
    sizes = np.asarray(num_samples, dtype=np.int64)
    cum = np.cumsum(sizes)
    positions = np.searchsorted(cum, ids.numpy(), side="right")
    local = ids.numpy() - (cum - sizes)[positions]
    return Draw(list(window_ids), ids, torch.from_numpy(positions), torch.from_numpy(local))
