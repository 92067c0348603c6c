"""`rbtool verify`: check a checkpoint, a buffer directory, or a folder of rank_* checkpoints."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.text import Text

from rbtool.cli._consoles import out
from rbtool.cli._json import bound, insert_after, print_jsonl
from rbtool.cli._options import (
    Lines,
    Pass,
    PathsArg,
    StorageOpt,
)
from rbtool.cli._output import Fitted, check_table, count, head, id_ranges, left_out, more_note, verdict
from rbtool.cli._places import EachPath, pass_lines
from rbtool.cli._progress import show_progress

if TYPE_CHECKING:
    from rbtool.ops.verify import CheckpointReport
    from rbtool.remote.places import Place

MAX_ROWS = 50  # problems shown per checkpoint in the human view; --all shows them all
_STYLE = {"error": "bold red", "warning": "yellow", "notice": "cyan"}


def _summary(report: CheckpointReport) -> Text:
    counts = report.counts()
    parts = [count(n, sev) for sev, n in counts.items() if n]
    size = "index unreadable" if report.size is None else count(report.size, "trajectory", "trajectories")
    if report.size is None and any(p.code == "rank_missing" for p in report.problems):
        size = "missing"
    return verdict(report.ok, f" {report.path} ({size}; {', '.join(parts) or 'no problems'})")


def _problem_table(report: CheckpointReport, limit: int | None) -> Fitted:
    rows = [
        [
            Text(problem.severity, style=_STYLE[problem.severity]),
            Text(problem.code),
            Text("" if problem.trajectory_id is None else str(problem.trajectory_id)),
            problem.message,  # plain text, control characters escaped
        ]
        for problem in head(report.problems, limit)
    ]
    # a message names files: at a narrow terminal the id, then the code, are left out before
    # a file name would have to be broken across lines
    return check_table(("severity", "code", "id", "message"), (1, 2), rows)


def _print_human(reports: list[CheckpointReport], every: bool) -> None:
    limit = None if every else MAX_ROWS
    for report in reports:
        out.print(_summary(report))
        if not report.problems:
            continue
        out.print(_problem_table(report, limit))
        hidden = report.problems[MAX_ROWS:] if limit is not None else []
        if hidden:
            out.print(more_note((p.code for p in hidden), "problem"), markup=False)


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


def problem_rows(reports: list[CheckpointReport], given: str) -> Iterator[dict[str, Any]]:
    """One dict per problem: the path given, its checkpoint directory, the problem; in the order checked."""
    for report in reports:
        path = str(report.path)
        for p in report.problems:
            yield {
                "path": given,
                "checkpoint": path,
                "code": p.code,
                "severity": p.severity,
                "trajectory_id": p.trajectory_id,
                "file": p.file,
                "message": p.message,
            }


def error_codes(result: Any) -> str:
    """`code xN, ...` of a result's errors, most frequent first."""
    counts = Counter(p.code for c in result.checkpoints for p in c.problems if p.severity == "error")
    return ", ".join(f"{code} x{n}" for code, n in counts.most_common())


def _name_url(result: Any, place: Place) -> None:
    """A result of a URL names the URL, not the local mirror it was made from."""
    result.path = place.url
    for report in result.checkpoints:
        report.path = place.show(report.path)


def verify(
    paths: PathsArg,
    deep: Annotated[
        bool,
        typer.Option(
            "--deep",
            help="Also load every trajectory file (safely) and check shapes, schema, NaN/Inf and hashes.",
        ),
    ] = False,
    passes: Pass = Pass(),
    output: Lines = Lines(),
    storage_option: StorageOpt = None,
) -> None:
    """Check that checkpoints are consistent; exit 1 if any error is found in any of them.

    The quick check reads only the index files and the directory listing. Notices (files an
    interrupted writer left) and warnings (differing field schemas) do not fail it. Several
    paths are checked in turn, each reported on its own.
    """
    if passes.journal is not None and not deep:
        raise typer.BadParameter(
            "the quick check reads no trajectory file: add --deep", param_hint="--journal"
        )
    from rbtool.ops.verify import verify as run_verify

    enabled = show_progress(output.json or output.jsonl)
    each = EachPath(paths, storage_option, data=deep, enabled=enabled)
    for i, path in enumerate(paths):
        result = each.run(
            path,
            "checking index files and listings",
            lambda place, advance, own: run_verify(
                place.local, deep=deep, progress=advance, jobs=passes.jobs, journal=own
            ),
            passes.journal,
            _name_url,
        )
        if result is None:
            continue
        if output.jsonl:
            print_jsonl(problem_rows(result.checkpoints, str(path)))
        elif output.json:
            each.documents.append(summarised(result, output.limit))
        else:
            if i:
                out.print()  # a blank line between paths
            _print_human(result.checkpoints, output.all_items)
            if deep:
                pass_lines("deep pass: ", result)
        if not result.ok:
            errors = sum(1 for c in result.checkpoints for p in c.problems if p.severity == "error")
            message = f"{path}: verification failed with {count(errors, 'error')}: {error_codes(result)}"
            each.fail(path, error_codes(result), message, output.pretty if output.json else None)
    each.finish("verification", output.pretty if output.json else None)
