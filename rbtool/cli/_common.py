"""What every command shares: the group class, option aliases, output, progress, error reporting.

Command modules import only this module (never each other, never the library at import
time: each command imports what it calls inside its function, so `rbtool --help` stays fast).
"""

from __future__ import annotations

import enum
import os
import sys
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import orjson
import typer
from rich.console import Console
from typer.core import TyperCommand, TyperGroup
from typer.exceptions import TyperException

from rbtool.cli._output import Column as Column
from rbtool.cli._output import Fitted as Fitted
from rbtool.cli._output import ResultConsole, SafeConsole, id_runs, size
from rbtool.cli._output import count as count
from rbtool.cli._output import head as head
from rbtool.cli._output import id_ranges as id_ranges
from rbtool.cli._output import key_values as key_values
from rbtool.cli._output import left_out as left_out
from rbtool.cli._output import number as number
from rbtool.cli._output import printable as printable
from rbtool.cli._output import side_by_side as side_by_side
from rbtool.cli._output import unique_prefixes as unique_prefixes
from rbtool.errors import (
    FieldsLeftOutWarning,
    LeftoversRemovedWarning,
    MissingTrajectoryFilesError,
    NeedsTrajectoryFilesError,
    OutputExistsError,
    RbtoolError,
    UsageError,
)

if TYPE_CHECKING:
    from rbtool.remote import IndexMirror

# Results go to stdout (see _output.ResultConsole); progress, warnings and errors to stderr.
# Both escape control characters and read no markup (_output.SafeConsole): names are shown,
# never acted on by the terminal.
out = ResultConsole(highlight=False)
err = SafeConsole(stderr=True, highlight=False, soft_wrap=True)


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
    """`Error: <first line of message>` on stderr, control characters escaped (a message names
    files, keys and ids that others wrote)."""
    err.print(f"Error: {printable(one_line(message)) or 'unknown error'}", markup=False, highlight=False)


def escape_usage_error(exc: Exception) -> None:
    """Escape, in place, the control characters of the parser's message (it may quote a value)."""
    message = getattr(exc, "message", None)
    if isinstance(message, str):
        exc.message = printable(message)  # type: ignore[attr-defined]


def print_warning(warning: Warning | str, command: Any) -> None:
    """A library warning as one line `Warning: ...` on stderr, in the command line's terms."""
    if settings.quiet and isinstance(warning, INFORMATION):
        return
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


# Commands that may run under torchrun with more than one rank: the passes spread over the
# ranks (rbtool.passes.ranks) and read-only commands; a writer started K times would race itself.
OVER_RANKS = frozenset({"verify", "stats", "convert", "export", "diff", "version"})


def _world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) if os.environ.get("RANK") is not None else 1
    except ValueError:
        return 1


