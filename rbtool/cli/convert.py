"""`rbtool convert`: rewrite a checkpoint's (or rank tree's) trajectory files in another format."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from rbtool.cli._consoles import out
from rbtool.cli._json import bound_state, print_json
from rbtool.cli._options import (
    SUMMARY_ITEMS,
    AllOpt,
    CopyOpt,
    DryRunOpt,
    JobsOpt,
    JournalOpt,
    JsonOpt,
    PrettyOpt,
    SourceArg,
    StorageOpt,
    StrictOpt,
    TrajectoryFormat,
    refuse_output_mix,
    summary_limit,
)
from rbtool.cli._output import count, files_line, size, state_table
from rbtool.cli._places import is_url, upload_note
from rbtool.cli._progress import progress_bar, show_progress
from rbtool.cli._writing import dry_run_note, read_and_write, trajectories


def convert(
    source_arg: SourceArg,
    target_arg: Annotated[
        str, typer.Option("--out", "-o", help="Where (a directory or URL) to write the converted copy.")
    ],
    trajectory_format: Annotated[
        TrajectoryFormat | None,
        typer.Option(
            "--format", help="The format to write every trajectory file in (required).", show_default=False
        ),
    ] = None,
    jobs: JobsOpt = None,
    journal: JournalOpt = None,
    strict: StrictOpt = True,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Replace OUT if it is empty, a checkpoint or an earlier rank tree output."
        ),
    ] = False,
    copy: CopyOpt = False,
    dry_run: DryRunOpt = False,
    all_items: AllOpt = False,
    json: JsonOpt = False,
    pretty: PrettyOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Write OUT with every trajectory file of IN in FORMAT (a rank tree keeps its rank_* layout)."""
    refuse_output_mix(json, pretty=pretty)
    if trajectory_format is None:  # one line, not the parser's list of choices on three lines
        from rbtool.errors import UsageError

        raise UsageError("--format is required: give pt or pkl (or set RBTOOL_FORMAT)")
    # to a local OUT, each file is read once: a source larger than the cache is streamed (a
    # remote OUT is staged whole in the cache first, so there the source must fit beside it)
    stream = not is_url(target_arg)
    opening = read_and_write(
        [source_arg], target_arg, storage_option, json=json, force=force, dry_run=dry_run, stream=stream
    )
    with opening as ([src], dst):
        source, target = src.local, dst.local
        from rbtool.ops import conversion

        with progress_bar("converting", None, show_progress(json) and not dry_run) as advance:
            result = conversion.convert(
                source,
                target,
                trajectory_format.value,
                jobs=jobs,
                strict=strict,
                overwrite=force,
                progress=advance,
                link=not copy and src.url is None,  # never a hard link into the cache
                journal=journal,
                dry_run=dry_run,
            )
        dst.finish()  # upload before printing (a URL's checkpoint exists only then)
        checkpoints: list[dict[str, Any]] = [
            {"path": dst.show(target if rel == "." else target / rel), **index.state()}
            for rel, index in result.checkpoints
        ]
        doc: dict[str, Any] = {
            "source": src.show(),
            "out": dst.show(),
            "upload": dst.upload,
            "trajectory_format": result.trajectory_format,
            "jobs": result.jobs,
            "bytes_read": result.throughput.bytes_read,
            "seconds": round(result.throughput.seconds, 6),
            "bytes_per_second": result.throughput.bytes_per_second,
            "checkpoints": checkpoints,
            "dry_run": dry_run,
            "files": None if dry_run else result.report.as_json(),
            "journal": result.journal,
        }
        if json:
            print_json(
                {**doc, "checkpoints": [bound_state(c, summary_limit(all_items)) for c in checkpoints]},
                pretty,
            )
            return
        out.print(
            state_table(
                f"{src.show()} {'would be ' if dry_run else ''}converted to {doc['trajectory_format']} "
                f"into {dst.show()} ({count(doc['jobs'], 'job')})",
                [(c["path"].rstrip("/").rsplit("/", 1)[-1], c) for c in checkpoints],
                None if all_items else SUMMARY_ITEMS,
            )
        )
        if dry_run:
            total = sum(c["size"] for c in checkpoints)
            dry_run_note(dst.show(), f"{trajectories(total)} in {doc['trajectory_format']}")
            return
        out.print(f"files: {files_line(doc['files'])}")
        upload_note(dst.upload)
        rate = (doc["bytes_per_second"] or 0) / 1e6
        out.print(
            f"read {size(doc['bytes_read'])} to rewrite in {doc['seconds']:.2f} s ({rate:.1f} MB/s)",
            markup=False,
        )
        if result.journal is not None:
            from rbtool.passes.ranks import journal_note

            out.print(journal_note(result.journal), markup=False)
