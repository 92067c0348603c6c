"""What an export wrote and what an import added."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rbtool.files.index import Index
from rbtool.files.writer import WriteReport


@dataclass
class ExportResult:
    """What an export wrote."""

    out: Path
    source: Path
    trajectories: int = 0
    episodes: int = 0
    frames: int = 0
    features: dict[str, dict[str, Any]] = field(default_factory=dict)
    columns: dict[str, str] = field(default_factory=dict)  # feature -> buffer field
    sidecar_fields: list[str] = field(default_factory=list)  # fields kept whole in the sidecar
    data_files: int = 0
    video_files: int = 0
    episode_files: int = 0
    bytes: int = 0
    journal: dict[str, int] | None = None  # a resumable export: trajectories, and those from the journal


@dataclass
class ImportResult:
    """What an import added."""

    buffer: Path
    dataset: Path
    codebase_version: str
    mode: str  # "rbtool" (rebuilt from the sidecar) or "episodes" (one trajectory per episode)
    added_ids: list[int] = field(default_factory=list)
    index: Index = field(default_factory=Index)
    report: WriteReport = field(default_factory=WriteReport)
    episodes: int = 0
    frames: int = 0
    fields: dict[str, str] = field(default_factory=dict)  # feature -> buffer field
    dropped: list[str] = field(default_factory=list)
    kept_ids: bool = False
    skipped: int = 0  # trajectories an interrupted import of the same export had already added