class Group(TyperGroup):
    """A command group that records the command it resolves.

    The root group is the one place where library errors become exit statuses: a
    `UsageError` is `Error: ...` and exit 2, any other `RbtoolError` `Error: ...` and exit 1,
    each with the hint of the running command's option that answers it; an OSError that
    escaped the library is one line and exit 1 too; anything else is a bug and keeps its
    traceback. Library warnings become one line `Warning: ...` each.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        root = self.name == ROOT
        adopt(self, "" if root else str(self.name))
        for name, command in self.commands.items():
            adopt(command, name if root else f"{self.name} {name}")

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        if parent is None:
            reset_settings()
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except TyperException as exc:
            escape_usage_error(exc)
            raise

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        """Each command with the whole first paragraph of its description, wrapped, never cut."""
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                text = command.short_help or (command.help or "").split("\n\n")[0]
                rows.append((name, " ".join(text.split())))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        name, command, rest = super().resolve_command(ctx, args)
        ctx.meta[_COMMAND] = command
        if ctx.parent is None and name not in OVER_RANKS and _world_size() > 1:
            from rbtool.errors import UsageError

            raise UsageError(
                f"rbtool {name} does not run over torchrun ranks (each rank would write the same "
                f"output); run it as one process. Over ranks: {', '.join(sorted(OVER_RANKS))}"
            )
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
            except typer.BadParameter as exc:  # the parser's own words about a value, made plain
                from rbtool.cli._errors import plain_option_error

                plain_option_error(exc)
                escape_usage_error(exc)
                raise
            except TyperException as exc:  # another usage error: a value it quotes is escaped
                escape_usage_error(exc)
                raise
            except RbtoolError as exc:
                from rbtool.cli._errors import fix_hint

                command = ctx.meta.get(_COMMAND)
                print_error(str(exc) + option_hint(exc, command) + fix_hint(exc, command))
                raise typer.Exit(exit_status(exc)) from None
            except BrokenPipeError:
                if not stdout_closed():
                    raise  # a pipe of the command's own: an error like any other
                # the reader of our stdout stopped (`| head`): stop quietly, as other tools do
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())  # nothing left unflushed fails again at exit
                os.close(devnull)
                raise typer.Exit(BROKEN_PIPE_STATUS) from None
            except OSError as exc:  # the library maps these itself; this is the last net
                from rbtool.files.fsutil import os_error

                print_error(str(os_error(exc, exc.filename or "?")))
                raise typer.Exit(1) from None


# ------------------------------------------------------------ help
def plain_metavar(param: Any) -> str:
    """What a value is called in help: N, X, PATH, TEXT, or its choices `[pt|pkl]`; never a Python type."""
    desc = getattr(param, "type_descriptor", None)
    choices = getattr(desc, "choices", None)
    if choices:
        return "[" + "|".join(str(getattr(c, "value", c)) for c in choices) + "]"
    annotation = getattr(desc, "annotation", None)
    if getattr(desc, "is_list", False):
        args = getattr(annotation, "__args__", ())
        annotation = args[0] if args else None
    if getattr(desc, "is_path", False) or annotation is Path:
        return "PATH"
    return {int: "N", float: "X", str: "TEXT"}.get(annotation, "VALUE")  # type: ignore[arg-type]


def _argument_name(param: Any) -> str:
    name = param.metavar or (param.name or "").upper()
    return name + ("..." if param.nargs != 1 else "")


class Command(TyperCommand):
    """A command whose help names values plainly (`PATH...`, `N`, `[pt|pkl]`) rather than by
    Python type (`<list[Path]>`, `<int range>`); ranges and defaults stay in the brackets after
    each option's help."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                name = _argument_name(param)
                pieces.append(name if param.required else f"[{name}]")
        return pieces

    def format_options(self, ctx: Any, formatter: Any) -> None:
        arguments, options = [], []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                record = param.get_help_record(ctx)
                if record is not None:
                    arguments.append((_argument_name(param), record[1]))
            elif param.param_type_name == "option":
                given = param.metavar
                if given is None and not (getattr(param, "is_flag", False) or getattr(param, "count", False)):
                    param.metavar = plain_metavar(param)
                try:
                    record = param.get_help_record(ctx)
                finally:
                    param.metavar = given
                if record is not None:
                    options.append(record)
        for title, rows in (("Arguments", arguments), ("Options", options)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


# ------------------------------------------------------------ options
# Lists that grow with a checkpoint are cut to their first SUMMARY_ITEMS items unless --all.
SUMMARY_ITEMS = 20


class TrajectoryFormat(str, enum.Enum):
    """How trajectory files are serialised."""

    pt = "pt"
    pkl = "pkl"


JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print exactly one JSON document on stdout (compact; see --pretty).")
]
PrettyOpt = Annotated[bool, typer.Option("--pretty", help="With --json: indent the document for reading.")]
JsonlOpt = Annotated[
    bool,
    typer.Option(
        "--jsonl", help="Print JSON Lines on stdout: one compact object per trajectory or problem, streamed."
    ),
]
AllOpt = Annotated[
    bool,
    typer.Option(
        "--all", help=f"List everything (default: counts, id ranges and the first {SUMMARY_ITEMS} items)."
    ),
]
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
JournalOpt = Annotated[
    Path | None,
    typer.Option(
        "--journal",
        help="Record each file read in DIR as it is done; a rerun with the same DIR skips the recorded "
        "files whose files are unchanged (resume after a crash or a lost rank).",
        metavar="DIR",
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
    str, typer.Argument(metavar="IN", help="A checkpoint, or a folder of rank_* checkpoints (or a URL).")
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
    TrajectoryFormat | None,
    typer.Option(
        "--format",
        help="Trajectory file format (default: the format the buffer or input already has, else pt).",
        show_default=False,
    ),
]
ExistingPath = Annotated[Path, typer.Argument(exists=False, help="A checkpoint or buffer directory.")]
PathsArg = Annotated[
    list[str],
    typer.Argument(
        metavar="PATH",
        help="Checkpoints or buffer directories, or folders of rank_* checkpoints (or URLs); each is "
        "reported.",
        show_default=False,
    ),
]
WideOpt = Annotated[
    bool,
    typer.Option(
        "--wide",
        help="At a terminal, keep every column and whole model_weights_ids even where lines get "
        "longer than the terminal (piped output always has them).",
    ),
]


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
    """--k means nothing to uniform draws (the library ignores it), and topk needs it: usage errors,
    exit 2, in the options' words."""
    if strategy is Strategy.uniform and k is not None:
        raise typer.BadParameter("applies only to --strategy topk", param_hint="--k")
    if strategy is Strategy.topk and k is None:
        raise UsageError("--strategy topk needs --k K (how many highest-reward samples are candidates)")


# ------------------------------------------------------------ output
_CHUNK_ITEMS = 65536  # a long list is serialised this many items at a time
_WRITE_BYTES = 1 << 20  # output is written in blocks of about this size
_NUMPY = orjson.OPT_SERIALIZE_NUMPY


def refuse_output_mix(json: bool, jsonl: bool = False, pretty: bool = False) -> None:
    """--json and --jsonl exclude each other; --pretty indents --json only (usage errors, exit 2)."""
    if json and jsonl:
        raise typer.BadParameter("give --json or --jsonl, not both", param_hint="--jsonl")
    if pretty and not json:
        raise typer.BadParameter("applies only with --json", param_hint="--pretty")


def summary_limit(all_items: bool) -> int | None:
    """How many items a summarised list keeps: None (all) with --all."""
    return None if all_items else SUMMARY_ITEMS


def bound(doc: dict[str, Any], key: str, limit: int | None, *, ranges: str | None = None) -> None:
    """Cut the list `doc[key]` to its first `limit` items and add `<key>_left_out` after it.

    With `ranges`, the ids of the whole list are first added as `ranges` (runs of consecutive
    ids, themselves cut to `limit` runs, with `<ranges>_left_out`). A null list stays null.
    """
    items = doc[key]
    extra: dict[str, Any] = {}
    if items is None:
        extra[f"{key}_left_out"] = None
        if ranges is not None:
            extra[ranges] = extra[f"{ranges}_left_out"] = None
    else:
        extra[f"{key}_left_out"] = left_out(items, limit)
        if ranges is not None:
            runs = id_ranges(items)
            extra[ranges] = head(runs, limit)
            extra[f"{ranges}_left_out"] = left_out(runs, limit)
        doc[key] = head(items, limit)
    insert_after(doc, key, extra)


def insert_after(doc: dict[str, Any], key: str, extra: dict[str, Any]) -> None:
    """Put the keys of `extra` right after `key` in `doc` (in place): new keys beside what they describe."""
    placed: dict[str, Any] = {}
    for k, v in doc.items():
        if k not in extra:
            placed[k] = v
        if k == key:
            placed.update(extra)
    doc.clear()
    doc.update(placed)


def bound_state(state: dict[str, Any], limit: int | None) -> dict[str, Any]:
    """A copy of a checkpoint state for --json: `trajectory_id_list` cut to `limit` ids, with its runs."""
    state = dict(state)
    bound(state, "trajectory_id_list", limit, ranges="trajectory_id_ranges")
    return state


def _is_long(value: Any) -> bool:
    return (
        not isinstance(value, (str, bytes, dict)) and hasattr(value, "__len__") and len(value) > _CHUNK_ITEMS
    )


def _json_chunks(value: Any) -> Iterator[bytes]:
    """Compact JSON of `value` in pieces: long lists (and numpy arrays) a block at a time."""
    if isinstance(value, dict) and any(_is_long(v) or isinstance(v, dict) for v in value.values()):
        yield b"{"
        for i, (key, item) in enumerate(value.items()):
            yield (b"," if i else b"") + orjson.dumps(key) + b":"
            yield from _json_chunks(item)
        yield b"}"
    elif _is_long(value):
        yield b"["
        for start in range(0, len(value), _CHUNK_ITEMS):
            block = value[start : start + _CHUNK_ITEMS]
            if not isinstance(block, list) and not hasattr(block, "dtype"):
                block = list(block)
            yield (b"," if start else b"") + orjson.dumps(block, default=_plain, option=_NUMPY)[1:-1]
        yield b"]"
    elif isinstance(value, list) and any(_is_long(v) or isinstance(v, dict) for v in value):
        yield b"["
        for i, item in enumerate(value):
            yield b"," if i else b""
            yield from _json_chunks(item)
        yield b"]"
    else:
        yield orjson.dumps(value, default=_plain, option=_NUMPY)


def _write_blocks(pieces: Iterable[bytes]) -> None:
    """Write byte pieces to stdout in blocks of about _WRITE_BYTES (as text where stdout has no buffer)."""
    binary = getattr(sys.stdout, "buffer", None)

    def emit(data: bytearray) -> None:
        if binary is None:
            sys.stdout.write(data.decode())
        else:
            binary.write(data)

    sys.stdout.flush()
    pending = bytearray()
    for piece in pieces:
        pending += piece
        if len(pending) >= _WRITE_BYTES:
            emit(pending)
            pending.clear()
    emit(pending)
    if binary is not None:
        binary.flush()
    sys.stdout.flush()


def print_json(doc: Any, pretty: bool = False) -> None:
    """Write one JSON document to stdout: compact and streamed a block at a time, or indented with `pretty`.

    Values may be numpy arrays or lazy columns (sequences that build items on access): a
    complete listing is serialised block by block and never held whole as text. An indented
    document is built whole (it is for reading, and summaries are small).
    """
    if pretty:
        data = orjson.dumps(doc, default=_plain, option=orjson.OPT_INDENT_2 | _NUMPY)
        _write_blocks([data, b"\n"])
    else:
        _write_blocks(chain(_json_chunks(doc), [b"\n"]))


BROKEN_PIPE_STATUS = 141  # 128 + SIGPIPE: what a tool killed by a closed pipe exits with


def stdout_closed() -> bool:
    """Whether stdout is a pipe (or socket) that nobody reads any more."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no descriptor (captured), or no poll
        return False


def _plain(value: Any) -> Any:
    """orjson's fallback: a lazy column (a sequence that builds items on access) as a list."""
    if hasattr(value, "__len__") and hasattr(value, "__getitem__"):
        return list(value)
    raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")


def print_jsonl(rows: Iterable[Any]) -> None:
    """Write one compact JSON object per line to stdout, row by row (nothing waits for the last row)."""
    _write_blocks(
        orjson.dumps(row, default=_plain, option=orjson.OPT_APPEND_NEWLINE | _NUMPY) for row in rows
    )


def show_progress(json_mode: bool) -> bool:
    """Progress bars only for a person at a terminal, never with --json, --jsonl, -q or --no-progress,
    and under torchrun only on rank 0 (one bar, not one per rank over each other)."""
    return (
        not json_mode and settings.progress and _stderr_is_terminal() and os.environ.get("RANK", "0") == "0"
    )


def _stderr_is_terminal() -> bool:
    # FORCE_COLOR (set by many CI systems for colour in their logs) makes Rich treat a log as a
    # terminal; colour, yes, but a log gets no progress bars: then the device itself decides.
    if not err.is_terminal:
        return False
    if "FORCE_COLOR" not in os.environ:
        return True
    try:
        return err.file.isatty()
    except (AttributeError, ValueError):
        return False


class Advance:
    """What `progress_bar` yields: `advance(n)` counts n more done; `advance.start(total, description)`
    begins a counted phase (library functions call it before each loop they report)."""

    def __init__(self, progress: Any = None, task: Any = None) -> None:
        self._progress = progress
        self._task = task

    def __call__(self, n: int = 1) -> None:
        if self._progress is not None and n:
            self._progress.advance(self._task, n)

    def phase(self, done: int, description: str) -> None:
        """Name the phase under way, `done` steps of the bar's total behind it."""
        if self._progress is not None:
            self._progress.update(self._task, completed=done, description=printable(description))

    def start(self, total: int | None, description: str | None = None) -> None:
        if self._progress is not None:
            changes: dict[str, Any] = {"total": total, "completed": 0}
            if description is not None:
                changes["description"] = printable(description)
            self._progress.reset(self._task, **changes)


class _PhaseLog(Advance):
    """An Advance for -v without a bar: one stderr line per phase, with the time the last one took."""

    def __init__(self, description: str) -> None:
        import time

        super().__init__()
        self._clock = time.perf_counter
        self._description = description
        self._started = self._clock()
        self._done = 0
        detail(f"{description} ...")

    def __call__(self, n: int = 1) -> None:
        self._done += n

    def _finished(self, now: float) -> None:
        done = f"{self._done} done " if self._done else ""
        detail(f"{self._description}: {done}in {now - self._started:.2f} s")

    def _next(self, description: str | None) -> None:
        now = self._clock()
        self._finished(now)
        self._description = description or self._description
        self._started, self._done = now, 0
        detail(f"{self._description} ...")

    def phase(self, done: int, description: str) -> None:
        if description != self._description:
            self._next(description)

    def start(self, total: int | None, description: str | None = None) -> None:
        self._next(description)

    def finish(self) -> None:
        self._finished(self._clock())


@contextmanager
def _phases(description: str) -> Iterator[Advance]:
    log = _PhaseLog(description)
    yield log
    log.finish()


@contextmanager
def progress_bar(description: str, total: int | None, enabled: bool) -> Iterator[Advance]:
    """A Rich progress bar on stderr with a count, the time taken and an ETA; yields an Advance.

    Disabled, the Advance does nothing (with -v it names each phase and its time on stderr).
    Transient: the bar is gone once the work is done.
    """
    if not enabled:
        if settings.verbose:
            with _phases(description) as advance:
                yield advance
        else:
            yield Advance()
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(
        # a description names inputs: plain text (no markup read from a name), escaped by `err`
        TextColumn("{task.description}", style="progress.description", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=err,
        transient=True,
    ) as progress:
        yield Advance(progress, progress.add_task(printable(description), total=total))


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


def state_table(title: str, rows: list[tuple[str, dict[str, Any]]], limit: int | None = None) -> Fitted:
    """A table of (label, state) rows: size, samples, counter and ids of each (the first `limit` runs)."""
    columns = [
        Column("", style="bold"),
        Column("size", right=True),
        Column("total samples", right=True),
        Column("counter", right=True),
        Column("trajectory ids", wrap=True),
    ]
    cells = [
        [
            label,
            f"{state['size']}",
            f"{state['total_samples']}",
            f"{state['trajectory_counter']}",
            format_ids(state["trajectory_id_list"], limit),
        ]
        for label, state in rows
    ]
    return Fitted(columns, cells, title=title)


def format_ids(ids: Sequence[int], limit: int | None = None) -> str:
    """Ids for a person: runs of consecutive ids as `a-b`; past `limit` runs, how many ids remain."""
    return id_runs(ids, limit)


def files_line(files: dict[str, int]) -> str:
    """How trajectory files were placed, for a person."""
    placed = (
        f"{files['reflinked']} reflinked, {files['linked']} linked, "
        f"{files['copied']} copied, {files['written']} written"
    )
    return f"{placed}, {size(files['bytes'])}"


# ------------------------------------------------------------ object storage
StorageOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--storage-option",
        metavar="KEY=VALUE",
        help="For URLs (s3://, gs://, ...): an fsspec storage option, e.g. endpoint_url=http://host:9000 "
        "(repeatable; a value that parses as JSON is that value, else a string). URLs are read through "
        "a local cache of the user's own: RBTOOL_CACHE_DIR (default ~/.cache/rbtool/remote), "
        "RBTOOL_CACHE_BYTES (default 20 GiB), RBTOOL_CACHE_SHARED=1 for a shared (sticky) one.",
        show_default=False,
    ),
]
DirArg = Annotated[str, typer.Argument(metavar="PATH", help="A checkpoint or buffer directory, or a URL.")]


