"""`rbtool checkpoint save` and `rbtool checkpoint load`."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from rbtool.cli._app import Command, sub_app
from rbtool.cli._consoles import out
from rbtool.cli._json import print_jsonl, print_report
from rbtool.cli._options import (
    BufferWrites,
    FormatOpt,
    Lines,
    StorageOpt,
    StrictOpt,
    TrajectoryFormat,
    Writes,
    refuse_link_with_copy,
)
from rbtool.cli._output import count, format_ids, state_table
from rbtool.cli._places import local_path_arg, reading, refuse_overlap
from rbtool.cli._progress import progress_bar, show_progress
from rbtool.cli._window import DEFAULT_WINDOW, window_line
from rbtool.cli._writing import Writer, dry_run_note, read_and_write, trajectories

if TYPE_CHECKING:
    from rbtool.files.index import Index
    from rbtool.remote.places import Place

checkpoint_app = sub_app(
    "checkpoint", "Save a checkpoint the way the buffer would, or show (and restore) what loading one yields."
)


class SaveMode(str, enum.Enum):
    """Which buffer's save to reproduce."""

    auto = "auto"
    auto_save = "auto-save"
    in_memory = "in-memory"


# ----------------------------------------------------------------------- save
@checkpoint_app.command(cls=Command)
def save(
    source_args: Annotated[
        list[str],
        typer.Argument(
            metavar="SOURCE",
            help="A buffer directory (auto-save), or trajectory files/folders/checkpoints (in-memory); "
            "directories may be URLs.",
            show_default=False,
        ),
    ],
    target_arg: Annotated[
        str, typer.Argument(metavar="OUT", help="Checkpoint directory (or URL) to write.", show_default=False)
    ],
    window: Annotated[
        int,
        typer.Option(
            "--window", "-w", min=0, help="The buffer's sample_window_size: keep the last N (0 = all)."
        ),
    ] = DEFAULT_WINDOW,
    mode: Annotated[
        SaveMode,
        typer.Option(
            "--mode",
            help="auto-save: a buffer with auto_save on over the one SOURCE directory; in-memory: a "
            "buffer with auto_save off fed every SOURCE trajectory; auto: auto-save for a single "
            "buffer/checkpoint directory, else in-memory.",
        ),
    ] = SaveMode.auto,
    trajectory_format: FormatOpt = None,
    seed: Annotated[
        int | None, typer.Option("--seed", help="Seed recorded by an in-memory save (default 1234).")
    ] = None,
    link: Annotated[
        bool,
        typer.Option(
            "--link",
            help="in-memory: hard-link loose trajectory files too (default: copy them, as ingest does; "
            "a checkpoint's files are linked).",
        ),
    ] = False,
    writes: Writes = Writes(),
) -> None:
    """Write the checkpoint a buffer's save_checkpoint would write, from files on disk."""
    refuse_link_with_copy(link, writes.copy)
    # a dry run of a save reads every file, as the save does
    opening = read_and_write(source_args, target_arg, writes, writes.storage_option, data=True, option="OUT")
    with opening as writer:
        _save(writer, window, mode, trajectory_format, seed, link)


