"""What every writing command shares: its opening, and the line that says what a dry run would write.

The rules every writer follows (docs/cli.md, "Writing"): missing parents of the output are
created; a parent that is a file is refused; an existing output is refused without --force;
--force replaces it atomically, and only with something of its own kind. A dry run checks the
inputs and the output path exactly as the real run would, reports what it would write, and
creates, changes and removes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from rbtool.cli._consoles import out
from rbtool.cli._output import count
from rbtool.cli._places import reading, refuse_overlap, writing
from rbtool.cli._progress import show_progress

if TYPE_CHECKING:
    from rbtool.remote.places import Place


def dry_run_note(target: Path | str, what: str) -> None:
    """The human view's last line of a dry run: `dry run: would write OUT (WHAT); nothing written`."""
    out.print(f"dry run: would write {target} ({what}); nothing written", markup=False)


def trajectories(n: int) -> str:
    """`1 trajectory`, `5 trajectories`."""
    return count(n, "trajectory", "trajectories")


@contextmanager
def read_and_write(
    sources: Sequence[str],
    target: str,
    storage_options: list[str] | None,
    *,
    json: bool,
    force: bool,
    dry_run: bool,
    stream: bool = False,
    data: bool | None = None,
    option: str = "--out",
) -> Iterator[tuple[list[Place], Place]]:
    """A writer's opening: its input checkpoints read (a URL fetched; its files only when it is
    no dry run, unless `data` says otherwise; streamed passes allowed with `stream`), its output
    opened (a URL staged for upload, an existing one refused without `force`), progress shown
    unless `json`, and an output that is, lies in or holds an input refused, named as `option`.
    The command calls `dst.finish()`."""
    enabled = show_progress(json)
    fetch = not dry_run if data is None else data
    with ExitStack() as stack:
        places = [
            stack.enter_context(reading(s, storage_options, data=fetch, enabled=enabled, stream=stream))
            for s in sources
        ]
        dst = stack.enter_context(writing(target, storage_options, overwrite=force, enabled=enabled))
        refuse_overlap(dst.local, [p.local for p in places], option)
        yield places, dst