class Place:
    """A directory a command works on: the local path the library reads or writes, and the name to show.

    For a URL the local path is a mirror (reading) or a staging directory (writing); every path
    under it is shown under the URL.
    """

    def __init__(self, given: str, local: Path, url: str | None = None) -> None:
        self.given = given
        self.local = local
        self.url = url
        self._finish: Any = None
        self.upload: dict[str, int] | None = None  # what the upload did (None: a local directory)
        self.mirror: IndexMirror | None = None  # read without data: objects are fetched on demand

    def finish(self) -> None:
        """Publish what was written (upload it, for a URL) now, before the result is printed."""
        if self._finish is not None:
            finish, self._finish = self._finish, None
            self.upload = finish()

    def show(self, path: str | os.PathLike[str] | None = None) -> str:
        if path is None:
            return self.url or str(self.local)
        if self.url is None:
            return str(path)
        try:
            rel = Path(path).relative_to(self.local)
        except ValueError:
            return str(path)
        return self.url if str(rel) == "." else f"{self.url}/{rel.as_posix()}"


def shown_in(places: Sequence[Place], path: str | os.PathLike[str]) -> str:
    """A path under one of the inputs read, named as it was given (under its URL, if it was)."""
    given = Path(path)
    for place in places:
        if given == place.local or place.local in given.parents:
            return place.show(given)
    return str(path)


