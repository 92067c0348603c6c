"""What a dataset may make rbtool do. Every dataset may come from someone else: what it names
is read only inside its root, and what it declares is checked against a memory budget
(RBTOOL_LEROBOT_MAX_BYTES) before anything is decoded; the integers and path templates of its
metadata are bounded.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Any, TypeGuard

from rbtool.errors import CheckpointError
from rbtool.format.bounded import env_bytes, human_bytes

MAX_BYTES_ENV = "RBTOOL_LEROBOT_MAX_BYTES"
DEFAULT_MAX_BYTES = 4 << 30  # what one decoded file or episode may take
_MAX_TEMPLATE_CHARS = 512
_MAX_TEMPLATE_WIDTH = 20  # `:03d`, `:06d`: LeRobot's widths; an int64 has 19 digits
_TEMPLATE_SPEC = re.compile(r"(0?)([0-9]{0,2})d?")
ID_LIMIT = 1 << 63  # ids and counters are int64, as in a checkpoint


def max_bytes() -> int:
    """The memory budget of a LeRobot import (RBTOOL_LEROBOT_MAX_BYTES, default 4 GiB)."""
    return env_bytes(MAX_BYTES_ENV, DEFAULT_MAX_BYTES)


def within_budget(need: int, what: str) -> None:
    """Refuse, before decoding, what would take more memory than the budget."""
    limit = max_bytes()
    if need > limit:
        raise CheckpointError(
            f"{what} would take {human_bytes(need)} of memory to decode, more than the {human_bytes(limit)} "
            f"{MAX_BYTES_ENV} allows"
        )


def is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def fill_template(template: Any, values: dict[str, Any], key: str, where: Path) -> str:
    """A path template of meta/info.json filled in: only the named fields, no attribute access
    or indexing, no conversion, and integer format specs of bounded width (`:03d`)."""
    import string

    shown = repr(template)[:80]
    if not isinstance(template, str) or not template or len(template) > _MAX_TEMPLATE_CHARS:
        raise CheckpointError(f"{where}: {key} {shown} is not a path template")
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise CheckpointError(f"{where}: {key} {shown} is not a path template ({exc})") from None
    out = []
    for literal, name, spec, conversion in parts:
        out.append(literal)
        if name is None:
            continue
        if name not in values:
            raise CheckpointError(
                f"{where}: {key} {shown} names {{{name}}}; a LeRobot path template names only "
                + ", ".join(f"{{{n}}}" for n in values)
            )
        if conversion is not None:
            raise CheckpointError(f"{where}: {key} {shown} converts {{{name}!{conversion}}}; refused")
        value = values[name]
        if isinstance(value, str):
            if spec:
                raise CheckpointError(f"{where}: {key} {shown} formats {{{name}}} with :{spec[:20]}; refused")
            out.append(value)
            continue
        spec = spec or ""
        match = _TEMPLATE_SPEC.fullmatch(spec)
        if match is None or int(match.group(2) or 0) > _MAX_TEMPLATE_WIDTH:
            raise CheckpointError(
                f"{where}: {key} {shown} formats {{{name}}} with :{spec[:20]}; only integer forms such "
                f"as :03d (width at most {_MAX_TEMPLATE_WIDTH}) are read"
            )
        out.append(format(value, spec or ""))
    return "".join(out)


def relative_parts(root: Path, rel: Any, what: str) -> tuple[str, ...]:
    """The parts of a path a dataset names, refused unless it stays inside `root`."""
    if not isinstance(rel, str) or not rel or "\0" in rel or "\\" in rel:
        raise CheckpointError(f"{root}: {what} {str(rel)[:80]!r} is not a path inside the dataset")
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts or not pure.parts:
        raise CheckpointError(f"{root}: {what} {rel[:200]!r} is outside the dataset; refused")
    return pure.parts


def _bound(limit: int) -> str:
    return f"2**{limit.bit_length() - 1}" if limit > 1024 and limit & (limit - 1) == 0 else str(limit)


def check_index(value: Any, what: str, where: Path, limit: int = ID_LIMIT) -> int:
    """A non-negative int64 (an episode, chunk, file or frame index; a length)."""
    if not is_int(value) or not 0 <= value < limit:
        raise CheckpointError(f"{where}: {what} {repr(value)[:40]} is not an integer in [0, {_bound(limit)})")
    return int(value)
