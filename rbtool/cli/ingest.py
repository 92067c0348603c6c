"""`rbtool ingest`: add trajectory files, folders or checkpoints to a buffer directory."""

from __future__ import annotations

from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import typer

from rbtool.cli._consoles import out
from rbtool.cli._json import print_json
from rbtool.cli._options import (
    BufferWrites,
    FormatOpt,
    Json,
    StorageOpt,
    refuse_link_with_copy,
)
from rbtool.cli._output import files_line, format_ids, key_values
from rbtool.cli._places import is_url, local_dir, reading
from rbtool.cli._progress import progress_bar, show_progress
from rbtool.cli._writing import added_line, dry_run_note, trajectories, waiting_note


def _count_items(sources: list[Path]) -> int | None:
    """How many trajectories the sources hold, for the progress bar's total (None if unknown)."""
    from rbtool.errors import RbtoolError
    from rbtool.ops.checkpoint import collect_items

    try:
        return len(collect_items(sources))
    except RbtoolError:
        return None  # ingest itself reports the problem


def ingest(
    source_args: Annotated[
        list[str],
        typer.Argument(
            metavar="SOURCE",
            help="Trajectory files (.pt/.pkl), folders of them, or buffer/checkpoint directories (or their "
            "URLs), in order.",
            show_default=False,
        ),
    ],
    buffer_arg: Annotated[
        str,
        typer.Option(
            "--buffer", "-b", help="Buffer directory (auto_save on) to add to; created if needed (local)."
        ),
    ],
    trajectory_format: FormatOpt = None,
    recursive: Annotated[
        bool, typer.Option("--recursive", "-r", help="Also walk the subfolders of folders given as sources.")
    ] = False,
    allow_duplicates: Annotated[
        bool,
        typer.Option(
            "--allow-duplicates",
            help="Add again what the buffer already holds (same content or uuid); default: skip it.",
        ),
    ] = False,
    link: Annotated[
        bool,
        typer.Option(
            "--link",
            help="Hard-link loose trajectory files too (default: copy them; a checkpoint's files are "
            "linked). Whoever writes such a file in place then changes the buffer's too.",
        ),
    ] = False,
    writes: BufferWrites = BufferWrites(),
    output: Json = Json(),
    storage_option: StorageOpt = None,
) -> None:
    """Add trajectories to a buffer directory; ids continue from its trajectory_counter.

    Every source is checked before anything is written. A trajectory the buffer already holds
    is skipped (so an interrupted ingest can simply be run again); folders are walked in
    natural order (t2 before t10). Loose files are copied (--link links them), the files of
    buffer and checkpoint directories are hard-linked (--copy copies them); a reflink
    (copy-on-write) is used wherever the file system can. After each published batch a line
    `added trajectory ids FIRST-LAST` goes to stderr (not beside a progress bar; none with -q
    or --no-progress). Ctrl-C stops after the last published batch and says which ids it holds.
    """
    if is_url(buffer_arg):
        # A buffer takes appends under a lock and publishes each batch by rename; an object
        # store has neither, so two writers (or a reader during an append) could see a mix.
        from rbtool.errors import UsageError

        raise UsageError(
            f"--buffer {buffer_arg}: a buffer in object storage cannot be appended to safely (no lock, "
            "no atomic rename); ingest into a local buffer, then `rbtool checkpoint save BUFFER URL`"
        )
    buffer = local_dir(buffer_arg, "--buffer")
    with ExitStack() as stack:
        places = [
            stack.enter_context(reading(s, storage_option, data=True, enabled=show_progress(output.json)))
            for s in source_args
        ]
        sources = [place.local for place in places]
        from rbtool.ops.ingestion import ingest as ingest_sources
        from rbtool.remote.places import shown_in

        refuse_link_with_copy(link, writes.copy)

        def on_published(ids: list[int]) -> None:
            added_line(ids, enabled)

        enabled = show_progress(output.json)
        total = _count_items(sources) if enabled else None
        with progress_bar("checking sources", total, enabled) as advance:
            result = ingest_sources(
                sources,
                buffer,
                trajectory_format=None if trajectory_format is None else trajectory_format.value,
                on_wait=partial(waiting_note, buffer),
                on_checked=advance,
                on_published=on_published,
                recursive=recursive,
                allow_duplicates=allow_duplicates,
                link=True if link else False if writes.copy else None,
                dry_run=writes.dry_run,
            )

        index = result.index
        doc: dict[str, Any] = {
            "buffer": str(result.buffer),
            "added": len(result.added_ids),
            "trajectory_ids": result.added_ids,
            "size": index.size,
            "total_samples": index.total_samples,
            "trajectory_counter": index.trajectory_counter,
            "trajectory_format": index.trajectory_format,
            "files": result.report.as_json(),
            "removed_leftovers": result.removed_leftovers,
            "duplicates": result.duplicates,
            "skipped": [{**s.as_json(), "source": shown_in(places, s.path)} for s in result.skipped],
            "dry_run": writes.dry_run,
        }
        if writes.dry_run:
            doc["files"] = None
        if output.json:
            print_json(doc, output.pretty)
            return
        ids = result.added_ids
        rows = [
            ("added", f"{len(ids)} ({'id' if len(ids) == 1 else 'ids'} {format_ids(ids)})" if ids else "0"),
            ("size", f"{doc['size']}"),
            ("total samples", f"{doc['total_samples']}"),
            ("trajectory counter", f"{doc['trajectory_counter']}"),
            ("format", doc["trajectory_format"]),
        ]
        if not writes.dry_run:
            rows.append(("files", files_line(doc["files"])))
        if result.removed_leftovers:
            rows.append(("removed leftovers", ", ".join(result.removed_leftovers)))
        if result.skipped:
            rows.append(("skipped", f"{len(result.skipped)} ({result.duplicates} already in the buffer)"))
        out.print(key_values(f"{'would ingest' if writes.dry_run else 'ingest'} into {result.buffer}", rows))
        shown = 20
        for skipped in result.skipped[:shown]:
            out.print(f"skipped {shown_in(places, skipped.path)}: {skipped.reason}", markup=False)
        if len(result.skipped) > shown:
            more = len(result.skipped) - shown
            out.print(f"... and {more} more skipped (--json lists them all)", markup=False)
        if writes.dry_run:
            dry_run_note(result.buffer, f"{trajectories(len(ids))} added")