def upload_line(upload: dict[str, int]) -> str:
    """What an upload did, for a person: `upload: 12 objects uploaded (3.4 MiB), 0 kept, 0 removed`."""
    return (
        f"upload: {count(upload['uploaded'], 'object')} uploaded ({size(upload['bytes'])}), "
        f"{upload['kept']} kept, {upload['removed']} removed"
    )


def upload_note(upload: dict[str, int] | None) -> None:
    """The human view's upload line of a write to a URL (none for a local OUT)."""
    if upload is not None:
        out.print(upload_line(upload), markup=False)


def is_url(value: str | os.PathLike[str]) -> bool:
    """True for an object-storage URL (s3://, gs://, memory:// ...); plain paths and file:// are local."""
    from rbtool.remote import is_url as remote_is_url

    return remote_is_url(value)


def local_dir(value: str, option: str) -> Path:
    """A directory argument that must be local (the command has no remote form)."""
    from rbtool.remote import local_path

    if is_url(value):
        raise typer.BadParameter(f"{value}: takes a local directory, not a URL", param_hint=option)
    return local_path(value)


def local_path_arg(value: str) -> Path:
    """Parser of a path argument that has no remote form: a URL there is a usage error (exit 2).

    Without it `s3://b/x` would become the local path `s3:/b/x`.
    """
    from rbtool.remote import local_path

    if is_url(value):
        raise typer.BadParameter(f"{value}: takes a local path, not a URL")
    return local_path(value)


