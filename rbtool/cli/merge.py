"""`rbtool merge`: merge checkpoints (or folders of rank_* checkpoints) into one."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from rbtool.cli._consoles import out
from rbtool.cli._json import print_report
from rbtool.cli._options import (
    FormatOpt,
    StrictOpt,
    Writes,
)
from rbtool.cli._output import count, state_table
from rbtool.cli._writing import read_and_write, trajectories


def merge(
    dir_args: Annotated[
        list[str],
        typer.Argument(
            metavar="DIR", help="Checkpoints, or folders of rank_* checkpoints (or URLs), in order."
        ),
    ],
    target_arg: Annotated[str, typer.Option("--out", "-o", help="Checkpoint directory (or URL) to write.")],
    trajectory_format: FormatOpt = None,
    strict: StrictOpt = True,
    writes: Writes = Writes(),
) -> None:
    """Merge checkpoints: unique ids are kept in input order, colliding ids renumbered from 0."""
    from rbtool.files.dirs import checkpoint_dirs
    from rbtool.ops import checkpoint
    from rbtool.remote.places import shown_in

    opening = read_and_write(dir_args, target_arg, writes, writes.storage_option)
    with opening as writer:
        places, dst = writer.sources, writer.dst
        dirs = [p.local for p in places]
        inputs = [p for d in dirs for p in checkpoint_dirs(d)]
        result = writer.run(
            "merging",
            checkpoint.merge,
            dirs,
            dst.local,
            strict=strict,
            trajectory_format=None if trajectory_format is None else trajectory_format.value,
        )
        index = result.index
        doc: dict[str, Any] = {
            "inputs": [shown_in(places, p) for p in inputs],
            "out": dst.show(),
            "upload": dst.upload,
            "renumbered": result.renumbered,
            "mapping_file": dst.show(dst.local / checkpoint.MERGE_MAP_FILE) if result.renumbered else None,
            **index.state(),
            "trajectory_format": index.trajectory_format,
            "dry_run": writes.dry_run,
            "files": None if writes.dry_run else result.report.as_json(),
        }
        if writes.json:
            print_report(doc, writes)
            return
        out.print(
            state_table(
                f"{'would merge' if writes.dry_run else 'merged'} {count(len(inputs), 'checkpoint')} "
                f"into {dst.show()}",
                [("merged", doc)],
                writes.limit,
            )
        )
        if result.renumbered:
            out.print(f"ids collided and were renumbered; mapping in {doc['mapping_file']}")
        fmt = doc["trajectory_format"]
        writer.last_lines(f"{trajectories(index.size)}, format {fmt}", doc["files"], f"format {fmt}; ")
