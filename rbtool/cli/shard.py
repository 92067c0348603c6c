"""`rbtool shard`: split a checkpoint into one checkpoint per rank."""

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
    JsonOpt,
    PrettyOpt,
    RanksForceOpt,
    StorageOpt,
    StrictOpt,
    WorldSizeOpt,
    refuse_output_mix,
    summary_limit,
)
from rbtool.cli._output import files_line, state_table
from rbtool.cli._places import upload_note
from rbtool.cli._progress import progress_bar, show_progress
from rbtool.cli._writing import dry_run_note, read_and_write, trajectories


def shard(
    ckpt_arg: Annotated[
        str, typer.Argument(metavar="CKPT", help="Checkpoint or buffer directory (or URL) to split.")
    ],
    world_size: WorldSizeOpt,
    target_arg: Annotated[
        str, typer.Option("--out", "-o", help="Directory (or URL) to write rank_0 .. rank_{N-1} into.")
    ],
    strict: StrictOpt = True,
    force: RanksForceOpt = False,
    copy: CopyOpt = False,
    dry_run: DryRunOpt = False,
    all_items: AllOpt = False,
    json: JsonOpt = False,
    pretty: PrettyOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Write OUT/rank_r for every rank: exactly what a distributed load of CKPT by rank r yields."""
    refuse_output_mix(json, pretty=pretty)
    opening = read_and_write([ckpt_arg], target_arg, storage_option, json=json, force=force, dry_run=dry_run)
    with opening as ([src], dst):
        ckpt, target = src.local, dst.local
        from rbtool.format.ranknames import rank_dir_name
        from rbtool.ops import checkpoint

        with progress_bar("sharding", None, show_progress(json) and not dry_run) as advance:
            shards, report = checkpoint.shard(
                ckpt,
                world_size,
                target,
                strict=strict,
                overwrite=force,
                progress=advance,
                link=not copy and src.url is None,  # never a hard link into the cache
                dry_run=dry_run,
            )
        dst.finish()  # upload before printing (a URL's checkpoint exists only then)
        ranks: list[dict[str, Any]] = [
            {"rank": r, "path": dst.show(target / rank_dir_name(r)), **part.state()}
            for r, part in enumerate(shards)
        ]
        doc: dict[str, Any] = {
            "source": src.show(),
            "out": dst.show(),
            "upload": dst.upload,
            "world_size": world_size,
            "ranks": ranks,
            "dry_run": dry_run,
            "files": None if dry_run else report.as_json(),
        }
        if json:
            print_json({**doc, "ranks": [bound_state(r, summary_limit(all_items)) for r in ranks]}, pretty)
            return
        out.print(
            state_table(
                f"{src.show()} {'would be ' if dry_run else ''}sharded over {world_size} ranks into "
                f"{dst.show()}",
                [(rank_dir_name(r["rank"]), r) for r in ranks],
                None if all_items else SUMMARY_ITEMS,
            )
        )
        if dry_run:
            dry_run_note(
                dst.show(), f"{world_size} rank directories, {trajectories(sum(r['size'] for r in ranks))}"
            )
        else:
            out.print(f"files: {files_line(doc['files'])}")
            upload_note(dst.upload)