def _save(
    writer: Writer,
    window: int,
    mode: SaveMode,
    trajectory_format: TrajectoryFormat | None,
    seed: int | None,
    link: bool,
) -> None:
    from rbtool.files.dirs import is_rank_tree, open_view
    from rbtool.files.index import DEFAULT_SEED
    from rbtool.format import is_checkpoint_dir
    from rbtool.ops import checkpoint

    sources, dst, dry_run = [p.local for p in writer.sources], writer.dst, writer.dry_run
    fmt = None if trajectory_format is None else trajectory_format.value
    chosen = mode
    if mode is SaveMode.auto:
        single_dir = (
            len(sources) == 1
            and sources[0].is_dir()
            and (is_checkpoint_dir(sources[0]) or is_rank_tree(sources[0]))
        )
        chosen = SaveMode.auto_save if single_dir else SaveMode.in_memory
    if chosen is SaveMode.auto_save:
        if len(sources) != 1:
            raise typer.BadParameter("auto-save mode takes exactly one buffer directory", param_hint="SOURCE")
        if seed is not None:
            raise typer.BadParameter("applies to --mode in-memory only", param_hint="--seed")
        own = open_view(sources[0], check_files=False).index
        own_format, listed = own.trajectory_format, own.id_list
        if fmt is not None and fmt != own_format:
            raise typer.BadParameter(
                f"a buffer with auto_save on saves its own files; {sources[0]} holds {own_format} files",
                param_hint="--format",
            )
        index, report = writer.run("saving", checkpoint.save_from_autosave_dir, sources[0], dst.local, window)
    else:
        index, report = writer.run(
            "saving",
            checkpoint.build_from_files,
            sources,
            dst.local,
            window,
            trajectory_format=fmt or "pt",
            seed=DEFAULT_SEED if seed is None else seed,
            # loose files are copied unless --link, as by ingest; never a hard link into the cache
            link=(True if link else None) if writer.link else False,
        )
        listed = list(range(index.trajectory_counter))  # an in-memory buffer numbers them 0..n-1

    doc: dict[str, Any] = {
        "mode": chosen.value,
        "out": dst.show(),
        "upload": dst.upload,
        "window": window,
        **index.state(),
        "trajectory_format": index.trajectory_format,
        "dry_run": dry_run,
        "files": None if dry_run else report.as_json(),
    }
    if writer.json:
        print_report(doc, writer.writes)
        return
    title = f"{'would save' if dry_run else 'saved'} {dst.show()} ({chosen.value}, window {window})"
    out.print(state_table(title, [("checkpoint", doc)], writer.writes.limit))
    out.print(window_line(window, index.id_list, listed), markup=False)
    saved = doc["trajectory_format"]
    writer.last_lines(f"{trajectories(index.size)}, format {saved}", doc["files"], f"format {saved}; ")


# ----------------------------------------------------------------------- load
def _rank_states(index: Index, world_size: int) -> list[dict[str, Any]]:
    return [{"rank": r, **index.rank_block(world_size, r).state()} for r in range(world_size)]


def trajectory_rows(index: Index, world_size: int | None, rank: int | None) -> Iterator[dict[str, Any]]:
    """One dict per trajectory a load yields (per rank's block in rank order without --rank)."""
    blocks: list[tuple[int | None, Index]]
    if world_size is not None and rank is None:
        blocks = [(r, index.rank_block(world_size, r)) for r in range(world_size)]
    else:
        blocks = [(rank, index)]
    for r, block in blocks:
        entries = block.entries
        for tid in block.id_list:
            entry = entries[tid]
            yield {
                "rank": r,
                "trajectory_id": tid,
                "num_samples": entry["num_samples"],
                "shape": entry["shape"],
                "max_episode_length": entry["max_episode_length"],
                "model_weights_id": entry["model_weights_id"],
                "file": block.file_name(tid),
            }


def check_rank_options(world_size: int | None, rank: int | None, buffer: Path | None) -> None:
    """Refuse a --rank without --world-size, a --rank out of its range, and a --buffer that would
    restore several ranks at once, naming the options as typed."""
    from rbtool.errors import UsageError

    if rank is not None and world_size is None:
        raise UsageError(f"--rank {rank} needs --world-size (the number of ranks the load is split over)")
    if rank is not None and world_size is not None and rank >= world_size:
        last = "0" if world_size == 1 else f"0 to {world_size - 1}"
        raise UsageError(f"--rank {rank} is out of range for --world-size {world_size}; give {last}")
    if buffer is not None and world_size is not None and rank is None:
        raise UsageError(
            f"--buffer restores one rank's block of --world-size {world_size}: give --rank too "
            "(or leave out --world-size to restore the whole load)"
        )


@checkpoint_app.command(cls=Command)
def load(
    ckpt_arg: Annotated[
        str,
        typer.Argument(metavar="CKPT", help="Checkpoint or buffer directory (or URL).", show_default=False),
    ],
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size", "-n", min=1, help="Distributed load over N ranks (all ranks unless --rank)."
        ),
    ] = None,
    rank: Annotated[
        int | None, typer.Option("--rank", "-r", min=0, help="Show (or restore) only this rank's block.")
    ] = None,
    strict: StrictOpt = True,
    buffer: Annotated[
        Path | None,
        typer.Option(
            "--buffer",
            "-b",
            help="Restore the load into this buffer directory (for ingest).",
            parser=local_path_arg,
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace the --buffer directory if it is a checkpoint or empty.")
    ] = False,
    writes: BufferWrites = BufferWrites(),
    output: Lines = Lines(),
    storage_option: StorageOpt = None,
) -> None:
    """Show what a full or distributed load of CKPT yields; --buffer restores it as a buffer directory.

    Id lists are summarised unless --all; --jsonl streams one object per trajectory loaded.
    """
    # Without --buffer only the JSON objects of a remote checkpoint are read.
    enabled = show_progress(output.json or output.jsonl)
    with reading(ckpt_arg, storage_option, data=buffer is not None, enabled=enabled) as place:
        _load(place, world_size, rank, strict, buffer, force, writes, output)


