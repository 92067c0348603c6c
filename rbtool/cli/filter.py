"""`rbtool filter`: a new checkpoint of the trajectories that match."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from rbtool.cli._consoles import out
from rbtool.cli._json import bound, bound_state, print_json
from rbtool.cli._options import (
    SUMMARY_ITEMS,
    AllOpt,
    CopyOpt,
    DryRunOpt,
    ForceOpt,
    JsonOpt,
    PrettyOpt,
    SourceArg,
    StorageOpt,
    StrictOpt,
    refuse_output_mix,
    summary_limit,
)
from rbtool.cli._output import files_line, format_ids, state_table
from rbtool.cli._places import upload_note
from rbtool.cli._progress import progress_bar, show_progress
from rbtool.cli._writing import dry_run_note, read_and_write, trajectories


def filter_(
    source_arg: SourceArg,
    target_arg: Annotated[str, typer.Option("--out", "-o", help="Checkpoint directory (or URL) to write.")],
    model_weights_id: Annotated[
        list[str] | None,
        typer.Option(
            "--model-weights-id", metavar="ID", help="Keep trajectories of this policy (repeatable)."
        ),
    ] = None,
    min_version: Annotated[
        float | None,
        typer.Option(
            "--min-version", metavar="V", help="Keep trajectories whose every `versions` value is >= V."
        ),
    ] = None,
    max_version: Annotated[
        float | None,
        typer.Option(
            "--max-version", metavar="V", help="Keep trajectories whose every `versions` value is <= V."
        ),
    ] = None,
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
    dry_run: DryRunOpt = False,
    strict: StrictOpt = True,
    force: ForceOpt = False,
    copy: CopyOpt = False,
    all_items: AllOpt = False,
    json: JsonOpt = False,
    pretty: PrettyOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Write OUT holding IN's trajectories that match every criterion given (files linked; see --copy)."""
    refuse_output_mix(json, pretty=pretty)
    opening = read_and_write(
        [source_arg], target_arg, storage_option, json=json, force=force, dry_run=dry_run
    )
    with opening as ([src], dst):
        source, target = src.local, dst.local
        from rbtool.ops import filtering

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
        with progress_bar("filtering", None, show_progress(json)) as advance:
            result = filtering.filter_checkpoint(
                source,
                target,
                criteria,
                strict=strict,
                dry_run=dry_run,
                overwrite=force,
                progress=advance,
                link=not copy and src.url is None,  # never a hard link into the cache
            )
        dst.finish()  # upload before printing (a URL's checkpoint exists only then)
        doc: dict[str, Any] = {
            "source": src.show(),
            "out": dst.show(),
            "upload": dst.upload,
            "dry_run": dry_run,
            "criteria": filtering.describe_criteria(criteria),
            **result.index.state(),
            "source_size": result.view.index.size,
            "dropped_ids": result.dropped,
            "renumbered": result.view.renumbered,
            "files": None if dry_run else result.report.as_json(),
        }
        if json:
            shown = bound_state(doc, summary_limit(all_items))
            bound(shown, "dropped_ids", summary_limit(all_items))
            print_json(shown, pretty)
            return
        action = "would keep" if dry_run else f"kept in {dst.show()}"
        limit = None if all_items else SUMMARY_ITEMS
        out.print(state_table(f"{src.show()}: {action}", [("kept", doc)], limit))
        out.print(
            f"dropped {len(result.dropped)} of {doc['source_size']}: ids {format_ids(result.dropped, limit)}"
        )
        if dry_run:
            dry_run_note(dst.show(), f"{trajectories(result.index.size)} kept")
        else:
            out.print(f"files: {files_line(doc['files'])}")
            upload_note(dst.upload)
