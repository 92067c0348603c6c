"""Option errors in plain words: what the argument parser found wrong with a value, and what to give.

Typer checks option values with pydantic, whose messages speak of Python types ("Input should be
a valid integer, unable to parse string as an integer", "Value error, 'TopK' is not one of ...").
`plain_option_error` rewrites such a message in place before Typer prints it, keeping Typer's
`Invalid value for '--opt':` prefix and its exit status 2.
"""

from __future__ import annotations

import re
from typing import Any

import typer

from rbtool.errors import DamagedCheckpointError, LooseFilesError, TrajectoryFileError

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
