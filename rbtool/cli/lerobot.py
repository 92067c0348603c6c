"""`rbtool export --to lerobot` and `rbtool import lerobot`: LeRobot datasets in and out."""

from __future__ import annotations

import enum
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text

from rbtool.cli._app import Command, sub_app
from rbtool.cli._consoles import out
from rbtool.cli._json import print_json
from rbtool.cli._options import (
    DryRunOpt,
    ForceOpt,
    FormatOpt,
    JournalOpt,
    Json,
    StorageOpt,
    StrictOpt,
)
from rbtool.cli._output import Column, Fitted, files_line, format_ids, key_values, size
from rbtool.cli._places import local_path_arg, reading, refuse_overlap
from rbtool.cli._progress import progress_bar, show_progress
from rbtool.cli._writing import added_line, dry_run_note, trajectories, waiting_note

import_app = sub_app("import", "Add the episodes of a dataset in another format to a buffer directory.")


class ExportFormat(str, enum.Enum):
    """Formats a checkpoint can be exported to."""

    lerobot = "lerobot"


def _unmappable(exc: Exception) -> Exception:
    """A feature the defaults cannot map, with the options that answer it."""
    from rbtool.errors import UsageError
    from rbtool.interop.lerobot import LeRobotFeatureError

    if isinstance(exc, LeRobotFeatureError):
        if exc.mappable:
            return UsageError(
                f"{exc}; pass --map {exc.feature}=FIELD to place it elsewhere or --drop {exc.feature}"
            )
        return UsageError(f"{exc}; pass --drop {exc.feature} to leave it out")
    return exc


def _removed_again(exc: Exception, ids: list[int]) -> Exception:
    """A failure after some batches were published: the import put the buffer back."""
    from rbtool.errors import CheckpointError, UsageError

    kind = UsageError if isinstance(exc, UsageError) else CheckpointError
    return kind(
        f"{exc}; the trajectories added before ({format_ids(ids)}) were removed, the buffer is as it was"
    )


def parse_episodes(text: str | None) -> list[int] | None:
    """`0,3,5-9` as [0, 3, 5, 6, 7, 8, 9] (in the order given)."""
    if text is None:
        return None
    episodes: list[int] = []
    for part in text.split(","):
        part = part.strip()
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise typer.BadParameter(f"{part!r} is not N or N-M", param_hint="--episodes")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise typer.BadParameter(f"{part!r}: the range is empty", param_hint="--episodes")
        episodes.extend(range(lo, hi + 1))
    if len(set(episodes)) != len(episodes):
        raise typer.BadParameter("names an episode twice", param_hint="--episodes")
    return episodes


