"""`rbtool report`: a checkpoint's stats, plots and frames as one self-contained HTML file (or Markdown)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rbtool.cli._consoles import out
from rbtool.cli._json import print_json
from rbtool.cli._options import DirArg, JobsOpt, Json, StorageOpt, WindowOpt
from rbtool.cli._output import count, printable, size
from rbtool.cli._places import is_url, local_path_arg, reading, refuse_overlap
from rbtool.cli._progress import progress_bar, show_progress
from rbtool.cli._window import DEFAULT_WINDOW


def report(
    path: DirArg,
    out_path: Annotated[
        Path,
        typer.Option(
            "--out",
            metavar="FILE",
            help="The page to write: one HTML file with everything inline (with --markdown, a .md "
            "file and its PNG images beside it).",
            parser=local_path_arg,
        ),
    ],
    markdown: Annotated[
        bool,
        typer.Option(
            "--markdown", help="Write Markdown, its images as PNG files beside it (FILE's stem-*.png)."
        ),
    ] = False,
    window: WindowOpt = DEFAULT_WINDOW,
    sample_draws: Annotated[
        int,
        typer.Option("--sample-draws", min=1, help="Uniform draws simulated for the draw-spread plot."),
    ] = 10_000,
    jobs: JobsOpt = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace the --out file (and its images) if they exist.")
    ] = False,
    output: Json = Json(),
    storage_option: StorageOpt = None,
) -> None:
    """Write a checkpoint's report: the stats summary, its fields, plots and a few frames.

    Plots: returns per trajectory, episode lengths and returns, samples per policy version
    and the spread of simulated uniform draws over the window; frames of the first, middle
    and last trajectories. The HTML file references nothing outside itself (no script, no
    network), for a CI artifact or a pull request. Needs pip install 'rbtool[view]'.
    """
    if not is_url(path):
        refuse_overlap(out_path, [local_path_arg(path)], "--out")

    from rbtool.files.fsutil import check_file_target
    from rbtool.view.report import write_report

    check_file_target(out_path, overwrite=force)  # before anything is read
    enabled = show_progress(output.json)
    with (
        reading(path, storage_option, data=True, enabled=enabled) as place,
        progress_bar("writing the report", None, enabled),
    ):
        done = write_report(
            place.local,
            out_path,
            shown_path=place.show(),
            markdown=markdown,
            overwrite=force,
            window=window,
            draws=sample_draws,
            jobs=jobs,
        )
    doc = {"path": place.show(), **done.as_json()}
    if output.json:
        print_json(doc, output.pretty)
        return
    images = f", {count(len(done.images), 'image')} beside it" if done.images else ""
    out.print(
        f"wrote {printable(done.out)} ({size(done.bytes)}{images}): {', '.join(done.sections)}; "
        f"frames of trajectories {', '.join(map(str, done.trajectories_shown)) or 'none'}",
        markup=False,
    )
