"""`rbtool doctor`: check what is in the trajectories of a checkpoint, not only that it is whole."""

from __future__ import annotations

from collections.abc import Iterator
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.text import Text

from rbtool.cli._consoles import out
from rbtool.cli._json import bound, insert_after, print_jsonl
from rbtool.cli._options import Lines, Pass, PathsArg, StorageOpt, refuse_output_mix
from rbtool.cli._output import (
    Fitted,
    check_table,
    count,
    head,
    id_ranges,
    id_runs,
    left_out,
    more_note,
    verdict,
)
from rbtool.cli._places import EachPath, pass_lines
from rbtool.cli._progress import show_progress

if TYPE_CHECKING:
    from rbtool.ops.doctor import Finding, Report
    from rbtool.remote.places import Place

MAX_ROWS = 50  # findings shown per path in the table and --markdown; --all shows them all
_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


class FailOn(str, Enum):
    error = "error"
    warning = "warning"


def _where(f: Finding) -> str:
    parts = []
    if f.envs is not None:
        parts.append(f"envs {', '.join(map(str, f.envs))}")
    if f.steps is not None:
        parts.append(f"steps {', '.join(map(str, f.steps))}")
    return "; ".join(parts)


def _ids(f: Finding, report: Report, every: bool) -> str:
    """The ids as runs (the first 20 unless --all), after their rank directory's name when the
    report covers several directories."""
    ids = ", ".join(map(str, f.ids)) if len(f.ids) <= 2 else id_runs(f.ids, None if every else 20)
    if len(report.checkpoints) > 1 and f.checkpoint:
        return f"{f.checkpoint.rstrip('/').rsplit('/', 1)[-1]}: {ids}"
    return ids


def _level_count(n: int, level: str) -> str:
    """`2 errors`, `1 warning`, `3 info`."""
    return count(n, level, "info" if level == "info" else None)


def _summary(report: Report, fail_on: str) -> Text:
    counts = report.counts()
    parts = [_level_count(n, level) for level, n in counts.items() if n]
    failed = report.fails(fail_on)
    trajectories = count(report.trajectories, "trajectory", "trajectories")
    return verdict(not failed, f" {report.path} ({trajectories}; {', '.join(parts) or 'no findings'})")


def _table(findings: list[Finding], report: Report, every: bool) -> Fitted:
    rows = [
        [
            Text(f.level, style=_STYLE[f.level]),
            Text(f.check),
            Text(_ids(f, report, every)),
            Text(f"{f.message}" + (f" ({_where(f)})" if _where(f) else "") + f". {f.advice}"),
        ]
        for f in findings
    ]
    return check_table(("level", "check", "ids", "message"), (2, 1), rows)


def _hidden_note(hidden: list[Finding]) -> str:
    return more_note((f.check for f in hidden), "finding")


def _print_human(report: Report, fail_on: str, every: bool) -> None:
    out.print(_summary(report, fail_on))
    if not report.findings:
        return
    limit = None if every else MAX_ROWS
    out.print(_table(head(report.findings, limit), report, every))
    hidden = report.findings[MAX_ROWS:] if limit is not None else []
    if hidden:
        out.print(_hidden_note(hidden), markup=False)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_lines(report: Report, fail_on: str, every: bool) -> Iterator[str]:
    """A report fit for a CI job summary or a pull-request comment."""
    counts = report.counts()
    failed = report.fails(fail_on)
    yield f"## rbtool doctor: `{report.path}`"
    yield ""
    tally = ", ".join(_level_count(n, level) for level, n in counts.items() if n) or "no findings"
    verdict = "FAILED" if failed else "OK"
    trajectories = count(report.trajectories, "trajectory", "trajectories")
    yield f"**{verdict}** (fail on {fail_on}): {trajectories}, {tally}."
    if not report.findings:
        return
    yield ""
    yield "| level | check | ids | field | where | finding | what to do |"
    yield "|---|---|---|---|---|---|---|"
    limit = None if every else MAX_ROWS
    for f in head(report.findings, limit):
        cells = [f.level, f.check, _ids(f, report, every), f.field or "", _where(f), f.message, f.advice]
        yield "| " + " | ".join(_cell(c) for c in cells) + " |"
    hidden = report.findings[MAX_ROWS:] if limit is not None else []
    if hidden:
        yield ""
        yield _hidden_note(hidden)


def by_check(report: Report, limit: int | None) -> list[dict[str, Any]]:
    """One summary per (level, check, field): how many findings, and their ids as runs."""
    groups: dict[tuple[str, str, str | None], list[Finding]] = {}
    for f in report.findings:
        groups.setdefault((f.level, f.check, f.field), []).append(f)
    rows = []
    for (level, check, fld), found in groups.items():
        runs = id_ranges(sorted({i for f in found for i in f.ids}))
        rows.append(
            {
                "level": level,
                "check": check,
                "field": fld,
                "count": len(found),
                "id_ranges": head(runs, limit),
                "id_ranges_left_out": left_out(runs, limit),
            }
        )
    return rows


