"""`rbtool reshard`: M rank directories (or one checkpoint) to N ranks in one step."""

from __future__ import annotations

import enum
from typing import Annotated, Any

import typer

from rbtool.cli._common import (
    SUMMARY_ITEMS,
    AllOpt,
    CopyOpt,
    JsonOpt,
    PrettyOpt,
    RanksForceOpt,
    SourceArg,
    StorageOpt,
    StrictOpt,
    WorldSizeOpt,
    bound_state,
    files_line,
    format_ids,
    out,
    print_json,
    progress_bar,
    reading,
    refuse_output_mix,
    refuse_overlap,
    show_progress,
    summary_limit,
    writing,
)


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
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and write nothing.")] = False,
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
    with (
        reading(source_arg, storage_option, data=not dry_run, enabled=show_progress(json)) as src,
        writing(target_arg, storage_option, overwrite=force, enabled=show_progress(json)) as dst,
    ):
        source, target = src.local, dst.local
        from rbtool import resharding

        refuse_overlap(target, [source], "--out")
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
                link=not copy,
            )
        dst.finish()  # upload before printing (a URL's checkpoint exists only then)
        ranks: list[dict[str, Any]] = [
            {"path": dst.show(target / f"rank_{p.rank}"), **p.as_json()} for p in result.ranks
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
        from rich.table import Table

        action = "would write" if dry_run else "wrote"
        table = Table(
            title=f"{src.show()} ({len(view.dirs)} checkpoint(s)) -> {world_size} ranks, balanced by "
            f"{balance.value}; {action} {dst.show()}",
            title_justify="left",
        )
        for name in ("rank", "trajectories", "samples", "bytes", "counter"):
            table.add_column(name, justify="right")
        table.add_column("trajectory ids")
        for r in ranks:
            table.add_row(
                f"rank_{r['rank']}",
                str(r["size"]),
                str(r["total_samples"]),
                f"{r['bytes']:,}",
                str(r["trajectory_counter"]),
                format_ids(r["trajectory_id_list"], None if all_items else SUMMARY_ITEMS),
            )
        out.print(table)
        if view.renumbered:
            out.print(
                "ids collided across the source's ranks and were renumbered; "
                "mapping in each rank's merge_map.json"
            )
        if dry_run:
            out.print("dry run: nothing written")
        else:
            out.print(f"files: {files_line(doc['files'])}")
