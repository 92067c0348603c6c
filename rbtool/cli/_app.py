"""How a command runs: the group class, the help's plain names, the options every command takes,
and the report of an interrupted command.

The root group is the one place where library errors become exit statuses (`Group.invoke`).
The options every command takes (-q, -v, --no-progress, --color) are declared once
(`_conventions`) and copied onto every command and group by `adopt`, with the RBTOOL_*
environment defaults of the options several commands share; their values live in
`_consoles.settings`, not in command arguments. Every command's function runs guarded
(`_guarded`): --json, --jsonl and --pretty checked together, the Ctrl-C report, -v's timing.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from typer.core import TyperCommand, TyperGroup
from typer.exceptions import TyperException

from rbtool.cli._consoles import ColorMode, configure_consoles, detail, err, settings
from rbtool.cli._errors import (
    escape_usage_error,
    exit_status,
    fix_hint,
    option_hint,
    plain_option_error,
    print_error,
    print_warning,
)
from rbtool.cli._options import SUMMARY_ITEMS, TrajectoryFormat, refuse_output_mix
from rbtool.cli._output import format_ids
from rbtool.cli._places import is_url
from rbtool.errors import RbtoolError, UsageError

# ctx.meta key (shared by every nested context) under which groups record the command they run.
_COMMAND = "rbtool.command"

# Commands that may run under torchrun with more than one rank: the passes spread over the
# ranks (rbtool.passes.ranks) and read-only commands; a writer started K times would race itself.
OVER_RANKS = frozenset({"verify", "doctor", "stats", "convert", "export", "diff", "version"})


def _world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) if os.environ.get("RANK") is not None else 1
    except ValueError:
        return 1


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
                plain_option_error(exc)
                escape_usage_error(exc)
                raise
            except TyperException as exc:  # another usage error: a value it quotes is escaped
                escape_usage_error(exc)
                raise
            except RbtoolError as exc:
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


def with_groups(callback: Callable[..., Any]) -> Callable[..., Any]:
    """`callback` with its option groups (parameters typed by a dataclass of `_options`: `Report`,
    `Writes` ...) spelled out as the groups' options, for the parser; each call gathers their
    values back into the group."""
    import dataclasses
    import functools
    import inspect
    from typing import get_type_hints

    signature = inspect.signature(callback, eval_str=True)
    groups: dict[str, Any] = {}
    params = []
    keyword = inspect.Parameter.KEYWORD_ONLY
    for param in signature.parameters.values():
        group = param.annotation
        if not (isinstance(group, type) and dataclasses.is_dataclass(group)):
            params.append(param.replace(kind=keyword))
            continue
        hints = get_type_hints(group, include_extras=True)
        groups[param.name] = group
        params += [
            inspect.Parameter(f.name, keyword, annotation=hints[f.name], default=f.default)
            for f in dataclasses.fields(group)
        ]
    if not groups:
        return callback

    @functools.wraps(callback)
    def run(**kwargs: Any) -> Any:
        for name, group in groups.items():
            kwargs[name] = group(**{f.name: kwargs.pop(f.name) for f in dataclasses.fields(group)})
        return callback(**kwargs)

    run.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in params}
    return run


CommandFunction = TypeVar("CommandFunction", bound=Callable[..., Any])


class Typer(typer.Typer):
    """typer's `Typer`, whose commands may take option groups (`with_groups`)."""

    def command(self, *args: Any, **kwargs: Any) -> Callable[[CommandFunction], CommandFunction]:
        register = super().command(*args, **kwargs)

        def decorator(callback: CommandFunction) -> CommandFunction:
            register(with_groups(callback))
            return callback

        return decorator


def sub_app(name: str, description: str) -> typer.Typer:
    """A group of commands under `rbtool NAME` (`rbtool checkpoint save`, `rbtool import lerobot`)."""
    return Typer(cls=Group, name=name, help=description, no_args_is_help=True, rich_markup_mode=None)


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


# ------------------------------------------------------------ conventions
# Options every command and group takes, before or after the command name (`rbtool -q stats X`
# and `rbtool stats X -q` alike). They are declared once, on `_conventions` below, and copied
# onto every command by `Group`; their values live in `settings`, not in command arguments.

# Environment defaults of options that several commands share, by option name. `Group`
# attaches them wherever the option appears, so every command reads the same variable.
OPTION_ENVVARS: dict[str, str] = {
    "--jobs": "RBTOOL_JOBS",
    "--window": "RBTOOL_WINDOW",
    "--format": "RBTOOL_FORMAT",  # only where --format takes a trajectory file format (pt, pkl)
}


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
    """Wrap a command's function: --json, --jsonl and --pretty checked together, one line on
    Ctrl-C saying what was kept (exit 130), and the time taken with -v."""
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
        refuse_output_mix(kwargs.get("json", False), kwargs.get("jsonl", False), kwargs.get("pretty", False))
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