# ------------------------------------------------------------------------ export
def export(
    source_arg: Annotated[
        str,
        typer.Argument(
            metavar="IN", help="A checkpoint, buffer directory or folder of rank_* checkpoints (or a URL)."
        ),
    ],
    target: Annotated[
        Path, typer.Argument(metavar="OUT", help="Dataset directory to write.", parser=local_path_arg)
    ],
    to: Annotated[ExportFormat, typer.Option("--to", help="Format to write.", show_default=False)],
    fps: Annotated[
        int, typer.Option("--fps", min=1, help="Frames per second of the data.", show_default=False)
    ],
    robot_type: Annotated[
        str | None, typer.Option("--robot-type", help="Robot type recorded in meta/info.json.")
    ] = None,
    task: Annotated[str, typer.Option("--task", help="Task text of every episode.")] = "",
    names: Annotated[
        list[str] | None,
        typer.Option(
            "--map",
            metavar="FIELD=FEATURE",
            help="Name the feature of a buffer field (dotted path, e.g. curr_obs.states=observation.state).",
            show_default=False,
        ),
    ] = None,
    images: Annotated[
        bool,
        typer.Option("--images/--no-images", help="uint8 [H, W, C] fields as PNG image features (lossless)."),
    ] = True,
    video: Annotated[
        bool,
        typer.Option(
            "--video",
            help="RGB image fields (even height and width) as H.264 video features (lossy; needs PyAV).",
        ),
    ] = False,
    data_file_size_mb: Annotated[
        float, typer.Option("--data-file-size-mb", min=0.001, help="Start a new data file beyond this size.")
    ] = 100.0,
    chunks_size: Annotated[
        int, typer.Option("--chunks-size", min=1, help="Files per chunk directory.")
    ] = 1000,
    strict: StrictOpt = True,
    force: ForceOpt = False,
    dry_run: DryRunOpt = False,
    output: Json = Json(),
    storage_option: StorageOpt = None,
    journal: JournalOpt = None,
) -> None:
    """Write a checkpoint as a LeRobot v3.0 dataset that `rbtool import lerobot` turns back into it.

    One episode per (trajectory, env column) segment, split where the done flags end an episode.
    Under torchrun every rank reads and encodes its share of the trajectories and rank 0 writes
    the dataset one process would write (byte for byte); with --journal a rerun resumes.
    """
    with reading(source_arg, storage_option, data=True, enabled=show_progress(output.json)) as src:
        source = src.local
        from rbtool.errors import RbtoolError, UsageError
        from rbtool.files.dirs import open_view
        from rbtool.interop.lerobot import CODEBASE_VERSION, export_lerobot, parse_field_map

        refuse_overlap(target, [source], "OUT")
        if video and not images:
            raise UsageError("--video needs --images: video features are image fields")
        mapping = parse_field_map(names or [], "--map")
        enabled = show_progress(output.json)
        total = None
        if enabled:
            try:
                total = 2 * open_view(source, strict=strict).index.size
            except RbtoolError:
                total = None  # the export itself reports the problem
        with progress_bar("exporting trajectories", total, enabled) as advance:
            result = export_lerobot(
                source,
                target,
                fps=fps,
                robot_type=robot_type,
                task=task,
                names=mapping,
                images=images,
                video=video,
                strict=strict,
                data_file_size_mb=data_file_size_mb,
                chunks_size=chunks_size,
                overwrite=force,
                progress=advance,
                dry_run=dry_run,
                journal=journal,
            )
        fields = {feature: field for feature, field in result.columns.items()}
        doc: dict[str, Any] = {
            "out": str(result.out),
            "source": src.show(result.source),
            "format": to.value,
            "codebase_version": CODEBASE_VERSION,
            "fps": fps,
            "trajectories": result.trajectories,
            "episodes": result.episodes,
            "frames": result.frames,
            "features": [
                {"name": name, "dtype": spec["dtype"], "shape": spec["shape"], "field": fields.get(name)}
                for name, spec in result.features.items()
            ],
            "sidecar_fields": result.sidecar_fields,
            "data_files": result.data_files,
            "video_files": result.video_files,
            "episode_files": result.episode_files,
            "bytes": result.bytes,
            "journal": result.journal,
            "dry_run": dry_run,
        }
        if dry_run:  # files are only known once written
            for key in ("data_files", "video_files", "episode_files", "bytes"):
                doc[key] = None
        if output.json:
            print_json(doc, output.pretty)
            return
        rows = [
            ("trajectories", f"{result.trajectories}"),
            ("episodes", f"{result.episodes}"),
            ("frames", f"{result.frames}"),
        ]
        if not dry_run:
            rows.append(
                (
                    "files",
                    f"{result.data_files} data, {result.video_files} video, "
                    f"{result.episode_files} episode metadata, {size(result.bytes)}",
                )
            )
        if result.journal is not None:
            from rbtool.passes.journal import journal_note

            rows.append(("journal", journal_note(result.journal, "trajectories")))
        verb = "would export" if dry_run else "export"
        out.print(
            key_values(f"{verb} {src.show(result.source)} to LeRobot {CODEBASE_VERSION} {result.out}", rows)
        )
        # names are never broken across lines: at a narrow terminal shape, then dtype, are left out
        columns = [
            Column("feature"),
            Column("dtype", drop=1),
            Column("shape", drop=2),
            Column("buffer field", wrap=True),
        ]
        features = [
            [Text(item["name"]), item["dtype"], str(item["shape"]), Text(item["field"] or "")]
            for item in doc["features"]
        ]
        out.print(Fitted(columns, features, title="features", hint="piped output and --json keep them"))
        if result.sidecar_fields:
            out.print(f"kept whole in the sidecar: {', '.join(result.sidecar_fields)}", markup=False)
        if dry_run:
            dry_run_note(result.out, f"{result.episodes} episodes, {result.frames} frames")


