"""`rbtool shard`: split a checkpoint into one checkpoint per rank."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from rbtool.cli._json import print_report
from rbtool.cli._options import (
    RankWrites,
    StrictOpt,
    WorldSizeOpt,
)
from rbtool.cli._writing import rank_tree, trajectories


def shard(
    ckpt_arg: Annotated[
        str, typer.Argument(metavar="CKPT", help="Checkpoint or buffer directory (or URL) to split.")
    ],
    world_size: WorldSizeOpt,
    target_arg: Annotated[
        str, typer.Option("--out", "-o", help="Directory (or URL) to write rank_0 .. rank_{N-1} into.")
    ],
    strict: StrictOpt = True,
    writes: RankWrites = RankWrites(),
) -> None:
    """Write OUT/rank_r for every rank: exactly what a distributed load of CKPT by rank r yields."""
    from rbtool.format.ranknames import rank_dir_name

    with rank_tree("sharding", ckpt_arg, world_size, target_arg, "count", strict, writes) as (writer, result):
        src, dst = writer.sources[0], writer.dst
        ranks: list[dict[str, Any]] = [
            {"rank": p.rank, "path": dst.show(dst.local / rank_dir_name(p.rank)), **p.index.state()}
            for p in result.ranks
        ]
        doc: dict[str, Any] = {
            "source": src.show(),
            "out": dst.show(),
            "upload": dst.upload,
            "world_size": world_size,
            "ranks": ranks,
            "dry_run": writes.dry_run,
            "files": None if writes.dry_run else result.report.as_json(),
        }
        if writes.json:
            print_report(doc, writes, each="ranks")
            return
        writer.state_view(f"sharded over {world_size} ranks", [(rank_dir_name(r["rank"]), r) for r in ranks])
        total = trajectories(sum(r["size"] for r in ranks))
        writer.last_lines(f"{world_size} rank directories, {total}", doc["files"])
