"""`rbtool convert`: rewrite a checkpoint's (or rank tree's) trajectory files in another format."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from rbtool.cli._consoles import out
from rbtool.cli._json import print_report
from rbtool.cli._options import (
    Pass,
    RankWrites,
    SourceArg,
    StrictOpt,
    TrajectoryFormat,
)
from rbtool.cli._output import count, size
from rbtool.cli._places import is_url
from rbtool.cli._writing import read_and_write, trajectories


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
    passes: Pass = Pass(),
    strict: StrictOpt = True,
    writes: RankWrites = RankWrites(),
) -> None:
    """Write OUT with every trajectory file of IN in FORMAT (a rank tree keeps its rank_* layout)."""
    if trajectory_format is None:  # one line, not the parser's list of choices on three lines
        from rbtool.errors import UsageError

        raise UsageError("--format is required: give pt or pkl (or set RBTOOL_FORMAT)")
    # to a local OUT, each file is read once: a source larger than the cache is streamed (a
    # remote OUT is staged whole in the cache first, so there the source must fit beside it)
    stream = not is_url(target_arg)
    from rbtool.ops import conversion

    opening = read_and_write(
        [source_arg],
        target_arg,
        writes,
        writes.storage_option,
        stream=stream,
    )
    with opening as writer:
        src, dst = writer.sources[0], writer.dst
        target = dst.local
        result = writer.run(
            "converting",
            conversion.convert,
            src.local,
            target,
            trajectory_format.value,
            jobs=passes.jobs,
            strict=strict,
            journal=passes.journal,
        )
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
            "dry_run": writes.dry_run,
            "files": None if writes.dry_run else result.report.as_json(),
            "journal": result.journal,
        }
        if writes.json:
            print_report(doc, writes, each="checkpoints")
            return
        rows = [(c["path"].rstrip("/").rsplit("/", 1)[-1], c) for c in checkpoints]
        writer.state_view(f"converted to {doc['trajectory_format']}", rows, f" ({count(doc['jobs'], 'job')})")
        total = sum(c["size"] for c in checkpoints)
        writer.last_lines(f"{trajectories(total)} in {doc['trajectory_format']}", doc["files"])
        if writes.dry_run:
            return
        rate = (doc["bytes_per_second"] or 0) / 1e6
        out.print(
            f"read {size(doc['bytes_read'])} to rewrite in {doc['seconds']:.2f} s ({rate:.1f} MB/s)",
            markup=False,
        )
        if result.journal is not None:
            from rbtool.passes.journal import journal_note

            out.print(journal_note(result.journal), markup=False)
