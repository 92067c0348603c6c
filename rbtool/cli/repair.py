"""`rbtool repair`: write a consistent checkpoint from what a damaged one really holds."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from rbtool.cli._consoles import out
from rbtool.cli._json import bound, print_json
from rbtool.cli._options import (
    JobsOpt,
    LocalWrites,
)
from rbtool.cli._output import count, format_ids, head, key_values, left_out, size
from rbtool.cli._places import local_path_arg
from rbtool.cli._writing import read_and_write, trajectories


def repair(
    path: Annotated[
        Path,
        typer.Argument(
            metavar="PATH",
            help="A damaged checkpoint or buffer directory, or a folder of rank_* checkpoints.",
            show_default=False,
            parser=local_path_arg,
        ),
    ],
    target: Annotated[
        Path,
        typer.Option(
            "--out",
            "-o",
            metavar="OUT",
            help="Where to write the repaired checkpoint.",
            show_default=False,
            parser=local_path_arg,
        ),
    ],
    jobs: JobsOpt = None,
    writes: LocalWrites = LocalWrites(),
) -> None:
    """Write to OUT a consistent checkpoint of what PATH really holds; PATH is never modified.

    Entries whose files are missing, unreadable or altered are dropped, counts are recounted,
    and a lost or corrupt index or metadata is rebuilt from the trajectory files.
    """
    from rbtool.ops.repair import repair as run_repair

    opening = read_and_write([str(path)], str(target), writes, None)
    with opening as writer:
        # a dry run checks the trajectory files as the repair does: that progress shows
        result = writer.run(
            "checking trajectory files", run_repair, path, target, jobs=jobs, dry_run_bar=True
        )
        limit = writes.limit
        if writes.json:
            doc = result.as_json()
            doc["dry_run"] = writes.dry_run
            if writes.dry_run:
                doc["files"] = None
            for ckpt_doc in doc["checkpoints"]:
                bound(ckpt_doc, "trajectory_id_list", limit, ranges="trajectory_id_ranges")
                for key in ("dropped", "ignored", "fixed"):
                    bound(ckpt_doc, key, limit)
            print_json(doc, writes.pretty)
            return
        for ckpt in result.checkpoints:
            rows: list[tuple[str, str | Text]] = []
            rows.append(("kept", f"{ckpt.index.size} ({format_ids(ckpt.index.id_list, limit)})"))
            rows.append(("total samples", f"{ckpt.index.total_samples}"))
            rows.append(("trajectory counter", f"{ckpt.index.trajectory_counter}"))
            rebuilt = [
                name
                for name, flag in (("metadata", ckpt.rebuilt_metadata), ("index", ckpt.rebuilt_index))
                if flag
            ]
            rows.append(("rebuilt", ", ".join(rebuilt) or "nothing"))
            for item in head(ckpt.dropped, limit):
                rows.append((f"dropped {item['trajectory_id']}", f"{item['file'] or ''}: {item['reason']}"))
            for item in head(ckpt.ignored, limit):
                rows.append(("ignored", f"{item['file'] or ''}: {item['reason']}".lstrip(": ")))
            for item in head(ckpt.fixed, limit):
                label = "fixed" if item["trajectory_id"] is None else f"fixed {item['trajectory_id']}"
                rows.append((label, item["message"]))
            hidden = [
                f"{left_out(items, limit)} {what}"
                for what, items in (
                    ("dropped", ckpt.dropped),
                    ("ignored", ckpt.ignored),
                    ("fixed", ckpt.fixed),
                )
                if left_out(items, limit)
            ]
            if hidden:
                rows.append(("...", f"{', '.join(hidden)} more; --all lists them"))
            title = f"{'would repair' if writes.dry_run else 'repaired'} {ckpt.source} -> {ckpt.out}"
            out.print(key_values(title, rows))
        read = result.throughput
        out.print(
            f"read {size(read.bytes_read)} in {read.seconds:.2f} s "
            f"({(read.bytes_per_second or 0) / 1e6:.1f} MB/s, {count(read.jobs, 'job')})",
            markup=False,
        )
        kept = sum(c.index.size for c in result.checkpoints)
        would = f"{count(len(result.checkpoints), 'checkpoint')}, {trajectories(kept)} kept"
        writer.last_lines(would, None if writes.dry_run else result.report.as_json())
