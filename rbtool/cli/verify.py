"""`rbtool verify`: check a checkpoint, a buffer directory, or a folder of rank_* checkpoints."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from rbtool.cli._common import (
    AllOpt,
    JobsOpt,
    JsonlOpt,
    JsonOpt,
    PrettyOpt,
    StorageOpt,
    bound,
    head,
    id_ranges,
    insert_after,
    left_out,
    out,
    print_json,
    print_jsonl,
    progress_bar,
    reading,
    refuse_output_mix,
    show_progress,
    summary_limit,
)

if TYPE_CHECKING:
    from rbtool.verify import CheckpointReport

MAX_ROWS = 50  # problems shown per checkpoint in the human view; --all shows them all
_STYLE = {"error": "bold red", "warning": "yellow", "notice": "cyan"}


def _summary(report: CheckpointReport) -> Text:
    counts = report.counts()
    parts = [f"{n} {sev}{'s' if n != 1 else ''}" for sev, n in counts.items() if n]
    size = "index unreadable" if report.size is None else f"{report.size} trajectories"
    line = Text("OK" if report.ok else "FAILED", style="green" if report.ok else "bold red")
    line.append(f" {report.path} ({size}; {', '.join(parts) or 'no problems'})")
    return line


def _problem_table(report: CheckpointReport, limit: int | None) -> Table:
    table = Table(show_edge=False, pad_edge=False)
    for column in ("severity", "code", "id", "message"):
        table.add_column(column, overflow="fold")
    for problem in head(report.problems, limit):
        table.add_row(
            Text(problem.severity, style=_STYLE[problem.severity]),
            Text(problem.code),
            Text("" if problem.trajectory_id is None else str(problem.trajectory_id)),
            Text(problem.message),
        )
    return table


def _print_human(reports: list[CheckpointReport], every: bool) -> None:
    limit = None if every else MAX_ROWS
    for report in reports:
        out.print(_summary(report))
        if not report.problems:
            continue
        out.print(_problem_table(report, limit))
        hidden = report.problems[MAX_ROWS:] if limit is not None else []
        if hidden:
            by_code = Counter(p.code for p in hidden)
            shown = ", ".join(f"{code} x{n}" for code, n in by_code.most_common())
            out.print(f"... and {len(hidden)} more ({shown}); --all lists every problem", markup=False)


def by_code(report: CheckpointReport, limit: int | None) -> list[dict[str, Any]]:
    """One summary per problem code, in order of first appearance: severity, count, trajectory id ranges."""
    codes: dict[str, list[Any]] = {}
    for p in report.problems:
        codes.setdefault(p.code, []).append(p)
    rows = []
    for code, problems in codes.items():
        ids = [p.trajectory_id for p in problems if p.trajectory_id is not None]
        runs = id_ranges(ids)
        rows.append(
            {
                "code": code,
                "severity": problems[0].severity,
                "count": len(problems),
                "id_ranges": head(runs, limit),
                "id_ranges_left_out": left_out(runs, limit),
            }
        )
    return rows


def summarised(result: Any, limit: int | None) -> dict[str, Any]:
    """The --json document: each checkpoint's problems cut to `limit` (None: all), with a summary by code."""
    doc: dict[str, Any] = result.as_json(plain=False)
    for report, ckpt in zip(result.checkpoints, doc["checkpoints"], strict=True):
        bound(ckpt, "problems", limit)
        insert_after(ckpt, "size", {"by_code": by_code(report, limit)})
    return doc


def problem_rows(reports: list[CheckpointReport]) -> Iterator[dict[str, Any]]:
    """One dict per problem, its checkpoint directory first, in the order checked."""
    for report in reports:
        path = str(report.path)
        for p in report.problems:
            yield {
                "checkpoint": path,
                "code": p.code,
                "severity": p.severity,
                "trajectory_id": p.trajectory_id,
                "file": p.file,
                "message": p.message,
            }


def verify(
    path: Annotated[
        str,
        typer.Argument(
            metavar="PATH",
            help="A checkpoint or buffer directory, or a folder of rank_* checkpoints (or a URL).",
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
    all_items: AllOpt = False,
    json: JsonOpt = False,
    pretty: PrettyOpt = False,
    jsonl: JsonlOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Check that a checkpoint is consistent; exit 1 if any error is found.

    The quick check reads only the index files and the directory listing. Notices (files an
    interrupted writer left) and warnings (differing field schemas) do not fail it.
    """
    refuse_output_mix(json, jsonl, pretty)
    from rbtool.errors import CheckpointError
    from rbtool.verify import verify as run_verify

    enabled = show_progress(json or jsonl)
    with (
        reading(path, storage_option, data=deep, enabled=enabled) as place,
        progress_bar("checking index files and listings", None, enabled) as advance,
    ):
        result = run_verify(place.local, deep=deep, progress=advance if enabled else None, jobs=jobs)
    if place.url is not None:  # reports name the URL, not the local mirror they were made from
        result.path = place.url  # type: ignore[assignment]
        for report in result.checkpoints:
            report.path = place.show(report.path)  # type: ignore[assignment]
    if jsonl:
        print_jsonl(problem_rows(result.checkpoints))
    elif json:
        print_json(summarised(result, summary_limit(all_items)), pretty)
    else:
        _print_human(result.checkpoints, all_items)
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