@contextmanager
def reading(
    value: str,
    storage_options: list[str] | None,
    *,
    data: bool,
    enabled: bool = False,
    stream: bool = False,
) -> Iterator[Place]:
    """The directory `value` to read: itself if local; for a URL a local mirror.

    With `data`, every object is copied into the bounded cache (verified against the upload's
    marker); without, only the JSON objects are read and the rest stand in by name and size
    (`Place.mirror.fetch` fetches some of them). With `stream` (a command whose data is read
    by one pass, each file once), a checkpoint that does not fit the cache (or not beside
    what other processes are reading there) is read through a streamed mirror instead: the
    pass fetches its files in batches and releases each once read.
    """
    from rbtool.remote import local_path

    if not is_url(value):
        yield Place(value, local_path(value))
        return
    from rbtool import remote

    options = remote.parse_storage_options(storage_options)
    if not data:
        with remote.index_mirror(value, options) as mirror:
            place = Place(value, mirror.path, value.rstrip("/"))
            place.mirror = mirror
            yield place
        return
    if stream and not remote.fits_cache(value, options):
        with _streamed(value, options) as place:
            yield place
        return
    with ExitStack() as stack:
        # the bar is gone once the copies are fetched: nothing of it is left under the report
        with progress_bar(f"fetching {remote.shown_url(value)}", None, enabled) as advance:
            try:
                local = stack.enter_context(remote.data_mirror(value, options, progress=advance))
            except remote.CacheFullError:
                if not stream:
                    raise
                local = None  # other processes read what the cache holds: stream instead
        if local is not None:
            yield Place(value, local, value.rstrip("/"))
            return
    with _streamed(value, options) as place:
        yield place


