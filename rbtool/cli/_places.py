"""Directories and URLs as commands take them: where the library reads and writes
(`rbtool.remote.places`, shown with progress bars for fetching and uploading), paths that
must be local, and outputs that would overwrite their inputs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from rbtool.cli._consoles import out
from rbtool.cli._output import count, size
from rbtool.cli._progress import Advance, progress_bar

if TYPE_CHECKING:
    from rbtool.remote.places import Place


def _bars(enabled: bool) -> Callable[[str], AbstractContextManager[Advance]]:
    """A bar with no total for each step the library names (fetching, uploading)."""
    return lambda description: progress_bar(description, None, enabled)


def reading(
    value: str, storage_options: list[str] | None, *, enabled: bool = False, **how: bool
) -> AbstractContextManager[Place]:
    """The directory `value` to read (`rbtool.remote.places.reading`, `how`: data, stream), its
    fetching shown if `enabled`."""
    from rbtool.remote import places

    return places.reading(value, storage_options, bar=_bars(enabled), **how)


def writing(
    value: str, storage_options: list[str] | None, *, overwrite: bool, enabled: bool
) -> AbstractContextManager[Place]:
    """The directory `value` to write (`rbtool.remote.places.writing`), its upload shown if `enabled`."""
    from rbtool.remote import places

    return places.writing(value, storage_options, overwrite=overwrite, bar=_bars(enabled))


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


def refuse_overlap(target: Path, inputs: Sequence[Path], option: str) -> None:
    """Refuse an output path that is, lies inside, or contains an input: writing it would change the input."""
    resolved = Path(os.path.realpath(target))
    for given in inputs:
        source = Path(os.path.realpath(given))
        if resolved == source or source in resolved.parents or resolved in source.parents:
            raise typer.BadParameter(
                f"{target} overlaps the input {given}; choose a path outside it", param_hint=option
            )


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
