"""How errors and warnings read: one line each on stderr, with the option or command that answers them.

A library error is `Error: <its first line>`, with the hint of the running command's option
that answers it (`OPTION_HINTS`) or the command that mends the damage (`fix_hint`); its exit
status is 2 for a usage error, else 1. A library warning is one line `Warning: ...`.

Typer checks option values with pydantic, whose messages speak of Python types ("Input should be
a valid integer, unable to parse string as an integer", "Value error, 'TopK' is not one of ...").
`plain_option_error` rewrites such a message in place before Typer prints it, keeping Typer's
`Invalid value for '--opt':` prefix and its exit status 2.
"""

from __future__ import annotations

import re
from typing import Any

import typer

from rbtool.cli._consoles import err, settings
from rbtool.cli._output import printable
from rbtool.errors import (
    DamagedCheckpointError,
    FieldsLeftOutWarning,
    LeftoversRemovedWarning,
    LooseFilesError,
    MissingTrajectoryFilesError,
    NeedsTrajectoryFilesError,
    OutputExistsError,
    RbtoolError,
    TrajectoryFileError,
    UsageError,
)

# Library errors that a command-line option answers: (error class, option, hint). The hint
# is added only when the running command has the option; library messages never name flags.
OPTION_HINTS: tuple[tuple[type[Exception], str, str], ...] = (
    (MissingTrajectoryFilesError, "--non-strict", "pass --non-strict to keep only what exists"),
    (OutputExistsError, "--force", "choose another path or pass --force to replace it"),
    (NeedsTrajectoryFilesError, "--index-only", "drop --index-only"),
)

# Warnings that only inform (nothing is wrong with the result): -q leaves them out.
INFORMATION: tuple[type[Warning], ...] = (FieldsLeftOutWarning, LeftoversRemovedWarning)


def _option_names(command: Any) -> set[str]:
    """Every option string of a command (`--force`, `-f`, `--no-progress`)."""
    return {opt for p in getattr(command, "params", []) for opt in (*p.opts, *p.secondary_opts)}


def option_hint(exc: Exception, command: Any) -> str:
    """`; <hint>` for the first option that answers `exc`, if the command has that option."""
    options = _option_names(command)
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
    if isinstance(warning, FieldsLeftOutWarning) and "--all-fields" in _option_names(command):
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


# Typer's own choice check: "'TopK' is not one of 'uniform', 'topk'."
_NOT_ONE_OF = re.compile(r"(?P<value>'.*') is not one of (?P<choices>.*)\.$")


def choice_message(value: str, choices: list[str]) -> str:
    """`'TopK' is not a choice; give one of: uniform, topk (did you mean topk?)`."""
    text = f"{value!r} is not a choice; give one of: {', '.join(choices)}"
    folded = [c for c in choices if c.casefold() == value.casefold()]
    if folded:
        text += f" (did you mean {folded[0]}? choices are case-sensitive)"
    return text


def _number(limit: Any) -> str:
    return f"{limit:g}" if isinstance(limit, float) else str(limit)


def plain_message(error: dict[str, Any]) -> str | None:
    """Plain words for one pydantic error of an option value, or None to keep the parser's message."""
    kind = error.get("type", "")
    given = error.get("input")
    ctx = error.get("ctx") or {}
    shown = repr(given) if isinstance(given, str) else str(given)  # what could not be parsed, quoted
    if kind in ("int_parsing", "int_from_float", "int_type"):
        return f"{shown} is not a whole number"
    if kind in ("float_parsing", "float_type"):
        return f"{shown} is not a number"
    if kind in ("bool_parsing", "bool_type"):
        return f"{shown} is not true or false"
    if kind == "greater_than_equal":
        return f"{given} is too small; give {_number(ctx['ge'])} or more"
    if kind == "greater_than":
        return f"{given} is too small; give more than {_number(ctx['gt'])}"
    if kind == "less_than_equal":
        return f"{given} is too large; give {_number(ctx['le'])} or less"
    if kind == "less_than":
        return f"{given} is too large; give less than {_number(ctx['lt'])}"
    if kind == "value_error":
        found = _NOT_ONE_OF.match(str(ctx.get("error", "")))
        if found and isinstance(given, str):
            choices = re.findall(r"'((?:[^'\\]|\\.)*)'", found.group("choices"))
            return choice_message(given, choices)
        cause = str(ctx.get("error", "")).strip()
        return cause or None
    return None


def plain_option_error(exc: typer.BadParameter) -> None:
    """Rewrite, in place, the message of a BadParameter that carries a pydantic validation error."""
    cause = exc.__cause__
    errors = getattr(cause, "errors", None)
    if cause is None or errors is None or type(cause).__name__ != "ValidationError":
        return
    try:
        found = errors()
    except Exception:  # a validation error of another shape: keep the parser's words
        return
    if not found:
        return
    message = plain_message(found[0])
    if message is not None:
        exc.message = message


# Commands that report damage themselves (verify lists it, repair drops it): no hint there.
_REPORTS_DAMAGE = {"verify", "repair"}
# Commands whose trajectory files come from a checkpoint (ingest and checkpoint save may read
# loose files, which repair cannot mend).
_READS_CHECKPOINT_FILES = {"sample", "stats", "diff", "convert", "export", "filter", "merge", "reshard"}


def fix_hint(exc: Exception, command: Any) -> str:
    """`; <the command that mends it>` for damage a command can only refuse, else ''."""
    name = getattr(command, "name", None)
    if isinstance(exc, LooseFilesError):  # a checkpoint is made of them by ingest
        where = exc.directory or "FOLDER"
        return (
            f"; `rbtool ingest {where} --buffer DIR` makes a buffer of them "
            f"(or `rbtool checkpoint save {where} OUT --mode in-memory`)"
        )
    if name is None or name in _REPORTS_DAMAGE:
        return ""
    if isinstance(exc, DamagedCheckpointError):
        where = exc.directory or "PATH"
        return (
            f"; `rbtool repair {where} --out OUT` rebuilds the metadata and index from the trajectory files"
        )
    if isinstance(exc, TrajectoryFileError) and name in _READS_CHECKPOINT_FILES:
        where = _checkpoint_of(str(exc))
        return (
            f"; `rbtool verify --deep {where}` lists every damaged file, "
            f"`rbtool repair {where} --out OUT` writes a checkpoint without them"
        )
    return ""


def _checkpoint_of(message: str) -> str:
    """The directory of the file a trajectory-file error names first (`PATH` if it names none)."""
    from pathlib import Path

    named = Path(message.split(": ", 1)[0])
    return str(named.parent) if named.parent.is_dir() and named.suffix in (".pt", ".pkl") else "PATH"
