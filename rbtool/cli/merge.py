"""`rbtool merge`: merge checkpoints (or folders of rank_* checkpoints) into one."""

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
    ForceOpt,
    FormatOpt,
    JsonOpt,
    PrettyOpt,
    StorageOpt,
    StrictOpt,
    refuse_output_mix,
    summary_limit,
)
from rbtool.cli._output import count, files_line, state_table
from rbtool.cli._places import upload_note
from rbtool.cli._progress import progress_bar, show_progress
from rbtool.cli._writing import dry_run_note, read_and_write, trajectories


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
    force: ForceOpt = False,
    copy: CopyOpt = False,
    dry_run: DryRunOpt = False,
    all_items: AllOpt = False,
    json: JsonOpt = False,
    pretty: PrettyOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Merge checkpoints: unique ids are kept in input order, colliding ids renumbered from 0."""
    refuse_output_mix(json, pretty=pretty)
    opening = read_and_write(dir_args, target_arg, storage_option, json=json, force=force, dry_run=dry_run)
    with opening as (places, dst):
        dirs, target = [p.local for p in places], dst.local
        from rbtool.files.dirs import checkpoint_dirs
        from rbtool.ops import checkpoint
        from rbtool.remote.places import shown_in

        inputs = [p for d in dirs for p in checkpoint_dirs(d)]
        with progress_bar("merging", None, show_progress(json) and not dry_run) as advance:
            result = checkpoint.merge(
                dirs,
                target,
                strict=strict,
                trajectory_format=None if trajectory_format is None else trajectory_format.value,
                overwrite=force,
                progress=advance,
                link=not copy and all(p.url is None for p in places),  # never into the cache
                dry_run=dry_run,
            )
        dst.finish()  # upload before printing (a URL's checkpoint exists only then)
        index = result.index
        doc: dict[str, Any] = {
            "inputs": [shown_in(places, p) for p in inputs],
            "out": dst.show(),
            "upload": dst.upload,
            "renumbered": result.renumbered,
            "mapping_file": dst.show(target / checkpoint.MERGE_MAP_FILE) if result.renumbered else None,
            **index.state(),
            "trajectory_format": index.trajectory_format,
            "dry_run": dry_run,
            "files": None if dry_run else result.report.as_json(),
        }
        if json:
            print_json(bound_state(doc, summary_limit(all_items)), pretty)
            return
        out.print(
            state_table(
                f"{'would merge' if dry_run else 'merged'} {count(len(inputs), 'checkpoint')} "
                f"into {dst.show()}",
                [("merged", doc)],
                None if all_items else SUMMARY_ITEMS,
            )
        )
        if result.renumbered:
            out.print(f"ids collided and were renumbered; mapping in {doc['mapping_file']}")
        if dry_run:
            dry_run_note(dst.show(), f"{trajectories(index.size)}, format {doc['trajectory_format']}")
        else:
            out.print(f"format {doc['trajectory_format']}; files: {files_line(doc['files'])}")
            upload_note(dst.upload)
