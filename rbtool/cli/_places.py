"""Directories and URLs as commands take them: where the library reads and writes
(`rbtool.remote.places`, shown with progress bars for fetching and uploading), paths that
must be local, and outputs that would overwrite their inputs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from rbtool.cli._consoles import out
from rbtool.cli._errors import print_error
from rbtool.cli._json import print_json
from rbtool.cli._output import count, size
from rbtool.cli._progress import Advance, progress_bar

T = TypeVar("T")

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


class EachPath:
    """What the commands that check several paths in turn share (verify, doctor): each path
    read (a URL fetched) and its pass run under a progress bar; with several paths, an
    unreadable one reported on its own line and passed over; at the end one JSON document
    (with --json) and one error naming every path that failed."""

    def __init__(self, paths: Sequence[str], storage_options: list[str] | None, *, data: bool, enabled: bool):
        self.paths = paths
        self.storage_options = storage_options
        self.data = data
        self.enabled = enabled
        self.single = len(paths) == 1
        self.documents: list[dict[str, Any]] = []  # each path's --json document, in order
        self.failed: list[str] = []

    def run(
        self,
        path: str,
        description: str,
        check: Callable[[Place, Advance | None, Path | None], T],
        journal: Path | None,
        rename: Callable[[T, Place], None],
    ) -> T | None:
        """`check(place, progress, journal)` on `path` read, or None when it could not be read
        and other paths remain (reported; with one path the error is the command's). The
        journal is `journal` itself for one path, else its subdirectory for this input. A
        result of a URL is passed to `rename(result, place)` to name the URL, not the local
        mirror it was made from."""
        from rbtool.errors import RbtoolError, UsageError
        from rbtool.passes.journal import input_journal

        own = journal if self.single else input_journal(journal, path)
        try:
            with (
                reading(
                    path, self.storage_options, data=self.data, enabled=self.enabled, stream=True
                ) as place,
                progress_bar(description, None, self.enabled) as advance,
            ):
                result = check(place, advance if self.enabled else None, own)
        except UsageError:
            raise
        except RbtoolError as exc:
            if self.single:
                raise
            print_error(str(exc))
            self.failed.append(f"{path} (unreadable)")
            self.documents.append({"path": str(path), "ok": False, "error": str(exc)})
            return None
        if place.url is not None:
            rename(result, place)
        return result

    def fail(self, path: str, reason: str, message: str, pretty: bool | None) -> None:
        """`path`'s report fails for `reason`: with one path the command ends with `message`
        (after its JSON document, when `pretty` is not None: --json was given), else it is noted."""
        from rbtool.errors import CheckpointError

        if not self.single:
            self.failed.append(f"{path} ({reason})")
            return
        if pretty is not None:
            print_json(self.documents[0], pretty)
        raise CheckpointError(message)

    def finish(self, what: str, pretty: bool | None) -> None:
        """The end: the JSON document of every path (when `pretty` is not None), then the error
        naming each failed path (`what failed for N of M paths: ...`)."""
        from rbtool.errors import CheckpointError

        if pretty is not None:
            doc = self.documents[0] if self.single else {"ok": not self.failed, "paths": self.documents}
            print_json(doc, pretty)
        if self.failed:
            raise CheckpointError(
                f"{what} failed for {len(self.failed)} of {len(self.paths)} paths: {', '.join(self.failed)}"
            )


def pass_lines(prefix: str, result: Any) -> None:
    """What a pass over a checkpoint's files read, how fast, with how many jobs (after
    `prefix`), and what its journal gave; `result` has bytes_read, seconds, jobs and journal."""
    from rbtool.passes.journal import journal_note

    rate = result.bytes_read / result.seconds if result.seconds > 0 else 0.0
    out.print(
        f"{prefix}{size(result.bytes_read)} read in {result.seconds:.2f} s "
        f"({rate / 1e6:.1f} MB/s, {count(result.jobs, 'job')})",
        markup=False,
    )
    if result.journal is not None:
        out.print(journal_note(result.journal), markup=False)
