"""`rbtool filter`: a new checkpoint of the trajectories that match."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from rbtool.cli._consoles import out
from rbtool.cli._json import print_report
from rbtool.cli._options import (
    SourceArg,
    StrictOpt,
    Writes,
)
from rbtool.cli._output import format_ids, state_table
from rbtool.cli._writing import read_and_write, trajectories


def _version_bound(option: str, relation: str) -> Any:
    """--min-version or --max-version: a bound on every value of a trajectory's `versions`."""
    return typer.Option(
        option, metavar="V", help=f"Keep trajectories whose every `versions` value is {relation} V."
    )


def filter_(
    source_arg: SourceArg,
    target_arg: Annotated[str, typer.Option("--out", "-o", help="Checkpoint directory (or URL) to write.")],
    model_weights_id: Annotated[
        list[str] | None,
        typer.Option(
            "--model-weights-id", metavar="ID", help="Keep trajectories of this policy (repeatable)."
        ),
    ] = None,
    min_version: Annotated[float | None, _version_bound("--min-version", ">=")] = None,
    max_version: Annotated[float | None, _version_bound("--max-version", "<=")] = None,
    max_staleness: Annotated[
        float | None,
        typer.Option(
            "--max-staleness",
            min=0,
            metavar="S",
            help="Keep trajectories whose oldest version is at most S behind the newest in IN.",
        ),
    ] = None,
    min_id: Annotated[int | None, typer.Option("--min-id", metavar="I", help="Keep ids >= I.")] = None,
    max_id: Annotated[int | None, typer.Option("--max-id", metavar="I", help="Keep ids <= I.")] = None,
    last: Annotated[
        int | None,
        typer.Option("--last", min=0, metavar="N", help="Then keep only the last N (in list order)."),
    ] = None,
    min_samples: Annotated[
        int | None,
        typer.Option("--min-samples", min=0, metavar="N", help="Keep trajectories with >= N samples (T*B)."),
    ] = None,
    strict: StrictOpt = True,
    writes: Writes = Writes(),
) -> None:
    """Write OUT holding IN's trajectories that match every criterion given (files linked; see --copy)."""
    from rbtool.ops import filtering

    opening = read_and_write([source_arg], target_arg, writes, writes.storage_option)
    with opening as writer:
        src, dst = writer.sources[0], writer.dst
        criteria = filtering.Criteria(
            model_weights_ids=tuple(model_weights_id or ()),
            min_version=min_version,
            max_version=max_version,
            max_staleness=max_staleness,
            min_id=min_id,
            max_id=max_id,
            last=last,
            min_samples=min_samples,
        )
        # the criteria read the trajectories' versions in a dry run too: that progress shows
        result = writer.run(
            "filtering",
            filtering.filter_checkpoint,
            src.local,
            dst.local,
            criteria,
            strict=strict,
            dry_run_bar=True,
        )
        doc: dict[str, Any] = {
            "source": src.show(),
            "out": dst.show(),
            "upload": dst.upload,
            "dry_run": writes.dry_run,
            "criteria": filtering.describe_criteria(criteria),
            **result.index.state(),
            "source_size": result.view.index.size,
            "dropped_ids": result.dropped,
            "renumbered": result.view.renumbered,
            "files": None if writes.dry_run else result.report.as_json(),
        }
        if writes.json:
            print_report(doc, writes, also=("dropped_ids",))
            return
        action = "would keep" if writes.dry_run else f"kept in {dst.show()}"
        limit = writes.limit
        out.print(state_table(f"{src.show()}: {action}", [("kept", doc)], limit))
        out.print(
            f"dropped {len(result.dropped)} of {doc['source_size']}: ids {format_ids(result.dropped, limit)}"
        )
        writer.last_lines(f"{trajectories(result.index.size)} kept", doc["files"])
