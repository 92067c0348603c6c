"""An export over ranks (or resumable): each trajectory's rows as Arrow IPC part files in a
fixed staging directory beside the output, written by the rank that rendered them and read
back by rank 0 to lay out the dataset.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rbtool.errors import CheckpointError
from rbtool.interop.lerobot.extras import require_arrow
from rbtool.interop.lerobot.plan import Write
from rbtool.interop.lerobot.render import Render

PARTS_DIR = ".rbtool-parts"  # in the staging directory of an export over ranks: each trajectory's rows


def resume_dirs(out: Path, journal: Path | None) -> tuple[Path, Path]:
    """Where an export over ranks builds `out` (a fixed hidden directory beside it) and journals."""
    staging = out.parent / f".{out.name}.rbtool-resume-staging"
    return staging, journal if journal is not None else out.parent / f".{out.name}.rbtool-resume-journal"


def part_files(parts: Path, tid: int) -> tuple[Path, Path]:
    return parts / f"{tid}.data.arrow", parts / f"{tid}.blobs.arrow"


def read_ipc(path: Path) -> Any:
    pa = require_arrow()
    try:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_file(source).read_all()
    except (OSError, pa.ArrowInvalid) as exc:
        raise CheckpointError(f"{path}: cannot read the rows a rank wrote: {exc}") from None


def _write_ipc(path: Path, table: Any) -> None:
    """`table` as one Arrow IPC batch at `path`, whole or not at all."""
    pa = require_arrow()
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table.combine_chunks())
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class Part:
    """A trajectory's rows as a rank writes them (pass 2 over ranks): its position and task."""

    position: int
    job: Write

    def __str__(self) -> str:
        return str(self.job.path)


class RenderPart:
    """`Render` on a rank: the tables go to the part files, the rest back to every rank."""

    def __init__(self, render: Render, parts: Path) -> None:
        self.render, self.parts = render, parts

    def __call__(self, part: Part) -> dict[str, Any]:
        meta, data_table, blob_table = self.render(part.job, part.position)
        data_path, blob_path = part_files(self.parts, part.job.tid)
        _write_ipc(data_path, data_table)
        _write_ipc(blob_path, blob_table)
        return meta