@contextmanager
def _streamed(value: str, options: dict[str, Any]) -> Iterator[Place]:
    """A streamed mirror of the URL `value`, fed to the passes run inside the block."""
    from rbtool import remote
    from rbtool.passes import pool as passes

    with remote.stream_mirror(value, options) as streamed, passes.feeding(streamed):
        place = Place(value, streamed.path, value.rstrip("/"))
        yield place


@contextmanager
def writing(
    value: str, storage_options: list[str] | None, *, overwrite: bool, enabled: bool = False
) -> Iterator[Place]:
    """The directory `value` to write: itself if local; for a URL a staging directory uploaded afterwards.

    The upload follows the remote protocol (trajectory objects, index, metadata, marker last)
    and only once the command's work succeeded: at `Place.finish()`, which a command calls
    before it prints its result, or at the end of the block.
    """
    from rbtool.remote import local_path

    if not is_url(value):
        yield Place(value, local_path(value))
        return
    from rbtool import remote

    options = remote.parse_storage_options(storage_options)
    with remote.writing(value, options, overwrite=overwrite) as staging:
        place = Place(value, staging.local, value.rstrip("/"))

        def publish() -> dict[str, int]:
            with progress_bar(f"uploading to {remote.shown_url(value)}", None, enabled) as advance:
                staging.progress = advance
                return staging.publish()

        place._finish = publish
        yield place
        place.finish()


# ------------------------------------------------------------ conventions
# Options every command and group takes, before or after the command name (`rbtool -q stats X`
# and `rbtool stats X -q` alike). They are declared once, on `_conventions` below, and copied
# onto every command by `Group`; their values live in `settings`, not in command arguments.
class ColorMode(str, enum.Enum):
    """When output carries colour and style escape codes."""

    auto = "auto"
    always = "always"
    never = "never"


# Warnings that only inform (nothing is wrong with the result): -q leaves them out.
INFORMATION: tuple[type[Warning], ...] = (FieldsLeftOutWarning, LeftoversRemovedWarning)

# Environment defaults of options that several commands share, by option name. `Group`
# attaches them wherever the option appears, so every command reads the same variable.
OPTION_ENVVARS: dict[str, str] = {
    "--jobs": "RBTOOL_JOBS",
    "--window": "RBTOOL_WINDOW",
    "--format": "RBTOOL_FORMAT",  # only where --format takes a trajectory file format (pt, pkl)
}


class Settings:
    """The shared options of the running command line: what was given, and where from."""

    def __init__(self) -> None:
        self.given: dict[str, Any] = {}  # on the command line (the last occurrence wins)
        self.environment: dict[str, Any] = {}  # from RBTOOL_* variables

    def _value(self, name: str, default: Any) -> Any:
        return self.given.get(name, self.environment.get(name, default))

    @property
    def quiet(self) -> bool:
        if "verbose" in self.given and "quiet" not in self.given:
            return False
        return bool(self._value("quiet", False))

    @property
    def verbose(self) -> bool:
        if "quiet" in self.given and "verbose" not in self.given:
            return False
        return bool(self._value("verbose", False)) and not self.quiet

    @property
    def progress(self) -> bool:
        return not self._value("no_progress", False) and not self.quiet

    @property
    def color(self) -> ColorMode:
        return ColorMode(self._value("color", ColorMode.auto))


