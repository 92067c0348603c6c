"""`rbtool verify`: check a checkpoint, a buffer directory, or a folder of rank_* checkpoints."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from rich.text import Text

from rbtool.cli._common import JobsOpt, JsonOpt, out, print_json, progress_bar, show_progress

if TYPE_CHECKING:
    from rbtool.verify import CheckpointReport

MAX_ROWS = 50  # problems shown per checkpoint in the human view; --json lists them all
_STYLE = {"error": "bold red", "warning": "yellow", "notice": "cyan"}


def _summary(report: CheckpointReport) -> Text:
    counts = report.counts()
    parts = [f"{n} {sev}{'s' if n != 1 else ''}" for sev, n in counts.items() if n]
    size = "index unreadable" if report.size is None else f"{report.size} trajectories"
    line = Text("OK" if report.ok else "FAILED", style="green" if report.ok else "bold red")
    line.append(f" {report.path} ({size}; {', '.join(parts) or 'no problems'})")
    return line


def _problem_table(report: CheckpointReport) -> Table:
    table = Table(show_edge=False, pad_edge=False)
    for column in ("severity", "code", "id", "message"):
        table.add_column(column, overflow="fold")
    for problem in report.problems[:MAX_ROWS]:
        table.add_row(
            Text(problem.severity, style=_STYLE[problem.severity]),
            Text(problem.code),
            Text("" if problem.trajectory_id is None else str(problem.trajectory_id)),
            Text(problem.message),
        )
    return table


def _print_human(reports: list[CheckpointReport]) -> None:
    for report in reports:
        out.print(_summary(report))
        if not report.problems:
            continue
        out.print(_problem_table(report))
        hidden = report.problems[MAX_ROWS:]
        if hidden:
            by_code = Counter(p.code for p in hidden)
            shown = ", ".join(f"{code} x{n}" for code, n in by_code.most_common())
            out.print(f"... and {len(hidden)} more ({shown}); --json lists every problem", markup=False)


def verify(
    path: Annotated[
        Path,
        typer.Argument(
            metavar="PATH",
            help="A checkpoint or buffer directory, or a folder of rank_* checkpoints.",
            show_default=False,
        ),
    ],
    deep: Annotated[
        bool,
        typer.Option(
            "--deep",
            help="Also load every trajectory file (safely) and check shapes, schema, NaN/Inf and hashes.",
        ),
    ] = False,
    jobs: JobsOpt = None,
    json: JsonOpt = False,
) -> None:
    """Check that a checkpoint is consistent; exit 1 if any error is found.

    The quick check reads only the index files and the directory listing. Notices (files an
    interrupted writer left) and warnings (differing field schemas) do not fail it.
    """
    from rbtool.errors import CheckpointError
    from rbtool.verify import verify as run_verify

    enabled = deep and show_progress(json)
    with progress_bar("loading trajectory files", None, enabled) as advance:
        result = run_verify(path, deep=deep, progress=advance if enabled else None, jobs=jobs)
    if json:
        print_json(result.as_json(plain=False))
    else:
        _print_human(result.checkpoints)
        if deep:
            rate = result.bytes_read / result.seconds if result.seconds > 0 else 0.0
            out.print(
                f"deep pass: {result.bytes_read} bytes read in {result.seconds:.2f} s "
                f"({rate / 1e6:.1f} MB/s, {result.jobs} job{'s' if result.jobs != 1 else ''})",
                markup=False,
            )
    if not result.ok:
        counts = Counter(p.code for c in result.checkpoints for p in c.problems if p.severity == "error")
        codes = ", ".join(f"{code} x{n}" for code, n in counts.most_common())
        raise CheckpointError(f"{path}: verification failed with {sum(counts.values())} error(s): {codes}")
