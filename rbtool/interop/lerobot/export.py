"""Export: a checkpoint, buffer directory or rank tree as a LeRobot v3.0 dataset, in one process
or over torchrun ranks (resumable with a journal), published by rename.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import orjson

from rbtool.errors import CheckpointError, OutputExistsError, UsageError
from rbtool.files.dirs import open_view
from rbtool.files.fsutil import fsync_dir, new_staging_dir, refuse_file_parent
from rbtool.interop.lerobot.assembly import Assembly, tree_bytes
from rbtool.interop.lerobot.columns import arrow_type
from rbtool.interop.lerobot.extras import require_arrow, require_av, require_pil
from rbtool.interop.lerobot.features import RB_FEATURES, Registry, hf_feature
from rbtool.interop.lerobot.layout import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_DATA_FILE_SIZE_MB,
    DEFAULT_VIDEO_FILE_SIZE_MB,
    FRAME_FEATURES,
    INFO_FILE,
)
from rbtool.interop.lerobot.parts import PARTS_DIR, Part, RenderPart, part_files, read_ipc, resume_dirs
from rbtool.interop.lerobot.plan import Probe, Write, probe, schema_from
from rbtool.interop.lerobot.render import Render
from rbtool.interop.lerobot.results import ExportResult
from rbtool.passes import ranks
from rbtool.passes.journal import open_journal
from rbtool.progress import Progress


def _check_replaceable(out: Path, overwrite: bool) -> None:
    """Refuse to replace the existing `out` without `overwrite`, and with it anything but an empty
    directory or an earlier dataset."""
    if not overwrite:
        raise OutputExistsError(f"{out}: already exists")
    if not out.is_dir() or not (not any(out.iterdir()) or (out / INFO_FILE).is_file()):
        raise CheckpointError(f"{out}: exists and is not a LeRobot dataset; refusing to replace it")


def _check_dataset_target(out: Path, overwrite: bool) -> None:
    """Refuse, creating nothing, what publishing a dataset at `out` would refuse (a dry run's check)."""
    refuse_file_parent(out)
    if out.exists() or out.is_symlink():
        _check_replaceable(out, overwrite)


def _publish_dataset(staging: Path, out: Path, overwrite: bool) -> None:
    """Rename a finished dataset into place; replace only an empty directory or an earlier dataset."""
    fsync_dir(staging)
    if out.exists() or out.is_symlink():
        try:
            _check_replaceable(out, overwrite)
        except CheckpointError:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        old = out.parent / f".{out.name}.rbtool-old-{uuid.uuid4().hex[:12]}"
        os.rename(out, old)
        os.rename(staging, out)
        fsync_dir(out.parent)
        shutil.rmtree(old, ignore_errors=True)
        return
    os.rename(staging, out)
    fsync_dir(out.parent)


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _recorded_sha256(entry: dict[str, Any]) -> str | None:
    recorded = entry.get("sha256")
    return recorded if isinstance(recorded, str) else None


def export_lerobot(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    fps: int,
    robot_type: str | None = None,
    task: str = "",
    names: dict[str, str] | None = None,
    images: bool = True,
    video: bool = False,
    strict: bool = True,
    data_file_size_mb: float = DEFAULT_DATA_FILE_SIZE_MB,
    video_file_size_mb: float = DEFAULT_VIDEO_FILE_SIZE_MB,
    chunks_size: int = DEFAULT_CHUNK_SIZE,
    overwrite: bool = False,
    progress: Progress | None = None,
    dry_run: bool = False,
    journal: str | os.PathLike[str] | None = None,
) -> ExportResult:
    """Write the checkpoint, buffer directory or rank tree at `source` as a LeRobot v3.0 dataset.

    `names` maps buffer fields (dotted paths such as `curr_obs.states`) to feature names;
    unmapped fields take RLinf's names (`image`, `state`, `actions`, `done`, ...) or their
    dotted path. uint8 `[H, W, C]` fields become PNG image features unless `images` is
    False. With `video`, RGB image fields of even height and width are `video` features
    instead (H.264 mp4 files, lossy); the sidecar keeps their exact rows, so that an import
    of the export is still bit for bit. `progress(1)` is called twice per trajectory
    (planning, then writing). With `dry_run` only the planning pass runs (every trajectory
    read, features, episodes and frames counted), `out` is checked as publishing would check
    it, and nothing is written (no file counts, no bytes).

    Under torchrun (rbtool.passes.ranks) both passes run over the ranks: each rank reads its share's
    structure, every rank decides the same features and episode numbers from the gathered
    results, each rank renders its share's rows into `.OUT.rbtool-resume-staging` beside `out`
    (journaled in `journal`, default `.OUT.rbtool-resume-journal`, removed once published), and
    rank 0 writes the files from them in trajectory order: the bytes one process writes. With
    `journal` in one process the same resumable path runs. A failed run leaves `out` untouched.
    """
    pa = require_arrow()
    if video and not images:
        raise UsageError("video needs images: video features are image fields")
    if images:
        require_pil()
    if video:
        require_av()
    if not video_file_size_mb > 0:
        raise UsageError(f"the video file size limit must be positive, got {video_file_size_mb!r}")
    if isinstance(fps, bool) or not isinstance(fps, int) or fps < 1:
        raise UsageError(f"fps must be a positive integer, got {fps!r}")
    if not data_file_size_mb > 0:
        raise UsageError(f"the data file size limit must be positive, got {data_file_size_mb!r}")
    if chunks_size < 1:
        raise UsageError(f"chunks size must be >= 1, got {chunks_size}")
    for name in (names or {}).values():
        if "/" in name:
            raise UsageError(f"feature name {name!r} contains '/', which LeRobot does not allow")
    out = Path(out)
    view = open_view(source, strict=strict)
    index = view.index
    ids = list(index.id_list)
    registry = Registry(dict(names or {}), images, video)

    # Pass 1: each trajectory's skeleton and episodes (memory-mapped, nothing copied), over
    # the ranks; the features are then decided from them in trajectory order, the same on
    # every rank, which fixes the plan: schemas, episode numbers and frame offsets.
    world = ranks.current()
    if (world.size > 1 or journal is not None) and not dry_run:
        _check_dataset_target(out, overwrite)  # refused before any rank reads, as publishing would
    probes = ranks.ranked_pass(
        probe,
        [Probe(view.file_of(tid), *(int(d) for d in index.entries[tid]["shape"][:2])) for tid in ids],
        jobs=1,
        weights=[_file_size(view.file_of(tid)) for tid in ids],
        progress=progress,
    )
    schemas: list[list[dict[str, Any]]] = []
    schema_ids: dict[bytes, int] = {}
    records: list[dict[str, Any]] = []
    bounds_of: list[list[tuple[int, int]]] = []
    for tid, (entries, values, bounds) in zip(ids, probes, strict=True):
        t, b = (int(d) for d in index.entries[tid]["shape"][:2])
        nodes = schema_from(entries, registry)
        key = orjson.dumps(nodes)
        sid = schema_ids.setdefault(key, len(schemas))
        if sid == len(schemas):
            schemas.append(nodes)
        records.append({"trajectory_id": tid, "T": t, "B": b, "schema": sid, "values": values})
        if dry_run:
            records[-1]["episodes"] = len(bounds)
        bounds_of.append([(int(lo), int(hi)) for lo, hi in bounds])
    unused = sorted(set(registry.names) - registry.used_names)
    if unused:
        raise UsageError(
            f"feature mapping names {', '.join(unused)}, which no trajectory has as a per-frame field"
        )

    columns = list(registry.columns.values())
    features: dict[str, dict[str, Any]] = {name: spec for c in columns for name, spec in c.specs(fps).items()}
    for name, dtype in RB_FEATURES.items():
        features[name] = {"dtype": dtype, "shape": [1], "names": None}
    for name, dtype in FRAME_FEATURES.items():
        features[name] = {"dtype": dtype, "shape": [1], "names": None}
    # Video features live in their mp4 files, not in the Parquet data (as LeRobot writes them).
    in_data = {name: spec for name, spec in features.items() if spec["dtype"] != "video"}
    video_names = [name for name, spec in features.items() if spec["dtype"] == "video"]
    schema = pa.schema(
        [pa.field(name, arrow_type(spec)) for name, spec in in_data.items()],
        metadata={
            "huggingface": orjson.dumps(
                {"info": {"features": {n: hf_feature(s) for n, s in in_data.items()}}}
            )
        },
    )

    result = ExportResult(out=out, source=Path(source), trajectories=len(ids))
    result.columns = {name: f for c in columns for name, f in c.fields().items()}
    result.features = features
    result.episodes = sum(len(bounds) for bounds in bounds_of)
    result.frames = sum(r["T"] * r["B"] for r in records)
    if dry_run:
        _check_dataset_target(out, overwrite)
        return result
    tasks: list[Write] = []
    first_episode = first_frame = 0
    for tid, record, bounds in zip(ids, records, bounds_of, strict=True):
        tasks.append(
            Write(
                tid, view.file_of(tid), record["T"], record["B"], record["schema"], first_episode, first_frame
            )
        )
        first_episode += len(bounds)
        first_frame += record["T"] * record["B"]
    render = Render(schemas, registry.columns, columns, features, list(in_data), schema, fps, task, bounds_of)
    assembly = Assembly(
        out, overwrite, columns, features, video_names, task, fps, robot_type, data_file_size_mb,
        video_file_size_mb, chunks_size, source, index, schemas, records, bounds_of,
    )  # fmt: skip
    if world.size == 1 and journal is None:
        staging = new_staging_dir(out)
        try:
            assembly.open(staging)
            for position, job in enumerate(tasks):
                meta, data_table, blob_table = render(job, position)
                assembly.add(position, job, meta, data_table, blob_table)
                if progress is not None:
                    progress(1)
            assembly.finish(result)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _publish_dataset(staging, out, overwrite)
        return result

    # Over ranks (or resumable): every rank writes the rows of its share of the trajectories
    # into a fixed staging directory beside `out`, journaling each; rank 0 then lays them out
    # in the plan's files in trajectory order (the bytes one process writes) and publishes.
    staging, journal_dir = resume_dirs(out, None if journal is None else Path(journal))
    parts = staging / PARTS_DIR
    identity = {
        "command": "export lerobot",
        "input": str(Path(source).absolute()),
        "out": str(out.absolute()),
        "fps": fps,
        "robot_type": robot_type,
        "task": task,
        "names": sorted((names or {}).items()),
        "images": images,
        "video": video,
        "data_file_size_mb": data_file_size_mb,
        "video_file_size_mb": video_file_size_mb,
        "chunks_size": chunks_size,
    }
    ranks.on_leader(world, lambda: parts.mkdir(parents=True, exist_ok=True))
    resumed = open_journal(journal_dir, identity)
    metas = ranks.ranked_pass(
        RenderPart(render, parts),
        [Part(i, job) for i, job in enumerate(tasks)],
        jobs=1,
        weights=[_file_size(job.path) for job in tasks],
        progress=progress,
        journal=resumed,
        files=lambda part: (part.job.path, *part_files(parts, part.job.tid)),
        hashes=lambda part: (_recorded_sha256(index.entries[part.job.tid]), None, None),
    )
    result.journal = None if resumed is None else resumed.counts()

    def assemble() -> None:
        for stale in staging.iterdir():  # what an interrupted assembly left
            if stale.name != PARTS_DIR:
                shutil.rmtree(stale) if stale.is_dir() and not stale.is_symlink() else stale.unlink()
        assembly.open(staging)
        for position, (job, meta) in enumerate(zip(tasks, metas, strict=True)):
            data_path, blob_path = part_files(parts, job.tid)
            assembly.add(position, job, meta, read_ipc(data_path), read_ipc(blob_path))
        assembly.finish(result)
        shutil.rmtree(parts)
        result.bytes = tree_bytes(staging)  # the rows the ranks wrote are gone
        _publish_dataset(staging, out, overwrite)
        if journal is None:
            shutil.rmtree(journal_dir, ignore_errors=True)

    ranks.on_leader(world, assemble)
    return result