settings = Settings()

# The command line's long-lived Rich consoles; `configure_consoles` sets their colour.
_consoles: list[Console] = [out, err]


def make_console(**kwargs: Any) -> Console:
    """A Rich console made while a command runs, following --color and NO_COLOR like `out` and `err`."""
    console = SafeConsole(**kwargs)
    _set_color(console)
    return console


def _set_color(console: Console) -> None:
    # Rich fixes a console's colour system when the console is made, at import time; the
    # mode (and NO_COLOR / FORCE_COLOR) is known only once the command line is parsed.
    from rich.color import ColorSystem

    mode = settings.color
    if mode is ColorMode.auto and os.environ.get("NO_COLOR", ""):
        mode = ColorMode.never
    if mode is ColorMode.never:
        console._color_system = None
    else:
        detected = console._detect_color_system()  # honours FORCE_COLOR, TERM, COLORTERM
        console._color_system = (detected or ColorSystem.STANDARD) if mode is ColorMode.always else detected
    console.no_color = mode is ColorMode.never


def configure_consoles() -> None:
    """Apply the colour mode to every console of the command line."""
    for console in _consoles:
        _set_color(console)


def note(message: str) -> None:
    """A line for a person on stderr (what the command is waiting for, what it kept); none with -q."""
    if not settings.quiet:
        err.print(message, markup=False, highlight=False)


def progress_line(message: str, bar_shown: bool) -> None:
    """A line of progress on stderr (a published batch): the log's form of a progress bar, so none
    beside a bar, with -q or with --no-progress; always with -v."""
    if settings.verbose or (settings.progress and not bar_shown):
        err.print(message, markup=False, highlight=False)


def detail(message: str) -> None:
    """A line of detail on stderr (phases, timings), only with -v."""
    if settings.verbose:
        err.print(message, markup=False, highlight=False)


def _conventions(
    quiet: Annotated[
        bool,
        typer.Option(
            "--quiet",
            "-q",
            envvar="RBTOOL_QUIET",
            help="Print results only: no progress, notes or merely informative warnings on stderr "
            "(errors still).",
        ),
    ] = False,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose", "-v", envvar="RBTOOL_VERBOSE", help="Print more on stderr: phases and timings."
        ),
    ] = False,
    no_progress: Annotated[
        bool,
        typer.Option("--no-progress", envvar="RBTOOL_NO_PROGRESS", help="Show no progress bars or lines."),
    ] = False,
    color: Annotated[
        ColorMode,
        typer.Option(
            "--color",
            envvar="RBTOOL_COLOR",
            help="Colour and style in the output: auto (at a terminal, unless NO_COLOR is set), "
            "always or never.",
        ),
    ] = ColorMode.auto,
) -> None:
    """The shared options' declarations (never run: `Group` copies its parameters)."""


# The context of the command being run, set while its options are parsed.
_running: dict[str, Any] = {}


def reset_settings() -> None:
    """Forget the shared options of an earlier command line (the CLI may run several in one process)."""
    settings.given.clear()
    settings.environment.clear()
    _running.clear()
    configure_consoles()


def _record(ctx: Any, param: Any, value: Any) -> Any:
    """Callback of a shared option: note where its value came from in `settings`."""
    if not isinstance(ctx.command, TyperGroup):
        _running["leaf"] = ctx
    source = ctx.get_parameter_source(param.name)
    if source is None or source.name == "DEFAULT":
        return value
    if source.name == "ENVIRONMENT":
        settings.environment[param.name] = value
    else:
        if param.name in ("quiet", "verbose") and value:
            other = "verbose" if param.name == "quiet" else "quiet"
            if settings.given.get(other):
                raise typer.BadParameter(
                    "give one of them, not both", ctx=ctx, param_hint="-q/--quiet, -v/--verbose"
                )
        settings.given[param.name] = value
    configure_consoles()
    return value


_SHARED: list[Any] = []


def shared_params() -> list[Any]:
    """Click parameters of the shared options, built once from `_conventions`."""
    if not _SHARED:
        template = typer.Typer(add_completion=False)
        template.command()(_conventions)
        for param in typer.main.get_command(template).params:
            param.expose_value = False
            param.callback = _record
            _SHARED.append(param)
    return _SHARED


def _trajectory_formats(param: Any) -> bool:
    from typing import get_args

    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    return annotation is TrajectoryFormat or TrajectoryFormat in get_args(annotation)


ROOT = "rbtool"  # the root group's name


