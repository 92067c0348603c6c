"""What every writing command shares: its opening, the operation run under the writers' rules,
and the last lines of its human view; and the lines of the commands that add to a buffer.

The rules every writer follows (docs/cli.md, "Writing"): missing parents of the output are
created; a parent that is a file is refused; an existing output is refused without --force;
--force replaces it atomically, and only with something of its own kind. A dry run checks the
inputs and the output path exactly as the real run would, reports what it would write, and
creates, changes and removes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rbtool.cli._consoles import note, out, progress_line
from rbtool.cli._options import LocalWrites, RankWrites
from rbtool.cli._output import count, files_line, state_table
from rbtool.cli._places import reading, refuse_overlap, upload_note, writing
from rbtool.cli._progress import progress_bar, show_progress

if TYPE_CHECKING:
    from rbtool.ops.resharding import ReshardResult
    from rbtool.remote.places import Place

T = TypeVar("T")


def dry_run_note(target: Path | str, what: str) -> None:
    """The human view's last line of a dry run: `dry run: would write OUT (WHAT); nothing written`."""
    out.print(f"dry run: would write {target} ({what}); nothing written", markup=False)


def id_range(ids: list[int]) -> str:
    """`first-last`, or the id alone for a single one (the shape other tooling parses)."""
    return str(ids[0]) if len(ids) == 1 else f"{ids[0]}-{ids[-1]}"


def added_line(ids: list[int], bar_shown: bool) -> None:
    """The progress line of a batch published into a buffer: `added trajectory ids FIRST-LAST`."""
    progress_line(f"added trajectory ids {id_range(ids)}", bar_shown)


def waiting_note(buffer: Path, holder: str) -> None:
    """What a command adding to `buffer` says while another process holds its lock."""
    note(f"waiting for {buffer} (locked by {holder})")


def trajectories(n: int) -> str:
    """`1 trajectory`, `5 trajectories`."""
    return count(n, "trajectory", "trajectories")


class Writer:
    """A writing command at work: the input checkpoints it reads, the output it writes, and the
    options every writer takes."""

    def __init__(self, sources: list[Place], dst: Place, writes: LocalWrites) -> None:
        self.sources = sources
        self.dst = dst
        self.writes = writes
        self.json = writes.json
        self.force = writes.force
        self.copy = writes.copy
        self.dry_run = writes.dry_run

    @property
    def link(self) -> bool:
        """Whether the output may hard-link the inputs' files: not with --copy, never into the cache."""
        return not self.copy and all(place.url is None for place in self.sources)

    def run(
        self,
        description: str,
        operation: Callable[..., T],
        *args: Any,
        dry_run_bar: bool = False,
        **kwargs: Any,
    ) -> T:
        """The library's `operation` on the output (`args` and `kwargs` its own), under the writers'
        rules: --force, --dry-run and links as allowed, progress shown under `description` (in a
        dry run too with `dry_run_bar`). The output is published (a URL's uploaded) before the
        result is returned, so that what is printed exists."""
        enabled = show_progress(self.json) and (dry_run_bar or not self.dry_run)
        with progress_bar(description, None, enabled) as advance:
            rules = {"overwrite": self.force, "progress": advance, "link": self.link, "dry_run": self.dry_run}
            result = operation(*args, **{**rules, **kwargs})
        self.dst.finish()
        return result

    def state_view(self, done: str, rows: list[tuple[str, dict[str, Any]]], suffix: str = "") -> None:
        """The human view's table of what was (or would be) written: one row a checkpoint,
        titled `IN [would be ]DONE into OUT[SUFFIX]`."""
        would = "would be " if self.dry_run else ""
        title = f"{self.sources[0].show()} {would}{done} into {self.dst.show()}{suffix}"
        out.print(state_table(title, rows, self.writes.limit))

    def last_lines(self, would: str, files: dict[str, int] | None, prefix: str = "") -> None:
        """The human view's last lines: what a dry run would write (`would`), else how the files
        were placed (after `prefix`) and what the upload did."""
        if self.dry_run:
            dry_run_note(self.dst.show(), would)
        else:
            assert files is not None
            out.print(f"{prefix}files: {files_line(files)}")
            upload_note(self.dst.upload)


@contextmanager
def read_and_write(
    sources: Sequence[str],
    target: str,
    writes: LocalWrites,
    storage_options: list[str] | None,
    *,
    stream: bool = False,
    data: bool | None = None,
    option: str = "--out",
) -> Iterator[Writer]:
    """A writer's opening: its input checkpoints read (a URL fetched; its files only when it is
    no dry run, unless `data` says otherwise; streamed passes allowed with `stream`), its output
    opened (a URL staged for upload, an existing one refused without --force), progress shown
    unless --json, and an output that is, lies in or holds an input refused, named as `option`."""
    enabled = show_progress(writes.json)
    fetch = not writes.dry_run if data is None else data
    with ExitStack() as stack:
        places = [
            stack.enter_context(reading(s, storage_options, data=fetch, enabled=enabled, stream=stream))
            for s in sources
        ]
        dst = stack.enter_context(writing(target, storage_options, overwrite=writes.force, enabled=enabled))
        refuse_overlap(dst.local, [p.local for p in places], option)
        yield Writer(places, dst, writes)


@contextmanager
def rank_tree(
    description: str, source: str, world_size: int, target: str, split: str, strict: bool, writes: RankWrites
) -> Iterator[tuple[Writer, ReshardResult]]:
    """What shard and reshard share (shard is reshard's count split): IN read, and OUT/rank_r
    written for `world_size` ranks, blocks split by `split`, under `description`."""
    from rbtool.ops import resharding

    with read_and_write([source], target, writes, writes.storage_option) as writer:
        local = writer.sources[0].local
        result = writer.run(
            description, resharding.reshard, local, world_size, writer.dst.local, split=split, strict=strict
        )
        yield writer, result