def _load(
    place: Place,
    world_size: int | None,
    rank: int | None,
    strict: bool,
    buffer: Path | None,
    force: bool,
    writes: BufferWrites,
    output: Lines,
) -> None:
    from rbtool.ops import checkpoint

    dry_run = writes.dry_run
    enabled = show_progress(output.json or output.jsonl)

    ckpt, display = place.local, place.show()
    if buffer is not None:
        refuse_overlap(buffer, [ckpt], "--buffer")
    elif writes.copy:
        raise typer.BadParameter("applies only with --buffer", param_hint="--copy")
    elif dry_run:
        raise typer.BadParameter("applies only with --buffer (nothing else writes)", param_hint="--dry-run")

    # --world-size and --rank are checked before anything is read, in the options' words;
    # without --rank every rank's block is shown.
    check_rank_options(world_size, rank, buffer)
    from rbtool.files.dirs import warn_layout

    # One step: the library reads the index and checks the files in one call.
    with progress_bar("reading the index and checking files", 1, enabled) as advance:
        if rank is not None:
            view = checkpoint.open_load_view(ckpt, world_size=world_size, rank=rank, strict=strict)
            assert world_size is not None
            shown = view.index.rank_block(world_size, rank)
        else:
            view = checkpoint.open_load_view(ckpt, strict=strict)
            warn_layout(view, world_size)  # a rank directory split again by its own world size
            shown = view.index
        dropped = view.dropped_ids()
        advance(1)
    doc: dict[str, Any] = {
        "checkpoint": display,
        "strict": strict,
        "dropped_missing_ids": dropped,
        "world_size": world_size,
        "rank": rank,
        "renumbered": view.renumbered,
        "renumbered_ids": view.renumbered_ids(),
    }
    if world_size is not None and rank is None:
        doc["ranks"] = _rank_states(shown, world_size)
    else:
        doc.update(shown.state())

    doc["restored_to"] = None
    if buffer is not None:
        with progress_bar("restoring", shown.size, enabled and not dry_run) as advance:
            checkpoint.restore(
                ckpt,
                buffer,
                world_size=world_size,
                rank=rank,
                strict=strict,
                overwrite=force,
                progress=advance,
                link=not writes.copy and place.url is None,  # never a hard link into the cache
                dry_run=dry_run,
            )
        doc["restored_to"] = None if dry_run else str(buffer)
    doc["dry_run"] = dry_run

    limit = output.limit
    if output.jsonl:
        print_jsonl(trajectory_rows(shown, world_size, rank))
        return
    if output.json:
        each = "ranks" if "ranks" in doc else None
        print_report(doc, output, each=each, also=("dropped_missing_ids",))
        return
    how = "full load" if world_size is None else f"distributed load, world size {world_size}"
    if "ranks" in doc:
        rows = [(f"rank {r['rank']}", r) for r in doc["ranks"]]
    else:
        rows = [("full" if rank is None else f"rank {rank}", doc)]
    out.print(state_table(f"{display} ({how})", rows, limit))
    if view.renumbered:
        from rbtool.files.dirs import RENUMBERED_NOTE

        changed = count(doc["renumbered_ids"], "id")
        out.print(f"{RENUMBERED_NOTE}; {changed} changed", markup=False, highlight=False)
    if dropped:
        out.print(f"dropped for missing files (non-strict): ids {format_ids(dropped, limit)}")
    if buffer is not None and dry_run:
        dry_run_note(buffer, f"a buffer directory of {trajectories(shown.size)}")
    elif buffer is not None:
        out.print(f"restored into {buffer}; `rbtool ingest ... --buffer {buffer}` continues the ids")
