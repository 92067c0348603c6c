"""What every command shares: the group class, option aliases, output, progress, error reporting.

Command modules import only this module (never each other, never the library at import
time: each command imports what it calls inside its function, so `rbtool --help` stays fast).
"""

from __future__ import annotations

import enum
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import orjson
import typer
from rich.console import Console
from typer.core import TyperGroup

from rbtool.errors import (
    FieldsLeftOutWarning,
    MissingTrajectoryFilesError,
    NeedsTrajectoryFilesError,
    OutputExistsError,
    RbtoolError,
    UsageError,
)

if TYPE_CHECKING:
    from rich.table import Table

# Results go to stdout; progress, warnings and errors to stderr.
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


# ------------------------------------------------------------ errors
# Library errors that a command-line option answers: (error class, option, hint). The hint
# is added only when the running command has the option; library messages never name flags.
OPTION_HINTS: tuple[tuple[type[Exception], str, str], ...] = (
    (MissingTrajectoryFilesError, "--non-strict", "pass --non-strict to keep only what exists"),
    (OutputExistsError, "--force", "choose another path or pass --force to replace it"),
    (NeedsTrajectoryFilesError, "--index-only", "drop --index-only"),
)

# ctx.meta key (shared by every nested context) under which groups record the command they run.
_COMMAND = "rbtool.command"


def _options(command: Any) -> set[str]:
    return {opt for p in getattr(command, "params", []) for opt in (*p.opts, *p.secondary_opts)}


def option_hint(exc: Exception, command: Any) -> str:
    """`; <hint>` for the first option that answers `exc`, if the command has that option."""
    options = _options(command)
    for cls, option, hint in OPTION_HINTS:
        if isinstance(exc, cls) and option in options and option not in str(exc):
            return f"; {hint}"
    return ""


def one_line(message: object) -> str:
    """The first line of a message, whitespace collapsed."""
    return " ".join(str(message).split("\n")[0].split())


def print_error(message: str) -> None:
    """`Error: <first line of message>` on stderr."""
    err.print(f"Error: {one_line(message) or 'unknown error'}", markup=False, highlight=False)


def print_warning(warning: Warning | str, command: Any) -> None:
    """A library warning as one line `Warning: ...` on stderr, in the command line's terms."""
    if isinstance(warning, FieldsLeftOutWarning) and "--all-fields" in _options(command):
        text = (
            f"sampled batches leave out {', '.join(warning.fields)} (RLinf's sampler ignores them); "
            "pass --all-fields to sample them"
        )
    else:
        text = one_line(warning)
        if isinstance(warning, Warning):
            text += option_hint(warning, command)
    err.print(f"Warning: {text}", markup=False, highlight=False)


def exit_status(exc: RbtoolError) -> int:
    """2 for a usage error found by the library's checks, 1 for anything wrong with the input."""
    return 2 if isinstance(exc, UsageError) else 1


class Group(TyperGroup):
    """A command group that records the command it resolves.

    The root group is the one place where library errors become exit statuses: a
    `UsageError` is `Error: ...` and exit 2, any other `RbtoolError` `Error: ...` and exit 1,
    each with the hint of the running command's option that answers it; an OSError that
    escaped the library is one line and exit 1 too; anything else is a bug and keeps its
    traceback. Library warnings become one line `Warning: ...` each.
    """

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        name, command, rest = super().resolve_command(ctx, args)
        ctx.meta[_COMMAND] = command
        return name, command, rest

    def invoke(self, ctx: Any) -> Any:
        if ctx.parent is not None:  # a nested group: the root maps what it raises
            return super().invoke(ctx)

        def show_warning(message: Warning | str, *args: Any, **kwargs: Any) -> None:
            print_warning(message, ctx.meta.get(_COMMAND))

        with warnings.catch_warnings():  # restores showwarning afterwards
            warnings.showwarning = show_warning
            try:
                return super().invoke(ctx)
            except RbtoolError as exc:
                print_error(str(exc) + option_hint(exc, ctx.meta.get(_COMMAND)))
                raise typer.Exit(exit_status(exc)) from None
            except OSError as exc:  # the library maps these itself; this is the last net
                from rbtool.fsutil import os_error

                print_error(str(os_error(exc, exc.filename or "?")))
                raise typer.Exit(1) from None


# ------------------------------------------------------------ options
class TrajectoryFormat(str, enum.Enum):
    """How trajectory files are serialised."""

    pt = "pt"
    pkl = "pkl"


JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON document on stdout.")]
JobsOpt = Annotated[
    int | None,
    typer.Option(
        "--jobs",
        "-j",
        min=1,
        help="Files worked on at once (default: the number of cores).",
        show_default=False,
    ),
]
CopyOpt = Annotated[
    bool,
    typer.Option(
        "--copy",
        help="Write trajectory files of the output's own: reflinked (copy-on-write) where the file "
        "system can, else copied; never hard links to the input's files.",
    ),
]
ForceOpt = Annotated[
    bool, typer.Option("--force", help="Replace OUT if it is an existing checkpoint directory.")
]
RanksForceOpt = Annotated[
    bool, typer.Option("--force", help="Replace OUT if it is empty, a checkpoint or an earlier shard output.")
]
SourceArg = Annotated[
    Path, typer.Argument(metavar="IN", help="A checkpoint, or a folder of rank_* checkpoints.")
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
FormatOpt = Annotated[
    TrajectoryFormat | None, typer.Option("--format", help="Trajectory file format.", show_default=False)
]
ExistingPath = Annotated[Path, typer.Argument(exists=False, help="A checkpoint or buffer directory.")]


class Strategy(str, enum.Enum):
    """How sample positions are drawn from the window."""

    uniform = "uniform"
    topk = "topk"


StrategyOpt = Annotated[
    Strategy,
    typer.Option(
        "--strategy",
        help="uniform: every sample of the window alike; topk: among the K highest-reward samples.",
    ),
]
KOpt = Annotated[
    int | None, typer.Option("--k", min=1, help="topk: how many highest-reward samples are candidates.")
]
TemperatureOpt = Annotated[
    float,
    typer.Option(
        "--temperature", help="topk: weights are softmax(reward / T); larger T spreads draws more evenly."
    ),
]
SeedOpt = Annotated[
    int | None, typer.Option("--seed", help="Generator seed (default: the checkpoint's seed, else 1234).")
]


def refuse_k_without_topk(strategy: Strategy, k: int | None) -> None:
    """--k means nothing to uniform draws (the library ignores it): a usage error, exit 2."""
    if strategy is Strategy.uniform and k is not None:
        raise typer.BadParameter("applies only to --strategy topk", param_hint="--k")


# ------------------------------------------------------------ output
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


def show_progress(json_mode: bool) -> bool:
    """Progress bars only for a person at a terminal, never with --json."""
    return not json_mode and err.is_terminal


@contextmanager
def progress_bar(description: str, total: int | None, enabled: bool) -> Iterator[Any]:
    """A Rich progress bar on stderr; yields `advance(n)` (a no-op when disabled)."""
    if not enabled:
        yield lambda n=1: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

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


def state_table(title: str, rows: list[tuple[str, dict[str, Any]]]) -> Table:
    """A table of (label, state) rows: size, samples, counter and ids of each."""
    from rich.table import Table

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
    placed = (
        f"{files['reflinked']} reflinked, {files['linked']} linked, "
        f"{files['copied']} copied, {files['written']} written"
    )
    return f"{placed}, {files['bytes']} bytes"