def summarised(report: Report, limit: int | None, fail_on: str) -> dict[str, Any]:
    """The --json document: the findings cut to `limit` (None: all), with a summary by check."""
    doc = report.as_json()
    doc["ok"] = not report.fails(fail_on)
    bound(doc, "findings", limit)
    for finding in doc["findings"]:  # one finding may name every trajectory (unpaired observations)
        finding["ids_left_out"] = left_out(finding["ids"], limit)
        finding["ids"] = head(finding["ids"], limit)
    insert_after(doc, "counts", {"by_check": by_check(report, limit)})
    return doc


def finding_rows(report: Report, given: str) -> Iterator[dict[str, Any]]:
    for f in report.findings:
        yield {"path": given, **f.as_json()}


CheckOpt = Annotated[
    list[str] | None,
    typer.Option("--check", metavar="NAME", help="Run only this check (repeatable; default: every check)."),
]
SkipOpt = Annotated[
    list[str] | None, typer.Option("--skip", metavar="NAME", help="Leave this check out (repeatable).")
]


def _name_url(report: Report, place: Place) -> None:
    """A report of a URL names the URL, not the local mirror it was made from."""
    report.path = place.url  # type: ignore[assignment]
    report.checkpoints = [str(place.show(c)) for c in report.checkpoints]
    for f in report.findings:
        f.checkpoint = str(place.show(f.checkpoint))


def doctor(
    paths: PathsArg,
    check: CheckOpt = None,
    skip: SkipOpt = None,
    fail_on: Annotated[
        FailOn,
        typer.Option("--fail-on", help="Exit 1 when a finding reaches this level (error, or warning)."),
    ] = FailOn.error,
    frozen_field: Annotated[
        list[str] | None,
        typer.Option(
            "--frozen-field",
            metavar="FIELD",
            help="A dotted field the frozen check looks at (repeatable; default: actions).",
        ),
    ] = None,
    reward_range: Annotated[
        tuple[float, float] | None,
        typer.Option("--reward-range", metavar="LOW HIGH", help="Report rewards outside [LOW, HIGH]."),
    ] = None,
    max_staleness: Annotated[
        float | None,
        typer.Option(
            "--max-staleness",
            metavar="V",
            help="Report trajectories whose newest version is more than V behind the checkpoint's newest.",
        ),
    ] = None,
    markdown: Annotated[
        bool, typer.Option("--markdown", help="Print a Markdown report (a CI summary, a PR comment).")
    ] = False,
    passes: Pass = Pass(),
    output: Lines = Lines(),
    storage_option: StorageOpt = None,
) -> None:
    """Check what the trajectories hold: NaN, frozen actions, blank cameras, done flags,
    observation pairing, policy identity, duplicates, rewards, episodes, index agreement.

    Exit 1 when a finding reaches --fail-on (default: error). Several paths are checked in
    turn, each reported on its own.
    """
    refuse_output_mix(output.json, output.jsonl, output.pretty)
    if markdown and (output.json or output.jsonl):
        raise typer.BadParameter("give --markdown, --json or --jsonl, not two", param_hint="--markdown")
    if reward_range is not None and reward_range[0] > reward_range[1]:
        raise typer.BadParameter("LOW must not be above HIGH", param_hint="--reward-range")
    from rbtool.ops.doctor import doctor as run_doctor
    from rbtool.ops.doctor import select_checks

    select_checks(check, skip or ())  # an unknown name is a usage error before anything is read
    enabled = show_progress(output.json or output.jsonl or markdown)
    each = EachPath(paths, storage_option, data=True, enabled=enabled)
    level = fail_on.value
    for i, path in enumerate(paths):
        report = each.run(
            path,
            "checking trajectory files",
            lambda place, advance, own: run_doctor(
                place.local,
                checks=check,
                skip=skip or (),
                frozen_fields=frozen_field or ("actions",),
                reward_range=reward_range,
                max_staleness=max_staleness,
                progress=advance,
                jobs=passes.jobs,
                journal=own,
            ),
            passes.journal,
            _name_url,
        )
        if report is None:
            continue
        if output.jsonl:
            print_jsonl(finding_rows(report, str(path)))
        elif output.json:
            each.documents.append(summarised(report, output.limit, level))
        elif markdown:
            if i:
                out.print()
            for line in markdown_lines(report, level, output.all_items):
                out.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            if i:
                out.print()  # a blank line between paths
            _print_human(report, level, output.all_items)
            pass_lines("", report)
        if report.fails(level):
            counts = report.counts()
            reached = ", ".join(count(counts[lv], lv) for lv in ("error", "warning") if counts[lv])
            message = f"{path}: doctor found {reached} (--fail-on {level})"
            each.fail(path, reached, message, output.pretty if output.json else None)
    each.finish("doctor", output.pretty if output.json else None)