# ------------------------------------------------------------------------ import
@import_app.command("lerobot", cls=Command)
def import_lerobot(
    source: Annotated[
        Path,
        typer.Argument(
            metavar="IN", help="A LeRobot dataset directory (v3.0 or v2.x).", parser=local_path_arg
        ),
    ],
    buffer: Annotated[
        Path,
        typer.Option(
            "--buffer",
            "-b",
            help="Buffer directory (auto_save on) to add to; created if needed.",
            parser=local_path_arg,
        ),
    ],
    episodes: Annotated[
        str | None,
        typer.Option("--episodes", metavar="LIST", help="Episodes to import, e.g. 0,3,5-9 (default: all)."),
    ] = None,
    field_map: Annotated[
        list[str] | None,
        typer.Option(
            "--map",
            metavar="FEATURE=FIELD",
            help="Buffer field of a feature (dotted path, e.g. observation.images.top=curr_obs.main_images).",
            show_default=False,
        ),
    ] = None,
    drop: Annotated[
        list[str] | None,
        typer.Option("--drop", metavar="FEATURE", help="Leave a feature out.", show_default=False),
    ] = None,
    sidecar: Annotated[
        bool,
        typer.Option(
            "--sidecar/--no-sidecar",
            help="Rebuild what rbtool exported from its sidecar (--no-sidecar: one trajectory per episode).",
        ),
    ] = True,
    model_weights_id: Annotated[
        str | None,
        typer.Option(
            "--model-weights-id", help="model_weights_id of the trajectories (default: lerobot-<name>)."
        ),
    ] = None,
    trajectory_format: FormatOpt = None,
    dry_run: DryRunOpt = False,
    output: Json = Json(),
) -> None:
    """Add a LeRobot dataset's episodes to a buffer directory; ids continue from its trajectory_counter.

    A dataset rbtool exported comes back as the checkpoint it was (into a new buffer directory,
    with its own ids). After each published batch a line `added trajectory ids FIRST-LAST` goes
    to stderr (not beside a progress bar; none with -q or --no-progress).
    """
    from rbtool.errors import RbtoolError
    from rbtool.interop.lerobot import count_units, parse_field_map
    from rbtool.interop.lerobot import import_lerobot as run_import

    refuse_overlap(buffer, [source], "--buffer")
    selected = parse_episodes(episodes)
    mapping = parse_field_map(field_map or [], "--map")

    published: list[int] = []

    def on_published(ids: list[int]) -> None:
        published.extend(ids)
        added_line(ids, enabled)

    enabled = show_progress(output.json)
    total = None
    if enabled:
        try:
            total = count_units(source, episodes=selected, use_sidecar=sidecar and not mapping and not drop)
        except RbtoolError:
            total = None
    try:
        with progress_bar("importing episodes", total, enabled) as advance:
            result = run_import(
                source,
                buffer,
                episodes=selected,
                field_map=mapping,
                drop=drop or [],
                use_sidecar=sidecar,
                model_weights_id=model_weights_id,
                trajectory_format=None if trajectory_format is None else trajectory_format.value,
                on_wait=partial(waiting_note, buffer),
                progress=advance,
                on_published=on_published,
                dry_run=dry_run,
            )
    except RbtoolError as exc:
        if published and not dry_run:  # the lines said they were added: say they are gone again
            raise _removed_again(exc, published) from None
        raise _unmappable(exc) from None
    index = result.index
    doc: dict[str, Any] = {
        "buffer": str(result.buffer),
        "dataset": str(result.dataset),
        "codebase_version": result.codebase_version,
        "mode": result.mode,
        "added": len(result.added_ids),
        "trajectory_ids": result.added_ids,
        "kept_ids": result.kept_ids,
        "skipped": result.skipped,
        "episodes": result.episodes,
        "frames": result.frames,
        "fields": [{"feature": feature, "field": f} for feature, f in result.fields.items()],
        "dropped": result.dropped,
        "size": index.size,
        "total_samples": index.total_samples,
        "trajectory_counter": index.trajectory_counter,
        "trajectory_format": index.trajectory_format,
        "dry_run": dry_run,
        "files": None if dry_run else result.report.as_json(),
    }
    if output.json:
        print_json(doc, output.pretty)
        return
    ids = result.added_ids
    rows = [
        ("dataset", f"{result.dataset} (LeRobot {result.codebase_version})"),
        ("read as", "rbtool export (sidecar)" if result.mode == "rbtool" else "one trajectory per episode"),
        ("added", f"{len(ids)} ({format_ids(ids)})" if ids else "0"),
        *(
            [("skipped", f"{result.skipped} (already added by an interrupted import)")]
            if result.skipped
            else []
        ),
        ("episodes", f"{result.episodes}"),
        ("frames", f"{result.frames}"),
        ("size", f"{index.size}"),
        ("total samples", f"{index.total_samples}"),
        ("trajectory counter", f"{index.trajectory_counter}"),
        ("format", index.trajectory_format),
        *([] if dry_run else [("files", files_line(doc["files"]))]),
    ]
    if result.dropped:
        rows.append(("dropped", ", ".join(result.dropped)))
    out.print(key_values(f"{'would import' if dry_run else 'import'} into {result.buffer}", rows))
    mapped = [[Text(feature), Text(f)] for feature, f in result.fields.items()]
    out.print(Fitted([Column("feature"), Column("buffer field")], mapped, title="fields"))
    if dry_run:
        dry_run_note(result.buffer, f"{trajectories(len(ids))} added")
