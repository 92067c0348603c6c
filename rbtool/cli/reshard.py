"""`rbtool reshard`: M rank directories (or one checkpoint) to N ranks in one step."""

from __future__ import annotations

import enum
from typing import Annotated, Any

import typer

from rbtool.cli._consoles import out
from rbtool.cli._json import print_report
from rbtool.cli._options import (
    RankWrites,
    SourceArg,
    StrictOpt,
    WorldSizeOpt,
)
from rbtool.cli._output import Column, Fitted, count, format_ids, size
from rbtool.cli._writing import rank_tree, trajectories


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
    strict: StrictOpt = True,
    writes: RankWrites = RankWrites(),
) -> None:
    """Write OUT/rank_r for N ranks from IN's trajectories (the merge of its ranks), files linked."""
    from rbtool.format.ranknames import rank_dir_name

    opening = rank_tree("resharding", source_arg, world_size, target_arg, balance.value, strict, writes)
    with opening as (writer, result):
        src, dst = writer.sources[0], writer.dst
        target = dst.local
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
            "dry_run": writes.dry_run,
            "ranks": ranks,
            "files": None if writes.dry_run else result.report.as_json(),
        }
        if writes.json:
            print_report(doc, writes, each="ranks")
            return
        action = "would write" if writes.dry_run else "wrote"
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
                format_ids(r["trajectory_id_list"], writes.limit),
            ]
            for r in ranks
        ]
        out.print(Fitted(columns, rows, title=title))
        if view.renumbered:
            out.print(
                "ids collided across the source's ranks and were renumbered; "
                "mapping in each rank's merge_map.json"
            )
        total = trajectories(sum(r["size"] for r in ranks))
        writer.last_lines(f"{world_size} rank directories, {total}", doc["files"])
