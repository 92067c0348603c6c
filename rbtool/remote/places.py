"""Where a command reads and writes: a local directory as it is, a URL through a local directory.

`reading` decides how a URL is read: only its JSON objects (the others stand in by name and
size), every object copied into the bounded cache, or, for a pass that reads each file once
and a checkpoint the cache cannot hold, a streamed mirror fed to the passes. `writing` builds
the output for a URL in a staging directory and uploads it once the work succeeded. A
`Place` names what it holds as it was given: paths under a mirror or a staging directory are
shown under the URL. Local paths never import fsspec.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any

from rbtool import remote
from rbtool.errors import CacheFullError
from rbtool.progress import Progress

# How a caller shows a step that takes a while (fetching, uploading): opened with the step's
# description, it yields the Progress the step reports to.
Bar = Callable[[str], AbstractContextManager[Progress | None]]


class Place:
    """A directory a command works on: the local path the library reads or writes, and the name to show.

    For a URL the local path is a mirror (reading) or a staging directory (writing); every path
    under it is shown under the URL.
    """

    def __init__(self, given: str, local: Path, url: str | None = None) -> None:
        self.given = given
        self.local = local
        self.url = url
        self._finish: Callable[[], dict[str, int]] | None = None
        self.upload: dict[str, int] | None = None  # what the upload did (None: a local directory)
        self.mirror: remote.IndexMirror | None = None  # read without data: objects are fetched on demand

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


def _shown(bar: Bar | None, description: str) -> AbstractContextManager[Progress | None]:
    return nullcontext() if bar is None else bar(description)


@contextmanager
def reading(
    value: str,
    storage_options: Sequence[str] | None,
    *,
    data: bool,
    stream: bool = False,
    bar: Bar | None = None,
) -> Iterator[Place]:
    """The directory `value` to read: itself if local; for a URL a local mirror.

    With `data`, every object is copied into the bounded cache (verified against the upload's
    marker); without, only the JSON objects are read and the rest stand in by name and size
    (`Place.mirror.fetch` fetches some of them). With `stream` (a command whose data is read
    by one pass, each file once), a checkpoint that does not fit the cache (or not beside
    what other processes are reading there) is read through a streamed mirror instead: the
    pass fetches its files in batches and releases each once read. `storage_options` are
    `key=value` pairs (`remote.parse_storage_options`), read for a URL only; `bar` shows the
    fetching.
    """
    if not remote.is_url(value):
        yield Place(value, remote.local_path(value))
        return
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
        with _shown(bar, f"fetching {remote.shown_url(value)}") as advance:
            try:
                local = stack.enter_context(remote.data_mirror(value, options, progress=advance))
            except CacheFullError:
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
    from rbtool.passes import pool as passes

    with remote.stream_mirror(value, options) as streamed, passes.feeding(streamed):
        place = Place(value, streamed.path, value.rstrip("/"))
        yield place


@contextmanager
def writing(
    value: str, storage_options: Sequence[str] | None, *, overwrite: bool, bar: Bar | None = None
) -> Iterator[Place]:
    """The directory `value` to write: itself if local; for a URL a staging directory uploaded afterwards.

    The upload follows the remote protocol (trajectory objects, index, metadata, marker last)
    and only once the command's work succeeded: at `Place.finish()`, which a command calls
    before it prints its result, or at the end of the block. `bar` shows the upload.
    """
    if not remote.is_url(value):
        yield Place(value, remote.local_path(value))
        return
    options = remote.parse_storage_options(storage_options)
    with remote.writing(value, options, overwrite=overwrite) as staging:
        place = Place(value, staging.local, value.rstrip("/"))

        def publish() -> dict[str, int]:
            with _shown(bar, f"uploading to {remote.shown_url(value)}") as advance:
                staging.progress = advance
                return staging.publish()

        place._finish = publish
        yield place
        place.finish()
