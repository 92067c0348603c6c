"""What every command shares: option aliases, output to stdout/stderr, progress, errors."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import orjson
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rbtool.errors import MissingTrajectoryFilesError, OutputExistsError, RbtoolError

# Results go to stdout; progress, warnings and errors to stderr.
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON document on stdout.")]
ForceOpt = Annotated[
    bool, typer.Option("--force", help="Replace OUT if it is an existing checkpoint directory.")
]
WorldSizeOpt = Annotated[int, typer.Option("--world-size", "-n", min=1, help="Number of ranks.")]
WindowOpt = Annotated[
    int, typer.Option("--window", "-w", min=0, help="Sampling window: the last N trajectories (0 = all).")
]
StrictOpt = Annotated[
    bool,
    typer.Option(
        "--strict/--non-strict",
        help="Refuse a checkpoint whose index names missing files (--non-strict keeps what exists).",
    ),
]
FormatOpt = Annotated[str | None, typer.Option("--format", help="Trajectory file format: pt or pkl.")]
ExistingPath = Annotated[Path, typer.Argument(exists=False, help="A checkpoint or buffer directory.")]


def print_json(doc: Any) -> None:
    """Write one JSON document to stdout (as bytes where possible: documents can be hundreds of MB)."""
    data = orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE)
    binary = getattr(sys.stdout, "buffer", None)
    if binary is None:
        sys.stdout.write(data.decode())
    else:
        sys.stdout.flush()
        binary.write(data)
    sys.stdout.flush()


def fail(message: str) -> NoReturn:
    """Report an input or checkpoint error as one line on stderr and exit 1."""
    first_line = " ".join(str(message).split("\n")[0].split()) or "unknown error"
    err.print(f"Error: {first_line}", markup=False, highlight=False)
    raise typer.Exit(1)


def show_progress(json_mode: bool) -> bool:
    """Progress bars only for a person at a terminal, never with --json."""
    return not json_mode and err.is_terminal


@contextmanager
def progress_bar(description: str, total: int | None, enabled: bool) -> Iterator[Any]:
    """A Rich progress bar on stderr; yields `advance(n)` (a no-op when disabled)."""
    if not enabled:
        yield lambda n=1: None
        return
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n=1: progress.advance(task, n)


# The command being run (set by the command-line groups as they resolve it).
INVOKED: list[Any] = []


def _option_hint(exc: RbtoolError) -> str:
    """The command-line option that answers a library error, for the commands that have it."""
    options = {opt for c in INVOKED for p in c.params for opt in (*p.opts, *p.secondary_opts)}
    if isinstance(exc, MissingTrajectoryFilesError) and "--non-strict" in options:
        return "; pass --non-strict to keep only what exists"
    if isinstance(exc, OutputExistsError) and "--force" in options:
        return "; pass --force to replace it"
    return ""


def handle_library_errors(exc: BaseException) -> NoReturn:
    """The one place where library errors become `Error: ...` and exit status 1."""
    if isinstance(exc, RbtoolError):
        fail(str(exc) + _option_hint(exc))
    raise exc


# ------------------------------------------------------------ shared by commands
def refuse_overlap(target: Path, inputs: Sequence[Path], option: str) -> None:
    """Refuse an output path that is, lies inside, or contains an input: writing it would change the input."""
    resolved = Path(os.path.realpath(target))
    for given in inputs:
        source = Path(os.path.realpath(given))
        if resolved == source or source in resolved.parents or resolved in source.parents:
            raise typer.BadParameter(
                f"{target} overlaps the input {given}; choose a path outside it", param_hint=option
            )


def check_format(value: str | None) -> None:
    """Reject a --format other than pt or pkl as a usage error."""
    if value is not None and value not in ("pt", "pkl"):
        raise typer.BadParameter(f"must be pt or pkl, got {value!r}", param_hint="--format")


def state_table(title: str, rows: list[tuple[str, dict[str, Any]]]) -> Table:
    """A table of (label, state) rows: size, samples, counter and ids of each."""
    table = Table(title=title, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("size", justify="right")
    table.add_column("total samples", justify="right")
    table.add_column("counter", justify="right")
    table.add_column("trajectory ids")
    for label, state in rows:
        table.add_row(
            label,
            str(state["size"]),
            str(state["total_samples"]),
            str(state["trajectory_counter"]),
            format_ids(state["trajectory_id_list"]),
        )
    return table


def format_ids(ids: list[int]) -> str:
    """Ids for a person: runs of consecutive ids collapsed to `a-b`."""
    if not ids:
        return "(none)"
    runs: list[str] = []
    start = prev = ids[0]
    for i in [*ids[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(runs)


def files_line(files: dict[str, int]) -> str:
    """How trajectory files were placed, for a person."""
    placed = f"{files['linked']} linked, {files['copied']} copied, {files['written']} written"
    return f"{placed}, {files['bytes']} bytes"
