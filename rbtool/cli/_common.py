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
from contextlib import contextmanager
from itertools import chain
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

    from rbtool.remote import IndexMirror

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


def head(items: Any, limit: int | None) -> Any:
    """The first `limit` items of a list, numpy array or lazy column (all of them when None)."""
    return items if limit is None or len(items) <= limit else items[:limit]


def left_out(items: Any, limit: int | None) -> int:
    """How many items `head(items, limit)` leaves out."""
    return 0 if limit is None else max(0, len(items) - limit)


def id_ranges(ids: Any) -> list[list[int]]:
    """Runs of consecutive ids, in list order, as [first, last] pairs: [0, 1, 2, 5] -> [[0, 2], [5, 5]]."""
    import numpy as np

    values = np.asarray(ids, dtype=np.int64).reshape(-1)
    if values.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(values) != 1)
    starts = np.concatenate(([0], breaks + 1))
    ends = np.concatenate((breaks, [values.size - 1]))
    return np.stack((values[starts], values[ends]), axis=1).tolist()  # type: ignore[no-any-return]


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
    """Progress bars only for a person at a terminal, never with --json or --jsonl."""
    return not json_mode and err.is_terminal


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
            self._progress.update(self._task, completed=done, description=description)

    def start(self, total: int | None, description: str | None = None) -> None:
        if self._progress is not None:
            changes: dict[str, Any] = {"total": total, "completed": 0}
            if description is not None:
                changes["description"] = description
            self._progress.reset(self._task, **changes)


@contextmanager
def progress_bar(description: str, total: int | None, enabled: bool) -> Iterator[Advance]:
    """A Rich progress bar on stderr with a count, the time taken and an ETA; yields an Advance.

    Disabled, the Advance does nothing. Transient: the bar is gone once the work is done.
    """
    if not enabled:
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
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=err,
        transient=True,
    ) as progress:
        yield Advance(progress, progress.add_task(description, total=total))


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


def state_table(title: str, rows: list[tuple[str, dict[str, Any]]], limit: int | None = None) -> Table:
    """A table of (label, state) rows: size, samples, counter and ids of each (the first `limit` runs)."""
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
            format_ids(state["trajectory_id_list"], limit),
        )
    return table


def format_ids(ids: Sequence[int], limit: int | None = None) -> str:
    """Ids for a person: runs of consecutive ids as `a-b`; past `limit` runs, how many ids remain."""
    if not len(ids):
        return "(none)"
    runs = id_ranges(ids)
    shown = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in head(runs, limit))
    hidden = left_out(runs, limit)
    if hidden:
        rest = sum(b - a + 1 for a, b in runs[len(runs) - hidden :])
        shown += f", ... {rest} more ids in {hidden} runs"
    return shown


def files_line(files: dict[str, int]) -> str:
    """How trajectory files were placed, for a person."""
    placed = (
        f"{files['reflinked']} reflinked, {files['linked']} linked, "
        f"{files['copied']} copied, {files['written']} written"
    )
    return f"{placed}, {files['bytes']} bytes"


# ------------------------------------------------------------ object storage
StorageOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--storage-option",
        metavar="KEY=VALUE",
        help="For URLs (s3://, gs://, ...): an fsspec storage option, e.g. endpoint_url=http://host:9000 "
        "(repeatable; a value that parses as JSON is that value, else a string).",
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
    value: str, storage_options: list[str] | None, *, data: bool, enabled: bool = False
) -> Iterator[Place]:
    """The directory `value` to read: itself if local; for a URL a local mirror.

    With `data`, every object is copied into the bounded cache (verified against the upload's
    marker); without, only the JSON objects are read and the rest stand in by name and size
    (`Place.mirror.fetch` fetches some of them).
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
    with (
        progress_bar(f"fetching {value}", None, enabled) as advance,
        remote.data_mirror(value, options, progress=advance) as local,
    ):
        yield Place(value, local, value.rstrip("/"))


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
            with progress_bar(f"uploading to {value}", None, enabled) as advance:
                staging.progress = advance
                return staging.publish()

        place._finish = publish
        yield place
        place.finish()
