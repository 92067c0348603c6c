"""Drawing a batch from a checkpoint as a TrajectoryReplayBuffer that loads it draws, and saving it.

`sample_checkpoint` loads the checkpoint into a buffer built with the defaults (a rank tree
reads as the merge of its ranks, with the merged ids; non-strict leaves out missing files
before merging, as load_checkpoint does), seeds its generator, draws one batch and, given
`out`, saves it with torch.save under the writers' rules. Of a remote checkpoint read
through an index mirror, only what the draw reads is fetched.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rbtool.progress import Progress, start_phase

if TYPE_CHECKING:
    from rbtool.buffer.sampling import Draw
    from rbtool.files.dirs import CheckpointView
    from rbtool.files.index import Index
    from rbtool.remote import IndexMirror

# What a draw reports to its progress, in order (a progress with `phase(done, description)`).
PHASES = ("reading the index", "loading the window", "drawing", "saving the batch")


def phase_count(saving: bool) -> int:
    """How many of PHASES a draw goes through: the last only when it saves the batch."""
    return len(PHASES) if saving else len(PHASES) - 1


@dataclass
class Sample:
    """A drawn batch and where it came from."""

    index: Index  # what the buffer loaded
    missing_ids: list[int]  # left out for missing files (non-strict)
    seed: int | None  # the generator's seed
    window_ids: list[int]
    draw: Draw  # which trajectory and row each batch row came from
    batch: dict[str, Any]
    out_bytes: int | None  # the saved batch's size (what it would be, in a dry run); None unsaved


def _phase(progress: Progress | None, done: int, description: str) -> None:
    phase = getattr(progress, "phase", None)
    if phase is not None:
        phase(done, description)


def sample_checkpoint(
    path: Path,
    num_chunks: int,
    *,
    window: int,
    strategy: str = "uniform",
    k: int | None = None,
    temperature: float = 1.0,
    seed: int | None = None,
    strict: bool = True,
    extra_fields: bool = False,
    out: Path | None = None,
    overwrite: bool = False,
    dry_run: bool = False,
    mirror: IndexMirror | None = None,
    progress: Progress | None = None,
) -> Sample:
    """Draw `num_chunks` rows from the last `window` trajectories of the checkpoint at `path`.

    `seed` reseeds the generator (default: the checkpoint's seed, else the buffer's). With
    `out` the batch is saved there (`save_batch`); `mirror` is the index mirror `path` is, for
    a remote checkpoint. `progress` is told of each phase (PHASES) and of the files the draw
    reads.
    """
    from rbtool.buffer.replay import TrajectoryReplayBuffer
    from rbtool.files.dirs import open_view

    view = open_view(path, strict=strict)
    before_gather = _remote_reads(mirror, view, strategy, extra_fields)
    missing = view.dropped_ids()
    _phase(progress, 1, PHASES[1])
    # one batch: only its drawn rows are read, not the window's
    buffer = TrajectoryReplayBuffer(sample_window_size=window, extra_fields=extra_fields, hold_rows_budget=0)
    buffer.load_checkpoint(view, strict=strict)  # the index just read; reseeds when it has a seed
    if seed is not None:
        buffer.seed = seed
        buffer.random_generator.manual_seed(seed)
    window_ids = buffer.window_ids()
    _phase(progress, 2, PHASES[2])
    draw, batch = buffer.sample_with_draw(
        num_chunks, strategy, k, temperature, progress=progress, before_gather=before_gather
    )
    written = None
    if out is not None:
        total = phase_count(saving=True)
        start_phase(progress, total, PHASES[3])
        _phase(progress, total - 1, PHASES[3])
        written = save_batch(batch, out, overwrite=overwrite, dry_run=dry_run)
    return Sample(view.index, missing, buffer.seed, window_ids, draw, batch, written)


def _remote_reads(mirror: IndexMirror | None, view: CheckpointView, strategy: str, extra_fields: bool) -> Any:
    """For a URL: what to fetch, and when. Uniform draws from a checkpoint whose index records
    every trajectory's schema read only the drawn rows, so only the byte ranges those reads
    need (zip directory, data.pkl, the drawn rows) are fetched, once drawn; top-k reads the
    window's rewards, and unrecorded schemas the window's headers, so then every object is
    fetched first."""
    if mirror is None:
        return None
    index = view.index
    if strategy == "uniform" and all(e.get("schema") in index.schemas for e in index.entries.values()):
        from rbtool.remote.ranges import drawn_rows

        return drawn_rows(mirror, view, extra_fields=extra_fields)
    mirror.fetch()
    return None


def save_batch(batch: dict[str, Any], path: Path, *, overwrite: bool, dry_run: bool) -> int:
    """torch.save the batch to `path` atomically (temporary file, then rename); returns its size.

    The writers' rules: missing parents are created, an existing file is replaced only with
    `overwrite`; with `dry_run` the batch is serialised to count its bytes and nothing is written.
    """
    import torch

    from rbtool.errors import RbtoolError
    from rbtool.files.fsutil import check_file_target, make_parents, write_bytes_atomic

    check_file_target(path, overwrite=overwrite)  # checked again: the draw may have taken a while
    buffer = io.BytesIO()
    torch.save(batch, buffer)
    data = buffer.getvalue()
    if dry_run:
        return len(data)
    make_parents(path)
    try:
        write_bytes_atomic(path, data)
    except OSError as exc:
        raise RbtoolError(f"{path}: cannot write ({exc.strerror})") from None
    return len(data)