def adopt(command: Any, path: str) -> None:
    """Give a command (or group) the shared options, the RBTOOL_* environment defaults of its
    options and its examples (`path`: the command as typed after `rbtool`); guard what it
    writes against Ctrl-C."""
    from rbtool.cli._examples import epilog

    if command.epilog is None:
        command.epilog = epilog(path)
    names = {opt for p in command.params for opt in p.opts}
    for param in command.params:
        for option, variable in OPTION_ENVVARS.items():
            if option in param.opts and (option != "--format" or _trajectory_formats(param)):
                param.envvar, param.show_envvar = variable, True
    command.params.extend(p for p in shared_params() if not names & set(p.opts))
    if not isinstance(command, TyperGroup) and not getattr(command.callback, "_rbtool_guarded", False):
        command.callback = _guarded(command.callback)


# ------------------------------------------------------------ Ctrl-C
def _targets(leaf: Any) -> tuple[Path | str | None, Path | None]:
    """(OUT, buffer) of the running command: where it writes a new output (a path, or a URL as
    given), or the buffer it adds to."""
    target = buffer = None
    for param in leaf.command.params:
        value = leaf.params.get(param.name)
        if isinstance(value, str) and not is_url(value):  # a path that may also be a URL
            value = Path(value)
        if not isinstance(value, (Path, str)):
            continue
        if "--buffer" in param.opts:
            if isinstance(value, Path):  # a URL buffer is refused before anything is written
                buffer = value
        elif "--out" in param.opts or param.metavar == "OUT":
            target = value
    return target, buffer


def _state(path: Path | str) -> tuple[int, int] | None:
    if isinstance(path, str):  # a URL: its objects change only at the upload, after the work
        return None
    try:
        stat = os.lstat(path)
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def interrupted_line(
    target: Path | str | None,
    before: tuple[int, int] | None,
    buffer: Path | None = None,
    index_before: tuple[int, int] | None = None,
) -> str:
    """What an interrupted command kept, in one line. `before` is the state (`_state`) of
    `target` when the command began, `index_before` that of the buffer's index."""
    if buffer is not None:
        index = buffer / "trajectory_index.json"
        after = _state(index)
        if after is None:
            return f"interrupted: nothing was written to {buffer}"
        if after == index_before:
            return f"interrupted: the buffer {buffer} is left as it was"
        from rbtool.files.index import read_index

        try:
            ids = read_index(buffer).id_list
        except (RbtoolError, OSError):
            return f"interrupted: {buffer} holds the batches published before the interrupt"
        held = f"ids {format_ids(ids, SUMMARY_ITEMS)}" if ids else "no trajectories"
        return f"interrupted: the buffer {buffer} holds {held}; nothing half-written"
    if isinstance(target, str):  # a URL: published by an upload whose marker goes last
        return (
            f"interrupted: {target} holds no new checkpoint unless its upload had finished; readers "
            "refuse a cut-short upload, and running the command again completes it"
        )
    if target is not None:
        if _state(target) == before:
            if before is None:
                return f"interrupted: nothing was written to {target}"
            return f"interrupted: {target} is left as it was"
        return f"interrupted: {target} had been written in full"
    return "interrupted: nothing was written"  # every writer names an OUT or a --buffer


def _detail_environment(leaf: Any) -> None:
    """With -v, name each option whose value came from an RBTOOL_* variable (once each)."""
    contexts = []
    while leaf is not None:
        contexts.append(leaf)
        leaf = leaf.parent
    named: set[str] = set()
    for ctx in reversed(contexts):
        for param in ctx.command.params:
            source = ctx.get_parameter_source(param.name)
            variable = param.envvar
            if source is None or source.name != "ENVIRONMENT" or not isinstance(variable, str):
                continue
            if variable not in named:
                named.add(variable)
                detail(f"{max(param.opts, key=len)} from {variable}={os.environ.get(variable, '')}")


def _guarded(callback: Any) -> Any:
    """Wrap a command's function: one line on Ctrl-C saying what was kept (exit 130), and the
    time taken with -v."""
    import functools
    import time

    @functools.wraps(callback)
    def run(*args: Any, **kwargs: Any) -> Any:
        ctx = _running.get("leaf")
        target, buffer = _targets(ctx) if ctx is not None else (None, None)
        before = None if target is None else _state(target)
        index_before = None if buffer is None else _state(buffer / "trajectory_index.json")
        if ctx is not None:
            _detail_environment(ctx)
        started = time.perf_counter()
        try:
            result = callback(*args, **kwargs)
        except KeyboardInterrupt:
            line = interrupted_line(target, before, buffer, index_before)
            err.print(line, markup=False, highlight=False)
            raise typer.Exit(130) from None
        if ctx is not None:
            detail(f"{ctx.command_path}: done in {time.perf_counter() - started:.2f} s")
        return result

    run._rbtool_guarded = True  # type: ignore[attr-defined]
    return run
