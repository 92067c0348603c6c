"""`rbtool repair`: write a consistent checkpoint from what a damaged one really holds."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from rbtool.cli._common import (
    SUMMARY_ITEMS,
    AllOpt,
    CopyOpt,
    ForceOpt,
    JobsOpt,
    JsonOpt,
    PrettyOpt,
    bound,
    files_line,
    format_ids,
    head,
    left_out,
    local_path_arg,
    out,
    print_json,
    progress_bar,
    refuse_output_mix,
    show_progress,
    summary_limit,
)


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
    force: ForceOpt = False,
    copy: CopyOpt = False,
    jobs: JobsOpt = None,
    all_items: AllOpt = False,
    json: JsonOpt = False,
    pretty: PrettyOpt = False,
) -> None:
    """Write to OUT a consistent checkpoint of what PATH really holds; PATH is never modified.

    Entries whose files are missing, unreadable or altered are dropped, counts are recounted,
    and a lost or corrupt index or metadata is rebuilt from the trajectory files.
    """
    refuse_output_mix(json, pretty=pretty)
    from rbtool.repair import repair as run_repair

    # The library refuses an OUT equal to, inside or containing PATH (a usage error, exit 2).
    with progress_bar("checking trajectory files", None, show_progress(json)) as advance:
        result = run_repair(path, target, overwrite=force, progress=advance, link=not copy, jobs=jobs)
    limit = summary_limit(all_items)
    if json:
        doc = result.as_json()
        for ckpt_doc in doc["checkpoints"]:
            bound(ckpt_doc, "trajectory_id_list", limit, ranges="trajectory_id_ranges")
            for key in ("dropped", "ignored", "fixed"):
                bound(ckpt_doc, key, limit)
        print_json(doc, pretty)
        return
    shown = None if all_items else SUMMARY_ITEMS
    for ckpt in result.checkpoints:
        table = Table(
            title=Text(f"repaired {ckpt.source} -> {ckpt.out}"), show_header=False, title_justify="left"
        )
        table.add_column("key", style="bold")
        table.add_column("value")
        table.add_row("kept", Text(f"{ckpt.index.size} ({format_ids(ckpt.index.id_list, shown)})"))
        table.add_row("total samples", str(ckpt.index.total_samples))
        table.add_row("trajectory counter", str(ckpt.index.trajectory_counter))
        rebuilt = [
            name
            for name, flag in (("metadata", ckpt.rebuilt_metadata), ("index", ckpt.rebuilt_index))
            if flag
        ]
        table.add_row("rebuilt", ", ".join(rebuilt) or "nothing")
        for item in head(ckpt.dropped, shown):
            table.add_row(
                Text(f"dropped {item['trajectory_id']}"), Text(f"{item['file'] or ''}: {item['reason']}")
            )
        for item in head(ckpt.ignored, shown):
            table.add_row("ignored", Text(f"{item['file'] or ''}: {item['reason']}".lstrip(": ")))
        for item in head(ckpt.fixed, shown):
            label = "fixed" if item["trajectory_id"] is None else f"fixed {item['trajectory_id']}"
            table.add_row(label, Text(item["message"]))
        hidden = [
            f"{left_out(items, shown)} {what}"
            for what, items in (("dropped", ckpt.dropped), ("ignored", ckpt.ignored), ("fixed", ckpt.fixed))
            if left_out(items, shown)
        ]
        if hidden:
            table.add_row("...", f"{', '.join(hidden)} more; --all lists them")
        out.print(table)
    out.print(f"files: {files_line(result.report.as_json())}", markup=False)
    read = result.throughput
    out.print(
        f"read {read.bytes_read} bytes in {read.seconds:.2f} s "
        f"({(read.bytes_per_second or 0) / 1e6:.1f} MB/s, {read.jobs} job{'s' if read.jobs != 1 else ''})",
        markup=False,
    )
