"""`rbtool shard`: split a checkpoint into one checkpoint per rank."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from rbtool.cli._common import (
    SUMMARY_ITEMS,
    AllOpt,
    CopyOpt,
    JsonOpt,
    PrettyOpt,
    RanksForceOpt,
    StrictOpt,
    WorldSizeOpt,
    bound_state,
    files_line,
    out,
    print_json,
    progress_bar,
    refuse_output_mix,
    refuse_overlap,
    show_progress,
    state_table,
    summary_limit,
)
from rbtool.cli._writing import DryRunOpt, dry_run_note, trajectories


def shard(
    ckpt: Annotated[Path, typer.Argument(metavar="CKPT", help="Checkpoint or buffer directory to split.")],
    world_size: WorldSizeOpt,
    target: Annotated[
        Path, typer.Option("--out", "-o", help="Directory to write rank_0 .. rank_{N-1} into.")
    ],
    strict: StrictOpt = True,
    force: RanksForceOpt = False,
    copy: CopyOpt = False,
    dry_run: DryRunOpt = False,
    all_items: AllOpt = False,
    json: JsonOpt = False,
    pretty: PrettyOpt = False,
) -> None:
    """Write OUT/rank_r for every rank: exactly what a distributed load of CKPT by rank r yields."""
    refuse_output_mix(json, pretty=pretty)
    from rbtool import checkpoint

    refuse_overlap(target, [ckpt], "--out")
    with progress_bar("sharding", None, show_progress(json) and not dry_run) as advance:
        shards, report = checkpoint.shard(
            ckpt,
            world_size,
            target,
            strict=strict,
            overwrite=force,
            progress=advance,
            link=not copy,
            dry_run=dry_run,
        )
    ranks: list[dict[str, Any]] = [
        {"rank": r, "path": str(target / f"rank_{r}"), **part.state()} for r, part in enumerate(shards)
    ]
    doc: dict[str, Any] = {
        "source": str(ckpt),
        "out": str(target),
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
            f"{ckpt} {'would be ' if dry_run else ''}sharded over {world_size} ranks into {target}",
            [(f"rank_{r['rank']}", r) for r in ranks],
            None if all_items else SUMMARY_ITEMS,
        )
    )
    if dry_run:
        dry_run_note(target, f"{world_size} rank directories, {trajectories(sum(r['size'] for r in ranks))}")
    else:
        out.print(f"files: {files_line(doc['files'])}")
