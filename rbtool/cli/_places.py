"""Directories and URLs as commands take them: a local directory as it is, a URL through a
local mirror (reading) or a staging directory uploaded afterwards (writing); paths that must be
local, and outputs that would overwrite their inputs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from rbtool.cli._consoles import out
from rbtool.cli._output import count, size
from rbtool.cli._progress import progress_bar

if TYPE_CHECKING:
    from rbtool.remote import IndexMirror


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


def refuse_overlap(target: Path, inputs: Sequence[Path], option: str) -> None:
    """Refuse an output path that is, lies inside, or contains an input: writing it would change the input."""
    resolved = Path(os.path.realpath(target))
    for given in inputs:
        source = Path(os.path.realpath(given))
        if resolved == source or source in resolved.parents or resolved in source.parents:
            raise typer.BadParameter(
                f"{target} overlaps the input {given}; choose a path outside it", param_hint=option
            )
