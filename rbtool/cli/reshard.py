"""`rbtool reshard`: M rank directories (or one checkpoint) to N ranks in one step."""

from __future__ import annotations

import enum
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
    SourceArg,
    StorageOpt,
    StrictOpt,
    WorldSizeOpt,
    refuse_output_mix,
    summary_limit,
)
from rbtool.cli._output import Column, Fitted, count, files_line, format_ids, size
from rbtool.cli._places import upload_note
from rbtool.cli._progress import progress_bar, show_progress
from rbtool.cli._writing import dry_run_note, read_and_write, trajectories


class Balance(str, enum.Enum):
    """What the rank blocks balance."""

    by_count = "count"
    by_samples = "samples"


def reshard(
    source_arg: SourceArg,
    world_size: WorldSizeOpt,
    target_arg: Annotated[
        str, typer.Option("--out", "-o", help="Directory (or URL) to write rank_0 .. rank_{N-1} into.")
    ],
    balance: Annotated[
        Balance,
        typer.Option(
            "--balance",
            help="count: blocks of trajectories as a distributed load cuts them; samples: blocks of "
            "about equal total samples. Both keep list order.",
        ),
    ] = Balance.by_count,
    dry_run: DryRunOpt = False,
    strict: StrictOpt = True,
    force: RanksForceOpt = False,
    copy: CopyOpt = False,
    all_items: AllOpt = False,
    json: JsonOpt = False,
    pretty: PrettyOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Write OUT/rank_r for N ranks from IN's trajectories (the merge of its ranks), files linked."""
    refuse_output_mix(json, pretty=pretty)
    opening = read_and_write(
        [source_arg], target_arg, storage_option, json=json, force=force, dry_run=dry_run
    )
    with opening as ([src], dst):
        source, target = src.local, dst.local
        from rbtool.format.ranknames import rank_dir_name
        from rbtool.ops import resharding

        with progress_bar("resharding", None, show_progress(json) and not dry_run) as advance:
            result = resharding.reshard(
                source,
                world_size,
                target,
                split=balance.value,
                strict=strict,
                dry_run=dry_run,
                overwrite=force,
                progress=advance,
                link=not copy and src.url is None,  # never a hard link into the cache
            )
        dst.finish()  # upload before printing (a URL's checkpoint exists only then)
        ranks: list[dict[str, Any]] = [
            {"path": dst.show(target / rank_dir_name(p.rank)), **p.as_json()} for p in result.ranks
        ]
        view = result.view
        doc: dict[str, Any] = {
            "source": src.show(),
            "source_dirs": [src.show(d) for d in view.dirs],
            "renumbered": view.renumbered,
            "out": dst.show(),
            "upload": dst.upload,
            "world_size": world_size,
            "balance": balance.value,
            "dry_run": dry_run,
            "ranks": ranks,
            "files": None if dry_run else result.report.as_json(),
        }
        if json:
            print_json({**doc, "ranks": [bound_state(r, summary_limit(all_items)) for r in ranks]}, pretty)
            return
        action = "would write" if dry_run else "wrote"
        title = (
            f"{src.show()} ({count(len(view.dirs), 'checkpoint')}) -> {count(world_size, 'rank')}, "
            f"balanced by {balance.value}; {action} {dst.show()}"
        )
        columns = [
            Column("rank", style="bold"),
            *(Column(name, right=True) for name in ("trajectories", "samples", "size", "counter")),
            Column("trajectory ids", wrap=True),
        ]
        rows = [
            [
                rank_dir_name(r["rank"]),
                f"{r['size']}",
                f"{r['total_samples']}",
                size(r["bytes"]),
                f"{r['trajectory_counter']}",
                format_ids(r["trajectory_id_list"], None if all_items else SUMMARY_ITEMS),
            ]
            for r in ranks
        ]
        out.print(Fitted(columns, rows, title=title))
        if view.renumbered:
            out.print(
                "ids collided across the source's ranks and were renumbered; "
                "mapping in each rank's merge_map.json"
            )
        if dry_run:
            dry_run_note(
                dst.show(), f"{world_size} rank directories, {trajectories(sum(r['size'] for r in ranks))}"
            )
        else:
            out.print(f"files: {files_line(doc['files'])}")
            upload_note(dst.upload)
